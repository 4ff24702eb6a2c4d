"""Lint over the code the notebooks run: what would crash only on a GPU, caught on a CPU.

On a GPU the model and what it computes live on CUDA, and `.numpy()` on a CUDA tensor raises
("can't convert cuda:0 device type tensor to numpy"). Every `.numpy()` in a notebook, exercise or
solution must therefore follow a `.cpu()` (a no-op on a CPU tensor).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))


def code_cells(path: Path) -> list[tuple[int, str]]:
    """(index, source) of each code cell, IPython magics and shell lines blanked so the source parses."""
    cells = json.loads(path.read_text())["cells"]
    return [(i, "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                          for line in "".join(c["source"]).splitlines()))
            for i, c in enumerate(cells) if c["cell_type"] == "code"]


def numpy_without_cpu(source: str) -> list[str]:
    """Each `.numpy()` call whose tensor is not moved by `.cpu()` right before it, as source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy":
            receiver = node.func.value
            moved = (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute)
                     and receiver.func.attr == "cpu")
            if not moved:
                found.append(ast.unparse(node))
    return found


def test_the_lint_flags_numpy_on_a_tensor_that_may_be_on_cuda():
    assert numpy_without_cpu("ax.hist(err.numpy(), bins=120)") == ["err.numpy()"]
    assert numpy_without_cpu("y = model(x)[0].detach().numpy()") == ["model(x)[0].detach().numpy()"]
    assert numpy_without_cpu("ax.hist(err.cpu().numpy())\nz = w.detach().cpu().numpy()") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_notebook_calls_numpy_on_a_tensor_that_may_be_on_cuda(path):
    bad = [f"cell {i}: {call}" for i, source in code_cells(path) for call in numpy_without_cpu(source)]
    assert not bad, f"{path.name}: .numpy() without .cpu() fails on a GPU:\n" + "\n".join(bad)
