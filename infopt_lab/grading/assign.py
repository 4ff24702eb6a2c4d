"""Write exercises/ from solutions/: each `### BEGIN SOLUTION` ... `### END SOLUTION` region becomes a stub.

nbgrader's markers, so instructors who know nbgrader feel at home. In code cells
the region becomes `# YOUR CODE HERE` + `raise NotImplementedError()` at the
marker's indentation; in markdown cells it becomes `YOUR ANSWER HERE`. Outputs,
execution counts and execution metadata are stripped; everything else is kept.
Both notebooks carry `metadata.infopt_lab.exercise` (the solution's file stem),
which is how the grader knows what a renamed submission answers; `assign` writes
it into a solution that lacks it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CODE_STUB = ["# YOUR CODE HERE", "raise NotImplementedError()"]
MARKDOWN_STUB = ["YOUR ANSWER HERE"]


def strip_regions(source: str, stub: list[str], where: str) -> str:
    """Replace every solution region in `source` with `stub`, indented like its BEGIN marker."""
    out: list[str] = []
    indent: str | None = None
    for number, line in enumerate(source.split("\n"), start=1):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if indent is not None:
                raise ValueError(f"{where}, line {number}: '{BEGIN}' inside another region; close it with '{END}'")
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in stub]
        elif marker.startswith(END):
            if indent is None:
                raise ValueError(f"{where}, line {number}: '{END}' without a '{BEGIN}' before it")
            indent = None
        elif indent is None:
            out.append(line)
    if indent is not None:
        raise ValueError(f"{where}: '{BEGIN}' is never closed; add '{END}'")
    return "\n".join(out)


def make_exercise(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The exercise notebook for a solution notebook (the input is not modified)."""
    nb = copy.deepcopy(solution)
    nb.metadata.pop("widgets", None)
    for index, cell in enumerate(nb.cells, start=1):
        where = f"{name}, cell {index}"
        if cell.cell_type == "code":
            cell.source = strip_regions(cell.source, CODE_STUB, where)
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
        elif cell.cell_type == "markdown":
            cell.source = strip_regions(cell.source, MARKDOWN_STUB, where)
    return nb


def exercise_name(nb: nbformat.NotebookNode) -> str | None:
    """The exercise a notebook declares in its metadata, or None."""
    meta = nb.metadata.get("infopt_lab")
    return meta.get("exercise") if isinstance(meta, dict) else None


def tag_solution(path: Path) -> bool:
    """Write `metadata.infopt_lab.exercise` into a solution notebook that lacks it; True if written."""
    nb = nbformat.read(path, as_version=4)
    if exercise_name(nb) == path.stem:
        return False
    meta = nb.metadata.get("infopt_lab")
    nb.metadata["infopt_lab"] = {**(meta if isinstance(meta, dict) else {}), "exercise": path.stem}
    nbformat.write(nb, path)
    return True


def exercise_text(solution_path: Path) -> str:
    """The exact file text `assign` writes for one solution notebook."""
    solution = nbformat.read(solution_path, as_version=4)
    text = nbformat.writes(make_exercise(solution, solution_path.name))
    return text if text.endswith("\n") else text + "\n"


@dataclass(frozen=True)
class Problem:
    """An exercise file that does not match its solution."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def solution_files(solutions: Path) -> list[Path]:
    """The solution notebooks, sorted; ValueError if the folder is missing."""
    if not solutions.is_dir():
        raise ValueError(f"solutions folder {solutions} does not exist; run from the course root "
                         "or pass --solutions DIR")
    return sorted(solutions.glob("*.ipynb"))


def assign(solutions: Path, exercises: Path) -> list[Path]:
    """Write one exercise per solution notebook; return the files written."""
    written = []
    exercises.mkdir(parents=True, exist_ok=True)
    for path in solution_files(solutions):
        if tag_solution(path):
            written.append(path)
        target = exercises / path.name
        target.write_bytes(exercise_text(path).encode("utf-8"))
        written.append(target)
    return written


def check(solutions: Path, exercises: Path) -> list[Problem]:
    """Exercise files that are missing, stale, or have no solution; empty when all match."""
    problems = []
    sources = solution_files(solutions)
    for path in sources:
        declared = exercise_name(nbformat.read(path, as_version=4))
        if declared != path.stem:
            problems.append(Problem(path, f"its metadata names exercise {declared!r}, not {path.stem!r}; "
                                          "run `infopt-lab assign` to write it"))
        target = exercises / path.name
        if not target.exists():
            problems.append(Problem(target, f"missing; run `infopt-lab assign` to write it from {path}"))
        elif target.read_bytes() != exercise_text(path).encode("utf-8"):
            problems.append(Problem(target, f"stale: it differs from what {path} generates; "
                                            "run `infopt-lab assign` and commit both"))
    names = {p.name for p in sources}
    for target in sorted(exercises.glob("*.ipynb")) if exercises.is_dir() else []:
        if target.name not in names:
            problems.append(Problem(target, f"has no solution {solutions / target.name}; exercises come "
                                            "only from solutions"))
    return problems
