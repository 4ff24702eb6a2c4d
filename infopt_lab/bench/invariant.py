"""`infopt-lab bench --only invariant`: what batch-invariant mode costs per precision, against the default."""
from __future__ import annotations

from ..device import get_device
from ..generate import generate
from ..invariant import BatchInvariant
from ..loading import load_model
from ..timing import time_cached_passes, time_interleaved
from .decode import DEFAULT_PROMPT, precision_variants
from .result import Result, describe_model


def invariant_costs(model, tok, new_tokens: int, k: int, repeats: int) -> dict[str, float]:
    """Decode tokens/s of `generate` and the (k + 1)-row pass / one-row pass ratio, default and invariant."""
    def run(flag: bool):
        return lambda: generate(model, tok, DEFAULT_PROMPT, max_new_tokens=new_tokens, stop_at_eos=False,
                                batch_invariant=flag)
    t = time_interleaved({False: run(False), True: run(True)}, repeats=repeats, warmup=1)
    default = time_cached_passes(model, sizes=(1, k + 1), repeats=repeats)
    with BatchInvariant():
        invariant = time_cached_passes(model, sizes=(1, k + 1), repeats=repeats)
    return {"decode_default": new_tokens / t[False], "decode_invariant": new_tokens / t[True],
            "pass_default": default[k + 1] / default[1], "pass_invariant": invariant[k + 1] / invariant[1]}


def bench_invariant(model_name: str = "target", new_tokens: int = 32, k: int = 3, repeats: int = 3) -> Result:
    """Batch-invariant mode against the default, per precision: decode speed and a (k + 1)-row verify pass."""
    device = get_device()
    model, tok = load_model(model_name, device=device)
    r = Result("batch invariance: every row computed as if alone (batch_invariant=True) vs the default")
    r.add("model", describe_model(model_name, model, device))
    r.add("workload", f"greedy decode of {new_tokens} tokens; a pass over {k + 1} rows (a k = {k} verify) "
                      "against a one-row pass, after 64 cached tokens")
    for name, m in precision_variants(model, model_name, device).items():
        c = invariant_costs(m, tok, new_tokens, k, repeats)
        r.add(name, f"decode {c['decode_default']:.1f} tok/s default, {c['decode_invariant']:.1f} invariant "
                    f"({c['decode_invariant'] / c['decode_default']:.2f}x); {k + 1}-row pass "
                    f"{c['pass_default']:.2f}x a one-row pass by default, {c['pass_invariant']:.2f}x invariant")
        r.values[name] = c
    return r
