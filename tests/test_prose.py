"""Prose a measurement can contradict is reviewed or generated; every notebook records a prediction first."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import infopt_lab as lab

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("prose_check", ROOT / "scripts" / "prose_check.py")
pc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = pc
spec.loader.exec_module(pc)

# Notebook 05's summary before issue 31: fixed sentences stating a GPU-shaped result beside CPU outputs.
OLD_05_SUMMARY = """## Summary

- Wall-clock gains need cheap drafts and cheap verification: prompt lookup (a free draft)
  gains on repetitive code even on a CPU; a draft model pays only when α is high and both its
  step and the verification are cheap, and section 9 measures all three for SmolLM2-135M.
- Inside a continuously batched engine each sequence drafts, one packed pass verifies all,
  and each rolls back its own blocks; the tokens do not change, and the gain shrinks as
  the batch grows (section 10).
"""


def _markdown(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": text.splitlines(keepends=True)}


@pytest.mark.parametrize("path", pc.notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_unreviewed_claim_in_any_notebook_or_solution(path):
    assert pc.notebook_problems(path) == []


def test_the_check_fails_on_notebook_05s_old_summary():
    problems = pc.cell_problems(_markdown(OLD_05_SUMMARY))
    assert any("the gain shrinks as the batch grows (section 10)" in p for p in problems), problems
    assert any("a draft model pays only when" in p for p in problems), problems


def test_a_review_mark_must_name_the_regime_and_the_hardware():
    claim = "At batch 1 the step is 2.0x faster in int8 (section 3)."
    assert pc.cell_problems(_markdown(claim))
    assert pc.cell_problems(_markdown("<!-- checked -->\n" + claim)) == ["a review mark without regime and hardware"]
    assert pc.cell_problems(_markdown("<!-- checked: regime=batch 1 decode -->\n" + claim)) == [
        "a review mark without hardware"]
    marked = "<!-- checked: regime=batch 1 decode, SmolLM2 fp32; hardware=2-core x86 CPU -->\n" + claim
    assert pc.cell_problems(_markdown(marked)) == []


def test_sentences_without_a_number_or_an_output_are_not_claims():
    assert pc.claims("Decoding is memory-bound on a GPU, so fewer bytes make it faster.") == []
    assert pc.claims("Code in `x = 3` is not a number.") == []
    assert pc.claims("The step grows with the batch (the table above).") != []


def test_generated_prose_keeps_a_decimal_in_ratios():
    cell = {"cell_type": "code", "metadata": {}, "source": ['print(f"{a / b:.0f}x lower, {c:.1f}x")\n']}
    assert pc.cell_problems(cell) == ["a ratio rounded to a whole number: {a / b:.0f}x"]


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_every_notebook_records_a_prediction_before_it_measures(path):
    assert pc.recorded_predictions(path) >= 1


def test_check_prediction_says_how_far_off():
    line = lab.check_prediction(4.0, 3.5, "the shrink", unit="x")
    assert "**4.00x**" in line and "**3.50x**" in line and "-0.50x" in line and "0.88 times" in line
    assert "right" in lab.check_prediction("feature", "feature", "the best draft")
    assert "not what was measured" in lab.check_prediction("feature", "lookup", "the best draft")
    with pytest.raises(ValueError, match="finite"):
        lab.check_prediction(float("nan"), 1.0, "x")
    with pytest.raises(ValueError, match="name the measured"):
        lab.check_prediction(1.0, 1.0, "")


def _printed_threads(path: Path) -> str | None:
    """The thread count a committed notebook's outputs print first ("threads : N"), or None."""
    import json
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", ""))
            found = re.search(r"^threads\s*:\s*(\d+)", text, re.MULTILINE)
            if found:
                return found.group(1)
    return None


@pytest.mark.parametrize("path", pc.notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_run_used_the_test_runs_thread_count(path):
    """One setting for every committed output: the test run's one thread per worker (conftest.py)."""
    assert _printed_threads(path) == "1"
