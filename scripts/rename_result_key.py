"""Rename a key of the committed ladder's rungs, in the JSON and in every source that reads it.

    python scripts/rename_result_key.py tokens_per_s throughput_tok_s
    python scripts/rename_result_key.py tokens_per_s throughput_tok_s --check    # change nothing; exit 1 if stale

Rewrites each rung of every committed ladder, infopt_lab/assets/results/ladder_*.json (the key renamed in
place, its order kept), and, as a whole word, the READERS: the notebooks, grader check and test that read
those rungs' keys. In a notebook only the cells' sources change: the outputs are what ran, and they print
values, not keys.
The package's own readers (infopt_lab/bench/, widgets.py) are renamed with the field, not by this script.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "infopt_lab" / "assets" / "results"
READERS = ("notebooks/07_putting_it_together.ipynb", "solutions/07_putting_it_together.ipynb",
           "exercises/07_putting_it_together.ipynb", "infopt_lab/grading/checks/07_putting_it_together.py",
           "tests/test_ladder.py")
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def renamed_json(text: str, old: str, new: str) -> str:
    """A committed ladder JSON with `old` renamed to `new` in each rung, written as `ladder_command` writes it."""
    data = json.loads(text)
    if new in {k for r in data["rungs"] for k in r}:
        raise ValueError(f"the rungs already have a key {new!r}")
    data["rungs"] = [{new if k == old else k: v for k, v in r.items()} for r in data["rungs"]]
    return json.dumps(data, indent=1) + "\n"


def renamed_source(text: str, old: str, new: str, notebook: bool) -> str:
    """`old` replaced by `new` as a whole word: everywhere in a source file, in cell sources in a notebook."""
    word = re.compile(rf"\b{re.escape(old)}\b")
    if not notebook:
        return word.sub(new, text)
    nb = json.loads(text)
    for cell in nb["cells"]:
        source = cell["source"]
        cell["source"] = [word.sub(new, line) for line in source] if isinstance(source, list) else word.sub(new, source)
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def rewrites(old: str, new: str) -> dict[Path, str]:
    """Every file this rename changes, with its new text."""
    out = {}
    for path in sorted(RESULTS.glob("ladder_*.json")):
        text = path.read_text(encoding="utf-8")
        if old in {k for r in json.loads(text)["rungs"] for k in r}:
            out[path] = renamed_json(text, old, new)
    for name in READERS:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        new_text = renamed_source(text, old, new, path.suffix == ".ipynb")
        if new_text != text:
            out[path] = new_text
    return out


def main(argv: list[str] | None = None) -> int:
    """Rename, or with --check list what still holds the old key."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="the key the rungs have now")
    parser.add_argument("new", help="the key they should have")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file still holds OLD")
    args = parser.parse_args(argv)
    for key in (args.old, args.new):
        if not KEY.fullmatch(key):
            parser.error(f"a key must be a Python identifier, got {key!r}")
    changes = rewrites(args.old, args.new)
    for path, text in changes.items():
        if not args.check:
            path.write_text(text, encoding="utf-8")
        print(f"{'stale' if args.check else 'rewrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and changes else 0


if __name__ == "__main__":
    sys.exit(main())
