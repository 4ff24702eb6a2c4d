"""Exercise 05's sampling checks, run in this process on plain functions: a correct rule passes, each wrong one fails.

The class-folder test grades the solution through a kernel (full marks); this says the same checks can fail, and on
which slip, without starting one.
"""
import importlib

import pytest
import torch

from infopt_lab import speculative as sp
from infopt_lab.grading.checks import CheckFailed

checks = importlib.import_module("infopt_lab.grading.checks.05_speculative_decoding")


def histogram_with(verify_sample):
    """The notebook's given helper, driving `verify_sample` (the same loop the exercise hands the student)."""
    def emitted_histogram(p, q, k, trials, seed, p_last=None):
        p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
        p_last = p if p_last is None else torch.tensor(p_last, dtype=torch.float64)
        g = torch.Generator().manual_seed(seed)
        target_probs = torch.cat([p.expand(k, -1), p_last[None]])
        first, bonus, accepted = [0] * len(p), [0] * len(p), 0
        for _ in range(trials):
            draft = torch.multinomial(q.expand(k, -1), 1, generator=g).squeeze(1)
            emitted = verify_sample(draft, q.expand(k, -1), target_probs, g)
            first[emitted[0]] += 1
            accepted += len(emitted) - 1
            if len(emitted) - 1 == k:
                bonus[emitted[-1]] += 1
        return {"first": first, "accepted": accepted, "bonus": bonus}
    return emitted_histogram


class Local:
    """What a check sees of a submission: `call(name, *args)`, here on functions of this process."""

    def __init__(self, **functions):
        self.functions = functions

    def call(self, name, *args):
        return self.functions[name](*args)


def draw(probs, g):
    return int(torch.multinomial(probs, 1, generator=g))


def accept_every_draft(draft, q, p, g):
    return [int(x) for x in draft] + [draw(p[-1], g)]


def residual_from_p(draft, q, p, g):
    """Right acceptance, but a rejection draws from p instead of max(0, p - q)."""
    out = []
    for i, x in enumerate(draft.tolist()):
        if q[i, x] > 0 and torch.rand((), generator=g) < min(1.0, float(p[i, x] / q[i, x])):
            out.append(x)
            continue
        return out + [draw(p[i], g)]
    return out + [draw(p[-1], g)]


def bonus_from_first_position(draft, q, p, g):
    """Right rule, but the bonus token after a fully accepted round is drawn from p_0, not p_k."""
    emitted, accepted = sp.verify(draft, q, p, g)
    return emitted if accepted < len(draft) else emitted[:-1] + [draw(p[0], g)]


@pytest.mark.parametrize("wrong, caught_by, says", [
    (accept_every_draft, checks.sampling_notebook, "from p in total variation"),
    (residual_from_p, checks.sampling_notebook, "from p in total variation"),
    (bonus_from_first_position, checks.sampling_hidden_longer, "draw them from target_probs"),
])
def test_a_wrong_rule_fails_a_sampling_check(wrong, caught_by, says):
    """(A correct rule's full marks are the class-folder test's: the solution graded through a kernel.)"""
    with pytest.raises(CheckFailed, match=says):
        caught_by(Local(emitted_histogram=histogram_with(wrong)))
