"""Generation: prefill the prompt, then decode one token at a time; the package's one decode loop.

With a KV cache, prefill writes the prompt's keys and values once and each
decode step feeds only the newest token. Without one, every step runs the model
over the whole sequence again: the recomputation notebook 01 measures.
`Decoder` (a model, its cache and how many positions the cache holds) is the
piece speculative decoding shares: it feeds several tokens at once and rolls back.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import validate
from .device import synchronize
from .invariant import invariant
from .kv_cache import KVCache
from .metrics import request_metrics
from .sampling import SamplingParams, check_request, make_generator, sample, sampling_params


@dataclass
class GenerationOutput:
    """One completed request: its text and tokens, and its latency figures (metrics.py's definitions)."""

    text: str                        # the decoded new tokens
    token_ids: list[int]             # the new tokens
    prompt_ids: list[int]            # the prompt as tokenized
    ttft_s: float                    # time to first token: prompt in -> first new token out
    tpot_s: float                    # time per output token after the first (mean inter-token latency)
    e2e_s: float                     # end-to-end latency of the whole request
    tokens_per_s: float              # new tokens / end-to-end latency
    token_times_s: list[float] = field(default_factory=list)  # when each token was ready, from the start

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


class Decoder:
    """A model, its KV cache, and how many positions the cache holds: feed tokens, get logits, roll back."""

    def __init__(self, model, batch_size: int, capacity: int, cache_factory: Callable = KVCache.for_model,
                 batch_invariant: bool = False, compile: bool = False):
        self.compiled = None                     # the compiled one-token step (compiled.py), with compile=True
        if compile:
            from .compiled import StaticKVCache, compile_model, static_capacity
            check_compile(batch_invariant, cache_factory)
            self.compiled = compile_model(model)
            self.cache = StaticKVCache.for_model(model, batch_size, static_capacity(model, capacity))
        else:
            self.cache = cache_factory(model, batch_size, capacity)
        self.model = model
        self.compiled_widths = {1}               # feeds of these many tokens run compiled (speculation adds k + 1)
        self.batch_invariant = batch_invariant   # every row of a feed computed as if it were fed alone
        self.device = next(model.parameters()).device
        self.pos = 0                  # positions written so far
        self.forwards = 0             # model calls made

    @torch.inference_mode()
    def feed(self, tokens: Tensor) -> Tensor:
        """Append tokens [B, T] at the current position; their logits [B, T, V]."""
        T = tokens.shape[1]
        input_pos = torch.arange(self.pos, self.pos + T, device=self.device)
        self.pos += T
        self.forwards += 1
        if self.compiled is not None and T in self.compiled_widths:
            return self.compiled.step(tokens, input_pos, self.cache.layers)
        with invariant(self.batch_invariant):
            return self.model(tokens, input_pos, self.cache)

    @torch.inference_mode()
    def feed_hidden(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Append tokens [B, T] like `feed`; their logits [B, T, V] and the last hidden states [B, T, C] behind them.

        A feature draft (feature_draft.py) reads the hidden states; the logits are computed from them as `feed` does.
        """
        T = tokens.shape[1]
        input_pos = torch.arange(self.pos, self.pos + T, device=self.device)
        self.pos += T
        self.forwards += 1
        if self.compiled is not None and T in self.compiled_widths:
            return self.compiled.step(tokens, input_pos, self.cache.layers, hidden=True)
        with invariant(self.batch_invariant):
            h = self.model.hidden_states(tokens, input_pos, self.cache)
            return self.model.logits(h), h

    def rollback(self, n: int) -> None:
        """Forget the last n positions: later writes overwrite them and attention never reads them."""
        self.pos -= n


def check_compile(batch_invariant: bool, cache_factory: Callable = KVCache.for_model) -> None:
    """Raise ValueError where compile=True meets an option it cannot honour."""
    if batch_invariant:
        raise ValueError("compile=True runs the fast kernels of the compiled graph; batch_invariant=True runs each "
                         "row alone in eager code: choose one")
    if cache_factory != KVCache.for_model:
        raise ValueError("compile=True decodes over its own static cache (compiled.StaticKVCache); "
                         "leave cache_factory at its default")


def finish_tokens(tokens: list[int], produced: int, max_new_tokens: int,
                  stop_ids: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], bool]:
    """Of `tokens`, the next ones a request produced after `produced` others, those it keeps; and whether it finished.

    A request finishes at its first stop id (kept: an end-of-sequence token is part of the output) or at
    its `max_new_tokens`-th token, whichever comes first; tokens after that are dropped. The one finishing
    rule: generation, speculative decoding and the engine's scheduler all call it.
    """
    for i, token in enumerate(tokens):
        if produced + i + 1 >= max_new_tokens or token in stop_ids:
            return list(tokens[:i + 1]), True
    return list(tokens), False


@torch.inference_mode()
def prefill(model, input_ids: Tensor, cache) -> Tensor:
    """Run the prompt [B, T] through the model; logits of its last position [B, V]."""
    input_pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    return model(input_ids, input_pos, cache)[:, -1]


@torch.inference_mode()
def decode_one_token(model, token: Tensor, pos: int, cache) -> Tensor:
    """Feed one token per sequence [B, 1] at position `pos`; next-token logits [B, V]."""
    input_pos = torch.tensor([pos], device=token.device)
    return model(token, input_pos, cache)[:, -1]


@torch.inference_mode()
def recompute(model, ids: Tensor, batch_invariant: bool = False) -> Tensor:
    """Logits [B, T, V] of the whole sequence, no cache kept (the recomputation notebook 01 measures)."""
    with invariant(batch_invariant):
        return model(ids)


@torch.inference_mode()
def generate_tokens(model, input_ids: Tensor, params: SamplingParams, use_cache: bool = True,
                    eos_id: int | None = None, cache_factory: Callable = KVCache.for_model,
                    batch_invariant: bool = False, compile: bool = False) -> Iterator[Tensor]:
    """Yield the next token of every sequence [B], one step at a time (a single sequence stops at a stop id)."""
    B, T = input_ids.shape
    for row in input_ids.tolist():
        check_request(row, params, model.config)
    stops = params.stop_ids(eos_id)
    generator = make_generator(params.seed, input_ids.device)
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached one-token step; use_cache=False has none")
    decoder = Decoder(model, B, T + params.max_new_tokens, cache_factory, batch_invariant, compile) \
        if use_cache else None
    seq = input_ids
    logits = (decoder.feed(input_ids) if use_cache else recompute(model, input_ids, batch_invariant))[:, -1]  # (B, V)
    for i in range(params.max_new_tokens):
        token = sample(logits, params, generator)                      # (B,)
        yield token
        # a single sequence may stop early; a batch runs to max_new_tokens (the engine retires rows)
        done = finish_tokens([int(token)], i, params.max_new_tokens, stops)[1] if B == 1 \
            else i == params.max_new_tokens - 1
        if done:
            return
        if use_cache:
            logits = decoder.feed(token[:, None])[:, -1]
        else:
            seq = torch.cat([seq, token[:, None]], dim=1)              # (B, T + i + 1)
            logits = recompute(model, seq, batch_invariant)[:, -1]     # recompute everything


def timed_tokens(model, input_ids: Tensor, params: SamplingParams, use_cache: bool = True,
                 eos_id: int | None = None, cache_factory: Callable = KVCache.for_model,
                 batch_invariant: bool = False, compile: bool = False) -> Iterator[tuple[int, float]]:
    """Yield each new token of one sequence [1, T] and when it was ready, in seconds from the start.

    The one timed decode loop: the device is waited for before the clock starts and before each reading,
    so a token counts when its kernels have finished, not when they were launched.
    """
    synchronize(input_ids.device)
    start = time.perf_counter()
    for token in generate_tokens(model, input_ids, params, use_cache, eos_id, cache_factory, batch_invariant,
                                 compile):
        synchronize(input_ids.device)
        yield int(token[0]), time.perf_counter() - start


def encode_prompt(model, tok, prompt: str) -> Tensor:
    """A text prompt as token ids [1, T] on the model's device (the tokenizer adds BOS); the model checked too."""
    validate.model("model", model)
    validate.text("prompt", prompt)
    ids = tok.encode(prompt)                      # begins with the BOS token
    device = next(model.parameters()).device
    return torch.tensor([ids], dtype=torch.long, device=device)


def generate(model, tok, prompt: str, params: SamplingParams | None = None, *, use_cache: bool = True,
             batch_invariant: bool = False, compile: bool = False, **overrides) -> GenerationOutput:
    """Complete one prompt and time it: text, tokens, TTFT, TPOT, tokens/s. Keyword overrides: SamplingParams fields.

    `batch_invariant=True` computes every row of a pass as if it were alone (invariant.py), so the tokens
    equal, bit for bit, what speculative decoding and the engine give in that mode.
    `compile=True` runs each one-token step through the compiled graph of compiled.py (compiled once per
    model and shape, with a progress bar; eager with one line saying why where compiling fails here).
    """
    params = sampling_params(params, **overrides)
    input_ids = encode_prompt(model, tok, prompt)
    new, times = [], []
    batch_invariant = validate.boolean("batch_invariant", batch_invariant)
    compile = validate.boolean("compile", compile)
    for token, seconds in timed_tokens(model, input_ids, params, use_cache, tok.eos_token_id,
                                       batch_invariant=batch_invariant, compile=compile):
        new.append(token)
        times.append(seconds)
    m = request_metrics(0.0, times)
    return GenerationOutput(text=tok.decode(new, skip_special_tokens=True), token_ids=new,
                            prompt_ids=input_ids[0].tolist(), ttft_s=m.ttft_s, tpot_s=m.tpot_s,
                            e2e_s=m.e2e_s, tokens_per_s=m.tokens_per_s, token_times_s=times)


def stream(model, tok, prompt: str, params: SamplingParams | None = None, **overrides) -> Iterator[str]:
    """Yield the completion's text piece by piece as tokens are decoded. Keyword overrides: SamplingParams fields."""
    params = sampling_params(params, **overrides)
    input_ids = encode_prompt(model, tok, prompt)
    new: list[int] = []
    shown = ""
    for token in generate_tokens(model, input_ids, params, True, tok.eos_token_id):
        new.append(int(token))
        text = tok.decode(new, skip_special_tokens=True)
        if not text.endswith("\ufffd"):          # wait for the rest of a multi-byte character
            yield text[len(shown):]
            shown = text
    text = tok.decode(new, skip_special_tokens=True)
    if len(text) > len(shown):
        yield text[len(shown):]
