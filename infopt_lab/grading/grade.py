"""Grade submitted exercise notebooks: run each in a fresh sandboxed kernel, then run its checks.

How a submission is kept from the checks it is graded by:
1. The checks and this grader are imported before any submission runs, and the
   kernel's start-up code is held in memory (see `kernel.py`).
2. The submission runs in a separate process (a kernel) in its own temporary
   folder, which is also its HOME, under memory, file-size and output caps.
3. Checks run here, in the grader's process. They reach the submission only by
   asking the kernel to call a function; only JSON text comes back (`protocol.py`).
4. After each submission, the grader's files are compared with a snapshot and
   restored (`guard.py`), and anything written next to its folder is removed.
The submitted file itself is only ever read.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from time import monotonic

import nbformat
from tqdm.auto import tqdm

from .answers import Written
from .checks import Check, CheckFailed, available_exercises, load_checks
from .guard import FileGuard, outside_writes
from .kernel import GraderError, KernelSession, Limits
from .protocol import CallError, KernelLost, NotDefined, NotImplementedYet, Raised, describe_call
from .report import CheckResult, SubmissionReport

MAX_NOTEBOOK_BYTES = 20 << 20
GRADING_DIR = Path(__file__).parent


class BadNotebook(Exception):
    """The submitted file is not a notebook the grader can run; the message says why."""


@dataclass(frozen=True)
class SubmissionFile:
    """A notebook to grade and the student id it is reported under."""

    id: str
    path: Path


def collect(paths: list[Path]) -> list[SubmissionFile]:
    """Notebooks under the given paths: a file's id is its stem; in a folder, a subfolder's name is the id."""
    found: list[SubmissionFile] = []
    for path in paths:
        if path.is_file():
            found.append(SubmissionFile(path.stem, path))
        elif path.is_dir():
            found += [SubmissionFile(p.stem, p) for p in sorted(path.glob("*.ipynb"))]
            for sub in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                notebooks = sorted(p for p in sub.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
                found += [SubmissionFile(sub.name if len(notebooks) == 1 else f"{sub.name}/{p.stem}", p)
                          for p in notebooks]
        else:
            raise GraderError(f"{path} does not exist; pass notebooks or folders of them")
    return unique_ids(found)


def unique_ids(found: list[SubmissionFile]) -> list[SubmissionFile]:
    """Replace ids that collide with the notebooks' paths."""
    ids = [f.id for f in found]
    return [SubmissionFile(f.path.with_suffix("").as_posix() if ids.count(f.id) > 1 else f.id, f.path)
            for f in found]


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """Parse a submitted file without changing it; BadNotebook with a reason if it is not a notebook."""
    size = path.stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        raise BadNotebook(f"the file is {size >> 20} MB; the grader reads notebooks up to "
                          f"{MAX_NOTEBOOK_BYTES >> 20} MB")
    try:
        text = path.read_bytes().decode("utf-8")
        json.loads(text)
    except UnicodeDecodeError as e:
        raise BadNotebook(f"not a valid notebook: the file is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise BadNotebook(f"not a valid notebook: the file is not JSON ({e.msg} at line {e.lineno}, "
                          f"column {e.colno})") from None
    try:
        nb = nbformat.reads(text, as_version=4)
        if not all(isinstance(c.get("cell_type"), str) and isinstance(c.get("source"), str) for c in nb.cells):
            raise ValueError("a cell has no cell_type or source")
    except Exception as e:  # any structural failure is the submission's, and is reported as such
        first = (str(e).strip().splitlines() or [""])[0]
        raise BadNotebook(f"not a valid notebook: {type(e).__name__}: {first}"[:200]) from None
    return nb


def identify_exercise(path: Path, nb: nbformat.NotebookNode | None, forced: str | None) -> str | None:
    """Which exercise a submission answers: --exercise, then notebook metadata, then the file name."""
    known = available_exercises()
    if forced:
        return forced
    meta = nb.metadata.get("infopt_lab") if nb is not None else None
    meta = meta.get("exercise") if isinstance(meta, dict) else None
    return meta if meta in known else named_exercise(path)


def named_exercise(path: Path) -> str | None:
    """The exercise a file name names (`00_orientation*.ipynb`), or None."""
    stem = re.sub(r"\.ipynb$", "", path.name)
    known = available_exercises()
    return stem if stem in known else next((k for k in known if stem.startswith(k)), None)


class Submission:
    """What a check sees of a submission: `call(name, *args)`, and what it wrote down (`record`, `answer`)."""

    def __init__(self, session: KernelSession, timeout: float, written: Written | None = None):
        self.session, self.timeout, self.deadline = session, timeout, monotonic() + timeout
        self.written = written or Written({}, [])

    def record(self, name: str):
        """A record the notebook saved with its outputs (see `answers.Written.record`)."""
        return self.written.record(name)

    def answer(self, title: str) -> str:
        """The markdown answer holding `title` (see `answers.Written.answer`)."""
        return self.written.answer(title)

    def start_check(self) -> None:
        """Give the next check its full time limit."""
        self.deadline = monotonic() + self.timeout

    def call(self, name: str, *args):
        """Call the submission's `name(*args)` and return its result as plain data."""
        return self.call_many(name, [args])[0]

    def call_many(self, name: str, calls: list[tuple]) -> list:
        """Call `name` once per argument tuple in one round trip; raise on the first failed call."""
        values = []
        for args, result in zip(calls, self.session.call(name, calls, self.deadline)):
            if "error" in result:
                raise call_error(name, args, result)
            values.append(result.get("value"))
        if any(isinstance(v, dict) and "__unsupported__" in v for v in values):
            kind = next(v for v in values if isinstance(v, dict) and "__unsupported__" in v)["__unsupported__"]
            raise CheckFailed(f"{name} returned a {kind}; return numbers, lists or tensors")
        return values


def grade_written(nb, exercise: str) -> list[CheckResult]:
    """The exercise's `written` checks on a saved notebook, no kernel run: how its decision tasks score."""
    sub = Submission(None, 0.0, Written.from_notebook(nb))
    return [run_check(c, sub, nb, None) for c in load_checks(exercise) if c.written]


def call_error(name: str, args: tuple, result: dict) -> CallError:
    """The CallError for a call that raised inside the submission."""
    error, message = str(result.get("error")), str(result.get("message", ""))[:150]
    if error == "NotImplementedError" or (error == "InterpreterError" and message.startswith("NotImplementedError")):
        return NotImplementedYet(f"not implemented: {name} still raises NotImplementedError")
    return Raised(f"{describe_call(name, args)} raised {error}: {message}".rstrip(": "), error)


def run_check(check: Check, sub: Submission, nb, session: KernelSession) -> CheckResult:
    """Run one check; any failure becomes a one-line reason, never a grader traceback."""
    sub.start_check()
    try:
        check.run(sub)
    except CheckFailed as e:
        return CheckResult(check.name, check.points, False, str(e))
    except NotDefined as e:
        return CheckResult(check.name, check.points, False, explain_missing(str(e), nb, session))
    except CallError as e:
        return CheckResult(check.name, check.points, False, str(e))
    except Exception as e:  # a result of an unexpected shape; the check could not judge it
        return CheckResult(check.name, check.points, False,
                           f"could not check the result ({type(e).__name__}: {e})"[:200])
    return CheckResult(check.name, check.points, True, "passed")


def explain_missing(message: str, nb, session: KernelSession) -> str:
    """'`f` is not defined', plus what went wrong in the cell that defines it, if any."""
    match = re.search(r"`(\w+)`", message)
    if not match or "not a function" in message:
        return message
    name = match.group(1)
    pattern = re.compile(rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*=", re.MULTILINE)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and pattern.search(cell.source):
            note = session.cell_notes.get(index)
            return f"{message}: the cell that defines it (cell {index + 1}) {note}" if note else message
    return f"{message}: no cell defines it"


def cell_label(nb, index: int) -> str:
    """'cell 8 `first line`': the position counts every cell from the top, markdown included."""
    lines = [line.strip() for line in nb.cells[index].source.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return f"cell {index + 1} `{first if len(first) <= 40 else first[:37] + '...'}`"


def error_report(sub: SubmissionFile, reason: str) -> SubmissionReport:
    """A submission that could not be graded at all: no scores, an error with the reason."""
    return SubmissionReport(sub.id, str(sub.path), None, error=reason)


def unmatched_reason(path: Path) -> str:
    """Why a notebook could not be matched to an exercise, and how to fix it."""
    return (f"cannot tell which exercise {path.name} answers: its metadata has no infopt_lab.exercise and its "
            f"file name names none; hand in the exercise notebook as given, or pass --exercise "
            f"(known: {', '.join(available_exercises())})")


def failed_report(sub: SubmissionFile, exercise: str | None, checks: list[Check],
                  reason: str) -> SubmissionReport:
    """A report with every check at 0 for the same reason."""
    report = SubmissionReport(sub.id, str(sub.path), exercise, notes=[reason])
    report.results = [CheckResult(c.name, c.points, False, reason) for c in checks]
    return report


def grade_one(sub: SubmissionFile, workdir: Path, limits: Limits, checks: dict[str, list[Check]],
              forced: str | None) -> SubmissionReport:
    """Copy one submission into `workdir`, run it there, then run its checks."""
    try:
        nb = read_notebook(sub.path)
    except BadNotebook as e:
        exercise = identify_exercise(sub.path, None, forced)
        if exercise is None:
            return error_report(sub, f"{e}; and {unmatched_reason(sub.path)}")
        return failed_report(sub, exercise, checks[exercise], str(e))
    exercise = identify_exercise(sub.path, nb, forced)
    if exercise is None:
        return error_report(sub, unmatched_reason(sub.path))
    written = Written.from_notebook(nb)           # as handed in, before running it changes the outputs
    workdir.mkdir()
    shutil.copyfile(sub.path, workdir / sub.path.name)
    report = SubmissionReport(sub.id, str(sub.path), exercise)
    named = named_exercise(sub.path)
    if forced is None and named not in (None, exercise):
        report.notes.append(f"its file name says {named} but its metadata says {exercise}; graded as {exercise}")
    with KernelSession(nb, workdir, limits) as session:
        try:
            session.execute()
        except KernelLost as e:
            report.notes.append(f"the notebook could not be run to the end: {e}")
        proxy = Submission(session, limits.check_timeout, written)
        report.results = [run_check(c, proxy, nb, session) for c in checks[exercise]]
    cell_notes = [f"{cell_label(nb, i)} {note}" for i, note in sorted(session.cell_notes.items())]
    report.notes = cell_notes + session.notes + report.notes
    if session.output_dropped:
        report.notes.append(f"printed more than {limits.output_kb} KB; the rest of its output was dropped")
    return report


def grade(paths: list[Path], limits: Limits | None = None, exercise: str | None = None,
          progress: bool = True) -> list[SubmissionReport]:
    """Grade every notebook under `paths`; one report per submission, in order."""
    limits = limits or Limits()
    if exercise is not None and exercise not in available_exercises():
        raise GraderError(f"--exercise {exercise!r} has no checks; known: {', '.join(available_exercises())}")
    submissions = collect(paths)
    checks = {name: load_checks(name) for name in available_exercises()}  # loaded before any submission runs
    guard = FileGuard(GRADING_DIR)
    reports = []
    with tempfile.TemporaryDirectory(prefix="infopt-grade-") as tmp:
        workroot = Path(tmp)
        for sub in tqdm(submissions, desc="grading", unit="notebook", disable=not progress):
            started = monotonic()
            try:
                report = grade_one(sub, workroot / "submission", limits, checks, exercise)
            except GraderError:
                raise
            except Exception as e:  # a grader bug must not cost the rest of the class their grades
                report = error_report(sub, f"the grader failed on this submission ({type(e).__name__}: {e}); "
                                           "please report it")
            finally:
                tampered = guard.restore()
                escaped = outside_writes(workroot, workroot / "submission")
                clear_folder(workroot)
            report.notes += tampered + [f"wrote {name} outside its folder; removed it" for name in escaped]
            report.seconds = monotonic() - started
            reports.append(report)
    return reports


def clear_folder(folder: Path) -> None:
    """Delete everything inside `folder`, keeping the folder."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def gradescope_json(report: SubmissionReport) -> str:
    """The report as Gradescope's results.json text."""
    return json.dumps(report.to_gradescope(), indent=2)
