"""The KV cache: keys and values of past tokens, kept so decoding never recomputes them.

Every cache the model can be handed implements `attend(layer, q, k, v, input_pos)`
(see `attention.py`). The contiguous caches (this float one and the int8 one in
`kv_quant.py`) do it the same way: `update` stores the new keys and values and
returns the layer's cache so far, then causal attention runs over it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import validate
from .attention import attend
from .config import ModelConfig
from .device import check_allocation


def zeros_checked(shapes_dtypes: list[tuple[tuple[int, ...], torch.dtype]], device, what: str) -> list[Tensor]:
    """Zero tensors of the given shapes, after checking that all of them together fit in the device's free memory."""
    nbytes = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in shapes_dtypes)
    check_allocation(nbytes, what, device)
    return [torch.zeros(s, dtype=d, device=device) for s, d in shapes_dtypes]


def take_blocks(pool: Tensor, block_tables: Tensor) -> Tensor:
    """The blocks a table lists, copied out of one layer's pool [N_blocks, block_size, ...] -> [B, n_blocks, ...].

    Each block is copied whole, as one row of the widest integer type its bytes divide into:
    indexing element by element (pool[block_tables]) costs 2-5x more on a CPU, most for int8 pools.
    """
    B, n = block_tables.shape
    rows = pool.reshape(pool.shape[0], -1)                                    # (N_blocks, block elements)
    row_bytes = rows.shape[1] * rows.element_size()
    for wide in (torch.int64, torch.int32, torch.int16):
        if wide.itemsize >= rows.element_size() and row_bytes % wide.itemsize == 0 \
                and rows.data_ptr() % wide.itemsize == 0:
            rows = rows.view(wide)
            break
    picked = rows.index_select(0, block_tables.reshape(-1))                   # (B * n, block bytes / width)
    return picked.view(pool.dtype).view(B, n, *pool.shape[1:])


def cache_slots(input_pos: Tensor, n_new: int, max_seq_len: int) -> tuple[int, int]:
    """(start, end) of the slots that `n_new` tokens at consecutive `input_pos` occupy; checked."""
    start = int(input_pos[0])
    end = start + n_new
    if end > max_seq_len:
        raise ValueError(f"position {end - 1} is past the cache's {max_seq_len} slots")
    return start, end


class ContiguousCache:
    """A cache with one preallocated row of `max_seq_len` positions per sequence; subclasses store it."""

    max_seq_len: int

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [B, H_kv, T, D] at `input_pos`; return the layer's keys and values up to there."""
        raise NotImplementedError

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """The attention contract: store the new keys and values, attend q [B, H, T, D] over the cache."""
        k, v = self.update(layer, input_pos, k, v)                  # (B, H_kv, S, D)
        return attend(q, k, v)                                       # (B, H, T, D)


class KVCache(ContiguousCache):
    """A contiguous cache preallocated for `max_seq_len` positions of every layer.

    Shape contract: k, v are [L, B, H_kv, S, D]; `update` writes the new keys and
    values of one layer at `input_pos` and returns that layer's cache up to the
    last written position, ready for attention.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        batch_size = validate.integer("batch_size", batch_size, low=1)
        self.max_seq_len = validate.integer("max_seq_len", max_seq_len or config.max_seq_len, low=1)
        shape = (config.n_layers, batch_size, config.n_kv_heads, self.max_seq_len, config.head_dim)
        self.k, self.v = zeros_checked([(shape, dtype)] * 2, device, "the KV cache")  # (L, B, H_kv, S, D) each

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


NULL_BLOCK = 0   # block 0 of every paged pool: never handed to a sequence; padding rows write their throw-away keys there


class PagedPool:
    """What every paged KV pool shares: [L, N_blocks, block_size, ...] tensors, their shape, the checks of both sizes.

    The pool owns `num_blocks` and `block_size`; the engine's block manager takes them from here.
    Subclasses allocate their tensors in `_allocate` and implement `write(layer, slots, k, v)` and
    `gather(layer, block_tables)`.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.num_blocks = validate.integer("num_blocks", num_blocks, low=2)      # NULL_BLOCK is the padding sink
        self.block_size = validate.integer("block_size", block_size, low=1, high=config.max_seq_len)
        self.n_kv_heads, self.head_dim, self.dtype = config.n_kv_heads, config.head_dim, dtype
        self._allocate((config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim), device)

    def _allocate(self, shape: tuple[int, ...], device) -> None:
        raise NotImplementedError

    @classmethod
    def for_model(cls, model, num_blocks: int | None, block_size: int = 16, reserve: tuple[int, int] = (1, 0)):
        """A block pool matching a model's config, dtype and device.

        `num_blocks=None` sizes it for `reserve` = (requests, tokens each) held at once, plus NULL_BLOCK.
        """
        p = next(model.parameters())
        if num_blocks is None:
            size = validate.integer("block_size", block_size, low=1, high=model.config.max_seq_len)
            num_blocks = reserve[0] * -(-reserve[1] // size) + 1
        return cls(model.config, num_blocks, block_size, dtype=p.dtype, device=p.device)

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool tensors (scales included, for a quantized pool)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def _flat(self, pool: Tensor, layer: int) -> Tensor:
        """One layer of a pool tensor with its slots in one dimension: [N_blocks * block_size, ...]."""
        return pool[layer].view(self.num_blocks * self.block_size, *pool.shape[3:])

    def _blocks(self, pool: Tensor, layer: int, block_tables: Tensor) -> Tensor:
        """The blocks each table lists, [B, n_blocks * block_size, ...] (slots in order)."""
        B, n = block_tables.shape
        return take_blocks(pool[layer], block_tables).view(B, n * self.block_size, *pool.shape[3:])


class PagedKVCache(PagedPool):
    """A pool of fixed-size KV blocks shared by all sequences (vLLM's layout).

    Shape contract: k, v are [L, N_blocks, block_size, H_kv, D]. A sequence owns a
    list of block ids (its block table); the token at position p lives in block
    table[p // block_size], row p % block_size. Nothing is reserved per sequence
    up front, so memory follows the tokens actually written.
    """

    def _allocate(self, shape: tuple[int, ...], device) -> None:
        self.k, self.v = zeros_checked([(shape, self.dtype)] * 2, device, "the paged KV pool")  # (L, N_blocks, block_size, H_kv, D)

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return self.k, self.v

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        # slots: [T] flat slot ids (block * block_size + row); k, v: [T, H_kv, D]
        self._flat(self.k, layer).index_copy_(0, slots, k)
        self._flat(self.v, layer).index_copy_(0, slots, v)

    def gather(self, layer: int, block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of each sequence, [B, H_kv, n_blocks * block_size, D], from tables [B, n_blocks]."""
        k = self._blocks(self.k, layer, block_tables)      # (B, S, H_kv, D)
        v = self._blocks(self.v, layer, block_tables)
        return k.transpose(1, 2), v.transpose(1, 2)        # (B, H_kv, S, D)
