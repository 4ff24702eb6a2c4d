"""The engine rung (`--only engine`): prefix caching and speculation inside the batch, against the same engine.

Part 1 serves the agentic workload (sessions sharing a long system prompt,
several turns each) with and without prefix caching. Part 2 serves the same
requests at several batch sizes with and without a draft, and measures why the
gain shrinks as the batch grows: a packed target step over B(k + 1) tokens
costs more than one over B tokens once the step is no longer bound by reading
the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..attention import NoCache
from ..device import get_device
from ..loading import load_model
from ..metrics import percentiles
from ..timing import time_interleaved
from .result import Result, describe_model
from .speculative import pass_costs

if TYPE_CHECKING:
    from ..engine.workload import SessionRun


@dataclass
class SpecPoint:
    """The same requests at one batch size, served plainly and with a draft, by the engine."""

    batch_size: int
    plain_tok_s: float
    spec_tok_s: float
    acceptance: float           # alpha, kept / judged drafts
    tokens_per_round: float
    same_tokens: bool
    verify_cost: float          # a packed target step over B (k + 1) tokens / one over B tokens

    @property
    def speedup(self) -> float:
        """Speculative throughput / plain throughput."""
        return self.spec_tok_s / self.plain_tok_s


def bench_engine(model_name: str = "target", draft_name: str | None = None, sessions: int = 16,
                 rate_per_s: float = 2.0, batch_sizes: tuple[int, ...] = (1, 4, 16), requests: int = 16,
                 new_tokens: int = 32, k: int | None = None) -> Result:
    """Prefix caching on the agentic workload, then batched speculative decoding against batch size, one run."""
    from ..loading import DRAFT_OF
    device = get_device()
    model, tok = load_model(model_name, device=device)
    draft_name = draft_name or DRAFT_OF.get(model_name)
    draft = load_model(draft_name, dtype=next(model.parameters()).dtype, device=device)[0] if draft_name else None
    k = k or (3 if model_name == "target" else 2)          # the real pair's best k (bench speculative)
    r = Result("engine: prefix caching on an agentic workload; speculative decoding inside the batch")
    r.add("model", describe_model(model_name, model, device))
    values = prefix_caching_rows(r, model, tok, sessions, rate_per_s)
    if draft is None:
        r.add("speculation", f"skipped: no bundled draft shares {model_name!r}'s tokenizer")
    else:
        r.add("draft", f"{describe_model(draft_name, draft, device)}, k = {k}")
        values.update(speculation_rows(r, model, draft, tok, batch_sizes, requests, new_tokens, k))
    r.values = values
    return r


def prefix_caching_runs(model, tok, workload) -> dict[bool, "SessionRun"]:
    """The workload served without (False) and with (True) prefix caching, each on a fresh engine, one slot a session."""
    from ..engine import Engine
    from ..engine.workload import run_sessions
    Engine(model, tok, max_batch_size=2).generate(["def f(x):"], max_new_tokens=2)    # warm up
    return {cache: run_sessions(Engine(model, tok, max_batch_size=len(workload.sessions),
                                       max_model_len=workload.max_seq_tokens, enable_prefix_caching=cache), workload)
            for cache in (False, True)}


def prefix_caching_rows(r: Result, model, tok, sessions: int, rate_per_s: float) -> dict:
    """Serve the agentic workload with and without prefix caching; rows and values."""
    from ..workloads import agentic_workload
    w = agentic_workload(tok, sessions=sessions, rate_per_s=rate_per_s)
    r.add("agentic workload", w.describe())
    runs = prefix_caching_runs(model, tok, w)
    for cache, run in runs.items():
        ttft = percentiles(run.ttft_s(), (50, 99))
        r.add("with prefix caching" if cache else "without prefix caching",
              f"TTFT p50 {ttft['p50'] * 1e3:.0f} ms, p99 {ttft['p99'] * 1e3:.0f} ms, "
              f"{run.throughput_tok_s():.1f} tok/s, KV blocks peak {run.stats.kv_blocks_peak}")
    off, on = runs[False], runs[True]
    ttft_ratio = percentiles(off.ttft_s(), (50,))["p50"] / percentiles(on.ttft_s(), (50,))["p50"]
    speedup = on.throughput_tok_s() / off.throughput_tok_s()
    same = [a.output.token_ids for a in off.turns] == [b.output.token_ids for b in on.turns]
    r.add("prefix cache", f"{on.stats.prefix_hit_rate:.1%} of looked-up prompt tokens hit, "
                          f"{on.stats.prefix_blocks_saved} blocks of keys and values reused, not computed")
    r.add("caching: TTFT p50 lower / throughput higher", f"{ttft_ratio:.1f}x / {speedup:.2f}x")
    r.add("caching: same tokens", str(same))
    return {"prefix_ttft_p50_ratio": ttft_ratio, "prefix_throughput_ratio": speedup,
            "prefix_hit_rate": on.stats.prefix_hit_rate, "prefix_blocks_saved": on.stats.prefix_blocks_saved,
            "prefix_same_tokens": same}


def speculation_points(model, draft, tok, batch_sizes=(1, 4, 16), requests: int = 16, new_tokens: int = 32,
                       k: int = 3, repeats: int = 2) -> list[SpecPoint]:
    """The same greedy requests served at each batch size, plain and with the draft; the faster of `repeats` runs.

    The two engines run in turn, so a machine whose speed drifts slows both alike.
    """
    from ..engine import Engine
    from ..workloads import code_prompts
    prompts = code_prompts(tok, requests)
    points = []
    for b in batch_sizes:
        engines = {"plain": Engine(model, tok, max_batch_size=b),
                   "spec": Engine(model, tok, max_batch_size=b, draft=draft, num_speculative_tokens=k)}
        runs = {}
        for engine in engines.values():
            engine.generate(prompts[:b], max_new_tokens=2)                             # warm up
        for _ in range(repeats):
            for name, engine in engines.items():
                out = engine.generate(prompts, max_new_tokens=new_tokens, stop_at_eos=False)
                if name not in runs or out.stats.throughput_tok_s > runs[name].stats.throughput_tok_s:
                    runs[name] = out
        plain, spec = runs["plain"], runs["spec"]
        points.append(SpecPoint(b, plain.stats.throughput_tok_s, spec.stats.throughput_tok_s,
                                spec.stats.acceptance_rate, spec.stats.tokens_per_round,
                                [o.token_ids for o in plain] == [o.token_ids for o in spec],
                                packed_step_cost(model, b, k)))
    return points


def speculation_rows(r: Result, model, draft, tok, batch_sizes, requests: int, new_tokens: int, k: int) -> dict:
    """Rows and values of `speculation_points`, with the cost model at batch 1 and the crossover."""
    from ..speculative import expected_tokens_per_pass
    r.add("speculation workload", f"{requests} code prompts x {new_tokens} new tokens, greedy, at batch sizes "
                                  f"{', '.join(map(str, batch_sizes))}")
    points = speculation_points(model, draft, tok, batch_sizes, requests, new_tokens, k)
    for p in points:
        r.add(f"batch {p.batch_size}", f"{p.plain_tok_s:.1f} -> {p.spec_tok_s:.1f} tok/s ({p.speedup:.2f}x), alpha "
                                       f"{p.acceptance:.3f}, {p.tokens_per_round:.2f} tokens/round (formula "
                                       f"{expected_tokens_per_pass(p.acceptance, k):.2f}), verify step "
                                       f"{p.verify_cost:.2f}x a plain one, same tokens: {p.same_tokens}")
    costs, draft_s = pass_costs(model, draft, new_tokens=(1, k + 1), repeats=20)
    c, v = draft_s / costs[1], costs[k + 1] / costs[1]
    one = next((p for p in points if p.batch_size == 1), points[0])
    predicted = expected_tokens_per_pass(one.acceptance, k) / (k * c + v)
    r.add("cost model at batch 1", f"draft step c = {c:.3f} of a target step, {k + 1}-token pass v = {v:.2f}x, "
                                   f"alpha {one.acceptance:.3f}: E / (k c + v) = {predicted:.2f}x "
                                   f"(measured {one.speedup:.2f}x)")
    crossover = crossover_batch(points)
    sizes = sorted(p.batch_size for p in points)
    r.add("crossover", "none: speculation pays at every batch size measured" if crossover is None else
          "speculation loses at every batch size measured (the cost model above says why at batch 1)"
          if crossover == sizes[0] else
          f"batch {crossover}: from there on speculation loses (the verify step over B (k + 1) tokens stops "
          "costing about one plain step as B grows, and rejected drafts' rows are paid for)")
    return {"spec": {p.batch_size: {"speedup": p.speedup, "alpha": p.acceptance, "verify_cost": p.verify_cost,
                                    "same_tokens": p.same_tokens} for p in points},
            "spec_cost_model": {"c": c, "v": v, "predicted": predicted}, "spec_crossover": crossover,
            "spec_same_tokens": all(p.same_tokens for p in points)}


def crossover_batch(points: list[SpecPoint]) -> int | None:
    """The smallest measured batch size from which speculation is slower than plain decoding at every larger one.

    None when it pays at the largest batch size measured.
    """
    return losing_from({p.batch_size: p.speedup for p in points})


def losing_from(speedups: dict[int, float]) -> int | None:
    """`crossover_batch` over {batch size: speedup}: from which batch size on every ratio is below 1 (None if none)."""
    crossover = None
    for batch in sorted(speedups, reverse=True):
        if speedups[batch] >= 1:
            break
        crossover = batch
    return crossover


def packed_step_cost(model, batch_size: int, k: int, context: int = 64, repeats: int = 10) -> float:
    """Seconds of one packed pass over B (k + 1) tokens / over B tokens (the linear layers' share of a step)."""
    device = next(model.parameters()).device

    def step(n: int):
        ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)       # (1, N) packed rows
        pos = torch.arange(context, context + n, device=device) % model.config.max_seq_len
        return lambda: model(ids, pos, NoCache())
    with torch.inference_mode():
        t = time_interleaved({"plain": step(batch_size), "verify": step(batch_size * (k + 1))}, repeats=repeats,
                             device=device)
    return t["verify"] / t["plain"]
