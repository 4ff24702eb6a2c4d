"""Decision tasks: the grader judges a choice from the student's own recorded measurement, read from the saved
notebook. Each solution's decision scores full marks, the exercise's stub none, and a wrong choice, or the
right one with a wrong number, loses exactly that task's points."""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import nbformat
import pytest

from infopt_lab.grading.answers import Written, numbers, read_records
from infopt_lab.grading.checks import available_exercises
from infopt_lab.grading.grade import grade_written

ROOT = Path(__file__).resolve().parents[1]
DECIDING = [name for name in available_exercises()
            if hasattr(importlib.import_module(f"infopt_lab.grading.checks.{name}"), "wrong_answers")]


def module(name: str):
    return importlib.import_module(f"infopt_lab.grading.checks.{name}")


def with_answer(nb, title: str, text: str):
    """A copy of the notebook whose answer cell under `title` says `text` instead."""
    nb = copy.deepcopy(nb)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and title in c.source)
    cell.source = cell.source.split(title, 1)[0] + title + text
    return nb


def score(results) -> float:
    return sum(r.max_score for r in results if r.passed)


def test_every_exercise_but_serving_has_a_decision_task():
    assert set(available_exercises()) - set(DECIDING) <= {"08_serving"}, DECIDING   # 08's task 3 measures


@pytest.mark.parametrize("name", DECIDING)
def test_solution_decides_right_and_exercise_is_unanswered(name):
    solution = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    results = grade_written(solution, name)
    assert results and all(r.passed for r in results), [(r.name, r.reason) for r in results if not r.passed]
    exercise = nbformat.read(ROOT / "exercises" / f"{name}.ipynb", as_version=4)
    assert all(not r.passed and r.reason.startswith("not implemented") for r in grade_written(exercise, name))


@pytest.mark.parametrize("name", DECIDING)
def test_a_wrong_decision_loses_that_tasks_points(name):
    solution = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    full = score(grade_written(solution, name))
    title = module(name).DECISION_TITLE
    wrong = module(name).wrong_answers(Written.from_notebook(solution))
    assert len(wrong) >= 2
    for text in wrong:
        results = grade_written(with_answer(solution, title, text), name)
        failed = [r for r in results if not r.passed]
        assert len(failed) == 1, (text, [(r.name, r.reason) for r in failed])
        assert full - score(results) == failed[0].max_score > 0
        assert "decision" in failed[0].name, failed[0].name          # the task's decision check, not its record


def test_an_answer_without_a_decision_line_is_named():
    name = "07_putting_it_together"
    solution = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    results = grade_written(with_answer(solution, module(name).DECISION_TITLE, "\n\nprefix caching, 0.715"), name)
    assert any("no line starting `Decision:`" in r.reason for r in results if not r.passed)


def test_records_come_from_the_saved_outputs_last_one_wins():
    nb = nbformat.v4.new_notebook()
    meta = {"application/json": {"infopt_lab_record": "x"}}
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"application/json": {"v": 1}}, metadata=meta),
                    nbformat.v4.new_output("display_data", data={"application/json": {"v": 2}}, metadata=meta),
                    nbformat.v4.new_output("display_data", data={"application/json": {"v": 3}})]
    nb.cells = [cell]
    assert read_records(nb) == {"x": {"v": 2}}


def test_numbers_read_as_written():
    assert numbers("**0.715** per Mtok, 1,024 tokens, +1.3%, k = 3, 2.5x, -4e-2; v(5)") == \
        [0.715, 1024.0, 1.3, 3.0, 2.5, -0.04, 5.0]
