"""How a QuantLinear multiplies: one small class per kernel path, chosen once per layer for its device.

A QuantLinear (`quantize.py`) stores integers and scales; how it multiplies by them depends on where it
lives. On a CPU, PyTorch's weight-only kernels read the integers directly with bf16 activations
(`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`), and an int8 call of many rows runs
tiled GEMMs over the integers instead (bf16 where the CPU has it in hardware, fp32 elsewhere); on CUDA,
int8 runs the same int8 kernel and int4 a Triton kernel. Everywhere else, and for calls of more rows than a
kernel takes, the fallback: dequantize to a float copy, then F.linear. `choose_kernels` probes what runs
once, when a layer is made or moved, and returns a `KernelChoice`: the paths by rows per call, and why the
layer falls back if it does.

One path is the course's own and is chosen only when asked for (`quantize.use_q8_kernel`): q8_path.Q8Kernel, the
hand-written CPU kernel of kernels/q8_dot.c, which quantizes the activations to int8 as llama.cpp does and
so computes other numbers than the PyTorch kernels (the same integers, activations rounded differently).
"""
from __future__ import annotations

import functools
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import validate
from .device import HAS_TRITON, cpu_has_native_bf16
from .quant_format import dequantize, pack_int4, pack_int4_for_cpu_kernel   # stored; the int4 kernel's form
from .quant_thresholds import cpu_thresholds

INT8_KERNEL = "aten._weight_int8pack_mm"            # int8 weights x bf16 activations on a CPU (x's dtype on CUDA)
INT4_KERNEL = "aten._weight_int4pack_mm_for_cpu"    # int4 weights x bf16 activations on a CPU, packed at quantization
DEQUANT_MATMUL = "dequantize+matmul"                # the fallback: a float copy of W, then F.linear
TRITON_INT4 = "triton int4 dequantize-matmul"
Q8_KERNEL = "hand-written int8-activation kernel"  # kernels/q8_dot.c: int4 or int8 weights x int8 activations
# Up to how many rows (tokens) a call runs a weight-only kernel; more dequantize (a float copy of the whole weight
# per call) and run one float matmul, which catches up on long prefills. These limits change results, not only
# speed: below them activations are rounded to bf16, above them the matmul computes in the model's dtype, and
# perplexity over long windows depends on which. So they are fixed (a sweep on a 2-core x86 CPU found the two even).
INT8_KERNEL_MAX_ROWS = 256
INT4_KERNEL_MAX_ROWS = 512
INT8_GEMM_TILE = 4096          # output rows per GEMM of the int8 tiles: each tile's float copy stays in cache
# From how many rows the int8 GEMMs take over (one tile; more than one, a vocabulary head): measured on each
# CPU and read from its record (quant_thresholds.py; `cpu_thresholds().source` says whose record).
INT8_GEMM_MIN_ROWS = cpu_thresholds().int8_gemm_min_rows
INT8_GEMM_MIN_ROWS_TILED = cpu_thresholds().int8_gemm_min_rows_tiled


# -- probes: what runs here -------------------------------------------------------------------------
def cpu_kernels_fast() -> bool:
    """Whether this CPU runs the vectorized code of the weight-only kernels (AVX2/AVX-512 on x86, NEON on Arm).

    Elsewhere they fall back to scalar loops, slower than dequantize+matmul.
    """
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    return capability.startswith("AVX") or platform.machine().lower() in ("arm64", "aarch64")


@functools.cache
def int8_kernel_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether aten._weight_int8pack_mm runs and is correct for activations of this device and dtype."""
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:                                             # a device without data (meta) fails at .item(): no kernel
        x = torch.randn(2, 64, device=device_type).to(dtype)
        wq = torch.randint(-127, 128, (32, 64), dtype=torch.int8, device=device_type)
        s = torch.rand(32, device=device_type).to(dtype)
        y = op(x, wq, s)
        ref = x.float() @ (wq.float() * s.float()[:, None]).T
        return bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()))
    except (RuntimeError, NotImplementedError):
        return False


@functools.cache
def int4_kernel_works() -> bool:
    """Whether aten._weight_int4pack_mm_for_cpu (and its converter) exist, run and agree with our dequantize on a CPU."""
    if not all(hasattr(torch.ops.aten, op) for op in ("_weight_int4pack_mm_for_cpu",
                                                      "_convert_weight_to_int4pack_for_cpu")):
        return False
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 128), generator=g, dtype=torch.uint8)             # (N, K), groups of 64
    s = 0.01 + 0.1 * torch.rand(32, 2, generator=g)
    z = torch.randint(0, 16, (32, 2), generator=g, dtype=torch.uint8)
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    try:
        packed, sz, kg = pack_int4_for_cpu_kernel(pack_int4(q), s, z, 128)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, kg, sz)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    ref = x.float() @ dequantize(q, s, z).T
    return bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()))


# -- operands a kernel derives from the stored format -----------------------------------------------
class DerivedOperands:
    """What a kernel makes from some of a layer's buffers, kept until one of them is replaced or edited in place.

    GPTQ replaces weight_q/scales/zeros after quantizing and load_state_dict copies into them in place: each
    buffer's identity and version counter say when to derive again.
    """

    def __init__(self, buffers: tuple[str, ...], derive: Callable[..., object]):
        self.buffers, self.derive = buffers, derive
        self.kept: tuple | None = None                      # (source tensors, their versions, operands)

    def get(self, layer) -> object:
        """The operands for the layer's current buffers, derived again only if they changed.

        A compiled step (compiled.py) reads the operands kept when it was traced, since versions cannot be read
        while tracing; a buffer replaced or edited after that needs the step compiled again.
        """
        if torch.compiler.is_compiling() and self.kept is not None:
            return self.kept[2]
        tensors = tuple(getattr(layer, name) for name in self.buffers)
        try:
            versions = tuple(t._version for t in tensors)
        except RuntimeError:                                # inference tensors keep no version counter
            versions = None
        kept = self.kept
        if kept is not None and kept[1] == versions and all(a is b for a, b in zip(kept[0], tensors)):
            return kept[2]
        operands = self.derive(*tensors)
        self.kept = (tensors, versions, operands)
        return operands

    def forget(self) -> None:
        """Drop the operands (the layer's buffers were reloaded, or swapped for views of fused ones)."""
        self.kept = None

    def nbytes(self) -> int:
        """Bytes the kept operands hold beside the layer's own buffers."""
        if self.kept is None:
            return 0
        ops = self.kept[2] if isinstance(self.kept[2], tuple) else (self.kept[2],)
        return sum(t.numel() * t.element_size() for t in ops if isinstance(t, Tensor))


# -- the paths ------------------------------------------------------------------------------------------
class KernelPath:
    """One way to compute a QuantLinear's x @ W^T: its `name`, the rows per call it serves, and `matmul`."""
    name = ""

    def __init__(self, min_rows: int = 0, max_rows: int | None = None):
        self.min_rows, self.max_rows = min_rows, max_rows   # calls of min_rows..max_rows rows (None: no limit)

    def serves(self, rows: int) -> bool:
        """Whether this path takes a call of `rows` rows."""
        return rows >= self.min_rows and (self.max_rows is None or rows <= self.max_rows)

    def forward(self, x: Tensor, layer) -> Tensor:
        """x [..., K] -> [..., N]: the product in the path's dtype, cast back to x's, plus the bias."""
        y = self.matmul(x.reshape(-1, layer.in_features), layer)                  # (rows, N)
        y = y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)
        return y + layer.bias if layer.bias is not None else y

    def matmul(self, x2: Tensor, layer) -> Tensor:
        """x2 [rows, K] times the layer's weight transposed: [rows, N], without the bias."""
        raise NotImplementedError

    def forget(self) -> None:
        """Drop derived operands, if the path keeps any."""

    def cached_bytes(self) -> int:
        """Bytes of derived operands the path keeps beside the layer's buffers."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rows {self.min_rows}..{'' if self.max_rows is None else self.max_rows})"


class DequantMatmul(KernelPath):
    """The fallback: the layer's float weight, dequantized for the call, then one F.linear in x's dtype."""
    name = DEQUANT_MATMUL

    def forward(self, x: Tensor, layer) -> Tensor:
        return F.linear(x, layer.dequantized_weight().to(x.dtype), layer.bias)

    def matmul(self, x2: Tensor, layer) -> Tensor:
        return F.linear(x2, layer.dequantized_weight().to(x2.dtype))


class Int8Kernel(KernelPath):
    """aten._weight_int8pack_mm: int8 weights [N, K] read directly, activations and scales in `compute_dtype`."""
    name = INT8_KERNEL

    def __init__(self, compute_dtype: torch.dtype, max_rows: int):
        super().__init__(0, max_rows)
        self.compute_dtype = compute_dtype
        self.scales = DerivedOperands(("scales",), functools.partial(Tensor.to, dtype=compute_dtype))   # (N,)

    def matmul(self, x2: Tensor, layer) -> Tensor:
        x2 = x2.to(self.compute_dtype).contiguous()                                     # (rows, K)
        return torch.ops.aten._weight_int8pack_mm(x2, layer.weight_q, self.scales.get(layer))

    def forget(self) -> None:
        self.scales.forget()

    def cached_bytes(self) -> int:
        return self.scales.nbytes()


def int8_gemm_name(gemm_dtype: torch.dtype) -> str:
    """What the GEMM band of the CPU int8 path is called, with the dtype its GEMMs run in."""
    return f"{'bf16' if gemm_dtype == torch.bfloat16 else 'fp32'} GEMMs over the int8 integers"   # not a layer's path


def int8_cpu_rows() -> str:
    """Which path an int8 call of how many rows takes on this CPU, in words: its thresholds and GEMM dtype."""
    t, most = cpu_thresholds(), INT8_KERNEL_MAX_ROWS
    if min(t.int8_gemm_min_rows, t.int8_gemm_min_rows_tiled) > most:
        return f"the kernel up to {most} rows per call (GEMMs over the integers never won on {t.measured_on})"
    gemm = int8_gemm_name(torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    one, tiled = min(t.int8_gemm_min_rows - 1, most), min(t.int8_gemm_min_rows_tiled - 1, most)
    return f"the kernel up to {one} rows per call ({tiled} for a vocabulary-sized head), then {gemm} up to {most}"


class Int8TiledGemm(KernelPath):
    """GEMMs over the int8 integers (exact in bf16 and fp32), INT8_GEMM_TILE output rows at a time, scales after.

    The CPU int8 kernel walks the whole weight once per row; from some rows up (`cpu_thresholds`) GEMMs over
    a float copy of each tile, small enough to stay in cache, compute the same product faster. The operands are
    the kernel's (activations rounded to bf16, scales in bf16); the GEMMs run in bf16 where the CPU multiplies
    bf16 in hardware and in fp32 elsewhere, where bf16 GEMMs are emulated several times slower than fp32 ones
    (every product of a bf16 activation and an int8 weight is exact in fp32, so only the sums round differently).
    """

    def __init__(self, kernel: Int8Kernel, min_rows: int, max_rows: int, gemm_dtype: torch.dtype | None = None):
        super().__init__(min_rows, max_rows)
        self.kernel = kernel                                 # shares its scales in the compute dtype
        native = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        self.gemm_dtype = validate.choice("gemm_dtype", gemm_dtype or native, (torch.bfloat16, torch.float32))
        self.name = int8_gemm_name(self.gemm_dtype)

    def matmul(self, x2: Tensor, layer) -> Tensor:
        dtype, gemm = self.kernel.compute_dtype, self.gemm_dtype
        x2 = x2.to(dtype).to(gemm).contiguous()                                          # (rows, K)
        y = x2.new_empty(x2.shape[0], layer.out_features)                                # (rows, N)
        for n in range(0, layer.out_features, INT8_GEMM_TILE):
            tile = layer.weight_q[n:n + INT8_GEMM_TILE].to(gemm)                         # (tile, K), exact
            torch.matmul(x2, tile.t(), out=y[:, n:n + INT8_GEMM_TILE])
        return y.to(dtype).mul_(self.kernel.scales.get(layer))


class Int4CpuKernel(KernelPath):
    """aten._weight_int4pack_mm_for_cpu: bf16 activations, over PyTorch's own packing of our integers."""
    name = INT4_KERNEL

    def __init__(self, in_features: int, max_rows: int):
        super().__init__(0, max_rows)
        self.packed = DerivedOperands(("weight_q", "scales", "zeros"),
                                      functools.partial(pack_int4_for_cpu_kernel, in_features=in_features))

    def matmul(self, x2: Tensor, layer) -> Tensor:
        packed, scales_and_zeros, group = self.packed.get(layer)
        x2 = x2.to(torch.bfloat16).contiguous()                                          # (rows, K)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scales_and_zeros)

    def forget(self) -> None:
        self.packed.forget()

    def cached_bytes(self) -> int:
        return self.packed.nbytes()


class TritonInt4(KernelPath):
    """The Triton kernel of kernels/int4_matmul.py: dequantizes each tile in registers inside the matmul."""
    name = TRITON_INT4

    def matmul(self, x2: Tensor, layer) -> Tensor:
        from .kernels.int4_matmul import int4_matmul   # here, not at the top: it imports Triton
        return int4_matmul(x2, layer.weight_q, layer.scales, layer.zeros)


# -- the choice -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class KernelChoice:
    """The paths one QuantLinear computes with, chosen once for the device and dtype it is on."""
    path: str                        # what the layer reports: its kernel, or DEQUANT_MATMUL
    compute_dtype: torch.dtype       # the activations' dtype on the kernel (bf16 for the CPU kernels)
    fallback_reason: str | None      # why no kernel, where the layer has none
    paths: tuple[KernelPath, ...]    # by rows per call; the last takes every call the others leave
    device: torch.device             # what it was chosen for
    dtype: torch.dtype

    def pick(self, rows: int) -> KernelPath:
        """The path that computes a call of `rows` rows."""
        return next(p for p in self.paths if p.serves(rows))

    def forget(self) -> None:
        """Drop every path's derived operands."""
        for p in self.paths:
            p.forget()

    def cached_bytes(self) -> int:
        """Bytes of derived operands kept beside the layer's buffers (the CPU int4 kernel's packing, bf16 scales)."""
        return sum(p.cached_bytes() for p in self.paths)


def int8_paths(layer, device: torch.device, dtype: torch.dtype) -> tuple[tuple[KernelPath, ...], torch.dtype]:
    """The int8 kernel; on a CPU in bf16, handing calls of many rows to tiled GEMMs (this CPU's thresholds)."""
    if device.type != "cpu":
        return (Int8Kernel(dtype, INT8_KERNEL_MAX_ROWS),), dtype
    limits = cpu_thresholds()
    gemm_from = limits.int8_gemm_min_rows_tiled if layer.out_features > INT8_GEMM_TILE else limits.int8_gemm_min_rows
    kernel = Int8Kernel(torch.bfloat16, min(gemm_from - 1, INT8_KERNEL_MAX_ROWS))
    gemm = (Int8TiledGemm(kernel, gemm_from, INT8_KERNEL_MAX_ROWS),) if gemm_from <= INT8_KERNEL_MAX_ROWS else ()
    return (kernel, *gemm), torch.bfloat16


def int4_cpu_paths(layer, device: torch.device, dtype: torch.dtype) -> tuple[tuple[KernelPath, ...], torch.dtype]:
    """The CPU int4 kernel, its packing done now: a ValueError here says the kernel cannot take the layer."""
    kernel = Int4CpuKernel(layer.in_features, INT4_KERNEL_MAX_ROWS)
    kernel.packed.get(layer)
    return (kernel,), torch.bfloat16


PATHS = {INT8_KERNEL: int8_paths, INT4_KERNEL: int4_cpu_paths,
         TRITON_INT4: lambda layer, device, dtype: ((TritonInt4(),), dtype),
         DEQUANT_MATMUL: lambda layer, device, dtype: ((), dtype)}   # and Q8_KERNEL, which q8_path adds


def kernel_choice(layer, path: str, device: torch.device | str, dtype: torch.dtype,
                  fallback_reason: str | None = None) -> KernelChoice:
    """`layer` running `path` (then DEQUANT_MATMUL past its rows), without probing whether it works here."""
    validate.choice("path", path, PATHS)
    device = torch.device(device)
    kernels, compute = PATHS[path](layer, device, dtype)
    last = kernels[-1].max_rows if kernels else -1
    rest = (DequantMatmul(last + 1),) if last is not None else ()
    return KernelChoice(path, compute, fallback_reason, (*kernels, *rest), device, dtype)


def int8_fallback_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int8 layers on this device and dtype cannot run the int8 kernel; None when they can."""
    if device.type == "cpu":                              # fp32 activations: far slower than F.linear;
        if not int8_kernel_works("cpu", torch.bfloat16):  # bf16: faster than it
            return f"{INT8_KERNEL} does not run correctly with bf16 activations (torch {torch.__version__})"
        if not cpu_kernels_fast():
            return "this CPU has no vectorized code for the int8 kernel"
        return None
    if not int8_kernel_works(device.type, dtype):
        return f"{INT8_KERNEL} does not run correctly for {dtype} on {device.type}"
    return None


def int4_fallback_reason(device: torch.device) -> str | None:
    """Why int4 layers on this device have no kernel (shape aside: see int4_cpu_paths); None if they have one."""
    if device.type == "cuda":
        return None if HAS_TRITON else "Triton is not installed"
    if device.type != "cpu":
        return f"no weight-only int4 kernel for {device.type}"
    if not int4_kernel_works():
        return f"torch {torch.__version__} has no working {INT4_KERNEL}"
    if not cpu_kernels_fast():
        return "this CPU has no vectorized code for the int4 kernel"
    return None


def choose_kernels(layer, device: torch.device | str, dtype: torch.dtype) -> KernelChoice:
    """The fastest correct paths for `layer` (a QuantLinear) on this device and dtype, and why not, if it falls back."""
    device = torch.device(device)
    if layer.scheme == "int8":
        reason, path = int8_fallback_reason(device, dtype), INT8_KERNEL
    else:
        reason, path = int4_fallback_reason(device), TRITON_INT4 if device.type == "cuda" else INT4_KERNEL
    if reason is not None:
        return kernel_choice(layer, DEQUANT_MATMUL, device, dtype, reason)
    try:
        return kernel_choice(layer, path, device, dtype)
    except ValueError as e:                               # the CPU int4 kernel cannot take this shape or group
        return kernel_choice(layer, DEQUANT_MATMUL, device, dtype, f"{INT4_KERNEL} cannot take this layer: {e}")


# -- measuring where the int8 GEMMs take over ---------------------------------------------------------
MEASURE_ROWS = (1, 2, 4, 6, 8, 10, 12, 14, 16, 17, 18, 20, 24, 32, 48, 64, 96, 128, 192, 256)   # to the most


def int8_gemm_crossover(layer, rows: Sequence[int] = MEASURE_ROWS,
                        repeats: int = 15) -> tuple[int, dict[int, dict[str, float]]]:
    """From how many rows Int8TiledGemm beats Int8Kernel on `layer` (int8, on a CPU), and the seconds per row count.

    Every (row count, path) pair runs in turn, round after round (`timing.interleaved_runs`), so a burst of
    other work hits them all alike; each keeps its fastest run, since a neighbour only ever slows a run down.
    The crossover is the first row count from which the GEMMs win at every larger one measured;
    INT8_KERNEL_MAX_ROWS + 1 (never) where they do not.
    """
    from .timing import interleaved_runs
    kernel = Int8Kernel(torch.bfloat16, INT8_KERNEL_MAX_ROWS)
    paths = {"kernel": kernel, "gemm": Int8TiledGemm(kernel, 0, INT8_KERNEL_MAX_ROWS)}
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(n, layer.in_features, generator=g).to(torch.bfloat16) for n in sorted(rows)}   # (n, K)
    runs = interleaved_runs({(n, name): functools.partial(p.matmul, x2, layer)
                             for n, x2 in inputs.items() for name, p in paths.items()}, repeats=repeats, warmup=1)
    seconds = {n: {name: min(runs[n, name]) for name in paths} for n in inputs}
    wins = {n: t["gemm"] < t["kernel"] for n, t in seconds.items()}
    crossover = next((n for n in seconds if all(wins[m] for m in seconds if m >= n)), INT8_KERNEL_MAX_ROWS + 1)
    return crossover, seconds
