"""Generation: prefill the prompt, then decode one token at a time.

With a KV cache, prefill writes the prompt's keys and values once and each
decode step feeds only the newest token. Without one, every step runs the model
over the whole sequence again: the recomputation notebook 01 measures.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .device import synchronize
from .kv_cache import KVCache
from .metrics import request_metrics
from .sampling import SamplingParams, make_generator, sample


@dataclass
class GenerationOutput:
    text: str                        # the decoded new tokens
    token_ids: list[int]             # the new tokens
    prompt_ids: list[int]            # the prompt as tokenized
    ttft_s: float                    # time to first token: prompt in -> first new token out
    tpot_s: float                    # time per output token after the first (mean inter-token latency)
    e2e_s: float                     # end-to-end latency of the whole request
    token_times_s: list[float] = field(default_factory=list)  # when each token was ready, from the start

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens after the first, per second (1 / TPOT)."""
        return 1.0 / self.tpot_s if self.tpot_s > 0 else float("nan")

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


@torch.inference_mode()
def prefill(model, input_ids: Tensor, cache: KVCache | None) -> Tensor:
    """Run the prompt [B, T] through the model; logits of its last position [B, V]."""
    input_pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    return model(input_ids, input_pos, cache)[:, -1]


@torch.inference_mode()
def decode_one_token(model, token: Tensor, pos: int, cache: KVCache) -> Tensor:
    """Feed one token per sequence [B, 1] at position `pos`; next-token logits [B, V]."""
    input_pos = torch.tensor([pos], device=token.device)
    return model(token, input_pos, cache)[:, -1]


def check_request(model, n_prompt: int, max_new_tokens: int) -> None:
    """Raise ValueError when a request cannot fit the model's context."""
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if n_prompt < 1:
        raise ValueError("the prompt is empty: give at least one token")
    context = model.config.max_seq_len
    if n_prompt + max_new_tokens > context:
        raise ValueError(f"prompt of {n_prompt} tokens + max_new_tokens={max_new_tokens} exceeds the "
                         f"model's context of {context} tokens; shorten the prompt or ask for at most "
                         f"{max(0, context - n_prompt)} new tokens")


@torch.inference_mode()
def generate_tokens(model, input_ids: Tensor, max_new_tokens: int, params: SamplingParams,
                    use_cache: bool = True, eos_id: int | None = None) -> Iterator[Tensor]:
    """Yield the next token of every sequence [B], one step at a time."""
    B, T = input_ids.shape
    check_request(model, T, max_new_tokens)
    generator = make_generator(params.seed, input_ids.device)
    cache = KVCache.for_model(model, B, T + max_new_tokens) if use_cache else None
    seq = input_ids
    logits = prefill(model, input_ids, cache)
    for i in range(max_new_tokens):
        token = sample(logits, params, generator)                     # (B,)
        yield token
        # a single sequence may stop at EOS; a batch runs to max_new_tokens (the engine retires rows)
        if i == max_new_tokens - 1 or (eos_id is not None and B == 1 and int(token) == eos_id):
            return
        if use_cache:
            logits = decode_one_token(model, token[:, None], T + i, cache)
        else:
            seq = torch.cat([seq, token[:, None]], dim=1)             # (B, T + i + 1)
            logits = model(seq)[:, -1]                                # recompute everything


def _encode(model, tok, prompt: str) -> Tensor:
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one character of text")
    ids = tok.encode(prompt)                      # begins with the BOS token
    device = next(model.parameters()).device
    return torch.tensor([ids], dtype=torch.long, device=device)


def generate(model, tok, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
             seed: int | None = 0, stop_at_eos: bool = True) -> GenerationOutput:
    """Complete one prompt and time it: text, token ids, TTFT, TPOT, tokens/s."""
    params = SamplingParams(temperature, top_k, top_p, seed)
    input_ids = _encode(model, tok, prompt)
    device = input_ids.device
    eos = tok.eos_token_id if stop_at_eos else None
    synchronize(device)
    start = time.perf_counter()
    new, times = [], []
    for token in generate_tokens(model, input_ids, max_new_tokens, params, use_cache, eos):
        synchronize(device)
        times.append(time.perf_counter() - start)
        new.append(int(token))
    m = request_metrics(0.0, times)
    return GenerationOutput(text=tok.decode(new, skip_special_tokens=True), token_ids=new,
                            prompt_ids=input_ids[0].tolist(), ttft_s=m.ttft_s, tpot_s=m.tpot_s,
                            e2e_s=m.e2e_s, token_times_s=times)


def stream(model, tok, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = 0,
           stop_at_eos: bool = True) -> Iterator[str]:
    """Yield the completion's text piece by piece as tokens are decoded."""
    params = SamplingParams(temperature, top_k, top_p, seed)
    input_ids = _encode(model, tok, prompt)
    eos = tok.eos_token_id if stop_at_eos else None
    new: list[int] = []
    shown = ""
    for token in generate_tokens(model, input_ids, max_new_tokens, params, True, eos):
        new.append(int(token))
        text = tok.decode(new, skip_special_tokens=True)
        if not text.endswith("\ufffd"):          # wait for the rest of a multi-byte character
            yield text[len(shown):]
            shown = text
    text = tok.decode(new, skip_special_tokens=True)
    if len(text) > len(shown):
        yield text[len(shown):]
