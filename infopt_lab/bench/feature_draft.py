"""`infopt-lab bench --only feature_draft`: the feature draft against the distilled one, and the cost model beside it.

On 16 held-out prompts (code from validation files, chat questions about held-out functions) it measures,
in one run: the pass costs (c = a draft step / a target step, v(n) = an n-token target pass / a 1-token
pass), each draft's acceptance at every k, the speedup the formula E / (k c + v(k + 1)) predicts from
them, the speedup measured, and the tokens against the target's own (by the rule of exactness.py);
then the same inside the engine at growing batch sizes, to find where speculation stops paying.
"""
from __future__ import annotations

import torch

from .. import validate
from ..device import get_device
from ..exactness import compare
from ..feature_draft import BUNDLED_NAME, FeatureDraft, load_feature_draft
from ..generate import encode_prompt, generate
from ..kv_cache import KVCache
from ..loading import DRAFT_OF, load_model
from ..model import weight_layout
from ..speculative import SpeculativeOutput, expected_tokens_per_pass, speculative_generate
from ..timing import interleaved_runs, time_interleaved
from .engine import losing_from
from .exactness import heldout_prompts
from .result import Result, describe_model

FEATURE_DRAFT_OF = {"smollm2-135m": BUNDLED_NAME}     # each model's bundled feature draft


def feature_drafts(target, model_name: str, quantized: bool = True) -> dict[str, FeatureDraft]:
    """The bundled feature draft attached to `target` and, with `quantized`, its int8 copy (FeatureDraft.quantized):
    a draft step streams a quarter of the bytes, at the acceptance the bench measures."""
    feature = load_feature_draft(target, FEATURE_DRAFT_OF[model_name])
    return {"feature": feature, **({"feature int8": feature.quantized("int8")} if quantized else {})}


def _target_passes(target, new_tokens, prefix: int) -> dict:
    """n -> a call running a pass of n tokens after a cached prefix of `prefix` tokens (its own cache)."""
    device = next(target.parameters()).device
    cache = KVCache.for_model(target, 1, prefix + max(new_tokens) + 1)
    target(torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device), cache)

    def target_pass(m: int):
        x, pos = torch.randint(0, 100, (1, m), device=device), torch.arange(prefix, prefix + m, device=device)
        return lambda: target.logits(target.hidden_states(x, pos, cache))

    return {n: target_pass(n) for n in new_tokens}


@torch.inference_mode()
def paired_pass_costs(target, other, new_tokens=(1, 2, 3, 4, 5), prefix: int = 160,
                      repeats: int = 30) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of each model's pass over n tokens, the two timed in one interleaved run (each n)."""
    a, b = _target_passes(target, new_tokens, prefix), _target_passes(other, new_tokens, prefix)
    med = time_interleaved({**{("a", n): f for n, f in a.items()}, **{("b", n): f for n, f in b.items()}},
                           repeats=repeats, warmup=2, device=next(target.parameters()).device)
    return {n: med[("a", n)] for n in new_tokens}, {n: med[("b", n)] for n in new_tokens}


@torch.inference_mode()
def pass_costs(target, drafts: dict, new_tokens=(1, 2, 3, 4, 5), prefix: int = 160,
               repeats: int = 30) -> tuple[dict[int, float], dict[str, float]]:
    """Median seconds of a target pass over n tokens after a cached prefix (each n), and of one step of each draft."""
    device = next(target.parameters()).device
    fns = _target_passes(target, new_tokens, prefix)
    for name, draft in drafts.items():
        if isinstance(draft, FeatureDraft):
            dc = KVCache.for_model(draft, 1, prefix + 2)
            h = torch.randn(1, prefix, target.config.dim, device=device, dtype=next(target.parameters()).dtype)
            draft.hidden(h, torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device), dc)
            h1, x1, p1 = h[:, :1], torch.randint(0, 100, (1, 1), device=device), torch.tensor([prefix], device=device)
            fns[name] = lambda draft=draft, dc=dc, h1=h1, x1=x1, p1=p1: draft.covered_logits(
                draft.hidden(h1, x1, p1, dc)).argmax()
        else:
            dc = KVCache.for_model(draft, 1, prefix + 2)
            draft(torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device), dc)
            x1, p1 = torch.randint(0, 100, (1, 1), device=device), torch.tensor([prefix], device=device)
            fns[name] = lambda draft=draft, dc=dc, x1=x1, p1=p1: draft(x1, p1, dc).argmax()
    med = time_interleaved(fns, repeats=repeats, warmup=2, device=device)
    return {n: med[n] for n in new_tokens}, {name: med[name] for name in drafts}


def _pass_cost_row(r: Result, target, drafts: dict, ks) -> tuple[float, dict[int, float], dict[str, float]]:
    """The target's one-token pass in seconds, v(n) and each draft's c, measured and added to `r`."""
    v_secs, d_secs = pass_costs(target, drafts, new_tokens=tuple(range(1, max(ks) + 2)))
    v = {n: s / v_secs[1] for n, s in v_secs.items()}
    c = {d: s / v_secs[1] for d, s in d_secs.items()}
    r.add("pass costs", f"target 1 token {1e3 * v_secs[1]:.1f} ms; v(n) "
          + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()) + "; c " + ", ".join(f"{d} {x:.3f}" for d, x in c.items()))
    return v_secs[1], v, c


def predicted_speedup(alpha: float, k: int, c: float, v: dict[int, float]) -> float:
    """E / (k c + v(k + 1)): tokens per round over a round's cost in target steps (v relative to a 1-token pass)."""
    return expected_tokens_per_pass(alpha, k) / (k * c + v[k + 1])


def _spec_run(target, draft, ids, k: int, new_tokens: int,
              compile: bool = False) -> tuple[float, SpeculativeOutput, list[list[int]]]:
    outs = [speculative_generate(target, draft, x, k=k, max_new_tokens=new_tokens, compile=compile) for x in ids]
    agg = SpeculativeOutput([], k, [r for o in outs for r in o.rounds], 0, 0, sum(o.wall_s for o in outs))
    return agg.wall_s, agg, [o.token_ids for o in outs]


def _alone(target, tok, prompts, new_tokens: int, compile: bool = False) -> tuple[float, list[list[int]]]:
    outs = [generate(target, tok, p, max_new_tokens=new_tokens, compile=compile) for p in prompts]
    return sum(o.e2e_s for o in outs), [o.token_ids for o in outs]


def spec_runner(target, draft, ids, k: int, new_tokens: int, compile: bool = False):
    """i -> a call decoding prompt i with the draft (`_spec_run` times it on every prompt), for `interleaved_rows`."""
    return lambda i: lambda: speculative_generate(target, draft, ids[i], k=k, max_new_tokens=new_tokens,
                                                  compile=compile)


def alone_runner(target, tok, prompts, new_tokens: int, compile: bool = False):
    """i -> a call decoding prompt i with the target alone, for `interleaved_rows`."""
    return lambda i: lambda: generate(target, tok, prompts[i], max_new_tokens=new_tokens, compile=compile)


def interleaved_rows(r: Result, runners: dict, rows: dict, n_prompts: int, repeats: int = 2) -> dict[str, float]:
    """The target alone and the fastest row of each kind (eager, row-major, compiled) timed once more, interleaved.

    Each row above is timed over all prompts before the next starts, so a host whose speed drifts between rows
    moves their ratios. Here every contender decodes prompt i next to the others before prompt i + 1 comes, the
    whole `repeats` times; each contender's time is the sum over prompts of its fastest run. Ratios over the
    eager target alone."""
    kinds = {"eager": lambda key: "," not in key and not key.startswith("distilled"),
             "row-major": lambda key: key.endswith(", row-major"), "compiled": lambda key: key.endswith(", compiled")}
    best = [max((key for key in rows if is_kind(key)), key=lambda key: rows[key]["measured"])
            for is_kind in kinds.values() if any(is_kind(key) for key in rows)]
    labels = ["target alone"] + (["target alone, compiled"] if "target alone, compiled" in runners else []) + best
    fns = {(label, i): runners[label](i) for i in range(n_prompts) for label in labels}
    runs = interleaved_runs(fns, repeats=repeats, warmup=0)
    secs = {label: sum(min(runs[label, i]) for i in range(n_prompts)) for label in labels}
    ratios = {label: secs["target alone"] / secs[label] for label in labels}
    r.add("interleaved", f"every prompt decoded by each in turn, fastest of {repeats}; over the target alone: "
          + ", ".join(f"{label} {x:.2f}x" for label, x in ratios.items() if label != "target alone"))
    return ratios


def _recording_run(engine, prompts, new_tokens: int, into: list):
    """A no-argument run of `engine` over `prompts` that appends each run's token lists to `into`."""
    return lambda: into.append([o.token_ids for o in engine.generate(prompts, max_new_tokens=new_tokens)])


def engine_ratios(target, tok, draft, prompts, k: int, new_tokens: int, batch_sizes=(1, 2, 4, 8),
                  repeats: int = 2) -> dict[int, dict]:
    """Engine throughput with and without the feature draft at each max batch size: ratio and acceptance.

    The two engines run in turn, `repeats` times each, and each keeps its fastest run: a drift in the
    machine's speed between two runs then moves both alike instead of the ratio.
    """
    from ..engine import Engine
    repeats = validate.integer("repeats", repeats, low=1)
    out = {}
    for b in batch_sizes:
        engines = {name: Engine(target, tok, max_batch_size=b, max_model_len=512, **kw)
                   for name, kw in (("plain", {}), ("feature", dict(draft=draft, num_speculative_tokens=k)))}
        got = {name: [] for name in engines}
        for engine in engines.values():
            engine.generate(prompts[:2], max_new_tokens=4)                 # warm-up
        runs = {name: _recording_run(engine, prompts, new_tokens, got[name]) for name, engine in engines.items()}
        secs = interleaved_runs(runs, repeats=repeats, warmup=0, device=engines["plain"].device)
        best = {name: sum(map(len, got[name][0])) / min(secs[name]) for name in engines}
        out[b] = {"plain_tok_s": best["plain"], "feature_tok_s": best["feature"],
                  "ratio": best["feature"] / best["plain"], "draft_yield": engines["feature"].stats.draft_yield,
                  "same_tokens": all(run == got["plain"][0] for run in got["plain"] + got["feature"])}
    return out


def _engine_rows(r: Result, target, tok, feature, prompts, k: int, new_tokens: int, batch_sizes) -> dict:
    """Engine rows at each batch size and the crossover: the batch from which speculation loses."""
    eng = engine_ratios(target, tok, feature, prompts, k, new_tokens, batch_sizes)
    for b, e in eng.items():
        r.add(f"engine batch {b}", f"{e['feature_tok_s']:.1f} vs {e['plain_tok_s']:.1f} tok/s "
                                   f"({e['ratio']:.2f}x), accepted/proposed {e['draft_yield']:.2f}, "
                                   f"same tokens: {e['same_tokens']}")
    paying = [b for b, e in eng.items() if e["ratio"] >= 1]
    losing = [b for b in eng if b not in paying]
    crossover = losing_from({b: e["ratio"] for b, e in eng.items()})
    r.add("crossover", "speculation lost at every batch size measured" if not paying else
          f"speculation paid at every batch size measured (up to {max(batch_sizes)})" if not losing else
          f"speculation paid at batch {', '.join(map(str, paying))} and lost at batch {', '.join(map(str, losing))}"
          + (f"; from batch {crossover} on it lost at every size measured" if crossover is not None else ""))
    return {"engine": eng, "crossover": crossover}


def _compiled_rows(r: Result, rows: dict, add_row, model_name, dtype, device, tok, prompts, ids, want,
                   alone_s: float, ks, new_tokens: int, values: dict, quantized: bool, runners: dict) -> None:
    """The target alone and each feature draft at each k through compiled graphs (the target's verify passes; the
    draft's steps stay eager), on a second copy of the target (compiling re-lays its weights), each against eager
    and against each other."""
    fast, _ = load_model(model_name, dtype=dtype, device=device)
    _alone(fast, tok, prompts[:1], 4, compile=True)                        # compile outside the clock
    fast_s, _ = _alone(fast, tok, prompts, new_tokens, compile=True)
    runners["target alone, compiled"] = alone_runner(fast, tok, prompts, new_tokens, compile=True)
    r.add("target alone, compiled", f"{sum(map(len, want)) / fast_s:.1f} tok/s ({alone_s / fast_s:.2f}x eager)")
    for name, draft in feature_drafts(fast, model_name, quantized).items():
        for k in ks:
            _spec_run(fast, draft, ids[:1], k, 4, compile=True)            # this k's verify width, compiled
            secs, agg, got = _spec_run(fast, draft, ids, k, new_tokens, compile=True)
            label = f"{name} k={k}, compiled"
            runners[label] = spec_runner(fast, draft, ids, k, new_tokens, compile=True)
            add_row(label, k, secs, agg, got, alone_s)
            rows[label]["over_compiled_alone"] = fast_s / secs
            r.add(f"{label} / target alone compiled", f"{fast_s / secs:.2f}x")
    values["alone_compiled_over_eager"] = alone_s / fast_s


def _layout_rows(r: Result, rows: dict, add_row, target, model_name, tok, prompts, ids, eager_want,
                 alone_s: float, c: dict[str, float], ks, new_tokens: int, values: dict, quantized: bool,
                 runners: dict) -> None:
    """Each feature draft at each k on a second copy of the target with row-major weights (lowering.lay_out_for).

    load_model lays a CPU model's weights column-major, the layout MKL's one-row product reads fastest; a
    verify pass of a few rows runs MKL's matrix-matrix product instead, which on some CPUs reads row-major
    weights faster. Its pass costs are timed beside the eager target's and given relative to its one-token pass,
    and c is each feature draft's (the same drafts), so the formula predicts the speedup over the eager target
    alone, which it is measured against."""
    from ..lowering import lay_out_for
    row, _ = load_model(model_name, dtype=torch.float32, device=next(target.parameters()).device)
    lay_out_for(row, "reduction")                                          # row-major weights, fused again
    col_secs, row_secs = paired_pass_costs(target, row, new_tokens=tuple(range(1, max(ks) + 2)))
    v = {n: s / col_secs[1] for n, s in row_secs.items()}
    col_v = {n: s / col_secs[1] for n, s in col_secs.items()}
    r.add("row-major: pass costs", "timed beside the column-major target, relative to its 1-token pass: v(n) "
          + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()) + " (column-major, same run: "
          + ", ".join(f"{n}: {x:.2f}" for n, x in col_v.items()) + ")")
    (row_s, row_want), (again_s, _) = (_alone(row, tok, prompts, new_tokens) for _ in range(2))
    row_s = min(row_s, again_s)
    r.add("row-major: target alone", f"{sum(map(len, row_want)) / row_s:.1f} tok/s ({alone_s / row_s:.2f}x the "
          f"column-major target); tokens {'the same as' if row_want == eager_want else 'not all the same as'} "
          "the column-major target's")
    for name, draft in feature_drafts(row, model_name, quantized).items():
        for k in ks:
            secs, agg, got = _spec_run(row, draft, ids, k, new_tokens)
            label = f"{name} k={k}, row-major"
            runners[label] = spec_runner(row, draft, ids, k, new_tokens)
            add_row(label, k, secs, agg, got, alone_s, c[name], v=v, want=row_want)
            rows[label]["over_row_major_alone"] = row_s / secs
    values["row_major"] = {"v": v, "c": c, "alone_over_column": alone_s / row_s,
                           "same_tokens_as_column": row_want == eager_want}


def _row_adder(r: Result, rows: dict, target, tok, lists, want, v):
    """add_row(label, k, secs, agg, got, base_s, c_draft=None, v=v, want=want): a speculative run's row in `rows`
    and `r` (acceptance, the formula's prediction where c_draft is given, the speedup over base_s, the tokens)."""
    def add_row(label: str, k: int, secs: float, agg: SpeculativeOutput, got, base_s: float, c_draft=None,
                v=v, want=want):
        agreement = compare(target, lists, want, got)
        pred = predicted_speedup(agg.acceptance_rate, k, c_draft, v) if c_draft is not None else None
        rows[label] = row = {"k": k, "yield": agg.draft_yield, "alpha": agg.acceptance_rate,
                             "by_position": agg.acceptance_by_position, "predicted": pred, "measured": base_s / secs,
                             "identical": agreement.rate, "holds": agreement.holds}
        r.add(label, f"accepted/proposed {row['yield']:.2f} (alpha {row['alpha']:.2f}; by position "
                     + ", ".join(f"{a:.2f}" for a in row["by_position"]) + "); speedup "
                     + (f"predicted {pred:.2f}x, " if pred is not None else "") + f"measured {row['measured']:.2f}x; "
                     f"tokens: {agreement.summary(tok).splitlines()[0]}")
    return add_row


def bench_feature_draft(model_name: str = "smollm2-135m", n_prompts: int = 16, new_tokens: int = 48,
                        ks: tuple[int, ...] = (2, 3, 4), dtype: torch.dtype = torch.float32, compile: bool = True,
                        batch_sizes: tuple[int, ...] = (1, 4, 8, 16), seed: int = 26, layouts: bool = True,
                        quantized: bool = True) -> Result:
    """Feature draft vs distilled draft vs the target alone: c, v(n), acceptance, predicted and measured speedups.

    With `quantized`, the feature draft's int8 copy runs beside it everywhere (a cheaper draft step, c, at the
    acceptance its rounding leaves). With `compile`, the target alone and the feature drafts at each k run once
    more through compiled graphs (`_compiled_rows`); with `layouts` (fp32 on a CPU), on a copy of the target with
    row-major weights, the layout a verify pass's few-row products may read faster (`_layout_rows`). The engine
    rows run the eager feature draft and k whose speedup E / (k c + v(k + 1)) predicts highest: its terms are
    measured interleaved or counted, while each row's measured speedup moves with the host between rows.
    """
    if model_name not in FEATURE_DRAFT_OF:
        raise ValueError(f"no bundled feature draft for {model_name!r}; choose from {list(FEATURE_DRAFT_OF)}")
    device = get_device()
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    r = Result(f"feature draft: EAGLE's one-layer draft on the target's features, vs the distilled draft ({name})")
    target, tok = load_model(model_name, dtype=dtype, device=device)
    features = feature_drafts(target, model_name, quantized)
    feature = features["feature"]
    distilled, _ = load_model(DRAFT_OF[model_name], dtype=dtype, device=device)
    prompts = heldout_prompts(tok, n_prompts, seed)
    ids = [encode_prompt(target, tok, p) for p in prompts]
    r.add("models", f"{describe_model(model_name, target, device)}; feature draft "
                    f"{feature.num_parameters() / 1e6:.2f}M params over {feature.coverage_size} tokens; "
                    f"distilled {describe_model(DRAFT_OF[model_name], distilled, device)}")
    r.add("prompts", f"{len(prompts)} held-out (seed {seed}: code and chat), up to {new_tokens} new tokens, greedy")
    step_s, v, c = _pass_cost_row(r, target, {**features, "distilled": distilled}, ks)
    (alone_s, want), (again_s, _) = (_alone(target, tok, prompts, new_tokens) for _ in range(2))
    alone_s = min(alone_s, again_s)
    r.add("target alone", f"{sum(map(len, want)) / alone_s:.1f} tok/s")
    rows, runners = {}, {"target alone": alone_runner(target, tok, prompts, new_tokens)}
    add_row = _row_adder(r, rows, target, tok, [x[0].tolist() for x in ids], want, v)
    for which, draft in features.items():
        for k in ks:
            secs, agg, got = _spec_run(target, draft, ids, k, new_tokens)
            add_row(f"{which} k={k}", k, secs, agg, got, alone_s, c[which])
            runners[f"{which} k={k}"] = spec_runner(target, draft, ids, k, new_tokens)
    name_best, k_best = max(((n, k) for n in features for k in ks),     # by the cost model: the rows drift
                            key=lambda nk: rows[f"{nk[0]} k={nk[1]}"]["predicted"])
    secs, agg, got = _spec_run(target, distilled, ids, 3, new_tokens)
    add_row("distilled k=3", 3, secs, agg, got, alone_s, c["distilled"])
    values = {"c": c, "v": v, "target_step_s": step_s, "rows": rows, "precision": name}
    if layouts and dtype == torch.float32 and weight_layout(target) == "column":     # a CPU: load_model's layout
        _layout_rows(r, rows, add_row, target, model_name, tok, prompts, ids, want, alone_s, c, ks,
                     new_tokens, values, quantized, runners)
    if compile:
        _compiled_rows(r, rows, add_row, model_name, dtype, device, tok, prompts, ids, want, alone_s, ks,
                       new_tokens, values, quantized, runners)
    values["interleaved"] = ratios = interleaved_rows(r, runners, rows, len(ids))
    best = max((key for key in ratios if key != "target alone"), key=ratios.get)
    r.add("best / target alone (eager), interleaved", f"{ratios[best]:.2f}x ({best})")
    chosen = rows[f"{name_best} k={k_best}"]
    r.add("engine", f"the {name_best} draft at k = {k_best}, the eager row the cost model predicts fastest "
                    f"({chosen['predicted']:.2f}x; measured {chosen['measured']:.2f}x)")
    values |= {"best": best, "engine_draft": name_best, "engine_k": k_best,
               **_engine_rows(r, target, tok, features[name_best], prompts, k_best, new_tokens, batch_sizes)}
    r.values = values
    return r
