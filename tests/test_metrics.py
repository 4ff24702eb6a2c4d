import pytest

import infopt_lab as lab


def test_weight_memory_matches_the_seed():
    gb = {name: lab.weight_memory_gb(7_000_000_000, b) for name, b in
          [("fp32", 4), ("fp16", 2), ("int8", 1), ("int4", 0.5)]}
    assert [f"{v:.2f}" for v in gb.values()] == ["26.08", "13.04", "6.52", "3.26"]
    assert f"{gb['fp32'] / gb['int4']:.1f}" == "8.0"


def test_weight_memory_rejects_bad_input():
    with pytest.raises(ValueError, match="bytes_per_param > 0"):
        lab.weight_memory_gb(10, 0)


def test_request_metrics_from_timestamps():
    m = lab.request_metrics(10.0, [10.5, 10.6, 10.7, 10.9])
    assert m.ttft_s == pytest.approx(0.5)
    assert m.tpot_s == pytest.approx(0.4 / 3)
    assert m.e2e_s == pytest.approx(0.9)
    assert m.tokens_per_s == pytest.approx(3 / 0.4)
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


def test_bandwidth_probe_is_positive():
    assert lab.measure_bandwidth_gbs(size_mb=16, repeats=2) > 0


def test_perplexity_and_bits_per_byte_agree(tiny):
    import math
    model, tok = tiny
    ppl = lab.perplexity(model, tok, max_tokens=2048)
    bpb = lab.bits_per_byte(model, tok, max_tokens=2048)
    # a random model is close to uniform over the vocabulary
    assert 0.5 * 4096 < ppl < 2 * 4096
    assert bpb == pytest.approx(math.log2(ppl) * 2048 / _bytes_of_first_tokens(tok, 2048), rel=1e-6)


def _bytes_of_first_tokens(tok, n):
    from infopt_lab import data
    tokens, _ = data.encode_split(tok, "val")
    lengths = data.token_byte_lengths(tok)
    windows = data.eval_windows(tokens[:n + 1], 256)
    return int(lengths[windows[:, 1:]].sum())
