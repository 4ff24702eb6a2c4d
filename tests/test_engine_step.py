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
