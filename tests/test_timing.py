"""infopt_lab.timing: timers, medians of repeated and interleaved runs, the probes, timed passes.

Every test drives the helpers with a fake clock, so each checks exactly what was
timed (which runs, in which order, how the seconds combine) and never wall-clock speed.
"""
from __future__ import annotations

import pytest
import torch

import infopt_lab as lab
from infopt_lab import timing


class FakeClock:
    """A clock that moves only when told (`advance`), or by `tick` seconds at every read."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick, self.reads = 0.0, tick, 0

    def __call__(self) -> float:
        self.reads += 1
        now = self.now
        self.now += self.tick
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def workload(clock: FakeClock, seconds: list[float], log: list | None = None, name: str = ""):
    """A function whose n-th call takes seconds[n] on `clock` (and logs `name` when given a log)."""
    durations = iter(seconds)

    def fn():
        clock.advance(next(durations))
        if log is not None:
            log.append(name)
    return fn


def test_timer_reads_the_clock_after_waiting_for_the_device_on_both_sides(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "synchronize", lambda device: events.append(("sync", device)))
    clock = FakeClock()

    def read():
        events.append("clock")
        return clock()

    with timing.Timer("cpu", clock=read) as t:
        clock.advance(0.25)
    assert t.seconds == 0.25
    assert events == [("sync", "cpu"), "clock", ("sync", "cpu"), "clock"]


def test_time_runs_leaves_out_the_warmup_runs():
    clock = FakeClock()
    fn = workload(clock, [100.0, 100.0, 3.0, 1.0, 2.0])
    assert timing.time_runs(fn, repeats=3, warmup=2, clock=clock) == [3.0, 1.0, 2.0]
    assert clock.reads == 6                          # two reads per timed run, none for the warm-up


@pytest.mark.parametrize("seconds, expected", [([100.0, 3.0, 1.0, 2.0], 2.0),        # odd: the middle run
                                               ([100.0, 1.0, 4.0, 2.0, 8.0], 3.0)])  # even: mean of the middle two
def test_time_fn_is_the_median_of_the_timed_runs(seconds, expected):
    clock = FakeClock()
    fn = workload(clock, seconds)
    assert lab.time_fn(fn, repeats=len(seconds) - 1, warmup=1, clock=clock) == expected


def test_interleaved_runs_alternate_the_contenders():
    clock, order = FakeClock(), []
    fns = {"a": workload(clock, [10.0, 1.0, 3.0, 2.0], order, "a"),
           "b": workload(clock, [20.0, 5.0, 4.0, 6.0], order, "b")}
    runs = timing.interleaved_runs(fns, repeats=3, warmup=1, clock=clock)
    assert order == ["a", "b"] * 4                   # one warm-up round, then three timed rounds, in turn
    assert runs == {"a": [1.0, 3.0, 2.0], "b": [5.0, 4.0, 6.0]}


def test_time_interleaved_gives_each_contender_its_median():
    clock = FakeClock()
    fns = {"x": workload(clock, [9.0, 0.5, 0.25, 0.75]), 4: workload(clock, [9.0, 2.0, 8.0, 4.0])}
    assert lab.time_interleaved(fns, repeats=3, warmup=1, clock=clock) == {"x": 0.5, 4: 4.0}


def test_fastest_keeps_the_quickest_run_with_its_payload():
    results = iter([(0.3, "first"), (0.1, "second"), (0.2, "third")])
    assert timing.fastest(lambda: next(results), repeats=3) == (0.1, "second")


@pytest.mark.parametrize("call, error, message", [
    (lambda: timing.time_runs(lambda: None, repeats=0), ValueError, "repeats must be an integer >= 1, got 0"),
    (lambda: timing.time_fn(lambda: None, warmup=-1), ValueError, "warmup must be an integer >= 0, got -1"),
    (lambda: timing.time_fn(lambda: None, repeats=2.0), TypeError, "repeats must be an integer >= 1, got 2.0"),
    (lambda: timing.interleaved_runs({}, repeats=2), ValueError, "fns is empty"),
    (lambda: timing.interleaved_runs({"a": lambda: None}, warmup=True), TypeError, "warmup must be an integer >= 0"),
    (lambda: timing.fastest(lambda: (0.0, None), repeats=0), ValueError, "repeats must be an integer >= 1"),
    (lambda: timing.median([]), ValueError, "median of an empty list"),
])
def test_timing_rejects_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


# -- the probes: the workload's size over the (fake) time it took --------------------------------
def test_bandwidth_probe_counts_a_read_and_a_write_of_the_buffer():
    clock = FakeClock(tick=2**-10)                   # every timed copy takes 1/1024 s
    gbs = lab.measure_bandwidth_gbs(size_mb=1, repeats=3, device="cpu", clock=clock)
    assert gbs == 2 * 2**20 * 2**10 / 1e9            # 1 MiB read + 1 MiB written, 1024 times a second
    assert clock.reads == 2 * 3


def test_matmul_probe_counts_two_flops_per_multiply_add():
    clock = FakeClock(tick=2**-10)
    flops = lab.measure_matmul_flops(n=16, dtype=torch.float32, device="cpu", repeats=2, clock=clock)
    assert flops == 2 * 16**3 * 2**10
    assert clock.reads == 2 * 2


def test_roofline_from_the_two_probes():
    roof = lab.measure_roofline("cpu", n=16, size_mb=1, clock=FakeClock(tick=0.5))
    assert isinstance(roof, lab.Roofline)
    assert roof.peak_flops == 2 * 16**3 / 0.5 and roof.bandwidth == 2 * 2**20 / 0.5
    assert roof.ridge == 16**3 / 2**20


# -- the cost model's passes, timed on a tiny model ----------------------------------------------
@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return lab.Transformer(lab.get_preset("tiny")).eval()


def _record_calls(model) -> list[tuple[int, ...]]:
    """Shapes of the token ids of every forward call of `model`, in order."""
    shapes = []
    model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    return shapes


def test_time_prefill_times_whole_prompts(tiny_model):
    calls = _record_calls(tiny_model)
    seconds = timing.time_prefill(tiny_model, 16, batch_size=2, repeats=3, clock=FakeClock(tick=0.5))
    assert seconds == 0.5
    assert calls == [(2, 16)] * 4                    # one warm-up prefill, three timed


def test_time_decode_step_is_a_run_of_steps_divided_by_their_number(tiny_model):
    calls = _record_calls(tiny_model)
    seconds = timing.time_decode_step(tiny_model, batch_size=2, context_len=8, steps=3, repeats=2,
                                      clock=FakeClock(tick=0.75))
    assert seconds == 0.75 / 3
    assert calls == [(2, 8)] + [(2, 1)] * 3 * 3      # the prefill, then warm-up + two timed runs of 3 steps


@pytest.mark.parametrize("call, error, message", [
    (lambda m: timing.time_prefill(m, 0), ValueError, "prompt_len must be an integer >= 1, got 0"),
    (lambda m: timing.time_prefill(m, 8.0), TypeError, "prompt_len must be an integer >= 1, got 8.0"),
    (lambda m: timing.time_decode_step(m, batch_size=0), ValueError, "batch_size must be an integer >= 1"),
    (lambda m: timing.time_decode_step(m, steps=0), ValueError, "steps must be an integer >= 1"),
    (lambda m: timing.time_cached_passes(m, sizes=(1, 0)), ValueError, r"sizes must hold integers >= 1, got \[0\]"),
])
def test_timed_passes_reject_bad_input(tiny_model, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny_model)


def test_time_cached_passes_times_each_size_on_the_cache_it_built(tiny):
    model, _ = tiny
    calls = []
    original = model.forward

    def spy(ids, input_pos=None, cache=None):
        calls.append((ids.shape[1], int(input_pos[0]) if input_pos is not None else 0))
        return original(ids, input_pos, cache)

    model.forward = spy
    try:
        costs = timing.time_cached_passes(model, sizes=(1, 3), context_len=8, repeats=2)
    finally:
        del model.forward
    assert set(costs) == {1, 3} and all(t > 0 for t in costs.values())
    assert {c for c in calls if c[0] in (1, 3)} == {(1, 8), (3, 8)}        # after the 8 cached positions
    with pytest.raises(ValueError):
        timing.time_cached_passes(model, sizes=(0,))
