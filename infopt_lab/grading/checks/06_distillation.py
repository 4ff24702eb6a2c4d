"""Checks for exercises/06_distillation.ipynb: the teacher's top-k cache, the distillation loss, the cache's size.

Conventions the notebook states and these checks hold the student to (N positions, V vocabulary entries):

- `top_k_cache(teacher_logits, k)` -> (values, indices), each [N, k]: the k largest logits of each row in
  descending order and their vocabulary ids as integers. Between equal logits any order of the ids is
  accepted: values must equal the reference's exactly, and each id must point at its value, once per row.
  ValueError when k < 1 or k > V.
- `distillation_loss(student_logits, targets, teacher_values, teacher_indices, weight, temperature)` =
  (1 - weight) * CE(student_logits, targets) + weight * T**2 * mean over rows of
  sum_j p_j * (log p_j - log s_j), with p = softmax(teacher_values / T) over the k cached entries and
  log s = log_softmax(student_logits / T) over the full vocabulary, gathered at teacher_indices: what
  `infopt_lab.distill.distillation_loss` computes given a top-k cache. A float or a 0-d tensor.
  ValueError for weight outside [0, 1] or temperature <= 0.
- `cache_bytes(n_tokens, k, value_bytes=2, index_bytes=4)` = n_tokens * k * (value_bytes + index_bytes).
- Task 4, a decision from the student's own measurement: the notebook records, for the bundled target as
  teacher on fixed validation windows, `lab.record("kept_mass", {"vocab_size": V, "positions": N,
  "full_bytes_per_position": 2 * V, "rows": [{"k", "mean_kept", "worst_kept", "bytes_per_position"}, ...]})`,
  k ascending, kept shares as fractions, bytes_per_position = cache_bytes(1, k). The answer under
  DECISION_TITLE names, on a line `Decision: k = ...`, the smallest recorded k whose mean kept share meets
  DECISION_FLOOR as the table prints it (the share rounded to 4 decimals, a percent to two), or `none` when no
  k does; it cites that k's mean kept share (a percent to one decimal or more, or a fraction to three) and its
  bytes per position (for `none`, the largest k's share). The checks recompute this from the record; they
  never run the model.
"""
from __future__ import annotations

import torch

from ...distill import distillation_loss
from ..answers import cites
from ..protocol import Tensor
from . import (CheckFailed, as_tensor, check, expect_cited, expect_close, expect_named, expect_raises, short,
               written_decision)

REL = 1e-4               # both compute in float32 (the reference casts); compared as float64 numbers
ABS = 1e-6


def parts(value, what: str) -> list:
    """A returned (values, indices) pair, or CheckFailed."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise CheckFailed(f"{what} returned {short(value)}, expected a tuple (values, indices)")
    return list(value)


def seeded(seed: int, *shapes: tuple[int, ...], scale: float = 1.0) -> list[torch.Tensor]:
    """Seeded float32 normal tensors, drawn in order from one generator."""
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(*shape, generator=g) for shape in shapes]


# --- the top-k cache ---------------------------------------------------------------------------

def check_top_k(sub, logits: torch.Tensor, k: int) -> None:
    """top_k_cache on one [N, V] float32 matrix: exact values, ids that point at them, each id once."""
    N, V = logits.shape
    what = f"top_k_cache(logits of shape {(N, V)}, k={k})"
    values, indices = parts(sub.call("top_k_cache", Tensor(logits.tolist()), k), what)
    got_v = as_tensor(values, f"{what}: values", (N, k))
    got_i = as_tensor(indices, f"{what}: indices", (N, k))
    if not all(isinstance(i, int) and not isinstance(i, bool) for row in indices for i in row):
        raise CheckFailed(f"{what}: indices must be integer vocabulary ids (an int64 tensor), got {short(indices)}")
    want = logits.double().topk(k, dim=-1).values
    if not torch.equal(got_v, want):
        row = int((got_v != want).any(-1).nonzero()[0])
        raise CheckFailed(f"{what}: values of row {row} are {short(got_v[row].tolist())}, expected the {k} "
                          f"largest logits in descending order, {short(want[row].tolist())}")
    if got_i.min() < 0 or got_i.max() >= V:
        raise CheckFailed(f"{what}: indices must be vocabulary ids in 0..{V - 1}")
    ids = got_i.long()
    if not torch.equal(logits.double().gather(-1, ids), got_v):
        raise CheckFailed(f"{what}: some indices do not point at their values in the teacher's row")
    if any(len(set(row)) != k for row in ids.tolist()):
        raise CheckFailed(f"{what}: a vocabulary id appears twice in one row")


@check("top_k_cache on the notebook's example (4 positions, V = 10, k = 3)", points=1)
def top_k_notebook(sub):
    """The seeded matrix the notebook prints."""
    (logits,) = seeded(0, (4, 10))
    check_top_k(sub, logits, 3)


@check("top_k_cache on hidden logits: ties, k = 1, k = V, one position", points=2)
def top_k_hidden(sub):
    """Random rows, rows with tied logits (any order of equal values is accepted), the extreme k."""
    logits, one = seeded(31, (7, 40), (1, 25), scale=3.0)
    ties = torch.tensor([[1.0, 3.0, 3.0, -2.0, 3.0, 0.5], [0.0] * 6, [2.0, -1.0, 2.0, -1.0, 0.0, 2.0]])
    for x, k in [(logits, 5), (logits, 1), (logits, 40), (one, 7), (ties, 2), (ties, 4), (ties, 6)]:
        check_top_k(sub, x, k)


@check("top_k_cache rejects k < 1 and k > V (ValueError)", points=1)
def top_k_rejects(sub):
    """k = 0, a negative k, and one more than the vocabulary (small tensors keep the reason line short)."""
    for k in (0, -3, 4):
        expect_raises(sub, "ValueError", "top_k_cache", Tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]), k)


# --- the distillation loss ---------------------------------------------------------------------

def check_loss(sub, student: torch.Tensor, targets: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
               weight: float, temperature: float, what: str) -> None:
    """distillation_loss against the package's reference in float64 for one case."""
    want = distillation_loss(student.double(), targets, values.double(), indices, weight, temperature).item()
    got = sub.call("distillation_loss", Tensor(student.tolist()), Tensor(targets.tolist(), "int64"),
                   Tensor(values.tolist()), Tensor(indices.tolist(), "int64"), weight, temperature)
    expect_close(got, want, f"distillation_loss({what}, weight={weight}, temperature={temperature})",
                 rel=REL, abs_tol=ABS)


def loss_case(seed: int, N: int, V: int, k: int, sharp: float = 2.0):
    """Seeded student logits [N, V], targets [N], and the top-k cache of a random teacher [N, k]."""
    student, teacher = seeded(seed, (N, V), (N, V))
    g = torch.Generator().manual_seed(seed + 1000)
    top = (sharp * teacher).topk(k, dim=-1)
    return student, torch.randint(0, V, (N,), generator=g), top.values, top.indices


@check("distillation_loss on the notebook's example (four weights and temperatures)", points=2)
def loss_notebook(sub):
    """The seeded tensors and settings of the notebook's self-check."""
    g = torch.Generator().manual_seed(1)
    student = torch.randn(6, 50, generator=g)
    teacher = 2 * torch.randn(6, 50, generator=g)
    targets = torch.randint(0, 50, (6,), generator=g)
    top = teacher.topk(8, dim=-1)
    for weight, temperature in [(0.0, 1.0), (0.5, 1.0), (0.9, 2.0), (1.0, 4.0)]:
        check_loss(sub, student, targets, top.values, top.indices, weight, temperature, "the notebook's example")


@check("distillation_loss at weight 0 is the plain cross-entropy; weight 1 is the KL term alone", points=2)
def loss_weight_ends(sub):
    """Both ends of the weight, at T = 1 and T = 3: cross-entropy on unsoftened logits, KL scaled by T**2."""
    student, targets, values, indices = loss_case(41, 9, 64, 16)
    ce = torch.nn.functional.cross_entropy(student.double(), targets).item()
    for temperature in (1.0, 3.0):
        got = sub.call("distillation_loss", Tensor(student.tolist()), Tensor(targets.tolist(), "int64"),
                       Tensor(values.tolist()), Tensor(indices.tolist(), "int64"), 0.0, temperature)
        expect_close(got, ce, f"distillation_loss(weight=0, temperature={temperature}) (the cross-entropy)",
                     rel=REL, abs_tol=ABS)
        check_loss(sub, student, targets, values, indices, 1.0, temperature, "hidden logits")


@check("distillation_loss on hidden cases: temperature 2, k = 1, k = V, a student equal to the teacher", points=2)
def loss_hidden(sub):
    """Other shapes and temperatures; a student that matches the teacher on its top k has no KL to pay."""
    for seed, (N, V, k), weight, temperature in [(51, (5, 30, 6), 0.7, 2.0), (52, (3, 20, 1), 0.9, 1.5),
                                                  (53, (4, 12, 12), 0.5, 0.5), (54, (1, 100, 10), 0.25, 2.0)]:
        student, targets, values, indices = loss_case(seed, N, V, k)
        check_loss(sub, student, targets, values, indices, weight, temperature, f"hidden logits {(N, V)}, k={k}")
    _, targets, values, indices = loss_case(55, 6, 40, 8)
    student = torch.full((6, 40), -1e4).scatter(-1, indices, values)     # the teacher on its top k, nothing else
    for temperature in (1.0, 2.0):
        check_loss(sub, student, targets, values, indices, 1.0, temperature, "a student equal to the teacher")


@check("distillation_loss rejects weight outside [0, 1] and temperature <= 0 (ValueError)", points=1)
def loss_rejects(sub):
    """Weights just outside the range, a zero and a negative temperature (on one small valid case)."""
    tensors = (Tensor([[1.0, 2.0, 0.5]]), Tensor([1], "int64"), Tensor([[3.0, 1.0]]), Tensor([[1, 0]], "int64"))
    for weight, temperature in [(-0.1, 1.0), (1.5, 1.0), (0.5, 0.0), (0.5, -2.0)]:
        expect_raises(sub, "ValueError", "distillation_loss", *tensors, weight, temperature)


# --- the cache's size --------------------------------------------------------------------------

@check("cache_bytes on hidden sizes, with and without the default widths", points=1)
def cache_size(sub):
    """n_tokens * k * (value_bytes + index_bytes), defaults 2 and 4."""
    for args, want in [((1_000_000, 32), 192_000_000), ((7, 3), 126), ((0, 16), 0), ((1000, 8, 4, 8), 96_000),
                       ((123_457, 64, 1, 2), 123_457 * 64 * 3)]:
        got = sub.call("cache_bytes", *args)
        if isinstance(got, bool) or not isinstance(got, int):
            raise CheckFailed(f"cache_bytes{args} returned {short(got)}, expected an int number of bytes")
        if got != want:
            raise CheckFailed(f"cache_bytes{args} returned {got}, expected {want}")


# --- task 4: a decision from the student's own measurement -----------------------------------

DECISION_TITLE = "Your decision (task 4)"
DECISION_FLOOR = 0.95                  # the least mean share of the teacher's probability the cache keeps
ROW_KEYS = ("k", "mean_kept", "worst_kept", "bytes_per_position")
SLACK = 1e-6                           # float sums of probabilities may pass 1, or a larger k's mean, by this


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def recorded_kept(sub) -> tuple[dict, list[dict]]:
    """The record 'kept_mass' and its rows, checked for shape and for agreeing with itself."""
    data = sub.record("kept_mass")
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) < 2:
        raise CheckFailed("record 'kept_mass' must be a dict whose 'rows' lists at least two values of k")
    V = data.get("vocab_size")
    if not isinstance(V, int) or isinstance(V, bool) or V < 2 or data.get("full_bytes_per_position") != 2 * V:
        raise CheckFailed("record 'kept_mass' needs vocab_size (an int) and full_bytes_per_position = 2 * vocab_size")
    if not isinstance(data.get("positions"), int) or data["positions"] < 1:
        raise CheckFailed("record 'kept_mass' needs positions, the number of positions measured")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or any(key not in r or not number(r[key]) for key in ROW_KEYS):
            raise CheckFailed(f"row {i} of record 'kept_mass' needs numbers for {', '.join(ROW_KEYS)}: {short(r)}")
        if not isinstance(r["k"], int) or not 1 <= r["k"] <= V:
            raise CheckFailed(f"row {i} of record 'kept_mass' has k = {r['k']!r}, not an int in 1..{V}")
        if not 0 <= r["worst_kept"] <= r["mean_kept"] + SLACK or r["mean_kept"] > 1 + SLACK:
            raise CheckFailed(f"row k={r['k']} of record 'kept_mass' needs 0 <= worst_kept <= mean_kept <= 1 "
                              f"(shares as fractions): {short(r)}")
        if r["bytes_per_position"] != r["k"] * 6:
            raise CheckFailed(f"row k={r['k']}: bytes_per_position is {r['bytes_per_position']}, but cache_bytes(1, "
                              f"{r['k']}) is {r['k'] * 6} (k fp16 values and k int32 ids)")
    for a, b in zip(rows, rows[1:]):
        if b["k"] <= a["k"]:
            raise CheckFailed("the rows of record 'kept_mass' must list k in ascending order, each once")
        if b["mean_kept"] < a["mean_kept"] - SLACK or b["worst_kept"] < a["worst_kept"] - SLACK:
            raise CheckFailed(f"top-{b['k']} keeps less than top-{a['k']} in record 'kept_mass'; the top k+1 "
                              "entries hold all the top k hold")
    return data, rows


def reference_k(rows: list[dict], floor: float = DECISION_FLOOR) -> dict | None:
    """The row of the smallest k whose mean kept share meets the floor as printed (4 decimals), or None."""
    return next((r for r in rows if round(r["mean_kept"], 4) >= floor), None)


@check("task 4: the recorded kept shares agree with themselves and with cache_bytes", points=1, written=True)
def kept_recorded(sub):
    """k ascending within the vocabulary, shares in [0, 1] that do not fall as k grows, 6 bytes per entry."""
    recorded_kept(sub)


def expect_share_cited(text: str, share: float, what: str) -> None:
    """CheckFailed unless the answer writes the share as a percent (one decimal or more) or a fraction (three)."""
    if not (cites(text, 100 * share, 0.0, 0.051) or cites(text, share, 0.0, 0.00051)):
        raise CheckFailed(f"the answer does not cite {what} ({100 * share:.2f}% from your own record, as a percent "
                          "to one decimal or more)")


@check("task 4: the decision names the smallest k that keeps 95% of the teacher's probability on the recorded "
       "windows, and cites its share and its bytes", points=2, written=True)
def kept_decision(sub):
    """The Decision line names the reference k (or none); the answer cites its mean share and bytes per position."""
    _, rows = recorded_kept(sub)
    text, line = written_decision(sub, DECISION_TITLE, "k")
    best = reference_k(rows)
    options = ["none", *(str(r["k"]) for r in rows)]
    floor = f"a mean kept share of at least {DECISION_FLOOR:.2%}"
    if best is None:
        expect_named(line, "none", options, f"{floor} (no recorded k reaches it)")
        expect_share_cited(text, rows[-1]["mean_kept"], f"the largest k's mean kept share (top-{rows[-1]['k']})")
        return
    expect_named(line, str(best["k"]), options, f"the smallest k with {floor}")
    expect_share_cited(text, best["mean_kept"], f"top-{best['k']}'s mean kept share")
    expect_cited(text, best["bytes_per_position"], f"top-{best['k']}'s bytes per position", rel=0.0, abs_tol=0.5)


def wrong_answers(written) -> list[str]:
    """Answers a grader must mark down, built from the notebook's own record: every other k with its own share
    and bytes, and the right k with a share nine tenths as large, or with twice its bytes."""
    rows = written.record("kept_mass")["rows"]
    best = reference_k(rows)

    def answer(name: str, share: float, nbytes: int) -> str:
        return f"\n\nDecision: k = {name}\n\nIt keeps {100 * share:.2f}% on average, {nbytes:,} bytes per position."
    wrong = [answer(str(r["k"]), r["mean_kept"], r["bytes_per_position"]) for r in rows if r is not best]
    if best is None:
        return wrong + [answer("none", rows[-1]["mean_kept"] * 0.9, rows[-1]["bytes_per_position"])]
    return wrong + ([answer("none", rows[-1]["mean_kept"], rows[-1]["bytes_per_position"]),
                     answer(str(best["k"]), best["mean_kept"] * 0.9, best["bytes_per_position"]),
                     answer(str(best["k"]), best["mean_kept"], 2 * best["bytes_per_position"])])
