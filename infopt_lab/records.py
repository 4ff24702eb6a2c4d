"""A measurement kept in the notebook for the grader: `lab.record(name, data)` in the cell that measured it.

The grader never re-runs a student's measurement to grade a decision: timings move from one run to the next,
and its kernel has no model cache. It reads what the student's own run printed, from the saved notebook, and
checks the decision written under it against that. The record is an output like any other: run the cell
again and it is replaced; hand in the notebook saved after the run.

    rows = [...]                                  # the student's measurement, plain numbers and strings
    lab.record("group_sizes", rows)               # shown as JSON, saved with the notebook's outputs
"""
from __future__ import annotations

import json
import math

RECORD_MIME = "application/json"
RECORD_KEY = "infopt_lab_record"  # in the output's metadata, naming the record


def _plain(value, where: str = "data"):
    """The value as JSON data, or ValueError naming the first part that is not."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}; a record holds finite numbers only")
        return value
    if callable(getattr(value, "tolist", None)):          # tensors, numpy arrays and scalars
        return _plain(value.tolist(), where)
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where} has a key that is not a string; a record's keys are strings")
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}; a record holds numbers, strings, lists and dicts")


def record(name: str, data) -> None:
    """Show `data` as JSON under `name`, in this cell's output, where the grader reads it from the saved notebook."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a Python identifier such as 'group_sizes', got {name!r}")
    plain = _plain(data)
    from IPython.display import display
    text = json.dumps(plain)
    shown = text if len(text) <= 300 else text[:297] + "..."
    display({RECORD_MIME: plain, "text/plain": f"record {name!r} (read by the grader): {shown}"}, raw=True,
            metadata={RECORD_MIME: {RECORD_KEY: name}})
