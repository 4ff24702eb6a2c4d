"""The data-only protocol between the grader and a submission's kernel.

The grader never runs a submission's code in its own process and never receives
its objects: a check asks the kernel to call a function on plain arguments, the
kernel answers with JSON text, and only that text crosses back. A submission can
return wrong numbers, but it cannot hand the grader an object whose `__eq__`
lies, and it cannot reach the code that compares.
"""
from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass
from typing import Any

MAX_REPLY_CHARS = 4 << 20  # a reply longer than this is refused, whatever the submission returned
MAX_RESULT_CHARS = 100_000  # one call's result, as JSON, in the kernel's helper
TENSOR_DTYPES = ("float32", "float64", "float16", "int64", "int32")


@dataclass(frozen=True)
class Tensor:
    """A torch tensor argument, sent as plain values and built inside the kernel."""

    values: list
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in TENSOR_DTYPES:
            raise ValueError(f"dtype must be one of {TENSOR_DTYPES}, got {self.dtype!r}")

    def __repr__(self) -> str:
        return f"tensor({self.values})"


class CallError(Exception):
    """A call into the submission did not return a value; the message is the one-line reason."""


class NotDefined(CallError):
    """The submission does not define the name (or it is not a function)."""


class NotImplementedYet(CallError):
    """The function still raises NotImplementedError, as the exercise template does."""


class Raised(CallError):
    """The function raised an exception."""

    def __init__(self, message: str, error_type: str):
        super().__init__(message)
        self.error_type = error_type


class TimedOut(CallError):
    """The call ran past the check's time limit."""


class KernelLost(CallError):
    """The kernel died, stopped answering, or could not be (re)started."""


class ProtocolError(CallError):
    """The kernel's answer was not what the grader's own helper produces."""


def encode_value(value: Any) -> Any:
    """Turn a check's argument into JSON data; `Tensor` becomes a tagged dict."""
    if isinstance(value, Tensor):
        return {"__tensor__": encode_value(value.values), "dtype": value.dtype}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, dict) and "__tensor__" not in value:
        return {str(k): encode_value(v) for k, v in value.items()}
    raise TypeError(f"check arguments must be numbers, strings, lists, dicts or Tensor, got {type(value).__name__}")


def describe_call(name: str, args: tuple) -> str:
    """Render `name(args)` for a reason line, shortened to stay on one line."""
    text = ", ".join(repr(a) for a in args)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{name}({text})"


# Runs inside the submission's kernel. It may be tampered with there; that only
# changes what the submission reports about itself, never how it is judged.
# Builtins are reached through `B.`: a notebook may well define its own `list` or `str`.
KERNEL_HELPER = r'''
def {helper}(name, calls_json):
    import builtins as B, json
    def decode(x):
        if B.isinstance(x, B.dict) and "__tensor__" in x:
            import torch
            return torch.tensor(x["__tensor__"], dtype=B.getattr(torch, x["dtype"]))
        if B.isinstance(x, B.list):
            return [decode(v) for v in x]
        if B.isinstance(x, B.dict):
            return {{k: decode(v) for k, v in x.items()}}
        return x
    def encode(x, depth=0):
        if depth > 20:
            raise B.ValueError("result nested more than 20 levels deep")
        if x is None or B.isinstance(x, (B.bool, B.int, B.float, B.str)):
            return x
        if B.callable(B.getattr(x, "tolist", None)):  # torch tensors, numpy arrays and scalars
            return encode(x.tolist(), depth + 1)
        if B.isinstance(x, (B.list, B.tuple)):
            return [encode(v, depth + 1) for v in x]
        if B.isinstance(x, B.dict):
            return {{B.str(k): encode(v, depth + 1) for k, v in x.items()}}
        return {{"__unsupported__": B.type(x).__name__}}
    fn = B.globals().get(name)
    if fn is None:
        return json.dumps({{"defined": False}})
    if not B.callable(fn):
        return json.dumps({{"defined": True, "callable": False, "type": B.type(fn).__name__}})
    results = []
    for args in json.loads(calls_json):
        try:
            value = encode(fn(*decode(args)))
            size = B.len(json.dumps(value))
            if size > {max_result}:
                results.append({{"error": "ResultTooLarge", "message": f"{{size}} characters of JSON; "
                                 "the grader takes up to {max_result}"}})
                continue
            results.append({{"value": value}})
        except B.NotImplementedError as e:
            results.append({{"error": "NotImplementedError", "message": B.str(e)[:200]}})
        except B.Exception as e:
            results.append({{"error": B.type(e).__name__, "message": B.str(e)[:200]}})
    return json.dumps({{"defined": True, "callable": True, "results": results}})
'''


@dataclass(frozen=True)
class CallRequest:
    """The code and expression that ask the kernel for one batch of calls."""

    code: str
    expression: str


def make_request(name: str, calls: list[tuple]) -> CallRequest:
    """Build the kernel code for calling `name` once per argument tuple in `calls`."""
    if not name.isidentifier():
        raise ValueError(f"function name must be a Python identifier, got {name!r}")
    nonce = secrets.token_hex(8)
    helper, out = f"_infopt_call_{nonce}", f"_infopt_out_{nonce}"
    payload = json.dumps([encode_value(list(args)) for args in calls])
    code = KERNEL_HELPER.format(helper=helper, max_result=MAX_RESULT_CHARS)
    code += f"\n{out} = {helper}({name!r}, {payload!r})\n"
    return CallRequest(code=code, expression=out)


def parse_reply(content: dict, name: str, n_calls: int) -> list[dict]:
    """Check an execute reply's shape and return one `{"value": ...}` or `{"error", "message"}` per call."""
    try:
        expr = content["user_expressions"]["r"]
        text = expr["data"]["text/plain"]
    except (KeyError, TypeError):
        raise ProtocolError(f"the kernel's reply for {name} carried no result") from None
    if not isinstance(text, str) or len(text) > MAX_REPLY_CHARS:
        raise ProtocolError(f"the kernel's reply for {name} was not a string under {MAX_REPLY_CHARS} chars")
    try:
        data = json.loads(ast.literal_eval(text))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ProtocolError(f"the kernel's reply for {name} was not the grader's JSON") from None
    if not isinstance(data, dict) or not data.get("defined"):
        raise NotDefined(f"`{name}` is not defined")
    if not data.get("callable"):
        raise NotDefined(f"`{name}` is defined but is not a function (it is a {data.get('type', '?')})")
    results = data.get("results")
    if not isinstance(results, list) or len(results) != n_calls or not all(isinstance(r, dict) for r in results):
        raise ProtocolError(f"the kernel's reply for {name} did not hold {n_calls} results")
    return results
