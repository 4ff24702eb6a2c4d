"""Checks for exercises/00_orientation.ipynb: memory footprint, request latency, decoding.

Conventions the notebook states and these checks hold the student to:

- `weight_memory_gb(num_params, bytes_per_param)` = num_params * bytes_per_param / 1024**3
  (the course's "GB"); ValueError for num_params < 0 or bytes_per_param <= 0.
- `memory_reduction(from_bytes, to_bytes)` = from_bytes / to_bytes; ValueError if either is <= 0.
- For a request started at `start` whose tokens arrived at `token_times` (seconds, sorted):
  TTFT = token_times[0] - start;
  TPOT = (token_times[-1] - token_times[0]) / (n - 1), and 0.0 for a single token;
  tokens/s = n / (token_times[-1] - start);
  all three raise ValueError for an empty `token_times`.
- `greedy(logits)` = index of the largest logit, the lowest index among ties, as an int.
- `sample_top_k(logits, k, seed)` keeps the k largest logits (all of them when k >= vocabulary
  size), samples from their softmax with a `torch.Generator` seeded with `seed`, returns an int.
  The same seed gives the same token; any sampling procedure with those properties passes.
- Task 4, a decision from the student's own request: the notebook times one request on the bundled target
  and records it (`lab.record("request_latency", {"prompt_tokens", "new_tokens", "token_times_s", "ttft_s",
  "tpot_s", "longest_reply_tokens"})`, token times in seconds from a start of 0.0; TTFT and TPOT as above,
  computed with the student's task 2 functions). The rule: the first token must be at least
  FIRST_TOKEN_SHARE = 0.5 of the wait TTFT + (n - 1) * TPOT, so the longest such reply is
  n* = floor(TTFT / TPOT) + 1 tokens. The answer under DECISION_TITLE has a line `Decision: <n> tokens` with
  n within SLACK_TOKENS = 1 of n* (timings move between runs, and a TTFT / TPOT near a whole number rounds
  either way), and cites the record's TTFT and TPOT in ms (to 1%, or 0.05 ms). The checks recompute n* from
  the record; they never time anything.
"""
from __future__ import annotations

import math
import random
import re

from ..protocol import Tensor
from . import CheckFailed, as_int, check, expect_cited, expect_close, expect_raises, short, written_decision

GIB = 1024**3
SEED_PARAMS = 7_000_000_000
PUBLIC_START, PUBLIC_TIMES = 0.0, [0.25, 0.30, 0.35, 0.40, 0.45]  # the request the notebook shows
SAMPLE_DRAWS = 2000  # seeds per distribution check
MAX_TV = 0.06  # total-variation bound; a correct sampler exceeds it with probability < 1e-6


# --- memory footprint --------------------------------------------------------------------------

@check("weight_memory_gb reproduces the reference table (26.08 / 13.04 / 6.52 / 3.26 GB)", points=2)
def seed_table(sub):
    """The reference figures for a 7B model, to two decimals."""
    for bytes_per_param, shown in [(4, 26.08), (2, 13.04), (1, 6.52), (0.5, 3.26)]:
        got = sub.call("weight_memory_gb", SEED_PARAMS, bytes_per_param)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or round(got, 2) != shown:
            raise CheckFailed(f"weight_memory_gb(7e9, {bytes_per_param}) returned {got!r}, expected {shown} "
                              "when rounded to 2 decimals")


@check("weight_memory_gb on other models, zero parameters included", points=2)
def other_models(sub):
    """Cases the notebook does not show, compared to the exact formula."""
    for n, b in [(0, 4), (1_100_000_000, 2), (70_000_000_000, 0.5), (124_439_808, 4), (3, 1)]:
        expect_close(sub.call("weight_memory_gb", n, b), n * b / GIB, f"weight_memory_gb({n}, {b})", rel=1e-9)


@check("weight_memory_gb rejects a negative count and non-positive bytes (ValueError)")
def memory_rejects(sub):
    """The errors the notebook asks for."""
    expect_raises(sub, "ValueError", "weight_memory_gb", -1, 4)
    expect_raises(sub, "ValueError", "weight_memory_gb", 1000, 0)


@check("memory_reduction gives the reference 8.0x and other ratios")
def reduction(sub):
    """FP32 -> INT4 is 8.0x; other pairs catch a hard-coded 8.0."""
    for a, b in [(4, 0.5), (2, 1), (4, 1), (2, 0.5), (1, 1)]:
        expect_close(sub.call("memory_reduction", a, b), a / b, f"memory_reduction({a}, {b})", rel=1e-9)


# --- request latency ---------------------------------------------------------------------------

def ttft(start, times):
    """Reference time to first token."""
    return times[0] - start


def tpot(start, times):
    """Reference time per output token: 0.0 for one token."""
    return 0.0 if len(times) == 1 else (times[-1] - times[0]) / (len(times) - 1)


def tps(start, times):
    """Reference tokens per second over the whole request."""
    return len(times) / (times[-1] - start)


HIDDEN_REQUESTS = [(100.0, [100.8, 101.0, 101.5, 103.0]), (2.5, [2.75]), (0.0, [0.1, 0.3]),
                   (10.0, [10.5, 10.5, 10.9, 11.0, 11.6, 12.0])]


def expect_metric(sub, name: str, reference, requests) -> None:
    """Compare one metric function to its reference on each (start, token_times)."""
    for start, times in requests:
        expect_close(sub.call(name, start, times), reference(start, times),
                     f"{name}({start}, {times})", rel=1e-9, abs_tol=1e-12)


@check("time_to_first_token on the notebook's request")
def ttft_public(sub):
    """The public request: TTFT 0.25 s."""
    expect_metric(sub, "time_to_first_token", ttft, [(PUBLIC_START, PUBLIC_TIMES)])


@check("time_to_first_token with a late start and a single token")
def ttft_hidden(sub):
    """Other starts, uneven gaps, one token."""
    expect_metric(sub, "time_to_first_token", ttft, HIDDEN_REQUESTS)


@check("time_per_output_token on the notebook's request")
def tpot_public(sub):
    """The public request: TPOT 0.05 s."""
    expect_metric(sub, "time_per_output_token", tpot, [(PUBLIC_START, PUBLIC_TIMES)])


@check("time_per_output_token with uneven gaps and a single token (0.0)")
def tpot_hidden(sub):
    """Uneven gaps, repeated timestamps, and 0.0 for one token."""
    expect_metric(sub, "time_per_output_token", tpot, HIDDEN_REQUESTS)


@check("tokens_per_second on the notebook's request")
def tps_public(sub):
    """The public request: 5 tokens over 0.45 s."""
    expect_metric(sub, "tokens_per_second", tps, [(PUBLIC_START, PUBLIC_TIMES)])


@check("tokens_per_second with one token and a non-zero start")
def tps_hidden(sub):
    """One token, non-zero starts: the whole request counts, prefill included."""
    expect_metric(sub, "tokens_per_second", tps, HIDDEN_REQUESTS)


@check("the three metrics reject a request with no tokens (ValueError)")
def metrics_reject_empty(sub):
    """An empty token list is a ValueError for all three metrics."""
    for name in ["time_to_first_token", "time_per_output_token", "tokens_per_second"]:
        expect_raises(sub, "ValueError", name, 0.0, [])


# --- decoding ----------------------------------------------------------------------------------

PUBLIC_LOGITS = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0]  # the vector the notebook shows


def hidden_logits(count: int, size: int, seed: int) -> list[list[float]]:
    """Distinct logits on a 1/8 grid, exact in float32, so the argmax is unambiguous."""
    rng = random.Random(seed)
    return [[v / 8 for v in rng.sample(range(-80, 80), size)] for _ in range(count)]


def sampling_logits(count: int, size: int, seed: int) -> list[list[float]]:
    """Distinct logits within 2.0 of each other, so every kept token is drawn often."""
    rng = random.Random(seed)
    return [[v / 8 for v in rng.sample(range(-8, 8), size)] for _ in range(count)]


def argmax(values: list[float]) -> int:
    """Index of the largest value, the lowest one among ties."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def top_k_probs(logits: list[float], k: int) -> dict[int, float]:
    """The softmax over the k largest logits (all when k >= len), as {token: probability}."""
    keep = sorted(range(len(logits)), key=lambda i: -logits[i])[: min(k, len(logits))]
    weights = {i: math.exp(logits[i] - max(logits)) for i in keep}
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}


def draw_tokens(sub, logits: list[float], k: int, seeds) -> list[int]:
    """The submission's samples for each seed, checked to be ints."""
    values = sub.call_many("sample_top_k", [(Tensor(logits), k, s) for s in seeds])
    return [as_int(v, f"sample_top_k(logits, {k}, seed)") for v in values]


def expect_distribution(sub, logits: list[float], k: int) -> None:
    """CheckFailed unless the token frequencies over many seeds match the top-k softmax."""
    probs = top_k_probs(logits, k)
    tokens = draw_tokens(sub, logits, k, range(SAMPLE_DRAWS))
    outside = sorted(set(tokens) - set(probs))
    if outside:
        raise CheckFailed(f"sample_top_k(logits, k={k}) returned tokens {outside[:5]} outside the top {k}")
    freq = {i: tokens.count(i) / len(tokens) for i in probs}
    tv = 0.5 * sum(abs(freq[i] - p) for i, p in probs.items())
    if tv > MAX_TV:
        shown = ", ".join(f"{i}: {freq[i]:.2f} vs {p:.2f}" for i, p in sorted(probs.items()))
        raise CheckFailed(f"sample_top_k(logits, k={k}) over {SAMPLE_DRAWS} seeds drew frequencies far from "
                          f"the top-{k} softmax ({shown})")


@check("greedy picks the largest logit")
def greedy_argmax(sub):
    """The public logits, then vectors the notebook does not show."""
    for logits in [PUBLIC_LOGITS] + hidden_logits(5, 12, seed=0):
        got = as_int(sub.call("greedy", Tensor(logits)), "greedy(logits)")
        if got != argmax(logits):
            raise CheckFailed(f"greedy({logits}) returned {got}, expected {argmax(logits)}")


@check("greedy breaks ties by the lowest index")
def greedy_ties(sub):
    """Ties go to the lowest index, as torch.argmax does."""
    for logits in [[1.0, 3.0, 3.0, 0.0], [5.0, 5.0], [-2.0, 0.5, -1.0, 0.5, 0.5]]:
        got = as_int(sub.call("greedy", Tensor(logits)), "greedy(logits)")
        if got != argmax(logits):
            raise CheckFailed(f"greedy({logits}) returned {got}, expected {argmax(logits)} (the first of the ties)")


@check("sample_top_k stays inside the top k and repeats for a seed")
def top_k_inside(sub):
    """Tokens within the top k; a seed repeats its token; different seeds differ."""
    for logits, k in [(PUBLIC_LOGITS, 3)] + [(lg, 4) for lg in sampling_logits(3, 10, seed=1)]:
        allowed = set(top_k_probs(logits, k))
        tokens = draw_tokens(sub, logits, k, range(50))
        again = draw_tokens(sub, logits, k, range(50))
        if not set(tokens) <= allowed:
            raise CheckFailed(f"sample_top_k({logits}, {k}, seed) returned {sorted(set(tokens) - allowed)}, "
                              f"outside the top {k} {sorted(allowed)}")
        if tokens != again:
            raise CheckFailed("sample_top_k gave different tokens for the same seed; seed a torch.Generator")
        if len(set(tokens)) < 2:
            raise CheckFailed(f"sample_top_k({logits}, {k}, seed) returned {tokens[0]} for 50 seeds; it should sample")


@check("sample_top_k with k=1 is greedy")
def top_k_one(sub):
    """k=1 keeps only the argmax, whatever the seed."""
    for logits in [PUBLIC_LOGITS] + hidden_logits(3, 9, seed=2):
        tokens = set(draw_tokens(sub, logits, 1, range(10)))
        if tokens != {argmax(logits)}:
            raise CheckFailed(f"sample_top_k({logits}, 1, seed) returned {sorted(tokens)}, expected only "
                              f"{argmax(logits)}")


@check("sample_top_k with k at or above the vocabulary size samples the whole vocabulary")
def top_k_whole_vocab(sub):
    """k equal to and larger than the vocabulary: the full softmax, no error."""
    logits = [0.5, 1.0, 0.0, 0.75]
    expect_distribution(sub, logits, len(logits))
    expect_distribution(sub, logits, len(logits) + 10)


@check("sample_top_k follows the softmax over the top k", points=2)
def top_k_distribution(sub):
    """Frequencies over 2000 seeds match the top-k softmax."""
    expect_distribution(sub, PUBLIC_LOGITS, 3)
    expect_distribution(sub, sampling_logits(1, 8, seed=3)[0], 2)


# --- task 4: a decision from the student's own request ------------------------------------------

DECISION_TITLE = "Your decision (task 4)"
FIRST_TOKEN_SHARE = 0.5     # the first token must be at least this share of the wait until the last one
SLACK_TOKENS = 1            # a named length this close to the reference passes: timings and rounding move it
RECORD_KEYS = ("prompt_tokens", "new_tokens", "token_times_s", "ttft_s", "tpot_s", "longest_reply_tokens")


def longest_reply(ttft_s: float, tpot_s: float, share: float = FIRST_TOKEN_SHARE) -> int:
    """The largest n with ttft_s >= share * (ttft_s + (n - 1) * tpot_s); floor(ttft / tpot) + 1 at share 0.5."""
    return math.floor(ttft_s * (1 - share) / (share * tpot_s)) + 1


def n_fits(n: int, ttft_s: float, tpot_s: float) -> bool:
    """Whether n is the longest reply to within float rounding (n* computed in ms instead of s, say)."""
    return (n - 1) * tpot_s <= ttft_s * (1 + 1e-9) and n * tpot_s > ttft_s * (1 - 1e-9)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def recorded_request(sub) -> dict:
    """The recorded request, checked: token times from a start of 0.0, and TTFT, TPOT and n* computed from them."""
    data = sub.record("request_latency")
    missing = [k for k in RECORD_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise CheckFailed(f"record 'request_latency' lacks {', '.join(missing)}")
    times = data["token_times_s"]
    if not isinstance(times, list) or len(times) < 2 or not all(is_number(t) for t in times):
        raise CheckFailed("record 'request_latency': token_times_s must list the times of at least two tokens")
    if times[0] <= 0 or any(b < a for a, b in zip(times, times[1:])) or times[-1] == times[0]:
        raise CheckFailed(f"record 'request_latency': token_times_s must be positive and rising (seconds from the "
                          f"start), got {short(times)}")
    if data["new_tokens"] != len(times) or not isinstance(data["prompt_tokens"], int) or data["prompt_tokens"] < 1:
        raise CheckFailed(f"record 'request_latency': new_tokens must be len(token_times_s) = {len(times)} and "
                          f"prompt_tokens a positive count, got {data['new_tokens']!r} and {data['prompt_tokens']!r}")
    for key, want in [("ttft_s", ttft(0.0, times)), ("tpot_s", tpot(0.0, times))]:
        if not is_number(data[key]) or not math.isclose(data[key], want, rel_tol=1e-9, abs_tol=1e-12):
            raise CheckFailed(f"record 'request_latency': {key} = {data[key]!r}, but token_times_s (start 0.0) "
                              f"gives {want:.6g}; compute it with your task 2 function")
    n, want = data["longest_reply_tokens"], longest_reply(data["ttft_s"], data["tpot_s"])
    if not isinstance(n, int) or isinstance(n, bool) or not (n == want or n_fits(n, data["ttft_s"], data["tpot_s"])):
        raise CheckFailed(f"record 'request_latency': longest_reply_tokens = {n!r}, but floor(ttft_s / tpot_s) + 1 "
                          f"on the record's own TTFT and TPOT is {want}")
    return data


@check("task 4: the recorded request holds TTFT, TPOT and the longest reply computed from its token times",
       points=1, written=True)
def request_recorded(sub):
    """TTFT and TPOT equal the task 2 formulas on the recorded token times; n* = floor(TTFT / TPOT) + 1."""
    recorded_request(sub)


@check("task 4: the decision gives the longest reply whose first token is at least half of the wait, and "
       "cites TTFT and TPOT", points=2, written=True)
def request_decision(sub):
    """The Decision line gives n* (within SLACK_TOKENS) in tokens; the answer cites TTFT and TPOT in ms."""
    data = recorded_request(sub)
    text, line = written_decision(sub, DECISION_TITLE, "a number of tokens")
    named = {int(x) for x in re.findall(r"(?<![\w.,])(\d+)\s*(?:new\s+)?tokens?\b", line, re.IGNORECASE)} or \
        {int(x) for x in re.findall(r"(?<![\w.,])(\d+)(?![\w.,])", line)}
    if len(named) != 1:
        raise CheckFailed(f"the decision line must give one number of tokens, such as 'Decision: 7 tokens'; "
                          f"got {line!r}")
    want, got = longest_reply(data["ttft_s"], data["tpot_s"]), named.pop()
    if abs(got - want) > SLACK_TOKENS:
        raise CheckFailed(f"the decision gives {got} tokens; your record's TTFT {data['ttft_s'] * 1e3:.2f} ms and "
                          f"TPOT {data['tpot_s'] * 1e3:.2f} ms give floor(TTFT / TPOT) + 1 = {want} "
                          f"({SLACK_TOKENS} either side passes)")
    expect_cited(text, data["ttft_s"] * 1e3, "your TTFT in ms", rel=0.01, abs_tol=0.05)
    expect_cited(text, data["tpot_s"] * 1e3, "your TPOT in ms", rel=0.01, abs_tol=0.05)


def wrong_answers(written) -> list[str]:
    """Lengths outside the slack with the right TTFT and TPOT, and n* citing a wrong TTFT, then a wrong TPOT."""
    data = written.record("request_latency")
    ms = {"ttft": data["ttft_s"] * 1e3, "tpot": data["tpot_s"] * 1e3}
    n = longest_reply(data["ttft_s"], data["tpot_s"])

    def answer(tokens: int, ttft_ms: float, tpot_ms: float) -> str:
        return f"\n\nDecision: {tokens} tokens\n\nTTFT {ttft_ms:.2f} ms, TPOT {tpot_ms:.2f} ms."
    wrong_n = sorted({n + SLACK_TOKENS + 1, 2 * n + SLACK_TOKENS + 1, data["new_tokens"]} - set(
        range(n - SLACK_TOKENS, n + SLACK_TOKENS + 1)))
    return ([answer(k, ms["ttft"], ms["tpot"]) for k in wrong_n]
            + [answer(n, ms["ttft"] * 1.5, ms["tpot"]), answer(n, ms["ttft"], ms["tpot"] * 1.5)])
