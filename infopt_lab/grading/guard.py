"""Keep the grader's own files as they were: snapshot before grading, restore after each submission.

The checks a run uses are imported before any submission runs, so a submission
that rewrites them on disk changes nothing in that run. The guard makes sure
it changes nothing in the next run either, and says so in the report.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


class FileGuard:
    """Every file under `root` at snapshot time, by content; `restore()` undoes any change since."""

    def __init__(self, root: Path):
        self.root = root
        self.files = {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}
        self.dirs = {p.parent for p in self.files} | {root}

    def restore(self) -> list[str]:
        """Rewrite changed or deleted files, delete new ones; return one note per path touched."""
        notes = [f"added {self.name(p)} to the grader's files; removed it" for p in self.remove_new()]
        for path, data in self.files.items():
            self.ensure_dir(path.parent)
            if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
                continue
            what = "deleted" if not os.path.lexists(path) else "modified"
            remove(path)
            path.write_bytes(data)
            notes.append(f"{what} the grader's file {self.name(path)}; restored it")
        return notes

    def remove_new(self) -> list[Path]:
        """Delete entries that were not there at snapshot time; links are removed, never followed."""
        removed = []
        for top, dirnames, filenames in os.walk(self.root, followlinks=False):
            for name in dirnames + filenames:
                path = Path(top) / name
                if path in self.files or (path in self.dirs and not path.is_symlink()):
                    continue
                remove(path)
                removed.append(path)
            dirnames[:] = [d for d in dirnames if (Path(top) / d) in self.dirs]
        return removed

    def ensure_dir(self, folder: Path) -> None:
        """Make `folder` a real directory again, replacing a file or link put in its place."""
        if folder != self.root:
            self.ensure_dir(folder.parent)
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            remove(folder)
        folder.mkdir(exist_ok=True)

    def name(self, path: Path) -> str:
        """The path relative to the guarded folder's parent, for notes."""
        return path.relative_to(self.root.parent).as_posix()


def remove(path: Path) -> None:
    """Delete a file, a link (not its target) or a folder, if present."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def outside_writes(workroot: Path, own: Path) -> list[str]:
    """Entries in the grader's work folder other than a submission's own, i.e. written outside it."""
    return sorted(p.name for p in workroot.iterdir() if p != own)
