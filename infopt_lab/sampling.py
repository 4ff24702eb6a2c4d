"""Decoding rules and per-request settings: logits of the last position -> the next token.

`SamplingParams` (vLLM's name) holds everything one request asks for: how many
tokens, how to pick each (greedy, or temperature with top-k / top-p, seeded so a
run can be repeated exactly) and when to stop. `lab.generate`, the engine and
speculative decoding all take it, all check a request with `check_request`, and
all pick tokens with `sample` (which draws through `draw`, the package's only
random draw of a token).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from . import validate

DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings: `lab.SamplingParams(max_new_tokens=64, temperature=0.0, seed=0)`.

    `max_new_tokens=None` means "not given": here the default (64); as an override (`sampling_params`,
    `lab.generate`, the engine) it keeps what `params` says.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS   # new tokens to produce at most (None: this default)
    temperature: float = 0.0                 # 0 means greedy (argmax)
    top_k: int | None = None                 # keep the k most likely tokens
    top_p: float | None = None               # keep the smallest set with cumulative probability >= top_p
    seed: int | None = 0                     # seed of the request's own generator; None: torch's global RNG
    stop_token_ids: tuple[int, ...] = ()     # stop after producing any of these
    stop_at_eos: bool = True                 # stop after the tokenizer's end-of-sequence token too

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        n = DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens
        set_(self, "max_new_tokens", validate.integer("max_new_tokens", n, low=1))
        set_(self, "temperature", validate.real("temperature", self.temperature, low=0))
        set_(self, "top_k", validate.integer("top_k", self.top_k, low=1, allow_none=True))
        set_(self, "top_p", validate.real("top_p", self.top_p, low=0, high=1, allow_none=True, low_open=True))
        set_(self, "seed", validate.integer("seed", self.seed, low=0, allow_none=True))
        set_(self, "stop_token_ids", tuple(validate.integers("stop_token_ids", self.stop_token_ids, low=0,
                                                             nonempty=False)))
        validate.boolean("stop_at_eos", self.stop_at_eos)

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax."""
        return self.temperature == 0.0

    def stop_ids(self, eos_id: int | None) -> frozenset[int]:
        """The token ids that end this request, given the tokenizer's end-of-sequence id."""
        extra = {eos_id} if self.stop_at_eos and eos_id is not None else set()
        return frozenset(self.stop_token_ids) | extra


def sampling_params(params: SamplingParams | None = None, **overrides) -> SamplingParams:
    """`params` (default settings when None) with keyword overrides applied; unknown names are refused.

    `max_new_tokens=None` is no override: the length stays `params`' (the default, 64, without params).
    """
    if params is not None:
        validate.instance("params", params, SamplingParams, "a SamplingParams (or None for the defaults)")
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {unknown}; allowed: {sorted(fields)}")
    if overrides.get("max_new_tokens", 0) is None:
        del overrides["max_new_tokens"]
    return dataclasses.replace(params or SamplingParams(), **overrides)


def check_request(prompt_ids, params: SamplingParams, config, extra_positions: int = 0) -> None:
    """Raise ValueError when a request cannot be served by a model with this config: the one request check.

    `extra_positions` are cache slots beyond the request's own tokens (speculative decoding's k + 1).
    """
    n = len(prompt_ids)
    if n < 1:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [int(t) for t in prompt_ids if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise ValueError(f"token ids must be in [0, {config.vocab_size}), got {bad[:5]}")
    context = config.max_seq_len - extra_positions
    if n + params.max_new_tokens > context:
        raise ValueError(f"prompt of {n} tokens + max_new_tokens={params.max_new_tokens}"
                         f"{f' + {extra_positions} draft positions' if extra_positions else ''} exceeds the "
                         f"model's context of {config.max_seq_len} tokens; shorten the prompt or ask for at "
                         f"most {max(0, context - n)} new tokens")


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


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token id per row of probabilities [..., V] -> [...], drawn with `generator`."""
    flat = probs.reshape(-1, probs.shape[-1])                             # (rows, V)
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """The next token id for each row of logits [..., V] -> [...]: argmax when greedy, else a seeded draw."""
    if params.greedy:
        return logits.argmax(-1)
    return draw(logits_to_probs(logits, params.temperature, params.top_k, params.top_p), generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator on the device, or None for the global RNG."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
