"""Checks for exercises/05_speculative_decoding.ipynb: greedy verification, the sampling rule, the formula.

Conventions the notebook states and these checks hold the student to:

- `verify_greedy(draft_tokens, target_argmax)` -> the longest prefix of draft_tokens equal to target_argmax
  position by position, then target_argmax at the first mismatch (target_argmax[k] if none).
- `verify_sample(draft_tokens, draft_probs, target_probs, generator)` -> emitted token ids: accept each draft
  token x with probability min(1, p_i(x) / q_i(x)); at the first rejection draw from normalised
  max(0, p_i - q_i) (p_i if that is all zero) and stop; if all k are accepted, draw a bonus from p_k.
  Driven through the given `emitted_histogram(p, q, k, trials, seed, p_last=None)`.
- `expected_tokens_per_pass(alpha, k)` = (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1; ValueError for
  alpha outside [0, 1] or k < 1.
- Task 4, the best k from the student's own measurement: the notebook records
  `lab.record("best_k", {"alpha", "c", "v": {"1": 1.0, ..., "7": ...}, "predicted": {"1": ..., "6": ...},
  "best_k", "measured_speedup"})` with predicted[k] = E(alpha, k) / (k c + v[k + 1]); the answer under
  DECISION_TITLE names k in a `Decision:` line and cites its predicted speedup. Timings decide, so any k whose
  prediction is within NEAR_TIE of the best counts as the best.
"""
from __future__ import annotations

import random
import re

from ...speculative import expected_tokens_per_pass, verify_greedy
from . import CheckFailed, check, expect_cited, expect_close, expect_raises, short, written_decision

# Each draw runs the student's verify_sample once in Python (about 0.25 ms on a slow 2-core CPU), and a check has
# 10 s for all its calls by default: 4,000 draws a case keeps every check under about 3 s there. At 4,000 draws a
# correct rule's first-token distance from p is about 0.013 (5 equal tokens; 0.004 of spread), so MAX_TV is more
# than 5 spreads away; the acceptance rate's spread is at most 0.008, so MAX_ACCEPT_GAP is more than 4.
TRIALS = 4000
MAX_TV = 0.035
MAX_ACCEPT_GAP = 0.035


def _greedy_case(sub, draft, argmax) -> None:
    want = verify_greedy(draft, argmax)[0]
    got = sub.call("verify_greedy", draft, argmax)
    if got != want:
        raise CheckFailed(f"verify_greedy({draft}, {argmax}) returned {short(got)}, expected {want}")


@check("verify_greedy on the notebook's three rounds", points=2)
def greedy_notebook(sub):
    for draft, argmax in [([5, 9, 2, 7], [5, 9, 4, 1, 3]), ([5, 9], [5, 9, 8]), ([6], [3, 0])]:
        _greedy_case(sub, draft, argmax)


@check("verify_greedy on hidden rounds: long drafts, a late mismatch, repeated tokens", points=2)
def greedy_hidden(sub):
    rng = random.Random(7)
    cases = [([1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 2, 9]), ([4, 4], [4, 5, 6]), ([0], [0, 0])]
    for _ in range(8):
        k = rng.randint(1, 9)
        draft = [rng.randint(0, 3) for _ in range(k)]
        cases.append((draft, [d if rng.random() < 0.7 else rng.randint(0, 3) for d in draft] + [rng.randint(0, 3)]))
    for draft, argmax in cases:
        _greedy_case(sub, draft, argmax)


def _tv(counts, p) -> float:
    total = sum(counts)
    return 0.5 * sum(abs(c / total - pi) for c, pi in zip(counts, p)) if total else 1.0


def _sampling_case(sub, p, q, k, seed, p_last=None) -> None:
    what = f"emitted_histogram(p={p}, q={q}, k={k})"
    got = sub.call("emitted_histogram", p, q, k, TRIALS, seed, p_last)
    if not isinstance(got, dict) or not {"first", "accepted", "bonus"} <= set(got):
        raise CheckFailed(f"{what} returned {short(got)}, expected the dict the given helper builds")
    tv = _tv(got["first"], p)
    if tv > MAX_TV:
        raise CheckFailed(f"{what}: the first emitted token is {tv:.3f} from p in total variation "
                          f"(at most {MAX_TV} for a correct rule)")
    overlap = sum(min(a, b) for a, b in zip(p, q))
    if k == 1 and abs(got["accepted"] / TRIALS - overlap) > MAX_ACCEPT_GAP:
        raise CheckFailed(f"{what}: {got['accepted'] / TRIALS:.3f} of draft tokens accepted, expected "
                          f"sum(min(p, q)) = {overlap:.3f}: accept with probability min(1, p/q)")
    if p_last is not None and sum(got["bonus"]) >= 500 and _tv(got["bonus"], p_last) > 2 * MAX_TV:
        raise CheckFailed(f"{what}: bonus tokens after a fully accepted round are {_tv(got['bonus'], p_last):.3f} "
                          f"from p_k; draw them from target_probs[k]")


@check("verify_sample emits the target's distribution on the notebook's pair, with the right acceptance", points=3)
def sampling_notebook(sub):
    _sampling_case(sub, [0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], 1, seed=1)


@check("verify_sample on hidden pairs, k = 1: q = 0 where p > 0, p = 0 where q > 0, equal (with the bonus)", points=2)
def sampling_hidden(sub):
    for i, (p, q, p_last) in enumerate([([0.1, 0.2, 0.3, 0.4], [0.7, 0.3, 0.0, 0.0], None),
                                        ([0.0, 0.0, 0.6, 0.4], [0.5, 0.5, 0.0, 0.0], None),
                                        ([0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2], [0.7, 0.1, 0.1, 0.05, 0.05])]):
        _sampling_case(sub, p, q, 1, seed=100 + i, p_last=p_last)


@check("verify_sample on hidden pairs, k > 1: a later rejection, a bonus drawn from the last position", points=2)
def sampling_hidden_longer(sub):
    _sampling_case(sub, [0.45, 0.05, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25], 3, seed=103)
    _sampling_case(sub, [0.6, 0.4, 0.0], [0.5, 0.3, 0.2], 2, seed=104, p_last=[0.0, 0.1, 0.9])


@check("expected_tokens_per_pass on the notebook's values", points=1)
def formula_notebook(sub):
    for alpha, k, want in [(0.0, 4, 1.0), (0.5, 2, 1.75), (0.8, 4, expected_tokens_per_pass(0.8, 4)), (1.0, 4, 5.0)]:
        expect_close(sub.call("expected_tokens_per_pass", alpha, k), want, f"expected_tokens_per_pass({alpha}, {k})",
                     rel=1e-9)


@check("expected_tokens_per_pass on hidden values and its errors (ValueError)", points=2)
def formula_hidden(sub):
    for alpha, k in [(0.3, 1), (0.95, 8), (0.999, 3), (0.62, 6), (1.0, 1)]:
        want = expected_tokens_per_pass(alpha, k)
        expect_close(sub.call("expected_tokens_per_pass", alpha, k), want, f"expected_tokens_per_pass({alpha}, {k})",
                     rel=1e-6)
    for args in [(1.2, 4), (-0.1, 4), (0.5, 0)]:
        expect_raises(sub, "ValueError", "expected_tokens_per_pass", *args)


# --- task 4: the best k from the student's own measurement ----------------------------------------

DECISION_TITLE = "Your decision (task 4)"
NEAR_TIE = 0.01          # a k predicted within 1% of the best is as good a choice: timings move that much


def recorded_predictions(sub) -> dict[int, float]:
    """The recorded predictions by k, checked against the formula on the record's own alpha, c and v."""
    data = sub.record("best_k")
    if not isinstance(data, dict) or not all(k in data for k in ("alpha", "c", "v", "predicted")):
        raise CheckFailed("record 'best_k' must hold alpha, c, v and predicted")
    alpha, c, v, predicted = data["alpha"], data["c"], data["v"], data["predicted"]
    try:
        v = {int(n): float(x) for n, x in v.items()}
        predicted = {int(k): float(x) for k, x in predicted.items()}
    except (AttributeError, TypeError, ValueError):
        raise CheckFailed("record 'best_k': v and predicted must map whole numbers to numbers") from None
    if not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1 and isinstance(c, (int, float)) and c > 0):
        raise CheckFailed(f"record 'best_k': alpha must be in [0, 1] and c > 0, got {alpha!r} and {c!r}")
    if len(predicted) < 3 or min(predicted) != 1:
        raise CheckFailed("record 'best_k' must predict k = 1 and at least two more")
    for k, got in predicted.items():
        if k + 1 not in v or v[k + 1] <= 0:
            raise CheckFailed(f"record 'best_k' predicts k = {k} but holds no v({k + 1})")
        want = expected_tokens_per_pass(alpha, k) / (k * c + v[k + 1])
        if abs(got - want) > 1e-6 * want:
            raise CheckFailed(f"predicted[{k}] = {got:.6g}, but E(alpha, {k}) / ({k} c + v({k + 1})) on the "
                              f"record's own alpha, c and v is {want:.6g}")
    return predicted


def acceptable_ks(predicted: dict[int, float]) -> list[int]:
    best = max(predicted.values())
    return [k for k, x in predicted.items() if x >= (1 - NEAR_TIE) * best]


@check("task 4: the recorded predictions are E / (k c + v(k + 1)) of the recorded alpha, c and v", points=1,
       written=True)
def best_k_recorded(sub):
    """Each prediction recomputed from the record's own measurements."""
    recorded_predictions(sub)


@check("task 4: the decision names the k the cost model favours on the recorded measurements, and cites its "
       "predicted speedup", points=2, written=True)
def best_k_decision(sub):
    """The Decision line names one k among the best (within NEAR_TIE); the answer cites its prediction."""
    predicted = recorded_predictions(sub)
    text, line = written_decision(sub, DECISION_TITLE, "k")
    named = [int(x) for x in re.findall(r"(?<![\w.])(\d+)(?![\w.])", line)]
    if len(named) != 1 or named[0] not in predicted:
        raise CheckFailed(f"the decision line must name one k of {sorted(predicted)}, got {line!r}")
    good = acceptable_ks(predicted)
    if named[0] not in good:
        raise CheckFailed(f"the decision names k = {named[0]}, predicted {predicted[named[0]]:.3f}x; your record "
                          f"favours k = {', '.join(map(str, good))} ({max(predicted.values()):.3f}x)")
    expect_cited(text, predicted[named[0]], f"k = {named[0]}'s predicted speedup", rel=0.01, abs_tol=0.005)


def wrong_answers(written) -> list[str]:
    """Each k outside the near-tie with its own prediction, and a best k citing a speedup a third higher."""
    predicted = {int(k): x for k, x in written.record("best_k")["predicted"].items()}
    good = acceptable_ks(predicted)
    return ([f"\n\nDecision: k = {k}\n\nPredicted {x:.3f}x." for k, x in predicted.items() if k not in good]
            + [f"\n\nDecision: k = {good[0]}\n\nPredicted {predicted[good[0]] * 4 / 3:.3f}x."])
