"""Checks for exercises/04_efficient_attention.ipynb: online softmax, tiled attention, a Triton loop.

Conventions the notebook states and these checks hold the student to:

- `online_softmax(x, block_size)` -> (probs, trace): probs = softmax(x), same dtype; trace = one [m, l]
  per block of block_size consecutive values (the last may be shorter), m the running max and l the
  running sum of exp(x - m) after that block; ValueError for block_size < 1 or an empty x.
- `tiled_attention(q, k, v, causal=True, block_m=16, block_n=16)`: single head, q [N, D], k, v [N_k, D],
  softmax(q k^T / sqrt(D)) v, causal bottom-right aligned (query i sees keys 0..N_k - N + i).
- `softmax_rows(x, block=16)` (given launcher) runs the student's Triton kernel: row softmax of [R, C].
"""
from __future__ import annotations

import math

import torch

from ...kernels.attention_ref import attention_reference
from ...kernels.softmax import online_softmax_reference
from ..protocol import Tensor
from . import CheckFailed, as_tensor, check, expect_raises, short


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
