"""One engine step on the model: pack every scheduled token into one row, attend over the paged cache.

All tokens of a step, prefill chunks and decode tokens of many sequences, go
through the linear layers together as one packed sequence [1, N]. Attention is
the only per-sequence part: short chunks (decode tokens, a draft to verify)
are attended as one padded batch over keys gathered through their block
tables; each longer prefill chunk attends causally over its own sequence's cache. With
cascade=True, blocks that every short chunk's table starts with (a shared system prompt) are
gathered once and attended by all of them together, then merged with each chunk's own blocks.

The runner reads sequences and block tables and returns data (`execute_model`: each sequence's
sampled token); only the scheduler changes a sequence (`Scheduler.update_from_output`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import attend, shared_prefix_attend
from ..device import HAS_TRITON
from ..invariant import invariant
from ..kernels.paged_attention import paged_kernel_fits
from ..kv_cache import NULL_BLOCK, PagedKVCache, PagedPool
from .block_manager import BlockManager
from .scheduler import Batch
from .sequence import Chunk, SeqOutput, Sequence

SHORT = 16  # chunks up to this long (decode tokens, drafts to verify) are attended as one padded batch
CASCADE_MIN_TOKENS = 64  # a shared prefix at least this long is read once for the whole batch (cascade=True)

PAGED_KERNEL, GATHER, CASCADE = "paged kernel", "gather", "cascade"   # how a step's decode tokens attend
COMPILED = "compiled"   # a step of single decode tokens through the compiled graph (compile=True)

Sampler = Callable[[Tensor, list[Sequence]], list[int]]   # logits (R, V), one sequence per row -> a token per row


class ShortPiece(NamedTuple):
    """A short chunk's place in the packed step."""

    row: int            # its first row in the packed step
    n: int              # its tokens
    start: int          # position of its first token
    table: list[int]    # its block table


class LongPiece(NamedTuple):
    """A long (prefill) chunk's place in the packed step, attended causally over its own cache."""

    row: int            # its first row in the packed step
    n: int              # its tokens
    table: Tensor       # [1, n_blocks] its block table
    keys: int           # cached keys it attends over (its new tokens included)


@dataclass
class AttentionMetadata:
    """Where every token of a step goes in the paged cache and what each one attends over (vLLM's name)."""

    slots: Tensor                          # [N] flat cache slot of every token of the step
    long: list[LongPiece] = field(default_factory=list)
    short_rows: Tensor | None = None       # [B_s, T_s] rows of the packed step of each short chunk (padded with
                                           #   its last row, which computes the same value again)
    short_tables: Tensor | None = None     # [B_s, n_blocks] block tables, padded with NULL_BLOCK
    short_lens: Tensor | None = None       # [B_s] cached tokens of each short chunk, its new ones included
    short_mask: Tensor | None = None       # [B_s, 1, T_s, S] True where a query may see a cached key
    prefix_table: Tensor | None = None     # [1, P] blocks every short chunk starts with (then short_tables hold
                                           #   the blocks after them), or None


class PagedAttention:
    """The attention of one step over the paged cache: the cache the model is handed (attention.py's contract)."""

    def __init__(self, cache: PagedPool, meta: AttentionMetadata, use_kernel: bool = False):
        self.cache, self.meta = cache, meta
        self.use_kernel = use_kernel          # single decode tokens through the Triton paged kernel, not the gather
        self.decode_path: str | None = None   # what a step of single decode tokens ran: PAGED_KERNEL or GATHER

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Write the step's keys and values to their slots, then attend each sequence over its own cache."""
        # q: [1, H, N, D]; k, v: [1, H_kv, N, D] for the N tokens of this step (input_pos: their positions)
        m = self.meta
        self.cache.write(layer, m.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))     # (N, H_kv, D)
        out = torch.empty_like(q)                                                          # (1, H, N, D)
        if m.short_rows is not None:
            self._short(layer, q, out, gqa=q.shape[1] != k.shape[1])
        for start, n, table, S in m.long:
            kc, vc = self.cache.gather(layer, table)                                       # (1, H_kv, S', D)
            out[:, :, start:start + n] = attend(q[:, :, start:start + n], kc[:, :, :S], vc[:, :, :S])  # (1, H, n, D)
        return out

    def _short(self, layer: int, q: Tensor, out: Tensor, gqa: bool) -> None:
        """Attend every short chunk at once: cascade over a shared prefix, the paged kernel, or a gather."""
        m = self.meta
        if m.prefix_table is None and self.use_kernel and m.short_rows.shape[1] == 1:
            from ..kernels.paged_attention import paged_decode_attention
            rows = m.short_rows[:, 0]
            qd = q[0, :, rows].transpose(0, 1).contiguous()                                # (B_s, H, D)
            y = paged_decode_attention(qd, self.cache.k[layer], self.cache.v[layer], m.short_tables,
                                       m.short_lens)                                       # (B_s, H, D)
            out[0, :, rows] = y.transpose(0, 1)
            self.decode_path = PAGED_KERNEL
            return
        if m.short_rows.shape[1] == 1:
            self.decode_path = CASCADE if m.prefix_table is not None else GATHER
        qs = q[0][:, m.short_rows].transpose(0, 1)                                         # (B_s, H, T_s, D)
        if m.prefix_table is not None:
            y = shared_prefix_attend(qs, *self.cache.gather(layer, m.prefix_table),
                                     *self.cache.gather(layer, m.short_tables), m.short_mask)
        else:
            kc, vc = self.cache.gather(layer, m.short_tables)                              # (B_s, H_kv, S, D)
            y = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=m.short_mask, enable_gqa=gqa)
        out[0][:, m.short_rows] = y.transpose(0, 1)                                        # (H, B_s, T_s, D)


class CompiledPagedLayer:
    """One layer's paged pool for a compiled decode step: every tensor of a fixed shape, whatever the step holds.

    B rows, one decode token each (padding rows write to NULL_BLOCK), each attending over W * block_size
    key slots (its block table padded with NULL_BLOCK) under a mask of its length: the step's shapes depend
    only on B and W, so one graph per batch bucket serves every step (the shapes a CUDA graph replays).
    """

    def __init__(self, pool: PagedKVCache, layer: int, slots: Tensor, key_slots: Tensor, mask: Tensor):
        self.k = pool._flat(pool.k, layer)            # (N_blocks * block_size, H_kv, D) views
        self.v = pool._flat(pool.v, layer)
        self.slots, self.key_slots, self.mask = slots, key_slots, mask   # [B], [B, S], [B, 1, 1, S]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        # q: [1, H, B, D]; k, v: [1, H_kv, B, D], one token per sequence
        self.k.index_copy_(0, self.slots, k[0].transpose(0, 1))                           # (B, H_kv, D)
        self.v.index_copy_(0, self.slots, v[0].transpose(0, 1))
        kc = self.k[self.key_slots].transpose(1, 2)                                      # (B, H_kv, S, D)
        vc = self.v[self.key_slots].transpose(1, 2)
        qs = q[0].transpose(0, 1).unsqueeze(2)                                           # (B, H, 1, D)
        y = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=self.mask, enable_gqa=q.shape[1] != k.shape[1])
        return y.squeeze(2).transpose(0, 1).unsqueeze(0)                                 # (1, H, B, D)


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes a compiled decode step is built for: powers of two below max_batch_size, and it."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


class ModelRunner:
    """Runs a model over packed chunks of many sequences, against a paged pool and its block tables."""

    def __init__(self, model, cache: PagedPool, blocks: BlockManager, paged_kernel: bool | None = None,
                 cascade: bool = False, batch_invariant: bool = False, compile_shape: tuple[int, int] | None = None):
        if blocks.block_size != cache.block_size or blocks.num_blocks != cache.num_blocks:
            raise ValueError(f"the block manager has {blocks.num_blocks} blocks of {blocks.block_size} tokens but "
                             f"the pool {cache.num_blocks} of {cache.block_size}; build it with BlockManager.for_pool")
        self.model, self.cache, self.blocks = model, cache, blocks
        self.cascade = cascade        # attend a prefix every short chunk shares once for all of them
        self.batch_invariant = batch_invariant   # every row computed as if alone (invariant.py)
        self.device = next(model.parameters()).device
        self.paged_kernel_asked = paged_kernel      # what the engine was asked; a draft runner is asked the same
        self.paged_kernel, self.gather_reason = self._choose_decode_path(paged_kernel)
        self.decode_steps: dict[str, int] = {}     # steps whose decode tokens took each path ("paged kernel", ...)
        # compile_shape = (max_batch_size, blocks per sequence): steps of single decode tokens run compiled
        self.compiled, self.compile_reason, self.buckets, self.width = None, "compile=False", [], 0
        if compile_shape is not None:
            self._set_up_compile(*compile_shape)

    def _set_up_compile(self, max_batch_size: int, width: int) -> None:
        """Compile decode steps (compiled.py) at every batch bucket, where this runner's options allow it."""
        from ..compiled import compile_model
        if not isinstance(self.cache, PagedKVCache):
            self.compile_reason = "a quantized KV pool: its steps run eagerly"
        elif self.batch_invariant:
            raise ValueError("compile=True runs the fast kernels of the compiled graph; batch_invariant=True runs "
                             "each row alone in eager code: choose one")
        else:
            self.compiled, self.compile_reason = compile_model(self.model), None
            self.buckets, self.width = batch_buckets(max_batch_size), width

    def _choose_decode_path(self, paged_kernel: bool | None) -> tuple[bool, str | None]:
        """Whether single decode tokens go through the Triton paged kernel for this model, and why not.

        None: on where it compiles for real (CUDA) and this model's shape allows it. True: on wherever
        the shape allows (the interpreter on a CPU). A shape the kernel cannot take (the bundled draft's
        head dim 24) takes the gather path, per model, and says so in `gather_reason`.
        """
        if paged_kernel and not HAS_TRITON:
            raise RuntimeError("paged_kernel=True needs Triton, which is not installed here; "
                               "leave paged_kernel=None for the gather path")
        if paged_kernel and not isinstance(self.cache, PagedKVCache):
            raise ValueError("paged_kernel=True reads a float pool; this engine's KV pool is quantized")
        if paged_kernel and self.batch_invariant:
            raise ValueError("paged_kernel=True attends many sequences in one kernel; batch_invariant=True needs "
                             "each query alone")
        head_dim = self.model.config.head_dim
        if paged_kernel is False:
            return False, "paged_kernel=False"
        if paged_kernel is None and not (HAS_TRITON and self.device.type == "cuda"):
            return False, "the paged kernel compiles only on CUDA (paged_kernel=True runs it interpreted)"
        if paged_kernel is None and (not isinstance(self.cache, PagedKVCache) or self.batch_invariant):
            return False, "a quantized pool or batch_invariant=True"
        if not paged_kernel_fits(head_dim, self.cache.block_size):
            return False, (f"the paged kernel takes powers of two; this model's head dim is {head_dim} and the "
                           f"block size {self.cache.block_size}")
        return True, None

    def execute_model(self, batch: Batch, sample: Sampler) -> dict[Sequence, SeqOutput]:
        """Run a scheduled batch and sample after every chunk that reaches its sequence's end (vLLM's name).

        Returns what happened to each sequence as data; no sequence is changed.
        """
        logits = self.forward(batch.chunks, padding=len(batch.padding))           # (R, V): a row per sampling chunk
        sampling = [c.seq for c in batch.chunks if c.logits]
        tokens = dict(zip(sampling, sample(logits, sampling)))
        return {c.seq: SeqOutput([tokens[c.seq]] if c.seq in tokens else [], c.num_tokens) for c in batch.chunks}

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], padding: int = 0, features: Tensor | None = None,
                with_hidden: bool = False):
        """Logits [R, V] of every chunk's last `logits` tokens, in order, in one packed pass.

        `padding` single-token rows are computed and thrown away (a static batch's finished members).
        A feature draft (feature_draft.py) is also handed `features` [N, C], one per packed token, and its
        "logits" are over its covered tokens. `with_hidden=True` returns (logits, hidden states [N, C] of
        every packed token): the target's features that a feature draft reads.
        """
        if features is None and not with_hidden \
                and self.compiled is not None and self.compiled.failed is None and not self.cascade \
                and all(c.num_tokens == 1 and c.logits == 1 for c in chunks) \
                and len(chunks) + padding <= self.buckets[-1]:
            return self._compiled_decode(chunks)
        ids, pos, slots, out_rows = [], [], [], []
        short, long = [], []
        for c in chunks:
            n, row, sid = c.num_tokens, len(ids), c.seq.seq_id
            ids += c.ids
            pos += range(c.start, c.start + n)
            slots += [self.blocks.slot(sid, x) for x in range(c.start, c.start + n)]
            table = self.blocks.block_table(sid)
            if n <= SHORT:
                short.append(ShortPiece(row, n, c.start, table))
            else:
                long.append(LongPiece(row, n, self._tensor([table]), c.start + n))
            out_rows += range(row + n - c.logits, row + n)
        for _ in range(padding):                  # finished rows of a static batch: computed, discarded
            short.append(ShortPiece(len(ids), 1, 0, [NULL_BLOCK]))
            ids.append(0), pos.append(0), slots.append(NULL_BLOCK * self.blocks.block_size)
        meta = self._metadata(short, long, slots, cascade=self.cascade and not padding)
        ctx = PagedAttention(self.cache, meta, use_kernel=self.paged_kernel)
        with invariant(self.batch_invariant):
            if features is None:
                h = self.model.hidden_states(self._tensor([ids]), self._tensor(pos), ctx)     # (1, N, C)
            else:
                h = self.model.hidden(features[None], self._tensor([ids]), self._tensor(pos), ctx)
            logits = self.model.logits(h[0, self._tensor(out_rows)])                       # (R, V)
        if ctx.decode_path is not None:
            self.decode_steps[ctx.decode_path] = self.decode_steps.get(ctx.decode_path, 0) + 1
        return (logits, h[0, :len(h[0]) - padding]) if with_hidden else logits

    def _compiled_decode(self, chunks: list[Chunk]) -> Tensor:
        """Logits [R, V] of a step of single decode tokens, run through the compiled graph at its batch bucket."""
        B = next(b for b in self.buckets if b >= len(chunks))
        size = self.blocks.block_size
        ids, pos, slots, tables, lens = [], [], [], [], []
        for c in chunks:
            table = self.blocks.block_table(c.seq.seq_id)
            ids.append(c.ids[0]), pos.append(c.start), lens.append(c.start + 1)
            slots.append(self.blocks.slot(c.seq.seq_id, c.start))
            tables.append(table + [NULL_BLOCK] * (self.width - len(table)))
        for _ in range(B - len(chunks)):       # padding rows: a throw-away token in NULL_BLOCK, seeing itself
            ids.append(0), pos.append(0), lens.append(1), slots.append(NULL_BLOCK * size)
            tables.append([NULL_BLOCK] * self.width)
        offsets = torch.arange(size, device=self.device)
        key_slots = (self._tensor(tables)[:, :, None] * size + offsets).reshape(B, -1)      # (B, S)
        keys = torch.arange(self.width * size, device=self.device)
        mask = (keys[None, :] < self._tensor(lens)[:, None])[:, None, None]                 # (B, 1, 1, S)
        slots_t = self._tensor(slots)
        layers = [CompiledPagedLayer(self.cache, i, slots_t, key_slots, mask) for i in range(len(self.model.layers))]
        logits = self.compiled.step(self._tensor([ids]), self._tensor(pos), layers)[0, :len(chunks)]   # (R, V)
        self.decode_steps[COMPILED] = self.decode_steps.get(COMPILED, 0) + 1
        return logits

    def _tensor(self, values) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _metadata(self, short: list[ShortPiece], long: list[LongPiece], slots: list[int],
                  cascade: bool) -> AttentionMetadata:
        """The step's attention metadata; with `cascade`, a prefix every short chunk shares is split off."""
        meta = AttentionMetadata(self._tensor(slots), long)
        if not short:
            return meta
        shared = self._shared_prefix(short) if cascade else 0
        if shared:
            meta.prefix_table = self._tensor([short[0].table[:shared]])
            short = [p._replace(table=p.table[shared:]) for p in short]
        offset = shared * self.blocks.block_size      # position of each remaining table's first block
        T = max(p.n for p in short)
        width = max(len(p.table) for p in short)
        meta.short_rows = self._tensor([[p.row + min(i, p.n - 1) for i in range(T)] for p in short])   # (B_s, T_s)
        qpos = self._tensor([[p.start + min(i, p.n - 1) for i in range(T)] for p in short])           # (B_s, T_s)
        meta.short_tables = self._tensor([p.table + [NULL_BLOCK] * (width - len(p.table)) for p in short])
        keys = offset + torch.arange(width * self.blocks.block_size, device=self.device)
        meta.short_mask = (keys[None, None, :] <= qpos[:, :, None])[:, None]                         # (B_s, 1, T_s, S)
        meta.short_lens = self._tensor([p.start + p.n - offset for p in short])
        return meta

    def _shared_prefix(self, short: list[ShortPiece]) -> int:
        """How many leading blocks every short chunk's table shares, all of them before its new tokens
        (so each of its queries sees them in full); 0 if that is under CASCADE_MIN_TOKENS or one chunk."""
        if len(short) < 2:
            return 0
        size = self.blocks.block_size
        first = short[0].table
        shared = min(p.start // size for p in short)
        for p in short[1:]:
            i = 0
            while i < shared and p.table[i] == first[i]:
                i += 1
            shared = i
        return shared if shared * size >= CASCADE_MIN_TOKENS else 0
