"""Print requirements.txt with every lower bound pinned (`>=X` -> `==X`): the oldest versions the course allows.

CI installs this in a second environment and runs the unit tests there, so each
floor in requirements.txt is a version the tests pass on.
usage: python scripts/lowest_requirements.py [requirements.txt] > floors.txt
"""
import re
import sys
from pathlib import Path

FLOOR = re.compile(r"^(?P<name>[A-Za-z0-9_.\-\[\]]+)\s*>=\s*(?P<version>[^,;\s]+)[^;]*(?P<marker>;.*)?$")


def lowest(lines: list[str]) -> list[str]:
    """Each `name>=X[,<Y][; marker]` line as `name==X[; marker]`; other lines (comments, `-e .`) kept."""
    out = []
    for line in lines:
        match = FLOOR.match(line.strip())
        if match:
            marker = f"; {match['marker'][1:].strip()}" if match["marker"] else ""
            out.append(f"{match['name']}=={match['version']}{marker}")
        elif line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "requirements.txt")
    print("\n".join(lowest(path.read_text(encoding="utf-8").splitlines())))
