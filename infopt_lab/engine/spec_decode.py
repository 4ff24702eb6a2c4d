"""Speculative decoding inside the engine: every decoding sequence drafts, one packed target pass verifies all.

A step with speculation runs in three parts:

1. Propose. A draft model with its own paged cache (same block tables as the
   target's, its own pool) first catches up on the tokens the target computes
   this step, which also gives its first proposal for each decoding sequence;
   then k - 1 more packed draft steps, one token per sequence. Prompt lookup
   ("ngram") proposes from each sequence's own tokens instead, with no model.
2. Verify. One packed target pass: each speculating sequence feeds its last
   token and its proposals, and reads logits at all of them.
3. Accept (greedy). Each sequence keeps its proposals while they equal the
   target's argmax, then the target's own token. Its cache is rolled back by
   truncating its block table to the tokens kept; the draft's likewise.

Only greedy requests speculate; a sampled request decodes one token a step
beside them, so the engine's outputs equal its outputs without speculation.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable

from torch import Tensor

from ..kv_cache import PagedKVCache
from ..speculative import lookup_draft, verify_greedy
from .block_manager import BlockManager
from .model_runner import ModelRunner, Piece
from .scheduler import Batch
from .sequence import Sequence

NGRAM = "ngram"   # the draft that is not a model: prompt lookup (vLLM's name for it)


class Speculator:
    """Proposes and verifies for the engine; holds the draft's runner and its paged cache."""

    def __init__(self, target_runner: ModelRunner, draft, k: int, blocks: BlockManager, pool=PagedKVCache,
                 max_ngram: int = 3):
        self.target, self.k, self.blocks, self.max_ngram = target_runner, k, blocks, max_ngram
        self.draft = None
        if draft != NGRAM:
            cache = pool.for_model(draft, blocks.num_blocks, blocks.block_size)   # checked against memory
            self.draft = ModelRunner(draft, cache, blocks, paged_kernel=target_runner.paged_kernel,
                                     cascade=target_runner.cascade)

    def lookahead(self, seq: Sequence) -> int:
        """Draft slots a decoding sequence may fill this step: k, less near its end, 0 if it samples."""
        if not seq.params.greedy:
            return 0
        return max(0, min(self.k, seq.max_new_tokens - len(seq.output_ids) - 1))

    def run(self, batch: Batch, sample: Callable[[Tensor, list[Sequence]], list[int]]) -> dict[Sequence, list[int]]:
        """Propose, verify and accept for a scheduled batch; each sampling sequence's new tokens.

        Advances every sequence's num_computed (and draft_computed) to the tokens whose keys
        and values stay valid.
        """
        proposals = self._propose(batch)
        pieces = []
        for c in batch.chunks:
            seq, d = c.seq, proposals.get(c.seq, [])
            ids = seq.all_ids[seq.num_computed:seq.num_computed + c.num_tokens] + d
            pieces.append(Piece(seq.seq_id, seq.num_computed, ids, len(d) + 1 if d else int(c.samples)))
        logits = self.target.forward(pieces, padding=len(batch.padding))     # (R, V)
        new, row, plain = {}, 0, []
        for c, p in zip(batch.chunks, pieces):
            seq, d = c.seq, proposals.get(c.seq, [])
            if d:
                argmax = logits[row:row + p.logits].argmax(-1).tolist()
                new[seq], accepted = verify_greedy(d, argmax)
                seq.num_computed += 1 + accepted                             # the last token + the drafts kept
                seq.draft_computed = (seq.num_computed if self.draft is None else
                                      min(seq.num_computed, seq.draft_computed + min(accepted, len(d) - 1)))
                seq.draft_tokens += len(d)
                seq.accepted_tokens += accepted
                seq.judged_tokens += accepted + (accepted < len(d))       # tokens after a rejection are not judged
                seq.spec_rounds += 1
            else:
                if c.samples:                                                # before the chunk counts as computed
                    plain.append((seq, row))
                seq.num_computed += c.num_tokens
                if self.draft is None:
                    seq.draft_computed = seq.num_computed
            row += p.logits
        if plain:
            tokens = sample(logits[[r for _, r in plain]], [s for s, _ in plain])
            new.update((s, [t]) for (s, _), t in zip(plain, tokens))
        return new

    def _propose(self, batch: Batch) -> dict[Sequence, list[int]]:
        """Each speculating sequence's draft tokens (prompt lookup, or the draft model's greedy steps)."""
        spec = [c for c in batch.chunks if c.lookahead > 0]
        if self.draft is None:
            found = {c.seq: lookup_draft(c.seq.all_ids, c.lookahead, self.max_ngram) for c in spec}
            return {s: d for s, d in found.items() if d}
        drafts: dict[Sequence, list[int]] = {c.seq: [] for c in spec}
        pieces = []
        for c in batch.chunks:                 # catch up on what the target computes now; the first proposal
            seq, end = c.seq, c.seq.num_computed + c.num_tokens
            pieces.append(Piece(seq.seq_id, seq.draft_computed, seq.all_ids[seq.draft_computed:end],
                                int(c.lookahead > 0)))
            seq.draft_computed = end
        for i in range(max((c.lookahead for c in spec), default=0) or 1):   # once at least: the catch-up
            if i > 0:                          # feed each sequence's last proposal
                pieces = [Piece(c.seq.seq_id, c.seq.length + i - 1, drafts[c.seq][-1:], 1)
                          for c in spec if c.lookahead > i]
            logits = self.draft.forward(pieces)                                  # (R, V)
            for c, token in zip([c for c in spec if c.lookahead > i], logits.argmax(-1).tolist()):
                drafts[c.seq].append(token)
        return drafts


def check_speculation(target, draft, k, max_model_len: int) -> int:
    """The engine's draft and num_speculative_tokens, checked when it is built; k as an int."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
    if draft is None:
        if k:
            raise ValueError(f"num_speculative_tokens={k} needs a draft: a draft model sharing the target's "
                             f"tokenizer, or draft={NGRAM!r} for prompt lookup")
        return 0
    if k == 0:
        raise ValueError("a draft was given but num_speculative_tokens is 0; give the tokens to draft per step (>= 1)")
    if isinstance(draft, str):
        if draft != NGRAM:
            raise ValueError(f"draft must be a model or {NGRAM!r} (prompt lookup), got {draft!r}")
        return int(k)
    from .. import validate
    validate.model("draft", draft)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                         f"({target.config.vocab_size}): speculative decoding needs one shared tokenizer")
    if draft.config.max_seq_len < max_model_len:
        raise ValueError(f"the draft's context ({draft.config.max_seq_len} tokens) is shorter than max_model_len "
                         f"({max_model_len}); lower max_model_len")
    t, d = next(target.parameters()), next(draft.parameters())
    if (t.device, t.dtype) != (d.device, d.dtype):
        raise ValueError(f"the draft is {d.dtype} on {d.device} but the target is {t.dtype} on {t.device}; "
                         "load both with the same dtype and device")
    return int(k)
