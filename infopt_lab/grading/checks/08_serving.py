"""Checks for exercises/08_serving.ipynb: goodput from a recorded run, the saturation knee, a max batch size for an SLO.

Conventions the notebook states and these checks hold the student to:

- `goodput(records, duration_s, slo_ttft_ms, slo_tpot_ms)`: records are dicts with ok, ttft_ms, tpot_ms (one per
  request, as the load test records them); requests per second of duration_s that completed (ok) with
  ttft_ms <= slo_ttft_ms and tpot_ms <= slo_tpot_ms (a request exactly at an SLO meets it); ValueError when
  duration_s <= 0.
- `knee(offered, achieved, keep_up=0.9)`: going up in offered rate, the last one with achieved >= keep_up x
  offered before the first that falls short (`infopt_lab.serving.loadtest.knee`); ValueError when none keeps up.
- `pick_max_batch_size(runs, slo_ttft_ms, slo_tpot_ms)`: runs are dicts with max_batch_size, ttft_p99_ms,
  tpot_p99_ms, output_throughput; the max_batch_size of the run with the highest output_throughput whose p99s
  meet both SLOs (at an SLO counts), the smaller batch size of equal throughputs; ValueError when none meets them.
"""
from __future__ import annotations

import random

from ...serving.loadtest import knee as reference_knee
from . import CheckFailed, as_number, check, expect_close, expect_raises, short


def reference_goodput(records: list[dict], duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> float:
    """What `goodput` must return."""
    good = [r for r in records if r["ok"] and r["ttft_ms"] <= slo_ttft_ms and r["tpot_ms"] <= slo_tpot_ms]
    return len(good) / duration_s


def reference_pick(runs: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> int | None:
    """What `pick_max_batch_size` must return (None where it must raise)."""
    ok = [r for r in runs if r["ttft_p99_ms"] <= slo_ttft_ms and r["tpot_p99_ms"] <= slo_tpot_ms]
    return min(ok, key=lambda r: (-r["output_throughput"], r["max_batch_size"]))["max_batch_size"] if ok else None


def random_records(rng: random.Random, n: int, slo: tuple[float, float]) -> list[dict]:
    """n requests, some failed, some exactly at an SLO, the rest spread around it."""
    records = []
    for _ in range(n):
        ttft = rng.choice([slo[0], round(rng.uniform(0.2, 2.0) * slo[0], 2)])
        tpot = rng.choice([slo[1], round(rng.uniform(0.3, 1.8) * slo[1], 3)])
        records.append({"ok": rng.random() > 0.1, "ttft_ms": ttft, "tpot_ms": tpot})
    return records


# --- goodput ---------------------------------------------------------------------------------------

@check("goodput on hidden recorded runs (failed requests, requests exactly at an SLO)", points=3)
def goodput_hidden(sub):
    rng = random.Random(80)
    cases = []
    for _ in range(10):
        slo = (round(rng.uniform(50, 3000), 1), round(rng.uniform(5, 300), 2))
        cases.append((random_records(rng, rng.randint(1, 60), slo), round(rng.uniform(1, 120), 2), *slo))
    cases.append(([{"ok": False, "ttft_ms": 1.0, "tpot_ms": 1.0}], 2.0, 100.0, 100.0))   # failed: never good
    for args, got in zip(cases, sub.call_many("goodput", cases)):
        expect_close(got, reference_goodput(*args), f"goodput({len(args[0])} hidden records, {args[1]}, {args[2]}, "
                     f"{args[3]})", rel=1e-9, abs_tol=1e-12)


@check("goodput rejects a run of zero or negative duration (ValueError)", points=1)
def goodput_rejects(sub):
    for duration in (0.0, -1.0):
        expect_raises(sub, "ValueError", "goodput", [{"ok": True, "ttft_ms": 1.0, "tpot_ms": 1.0}], duration, 10.0, 10.0)


# --- the knee --------------------------------------------------------------------------------------

@check("knee on hidden saturation curves (any order, a lucky rate after the first miss ignored)", points=3)
def knee_hidden(sub):
    rng = random.Random(81)
    cases = [([1.0, 2.0, 4.0, 8.0], [1.0, 1.95, 3.0, 3.1], 0.9), ([4.0, 1.0, 2.0], [4.0, 1.0, 1.0], 0.9),
             ([1.0, 2.0], [0.9, 1.8], 0.9), ([0.5, 1.0, 2.0], [0.5, 0.99, 1.2], 0.99)]
    while len(cases) < 14:
        capacity = rng.uniform(0.5, 20)
        offered = sorted({round(rng.uniform(0.1, 3) * capacity, 2) for _ in range(rng.randint(2, 7))})
        achieved = [round(min(o, capacity) * rng.uniform(0.93, 1.0), 3) for o in offered]
        pairs = list(zip(offered, achieved))
        rng.shuffle(pairs)
        if any(a >= 0.9 * o for o, a in pairs):
            cases.append(([o for o, _ in pairs], [a for _, a in pairs], 0.9))
    for args, got in zip(cases, sub.call_many("knee", cases)):
        expect_close(got, reference_knee(*args), f"knee({short(args[0])}, {short(args[1])}, {args[2]})", rel=1e-12)


@check("knee raises ValueError when the server keeps up with no rate", points=1)
def knee_rejects(sub):
    expect_raises(sub, "ValueError", "knee", [1.0, 2.0], [0.5, 0.6], 0.9)


# --- a max batch size for an SLO -----------------------------------------------------------------

def random_runs(rng: random.Random) -> list[dict]:
    """Runs at batch sizes 1, 2, 4, ...: throughput and p99s grow with the batch, some throughputs equal."""
    runs, tput = [], rng.uniform(20, 200)
    for b in [1, 2, 4, 8, 16, 32][:rng.randint(2, 6)]:
        tput = tput if rng.random() < 0.2 else round(tput * rng.uniform(0.9, 1.8), 1)
        runs.append({"max_batch_size": b, "ttft_p99_ms": round(rng.uniform(20, 400) * b ** 0.5, 1),
                     "tpot_p99_ms": round(rng.uniform(10, 40) * (1 + b / 8), 2), "output_throughput": tput})
    return runs


@check("pick_max_batch_size on hidden measurements (ties to the smaller batch, an SLO met exactly)", points=3)
def pick_hidden(sub):
    rng = random.Random(82)
    cases = []
    while len(cases) < 20:
        runs = random_runs(rng)
        edge = rng.choice(runs)
        slo = (edge["ttft_p99_ms"], edge["tpot_p99_ms"]) if rng.random() < 0.4 else \
            (round(rng.uniform(50, 1500), 1), round(rng.uniform(15, 120), 2))
        if reference_pick(runs, *slo) is not None:
            cases.append((runs, *slo))
    for args, got in zip(cases, sub.call_many("pick_max_batch_size", cases)):
        want = reference_pick(*args)
        what = f"pick_max_batch_size({len(args[0])} hidden runs, {args[1]}, {args[2]})"
        if as_number(got, what) != want:
            raise CheckFailed(f"{what} returned {short(got)}, expected {want}")


@check("pick_max_batch_size raises ValueError when no run meets the SLOs", points=1)
def pick_rejects(sub):
    runs = random_runs(random.Random(83))
    expect_raises(sub, "ValueError", "pick_max_batch_size", runs, 1.0, 1.0)
