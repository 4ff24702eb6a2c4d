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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .. import validate
from ..metrics import percentiles
from .baselines import OneRequest
from .decision import GPUS, cost_per_million_tokens, gpu_estimate
from .result import Run

RUNG_NAMES = ("transformers generate, one at a time", "our KV-cached decoding, one at a time",
              "continuous batching", "int8 weights + int8 KV", "speculative decoding", "prefix caching",
              "all combined")


@dataclass
class Rung:
    """One row of the ladder: how fast, how soon, how big and how faithful one way of serving the workload was."""

    name: str
    throughput_tok_s: float         # the run's new tokens / its wall time (Run.throughput_tok_s)
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_s: float                   # median over turns of the mean gap between a turn's new tokens
    peak_memory_bytes: int          # weights + KV (pool, or the longest request's cache), counted
    ppl_delta_pct: float            # perplexity change of the rung's numerics (0 for rungs that only schedule)
    exact_match: float              # share of turns whose tokens equal rung 0's
    settings: str = ""              # how the rung serves: batch size, weights, KV, speculation, caching
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def as_json(self) -> dict:
        """The row as the committed JSON stores it (the outputs left out)."""
        d = asdict(self)
        d.pop("outputs")
        return d


def serve_one_at_a_time(name: str, generate_one: OneRequest, workload) -> Run:
    """A server that runs one request to completion before the next, first come first served.

    `generate_one(prompt_ids, max_new_tokens)` returns the new tokens and the seconds at which each was
    ready. A turn waits for the server; the next turn of its session arrives as it finishes. The run's
    wall time is the server's clock when the last turn finishes; turns are in (session, turn) order.
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
    ids, ttft, tpot = zip(*(results[k] for k in sorted(results)))
    return Run(name, list(ids), clock, ttft_s=list(ttft), tpot_s=list(tpot))


def ours_one(model, tok) -> OneRequest:
    """`generate_one` for our cached greedy decoding (generate.timed_tokens, lab.generate's loop)."""
    from ..generate import timed_tokens
    from ..sampling import SamplingParams
    device = next(model.parameters()).device

    def run(prompt: list[int], new_tokens: int):
        ids = torch.tensor([prompt], device=device)                                    # (1, T)
        timed = list(timed_tokens(model, ids, SamplingParams(max_new_tokens=new_tokens), eos_id=tok.eos_token_id))
        return [token for token, _ in timed], [seconds for _, seconds in timed]
    return run


def served_by_engine(name: str, engine, workload) -> Run:
    """The workload through an engine (`run_sessions`), as a Run."""
    from ..engine.workload import run_sessions
    run = run_sessions(engine, workload)
    return Run(name, [t.output.token_ids for t in run.turns], run.stats.wall_s,
               ttft_s=[t.output.ttft_s for t in run.turns],
               tpot_s=[t.output.tpot_s for t in run.turns if t.output.tpot_s is not None], stats=run.stats)


def rung(served: Run, memory_bytes: int, ppl_delta_pct: float, reference: list[list[int]],
         settings: str = "") -> Rung:
    """A rung's row from how it served the workload."""
    ttft = percentiles(served.ttft_s, (50, 99))
    tpot = [x for x in served.tpot_s if x == x]
    return Rung(served.name, served.throughput_tok_s, ttft["p50"], ttft["p99"],
                percentiles(tpot, (50,))["p50"] if tpot else float("nan"), memory_bytes, ppl_delta_pct,
                sum(a == b for a, b in zip(served.token_ids, reference)) / len(reference), settings,
                served.token_ids)


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
    from ..costs import kv_cache_bytes
    from ..engine import Engine
    from ..kv_cache import KVCache
    from ..kv_quant import QuantizedKVCache
    from ..loading import load_model
    from ..quantize import quantize_model, state_dict_bytes
    from ..workloads import agentic_workload
    from .baselines import load_transformers, transformers_one
    from .quant import cached_perplexity
    say = progress or (lambda _: None)
    model, tok = load_model(model_name, dtype=torch.float32)
    w = agentic_workload(tok, sessions=sessions, turns=turns, system_tokens=system_tokens, new_tokens=new_tokens)
    say(f"workload: {w.describe()}")
    q_model = quantize_model(model, "int8")
    seq_len = min(512, ppl_tokens)
    base_ppl = cached_perplexity(model, tok, KVCache.for_model, ppl_tokens, seq_len)
    int8_delta = 100 * (cached_perplexity(q_model, tok, QuantizedKVCache.for_model, ppl_tokens, seq_len) / base_ppl - 1)
    say(f"perplexity over {ppl_tokens} val tokens: fp32 {base_ppl:.3f}; int8 weights + int8 KV {int8_delta:+.2f}%")
    one_at_a_time = state_dict_bytes(model) + kv_cache_bytes(model.config, w.max_seq_tokens, 1, bytes_per_element=4)
    served = serve_one_at_a_time(RUNG_NAMES[0], transformers_one(load_transformers(model_name), tok), w)
    reference = served.token_ids
    rungs = [rung(served, one_at_a_time, 0.0, reference, "transformers generate, batch 1, fp32")]
    say(rung_line(rungs[-1]))
    served = serve_one_at_a_time(RUNG_NAMES[1], ours_one(model, tok), w)
    rungs.append(rung(served, one_at_a_time, 0.0, reference, "our cached decoding, batch 1, fp32"))
    say(rung_line(rungs[-1]))
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
        rungs.append(rung(served_by_engine(name, engine, w), memory, delta, reference, engine_settings(m, batch, kw)))
        say(rung_line(rungs[-1]))
    return rungs, w


def engine_settings(model, batch: int, kw: dict) -> str:
    """An engine rung's configuration in words."""
    from ..quantize import QuantLinear
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


def rung_line(r: Rung) -> str:
    """One rung in a line, as the ladder prints it while it runs."""
    return (f"{r.name}: {r.throughput_tok_s:.1f} tok/s, TTFT p50 {r.ttft_p50_s * 1e3:.0f} ms, "
            f"p99 {r.ttft_p99_s * 1e3:.0f} ms, TPOT {r.tpot_s * 1e3:.0f} ms, memory "
            f"{r.peak_memory_bytes / 2 ** 20:.0f} MiB, ppl {r.ppl_delta_pct:+.2f}%, exact match {r.exact_match:.0%}")


def format_ladder(rungs: list[Rung], price_per_hour: float) -> str:
    """The ladder as a table: each rung's speed against rung 0, latency, memory, quality and price."""
    head = (f"{'rung':<38}{'tok/s':>8}{'vs 0':>7}{'TTFT p50':>10}{'p99':>9}{'TPOT':>8}{'MiB':>7}{'ppl':>8}"
            f"{'match':>7}{'$/Mtok':>9}")
    base = rungs[0].throughput_tok_s
    lines = [head] + [f"{r.name:<38}{r.throughput_tok_s:8.1f}{r.throughput_tok_s / base:6.1f}x"
                      f"{r.ttft_p50_s * 1e3:8.0f}ms{r.ttft_p99_s * 1e3:7.0f}ms{r.tpot_s * 1e3:6.0f}ms"
                      f"{r.peak_memory_bytes / 2 ** 20:7.0f}{r.ppl_delta_pct:+7.2f}%{r.exact_match:7.0%}"
                      f"{cost_per_million_tokens(r.throughput_tok_s, price_per_hour):9.2f}" for r in rungs]
    return "\n".join(lines)


def plot_ladder(rungs: list[Rung], path=None, title: str = "The optimization ladder"):
    """Two panels: tokens/s against rung 0, and TTFT p50 (log scale); saved to `path` when given."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [f"{i}. {r.name}" for i, r in enumerate(rungs)]
    a.barh(names, [r.throughput_tok_s / rungs[0].throughput_tok_s for r in rungs], color="tab:blue")
    a.set(xlabel="tokens/s vs rung 0", title=title)
    a.invert_yaxis()
    b.barh(names, [r.ttft_p50_s * 1e3 for r in rungs], color="tab:orange")
    b.set(xscale="log", xlabel="TTFT p50 (ms, log)", yticklabels=[])
    b.invert_yaxis()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def gpu_estimates(params: int, batch: int) -> dict[str, dict]:
    """For each datasheet GPU: the combined rung's decode tokens/s at `batch` with 8-bit weights, price, $/Mtok."""
    gpus = {}
    for name, g in GPUS.items():
        tps = gpu_estimate(params, batch, g["bandwidth_gbs"], g["peak_tflops"], bytes_per_param=1.0)
        gpus[name] = {"tokens_per_s_estimate": tps, "price_per_hour": g["price_per_hour"],
                      "cost_per_million_tokens_estimate": cost_per_million_tokens(tps, g["price_per_hour"])}
    return gpus


def ladder_command(model_name: str, json_path: str | None, price_per_hour: float, **kwargs) -> list[Rung]:
    """`infopt-lab bench --ladder`: run, print the table and the GPU estimates, write JSON and a plot."""
    import json
    from pathlib import Path
    from ..device import describe
    from ..loading import load_model
    validate.real("--price-per-hour", price_per_hour, low=0)
    machine = describe()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    rungs, workload = run_ladder(model_name, **kwargs)
    print(f"\n== the ladder on {model_name}: {workload.describe()} ==")
    print(format_ladder(rungs, price_per_hour))
    top = rungs[-1]
    print(f"combined / rung 0: {top.throughput_tok_s / rungs[0].throughput_tok_s:.1f}x tokens/s, perplexity "
          f"{top.ppl_delta_pct:+.2f}%; $/Mtok at {price_per_hour:.2f} per hour (this machine, measured)")
    for i, r in enumerate(rungs):
        print(f"  {i}. {r.name}: {r.settings}")
    batch = kwargs.get("combined_batch_size", 16)
    print(f"GPU estimates for the combined rung's weights (8-bit) at batch {batch}, from datasheet bandwidth and "
          "peak (not measurements; example prices):")
    gpus = gpu_estimates(load_model(model_name)[0].num_parameters(), batch)
    for name, g in gpus.items():
        print(f"  {name:<18} ~{g['tokens_per_s_estimate']:9.0f} tok/s at {g['price_per_hour']:.2f}/h: "
              f"~{g['cost_per_million_tokens_estimate']:.4f} per million tokens")
    if json_path:
        path = Path(json_path)
        path.write_text(json.dumps({"rungs": [r.as_json() for r in rungs], "model": model_name,
                                    "workload": workload.describe(), "machine": machine,
                                    "price_per_hour": price_per_hour, "gpu_estimates": gpus}, indent=1) + "\n")
        plot_ladder(rungs, path.with_suffix(".png"), title=f"The ladder on {model_name}")
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return rungs


@dataclass
class Fit:
    """How many sequences one precision choice fits in a memory budget, and the decode speed that batch reaches."""

    weights: str                    # "fp32" or "int8"
    kv: str                         # "fp32" or "int8"
    weight_bytes: int
    kv_bytes_per_sequence: int      # the KV blocks one sequence of seq_tokens tokens holds
    max_sequences: int              # that fit beside the weights
    batch: int                      # the batch measured: max_sequences, capped
    throughput_tok_s: float         # total decode tokens/s at that batch (decode-only steps)


def memory_interplay(model, tok, budget_bytes: int, seq_tokens: int, block_size: int = 16, new_tokens: int = 8,
                     cap: int = 32) -> list[Fit]:
    """fp32 vs int8 weights x fp32 vs int8 KV at one memory budget: sequences that fit, and their throughput."""
    from ..engine import Engine
    from ..engine.llm_engine import KV_CACHE_DTYPES
    from ..quantize import quantize_model, state_dict_bytes
    from ..workloads import code_prompts
    from .decode import decode_step_rate
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
                speed = decode_step_rate(engine.generate(prompts[:b], max_new_tokens=new_tokens,
                                                         stop_at_eos=False).stats)
            fits.append(Fit(wname, kname, weight_bytes, per_seq, int(n), b, speed))
    return fits


COMMITTED = "ladder_smollm2-135m.json"   # `infopt-lab bench --ladder --json` output shipped with the package


def committed_ladder(name: str = COMMITTED) -> dict:
    """The committed full ladder run (rungs, workload, machine, price, GPU estimates) from the package's assets."""
    import json
    from pathlib import Path
    path = Path(__file__).parents[1] / "assets" / "results" / name
    if not path.exists():
        raise FileNotFoundError(f"no committed ladder at {path}; run `infopt-lab bench --ladder --json {path}`")
    return json.loads(path.read_text())
