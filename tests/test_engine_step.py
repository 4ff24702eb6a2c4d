"""One writer of per-step state: the model runner and the speculator return data; the scheduler alone applies it."""
import copy

import pytest
import torch

import infopt_lab as lab
from infopt_lab.engine import BlockManager, ModelRunner
from test_engine import PROMPTS


@pytest.fixture(scope="module")
def pair():
    target, tok = lab.load_model("target", dtype=torch.float32)
    draft, _ = lab.load_model("draft", dtype=torch.float32)
    return target, draft, tok


def snapshot(engine) -> dict:
    """Everything a step may change: every sequence's fields and the block manager's tables, counts and cache."""
    seqs = {i: {k: copy.deepcopy(v) for k, v in vars(s).items() if k not in ("generator", "params")}
            for i, s in engine.sequences.items()}
    b = engine.blocks
    blocks = copy.deepcopy((b.tables, b.num_tokens, b.refs, b.cached, b.keys, list(b.free_blocks),
                            list(b.evictable)))
    return {"sequences": seqs, "blocks": blocks, "running": [s.seq_id for s in engine.scheduler.running],
            "waiting": [s.seq_id for s in engine.scheduler.waiting]}


def spy_on(engine, executor, seen: list) -> None:
    """Wrap `executor.execute_model` to record the state before and after each call, and what it returned."""
    run = executor.execute_model

    def spied(batch, sample):
        before = snapshot(engine)
        outputs = run(batch, sample)
        seen.append((before, snapshot(engine), batch, outputs))
        return outputs
    executor.execute_model = spied


@pytest.mark.parametrize("draft", [None, "model", "ngram"])
def test_the_runner_and_the_speculator_leave_every_sequence_unchanged(pair, draft):
    target, draft_model, tok = pair
    kw = {} if draft is None else dict(draft=draft_model if draft == "model" else draft, num_speculative_tokens=3)
    engine = lab.Engine(target, tok, max_batch_size=4, block_size=4, num_blocks=60, enable_prefix_caching=True,
                        **kw)
    executor = engine.runner if draft is None else engine.speculator
    seen = []
    spy_on(engine, executor, seen)
    prompts = PROMPTS[:6] + PROMPTS[:2]                     # repeats: prefix-cache hits and commits
    for p in prompts:
        engine.add_request(p, lab.SamplingParams(max_new_tokens=12, stop_at_eos=False))
    while engine.has_unfinished():
        engine.step()
        before, after, batch, outputs = seen[-1]
        assert before == after, "execute_model changed engine state; only update_from_output may"
        for chunk in batch.chunks:                          # the scheduler applied exactly what was returned
            if not chunk.seq.done:
                assert chunk.seq.num_computed == chunk.start + outputs[chunk.seq].computed
    assert len(seen) > 3 and all(len(s.output_ids) == 12 for s in engine.sequences.values())
    if draft is not None:
        assert sum(o.drafted for *_, outs in seen for o in outs.values()) > 0


def test_update_from_output_alone_advances_the_sequences(pair):
    target, _, tok = pair
    engine = lab.Engine(target, tok, max_batch_size=2)
    engine.add_request(PROMPTS[0], lab.SamplingParams(max_new_tokens=3, stop_at_eos=False))
    batch = engine.scheduler.schedule(engine.now())
    seq = batch.chunks[0].seq
    outputs = engine.runner.execute_model(batch, engine._sample)
    assert seq.num_computed == 0 and seq.output_ids == []
    engine.scheduler.update_from_output(batch, outputs, engine.now())
    assert seq.num_computed == len(seq.prompt_ids) and seq.output_ids == outputs[seq].tokens


def test_update_from_output_stops_at_a_stop_token_inside_the_kept_tokens(pair):
    target, _, tok = pair
    engine = lab.Engine(target, tok, max_batch_size=2)
    engine.add_request(PROMPTS[0], lab.SamplingParams(max_new_tokens=10, stop_token_ids=(7,)))
    batch = engine.scheduler.schedule(engine.now())
    seq = batch.chunks[0].seq
    out = lab.engine.SeqOutput([5, 7, 9], computed=batch.chunks[0].num_tokens)
    finished = engine.scheduler.update_from_output(batch, {seq: out}, 1.0)
    assert finished == [seq] and seq.output_ids == [5, 7] and seq.status is lab.engine.Status.FINISHED
    assert engine.blocks.num_used == 0


def test_the_pool_owns_the_block_size(pair):
    target, _, tok = pair
    engine = lab.Engine(target, tok, block_size=8, num_blocks=10)
    assert engine.blocks.block_size == engine.cache.block_size == 8
    assert engine.blocks.num_blocks == engine.cache.num_blocks == 10
    with pytest.raises(ValueError, match="BlockManager.for_pool"):
        ModelRunner(target, engine.cache, BlockManager(10, 4))


# -- streaming and aborting: what a server needs from the loop -------------------------------------------
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_step_tokens_add_up_to_each_output(pair, policy):
    """The tokens each step reports per request, joined in order, are exactly the request's output."""
    target, _, tok = pair
    engine = lab.Engine(target, tok, scheduler=policy, max_batch_size=3, max_num_batched_tokens=16)
    lengths = [5, 9, 3, 7]
    ids = [engine.add_request(p, lab.SamplingParams(max_new_tokens=n, stop_at_eos=False))
           for p, n in zip(PROMPTS, lengths)]
    streamed, finished = {i: [] for i in ids}, {}
    while engine.has_unfinished():
        outs = engine.step()
        for i, toks in engine.step_tokens.items():
            streamed[i] += toks
        finished.update({o.request_id: o.token_ids for o in outs})
    assert streamed == finished
    assert [len(streamed[i]) for i in ids] == lengths


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_abort_frees_blocks_at_the_next_step_and_others_are_unchanged(pair, policy):
    target, _, tok = pair
    params = lab.SamplingParams(max_new_tokens=12, stop_at_eos=False)
    alone = lab.Engine(target, tok, scheduler=policy, max_batch_size=4).generate(PROMPTS[:3], params)
    engine = lab.Engine(target, tok, scheduler=policy, max_batch_size=4)
    idle = engine.blocks.num_used
    ids = [engine.add_request(p, params) for p in PROMPTS[:4]]
    engine.step()
    engine.step()
    engine.abort_request(ids[3])                      # running: it holds blocks
    assert ids[3] in engine.sequences                 # nothing happens before the next step
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert ids[3] not in engine.sequences
    assert sorted(o.request_id for o in outs) == ids[:3]
    assert [o.token_ids for o in sorted(outs, key=lambda o: o.request_id)] == [o.token_ids for o in alone]
    assert engine.blocks.num_used == idle


def test_abort_of_a_queued_request_and_release(pair):
    target, _, tok = pair
    engine = lab.Engine(target, tok, max_batch_size=1)
    a = engine.add_request("x = 1", lab.SamplingParams(max_new_tokens=3))
    b = engine.add_request("import os", lab.SamplingParams(max_new_tokens=3))
    engine.abort_request(b)                           # still queued behind a
    with pytest.raises(ValueError, match=f"request {a} has not finished"):
        engine.release(a)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [a]
    engine.release(a)
    assert engine.sequences == {} and engine.blocks.num_used == 0
    assert engine.add_request("x", lab.SamplingParams(max_new_tokens=1)) == b + 1   # ids are never reused
