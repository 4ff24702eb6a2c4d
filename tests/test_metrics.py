import pytest

import infopt_lab as lab


def test_weight_memory_matches_the_seed():
    gb = {name: lab.weight_memory_gb(7_000_000_000, b) for name, b in
          [("fp32", 4), ("fp16", 2), ("int8", 1), ("int4", 0.5)]}
    assert [f"{v:.2f}" for v in gb.values()] == ["26.08", "13.04", "6.52", "3.26"]
    assert f"{gb['fp32'] / gb['int4']:.1f}" == "8.0"


def test_weight_memory_rejects_bad_input():
    with pytest.raises(ValueError, match="bytes_per_param must be a finite number > 0"):
        lab.weight_memory_gb(10, 0)


def test_request_metrics_from_timestamps():
    m = lab.request_metrics(10.0, [10.5, 10.6, 10.7, 10.9])
    assert m.ttft_s == pytest.approx(0.5)
    assert m.tpot_s == pytest.approx(0.4 / 3)
    assert m.e2e_s == pytest.approx(0.9)
    assert m.tokens_per_s == pytest.approx(4 / 0.9)        # new tokens over the end-to-end latency
    one = lab.request_metrics(0.0, [0.2])
    assert one.tpot_s == 0.0 and one.ttft_s == pytest.approx(0.2)
    with pytest.raises(ValueError, match="non-decreasing"):
        lab.request_metrics(0.0, [0.3, 0.2])


def test_percentiles():
    p = lab.percentiles(list(range(1, 101)))
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)


def test_model_weight_bytes_counts_a_tied_head_once(tiny):
    model, _ = tiny
    assert lab.model_weight_bytes(model) == sum(
        p.numel() * 4 for p in model.parameters()) + sum(b.numel() * 4 for b in model.buffers())
