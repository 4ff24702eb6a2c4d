"""The engine loop in a background thread: requests in through an inbox, each one's tokens out through its own queue.

Only the loop's thread touches the engine and the tokenizer: HTTP handlers put a submission or an
abort in the inbox and read their request's queue (vLLM's AsyncLLM does the same across processes).
Each step, the loop sends every request the tokens it gained (`LLMEngine.step_tokens`), one item per
token with its text, and a last item when it finishes. A request whose client hung up is aborted:
the engine drops it at its next step and frees its blocks.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field

from ..engine.llm_engine import LLMEngine, RequestOutput
from ..sampling import SamplingParams
from .prometheus import ServerMetrics
from .protocol import ApiError, Request


@dataclass
class Token:
    """One generated token and the text it completes (empty while a character is still incomplete)."""

    token_id: int
    text: str
    finish_reason: str | None = None     # set on a request's last token: "stop" or "length"


@dataclass
class Finished:
    """The request finished: why ("stop" or "length") and the engine's output, or the error that ended it."""

    finish_reason: str | None
    output: RequestOutput | None = None
    error: ApiError | None = None


class Stream:
    """One request's channel from the engine thread to its handler (an asyncio queue fed thread-safely)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id: int | None = None        # the engine's id once added
        self.prompt_tokens = 0
        self.done = False                          # the engine is done with it (finished, refused or aborted)

    def put(self, item) -> None:
        """Hand an item to the handler's event loop (called from the engine thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self):
        """The next item: an int (the request's prompt length, once admitted), a Token, or a Finished."""
        return await self.queue.get()


@dataclass
class Detokenizer:
    """A request's text so far, decoded incrementally: a token ending in half a character waits for the next."""

    tok: object
    ids: list[int] = field(default_factory=list)
    sent: str = ""

    def add(self, token_id: int) -> str:
        """The new text this token completes."""
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class AsyncEngine:
    """Drives an LLMEngine in a thread; `submit` and `abort` may be called from the event loop at any time."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 256, chat_template: bool = False):
        self.engine, self.tok = engine, engine.tok
        self.max_waiting = max_waiting              # queued requests beyond which new ones get 429
        self.chat_template = chat_template
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[int, tuple[Stream, Detokenizer]] = {}
        self.metrics = ServerMetrics()
        self.num_waiting = 0                        # inbox + engine queue, as the loop last saw it
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the engine loop is running."""
        return self.thread.is_alive() and not self.closing

    def start(self) -> None:
        """Start the engine loop."""
        self.thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, abort what is left (clients see an error), and join the loop."""
        self.closing = True
        self.inbox.put(None)
        self.thread.join(timeout_s)

    def submit(self, request: Request) -> Stream:
        """Queue a request; ApiError 503 while shutting down, 429 with Retry-After when the queue is full."""
        if not self.alive:
            raise ApiError(503, "the server is shutting down", kind="server_error", headers={"Retry-After": "5"})
        if self.num_waiting + self.inbox.qsize() >= self.max_waiting:
            raise ApiError(429, f"{self.max_waiting} requests are already waiting (--max-waiting); retry later",
                           kind="rate_limit_error", headers={"Retry-After": "1"})
        stream = Stream(request, asyncio.get_running_loop())
        self.inbox.put(("add", stream))
        return stream

    def abort(self, stream: Stream) -> None:
        """The client went away: drop its request (the engine frees its blocks at the next step)."""
        if not stream.done:
            self.inbox.put(("abort", stream))

    # -- the engine thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.closing:
            try:
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished() and not self.closing:
                    self._step()
            except Exception as e:            # a failing step fails its requests, never the server
                traceback.print_exc()
                self._fail_all(ApiError(500, f"the engine failed: {type(e).__name__}: {e}", kind="server_error"))
        self._fail_all(ApiError(503, "the server shut down before the request finished", kind="server_error"))

    def _drain(self, block: bool) -> None:
        """Take every waiting submission and abort; wait for one first when the engine has nothing to do."""
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while item is not None:
                action, stream = item
                if action == "add":
                    self._add(stream)
                else:
                    self._abort(stream)
                item = self.inbox.get_nowait()
            self.closing = True                      # None: stop() asked
        except queue.Empty:
            pass
        self.num_waiting = len(self.engine.scheduler.waiting)
        if not self.engine.has_unfinished():
            self.engine.stats.timeline.clear()       # a server keeps no per-step history while idle

    def _add(self, stream: Stream) -> None:
        """Tokenize (through the chat template for chat), add to the engine; a refusal ends the stream at once."""
        try:
            ids = self._prompt_ids(stream.request)
            rid = self.engine.add_request(ids, stream.request.params)
        except (TypeError, ValueError) as e:
            param = "messages" if stream.request.kind == "chat" else "prompt"
            return self._end(stream, Finished(None, error=ApiError(400, str(e), param)))
        except Exception as e:                    # anything else the request provoked ends it, not the loop
            return self._end(stream, Finished(None, error=ApiError(500, f"{type(e).__name__}: {e}", kind="server_error")))
        error = self.engine.sequences[rid].error
        if error:
            self.engine.abort_request(rid)           # reported by the next step otherwise
            param = "max_tokens" if "max_new_tokens" in error else "prompt"
            return self._end(stream, Finished(None, error=ApiError(400, error, param)))
        stream.request_id, stream.prompt_tokens = rid, len(ids)
        self.streams[rid] = (stream, Detokenizer(self.tok))
        stream.put(len(ids))

    def _prompt_ids(self, request: Request) -> list[int]:
        if request.kind == "chat":
            if not self.chat_template:
                raise ValueError("this model has no chat template; use /v1/completions")
            text = self.tok.apply_chat_template(request.prompt, tokenize=False, add_generation_prompt=True)
            return self.tok.encode(text, add_special_tokens=False)
        if isinstance(request.prompt, str):
            return self.tok.encode(request.prompt)
        return list(request.prompt)

    def _abort(self, stream: Stream) -> None:
        if stream.request_id is not None and self.streams.pop(stream.request_id, None) is not None:
            self.engine.abort_request(stream.request_id)
            self.metrics.aborted += 1
        stream.done = True

    def _step(self) -> None:
        """One engine step: every request's new tokens to its stream (the last with its finish reason), then its end."""
        finished = self.engine.step()
        reasons = {out.request_id: finish_reason(self.streams[out.request_id][0].request.params,
                                                 self.tok.eos_token_id, out.token_ids)
                   for out in finished if out.ok and out.request_id in self.streams}
        for rid, token_ids in self.engine.step_tokens.items():
            if rid in self.streams:
                stream, detok = self.streams[rid]
                for i, t in enumerate(token_ids):
                    last = i == len(token_ids) - 1
                    stream.put(Token(t, detok.add(t), reasons.get(rid) if last else None))
        for out in finished:
            entry = self.streams.pop(out.request_id, None)
            self.engine.release(out.request_id)
            if entry is not None and out.request_id in reasons:
                self.metrics.observe(out, reasons[out.request_id])
                self._end(entry[0], Finished(reasons[out.request_id], out))
        sched = self.engine.scheduler
        self.metrics.running, self.num_waiting = len(sched.running), len(sched.waiting)

    def _end(self, stream: Stream, item: Finished) -> None:
        stream.done = True
        stream.put(item)

    def _fail_all(self, error: ApiError) -> None:
        """End every open request with an error and leave the engine empty."""
        for stream, _ in list(self.streams.values()):
            self._end(stream, Finished(None, error=error))
        self.streams.clear()
        self.engine.abort_all()


def finish_reason(params: SamplingParams, eos_id: int | None, token_ids: list[int]) -> str:
    """OpenAI's finish_reason: "stop" when the last token is a stop token (EOS included), else "length"."""
    return "stop" if token_ids and token_ids[-1] in params.stop_ids(eos_id) else "length"
