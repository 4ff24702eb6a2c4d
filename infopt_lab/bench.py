"""The optimization ladder behind `infopt-lab bench`: each rung measured side by side.

Every rung runs its contenders in one process on the same weights, prompt and
length, and reports ratios, so the figures mean the same on any machine.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .batching import DEFAULT_PROMPT, decode_throughput
from .device import default_dtype, get_device, synchronize
from .loading import load_model, resolve_model_dir
from .metrics import model_weight_bytes
from .timing import bf16_supported, matvec_bandwidth_gbs, measure_bandwidth_gbs, time_interleaved


@dataclass
class Result:
    name: str
    rows: list[tuple[str, str]] = field(default_factory=list)   # (label, formatted value)
    values: dict[str, float | bool] = field(default_factory=dict)  # raw figures, for tests and notebooks

    def add(self, label: str, value: str) -> None:
        self.rows.append((label, value))

    def render(self) -> str:
        width = max((len(label) for label, _ in self.rows), default=0)
        lines = [f"== {self.name} =="] + [f"  {label:<{width}} : {value}" for label, value in self.rows]
        return "\n".join(lines)


def _describe(model_name: str, model, device) -> str:
    """'target (5.28M params, torch.float32, cpu)' for a Result's model row."""
    return f"{model_name} ({model.num_parameters() / 1e6:.2f}M params, {next(model.parameters()).dtype}, {device})"


def bench_decode(model_name: str = "target", new_tokens: int = 128, repeats: int = 3,
                 prompt: str = DEFAULT_PROMPT) -> Result:
    """Batch-1 greedy decode with our KV cache vs transformers' generate on the same weights."""
    from transformers import AutoModelForCausalLM
    from .generate import generate
    device = get_device()
    model, tok = load_model(model_name, device=device)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name),
                                              dtype=next(model.parameters()).dtype).to(device).eval()
    ids = torch.tensor([tok.encode(prompt)], device=device)
    n_prompt = ids.shape[1]

    def ours():
        return generate(model, tok, prompt, max_new_tokens=new_tokens, stop_at_eos=False)

    def theirs():
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)

    # in turn (ours, theirs, ours, ...) after a warm-up round: allocator, kernels, caches
    t = time_interleaved({"ours": ours, "theirs": theirs}, repeats=repeats, warmup=1, device=device)
    t_ours, t_hf = t["ours"], t["theirs"]
    same = ours().token_ids == theirs()[0, n_prompt:].tolist()
    out = ours()                                               # for TTFT and TPOT

    weight_bytes = model_weight_bytes(model)
    bandwidth = measure_bandwidth_gbs(device=device)
    bound = bandwidth * 1e9 / weight_bytes                     # tokens/s if each step streamed the weights once
    gemv = matvec_bandwidth_gbs(model)                         # what one matrix-vector product streams
    bf16 = bf16_decode_tokens_per_s(model_name, tok, prompt, new_tokens) if device.type == "cpu" else None
    r = Result("decode: batch 1, greedy, KV cache")
    r.add("model", _describe(model_name, model, device))
    r.add("prompt / new tokens", f"{n_prompt} / {new_tokens}")
    r.add("infopt_lab tokens/s", f"{new_tokens / t_ours:.1f}  (TTFT {out.ttft_s * 1e3:.1f} ms, "
                                 f"TPOT {out.tpot_s * 1e3:.2f} ms)")
    r.add("transformers tokens/s", f"{new_tokens / t_hf:.1f}")
    r.add("speedup vs transformers", f"{t_hf / t_ours:.2f}x")
    r.add("same greedy tokens", str(same))
    r.add("weight bytes", f"{weight_bytes / 2**20:.1f} MiB")
    r.add("measured bandwidth", f"{bandwidth:.1f} GB/s")
    r.add("weight-streaming bound", f"{bound:.0f} tokens/s")
    r.add("fraction of bound reached", f"{new_tokens / t_ours / bound:.1%}")
    r.add("one matrix-vector product", f"{gemv:.1f} GB/s streaming the head's weight alone: "
                                       f"{gemv * 1e9 / weight_bytes:.0f} tokens/s if every weight streamed so; "
                                       f"reached {new_tokens / t_ours / (gemv * 1e9 / weight_bytes):.1%} of that")
    if bf16 is not None:
        r.add("bf16 weights (same loop)", f"{bf16:.1f} tokens/s ({bf16 / (new_tokens / t_ours):.2f}x fp32)"
                                          if bf16 else "this CPU has no fast bf16 matrix products: not measured")
    r.values = {"same_tokens": same, "speedup": t_hf / t_ours, "fraction_of_bound": new_tokens / t_ours / bound,
                "fraction_of_matvec_bound": new_tokens / t_ours / (gemv * 1e9 / weight_bytes), "bf16_tokens_per_s": bf16}
    return r


def bf16_decode_tokens_per_s(model_name: str, tok, prompt: str, new_tokens: int) -> float | None:
    """Greedy tokens/s of the same loop with bf16 weights and activations on a CPU; None without native bf16."""
    from .generate import generate
    from .timing import time_fn
    if not bf16_supported():
        return None
    model, _ = load_model(model_name, dtype=torch.bfloat16, device="cpu")
    seconds = time_fn(lambda: generate(model, tok, prompt, max_new_tokens=new_tokens, stop_at_eos=False),
                      repeats=2, warmup=1)
    return new_tokens / seconds


# A fixed piece of library-style code: the kv rung's prompt is its first `prompt_tokens` tokens.
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
        return self.cached_ids == self.recomputed_ids

    @property
    def cached_s(self) -> float:
        return self.cached_times_s[-1]

    @property
    def recomputed_s(self) -> float:
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
    from .generate import generate_tokens
    from .sampling import SamplingParams
    device = input_ids.device
    tokens, times = [], []
    synchronize(device)
    start = time.perf_counter()
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    for token in generate_tokens(model, input_ids, params, use_cache):
        synchronize(device)
        times.append(time.perf_counter() - start)
        tokens.append(int(token[0]))
    return tokens, times


def kv_prompt_ids(tok, prompt_tokens: int = 32, device=None) -> torch.Tensor:
    """The kv rung's prompt: the first `prompt_tokens` tokens of KV_PROMPT_TEXT, [1, T]."""
    ids = tok.encode(KV_PROMPT_TEXT, add_special_tokens=False)
    if not 1 <= prompt_tokens <= len(ids):
        raise ValueError(f"prompt_tokens must be between 1 and {len(ids)}, got {prompt_tokens}")
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
    from .costs import generation_cost
    device = get_device()
    model, tok = load_model(model_name, device=device)
    ids = kv_prompt_ids(tok, prompt_tokens, device)
    c = kv_comparison(model, ids, new_tokens)
    flops = {use: generation_cost(model.config, prompt_tokens, new_tokens, use_cache=use).flops
             for use in (True, False)}
    cached_steps, recomputed_steps = c.step_times(c.cached_times_s), c.step_times(c.recomputed_times_s)
    r = Result("kv: greedy decode, KV cache vs recomputation")
    r.add("model", _describe(model_name, model, device))
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


def bench_quant(model_name: str = "target", max_tokens: int | None = None) -> Result:
    """Every quantization scheme on one model (memory, speed, quality), and the int8 vs bf16 matmul."""
    from .quant_eval import default_schemes, format_table, matmul_speedup, scheme_table
    device = get_device()
    model, tok = load_model(model_name, device=device)
    schemes = default_schemes(model, tok)
    rows = scheme_table(model, tok, schemes, max_tokens=max_tokens,
                        progress=lambda name: print(f"  measuring {name} ...", flush=True))
    mm = matmul_speedup(device=str(device))
    by_name = {row.name: row for row in rows}
    r = Result("quant: weight and KV-cache quantization, batch 1")
    r.add("model", f"{model_name} ({model.num_parameters() / 1e6:.2f}M params, {device}); "
                   f"perplexity over {'all' if max_tokens is None else max_tokens} val tokens")
    for line in format_table(rows).splitlines():
        r.add("", line)
    r.add("4096x4096 matmul, batch 1", f"bf16 {mm['bf16_s'] * 1e3:.2f} ms, int8 weight-only "
                                       f"{mm['int8_s'] * 1e3:.2f} ms: {mm['speedup']:.2f}x")
    base = by_name["fp32"].perplexity
    gptq_name = next(n for n in by_name if "GPTQ" in n)
    r.values = {"int8_matmul_speedup": mm["speedup"], "rows": rows,
                "int8_ppl_increase": by_name["int8 per-channel"].perplexity / base - 1,
                "int4_g64_ppl_increase": by_name["int4 g64"].perplexity / base - 1,
                "gptq_beats_rtn": by_name[gptq_name].perplexity < by_name["int4 g64"].perplexity}
    return r


def bench_batching(model_name: str = "target", n_requests: int = 64, max_batch_size: int = 8,
                   seed: int = 0) -> Result:
    """Static vs continuous batching on our paged engine vs transformers' padded batched generate."""
    from transformers import AutoModelForCausalLM
    from .batching import compare_policies
    from .workloads import code_prompts, skewed_lengths
    from .metrics import percentiles
    device = get_device()
    model, tok = load_model(model_name, device=device)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name),
                                              dtype=next(model.parameters()).dtype).to(device).eval()
    prompts, lengths = code_prompts(tok, n_requests, seed=seed), skewed_lengths(n_requests, seed=seed)
    runs = compare_policies(model, tok, prompts, lengths, max_batch_size, hf_model=hf)
    cont, static, hf_run = runs["continuous"], runs["static"], runs["transformers"]
    r = Result("batching: static vs continuous on the paged engine, and transformers")
    r.add("model", _describe(model_name, model, device))
    r.add("workload", f"{n_requests} requests, prompts {min(len(tok.encode(p)) for p in prompts)}-"
                      f"{max(len(tok.encode(p)) for p in prompts)} tokens, outputs {min(lengths)}-{max(lengths)} "
                      f"tokens (median {sorted(lengths)[len(lengths) // 2]}), max_batch_size {max_batch_size}")
    for run in (cont, static):
        s, lat = run.stats, percentiles(run.e2e_s, (50, 99))
        r.add(f"{run.name}", f"{run.throughput_tok_s:.1f} tok/s, utilization {s.utilization:.1%}, "
                             f"{s.steps} steps, latency p50 {lat['p50']:.2f} s / p99 {lat['p99']:.2f} s")
    r.add("transformers padded generate", f"{hf_run.throughput_tok_s:.1f} tok/s")
    r.add("continuous / static", f"{cont.throughput_tok_s / static.throughput_tok_s:.2f}x")
    r.add("continuous / transformers", f"{cont.throughput_tok_s / hf_run.throughput_tok_s:.2f}x")
    r.add("KV slots holding real tokens", f"paged {cont.stats.kv_real_share:.1%} vs contiguous at full "
                                          f"context {cont.stats.kv_real_share_contiguous:.1%}")
    same = cont.token_ids == static.token_ids
    r.add("same greedy tokens", f"continuous = static: {same}; = transformers: "
                                f"{sum(a == b for a, b in zip(cont.token_ids, hf_run.token_ids))}/{n_requests}")
    r.values = {"continuous_over_static": cont.throughput_tok_s / static.throughput_tok_s,
                "continuous_over_transformers": cont.throughput_tok_s / hf_run.throughput_tok_s,
                "continuous_utilization": cont.stats.utilization, "static_utilization": static.stats.utilization,
                "kv_real_share": cont.stats.kv_real_share, "same_tokens": same}
    return r


PASS_SIZES = (1, 2, 3, 5, 9)


def precision_variants(model, model_name: str, device) -> dict[str, torch.nn.Module]:
    """fp32 (as loaded), bf16 where the CPU has it, int8 per-channel and int4 groups of 64."""
    from .quantize import quantize_model
    variants = {"fp32": model}
    if device.type != "cpu" or bf16_supported():
        variants["bf16"] = load_model(model_name, dtype=torch.bfloat16, device=device)[0]
    variants["int8"] = quantize_model(model, "int8")
    variants["int4 g64"] = quantize_model(model, "int4", group_size=64)
    return variants


def bench_precision(model_name: str = "target", context_len: int = 64, steps: int = 16,
                    quality_tokens: int = 8192, n_prompts: int = 8, new_tokens: int = 32) -> Result:
    """Decode speed, the cost of a pass over k + 1 tokens and quality, for each weight precision, in one run."""
    from .quality import PROMPTS, evaluate, exact_match, greedy_ids, matched_prefix
    from .quantize import quant_paths, state_dict_bytes
    from .timing import time_cached_passes, time_decode_step
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
    r.add("model", _describe(model_name, model, device) + f"; decode after {context_len} cached tokens")
    base = step_s["fp32"]
    ppl0 = None
    values = {}
    for name, m in variants.items():
        paths = quant_paths(m)
        ev = evaluate(m, tok, "val", max_tokens=quality_tokens)
        ppl0 = ppl0 or ev.perplexity
        ids = reference if name == "fp32" else [greedy_ids(m, tok, p, new_tokens) for p in prompts]
        cost = passes[name]
        r.add(name, f"{state_dict_bytes(m) / 2**20:6.1f} MiB, {1 / step_s[name]:6.1f} tokens/s "
                    f"({base / step_s[name]:.2f}x fp32), perplexity {ev.perplexity:.3f} "
                    f"({ev.perplexity / ppl0 - 1:+.2%}), greedy exact-match {exact_match(reference, ids, new_tokens):.0%} "
                    f"(matched prefix {matched_prefix(reference, ids):.1f}/{new_tokens})")
        reasons = sorted({layer.fallback_reason for layer in m.modules() if getattr(layer, "fallback_reason", None)})
        r.add(f"  {name} path", (", ".join(f"{k} x{v}" for k, v in paths.items()) or "float matmuls")
              + "".join(f"; fallback: {why}" for why in reasons))
        r.add(f"  {name} pass over n tokens", ", ".join(f"n={n}: {cost[n] / cost[1]:.2f}x" for n in PASS_SIZES))
        values[name] = {"tokens_per_s": 1 / step_s[name], "speedup": base / step_s[name],
                        "perplexity": ev.perplexity, "exact_match": exact_match(reference, ids, new_tokens),
                        "pass_cost": {n: cost[n] / cost[1] for n in PASS_SIZES}, "bytes": state_dict_bytes(m)}
    r.add("quality scored on", f"{quality_tokens} validation tokens (perplexity) and the first {new_tokens} greedy "
                               f"tokens of {len(prompts)} prompts (exact-match against fp32)")
    r.values = values
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
    r.add("model", _describe(model_name, model, device))
    r.add("workload", f"the same prompt x batch size, {new_tokens} new tokens each, decode steps only")
    base = rates[batch_sizes[0]]
    for b, rate in rates.items():
        r.add(f"batch {b}", f"{rate:.1f} tokens/s total ({rate / base:.2f}x batch {batch_sizes[0]}), "
                            f"{b / rate * 1e3:.1f} ms per step")
    r.values = {"tokens_per_s": rates, "scaling": {b: x / base for b, x in rates.items()}}
    return r


ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def bench_attention(model_name: str = "target", lengths: tuple[int, ...] = ATTENTION_LENGTHS) -> Result:
    """On CUDA: TFLOP/s of our Triton FlashAttention, SDPA and naive attention, bf16, causal, D=128.

    On a CPU: one line saying that speed needs a GPU, and the interpreter's agreement with the reference.
    (`model_name` is accepted for a uniform command line; attention is benchmarked on synthetic shapes.)
    """
    from .device import HAS_CUDA, HAS_TRITON
    from .kernels.benchmark import device_peak_tflops, gpu_contenders, interpreter_check, time_attention
    from .kernels.flash_attention import attention_path
    r = Result("attention: Triton FlashAttention vs PyTorch SDPA vs naive")
    r.add("path", attention_path(get_device()))
    if not HAS_TRITON:
        r.add("result", "Triton is not installed here: nothing to measure (the reference runs instead)")
        return r
    for label, err in interpreter_check():
        r.add(f"max |ours - reference|, {label}", f"{err:.2e}")
    if not HAS_CUDA:
        r.add("speed", "needs a CUDA GPU: the Triton interpreter runs kernels in Python, so on a CPU only "
                       "correctness is measured")
        return r
    peak = device_peak_tflops()
    r.add("device", f"{torch.cuda.get_device_name()} (16-bit peak {peak or 'unknown'} TFLOP/s)")
    r.add("shape", "B=4, H=16, D=128, bf16, causal; TFLOP/s (share of peak)")
    ratios = {}
    for N in lengths:
        timings = {t.impl: t for t in time_attention(gpu_contenders(), N)}
        cells = []
        for t in timings.values():
            if t.tflops is None:
                cells.append(f"{t.impl} OOM")
            else:
                share = f" ({t.tflops / peak:.0%})" if peak else ""
                cells.append(f"{t.impl} {t.tflops:.0f}{share}")
        r.add(f"N={N}", ", ".join(cells))
        ours, sdpa = timings["ours (Triton)"].tflops, timings["PyTorch SDPA"].tflops
        if ours and sdpa:
            ratios[N] = ours / sdpa
    r.add("ours / SDPA", ", ".join(f"N={n}: {x:.2f}x" for n, x in ratios.items()))
    r.values = {"ours_over_sdpa": ratios}
    return r


def bench_speculative(model_name: str = "target", draft_name: str | None = None, new_tokens: int = 128,
                      dtypes: tuple[torch.dtype, ...] | None = None, ks: tuple[int, ...] | None = None) -> Result:
    """Target greedy vs speculative (each k) vs transformers' assisted generation, per precision, one run.

    Each precision pits the pair against the same target alone (fp32 against fp32, bf16 against
    bf16). The real model's rung measures fp32 and bf16; prompt lookup runs on the first precision.
    """
    from .loading import DRAFT_OF
    from .speculative_bench import SPEC_PROMPTS
    draft_name = draft_name or DRAFT_OF.get(model_name)
    if draft_name is None:
        raise ValueError(f"no bundled draft shares {model_name!r}'s tokenizer; give draft_name (known pairs: {DRAFT_OF})")
    device = get_device()
    real = model_name in DRAFT_OF and model_name != "target"
    dtypes = dtypes or ((torch.float32, torch.bfloat16) if real and device.type == "cpu" else (default_dtype(device),))
    ks = ks or ((2, 3, 4) if real else (1, 2, 3, 4, 6))       # the real pair's steps are 10x longer: fewer k
    r = Result("speculative: draft -> verify -> accept, greedy, vs the same target alone and transformers")
    r.add("workload", f"{len(SPEC_PROMPTS)} code prompts x {new_tokens} new tokens, greedy")
    values: dict[str, dict] = {}
    for n, dtype in enumerate(dtypes):
        values[_dtype_name(dtype)] = _speculative_precision(r, model_name, draft_name, device, dtype, new_tokens, ks,
                                                            lookup=n == 0)
    best = max(values, key=lambda d: values[d]["best_over_target"])
    r.add("best pair / same target alone", f"{values[best]['best_over_target']:.2f}x ({best}, "
                                           f"{values[best]['best_k']})")
    r.values = {**values[best], "by_precision": values}
    return r


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _speculative_precision(r: Result, model_name: str, draft_name: str, device, dtype, new_tokens: int,
                           ks: tuple[int, ...], lookup: bool) -> dict:
    """One precision's rows: target alone, each k, transformers' assisted generation (and prompt lookup)."""
    from transformers import AutoModelForCausalLM
    from .speculative import expected_tokens_per_pass
    from .speculative_bench import SPEC_PROMPTS, prompt_lookup_runs, speculative_runs
    name = _dtype_name(dtype)
    target, tok = load_model(model_name, dtype=dtype, device=device)
    draft, _ = load_model(draft_name, dtype=dtype, device=device)
    hf_target, hf_draft = (AutoModelForCausalLM.from_pretrained(resolve_model_dir(n), dtype=dtype).to(device).eval()
                           for n in (model_name, draft_name))
    runs = speculative_runs(target, draft, tok, SPEC_PROMPTS, new_tokens, ks=ks, hf_pair=(hf_target, hf_draft))
    base = runs["target"]
    r.add(f"[{name}] models", f"{_describe(model_name, target, device)} with draft {_describe(draft_name, draft, device)}")
    r.add(f"[{name}] target only", f"{base.tokens_per_s:.1f} tok/s")
    spec = {n: x for n, x in runs.items() if x.alpha is not None}
    for key, x in spec.items():
        k = int(key.split("=")[1])
        r.add(f"[{name}] speculative {key}", f"{x.tokens_per_s:.1f} tok/s ({x.tokens_per_s / base.tokens_per_s:.2f}x), "
                                            f"alpha {x.alpha:.3f}, tokens/pass {x.tokens_per_pass:.2f} "
                                            f"(formula {expected_tokens_per_pass(x.alpha, k):.2f}), "
                                            f"same tokens: {x.token_ids == base.token_ids}")
    best_key = max(spec, key=lambda n: spec[n].tokens_per_s)
    best, hf = spec[best_key], runs["transformers"]
    r.add(f"[{name}] {hf.name}", f"{hf.tokens_per_s:.1f} tok/s, same tokens: {hf.token_ids == base.token_ids}")
    r.add(f"[{name}] best speculative / target", f"{best.tokens_per_s / base.tokens_per_s:.2f}x ({best.name})")
    r.add(f"[{name}] best speculative / transformers assisted", f"{best.tokens_per_s / hf.tokens_per_s:.2f}x")
    values = {"best_over_target": best.tokens_per_s / base.tokens_per_s, "best_k": best_key,
              "best_over_transformers": best.tokens_per_s / hf.tokens_per_s,
              "same_tokens": all(x.token_ids == base.token_ids for x in spec.values()),
              "formula_error": {n: x.tokens_per_pass / expected_tokens_per_pass(x.alpha, int(n.split("=")[1])) - 1
                                for n, x in spec.items()}}
    if lookup:
        look = prompt_lookup_runs(target, tok, new_tokens=new_tokens, hf_target=hf_target)
        lb, lk, lh = look["target"], look["lookup"], look["transformers"]
        r.add(f"[{name}] prompt lookup (repeating prompt)",
              f"{lk.tokens_per_s:.1f} vs target {lb.tokens_per_s:.1f} tok/s: {lk.tokens_per_s / lb.tokens_per_s:.2f}x, "
              f"tokens/pass {lk.tokens_per_pass:.2f}, same tokens: {lk.token_ids == lb.token_ids}")
        r.add(f"[{name}] {lh.name}", f"{lh.tokens_per_s:.1f} tok/s")
        values["lookup_over_target"] = lk.tokens_per_s / lb.tokens_per_s
    return values


def bench_engine(**kwargs) -> Result:
    """Prefix caching and speculative decoding inside the engine (engine_bench.py)."""
    from .engine_bench import bench_engine as engine_rung
    return engine_rung(**kwargs)


LADDER: dict[str, Callable[..., Result]] = {
    "decode": bench_decode,
    "kv": bench_kv,
    "quant": bench_quant,
    "batching": bench_batching,
    "batch_size": bench_batch_size,
    "precision": bench_precision,
    "attention": bench_attention,
    "speculative": bench_speculative,
    "engine": bench_engine,
}


# the rungs `infopt-lab bench --model smollm2-135m` runs by default: the real model's speed lessons
REAL_MODEL_RUNGS = ("decode", "precision", "batch_size")


def run(only: list[str] | None = None, **kwargs) -> list[Result]:
    """Run the named rungs (by default all of them, or REAL_MODEL_RUNGS on the real model) and print each."""
    from .hub import REMOTE
    real = kwargs.get("model_name") in REMOTE
    names = only or (list(REAL_MODEL_RUNGS) if real else list(LADDER))
    unknown = [n for n in names if n not in LADDER]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown}; choose from {list(LADDER)}")
    from .device import describe
    print("machine: " + ", ".join(f"{k} {v}" for k, v in describe().items()), flush=True)
    results = []
    for name in names:
        result = LADDER[name](**kwargs)
        print(result.render(), flush=True)
        results.append(result)
    return results

