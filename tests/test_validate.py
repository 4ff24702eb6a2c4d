"""infopt_lab.validate: one error style; a wrong type is a TypeError, a wrong value a ValueError."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import infopt_lab as lab
from infopt_lab import validate


def test_integers_take_lists_arrays_and_1d_tensors():
    assert validate.integers("n", [1, np.int64(2)]) == [1, 2]
    assert validate.integers("n", (3,), low=1) == [3]
    assert validate.integers("n", np.array([4, 5]), high=5) == [4, 5]
    assert validate.integers("n", torch.tensor([6])) == [6]
    assert validate.integers("n", [], nonempty=False) == []


@pytest.mark.parametrize("values, kwargs, error, message", [
    ("12", {}, TypeError, "n must be a list of integers, got str"),
    (3, {}, TypeError, "n must be a list of integers, got int"),
    ({1: 2}, {}, TypeError, "n must be a list of integers, got dict"),
    (torch.zeros(2, 2, dtype=torch.long), {}, TypeError, "n must be a list of integers, got Tensor"),
    ([1, True], {}, TypeError, r"n must hold integers, got \[True\]"),
    ([1, 2.0], dict(low=1), TypeError, r"n must hold integers >= 1, got \[2.0\]"),
    ([1, 0, -1], dict(low=1), ValueError, r"n must hold integers >= 1, got \[0, -1\]"),
    ([7], dict(low=1, high=5), ValueError, r"n must hold integers in \[1, 5\], got \[7\]"),
    ([], {}, ValueError, "n is empty: give at least one integer"),
    ([1, 2, 3], dict(length=2), ValueError, "n must hold exactly 2 integers, got 3"),
])
def test_integers_name_what_is_wrong(values, kwargs, error, message):
    with pytest.raises(error, match=message):
        validate.integers("n", values, **kwargs)


def test_reals_and_arrival_times():
    assert validate.reals("x", [1, 2.5, np.float32(0.5)]) == [1.0, 2.5, 0.5]
    assert validate.arrival_times("arrival_s", []) == [] and validate.arrival_times("arrival_s", (0, 1.5)) == [0.0, 1.5]
    assert validate.arrival_time("arrival_s", 2) == 2.0
    with pytest.raises(ValueError, match=r"x must hold finite numbers, got \[nan\]"):
        validate.reals("x", [1.0, float("nan")])
    with pytest.raises(ValueError, match=r"arrival_s must hold finite numbers >= 0 \(seconds after the start\), "
                                         r"got \[inf\]"):
        validate.arrival_times("arrival_s", [float("inf"), 0])
    with pytest.raises(TypeError, match=r"arrival_s must hold finite numbers >= 0 \(seconds after the start\), "
                                        r"got \['1'\]"):
        validate.arrival_times("arrival_s", ["1"])
    with pytest.raises(ValueError, match="arrival_s must hold exactly 2 numbers, got 1"):
        validate.arrival_times("arrival_s", [0.0], length=2)
    with pytest.raises(ValueError, match=r"arrival_s must be a finite number >= 0 \(seconds after the start\), got -1"):
        validate.arrival_time("arrival_s", -1)
    with pytest.raises(TypeError, match="arrival_s must be a finite number >= 0"):
        validate.arrival_time("arrival_s", True)


def test_choice_instance_and_probabilities():
    assert validate.choice("policy", "static", ("static", "continuous")) == "static"
    assert validate.choice("weights", None, {None: 0, "int8": 1}) is None
    for bad in ("fifo", None, [], True):
        with pytest.raises(ValueError, match=r"policy must be one of \('static', 'continuous'\), got "):
            validate.choice("policy", bad, ("static", "continuous"))
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 8\), got True"):
        validate.choice("bits", True, (4, 8))                  # True == 1, but a switch is not a count
    with pytest.raises(TypeError, match="config must be a lab.ModelConfig, got dict"):
        validate.instance("config", {}, lab.ModelConfig, "a lab.ModelConfig")
    validate.probabilities("p", torch.tensor([[0.5, 0.5]]))
    with pytest.raises(TypeError, match="p must be a floating-point tensor"):
        validate.probabilities("p", torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="p must hold finite, non-negative probabilities"):
        validate.probabilities("p", torch.tensor([[1.5, -0.5]]))
    with pytest.raises(ValueError, match=r"p's rows must each sum to 1, got sums \[0.5\]"):
        validate.probabilities("p", torch.tensor([[0.25, 0.25]]))


def test_speculation_length_and_draft():
    assert validate.speculation_length("k", np.int64(3)) == 3
    assert validate.speculation_length("num_speculative_tokens", 0, low=0) == 0
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
        validate.speculation_length("k", 0)
    with pytest.raises(TypeError, match="num_speculative_tokens must be an integer >= 0, got True"):
        validate.speculation_length("num_speculative_tokens", True, low=0)
    torch.manual_seed(0)
    target = lab.Transformer(lab.get_preset("tiny"))
    validate.draft(target, copy.deepcopy(target), max_len=target.config.max_seq_len)
    with pytest.raises(TypeError, match="draft must be a model"):
        validate.draft(target, "ngram")
    with pytest.raises(TypeError, match="target must be a model"):
        validate.draft(None, target)
    config = lab.get_preset("tiny")
    config.vocab_size = 100
    with pytest.raises(ValueError, match=r"the draft's vocabulary \(100 tokens\) differs from the target's \(512\)"):
        validate.draft(target, lab.Transformer(config))
    with pytest.raises(ValueError, match=r"the draft's context \(\d+ tokens\) is shorter than max_model_len"):
        validate.draft(target, target, max_len=target.config.max_seq_len + 1)
    with pytest.raises(ValueError, match="the draft is torch.bfloat16 on cpu but the target is torch.float32"):
        validate.draft(target, copy.deepcopy(target).to(torch.bfloat16))
