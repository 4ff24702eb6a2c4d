"""Argument checks for the public entry points: one error style, naming the argument, what it got, what is allowed.

Numbers may be Python or numpy numbers (bools are refused where a count or a size is meant); a
number must be finite; a model must be one of the package's models (or anything with a `config`).
The rule everywhere: a wrong type raises TypeError (a bool or a float where an integer is meant, a
string where a list is), a wrong value raises ValueError (a negative count, an empty list, an unknown
choice); every message names the argument, what it got and what is allowed.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch
from torch import Tensor

TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)     # the dtypes a tensor of token ids may have


def integer(name: str, value, low: int | None = None, high: int | None = None, allow_none: bool = False) -> int | None:
    """`value` as an int within [low, high]; TypeError for a non-integer (a bool included), ValueError out of range."""
    if value is None and allow_none:
        return None
    allowed = _range("an integer", low, high) + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def boolean(name: str, value) -> bool:
    """`value` if it is a bool; TypeError otherwise: a 0, 1 or "yes" is not taken for a switch."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def real(name: str, value, low: float | None = None, high: float | None = None, allow_none: bool = False,
         low_open: bool = False) -> float | None:
    """`value` as a finite float within [low, high] ((low, high] with low_open); clear errors otherwise."""
    if value is None and allow_none:
        return None
    allowed = _range("a finite number", low, high, low_open) + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    if not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low)) \
            or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _range(kind: str, low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {low}"
    return f"{kind} <= {high}" if high is not None else kind


def model(name: str, value) -> None:
    """A model of this package (an nn.Module with a `config`), else a TypeError naming what was given."""
    if not isinstance(value, torch.nn.Module) or not hasattr(value, "config"):
        raise TypeError(f"{name} must be a model from lab.load_model (or lab.Transformer), got "
                        f"{type(value).__name__}")


def tensor(name: str, value, dims: int | None = None, dtypes: tuple[torch.dtype, ...] | None = None,
           finite: bool = False, floating: bool = False) -> Tensor:
    """A tensor with the given number of dimensions and dtype (or any floating dtype), optionally only finite values."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dims is not None and value.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must be of dtype {' or '.join(str(d) for d in dtypes)}, got {value.dtype}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if finite and value.is_floating_point() and not torch.isfinite(value).all():
        raise ValueError(f"{name} must hold only finite values")
    return value


def text(name: str, value) -> str:
    """A non-empty string that can be encoded as UTF-8 (no lone surrogates)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} is empty: give at least one character of text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds a character that is not valid Unicode text ({value[e.start]!r} at "
                         f"index {e.start}, a lone surrogate); remove it") from None
    return value


# -- lists, choices, types --------------------------------------------------------------------------------
def integers(name: str, values, low: int | None = None, high: int | None = None, length: int | None = None,
             nonempty: bool = True) -> list[int]:
    """`values` (a list, tuple, array or 1-D tensor) as a list of ints within [low, high]; `length` of them if given."""
    items = _items(name, values, "integer", length, nonempty)
    allowed = _range("integers", low, high)
    wrong = [v for v in items if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if wrong:
        raise TypeError(f"{name} must hold {allowed}, got {wrong[:5]}")
    bad = [v for v in items if (low is not None and v < low) or (high is not None and v > high)]
    if bad:
        raise ValueError(f"{name} must hold {allowed}, got {bad[:5]}")
    return [int(v) for v in items]


def reals(name: str, values, low: float | None = None, high: float | None = None, length: int | None = None,
          nonempty: bool = True, unit: str = "") -> list[float]:
    """`values` as a list of finite floats within [low, high]; `unit` (e.g. "seconds after the start") joins the message."""
    items = _items(name, values, "number", length, nonempty)
    allowed = _range("finite numbers", low, high) + (f" ({unit})" if unit else "")
    wrong = [v for v in items if isinstance(v, bool) or not isinstance(v, numbers.Real)]
    if wrong:
        raise TypeError(f"{name} must hold {allowed}, got {wrong[:5]}")
    bad = [v for v in items if not math.isfinite(v) or (low is not None and v < low) or (high is not None and v > high)]
    if bad:
        raise ValueError(f"{name} must hold {allowed}, got {bad[:5]}")
    return [float(v) for v in items]


def _items(name: str, values, kind: str, length: int | None, nonempty: bool) -> list:
    """The elements of a list-like argument; TypeError for a string, a mapping, a scalar or a non-1-D tensor."""
    if isinstance(values, Tensor) and values.dim() == 1:
        values = values.tolist()
    if isinstance(values, (str, bytes, Mapping, Tensor)) or not hasattr(values, "__len__") \
            or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of {kind}s, got {type(values).__name__}")
    items = list(values)
    if nonempty and not items:
        raise ValueError(f"{name} is empty: give at least one {kind}")
    if length is not None and len(items) != length:
        raise ValueError(f"{name} must hold exactly {length} {kind}s, got {len(items)}")
    return items


ARRIVAL_UNIT = "seconds after the start"


def arrival_time(name: str, value) -> float:
    """A request's arrival time in seconds after the start: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite number >= 0 ({ARRIVAL_UNIT}), got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 ({ARRIVAL_UNIT}), got {value!r}")
    return float(value)


def arrival_times(name: str, values, length: int | None = None) -> list[float]:
    """One arrival time per request (finite numbers >= 0, seconds after the start); an empty list is allowed."""
    return reals(name, values, low=0, length=length, nonempty=False, unit=ARRIVAL_UNIT)


def choice(name: str, value, allowed):
    """`value` if it is one of `allowed` (compared with ==, so an unhashable value is refused clearly too)."""
    allowed = tuple(allowed)
    if not any(_same(value, a) for a in allowed):
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _same(value, a) -> bool:
    """value == a, a bool never equal to a number, and a value == cannot answer (a tensor, an array) unequal."""
    if isinstance(value, bool) != isinstance(a, bool):
        return False
    try:
        return bool(value == a)
    except (TypeError, ValueError, RuntimeError):
        return False


def instance(name: str, value, types: type | tuple[type, ...], allowed: str):
    """`value` if it is an instance of `types`; else a TypeError saying what is `allowed` (e.g. "a lab.ModelConfig")."""
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}")
    return value


def probabilities(name: str, probs: Tensor) -> Tensor:
    """Rows of probabilities [..., V]: a floating tensor of finite, non-negative values, each row summing to 1."""
    tensor(name, probs, floating=True)
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise ValueError(f"{name} must hold finite, non-negative probabilities")
    sums = probs.sum(-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-3):
        raise ValueError(f"{name}'s rows must each sum to 1, got sums {[round(s, 4) for s in sums.flatten().tolist()]}")
    return probs


# -- speculative decoding: the draft and the tokens it proposes per round --------------------------------
def speculation_length(name: str, k, low: int = 1) -> int:
    """Tokens drafted per round as an int >= low (1 for the speculative functions; 0, no speculation, for the engine)."""
    return integer(name, k, low=low)


def draft(target, draft, max_len: int | None = None) -> None:
    """A draft model that can propose tokens for `target`: one vocabulary, dtype and device, context >= max_len.

    TypeError when either is not a model; ValueError for another vocabulary size, a context shorter
    than `max_len` (the engine's max_model_len), or another dtype or device.
    """
    model("target", target)
    model("draft", draft)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                         f"({target.config.vocab_size}): speculative decoding needs one shared tokenizer")
    if max_len is not None and draft.config.max_seq_len < max_len:
        raise ValueError(f"the draft's context ({draft.config.max_seq_len} tokens) is shorter than max_model_len "
                         f"({max_len}); lower max_model_len")
    t, d = next(target.parameters(), None), next(draft.parameters(), None)
    if t is not None and d is not None and (t.device, t.dtype) != (d.device, d.dtype):
        raise ValueError(f"the draft is {d.dtype} on {d.device} but the target is {t.dtype} on {t.device}; "
                         "load both with the same dtype and device")
