"""One engine step on the model: pack every scheduled token into one row, attend over the paged cache.

All tokens of a step, prefill chunks and decode tokens of many sequences, go
through the linear layers together as one packed sequence [1, N]. Attention is
the only per-sequence part: short pieces (decode tokens, a draft to verify)
are attended as one padded batch over keys gathered through their block
tables; each longer prefill chunk attends causally over its own sequence's cache. With
cascade=True, blocks that every short piece's table starts with (a shared system prompt) are
gathered once and attended by all of them together, then merged with each piece's own blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import attend, shared_prefix_attend
from ..device import HAS_TRITON
from ..kv_cache import PagedKVCache
from .block_manager import BlockManager
from .scheduler import Batch

PAD_SLOT = 0  # block 0, row 0: where padding rows write their throw-away keys and values


@dataclass
class Piece:
    """A run of one sequence's tokens to feed in a step, from position `start`, and how many last rows give logits."""

    seq_id: int
    start: int
    ids: list[int]
    logits: int = 0          # logits for the last `logits` tokens (1: the next token; all: verifying a draft)


SHORT = 16  # pieces up to this long (decode tokens, drafts to verify) are attended as one padded batch
CASCADE_MIN_TOKENS = 64  # a shared prefix at least this long is read once for the whole batch (cascade=True)


class PagedAttention:
    """The attention of one step over the paged cache: the cache the model is handed (attention.py's contract)."""

    def __init__(self, cache: PagedKVCache, slots: Tensor, short_rows: Tensor | None,
                 short_tables: Tensor | None, short_lens: Tensor | None, short_mask: Tensor | None,
                 long: list[tuple[int, int, Tensor, int]], use_kernel: bool = False,
                 prefix_table: Tensor | None = None):
        self.cache = cache
        self.use_kernel = use_kernel          # single decode tokens through the Triton paged kernel, not the gather
        self.slots = slots                    # [N] flat cache slot of every token of the step
        self.short_rows = short_rows          # [B_s, T_s] rows of the packed step of each short piece (padded
                                              #   with its last row, which computes the same value again)
        self.short_tables = short_tables      # [B_s, n_blocks] block tables, padded with block 0
        self.short_lens = short_lens          # [B_s] cached tokens of each short piece, its new ones included
        self.short_mask = short_mask          # [B_s, 1, T_s, S] True where a query may see a cached key
        self.long = long                      # (first row, n tokens, block table [1, n_blocks], cached keys S)
        self.prefix_table = prefix_table      # [1, P] blocks every short piece starts with (then short_tables
                                              #   hold the blocks after them), or None

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Write the step's keys and values to their slots, then attend each sequence over its own cache."""
        # q: [1, H, N, D]; k, v: [1, H_kv, N, D] for the N tokens of this step (input_pos: their positions)
        self.cache.write(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, H_kv, D)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)                                                          # (1, H, N, D)
        if self.prefix_table is not None:
            qs = q[0][:, self.short_rows].transpose(0, 1)                                  # (B_s, H, T_s, D)
            y = shared_prefix_attend(qs, *self.cache.gather(layer, self.prefix_table),
                                     *self.cache.gather(layer, self.short_tables), self.short_mask)
            out[0][:, self.short_rows] = y.transpose(0, 1)
        elif self.short_rows is not None and self.use_kernel and self.short_rows.shape[1] == 1:
            from ..kernels.paged_attention import paged_decode_attention
            rows = self.short_rows[:, 0]
            qd = q[0, :, rows].transpose(0, 1).contiguous()                                # (B_s, H, D)
            y = paged_decode_attention(qd, self.cache.k[layer], self.cache.v[layer], self.short_tables,
                                       self.short_lens)                                    # (B_s, H, D)
            out[0, :, rows] = y.transpose(0, 1)
        elif self.short_rows is not None:
            kc, vc = self.cache.gather(layer, self.short_tables)                           # (B_s, H_kv, S, D)
            qs = q[0][:, self.short_rows].transpose(0, 1)                                  # (B_s, H, T_s, D)
            y = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=self.short_mask, enable_gqa=gqa)
            out[0][:, self.short_rows] = y.transpose(0, 1)                                 # (H, B_s, T_s, D)
        for start, n, table, S in self.long:
            kc, vc = self.cache.gather(layer, table)                                       # (1, H_kv, S', D)
            out[:, :, start:start + n] = attend(q[:, :, start:start + n], kc[:, :, :S], vc[:, :, :S])  # (1, H, n, D)
        return out


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, blocks: BlockManager, paged_kernel: bool | None = None,
                 cascade: bool = False):
        self.model, self.cache, self.blocks = model, cache, blocks
        self.cascade = cascade        # attend a prefix every short piece shares once for all of them
        self.device = next(model.parameters()).device
        # the Triton paged decode kernel on CUDA (compiled); the gather path elsewhere unless asked
        if paged_kernel and not HAS_TRITON:
            raise RuntimeError("paged_kernel=True needs Triton, which is not installed here; "
                               "leave paged_kernel=None for the gather path")
        if paged_kernel and not isinstance(cache, PagedKVCache):
            raise ValueError("paged_kernel=True reads a float pool; this engine's KV pool is quantized")
        self.paged_kernel = (HAS_TRITON and self.device.type == "cuda" and isinstance(cache, PagedKVCache)
                             if paged_kernel is None else paged_kernel)

    def run(self, batch: Batch) -> Tensor:
        """Logits [R, V] for the chunks that sample (those reaching their sequence's last token), in order."""
        pieces = [Piece(c.seq.seq_id, c.seq.num_computed, c.seq.all_ids[c.seq.num_computed:
                                                                          c.seq.num_computed + c.num_tokens],
                        int(c.samples)) for c in batch.chunks]
        return self.forward(pieces, padding=len(batch.padding))

    @torch.inference_mode()
    def forward(self, pieces: list[Piece], padding: int = 0) -> Tensor:
        """Logits [R, V] of every piece's last `logits` tokens, in order, in one packed pass.

        `padding` single-token rows are computed and thrown away (a static batch's finished members).
        """
        ids, pos, slots, out_rows = [], [], [], []
        short, long = [], []
        for p in pieces:
            n, row = len(p.ids), len(ids)
            ids += p.ids
            pos += range(p.start, p.start + n)
            slots += [self.blocks.slot(p.seq_id, x) for x in range(p.start, p.start + n)]
            table = self.blocks.block_table(p.seq_id)
            if n <= SHORT:
                short.append((row, n, p.start, table))
            else:
                long.append((row, n, self._tensor([table]), p.start + n))
            out_rows += range(row + n - p.logits, row + n)
        for _ in range(padding):                  # finished rows of a static batch: computed, discarded
            short.append((len(ids), 1, 0, [0]))
            ids.append(0), pos.append(0), slots.append(PAD_SLOT)
        shared = self._shared_prefix(short) if self.cascade and not padding else 0
        prefix_table = self._tensor([short[0][3][:shared]]) if shared else None
        short = [(r, n, s, t[shared:]) for r, n, s, t in short]
        meta = self._short_meta(short, shared * self.blocks.block_size)
        ctx = PagedAttention(self.cache, self._tensor(slots), *meta, long, use_kernel=self.paged_kernel,
                             prefix_table=prefix_table)
        h = self.model.hidden_states(self._tensor([ids]), self._tensor(pos), ctx)         # (1, N, C)
        return self.model.logits(h[0, self._tensor(out_rows)])                             # (R, V)

    def _tensor(self, values) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _shared_prefix(self, short: list[tuple[int, int, int, list[int]]]) -> int:
        """How many leading blocks every short piece's table shares, all of them before its new tokens
        (so each of its queries sees them in full); 0 if that is under CASCADE_MIN_TOKENS or one piece."""
        if len(short) < 2:
            return 0
        size = self.blocks.block_size
        first = short[0][3]
        shared = min(start // size for _, _, start, _ in short)
        for *_, table in short[1:]:
            i = 0
            while i < shared and table[i] == first[i]:
                i += 1
            shared = i
        return shared if shared * size >= CASCADE_MIN_TOKENS else 0

    def _short_meta(self, short: list[tuple[int, int, int, list[int]]], offset: int = 0):
        """Rows, padded block tables, lengths and masks of the short pieces (first row, n, start, table);
        `offset` is the position of each table's first block (past a shared prefix)."""
        if not short:
            return None, None, None, None
        T = max(n for _, n, _, _ in short)
        width = max(len(t) for *_, t in short)
        rows = self._tensor([[r + min(i, n - 1) for i in range(T)] for r, n, _, _ in short])       # (B_s, T_s)
        qpos = self._tensor([[s + min(i, n - 1) for i in range(T)] for _, n, s, _ in short])       # (B_s, T_s)
        tables = self._tensor([t + [0] * (width - len(t)) for *_, t in short])                     # (B_s, n_blocks)
        keys = offset + torch.arange(width * self.blocks.block_size, device=self.device)
        mask = keys[None, None, :] <= qpos[:, :, None]                                             # (B_s, T_s, S)
        lens = self._tensor([s + n - offset for _, n, s, _ in short])
        return rows, tables, lens, mask[:, None]
