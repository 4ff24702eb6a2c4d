import pytest
import torch

from infopt_lab.sampling import SamplingParams, logits_to_probs, make_generator, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0.0)).tolist() == [0]


def test_top_k_keeps_k_tokens():
    probs = logits_to_probs(LOGITS, 1.0, top_k=2)
    assert (probs > 0).sum().item() == 2
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_k_larger_than_vocab_keeps_everything():
    assert (logits_to_probs(LOGITS, 1.0, top_k=99) > 0).sum().item() == 5


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = LOGITS.softmax(-1)[0]
    probs = logits_to_probs(LOGITS, 1.0, top_p=float(full[0]) + 1e-4)   # needs the top two
    assert (probs > 0).sum().item() == 2
    probs = logits_to_probs(LOGITS, 1.0, top_p=float(full[0]) - 1e-4)   # the top one suffices
    assert (probs > 0).sum().item() == 1


def test_temperature_sharpens():
    cold = logits_to_probs(LOGITS, 0.1)
    hot = logits_to_probs(LOGITS, 10.0)
    assert cold[0, 0] > 0.99 and hot[0, 0] < 0.3


def test_seeded_sampling_follows_the_distribution():
    g = make_generator(0)
    params = SamplingParams(temperature=1.0, seed=0)
    draws = torch.stack([sample(LOGITS, params, g) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, LOGITS.softmax(-1)[0], atol=0.03, rtol=0)
