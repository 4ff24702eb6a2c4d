"""Triton kernels, each beside its plain-PyTorch reference.

Without CUDA, Triton can still run a kernel in its interpreter, but only if
TRITON_INTERPRET=1 is set before Triton itself is imported: `import infopt_lab`
imports this package first and sets it then, so the same kernels run (slowly) on
a CPU. The interpreter has no bf16 and no autotune: on CPU use fp32/fp16 and
fixed block sizes.
"""
from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
from dataclasses import dataclass, field
from types import ModuleType

from torch import Tensor

from ..device import HAS_CUDA, HAS_TRITON

# Triton reads TRITON_INTERPRET once, when it is imported: set too late, the kernels cannot run on a CPU.
# Whether a GPU exists does not matter here: a CPU tensor on a CUDA machine needs the interpreter too.
INTERPRETER_READY: bool = "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def require_interpreter() -> None:
    """Raise a clear error when a kernel is handed CPU tensors but Triton cannot interpret it here."""
    if not INTERPRETER_READY:
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
                           "on this CPU: `import infopt_lab` before anything that imports triton "
                           "(transformers, torch.compile), or start Python with TRITON_INTERPRET=1")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("these tensors are on the CPU but Triton compiles for the GPU in this process "
                           "(TRITON_INTERPRET is not 1): move them to CUDA with .cuda(), or start Python "
                           "with TRITON_INTERPRET=1 to interpret the kernel on the CPU")


def require_same_device(**tensors: Tensor) -> None:
    """Refuse tensors spread over devices: a kernel reads all of them from where the first one lives."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"every tensor must be on one device, got {devices}")


@dataclass
class Launch:
    """One kernel launch, decided but not run: what a launcher passes, so CI can compile it ahead of time."""

    kernel: object                  # the @triton.jit function
    grid: tuple[int, ...]           # programs along each axis
    args: tuple                     # positional arguments, tensors included
    options: dict = field(default_factory=dict)   # constexprs, num_warps, num_stages
    out: Tensor | None = None       # the tensor the kernel writes, returned by run()

    def run(self) -> Tensor | None:
        """Launch it (compiled on CUDA, interpreted on a CPU); the output tensor."""
        self.kernel[self.grid](*self.args, **self.options)
        return self.out


def kernel_source(module: ModuleType, name: str) -> str:
    """The source of kernel `name` in `module`, decorator included; read from the file, so it needs no Triton."""
    source = inspect.getsource(module)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return textwrap.dedent("\n".join(source.splitlines()[first - 1:node.end_lineno]))
    raise ValueError(f"{module.__name__} defines no function named {name!r}")
