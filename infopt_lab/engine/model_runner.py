"""One engine step on the model: pack every scheduled token into one row, attend over the paged cache.

All tokens of a step, prefill chunks and decode tokens of many sequences, go
through the linear layers together as one packed sequence [1, N]. Attention is
the only per-sequence part: decode tokens are attended as one padded batch
over keys gathered through their block tables; each prefill chunk attends
causally over its own sequence's cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import attend
from ..device import HAS_TRITON
from ..kv_cache import PagedKVCache
from .block_manager import BlockManager
from .scheduler import Batch

PAD_SLOT = 0  # block 0, row 0: where padding rows write their throw-away keys and values


class PagedAttention:
    """The attention of one step over the paged cache: the cache the model is handed (attention.py's contract)."""

    def __init__(self, cache: PagedKVCache, slots: Tensor, decode_rows: Tensor | None,
                 decode_tables: Tensor | None, decode_lens: Tensor | None, decode_mask: Tensor | None,
                 prefill: list[tuple[int, int, Tensor, Tensor | None]], use_kernel: bool = False):
        self.cache = cache
        self.use_kernel = use_kernel          # decode rows through the Triton paged kernel, not the gather
        self.slots = slots                    # [N] flat cache slot of every token of the step
        self.decode_rows = decode_rows        # [B_dec] rows of the packed step that are single tokens
        self.decode_tables = decode_tables    # [B_dec, n_blocks] block tables, padded with block 0
        self.decode_lens = decode_lens        # [B_dec] cached tokens of each decode row, the new one included
        self.decode_mask = decode_mask        # [B_dec, 1, 1, S] True where a cached key is real
        self.prefill = prefill                # (first row, n tokens, block table [1, n_blocks], cached keys S)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Write the step's keys and values to their slots, then attend each sequence over its own cache."""
        # q: [1, H, N, D]; k, v: [1, H_kv, N, D] for the N tokens of this step (input_pos: their positions)
        self.cache.write(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, H_kv, D)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)                                                          # (1, H, N, D)
        if self.decode_rows is not None and self.use_kernel:
            from ..kernels.paged_attention import paged_decode_attention
            qd = q[0, :, self.decode_rows].transpose(0, 1).contiguous()                    # (B_dec, H, D)
            y = paged_decode_attention(qd, self.cache.k[layer], self.cache.v[layer], self.decode_tables,
                                       self.decode_lens)                                   # (B_dec, H, D)
            out[0, :, self.decode_rows] = y.transpose(0, 1)
        elif self.decode_rows is not None:
            kc, vc = self.cache.gather(layer, self.decode_tables)                          # (B_dec, H_kv, S, D)
            qd = q[0, :, self.decode_rows].transpose(0, 1).unsqueeze(2)                    # (B_dec, H, 1, D)
            y = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=self.decode_mask, enable_gqa=gqa)
            out[0, :, self.decode_rows] = y[:, :, 0].transpose(0, 1)                       # (H, B_dec, D)
        for start, n, table, S in self.prefill:
            kc, vc = self.cache.gather(layer, table)                                       # (1, H_kv, S', D)
            out[:, :, start:start + n] = attend(q[:, :, start:start + n], kc[:, :, :S], vc[:, :, :S])  # (1, H, n, D)
        return out


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, blocks: BlockManager, paged_kernel: bool | None = None):
        self.model, self.cache, self.blocks = model, cache, blocks
        self.device = next(model.parameters()).device
        # the Triton paged decode kernel on CUDA (compiled); the gather path elsewhere unless asked
        if paged_kernel and not HAS_TRITON:
            raise RuntimeError("paged_kernel=True needs Triton, which is not installed here; "
                               "leave paged_kernel=None for the gather path")
        self.paged_kernel = HAS_TRITON and self.device.type == "cuda" if paged_kernel is None else paged_kernel

    @torch.inference_mode()
    def run(self, batch: Batch) -> Tensor:
        """Logits [R, V] for the chunks that sample (those reaching their sequence's last token), in order."""
        ids, pos, slots, out_rows = [], [], [], []
        dec_rows, dec_tables, dec_lens, prefill = [], [], [], []
        for chunk in batch.chunks:
            seq, n, row = chunk.seq, chunk.num_tokens, len(ids)
            start = seq.num_computed
            ids += seq.all_ids[start:start + n]
            pos += range(start, start + n)
            slots += [self.blocks.slot(seq.seq_id, p) for p in range(start, start + n)]
            table = self.blocks.block_table(seq.seq_id)
            if n == 1:
                dec_rows.append(row), dec_tables.append(table), dec_lens.append(start + 1)
            else:
                prefill.append((row, n, self._tensor([table]), start + n))
            if chunk.samples:
                out_rows.append(row + n - 1)
        for _ in batch.padding:                   # finished rows of a static batch: computed, discarded
            dec_rows.append(len(ids)), dec_tables.append([0]), dec_lens.append(1)
            ids.append(0), pos.append(0), slots.append(PAD_SLOT)
        ctx = PagedAttention(self.cache, self._tensor(slots), *self._decode_meta(dec_rows, dec_tables, dec_lens),
                             prefill, use_kernel=self.paged_kernel)
        h = self.model.hidden_states(self._tensor([ids]), self._tensor(pos), ctx)         # (1, N, C)
        return self.model.logits(h[0, self._tensor(out_rows)])                             # (R, V)

    def _tensor(self, values) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _decode_meta(self, rows: list[int], tables: list[list[int]], lens: list[int]):
        if not rows:
            return None, None, None, None
        width = max(len(t) for t in tables)
        padded = self._tensor([t + [0] * (width - len(t)) for t in tables])                 # (B_dec, n_blocks)
        keys = torch.arange(width * self.blocks.block_size, device=self.device)
        lens_t = self._tensor(lens)
        mask = keys[None, :] < lens_t[:, None]                                              # (B_dec, S)
        return self._tensor(rows), padded, lens_t, mask[:, None, None, :]
