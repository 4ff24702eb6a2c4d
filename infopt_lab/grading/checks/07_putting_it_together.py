"""Checks for exercises/07_putting_it_together.ipynb: what a rung costs, whether it meets the targets, the cheapest.

Conventions the notebook states and these checks hold the student to (a rung is a dict with the keys of
`Rung.as_json()`: name, throughput_tok_s, ttft_p50_s, ttft_p99_s, tpot_s, peak_memory_bytes, ppl_delta_pct,
exact_match):

- `cost_per_million_tokens(throughput_tok_s, price_per_hour)` = price_per_hour / (throughput_tok_s * 3600) * 1e6,
  what `infopt_lab.bench.decision.cost_per_million_tokens` computes; ValueError when throughput_tok_s <= 0 or
  price_per_hour < 0.
- `meets(rung, ttft_slo_s, max_ppl_delta_pct, min_exact_match=0.0)` -> bool: ttft_p99_s <= ttft_slo_s,
  ppl_delta_pct <= max_ppl_delta_pct and exact_match >= min_exact_match; a rung exactly at a target meets it.
- `cheapest(rungs, price_per_hour, ttft_slo_s, max_ppl_delta_pct, min_exact_match=0.0, memory_budget_bytes=None)`
  -> the rung's dict with the lowest cost per million tokens among those that meet the targets and have
  peak_memory_bytes <= memory_budget_bytes (any memory when None); the earlier of equal costs. ValueError with
  "no rung" in its message when none qualifies.
- Task 4, a decision from the student's own ladder: the notebook records the ladder it decided from
  (`lab.record("ladder", {"source": ..., "rungs": [...]})`) and answers under DECISION_TITLE with a line
  `Decision: <rung name>` and the rung's cost per million tokens at DECISION_PRICE, for transcripts that must
  match rung 0's (exact match 1.0) at no perplexity cost (0.0%), any TTFT. The checks recompute the answer from
  that record; they never run the ladder.
"""
from __future__ import annotations

import math
import random

from ...bench.decision import cost_per_million_tokens, misses
from ..protocol import Raised
from . import CheckFailed, check, expect_cited, expect_close, expect_named, expect_raises, short, written_decision

GiB = 2 ** 30


# --- hidden rung tables and their answers ------------------------------------------------------

def random_rungs(rng: random.Random, n: int) -> list[dict]:
    """n rungs of plausible numbers, named 'rung 0', 'rung 1', ... (some with equal throughput, so equal cost)."""
    rungs = []
    for i in range(n):
        p50 = round(rng.uniform(0.02, 2.0), 3)
        throughput_tok_s = rungs[-1]["throughput_tok_s"] if rungs and rng.random() < 0.2 else round(rng.uniform(5, 2000), 1)
        rungs.append(dict(name=f"rung {i}", throughput_tok_s=throughput_tok_s, ttft_p50_s=p50,
                          ttft_p99_s=round(p50 * rng.uniform(1.2, 8.0), 3), tpot_s=round(rng.uniform(0.005, 0.08), 4),
                          peak_memory_bytes=rng.randrange(GiB // 4, 80 * GiB),
                          ppl_delta_pct=0.0 if rng.random() < 0.4 else round(rng.uniform(-0.3, 6.0), 2),
                          exact_match=round(rng.uniform(0.3, 1.0), 3)))
    return rungs


def random_targets(rng: random.Random, rungs: list[dict]) -> tuple:
    """(ttft_slo_s, max_ppl_delta_pct[, min_exact_match[, memory_budget_bytes]]), half at some rung's own value."""
    def threshold(key: str, low: float, high: float):
        return rng.choice(rungs)[key] if rng.random() < 0.5 else round(rng.uniform(low, high), 3)
    targets = (threshold("ttft_p99_s", 0.05, 12.0), threshold("ppl_delta_pct", -0.2, 5.0))
    optional = (threshold("exact_match", 0.3, 1.0),
                rng.choice([None, rng.choice(rungs)["peak_memory_bytes"], rng.randrange(GiB, 80 * GiB)]))
    return targets + optional[:rng.randrange(3)]          # leave the defaults out in some calls


def reference_meets(rung: dict, ttft_slo_s: float, max_ppl_delta_pct: float, min_exact_match: float = 0.0) -> bool:
    """What `meets` must return: every target met, a rung exactly at one included."""
    return not misses(rung, ttft_slo_s, max_ppl_delta_pct, min_exact_match)


def qualifies(rung: dict, targets: tuple) -> bool:
    """Whether the rung meets `targets` (as passed to cheapest after the price) and fits its memory budget."""
    return not misses(rung, *targets)


def reference_cheapest(rungs: list[dict], price_per_hour: float, targets: tuple) -> int | None:
    """The index of the cheapest qualifying rung (the first of equal costs), or None."""
    costs = [(cost_per_million_tokens(r["throughput_tok_s"], price_per_hour), i) for i, r in enumerate(rungs)
             if qualifies(r, targets)]
    return min(costs)[1] if costs else None


def describe(rungs: list[dict], price_per_hour: float, targets: tuple) -> str:
    """The call, for a reason line: the rungs are hidden, the rest is shown."""
    names = ("ttft_slo_s", "max_ppl_delta_pct", "min_exact_match", "memory_budget_bytes")
    args = ", ".join(f"{n}={v!r}" for n, v in zip(names, targets))
    return f"cheapest({f'{len(rungs)} hidden rungs' if rungs else '[]'}, price_per_hour={price_per_hour}, {args})"


def expect_choice(got, rungs: list[dict], price_per_hour: float, targets: tuple) -> None:
    """CheckFailed unless `got` is the reference's rung, with a reason that says what is wrong with the one returned."""
    what = describe(rungs, price_per_hour, targets)
    want = rungs[reference_cheapest(rungs, price_per_hour, targets)]
    if got == want:
        return
    if got not in rungs:
        raise CheckFailed(f"{what} returned {short(got)}, expected the dict of {want['name']!r} as given")
    cost = {r["name"]: cost_per_million_tokens(r["throughput_tok_s"], price_per_hour) for r in (got, want)}
    if not qualifies(got, targets):
        why = f"which misses its targets ({'; '.join(misses(got, *targets))})"
    elif cost[got["name"]] > cost[want["name"]]:
        why = f"which costs {cost[got['name']]:.6g} per million tokens against {cost[want['name']]:.6g}"
    else:
        why = "which costs the same but comes later in the list (the earlier of equal costs wins)"
    raise CheckFailed(f"{what} returned {got['name']!r}, {why}; expected {want['name']!r}")


# --- the cost of a rung ------------------------------------------------------------------------

@check("cost_per_million_tokens on hidden throughputs and prices (a price of 0 included)", points=2)
def cost_hidden(sub):
    """Seeded throughputs and prices, and the ends: one token a second, a free machine."""
    rng = random.Random(70)
    cases = [(round(rng.uniform(1, 5000), 2), round(rng.uniform(0.1, 40), 2)) for _ in range(8)]
    cases += [(1.0, 1.0), (0.5, 3.0), (12_000.0, 98.32), (250.0, 0.0)]
    for (throughput_tok_s, price_per_hour), got in zip(cases, sub.call_many("cost_per_million_tokens", cases)):
        expect_close(got, cost_per_million_tokens(throughput_tok_s, price_per_hour),
                     f"cost_per_million_tokens({throughput_tok_s}, {price_per_hour})", rel=1e-9, abs_tol=1e-12)


@check("cost_per_million_tokens rejects throughput_tok_s <= 0 and price_per_hour < 0 (ValueError)", points=1)
def cost_rejects(sub):
    """No throughput, a negative throughput, a negative price."""
    for args in [(0.0, 2.0), (0, 1), (-12.5, 2.0), (100.0, -0.01)]:
        expect_raises(sub, "ValueError", "cost_per_million_tokens", *args)


# --- whether a rung meets the targets ----------------------------------------------------------

def expect_meets(sub, calls: list[tuple]) -> None:
    """meets on many (rung, targets...) calls in one round trip, each against the reference."""
    for args, got in zip(calls, sub.call_many("meets", calls)):
        want = reference_meets(*args)
        rung, targets = args[0], ", ".join(repr(a) for a in args[1:])
        what = (f"meets(a hidden rung with ttft_p99_s={rung['ttft_p99_s']}, ppl_delta_pct={rung['ppl_delta_pct']}, "
                f"exact_match={rung['exact_match']}; {targets})")
        if not isinstance(got, bool):
            raise CheckFailed(f"{what} returned {short(got)}, expected a bool")
        if got != want:
            raise CheckFailed(f"{what} returned {got}, expected {want}")


@check("meets on hidden rungs and targets, with and without min_exact_match", points=2)
def meets_hidden(sub):
    """Seeded rungs against seeded targets, a third of them leaving min_exact_match to its default."""
    rng = random.Random(71)
    rungs = random_rungs(rng, 30)
    expect_meets(sub, [(r, *random_targets(rng, rungs)[:3]) for r in rungs])


@check("meets counts a rung exactly at each target as meeting it, and one just past as not", points=2)
def meets_boundary(sub):
    """Targets set at a rung's own numbers, then each moved by the smallest float step to the wrong side."""
    calls = []
    for r in random_rungs(random.Random(72), 3) + [dict(random_rungs(random.Random(73), 1)[0], ppl_delta_pct=0.0)]:
        at = (r["ttft_p99_s"], r["ppl_delta_pct"], r["exact_match"])
        calls += [(r, *at), (r, at[0], at[1]),
                  (r, math.nextafter(at[0], -math.inf), at[1], at[2]),
                  (r, at[0], math.nextafter(at[1], -math.inf), at[2]),
                  (r, at[0], at[1], math.nextafter(at[2], math.inf))]
    expect_meets(sub, calls)


# --- the cheapest rung -------------------------------------------------------------------------

@check("cheapest on hidden scenarios (random rung tables, prices, targets and memory budgets)", points=2)
def cheapest_hidden(sub):
    """Seeded scenarios that some rung meets; the defaults left out in some calls."""
    rng = random.Random(74)
    scenarios = []
    while len(scenarios) < 30:
        rungs = random_rungs(rng, rng.randint(1, 9))
        price, targets = round(rng.uniform(0.2, 40.0), 2), random_targets(rng, rungs)
        if reference_cheapest(rungs, price, targets) is not None:
            scenarios.append((rungs, price, *targets))
    for args, got in zip(scenarios, sub.call_many("cheapest", scenarios)):
        expect_choice(got, args[0], args[1], args[2:])


def constructed_rungs() -> list[dict]:
    """Six hidden rungs: 'fast' is the cheapest overall, 'twin a' and 'twin b' cost the same."""
    rows = [("slow", 40.0, 9.0, 14.6, 0.0, 1.0), ("fast", 900.0, 0.5, 30.0, 1.5, 0.7),
            ("twin a", 500.0, 0.4, 20.0, 0.0, 0.95), ("twin b", 500.0, 0.3, 12.0, 0.0, 0.98),
            ("small", 300.0, 0.6, 8.0, 0.8, 0.9), ("quick start", 200.0, 0.08, 22.0, 0.0, 0.99)]
    return [dict(name=name, throughput_tok_s=tps, ttft_p50_s=p99 / 4, ttft_p99_s=p99, tpot_s=0.02,
                 peak_memory_bytes=round(gib * GiB), ppl_delta_pct=ppl, exact_match=match)
            for name, tps, p99, gib, ppl, match in rows]


@check("cheapest: ties go to the earlier rung, a memory budget rules out the cheapest, a rung at the SLO counts",
       points=2)
def cheapest_edges(sub):
    """Constructed scenarios, each of which a common slip gets wrong."""
    rungs = constructed_rungs()
    fast = rungs[1]
    scenarios = [
        (rungs, 2.0, 10.0, 2.0),                                    # everything meets: the fastest
        (rungs, 2.0, 10.0, 1.0),                                    # quality rules out 'fast': twins tie, 'twin a'
        (rungs[::-1], 2.0, 10.0, 1.0),                              # the same, reversed: 'twin b' comes first now
        (rungs, 2.0, 10.0, 2.0, 0.0, fast["peak_memory_bytes"] - 1),  # one byte short of 'fast': 'twin a'
        (rungs, 2.0, 10.0, 2.0, 0.0, fast["peak_memory_bytes"]),    # exactly 'fast''s memory: it fits
        (rungs, 2.0, 10.0, 2.0, 0.0, 19 * GiB),                     # twin a out too: 'twin b'
        (rungs, 2.0, fast["ttft_p99_s"], 2.0),                      # SLO exactly at 'fast''s p99: it meets it
        (rungs, 2.0, 0.4, 2.0),                                     # 'twin a' exactly at the SLO
        (rungs, 2.0, 10.0, 1.0, 0.96),                              # the exact-match floor rules out 'twin a'
        (rungs, 2.0, 0.1, 1.0),                                     # only 'quick start' is fast enough
        (rungs[:1], 0.35, 9.0, 0.0, 1.0, rungs[0]["peak_memory_bytes"]),  # one rung, at every target
    ]
    for args, got in zip(scenarios, sub.call_many("cheapest", scenarios)):
        expect_choice(got, args[0], args[1], args[2:])


def expect_no_rung(sub, args: tuple) -> None:
    """CheckFailed unless cheapest(*args) raises ValueError whose message contains 'no rung'."""
    what = describe(args[0], args[1], args[2:])
    try:
        got = sub.call("cheapest", *args)
    except Raised as e:
        if e.error_type != "ValueError":
            raise CheckFailed(f"{what} raised {e.error_type}, expected ValueError") from None
        message = str(e).split(" raised ValueError", 1)[-1]
        if "no rung" not in message.lower():
            raise CheckFailed(f"{what} raised ValueError{message}; its message must contain 'no rung'") from None
        return
    name = got.get("name") if isinstance(got, dict) else got
    raise CheckFailed(f"{what} returned {short(name)}, expected ValueError: no rung meets every target")


@check("cheapest raises ValueError with 'no rung' when none qualifies (or the list is empty)", points=1)
def cheapest_none(sub):
    """Each target alone too strict for every rung, targets each met by some rung but never together, no rungs."""
    rungs = constructed_rungs()
    expect_no_rung(sub, ([], 2.0, 1.0, 1.0))
    for args in [(rungs, 2.0, 0.05, 5.0), (rungs, 2.0, 10.0, -1.0), (rungs, 2.0, 5.0, 5.0, 1.0),
                 (rungs, 2.0, 10.0, 5.0, 0.0, 4 * GiB), (rungs, 2.0, 0.5, 0.5, 0.995),
                 (rungs, 2.0, 0.4, 1.0, 0.0, 10 * GiB)]:
        expect_no_rung(sub, args)


# --- task 4: a decision from the student's own ladder -------------------------------------------

DECISION_TITLE = "Your decision (task 4)"
DECISION_PRICE = 0.10                                       # per hour, as the notebook states
DECISION_TARGETS = (math.inf, 0.0, 1.0)                     # any TTFT, no perplexity change, every turn identical
RUNG_KEYS = ("name", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_s", "peak_memory_bytes",
             "ppl_delta_pct", "exact_match")


def recorded_rungs(sub) -> list[dict]:
    """The rungs of the recorded ladder, checked for the shape `Rung.as_json()` gives them."""
    data = sub.record("ladder")
    rungs = data.get("rungs") if isinstance(data, dict) else None
    if not isinstance(rungs, list) or len(rungs) < 2:
        raise CheckFailed("record 'ladder' must be a dict whose 'rungs' lists at least two rungs")
    for i, r in enumerate(rungs):
        missing = [k for k in RUNG_KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise CheckFailed(f"rung {i} of record 'ladder' lacks {', '.join(missing)}")
        numbers = [r[k] for k in RUNG_KEYS[1:]]
        if not isinstance(r["name"], str) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                     for x in numbers):
            raise CheckFailed(f"rung {i} of record 'ladder' needs a name and numbers, got {short(r)}")
        if r["throughput_tok_s"] <= 0 or not 0 <= r["exact_match"] <= 1 or r["peak_memory_bytes"] <= 0:
            raise CheckFailed(f"rung {r['name']!r} of record 'ladder' holds impossible numbers: {short(r)}")
    if len({r["name"] for r in rungs}) != len(rungs):
        raise CheckFailed("record 'ladder' names a rung twice")
    return rungs


@check("task 4: the recorded ladder has the rows bench --ladder writes", points=1, written=True)
def ladder_recorded(sub):
    """Every rung with a name, a positive throughput and memory, an exact match in [0, 1]."""
    recorded_rungs(sub)


@check("task 4: the decision names the cheapest rung for identical transcripts on the recorded ladder, "
       "and cites its cost", points=2, written=True)
def ladder_decision(sub):
    """The answer's Decision line names the reference choice, and the answer writes that rung's cost."""
    rungs = recorded_rungs(sub)
    text, line = written_decision(sub, DECISION_TITLE, "a rung")
    best = reference_cheapest(rungs, DECISION_PRICE, DECISION_TARGETS)
    if best is None:
        expect_named(line, "none", ["none", *(r["name"] for r in rungs)], "identical transcripts at no cost")
        return
    want = rungs[best]
    expect_named(line, want["name"], [r["name"] for r in rungs], "identical transcripts at no perplexity cost")
    expect_cited(text, cost_per_million_tokens(want["throughput_tok_s"], DECISION_PRICE),
                 f"{want['name']!r}'s cost per million tokens at {DECISION_PRICE:.2f} per hour")


def wrong_answers(written) -> list[str]:
    """Answers a grader must mark down, built from the notebook's own record: every other rung with its own
    cost, and the right rung with a cost half as large again."""
    rungs = written.record("ladder")["rungs"]
    best = rungs[reference_cheapest(rungs, DECISION_PRICE, DECISION_TARGETS)]
    cost = {r["name"]: cost_per_million_tokens(r["throughput_tok_s"], DECISION_PRICE) for r in rungs}
    return ([f"\n\nDecision: {r['name']}\n\nIt costs {cost[r['name']]:.3f} per million tokens."
             for r in rungs if r is not best]
            + [f"\n\nDecision: {best['name']}\n\nIt costs {cost[best['name']] * 1.5:.3f} per million tokens."])
