"""Graded checks, one module per exercise notebook: `checks/NN_topic.py` grades `NN_topic.ipynb`.

A check is a function decorated with `@check(name, points)` that takes a
`Submission` (see `infopt_lab.grading.grade`) and raises `CheckFailed` with a
one-line reason when the answer is wrong. It reaches the student's code only
through `sub.call(...)`, which returns plain data (numbers, lists, strings).
Checks score all or nothing; they run in definition order.

A decision task's checks read what the notebook wrote down instead (`sub.record(name)`, `sub.answer(title)`,
see `infopt_lab.grading.answers`) and are marked `@check(..., written=True)`: they judge the choice a student
made from their own measurement, so they never call into the kernel, and tests run them on a notebook alone.
"""
from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..protocol import Raised

EXERCISE_NAME = re.compile(r"^\d\d_[a-z0-9_]+$")


class CheckFailed(Exception):
    """The answer is wrong; the message is the one-line reason shown to the student."""


@dataclass(frozen=True)
class Check:
    """One graded check: its name, its points and the function that runs it."""

    name: str
    points: float
    run: Callable
    written: bool = False  # reads only the saved notebook (records, answers), never the kernel


def check(name: str, points: float = 1, written: bool = False) -> Callable:
    """Mark a function as a graded check worth `points`; `written` when it reads only the saved notebook."""
    if points <= 0:
        raise ValueError(f"points must be positive, got {points}")

    def mark(fn: Callable) -> Callable:
        fn.check_name, fn.check_points, fn.check_written = name, points, written
        return fn
    return mark


def available_exercises() -> list[str]:
    """Exercise names that have a check module, e.g. ['00_orientation']."""
    here = Path(__file__).parent
    return sorted(p.stem for p in here.glob("*.py") if EXERCISE_NAME.match(p.stem))


def load_checks(exercise: str) -> list[Check]:
    """The checks of one exercise, in the order they are written in its module."""
    if exercise not in available_exercises():
        raise ValueError(f"no checks for exercise {exercise!r}; known: {', '.join(available_exercises())}")
    module = importlib.import_module(f"{__name__}.{exercise}")
    marked = [fn for _, fn in inspect.getmembers(module, inspect.isfunction) if hasattr(fn, "check_name")]
    marked.sort(key=lambda fn: fn.__code__.co_firstlineno)
    checks = [Check(fn.check_name, fn.check_points, fn, fn.check_written) for fn in marked]
    names = [c.name for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"check names in {exercise} must be unique, got {names}")
    return checks


# Helpers that check modules share; each raises CheckFailed with a reason a student can act on.

def as_number(value, what: str) -> float:
    """The value as a float, or CheckFailed if it is not a real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"{what} returned {short(value)}, expected a number")
    return float(value)


def as_int(value, what: str) -> int:
    """The value as an int (a 0-d integer tensor arrives as an int), or CheckFailed."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckFailed(f"{what} returned {short(value)}, expected an int token id")
    return value


def as_tensor(value, what: str, shape: tuple[int, ...] | None = None):
    """The returned value as a float64 tensor (of the expected shape), or CheckFailed."""
    import torch
    try:
        t = torch.tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise CheckFailed(f"{what} returned {short(value)}, expected a tensor") from None
    if shape is not None and tuple(t.shape) != shape:
        raise CheckFailed(f"{what} has shape {tuple(t.shape)}, expected {shape}")
    return t


def expect_close(value, expected: float, what: str, rel: float = 1e-6, abs_tol: float = 1e-9) -> None:
    """CheckFailed unless `value` is a number within tolerance of `expected`."""
    got = as_number(value, what)
    if not math.isclose(got, expected, rel_tol=rel, abs_tol=abs_tol):
        raise CheckFailed(f"{what} returned {got:.6g}, expected {expected:.6g}")


def expect_raises(sub, error_type: str, name: str, *args) -> None:
    """CheckFailed unless calling `name(*args)` raises `error_type` in the submission."""
    what = f"{name}{args!r}" if len(args) != 1 else f"{name}({args[0]!r})"
    try:
        value = sub.call(name, *args)
    except Raised as e:
        if e.error_type != error_type:
            raise CheckFailed(f"{what} raised {e.error_type}, expected {error_type}") from None
        return
    raise CheckFailed(f"{what} returned {short(value)}, expected it to raise {error_type}")


def short(value) -> str:
    """A repr cut to fit in a reason line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Helpers for decision tasks: the answer a student wrote under a task's title, read from the saved notebook.

def written_decision(sub, title: str, what: str) -> tuple[str, str]:
    """(the whole answer, its `Decision:` line), or CheckFailed saying the line is missing."""
    from ..answers import decision
    text = sub.answer(title)
    try:
        return text, decision(text, what)
    except ValueError as e:
        raise CheckFailed(f"under {title!r}: {e}") from None


def expect_named(line: str, want: str, options: list[str], what: str) -> None:
    """CheckFailed unless the decision line names `want` and no other of `options` (names matched whole)."""
    def names(option: str) -> bool:
        return re.search(rf"(?<![\w.]){re.escape(option.lower())}(?![\w.])", line.lower()) is not None
    named = [o for o in options if names(o)]
    longest = [o for o in named if not any(o != other and o.lower() in other.lower() for other in named)]
    if longest != [want]:
        got = ", ".join(repr(o) for o in longest) or "none of them"
        raise CheckFailed(f"the decision names {got} for {what}; your own record gives {want!r}")


def expect_cited(text: str, value: float, what: str, rel: float = 0.01, abs_tol: float = 0.005) -> None:
    """CheckFailed unless the answer writes `value` (to within rounding) as the number behind the decision."""
    from ..answers import cites
    if not cites(text, value, rel, abs_tol):
        within = "exactly" if rel == 0 and abs_tol == 0 else f"to {rel:.0%} or {abs_tol:g}"
        raise CheckFailed(f"the answer does not cite {what} ({value:.4g} from your own record, {within})")
