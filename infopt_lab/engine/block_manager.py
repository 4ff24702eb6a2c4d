"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, a block table per sequence.

A sequence asks for room one token (or one prefill chunk) at a time; a new
block is taken from the free list only when its last block is full, so at most
block_size - 1 slots per sequence are ever empty. NULL_BLOCK (block 0) is never
handed out: padding rows write their throw-away keys and values there.

With prefix caching (vLLM's automatic prefix caching), every full block of
computed tokens gets a key: a hash of its parent block's key and its own token
ids, so a key names the whole prefix up to the block's end. A new sequence
whose first blocks' keys are cached shares those blocks (a reference count per
block) instead of computing them. A cached block no sequence holds stays
cached, and is evicted least recently used only when the free list is empty.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from .. import validate
from ..kv_cache import NULL_BLOCK


class OutOfBlocks(RuntimeError):
    """The free list cannot cover a request for blocks; nothing was changed."""


def block_key(parent: bytes, token_ids) -> bytes:
    """The key of a full block: sha256 of its parent's key and its token ids (collisions are not a concern)."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockManager:
    """Which blocks of a paged pool each sequence holds; `for_pool` takes the pool's sizes (the pool owns them)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        self.num_blocks = validate.integer("num_blocks", num_blocks, low=2)    # NULL_BLOCK is reserved
        self.block_size = validate.integer("block_size", block_size, low=1)
        self.enable_prefix_caching = validate.boolean("enable_prefix_caching", enable_prefix_caching)
        self.free_blocks: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self.tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}
        self.refs = [0] * num_blocks                       # sequences holding each block
        self.cached: dict[bytes, int] = {}                 # key -> block holding that prefix's last block
        self.key_of: dict[int, bytes] = {}                 # block -> its key, for cached blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()   # cached, held by none; least recently used first
        self.keys: dict[int, list[bytes]] = {}             # each sequence's chain of full-block keys so far

    @classmethod
    def for_pool(cls, pool, enable_prefix_caching: bool = False) -> "BlockManager":
        """The manager of a paged KV pool's blocks (PagedPool): its number and size, as the pool has them."""
        return cls(pool.num_blocks, pool.block_size, enable_prefix_caching)

    @property
    def capacity(self) -> int:
        """Blocks sequences can hold (all but the reserved padding block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take: never used or evicted, plus cached blocks no sequence holds."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose key is cached (held or evictable)."""
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq_id: int, more_tokens: int) -> int:
        """New blocks a sequence needs to hold `more_tokens` more tokens."""
        have = self.num_tokens.get(seq_id, 0)
        return self.blocks_for(have + more_tokens) - len(self.tables.get(seq_id, ()))

    def can_append(self, seq_id: int, more_tokens: int) -> bool:
        return self.extra_blocks(seq_id, more_tokens) <= self.num_free

    # -- prefix caching ----------------------------------------------------------------
    def match(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest cached prefix of `token_ids`, leaving at least its last token out.

        The last token is always computed, to give the logits of the next one; so is every
        token of a block that holds it, as a cached block is never written.
        """
        if not self.enable_prefix_caching:
            return []
        hit, key = [], b""
        for i in range((len(token_ids) - 1) // self.block_size):
            key = block_key(key, token_ids[i * self.block_size:(i + 1) * self.block_size])
            if key not in self.cached:
                break
            hit.append(self.cached[key])
        return hit

    def can_allocate(self, hit: list[int], num_tokens: int) -> bool:
        """Whether a new sequence can hold num_tokens tokens, its first blocks the cached `hit` ones."""
        reclaimed = sum(1 for b in hit if self.refs[b] == 0)          # evictable now, held once taken
        return self.blocks_for(num_tokens) - len(hit) + reclaimed <= self.num_free

    def commit(self, seq_id: int, token_ids: list[int]) -> None:
        """Cache every full block of a sequence's computed tokens `token_ids` that is not cached yet."""
        if not self.enable_prefix_caching:
            return
        keys, table = self.keys[seq_id], self.tables[seq_id]
        for i in range(len(keys), len(token_ids) // self.block_size):
            key = block_key(keys[-1] if keys else b"", token_ids[i * self.block_size:(i + 1) * self.block_size])
            keys.append(key)
            if key not in self.cached and table[i] not in self.key_of:   # a twin computed elsewhere stays uncached
                self.cached[key], self.key_of[table[i]] = table[i], key

    # -- a sequence's table --------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, hit: list[int] = ()) -> list[int]:
        """A block table for a new sequence holding num_tokens tokens, its first blocks the cached `hit` ones."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds blocks; use append")
        num_tokens = validate.integer("num_tokens", num_tokens, low=1)
        if len(hit) * self.block_size >= num_tokens:
            raise ValueError(f"{len(hit)} cached blocks leave none of {num_tokens} tokens to compute")
        if not self.can_allocate(list(hit), num_tokens):
            raise OutOfBlocks(f"sequence {seq_id} needs {self.blocks_for(num_tokens) - len(hit)} more blocks, "
                              f"{self.num_free} are free")
        for b in hit:
            self._hold(b)
        self.tables[seq_id], self.keys[seq_id] = list(hit), [self.key_of[b] for b in hit]
        self.num_tokens[seq_id] = len(hit) * self.block_size
        return self.append(seq_id, num_tokens - self.num_tokens[seq_id])

    def append(self, seq_id: int, more_tokens: int = 1) -> list[int]:
        """Room for `more_tokens` more tokens of a sequence; returns its block table."""
        if seq_id not in self.tables:
            raise KeyError(f"sequence {seq_id} holds no blocks; allocate first")
        self._check(seq_id, more_tokens)
        table = self.tables[seq_id]
        for _ in range(self.extra_blocks(seq_id, more_tokens)):
            table.append(self._take())
        self.num_tokens[seq_id] += more_tokens
        return table

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep room for only the first num_tokens tokens (a rejected draft's slots): later blocks are freed."""
        table = self.tables[seq_id]
        if not 0 <= num_tokens <= self.num_tokens[seq_id]:
            raise ValueError(f"sequence {seq_id} holds {self.num_tokens[seq_id]} tokens; cannot keep {num_tokens}")
        keep = self.blocks_for(num_tokens)
        if num_tokens < len(self.keys[seq_id]) * self.block_size:
            raise ValueError(f"sequence {seq_id}'s first {len(self.keys[seq_id])} blocks are committed; "
                             f"cannot keep only {num_tokens} tokens")
        for b in reversed(table[keep:]):
            self._release(b)
        del table[keep:]
        self.num_tokens[seq_id] = num_tokens

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (a no-op for one that holds none); cached ones stay cached."""
        for b in reversed(self.tables.pop(seq_id, ())):    # the tail first: evicted before the shared head
            self._release(b)
        self.num_tokens.pop(seq_id, None)
        self.keys.pop(seq_id, None)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def slot(self, seq_id: int, position: int) -> int:
        """Flat cache slot of a sequence's token at `position`."""
        return self.tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def _take(self) -> int:
        """A block for new tokens: a free one, else the least recently used cached block no one holds."""
        if self.free_blocks:
            b = self.free_blocks.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of.pop(b)]
        self.refs[b] = 1
        return b

    def _hold(self, b: int) -> None:
        self.evictable.pop(b, None)
        self.refs[b] += 1

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.key_of:
                self.evictable[b] = None                   # most recently used: evicted last
            else:
                self.free_blocks.append(b)

    def _check(self, seq_id: int, more_tokens: int) -> None:
        need = self.extra_blocks(seq_id, more_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} more blocks, {self.num_free} are free")
