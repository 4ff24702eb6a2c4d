"""Quantization: exact packing, honest footprints, bounded errors, clear refusals."""
from __future__ import annotations

import ast
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infopt_lab as lab
from infopt_lab import gptq, quality, quant_kernels, quantize
from infopt_lab.kv_cache import KVCache
from infopt_lab.kv_quant import QuantizedKVCache
from infopt_lab.quantize import (DEQUANT_MATMUL, INT4_KERNEL, INT8_KERNEL, cpu_kernels_fast, int4_kernel_works,
                                 int8_kernel_works, quant_paths)

KERNELS_HERE = {"int8": cpu_kernels_fast() and int8_kernel_works("cpu", torch.bfloat16),
                "int4": cpu_kernels_fast() and int4_kernel_works()}   # what this machine's CPU runs


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


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


def test_scales_and_zeros_are_the_ranges_of_their_groups(w):
    absmax = w.abs().amax(dim=1, keepdim=True)                        # (64, 1): one scale per row
    torch.testing.assert_close(lab.quantize_symmetric(w, 8)[1], absmax / 127, rtol=0, atol=0)
    torch.testing.assert_close(lab.quantize_symmetric(w, 8, per_tensor=True)[1], w.abs().max().reshape(1, 1) / 127,
                               rtol=0, atol=0)
    q, s, z = lab.quantize_asymmetric(w, 4, 64)
    groups = w.reshape(64, 4, 64)                                      # (N, K/G, G)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    torch.testing.assert_close(s, (hi - lo) / 15, rtol=0, atol=0)     # (64, 4): the group's range in 15 steps
    assert torch.equal(z, torch.round(-lo / s).to(torch.uint8))        # the integer that dequantizes to 0.0
    assert torch.equal(q.reshape(64, 4, 64).amin(-1), torch.zeros(64, 4, dtype=torch.uint8))   # each group's min
    assert (q.reshape(64, 4, 64).amax(-1) == 15).all()                 # and its max use the ends of the range


# -- bad input --------------------------------------------------------------------------------------
def test_bad_inputs_say_what_is_allowed(w):
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 8\), got 3"):
        lab.quantize_symmetric(w, 3)
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 8\), got 2"):
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
    N = K = 4096
    assert fp32 == 4 * N * K
    assert lab.state_dict_bytes(int8) == N * K + 4 * N                   # int8 weights, an fp32 scale per row
    assert lab.state_dict_bytes(int4) == N * K // 2 + (4 + 1) * N * K // 64   # nibbles; fp32 scale, uint8 zero per group


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32), ("int4", None)])
def test_quant_linear_matches_dequantized_matmul(scheme, group_size):
    torch.manual_seed(0)
    linear = nn.Linear(128, 48)
    ql = lab.quantize_linear(linear, scheme, group_size)
    max_rows = quantize.INT8_KERNEL_MAX_ROWS if scheme == "int8" else quantize.INT4_KERNEL_MAX_ROWS
    for rows in (1, 40, max_rows + 1):                                 # decode, a short prefill (kernel), a long one
        x = torch.randn(1, rows, 128)
        expected = x @ ql.dequantized_weight().T + linear.bias
        if ql.path in (INT8_KERNEL, INT4_KERNEL) and rows <= max_rows:   # the CPU kernels compute in bf16
            assert _rel(ql(x), expected) < 5e-3
        else:
            torch.testing.assert_close(ql(x), expected, rtol=1e-4, atol=1e-4)
        rel = (ql(x) - linear(x)).norm() / linear(x).norm()
        assert rel < (0.01 if scheme == "int8" else 0.15)


def test_int8_uses_the_fused_kernel_where_it_works():
    ql = lab.quantize_linear(nn.Linear(64, 32), "int8")
    assert ql.path == (INT8_KERNEL if KERNELS_HERE["int8"] else DEQUANT_MATMUL)
    assert lab.quantize_linear(nn.Linear(64, 32), "int4", 32).path == (INT4_KERNEL if KERNELS_HERE["int4"]
                                                                       else DEQUANT_MATMUL)


# -- PyTorch's CPU weight-only kernels ------------------------------------------------------------------
needs_int4_kernel = pytest.mark.skipif(not KERNELS_HERE["int4"], reason="no working CPU int4 kernel here")


@pytest.mark.parametrize("scheme,group_size,K", [("int8", None, 576), ("int4", 64, 576), ("int4", 128, 1536),
                                                 ("int4", None, 192), ("int4", 32, 96)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_kernel_paths_equal_the_dequantized_reference_up_to_bf16(scheme, group_size, K, bias):
    if not KERNELS_HERE[scheme]:
        pytest.skip(f"no working CPU {scheme} kernel here")
    g = torch.Generator().manual_seed(K)
    linear = nn.Linear(K, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(0.02 * torch.randn(48, K, generator=g))
    ql = lab.quantize_linear(linear, scheme, group_size)
    assert ql.path == (INT8_KERNEL if scheme == "int8" else INT4_KERNEL) and ql.compute_dtype == torch.bfloat16
    assert ql.fallback_reason is None and ql.path in repr(ql)
    for shape in [(1, K), (2, 1, K), (1, 9, K), (3, 5, K)]:          # decode, a batch, a verify pass, a prefill
        x = torch.randn(*shape, generator=g)
        y, expected = ql(x), F.linear(x, ql.dequantized_weight(), ql.bias)
        assert y.shape == expected.shape and y.dtype == x.dtype
        assert _rel(y, expected) < 5e-3, shape                       # bf16 activations: ~2**-9 per element
    xt = torch.randn(K, 4, generator=g).T                              # a non-contiguous input
    assert _rel(ql(xt), F.linear(xt, ql.dequantized_weight(), ql.bias)) < 5e-3


@pytest.mark.parametrize("out_features", [48, 4096 + 40], ids=["one-tile", "tiled"])
def test_int8_many_rows_take_tiled_gemms_that_equal_the_kernel_up_to_bf16(out_features, monkeypatch):
    if not KERNELS_HERE["int8"]:
        pytest.skip("no working CPU int8 kernel here")
    g = torch.Generator().manual_seed(out_features)
    linear = nn.Linear(64, out_features)
    with torch.no_grad():
        linear.weight.copy_(0.02 * torch.randn(out_features, 64, generator=g))
    ql = lab.quantize_linear(linear, "int8")
    calls, gemm = [], quant_kernels.Int8TiledGemm.matmul
    monkeypatch.setattr(quant_kernels.Int8TiledGemm, "matmul",
                        lambda self, x2, layer: calls.append(len(x2)) or gemm(self, x2, layer))
    few = quantize.INT8_GEMM_MIN_ROWS_TILED if out_features > quantize.INT8_GEMM_TILE else quantize.INT8_GEMM_MIN_ROWS
    if few > quantize.INT8_KERNEL_MAX_ROWS:
        pytest.skip(f"on this CPU the GEMMs never win ({quant_kernels.cpu_thresholds().source})")
    many = max(40, few)                                              # a prefill: past both thresholds
    x = torch.randn(many, 64, generator=g)
    kernel = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), ql.weight_q, ql.scales.bfloat16()).float() + ql.bias
    assert _rel(ql(x), kernel) < 5e-3 and calls == [many]
    ql(x[:few - 1])                                                  # fewer rows: the kernel
    assert calls == [many]
    ql(x[:few])
    assert calls == [many, few]


@needs_int4_kernel
def test_int4_kernel_packing_round_trips_exactly():
    """The kernel's packed weights hold exactly our integers, and its (scale, offset) pairs our scale and zero."""
    from infopt_lab.quant_format import int4_kernel_scales_and_zeros
    g = torch.Generator().manual_seed(0)
    N, K = 64, 256
    q, s, z = lab.quantize_asymmetric(torch.randn(N, K, generator=g), 4, 128)
    eye = torch.eye(K, dtype=torch.bfloat16)                           # x = I reads the weight the kernel uses
    # unit scales: the kernel's weight (q - 8) * 1 + (8 - zero) is an integer, exact in bf16
    packed, sz, kg = quantize.pack_int4_for_cpu_kernel(lab.pack_int4(q), torch.ones_like(s), z, K)
    assert kg == 128 and packed.dtype == torch.uint8 and sz.shape == (K // kg, N, 2) and sz.dtype == torch.bfloat16
    w_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, kg, sz).T     # (N, K)
    assert torch.equal(w_kernel.float(), lab.dequantize(q, torch.ones_like(s), z))
    # real scales: exactly our formula with the scale and offset rounded to bf16 (the kernel's one rounding)
    packed, sz, kg = quantize.pack_int4_for_cpu_kernel(lab.pack_int4(q), s, z, K)
    w_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, kg, sz).T
    scale, offset = sz.float().transpose(0, 1).unbind(-1)              # (N, K/kg) each
    want = (q.float().reshape(N, -1, kg) - 8) * scale[..., None] + offset[..., None]
    assert torch.equal(w_kernel, want.reshape(N, K).to(torch.bfloat16))
    assert _rel(w_kernel, lab.dequantize(q, s, z)) < 4e-3
    # the mapping itself, in fp32: (q - 8) * scale + (8 - zero) * scale == (q - zero) * scale; groups split finer
    sz32 = int4_kernel_scales_and_zeros(s, z, 128, 32, dtype=torch.float32)   # (K/32, N, 2)
    scale, offset = sz32.transpose(0, 1).unbind(-1)
    w32 = ((q.float().reshape(N, -1, 32) - 8) * scale[..., None] + offset[..., None]).reshape(N, K)
    torch.testing.assert_close(w32, lab.dequantize(q, s, z), rtol=0, atol=1e-6)


@needs_int4_kernel
def test_int4_kernel_follows_replaced_and_edited_weights():
    """GPTQ replaces weight_q/scales/zeros after quantizing; load_state_dict copies in place: the packing follows."""
    g = torch.Generator().manual_seed(1)
    ql = lab.quantize_linear(nn.Linear(128, 32, bias=False), "int4", 32)
    x = torch.randn(2, 128, generator=g)
    check = lambda: _rel(ql(x), x @ ql.dequantized_weight().T) < 5e-3
    assert ql.path == INT4_KERNEL and check()
    q, s, z = lab.quantize_asymmetric(torch.randn(32, 128, generator=g), 4, 32)
    ql.weight_q, ql.scales, ql.zeros = lab.pack_int4(q), s, z          # what gptq_quantize_model does
    assert check()
    other = lab.quantize_linear(nn.Linear(128, 32, bias=False), "int4", 32)
    ql.load_state_dict(other.state_dict())                             # in place, into the same tensors
    torch.testing.assert_close(ql(x), other(x))
    with torch.no_grad():
        ql.scales.mul_(2)                                              # an in-place edit
    assert check()
    copied = copy.deepcopy(ql)
    torch.testing.assert_close(copied(x), ql(x))


def test_fallback_is_named_when_the_kernels_are_unavailable(monkeypatch):
    monkeypatch.setattr(quant_kernels, "int4_kernel_works", lambda: False)     # e.g. a torch without the ops
    monkeypatch.setattr(quant_kernels, "int8_kernel_works", lambda device_type, dtype: False)
    linear = nn.Linear(128, 48)
    x = torch.randn(3, 128)
    for scheme, g, kernel in [("int8", None, INT8_KERNEL), ("int4", 32, INT4_KERNEL)]:
        ql = lab.quantize_linear(linear, scheme, g)
        assert ql.path == DEQUANT_MATMUL and kernel in ql.fallback_reason and ql.fallback_reason in repr(ql)
        assert ql.kernels.cached_bytes() == 0                           # no packed copy kept for nothing
        torch.testing.assert_close(ql(x), F.linear(x, ql.dequantized_weight(), linear.bias), rtol=0, atol=0)
    monkeypatch.undo()
    monkeypatch.setattr(quant_kernels, "cpu_kernels_fast", lambda: False)       # a CPU without AVX2/AVX-512/NEON
    assert "vectorized" in lab.quantize_linear(linear, "int4", 32).fallback_reason
    assert "vectorized" in lab.quantize_linear(linear, "int8").fallback_reason


@needs_int4_kernel
def test_int4_layers_the_kernel_cannot_take_fall_back_by_name():
    odd_rows = lab.quantize_linear(nn.Linear(128, 40), "int4", 32)              # N not a multiple of 16
    assert odd_rows.path == DEQUANT_MATMUL and "multiple of 16" in odd_rows.fallback_reason
    small_groups = lab.quantize_linear(nn.Linear(128, 32), "int4", 16)          # groups finer than 32
    assert small_groups.path == DEQUANT_MATMUL and "group size 16" in small_groups.fallback_reason
    assert [quantize.int4_kernel_group(g) for g in (16, 32, 64, 96, 192, 576, 1024)] == [None, 32, 64, 32, 64, 64, 256]


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32)])
def test_a_moved_or_cast_layer_chooses_its_kernels_again(scheme, group_size):
    """The kernels are chosen once per layer, and again when .to() moves or casts it; not on every call."""
    torch.manual_seed(0)
    ql = lab.quantize_linear(nn.Linear(128, 48), scheme, group_size)
    chosen = ql.kernels
    assert (chosen.device, chosen.dtype) == (torch.device("cpu"), torch.float32)
    assert ql.to("cpu") is ql and ql.kernels is chosen                 # nothing moved: the same choice
    ql(torch.randn(2, 128))
    assert ql.kernels is chosen                                        # a call probes nothing
    ql.to(torch.bfloat16)
    assert ql.kernels is not chosen and ql.kernels.dtype == ql.dtype == ql.scales.dtype == torch.bfloat16
    assert ql.path == chosen.path                                      # the same kernel, chosen for bf16
    x = torch.randn(3, 128).bfloat16()
    y = ql(x)
    assert y.dtype == torch.bfloat16 and _rel(y, F.linear(x.float(), ql.dequantized_weight().float(),
                                                          ql.bias.float())) < 1e-2
    ql.to("meta")                                                      # a device with no kernel at all
    assert ql.kernels.device.type == "meta" and ql.path == DEQUANT_MATMUL and "meta" in ql.fallback_reason
    assert ql(x.to("meta")).shape == (3, 48)


def test_a_cast_model_leaves_its_stale_fused_copies(tiny):
    model, _ = tiny
    q = lab.quantize_model(model, "int8")
    attn = q.layers[0].self_attn
    assert attn.fused.holds(attn.projections())
    q.to(torch.bfloat16)                                               # the layers cast; the fused copies do not
    assert not attn.fused.holds(attn.projections())
    assert all(m.kernels.dtype == torch.bfloat16 for m in q.modules() if isinstance(m, lab.QuantLinear))


def test_thresholds_are_this_cpus_record_or_say_whose_they_are(tmp_path, monkeypatch):
    from infopt_lab import quant_thresholds
    path = tmp_path / "thresholds.json"
    with pytest.raises(FileNotFoundError, match="measure_quant_thresholds"):
        quant_thresholds.cpu_thresholds(path)
    monkeypatch.setattr(quant_thresholds, "cpu_key", lambda: "Some CPU, AVX2")
    quant_thresholds.save_thresholds(12, 6, {}, path)                  # the first CPU measured: the default
    mine = quant_thresholds.cpu_thresholds(path)
    assert (mine.int8_gemm_min_rows, mine.int8_gemm_min_rows_tiled, mine.measured_on) == (12, 6, "Some CPU, AVX2")
    assert mine.source.startswith("measured on this CPU")
    monkeypatch.setattr(quant_thresholds, "cpu_key", lambda: "Other CPU, DEFAULT")
    quant_thresholds.cpu_thresholds.cache_clear()
    other = quant_thresholds.cpu_thresholds(path)
    assert (other.int8_gemm_min_rows, other.measured_on) == (12, "Some CPU, AVX2")
    assert "no record for this CPU (Other CPU, DEFAULT)" in other.source
    with pytest.raises(ValueError, match="int8_gemm_min_rows must be an integer >= 1, got 0"):
        quant_thresholds.save_thresholds(0, 6, {}, path)
    quant_thresholds.cpu_thresholds.cache_clear()


def test_the_committed_thresholds_were_measured_and_are_the_ones_used():
    from infopt_lab.quant_thresholds import cpu_thresholds, read_records
    records = read_records()
    assert records["default"] in records["cpus"]
    assert all(r["timings"] and r["command"] for r in records["cpus"].values())     # measured, not typed in
    limits = cpu_thresholds()
    assert (quant_kernels.INT8_GEMM_MIN_ROWS, quant_kernels.INT8_GEMM_MIN_ROWS_TILED) == \
        (limits.int8_gemm_min_rows, limits.int8_gemm_min_rows_tiled)
    assert limits.measured_on in limits.source


def test_int8_gemm_crossover_times_both_paths_at_each_row_count():
    if not KERNELS_HERE["int8"]:
        pytest.skip("no working CPU int8 kernel here")
    layer = lab.quantize_linear(nn.Linear(64, 32, bias=False), "int8")
    crossover, seconds = quant_kernels.int8_gemm_crossover(layer, rows=(2, 1), repeats=1)
    assert list(seconds) == [1, 2] and all(set(t) == {"kernel", "gemm"} for t in seconds.values())
    wins = [n for n, t in seconds.items() if t["gemm"] < t["kernel"]]
    assert crossover == (1 if wins == [1, 2] else 2 if wins == [2] else quant_kernels.INT8_KERNEL_MAX_ROWS + 1)


def test_quantize_model_quantizes_the_tied_head_and_keeps_the_embedding(tiny):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.lm_head.weight is model.embed_tokens.weight and model.config.tie_embeddings
    ids = torch.tensor([tok.encode("def fib(n):\n    return n")])
    ref = model(ids)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}    # the head included
    for scheme, g, tol in [("int8", None, 0.02), ("int4", 32, 0.2)]:
        q = lab.quantize_model(model, scheme, group_size=g)
        assert isinstance(q.lm_head, lab.QuantLinear) and sum(quant_paths(q).values()) == len(linears)
        assert type(q.embed_tokens) is nn.Embedding and q.embed_tokens.weight.dtype == torch.float32
        assert torch.equal(q.embed_tokens.weight, model.embed_tokens.weight)             # the float table, as is
        assert q.embed_tokens.weight.data_ptr() != model.embed_tokens.weight.data_ptr()  # a copy: no sharing
        assert not q.config.tie_embeddings and model.config.tie_embeddings               # untied in the copy only
        alone = lab.quantize_linear(model.lm_head, scheme, g).state_dict()
        assert all(torch.equal(alone[k], q.lm_head.state_dict()[k]) for k in alone)
        # the head's integers come on top of the float table they used to share: bytes count each tensor once
        head_bytes = sum(t.numel() * t.element_size() for t in alone.values())
        rest = lab.quantize_model(model, scheme, group_size=g, quantize_tied_head=False)
        assert lab.state_dict_bytes(q) == lab.state_dict_bytes(rest) + head_bytes
        expected = sum(t.numel() * t.element_size() for t in q.state_dict().values())   # nothing shared now
        assert lab.state_dict_bytes(q) == expected
        rel = ((q(ids) - ref).norm() / ref.norm()).item()
        assert rel < tol, (scheme, rel)
    kept = lab.quantize_model(model, "int8", quantize_tied_head=False)
    assert kept.lm_head.weight is kept.embed_tokens.weight and kept.config.tie_embeddings
    assert lab.quantize_model(model, "int8", skip=("lm_head",)).lm_head.weight.dtype == torch.float32
    with pytest.raises(TypeError, match="quantize_tied_head"):
        lab.quantize_model(model, "int8", quantize_tied_head="yes")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())         # the original: untouched
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not any(isinstance(m, lab.QuantLinear) for m in model.modules())


# -- models -----------------------------------------------------------------------------------------
def test_quantize_model_copies_and_stays_close(tiny):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([tok.encode("def fib(n):\n    return n")])
    ref = model(ids)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"}
    assert model.lm_head.weight is model.embed_tokens.weight          # tied: the head stays in float
    for scheme, g, tol in [("int8", None, 0.02), ("int4", 32, 0.2)]:
        q = lab.quantize_model(model, scheme, group_size=g, quantize_tied_head=False)
        assert sum(quant_paths(q).values()) == len(linears)
        saved = 0
        for name, linear in linears.items():                             # each layer: quantize_linear of the original
            alone = lab.quantize_linear(linear, scheme, g).state_dict()
            swapped = q.get_submodule(name).state_dict()
            assert alone.keys() == swapped.keys() and all(torch.equal(alone[k], swapped[k]) for k in alone)
            saved += lab.state_dict_bytes(linear) - sum(t.numel() * t.element_size() for t in alone.values())
        assert lab.state_dict_bytes(q) == lab.state_dict_bytes(model) - saved
        rel = ((q(ids) - ref).norm() / ref.norm()).item()
        assert rel < tol, (scheme, rel)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, lab.QuantLinear) for m in model.modules())


def _correlated_layer():
    """A seeded layer W [64, 128] and calibration inputs X [512, 128] that mostly lie in 16 directions."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g)    # correlated inputs, like
    x = x + 0.1 * torch.randn(512, 128, generator=g)                            # a real layer's
    return x, torch.randn(64, 128, generator=g)


def _rtn_int4(w, H, group_size):
    """Round-to-nearest with GPTQ's signature: what a GPTQ step that did nothing would return."""
    return lab.quantize_asymmetric(w, 4, group_size)


GPTQ_MARGIN = 0.5   # a clear margin: GPTQ's output error on this layer is well under half of round-to-nearest's


def _beats_rtn(quantizer, group_size) -> bool:
    """Whether quantizer(w, H, group_size) leaves ||X W^T - X W_hat^T|| under GPTQ_MARGIN of round-to-nearest's."""
    x, w = _correlated_layer()
    H = x.T @ x / x.shape[0]                                                      # (K, K)
    err = lambda q_s_z: (x @ (w - lab.dequantize(*q_s_z)).T).norm().item()
    return err(quantizer(w, H, group_size)) < GPTQ_MARGIN * err(_rtn_int4(w, H, group_size))


@pytest.mark.parametrize("group_size", [32, None])
def test_gptq_lowers_the_output_error_of_round_to_nearest(group_size):
    assert _beats_rtn(gptq.gptq_int4, group_size)
    assert not _beats_rtn(_rtn_int4, group_size)          # the margin is what a do-nothing GPTQ cannot reach


def test_gptq_keeps_the_int4_format_of_round_to_nearest():
    x, w = _correlated_layer()
    q, s, z = gptq.gptq_int4(w, x.T @ x / x.shape[0], 32)
    q_rtn, s_rtn, z_rtn = lab.quantize_asymmetric(w, 4, 32)
    assert q.dtype == q_rtn.dtype and s.dtype == s_rtn.dtype and z.dtype == z_rtn.dtype
    assert q.shape == q_rtn.shape and s.shape == s_rtn.shape and z.shape == z_rtn.shape
    assert int(q.max()) == 15 and int(q.min()) == 0
    assert not torch.equal(q, q_rtn)                      # other integers: the point of it


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    """With H = I no input direction matters more than another: nothing to trade, so the same integers."""
    _, w = _correlated_layer()
    for group_size in (32, None):
        for got, want in zip(gptq.gptq_int4(w, torch.eye(128), group_size), lab.quantize_asymmetric(w, 4, group_size)):
            assert torch.equal(got, want)


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
        v_step = v1.abs().amax(-1, keepdim=True) / 127
        assert v2.shape == v1.shape and ((v2 - v1).abs() <= 0.57 * v_step).all()   # values too, not only keys
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
    from infopt_lab.bench.quant import Scheme, format_table, scheme_table
    model, tok = tiny
    schemes = [Scheme("fp32", lambda m: m), Scheme("int8", lambda m: lab.quantize_model(m, "int8")),
               Scheme("fp32 + int8 KV", lambda m: m, QuantizedKVCache.for_model)]
    rows = scheme_table(model, tok, schemes, max_tokens=1024, prompts=quality.PROMPTS[:3])
    fp32, int8, kv = rows
    assert fp32.exact_match == 1.0 and fp32.ratio == 1.0                  # the reference agrees with itself
    assert int8.ratio == lab.state_dict_bytes(model) / lab.state_dict_bytes(lab.quantize_model(model, "int8"))
    assert kv.ratio == 1.0 and kv.kv_bytes < fp32.kv_bytes / 3
    assert abs(int8.perplexity / fp32.perplexity - 1) < 0.05
    assert len(format_table(rows).splitlines()) == 4


def test_gptq_model_keeps_the_int4_format_and_lowers_every_layers_error(tiny):
    model, tok = tiny
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    q = gptq.gptq_quantize_model(model, ids, group_size=32)
    rtn = lab.quantize_model(model, "int4", group_size=32, quantize_tied_head=False)   # as GPTQ leaves the head
    assert {k: (v.shape, v.dtype) for k, v in q.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in rtn.state_dict().items()}
    moments = gptq.input_moments(model, ids)                          # H = X^T X / n of each layer's inputs
    layers = [name for name, m in q.named_modules() if isinstance(m, lab.QuantLinear)]
    assert layers and all(q.get_submodule(name).calibration == "gptq" for name in layers)
    for name in layers:                                               # E||X (W - W_hat)^T||^2 = tr(D H D^T)
        w, H = model.get_submodule(name).weight.detach().float(), moments[name]
        err = lambda m: torch.trace((d := w - m.get_submodule(name).dequantized_weight()) @ H @ d.T).item()
        assert err(q) < 0.85 * err(rtn), name


def test_perplexity_through_the_cache_equals_the_one_pass_figure(tiny):
    from infopt_lab.bench.quant import cached_perplexity
    model, tok = tiny
    one_pass = lab.perplexity(model, tok, seq_len=128, max_tokens=512)
    cached = cached_perplexity(model, tok, KVCache.for_model, max_tokens=512, seq_len=128, chunk=32)
    assert abs(cached / one_pass - 1) < 1e-4
    int8_kv = cached_perplexity(model, tok, QuantizedKVCache.for_model, max_tokens=512, seq_len=128, chunk=32)
    assert int8_kv != cached and abs(int8_kv / cached - 1) < 0.01


# -- imports: the int4 format sits below the quantizers and the kernel ------------------------------------
PACKAGE = Path(lab.__file__).parent


def _import_graph() -> dict[str, set[str]]:
    """Each infopt_lab module -> the infopt_lab modules it imports, at the top or inside a function."""
    files = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
                base = ".".join(p for p in (base, node.module) if p)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


@pytest.mark.parametrize("module", ["infopt_lab.quant_format", "infopt_lab.quantize", "infopt_lab.gptq",
                                    "infopt_lab.quant_kernels", "infopt_lab.quant_thresholds",
                                    "infopt_lab.kernels.int4_matmul"])
def test_quantization_modules_are_in_no_import_cycle(module):
    graph = _import_graph()
    assert "infopt_lab.quant_format" in graph[module] or module in ("infopt_lab.quant_format",
                                                                    "infopt_lab.quant_thresholds")   # no format there
    seen, todo = set(), list(graph[module])
    while todo:                                          # every module `module` reaches through its imports
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    assert module not in seen, f"{module} imports itself back through {sorted(seen)}"


IMPORT_CHECK = """
import torch
import {first}
from infopt_lab.kernels.int4_matmul import int4_matmul_reference
from infopt_lab.quantize import QuantLinear, dequantize, pack_int4, quantize_model, unpack_int4
import infopt_lab as lab
layer = lab.quantize_linear(torch.nn.Linear(64, 16), "int4", group_size=32)
x = torch.randn(3, 64)
tol = 2e-2 if layer.path == "aten._weight_int4pack_mm_for_cpu" else None   # that kernel computes in bf16
torch.testing.assert_close(layer(x), int4_matmul_reference(x, layer.weight_q, layer.scales, layer.zeros) + layer.bias,
                           rtol=tol, atol=tol)
print("ok")
"""


@pytest.mark.parametrize("first", ["infopt_lab.quantize", "infopt_lab.kernels.int4_matmul"])
def test_quantize_and_the_int4_kernel_import_first_in_a_fresh_interpreter(first):
    """A fresh interpreter, in which nothing of the package is imported yet when `first` is."""
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK.format(first=first)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_public_int4_names_are_the_format_modules():
    from infopt_lab import quant_format, quantize
    for name in ("pack_int4", "unpack_int4", "dequantize"):
        assert getattr(lab, name) is getattr(quantize, name) is getattr(quant_format, name)


def test_head_scheme_gives_the_output_head_its_own_precision(tiny):
    model, _ = tiny
    q = lab.quantize_model(model, "int4", group_size=32, head_scheme="int8")
    assert q.lm_head.scheme == "int8" and q.layers[0].mlp.up_proj.scheme == "int4"
    assert isinstance(q.embed_tokens, torch.nn.Embedding) and not isinstance(model.lm_head, lab.QuantLinear)
    with pytest.raises(ValueError, match="head_scheme must be one of"):
        lab.quantize_model(model, "int4", group_size=32, head_scheme="fp8")


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 32)])
def test_quantized_projections_run_fused_with_the_same_outputs_and_bytes(tiny, scheme, group):
    import copy
    model, _ = tiny
    q = lab.quantize_model(model, scheme, group_size=group)
    attn = q.layers[0].self_attn
    assert attn.fused is not None and attn.fused.holds(attn.projections())
    unfused = copy.deepcopy(q)                                  # a deep copy runs its projections one by one
    assert all(m.fused is None for m in unfused.modules() if hasattr(m, "projections"))
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(q(ids), unfused(ids), rtol=0, atol=0)
    assert sorted(q.state_dict()) == sorted(unfused.state_dict())
    assert lab.state_dict_bytes(q) == lab.state_dict_bytes(unfused)   # the slices are counted once


def test_gptq_layers_are_fused_again_after_calibration(tiny):
    model, _ = tiny
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    q = gptq.gptq_quantize_model(model, ids, group_size=32)
    mlp = q.layers[0].mlp
    assert mlp.fused is not None and mlp.fused.holds(mlp.projections())
