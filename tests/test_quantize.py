"""Quantization: exact packing, honest footprints, bounded errors, clear refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infopt_lab as lab
from infopt_lab import gptq, quality
from infopt_lab.kv_cache import KVCache
from infopt_lab.kv_quant import QuantizedKVCache
from infopt_lab.quantize import DEQUANT_MATMUL, INT8_KERNEL, int8_kernel_works, quant_paths


# -- packing ----------------------------------------------------------------------------------------
def test_pack_unpack_all_16_values_exact():
    q = torch.arange(16, dtype=torch.uint8)
    packed = lab.pack_int4(q)
    assert packed.shape == (8,) and packed.dtype == torch.uint8
    assert torch.equal(lab.unpack_int4(packed), q)
    pairs = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8)  # every byte value
    assert torch.equal(lab.unpack_int4(lab.pack_int4(pairs)), pairs)
    assert sorted(lab.pack_int4(pairs).flatten().tolist()) == list(range(256))


@pytest.mark.parametrize("length", [1, 3, 15, 17, 33])
def test_pack_unpack_odd_lengths(length):
    q = torch.randint(0, 16, (5, length), generator=torch.Generator().manual_seed(length)).to(torch.uint8)
    packed = lab.pack_int4(q)
    assert packed.shape == (5, (length + 1) // 2)
    assert torch.equal(lab.unpack_int4(packed, length), q)


def test_pack_rejects_out_of_range_and_floats():
    with pytest.raises(ValueError, match="0..15"):
        lab.pack_int4(torch.tensor([3, 16]))
    with pytest.raises(ValueError, match="0..15"):
        lab.pack_int4(torch.tensor([-1, 2]))
    with pytest.raises(TypeError, match="integer"):
        lab.pack_int4(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="length"):
        lab.unpack_int4(torch.zeros(4, dtype=torch.uint8), 5)


# -- primitives -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def w():
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size,per_tensor", [(None, True), (None, False), (64, False), (32, False)])
def test_round_trip_within_half_a_step(w, bits, group_size, per_tensor):
    q, scale = lab.quantize_symmetric(w, bits, group_size, per_tensor)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert int(q.abs().max()) <= 2 ** (bits - 1) - 1
    w_hat = lab.dequantize(q, scale)
    step = scale.max().item()
    assert (w - w_hat).abs().max() <= step / 2 + 1e-6
    q, scale, zero = lab.quantize_asymmetric(w, bits, group_size, per_tensor)
    assert q.dtype == torch.uint8 and int(q.max()) <= 2 ** bits - 1
    assert (w - lab.dequantize(q, scale, zero)).abs().max() <= scale.max().item() / 2 + 1e-6


def test_finer_groups_and_more_bits_mean_less_error(w):
    def err(bits, g):
        q, s, z = lab.quantize_asymmetric(w, bits, g)
        return lab.quantization_error(w, lab.dequantize(q, s, z))["rel_rms"]
    assert err(4, 32) < err(4, 128) < err(4, None)
    assert err(8, None) < err(4, 32)
    assert lab.quantization_error(w, w)["max_abs"] == 0.0


def test_shapes_of_scales(w):
    assert lab.quantize_symmetric(w, 8)[1].shape == (64, 1)            # per channel
    assert lab.quantize_symmetric(w, 8, per_tensor=True)[1].shape == (1, 1)
    q, s, z = lab.quantize_asymmetric(w, 4, 64)
    assert s.shape == z.shape == (64, 4)


# -- bad input --------------------------------------------------------------------------------------
def test_bad_inputs_say_what_is_allowed(w):
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        lab.quantize_symmetric(w, 3)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 2"):
        lab.quantize_asymmetric(w, 2)
    with pytest.raises(ValueError, match="group_size must divide the 256 input features, got 48"):
        lab.quantize_asymmetric(w, 4, 48)
    with pytest.raises(TypeError, match="floating-point"):
        lab.quantize_symmetric(torch.ones(4, 4, dtype=torch.int32), 8)
    linear = nn.Linear(100, 8)
    with pytest.raises(ValueError, match="divide the 100 input features"):
        lab.quantize_linear(linear, "int4", group_size=64)
    with pytest.raises(ValueError, match="scheme must be one of"):
        lab.quantize_linear(linear, "int3")
    with pytest.raises(TypeError, match="nn.Linear"):
        lab.quantize_linear(nn.Conv1d(2, 2, 1), "int8")


# -- layers -----------------------------------------------------------------------------------------
def test_state_dict_footprint_of_a_4096_layer():
    linear = nn.Linear(4096, 4096, bias=False)                         # fp32: 64 MiB
    fp32 = lab.state_dict_bytes(linear)
    int8 = lab.quantize_linear(linear, "int8")
    int4 = lab.quantize_linear(linear, "int4", group_size=64)
    assert set(int8.state_dict()) == {"weight_q", "scales"}
    assert set(int4.state_dict()) == {"weight_q", "scales", "zeros"}
    assert int4.state_dict()["weight_q"].dtype == torch.uint8
    assert fp32 / lab.state_dict_bytes(int8) >= 3.9
    assert fp32 / lab.state_dict_bytes(int4) >= 6.0


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32), ("int4", None)])
def test_quant_linear_matches_dequantized_matmul(scheme, group_size):
    torch.manual_seed(0)
    linear = nn.Linear(128, 48)
    ql = lab.quantize_linear(linear, scheme, group_size)
    for rows in (1, 40):                                               # decode (kernel) and prefill
        x = torch.randn(2, rows, 128)
        expected = x @ ql.dequantized_weight().T + linear.bias
        torch.testing.assert_close(ql(x), expected, rtol=1e-4, atol=1e-4)
        rel = (ql(x) - linear(x)).norm() / linear(x).norm()
        assert rel < (0.01 if scheme == "int8" else 0.15)


def test_int8_uses_the_fused_kernel_where_it_works():
    ql = lab.quantize_linear(nn.Linear(64, 32), "int8")
    assert ql.path == (INT8_KERNEL if int8_kernel_works("cpu", torch.float32) else DEQUANT_MATMUL)
    assert lab.quantize_linear(nn.Linear(64, 32), "int4", 32).path == DEQUANT_MATMUL


# -- models -----------------------------------------------------------------------------------------
def test_quantize_model_copies_and_stays_close(tiny):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([tok.encode("def fib(n):\n    return n")])
    ref = model(ids)
    for scheme, g, tol in [("int8", None, 0.02), ("int4", 32, 0.2)]:
        q = lab.quantize_model(model, scheme, group_size=g)
        n_linear = sum(isinstance(m, nn.Linear) for m in model.modules()) - 1   # the tied head stays
        assert sum(quant_paths(q).values()) == n_linear
        assert lab.state_dict_bytes(q) < lab.state_dict_bytes(model)
        rel = ((q(ids) - ref).norm() / ref.norm()).item()
        assert rel < tol, (scheme, rel)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, lab.QuantLinear) for m in model.modules())


def test_gptq_beats_round_to_nearest_on_its_layer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g)    # correlated inputs, like
    x = x + 0.1 * torch.randn(512, 128, generator=g)                            # a real layer's
    w = torch.randn(64, 128, generator=g)
    H = x.T @ x / x.shape[0]
    q, s, z = gptq.gptq_int4(w, H, 32)
    w_gptq = lab.dequantize(q, s, z)
    w_rtn = lab.dequantize(*lab.quantize_asymmetric(w, 4, 32))
    err = lambda wh: (x @ (w - wh).T).pow(2).mean().item()
    assert err(w_gptq) < 0.8 * err(w_rtn)
    assert int(q.max()) <= 15 and s.shape == z.shape == (64, 4)


# -- KV cache -----------------------------------------------------------------------------------------
def test_quantized_kv_cache_keeps_the_update_contract(tiny):
    model, _ = tiny
    exact, quant = KVCache.for_model(model, 2, 16), QuantizedKVCache.for_model(model, 2, 16)
    H, D = model.config.n_kv_heads, model.config.head_dim
    for start, T in [(0, 5), (5, 1), (6, 3)]:
        k, v = torch.randn(2, H, T, D), torch.randn(2, H, T, D)
        pos = torch.arange(start, start + T)
        (k1, v1), (k2, v2) = exact.update(0, pos, k, v), quant.update(0, pos, k, v)
        assert k2.shape == k1.shape == (2, H, start + T, D) and k2.dtype == k1.dtype
        step = k1.abs().amax(-1, keepdim=True) / 127
        assert ((k2 - k1).abs() <= 0.57 * step).all()        # half a step, plus the fp16 scale's rounding
    assert quant.nbytes < exact.nbytes / 3
    with pytest.raises(ValueError, match="past the cache"):
        quant.update(0, torch.arange(15, 17), torch.randn(2, H, 2, D), torch.randn(2, H, 2, D))


# -- quality helpers ----------------------------------------------------------------------------------
def test_quality_helpers():
    assert quality.exact_match([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == 0.5
    assert quality.matched_prefix([[1, 2, 3], [4, 5]], [[1, 2, 9], [0, 5]]) == 1.0
    src = quality.function_source("def f(x):", "\n    return x\n\n\ndef g(y):\n    ret")
    assert src == "def f(x):\n    return x\n\n\n" and quality.parses(src)
    assert quality.parse_rate(["def f(x):", "def g():"], ["\n    return x\n", "\n    return (\n"]) == 0.5
    assert all(not p.endswith("\n") for p in quality.PROMPTS)


# -- the scorecard ----------------------------------------------------------------------------------
def test_scheme_table_on_a_tiny_model(tiny):
    from infopt_lab.quant_eval import Scheme, format_table, scheme_table
    model, tok = tiny
    schemes = [Scheme("fp32", lambda m: m), Scheme("int8", lambda m: lab.quantize_model(m, "int8")),
               Scheme("fp32 + int8 KV", lambda m: m, QuantizedKVCache.for_model)]
    rows = scheme_table(model, tok, schemes, max_tokens=1024, prompts=quality.PROMPTS[:3])
    fp32, int8, kv = rows
    assert fp32.exact_match == 1.0 and fp32.ratio == 1.0                  # the reference agrees with itself
    assert int8.ratio > 1.0 and kv.ratio == 1.0 and kv.kv_bytes < fp32.kv_bytes / 3
    assert abs(int8.perplexity / fp32.perplexity - 1) < 0.05
    assert len(format_table(rows).splitlines()) == 4


def test_gptq_model_keeps_the_int4_format(tiny):
    model, tok = tiny
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    q = gptq.gptq_quantize_model(model, ids, group_size=32)
    rtn = lab.quantize_model(model, "int4", group_size=32)
    assert {k: v.shape for k, v in q.state_dict().items()} == {k: v.shape for k, v in rtn.state_dict().items()}
    assert lab.state_dict_bytes(q) == lab.state_dict_bytes(rtn)


def test_perplexity_through_the_cache_equals_the_one_pass_figure(tiny):
    from infopt_lab.quant_eval import cached_perplexity
    model, tok = tiny
    one_pass = lab.perplexity(model, tok, seq_len=128, max_tokens=512)
    cached = cached_perplexity(model, tok, KVCache.for_model, max_tokens=512, seq_len=128, chunk=32)
    assert abs(cached / one_pass - 1) < 1e-4
    int8_kv = cached_perplexity(model, tok, QuantizedKVCache.for_model, max_tokens=512, seq_len=128, chunk=32)
    assert int8_kv != cached and abs(int8_kv / cached - 1) < 0.01
