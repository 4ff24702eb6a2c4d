"""Quantization: exact packing, honest footprints, bounded errors, clear refusals."""
from __future__ import annotations

import ast
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import infopt_lab as lab
from infopt_lab import quality, quantize
from infopt_lab.kv_cache import KVCache
from infopt_lab.kv_quant import QuantizedKVCache
from infopt_lab.quantize import (INT4_KERNEL, INT8_KERNEL, cpu_kernels_fast, int4_kernel_works, int8_kernel_works,
                                 quant_paths)

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


def test_quantize_model_quantizes_the_tied_head_and_the_embedding_reads_its_integers(tiny):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.lm_head.weight is model.embed_tokens.weight and model.config.tie_embeddings
    ids = torch.tensor([tok.encode("def fib(n):\n    return n")])
    ref = model(ids)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}    # the head included
    for scheme, g, tol in [("int8", None, 0.02), ("int4", 32, 0.2)]:
        q = lab.quantize_model(model, scheme, group_size=g)
        assert isinstance(q.lm_head, lab.QuantLinear) and sum(quant_paths(q).values()) == len(linears)
        assert type(q.embed_tokens) is lab.QuantEmbedding and q.embed_tokens.head is q.lm_head   # no float table
        assert not list(q.embed_tokens.parameters()) and not list(q.embed_tokens.buffers())
        torch.testing.assert_close(q.embed_tokens(ids), q.lm_head.dequantized_weight()[ids], rtol=0, atol=0)
        assert not q.config.tie_embeddings and model.config.tie_embeddings               # untied in the copy only
        alone = lab.quantize_linear(model.lm_head, scheme, g).state_dict()
        assert all(torch.equal(alone[k], q.lm_head.state_dict()[k]) for k in alone)
        # the head's integers replace the float table they used to share: bytes count each tensor once
        head_bytes = sum(t.numel() * t.element_size() for t in alone.values())
        rest = lab.quantize_model(model, scheme, group_size=g, quantize_tied_head=False)
        table = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
        assert lab.state_dict_bytes(q) == lab.state_dict_bytes(rest) - table + head_bytes
        expected = sum(t.numel() * t.element_size() for t in q.state_dict().values())   # nothing shared now
        assert lab.state_dict_bytes(q) == expected
        assert lab.weight_bytes(q).resident < lab.weight_bytes(rest).resident
        assert lab.weight_bytes(q).streamed < lab.weight_bytes(rest).streamed
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


@pytest.mark.parametrize("native", [True, False])
def test_the_default_schemes_keep_bf16_where_the_hardware_has_it(monkeypatch, tiny, native):
    """Emulated bf16 makes one perplexity pass many times fp32's: the default table leaves the row out there."""
    from infopt_lab.bench import quant
    monkeypatch.setattr(quant, "has_native_bf16", lambda device: native)
    model, tok = tiny
    names = [s.name for s in quant.default_schemes(model, tok)]
    assert ("bf16" in names) is native and names[0] == "fp32" and "int8 per-channel" in names
    assert "bf16" in [s.name for s in quant.default_schemes(model, tok, bf16=True)]


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
    assert isinstance(q.embed_tokens, lab.QuantEmbedding) and q.embed_tokens.head.scheme == "int8"
    assert not isinstance(model.lm_head, lab.QuantLinear)
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
