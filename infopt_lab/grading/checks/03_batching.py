"""Checks for exercises/03_batching.ipynb: static utilization, a continuous scheduler step, a block allocator.

Conventions the notebook states and these checks hold the student to:

- `static_batch_utilization(request_lengths, batch_size)` = sum(lengths) / sum over consecutive batches of
  max(batch) * len(batch); ValueError for batch_size < 1, an empty list, or a length < 1.
- `continuous_schedule_step(running, waiting, max_slots, token_budget)` -> (running, waiting, retired):
  running requests with remaining == 0 retire (order kept); each other running request costs 1 token;
  requests move from the front of waiting while len(running) < max_slots and prompt_len fits the budget
  left, stopping at the first that does not fit.
- `serve_continuous(prompt_lens, lengths, max_slots, token_budget)` (given) drives it.
- `BlockAllocator(num_blocks, block_size)` with allocate / append / free / num_free, driven through the
  given `replay_allocator(num_blocks, block_size, ops)`; a sequence holds ceil(tokens / block_size)
  blocks; errors: ValueError (allocate twice), RuntimeError (not enough free blocks, nothing changes),
  KeyError (unknown sequence).
- `preempting_schedule_step(running, waiting, max_slots, token_budget, kv_capacity)`: task 2's step; requests
  also carry "generated" and "preempted" (0 on arrival). After retiring, while sum(prompt_len + generated + 1)
  over running exceeds kv_capacity, the newest running request goes to the front of waiting as a new dict with
  prompt_len += generated, generated = 0, preempted += 1; admission also needs prompt_len + 1 within the KV
  left free. Compared field by field with `reference_preempting_step`.
- Task 5 decides from the student's own run: "kv_policies" records one seeded workload served by the given
  `serve_with_kv` with preemption and with reservation (`reference_reserving_step`) at TIGHT and LOOSE tokens
  of KV. Steps are counted, not timed, so the record check serves the recorded workload again with the
  reference steps and wants the same numbers. The `Decision:` line under DECISION_TITLE names the policy with
  fewer steps at TIGHT (equal steps: reservation, which recomputes nothing); the answer cites both step counts.
"""
from __future__ import annotations

import random

from ...batching import continuous_schedule_step as reference_step
from ...batching import simulate
from ...batching import static_batch_utilization as reference_utilization
from . import CheckFailed, check, expect_cited, expect_close, expect_named, expect_raises, short, written_decision

SEED_MIX = [10, 50, 15, 100, 20, 12, 80, 18]


# --- static utilization ----------------------------------------------------------------------

@check("static_batch_utilization gives the seed's 42.4% on its mix", points=2)
def seed_mix(sub):
    expect_close(sub.call("static_batch_utilization", SEED_MIX, 4), reference_utilization(SEED_MIX, 4),
                 f"static_batch_utilization({SEED_MIX}, 4)", rel=1e-9)


@check("static_batch_utilization on hidden mixes, a short last batch and batch size 1 included", points=2)
def hidden_mixes(sub):
    rng = random.Random(3)
    cases = [([5, 5, 5, 5], 2), ([1, 100], 2), ([7, 3, 9], 2), ([4], 8), ([3, 9, 27], 1)]
    cases += [([rng.randint(1, 300) for _ in range(rng.randint(1, 40))], rng.randint(1, 9)) for _ in range(6)]
    for lengths, b in cases:
        expect_close(sub.call("static_batch_utilization", lengths, b), reference_utilization(lengths, b),
                     f"static_batch_utilization({short(lengths)}, {b})", rel=1e-9)


@check("static_batch_utilization rejects an empty list, a zero length and batch size 0 (ValueError)")
def utilization_rejects(sub):
    for args in [([], 2), ([3, 0], 2), ([3, 4], 0), ([2, -1], 1)]:
        expect_raises(sub, "ValueError", "static_batch_utilization", *args)


# --- continuous scheduler step ---------------------------------------------------------------

def _ids(requests) -> list:
    if not isinstance(requests, list) or not all(isinstance(r, dict) and "id" in r for r in requests):
        raise CheckFailed(f"expected a list of request dicts, got {short(requests)}")
    return [r["id"] for r in requests]


def _step_case(sub, running, waiting, slots, budget) -> None:
    got = sub.call("continuous_schedule_step", running, waiting, slots, budget)
    if not isinstance(got, list) or len(got) != 3:
        raise CheckFailed(f"continuous_schedule_step returned {short(got)}, expected (running, waiting, retired)")
    want = reference_step(running, waiting, slots, budget)
    for label, g, w in zip(("running", "waiting", "retired"), got, want):
        if _ids(g) != _ids(w):
            raise CheckFailed(f"with running {_ids(running)}, waiting {_ids(waiting)}, max_slots={slots}, "
                              f"token_budget={budget}: {label} ids {_ids(g)}, expected {_ids(w)}")


def _request(i, rng) -> dict:
    return {"id": i, "prompt_len": rng.randint(1, 12), "remaining": rng.randint(0, 3)}


@check("continuous_schedule_step on the notebook's step", points=2)
def notebook_step(sub):
    running = [{"id": 0, "prompt_len": 5, "remaining": 0}, {"id": 1, "prompt_len": 5, "remaining": 3}]
    waiting = [{"id": 2, "prompt_len": 6, "remaining": 4}, {"id": 3, "prompt_len": 9, "remaining": 2},
               {"id": 4, "prompt_len": 1, "remaining": 1}]
    _step_case(sub, running, waiting, 4, 12)


@check("continuous_schedule_step on hidden queues: full slots, exhausted budget, no overtaking", points=3)
def hidden_steps(sub):
    rng = random.Random(11)
    cases = [([], [{"id": 0, "prompt_len": 4, "remaining": 2}], 1, 4),            # exactly fits the budget
             ([{"id": 0, "prompt_len": 1, "remaining": 1}], [{"id": 1, "prompt_len": 1, "remaining": 1}], 1, 9),
             ([{"id": 0, "prompt_len": 1, "remaining": 0}], [], 2, 5),           # retire only
             ([], [{"id": 0, "prompt_len": 9, "remaining": 1}, {"id": 1, "prompt_len": 1, "remaining": 1}], 4, 8)]
    for _ in range(12):
        n_run, n_wait = rng.randint(0, 6), rng.randint(0, 8)
        reqs = [_request(i, rng) for i in range(n_run + n_wait)]
        for r in reqs[n_run:]:
            r["remaining"] = max(1, r["remaining"])
        cases.append((reqs[:n_run], reqs[n_run:], rng.randint(1, 8), rng.randint(1, 30)))
    for running, waiting, slots, budget in cases:
        _step_case(sub, running, waiting, slots, budget)


@check("serve_continuous with your step finishes hidden workloads in the reference's steps", points=2)
def hidden_serving(sub):
    rng = random.Random(5)
    for _ in range(4):
        n = rng.randint(5, 30)
        lengths = [rng.choice([rng.randint(1, 10), rng.randint(40, 120)]) for _ in range(n)]
        slots = rng.randint(2, 6)
        got = sub.call("serve_continuous", [1] * n, lengths, slots, slots + 4)
        want = simulate(lengths, slots, "continuous").steps
        if not isinstance(got, list) or got[0] != want:
            raise CheckFailed(f"serving {n} requests with {slots} slots took {short(got)} steps, expected {want}")


# --- block allocator -------------------------------------------------------------------------

def _reference_replay(num_blocks, block_size, ops) -> list[tuple[str | int, int]]:
    """Per op: the error name or the number of blocks the sequence holds, and num_free."""
    free, tokens = num_blocks, {}
    out = []

    def blocks(num_tokens: int) -> int:
        return -(-num_tokens // block_size)
    for op, seq, *n in ops:
        if op == "allocate":
            if seq in tokens:
                out.append(("ValueError", free))
                continue
            if blocks(n[0]) > free:
                out.append(("RuntimeError", free))
                continue
            tokens[seq], free = n[0], free - blocks(n[0])
            out.append((blocks(n[0]), free))
        elif op == "append":
            if seq not in tokens:
                out.append(("KeyError", free))
                continue
            extra = blocks(tokens[seq] + 1) - blocks(tokens[seq])
            if extra > free:
                out.append(("RuntimeError", free))
                continue
            tokens[seq], free = tokens[seq] + 1, free - extra
            out.append((blocks(tokens[seq]), free))
        else:
            if seq not in tokens:
                out.append(("KeyError", free))
                continue
            free += blocks(tokens.pop(seq))
            out.append((None, free))
    return out


def _replay_case(sub, num_blocks, block_size, ops) -> None:
    got = sub.call("replay_allocator", num_blocks, block_size, ops)
    want = _reference_replay(num_blocks, block_size, ops)
    if not isinstance(got, list) or len(got) != len(ops):
        raise CheckFailed(f"replay_allocator returned {short(got)}, expected one [result, num_free] per op")
    live: dict[int, list[int]] = {}
    for op, g, (w_result, w_free) in zip(ops, got, want):
        where = f"after {op} (pool of {num_blocks} blocks of {block_size})"
        result, free = g
        if isinstance(w_result, str) or w_result is None:
            if result != w_result:
                raise CheckFailed(f"{where}: got {short(result)}, expected {w_result or 'no table (free)'}")
            if w_result is None:
                live.pop(op[1], None)
        else:
            if not isinstance(result, list) or len(result) != w_result:
                raise CheckFailed(f"{where}: block table {short(result)}, expected {w_result} blocks")
            old = live.get(op[1], [])
            if op[0] == "append" and result[:len(old)] != old:
                raise CheckFailed(f"{where}: append changed existing table entries {old} -> {result}")
            live[op[1]] = result
            owned = [b for t in live.values() for b in t]
            if len(set(owned)) != len(owned) or not all(isinstance(b, int) and 0 <= b < num_blocks for b in owned):
                raise CheckFailed(f"{where}: tables {live} share a block or use ids outside 0..{num_blocks - 1}")
        if free != w_free:
            raise CheckFailed(f"{where}: num_free is {short(free)}, expected {w_free}")


@check("BlockAllocator on the notebook's operations", points=2)
def notebook_allocator(sub):
    ops = [["allocate", 0, 6], ["allocate", 1, 9], ["append", 0], ["append", 0], ["append", 0],
           ["allocate", 2, 13], ["allocate", 2, 9], ["append", 1], ["free", 0], ["allocate", 2, 9], ["append", 9]]
    _replay_case(sub, 8, 4, ops)


@check("BlockAllocator on hidden operation sequences: growth, a full pool, reuse, errors", points=3)
def hidden_allocator(sub):
    rng = random.Random(17)
    _replay_case(sub, 3, 1, [["allocate", 5, 1], ["append", 5], ["append", 5], ["append", 5], ["free", 5],
                             ["free", 5], ["allocate", 5, 3], ["allocate", 5, 1]])
    for _ in range(6):
        num_blocks, block_size = rng.randint(2, 20), rng.choice([1, 2, 4, 16])
        ops, seqs = [], list(range(6))
        for _ in range(40):
            seq = rng.choice(seqs)
            kind = rng.choices(["allocate", "append", "free"], weights=[2, 6, 1])[0]
            ops.append([kind, seq, rng.randint(1, 3 * block_size)] if kind == "allocate" else [kind, seq])
        _replay_case(sub, num_blocks, block_size, ops)


# --- task 4: preemption under a KV limit ------------------------------------------------------

REQUEST_KEYS = ("id", "prompt_len", "remaining", "generated", "preempted")


def _req(i: int, p: int, g: int, r: int, x: int = 0) -> dict:
    """Request i with prompt_len p, generated g, remaining r, preempted x times."""
    return {"id": i, "prompt_len": p, "remaining": r, "generated": g, "preempted": x}


def _admit(running: list[dict], waiting: list[dict], max_slots: int, budget: int, room: int, cost) -> list[dict]:
    """Task 2's admission, a request also needing cost(request) of the `room` tokens of KV still free."""
    while waiting and len(running) < max_slots and waiting[0]["prompt_len"] <= budget and cost(waiting[0]) <= room:
        request = waiting.pop(0)
        budget, room = budget - request["prompt_len"], room - cost(request)
        running.append(request)
    return running


def reference_preempting_step(running: list[dict], waiting: list[dict], max_slots: int, token_budget: int,
                              kv_capacity: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Task 2's step under a KV limit: retire, preempt the newest while this step's KV does not fit, admit."""
    retired = [r for r in running if r["remaining"] == 0]
    running = [r for r in running if r["remaining"] > 0]
    held = sum(r["prompt_len"] + r["generated"] + 1 for r in running)      # KV once this step's token is in
    preempted = []
    while held > kv_capacity:
        victim = running.pop()
        held -= victim["prompt_len"] + victim["generated"] + 1
        preempted.insert(0, {**victim, "prompt_len": victim["prompt_len"] + victim["generated"], "generated": 0,
                             "preempted": victim["preempted"] + 1})
    waiting = preempted + list(waiting)
    running = _admit(running, waiting, max_slots, token_budget - len(running), kv_capacity - held,
                     lambda r: r["prompt_len"] + 1)
    return running, waiting, retired


def reference_reserving_step(running: list[dict], waiting: list[dict], max_slots: int, token_budget: int,
                             kv_capacity: int) -> tuple[list[dict], list[dict], list[dict]]:
    """The notebook's given reservation step: admit only when prompt + whole output fit what is not reserved."""
    retired = [r for r in running if r["remaining"] == 0]
    running = [r for r in running if r["remaining"] > 0]
    reserved = sum(r["prompt_len"] + r["generated"] + r["remaining"] for r in running)
    waiting = list(waiting)
    running = _admit(running, waiting, max_slots, token_budget - len(running), kv_capacity - reserved,
                     lambda r: r["prompt_len"] + r["remaining"])
    return running, waiting, retired


def reference_serve(step, prompt_lens, lengths, max_slots, token_budget, kv_capacity) -> tuple[int, int, int]:
    """What the notebook's `serve_with_kv` returns: (steps, preemptions, recomputed tokens)."""
    waiting = [_req(i, p, 0, n) for i, (p, n) in enumerate(zip(prompt_lens, lengths))]
    running, finished, steps, prefilled = [], [], 0, 0
    while True:
        before = {r["id"] for r in running}
        running, waiting, retired = step(running, waiting, max_slots, token_budget, kv_capacity)
        finished += retired
        if not running:
            if waiting:
                raise CheckFailed("the recorded workload cannot be served: a request never fits the KV or the budget")
            return steps, sum(r["preempted"] for r in finished), prefilled - sum(prompt_lens)
        prefilled += sum(r["prompt_len"] for r in running if r["id"] not in before)
        steps += 1
        for r in running:
            r["remaining"], r["generated"] = r["remaining"] - 1, r["generated"] + 1


def _kv_compare(args: tuple, got) -> None:
    """CheckFailed unless `got` lists the reference's requests, field by field, in each of the three lists."""
    running, waiting, slots, budget, capacity = args
    shown = [[(r["id"], r["prompt_len"], r["generated"], r["remaining"], r["preempted"]) for r in q] for q in args[:2]]
    where = (f"with running {shown[0]}, waiting {shown[1]} as (id, prompt_len, generated, remaining, preempted), "
             f"max_slots={slots}, token_budget={budget}, kv_capacity={capacity}")
    if not isinstance(got, list) or len(got) != 3:
        raise CheckFailed(f"preempting_schedule_step returned {short(got)}, expected (running, waiting, retired)")
    want = reference_preempting_step(running, waiting, slots, budget, capacity)
    for label, g, w in zip(("running", "waiting", "retired"), got, want):
        if _ids(g) != _ids(w):
            raise CheckFailed(f"{where}: {label} ids {_ids(g)}, expected {_ids(w)}")
        for r, expected in zip(g, w):
            key = next((k for k in REQUEST_KEYS if r.get(k) != expected[k]), None)
            if key:
                raise CheckFailed(f"{where}: request {r['id']} in {label} has {key} {short(r.get(key))}, "
                                  f"expected {expected[key]}")


NOTEBOOK_KV_STEP = ([_req(0, 6, 4, 0), _req(1, 5, 6, 3), _req(2, 8, 2, 5)], [_req(3, 4, 0, 2)], 4, 16, 20)


@check("preempting_schedule_step on the notebook's step", points=2)
def notebook_kv_step(sub):
    _kv_compare(NOTEBOOK_KV_STEP, sub.call("preempting_schedule_step", *NOTEBOOK_KV_STEP))


@check("preempting_schedule_step on hidden states: several preempted, KV exactly full, a lone request "
       "preempted, no overtaking", points=3)
def hidden_kv_steps(sub):
    rng = random.Random(29)
    cases = [([_req(0, 4, 2, 2)], [_req(1, 1, 0, 1)], 3, 9, 7),                               # exactly full
             ([_req(0, 5, 3, 1), _req(1, 4, 2, 2, 1), _req(2, 3, 1, 3)], [_req(3, 1, 0, 1)], 4, 20, 10),  # two go
             ([_req(0, 10, 5, 0), _req(1, 3, 1, 2)], [], 2, 9, 6),                             # retiring frees KV
             ([_req(0, 8, 3, 2)], [_req(1, 1, 0, 1)], 2, 20, 10),                               # a lone one goes
             ([], [_req(0, 9, 0, 1), _req(1, 1, 0, 1)], 4, 20, 9),                              # KV blocks the front
             ([_req(0, 2, 0, 3), _req(1, 2, 0, 3)], [_req(2, 1, 0, 1)], 3, 3, 5)]               # a preempted one too
    for k in range(16):                                     # odd k: KV short of this step's tokens; even: room
        n_run, n_wait = rng.randint(0, 6), rng.randint(0, 6)
        reqs = [_req(i, rng.randint(1, 12), 0 if i >= n_run else rng.randint(0, 9),
                     rng.randint(int(i >= n_run), 4), rng.choice([0, 0, 0, 1, 2])) for i in range(n_run + n_wait)]
        held = sum(r["prompt_len"] + r["generated"] + 1 for r in reqs[:n_run] if r["remaining"])
        room = rng.randint(-15, 0) if k % 2 else rng.randint(0, 40)
        cases.append((reqs[:n_run], reqs[n_run:], n_run + rng.randint(0, 3), rng.randint(4, 40), max(1, held + room)))
    for args, got in zip(cases, sub.call_many("preempting_schedule_step", cases)):
        _kv_compare(args, got)


# --- task 5: a decision from the student's own run ------------------------------------------------

DECISION_TITLE = "Your decision (task 5)"
TIGHT, LOOSE = 400, 2400                                    # tokens of KV, as the notebook states
POLICIES = {"preemption": reference_preempting_step, "reservation": reference_reserving_step}
ROW_KEYS = ("kv_capacity", "policy", "steps", "preemptions", "recomputed_tokens")


def recorded_rows(sub) -> tuple[dict, dict]:
    """The record and its rows by (kv_capacity, policy), checked for shape: TIGHT and LOOSE, both policies."""
    data = sub.record("kv_policies")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise CheckFailed("record 'kv_policies' must be a dict with prompt_lens, lengths, max_slots, "
                          "token_budget and rows")
    prompts, lengths = data.get("prompt_lens"), data.get("lengths")
    whole = [v for v in (prompts or []) + (lengths or []) + [data.get("max_slots"), data.get("token_budget")]
             if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096]
    if not (isinstance(prompts, list) and isinstance(lengths, list) and 1 <= len(prompts) == len(lengths) <= 256
            and len(whole) == 2 * len(prompts) + 2 and sum(lengths) <= 20000):
        raise CheckFailed("record 'kv_policies' needs prompt_lens and lengths (1 to 256 each, whole numbers in "
                          "1..4096, at most 20000 output tokens), max_slots and token_budget")
    rows = {}
    for r in data["rows"]:
        if not isinstance(r, dict) or any(k not in r for k in ROW_KEYS):
            raise CheckFailed(f"each row of record 'kv_policies' needs {', '.join(ROW_KEYS)}; got {short(r)}")
        rows[(r["kv_capacity"], r["policy"])] = r
    want = {(c, p) for c in (TIGHT, LOOSE) for p in POLICIES}
    if set(rows) != want or len(data["rows"]) != len(want):
        raise CheckFailed(f"record 'kv_policies' needs one row per policy ({', '.join(POLICIES)}) at each "
                          f"kv_capacity, {TIGHT} and {LOOSE}; got {sorted(rows, key=str)}")
    return data, rows


@check("task 5: the recorded steps, preemptions and recomputed tokens are what the workload gives", points=1,
       written=True)
def kv_policies_recorded(sub):
    """Each recorded row equals the reference scheduler's, serving the recorded workload again (no timing)."""
    data, rows = recorded_rows(sub)
    for (capacity, policy), row in sorted(rows.items(), key=str):
        want = reference_serve(POLICIES[policy], data["prompt_lens"], data["lengths"], data["max_slots"],
                               data["token_budget"], capacity)
        got = tuple(row[k] for k in ROW_KEYS[2:])
        if got != want:
            raise CheckFailed(f"at kv_capacity {capacity}, {policy}: the record says steps, preemptions, recomputed "
                              f"tokens = {got}; the reference steps give {want} on the recorded workload")


def reference_choice(rows: dict) -> str:
    """The policy with fewer steps at TIGHT; reservation on equal steps (it recomputes nothing)."""
    return "preemption" if rows[TIGHT, "preemption"]["steps"] < rows[TIGHT, "reservation"]["steps"] else "reservation"


@check(f"task 5: the decision names the policy with fewer steps at {TIGHT} tokens of KV, and cites both step "
       "counts", points=2, written=True)
def kv_policy_decision(sub):
    """The answer's Decision line names the reference choice, and the answer writes both policies' steps."""
    _, rows = recorded_rows(sub)
    text, line = written_decision(sub, DECISION_TITLE, "a policy")
    expect_named(line, reference_choice(rows), list(POLICIES), f"fewer steps at {TIGHT} tokens of KV")
    for policy in POLICIES:
        expect_cited(text, rows[(TIGHT, policy)]["steps"], f"{policy}'s steps at {TIGHT} tokens of KV",
                     rel=0.0, abs_tol=0.0)


def wrong_answers(written) -> list[str]:
    """Marked down, from the notebook's own record: the other policy; the right one with wrong step counts."""
    rows = {(r["kv_capacity"], r["policy"]): r for r in written.record("kv_policies")["rows"]}
    best, other = sorted(POLICIES, key=lambda p: p != reference_choice(rows))

    def answer(choice: str, capacity: int, scale: float = 1.0) -> str:
        steps = {p: round(rows[(capacity, p)]["steps"] * scale) for p in POLICIES}
        return (f"\n\nDecision: {choice}\n\nAt {TIGHT} tokens of KV, preemption takes {steps['preemption']} steps "
                f"and reservation {steps['reservation']}.")
    return [answer(other, TIGHT), answer(best, LOOSE), answer(best, TIGHT, 1.5)]
