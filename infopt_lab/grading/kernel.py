"""A submission's kernel: started fresh under limits, run cell by cell, then called through the protocol.

The kernel is a child process with its own working directory and HOME (the
submission's temporary directory), a file-size cap and a scrubbed environment;
a watchdog in the grader stops it when its resident memory passes the cap
(`watchdog.py`). Its command line is built here, from source read when this
module was imported, so nothing a submission writes to disk changes how the next
kernel starts. Output it prints is capped twice: zmq refuses any message over
`MAX_MESSAGE_BYTES`, and the executor keeps at most `Limits.output_kb` of it.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from time import monotonic

import zmq
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError
from nbformat import NotebookNode
from nbformat.v4 import new_output
from traitlets import Instance, Integer

from .protocol import KernelLost, Raised, TimedOut, describe_call, make_request, parse_reply
from .watchdog import MemoryWatchdog

# Read once, when the grader imports this module, before any submission runs.
LAUNCHER_SOURCE = Path(__file__).with_name("kernel_launcher.py").read_text(encoding="utf-8")
MAX_MESSAGE_BYTES = 4 << 20  # zmq drops (never buffers) any single kernel message larger than this
MAX_QUEUED_MESSAGES = 64  # and queues at most this many unread ones per socket
MAX_KERNEL_STARTS = 20  # first start plus restarts after crashes and hangs, per submission
GRACE_S = 3.0  # how long an interrupted kernel gets to answer again
MIN_MEMORY_MB = 1024  # importing torch alone holds about 300 MB
TIMEOUT_ENAME = "GraderTimeout"
DROPPED = "[grader: further output dropped]"  # also written by the kernel launcher's own cap
PASS_THROUGH_ENV = ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "SYSTEMROOT", "WINDIR", "COMSPEC", "PATHEXT")


class GraderError(RuntimeError):
    """Grading could not run at all (bad arguments, no kernel); not a submission's fault."""


@dataclass(frozen=True)
class Limits:
    """What one submission may use; every field is checked to be positive."""

    cell_timeout: float = 30.0  # seconds one cell may run
    notebook_timeout: float = 300.0  # seconds for starting kernels and running cells, re-runs included
    check_timeout: float = 10.0  # seconds one check (all its calls) may run
    memory_mb: int = 4096  # resident memory of the kernel and its children; past it, they are killed
    output_kb: int = 1024  # printed output kept per submission; the rest is dropped
    file_mb: int = 64  # largest file the kernel may write

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.memory_mb < MIN_MEMORY_MB:
            raise ValueError(f"memory_mb must be at least {MIN_MEMORY_MB} (a kernel that imports torch holds "
                             f"about 300 MB), got {self.memory_mb}")


class SandboxKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel command comes from the grader, never from a kernel spec on disk."""

    sandbox_spec = Instance(KernelSpec)

    @property
    def kernel_spec(self) -> KernelSpec:
        """The grader's fixed spec (the base class would look one up by name)."""
        return self.sandbox_spec

    def client(self, **kwargs):
        """A client on this manager's zmq context, so the context's message limits apply to it."""
        kwargs.setdefault("context", self.context)
        return super().client(**kwargs)


class CappedClient(NotebookClient):
    """nbclient's executor that keeps a bounded amount of output and remembers each cell's reply."""

    max_output_bytes = Integer(1 << 20)

    def __init__(self, nb: NotebookNode, km=None, **kw):
        super().__init__(nb, km=km, **kw)
        self.output_bytes = 0
        self.truncated = False
        self.last_reply: dict | None = None
        self.on_cell_executed = self._remember_reply

    def _remember_reply(self, cell, cell_index, execute_reply) -> None:
        """Keep the execute reply so the session can tell errors and timeouts apart."""
        self.last_reply = execute_reply

    def output(self, outs, msg, display_id, cell_index):
        """Store an output unless the submission has already printed its allowance."""
        content = msg["content"]
        text = content.get("text", "") if msg["msg_type"] == "stream" else json.dumps(content)
        self.output_bytes += len(text)
        self.truncated |= DROPPED in text  # the kernel's own cap already dropped some
        if self.output_bytes <= self.max_output_bytes:
            return super().output(outs, msg, display_id, cell_index)
        if self.output_bytes - len(text) <= self.max_output_bytes:  # the first output over the cap
            self.truncated = True
            outs.append(new_output("stream", name="stderr", text=DROPPED + "\n"))
        return None


def kernel_env(workdir: Path) -> dict[str, str]:
    """A scrubbed environment: HOME and temp dirs inside the submission's directory, one thread, offline."""
    w = str(workdir)
    return {
        "PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8",
        "HOME": w, "USERPROFILE": w, "TMPDIR": w, "TEMP": w, "TMP": w,
        "XDG_CACHE_HOME": str(workdir / ".cache"), "XDG_CONFIG_HOME": str(workdir / ".config"),
        "IPYTHONDIR": str(workdir / ".ipython"), "MPLCONFIGDIR": str(workdir / ".matplotlib"),
        "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2",
        "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        **{k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ},
    }


def sandbox_spec(limits: Limits) -> KernelSpec:
    """The kernel command: this interpreter, isolated mode, the launcher's source inline."""
    argv = [sys.executable, "-I", "-c", LAUNCHER_SOURCE, str(limits.file_mb << 20), str(limits.output_kb << 10),
            "-f", "{connection_file}"]
    return KernelSpec(argv=argv, display_name="infopt-lab grader", language="python", interrupt_mode="signal")


class KernelSession:
    """One submission's kernel: run the notebook, answer calls, restart after a crash or a hang."""

    def __init__(self, nb: NotebookNode, workdir: Path, limits: Limits):
        self.nb, self.workdir, self.limits = nb, workdir, limits
        # zmq.asyncio needs a selector loop; Windows' default (proactor) loop has no add_reader.
        self.loop = asyncio.SelectorEventLoop() if sys.platform == "win32" else asyncio.new_event_loop()
        self.km: SandboxKernelManager | None = None
        self.client: CappedClient | None = None
        self.ctx: zmq.asyncio.Context | None = None
        self.watchdog: MemoryWatchdog | None = None
        self.skip: set[int] = set()  # cells that ended or hung the kernel; left out of re-runs
        self.cell_notes: dict[int, str] = {}  # cell index -> what went wrong there, from the first run
        self.notes: list[str] = []  # restarts and other events, one line each
        self.starts = 0
        self.time_left = limits.notebook_timeout  # for kernel starts and cells, all runs together
        self.healthy = False
        self.output_dropped = False  # whether any run printed past its allowance

    def __enter__(self) -> "KernelSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def execute(self) -> None:
        """Run the notebook's code cells, skipping any that ends or hangs the kernel."""
        self.loop.run_until_complete(self._execute())

    def call(self, name: str, calls: list[tuple], deadline: float) -> list[dict]:
        """Call `name` once per argument tuple; raise a CallError when no answer comes back."""
        return self.loop.run_until_complete(self._call(name, calls, deadline))

    def close(self) -> None:
        """Kill the kernel and release its sockets."""
        if not self.loop.is_closed():
            self.loop.run_until_complete(self._stop())
            self.loop.close()

    async def _start(self) -> None:
        """Start a fresh kernel in the submission's directory."""
        await self._stop()
        if self.starts >= MAX_KERNEL_STARTS or self.time_left < 1:
            raise KernelLost(f"not run: no restart left after {self.starts} kernel starts (at most "
                             f"{MAX_KERNEL_STARTS}, within the notebook's {self.limits.notebook_timeout:g} s)")
        self.starts += 1
        started = monotonic()
        try:
            await self._launch()
        finally:
            self.time_left -= monotonic() - started

    async def _launch(self) -> None:
        """Create the manager and executor, start the kernel and connect to it."""
        self.ctx = zmq.asyncio.Context()
        self.ctx.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.ctx.setsockopt(zmq.RCVHWM, MAX_QUEUED_MESSAGES)
        self.km = SandboxKernelManager(sandbox_spec=sandbox_spec(self.limits), context=self.ctx)
        self.client = CappedClient(
            self.nb, km=self.km, allow_errors=True, interrupt_on_timeout=True, record_timing=False,
            error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": "cell ran over its time limit", "traceback": []},
            startup_timeout=60, iopub_timeout=2, max_output_bytes=self.limits.output_kb << 10,
            extra_arguments=["--HistoryManager.hist_file=:memory:"])
        try:
            await self.client.async_start_new_kernel(
                cwd=str(self.workdir), env=kernel_env(self.workdir),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.watchdog = MemoryWatchdog(self.km.provisioner.process.pid, self.limits.memory_mb << 20).start()
            await self.client.async_start_new_kernel_client()
        except Exception as e:  # the first start fails only when the environment is broken
            reason = f"{type(e).__name__}: {e}"
            if self.starts == 1:
                raise GraderError(f"could not start a Python kernel ({reason}); is ipykernel installed "
                                  f"for {sys.executable}?") from e
            raise KernelLost(f"the kernel could not be restarted ({reason})") from None

    async def _stop(self) -> None:
        """Stop channels, kill the kernel's process group, close the zmq context."""
        if self.client is not None:
            self.output_dropped |= self.client.truncated
            if self.client.kc is not None:
                self.client.kc.stop_channels()
        if self.km is not None and self.km.has_kernel:
            await self.km.shutdown_kernel(now=True)
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        self.km = self.client = self.ctx = self.watchdog = None
        self.healthy = False

    def lost_reason(self) -> str:
        """Why the kernel ended: the memory cap when the watchdog stopped it, else the usual suspects."""
        if self.watchdog is not None and self.watchdog.tripped:
            return f"went over the {self.limits.memory_mb} MB memory cap and was stopped"
        return "ended the kernel (os._exit, a crash)"

    async def _execute(self, first_run: bool = True) -> None:
        """Start a kernel and run all cells; on a lost kernel, skip that cell and run again."""
        while True:
            await self._start()
            lost_at = await self._run_cells(first_run)
            if lost_at is None:
                self.healthy = True
                return
            self.skip.add(lost_at)
            self.notes.append(f"restarted the kernel and re-ran the notebook without cell {lost_at + 1}")

    async def _run_cells(self, record: bool) -> int | None:
        """Run every code cell not skipped; return the index of a cell that lost the kernel, else None."""
        notes = self.cell_notes if record else {}
        for index, cell in enumerate(self.nb.cells):
            if cell.cell_type != "code" or not cell.source.strip() or index in self.skip:
                continue
            if self.time_left < 1:
                notes.setdefault(index, f"not run: the notebook's {self.limits.notebook_timeout:g} s were used up")
                return None
            timeout = max(1, int(min(self.limits.cell_timeout, self.time_left)))
            self.client.timeout, self.client.last_reply = timeout, None
            started = monotonic()
            try:
                await self.client.async_execute_cell(cell, index, execution_count=index + 1)
            except DeadKernelError:
                self.cell_notes.setdefault(index, f"{self.lost_reason()}; it was skipped")
                return index
            except Exception as e:  # zmq or protocol trouble: the kernel is no longer usable
                self.cell_notes.setdefault(index, f"lost the kernel ({type(e).__name__}: {e}); it was skipped")
                return index
            finally:
                self.time_left -= monotonic() - started
            content = (self.client.last_reply or {}).get("content", {})
            if content.get("status") != "error":
                continue
            if content.get("ename") != TIMEOUT_ENAME:
                notes.setdefault(index, self._error_note(content))
            elif await self._responsive():
                notes.setdefault(index, f"ran over the {timeout} s cell time limit and was interrupted")
            else:
                self.cell_notes.setdefault(index, f"ran over the {timeout} s cell time limit and ignored the "
                                                  "interrupt; it was skipped")
                return index
        return None

    def _error_note(self, content: dict) -> str:
        """One line for a cell that raised."""
        ename, evalue = content.get("ename", "Error"), str(content.get("evalue", "")).splitlines()
        text = f"raised {ename}: {evalue[0] if evalue else ''}".rstrip(": ")
        if ename == "MemoryError" or "allocate" in text:
            text += f" (the memory cap is {self.limits.memory_mb} MB)"
        return text[:200]

    async def _responsive(self) -> bool:
        """Whether the kernel answers a kernel_info request within the grace period."""
        try:
            msg_id = self.client.kc.kernel_info()
            return await self._reply(msg_id, monotonic() + GRACE_S) is not None
        except KernelLost:
            return False

    async def _reply(self, msg_id: str, deadline: float) -> dict | None:
        """Wait for the shell reply to `msg_id`, draining output meanwhile; None at the deadline."""
        kc = self.client.kc
        while (remaining := deadline - monotonic()) > 0:
            try:
                msg = await kc.get_shell_msg(timeout=min(0.2, remaining))
            except Empty:
                await self._drain_output()
                if not await self.km.is_alive():
                    raise KernelLost("the kernel died") from None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
        return None

    async def _drain_output(self) -> None:
        """Read and discard pending output messages, so none pile up while checks run."""
        for _ in range(10 * MAX_QUEUED_MESSAGES):
            try:
                await self.client.kc.get_iopub_msg(timeout=0)
            except Empty:
                return

    async def _revive(self) -> None:
        """Replace a hung or dead kernel: start again and re-run the notebook."""
        await self._execute(first_run=False)
        self.notes.append("restarted the kernel and re-ran the notebook after a check hung or ended it")

    async def _call(self, name: str, calls: list[tuple], deadline: float) -> list[dict]:
        """Send one batch of calls; interrupt it at the deadline."""
        if not self.healthy:
            started = monotonic()
            await self._revive()
            deadline += monotonic() - started  # a restart does not count against the check
        what = describe_call(name, calls[0]) if len(calls) == 1 else f"{name} ({len(calls)} calls)"
        request = make_request(name, calls)
        msg_id = self.client.kc.execute(request.code, silent=True, store_history=False,
                                        user_expressions={"r": request.expression}, stop_on_error=False)
        try:
            reply = await self._reply(msg_id, deadline)
            if reply is None:
                await self.km.interrupt_kernel()
                if await self._reply(msg_id, monotonic() + GRACE_S) is None:
                    self.healthy = False
                raise TimedOut(f"{what} ran past the check's {self.limits.check_timeout:g} s time limit")
        except KernelLost:
            self.healthy = False
            why = " (it went over the memory cap)" if self.watchdog and self.watchdog.tripped else ""
            raise KernelLost(f"the kernel died while running {what}{why}") from None
        content = reply["content"]
        if content.get("status") != "ok":
            ename = content.get("ename", "Error")
            raise Raised(f"{what} raised {ename}: {content.get('evalue', '')}"[:200], ename)
        return parse_reply(content, name, len(calls))
