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

The speculator returns what each sequence got (tokens, how many fed tokens stay
computed in each cache, drafts proposed and accepted) and changes no sequence;
the scheduler applies it. Only greedy requests speculate; a sampled request decodes one token a step
beside them, so the engine's outputs equal its outputs without speculation.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import validate
from ..feature_draft import FeatureDraft
from ..kv_cache import PagedKVCache
from ..speculative import lookup_draft, verify_greedy
from .block_manager import BlockManager
from .model_runner import ModelRunner, Sampler
from .scheduler import Batch
from .sequence import Chunk, SeqOutput, Sequence

NGRAM = "ngram"   # the draft that is not a model: prompt lookup (vLLM's name for it)


class Speculator:
    """Proposes and verifies for the engine; holds the draft's runner and its paged cache."""

    def __init__(self, target_runner: ModelRunner, draft, k: int, blocks: BlockManager, pool=PagedKVCache,
                 max_ngram: int = 3):
        self.target, self.k, self.blocks, self.max_ngram = target_runner, k, blocks, max_ngram
        self.draft = None
        if draft != NGRAM:
            cache = pool.for_model(draft, blocks.num_blocks, blocks.block_size)   # checked against memory
            self.draft = ModelRunner(draft, cache, blocks, paged_kernel=target_runner.paged_kernel_asked,
                                     cascade=target_runner.cascade, batch_invariant=target_runner.batch_invariant)

    def execute_model(self, batch: Batch, sample: Sampler) -> dict[Sequence, SeqOutput]:
        """Propose, verify and accept for a scheduled batch; what each sequence got, as data (none is changed).

        A speculating sequence keeps as computed its last token and the drafts accepted; the draft's
        cache keeps what it computed up to the first rejected proposal.
        """
        proposals, draft_end = self._propose(batch)
        chunks = [c.extended(proposals[c.seq]) if proposals.get(c.seq) else c for c in batch.chunks]
        logits = self.target.forward(chunks, padding=len(batch.padding))     # (R, V)
        outputs, row, plain = {}, 0, []
        for c in chunks:
            seq, d = c.seq, proposals.get(c.seq, [])
            if d:
                tokens, accepted = verify_greedy(d, logits[row:row + c.logits].argmax(-1).tolist())
                drafted = None if self.draft is None else draft_end[seq] + min(accepted, len(d) - 1)
                outputs[seq] = SeqOutput(tokens, 1 + accepted, drafted, len(d), accepted)
            else:
                if c.logits:
                    plain.append((seq, row))
                outputs[seq] = SeqOutput([], c.num_tokens, draft_end.get(seq))
            row += c.logits
        if plain:
            tokens = sample(logits[[r for _, r in plain]], [s for s, _ in plain])
            for (seq, _), token in zip(plain, tokens):
                outputs[seq].tokens.append(token)
        return outputs

    def _propose(self, batch: Batch) -> tuple[dict[Sequence, list[int]], dict[Sequence, int]]:
        """Each speculating sequence's draft tokens (prompt lookup, or the draft model's greedy steps), and
        the positions each sequence's draft cache holds after catching up (none for prompt lookup)."""
        spec = [c for c in batch.chunks if c.lookahead > 0]
        if self.draft is None:
            found = {c.seq: lookup_draft(c.seq.all_ids, c.lookahead, self.max_ngram) for c in spec}
            return {s: d for s, d in found.items() if d}, {}
        drafts: dict[Sequence, list[int]] = {c.seq: [] for c in spec}
        end = {c.seq: c.start + c.num_tokens for c in batch.chunks}
        chunks = [Chunk(c.seq, c.seq.draft_computed, c.seq.all_ids[c.seq.draft_computed:end[c.seq]],
                        int(c.lookahead > 0)) for c in batch.chunks]   # catch up on the target's tokens of the step
        for i in range(max((c.lookahead for c in spec), default=0) or 1):   # once at least: the catch-up
            if i > 0:                          # feed each sequence's last proposal
                chunks = [Chunk(c.seq, c.seq.length + i - 1, drafts[c.seq][-1:], 1) for c in spec if c.lookahead > i]
            logits = self.draft.forward(chunks)                                  # (R, V)
            for c, token in zip([c for c in spec if c.lookahead > i], logits.argmax(-1).tolist()):
                drafts[c.seq].append(token)
        return drafts, end


class FeatureSpeculator(Speculator):
    """Speculation with a feature draft (feature_draft.py): the draft reads the target's hidden states.

    Draft position j reads (h_{j-1}, x_j). The target's verify pass of one step gives the features of the
    tokens it keeps; the speculator holds them per sequence until the next step, when the draft catches
    up on them (through the last token kept, whose feature came one step earlier) and proposes k tokens,
    each step after the first reading its own guess. Prefill chunks leave their features for the first
    decode step likewise. Positions the target never computed here (a prefix-cache hit) reach the draft
    with a zero feature: a weaker proposal there, never another token (the target verifies every one).
    """

    def __init__(self, target_runner: ModelRunner, draft: FeatureDraft, k: int, blocks: BlockManager,
                 pool=PagedKVCache, max_ngram: int = 3):
        super().__init__(target_runner, draft, k, blocks, pool, max_ngram)
        self.features: dict[Sequence, tuple[int, Tensor]] = {}   # seq -> (first position, its features [n, C])

    def execute_model(self, batch: Batch, sample: Sampler) -> dict[Sequence, SeqOutput]:
        for seq in [s for s in self.features if s.done]:
            del self.features[seq]
        proposals = self._propose_features([c for c in batch.chunks if c.lookahead > 0])
        chunks = [c.extended(proposals[c.seq]) if proposals.get(c.seq) else c for c in batch.chunks]
        logits, hidden = self.target.forward(chunks, padding=len(batch.padding), with_hidden=True)
        outputs, row, packed, plain = {}, 0, 0, []
        for c in chunks:
            seq, d = c.seq, proposals.get(c.seq, [])
            if d:
                tokens, accepted = verify_greedy(d, logits[row:row + c.logits].argmax(-1).tolist())
                kept = 1 + accepted
                outputs[seq] = SeqOutput(tokens, kept, c.start + 1, len(d), accepted)
            else:
                kept = c.num_tokens
                if c.logits:
                    plain.append((seq, row))
                outputs[seq] = SeqOutput([], kept, seq.draft_computed)
            self._keep(seq, c.start, hidden[packed:packed + kept])
            row, packed = row + c.logits, packed + c.num_tokens
        if plain:
            tokens = sample(logits[[r for _, r in plain]], [s for s, _ in plain])
            for (seq, _), token in zip(plain, tokens):
                outputs[seq].tokens.append(token)
        return outputs

    def _keep(self, seq: Sequence, start: int, h: Tensor) -> None:
        """Hold the target's features of positions start.. for the draft's next catch-up (after what is held)."""
        first, held = self.features.get(seq, (start, h[:0]))
        if first + len(held) != start:                  # a gap (preemption, a prefix hit): start again here
            first, held = start, h[:0]
        self.features[seq] = (first, torch.cat([held, h]))

    def _propose_features(self, spec: list[Chunk]) -> dict[Sequence, list[int]]:
        """Each speculating sequence's k greedy proposals: catch up on held features, then read its own guesses."""
        if not spec:
            return {}
        draft: FeatureDraft = self.draft.model
        C = draft.config.dim
        chunks, feats = [], []
        for c in spec:
            seq, last = c.seq, c.start                     # position of the token the target feeds now
            begin = max(1, min(seq.draft_computed, last))  # draft position 0 reads no feature: never computed
            first, held = self.features.get(seq, (0, torch.zeros(0, C)))
            chunks.append(Chunk(seq, begin, seq.all_ids[begin:last + 1], 1))
            feats.append(_shifted_rows(held, first, begin, last, C))
            self.features[seq] = (last, held[last - first:]) if last - first < len(held) else (last, held[:0])
        drafts: dict[Sequence, list[int]] = {c.seq: [] for c in spec}
        dtype = draft.target.norm.weight.dtype          # the target's features, in its dtype
        _, h = self.draft.forward(chunks, features=torch.cat(feats).to(dtype), with_hidden=True)
        guess = h[torch.tensor([c.num_tokens for c in chunks]).cumsum(0) - 1]     # (B, C): each one's last guess
        active = spec
        for i in range(max(c.lookahead for c in spec)):
            if i > 0:                                  # feed each sequence's last proposal with the guess behind it
                keep = [j for j, c in enumerate(active) if c.lookahead > i]
                active = [active[j] for j in keep]
                steps = [Chunk(c.seq, c.start + i, drafts[c.seq][-1:], 1) for c in active]
                _, guess = self.draft.forward(steps, features=guess[keep], with_hidden=True)
            for c, token in zip(active, draft.token_ids[draft.covered_logits(guess).argmax(-1)].tolist()):
                drafts[c.seq].append(token)
        return drafts


def check_speculation(target, draft, k, max_model_len: int) -> int:
    """The engine's draft and num_speculative_tokens, checked when it is built; k as an int."""
    k = validate.speculation_length("num_speculative_tokens", k, low=0)
    if draft is None:
        if k:
            raise ValueError(f"num_speculative_tokens={k} needs a draft: a draft model sharing the target's "
                             f"tokenizer, or draft={NGRAM!r} for prompt lookup")
        return 0
    if k == 0:
        raise ValueError("a draft was given but num_speculative_tokens is 0; give the tokens to draft per step (>= 1)")
    if isinstance(draft, str):
        validate.choice("a draft given by name (else a model)", draft, (NGRAM,))
    else:
        validate.draft(target, draft, max_model_len)
        if isinstance(draft, FeatureDraft):
            draft.bind(target)
    return k


def _shifted_rows(held: Tensor, first: int, begin: int, last: int, dim: int) -> Tensor:
    """Features for positions begin..last, each the held feature of the position before it (zeros where none is held)."""
    lo = begin - 1 - first                              # index in held of position begin - 1
    rows = held.new_zeros(last + 1 - begin, dim)
    a, b = max(lo, 0), min(last - first, len(held))
    if a < b:
        rows[a - lo:b - lo] = held[a:b]
    return rows
