"""Grading results and the files they go to: Gradescope-shaped JSON per submission, one CSV per class."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CheckResult:
    """One check's outcome for one submission."""

    name: str
    max_score: float
    passed: bool
    reason: str  # one line

    @property
    def score(self) -> float:
        return self.max_score if self.passed else 0.0


@dataclass
class SubmissionReport:
    """Everything graded for one submission."""

    id: str
    path: str
    exercise: str | None
    results: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what happened while running it, one line each
    seconds: float = 0.0
    error: str | None = None  # set when it could not be graded at all (no exercise matched, a grader bug)

    @property
    def score(self) -> float:
        return sum(r.score for r in self.results)

    @property
    def max_score(self) -> float:
        return sum(r.max_score for r in self.results)

    def to_gradescope(self) -> dict:
        """The results.json shape Gradescope reads: score, max_score, tests[name, score, max_score, status, output]."""
        tests = [{"name": r.name, "score": r.score, "max_score": r.max_score,
                  "status": "passed" if r.passed else "failed", "output": r.reason} for r in self.results]
        head = f"{self.id}: ERROR: {self.error}" if self.error else f"{self.id}: {self.score:g}/{self.max_score:g}"
        result = {"score": self.score, "max_score": self.max_score, "execution_time": round(self.seconds, 1),
                  "output": "\n".join([head] + self.notes), "tests": tests}
        if self.error:
            result["extra_data"] = {"error": self.error}
        return result

    def summary(self, verbose: bool = True) -> str:
        """Lines for the terminal: the total, then each check with its reason."""
        if self.error:
            return "\n".join([f"{self.id}: ERROR: {self.error}"] + [f"  note: {n}" for n in self.notes])
        lines = [f"{self.id} ({self.exercise}): {self.score:g}/{self.max_score:g}"]
        if verbose:
            lines += [f"  note: {n}" for n in self.notes]
            lines += [f"  [{r.score:g}/{r.max_score:g}] {r.name}: {r.reason}" for r in self.results]
        return "\n".join(lines)


def file_stem(submission_id: str) -> str:
    """A file name for a submission id (ids may hold '/')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "__", submission_id).strip("_") or "submission"


def write_json(reports: list[SubmissionReport], path: Path) -> list[Path]:
    """One submission: write its JSON to `path`. Several: `path` is a folder of `<id>.json`."""
    if len(reports) == 1 and path.suffix == ".json":
        targets = [path]
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        if path.suffix == ".json":
            raise ValueError(f"--json {path} names one file, but {len(reports)} submissions were graded; "
                             "pass a folder to get one <id>.json per submission")
        path.mkdir(parents=True, exist_ok=True)
        targets = [path / f"{file_stem(r.id)}.json" for r in reports]
    for report, target in zip(reports, targets):
        write_atomic(target, json.dumps(report.to_gradescope(), indent=2) + "\n")
    return targets


def write_atomic(path: Path, text: str) -> None:
    """Write a whole file or nothing: a temporary file beside it, then a rename over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def csv_columns(reports: list[SubmissionReport]) -> list[str]:
    """Check columns in first-seen order, prefixed by exercise when several exercises are mixed."""
    mixed = len({r.exercise for r in reports if not r.error}) > 1
    columns: list[str] = []
    for report in reports:
        for result in report.results:
            column = f"{report.exercise}: {result.name}" if mixed else result.name
            if column not in columns:
                columns.append(column)
    return columns


def write_csv(reports: list[SubmissionReport], path: Path) -> None:
    """One row per submission: id, each check's score, total, max, error (empty when it was graded)."""
    columns = csv_columns(reports)
    mixed = len({r.exercise for r in reports if not r.error}) > 1
    path.parent.mkdir(parents=True, exist_ok=True)
    f = io.StringIO(newline="")
    writer = csv.writer(f)
    writer.writerow(["id", *columns, "total", "max", "error"])
    for report in reports:
        scores = {(f"{report.exercise}: {r.name}" if mixed else r.name): r.score for r in report.results}
        totals = ["", ""] if report.error else [fmt(report.score), fmt(report.max_score)]
        writer.writerow([report.id, *(fmt(scores[c]) if c in scores else "" for c in columns),
                         *totals, report.error or ""])
    write_atomic(path, f.getvalue())


def fmt(x: float) -> str:
    """A score without a trailing .0."""
    return f"{x:g}"


def check_output_paths(csv_path: Path | None, json_path: Path | None, inputs: list[Path], count: int) -> None:
    """Refuse, before any grading, output paths that would overwrite an input or cannot be written."""
    given = {p.resolve() for p in inputs}
    if csv_path is not None:
        _check_file_target("--csv", csv_path, given)
    if json_path is not None and json_path.suffix == ".json":
        if count != 1:
            raise ValueError(f"--json {json_path} names one file, but {count} notebooks were found; "
                             "pass a folder to get one <id>.json per submission")
        _check_file_target("--json", json_path, given)
    elif json_path is not None:
        folder = json_path.resolve()
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--json {json_path} is a file; pass a folder (or a .json file for one notebook)")
        if folder in given or any(p.parent == folder for p in given):
            raise ValueError(f"--json {json_path} holds submitted notebooks; write the reports to another folder")
        _check_writable("--json", folder)
    if csv_path is not None and json_path is not None and csv_path.resolve() == json_path.resolve():
        raise ValueError(f"--csv and --json both name {csv_path}; give them different paths")


def _check_file_target(option: str, path: Path, inputs: set[Path]) -> None:
    """An output file must not be an input, a notebook or a folder, and its folder must be writable."""
    target = path.resolve()
    if target in inputs:
        raise ValueError(f"{option} {path} is one of the paths being graded; it would be overwritten")
    if target.suffix == ".ipynb":
        raise ValueError(f"{option} {path} names a notebook; give a .csv or .json file name")
    if target.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file name")
    _check_writable(option, target.parent)


def _check_writable(option: str, folder: Path) -> None:
    """The folder, or its nearest existing ancestor (it will be created), must take a file: tried for real."""
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a folder")
        fd, probe = tempfile.mkstemp(prefix=".infopt-grade-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{option}: cannot write under {folder} ({e})") from None
