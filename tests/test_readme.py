"""README.md's figures agree with the committed notebook outputs (scripts/readme_figures.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


rf = _load_script()


def _write_notebook(root: Path, printed: str) -> None:
    """notebooks/01_demo.ipynb with one code cell that printed `printed`."""
    cell = nbformat.v4.new_code_cell("speedup = measure()\nprint(speedup)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
    (root / "notebooks").mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), root / "notebooks" / "01_demo.ipynb")


def test_readme_figures_match_the_notebooks():
    assert rf.check(ROOT / "README.md") == []


def test_rewrite_replaces_a_markers_value(tmp_path):
    _write_notebook(tmp_path, "the cache is 18.8x faster\n")
    figures = {"kv_speedup": rf.Source("01", "speedup = measure()", r"the cache is ([\d.]+x) faster")}
    readme = tmp_path / "README.md"
    readme.write_text("| 01 | <!-- fig:kv_speedup -->20.5x<!-- /fig --> faster |\n")
    drift = rf.check(readme, figures, tmp_path)
    assert len(drift) == 1 and "'20.5x'" in drift[0] and "'18.8x'" in drift[0] and "01_demo.ipynb" in drift[0]
    found = rf.source_values(figures, tmp_path)
    assert rf.rewrite(readme.read_text(), found) == "| 01 | <!-- fig:kv_speedup -->18.8x<!-- /fig --> faster |\n"


@pytest.mark.parametrize("source, reason", [
    (rf.Source("01", "no such cell", r"(\d+)"), "is in 0 code cells"),
    (rf.Source("01", "speedup = measure()", r"tokens/s: (\d+)"), "matches nothing"),
    (rf.Source("02", "speedup = measure()", r"(\d+)"), "found 0"),
])
def test_a_missing_source_is_an_error_naming_the_figure(tmp_path, source, reason):
    _write_notebook(tmp_path, "the cache is 18.8x faster\n")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- fig:kv_speedup -->18.8x<!-- /fig -->\n")
    with pytest.raises(rf.FigureError, match=rf"kv_speedup: .*{reason}"):
        rf.check(readme, {"kv_speedup": source}, tmp_path)


def test_a_marker_without_a_figure_is_an_error(tmp_path):
    _write_notebook(tmp_path, "the cache is 18.8x faster\n")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- fig:typo -->18.8x<!-- /fig -->\n")
    figures = {"kv_speedup": rf.Source("01", "speedup = measure()", r"the cache is ([\d.]+x) faster")}
    with pytest.raises(rf.FigureError, match=r"no source: \['typo'\].*no README marker: \['kv_speedup'\]"):
        rf.check(readme, figures, tmp_path)
