"""The baseline every rung is measured against: transformers' model on the same weights, and its generate runners.

`load_transformers` is the one loader; each runner hands back what ours do (new tokens, and seconds or the
time each token was ready), so a rung compares like with like. Our own timed loop is `generate.timed_tokens`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..timing import Timer

# `generate_one(prompt_ids, max_new_tokens) -> (new token ids, seconds at which each was ready)`
OneRequest = Callable[[list[int], int], tuple[list[int], list[float]]]


def load_transformers(model_name: str, dtype: torch.dtype = torch.float32, device=None):
    """transformers' AutoModelForCausalLM on a bundled or fetched model's weights, in eval mode (moved to `device`)."""
    from transformers import AutoModelForCausalLM
    from ..loading import resolve_model_dir
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name), dtype=dtype)
    return (model if device is None else model.to(device)).eval()


def hf_greedy(hf_model, ids: torch.Tensor, max_new_tokens: int, pad_id: int, attention_mask=None, **options):
    """transformers' greedy `generate` on ids [B, T] (every position attended unless a mask is given): [B, T + n].

    `options` go to `generate` as they are: min_new_tokens, eos_token_id, streamer, assistant_model, ...
    """
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    with torch.no_grad():
        return hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad_id, **options)


class TokenClock:
    """A transformers streamer that records when each new token arrives (its first `put` is the prompt)."""

    def __init__(self):
        self.start, self.times, self.prompt_seen = time.perf_counter(), [], False

    def put(self, value) -> None:
        """Called by `generate` with the prompt, then with each new token."""
        if self.prompt_seen:
            self.times.append(time.perf_counter() - self.start)
        self.prompt_seen = True

    def end(self) -> None:
        """Called by `generate` when it is done."""


def transformers_one(hf_model, tok) -> OneRequest:
    """`generate_one` for transformers' greedy `generate`, stopping at the same EOS as ours."""
    def run(prompt: list[int], new_tokens: int):
        clock = TokenClock()
        ids = torch.tensor([prompt], device=hf_model.device)                           # (1, T)
        out = hf_greedy(hf_model, ids, new_tokens, tok.eos_token_id, eos_token_id=tok.eos_token_id, streamer=clock)
        return out[0, len(prompt):].tolist(), clock.times
    return run


def transformers_batched_generate(hf_model, prompt_ids: Sequence[list[int]], max_new_tokens: Sequence[int],
                                  batch_size: int, pad_id: int) -> tuple[list[list[int]], float]:
    """The baseline a student would write: transformers' padded batched greedy `generate`, batch by batch.

    Prompts are left-padded; each batch runs to its longest request and the extra tokens of
    shorter ones are cut off. Returns each request's tokens and the wall time in seconds.
    """
    device = next(hf_model.parameters()).device
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompt_ids), batch_size):
        prompts, news = prompt_ids[i:i + batch_size], max_new_tokens[i:i + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)      # (B, T)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = hf_greedy(hf_model, ids, max(news), pad_id, attention_mask=mask, min_new_tokens=max(news))
        outputs += [row[width:width + m].tolist() for row, m in zip(out, news)]
    return outputs, time.perf_counter() - start


def transformers_assisted(hf_target, hf_draft, prompts: Sequence[torch.Tensor], new_tokens: int,
                          k: int) -> tuple[float, list[list[int]]]:
    """Seconds and tokens of transformers' assisted generation (k drafted a round) over every prompt [1, T]."""
    hf_draft.generation_config.num_assistant_tokens = k
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    tokens = []
    with Timer(prompts[0].device) as t:
        for x in prompts:
            out = hf_greedy(hf_target, x, new_tokens, 0, assistant_model=hf_draft)
            tokens.append(out[0, x.shape[1]:].tolist())
    return t.seconds, tokens


def transformers_prompt_lookup(hf_target, x: torch.Tensor, new_tokens: int, k: int) -> tuple[float, list[list[int]]]:
    """Seconds and tokens of transformers' prompt-lookup generation (k looked up a round) on one prompt [1, T]."""
    with Timer(x.device) as t:
        out = hf_greedy(hf_target, x, new_tokens, 0, prompt_lookup_num_tokens=k)
    return t.seconds, [out[0, x.shape[1]:].tolist()]
