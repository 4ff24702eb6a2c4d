"""The Colab set-up cell: one text in every notebook, the repository named once, and safe to run again.

The cell runs twice against a local clone of this repository standing in for GitHub, installing into a
throwaway virtual environment (never the test run's own): first a fresh set-up, then, after the
"remote" moved on, two runs in one new process (a restarted runtime, then the cell run again).
"""
from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from set_colab_cell import CELL, notebooks  # noqa: E402

SOURCE = CELL.read_text().rstrip("\n")


def _git(*args, cwd=None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_every_notebook_carries_the_cell_and_the_cell_names_the_repository_of_pyproject():
    cells = {p.name: "".join(json.loads(p.read_text())["cells"][1]["source"]) for p in notebooks()}
    assert len(cells) >= 8 and all(c == SOURCE for c in cells.values())
    repository = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    assert re.findall(r'"(https://\S+)"', SOURCE) == [repository]      # the fallback, before anything is installed


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A throwaway environment that receives the install. It has no pip of its own: pip and the build
    backend are read from the test run's environment (a .pth line, read-only), so no network is needed."""
    path = tmp_path_factory.mktemp("colab") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    Path(own, "test_run_tools.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _run_cell(python: Path, env: dict, cwd: Path, times: int = 1) -> subprocess.CompletedProcess:
    code = f"source = {SOURCE!r}\n" + "exec(compile(source, 'setup-cell', 'exec'), {})\n" * times
    return subprocess.run([str(python), "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def _offline_editable_build() -> str | None:
    """Why this environment's setuptools cannot build an editable install without the network, or None."""
    import importlib.util

    import setuptools
    version = tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < (70, 1) and importlib.util.find_spec("wheel") is None:
        return (f"setuptools {setuptools.__version__} builds editable installs only with the wheel package "
                "(built in from 70.1), and this environment has neither")
    return None


@pytest.mark.skipif(sys.platform == "win32", reason="the cell runs on Colab (Linux)")
@pytest.mark.skipif(_offline_editable_build() is not None, reason=str(_offline_editable_build()))
def test_the_cell_sets_up_then_updates_on_every_run(tmp_path, venv):
    remote = tmp_path / "remote"
    _git("clone", "-q", str(ROOT), str(remote))                          # this repository, as GitHub
    course = tmp_path / "content" / "infopt-lab"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFOPT_LAB_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(INFOPT_LAB_DIR=str(course), INFOPT_LAB_PIP=f"{venv} -m pip install -q --no-deps --no-build-isolation",
               PIP_NO_INDEX="1", GIT_TERMINAL_PROMPT="0")
    first = _run_cell(venv, {**env, "INFOPT_LAB_REPO": remote.as_uri()}, tmp_path)
    assert first.returncode == 0, first.stderr
    assert _git("rev-parse", "HEAD", cwd=course) == _git("rev-parse", "HEAD", cwd=remote)
    where = subprocess.run([str(venv), "-c", "import importlib.metadata as m, importlib.util as u; "
                            "print(u.find_spec('infopt_lab').origin); print(m.metadata('infopt-lab').get_all('Project-URL'))"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(course / "infopt_lab")) and "Repository, https://" in where

    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "moved on", cwd=remote)
    again = _run_cell(venv, env, tmp_path, times=2)                                 # a restart, then the cell run again
    assert again.returncode == 0, again.stderr
    assert "already exists" not in again.stderr
    assert _git("rev-parse", "HEAD", cwd=course) == _git("rev-parse", "HEAD", cwd=remote)
