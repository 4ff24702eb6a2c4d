"""Grading results and the files they go to: Gradescope-shaped JSON per submission, one CSV per class."""
from __future__ import annotations

import csv
import json
import re
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
        target.write_text(json.dumps(report.to_gradescope(), indent=2) + "\n", encoding="utf-8")
    return targets


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
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", *columns, "total", "max", "error"])
        for report in reports:
            scores = {(f"{report.exercise}: {r.name}" if mixed else r.name): r.score for r in report.results}
            totals = ["", ""] if report.error else [fmt(report.score), fmt(report.max_score)]
            writer.writerow([report.id, *(fmt(scores[c]) if c in scores else "" for c in columns),
                             *totals, report.error or ""])


def fmt(x: float) -> str:
    """A score without a trailing .0."""
    return f"{x:g}"
