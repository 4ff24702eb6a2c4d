"""`infopt-lab assign` and `infopt-lab grade`, registered on the main parser by `add_subcommands`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_assign(args) -> int:
    from .assign import assign, check
    try:
        if args.check:
            problems = check(args.solutions, args.exercises)
            for problem in problems:
                print(problem, file=sys.stderr)
            if not problems:
                print(f"{args.exercises}/ matches {args.solutions}/")
            return 1 if problems else 0
        for path in assign(args.solutions, args.exercises):
            print(f"wrote {path}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_grade(args) -> int:
    from .grade import collect, grade
    from .kernel import GraderError, Limits
    from .report import check_output_paths, write_csv, write_json
    try:
        limits = Limits(cell_timeout=args.timeout, notebook_timeout=args.notebook_timeout,
                        check_timeout=args.check_timeout, memory_mb=args.memory_mb)
        submissions = collect(args.paths)
        check_output_paths(args.csv, args.json, [s.path for s in submissions] + list(args.paths), len(submissions))
        reports = grade(args.paths, limits, exercise=args.exercise, progress=not args.quiet)
    except (GraderError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if sys.platform == "win32":
        print("warning: the file-size cap does not apply on Windows", file=sys.stderr)
    if not reports:
        print("no notebooks found under " + " ".join(map(str, args.paths)), file=sys.stderr)
    for report in reports:
        print(report.summary(verbose=not args.quiet))
    if args.json:
        targets = write_json(reports, args.json)
        print(f"wrote {len(targets)} JSON report(s) to {args.json}")
    if args.csv:
        write_csv(reports, args.csv)
        print(f"wrote {args.csv} ({len(reports)} rows)")
    errors = [r.id for r in reports if r.error]
    if errors:
        print(f"error: {len(errors)} submission(s) could not be graded: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register `assign` and `grade` on the `infopt-lab` subcommand parser."""
    p = sub.add_parser("assign", help="write exercises/ from solutions/; --check fails if exercises/ is stale")
    p.add_argument("--solutions", type=Path, default=Path("solutions"), help="solution notebooks (default: solutions)")
    p.add_argument("--exercises", type=Path, default=Path("exercises"), help="exercise notebooks (default: exercises)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale exercise")
    p.set_defaults(func=_cmd_assign)

    p = sub.add_parser("grade", help="run submitted exercise notebooks and score them")
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="a notebook, or a folder of them (one per student; the file or folder name is the id)")
    p.add_argument("--json", type=Path, help="Gradescope results JSON: a file for one submission, else a folder")
    p.add_argument("--csv", type=Path, help="class CSV: one row per submission (id, each check, total, max)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="time limit per cell (default 30)")
    p.add_argument("--notebook-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="time limit for all cells and kernel starts of one submission, re-runs included "
                        "(default 300)")
    p.add_argument("--check-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="time limit per check (default 10)")
    p.add_argument("--memory-mb", type=int, default=4096, help="resident memory cap of a submission's kernel and its child processes, in MB (default 4096)")
    p.add_argument("--exercise", help="grade every notebook as this exercise, e.g. 00_orientation")
    p.add_argument("--quiet", action="store_true", help="print totals only, no progress bar")
    p.set_defaults(func=_cmd_grade)
