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
from types import ModuleType

from ..device import HAS_CUDA, HAS_TRITON

# Triton reads TRITON_INTERPRET once, when it is imported: set too late, the kernels cannot run on a CPU.
INTERPRETER_READY: bool = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def require_interpreter() -> None:
    """Raise a clear error when Triton was imported on a CPU machine before TRITON_INTERPRET=1 was set."""
    if not INTERPRETER_READY:
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
                           "on this CPU: `import infopt_lab` before anything that imports triton "
                           "(transformers, torch.compile), or start Python with TRITON_INTERPRET=1")


def kernel_source(module: ModuleType, name: str) -> str:
    """The source of kernel `name` in `module`, decorator included; read from the file, so it needs no Triton."""
    source = inspect.getsource(module)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return textwrap.dedent("\n".join(source.splitlines()[first - 1:node.end_lineno]))
    raise ValueError(f"{module.__name__} defines no function named {name!r}")
