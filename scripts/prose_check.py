"""Prose that a measurement can contradict: comparative sentences beside numbers, unreviewed.

A markdown cell's sentence that holds a comparative word (faster, slower, shrinks, grows, little,
nearly free, always, never, pays, loses, "3x lower") and also a number or a pointer to an output
(a section, a table, "above", "measured") is a claim a run on another machine can contradict. Such a
sentence belongs in the cell that measured it (generated from the numbers), or its cell carries a
review mark naming the regime and the hardware it was checked on:

    <!-- checked: regime=batch 1 decode of SmolLM2 in fp32; hardware=2-core x86 CPU -->

A bare mark (`<!-- checked -->`, or one that leaves out either name) is itself a problem. Code cells
that write prose must not round a ratio to a whole number (`{x:.0f}x` prints 2.5 as "2x").

Also counted: recorded predictions, a code cell assigning `MY_PREDICTION` before the measurement
and a later cell comparing the result with it.

    python scripts/prose_check.py            # every notebook and solution; exit 1 on a problem
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPARATIVE = re.compile(r"\b(faster|slower|shrinks?|shrinking|grows?|growing|little|nearly free|always|never|"
                         r"pays?|paid|paying|loses?|losing)\b|\d(\.\d+)?x (lower|higher)\b", re.IGNORECASE)
POINTER = re.compile(r"\d|\b(above|below|tables?|plots?|printed|printout|outputs?|measured)\b", re.IGNORECASE)
MARK = re.compile(r"<!--\s*checked\b(.*?)-->", re.IGNORECASE | re.DOTALL)
WHOLE_RATIO = re.compile(r"\{[^{}]*:[^{}]*\.0f\}x")
PREDICTION = re.compile(r"^MY_PREDICTION\s*=", re.MULTILINE)


def sentences(markdown: str) -> list[str]:
    """The prose sentences of a markdown cell: comments, code and headings removed, list items split."""
    text = re.sub(r"<!--.*?-->", " ", markdown, flags=re.DOTALL)
    text = re.sub(r"```.*?```", " ", text, flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", "CODE", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)                    # link targets
    text = re.sub(r"^#+ .*$", " ", text, flags=re.MULTILINE)
    parts = re.split(r"(?<=[.!?:;])\s+|\n\s*(?:[-*]|\d+\.)\s+|\n\s*\n", text)
    return [" ".join(p.split()) for p in parts if p.strip()]


def mark_problem(markdown: str) -> str | None:
    """None where the cell's review mark names a regime and a hardware, else what is wrong (or 'no mark')."""
    found = MARK.search(markdown)
    if found is None:
        return "no mark"
    fields = dict(re.findall(r"(regime|hardware)\s*=\s*([^;>]*[^;>\s-])", found.group(1)))
    missing = [name for name in ("regime", "hardware") if not fields.get(name, "").strip()]
    return f"a review mark without {' and '.join(missing)}" if missing else None


def claims(markdown: str) -> list[str]:
    """The sentences of a cell that a measurement could contradict."""
    return [s for s in sentences(markdown) if COMPARATIVE.search(s) and POINTER.search(s)]


def cell_problems(cell: dict) -> list[str]:
    source = "".join(cell["source"])
    if cell["cell_type"] == "code":
        return [f"a ratio rounded to a whole number: {m.group(0)}" for m in WHOLE_RATIO.finditer(source)]
    if cell["cell_type"] != "markdown":
        return []
    mark = mark_problem(source)
    if mark not in (None, "no mark"):
        return [mark]
    if mark is None:
        return []
    return [f"unreviewed claim: {s[:160]}" for s in claims(source)]


def notebook_problems(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return [f"{path.relative_to(ROOT)} cell {i}: {p}" for i, cell in enumerate(cells) for p in cell_problems(cell)]


def recorded_predictions(path: Path) -> int:
    """Cells that record a prediction and are followed by a code cell comparing a result with it."""
    codes = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    return sum(1 for i, src in enumerate(codes) if PREDICTION.search(src)
               and any("MY_PREDICTION[" in later or "MY_PREDICTION)" in later for later in codes[i:]))


def notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


def main() -> int:
    problems = [p for path in notebooks() for p in notebook_problems(path)]
    print("\n".join(problems) or "no unreviewed claims")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
