"""`infopt-lab serve` in a subprocess, as a user would run it: started on a free port, waited for, always stopped."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def launch(model: str = "target", host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 180.0,
           log: str | None = None, **knobs) -> Iterator[str]:
    """Run `infopt-lab serve --model MODEL` (knobs: its flags, `max_batch_size=4` -> `--max-batch-size 4`,
    True -> a bare flag) until the block ends; its base URL once /health answers. SIGTERM, then kill, on exit."""
    port = port or free_port(host)
    args = [sys.executable, "-m", "infopt_lab.cli", "serve", "--model", model, "--host", host, "--port", str(port)]
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [] if value is False or value is None else [flag, str(value)]
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}: {' '.join(args)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s: {' '.join(args)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
