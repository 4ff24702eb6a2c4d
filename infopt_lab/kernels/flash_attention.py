"""FlashAttention forward in Triton: tiles of queries against tiles of keys, an online softmax, no N x N matrix.

Each program owns BLOCK_M query rows of one (batch, head). It loads them once, then walks
the keys BLOCK_N at a time: scores for the tile, a running max m and sum l per row, and an
accumulator rescaled whenever the max grows. Only O(BLOCK_M * D) numbers stay live, and
the output is written once. Order in this file: kernel -> launcher (checks) -> dispatch.
The plain-PyTorch versions it must equal are in `attention_ref.py`.
"""
from __future__ import annotations

import math
import os
import warnings

import torch
from torch import Tensor

from ..device import HAS_TRITON, capability, check_dtype
from . import INTERPRETER_READY, Launch, require_interpreter, require_same_device
from .attention_ref import attention_reference, check_attention_inputs
from .targets import flash_tiles

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): exp2 is the cheaper instruction

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _flash_attention_fwd(
        Q,                                            # queries q [B, H, N_Q, D]
        K,                                            # keys k [B, H_KV, N_K, D]
        V,                                            # values v [B, H_KV, N_K, D]
        O,                                            # output o [B, H, N_Q, D], q's dtype
        stride_qb,                                    # q stride over batch (elements)
        stride_qh,                                    # q stride over heads
        stride_qn,                                    # q stride over positions; the head dim is contiguous
        stride_kb,                                    # k stride over batch
        stride_kh,                                    # k stride over KV heads
        stride_kn,                                    # k stride over positions; the head dim is contiguous
        stride_vb,                                    # v stride over batch
        stride_vh,                                    # v stride over KV heads
        stride_vn,                                    # v stride over positions; the head dim is contiguous
        stride_ob,                                    # o stride over batch
        stride_oh,                                    # o stride over heads
        stride_on,                                    # o stride over positions; the head dim is contiguous
        H,                                            # query heads
        N_Q,                                          # query length
        N_K,                                          # key length (>= N_Q when CAUSAL)
        qk_scale,                                     # 1 / sqrt(D) * log2(e): scores come out in base 2
        GROUP: tl.constexpr,                          # query heads sharing one KV head (H / H_KV)
        CAUSAL: tl.constexpr,                         # mask keys after each query (bottom-right aligned)
        D: tl.constexpr,                              # head dim, a power of two in 16..128
        BLOCK_M: tl.constexpr,                        # query rows per program
        BLOCK_N: tl.constexpr,                        # keys per inner step
        PRECISION: tl.constexpr,                      # "ieee" for exact fp32 dots, "tf32" otherwise
    ):
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = pid_bh // H, pid_bh % H
        kv_h = h // GROUP                             # grouped-query attention: the shared KV head
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # this program's query rows
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                    mask=offs_m[:, None] < N_Q, other=0.0)        # (BLOCK_M, D), loaded once
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of each row's scores
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)                # running sum of exp2(score - m_i)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)              # running sum of exp2(score - m_i) * v
        offset = N_K - N_Q                            # query i sits at key position offset + i
        hi = N_K
        if CAUSAL:                                    # key tiles past this block's last query are all masked
            hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M + offset)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :],
                        mask=offs_n[:, None] < N_K, other=0.0)    # (BLOCK_N, D)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                        mask=offs_n[:, None] < N_K, other=0.0)    # (BLOCK_N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale   # (BLOCK_M, BLOCK_N), fp32
            keep = offs_n[None, :] < N_K                           # the key tail past N_K
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + offset)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])                        # this tile's weights, relative to m_new
            correction = tl.exp2(m_i - m_new)                      # rescales what was summed before
            l_i = l_i * correction + tl.sum(p, 1)
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=offs_m[:, None] < N_Q)


def _check_kernel_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool, cap: tuple[int, int] | None) -> None:
    check_attention_inputs(q, k, v, causal)
    require_same_device(q=q, k=k, v=v)
    D = q.shape[-1]
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head dim must be a power of two in 16..128, got {D}")
    check_dtype(q.dtype, cap, "the FlashAttention kernel")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dim, got strides {t.stride()}; "
                             f"call .contiguous() first")


def plan_flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, cap: tuple[int, int] | None,
                         block_m: int | None = None, block_n: int | None = None) -> Launch:
    """The launch for a GPU of compute capability `cap` (None: the interpreter): checks, tiles, grid, arguments."""
    _check_kernel_inputs(q, k, v, causal, cap)
    B, H, N, D = q.shape
    tiles = flash_tiles(D, q.dtype, cap)
    bm, bn = block_m or tiles.block_m, block_n or tiles.block_n
    o = torch.empty_like(q)
    return Launch(_flash_attention_fwd, (triton.cdiv(N, bm), B * H), (
        q, k, v, o,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        H, N, k.shape[2], LOG2E / math.sqrt(D)), dict(
        GROUP=H // k.shape[1], CAUSAL=causal, D=D, BLOCK_M=bm, BLOCK_N=bn,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages), out=o)


def flash_attention_triton(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                           block_m: int | None = None, block_n: int | None = None) -> Tensor:
    """The Triton kernel itself (compiled on CUDA, interpreted on a CPU); errors if it cannot run here."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed here; use attention_reference")
    if q.device.type != "cuda":
        require_interpreter()
    return plan_flash_attention(q, k, v, causal, capability(q.device), block_m, block_n).run()


def attention_path(device: torch.device | str = "cpu") -> str:
    """Which implementation `flash_attention` runs for tensors on `device`.

    'triton-compiled' on CUDA, 'triton-interpreter' on a CPU with Triton (TRITON_INTERPRET=1,
    which `import infopt_lab` sets before any kernel is defined), else 'reference'.
    """
    if not HAS_TRITON:
        return "reference"
    if torch.device(device).type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton-compiled"
    if os.environ.get("TRITON_INTERPRET") == "1" and INTERPRETER_READY:
        return "triton-interpreter"
    return "reference"


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """Attention, [B, H, N, D] x [B, H_kv, N_k, D] -> [B, H, N, D], by the best path here (see attention_path)."""
    check_attention_inputs(q, k, v, causal)
    if attention_path(q.device) == "reference":
        warnings.warn("Triton cannot run here: flash_attention runs the plain-PyTorch attention_reference",
                      stacklevel=2)
        check_attention_inputs(q, k, v, causal)
        return attention_reference(q, k, v, causal)
    return flash_attention_triton(q, k, v, causal)
