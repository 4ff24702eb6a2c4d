"""The agentic workload: seeded and within its bounds; run_sessions serves each turn as the conversation so far."""
import time

import numpy as np
import pytest
import torch

import infopt_lab as lab
from infopt_lab.engine.workload import AgenticWorkload, SessionRun, agentic_workload, run_sessions

SMALL = dict(sessions=3, turns=2, system_tokens=64, new_tokens=4)


@pytest.fixture(scope="module")
def target():
    # fp32: batched turns equal one request alone only without 16-bit rounding
    return lab.load_model("target", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(target):
    return target[1]


def test_the_same_seed_gives_the_same_workload_and_another_seed_another(tok):
    a, b, c = agentic_workload(tok, seed=0), agentic_workload(tok, seed=0), agentic_workload(tok, seed=1)
    assert a == b
    assert a.system_ids == c.system_ids                     # the shared preamble is fixed; the rest is drawn
    assert [s.start_s for s in a.sessions] != [s.start_s for s in c.sessions]
    assert [s.user_ids for s in a.sessions] != [s.user_ids for s in c.sessions]
    few = agentic_workload(tok, sessions=4, seed=0)         # session i depends on the seed and i only
    assert [s.user_ids for s in few.sessions] == [s.user_ids for s in a.sessions[:4]]


def test_the_default_workload_is_the_issues_and_describes_itself(tok):
    w = agentic_workload(tok)
    assert isinstance(w, AgenticWorkload)
    assert w.describe() == ("16 sessions x 3 turns, system prompt 512 tokens, user 10-40 tokens, 32 new tokens, "
                            "Poisson arrivals at 2.0 sessions/s, seed 0")
    assert len(w.sessions) == 16 and w.turns == 3 and w.total_turns == 48 and w.new_tokens == 32
    assert len(w.system_ids) == 512 and w.system_ids[0] == tok.bos_token_id
    assert tok.decode(list(w.system_ids)).startswith("<|endoftext|>You are a coding agent")
    lengths = [len(u) for s in w.sessions for u in s.user_ids]
    assert min(lengths) >= 10 and max(lengths) <= 40 and len(set(lengths)) > 5
    assert all(tok.bos_token_id not in u for s in w.sessions for u in s.user_ids)
    longest = max(sum(map(len, s.user_ids)) for s in w.sessions)
    assert w.max_seq_tokens == 512 + longest + 3 * 32


@pytest.mark.parametrize("system_tokens", [1, 64, 700])
def test_the_system_prompt_is_cut_to_exactly_system_tokens(tok, system_tokens):
    w = agentic_workload(tok, sessions=1, turns=1, system_tokens=system_tokens)
    assert len(w.system_ids) == system_tokens
    assert w.system_ids == agentic_workload(tok, sessions=1, turns=1, system_tokens=1000).system_ids[:system_tokens]


def test_arrivals_are_increasing_at_the_stated_rate(tok):
    w = agentic_workload(tok, sessions=400, turns=1, system_tokens=8, user_tokens=(1, 1), rate_per_s=4.0, seed=3)
    starts = np.array([s.start_s for s in w.sessions])
    assert starts[0] == 0.0 and np.all(np.diff(starts) > 0)
    assert np.diff(starts).mean() == pytest.approx(1 / 4.0, rel=0.15)   # 399 gaps: the mean is within ~5%


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sessions=0), ValueError, "sessions must be an integer >= 1, got 0"),
    (dict(turns=-1), ValueError, "turns must be an integer >= 1"),
    (dict(system_tokens=0), ValueError, "system_tokens must be an integer >= 1"),
    (dict(system_tokens=10**6), ValueError, "system_tokens must be at most"),
    (dict(user_tokens=(0, 5)), ValueError, r"user_tokens must hold integers in \[1, \d+\], got \[0\]"),
    (dict(user_tokens=(20, 10)), ValueError, r"user_tokens must be a pair \(lo, hi\) with 1 <= lo <= hi"),
    (dict(user_tokens=10), TypeError, r"user_tokens must be a list of integers, got int"),
    (dict(user_tokens=(1, 2, 3)), ValueError, r"user_tokens must hold exactly 2 integers, got 3"),
    (dict(user_tokens=(1, 10**6)), ValueError, r"user_tokens must hold integers in \[1, \d+\], got \[1000000\]"),
    (dict(new_tokens=0), ValueError, "new_tokens must be an integer >= 1"),
    (dict(rate_per_s=0), ValueError, "rate_per_s must be a finite number > 0"),
    (dict(rate_per_s=float("inf")), ValueError, "rate_per_s must be a finite number > 0"),
    (dict(rate_per_s=float("nan")), ValueError, "rate_per_s must be a finite number > 0"),
    (dict(seed=-1), ValueError, "seed must be an integer >= 0"),
    (dict(sessions=True), TypeError, "sessions must be an integer >= 1, got True"),
    (dict(turns=2.0), TypeError, "turns must be an integer >= 1, got 2.0"),
    (dict(rate_per_s=True), TypeError, "rate_per_s must be a finite number > 0, got True"),
])
def test_bad_arguments_are_refused_by_name(tok, kwargs, error, match):
    with pytest.raises(error, match=match):
        agentic_workload(tok, **kwargs)


@pytest.fixture(scope="module")
def small_run(target):
    model, tok = target
    workload = agentic_workload(tok, **SMALL, rate_per_s=0.05)     # sessions ~20 s apart: idle time to skip
    engine = lab.Engine(model, tok, max_batch_size=4)
    start = time.perf_counter()
    run = run_sessions(engine, workload)
    return engine, workload, run, time.perf_counter() - start


def test_every_turn_is_served_and_extends_the_conversation(small_run):
    engine, workload, run, seconds = small_run
    assert isinstance(run, SessionRun)
    assert [(t.session, t.turn) for t in run.turns] == [(i, j) for i in range(3) for j in range(2)]
    assert all(t.output.ok for t in run.turns) and len(run.ttft_s()) == 6
    for i, s in enumerate(workload.sessions):
        first, second = run.turns[2 * i].output, run.turns[2 * i + 1].output
        assert first.prompt_ids == list(workload.system_ids + s.user_ids[0])
        assert second.prompt_ids == first.prompt_ids + first.token_ids + list(s.user_ids[1])
        assert run.turns[2 * i + 1].prompt_len == len(second.prompt_ids)
        # the first turn arrives at the session's start, the second the moment the first finished
        assert engine.sequences[run.turns[2 * i].request_id].arrival_s == s.start_s
        assert engine.sequences[run.turns[2 * i + 1].request_id].arrival_s >= s.start_s + first.e2e_s
    stats = run.stats
    assert stats.completed == 6 and stats.generated_tokens == sum(len(t.output.token_ids) for t in run.turns)
    # the engine clock jumped over the idle gaps between sessions instead of waiting them out
    assert stats.wall_s >= workload.sessions[-1].start_s > seconds
    assert run.throughput_tok_s() == stats.generated_tokens / stats.wall_s
    assert run.summary().startswith("6/6 turns served, TTFT p50 ")


def test_each_turn_equals_its_prompt_served_alone(target, small_run):
    model, tok = target
    _, workload, run, _ = small_run
    alone = lab.Engine(model, tok).generate([t.output.prompt_ids for t in run.turns],
                                            max_new_tokens=workload.new_tokens)
    assert [o.token_ids for o in alone] == [t.output.token_ids for t in run.turns]


def test_a_refused_turn_ends_its_session(target):
    model, tok = target
    workload = agentic_workload(tok, sessions=2, turns=3, system_tokens=64, user_tokens=(10, 10), new_tokens=4)
    # 5 blocks of 16 hold a first turn (64 + 10 + 4 - 1 = 77 tokens) but no second (at least 88)
    engine = lab.Engine(model, tok, block_size=16, num_blocks=6)
    run = run_sessions(engine, workload)
    assert [(t.session, t.turn, t.output.ok) for t in run.turns] == [(0, 0, True), (0, 1, False),
                                                                      (1, 0, True), (1, 1, False)]
    assert "KV blocks" in run.turns[1].output.error
    assert run.stats.completed == 2 and run.stats.failed == 2 and len(run.ttft_s()) == 2


def test_a_busy_engine_is_refused_and_a_failed_run_leaves_it_empty(target, monkeypatch):
    model, tok = target
    workload = agentic_workload(tok, **SMALL)
    engine = lab.Engine(model, tok)
    engine.add_request("x = 1")
    with pytest.raises(ValueError, match="holds 1 request"):
        run_sessions(engine, workload)
    engine.abort_all()
    with pytest.raises(TypeError, match="engine must be a lab.Engine"):
        run_sessions(object(), workload)
    with pytest.raises(TypeError, match="workload must be an AgenticWorkload"):
        run_sessions(engine, [workload])

    calls = []
    step = engine.step

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        run_sessions(engine, workload)
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.capacity
