"""The rule of exactness: identical in invariant mode, identical up to rounding ties in the default mode, on prompts nobody tuned."""
import copy

import pytest
import torch

import infopt_lab as lab
from infopt_lab.bench.exactness import heldout_prompts, speculative_agreement
from infopt_lab.generate import recompute
from infopt_lab.exactness import TIE_MARGIN, Agreement, Divergence, compare, exact_tokens, first_difference
from test_engine import LENGTHS, PROMPTS
from test_spec_decode import pair  # noqa: F401  (the bundled pair in fp32, one fixture for both files)


@pytest.fixture(scope="module")
def smol():
    target, tok = lab.load_model("smollm2-135m", dtype=torch.float32)
    draft, _ = lab.load_model("smollm2-135m-draft", dtype=torch.float32)
    return target, draft, tok


def test_first_difference_counts_length_too():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2                     # one stopped early: a difference
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [7]) == 0


def test_only_a_near_tie_where_both_go_on_counts_as_a_tie():
    assert Divergence(0, 3, 5, 6, TIE_MARGIN / 2).tie
    assert not Divergence(0, 3, 5, 6, TIE_MARGIN * 2).tie
    assert not Divergence(0, 3, 5, None, 0.0).tie                        # a length difference is never a tie
    agreement = Agreement(4, [Divergence(1, 3, 5, 6, 1e-6)])
    assert agreement.rate == 0.75 and agreement.holds
    assert "3/4 outputs identical" in agreement.summary() and "1 of them at rounding ties" in agreement.summary()


def test_compare_finds_each_first_divergence_and_measures_its_margin(pair):
    target, _, tok = pair
    prompts = ["def fib(n):", "class Stack:"]
    ids = [tok.encode(p) for p in prompts]
    want = [lab.generate(target, tok, p, max_new_tokens=12, stop_at_eos=False).token_ids for p in prompts]
    changed = list(want[0])
    changed[4] = (changed[4] + 1) % len(tok)
    result = compare(target, ids, want, [changed, want[1][:7]])
    assert [(d.index, d.position) for d in result.divergences] == [(0, 4), (1, 7)]
    logits = recompute(target, torch.tensor([ids[0] + want[0][:4]]))[0, -1]
    top = torch.topk(logits, 2).values
    assert result.divergences[0].margin == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert result.divergences[1].got is None and not result.holds      # a truncated output breaks the rule
    with pytest.raises(ValueError, match="one entry each"):
        compare(target, ids, want, want[:1])


def test_exact_tokens_names_the_mode_for_each_precision(pair):
    target, _, _ = pair
    fp32 = exact_tokens(target)
    assert fp32.in_default_mode and "float32 on cpu" in fp32.reason
    bf16 = exact_tokens(copy.deepcopy(target).to(torch.bfloat16))
    assert bf16.batch_invariant and "bfloat16" in bf16.reason
    int8 = exact_tokens(lab.quantize_model(target, "int8"))
    assert int8.batch_invariant and "quantized" in int8.reason
    with pytest.raises(TypeError):
        exact_tokens("not a model")


def test_heldout_prompts_are_seeded_and_chat_where_the_tokenizer_chats(pair, smol):
    _, _, tok = pair
    assert heldout_prompts(tok, 6, seed=1) == heldout_prompts(tok, 6, seed=1) != heldout_prompts(tok, 6, seed=2)
    smol_prompts = heldout_prompts(smol[2], 4, seed=1)
    assert sum("<|im_start|>assistant" in p for p in smol_prompts) == 2


@pytest.mark.parametrize("stop_at_eos", [True, False])
def test_bundled_pair_follows_the_rule_on_heldout_prompts(pair, stop_at_eos):
    target, draft, tok = pair
    prompts = heldout_prompts(tok, 6, seed=7)
    found = speculative_agreement(target, draft, tok, prompts, ks=(2, 5), new_tokens=32, stop_at_eos=stop_at_eos)
    found.pop("ended at EOS")
    for name, agreement in found.items():
        assert agreement.holds, f"{name}: {agreement.summary(tok)}"


def test_smollm2_follows_the_rule_on_heldout_prompts_with_eos_in_the_window(smol):
    """SmolLM2 fp32 with its draft, default mode: equal to generate, length included, except at rounding ties."""
    target, draft, tok = smol
    prompts = heldout_prompts(tok, 4, seed=11)
    found = speculative_agreement(target, draft, tok, prompts, ks=(2, 5), new_tokens=32)
    assert found.pop("ended at EOS") >= 1                             # a chat answer ends inside the window
    for name, agreement in found.items():
        assert agreement.holds, f"{name}: {agreement.summary(tok)}"


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_invariant_mode_is_identical_where_the_default_is_not_promised(pair, name):
    target, draft, tok = pair
    t, d = ((copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16)) if name == "bf16"
            else (lab.quantize_model(target, "int8"), draft))
    prompts = heldout_prompts(tok, 2, seed=3)
    found = speculative_agreement(t, d, tok, prompts, ks=(3,), new_tokens=16, batch_invariant=True)
    found.pop("ended at EOS")
    assert all(a.rate == 1.0 for a in found.values()), {k: a.summary(tok) for k, a in found.items()}


def test_smollm2_int8_engine_batched_equals_alone_in_invariant_mode(smol):
    """16 mixed requests on the real model, int8 weights (the default mode's drift is largest there): the
    batched engine gives each request's tokens alone, bit for bit (fp32: test_invariant's engine test)."""
    target, _, tok = smol
    model = lab.quantize_model(target, "int8")
    prompts, lengths = PROMPTS[:16], [max(1, n // 3) for n in LENGTHS[:16]]
    want = [lab.generate(model, tok, p, max_new_tokens=n, stop_at_eos=False, batch_invariant=True).token_ids
            for p, n in zip(prompts, lengths)]
    engine = lab.Engine(model, tok, max_batch_size=16, batch_invariant=True)
    outs = engine.generate(prompts, max_new_tokens=lengths, stop_at_eos=False)
    assert [o.token_ids for o in outs] == want
