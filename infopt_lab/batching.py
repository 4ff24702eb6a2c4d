"""Batching policies on paper: the seed's utilization function and a step simulator.

The simulator counts steps, not seconds: in every step each running request
produces one token. It shows what the scheduling policy alone costs; the
engine (`infopt_lab.engine`) then runs the same policies on the real model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from . import validate
from .workloads import code_prompts, poisson_arrivals, skewed_lengths  # noqa: F401  (re-exported: their old home)


def static_batch_utilization(request_lengths: Sequence[int], batch_size: int) -> float:
    """Useful share of the slot-steps static batching holds: sum(lengths) / sum(longest * batch members)."""
    batch_size = validate.integer("batch_size", batch_size, low=1)
    request_lengths = validate.integers("request_lengths", request_lengths, low=1)
    held = useful = 0
    for i in range(0, len(request_lengths), batch_size):
        batch = request_lengths[i:i + batch_size]
        held += max(batch) * len(batch)          # every member holds its slot until the longest ends
        useful += sum(batch)
    return useful / held


def continuous_schedule_step(running: list[dict], waiting: list[dict], max_slots: int,
                             token_budget: int) -> tuple[list[dict], list[dict], list[dict]]:
    """One continuous-batching step: retire, then admit first-come-first-served within slots and budget.

    A request is a dict with "id", "prompt_len" and "remaining" (tokens still to produce).
    Requests with remaining == 0 leave `running`; each one still running costs 1 token of
    the budget (its decode); then requests move from the front of `waiting` while a slot
    is free and their prompt fits what is left of the budget, stopping at the first that
    does not (no overtaking). Returns new lists (running, waiting, retired).
    """
    retired = [r for r in running if r["remaining"] == 0]
    running = [r for r in running if r["remaining"] > 0]
    waiting = list(waiting)
    budget = token_budget - len(running)
    while waiting and len(running) < max_slots and waiting[0]["prompt_len"] <= budget:
        request = waiting.pop(0)
        budget -= request["prompt_len"]
        running.append(request)
    return running, waiting, retired


@dataclass
class SimResult:
    policy: str
    steps: int
    utilization: float                 # produced tokens / slot-steps held (the seed's measure)
    occupancy: float                   # produced tokens / (steps * batch_size)
    ttft_steps: list[int]              # arrival -> first token, per request
    latency_steps: list[int]           # arrival -> last token, per request
    timeline: list[list[tuple[int, int, str]]] = field(repr=False, default_factory=list)  # (slot, id, kind) per step


def simulate(request_lengths: Sequence[int], batch_size: int, policy: str = "continuous",
             arrivals: Sequence[int] | None = None, prompt_lens: Sequence[int] | None = None,
             token_budget: int | None = None) -> SimResult:
    """Step-by-step schedule of requests producing request_lengths tokens; arrivals in steps (default all 0)."""
    batch_size = validate.integer("batch_size", batch_size, low=1)
    request_lengths = validate.integers("request_lengths", request_lengths, low=1)
    validate.choice("policy", policy, ("static", "continuous"))
    n = len(request_lengths)
    arrivals = [0] * n if arrivals is None else validate.integers("arrivals", arrivals, low=0, length=n)
    prompt_lens = [1] * n if prompt_lens is None else validate.integers("prompt_lens", prompt_lens, low=1, length=n)
    # a budget below the longest prompt would never admit that request: the simulation would not end
    budget = validate.integer("token_budget", token_budget, low=max(prompt_lens), allow_none=True)
    budget = batch_size + max(prompt_lens) if budget is None else budget
    queue = sorted(({"id": i, "prompt_len": prompt_lens[i], "remaining": request_lengths[i]} for i in range(n)),
                   key=lambda r: arrivals[r["id"]])
    first, last, timeline, slots = {}, {}, [], {}
    running: list[dict] = []
    step = 0
    while len(last) < n:
        arrived = [r for r in queue if arrivals[r["id"]] <= step]
        if policy == "continuous":
            running, rest, retired = continuous_schedule_step(running, arrived, batch_size, budget)
            for r in retired:
                slots.pop(r["id"])
            for r in running:
                if r["id"] not in slots:             # the lowest free slot
                    slots[r["id"]] = min(set(range(batch_size)) - set(slots.values()))
            members, padding = running, []
        else:
            if all(r["remaining"] == 0 for r in running):
                running = arrived[:batch_size]
                slots = {r["id"]: i for i, r in enumerate(running)}
            rest = [r for r in arrived if r not in running]
            members = [r for r in running if r["remaining"] > 0]
            padding = [r for r in running if r["remaining"] == 0]
        queue = rest + [r for r in queue if arrivals[r["id"]] > step]
        rows = []
        for r in members:
            kind = "prefill" if r["id"] not in first else "decode"
            first.setdefault(r["id"], step)
            r["remaining"] -= 1
            if r["remaining"] == 0:
                last[r["id"]] = step
            rows.append((slots[r["id"]], r["id"], kind))
        rows += [(slots[r["id"]], r["id"], "padding") for r in padding]
        timeline.append(rows)
        step += 1
    produced = sum(request_lengths)
    held = produced + sum(1 for rows in timeline for *_, kind in rows if kind == "padding")
    return SimResult(policy, step, produced / held, produced / (step * batch_size),
                     [first[i] - arrivals[i] + 1 for i in range(n)], [last[i] - arrivals[i] + 1 for i in range(n)],
                     timeline)


def __getattr__(name: str):
    """`batching.compare_policies` (notebook 03) lives with the benchmarks; imported on first use, not with the package."""
    if name == "compare_policies":
        from .bench.batching import compare_policies
        return compare_policies
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
