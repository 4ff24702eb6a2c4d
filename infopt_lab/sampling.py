"""Decoding rules: logits of the last position -> the next token.

Greedy takes the argmax; sampling divides by a temperature, keeps the top-k
tokens and/or the smallest set whose probability reaches top-p, renormalises
and draws with a seeded generator, so a run can be repeated exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    temperature: float = 0.0     # 0 means greedy
    top_k: int | None = None     # keep the k most likely tokens
    top_p: float | None = None   # keep the smallest set with cumulative probability >= top_p
    seed: int | None = 0         # seed of the sampling generator

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming what is allowed for each sampling setting."""
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p filtering."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]          # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs              # mass of the more likely tokens
        drop_sorted = mass_before >= top_p                                # the set already reached top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(logits: Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> Tensor:
    """The next token id for each row of logits [B, V] -> [B]."""
    if params.greedy:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator on the device, or None for the global RNG."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
