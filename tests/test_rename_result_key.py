"""scripts/rename_result_key.py: the committed rungs' key renamed in place, readers' sources renamed, outputs kept."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("rename_result_key", ROOT / "scripts" / "rename_result_key.py")
rk = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = rk
spec.loader.exec_module(rk)


def test_the_json_keeps_the_key_order_and_refuses_a_key_it_has():
    text = json.dumps({"rungs": [{"name": "a", "old": 1.0, "x": 2}], "model": "m"}, indent=1) + "\n"
    out = rk.renamed_json(text, "old", "new")
    assert list(json.loads(out)["rungs"][0]) == ["name", "new", "x"] and json.loads(out)["model"] == "m"
    with pytest.raises(ValueError, match="already have a key 'x'"):
        rk.renamed_json(text, "old", "x")


def test_a_notebook_changes_in_its_sources_only_and_as_whole_words():
    cell = nbformat.v4.new_code_cell("r['old'] + r['old_estimate']\nprint(old)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="old\n")]
    text = json.dumps(nbformat.v4.new_notebook(cells=[cell]), indent=1, ensure_ascii=False) + "\n"
    nb = json.loads(rk.renamed_source(text, "old", "new", notebook=True))
    assert "".join(nb["cells"][0]["source"]) == "r['new'] + r['old_estimate']\nprint(new)"
    assert nb["cells"][0]["outputs"][0]["text"] == "old\n"


def test_nothing_in_the_repository_reads_the_old_key():
    assert rk.rewrites("tokens_per_s", "throughput_tok_s") == {}
