"""The KV cache: keys and values of past tokens, kept so decoding never recomputes them."""
from __future__ import annotations

import torch
from torch import Tensor

from .config import ModelConfig


def cache_slots(input_pos: Tensor, n_new: int, max_seq_len: int) -> tuple[int, int]:
    """(start, end) of the slots that `n_new` tokens at consecutive `input_pos` occupy; checked."""
    start = int(input_pos[0])
    end = start + n_new
    if end > max_seq_len:
        raise ValueError(f"position {end - 1} is past the cache's {max_seq_len} slots")
    return start, end


class KVCache:
    """A contiguous cache preallocated for `max_seq_len` positions of every layer.

    Shape contract: k, v are [L, B, H_kv, S, D]; `update` writes the new keys and
    values of one layer at `input_pos` and returns that layer's cache up to the
    last written position, ready for attention.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.max_seq_len = max_seq_len or config.max_seq_len
        shape = (config.n_layers, batch_size, config.n_kv_heads, self.max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H_kv, S, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None) -> "KVCache":
        """A cache matching a model's config, dtype and device."""
        p = next(model.parameters())
        return cls(model.config, batch_size, max_seq_len, dtype=p.dtype, device=p.device)

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos: [T] consecutive positions, k/v: [B, H_kv, T, D]
        start, end = cache_slots(input_pos, k.shape[2], self.max_seq_len)
        self.k[layer, :, :, start:end] = k                          # (B, H_kv, T, D) written in place
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, H_kv, end, D)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
