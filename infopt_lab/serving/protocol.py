"""The OpenAI API as this server speaks it: request bodies checked into (prompt, SamplingParams), responses built.

Every field is checked with `validate.py`, so a wrong value gets the same message as in Python, named
by its OpenAI name (`max_tokens`, not `max_new_tokens`). Unknown fields are refused, not ignored: a
typo should not pass silently. vLLM's extensions that map onto the engine are accepted too
(`top_k`, `seed`, `stop_token_ids`, `ignore_eos`, `return_token_ids`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .. import validate
from ..sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams

COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
          "stream", "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logprobs",
          "return_token_ids")
FIELDS = {"completion": ("prompt", "echo", "best_of") + COMMON,
          "chat": ("messages", "max_completion_tokens", "top_logprobs") + COMMON}
ROLES = ("system", "user", "assistant")
# fields accepted only at the value that changes nothing: this engine has no such feature
NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
           "logprobs": (False, 0), "top_logprobs": (0,)}


class ApiError(Exception):
    """A request the server answers with an OpenAI-style error body: status, message, the field named."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        """The JSON body OpenAI's API sends with an error."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Request:
    """One checked request: what to generate from, how, and how to answer."""

    kind: str                               # "completion" | "chat"
    prompt: str | list[int] | list[dict]    # text, token ids, or chat messages
    params: SamplingParams
    stream: bool = False
    include_usage: bool = True              # send a last chunk with the usage (streaming)
    return_token_ids: bool = False          # vLLM's extension: the generated ids beside the text


def parse(body, kind: str, model_name: str) -> Request:
    """A request body (parsed JSON) -> Request; ApiError(400) naming the field for anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS[kind]))
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; allowed: {sorted(FIELDS[kind])}", unknown[0])
    try:
        return _parse(body, kind, model_name)
    except (TypeError, ValueError) as e:
        name = str(e).split(" ")[0]           # validate.py's messages start with the argument's name
        known = name in FIELDS[kind] or name.startswith("messages[") or name == "include_usage"
        raise ApiError(400, str(e), name if known else None) from None


def _parse(body: dict, kind: str, model_name: str) -> Request:
    model = body.get("model", model_name)
    if model != model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {model_name!r}", "model",
                       "not_found_error")
    for name, allowed in NEUTRAL.items():
        if body.get(name) is not None:
            validate.choice(name, body[name], allowed)
    if body.get("stop") not in (None, [], ""):
        raise ValueError(f"stop strings are not supported by this engine, got {body['stop']!r}; "
                         "give token ids in stop_token_ids instead")
    prompt = messages(body.get("messages")) if kind == "chat" else completion_prompt(body.get("prompt"))
    length = body.get("max_completion_tokens") if body.get("max_tokens") is None else body.get("max_tokens")
    stream = validate.boolean("stream", body.get("stream", False))
    options = _given(body, "stream_options", {})
    validate.instance("stream_options", options, dict, 'an object such as {"include_usage": true}')
    if set(options) - {"include_usage"}:
        raise ValueError(f"stream_options may hold only include_usage, got {sorted(options)}")
    params = SamplingParams(
        max_new_tokens=validate.integer("max_tokens", length, low=1, allow_none=True) or DEFAULT_MAX_NEW_TOKENS,
        temperature=validate.real("temperature", body.get("temperature", 1.0), low=0),
        top_k=_top_k(body.get("top_k")),
        top_p=validate.real("top_p", body.get("top_p"), low=0, high=1, allow_none=True, low_open=True),
        seed=validate.integer("seed", body.get("seed"), low=0, high=2**63 - 1, allow_none=True),
        stop_token_ids=tuple(validate.integers("stop_token_ids", _given(body, "stop_token_ids", []), low=0,
                                               nonempty=False)),
        stop_at_eos=not validate.boolean("ignore_eos", body.get("ignore_eos", False)))
    return Request(kind, prompt, params, stream, validate.boolean("include_usage", options.get("include_usage", True)),
                   validate.boolean("return_token_ids", body.get("return_token_ids", False)))


def _given(body: dict, name: str, default):
    """A field's value, `default` when absent or null (an empty string or list is a value, not an absence)."""
    return default if body.get(name) is None else body[name]


def _top_k(value) -> int | None:
    """vLLM's top_k: an integer >= 1, or -1 / 0 / null for no limit."""
    if type(value) is int and value in (-1, 0):
        return None
    return validate.integer("top_k", value, low=1, allow_none=True)


def completion_prompt(prompt) -> str | list[int]:
    """A completion's prompt: one non-empty string, or one list of token ids (batched prompts are refused)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ValueError("prompt must be one string or one list of token ids; send one request per prompt")
    if isinstance(prompt, list):
        return validate.integers("prompt", prompt, low=0)
    return validate.text("prompt", prompt)


def messages(value) -> list[dict]:
    """Chat messages: a non-empty list of {"role": system|user|assistant, "content": text or text parts}."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {value!r:.80}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {m!r:.80}")
        role = validate.choice(f"messages[{i}].role", m.get("role"), ROLES)
        content = m.get("content")
        if isinstance(content, list):         # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}].content parts must all be of type 'text'")
            content = "".join(validate.text(f"messages[{i}].content", p.get("text")) for p in content)
        out.append({"role": role, "content": validate.text(f"messages[{i}].content", content)})
    return out


# -- responses -------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(request_id: str, kind: str, model: str, stream: bool) -> dict:
    obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if stream else "chat.completion"}[kind]
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model}


def chunk(request_id: str, kind: str, model: str, text: str, finish_reason: str | None = None,
          first: bool = False) -> dict:
    """One streamed chunk: one token's text (OpenAI's chunk shapes for completions and chat)."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_envelope(request_id, kind, model, True), "choices": [choice]}


def usage_chunk(request_id: str, kind: str, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last streamed chunk: no choices, the usage."""
    return {**_envelope(request_id, kind, model, True), "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def response(request_id: str, kind: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
             completion_tokens: int, token_ids: list[int] | None = None) -> dict:
    """A whole (non-streamed) response; `token_ids` joins the choice when asked for (vLLM's return_token_ids)."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**_envelope(request_id, kind, model, False), "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}
