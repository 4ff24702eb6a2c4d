"""What a submission wrote down, read from the saved notebook: its records and its markdown answers.

A decision task grades a choice the student made from their own measurement. The grader does not re-run
that measurement (timings move between runs, and its kernel has no model cache): it reads the record the
student's run saved (`lab.record`, see `infopt_lab/records.py`) and the markdown answer written under it,
both from the submitted file as handed in, before the grader runs anything.

An answer is a markdown cell holding the task's title; its first line that starts with `Decision:` names
the choice, and the prose around it cites the number that decided it.
"""
from __future__ import annotations

import math
import re

from ..records import RECORD_KEY, RECORD_MIME
from .assign import MARKDOWN_STUB
from .protocol import NotImplementedYet

DECISION = re.compile(r"^\W*decision\W*:\s*(.+)$", re.IGNORECASE | re.MULTILINE)
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?")


def read_records(nb) -> dict:
    """Every record in the notebook's saved outputs, by name; a record shown twice keeps its last value."""
    found = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            meta = (out.get("metadata") or {}).get(RECORD_MIME) or {}
            name = meta.get(RECORD_KEY) if isinstance(meta, dict) else None
            if isinstance(name, str) and RECORD_MIME in (out.get("data") or {}):
                found[name] = out["data"][RECORD_MIME]
    return found


class Written:
    """The records and markdown answers of one submitted notebook, as handed in."""

    def __init__(self, records: dict, markdown: list[str]):
        self.records, self.markdown = records, markdown

    @classmethod
    def from_notebook(cls, nb) -> "Written":
        return cls(read_records(nb), [c.source for c in nb.cells if c.cell_type == "markdown"])

    def record(self, name: str):
        """The saved record `name`; NotImplementedYet when the notebook was handed in without it."""
        if name not in self.records:
            raise NotImplementedYet(f"not implemented: the notebook holds no record {name!r}; run the cell that "
                                    f"measures it (it calls lab.record({name!r}, ...)) and save before handing in")
        return self.records[name]

    def answer(self, title: str) -> str:
        """The text of the markdown answer holding `title`; NotImplementedYet while it is the exercise's stub."""
        cells = [text for text in self.markdown if title in text]
        if not cells:
            raise NotImplementedYet(f"not implemented: no markdown cell holds {title!r}; keep the answer cell "
                                    "the exercise gives and write under it")
        text = cells[-1].split(title, 1)[1]
        if MARKDOWN_STUB[0] in text or not text.strip():
            raise NotImplementedYet(f"not implemented: the answer under {title!r} still says {MARKDOWN_STUB[0]}")
        return text


def plain(text: str) -> str:
    """Markdown emphasis and code marks removed, for matching names and numbers."""
    return re.sub(r"[*_`]", "", text)


def decision(text: str, what: str) -> str:
    """The choice after `Decision:` in an answer, or CheckFailed-worthy ValueError saying what is missing."""
    match = DECISION.search(plain(text))
    if not match:
        raise ValueError(f"the answer has no line starting `Decision:` that names {what}")
    return match.group(1).strip()


def numbers(text: str) -> list[float]:
    """Every number written in the text: 1,024, 0.52, -3.1e-2, +1.3 (a percent sign or an x after it is fine)."""
    found = []
    for token in NUMBER.findall(plain(text)):
        digits = token.replace(",", "")
        if any(ch.isdigit() for ch in digits):
            try:
                found.append(float(digits))
            except ValueError:
                continue
    return found


def cites(text: str, value: float, rel: float, abs_tol: float) -> bool:
    """Whether the text writes `value`, to within the tolerance a rounded figure needs."""
    return any(math.isclose(n, value, rel_tol=rel, abs_tol=abs_tol) for n in numbers(text))
