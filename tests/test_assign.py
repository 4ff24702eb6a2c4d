"""infopt_lab.grading.assign: exercises/ kept in step with solutions/, answers stripped, metadata named."""
import shutil
from pathlib import Path

import nbformat
import pytest

from grading_cli import run_cli
from infopt_lab.grading.assign import check as assign_check
from infopt_lab.grading.assign import exercise_text, strip_regions
from infopt_lab.grading.checks import available_exercises

ROOT = Path(__file__).resolve().parents[1]


def test_every_exercise_has_checks_solution_and_exercise():
    assert available_exercises() == sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
    for name in available_exercises():
        assert (ROOT / "exercises" / f"{name}.ipynb").exists()

def test_assign_check_passes_on_main():
    assert assign_check(ROOT / "solutions", ROOT / "exercises") == []

def test_assign_check_fails_naming_the_file_until_regenerated(tmp_path, capsys):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    shutil.copytree(ROOT / "solutions", solutions)
    shutil.copytree(ROOT / "exercises", exercises)
    nb = nbformat.read(solutions / "00_orientation.ipynb", as_version=4)
    nb.cells[0].source += "\n\nOne more sentence."
    nbformat.write(nb, solutions / "00_orientation.ipynb")
    dirs = ["--solutions", str(solutions), "--exercises", str(exercises)]
    assert run_cli("assign", "--check", *dirs) == 1
    assert str(exercises / "00_orientation.ipynb") in capsys.readouterr().err
    assert run_cli("assign", *dirs) == 0
    assert run_cli("assign", "--check", *dirs) == 0

def test_exercise_strips_answers_and_outputs_only():
    solution = nbformat.read(ROOT / "solutions" / "00_orientation.ipynb", as_version=4)
    exercise = nbformat.reads(exercise_text(ROOT / "solutions" / "00_orientation.ipynb"), as_version=4)
    assert len(exercise.cells) == len(solution.cells) and exercise.metadata == solution.metadata
    for s, e in zip(solution.cells, exercise.cells):
        assert (s.cell_type, s.id) == (e.cell_type, e.id)
        if "### BEGIN SOLUTION" in s.source:
            stub = "raise NotImplementedError()" if s.cell_type == "code" else "YOUR ANSWER HERE"
            assert stub in e.source and "### BEGIN SOLUTION" not in e.source
        else:
            assert s.source == e.source
        if e.cell_type == "code":
            assert e.outputs == [] and e.execution_count is None

def test_strip_regions_keeps_indentation_and_rejects_unbalanced_markers():
    source = "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n\nx = 2"
    stub = ["# YOUR CODE HERE", "raise NotImplementedError()"]
    assert strip_regions(source, stub, "nb") == ("def f():\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
                                                 "\nx = 2")
    with pytest.raises(ValueError, match="never closed"):
        strip_regions("### BEGIN SOLUTION\nx = 1", stub, "nb, cell 3")
    with pytest.raises(ValueError, match="without a"):
        strip_regions("x = 1\n### END SOLUTION", stub, "nb, cell 3")

def test_assign_writes_missing_metadata_and_check_names_it(tmp_path, capsys):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    nb = nbformat.read(ROOT / "solutions" / "00_orientation.ipynb", as_version=4)
    del nb.metadata["infopt_lab"]
    nbformat.write(nb, solutions / "00_orientation.ipynb")
    dirs = ["--solutions", str(solutions), "--exercises", str(exercises)]
    assert run_cli("assign", "--check", *dirs) == 1
    assert "metadata names exercise None, not '00_orientation'" in capsys.readouterr().err
    assert run_cli("assign", *dirs) == 0 and run_cli("assign", "--check", *dirs) == 0
    for folder in (solutions, exercises):
        meta = nbformat.read(folder / "00_orientation.ipynb", as_version=4).metadata
        assert meta["infopt_lab"] == {"exercise": "00_orientation"}

def test_every_solution_and_exercise_names_its_exercise():
    for folder in ("solutions", "exercises"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            assert nbformat.read(path, as_version=4).metadata["infopt_lab"]["exercise"] == path.stem

def test_every_notebook_opens_with_the_same_colab_setup_cell():
    """Lecture, solution and exercise notebooks all install the course on Colab in their second cell."""
    notebooks = [p for d in ("notebooks", "solutions", "exercises") for p in sorted((ROOT / d).glob("*.ipynb"))]
    cells = {p.relative_to(ROOT).as_posix(): nbformat.read(p, as_version=4).cells[1] for p in notebooks}
    reference = cells["notebooks/00_orientation.ipynb"].source
    assert "google.colab" in reference and "pip" in reference
    assert {name: c.source == reference and c.cell_type == "code" for name, c in cells.items()} == \
        {name: True for name in cells}
