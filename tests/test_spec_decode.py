"""Speculative decoding inside the engine: the same tokens as without it, under batching, preemption and caching."""
import copy

import pytest
import torch

import infopt_lab as lab
from infopt_lab.config import get_preset
from infopt_lab.model import Transformer
from test_engine import LENGTHS, PROMPTS

PROMPTS16, LENGTHS16 = PROMPTS[:16], LENGTHS[:16]


@pytest.fixture(scope="module")
def pair():
    target, tok = lab.load_model("target", dtype=torch.float32)
    draft, _ = lab.load_model("draft", dtype=torch.float32)
    return target, draft, tok


@pytest.fixture(scope="module")
def plain(pair):
    """The engine's greedy tokens without speculation."""
    target, _, tok = pair
    outs = lab.Engine(target, tok, max_batch_size=16).generate(PROMPTS16, max_new_tokens=LENGTHS16, stop_at_eos=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("setting", [
    dict(num_speculative_tokens=3),
    dict(num_speculative_tokens=4, block_size=4, num_blocks=40),                        # KV pressure: preempts
    dict(num_speculative_tokens=2, block_size=4, num_blocks=40, enable_prefix_caching=True),
    dict(num_speculative_tokens=3, draft="ngram"),
], ids=["draft", "draft-preempting", "draft-preempting-prefix-cache", "prompt-lookup"])
def test_sixteen_requests_get_the_tokens_they_get_without_speculation(pair, plain, setting):
    target, draft, tok = pair
    setting = {"draft": draft, **setting}
    engine = lab.Engine(target, tok, max_batch_size=16, **setting)
    outs = engine.generate(PROMPTS16, max_new_tokens=LENGTHS16, stop_at_eos=False)
    assert [o.token_ids for o in outs] == plain
    stats = outs.stats
    assert 0 < stats.accepted_tokens <= stats.judged_tokens <= stats.draft_tokens
    assert stats.tokens_per_round > 1 and "draft acceptance" in stats.summary()
    if "num_blocks" in setting:
        assert stats.preemptions > 0
    assert engine.blocks.num_free == engine.blocks.capacity


def test_stop_tokens_inside_an_accepted_draft_end_the_request_there(pair):
    target, draft, tok = pair
    newline = tok.encode("\n", add_special_tokens=False)
    kw = dict(max_new_tokens=30, stop_token_ids=newline, stop_at_eos=True)
    plain = lab.Engine(target, tok, max_batch_size=8).generate(PROMPTS[:8], **kw)
    spec = lab.Engine(target, tok, max_batch_size=8, draft=draft, num_speculative_tokens=4).generate(PROMPTS[:8], **kw)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert any(o.token_ids[-1] in newline and len(o.token_ids) < 30 for o in spec)


def test_sampled_requests_decode_beside_speculating_ones_unchanged(pair):
    target, draft, tok = pair
    params = [lab.SamplingParams(max_new_tokens=12, temperature=1.0, seed=i, stop_at_eos=False) if i % 2 else
              lab.SamplingParams(max_new_tokens=12, stop_at_eos=False) for i in range(6)]
    plain = lab.Engine(target, tok, max_batch_size=6).generate(PROMPTS[:6], params)
    spec = lab.Engine(target, tok, max_batch_size=6, draft=draft, num_speculative_tokens=3).generate(PROMPTS[:6], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec.stats.spec_rounds > 0


def test_a_request_that_cannot_be_served_fails_alone(pair):
    target, draft, tok = pair
    engine = lab.Engine(target, tok, max_batch_size=4, block_size=4, num_blocks=12, draft=draft, num_speculative_tokens=3)
    outs = engine.generate(["x = 1", PROMPTS[-1], "def f():"], max_new_tokens=[5, 40, 5], stop_at_eos=False)
    assert [o.ok for o in outs] == [True, False, True] and "KV blocks" in outs[1].error
    assert outs.stats.completed == 2 and len(outs[0].token_ids) == 5


def test_bad_drafts_and_draft_lengths_are_refused_when_the_engine_is_built(pair):
    target, draft, tok = pair
    config = get_preset("tiny")
    config.vocab_size = 100
    other = Transformer(config)
    with pytest.raises(ValueError, match="vocabulary"):
        lab.Engine(target, tok, draft=other, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0"):
        lab.Engine(target, tok, draft=draft, num_speculative_tokens=-1)
    with pytest.raises(TypeError, match="num_speculative_tokens must be an integer >= 0"):
        lab.Engine(target, tok, draft=draft, num_speculative_tokens=True)
    with pytest.raises(ValueError, match="needs a draft"):
        lab.Engine(target, tok, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens is 0"):
        lab.Engine(target, tok, draft=draft)
    with pytest.raises(ValueError, match="'ngram'"):
        lab.Engine(target, tok, draft="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="dtype"):
        lab.Engine(target, tok, draft=copy.deepcopy(draft).to(torch.bfloat16), num_speculative_tokens=2)


def test_the_drafts_paged_cache_holds_what_the_draft_computes_alone(pair):
    from infopt_lab.kv_cache import KVCache
    target, draft, tok = pair
    engine = lab.Engine(target, tok, max_batch_size=3, block_size=4, draft=draft, num_speculative_tokens=3,
                        max_num_batched_tokens=24)                       # prompts prefilled in chunks
    for p in PROMPTS[-3:]:
        engine.add_request(p, lab.SamplingParams(max_new_tokens=20, stop_at_eos=False))
    pool = engine.speculator.draft.cache
    for _ in range(8):
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.draft_computed
            alone = KVCache.for_model(draft, 1, n)
            draft(torch.tensor([seq.all_ids[:n]]), torch.arange(n), alone)
            slots = [engine.blocks.slot(seq.seq_id, p) for p in range(n)]
            for layer in range(draft.config.n_layers):
                paged = pool.k[layer].view(-1, *pool.k.shape[-2:])[slots]    # (n, H_kv, D)
                torch.testing.assert_close(paged, alone.k[layer, 0, :, :n].transpose(0, 1))


def test_acceptance_does_not_depend_on_the_batch(pair):
    target, draft, tok = pair
    counts = []
    for b in (1, 4):
        engine = lab.Engine(target, tok, max_batch_size=b, draft=draft, num_speculative_tokens=3)
        engine.generate(PROMPTS[:4], max_new_tokens=24, stop_at_eos=False)
        counts.append([(s.accepted_tokens, s.draft_tokens) for s in engine.sequences.values()])
    assert counts[0] == counts[1]
