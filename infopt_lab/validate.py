"""Argument checks for the public entry points: one error style, naming the argument, what it got, what is allowed.

Numbers may be Python or numpy numbers (bools are refused where a count or a size is meant); a
number must be finite; a model must be one of the package's models (or anything with a `config`).
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


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
           finite: bool = False) -> Tensor:
    """A tensor with the given number of dimensions and dtype, optionally with only finite values."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dims is not None and value.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must be of dtype {' or '.join(str(d) for d in dtypes)}, got {value.dtype}")
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
