"""infopt_lab.grading: grade scores any submission fairly (assign: tests/test_assign.py).

Kernels are the slow part, so every fixture submission is graded in one grader run
(one module-scoped fixture), and solutions/ + exercises/ in one command-line run.
"""
from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grading_cli import run_cli
from infopt_lab.grading.checks import available_exercises, load_checks
from infopt_lab.grading.grade import BadNotebook, GRADING_DIR, collect, grade, read_notebook
from infopt_lab.grading.guard import FileGuard
from infopt_lab.grading.kernel import Limits
from infopt_lab.grading.protocol import NotDefined, ProtocolError, Tensor, encode_value, parse_reply
from infopt_lab.grading.watchdog import MemoryWatchdog

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "grading"
LIMITS = Limits(cell_timeout=10, check_timeout=5, memory_mb=2048)
MAX_SCORE = 23

# case -> (score, {check name prefix: reason fragment} for every check that must fail, note fragment)
EXPECTED = {
    "raises": (13, {"time_to_first_token on": "(cell 8) raised RuntimeError: unfinished",
                    "time_to_first_token with": "not defined", "time_per_output_token on": "not defined",
                    "time_per_output_token with": "not defined", "tokens_per_second on": "not defined",
                    "tokens_per_second with": "not defined", "the three metrics": "not defined"},
               "raised RuntimeError: unfinished"),
    "syntax_error": (13, {"greedy picks": "raised SyntaxError", "greedy breaks": "not defined",
                          "sample_top_k stays": "not defined", "sample_top_k with k=1": "not defined",
                          "sample_top_k with k at": "not defined", "sample_top_k follows": "not defined"},
                     "raised SyntaxError"),
    "infinite_loop": (19, {"time_per_output_token with": "ran past the check's 5 s time limit"},
                      "ignored the interrupt; it was skipped"),
    "exits": (12, {"memory_reduction": "the kernel died while running memory_reduction(2, 1)",
                   "greedy picks": "ended the kernel", "greedy breaks": "ended the kernel",
                   "sample_top_k stays": "ended the kernel", "sample_top_k with k=1": "ended the kernel",
                   "sample_top_k with k at": "ended the kernel", "sample_top_k follows": "ended the kernel"},
              "raised SystemExit: done for today"),
    "huge_output": (20, {}, "the rest of its output was dropped"),
    "memory_hog": (20, {}, "went over the 2048 MB memory cap and was stopped; it was skipped"),
    "hard_coded": (7, {"weight_memory_gb on other": "weight_memory_gb(0, 4) returned 26.08, expected 0",
                       "memory_reduction": "memory_reduction(2, 1) returned 8, expected 2",
                       "time_to_first_token with": "returned 0.25, expected 0.8",
                       "time_per_output_token with": "returned 0.05",
                       "tokens_per_second with": "returned 11.1111",
                       "greedy picks": "returned 3, expected 10", "greedy breaks": "the first of the ties",
                       "sample_top_k stays": "outside the top 4", "sample_top_k with k=1": "expected only 3",
                       "sample_top_k with k at": "far from the top-4 softmax",
                       "sample_top_k follows": "far from the top-3 softmax"}, None),
    "tamper": (18, {"tokens_per_second on": "returned 25, expected 11.1111",
                    "tokens_per_second with": "returned 1.81818, expected 1.33333"},
               "modified the grader's file grading/checks/00_orientation.py; restored it"),
    "invalid_json": (0, {name: "not a valid notebook: the file is not JSON" for name in
                         [c.name for c in load_checks("00_orientation")]}, "not JSON"),
}


# The fixtures predate exercise 00's decision task (task 4): they hold no record, so its two checks say so.
for _case, (_, _failures, _) in EXPECTED.items():
    if _case != "invalid_json":
        _failures["task 4"] = "not implemented: the notebook holds no record"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def fixture_reports():
    """Grade every bad-submission fixture in one run; the submitted files and the grader stay untouched."""
    notebooks = sorted(FIXTURES.glob("*/*.ipynb"))
    grader_files = sorted(p for p in GRADING_DIR.rglob("*.py"))
    before = [digest(p) for p in notebooks + grader_files]
    reports = {r.id: r for r in grade([FIXTURES], LIMITS, progress=False)}
    assert [digest(p) for p in notebooks + grader_files] == before
    return reports


# A class folder as the README describes it: one notebook per student, named by student id.
# s00..s05 hand in the solution of each exercise; "ballast" hands in solution 00 holding 1.5 GB
# (under the default 4096 MB cap); "nometa" hands in solution 00 with its exercise metadata removed.
STUDENTS = {f"s{name[:2]}": name for name in available_exercises()}
# "wrong07" hands in solution 07 with task 4's decision changed to a rung that changes the transcripts.
WRONG_07 = ("**Your decision (task 4)**", "\n\nDecision: all combined\n\nIt costs 0.273 per million tokens.")
BALLAST = "ballast = torch.ones(1536 << 18)  # 1.5 GiB, touched\nassert ballast.sum().item() == 1536 << 18"


def write_class(folder: Path) -> None:
    """The class folder described above."""
    folder.mkdir()
    for student, name in STUDENTS.items():
        shutil.copyfile(ROOT / "solutions" / f"{name}.ipynb", folder / f"{student}.ipynb")
    nb = nbformat.read(ROOT / "solutions" / "00_orientation.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "import torch" in c.source)
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(BALLAST))
    nbformat.write(nb, folder / "ballast.ipynb")
    nb = nbformat.read(ROOT / "solutions" / "00_orientation.ipynb", as_version=4)
    del nb.metadata["infopt_lab"]
    nbformat.write(nb, folder / "nometa.ipynb")
    nb = nbformat.read(ROOT / "solutions" / "07_putting_it_together.ipynb", as_version=4)
    answer = next(c for c in nb.cells if c.cell_type == "markdown" and WRONG_07[0] in c.source)
    answer.source = WRONG_07[0] + WRONG_07[1]
    nbformat.write(nb, folder / "wrong07.ipynb")
    (folder / "carol").mkdir()                    # solution 00 in a file named after exercise 01
    shutil.copyfile(ROOT / "solutions" / "00_orientation.ipynb", folder / "carol" / "01_cost_anatomy_kv_cache.ipynb")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`infopt-lab grade CLASS exercises --json DIR --csv FILE` through the command line, default limits."""
    out = tmp_path_factory.mktemp("grade")
    write_class(out / "class")
    proc = subprocess.run([sys.executable, "-m", "infopt_lab.cli", "grade", str(out / "class"), "exercises",
                           "--json", str(out / "json"), "--csv", str(out / "class.csv")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    return proc, out


def test_fixtures_cover_every_case():
    assert sorted(p.parent.name for p in FIXTURES.glob("*/*.ipynb")) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_submission_score_and_reasons(fixture_reports, case):
    score, failures, note = EXPECTED[case]
    report = fixture_reports[case]
    assert report.max_score == MAX_SCORE
    failed = {r.name: r.reason for r in report.results if not r.passed}
    for prefix, fragment in failures.items():
        matches = [name for name in failed if name.startswith(prefix)]
        assert matches, f"{case}: expected a failed check starting {prefix!r}; failed: {failed}"
        assert all(fragment in failed[m] for m in matches), f"{case}: {[failed[m] for m in matches]}"
    assert all(any(n.startswith(p) for p in failures) for n in failed), f"{case}: unexpected failures {failed}"
    assert report.score == score
    assert all("\n" not in r.reason and "Traceback" not in r.reason for r in report.results)
    if note:
        assert any(note in n for n in report.notes), f"{case}: {report.notes}"


def test_tamper_cannot_escape(fixture_reports):
    notes = fixture_reports["tamper"].notes
    assert any("deleted the grader's file grading/kernel_launcher.py; restored it" in n for n in notes)
    assert any("wrote escaped.txt outside its folder; removed it" in n for n in notes)
    assert any("re-ran the notebook" in n for n in notes)  # a kernel started after the launcher was deleted


def test_class_folder_full_marks_exercises_zero(cli_run):
    proc, out = cli_run
    assert "Traceback" not in proc.stdout + proc.stderr
    for student, name in [*STUDENTS.items(), ("ballast", "00_orientation"), ("carol", "00_orientation")]:
        solution = json.loads((out / "json" / f"{student}.json").read_text())
        exercise = json.loads((out / "json" / f"{name}.json").read_text())
        assert solution["score"] == solution["max_score"] == exercise["max_score"] > 0, solution["output"]
        assert exercise["score"] == 0
        assert all(t["output"].startswith("not implemented") for t in exercise["tests"])


def test_a_wrong_decision_costs_that_tasks_points_end_to_end(cli_run):
    _, out = cli_run
    wrong = json.loads((out / "json" / "wrong07.json").read_text())
    failed = [t for t in wrong["tests"] if t["status"] == "failed"]
    assert [t["name"] for t in failed] == [next(c.name for c in load_checks("07_putting_it_together")
                                                if c.written and "decision" in c.name)]
    assert "your own record gives 'prefix caching'" in failed[0]["output"]
    assert wrong["score"] == wrong["max_score"] - failed[0]["max_score"]


def test_unmatched_notebook_is_an_error_not_a_zero(cli_run):
    proc, out = cli_run
    assert proc.returncode == 1, proc.stderr
    assert "1 submission(s) could not be graded: nometa" in proc.stderr
    assert "nometa: ERROR: cannot tell which exercise nometa.ipynb answers" in proc.stdout
    report = json.loads((out / "json" / "nometa.json").read_text())
    assert report["tests"] == [] and "cannot tell which exercise" in report["extra_data"]["error"]
    assert report["output"].startswith("nometa: ERROR:")


def test_json_has_gradescope_shape(cli_run):
    _, out = cli_run
    for path in sorted((out / "json").glob("*.json")):
        data = json.loads(path.read_text())
        assert isinstance(data["score"], (int, float)) and isinstance(data["max_score"], (int, float))
        assert data["score"] == sum(t["score"] for t in data["tests"])
        assert data["tests"] or path.stem == "nometa"
        for test in data["tests"]:
            assert set(test) >= {"name", "score", "max_score", "status", "output"}
            assert test["status"] in {"passed", "failed"} and isinstance(test["output"], str)
            assert test["score"] in (0, test["max_score"])


def test_csv_has_one_row_per_submission(cli_run):
    _, out = cli_run
    with (out / "class.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    names = available_exercises()
    assert header[0] == "id" and header[-3:] == ["total", "max", "error"]
    assert len(header) == 4 + sum(len(load_checks(n)) for n in names)
    ids = ["ballast", "nometa", *STUDENTS, "wrong07", "carol", *names]
    assert [r[0] for r in body] == ids
    assert all(len(r) == len(header) for r in body)
    by_id = {r[0]: r for r in body}
    assert by_id["nometa"][-3:-1] == ["", ""] and "cannot tell which exercise" in by_id["nometa"][-1]
    assert all(by_id[s][-3] == by_id[s][-2] != "" and by_id[s][-1] == "" for s in ["ballast", "carol", *STUDENTS])
    assert all(by_id[n][-3] == "0" for n in names)


def test_read_notebook_reasons(tmp_path):
    cases = {"not_json.ipynb": b'{"cells": [', "binary.ipynb": b"\xff\xfe\x00",
             "list.ipynb": b"[1, 2]",
             "cells.ipynb": b'{"cells": 3, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}'}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(BadNotebook, match="not a valid notebook"):
            read_notebook(tmp_path / name)


def test_collect_names_submissions_by_file_or_folder(tmp_path):
    (tmp_path / "alice.ipynb").write_text("{}")
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "00_orientation.ipynb").write_text("{}")
    assert [s.id for s in collect([tmp_path])] == ["alice", "bob"]


def test_guard_restores_files_without_following_links(tmp_path):
    root, outside = tmp_path / "pkg", tmp_path / "outside.txt"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("a")
    (root / "sub" / "b.py").write_text("b")
    outside.write_text("keep me")
    guard = FileGuard(root)
    (root / "a.py").unlink()
    (root / "a.py").symlink_to(outside)
    (root / "sub" / "b.py").write_text("evil")
    (root / "new.py").write_text("new")
    notes = guard.restore()
    assert (root / "a.py").read_text() == "a" and not (root / "a.py").is_symlink()
    assert (root / "sub" / "b.py").read_text() == "b" and not (root / "new.py").exists()
    assert outside.read_text() == "keep me" and len(notes) == 3


def test_protocol_accepts_only_the_helpers_json():
    assert encode_value([Tensor([1.0, 2.0]), 3]) == [{"__tensor__": [1.0, 2.0], "dtype": "float32"}, 3]
    with pytest.raises(ProtocolError):
        parse_reply({"user_expressions": {"r": {"data": {"text/plain": "'not json'"}}}}, "f", 1)
    with pytest.raises(NotDefined):
        parse_reply({"user_expressions": {"r": {"data": {"text/plain": repr('{"defined": false}')}}}}, "f", 1)
    with pytest.raises(ValueError, match="must be positive"):
        Limits(cell_timeout=0)


def test_watchdog_stops_a_process_past_the_cap_and_spares_one_under_it():
    hog = "import time\nkept = []\nwhile True:\n    kept.append(bytearray(50_000_000))\n    time.sleep(0.01)"
    calm = "import time\nkept = bytearray(100_000_000)\ntime.sleep(1.5)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in (hog, calm)]
    dogs = [MemoryWatchdog(p.pid, 512 << 20).start() for p in procs]
    assert procs[0].wait(timeout=30) != 0 and dogs[0].tripped
    assert procs[1].wait(timeout=30) == 0 and not dogs[1].tripped
    assert 90 << 20 < dogs[1].peak_bytes < 512 << 20
    for dog in dogs:
        dog.stop()


def test_watchdog_counts_the_memory_a_process_holds_on_the_gpu():
    """A process small on the host but holding 600 MB on a GPU (a fake nvidia-smi reading) passes a 512 MB cap."""
    calm = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(20)"])
    dog = MemoryWatchdog(calm.pid, 512 << 20, gpu_reader=lambda: {calm.pid: 600 << 20}).start()
    assert calm.wait(timeout=30) != 0 and dog.tripped and dog.peak_bytes > 600 << 20
    dog.stop()

def test_grade_refuses_outputs_that_would_overwrite_an_input_before_grading(tmp_path, capsys):
    """`--csv` or `--json` naming a submission is refused up front (exit 2) and no file changes."""
    folder = tmp_path / "one"
    folder.mkdir()
    alice = folder / "alice.ipynb"
    shutil.copyfile(ROOT / "exercises" / "00_orientation.ipynb", alice)
    (folder / "notes.txt").write_text("keep")
    before = {p: digest(p) for p in folder.iterdir()}
    cases = [["--csv", str(alice)], ["--json", str(alice)], ["--csv", str(folder / "x.ipynb")],
             ["--json", str(folder)], ["--csv", str(folder)], ["--csv", str(tmp_path / "g.csv"), "--json",
                                                                   str(tmp_path / "g.csv")],
             ["--json", "/proc/x.json"], ["--csv", "/proc/grades.csv"]]
    for extra in cases:
        assert run_cli("grade", str(alice), "--quiet", *extra) == 2, extra
        assert "error:" in capsys.readouterr().err
    assert {p: digest(p) for p in folder.iterdir()} == before


def test_reports_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from infopt_lab.grading import report as report_module
    target = tmp_path / "grades.csv"
    target.write_text("old,complete\n")
    reports = [report_module.SubmissionReport("alice", "alice.ipynb", None, error="no exercise")]

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(report_module.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        report_module.write_csv(reports, target)
    assert target.read_text() == "old,complete\n" and sorted(p.name for p in tmp_path.iterdir()) == ["grades.csv"]


def test_metadata_decides_over_the_file_name_and_the_report_says_so(cli_run):
    _, out = cli_run
    report = json.loads((out / "json" / "carol.json").read_text())
    assert report["score"] == report["max_score"]
    assert "its file name says 01_cost_anatomy_kv_cache but its metadata says 00_orientation" in report["output"]


# Exercise 07 handed in with one common slip each: (the code cell it is in, by its first words; the text;
# its replacement; the checks that must fail, by name prefix). Every other check must pass.
SLIPS_07 = {
    "strict_slo": ("def meets", 'rung["ttft_p99_s"] <= ttft_slo_s', 'rung["ttft_p99_s"] < ttft_slo_s',
                   {"meets counts a rung exactly", "cheapest on hidden", "cheapest: ties"}),
    "last_of_ties": ("def cheapest", "return min(qualified,", "return min(qualified[::-1],",
                     {"cheapest on hidden", "cheapest: ties"}),
    "no_budget": ("def cheapest", 'memory_budget_bytes is None or r["peak_memory_bytes"] <= memory_budget_bytes',
                  "True", {"cheapest on hidden", "cheapest: ties", "cheapest raises"}),
    "other_message": ("def cheapest", '"no rung', '"nothing', {"cheapest raises"}),
    "per_minute": ("def cost_per_million_tokens", "* 3600", "* 60", {"cost_per_million_tokens on hidden"}),
}


def test_exercise_07_full_marks_zero_and_each_slip_loses_its_checks(tmp_path):
    solution = ROOT / "solutions" / "07_putting_it_together.ipynb"
    shutil.copyfile(solution, tmp_path / "solution.ipynb")
    shutil.copyfile(ROOT / "exercises" / solution.name, tmp_path / "exercise.ipynb")
    for case, (start, old, new, _) in SLIPS_07.items():
        nb = nbformat.read(solution, as_version=4)
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))
        assert old in cell.source, case
        cell.source = cell.source.replace(old, new, 1)
        nbformat.write(nb, tmp_path / f"{case}.ipynb")
    reports = {r.id: r for r in grade([tmp_path], LIMITS, progress=False)}
    assert reports["solution"].score == reports["solution"].max_score == 15
    assert reports["exercise"].score == 0 and reports["exercise"].max_score == 15
    assert all(r.reason.startswith("not implemented") for r in reports["exercise"].results)
    for case, (*_, failing) in SLIPS_07.items():
        failed = {r.name for r in reports[case].results if not r.passed}
        assert {p for p in failing if any(n.startswith(p) for n in failed)} == failing, (case, failed)
        assert all(any(n.startswith(p) for p in failing) for n in failed), (case, failed)
        assert all("\n" not in r.reason for r in reports[case].results)
