"""Checks for exercises/01_cost_anatomy_kv_cache.ipynb: KV-cache memory, arithmetic intensity, cached attention.

Conventions the notebook states and these checks hold the student to:

- `kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch_size=1, bytes_per_element=2)`
  = 2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size * bytes_per_element;
  ValueError when any count is < 1 or bytes_per_element <= 0.
- `matmul_flops(m, k, n)` = 2 * m * k * n for [m, k] @ [k, n].
- `arithmetic_intensity(m, k, n, bytes_per_element=2)` = matmul_flops / ((m*k + k*n + m*n) * bytes_per_element);
  ValueError when a size is < 1 or bytes_per_element <= 0.
- `attention_step(q, k_new, v_new, k_cache, v_cache)`: q, k_new, v_new are [D]; the caches are [S, D];
  returns (out [D], k_cache [S+1, D], v_cache [S+1, D]) with the new key and value appended as the
  last row and out = softmax(k_cache @ q / sqrt(D)) @ v_cache over all S+1 positions.
- `decode_all(Q, K, V)` (given in the notebook, built on attention_step) equals causal attention over
  [T, D] inputs, starting from an empty cache.
"""
from __future__ import annotations

import math
import random

from ..protocol import Tensor
from . import CheckFailed, check, expect_close, expect_raises, short

GIB, MIB = 1024**3, 1024**2
TOL = 1e-4  # float32 attention against a float64 reference


def kv_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch_size=1, bytes_per_element=2):
    """Reference KV-cache size in bytes."""
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size * bytes_per_element


def intensity(m, k, n, b=2):
    """Reference arithmetic intensity of [m, k] @ [k, n]."""
    return 2 * m * k * n / ((m * k + k * n + m * n) * b)


# --- KV-cache memory -------------------------------------------------------------------------

@check("kv_cache_bytes gives 2 GiB for a 7B model at 4096 tokens, 512 MiB with 8 KV heads", points=2)
def kv_seven_b(sub):
    """The figures the notebook shows."""
    expect_close(sub.call("kv_cache_bytes", 32, 32, 128, 4096, 1, 2), 2 * GIB,
                 "kv_cache_bytes(32, 32, 128, 4096, 1, 2)", rel=1e-12)
    expect_close(sub.call("kv_cache_bytes", 32, 8, 128, 4096, 1, 2), 512 * MIB,
                 "kv_cache_bytes(32, 8, 128, 4096, 1, 2)", rel=1e-12)


@check("kv_cache_bytes on other shapes, batches and precisions (defaults included)", points=2)
def kv_hidden(sub):
    """Cases the notebook does not show: batches, 1 and 0.5 bytes, one token, the default arguments."""
    for args in [(80, 8, 128, 8192, 16, 2), (6, 2, 32, 1024, 1, 4), (1, 1, 1, 1, 1, 1), (28, 4, 128, 32768, 3, 1),
                 (40, 40, 128, 2048, 2, 0.5), (12, 12, 64, 1, 7, 4)]:
        expect_close(sub.call("kv_cache_bytes", *args), kv_bytes(*args), f"kv_cache_bytes{args}", rel=1e-12)
    expect_close(sub.call("kv_cache_bytes", 24, 4, 64, 100), kv_bytes(24, 4, 64, 100),
                 "kv_cache_bytes(24, 4, 64, 100) (default batch 1, 2 bytes)", rel=1e-12)
    expect_close(sub.call("kv_cache_bytes", 24, 4, 64, 100, 5), kv_bytes(24, 4, 64, 100, 5),
                 "kv_cache_bytes(24, 4, 64, 100, 5) (default 2 bytes)", rel=1e-12)


@check("kv_cache_bytes rejects non-positive lengths, batches, sizes and element sizes (ValueError)")
def kv_rejects(sub):
    """Zero or negative inputs are errors, not zero bytes."""
    for args in [(32, 8, 128, 0, 1, 2), (32, 8, 128, -5, 1, 2), (32, 8, 128, 4096, 0, 2),
                 (32, 8, 128, 4096, 1, 0), (32, 8, 128, 4096, 1, -2), (0, 8, 128, 4096, 1, 2),
                 (32, 0, 128, 4096, 1, 2)]:
        expect_raises(sub, "ValueError", "kv_cache_bytes", *args)


# --- arithmetic intensity ------------------------------------------------------------------------

@check("matmul_flops counts 2 FLOPs per multiply-add")
def flops(sub):
    """Square, matrix-vector and rectangular products."""
    for m, k, n in [(4096, 4096, 1), (4096, 4096, 4096), (3, 5, 7), (1, 1, 1), (11008, 4096, 64)]:
        expect_close(sub.call("matmul_flops", m, k, n), 2 * m * k * n, f"matmul_flops({m}, {k}, {n})", rel=1e-12)


@check("arithmetic_intensity of the notebook's matrix-vector and matrix-matrix products")
def intensity_public(sub):
    """4096 x 4096 weights times one vector and times 4096 vectors, 2 bytes per element."""
    for m, k, n in [(4096, 4096, 1), (4096, 4096, 4096)]:
        expect_close(sub.call("arithmetic_intensity", m, k, n, 2), intensity(m, k, n),
                     f"arithmetic_intensity({m}, {k}, {n}, 2)", rel=1e-9)


@check("arithmetic_intensity on rectangular products and other precisions", points=2)
def intensity_hidden(sub):
    """Shapes and byte sizes the notebook does not show, the default included."""
    for args in [(11008, 4096, 8, 2), (4096, 4096, 1, 4), (256, 704, 32, 4), (1, 1, 1, 1), (4096, 14336, 512, 1),
                 (7, 3, 2, 0.5)]:
        expect_close(sub.call("arithmetic_intensity", *args), intensity(*args),
                     f"arithmetic_intensity{args}", rel=1e-9)
    expect_close(sub.call("arithmetic_intensity", 512, 512, 16), intensity(512, 512, 16),
                 "arithmetic_intensity(512, 512, 16) (default 2 bytes)", rel=1e-9)


@check("arithmetic_intensity rejects non-positive sizes and element sizes (ValueError)")
def intensity_rejects(sub):
    """A product with no rows, or elements of no size, is an error."""
    for args in [(0, 4096, 1, 2), (4096, -1, 1, 2), (4096, 4096, 0, 2), (4096, 4096, 1, 0)]:
        expect_raises(sub, "ValueError", "arithmetic_intensity", *args)


# --- attention with a KV cache ---------------------------------------------------------------------

def attend(q, keys, values):
    """Reference: softmax(keys @ q / sqrt(D)) @ values, in float64."""
    scale = 1 / math.sqrt(len(q))
    scores = [sum(a * b for a, b in zip(q, k)) * scale for k in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [sum(w * v[d] for w, v in zip(weights, values)) / total for d in range(len(q))]


def causal(Q, K, V):
    """Reference: row t attends to rows 0..t."""
    return [attend(Q[t], K[:t + 1], V[:t + 1]) for t in range(len(Q))]


def grid(rng, rows, cols, scale=1.0):
    """Random values on a 1/64 grid (exact in float32)."""
    return [[rng.randint(-128, 128) / 64 * scale for _ in range(cols)] for _ in range(rows)]


def expect_matrix(got, expected, what: str) -> None:
    """CheckFailed unless `got` is a list (of lists) of numbers within TOL of `expected`."""
    flat_e = expected if not isinstance(expected[0], list) else [x for row in expected for x in row]
    if not isinstance(got, list):
        raise CheckFailed(f"{what} returned {short(got)}, expected a tensor")
    flat_g = got if not got or not isinstance(got[0], list) else [x for row in got for x in row]
    rows = len(expected) if isinstance(expected[0], list) else None
    if (rows is not None and len(got) != rows) or len(flat_g) != len(flat_e):
        raise CheckFailed(f"{what} returned {len(flat_g)} values, expected shape "
                          f"{[rows, len(expected[0])] if rows is not None else [len(expected)]}")
    for i, (g, e) in enumerate(zip(flat_g, flat_e)):
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isclose(g, e, rel_tol=TOL, abs_tol=TOL):
            raise CheckFailed(f"{what}: element {i} is {short(g)}, expected {e:.6g}")


def step_result(sub, q, k, v, kc, vc):
    """Call attention_step and split its result into (out, k_cache, v_cache)."""
    result = sub.call("attention_step", Tensor(q), Tensor(k), Tensor(v), Tensor(kc), Tensor(vc))
    if not isinstance(result, list) or len(result) != 3:
        raise CheckFailed(f"attention_step returned {short(result)}, expected (out, k_cache, v_cache)")
    return result


@check("attention_step matches attention over the whole cache", points=2)
def step_output(sub):
    """One step after cached positions: the notebook's size, then others (D odd, one cached row)."""
    rng = random.Random(1)
    for S, D in [(5, 8), (1, 4), (9, 3), (16, 64)]:
        kc, vc = grid(rng, S, D), grid(rng, S, D)
        q, k, v = grid(rng, 1, D)[0], grid(rng, 1, D)[0], grid(rng, 1, D)[0]
        out, _, _ = step_result(sub, q, k, v, kc, vc)
        expect_matrix(out, attend(q, kc + [k], vc + [v]), f"attention_step output (S={S}, D={D})")


@check("attention_step appends the new key and value as the cache's last row")
def step_appends(sub):
    """The returned caches are the old rows, unchanged, then the new one."""
    rng = random.Random(2)
    for S, D in [(3, 4), (1, 6)]:
        kc, vc = grid(rng, S, D), grid(rng, S, D)
        q, k, v = grid(rng, 1, D)[0], grid(rng, 1, D)[0], grid(rng, 1, D)[0]
        _, k_out, v_out = step_result(sub, q, k, v, kc, vc)
        expect_matrix(k_out, kc + [k], f"attention_step's k_cache (S={S}, D={D})")
        expect_matrix(v_out, vc + [v], f"attention_step's v_cache (S={S}, D={D})")


@check("decoding token by token with the cache equals causal recomputation", points=2)
def decode_matches_recompute(sub):
    """decode_all over sequences the notebook does not show, from one token to many."""
    rng = random.Random(3)
    for T, D in [(1, 4), (2, 2), (7, 5), (24, 16)]:
        Q, K, V = grid(rng, T, D), grid(rng, T, D), grid(rng, T, D)
        got = sub.call("decode_all", Tensor(Q), Tensor(K), Tensor(V))
        expect_matrix(got, causal(Q, K, V), f"decode_all on T={T}, D={D}")


@check("attention_step stays finite for large scores (a stable softmax)")
def step_stable(sub):
    """Scores in the thousands overflow a naive exp; subtracting the maximum (as torch.softmax does) does not."""
    rng = random.Random(4)
    D = 4
    kc, vc = grid(rng, 6, D, scale=40.0), grid(rng, 6, D)
    q, k, v = [60.0, -60.0, 60.0, 60.0], grid(rng, 1, D, scale=40.0)[0], grid(rng, 1, D)[0]
    out, _, _ = step_result(sub, q, k, v, kc, vc)
    expect_matrix(out, attend(q, kc + [k], vc + [v]), "attention_step output with large scores")
