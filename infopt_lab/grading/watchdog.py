"""The submission memory cap: a watchdog on the resident memory of a kernel's process tree.

An address-space cap (RLIMIT_AS) counts memory a process only reserves: the
CUDA build of torch maps gigabytes of libraries and a CUDA context reserves far
more, so under any sensible cap `import torch` fails. What a kernel really uses
is its resident memory. A thread in the grader (outside the submission's reach)
reads it for the kernel and every process it started, every `interval` seconds,
and kills the whole tree once the total passes the cap; the session then reports
that the cap was hit. On Linux it counts anonymous and shared-memory pages
(`RssAnon + RssShmem`), leaving out library code that is mapped from disk and
shared with every other Python; elsewhere psutil's RSS. Where a GPU is present, the
memory each process of the tree holds on it (nvidia-smi, read at every rescan) counts too.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Callable

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


def gpu_bytes_by_pid() -> dict[int, int]:
    """GPU memory each process holds, summed over GPUs, as nvidia-smi reports it; empty without a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    used: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0) + (int(mib) << 20)
    return used


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

    def __init__(self, pid: int, limit_bytes: int, interval: float = INTERVAL_S,
                 gpu_reader: Callable[[], dict[int, int]] = gpu_bytes_by_pid):
        self.pid, self.limit_bytes, self.interval = pid, limit_bytes, interval
        self.gpu_reader = gpu_reader          # process id -> bytes on the GPU, read at every rescan
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
        on_gpu = 0
        for reading in range(sys.maxsize):
            if self._stop.is_set() or not psutil.pid_exists(self.pid):
                return
            if reading % RESCAN_EVERY == 0:
                procs = tree(self.pid)
                gpu = self.gpu_reader()
                on_gpu = sum(gpu.get(p.pid, 0) for p in procs)
            used = sum(used_bytes(p) for p in procs) + on_gpu
            self.peak_bytes = max(self.peak_bytes, used)
            if used > self.limit_bytes:
                self.tripped = True
                kill_tree(self.pid)
                return
            self._stop.wait(self.interval)
