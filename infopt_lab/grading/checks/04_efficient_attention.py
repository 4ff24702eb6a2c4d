"""Checks for exercises/04_efficient_attention.ipynb: online softmax, tiled attention, a Triton loop.

Conventions the notebook states and these checks hold the student to:

- `online_softmax(x, block_size)` -> (probs, trace): probs = softmax(x), same dtype; trace = one [m, l]
  per block of block_size consecutive values (the last may be shorter), m the running max and l the
  running sum of exp(x - m) after that block; ValueError for block_size < 1 or an empty x.
- `tiled_attention(q, k, v, causal=True, block_m=16, block_n=16)`: single head, q [N, D], k, v [N_k, D],
  softmax(q k^T / sqrt(D)) v, causal bottom-right aligned (query i sees keys 0..N_k - N + i).
- `softmax_rows(x, block=16)` (given launcher) runs the student's Triton kernel: row softmax of [R, C].
- Task 4, a decision from the student's own timings: the notebook records
  `lab.record("block_sizes", {"N", "D", "full": {"ms", "largest_bytes"}, "rows": [{"block", "ms",
  "largest_bytes", "vs_full"}, ...]})`: the median ms of tiled_attention with square tiles of each block size and
  of the full attention, the bytes of the largest intermediate each holds (a [block, block] float32 tile of
  scores, the [N, N] float32 matrix), and each block's time divided by the full attention's. The rule: among
  the contenders whose largest intermediate takes at most TILE_BUDGET bytes, the one with the least median
  time; any contender within NEAR_FASTEST (5%) of that time is accepted, since timings move between runs. The
  answer under DECISION_TITLE has a line `Decision: block <size>` (or `full attention`) and cites the
  choice's ms or its time / full as the table prints them. The checks read the record; they never re-time.
"""
from __future__ import annotations

import math

import torch

from ...kernels.attention_ref import attention_reference
from ...kernels.softmax import online_softmax_reference
from ..protocol import Tensor
from ..answers import cites
from . import CheckFailed, as_tensor, check, expect_named, expect_raises, short, written_decision


def _values(shape, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale + shift


def _check_online(sub, x: torch.Tensor, block: int) -> None:
    what = f"online_softmax({short(x.tolist())}, {block})"
    got = sub.call("online_softmax", Tensor(x.tolist()), block)
    if not isinstance(got, list) or len(got) != 2:
        raise CheckFailed(f"{what} returned {short(got)}, expected (probs, trace)")
    probs = as_tensor(got[0], what, tuple(x.shape))
    if not torch.allclose(probs, x.double().softmax(0), atol=1e-6, rtol=1e-5):
        raise CheckFailed(f"{what}: probabilities differ from softmax by {(probs - x.double().softmax(0)).abs().max():.2e}")
    want = online_softmax_reference(x, block)[1]
    trace = got[1]
    if not isinstance(trace, list) or len(trace) != len(want):
        raise CheckFailed(f"{what}: trace has {len(trace) if isinstance(trace, list) else short(trace)} entries, "
                          f"expected one per block ({len(want)})")
    for i, (entry, (m, l)) in enumerate(zip(trace, want)):
        if (not isinstance(entry, list) or len(entry) != 2
                or not math.isclose(entry[0], m, rel_tol=1e-6, abs_tol=1e-9)
                or not math.isclose(entry[1], l, rel_tol=1e-6)):
            raise CheckFailed(f"{what}: after block {i} the trace holds {short(entry)}, expected [{m:.6g}, {l:.6g}]")


@check("online_softmax on the notebook's row, block 2", points=2)
def online_notebook(sub):
    _check_online(sub, torch.tensor([2.0, 1.0, 3.0, 0.5, 5.0, -1.0, 4.0]), 2)


@check("online_softmax on hidden rows: large values, a falling max, blocks of 1 and larger than the row", points=3)
def online_hidden(sub):
    cases = [(_values((23,), 1, 3.0), 5), (_values((9,), 2, 1.0, 800.0), 4), (torch.arange(12.0, 0, -1), 3),
             (_values((6,), 3), 1), (_values((5,), 4), 16), (torch.tensor([-30.0, 40.0, -5.0]), 2)]
    for x, block in cases:
        _check_online(sub, x, block)


@check("online_softmax rejects block_size 0 and an empty tensor (ValueError)")
def online_rejects(sub):
    expect_raises(sub, "ValueError", "online_softmax", Tensor([1.0, 2.0]), 0)
    expect_raises(sub, "ValueError", "online_softmax", Tensor([]), 4)


def _check_tiled(sub, N: int, N_k: int, D: int, causal: bool, bm: int, bn: int, seed: int) -> None:
    q, k, v = _values((N, D), seed), _values((N_k, D), seed + 1), _values((N_k, D), seed + 2)
    want = attention_reference(q[None, None].double(), k[None, None].double(), v[None, None].double(), causal)[0, 0]
    what = f"tiled_attention(q [{N}, {D}], k/v [{N_k}, {D}], causal={causal}, block_m={bm}, block_n={bn})"
    got = as_tensor(sub.call("tiled_attention", Tensor(q.tolist()), Tensor(k.tolist()), Tensor(v.tolist()),
                              causal, bm, bn), what, (N, D))
    err = (got - want).abs().max().item()
    if err > 1e-4:
        raise CheckFailed(f"{what}: max error {err:.2e} against the reference")


@check("tiled_attention equals the reference on the notebook's shapes", points=2)
def tiled_notebook(sub):
    for N, N_k, causal in [(37, 37, True), (37, 37, False), (1, 50, True), (10, 50, True)]:
        _check_tiled(sub, N, N_k, 32, causal, 16, 16, seed=N + N_k)


@check("tiled_attention on hidden shapes and block sizes (ragged tiles, one query, blocks larger than N)", points=3)
def tiled_hidden(sub):
    for N, N_k, D, causal, bm, bn in [(45, 45, 16, True, 8, 32), (33, 70, 8, True, 16, 8), (1, 1, 4, True, 16, 16),
                                      (20, 20, 64, False, 64, 64), (7, 31, 16, False, 4, 5), (64, 64, 32, True, 32, 16)]:
        _check_tiled(sub, N, N_k, D, causal, bm, bn, seed=3 * N + N_k)


@check("the Triton kernel's softmax_rows equals softmax on the notebook's rows", points=2)
def triton_notebook(sub):
    x = _values((4, 37), 0, 5.0)
    x[1] += 500
    got = as_tensor(sub.call("softmax_rows", Tensor(x.tolist()), 16), "softmax_rows(x [4, 37], 16)", (4, 37))
    if (got - x.double().softmax(-1)).abs().max().item() > 1e-6:
        raise CheckFailed("softmax_rows(x [4, 37], 16) differs from torch.softmax")


@check("softmax_rows on hidden rows: one column, exact multiples of the block, huge and tiny values", points=3)
def triton_hidden(sub):
    cases = [(_values((3, 1), 5), 16), (_values((2, 64), 6, 10.0), 16), (_values((5, 50), 7, 2.0, -700.0), 8),
             (_values((1, 100), 8, 30.0), 32)]
    for x, block in cases:
        what = f"softmax_rows(x {list(x.shape)}, {block})"
        got = as_tensor(sub.call("softmax_rows", Tensor(x.tolist()), block), what, tuple(x.shape))
        err = (got - x.double().softmax(-1)).abs().max().item()
        if err > 1e-6:
            raise CheckFailed(f"{what}: max error {err:.2e} against torch.softmax")


# --- task 4: the block size, decided from the student's own timings -------------------------------

DECISION_TITLE = "Your decision (task 4)"
TILE_BUDGET = 64 * 1024          # bytes the largest intermediate may take, as the notebook states
NEAR_FASTEST = 0.05              # a contender within 5% of the least time is accepted
FLOAT32 = 4                      # bytes per value
FULL = "full attention"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def recorded_blocks(sub) -> tuple[dict, list[dict]]:
    """(full, rows) of the record, checked: times, bytes from the shapes, ratios from the record's own times."""
    data = sub.record("block_sizes")
    if not isinstance(data, dict) or not all(k in data for k in ("N", "D", "full", "rows")):
        raise CheckFailed("record 'block_sizes' must be a dict with N, D, full and rows")
    N, full, rows = data["N"], data["full"], data["rows"]
    if (not all(isinstance(n, int) and n >= 1 for n in (N, data["D"])) or not isinstance(full, dict)
            or not isinstance(rows, list)):
        raise CheckFailed(f"record 'block_sizes' needs ints N, D >= 1, a dict full and a list rows, got {short(data)}")
    if not _number(full.get("ms")) or full["ms"] <= 0 or full.get("largest_bytes") != N * N * FLOAT32:
        raise CheckFailed(f"full must hold its ms (> 0) and the bytes of the [N, N] float32 scores, "
                          f"{N * N * FLOAT32}; got {short(full)}")
    if len(rows) < 3 or not all(isinstance(r, dict) for r in rows) or len({r.get("block") for r in rows}) != len(rows):
        raise CheckFailed("rows must hold at least three different block sizes, one dict each")
    for r in rows:
        b = r.get("block")
        if not isinstance(b, int) or b < 1 or not all(_number(r.get(key)) for key in ("ms", "vs_full")) or r["ms"] <= 0:
            raise CheckFailed(f"a row needs an int block >= 1, its ms (> 0) and vs_full; got {short(r)}")
        if r.get("largest_bytes") != min(b, N) ** 2 * FLOAT32:
            raise CheckFailed(f"block {b}: largest_bytes is {short(r.get('largest_bytes'))}, but one [{b}, {b}] "
                              f"float32 tile of scores takes {min(b, N) ** 2 * FLOAT32} bytes")
        if not math.isclose(r["vs_full"], r["ms"] / full["ms"], rel_tol=1e-6):
            raise CheckFailed(f"block {b}: vs_full is {r['vs_full']:.4g}, but its ms / the full attention's ms "
                              f"is {r['ms'] / full['ms']:.4g}")
    if not any(r["largest_bytes"] <= TILE_BUDGET for r in rows):
        raise CheckFailed(f"no recorded block's tile fits {TILE_BUDGET} bytes: time the notebook's BLOCKS")
    return full, rows


def contenders(full: dict, rows: list[dict]) -> list[tuple[str, float, float]]:
    """(name as the table prints it, ms, time / full) of every contender, the full attention last."""
    return [*((f"block {r['block']}", r["ms"], r["vs_full"]) for r in rows), (FULL, full["ms"], 1.0)]


def accepted(full: dict, rows: list[dict]) -> tuple[list[tuple[str, float, float]], tuple[str, float, float]]:
    """(the contenders the rule accepts, the one with the least time) among those within TILE_BUDGET."""
    sizes = [*(r["largest_bytes"] for r in rows), full["largest_bytes"]]
    fits = [c for c, nbytes in zip(contenders(full, rows), sizes) if nbytes <= TILE_BUDGET]
    best = min(fits, key=lambda c: c[1])
    return [c for c in fits if c[1] <= best[1] * (1 + NEAR_FASTEST)], best


@check("task 4: the recorded block sizes hold times, tile bytes from the shapes and ratios to the full attention",
       points=1, written=True)
def blocks_recorded(sub):
    """At least three block sizes; bytes = 4 * block^2 and 4 * N^2; vs_full = ms / the full attention's ms."""
    recorded_blocks(sub)


@check("task 4: the decision names the block with the least recorded time whose tile fits 64 KiB, "
       "and cites its time", points=2, written=True)
def blocks_decision(sub):
    """The Decision line names an accepted contender; the answer cites its ms or its time / full."""
    full, rows = recorded_blocks(sub)
    text, line = written_decision(sub, DECISION_TITLE, "a block size")
    ok, best = accepted(full, rows)
    options = [c[0] for c in contenders(full, rows)]
    what = f"the least time within {TILE_BUDGET // 1024} KiB (or within {NEAR_FASTEST:.0%} of it)"
    for name, ms, ratio in ok:
        try:
            expect_named(line, name, options, what)
        except CheckFailed:
            continue
        if not (cites(text, ms, 0.02, 0.005) or (name != FULL and cites(text, ratio, 0.02, 0.005))):
            raise CheckFailed(f"the answer does not cite {name}'s time, {ms:.2f} ms or {ratio:.2f} of the full "
                              "attention's, from your own record")
        return
    expect_named(line, best[0], options, what)          # names none of the accepted: say which one the record gives


def wrong_answers(written) -> list[str]:
    """Answers a grader must mark down, built from the notebook's own record: every contender the rule does not
    accept, with its own numbers, and the least-time block with numbers half as large again."""
    data = written.record("block_sizes")
    ok, best = accepted(data["full"], data["rows"])
    texts = [f"\n\nDecision: {name}\n\nIt takes {ms:.2f} ms, {ratio:.2f} of the full attention's time."
             for name, ms, ratio in contenders(data["full"], data["rows"]) if name not in {c[0] for c in ok}]
    return texts + [f"\n\nDecision: {best[0]}\n\nIt takes {best[1] * 1.5:.2f} ms."]
