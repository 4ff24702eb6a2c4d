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
"""
from __future__ import annotations

import random

from ...batching import continuous_schedule_step as reference_step
from ...batching import simulate
from ...batching import static_batch_utilization as reference_utilization
from . import CheckFailed, check, expect_close, expect_raises, short

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
