"""The speculative rung: pass costs, each k, prompt lookup and transformers' versions, measured side by side.

`infopt-lab bench --only speculative` and notebook 05 both call these, so the command line
and the notebook report the same measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import default_dtype, get_device
from ..generate import generate
from ..kv_cache import KVCache
from ..loading import load_model
from ..speculative import SpeculativeOutput, expected_tokens_per_pass, prompt_lookup_generate, speculative_generate
from ..timing import interleaved_runs, time_interleaved
from .baselines import load_transformers, transformers_assisted, transformers_prompt_lookup
from .result import Result, Run, describe_model

SPEC_PROMPTS = ("import os\n\n\ndef walk_files(root):", "class Stack:\n    def __init__(self):",
                "def parse_args(argv=None):", "    for i in range(len(items)):")
REPEAT_PROMPT = ("def area(shape):\n    if shape.kind == 'circle':\n        return 3.14159 * shape.r * shape.r\n"
                 "    if shape.kind == 'square':\n        return shape.side * shape.side\n    return 0\n\n\n"
                 "def perimeter(shape):\n    if shape.kind == 'circle':\n")


@dataclass
class SpecRun(Run):
    """A `Run` of greedy requests one at a time, with what speculation did (None and zeros for plain decoding)."""

    alpha: float | None = None         # acceptance rate: kept / judged drafts
    tokens_per_pass: float | None = None
    rounds: int = 0                    # target verification passes (speculative runs)
    draft_s: float = 0.0               # of `wall_s`: proposing, verifying (speculative_generate's split)
    verify_s: float = 0.0


@torch.inference_mode()
def pass_costs(target, draft, new_tokens=(1, 2, 3, 4, 5, 7, 9), prefix: int = 200,
               repeats: int = 60) -> tuple[dict[int, float], float]:
    """Median seconds of a target pass over n new tokens after a cached prefix, for each n, and of a draft step.

    The calls are interleaved (every n once per repeat), so a machine whose speed drifts
    affects all of them alike and their ratios stay meaningful.
    """
    device = next(target.parameters()).device
    caches = {}
    for name, model in (("target", target), ("draft", draft)):
        caches[name] = KVCache.for_model(model, 1, prefix + max(new_tokens) + 1)
        model(torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device), caches[name])

    def one_pass(model, cache, m: int):
        """A call of `model` on m new tokens after the prefix, ready to time."""
        x = torch.randint(0, 100, (1, m), device=device)                 # (1, m)
        pos = torch.arange(prefix, prefix + m, device=device)            # the same positions every run
        return lambda: model(x, pos, cache)

    passes = {n: one_pass(target, caches["target"], n) for n in new_tokens}
    passes["draft"] = one_pass(draft, caches["draft"], 1)
    med = time_interleaved(passes, repeats=repeats, warmup=1, device=device)
    return {n: med[n] for n in new_tokens}, med["draft"]


def prompt_by_prompt(contenders: dict, n_prompts: int, repeats: int) -> dict[str, tuple[float, list]]:
    """{name: i -> (seconds, output)}, run prompt by prompt: prompt i decoded by every contender in turn before
    prompt i + 1, the whole `repeats` times. For each name, the outputs of its fastest run of each prompt and the
    sum of those runs' seconds.

    A machine whose speed drifts (turbo, a neighbour process) then slows every contender alike on each prompt,
    instead of whichever ran while it was slow, so their ratios hold."""
    got: dict[tuple[str, int], list] = {(name, i): [] for i in range(n_prompts) for name in contenders}
    runs = {key: (lambda key=key: got[key].append(contenders[key[0]](key[1]))) for key in got}
    interleaved_runs(runs, repeats=repeats, warmup=0)                  # the turns; the seconds are the callee's
    best = {key: min(results, key=lambda r: r[0]) for key, results in got.items()}
    return {name: (sum(best[name, i][0] for i in range(n_prompts)), [best[name, i][1] for i in range(n_prompts)])
            for name in contenders}


def _alone_run(target, tok, prompts, new_tokens: int):
    """i -> (seconds, output) of the target alone, greedy, on prompt i."""
    def run(i):
        out = generate(target, tok, prompts[i], max_new_tokens=new_tokens, stop_at_eos=False)
        return out.e2e_s, out
    return run


def _alone(secs: float, outs) -> SpecRun:
    return SpecRun("target only", [o.token_ids for o in outs], secs, tokens_per_pass=1.0)


def _spec_result(name: str, k: int, secs: float, outs) -> SpecRun:
    agg = SpeculativeOutput([], k, [r for o in outs for r in o.rounds], 0, 0, secs)
    return SpecRun(name, [o.token_ids for o in outs], secs, alpha=agg.acceptance_rate,
                   tokens_per_pass=agg.tokens_per_pass, rounds=len(agg.rounds),
                   draft_s=sum(o.draft_s for o in outs), verify_s=sum(o.verify_s for o in outs))


def speculative_runs(target, draft, tok, prompts, new_tokens: int = 128, ks=(1, 2, 3, 4, 6),
                     hf_pair=None, repeats: int = 2) -> dict[str, SpecRun]:
    """Target-only greedy, speculative greedy at each k, and transformers' assisted generation, same prompts.

    Every contender decodes each prompt in turn (`prompt_by_prompt`), the fastest of `repeats` runs per prompt:
    the target alone, each k, and with `hf_pair` transformers' assisted generation at each k, reported at the k
    that ran fastest here."""
    ids = [torch.tensor([tok.encode(p)], device=next(target.parameters()).device) for p in prompts]
    contenders = {"target": _alone_run(target, tok, prompts, new_tokens)}
    for k in ks:
        def spec(i, k=k):
            out = speculative_generate(target, draft, ids[i], max_new_tokens=new_tokens, k=k, stop_at_eos=False)
            return out.wall_s, out
        contenders[f"k={k}"] = spec
        if hf_pair is not None:
            contenders[f"transformers k={k}"] = lambda i, k=k: transformers_assisted(*hf_pair, [ids[i]], new_tokens, k)
    done = prompt_by_prompt(contenders, len(prompts), repeats)
    runs = {"target": _alone(*done["target"])}
    runs |= {f"k={k}": _spec_result(f"speculative k={k}", k, *done[f"k={k}"]) for k in ks}
    if hf_pair is not None:
        k = max(ks, key=lambda k: runs[f"k={k}"].throughput_tok_s)
        secs, toks = done[f"transformers k={k}"]
        runs["transformers"] = SpecRun(f"transformers assisted k={k}", [t for (t,) in toks], secs)
    return runs


def prompt_lookup_runs(target, tok, prompt: str = REPEAT_PROMPT, new_tokens: int = 128, k: int = 6,
                       hf_target=None, repeats: int = 2) -> dict[str, SpecRun]:
    """Target-only greedy vs prompt-lookup speculation (ours, and transformers' if given) on one prompt, each in
    turn, the fastest of `repeats` runs each."""
    x = torch.tensor([tok.encode(prompt)], device=next(target.parameters()).device)

    def lookup(_):
        o = prompt_lookup_generate(target, x, max_new_tokens=new_tokens, k=k, stop_at_eos=False)
        return o.wall_s, o
    contenders = {"target": _alone_run(target, tok, [prompt], new_tokens), "lookup": lookup}
    if hf_target is not None:
        contenders["transformers"] = lambda _: transformers_prompt_lookup(hf_target, x, new_tokens, k)
    done = prompt_by_prompt(contenders, 1, repeats)
    runs = {"target": _alone(*done["target"])}
    secs, (o,) = done["lookup"]
    runs["lookup"] = SpecRun(f"prompt lookup k={k}", [o.token_ids], secs, alpha=o.acceptance_rate,
                             tokens_per_pass=o.tokens_per_pass)
    if hf_target is not None:
        secs, (toks,) = done["transformers"]
        runs["transformers"] = SpecRun(f"transformers prompt lookup k={k}", toks, secs)
    return runs


def bench_speculative(model_name: str = "target", draft_name: str | None = None, new_tokens: int = 128,
                      dtypes: tuple[torch.dtype, ...] | None = None, ks: tuple[int, ...] | None = None) -> Result:
    """Target greedy vs speculative (each k) vs transformers' assisted generation, per precision, one run.

    Each precision pits the pair against the same target alone (fp32 against fp32, bf16 against
    bf16). The real model's rung measures fp32 and bf16; prompt lookup runs on the first precision.
    """
    from ..loading import DRAFT_OF
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
    name = _dtype_name(dtype)
    target, tok = load_model(model_name, dtype=dtype, device=device)
    draft, _ = load_model(draft_name, dtype=dtype, device=device)
    hf_target, hf_draft = (load_transformers(n, dtype, device) for n in (model_name, draft_name))
    runs = speculative_runs(target, draft, tok, SPEC_PROMPTS, new_tokens, ks=ks, hf_pair=(hf_target, hf_draft))
    base = runs["target"]
    r.add(f"[{name}] models", f"{describe_model(model_name, target, device)} with draft "
                              f"{describe_model(draft_name, draft, device)}")
    r.add(f"[{name}] target only", f"{base.throughput_tok_s:.1f} tok/s")
    spec = {n: x for n, x in runs.items() if x.alpha is not None}
    for key, x in spec.items():
        k = int(key.split("=")[1])
        r.add(f"[{name}] speculative {key}", f"{x.throughput_tok_s:.1f} tok/s "
                                            f"({x.throughput_tok_s / base.throughput_tok_s:.2f}x), "
                                            f"alpha {x.alpha:.3f}, tokens/pass {x.tokens_per_pass:.2f} "
                                            f"(formula {expected_tokens_per_pass(x.alpha, k):.2f}), "
                                            f"same tokens: {x.token_ids == base.token_ids}")
    best_key = max(spec, key=lambda n: spec[n].throughput_tok_s)
    best, hf = spec[best_key], runs["transformers"]
    r.add(f"[{name}] {hf.name}", f"{hf.throughput_tok_s:.1f} tok/s, same tokens: {hf.token_ids == base.token_ids}")
    r.add(f"[{name}] best speculative / target", f"{best.throughput_tok_s / base.throughput_tok_s:.2f}x ({best.name})")
    r.add(f"[{name}] best speculative / transformers assisted", f"{best.throughput_tok_s / hf.throughput_tok_s:.2f}x")
    values = {"best_over_target": best.throughput_tok_s / base.throughput_tok_s, "best_k": best_key,
              "best_over_transformers": best.throughput_tok_s / hf.throughput_tok_s,
              "same_tokens": all(x.token_ids == base.token_ids for x in spec.values()),
              "formula_error": {n: x.tokens_per_pass / expected_tokens_per_pass(x.alpha, int(n.split("=")[1])) - 1
                                for n, x in spec.items()}}
    if lookup:
        look = prompt_lookup_runs(target, tok, new_tokens=new_tokens, hf_target=hf_target)
        lb, lk, lh = look["target"], look["lookup"], look["transformers"]
        r.add(f"[{name}] prompt lookup (repeating prompt)",
              f"{lk.throughput_tok_s:.1f} vs target {lb.throughput_tok_s:.1f} tok/s: "
              f"{lk.throughput_tok_s / lb.throughput_tok_s:.2f}x, tokens/pass {lk.tokens_per_pass:.2f}, "
              f"same tokens: {lk.token_ids == lb.token_ids}")
        r.add(f"[{name}] {lh.name}", f"{lh.throughput_tok_s:.1f} tok/s")
        values["lookup_over_target"] = lk.throughput_tok_s / lb.throughput_tok_s
    return values
