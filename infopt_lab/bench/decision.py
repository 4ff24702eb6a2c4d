"""What a rung costs, what a GPU could serve, and the cheapest rung that meets a scenario's targets.

A rung here is a `Rung.as_json()` dict, as the committed ladder stores it, so the decision guide and
the exercise-07 grader read the same rows the ladder writes.
"""
from __future__ import annotations

from .. import validate


def cost_per_million_tokens(throughput_tok_s: float, price_per_hour: float) -> float:
    """Dollars (or whatever the price is in) per million new tokens at a sustained rate."""
    throughput_tok_s = validate.real("throughput_tok_s", throughput_tok_s, low=0, low_open=True)
    price_per_hour = validate.real("price_per_hour", price_per_hour, low=0)
    return price_per_hour / (throughput_tok_s * 3600) * 1e6


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
        cost = cost_per_million_tokens(r["throughput_tok_s"], price_per_hour)
        if best is None or cost < best[1]:
            best = (r, cost)
    if best is None:
        raise ValueError("no rung meets these constraints: " + "; ".join(why))
    return best
