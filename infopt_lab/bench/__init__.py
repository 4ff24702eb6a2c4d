"""The optimization ladder behind `infopt-lab bench`: each rung measured side by side.

Every rung runs its contenders in one process on the same weights, prompt and
length, and reports ratios, so the figures mean the same on any machine.
One module per rung family: decode (decode, kv, precision, batch_size), quant, batching,
attention, speculative, engine; `baselines` holds transformers' loader and runners, `result`
the two result types (a rung's `Result`, a measured `Run`), and `ladder` the whole ladder, priced.
"""
from __future__ import annotations

from collections.abc import Callable

from ..timing import matvec_bandwidth_gbs  # noqa: F401  (notebooks 00 to 02 call it as bench.matvec_bandwidth_gbs)
from .attention import ATTENTION_LENGTHS, bench_attention
from .batching import bench_batching, compare_policies
from .decode import (DEFAULT_PROMPT, KV_PROMPT_TEXT, PASS_SIZES, KVComparison, bench_batch_size, bench_decode,
                     bench_kv, bench_precision, bf16_decode_tokens_per_s, decode_throughput, decode_tokens_per_s,
                     kv_comparison, kv_prompt_ids, precision_variants, timed_greedy)
from .engine import bench_engine
from .exactness import bench_exactness
from .invariant import bench_invariant
from .overhead import AGAINST, bench_overhead
from .quant import bench_quant
from .result import Result, Run, describe_model
from .feature_draft import bench_feature_draft
from .speculative import bench_speculative

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
    "invariant": bench_invariant,
    "exactness": bench_exactness,
    "overhead": bench_overhead,
    "feature_draft": bench_feature_draft,
}

# the rungs `infopt-lab bench --model smollm2-135m` runs by default: the real model's speed lessons
REAL_MODEL_RUNGS = ("decode", "precision", "batch_size", "overhead")
# rungs with no bundled-model version (the feature draft is trained for the real model only): asked for by name
REAL_ONLY_RUNGS = ("feature_draft",)


def run(only: list[str] | None = None, against: str | None = None, **kwargs) -> list[Result]:
    """Run the named rungs (by default all of them, or REAL_MODEL_RUNGS on the real model) and print each.

    `against="llama.cpp"` measures decoding against llama.cpp on the real model's own GGUF file: the decode
    rung is then the overhead rung with llama.cpp interleaved (bench_overhead).
    """
    from ..device import describe
    from ..hub import REMOTE
    if against is not None and against not in AGAINST:
        raise ValueError(f"against must be one of {list(AGAINST)}, got {against!r}")
    if against is not None and kwargs.get("model_name") not in REMOTE:
        raise ValueError(f"--against {against} runs the GGUF file the real model came from: use --model "
                         f"{sorted(REMOTE)[0]}")
    real = kwargs.get("model_name") in REMOTE
    names = only or (["decode"] if against else list(REAL_MODEL_RUNGS) if real
                     else [n for n in LADDER if n not in REAL_ONLY_RUNGS])
    unknown = [n for n in names if n not in LADDER]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown}; choose from {list(LADDER)}")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in describe().items()), flush=True)
    results = []
    for name in names:
        result = bench_overhead(against=against, **kwargs) if against and name in ("decode", "overhead") \
            else LADDER[name](**kwargs)
        print(result.render(), flush=True)
        results.append(result)
    return results


__all__ = [
    "LADDER", "REAL_MODEL_RUNGS", "run", "Result", "Run", "describe_model",
    "bench_decode", "bench_kv", "bench_quant", "bench_batching", "bench_batch_size", "bench_precision",
    "bench_attention", "bench_speculative", "bench_engine", "bench_invariant", "bench_exactness", "bench_overhead", "bench_feature_draft",
    # what notebooks and tests call as bench.<name>
    "ATTENTION_LENGTHS", "DEFAULT_PROMPT", "KV_PROMPT_TEXT", "PASS_SIZES", "KVComparison", "compare_policies",
    "bf16_decode_tokens_per_s", "decode_throughput", "decode_tokens_per_s", "kv_comparison", "kv_prompt_ids",
    "matvec_bandwidth_gbs", "precision_variants", "timed_greedy",
]
