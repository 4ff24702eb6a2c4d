"""`infopt-lab bench --ladder`: one agentic workload served by each rung of optimizations in turn, and priced.

Rung 0 is transformers' `generate`, one request at a time; rung 1 our cached decoding,
one at a time; then the engine: continuous batching, int8 weights and int8 KV,
speculative decoding, prefix caching, and all of them combined. Every rung serves the
same sessions (a turn's prompt is the conversation so far, with that rung's own
answers), so exact-match against rung 0 compounds over a session's turns.
Memory is counted, not sampled: weight bytes plus the KV pool's (or, one request at
a time, the longest request's cache).
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .metrics import percentiles

RUNG_NAMES = ("transformers generate, one at a time", "our KV-cached decoding, one at a time",
              "continuous batching", "int8 weights + int8 KV", "speculative decoding", "prefix caching",
              "all combined")


@dataclass
class Rung:
    name: str
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_s: float                   # median over turns of the mean gap between a turn's new tokens
    peak_memory_bytes: int          # weights + KV (pool, or the longest request's cache), counted
    ppl_delta_pct: float            # perplexity change of the rung's numerics (0 for rungs that only schedule)
    exact_match: float              # share of turns whose tokens equal rung 0's
    settings: str = ""              # how the rung serves: batch size, weights, KV, speculation, caching
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def as_json(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        return d


@dataclass
class Served:
    """One way of serving the workload: each turn's tokens, TTFT and TPOT, and the run's new tokens per second."""

    outputs: list[list[int]]        # in (session, turn) order
    ttft_s: list[float]
    tpot_s: list[float]
    tokens_per_s: float


def serve_one_at_a_time(generate_one: Callable[[list[int], int], tuple[list[int], list[float]]],
                        workload) -> Served:
    """A server that runs one request to completion before the next, first come first served.

    `generate_one(prompt_ids, max_new_tokens)` returns the new tokens and the seconds at which each was
    ready. A turn waits for the server; the next turn of its session arrives as it finishes.
    """
    system = list(workload.system_ids)
    queue = [(s.start_s, i, 0, system + list(s.user_ids[0])) for i, s in enumerate(workload.sessions)]
    heapq.heapify(queue)
    clock, results = 0.0, {}
    while queue:
        arrival, i, t, prompt = heapq.heappop(queue)
        start = max(clock, arrival)
        ids, times = generate_one(prompt, workload.new_tokens)
        clock = start + times[-1]
        gaps = [b - a for a, b in zip(times, times[1:])]
        results[i, t] = (ids, start - arrival + times[0], sum(gaps) / len(gaps) if gaps else float("nan"))
        user = workload.sessions[i].user_ids
        if t + 1 < len(user):
            heapq.heappush(queue, (clock, i, t + 1, prompt + ids + list(user[t + 1])))
    order = sorted(results)
    new = sum(len(results[k][0]) for k in order)
    return Served([results[k][0] for k in order], [results[k][1] for k in order], [results[k][2] for k in order],
                  new / clock)


def ours_one(model, tok) -> Callable[[list[int], int], tuple[list[int], list[float]]]:
    """`generate_one` for our cached greedy decoding (lab.generate's loop)."""
    from .generate import generate_tokens
    from .sampling import SamplingParams
    device = next(model.parameters()).device

    def run(prompt: list[int], new_tokens: int):
        params = SamplingParams(max_new_tokens=new_tokens)
        start, ids, times = time.perf_counter(), [], []
        for token in generate_tokens(model, torch.tensor([prompt], device=device), params, eos_id=tok.eos_token_id):
            ids.append(int(token[0]))
            times.append(time.perf_counter() - start)
        return ids, times
    return run


class _Clock:
    """A transformers streamer that records when each new token arrives (the first `put` is the prompt)."""

    def __init__(self):
        self.start, self.times, self.prompt_seen = time.perf_counter(), [], False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter() - self.start)
        self.prompt_seen = True

    def end(self) -> None:
        pass


def transformers_one(hf_model, tok) -> Callable[[list[int], int], tuple[list[int], list[float]]]:
    """`generate_one` for transformers' greedy `generate`, stopping at the same EOS as ours."""
    device = hf_model.device

    def run(prompt: list[int], new_tokens: int):
        clock = _Clock()
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=device)                                  # (1, T)
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                    streamer=clock)
        return out[0, len(prompt):].tolist(), clock.times
    return run


def served_by_engine(engine, workload) -> Served:
    """The workload through an engine (`run_sessions`), as a Served."""
    from .engine.workload import run_sessions
    run = run_sessions(engine, workload)
    return Served([t.output.token_ids for t in run.turns], [t.output.ttft_s for t in run.turns],
                  [t.output.tpot_s for t in run.turns if t.output.tpot_s is not None], run.throughput_tok_s())


def rung(name: str, served: Served, memory_bytes: int, ppl_delta_pct: float, reference: list[list[int]],
         settings: str = "") -> Rung:
    """A rung's row from how it served the workload."""
    ttft = percentiles(served.ttft_s, (50, 99))
    tpot = [x for x in served.tpot_s if x == x]
    return Rung(name, served.tokens_per_s, ttft["p50"], ttft["p99"],
                percentiles(tpot, (50,))["p50"] if tpot else float("nan"), memory_bytes, ppl_delta_pct,
                sum(a == b for a, b in zip(served.outputs, reference)) / len(reference), settings, served.outputs)


def cost_per_million_tokens(tokens_per_s: float, price_per_hour: float) -> float:
    """Dollars (or whatever the price is in) per million new tokens at a sustained rate."""
    if tokens_per_s <= 0 or price_per_hour < 0:
        raise ValueError(f"need tokens_per_s > 0 and price_per_hour >= 0, got {tokens_per_s} and {price_per_hour}")
    return price_per_hour / (tokens_per_s * 3600) * 1e6


# datasheet figures (dense bf16 tensor-core peak, memory bandwidth) and example on-demand prices: for estimates only
GPUS = {
    "NVIDIA T4": dict(bandwidth_gbs=320, peak_tflops=65, price_per_hour=0.35),
    "NVIDIA L4": dict(bandwidth_gbs=300, peak_tflops=121, price_per_hour=0.70),
    "NVIDIA A100 80GB": dict(bandwidth_gbs=2039, peak_tflops=312, price_per_hour=1.80),
    "NVIDIA H100 SXM": dict(bandwidth_gbs=3350, peak_tflops=989, price_per_hour=3.00),
}


def gpu_estimate(params: int, batch_size: int, bandwidth_gbs: float, peak_tflops: float,
                 bytes_per_param: float = 2.0) -> float:
    """Decode tokens/s a GPU could reach at a batch size: one step reads the weights once (bandwidth) and does
    2 x params FLOPs per row (peak), whichever takes longer. An estimate from the datasheet, not a measurement."""
    step_s = max(params * bytes_per_param / (bandwidth_gbs * 1e9), 2 * params * batch_size / (peak_tflops * 1e12))
    return batch_size / step_s


def run_ladder(model_name: str = "smollm2-135m", sessions: int = 16, turns: int = 3, system_tokens: int = 512,
               new_tokens: int = 32, max_batch_size: int = 8, combined_batch_size: int = 16, k: int = 2,
               ppl_tokens: int = 4096, progress: Callable[[str], None] | None = print) -> tuple[list[Rung], object]:
    """Every rung on one agentic workload, rung 0 first and the combined rung last; and the workload.

    Rungs 2 to 5 run the engine at `max_batch_size`. Speculation drafts by prompt lookup ("ngram", k tokens),
    which costs no draft model (notebook 05 measures the distilled draft). The combined rung runs at
    `combined_batch_size`, which its int8 weights and KV make room for (each rung's memory is in its row);
    and it reads the shared system prompt's blocks once per step for the whole batch (cascade attention),
    which prefix caching makes possible. Each rung's `settings` says how it served.
    """
    from transformers import AutoModelForCausalLM
    from .costs import kv_cache_bytes
    from .engine import Engine
    from .workloads import agentic_workload
    from .kv_cache import KVCache
    from .kv_quant import QuantizedKVCache
    from .loading import load_model, resolve_model_dir
    from .quant_eval import cached_perplexity
    from .quantize import quantize_model, state_dict_bytes
    say = progress or (lambda _: None)
    model, tok = load_model(model_name, dtype=torch.float32)
    w = agentic_workload(tok, sessions=sessions, turns=turns, system_tokens=system_tokens, new_tokens=new_tokens)
    say(f"workload: {w.describe()}")
    q_model = quantize_model(model, "int8")
    seq_len = min(512, ppl_tokens)
    base_ppl = cached_perplexity(model, tok, KVCache.for_model, ppl_tokens, seq_len)
    int8_delta = 100 * (cached_perplexity(q_model, tok, QuantizedKVCache.for_model, ppl_tokens, seq_len) / base_ppl - 1)
    say(f"perplexity over {ppl_tokens} val tokens: fp32 {base_ppl:.3f}; int8 weights + int8 KV {int8_delta:+.2f}%")
    longest_kv = kv_cache_bytes(model.config, w.max_seq_tokens, 1, bytes_per_element=4)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name), dtype=torch.float32).eval()
    served = serve_one_at_a_time(transformers_one(hf, tok), w)
    rungs = [rung(RUNG_NAMES[0], served, state_dict_bytes(model) + longest_kv, 0.0, served.outputs,
                  "transformers generate, batch 1, fp32")]
    reference = served.outputs
    say(_line(rungs[-1]))
    served = serve_one_at_a_time(ours_one(model, tok), w)
    rungs.append(rung(RUNG_NAMES[1], served, state_dict_bytes(model) + longest_kv, 0.0, reference,
                      "our cached decoding, batch 1, fp32"))
    say(_line(rungs[-1]))
    spec = dict(draft="ngram", num_speculative_tokens=k)
    everything = dict(kv_cache_dtype="int8", enable_prefix_caching=True, cascade_attention=True, **spec)
    settings = [(RUNG_NAMES[2], model, max_batch_size, {}, 0.0),
                (RUNG_NAMES[3], q_model, max_batch_size, dict(kv_cache_dtype="int8"), int8_delta),
                (RUNG_NAMES[4], model, max_batch_size, spec, 0.0),
                (RUNG_NAMES[5], model, max_batch_size, dict(enable_prefix_caching=True), 0.0),
                (RUNG_NAMES[6], q_model, combined_batch_size, everything, int8_delta)]
    for name, m, batch, kw, delta in settings:
        engine = Engine(m, tok, max_batch_size=batch, max_model_len=w.max_seq_tokens, **kw)
        engine.generate(["def f(x):"], max_new_tokens=2)                                  # warm up
        memory = state_dict_bytes(m) + engine.cache.nbytes
        rungs.append(rung(name, served_by_engine(engine, w), memory, delta, reference, _settings(m, batch, kw)))
        say(_line(rungs[-1]))
    return rungs, w


def _settings(model, batch: int, kw: dict) -> str:
    """An engine rung's configuration in words."""
    from .quantize import QuantLinear
    parts = [f"engine, batch {batch}", "int8 weights" if any(isinstance(m, QuantLinear) for m in model.modules())
             else "fp32 weights", f"{'int8' if kw.get('kv_cache_dtype') == 'int8' else 'fp32'} KV"]
    if kw.get("draft") is not None:
        how = "prompt lookup" if kw["draft"] == "ngram" else "a draft model"
        parts.append(f"speculation by {how}, k = {kw['num_speculative_tokens']}")
    if kw.get("enable_prefix_caching"):
        parts.append("prefix caching")
    if kw.get("cascade_attention"):
        parts.append("cascade attention")
    return ", ".join(parts)


def _line(r: Rung) -> str:
    return (f"{r.name}: {r.tokens_per_s:.1f} tok/s, TTFT p50 {r.ttft_p50_s * 1e3:.0f} ms, p99 {r.ttft_p99_s * 1e3:.0f} ms, "
            f"TPOT {r.tpot_s * 1e3:.0f} ms, memory {r.peak_memory_bytes / 2 ** 20:.0f} MiB, "
            f"ppl {r.ppl_delta_pct:+.2f}%, exact match {r.exact_match:.0%}")


def format_ladder(rungs: list[Rung], price_per_hour: float) -> str:
    """The ladder as a table: each rung's speed against rung 0, latency, memory, quality and price."""
    head = (f"{'rung':<38}{'tok/s':>8}{'vs 0':>7}{'TTFT p50':>10}{'p99':>9}{'TPOT':>8}{'MiB':>7}{'ppl':>8}"
            f"{'match':>7}{'$/Mtok':>9}")
    base = rungs[0].tokens_per_s
    lines = [head] + [f"{r.name:<38}{r.tokens_per_s:8.1f}{r.tokens_per_s / base:6.1f}x{r.ttft_p50_s * 1e3:8.0f}ms"
                      f"{r.ttft_p99_s * 1e3:7.0f}ms{r.tpot_s * 1e3:6.0f}ms{r.peak_memory_bytes / 2 ** 20:7.0f}"
                      f"{r.ppl_delta_pct:+7.2f}%{r.exact_match:7.0%}"
                      f"{cost_per_million_tokens(r.tokens_per_s, price_per_hour):9.2f}" for r in rungs]
    return "\n".join(lines)


def plot_ladder(rungs: list[Rung], path=None, title: str = "The optimization ladder"):
    """Two panels: tokens/s against rung 0, and TTFT p50 (log scale); saved to `path` when given."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [f"{i}. {r.name}" for i, r in enumerate(rungs)]
    a.barh(names, [r.tokens_per_s / rungs[0].tokens_per_s for r in rungs], color="tab:blue")
    a.set(xlabel="tokens/s vs rung 0", title=title)
    a.invert_yaxis()
    b.barh(names, [r.ttft_p50_s * 1e3 for r in rungs], color="tab:orange")
    b.set(xscale="log", xlabel="TTFT p50 (ms, log)", yticklabels=[])
    b.invert_yaxis()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def ladder_command(model_name: str, json_path: str | None, price_per_hour: float, **kwargs) -> list[Rung]:
    """`infopt-lab bench --ladder`: run, print the table and the GPU estimates, write JSON and a plot."""
    import json
    from pathlib import Path
    from .device import describe
    from .loading import load_model
    if not price_per_hour >= 0:
        raise ValueError(f"--price-per-hour must be a number >= 0, got {price_per_hour}")
    machine = describe()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    rungs, workload = run_ladder(model_name, **kwargs)
    print(f"\n== the ladder on {model_name}: {workload.describe()} ==")
    print(format_ladder(rungs, price_per_hour))
    top = rungs[-1]
    print(f"combined / rung 0: {top.tokens_per_s / rungs[0].tokens_per_s:.1f}x tokens/s, perplexity "
          f"{top.ppl_delta_pct:+.2f}%; $/Mtok at {price_per_hour:.2f} per hour (this machine, measured)")
    params = load_model(model_name)[0].num_parameters()
    for i, r in enumerate(rungs):
        print(f"  {i}. {r.name}: {r.settings}")
    batch = kwargs.get("combined_batch_size", 16)
    print(f"GPU estimates for the combined rung's weights (8-bit) at batch {batch}, from datasheet bandwidth and "
          "peak (not measurements; example prices):")
    gpus = {}
    for name, g in GPUS.items():
        tps = gpu_estimate(params, batch, g["bandwidth_gbs"], g["peak_tflops"], bytes_per_param=1.0)
        gpus[name] = {"tokens_per_s_estimate": tps, "price_per_hour": g["price_per_hour"],
                      "cost_per_million_tokens_estimate": cost_per_million_tokens(tps, g["price_per_hour"])}
        print(f"  {name:<18} ~{tps:9.0f} tok/s at {g['price_per_hour']:.2f}/h: "
              f"~{gpus[name]['cost_per_million_tokens_estimate']:.4f} per million tokens")
    if json_path:
        path = Path(json_path)
        path.write_text(json.dumps({"rungs": [r.as_json() for r in rungs], "model": model_name,
                                    "workload": workload.describe(), "machine": machine,
                                    "price_per_hour": price_per_hour, "gpu_estimates": gpus}, indent=1) + "\n")
        plot_ladder(rungs, path.with_suffix(".png"), title=f"The ladder on {model_name}")
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return rungs


# what each scenario asks of a rung: a TTFT p99 SLO (seconds), a perplexity budget (%), an exact-match floor,
# and a memory budget (bytes, None: any); the decision guide picks the cheapest rung that meets them
SCENARIOS = {
    "latency-bound chat": dict(ttft_slo_s=1.0, max_ppl_delta_pct=1.0, min_exact_match=0.0, memory_budget_bytes=None),
    "offline batch": dict(ttft_slo_s=600.0, max_ppl_delta_pct=1.0, min_exact_match=0.0, memory_budget_bytes=None),
    "many agent sessions": dict(ttft_slo_s=2.0, max_ppl_delta_pct=1.0, min_exact_match=0.0, memory_budget_bytes=None),
    "memory-limited edge device": dict(ttft_slo_s=10.0, max_ppl_delta_pct=2.0, min_exact_match=0.0,
                                       memory_budget_bytes=512 * 2 ** 20),
}


def misses(rung: dict, ttft_slo_s: float, max_ppl_delta_pct: float, min_exact_match: float = 0.0,
           memory_budget_bytes: int | None = None) -> list[str]:
    """The targets a rung (`Rung.as_json()` dict) misses, in words; empty when it meets them all (at a target counts)."""
    r = rung
    found = [f"TTFT p99 {r['ttft_p99_s']:.2f} s > {ttft_slo_s:g} s" if r["ttft_p99_s"] > ttft_slo_s else "",
             f"perplexity {r['ppl_delta_pct']:+.2f}% > {max_ppl_delta_pct:+g}%"
             if r["ppl_delta_pct"] > max_ppl_delta_pct else "",
             f"exact match {r['exact_match']:.0%} < {min_exact_match:.0%}" if r["exact_match"] < min_exact_match
             else "",
             f"memory {r['peak_memory_bytes'] / 2 ** 20:.0f} MiB > {memory_budget_bytes / 2 ** 20:.0f} MiB"
             if memory_budget_bytes is not None and r["peak_memory_bytes"] > memory_budget_bytes else ""]
    return [m for m in found if m]


def recommend(rungs: list[dict], price_per_hour: float, ttft_slo_s: float, max_ppl_delta_pct: float,
              min_exact_match: float = 0.0, memory_budget_bytes: int | None = None) -> tuple[dict, float]:
    """The cheapest rung (per million tokens) meeting the TTFT p99 SLO, the quality floor and the memory budget.

    `rungs` are `Rung.as_json()` dicts; returns (rung, its cost per million tokens). Ties go to the earlier
    rung. ValueError, naming what excluded each rung, when none qualifies.
    """
    best, why = None, []
    for r in rungs:
        missed = misses(r, ttft_slo_s, max_ppl_delta_pct, min_exact_match, memory_budget_bytes)
        if missed:
            why.append(f"{r['name']}: {', '.join(missed)}")
            continue
        cost = cost_per_million_tokens(r["tokens_per_s"], price_per_hour)
        if best is None or cost < best[1]:
            best = (r, cost)
    if best is None:
        raise ValueError("no rung meets these constraints: " + "; ".join(why))
    return best


@dataclass
class Fit:
    """How many sequences one precision choice fits in a memory budget, and the decode speed that batch reaches."""

    weights: str                    # "fp32" or "int8"
    kv: str                         # "fp32" or "int8"
    weight_bytes: int
    kv_bytes_per_sequence: int      # the KV blocks one sequence of seq_tokens tokens holds
    max_sequences: int              # that fit beside the weights
    batch: int                      # the batch measured: max_sequences, capped
    tokens_per_s: float             # total decode tokens/s at that batch (decode-only steps)


def memory_interplay(model, tok, budget_bytes: int, seq_tokens: int, block_size: int = 16, new_tokens: int = 8,
                     cap: int = 32) -> list[Fit]:
    """fp32 vs int8 weights x fp32 vs int8 KV at one memory budget: sequences that fit, and their throughput."""
    from .workloads import code_prompts
    from .engine import Engine
    from .engine.llm_engine import KV_CACHE_DTYPES
    from .quantize import quantize_model, state_dict_bytes
    prompts = code_prompts(tok, cap, min_tokens=16, max_tokens=24)
    fits = []
    for wname, m in (("fp32", model), ("int8", quantize_model(model, "int8"))):
        weight_bytes = state_dict_bytes(m)
        for kname, kv in (("fp32", "auto"), ("int8", "int8")):
            per_block = KV_CACHE_DTYPES[kv].for_model(m, 2, block_size).nbytes // 2
            per_seq = -(-seq_tokens // block_size) * per_block
            n = max(0, (budget_bytes - weight_bytes) // per_seq)
            b = min(n, cap)
            speed = 0.0
            if b > 0:
                engine = Engine(m, tok, max_batch_size=b, block_size=block_size, kv_cache_dtype=kv,
                                num_blocks=b * -(-(24 + new_tokens) // block_size) + 1)
                out = engine.generate(prompts[:b], max_new_tokens=new_tokens, stop_at_eos=False)
                steps = [r for r in out.stats.timeline if all(kind == "decode" for *_, kind in r.rows)]
                speed = sum(len(r.rows) for r in steps) / sum(r.end_s - r.start_s for r in steps)
            fits.append(Fit(wname, kname, weight_bytes, per_seq, int(n), b, speed))
    return fits


COMMITTED = "ladder_smollm2-135m.json"   # `infopt-lab bench --ladder --json` output shipped with the package


def committed_ladder(name: str = COMMITTED) -> dict:
    """The committed full ladder run (rungs, workload, machine, price, GPU estimates) from the package's assets."""
    import json
    from pathlib import Path
    path = Path(__file__).parent / "assets" / "results" / name
    if not path.exists():
        raise FileNotFoundError(f"no committed ladder at {path}; run `infopt-lab bench --ladder --json {path}`")
    return json.loads(path.read_text())
