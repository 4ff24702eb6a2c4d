"""The decode rungs: batch-1 decoding against transformers (decode), the KV cache against recomputation (kv),
weight precisions (precision), and the engine's decode throughput against batch size (batch_size).

Decode speed is measured two ways here, and only these: `decode_tokens_per_s`, a request's new tokens over its
latency at batch 1; and `decode_throughput`, the engine's tokens per second over its decode-only steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import validate
from ..device import get_device
from ..generate import generate, timed_tokens
from ..kv_cache import KVCache
from ..loading import load_model
from ..quality import PROMPTS, greedy_ids
from ..sampling import SamplingParams
from ..timing import bf16_supported, time_fn
from .result import Result, describe_model

DEFAULT_PROMPT = "import os\n\n\ndef walk_files(root):\n    "   # the decode rungs' one prompt


def decode_tokens_per_s(model, tok, cache_factory=KVCache.for_model, new_tokens: int = 64,
                        repeats: int = 3, prompt: str = PROMPTS[0]) -> float:
    """Median greedy tokens/s of one request at batch 1 (prefill of the short prompt included)."""
    device = next(model.parameters()).device
    greedy_ids(model, tok, prompt, 4, cache_factory)             # a short warm-up
    seconds = time_fn(lambda: greedy_ids(model, tok, prompt, new_tokens, cache_factory),
                      repeats=repeats, warmup=0, device=device)
    return new_tokens / seconds


def bf16_decode_tokens_per_s(model_name: str, tok, prompt: str, new_tokens: int) -> float | None:
    """`decode_tokens_per_s` with bf16 weights and activations on a CPU; None where the CPU has no native bf16."""
    if not bf16_supported():
        return None
    model, _ = load_model(model_name, dtype=torch.bfloat16, device="cpu")
    return decode_tokens_per_s(model, tok, new_tokens=new_tokens, repeats=2, prompt=prompt)


def decode_step_rate(stats, batch_size: int | None = None) -> float:
    """Tokens/s over an engine run's steps in which every row decoded (and, given `batch_size`, the batch was full)."""
    steps = [r for r in stats.timeline if all(kind == "decode" for *_, kind in r.rows)
             and (batch_size is None or len(r.rows) == batch_size)]
    return sum(len(r.rows) for r in steps) / sum(r.end_s - r.start_s for r in steps)


def decode_throughput(model, tok, batch_size: int, new_tokens: int = 32, prompt: str = DEFAULT_PROMPT,
                      repeats: int = 1, compile: bool = False) -> float:
    """Decode tokens/s of the engine serving `batch_size` copies of a prompt at once (prefill excluded), best run.

    Only steps in which every row decodes count: the rate at which a full batch makes tokens. With
    `compile=True` they run the compiled step (compiled once, by an untimed first run).
    """
    from ..engine import Engine
    best = 0.0
    length = len(tok.encode(prompt)) + new_tokens
    if compile:                                         # the compile happens here, not in a timed run
        Engine(model, tok, max_batch_size=batch_size, max_model_len=length, compile=True).generate(
            [prompt] * batch_size, max_new_tokens=2, stop_at_eos=False)
    for _ in range(repeats):
        engine = Engine(model, tok, max_batch_size=batch_size, max_model_len=length, compile=compile)
        outs = engine.generate([prompt] * batch_size, max_new_tokens=new_tokens, stop_at_eos=False)
        best = max(best, decode_step_rate(outs.stats, batch_size))
    return best


def bench_decode(model_name: str = "target", new_tokens: int = 128, repeats: int = 3,
                 prompt: str = DEFAULT_PROMPT) -> Result:
    """Batch-1 greedy decode with our KV cache vs transformers' generate on the same weights."""
    from ..metrics import model_weight_bytes
    from ..timing import matvec_bandwidth_gbs, measure_bandwidth_gbs, time_interleaved
    from .baselines import hf_greedy, load_transformers
    device = get_device()
    model, tok = load_model(model_name, device=device)
    hf = load_transformers(model_name, next(model.parameters()).dtype, device)
    ids = torch.tensor([tok.encode(prompt)], device=device)
    n_prompt = ids.shape[1]

    def ours():
        return generate(model, tok, prompt, max_new_tokens=new_tokens, stop_at_eos=False)

    def theirs():
        return hf_greedy(hf, ids, new_tokens, tok.eos_token_id, min_new_tokens=new_tokens)

    # in turn (ours, theirs, ours, ...) after a warm-up round: allocator, kernels, caches
    t = time_interleaved({"ours": ours, "theirs": theirs}, repeats=repeats, warmup=1, device=device)
    rate, same = new_tokens / t["ours"], ours().token_ids == theirs()[0, n_prompt:].tolist()
    out = ours()                                               # for TTFT and TPOT
    weight_bytes = model_weight_bytes(model)
    bandwidth = measure_bandwidth_gbs(device=device)
    bound = bandwidth * 1e9 / weight_bytes                     # tokens/s if each step streamed the weights once
    gemv = matvec_bandwidth_gbs(model)                         # what one matrix-vector product streams
    gemv_bound = gemv * 1e9 / weight_bytes                     # tokens/s if every weight streamed so
    bf16 = bf16_decode_tokens_per_s(model_name, tok, prompt, new_tokens) if device.type == "cpu" else None
    r = Result("decode: batch 1, greedy, KV cache")
    r.add("model", describe_model(model_name, model, device))
    r.add("prompt / new tokens", f"{n_prompt} / {new_tokens}")
    r.add("infopt_lab tokens/s", f"{rate:.1f}  (TTFT {out.ttft_s * 1e3:.1f} ms, TPOT {out.tpot_s * 1e3:.2f} ms)")
    r.add("transformers tokens/s", f"{new_tokens / t['theirs']:.1f}")
    r.add("speedup vs transformers", f"{t['theirs'] / t['ours']:.2f}x")
    r.add("same greedy tokens", str(same))
    r.add("weight bytes", f"{weight_bytes / 2**20:.1f} MiB")
    r.add("measured bandwidth", f"{bandwidth:.1f} GB/s")
    r.add("weight-streaming bound", f"{bound:.0f} tokens/s")
    r.add("fraction of bound reached", f"{rate / bound:.1%}")
    r.add("one matrix-vector product", f"{gemv:.1f} GB/s streaming the head's weight alone: {gemv_bound:.0f} "
                                       f"tokens/s if every weight streamed so; reached {rate / gemv_bound:.1%} of that")
    if bf16 is not None:
        r.add("bf16 weights (same loop)", f"{bf16:.1f} tokens/s ({bf16 / rate:.2f}x fp32)"
                                          if bf16 else "this CPU has no fast bf16 matrix products: not measured")
    r.values = {"same_tokens": same, "tokens_per_s": rate, "speedup": t["theirs"] / t["ours"],
                "fraction_of_bound": rate / bound,
                "fraction_of_matvec_bound": rate / gemv_bound, "bf16_tokens_per_s": bf16}
    return r


# A fixed piece of library-style code (data, not code of this package): the kv rung's prompt is its
# first `prompt_tokens` tokens. Notebook 01's committed figures were measured on it: keep it as it is.
KV_PROMPT_TEXT = '''"""Helpers for reading configuration files."""
import os
import sys


def read_config(path, defaults=None):
    """Return the settings in `path` as a dict, falling back to `defaults`."""
    settings = dict(defaults or {})
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings
'''


@dataclass
class KVComparison:
    """Greedy decoding of one prompt with the KV cache and by recomputing, timed token by token."""

    prompt_len: int
    cached_ids: list[int]
    recomputed_ids: list[int]
    cached_times_s: list[float]      # when each new token was ready, from the start of the request
    recomputed_times_s: list[float]

    @property
    def same_tokens(self) -> bool:
        """Whether both ways decoded the same tokens."""
        return self.cached_ids == self.recomputed_ids

    @property
    def cached_s(self) -> float:
        """Seconds of the whole request with the cache."""
        return self.cached_times_s[-1]

    @property
    def recomputed_s(self) -> float:
        """Seconds of the whole request recomputing."""
        return self.recomputed_times_s[-1]

    @property
    def speedup(self) -> float:
        """Recompute time / cached time for the whole request."""
        return self.recomputed_s / self.cached_s

    @staticmethod
    def step_times(times_s: list[float]) -> list[float]:
        """Seconds each token took: the first is the prefill, then one per decode step."""
        return [b - a for a, b in zip([0.0] + times_s, times_s)]


def timed_greedy(model, input_ids: torch.Tensor, new_tokens: int,
                 use_cache: bool) -> tuple[list[int], list[float]]:
    """Greedy tokens and when each was ready (seconds from the start), with or without the KV cache."""
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    timed = list(timed_tokens(model, input_ids, params, use_cache))
    return [token for token, _ in timed], [seconds for _, seconds in timed]


def kv_prompt_ids(tok, prompt_tokens: int = 32, device=None) -> torch.Tensor:
    """The kv rung's prompt: the first `prompt_tokens` tokens of KV_PROMPT_TEXT, [1, T]."""
    ids = tok.encode(KV_PROMPT_TEXT, add_special_tokens=False)
    prompt_tokens = validate.integer("prompt_tokens", prompt_tokens, low=1, high=len(ids))
    return torch.tensor([ids[:prompt_tokens]], device=device)


def kv_comparison(model, input_ids: torch.Tensor, new_tokens: int = 512) -> KVComparison:
    """Decode `new_tokens` greedily with the cache and by recomputation, one run each, after a warm-up."""
    timed_greedy(model, input_ids, 8, use_cache=True)              # warm-up: allocator, kernels
    timed_greedy(model, input_ids, 2, use_cache=False)
    cached_ids, cached_t = timed_greedy(model, input_ids, new_tokens, use_cache=True)
    recomputed_ids, recomputed_t = timed_greedy(model, input_ids, new_tokens, use_cache=False)
    return KVComparison(input_ids.shape[1], cached_ids, recomputed_ids, cached_t, recomputed_t)


def bench_kv(model_name: str = "target", new_tokens: int = 512, prompt_tokens: int = 32) -> Result:
    """Greedy decode with the KV cache vs recomputing the whole sequence every step, in one run."""
    from ..costs import generation_cost
    device = get_device()
    model, tok = load_model(model_name, device=device)
    c = kv_comparison(model, kv_prompt_ids(tok, prompt_tokens, device), new_tokens)
    flops = {use: generation_cost(model.config, prompt_tokens, new_tokens, use_cache=use).flops
             for use in (True, False)}
    cached_steps, recomputed_steps = c.step_times(c.cached_times_s), c.step_times(c.recomputed_times_s)
    r = Result("kv: greedy decode, KV cache vs recomputation")
    r.add("model", describe_model(model_name, model, device))
    r.add("prompt / new tokens", f"{prompt_tokens} / {new_tokens}")
    r.add("with KV cache", f"{c.cached_s:.2f} s  ({new_tokens / c.cached_s:.1f} tokens/s, "
                           f"last step {cached_steps[-1] * 1e3:.2f} ms)")
    r.add("recomputing", f"{c.recomputed_s:.2f} s  ({new_tokens / c.recomputed_s:.1f} tokens/s, "
                         f"last step {recomputed_steps[-1] * 1e3:.2f} ms)")
    r.add("speedup of the cache", f"{c.speedup:.1f}x")
    r.add("FLOPs ratio (cost model)", f"{flops[False] / flops[True]:.1f}x")
    r.add("same greedy tokens", str(c.same_tokens))
    r.values = {"same_tokens": c.same_tokens, "speedup": c.speedup, "cached_s": c.cached_s,
                "recomputed_s": c.recomputed_s, "flops_ratio": flops[False] / flops[True]}
    return r


PASS_SIZES = (1, 2, 3, 5, 9)


def precision_variants(model, model_name: str, device) -> dict[str, torch.nn.Module]:
    """fp32 (as loaded), bf16 where the CPU has it, int8 per-channel and int4 groups of 64."""
    from ..quantize import quantize_model
    variants = {"fp32": model}
    if device.type != "cpu" or bf16_supported():
        variants["bf16"] = load_model(model_name, dtype=torch.bfloat16, device=device)[0]
    variants["int8"] = quantize_model(model, "int8")
    variants["int4 g64"] = quantize_model(model, "int4", group_size=64)
    return variants


def precision_row(r: Result, name: str, m, tok, step_s: dict[str, float], pass_cost: dict[int, float],
                  reference: list[list[int]], prompts, new_tokens: int, quality_tokens: int,
                  ppl0: float | None) -> dict:
    """One precision's rows (bytes, speed, perplexity, exact-match, its matmul path, its pass costs) and values.

    `ppl0` is fp32's perplexity, None for fp32 itself (it is the first variant).
    """
    from ..quality import evaluate, exact_match, matched_prefix
    from ..quantize import quant_paths, state_dict_bytes
    ev = evaluate(m, tok, "val", max_tokens=quality_tokens)
    ppl0 = ppl0 or ev.perplexity
    ids = reference if name == "fp32" else [greedy_ids(m, tok, p, new_tokens) for p in prompts]
    match, base = exact_match(reference, ids, new_tokens), step_s["fp32"]
    r.add(name, f"{state_dict_bytes(m) / 2**20:6.1f} MiB, {1 / step_s[name]:6.1f} tokens/s "
                f"({base / step_s[name]:.2f}x fp32), perplexity {ev.perplexity:.3f} "
                f"({ev.perplexity / ppl0 - 1:+.2%}), greedy exact-match {match:.0%} "
                f"(matched prefix {matched_prefix(reference, ids):.1f}/{new_tokens})")
    reasons = sorted({layer.fallback_reason for layer in m.modules() if getattr(layer, "fallback_reason", None)})
    r.add(f"  {name} path", (", ".join(f"{k} x{v}" for k, v in quant_paths(m).items()) or "float matmuls")
          + "".join(f"; fallback: {why}" for why in reasons))
    r.add(f"  {name} pass over n tokens", ", ".join(f"n={n}: {pass_cost[n] / pass_cost[1]:.2f}x" for n in PASS_SIZES))
    return {"tokens_per_s": 1 / step_s[name], "speedup": base / step_s[name], "perplexity": ev.perplexity,
            "exact_match": match, "pass_cost": {n: pass_cost[n] / pass_cost[1] for n in PASS_SIZES},
            "bytes": state_dict_bytes(m)}


def bench_precision(model_name: str = "target", context_len: int = 64, steps: int = 16,
                    quality_tokens: int = 8192, n_prompts: int = 8, new_tokens: int = 32) -> Result:
    """Decode speed, the cost of a pass over k + 1 tokens and quality, for each weight precision, in one run."""
    from ..timing import time_cached_passes, time_decode_step
    device = get_device()
    model, tok = load_model(model_name, device=device)
    variants = precision_variants(model, model_name, device)
    step_s: dict[str, float] = {}
    for _ in range(2):                         # two rounds in turn; each precision's better round
        for name, m in variants.items():
            t = time_decode_step(m, batch_size=1, context_len=context_len, steps=steps)
            step_s[name] = min(step_s.get(name, float("inf")), t)
    passes = {name: time_cached_passes(m, PASS_SIZES, context_len) for name, m in variants.items()}
    prompts = PROMPTS[:n_prompts]
    reference = [greedy_ids(model, tok, p, new_tokens) for p in prompts]
    r = Result("precision: weight bytes, decode speed, (k+1)-token passes and quality, batch 1")
    r.add("model", describe_model(model_name, model, device) + f"; decode after {context_len} cached tokens")
    values: dict[str, dict] = {}
    for name, m in variants.items():
        values[name] = precision_row(r, name, m, tok, step_s, passes[name], reference, prompts, new_tokens,
                                     quality_tokens, values.get("fp32", {}).get("perplexity"))
    r.values = values
    r.add("quality scored on", f"{quality_tokens} validation tokens (perplexity) and the first {new_tokens} greedy "
                               f"tokens of {len(prompts)} prompts (exact-match against fp32)")
    return r


def bench_batch_size(model_name: str = "target", batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
                     new_tokens: int = 32) -> Result:
    """Total decode tokens/s of the engine against batch size: nearly free while the weights dominate."""
    device = get_device()
    model, tok = load_model(model_name, device=device)
    decode_throughput(model, tok, 2, new_tokens=4)                       # warm-up
    rates = {}
    for b in batch_sizes:                                                # twice, in turn: the best of two
        for _ in range(2):
            rates[b] = max(rates.get(b, 0.0), decode_throughput(model, tok, b, new_tokens))
    r = Result("batch size: total decode tokens/s on the engine")
    r.add("model", describe_model(model_name, model, device))
    r.add("workload", f"the same prompt x batch size, {new_tokens} new tokens each, decode steps only")
    base = rates[batch_sizes[0]]
    for b, rate in rates.items():
        r.add(f"batch {b}", f"{rate:.1f} tokens/s total ({rate / base:.2f}x batch {batch_sizes[0]}), "
                            f"{b / rate * 1e3:.1f} ms per step")
    r.values = {"throughput_tok_s": rates, "scaling": {b: x / base for b, x in rates.items()}}
    return r
