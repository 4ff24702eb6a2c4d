"""Prefix caching: shared blocks keyed by their prefix, reference counts, LRU eviction; outputs unchanged."""
import pytest
import torch

import infopt_lab as lab
from infopt_lab.engine import BlockManager
from infopt_lab.engine.block_manager import block_key

SYSTEM = ("You are a careful Python assistant. Answer with code only.\n"
          "Tools: read_file(path) -> str; write_file(path, text); run(cmd) -> (status, output).\n")
QUESTIONS = ["def fib(n):", "import os\n\n\ndef walk(root):", "class Stack:", "    for i in range(n):",
             "x = 1", "def main():", "import sys", "try:", "def join(a, *p):", "while True:"]
LENGTHS = [12, 5, 20, 9, 3, 16, 1, 7, 14, 10]


@pytest.fixture(scope="module")
def target():
    return lab.load_model("target", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(target):
    _, tok = target
    return [SYSTEM + q for q in QUESTIONS]


@pytest.fixture(scope="module")
def uncached(target, prompts):
    model, tok = target
    outs = lab.Engine(model, tok, max_batch_size=4, block_size=4).generate(
        prompts, max_new_tokens=LENGTHS, stop_at_eos=False)
    return [o.token_ids for o in outs]


def test_block_keys_name_the_whole_prefix():
    a = block_key(b"", [1, 2, 3, 4])
    assert block_key(b"", [1, 2, 3, 4]) == a and block_key(b"", [1, 2, 3, 5]) != a
    assert block_key(a, [5, 6, 7, 8]) != block_key(block_key(b"", [0, 2, 3, 4]), [5, 6, 7, 8])


def test_shared_blocks_are_counted_kept_and_evicted_least_recently_used():
    bm = BlockManager(num_blocks=7, block_size=2, enable_prefix_caching=True)   # blocks 1..6
    ids = [10, 11, 12, 13, 14]
    assert bm.match(ids) == []
    bm.allocate(0, 5)
    bm.commit(0, ids[:4])                                   # two full blocks of computed tokens
    assert bm.num_cached == 2
    hit = bm.match(ids)
    assert hit == bm.block_table(0)[:2]
    assert bm.match(ids[:4]) == hit[:1]                     # the last token is always computed
    bm.allocate(1, 5, hit)                                  # shares two blocks, takes one
    assert bm.refs[hit[0]] == 2 and bm.num_free == 6 - 4
    bm.free(0)
    bm.free(1)
    assert bm.num_free == 6 and bm.num_cached == 2          # kept, evictable
    assert bm.match(ids) == hit
    bm.allocate(2, 10)                                      # 5 blocks: the 4 uncached ones, then the LRU cached one
    assert bm.num_cached == 1 and hit[1] in bm.block_table(2)
    assert bm.match(ids) == hit[:1]                         # the tail went first; the shared head is still cached
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        BlockManager(4, 2, enable_prefix_caching=1)


def test_truncate_frees_the_tail_but_never_a_committed_block():
    bm = BlockManager(num_blocks=9, block_size=2, enable_prefix_caching=True)
    bm.allocate(0, 7)                                       # 4 blocks
    bm.commit(0, [1, 2, 3, 4])
    bm.truncate(0, 5)
    assert len(bm.block_table(0)) == 3 and bm.num_free == 5
    with pytest.raises(ValueError, match="committed"):
        bm.truncate(0, 3)


@pytest.mark.parametrize("pool", [dict(), dict(num_blocks=22)], ids=["roomy", "preempting"])
def test_outputs_are_identical_with_and_without_prefix_caching(target, prompts, uncached, pool):
    model, tok = target
    engine = lab.Engine(model, tok, max_batch_size=4, block_size=4, enable_prefix_caching=True, **pool)
    for run in range(2):                                    # cold, then warm: the cache outlives a generate
        outs = engine.generate(prompts, max_new_tokens=LENGTHS, stop_at_eos=False)
        assert [o.token_ids for o in outs] == uncached
        stats = outs.stats
        assert stats.prefix_hit_tokens > 0 and 0 < stats.prefix_hit_rate < 1
        assert stats.prefix_blocks_saved == stats.prefix_hit_tokens // 4
        assert "prefix cache hits" in stats.summary()
    if pool:
        assert stats.preemptions > 0
    assert engine.blocks.num_free == engine.blocks.capacity


def test_a_warm_cache_skips_the_shared_system_prompt(target, prompts):
    model, tok = target
    engine = lab.Engine(model, tok, max_batch_size=1, block_size=4, enable_prefix_caching=True)
    engine.generate(prompts[:1], max_new_tokens=2, stop_at_eos=False)
    outs = engine.generate(prompts[1:], max_new_tokens=2, stop_at_eos=False)
    shared = len(tok.encode(SYSTEM)) - 1                    # the system prompt's tokens, less a boundary merge
    assert outs.stats.prefix_hit_tokens >= len(prompts[1:]) * (shared // 4 * 4 - 4)


def test_without_prefix_caching_nothing_is_looked_up(target, prompts):
    model, tok = target
    outs = lab.Engine(model, tok, block_size=4).generate(prompts[:3], max_new_tokens=2)
    assert outs.stats.prefix_lookup_tokens == 0 and outs.stats.prefix_hit_tokens == 0
    assert "prefix cache" not in outs.stats.summary()


def test_cascade_attention_reads_the_shared_prefix_once_and_keeps_the_tokens(target, prompts, uncached,
                                                                             monkeypatch):
    from infopt_lab.engine import model_runner
    model, tok = target
    calls = []
    attend = model_runner.shared_prefix_attend

    def counted(q, k_prefix, *rest):
        calls.append(k_prefix.shape[2])                      # the shared prefix's keys, read once for the batch
        return attend(q, k_prefix, *rest)
    monkeypatch.setattr(model_runner, "shared_prefix_attend", counted)
    monkeypatch.setattr(model_runner, "CASCADE_MIN_TOKENS", 8)
    for cascade in (False, True):
        engine = lab.Engine(model, tok, max_batch_size=4, block_size=4, enable_prefix_caching=True,
                            cascade_attention=cascade)
        outs = engine.generate(prompts, max_new_tokens=LENGTHS, stop_at_eos=False)
        assert [o.token_ids for o in outs] == uncached
        assert bool(calls) == cascade                        # taken only when asked for
    assert min(calls) >= 8 and max(calls) <= len(tok.encode(SYSTEM))


def test_cascade_attention_is_a_switch(target):
    model, tok = target
    with pytest.raises(TypeError, match="cascade_attention must be True or False"):
        lab.Engine(model, tok, cascade_attention="yes")
