"""Exercise 05's sampling checks, run in this process on plain functions: each wrong rule fails, with its message.

A correct rule's full marks are the class-folder test's (the solution graded through a kernel); this says the same
checks can fail, and on which slip, without starting one.
"""
import importlib
from pathlib import Path

import nbformat
import pytest
import torch

from infopt_lab import speculative as sp
from infopt_lab.grading.checks import CheckFailed

checks = importlib.import_module("infopt_lab.grading.checks.05_speculative_decoding")
SOLUTION = Path(__file__).resolve().parents[1] / "solutions" / "05_speculative_decoding.ipynb"


def histogram_with(verify_sample):
    """The notebook's own `emitted_histogram` (the helper the exercise hands the student), driving `verify_sample`."""
    nb = nbformat.read(SOLUTION, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def emitted_histogram(" in c.source)
    namespace = {"torch": torch, "verify_sample": verify_sample}
    exec(cell.source, namespace)
    return namespace["emitted_histogram"]


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
    with pytest.raises(CheckFailed, match=says):
        caught_by(Local(emitted_histogram=histogram_with(wrong)))
