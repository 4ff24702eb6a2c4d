"""Compile the package's kernels ahead of time for GPUs this machine does not have, and read what they need.

No GPU has to be present: `triton.compile` lowers a kernel for any target (`GPUTarget("cuda", 75, 32)`
for a T4), ptxas ships in the Triton wheel, and `cuobjdump` (shipped beside it) reads each compiled
kernel's registers and stack. Each configuration goes through its real launcher (`plan_*`), which
decides the grid, constexprs, warps and stages as it would on that GPU; only the launch is skipped.

Triton's interpreter replaces @triton.jit functions, so this runs with TRITON_INTERPRET=0, in a
process of its own: `python -m infopt_lab.kernels.aot` prints one JSON line per configuration.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from ..device import HAS_TRITON, default_dtype, supported_dtypes
from . import Launch
from .targets import TARGETS, shared_per_block

HEAD_DIMS = (32, 64, 128)         # the head dims FlashAttention is compiled for (the kernel takes 16..128)


@dataclass
class Compiled:
    """What one configuration needs on one target, and whether that fits."""

    kernel: str                   # the launcher's name
    target: str                   # "sm_80 (A100)"
    dtype: str                    # "float16"
    shape: str                    # what else varies (head dim, tiles)
    shared: int = 0               # bytes of shared memory per block
    shared_limit: int = 0         # what the target allows one block
    registers: int = 0            # per thread
    spilled: int = 0              # stack bytes per thread: registers spilled to local memory
    error: str = ""               # compile failure, or why it does not fit

    @property
    def ok(self) -> bool:
        return not self.error


def configurations(cap: tuple[int, int]) -> list[tuple[str, str, torch.dtype, Launch]]:
    """(kernel, shape, dtype, launch) for every kernel in every dtype that `cap` runs, from the real launchers."""
    from .flash_attention import plan_flash_attention
    from .int4_matmul import plan_int4_matmul
    from .paged_attention import plan_paged_decode
    from .softmax import plan_softmax
    out = []
    for dtype in supported_dtypes(cap):
        def t(*shape):
            return torch.zeros(*shape, dtype=dtype)
        for D in HEAD_DIMS:                                   # GQA 4/2 heads, causal: what the models run
            out.append(("flash_attention", f"D={D}", dtype, plan_flash_attention(t(1, 4, 256, D), t(1, 2, 256, D),
                                                                                 t(1, 2, 256, D), True, cap)))
        tables, lens = torch.zeros(2, 8, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32)
        out.append(("paged_decode", "D=64 block=16", dtype,
                    plan_paged_decode(t(2, 4, 64), t(32, 16, 2, 64), t(32, 16, 2, 64), tables, lens, cap)))
        out.append(("softmax", "block=16", dtype, plan_softmax(t(8, 100), 16, False, cap)))
        packed = torch.zeros(96, 64, dtype=torch.uint8)
        out.append(("int4_matmul", "64x128 @ 128x96, G=32", dtype,
                    plan_int4_matmul(t(64, 128), packed, t(96, 4), torch.zeros(96, 4, dtype=torch.uint8), cap)))
    return out


def compile_launch(launch: Launch, cap: tuple[int, int]):
    """Compile one launch for capability `cap` exactly as the JIT would specialize it; the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    fn = launch.kernel
    target = GPUTarget("cuda", cap[0] * 10 + cap[1], 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.options, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def registers_and_stack(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and stack bytes per thread of a cubin's kernel, read by cuobjdump.

    These kernels call no functions and keep no local arrays, so any stack is registers spilled.
    """
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no register count:\n{usage}")
    return int(match[1]), int(match[2])


def check(kernel: str, shape: str, dtype: torch.dtype, launch: Launch, cap: tuple[int, int]) -> Compiled:
    """Compile one configuration for `cap` and say whether it fits: shared memory, registers, no spills."""
    name = f"sm_{cap[0]}{cap[1]}" + (f" ({TARGETS[cap]})" if cap in TARGETS else "")
    c = Compiled(kernel, name, str(dtype).removeprefix("torch."), shape, shared_limit=shared_per_block(cap))
    try:
        compiled = compile_launch(launch, cap)
    except Exception as e:                      # a compile error is this configuration's result, not a crash
        c.error = f"does not compile: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return c
    c.shared = compiled.metadata.shared
    c.registers, c.spilled = registers_and_stack(compiled.asm["cubin"])
    if c.shared > c.shared_limit:
        c.error = f"needs {c.shared / 1024:.1f} KB of shared memory, {c.shared_limit / 1024:.0f} KB allowed"
    elif c.spilled:
        c.error = f"spills {c.spilled} bytes per thread ({c.registers} registers)"
    return c


def aot_unavailable() -> str | None:
    """Why this machine's Triton cannot compile ahead of time for other GPUs (too old, no NVIDIA backend), or None."""
    if not HAS_TRITON:
        return "Triton is not installed"
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
        triton.knobs.nvidia.cuobjdump.path
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this Triton ({getattr(triton, '__version__', '?')}) lacks the ahead-of-time API used here: {e}"
    return None


def attention_configurations(D: int) -> list[tuple[tuple[int, int], str, torch.dtype, Launch]]:
    """Per target, FlashAttention at head dim D in the dtype that target computes in (device.default_dtype)."""
    from .flash_attention import plan_flash_attention
    out = []
    for cap in TARGETS:
        dtype = default_dtype("cuda", cap)
        q, kv = torch.zeros(1, 4, 256, D, dtype=dtype), torch.zeros(1, 2, 256, D, dtype=dtype)
        launch = plan_flash_attention(q, kv, kv, True, cap)
        o = launch.options
        shape = f"D={D}, tiles {o['BLOCK_M']}x{o['BLOCK_N']}, {o['num_warps']} warps, {o['num_stages']} stages"
        out.append((cap, shape, dtype, launch))
    return out


def main(argv: list[str]) -> None:
    """Print one JSON line per configuration: every kernel on the targets given (75 80 ...; default all four),
    or with `--attention D`, the FlashAttention tiles each target gets at head dim D."""
    if argv[:1] == ["--attention"]:
        for cap, shape, dtype, launch in attention_configurations(int(argv[1])):
            print(json.dumps(asdict(check("flash_attention", shape, dtype, launch, cap))), flush=True)
        return
    for cap in [(int(a) // 10, int(a) % 10) for a in argv] or list(TARGETS):
        for kernel, shape, dtype, launch in configurations(cap):
            print(json.dumps(asdict(check(kernel, shape, dtype, launch, cap))), flush=True)


def run_subprocess(args: list[str] | None = None, timeout: float = 1800) -> list[Compiled]:
    """Run `main` in a fresh process with the interpreter off; the configurations it compiled."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-m", "infopt_lab.kernels.aot", *(args or [])],
                         env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"the ahead-of-time compile failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return [Compiled(**json.loads(line)) for line in out.stdout.splitlines() if line.startswith("{")]


def attention_table(D: int = 128) -> list[str]:
    """One line per target: the FlashAttention tiles chosen at head dim D, their shared memory and registers."""
    why = aot_unavailable()
    if why is not None:
        return [f"not compiled ahead of time here: {why}"]
    return [f"{c.target}, {c.dtype}, {c.shape}: {c.shared / 1024:.1f} of {c.shared_limit / 1024:.0f} KB shared, "
            f"{c.registers} registers" + (f" -- {c.error}" if c.error else "")
            for c in run_subprocess(["--attention", str(D)])]


if __name__ == "__main__":
    main(sys.argv[1:])
