"""The quant rung: every quantization scheme on one model, measured side by side in one run.

For each scheme: state_dict bytes (what saving it writes), the ratio to fp32,
greedy decode tokens/s, val perplexity, exact-match of the first 32 greedy tokens
against the unquantized model, and the share of completions that parse.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..device import get_device, has_native_bf16
from ..gptq import calibration_ids, gptq_quantize_model
from ..kv_cache import KVCache
from ..kv_quant import QuantizedKVCache
from ..loading import load_model
from ..quality import PROMPTS, perplexity, quality_report, split_tokens
from ..quantize import quantize_model, state_dict_bytes
from ..timing import time_interleaved
from .decode import decode_tokens_per_s
from .result import Result

MB = 2 ** 20


@dataclass
class Scheme:
    """A way of storing the model: how to build it from the float model, and the KV cache it decodes with."""

    name: str
    build: Callable[[nn.Module], nn.Module]          # float model -> model to measure
    cache_factory: Callable = KVCache.for_model      # the KV cache it decodes with


@dataclass
class SchemeRow:
    """One scheme's line of the scorecard."""

    name: str
    state_mb: float        # state_dict MiB
    ratio: float           # fp32 state_dict bytes / this scheme's
    kv_bytes: int          # bytes of a KV cache of the model's full context, batch 1
    tokens_per_s: float    # one greedy request at batch 1: new tokens / its latency (decode_tokens_per_s)
    perplexity: float      # val split (through the KV cache for a cache scheme)
    exact_match: float     # share of prompts whose first 32 greedy tokens equal the float model's
    parse_rate: float      # share of completed functions that ast.parse accepts


def divides_all(model: nn.Module, group_size: int) -> bool:
    """Whether group_size divides the input features of every nn.Linear of the model."""
    return all(m.in_features % group_size == 0 for m in model.modules() if isinstance(m, nn.Linear))


def default_schemes(model: nn.Module, tok, group_sizes=(128, 64, 32), gptq_group: int = 64,
                    bf16: bool | None = None) -> list[Scheme]:
    """fp32, bf16, int8 per-channel, int4 per-channel and group-wise, int4 + GPTQ, int8 KV cache.

    `bf16=None` keeps the bf16 row where the model's device has bf16 in hardware (`device.has_native_bf16`):
    elsewhere bf16 is emulated, and its perplexity pass alone takes many times fp32's.
    """
    def to(dtype):
        return lambda m: copy.deepcopy(m).to(dtype)
    if bf16 is None:
        bf16 = has_native_bf16(next(model.parameters()).device)
    schemes = [Scheme("fp32", to(torch.float32))] + ([Scheme("bf16", to(torch.bfloat16))] if bf16 else [])
    schemes += [Scheme("int8 per-channel", lambda m: quantize_model(m, "int8")),
                Scheme("int4 per-channel", lambda m: quantize_model(m, "int4", None))]
    schemes += [Scheme(f"int4 g{g}", lambda m, g=g: quantize_model(m, "int4", g))
                for g in group_sizes if divides_all(model, g)]
    calib = calibration_ids(tok)
    schemes.append(Scheme(f"int4 g{gptq_group} + GPTQ", lambda m: gptq_quantize_model(m, calib, gptq_group)))
    schemes.append(Scheme("fp32 + int8 KV", to(torch.float32), QuantizedKVCache.for_model))
    return schemes


@torch.inference_mode()
def cached_perplexity(model, tok, cache_factory=KVCache.for_model, max_tokens: int | None = None,
                      seq_len: int = 512, chunk: int = 64, batch_size: int = 8) -> float:
    """Val perplexity computed chunk by chunk through a KV cache, so a cache's rounding reaches the score."""
    from ..data import eval_windows
    tokens, _ = split_tokens(tok, "val")
    tokens = tokens[:max_tokens + 1] if max_tokens is not None else tokens
    windows = eval_windows(tokens, min(seq_len, model.config.max_seq_len))   # (N, T + 1)
    if len(windows) == 0:
        raise ValueError(f"no window of seq_len={seq_len} tokens fits in the {len(tokens)} tokens scored: "
                         "give max_tokens >= seq_len (or a smaller seq_len)")
    device = next(model.parameters()).device
    nats, n = 0.0, 0
    for w in windows.split(batch_size):
        w = w.to(device)
        cache = cache_factory(model, w.shape[0], w.shape[1] - 1)
        for start in range(0, w.shape[1] - 1, chunk):
            ids = w[:, start:start + chunk]                                   # (B, chunk)
            pos = torch.arange(start, start + ids.shape[1], device=device)
            logits = model(ids, pos, cache).float()                           # (B, chunk, V)
            target = w[:, start + 1:start + 1 + ids.shape[1]]
            nats += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
            n += target.numel()
    return math.exp(nats / n)


def scheme_table(model, tok, schemes: list[Scheme] | None = None, max_tokens: int | None = None,
                 prompts: tuple[str, ...] = PROMPTS,
                 progress: Callable[[str], None] | None = None) -> list[SchemeRow]:
    """Measure every scheme on `model` (kept untouched) with `tok`; perplexity over max_tokens val tokens."""
    schemes = schemes or default_schemes(model, tok)
    reference = quality_report(model, tok, prompts=prompts)["token_ids"]
    fp32_bytes = state_dict_bytes(model) * 4 // next(model.parameters()).element_size()
    ctx = model.config.max_seq_len
    rows = []
    for s in schemes:
        if progress:
            progress(s.name)
        m = s.build(model)
        q = quality_report(m, tok, reference, prompts=prompts, cache_factory=s.cache_factory)
        rows.append(SchemeRow(
            name=s.name, state_mb=state_dict_bytes(m) / MB, ratio=fp32_bytes / state_dict_bytes(m),
            kv_bytes=s.cache_factory(m, 1, ctx).nbytes, tokens_per_s=decode_tokens_per_s(m, tok, s.cache_factory),
            perplexity=perplexity(m, tok, max_tokens=max_tokens) if s.cache_factory is KVCache.for_model
            else cached_perplexity(m, tok, s.cache_factory, max_tokens),
            exact_match=q["exact_match"],
            parse_rate=q["parse_rate"]))
    return rows


def format_table(rows: list[SchemeRow]) -> str:
    """The scorecard as aligned text, one scheme per line."""
    head = f"{'scheme':<22}{'MiB':>7}{'vs fp32':>9}{'KV MiB':>8}{'tok/s':>8}{'ppl':>8}{'ppl +%':>8}{'match':>7}{'parse':>7}"
    base = rows[0].perplexity
    lines = [head] + [f"{r.name:<22}{r.state_mb:>7.2f}{r.ratio:>8.2f}x{r.kv_bytes / MB:>8.2f}"
                      f"{r.tokens_per_s:>8.1f}{r.perplexity:>8.3f}{100 * (r.perplexity / base - 1):>+8.2f}"
                      f"{r.exact_match:>7.0%}{r.parse_rate:>7.0%}" for r in rows]
    return "\n".join(lines)


def matmul_speedup(n: int = 4096, repeats: int = 20, device: str = "cpu") -> dict[str, float]:
    """Seconds of a batch-1 [1, n] @ [n, n] matmul: bf16 weights vs int8 weight-only (the fused kernel)."""
    from ..quantize import int8_kernel_works
    x = torch.randn(1, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    wq = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
    scales = torch.rand(n, device=device, dtype=torch.bfloat16)
    if not int8_kernel_works(torch.device(device).type, torch.bfloat16):
        raise RuntimeError(f"aten._weight_int8pack_mm does not run for bf16 on {device} with torch {torch.__version__}")
    t = time_interleaved({"bf16": lambda: torch.nn.functional.linear(x, w),
                          "int8": lambda: torch.ops.aten._weight_int8pack_mm(x, wq, scales)},
                         repeats=repeats, warmup=3, device=device)
    return {"bf16_s": t["bf16"], "int8_s": t["int8"], "speedup": t["bf16"] / t["int8"]}


def bench_quant(model_name: str = "target", max_tokens: int | None = None) -> Result:
    """Every quantization scheme on one model (memory, speed, quality), and the int8 vs bf16 matmul."""
    device = get_device()
    model, tok = load_model(model_name, device=device)
    rows = scheme_table(model, tok, default_schemes(model, tok), max_tokens=max_tokens,
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
