"""The serving figures of issue 30, measured in one run against `infopt-lab serve` subprocesses on loopback.

1. Static batching's capacity on the bundled target (requests/s, everything sent at once, skewed workload);
   then Poisson load at 0.5x, 1x and 2x that rate against the static and the continuous server: goodput
   under SLOs. The target's SLOs are SmolLM2's (TTFT 2 s, TPOT 250 ms) scaled by how much faster the
   target's unloaded TTFT and TPOT are than SmolLM2's, both measured here (one request at a time).
2. Prefix caching on the agentic workload over HTTP: TTFT p50 off / on.
3. Server overhead: output tokens/s through HTTP at concurrency 8 against the engine in-process on the
   same requests, on SmolLM2 and on the target.
Every process runs torch on one thread (OMP_NUM_THREADS=1 unless set): on a busy 2-core machine a second
OpenMP thread makes a step up to 10x slower in a main thread and not in the server's engine thread, which
would flatter the server; with one thread both sides compute alike.
usage: PYTHONPATH=. python scripts/serving_figures.py [--json FILE] [--quick]
"""
import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")    # before torch is imported; the servers inherit it

import infopt_lab as lab  # noqa: E402
from infopt_lab.serving.loadtest import build_jobs, loadtest  # noqa: E402
from infopt_lab.serving.process import launch  # noqa: E402

SMOL_SLO_MS = {"ttft": 2000.0, "tpot": 250.0}


def unloaded(model: str) -> dict:
    """TTFT and TPOT p50 (ms) of one request at a time: the model's own speed, no queueing."""
    with launch(model) as url:
        m = loadtest(url, concurrency=1, num_requests=6)
    return {"ttft": m["ttft_ms"]["p50"], "tpot": m["tpot_ms"]["p50"]}


def goodput_curve(n: int, slo: dict) -> dict:
    """Static capacity, then static vs continuous at 0.5x, 1x, 2x of it."""
    with launch("target", scheduler="static") as url:
        capacity = loadtest(url, num_requests=n)["request_throughput"]
    runs = {}
    for scheduler in ("static", "continuous"):
        with launch("target", scheduler=scheduler) as url:
            for x in (0.5, 1.0, 2.0):
                m = loadtest(url, rate=x * capacity, num_requests=n, slo_ttft_ms=slo["ttft"], slo_tpot_ms=slo["tpot"])
                runs[f"{scheduler}@{x}x"] = m
                print(f"  {scheduler:<10} {x:>3}x = {x * capacity:5.2f} req/s: goodput {m['goodput']:.2f} req/s, "
                      f"throughput {m['request_throughput']:.2f} req/s, TTFT p99 {m['ttft_ms']['p99']:.0f} ms, "
                      f"TPOT p99 {m['tpot_ms']['p99']:.1f} ms", flush=True)
    return {"static_capacity_req_s": capacity, "runs": runs}


def prefix_caching(sessions: int, rate: float) -> dict:
    """TTFT p50 of the agentic workload with prefix caching off and on."""
    out = {}
    for on in (False, True):
        with launch("target", enable_prefix_caching=on) as url:
            out["on" if on else "off"] = loadtest(url, rate=rate, workload="agentic", num_requests=sessions)
    return out


def overhead(model: str, n: int) -> dict:
    """Output tokens/s at concurrency 8: through HTTP, and the engine in-process on the same text prompts."""
    jobs, _ = build_jobs("skewed", n, None)
    prompts, lengths = [j[0].prompt for j in jobs], [j[0].max_tokens for j in jobs]
    with launch(model, max_batch_size=8) as url:
        http = loadtest(url, concurrency=8, num_requests=n)
    m, tok = lab.load_model(model)
    engine = lab.Engine(m, tok, max_batch_size=8)
    engine.generate(prompts[:2], max_new_tokens=4)                     # warm up
    outs = engine.generate(prompts, max_new_tokens=lengths, stop_at_eos=False)
    assert sum(len(o.token_ids) for o in outs) == http["output_tokens"], "the two runs generated different counts"
    return {"http_tok_s": http["output_throughput"], "in_process_tok_s": outs.stats.throughput_tok_s,
            "ratio": http["output_throughput"] / outs.stats.throughput_tok_s, "requests": n,
            "tokens": http["output_tokens"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not the figures)")
    args = p.parse_args()
    n = 12 if args.quick else 40
    fig = {}
    fig["unloaded_ms"] = {m: unloaded(m) for m in ("target", "smollm2-135m")}
    t, s = fig["unloaded_ms"]["target"], fig["unloaded_ms"]["smollm2-135m"]
    slo = {k: SMOL_SLO_MS[k] * t[k] / s[k] for k in SMOL_SLO_MS}
    fig["target_slo_ms"] = slo
    print(f"unloaded p50 (ms): target TTFT {t['ttft']:.1f} TPOT {t['tpot']:.2f}; SmolLM2 TTFT {s['ttft']:.1f} "
          f"TPOT {s['tpot']:.2f} -> target SLOs TTFT <= {slo['ttft']:.0f} ms, TPOT <= {slo['tpot']:.1f} ms", flush=True)
    fig["goodput"] = g = goodput_curve(n, slo)
    static, cont = g["runs"]["static@1.0x"]["goodput"], g["runs"]["continuous@1.0x"]["goodput"]
    print(f"static capacity {g['static_capacity_req_s']:.2f} req/s; goodput at it: continuous {cont:.2f}, "
          f"static {static:.2f} -> {cont / static if static else float('inf'):.2f}x", flush=True)
    fig["prefix"] = pc = prefix_caching(8 if args.quick else 16, 2.0)
    off, on = pc["off"]["ttft_ms"]["p50"], pc["on"]["ttft_ms"]["p50"]
    print(f"agentic TTFT p50: prefix caching off {off:.1f} ms, on {on:.1f} ms -> {off / on:.2f}x lower", flush=True)
    fig["overhead"] = {m: overhead(m, 16 if args.quick else 32) for m in ("smollm2-135m", "target")}
    for m, o in fig["overhead"].items():
        print(f"{m}: concurrency 8, {o['tokens']} tokens: HTTP {o['http_tok_s']:.1f} tok/s, in-process "
              f"{o['in_process_tok_s']:.1f} tok/s -> {o['ratio']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(fig, f, indent=2)


if __name__ == "__main__":
    main()
