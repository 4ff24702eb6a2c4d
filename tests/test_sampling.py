"""Sampling: exact filtered distributions for known logits, and seeded draws that follow them."""
import pytest
import torch

from infopt_lab.sampling import SamplingParams, logits_to_probs, make_generator, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0.0)).tolist() == [0]


# Known probabilities, so every filtered distribution can be written down exactly.
P = torch.tensor([0.5, 0.25, 0.15, 0.1])
KNOWN = P.log()


def assert_probs(logits, expected, **kwargs):
    torch.testing.assert_close(logits_to_probs(logits, **kwargs), torch.tensor(expected, dtype=torch.float32),
                               rtol=0, atol=1e-6)


def test_no_filter_is_softmax():
    assert_probs(KNOWN, P.tolist())
    assert_probs(KNOWN, P.tolist(), top_k=4, top_p=1.0)            # keeping everything filters nothing
    assert_probs(KNOWN, P.tolist(), top_k=99)                      # k past the vocabulary too


@pytest.mark.parametrize("top_k,expected", [(1, [1, 0, 0, 0]), (2, [2 / 3, 1 / 3, 0, 0]),
                                            (3, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])])
def test_top_k_renormalizes_the_k_most_likely(top_k, expected):
    assert_probs(KNOWN, expected, top_k=top_k)


@pytest.mark.parametrize("top_p,expected", [
    (0.4, [1, 0, 0, 0]),                                # the top token alone reaches 0.4
    (0.5, [1, 0, 0, 0]),                                # ... and exactly 0.5: the smallest set, edge included
    (0.7, [2 / 3, 1 / 3, 0, 0]),                        # 0.5 + 0.25 = 0.75 >= 0.7
    (0.75, [2 / 3, 1 / 3, 0, 0]),                       # reaches 0.75 exactly: no third token
    (0.76, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),     # just past it: the third is needed
    (0.95, [0.5, 0.25, 0.15, 0.1]),
])
def test_top_p_renormalizes_the_smallest_set_reaching_p(top_p, expected):
    assert_probs(KNOWN, expected, top_p=top_p)


def test_top_p_follows_each_rows_own_order():
    shuffled = torch.stack([KNOWN, KNOWN[[3, 1, 2, 0]]])          # row 1: the likeliest token is last
    assert_probs(shuffled, [[2 / 3, 1 / 3, 0, 0], [0, 1 / 3, 0, 2 / 3]], top_p=0.7)
    assert_probs(shuffled, [[2 / 3, 1 / 3, 0, 0], [0, 1 / 3, 0, 2 / 3]], top_k=2)


def test_top_p_applies_to_what_top_k_kept():
    # top_k=3 leaves [0.5, 0.25, 0.15] / 0.9 = [0.56, 0.28, 0.17]: 0.8 is reached by two of them, not three
    assert_probs(KNOWN, [2 / 3, 1 / 3, 0, 0], top_k=3, top_p=0.8)
    assert_probs(KNOWN, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], top_p=0.8)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_raises_probabilities_to_the_power_one_over_t(temperature):
    sharpened = P ** (1 / temperature)
    assert_probs(KNOWN, (sharpened / sharpened.sum()).tolist(), temperature=temperature)
    top2 = sharpened[:2] / sharpened[:2].sum()                     # filters apply after the temperature
    assert_probs(KNOWN, top2.tolist() + [0, 0], temperature=temperature, top_k=2)


def test_temperature_near_zero_is_greedy():
    assert_probs(LOGITS, [[1, 0, 0, 0, 0]], temperature=0.0)


def test_seeded_sampling_follows_the_distribution():
    g = make_generator(0)
    params = SamplingParams(temperature=1.0, seed=0)
    draws = torch.stack([sample(LOGITS, params, g) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, LOGITS.softmax(-1)[0], atol=0.03, rtol=0)


def test_max_new_tokens_none_means_not_given():
    """None is the default length in SamplingParams, and no override in sampling_params (the engine's rule too)."""
    from infopt_lab.sampling import DEFAULT_MAX_NEW_TOKENS, sampling_params
    assert SamplingParams(max_new_tokens=None).max_new_tokens == DEFAULT_MAX_NEW_TOKENS == SamplingParams().max_new_tokens
    assert sampling_params(None, max_new_tokens=None) == SamplingParams()
    assert sampling_params(SamplingParams(max_new_tokens=5), max_new_tokens=None, top_k=2).max_new_tokens == 5


def test_stop_settings_are_checked():
    assert SamplingParams(stop_token_ids=[3, 5]).stop_token_ids == (3, 5)
    with pytest.raises(TypeError, match="stop_token_ids must be a list of integers, got int"):
        SamplingParams(stop_token_ids=3)
    with pytest.raises(TypeError, match=r"stop_token_ids must hold integers >= 0, got \[1.5\]"):
        SamplingParams(stop_token_ids=[1.5])
    with pytest.raises(ValueError, match=r"stop_token_ids must hold integers >= 0, got \[-1\]"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(TypeError, match="stop_at_eos must be True or False, got 1"):
        SamplingParams(stop_at_eos=1)
