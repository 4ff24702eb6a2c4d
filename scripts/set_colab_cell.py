"""Write scripts/colab_setup_cell.py into the Colab set-up cell (the second cell) of every notebook.

Lecture notebooks, solutions and exercises all open with the same set-up cell; this keeps them one text.
Only the cell's source changes: its id, metadata and outputs stay, and no notebook is executed.
Usage: python scripts/set_colab_cell.py
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CELL = ROOT / "scripts" / "colab_setup_cell.py"
FOLDERS = ("notebooks", "solutions", "exercises")


def notebooks() -> list[Path]:
    """Every notebook that carries the set-up cell."""
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.ipynb"))]


def set_cell(path: Path, source: str) -> bool:
    """Put `source` into the notebook's set-up cell; whether the file changed."""
    text = path.read_text()
    nb = json.loads(text)
    cell = nb["cells"][1]
    if cell["cell_type"] != "code" or "google.colab" not in "".join(cell["source"]):
        raise ValueError(f"{path}: its second cell is not the Colab set-up cell")
    cell["source"] = source.splitlines(keepends=True)
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if new != text:
        path.write_text(new)
    return new != text


def main() -> None:
    source = CELL.read_text().rstrip("\n")
    changed = [p.relative_to(ROOT).as_posix() for p in notebooks() if set_cell(p, source)]
    print(f"set-up cell written into {len(changed)} notebooks" + "".join(f"\n  {c}" for c in changed))


if __name__ == "__main__":
    main()
