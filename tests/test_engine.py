"""The engine: batched == one request at a time, paged cache bookkeeping, preemption, bad input."""
import pytest
import torch

import infopt_lab as lab
from infopt_lab import batching
from infopt_lab.engine import BlockManager, OutOfBlocks

PROMPTS = ["def fib(n):", "import os\n\n\ndef read_file(path):", "class Stack:\n    def __init__(self):",
           "    for i in range(len(items)):", "x = 1", "def main():\n    args = parse_args()",
           "import sys", "    return self._cache[key]", "try:\n    import threading",
           "def _check(value, name):\n    if value is None:", "class Error(Exception):", "    @property",
           "SEP = '/'", "def join(a, *p):", "    if not isinstance(path, str):", "from collections import deque",
           "    def __repr__(self):", "while True:",
           "def copyfile(src, dst, *, follow_symlinks=True):\n    \"\"\"Copy data from src to dst in the most "
           "efficient way possible.\n\n    If follow_symlinks is not set and src is a symbolic link, a new\n"
           "    symlink will be created instead of copying the file it points to.\n    \"\"\""]
LENGTHS = [20, 5, 33, 12, 40, 7, 1, 25, 16, 3, 28, 9, 14, 31, 2, 18, 22, 11, 24]


@pytest.fixture(scope="module")
def target():
    # fp32 on every device: equality with one-request decoding is exact only without 16-bit rounding
    return lab.load_model("target", dtype=torch.float32)


@pytest.fixture(scope="module")
def alone(target):
    """Each request's greedy tokens from lab.generate, one request at a time."""
    model, tok = target
    return [lab.generate(model, tok, p, max_new_tokens=n, stop_at_eos=False).token_ids
            for p, n in zip(PROMPTS, LENGTHS)]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_batched_engine_equals_one_request_at_a_time(target, alone, policy):
    model, tok = target
    engine = lab.Engine(model, tok, scheduler=policy, max_batch_size=6, max_num_batched_tokens=24)
    outs = engine.generate(PROMPTS, max_new_tokens=LENGTHS, stop_at_eos=False)
    assert [o.token_ids for o in outs] == alone
    assert all(o.ok and o.ttft_s <= o.e2e_s for o in outs)
    stats = outs.stats
    assert stats.completed == len(PROMPTS) and stats.generated_tokens == sum(LENGTHS)
    assert stats.preemptions == 0 and stats.kv_blocks_peak <= stats.kv_blocks_total
    assert any(kind == "prefill" for r in stats.timeline for *_, kind in r.rows)
    assert len(tok.encode(PROMPTS[-1])) > 24                 # the last prompt is prefilled in chunks
    if policy == "continuous":
        assert stats.utilization == 1.0
    else:
        assert stats.utilization < 1.0 and stats.padding_rows > 0


def test_preemption_recomputes_and_keeps_every_token(target, alone):
    model, tok = target
    engine = lab.Engine(model, tok, max_batch_size=8, block_size=4, num_blocks=28)
    outs = engine.generate(PROMPTS, max_new_tokens=LENGTHS, stop_at_eos=False)
    assert [o.token_ids for o in outs] == alone
    assert outs.stats.preemptions > 0 and outs.stats.recomputed_tokens > 0
    assert sum(o.preemptions for o in outs) == outs.stats.preemptions
    assert outs.stats.kv_blocks_peak <= 27 and engine.blocks.num_free == 27


def test_engine_on_the_seeds_mix_measures_the_seeds_utilization(tiny):
    model, tok = tiny
    lengths = [10, 50, 15, 100, 20, 12, 80, 18]
    engine = lab.Engine(model, tok, scheduler="static", max_batch_size=4)
    outs = engine.generate(["x = 1"] * 8, max_new_tokens=lengths, stop_at_eos=False)
    assert outs.stats.utilization == pytest.approx(batching.static_batch_utilization(lengths, 4))
    assert f"{outs.stats.utilization:.1%}" == "42.4%"


def test_a_request_that_can_never_fit_fails_alone(tiny):
    model, tok = tiny
    engine = lab.Engine(model, tok, max_batch_size=4, block_size=16, num_blocks=9)   # 8 blocks = 128 tokens
    outs = engine.generate(["x = 1", "y = 2", "z = 3", "", [0, 5, 99999]], max_new_tokens=[8, 253, 200, 4, 4],
                           stop_at_eos=False)
    assert outs[0].ok and len(outs[0].token_ids) == 8
    assert "context of 256 tokens" in outs[1].error and outs[1].token_ids == []
    assert "KV blocks" in outs[2].error and "num_blocks" in outs[2].error
    assert "empty" in outs[3].error
    assert "token ids must be in [0, 4096)" in outs[4].error
    assert outs.stats.completed == 1 and outs.stats.failed == 4


def test_engine_rejects_bad_settings(tiny):
    model, tok = tiny
    assert lab.Engine(model, tok).generate([]) == []
    with pytest.raises(ValueError, match="max_batch_size"):
        lab.Engine(model, tok, max_batch_size=0)
    with pytest.raises(ValueError, match="scheduler"):
        lab.Engine(model, tok, scheduler="fifo")
    with pytest.raises(ValueError, match="num_blocks"):
        lab.Engine(model, tok, num_blocks=1)
    engine = lab.Engine(model, tok)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(["x"], temperature=-1)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(["x", "y"], max_new_tokens=[3])
    with pytest.raises(TypeError, match="list"):
        engine.generate("x = 1")


def test_sampling_does_not_depend_on_the_batch(tiny):
    model, tok = tiny
    prompts = ["x = 1", "def f():", "import os", "class A:"]
    kw = dict(max_new_tokens=10, temperature=1.0, seed=3, stop_at_eos=False)
    together = lab.Engine(model, tok, max_batch_size=4).generate(prompts, **kw)
    one_slot = lab.Engine(model, tok, max_batch_size=1).generate(prompts, **kw)
    assert [o.token_ids for o in together] == [o.token_ids for o in one_slot]


def test_block_manager_allocates_appends_and_frees():
    bm = BlockManager(num_blocks=6, block_size=4)            # blocks 1..5 usable
    assert bm.allocate(7, 5) == [1, 2] and bm.num_free == 3
    assert bm.append(7) == [1, 2]                            # 6 tokens: still two blocks
    bm.append(7, 2)                                          # 8 tokens
    assert len(bm.block_table(7)) == 2 and bm.slot(7, 5) == 2 * 4 + 1
    assert len(bm.append(7)) == 3                            # the 9th token opens a block
    with pytest.raises(OutOfBlocks):
        bm.allocate(8, 9)                                    # needs 3, 2 are free
    assert bm.num_free == 2 and 8 not in bm.tables           # nothing changed
    with pytest.raises(ValueError, match="already"):
        bm.allocate(7, 1)
    with pytest.raises(KeyError):
        bm.append(99)
    bm.free(7)
    assert bm.num_free == 5 and sorted(bm.allocate(8, 20)) == [1, 2, 3, 4, 5]


def test_simulator_matches_the_seed_and_continuous_never_pads():
    lengths = [10, 50, 15, 100, 20, 12, 80, 18]
    static = batching.simulate(lengths, 4, "static")
    cont = batching.simulate(lengths, 4, "continuous")
    assert static.utilization == pytest.approx(batching.static_batch_utilization(lengths, 4))
    assert cont.utilization == 1.0 and cont.steps < static.steps
    assert cont.latency_steps[:4] == [10, 50, 15, 100]       # the first four start at once
    assert max(cont.latency_steps) <= max(static.latency_steps)
    with pytest.raises(ValueError, match="batch_size"):
        batching.static_batch_utilization(lengths, 0)
    with pytest.raises(ValueError, match=">= 1"):
        batching.static_batch_utilization([3, 0], 2)


def test_continuous_schedule_step_respects_slots_and_budget():
    running = [{"id": 0, "prompt_len": 5, "remaining": 0}, {"id": 1, "prompt_len": 5, "remaining": 3}]
    waiting = [{"id": 2, "prompt_len": 6, "remaining": 4}, {"id": 3, "prompt_len": 9, "remaining": 2},
               {"id": 4, "prompt_len": 1, "remaining": 1}]
    run, wait, retired = batching.continuous_schedule_step(running, waiting, max_slots=4, token_budget=12)
    assert [r["id"] for r in retired] == [0]
    assert [r["id"] for r in run] == [1, 2]                  # 1 + 6 = 7 of 12; request 3 (9) does not fit
    assert [r["id"] for r in wait] == [3, 4]                 # and request 4 may not overtake it


def test_arrivals_out_of_order_are_served_first_come_first_served(tiny):
    model, tok = tiny
    engine = lab.Engine(model, tok, max_batch_size=1)
    outs = engine.generate(["x = 1", "y = 2", "z = 3"], max_new_tokens=2, stop_at_eos=False, arrival_s=[0.2, 0.0, 0.1])
    first = [min(o.token_times_s) + a for o, a in zip(outs, [0.2, 0.0, 0.1])]
    assert [o.request_id for o in outs] == [0, 1, 2]
    assert first[1] < first[2] < first[0]                        # served in arrival order, reported in prompt order


def test_a_failed_generate_leaves_the_engine_as_new(tiny):
    model, tok = tiny
    kw = dict(max_new_tokens=[6, 9, 4], stop_at_eos=False)
    fresh = lab.Engine(model, tok, max_batch_size=2, block_size=4).generate(["a = 1", "b = 2", "c = 3"], **kw)
    engine = lab.Engine(model, tok, max_batch_size=2, block_size=4)
    for bad in [dict(arrival_s=[0.0, float("nan"), 0.0]), dict(arrival_s=[0.0, -1.0, 0.0]), dict(temperature=float("nan"))]:
        with pytest.raises(ValueError):
            engine.generate(["a = 1", "b = 2", "c = 3"], **{**kw, **bad})
        assert engine.blocks.num_free == engine.blocks.capacity and not engine.has_unfinished()
    again = engine.generate(["a = 1", "b = 2", "c = 3"], **kw)
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]


def test_an_exception_mid_run_leaves_the_engine_as_new(tiny, monkeypatch):
    model, tok = tiny
    prompts, kw = ["a = 1", "b = 2", "c = 3"], dict(max_new_tokens=[6, 9, 4], stop_at_eos=False)
    fresh = lab.Engine(model, tok, max_batch_size=2, block_size=4).generate(prompts, **kw)
    engine = lab.Engine(model, tok, max_batch_size=2, block_size=4)
    run, calls = engine.runner.execute_model, []

    def failing(batch, sample):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the device went away")
        return run(batch, sample)
    monkeypatch.setattr(engine.runner, "execute_model", failing)
    with pytest.raises(RuntimeError, match="went away"):
        engine.generate(prompts, **kw)
    assert engine.blocks.num_free == engine.blocks.capacity and not engine.has_unfinished()
    assert [o.token_ids for o in engine.generate(prompts, **kw)] == [o.token_ids for o in fresh]


def test_generate_never_drops_requests_added_by_hand(tiny):
    model, tok = tiny
    engine = lab.Engine(model, tok)
    engine.add_request("x = 1", lab.SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="have not finished"):
        engine.generate(["y = 2"], max_new_tokens=2)
    assert engine.has_unfinished()                          # still queued, nothing lost
    while engine.has_unfinished():
        engine.step()
    assert engine.generate(["y = 2"], max_new_tokens=2, stop_at_eos=False)[0].ok


def test_default_pool_is_sized_by_max_model_len_not_the_whole_context(tiny):
    from infopt_lab.engine.llm_engine import DEFAULT_MAX_MODEL_LEN
    model, tok = tiny
    engine = lab.Engine(model, tok, max_batch_size=2, block_size=16, max_model_len=40)
    assert engine.blocks.capacity == 2 * 3                                   # 40 tokens -> 3 blocks per slot
    out = engine.generate(["def f(x):"], max_new_tokens=8)
    assert len(out[0].token_ids) >= 1
    default = lab.Engine(model, tok, max_batch_size=2, block_size=16)
    assert default.max_model_len == min(model.config.max_seq_len, DEFAULT_MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="max_model_len"):
        lab.Engine(model, tok, max_model_len=model.config.max_seq_len + 1)


# -- the paged decode kernel, per model -----------------------------------------------------------------
@pytest.mark.skipif(not lab.HAS_TRITON, reason="Triton is not installed, so there is no paged kernel")
def test_paged_kernel_runs_per_model_where_its_shape_allows(target):
    """The target (head dim 32) decodes through the kernel (interpreted on a CPU); the bundled draft (head dim 24,
    not a power of two) through the gather path; the tokens are the gather path's."""
    model, tok = target
    draft, _ = lab.load_model("draft", dtype=torch.float32)
    assert model.config.head_dim & (model.config.head_dim - 1) == 0 and draft.config.head_dim == 24
    prompts, news = PROMPTS[:4], [6, 3, 5, 2]
    runs = {}
    for paged_kernel in (True, False):
        engine = lab.Engine(model, tok, max_batch_size=4, draft=draft, num_speculative_tokens=2,
                            paged_kernel=paged_kernel)
        outs = engine.generate(prompts, max_new_tokens=news, stop_at_eos=False)
        runs[paged_kernel] = [o.token_ids for o in outs], outs.stats.decode_attention
    (kernel_tokens, kernel_paths), (gather_tokens, gather_paths) = runs[True], runs[False]
    assert set(kernel_paths["target"]) == {"paged kernel"} and set(kernel_paths["draft"]) == {"gather"}
    assert set(gather_paths["target"]) == {"gather"} and set(gather_paths["draft"]) == {"gather"}
    assert kernel_tokens == gather_tokens
    engine = lab.Engine(model, tok, draft=draft, num_speculative_tokens=2, paged_kernel=True)
    assert engine.runner.gather_reason is None
    assert "head dim is 24" in engine.speculator.draft.gather_reason


def test_paged_kernel_is_on_by_default_only_where_it_compiles(target):
    model, tok = target
    engine = lab.Engine(model, tok)
    assert engine.runner.paged_kernel == (lab.HAS_TRITON and engine.device.type == "cuda")
    with pytest.raises(TypeError, match="paged_kernel"):
        lab.Engine(model, tok, paged_kernel="yes")
