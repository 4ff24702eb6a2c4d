"""The engine rung of the bench: its values, its crossover rule; small sizes (speed is the bench's job)."""
import pytest

from infopt_lab.bench.engine import SpecPoint, bench_engine, crossover_batch


def point(b: int, speedup: float) -> SpecPoint:
    return SpecPoint(b, 100.0, 100.0 * speedup, 0.5, 1.5, True, 1.0)


@pytest.mark.parametrize("speedups, expected", [
    ({1: 1.3, 4: 1.1, 16: 0.8}, 16),       # pays, then loses from batch 16
    ({1: 0.8, 4: 1.05, 16: 0.9}, 16),      # losing at 1 does not make 1 the crossover when 4 pays
    ({1: 0.7, 4: 0.9, 16: 0.8}, 1),        # loses everywhere
    ({1: 1.2, 4: 1.1, 16: 1.0}, None),     # never loses
])
def test_crossover_is_where_speculation_starts_losing_for_good(speedups, expected):
    points = [point(b, s) for b, s in reversed(speedups.items())]
    assert crossover_batch(points) == expected


def test_the_engine_rung_reports_caching_and_speculation_on_the_bundled_pair():
    r = bench_engine("target", sessions=3, rate_per_s=4.0, batch_sizes=(1, 2), requests=4, new_tokens=6)
    v = r.values
    assert v["prefix_same_tokens"] and v["spec_same_tokens"]
    assert 0 < v["prefix_hit_rate"] < 1 and v["prefix_blocks_saved"] > 0
    assert set(v["spec"]) == {1, 2} and all(0 < p["alpha"] <= 1 for p in v["spec"].values())
    assert v["spec_cost_model"]["v"] > 0 and "cost model at batch 1" in r.render()
