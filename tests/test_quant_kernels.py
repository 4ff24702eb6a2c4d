"""The kernel a quantized layer runs (quant_kernels.py, quant_thresholds.py): each path equals the reference,
the choice is made once per device and dtype and again when the layer moves, thresholds come from a record."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infopt_lab as lab
from infopt_lab import quant_kernels, quantize
from infopt_lab.quantize import DEQUANT_MATMUL, INT4_KERNEL, INT8_KERNEL
from test_quantize import KERNELS_HERE, _rel   # what this machine's CPU runs; a relative error


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


@pytest.mark.parametrize("native", [True, False], ids=["bf16-in-hardware", "bf16-emulated"])
def test_int8_gemms_run_in_bf16_only_where_the_cpu_has_it_and_equal_the_kernel_either_way(native, monkeypatch):
    """A CPU without bf16 in hardware emulates bf16 GEMMs several times slower than fp32 ones: there the GEMMs
    run in fp32 over the same bf16 activations (each product exact), and the result still is the kernel's."""
    if not KERNELS_HERE["int8"]:
        pytest.skip("no working CPU int8 kernel here")
    monkeypatch.setattr(quant_kernels, "cpu_has_native_bf16", lambda: native)
    g = torch.Generator().manual_seed(7)
    linear = nn.Linear(96, 4096 + 40, bias=False)                       # two tiles
    with torch.no_grad():
        linear.weight.copy_(0.02 * torch.randn(4096 + 40, 96, generator=g))
    ql = lab.quantize_linear(linear, "int8")
    kernel = ql.kernels.pick(1)
    gemm = quant_kernels.Int8TiledGemm(kernel, 0, quantize.INT8_KERNEL_MAX_ROWS)
    want = torch.bfloat16 if native else torch.float32
    assert gemm.gemm_dtype == want and gemm.name.startswith("bf16" if native else "fp32")
    seen, matmul = [], torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b, **kw: seen.append((a.dtype, b.dtype)) or matmul(a, b, **kw))
    x = torch.randn(40, 96, generator=g)
    y = gemm.matmul(x, ql)
    assert seen == [(want, want)] * 2 and y.dtype == torch.bfloat16
    assert _rel(y.float(), kernel.matmul(x, ql).float()) < 5e-3
    with pytest.raises(ValueError, match="gemm_dtype must be one of"):
        quant_kernels.Int8TiledGemm(kernel, 0, 8, gemm_dtype=torch.float16)


@pytest.mark.parametrize("native", [True, False], ids=["bf16-in-hardware", "bf16-emulated"])
def test_the_int8_rows_sentence_follows_this_cpus_thresholds_and_gemm_dtype(native, monkeypatch):
    from infopt_lab.quant_thresholds import CpuThresholds
    monkeypatch.setattr(quant_kernels, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(quant_kernels, "cpu_thresholds", lambda: CpuThresholds(17, 8, "Some CPU, AVX2", "a test"))
    assert quant_kernels.int8_cpu_rows() == (
        f"the kernel up to 16 rows per call (7 for a vocabulary-sized head), then {'bf16' if native else 'fp32'} "
        "GEMMs over the int8 integers up to 256")
    monkeypatch.setattr(quant_kernels, "cpu_thresholds", lambda: CpuThresholds(257, 257, "Some CPU, AVX2", "a test"))
    assert quant_kernels.int8_cpu_rows() == ("the kernel up to 256 rows per call (GEMMs over the integers never won "
                                             "on Some CPU, AVX2)")


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
    assert "no record for this CPU (Other CPU, DEFAULT)" in other.source and "same vector unit" not in other.source
    monkeypatch.setattr(quant_thresholds, "cpu_key", lambda: "Third CPU, AVX512")
    quant_thresholds.save_thresholds(40, 30, {}, path)                 # a second record, not the default
    monkeypatch.setattr(quant_thresholds, "cpu_key", lambda: "Laptop CPU, AVX512")
    quant_thresholds.cpu_thresholds.cache_clear()
    alike = quant_thresholds.cpu_thresholds(path)                      # no record: the same vector unit's
    assert (alike.int8_gemm_min_rows, alike.measured_on) == (40, "Third CPU, AVX512")
    assert "no record for this CPU (Laptop CPU, AVX512)" in alike.source and "same vector unit" in alike.source
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


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32)])
def test_a_layer_moved_to_another_device_chooses_its_path_again(scheme, group):
    """Quantized on the CPU, then moved (meta stands in for CUDA here): the CPU kernel's path and packing
    must not follow the layer to a device they cannot run on."""
    layer = lab.quantize_linear(nn.Linear(64, 32), scheme, group)
    assert layer.kernels.device.type == "cpu"
    layer.to("meta")
    assert layer.kernels.device.type == "meta" and layer.path == DEQUANT_MATMUL
    assert "meta" in layer.fallback_reason
