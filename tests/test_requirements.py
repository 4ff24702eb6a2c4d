"""The install path: requirements.txt and pyproject.toml allow the same versions, and the floors CI tests are real."""
from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lowest_requirements", ROOT / "scripts" / "lowest_requirements.py")
lowest_requirements = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowest_requirements)


def specifiers(lines: list[str]) -> dict[str, str]:
    """name -> version specifier and marker, spaces and quote style ignored."""
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        match = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", line)
        if match and not line.startswith("-"):
            out[match[1].lower()] = re.sub(r"\s+", "", match[2]).replace("'", '"')
    return out


def test_package_dependencies_match_requirements():
    """Every dependency of the package is in requirements.txt with the same bounds (which adds the test tools)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    required = specifiers((ROOT / "requirements.txt").read_text().splitlines())
    for name, spec in specifiers(project).items():
        assert required.get(name) == spec, f"{name}: pyproject {spec!r}, requirements.txt {required.get(name)!r}"


def test_every_requirement_has_a_floor_and_the_floors_file_pins_each():
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    required = specifiers(lines)
    pinned = specifiers(lowest_requirements.lowest(lines))
    assert set(pinned) == set(required)
    for name, spec in required.items():
        floor = re.search(r">=([^,;]+)", spec)
        assert floor, f"{name} has no lower bound in requirements.txt"
        assert pinned[name].startswith(f"=={floor[1]}"), (name, pinned[name])
        assert pinned[name].partition(";")[2] == spec.partition(";")[2], f"{name}: marker lost"


def test_lowest_keeps_markers_and_other_lines():
    got = lowest_requirements.lowest(["# comment", "torch>=2.6,<3", 'triton>=3.2; sys_platform == "linux"', "-e ."])
    assert got == ["torch==2.6", 'triton==3.2; sys_platform == "linux"', "-e ."]
