"""Checks for exercises/02_quantization.ipynb: absmax int8, group-wise int4, packing, a dequantizing linear.

Conventions the notebook states and these checks hold the student to (W is [N, K], G divides K):

- `absmax_int8(w)` -> (q, scale): one scale per row, scale = max|row| / 127, q = round(w / scale)
  clamped to -127..127; q is [N, K], scale is [N, 1]. An all-zero row must not divide by zero.
- `quantize_int4(w, group_size)` -> (q, scale, zero): per group of G consecutive columns,
  scale = (max(hi, 0) - min(lo, 0)) / 15, zero = round(-min(lo, 0) / scale), q = round(w / scale + zero)
  clamped to 0..15; q is [N, K], scale and zero are [N, K/G]. ValueError when G does not divide K.
- `pack_int4(q)` packs values 0..15 two per byte along the last dim, the even index in the low
  nibble: [a, b] -> a | b << 4; an odd length is padded with a zero nibble. `unpack_int4(packed, length)`
  inverts it exactly.
- `int4_linear(x, packed, scale, zero)` = x @ W_hat.T with W_hat = (q - zero) * scale per group.
- Task 5, a group size chosen from the student's own measurement: the notebook records
  `lab.record("group_sizes", {"model", "fp32_ppl", "rows": [{"group_size", "bytes_per_weight", "ppl",
  "ppl_delta_pct"}]})`, where bytes_per_weight = 0.5 + (scale bytes + zero bytes) / group_size and
  ppl_delta_pct = 100 (ppl / fp32_ppl - 1); the answer under DECISION_TITLE names, in a `Decision:` line,
  the group size with the lowest perplexity among those within BUDGET bytes per weight (`none` when none
  fits) and cites that row's ppl_delta_pct. Checked against the record, never re-measured.
"""
from __future__ import annotations

import torch

from ..protocol import Tensor
from . import CheckFailed, as_tensor, check, expect_cited, expect_named, expect_raises, short, written_decision

HIDDEN_SEEDS = (11, 12)


def rand(shape, seed: int, spread: float = 1.0) -> list:
    """A seeded random matrix as nested lists, with uneven row magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * (torch.rand(shape[0], 1, generator=g) * spread + 0.1)
    return w.tolist()


def parts(value, what: str, n: int) -> list:
    """A returned tuple of n items, or CheckFailed."""
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise CheckFailed(f"{what} returned {short(value)}, expected a tuple of {n} tensors")
    return list(value)


def ref_int4(w: torch.Tensor, g: int):
    """Reference asymmetric int4 of w [N, K]: (q, scale, zero) in float64."""
    groups = w.reshape(w.shape[0], -1, g)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(w.shape), scale, zero


# --- absmax int8 -------------------------------------------------------------------------------

def check_int8(sub, w: list) -> None:
    """Shapes, range, scale and the half-step round-trip bound of absmax_int8 on one matrix."""
    wt = torch.tensor(w, dtype=torch.float64)
    N, K = wt.shape
    q, scale = parts(sub.call("absmax_int8", Tensor(w)), "absmax_int8", 2)
    q, scale = as_tensor(q, "q", (N, K)), as_tensor(scale, "scale", (N, 1))
    expected = wt.abs().amax(1, keepdim=True) / 127
    rows = expected[:, 0] > 0                                      # an all-zero row may take any small scale
    if not torch.allclose(scale[rows], expected[rows], rtol=1e-5, atol=1e-12):
        raise CheckFailed(f"scale is not max|row| / 127 (first row: got {scale[0, 0]:.6g}, "
                          f"expected {expected[0, 0]:.6g})")
    if (q != q.round()).any() or q.abs().max() > 127:
        raise CheckFailed("q must hold whole numbers in -127..127")
    if not torch.isfinite(scale).all() or ((q * scale - wt).abs() > scale / 2 * (1 + 1e-4) + 1e-7).any():
        raise CheckFailed("q * scale is more than half a step from w somewhere: round, do not truncate")


@check("absmax_int8 on the notebook's matrix: shapes, range, round trip", points=2)
def int8_public(sub):
    """The 4x8 matrix the notebook prints."""
    check_int8(sub, rand((4, 8), 0))


@check("absmax_int8 on hidden matrices, an all-zero row included", points=2)
def int8_hidden(sub):
    """Bigger matrices, a zero row that must not produce NaN."""
    for seed in HIDDEN_SEEDS:
        w = rand((16, 64), seed, spread=5.0)
        w[3] = [0.0] * 64
        q, _ = parts(sub.call("absmax_int8", Tensor(w)), "absmax_int8", 2)
        if torch.isnan(as_tensor(q, "q")).any():
            raise CheckFailed("an all-zero row gave NaN: keep the scale above zero")
        check_int8(sub, w)


# --- group-wise int4 ---------------------------------------------------------------------------

def check_int4(sub, w: list, g: int) -> None:
    """quantize_int4 against the reference on one matrix and group size."""
    wt = torch.tensor(w, dtype=torch.float64)
    N, K = wt.shape
    out = parts(sub.call("quantize_int4", Tensor(w), g), f"quantize_int4(w, {g})", 3)
    q, scale, zero = as_tensor(out[0], "q", (N, K)), as_tensor(out[1], "scale", (N, K // g)), \
        as_tensor(out[2], "zero", (N, K // g))
    rq, rs, rz = ref_int4(wt, g)
    if not torch.allclose(scale, rs, rtol=1e-5, atol=1e-10):
        raise CheckFailed(f"scale with group_size={g} differs from (max - min) / 15 per group")
    if (q < 0).any() or (q > 15).any() or (q != q.round()).any():
        raise CheckFailed("q must hold whole numbers in 0..15")
    w_hat = ((q.reshape(N, -1, g) - zero[..., None]) * scale[..., None]).reshape(N, K)
    if ((w_hat - wt).abs().reshape(N, -1, g) > rs[..., None] / 2 * (1 + 1e-4) + 1e-7).any():
        raise CheckFailed(f"(q - zero) * scale is more than half a step from w with group_size={g}")
    if (zero != rz).sum() > zero.numel() // 50 or (q != rq).sum() > q.numel() // 50:
        raise CheckFailed("zero points or q differ from round(-min / scale) and round(w / scale + zero)")


@check("quantize_int4 on the notebook's matrix (group_size 4)", points=2)
def int4_public(sub):
    """The 4x8 matrix the notebook prints, two groups per row."""
    check_int4(sub, rand((4, 8), 0), 4)


@check("quantize_int4 on hidden matrices and group sizes", points=2)
def int4_hidden(sub):
    """Other shapes; per-row groups (G = K) included."""
    for seed, (shape, g) in zip(HIDDEN_SEEDS + (13,), [((8, 64), 32), ((6, 96), 16), ((5, 40), 40)]):
        check_int4(sub, rand(shape, seed, spread=3.0), g)


@check("quantize_int4 rejects a group size that does not divide the columns (ValueError)")
def int4_rejects(sub):
    """48 does not divide 64."""
    expect_raises(sub, "ValueError", "quantize_int4", Tensor(rand((2, 64), 1)), 48)


# --- packing -----------------------------------------------------------------------------------

@check("pack_int4 puts the even index in the low nibble; all 16 values round-trip", points=2)
def pack_all_values(sub):
    """Every value 0..15 in both nibbles, and the layout [a, b] -> a | b << 4."""
    got = as_tensor(sub.call("pack_int4", Tensor([1, 2], "int64")), "pack_int4([1, 2])")
    if got.tolist() != [33.0]:
        raise CheckFailed(f"pack_int4([1, 2]) returned {got.tolist()}, expected [33] (1 | 2 << 4)")
    values = [a for a in range(16) for _ in range(16)], [b for _ in range(16) for b in range(16)]
    pairs = [x for ab in zip(*values) for x in ab]                   # every (a, b) byte
    packed = as_tensor(sub.call("pack_int4", Tensor(pairs, "int64")), "pack_int4")
    if sorted(packed.flatten().tolist()) != list(range(256)):
        raise CheckFailed("packing every pair of values 0..15 must give every byte 0..255 once")
    back = as_tensor(sub.call("unpack_int4", Tensor(packed.long().tolist(), "int64"), len(pairs)), "unpack_int4")
    if back.tolist() != pairs:
        raise CheckFailed("unpack_int4(pack_int4(q)) is not q for the 256 pairs")


@check("pack_int4 / unpack_int4 round-trip odd lengths and 2-D input", points=2)
def pack_odd(sub):
    """Odd lengths pad one zero nibble; rows pack independently."""
    g = torch.Generator().manual_seed(5)
    for shape in [(1,), (7,), (3, 5), (2, 16)]:
        q = torch.randint(0, 16, shape, generator=g).tolist()
        packed = as_tensor(sub.call("pack_int4", Tensor(q, "int64")), f"pack_int4 of shape {shape}")
        if packed.shape[-1] != (shape[-1] + 1) // 2:
            raise CheckFailed(f"pack_int4 of shape {shape} gave {tuple(packed.shape)}, "
                              f"expected last dim {(shape[-1] + 1) // 2}")
        back = sub.call("unpack_int4", Tensor(packed.long().tolist(), "int64"), shape[-1])
        if as_tensor(back, "unpack_int4").tolist() != torch.tensor(q, dtype=torch.float64).tolist():
            raise CheckFailed(f"unpack_int4(pack_int4(q), {shape[-1]}) is not q for shape {shape}")


# --- dequantizing linear -----------------------------------------------------------------------

def check_linear(sub, seed: int, M: int, N: int, K: int, g: int) -> None:
    """int4_linear against x @ W_hat.T for one random layer."""
    w = torch.tensor(rand((N, K), seed), dtype=torch.float64)
    q, scale, zero = ref_int4(w, g)
    flat = q.long()
    if K % 2:
        raise ValueError("K must be even here")
    packed = (flat[:, 0::2] | (flat[:, 1::2] << 4)).tolist()
    x = torch.tensor(rand((M, K), seed + 100), dtype=torch.float64)
    expected = x @ (((q.reshape(N, -1, g) - zero[..., None]) * scale[..., None]).reshape(N, K)).T
    got = as_tensor(sub.call("int4_linear", Tensor(x.tolist()), Tensor(packed, "int64"), Tensor(scale.tolist()),
                             Tensor(zero.tolist())), "int4_linear", (M, N))
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item()):
        raise CheckFailed(f"int4_linear differs from x @ W_hat.T (max difference {(got - expected).abs().max():.3g})")


@check("int4_linear equals x @ dequantized W.T on the notebook's layer", points=2)
def linear_public(sub):
    """The layer the notebook builds: 8 inputs, 4 outputs, groups of 4."""
    check_linear(sub, 0, 3, 4, 8, 4)


@check("int4_linear on hidden layers and batch sizes", points=2)
def linear_hidden(sub):
    """One row (decode) and many rows, other group sizes."""
    check_linear(sub, 21, 1, 16, 64, 32)
    check_linear(sub, 22, 9, 12, 48, 16)


# --- task 5: a group size from the student's own measurement -------------------------------------

DECISION_TITLE = "Your decision (task 5)"
BUDGET = 0.6                                   # bytes per weight, as the notebook states
ELEMENT_BYTES = (1, 2, 4, 8)                   # what a scale or a zero point may be stored in


def recorded_rows(sub) -> list[dict]:
    """The recorded rows, checked against the formulas they must satisfy."""
    data = sub.record("group_sizes")
    rows = data.get("rows") if isinstance(data, dict) else None
    fp32 = data.get("fp32_ppl") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) < 2 or not isinstance(fp32, (int, float)) or not fp32 > 1:
        raise CheckFailed("record 'group_sizes' must hold fp32_ppl (> 1) and at least two rows")
    for r in rows:
        keys = ("group_size", "bytes_per_weight", "ppl", "ppl_delta_pct")
        if not isinstance(r, dict) or any(not isinstance(r.get(k), (int, float)) or isinstance(r.get(k), bool)
                                          for k in keys):
            raise CheckFailed(f"each row of record 'group_sizes' needs numbers {', '.join(keys)}; got {short(r)}")
        g = r["group_size"]
        overhead = (r["bytes_per_weight"] - 0.5) * g
        if g < 1 or not any(abs(overhead - a - b) < 1e-6 for a in ELEMENT_BYTES for b in ELEMENT_BYTES):
            raise CheckFailed(f"group size {g}: bytes_per_weight {r['bytes_per_weight']:.6g} is not 0.5 plus a "
                              "scale and a zero point's bytes per group")
        if abs(r["ppl_delta_pct"] - 100 * (r["ppl"] / fp32 - 1)) > 1e-6 * max(1.0, abs(r["ppl_delta_pct"])):
            raise CheckFailed(f"group size {g}: ppl_delta_pct {r['ppl_delta_pct']:.6g} is not "
                              f"100 * (ppl / fp32_ppl - 1) = {100 * (r['ppl'] / fp32 - 1):.6g}")
    if len({r["group_size"] for r in rows}) != len(rows):
        raise CheckFailed("record 'group_sizes' measures a group size twice")
    return rows


def reference_group(rows: list[dict]) -> dict | None:
    """The row with the lowest perplexity within the budget (the larger group of equal perplexities), or None."""
    fits = [r for r in rows if r["bytes_per_weight"] <= BUDGET]
    return min(fits, key=lambda r: (r["ppl"], -r["group_size"])) if fits else None


@check("task 5: the recorded group sizes follow the size and perplexity-change formulas", points=1, written=True)
def group_sizes_recorded(sub):
    """Each row's bytes per weight and perplexity change agree with its own group size and perplexity."""
    recorded_rows(sub)


@check("task 5: the decision names the group size with the lowest perplexity within 0.6 bytes per weight, "
       "and cites its perplexity change", points=2, written=True)
def group_size_decision(sub):
    """The Decision line names the reference group size (or none); the answer cites its ppl_delta_pct."""
    rows = recorded_rows(sub)
    text, line = written_decision(sub, DECISION_TITLE, "a group size")
    best = reference_group(rows)
    options = ["none", *(str(r["group_size"]) for r in rows)]
    expect_named(line, "none" if best is None else str(best["group_size"]), options,
                 f"the lowest perplexity within {BUDGET} bytes per weight")
    if best is not None:
        expect_cited(text, best["ppl_delta_pct"], f"group size {best['group_size']}'s perplexity change in percent",
                     rel=0.02, abs_tol=0.05)


def wrong_answers(written) -> list[str]:
    """Every other group size with its own perplexity change, and the right one citing another row's."""
    rows = written.record("group_sizes")["rows"]
    best = reference_group(rows)
    other = [r for r in rows if r is not best]
    return ([f"\n\nDecision: group size {r['group_size']}\n\nIts perplexity rises {r['ppl_delta_pct']:+.2f}%."
             for r in other]
            + [f"\n\nDecision: group size {best['group_size']}\n\nIts perplexity rises "
               f"{max(other, key=lambda r: r['ppl'])['ppl_delta_pct']:+.2f}%."])
