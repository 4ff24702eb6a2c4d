"""Attention in plain PyTorch: the naive version that materializes every score, and the tiled one.

Shapes: q [B, H, N, D]; k, v [B, H_kv, N_k, D] with H a multiple of H_kv (grouped-query
attention: query head h reads KV head h // (H / H_kv)). With causal=True and N < N_k (new
queries after cached keys) query i sits at position N_k - N + i and sees keys 0..N_k - N + i,
the bottom-right alignment a decode step needs.

Memory traffic of the naive version, per (batch, head), in elements:
  S = Q K^T    reads N*D + N_k*D, writes N*N_k      <- the N x N_k matrix, in memory
  P = softmax  reads N*N_k,       writes N*N_k      <- a second one
  O = P V      reads N*N_k + N_k*D, writes N*D
so it moves O(N * N_k) bytes and holds two N x N_k matrices at once. The tiled version
(and the Triton kernel) keeps one [BLOCK_M, BLOCK_N] tile of scores at a time, plus a
running max and sum per query row: O(N * D) memory.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import validate
from ..attention import causal_mask


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """Raise TypeError or ValueError naming the first type, shape, dtype or device mismatch."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        validate.tensor(name, x, floating=True)          # [B, H, N, D], checked below
    validate.boolean("causal", causal)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, N, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (B, H, N, D), (Bk, H_kv, N_k, Dk) = q.shape, k.shape
    if B != Bk or D != Dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head dim")
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({H_kv})")
    if N < 1 or N_k < 1:
        raise ValueError(f"query and key lengths must be >= 1, got {N} and {N_k}")
    if causal and N > N_k:
        raise ValueError(f"causal attention needs at least as many keys as queries, got {N} queries, {N_k} keys")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _expand_kv(k: Tensor, n_heads: int) -> Tensor:
    return k.repeat_interleave(n_heads // k.shape[1], dim=1)          # (B, H, N_k, D)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """Naive attention: materialize the [B, H, N, N_k] scores, softmax them, multiply by V (fp32 inside)."""
    check_attention_inputs(q, k, v, causal)
    H, D = q.shape[1], q.shape[-1]
    k, v = _expand_kv(k, H).float(), _expand_kv(v, H).float()
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(D)           # (B, H, N, N_k): written to memory
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = scores.softmax(dim=-1)                                     # (B, H, N, N_k): a second one
    return (probs @ v).to(q.dtype)                                     # (B, H, N, D)


def attention_tiled(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                    block_m: int = 64, block_n: int = 64) -> Tensor:
    """The same result one [block_m, block_n] tile of scores at a time, with an online softmax.

    For each tile of queries, walk the key tiles keeping per row: m (the largest score so far),
    l (the sum of exp(score - m)) and acc (the sum of exp(score - m) * v). When a tile raises the
    max from m to m_new, the old sums are rescaled by exp(m - m_new); at the end O = acc / l.
    This is what the Triton kernel does in each program.
    """
    check_attention_inputs(q, k, v, causal)
    B, H, N, D = q.shape
    N_k, offset = k.shape[2], k.shape[2] - q.shape[2]
    k, v = _expand_kv(k, H).float(), _expand_kv(v, H).float()
    out = torch.empty(B, H, N, D, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(D)
    for i0 in range(0, N, block_m):
        qi = q[:, :, i0:i0 + block_m].float()                          # (B, H, bm, D)
        rows = torch.arange(i0, i0 + qi.shape[2], device=q.device)
        m = torch.full(qi.shape[:3], float("-inf"), device=q.device)   # (B, H, bm) running max
        l = torch.zeros(qi.shape[:3], device=q.device)                 # running sum of exp(s - m)
        acc = torch.zeros_like(qi)                                     # running sum of exp(s - m) * v
        hi = min(N_k, i0 + qi.shape[2] + offset) if causal else N_k   # later keys are all masked
        for j0 in range(0, hi, block_n):
            s = qi @ k[:, :, j0:j0 + block_n].transpose(-1, -2) * scale   # (B, H, bm, bn): one tile
            if causal:
                cols = torch.arange(j0, j0 + s.shape[-1], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None] + offset, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)                          # rescale what was summed so far
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + p @ v[:, :, j0:j0 + block_n]
            m = m_new
        out[:, :, i0:i0 + qi.shape[2]] = acc / l[..., None]
    return out.to(q.dtype)


class _AllocationTracker(TorchDispatchMode):
    """Counts the bytes of every tensor the ops inside allocate, and the peak held at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if nbytes == 0:
                    continue
                self.seen.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key, nbytes)
        return out


def peak_intermediate_bytes(fn, *args, **kwargs) -> int:
    """Measured: the most bytes of tensors allocated by fn(*args) held at one time (its output included).

    On CUDA this is the allocator's peak above what was allocated before the call; elsewhere
    every op's output tensors are counted as they are created and released.
    """
    first = next(a for a in args if isinstance(a, Tensor))
    if first.is_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak
    with _AllocationTracker() as tracker:
        out = fn(*args, **kwargs)
    del out
    return tracker.peak
