"""Batch-invariant mode: a row's logits do not depend on how many rows share its pass, bit for bit, in every dtype."""
import copy

import pytest
import torch

import infopt_lab as lab
from infopt_lab import speculative as sp
from infopt_lab.invariant import BatchInvariant, attention_by_query
from infopt_lab.kv_cache import KVCache
from test_engine import LENGTHS, PROMPTS

PROMPT = "def read_config(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def pair():
    target, tok = lab.load_model("target", dtype=torch.float32)
    draft, _ = lab.load_model("draft", dtype=torch.float32)
    return target, draft, tok


def precision(target, draft, name):
    """The pair in one precision: fp32, bf16 (both models), or an int8 target with the fp32 draft."""
    if name == "bf16":
        return copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16)
    if name in ("int8", "int4"):
        kw = {"group_size": 32} if name == "int4" else {}
        return lab.quantize_model(target, name, **kw), draft
    return target, draft


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4"])
def test_a_pass_over_many_rows_equals_one_row_passes_bit_for_bit(pair, name):
    target, draft, tok = pair
    model, _ = precision(target, draft, name)
    ids = torch.tensor([tok.encode(PROMPT)])
    T, p = ids.shape[1], 6
    many_cache, one_cache = KVCache.for_model(model, 1, 64), KVCache.for_model(model, 1, 64)
    with torch.inference_mode(), BatchInvariant():
        model(ids[:, :p], torch.arange(p), many_cache)
        model(ids[:, :p], torch.arange(p), one_cache)
        many = model(ids[:, p:], torch.arange(p, T), many_cache)[0]                    # (T - p, V) in one pass
        one = torch.cat([model(ids[:, i:i + 1], torch.tensor([i]), one_cache)[0] for i in range(p, T)])
    assert torch.equal(many, one)


def test_attention_by_query_equals_sdpa_and_refuses_what_it_cannot_split():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + 4                     # bottom-right causal
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(attention_by_query(q, k, v, attn_mask=mask, enable_gqa=True), want, atol=1e-6)
    holes = mask.clone()
    holes[:, 0] = False                                                                 # not a prefix of the keys
    with pytest.raises(ValueError, match="prefix of the keys"):
        attention_by_query(q, k, v, attn_mask=holes, enable_gqa=True)
    with pytest.raises(ValueError, match="boolean masks"):
        attention_by_query(q, k, v, attn_mask=mask.float(), enable_gqa=True)


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8"])
def test_speculative_greedy_equals_generate_bit_for_bit(pair, name):
    target, draft, tok = pair
    t, d = precision(target, draft, name)
    for prompt in PROMPTS[:4 if name != "bf16" else 2]:                 # bf16 matmuls are slow on most CPUs
        want = lab.generate(t, tok, prompt, max_new_tokens=32, batch_invariant=True).token_ids
        ids = torch.tensor([tok.encode(prompt)])
        for k in (2, 3, 5):
            got = sp.speculative_generate(t, d, ids, max_new_tokens=32, k=k, batch_invariant=True)
            assert got.token_ids == want, (prompt, k)
        assert sp.prompt_lookup_generate(t, ids, max_new_tokens=32, k=3, batch_invariant=True).token_ids == want


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_the_batched_engine_equals_one_request_alone_bit_for_bit(pair, name):
    target, draft, tok = pair
    t, d = precision(target, draft, name)
    n = 16 if name == "fp32" else 8                                   # bf16 matmuls are slow on most CPUs
    prompts, lengths = PROMPTS[:n], LENGTHS[:n]
    want = [lab.generate(t, tok, p, max_new_tokens=n, stop_at_eos=False, batch_invariant=True).token_ids
            for p, n in zip(prompts, lengths)]
    settings = [dict(draft=d, num_speculative_tokens=3)] if name == "fp32" else [dict(block_size=4, num_blocks=60)]
    for kw in [{}] + settings:                                     # speculating; preempting under KV pressure
        engine = lab.Engine(t, tok, max_batch_size=16, batch_invariant=True, **kw)
        outs = engine.generate(prompts, max_new_tokens=lengths, stop_at_eos=False)
        assert [o.token_ids for o in outs] == want, kw


def test_modes_that_read_many_rows_at_once_are_refused(pair):
    target, _, tok = pair
    with pytest.raises(ValueError, match="choose one"):
        lab.Engine(target, tok, cascade_attention=True, batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant must be True or False"):
        lab.Engine(target, tok, batch_invariant=1)
    with pytest.raises(TypeError, match="batch_invariant must be True or False"):
        lab.generate(target, tok, "x = 1", max_new_tokens=2, batch_invariant="yes")
    assert not lab.Engine(target, tok, batch_invariant=True).runner.paged_kernel
