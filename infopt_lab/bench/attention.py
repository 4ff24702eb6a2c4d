"""The attention rung: TFLOP/s of our kernel, PyTorch SDPA and naive attention; the interpreter's check.

Speed is only meaningful on a GPU (the interpreter runs a kernel in Python); on a CPU the
benchmark reports the kernel's agreement with the reference instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..device import HAS_CUDA, HAS_TRITON, default_dtype, get_device
from .result import Result

# Dense 16-bit tensor-core peaks (no sparsity), TFLOP/s, from the vendors' datasheets.
PEAK_TFLOPS_16BIT = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
                     "A10": 125.0, "T4": 65.0, "V100": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0}
ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def device_peak_tflops(device: torch.device | str = "cuda") -> float | None:
    """The datasheet 16-bit peak of the current GPU, or None when it is not in the table."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS_16BIT.items() if key in name), None)


def attention_flops(B: int, H: int, N: int, D: int, causal: bool) -> float:
    """FLOPs of attention's two matmuls (QK^T and PV): 4 * B * H * N^2 * D, halved when causal."""
    return 4 * B * H * N * N * D / (2 if causal else 1)


@dataclass
class AttentionTiming:
    """One implementation on one sequence length: milliseconds per call and TFLOP/s."""

    impl: str
    N: int
    ms: float | None          # None: out of memory
    tflops: float | None


def time_attention(impls: dict, N: int, B: int = 4, H: int = 16, D: int = 128, causal: bool = True,
                   dtype: torch.dtype | None = None, repeats: int = 10) -> list[AttentionTiming]:
    """CUDA-event timings of each implementation on one shape (in the GPU's own dtype by default); an OOM is
    reported, not raised."""
    dtype = dtype or default_dtype("cuda")
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))   # (B, H, N, D)
    out = []
    for name, fn in impls.items():
        try:
            fn(q, k, v, causal)                                        # warm-up and compile
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(repeats):
                fn(q, k, v, causal)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / repeats
            out.append(AttentionTiming(name, N, ms, attention_flops(B, H, N, D, causal) / ms / 1e9))
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            out.append(AttentionTiming(name, N, None, None))
    return out


def gpu_contenders() -> dict:
    """Ours (where Triton is installed), PyTorch SDPA and naive attention, as (q, k, v, causal) -> out."""
    from ..kernels.attention_ref import attention_reference
    from ..kernels.flash_attention import flash_attention_triton
    ours = {"ours (Triton)": flash_attention_triton} if HAS_TRITON else {}   # a CUDA machine without Triton: Windows
    return {**ours, "PyTorch SDPA": lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
            "naive": attention_reference}


def interpreter_check(seed: int = 0) -> list[tuple[str, float]]:
    """Max |ours - reference| for a few shapes run in the Triton interpreter (or compiled on CUDA)."""
    from ..kernels.attention_ref import attention_reference
    from ..kernels.flash_attention import flash_attention_triton
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    rows = []
    for B, H, H_kv, N, N_k, D, causal, dtype in [(2, 4, 2, 77, 77, 64, True, torch.float32),
                                                 (2, 4, 4, 130, 130, 32, False, torch.float32),
                                                 (1, 8, 2, 1, 300, 128, True, torch.float16),
                                                 (2, 4, 1, 256, 256, 16, True, torch.float16)]:
        q, k, v = (torch.randn(*s, generator=g).to(dtype).to(device)
                   for s in ((B, H, N, D), (B, H_kv, N_k, D), (B, H_kv, N_k, D)))
        err = (flash_attention_triton(q, k, v, causal).float()
               - attention_reference(q.float(), k.float(), v.float(), causal)).abs().max().item()
        label = f"B={B} H={H} H_kv={H_kv} N={N} N_k={N_k} D={D} {'causal' if causal else 'full'} {str(dtype)[6:]}"
        rows.append((label, err))
    return rows


def bench_attention(model_name: str = "target", lengths: tuple[int, ...] = ATTENTION_LENGTHS,
                    tiles: bool = True) -> Result:
    """On CUDA: TFLOP/s of our Triton FlashAttention, SDPA and naive attention, causal, D=128, in the GPU's dtype.

    On a CPU: one line saying that speed needs a GPU, and the interpreter's agreement with the reference.
    Everywhere (`tiles`): the tiles chosen for a T4, an A100, an L4 and an H100, compiled ahead of time.
    (`model_name` is accepted for a uniform command line; attention is benchmarked on synthetic shapes.)
    """
    from ..kernels.flash_attention import attention_path
    r = Result("attention: Triton FlashAttention vs PyTorch SDPA vs naive")
    r.add("path", attention_path(get_device()))
    if not HAS_TRITON:
        r.add("result", "Triton is not installed here: nothing to measure (the reference runs instead)")
        return r
    for label, err in interpreter_check():
        r.add(f"max |ours - reference|, {label}", f"{err:.2e}")
    if tiles:
        from ..kernels.aot import attention_table
        for line in attention_table(128):
            r.add("tiles", line)
    if not HAS_CUDA:
        r.add("speed", "needs a CUDA GPU: the Triton interpreter runs kernels in Python, so on a CPU only "
                       "correctness is measured")
        return r
    peak = device_peak_tflops()
    r.add("device", f"{torch.cuda.get_device_name()} (16-bit peak {peak or 'unknown'} TFLOP/s)")
    r.add("shape", f"B=4, H=16, D=128, {str(default_dtype('cuda')).removeprefix('torch.')}, causal; "
                   "TFLOP/s (share of peak)")
    ratios, tflops = {}, {}
    for N in lengths:
        timings = {t.impl: t for t in time_attention(gpu_contenders(), N)}
        for t in timings.values():
            tflops.setdefault(t.impl, {})[N] = t.tflops
        cells = [f"{t.impl} OOM" if t.tflops is None
                 else f"{t.impl} {t.tflops:.0f}" + (f" ({t.tflops / peak:.0%})" if peak else "")
                 for t in timings.values()]
        r.add(f"N={N}", ", ".join(cells))
        ours, sdpa = timings["ours (Triton)"].tflops, timings["PyTorch SDPA"].tflops
        if ours and sdpa:
            ratios[N] = ours / sdpa
    r.add("ours / SDPA", ", ".join(f"N={n}: {x:.2f}x" for n, x in ratios.items()))
    r.values = {"ours_over_sdpa": ratios, "tflops": tflops, "dtype": str(default_dtype("cuda"))}
    return r
