"""The HTTP side: a FastAPI app over an AsyncEngine, OpenAI's routes, server-sent events; run by uvicorn.

`POST /v1/completions` and `POST /v1/chat/completions` answer whole or, with `"stream": true`, one
server-sent event per token, then a usage chunk and `data: [DONE]`. A client that hangs up aborts its
request. Every error is an OpenAI-style JSON body: 400 for a bad request (the field named, validate.py's
message), 404 for another model or route, 429 / 503 with Retry-After when the queue is full or the
server is going down. `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text, vLLM's names).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.llm_engine import LLMEngine
from . import protocol
from .async_engine import AsyncEngine, Finished, Stream, Token
from .protocol import ApiError


def build_app(engine: LLMEngine, model_name: str, max_waiting: int = 256) -> FastAPI:
    """The OpenAI-compatible app serving `engine` as `model_name`; its engine loop runs while the app does."""
    aengine = AsyncEngine(engine, max_waiting, chat_template=getattr(engine.tok, "chat_template", None) is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        yield
        aengine.stop()          # after uvicorn's graceful wait: whatever still runs is aborted

    app = FastAPI(title="infopt-lab", lifespan=lifespan)
    app.state.engine = aengine

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), e.status_code)

    @app.get("/health")
    async def health():
        if not aengine.alive:
            raise ApiError(503, "the engine loop is not running", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "infopt-lab",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        text = aengine.metrics.render(engine, model_name, aengine.num_waiting + aengine.inbox.qsize())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(aengine, request, "completion", model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(aengine, request, "chat", model_name)

    return app


async def read_json(request: Request):
    """The request body as JSON; ApiError(400) when it is not."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


async def answer(aengine: AsyncEngine, http: Request, kind: str, model: str):
    """Check, queue and answer one request: a stream of events, or one JSON body when it finishes."""
    request = protocol.parse(await read_json(http), kind, model)
    stream = aengine.submit(request)
    try:
        first = await stream.get()                  # the prompt's length once admitted, or a refusal
    except asyncio.CancelledError:
        aengine.abort(stream)
        raise
    if isinstance(first, Finished):
        raise first.error
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    if request.stream:
        return StreamingResponse(events(aengine, stream, request_id, model), media_type="text/event-stream")
    return await whole(aengine, http, stream, request_id, model)


async def events(aengine: AsyncEngine, stream: Stream, request_id: str, model: str) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token (the last with its finish reason), the usage, [DONE]."""
    kind, n = stream.request.kind, 0
    try:
        while True:
            item = await stream.get()
            if isinstance(item, Token):
                yield sse(protocol.chunk(request_id, kind, model, item.text, item.finish_reason, first=n == 0))
                n += 1
                continue
            if item.error is not None:
                yield sse(item.error.body())
            elif stream.request.include_usage:
                yield sse(protocol.usage_chunk(request_id, kind, model, stream.prompt_tokens, n))
            yield "data: [DONE]\n\n"
            return
    finally:
        aengine.abort(stream)                       # a hang-up lands here (cancelled); a finished stream is a no-op


async def whole(aengine: AsyncEngine, http: Request, stream: Stream, request_id: str, model: str) -> JSONResponse:
    """Wait for the request to finish (aborting it if the client hangs up) and answer it in one body."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(stream.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return JSONResponse({}, 499)    # nobody is listening
                continue
            if isinstance(item, Finished):
                break
    finally:
        aengine.abort(stream)
    if item.error is not None:
        raise item.error
    out = item.output
    ids = out.token_ids if stream.request.return_token_ids else None
    return JSONResponse(protocol.response(request_id, stream.request.kind, model, out.text, item.finish_reason,
                                          stream.prompt_tokens, len(out.token_ids), ids))


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


@contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `app` from a background thread (port 0: any free one); its base URL; stopped on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port} within {timeout_s:.0f} s")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def serve(engine: LLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int = 256) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM: running requests get 5 s to finish, then are aborted)."""
    uvicorn.run(build_app(engine, model_name, max_waiting), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=5)
