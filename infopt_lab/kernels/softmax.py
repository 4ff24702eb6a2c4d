"""Row softmax in Triton with an online (streaming) max and sum: the heart of FlashAttention, alone.

Each program owns one row. Pass 1 walks the row BLOCK columns at a time, keeping the
largest value seen (m) and the sum of exp(x - m) (l); when a block raises the max, the sum
so far is rescaled by exp(m_old - m_new). Pass 2 writes exp(x - m) / l. No block ever needs
the whole row in registers, which is what lets attention tile its score matrix.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import validate
from ..device import HAS_TRITON, capability, check_dtype
from . import Launch, require_interpreter


def online_softmax_reference(x: Tensor, block: int = 4) -> tuple[Tensor, list[tuple[float, float]]]:
    """Softmax of a 1-D tensor by streaming blocks; also the (running max, running sum) after each block."""
    m, l, trace = float("-inf"), 0.0, []
    for start in range(0, x.numel(), block):
        chunk = x[start:start + block].double()
        m_new = max(m, chunk.max().item())
        shift = m_new if m_new > float("-inf") else 0.0           # all -inf so far: exp(-inf - -inf) is NaN
        l = l * math.exp(m - shift) + torch.exp(chunk - shift).sum().item()
        m = m_new
        trace.append((m, l))
    return (torch.exp(x.double() - m) / l).to(x.dtype), trace


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _softmax_rows_kernel(
        X,                             # input x [R, C], one row per program
        Y,                             # output y [R, C], softmax of each row, in y's dtype
        stride_x,                      # x stride over rows (elements); columns are contiguous
        stride_y,                      # y stride over rows (elements); columns are contiguous
        C,                             # columns per row (any size: the last block is masked)
        BLOCK: tl.constexpr,           # columns loaded per step (a power of two)
        VERBOSE: tl.constexpr,         # print row 0's running max and sum after every block
    ):
        row = tl.program_id(0)
        m = tl.full((1,), float("-inf"), dtype=tl.float32)      # running max
        l = tl.zeros((1,), dtype=tl.float32)                    # running sum of exp(x - m)
        for start in range(0, C, BLOCK):                        # pass 1: statistics, streamed
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * stride_x + cols, mask=cols < C, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)   # all -inf so far: exp(-inf - -inf) is NaN
            l = l * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
            m = m_new
            if VERBOSE:
                if row == 0:
                    tl.device_print("running max", m)
                    tl.device_print("running sum", l)
        for start in range(0, C, BLOCK):                        # pass 2: normalise with the final m and l
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * stride_x + cols, mask=cols < C, other=float("-inf")).to(tl.float32)
            tl.store(Y + row * stride_y + cols, (tl.exp(x - m) / l).to(Y.dtype.element_ty), mask=cols < C)


def plan_softmax(x: Tensor, block: int, verbose: bool, cap: tuple[int, int] | None) -> Launch:
    """The launch for compute capability `cap` (None: the interpreter): checks, a program per row, arguments."""
    validate.tensor("x", x)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a 2-D tensor contiguous in its last dim, got shape {tuple(x.shape)}")
    if validate.integer("block", block, low=1) & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    check_dtype(x.dtype, cap, "the softmax kernel")
    y = torch.empty_like(x)
    return Launch(_softmax_rows_kernel, (x.shape[0],), (x, y, x.stride(0), y.stride(0), x.shape[1]),
                  dict(BLOCK=block, VERBOSE=verbose), out=y)


def softmax_triton(x: Tensor, block: int = 16, verbose: bool = False) -> Tensor:
    """Softmax over the last dim of a 2-D tensor with the streaming kernel (interpreted on a CPU)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed here; use torch.softmax")
    validate.tensor("x", x)
    if x.device.type != "cuda":
        require_interpreter()
    return plan_softmax(x, block, verbose, capability(x.device)).run()
