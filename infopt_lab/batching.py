"""Batching policies on paper: the seed's utilization function, a step simulator; and the policies measured.

The simulator counts steps, not seconds: in every step each running request
produces one token. It shows what the scheduling policy alone costs; the
engine (`infopt_lab.engine`) then runs the same policies on the real model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral

from .workloads import code_prompts, poisson_arrivals, skewed_lengths  # noqa: F401  (re-exported: their old home)


def _check_lengths(request_lengths: Sequence[int], batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if isinstance(request_lengths, (str, bytes)) or not hasattr(request_lengths, "__len__"):
        raise TypeError(f"request_lengths must be a list of integers, got {type(request_lengths).__name__}")
    if len(request_lengths) == 0:
        raise ValueError("request_lengths is empty: give at least one request")
    bad = [n for n in request_lengths if isinstance(n, bool) or not isinstance(n, Integral) or n < 1]
    if bad:
        raise ValueError(f"request lengths must be integers >= 1, got {bad[:5]}")


def static_batch_utilization(request_lengths: Sequence[int], batch_size: int) -> float:
    """Useful share of the slot-steps static batching holds: sum(lengths) / sum(longest * batch members)."""
    _check_lengths(request_lengths, batch_size)
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
    _check_lengths(request_lengths, batch_size)
    if policy not in ("static", "continuous"):
        raise ValueError(f"policy must be 'static' or 'continuous', got {policy!r}")
    n = len(request_lengths)
    arrivals = list(arrivals) if arrivals is not None else [0] * n
    prompt_lens = list(prompt_lens) if prompt_lens is not None else [1] * n
    budget = token_budget if token_budget is not None else batch_size + max(prompt_lens)
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


def transformers_batched_generate(hf_model, prompt_ids: Sequence[list[int]], max_new_tokens: Sequence[int],
                                  batch_size: int, pad_id: int) -> tuple[list[list[int]], float]:
    """The baseline a student would write: transformers' padded batched greedy `generate`, batch by batch.

    Prompts are left-padded; each batch runs to its longest request and the extra tokens of
    shorter ones are cut off. Returns each request's tokens and the wall time in seconds.
    """
    import time

    import torch
    device = next(hf_model.parameters()).device
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompt_ids), batch_size):
        prompts, news = prompt_ids[i:i + batch_size], max_new_tokens[i:i + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news),
                                    do_sample=False, pad_token_id=pad_id)
        outputs += [row[width:width + m].tolist() for row, m in zip(out, news)]
    return outputs, time.perf_counter() - start


@dataclass
class PolicyRun:
    name: str
    throughput_tok_s: float
    wall_s: float
    token_ids: list[list[int]]
    stats: object = None                  # EngineStats for our engine, None for transformers
    e2e_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


def compare_policies(model, tok, prompts: Sequence[str], lengths: Sequence[int], max_batch_size: int = 8,
                     hf_model=None, arrival_s: Sequence[float] | None = None) -> dict[str, PolicyRun]:
    """Serve one workload with continuous and static batching (and transformers if given), in this run."""
    from .engine import Engine
    Engine(model, tok, max_batch_size=max_batch_size).generate(prompts[:2], max_new_tokens=4)   # warm-up
    runs = {}
    for policy in ("continuous", "static"):
        engine = Engine(model, tok, scheduler=policy, max_batch_size=max_batch_size)
        outs = engine.generate(prompts, max_new_tokens=list(lengths), arrival_s=arrival_s, stop_at_eos=False)
        runs[policy] = PolicyRun(policy, outs.stats.throughput_tok_s, outs.stats.wall_s,
                                 [o.token_ids for o in outs], outs.stats,
                                 [o.e2e_s for o in outs], [o.ttft_s for o in outs])
    if hf_model is not None:
        ids = [tok.encode(p) for p in prompts]
        token_ids, wall = transformers_batched_generate(hf_model, ids, lengths, max_batch_size, pad_id=0)
        runs["transformers"] = PolicyRun("transformers", sum(lengths) / wall, wall, token_ids)
    return runs


DEFAULT_PROMPT = "import os\n\n\ndef walk_files(root):\n    "   # the benchmarks' one prompt


def decode_throughput(model, tok, batch_size: int, new_tokens: int = 32, prompt: str = DEFAULT_PROMPT,
                      repeats: int = 1) -> float:
    """Decode tokens/s of the engine serving `batch_size` copies of a prompt at once (prefill excluded).

    Only steps in which every row decodes count: the rate at which a full batch makes tokens.
    """
    from .engine import Engine
    best = 0.0
    for _ in range(repeats):
        engine = Engine(model, tok, max_batch_size=batch_size, max_model_len=len(tok.encode(prompt)) + new_tokens)
        outs = engine.generate([prompt] * batch_size, max_new_tokens=new_tokens, stop_at_eos=False)
        steps = [r for r in outs.stats.timeline
                 if len(r.rows) == batch_size and all(kind == "decode" for _, _, kind in r.rows)]
        seconds = sum(r.end_s - r.start_s for r in steps)
        best = max(best, batch_size * len(steps) / seconds)
    return best
