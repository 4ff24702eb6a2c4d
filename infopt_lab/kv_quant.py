"""An int8 KV cache: keys and values stored as int8 with one scale per head and position.

Same `update` and `attend` contract as `KVCache`: write a layer's new keys and values at
`input_pos`, get back that layer's cache up to the last written position, in the
compute dtype, ready for attention. Each head's [D] vector at each position is
scaled by its own absmax, so one outlier token cannot coarsen the others.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .config import ModelConfig
from . import validate
from .kv_cache import ContiguousCache, PagedPool, cache_slots, zeros_checked

SCALE_DTYPE = torch.float16   # scales in 16 bits: 2 bytes per head and position


def quantize_heads(x: Tensor) -> tuple[Tensor, Tensor]:
    """Absmax int8 over the last dim: x [B, H, T, D] -> (q int8 [B, H, T, D], scale [B, H, T])."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-6) / 127   # (B, H, T)
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(SCALE_DTYPE)


class QuantizedKVCache(ContiguousCache):
    """A contiguous int8 cache: k_q, v_q [L, B, H_kv, S, D] int8 and k_scale, v_scale [L, B, H_kv, S]."""

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        batch_size = validate.integer("batch_size", batch_size, low=1)
        self.max_seq_len = validate.integer("max_seq_len", max_seq_len or config.max_seq_len, low=1)
        self.dtype = dtype                                       # what `update` returns
        shape = (config.n_layers, batch_size, config.n_kv_heads, self.max_seq_len, config.head_dim)
        # k_q, v_q: (L, B, H_kv, S, D) int8; k_scale, v_scale: (L, B, H_kv, S)
        self.k_q, self.v_q, self.k_scale, self.v_scale = zeros_checked(
            [(shape, torch.int8)] * 2 + [(shape[:-1], SCALE_DTYPE)] * 2, device, "the int8 KV cache")

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None) -> "QuantizedKVCache":
        """A cache matching a model's config, compute dtype and device."""
        p = next(model.parameters())
        return cls(model.config, batch_size, max_seq_len, dtype=p.dtype, device=p.device)

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos: [T] consecutive positions, k/v: [B, H_kv, T, D]
        start, end = cache_slots(input_pos, k.shape[2], self.max_seq_len)
        self.k_q[layer, :, :, start:end], self.k_scale[layer, :, :, start:end] = quantize_heads(k)
        self.v_q[layer, :, :, start:end], self.v_scale[layer, :, :, start:end] = quantize_heads(v)
        return self._read(self.k_q, self.k_scale, layer, end), self._read(self.v_q, self.v_scale, layer, end)

    def _read(self, q: Tensor, scale: Tensor, layer: int, end: int) -> Tensor:
        # (B, H_kv, end, D) int8 * (B, H_kv, end, 1) -> compute dtype
        return (q[layer, :, :, :end].to(self.dtype) * scale[layer, :, :, :end, None].to(self.dtype))

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors, scales included."""
        return sum(t.numel() * t.element_size() for t in (self.k_q, self.v_q, self.k_scale, self.v_scale))


class QuantizedPagedKVCache(PagedPool):
    """The engine's block pool in int8 (`lab.Engine(..., kv_cache_dtype="int8")`): PagedKVCache's contract.

    k_q, v_q are [L, N_blocks, block_size, H_kv, D] int8 and k_scale, v_scale [L, N_blocks, block_size, H_kv],
    one scale per token and head, as in QuantizedKVCache: the same rounding, so a perplexity measured
    through QuantizedKVCache is the one this pool gives. `gather` dequantizes to the compute dtype.
    """

    def _allocate(self, shape: tuple[int, ...], device) -> None:
        self.k_q, self.v_q, self.k_scale, self.v_scale = zeros_checked(
            [(shape, torch.int8)] * 2 + [(shape[:-1], SCALE_DTYPE)] * 2, device, "the int8 paged KV pool")

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return self.k_q, self.v_q, self.k_scale, self.v_scale

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        # slots: [T] flat slot ids; k, v: [T, H_kv, D], quantized per token and head
        for q_pool, s_pool, x in ((self.k_q, self.k_scale, k), (self.v_q, self.v_scale, v)):
            q, scale = quantize_heads(x)                                    # (T, H_kv, D) int8, (T, H_kv)
            self._flat(q_pool, layer).index_copy_(0, slots, q)
            self._flat(s_pool, layer).index_copy_(0, slots, scale)

    def gather(self, layer: int, block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """Dequantized keys and values of each sequence, [B, H_kv, n_blocks * block_size, D]."""
        out = []
        for q_pool, s_pool in ((self.k_q, self.k_scale), (self.v_q, self.v_scale)):
            x = self._blocks(q_pool, layer, block_tables).to(self.dtype)    # (B, S, H_kv, D)
            x.mul_(self._blocks(s_pool, layer, block_tables).to(self.dtype).unsqueeze(-1))   # in place: one copy
            out.append(x.transpose(1, 2))
        return out[0], out[1]                                               # (B, H_kv, S, D) each
