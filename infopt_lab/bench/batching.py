"""The batching rung: static vs continuous batching on our paged engine, and transformers' padded batches.

The policies themselves, on paper, are `infopt_lab.batching`'s; here they serve real requests and are timed.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..device import get_device
from ..loading import load_model
from .baselines import load_transformers, transformers_batched_generate
from .result import Result, Run, describe_model


def compare_policies(model, tok, prompts: Sequence[str], lengths: Sequence[int], max_batch_size: int = 8,
                     hf_model=None, arrival_s: Sequence[float] | None = None) -> dict[str, Run]:
    """Serve one workload with continuous and static batching (and transformers if given), in this run."""
    from ..engine import Engine
    Engine(model, tok, max_batch_size=max_batch_size).generate(prompts[:2], max_new_tokens=4)   # warm-up
    runs = {}
    for policy in ("continuous", "static"):
        engine = Engine(model, tok, scheduler=policy, max_batch_size=max_batch_size)
        outs = engine.generate(prompts, max_new_tokens=list(lengths), arrival_s=arrival_s, stop_at_eos=False)
        runs[policy] = Run(policy, [o.token_ids for o in outs], outs.stats.wall_s, ttft_s=[o.ttft_s for o in outs],
                           e2e_s=[o.e2e_s for o in outs], stats=outs.stats)
    if hf_model is not None:
        ids = [tok.encode(p) for p in prompts]
        token_ids, wall = transformers_batched_generate(hf_model, ids, lengths, max_batch_size, pad_id=0)
        runs["transformers"] = Run("transformers", token_ids, wall)
    return runs


def bench_batching(model_name: str = "target", n_requests: int = 64, max_batch_size: int = 8,
                   seed: int = 0) -> Result:
    """Static vs continuous batching on our paged engine vs transformers' padded batched generate."""
    from ..metrics import percentiles
    from ..workloads import code_prompts, skewed_lengths
    device = get_device()
    model, tok = load_model(model_name, device=device)
    hf = load_transformers(model_name, next(model.parameters()).dtype, device)
    prompts, lengths = code_prompts(tok, n_requests, seed=seed), skewed_lengths(n_requests, seed=seed)
    runs = compare_policies(model, tok, prompts, lengths, max_batch_size, hf_model=hf)
    cont, static, hf_run = runs["continuous"], runs["static"], runs["transformers"]
    r = Result("batching: static vs continuous on the paged engine, and transformers")
    r.add("model", describe_model(model_name, model, device))
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
