"""The hand-written CPU kernel of kernels/q8_dot.c: built at first use, called by eager and compiled steps.

`available()` says whether it runs here, and `why_not()` why not: it needs an x86 CPU with AVX2 and a C
compiler (`cc`, or $CC). The library is built once per source and CPU into the course's cache
(`hub.cache_root() / "kernels"`), in about a second, linked to the OpenMP runtime PyTorch already loaded
so the two share one pool of threads, and loaded with ctypes. `q4_linear` and `q8w_linear` compute x @ W^T
in fp32 from a layer's own buffers.

A compiled step calls them as operators. Where a C++ compiler (`c++`, or $CXX) builds kernels/q8_ops.cpp
against PyTorch's headers (about ten seconds, once), they are `infopt::q4_linear_native` and
`infopt::q8w_linear_native`, C++ kernels the dispatcher calls directly; elsewhere `infopt::q4_linear` and
`infopt::q8w_linear`, registered from Python, which cost tens of microseconds more a call.
`native_why_not()` says why the C++ operators are not in use. The same build registers
`infopt::one_query_attention` (kernels/attention.c), a compiled CPU step's attention for one new token.

This module depends on nothing else in the package but device.py (the CPU's flags), so that compiled.py can
read whether the operators are loaded; the kernel as a path a quantized layer computes with is q8_path.py's.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from .device import cpu_flags


SOURCE = Path(__file__).parent / "kernels" / "q8_dot.c"
NATIVE_SOURCE = Path(__file__).parent / "kernels" / "q8_ops.cpp"
ATTENTION_SOURCE = Path(__file__).parent / "kernels" / "attention.c"   # linked into the C++ operators only
BLOCK = 32                     # activations per quantization block: K and the int4 group size are multiples of it
C_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC")
FLAGS = (*C_FLAGS, "-shared")
CXX_FLAGS = ("-O2", "-std=c++20", "-fPIC", "-shared")   # PyTorch's recent headers need C++20


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cxx_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _openmp_flags() -> list[str]:
    """Link to PyTorch's own libgomp where it ships one, so one OpenMP runtime serves both."""
    torch_lib = Path(torch.__file__).parent / "lib"
    gomp = torch_lib / "libgomp.so.1"
    if gomp.exists():
        return ["-fopenmp", f"-L{torch_lib}", "-l:libgomp.so.1", f"-Wl,-rpath,{torch_lib}"]
    return ["-fopenmp"]


def _library_path(cc: str, cxx: str | None = None) -> Path:
    """Where the build of this source, compiler, CPU and torch lives: q8_dot-KEY.so, or q8_ops-KEY.so with cxx."""
    from .hub import cache_root
    sources = SOURCE.read_bytes() + (NATIVE_SOURCE.read_bytes() + ATTENTION_SOURCE.read_bytes() if cxx else b"")
    flags = (cc, *FLAGS, *((cxx, *CXX_FLAGS) if cxx else ()), *sorted(cpu_flags()))
    key = hashlib.sha256(sources + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{'q8_ops' if cxx else 'q8_dot'}-{key}.so"


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-400:]}")


def _torch_link_flags() -> list[str]:
    """PyTorch's headers, libraries and C++ ABI, for a library of operators loaded into this process."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{root / 'lib'}"]


def _build(cc: str, out: Path, cxx: str | None = None) -> None:
    """Build the C library into `out`, or with cxx the C++ operators with the C library linked in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name              # built aside, then moved: a reader never sees half a file
        if cxx is None:
            _run([cc, *FLAGS, str(SOURCE), "-o", str(built), *_openmp_flags(), "-lm"])
        else:
            objs = [str(Path(tmp) / f"{src.stem}.o") for src in (SOURCE, ATTENTION_SOURCE)]
            for src, obj in zip((SOURCE, ATTENTION_SOURCE), objs):
                _run([cc, *C_FLAGS, "-fopenmp", "-fvisibility=hidden", "-c", str(src), "-o", obj])
            _run([cxx, *CXX_FLAGS, str(NATIVE_SOURCE), *objs, "-o", str(built), *_torch_link_flags(),
                  *_openmp_flags(), "-lm"])
        os.replace(built, out)
    stem = out.name.partition("-")[0]
    for old in out.parent.glob(f"{stem}-*.so"):   # builds of an older source, CPU or torch: not loaded again
        if old != out:
            old.unlink(missing_ok=True)


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """The loaded library, or None and why."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the hand-written kernel is written for x86 AVX2, not {platform.machine()}"
    if "avx2" not in cpu_flags() or "fma" not in cpu_flags():
        return None, "this CPU has no AVX2 and FMA"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) to build the hand-written kernel"
    path = _library_path(cc)
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"the hand-written kernel did not build: {e}"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.q4_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.q8w_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    return lib, None


@functools.cache
def _native() -> tuple[bool, str | None]:
    """Load the C++ operators (built on first use); False and why where they cannot be."""
    if _library()[0] is None:
        return False, why_not()
    cc, cxx = _compiler(), _cxx_compiler()
    if cxx is None:
        return False, "no C++ compiler (c++, g++ or clang++) to build the operators against PyTorch"
    path = _library_path(cc, cxx)
    try:
        if not path.exists():
            print("building the decode step's C++ operators (the q8 kernel, one-query attention) against PyTorch's "
                  "headers (once, about ten seconds)...")
            _build(cc, path, cxx)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return False, f"the C++ operators did not build or load: {e}"
    for name in ("q4_linear_native", "q8w_linear_native"):
        torch.library.register_fake(f"infopt::{name}", _FAKES[name.removesuffix("_native")])
    torch.library.register_fake("infopt::one_query_attention", lambda q, k, v, input_pos: q.new_empty(q.shape))
    _LOADED[0] = True
    return True, None


def native_loaded() -> bool:
    """Whether the C++ operators are loaded in this process, without building or loading them (a trace asks
    this: no build may start inside one, and it reads a flag where it could not call into the cache)."""
    return _LOADED[0]


_LOADED = [False]                                  # set by _native once the operators load


def native_why_not() -> str | None:
    """Why the C++ operators are not in use here (calls then cross into Python); None if they are."""
    return _native()[1]


def operators() -> tuple:
    """The (int4, int8) operators a step calls: the C++ ones where they build, else those registered from Python."""
    ops = torch.ops.infopt
    if _native()[0]:
        return ops.q4_linear_native, ops.q8w_linear_native
    return ops.q4_linear, ops.q8w_linear


def available() -> bool:
    """Whether the hand-written kernel runs here (built on first call)."""
    return _library()[0] is not None


def why_not() -> str | None:
    """Why the hand-written kernel does not run here; None if it does."""
    return _library()[1]


def takes(in_features: int, group_size: int | None = None) -> str | None:
    """Why the kernel cannot take a layer of this shape (int8: group_size None; int4: its group size); None if it can.

    int8 reads blocks of 32 inputs; int4 pairs of blocks (the nibbles of 32 bytes), in groups of 32 or more."""
    step = BLOCK if group_size is None else 2 * BLOCK
    if in_features % step:
        return f"in_features {in_features} is not a multiple of {step}"
    if group_size is not None and (group_size % BLOCK or in_features % group_size):
        return f"group size {group_size} is not a multiple of {BLOCK} dividing {in_features}"
    return None


OPERAND_DTYPES = {"q4_linear": ((torch.uint8,), (torch.float32,), (torch.uint8,)),   # weight_q, scales, zeros
                  "q8w_linear": ((torch.int8,), (torch.float32,))}


def _call(name: str, x: Tensor, n_out: int, *args) -> Tensor:
    """Run the library's `name` on x [rows, K] and the layer's operands; a decode step makes a hundred such calls,
    so each check here is the cheapest that still keeps raw memory reads safe."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(why_not())
    for a, dtypes in zip(args, OPERAND_DTYPES[name]):     # the kernel reads raw memory: the layout must be right
        if not (a.is_cpu and a.dtype in dtypes and a.is_contiguous()):
            raise ValueError(f"{name} takes contiguous CPU operands of dtype {' or '.join(map(str, dtypes))}, "
                             f"got {a.dtype} on {a.device} ({'' if a.is_contiguous() else 'not '}contiguous)")
    if not x.is_cpu:
        raise ValueError(f"{name} takes activations on the CPU, got them on {x.device}")
    K = args[0].shape[1] * (2 if name == "q4_linear" else 1)           # int4 packs two weights a byte
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{name} takes activations [rows, {K}], got {list(x.shape)}")
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()                                              # (rows, K)
    y = torch.empty(x.shape[0], n_out, dtype=torch.float32)                              # (rows, N)
    ptrs = [a.data_ptr() if isinstance(a, Tensor) else a for a in args]
    if getattr(lib, name)(x.data_ptr(), x.shape[0], x.shape[1], *ptrs, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"{name}: no memory for the quantized activations of {x.shape[0]} rows")
    return y


def q4_linear_eager(x: Tensor, weight_q: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """x [rows, K] @ W^T for int4 W (packed [N, K/2] uint8, scales fp32 and zeros uint8 [N, K/G]): [rows, N] fp32."""
    n = weight_q.shape[0]
    return _call("q4_linear", x, n, weight_q, scales, zeros, n, group_size)


def q8w_linear_eager(x: Tensor, weight_q: Tensor, scales: Tensor) -> Tensor:
    """x [rows, K] @ W^T for int8 W ([N, K] int8, scales fp32 [N]): [rows, N] fp32."""
    n = weight_q.shape[0]
    return _call("q8w_linear", x, n, weight_q, scales, n)


# The two products as operators of their own, so a compiled graph calls them as it calls PyTorch's kernels:
# registered for CPU tensors directly (a torch.library.custom_op wrapper would add tens of microseconds a call).
_OPS = torch.library.Library("infopt", "DEF")
_OPS.define("q4_linear(Tensor x, Tensor weight_q, Tensor scales, Tensor zeros, int group_size) -> Tensor")
_OPS.define("q8w_linear(Tensor x, Tensor weight_q, Tensor scales) -> Tensor")
_OPS.impl("q4_linear", q4_linear_eager, "CPU")
_OPS.impl("q8w_linear", q8w_linear_eager, "CPU")


def _q4_fake(x, weight_q, scales, zeros, group_size):
    return x.new_empty(x.shape[0], weight_q.shape[0], dtype=torch.float32)


def _q8w_fake(x, weight_q, scales):
    return x.new_empty(x.shape[0], weight_q.shape[0], dtype=torch.float32)


_FAKES = {"q4_linear": _q4_fake, "q8w_linear": _q8w_fake}   # the C++ operators get theirs when they load
for _name, _fake in _FAKES.items():
    torch.library.register_fake(f"infopt::{_name}", _fake)


def q4_linear(x: Tensor, weight_q: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """The int4 product through `operators()` (infopt::q4_linear inside a trace, where no build may start)."""
    if torch.compiler.is_compiling():
        return torch.ops.infopt.q4_linear(x, weight_q, scales, zeros, group_size)
    return operators()[0](x, weight_q, scales, zeros, group_size)


def q8w_linear(x: Tensor, weight_q: Tensor, scales: Tensor) -> Tensor:
    """The int8 product through `operators()` (infopt::q8w_linear inside a trace, where no build may start)."""
    if torch.compiler.is_compiling():
        return torch.ops.infopt.q8w_linear(x, weight_q, scales)
    return operators()[1](x, weight_q, scales)


# Up to how many rows a call runs the hand-written kernel; more go to the layer's PyTorch paths. Its cost
# grows with the rows (each row's byte products are its own work), and on a CPU with AMX or VNNI PyTorch's
# kernels share more work between rows; on an AVX2 CPU without them (a Zen 1 EPYC) it stayed the faster up to
# the 64 rows measured. 16 takes decode steps, small batches, verify passes and a short prompt's prefill (the
# first token's wait); `infopt-lab bench --only overhead` measures both by rows on the CPU it runs on.
Q8_MAX_ROWS = {"int8": 16, "int4": 16}


def reference(x: Tensor, weight: Tensor) -> Tensor:
    """What the kernel computes, in float64: x's blocks of 32 quantized as the kernel does (in fp32), times W [N, K].

    The quantized activations are the kernel's own integers and scales; the sums are exact here, so kernel and
    reference differ only by the kernel's fp32 accumulation.
    """
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)                                    # (rows, K/32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))            # fp32, as the kernel
    a = torch.round(blocks * inv)                                                         # half to even, as lrintf
    d = amax / 127.0
    return (a.double() * d.double()).reshape(x.shape[0], -1) @ weight.double().T
