"""The int8 KV caches: the engine's paged pool rounds as the contiguous one does, and serves the same tokens."""
import pytest
import torch

import infopt_lab as lab
from infopt_lab.kv_cache import PagedKVCache
from infopt_lab.kv_quant import QuantizedKVCache, QuantizedPagedKVCache
from infopt_lab.quality import greedy_ids


@pytest.fixture(scope="module")
def target():
    return lab.load_model("target", dtype=torch.float32)


def test_the_paged_pool_stores_what_the_contiguous_cache_stores(target):
    model, _ = target
    config = model.config
    torch.manual_seed(0)
    k, v = (torch.randn(1, config.n_kv_heads, 10, config.head_dim) * 3 for _ in range(2))   # (B, H_kv, T, D)
    contiguous = QuantizedKVCache(config, 1, 16)
    ck, cv = contiguous.update(0, torch.arange(10), k, v)                                     # (1, H_kv, 10, D)
    paged = QuantizedPagedKVCache(config, num_blocks=4, block_size=4)
    slots = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15, 8, 9])                                # blocks 1, 3, 2
    paged.write(0, slots, k[0].transpose(0, 1), v[0].transpose(0, 1))                         # (T, H_kv, D)
    pk, pv = paged.gather(0, torch.tensor([[1, 3, 2]]))                                       # (1, H_kv, 12, D)
    assert torch.equal(pk[:, :, :10], ck) and torch.equal(pv[:, :, :10], cv)
    fp32 = PagedKVCache(config, num_blocks=4, block_size=4)
    assert paged.nbytes < 0.3 * fp32.nbytes


def test_an_int8_engine_serves_the_tokens_of_int8_cached_decoding(target):
    model, tok = target
    prompts = ["def fib(n):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef walk(root):"]
    alone = [greedy_ids(model, tok, p, 16, QuantizedKVCache.for_model) for p in prompts]
    engine = lab.Engine(model, tok, max_batch_size=3, block_size=4, kv_cache_dtype="int8")
    outs = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False)
    assert [o.token_ids for o in outs] == alone
    assert isinstance(engine.cache, QuantizedPagedKVCache) and not engine.runner.paged_kernel


def test_int8_kv_works_with_prefix_caching_and_speculation(target):
    model, tok = target
    draft, _ = lab.load_model("draft", dtype=torch.float32)
    prompts = ["x = 1\n" * 8 + q for q in ("def f():", "def g():", "class A:")]
    plain = lab.Engine(model, tok, max_batch_size=3, block_size=4, kv_cache_dtype="int8").generate(
        prompts, max_new_tokens=12, stop_at_eos=False)
    engine = lab.Engine(model, tok, max_batch_size=3, block_size=4, kv_cache_dtype="int8", enable_prefix_caching=True,
                        draft=draft, num_speculative_tokens=3)
    for _ in range(2):                                     # cold, then with the prompts' blocks cached
        both = engine.generate(prompts, max_new_tokens=12, stop_at_eos=False)
        assert [o.token_ids for o in both] == [o.token_ids for o in plain]
    assert both.stats.prefix_hit_tokens > 0 and both.stats.draft_tokens > 0


def test_an_unknown_kv_cache_dtype_is_refused(target):
    model, tok = target
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        lab.Engine(model, tok, kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("shape", [(9, 4, 3, 8), (9, 5, 3, 7)], ids=["even", "odd"])
def test_blocks_are_copied_whole_and_equal_indexing(dtype, shape):
    from infopt_lab.kv_cache import take_blocks
    pool = (torch.randn(*shape) * 50).to(dtype)                       # (N_blocks, block_size, H_kv, D)
    tables = torch.tensor([[3, 1, 4], [1, 5, 0]])
    got = take_blocks(pool, tables)
    assert got.dtype == dtype and torch.equal(got, pool[tables])
