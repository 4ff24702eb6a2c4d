"""Run the course's grading subcommands (assign, grade) in-process, as the command line would."""
import argparse

from infopt_lab.grading.cli import add_subcommands


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
