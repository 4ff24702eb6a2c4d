"""Shared by the speculative-sampling tests: what verification emits when the draft is drawn from q."""

from __future__ import annotations

import torch

from infopt_lab import speculative as sp


def first_token_counts(p: torch.Tensor, q: torch.Tensor, k: int, trials: int, seed: int) -> torch.Tensor:
    """Draw k draft tokens from q, verify them against p at every position; count the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p)
    draft_probs, target_probs = q.expand(k, -1), p.expand(k + 1, -1)
    for _ in range(trials):
        draft = torch.multinomial(draft_probs, 1, generator=g).squeeze(1)
        emitted, accepted = sp.verify(draft, draft_probs, target_probs, g)
        assert len(emitted) == accepted + 1 and 0 <= accepted <= k
        counts[emitted[0]] += 1
    return counts
