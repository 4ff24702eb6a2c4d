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
- Task 4, a decision from the student's own measurement: the notebook records the KV footprint of real caches of
  the bundled target after a prefill (`lab.record("kv_footprint", {"context", "budget_bytes", "caches": [...]})`,
  one row per cache: its dtype name, tokens held, cache bytes, measured and formula bytes per token, and the
  conversations the budget holds) and answers under DECISION_TITLE with `Decision: <cache>, <N> conversations`
  and the cache's measured bytes per token. The rule: DECISION_BUDGET bytes of KV memory, every conversation
  keeping DECISION_CONTEXT tokens; N = floor(budget / (measured bytes per token * context)), the right cache is
  the one with the largest N (caches tied at that N are all accepted), N is the first number of the Decision
  line, and the cited bytes per token must be within 1% of the record's. The checks recompute the answer from
  the record; they never run the model.
"""
from __future__ import annotations

import math
import random
import re

from ...config import get_preset
from ..answers import numbers
from ..protocol import Tensor
from . import CheckFailed, check, expect_cited, expect_close, expect_named, expect_raises, short, written_decision

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


# --- task 4: a decision from the student's own cache measurement --------------------------------

DECISION_TITLE = "Your decision (task 4)"
DECISION_CONTEXT = 1024                 # tokens each conversation keeps, as the notebook states
DECISION_BUDGET = 64 * MIB              # bytes of memory for the KV caches
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}   # a cache's name: its element size
CACHE_KEYS = ("cache", "tokens_held", "cache_bytes", "bytes_per_token_measured", "bytes_per_token_formula",
              "conversations")


def conversations(bytes_per_token: float) -> int:
    """How many conversations of DECISION_CONTEXT tokens fit in DECISION_BUDGET (exact quotients stay whole)."""
    return math.floor(DECISION_BUDGET / (bytes_per_token * DECISION_CONTEXT) + 1e-9)


def check_cache_row(i: int, r) -> None:
    """CheckFailed unless row i of the record has the keys, the numbers and the arithmetic the notebook states."""
    missing = [k for k in CACHE_KEYS if not isinstance(r, dict) or k not in r]
    if missing:
        raise CheckFailed(f"cache {i} of record 'kv_footprint' lacks {', '.join(missing)}")
    if r["cache"] not in ELEMENT_BYTES or not all(isinstance(r[k], (int, float)) and not isinstance(r[k], bool)
                                                  for k in CACHE_KEYS[1:]):
        raise CheckFailed(f"cache {i} of record 'kv_footprint' needs a dtype name ({', '.join(ELEMENT_BYTES)}) "
                          f"and numbers, got {short(r)}")
    if r["tokens_held"] < 1 or r["cache_bytes"] <= 0:
        raise CheckFailed(f"cache {r['cache']!r} holds {r['tokens_held']} tokens in {r['cache_bytes']} bytes")
    if not math.isclose(r["bytes_per_token_measured"], r["cache_bytes"] / r["tokens_held"], rel_tol=1e-9):
        raise CheckFailed(f"cache {r['cache']!r}: bytes_per_token_measured is not cache_bytes / tokens_held")
    cfg = get_preset("target")
    want = kv_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 1, 1, ELEMENT_BYTES[r["cache"]])
    if not math.isclose(r["bytes_per_token_formula"], want, rel_tol=1e-9):
        raise CheckFailed(f"cache {r['cache']!r}: bytes_per_token_formula is {r['bytes_per_token_formula']}, "
                          f"task 1's formula gives {want} for one token of the target")
    if not want <= r["bytes_per_token_measured"] <= 2 * want:
        raise CheckFailed(f"cache {r['cache']!r}: {r['bytes_per_token_measured']:.1f} bytes per token measured, "
                          f"against {want} of keys and values; count only the tokens the cache holds")
    if r["conversations"] != conversations(r["bytes_per_token_measured"]):
        raise CheckFailed(f"cache {r['cache']!r}: conversations is {r['conversations']}, the budget holds "
                          f"{conversations(r['bytes_per_token_measured'])} at its measured bytes per token")


def named_in(line: str, options: list[str]) -> list[str]:
    """The options a decision line names, each matched as a whole word."""
    return [o for o in options if re.search(rf"(?<![\w.]){re.escape(o.lower())}(?![\w.])", line.lower())]


def recorded_caches(sub) -> list[dict]:
    """The cache rows of the recorded footprint, checked for shape, the rule's numbers and their arithmetic."""
    data = sub.record("kv_footprint")
    caches = data.get("caches") if isinstance(data, dict) else None
    if not isinstance(caches, list) or len(caches) < 2:
        raise CheckFailed("record 'kv_footprint' must be a dict whose 'caches' lists at least two caches")
    if data.get("context") != DECISION_CONTEXT or data.get("budget_bytes") != DECISION_BUDGET:
        raise CheckFailed(f"record 'kv_footprint' must keep the rule's context {DECISION_CONTEXT} and budget "
                          f"{DECISION_BUDGET} bytes, got {data.get('context')!r} and {data.get('budget_bytes')!r}")
    for i, r in enumerate(caches):
        check_cache_row(i, r)
    if len({r["cache"] for r in caches}) != len(caches):
        raise CheckFailed("record 'kv_footprint' names a cache twice")
    return caches


@check("task 4: the recorded KV footprint has a row per cache, its bytes per token from its own columns",
       points=1, written=True)
def footprint_recorded(sub):
    """Every cache's bytes per token is its bytes over its tokens, at least task 1's formula, within the rule."""
    recorded_caches(sub)


@check("task 4: the decision names the cache that holds the most conversations in the budget, how many, "
       "and cites its measured bytes per token", points=2, written=True)
def footprint_decision(sub):
    """The Decision line names a cache with the most conversations and that number first; the answer cites its
    measured bytes per token."""
    caches = recorded_caches(sub)
    text, line = written_decision(sub, DECISION_TITLE, "a cache and a number of conversations")
    counts = {r["cache"]: conversations(r["bytes_per_token_measured"]) for r in caches}
    best = [r for r in caches if counts[r["cache"]] == max(counts.values())]
    names = [r["cache"] for r in caches]
    what = f"the most conversations of {DECISION_CONTEXT} tokens in {DECISION_BUDGET // MIB} MiB"
    named = named_in(line, names)
    want = next((r for r in best if r["cache"] in named), best[0])   # caches tied at the most are all right
    expect_named(line, want["cache"], names, what)
    written = numbers(line)
    if not written or written[0] != counts[want["cache"]]:
        got = f"its first number is {written[0]:g}" if written else "it has no number"
        raise CheckFailed(f"the Decision line must give the conversations before any other number, and {got}; "
                          f"your own record gives {counts[want['cache']]} for {want['cache']} (from its measured "
                          "bytes per token, not the formula's)")
    expect_cited(text, want["bytes_per_token_measured"], f"the {want['cache']} cache's measured bytes per token",
                 rel=0.01, abs_tol=0.5)


def wrong_answers(written) -> list[str]:
    """Answers a grader must mark down, built from the notebook's own record: every cache that holds fewer
    conversations, with its own numbers, the right cache with the formula's numbers (where they differ), and the right cache citing bytes
    per token half as large again."""
    caches = written.record("kv_footprint")["caches"]
    counts = {r["cache"]: conversations(r["bytes_per_token_measured"]) for r in caches}
    best = max(caches, key=lambda r: counts[r["cache"]])
    texts = [f"\n\nDecision: {r['cache']}, {counts[r['cache']]} conversations\n\nIt measured "
             f"{r['bytes_per_token_measured']:.1f} bytes per token." for r in caches
             if counts[r["cache"]] < counts[best["cache"]]]
    by_formula = conversations(best["bytes_per_token_formula"])
    if by_formula != counts[best["cache"]]:
        texts.append(f"\n\nDecision: {best['cache']}, {by_formula} conversations\n\nThe formula gives "
                     f"{best['bytes_per_token_formula']:.1f} bytes per token.")
    return texts + [f"\n\nDecision: {best['cache']}, {counts[best['cache']]} conversations\n\nIt measured "
                    f"{best['bytes_per_token_measured'] * 1.5:.1f} bytes per token."]
