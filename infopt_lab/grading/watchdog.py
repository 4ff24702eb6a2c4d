"""The submission memory cap: a watchdog on the resident memory of a kernel's process tree.

An address-space cap (RLIMIT_AS) counts memory a process only reserves: the
CUDA build of torch maps gigabytes of libraries and a CUDA context reserves far
more, so under any sensible cap `import torch` fails. What a kernel really uses
is its resident memory. A thread in the grader (outside the submission's reach)
reads it for the kernel and every process it started, every `interval` seconds,
and kills the whole tree once the total passes the cap; the session then reports
that the cap was hit. On Linux it counts anonymous and shared-memory pages
(`RssAnon + RssShmem`), leaving out library code that is mapped from disk and
shared with every other Python; elsewhere psutil's RSS.
"""
from __future__ import annotations

import sys
import threading

import psutil

INTERVAL_S = 0.02  # a process that fills memory at 5 GB/s overshoots the cap by about 100 MB
RESCAN_EVERY = 10  # look for new child processes every this many readings (a scan reads all of /proc)


def used_bytes(proc: psutil.Process) -> int:
    """Memory that one process really holds (see the module docstring); 0 once it is gone."""
    try:
        if sys.platform.startswith("linux"):
            fields = {}
            with open(f"/proc/{proc.pid}/status", "rb") as f:
                for line in f:
                    if line.startswith((b"RssAnon:", b"RssShmem:")):
                        fields[line.split(b":")[0]] = int(line.split()[1]) << 10  # kB
            return sum(fields.values())
        return proc.memory_info().rss
    except (OSError, psutil.Error):
        return 0


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants that still exist."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def kill_tree(pid: int) -> None:
    """SIGKILL the process and its descendants, all found before any is killed so none escapes.

    Not reaped here: the process's parent (the kernel manager) collects its exit status.
    """
    for proc in tree(pid):
        try:
            proc.kill()
        except psutil.Error:
            pass


class MemoryWatchdog:
    """Kill a process tree whose resident memory passes `limit_bytes`; `tripped` says whether it did."""

    def __init__(self, pid: int, limit_bytes: int, interval: float = INTERVAL_S):
        self.pid, self.limit_bytes, self.interval = pid, limit_bytes, interval
        self.tripped = False
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"memory-watchdog-{pid}", daemon=True)

    def start(self) -> "MemoryWatchdog":
        """Begin watching; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the process is left alone)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        procs: list[psutil.Process] = []
        for reading in range(sys.maxsize):
            if self._stop.is_set() or not psutil.pid_exists(self.pid):
                return
            if reading % RESCAN_EVERY == 0:
                procs = tree(self.pid)
            used = sum(used_bytes(p) for p in procs)
            self.peak_bytes = max(self.peak_bytes, used)
            if used > self.limit_bytes:
                self.tripped = True
                kill_tree(self.pid)
                return
            self._stop.wait(self.interval)
