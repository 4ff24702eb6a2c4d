"""Paged decode attention in Triton: one query per sequence over its KV blocks, read through a block table.

The engine's cache (`PagedKVCache`, one layer: [N_blocks, block_size, H_kv, D]) scatters a
sequence's keys over blocks listed in its block table. The gather path copies them into a
contiguous [B, H_kv, S, D] tensor first, then attends. The kernel reads each block where it
lies: program (b, h) walks the table of sequence b, one block per step, with the same
online softmax as FlashAttention, and never materializes the gathered copy.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..device import HAS_TRITON, capability, check_dtype
from . import Launch, require_interpreter, require_same_device
from .flash_attention import LOG2E


def paged_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                              seq_lens: Tensor) -> Tensor:
    """Gather then attend: q [B, H, D]; caches [N_blocks, block_size, H_kv, D]; tables [B, max_blocks]."""
    B, H, D = q.shape
    _, block_size, H_kv, _ = k_cache.shape
    n = block_tables.shape[1]
    k = k_cache[block_tables].view(B, n * block_size, H_kv, D).transpose(1, 2)   # (B, H_kv, S, D): a copy
    v = v_cache[block_tables].view(B, n * block_size, H_kv, D).transpose(1, 2)
    keep = torch.arange(n * block_size, device=q.device)[None, :] < seq_lens[:, None]   # (B, S)
    out = F.scaled_dot_product_attention(q[:, :, None].float(), k.float(), v.float(),
                                         attn_mask=keep[:, None, None, :], enable_gqa=H != H_kv)
    return out[:, :, 0].to(q.dtype)                                                    # (B, H, D)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_decode_kernel(
        Q,                                      # queries q [B, H, D]: one decode position per sequence
        K_CACHE,                                # key cache [N_BLOCKS, BLOCK_SIZE, H_KV, D]
        V_CACHE,                                # value cache, same shape and strides as K_CACHE
        O,                                      # output o [B, H, D], q's dtype
        BLOCK_TABLES,                           # [B, MAX_BLOCKS] int32: the cache blocks of each sequence, in order
        SEQ_LENS,                               # [B] int32: tokens cached for each sequence (>= 1)
        stride_qb,                              # q stride over sequences (elements)
        stride_qh,                              # q stride over heads; the head dim is contiguous
        stride_cb,                              # cache stride over blocks
        stride_cs,                              # cache stride over rows within a block
        stride_ch,                              # cache stride over KV heads; the head dim is contiguous
        stride_tb,                              # block-table stride over sequences
        stride_ob,                              # o stride over sequences
        stride_oh,                              # o stride over heads
        qk_scale,                               # 1 / sqrt(D) * log2(e): scores come out in base 2
        GROUP: tl.constexpr,                    # query heads per KV head (H / H_KV)
        D: tl.constexpr,                        # head dim (a power of two)
        BLOCK_SIZE: tl.constexpr,               # tokens per cache block (a power of two)
    ):
        b, h = tl.program_id(0), tl.program_id(1)
        kv_h = h // GROUP
        offs_d = tl.arange(0, D)
        offs_s = tl.arange(0, BLOCK_SIZE)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d).to(tl.float32)   # (D,)
        seq_len = tl.load(SEQ_LENS + b)
        m_i = tl.full((1,), float("-inf"), dtype=tl.float32)   # running max, sum and weighted sum,
        l_i = tl.zeros((1,), dtype=tl.float32)                  # as in FlashAttention
        acc = tl.zeros((D,), dtype=tl.float32)
        for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            block = tl.load(BLOCK_TABLES + b * stride_tb + j).to(tl.int64)       # where this block lies
            rows = block * stride_cb + offs_s[:, None] * stride_cs + kv_h * stride_ch + offs_d[None, :]
            k = tl.load(K_CACHE + rows).to(tl.float32)                            # (BLOCK_SIZE, D)
            v = tl.load(V_CACHE + rows).to(tl.float32)
            s = tl.sum(k * q[None, :], 1) * qk_scale                              # (BLOCK_SIZE,)
            s = tl.where(j * BLOCK_SIZE + offs_s < seq_len, s, float("-inf"))     # the last block's tail
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.exp2(s - m_new)
            correction = tl.exp2(m_i - m_new)
            l_i = l_i * correction + tl.sum(p, 0)
            acc = acc * correction + tl.sum(p[:, None] * v, 0)
            m_i = m_new
        tl.store(O + b * stride_ob + h * stride_oh + offs_d, (acc / l_i).to(O.dtype.element_ty))


def plan_paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                      cap: tuple[int, int] | None) -> Launch:
    """The launch for compute capability `cap` (None: the interpreter): checks, a program per sequence and head."""
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    B, H, D = q.shape
    n_blocks, block_size, H_kv, Dc = k_cache.shape
    if k_cache.shape != v_cache.shape or Dc != D or H % H_kv:
        raise ValueError(f"caches must both be [N_blocks, block_size, H_kv, {D}] with H_kv dividing {H}, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not paged_kernel_fits(D, block_size):
        raise ValueError(f"head dim and block size must be powers of two, got {D} and {block_size}")
    if block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_tables must be [{B}, max_blocks] and seq_lens [{B}], got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches must be contiguous in the head dim, and the caches share strides")
    check_dtype(q.dtype, cap, "the paged decode kernel")
    block_tables, seq_lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    o = torch.empty_like(q)
    return Launch(_paged_decode_kernel, (B, H), (
        q, k_cache, v_cache, o, block_tables, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), o.stride(0), o.stride(1), LOG2E / math.sqrt(D)),
        dict(GROUP=H // H_kv, D=D, BLOCK_SIZE=block_size), out=o)


def paged_kernel_fits(head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes this shape: head dim and block size powers of two (tl.arange needs them)."""
    return head_dim > 0 and block_size > 0 and not head_dim & (head_dim - 1) and not block_size & (block_size - 1)


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           seq_lens: Tensor) -> Tensor:
    """The Triton kernel: same arguments and result as paged_attention_reference."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed here; use paged_attention_reference")
    if q.device.type != "cuda":
        require_interpreter()
    return plan_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, capability(q.device)).run()
