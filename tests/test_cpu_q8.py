"""The hand-written int8-activation CPU kernel (kernels/q8_dot.c through cpu_q8.py) and the path that uses it."""
import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import infopt_lab as lab
from infopt_lab import cpu_q8
from infopt_lab.quant_format import dequantize, pack_int4
from infopt_lab.cpu_q8 import Q8_MAX_ROWS
from infopt_lab.quant_kernels import Q8_KERNEL
from infopt_lab.quantize import QuantLinear

needs_kernel = pytest.mark.skipif(not cpu_q8.available(), reason=f"{cpu_q8.why_not()}")


def int4_layer_operands(N, K, G, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    s = 0.01 + 0.1 * torch.rand(N, K // G, generator=g)
    z = torch.randint(0, 16, (N, K // G), generator=g, dtype=torch.uint8)
    return pack_int4(q), s, z, dequantize(q, s, z, dtype=torch.float32)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 12), n=st.integers(1, 70), group_blocks=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**16))
def test_int4_kernel_equals_its_reference_and_each_row_is_alone(rows, blocks, n, group_blocks, seed):
    K = 64 * group_blocks * blocks                           # any multiple of 64 and the group, N not a power of two
    G = 32 * group_blocks
    wq, s, z, w = int4_layer_operands(n, K, G, seed)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed + 1)) * 3
    x[0, :32] = 0.0                                          # an all-zero block quantizes to zeros, not NaN
    y = cpu_q8.q4_linear(x, wq, s, z, G)
    ref = cpu_q8.reference(x, w)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    alone = torch.cat([cpu_q8.q4_linear(x[i:i + 1], wq, s, z, G) for i in range(rows)])
    assert torch.equal(y, alone)                             # bit for bit: the rows beside it change nothing


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 40), n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int8_kernel_equals_its_reference_and_each_row_is_alone(rows, blocks, n, seed):
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    wq = torch.randint(-128, 128, (n, K), generator=g, dtype=torch.int8)     # -128 too: |w| is read as a byte
    s = torch.rand(n, generator=g) * 0.01
    x = torch.randn(rows, K, generator=g)
    y = cpu_q8.q8w_linear(x, wq, s)
    ref = cpu_q8.reference(x, wq.float() * s[:, None])
    assert (y.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    assert torch.equal(y, torch.cat([cpu_q8.q8w_linear(x[i:i + 1], wq, s) for i in range(rows)]))


def test_the_reference_quantizes_activations_to_about_two_decimal_digits():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    w = torch.eye(256)
    err = (cpu_q8.reference(x, w) - x.double()).abs()
    bound = x.reshape(4, -1, 32).abs().amax(-1).repeat_interleave(32, 1).double() / 254   # half a step
    assert (err <= bound + 1e-7).all() and err.max() > 0


def test_shapes_the_kernel_cannot_take_are_named():
    assert "not a multiple of 32" in cpu_q8.takes(24)
    assert "not a multiple of 64" in cpu_q8.takes(96, 32)
    assert "group size 16" in cpu_q8.takes(64, 16)
    assert cpu_q8.takes(576, 64) is None


@needs_kernel
@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 64)])
def test_a_model_on_the_q8_path_decodes_close_to_the_pytorch_kernels(tiny, scheme, group):
    model, tok = tiny
    base = lab.quantize_model(model, scheme, group_size=group)
    q8 = lab.quantize_model(model, scheme, group_size=group)
    assert lab.use_q8_kernel(q8) > 0
    layers = [m for m in q8.modules() if isinstance(m, QuantLinear) and m.path == Q8_KERNEL]
    assert layers and all(m.kernels.pick(Q8_MAX_ROWS[scheme]).name == Q8_KERNEL for m in layers)
    assert all(m.kernels.pick(Q8_MAX_ROWS[scheme] + 1).name != Q8_KERNEL for m in layers)   # longer calls: PyTorch's
    ids = torch.tensor([tok.encode("def add(a, b):\n    return")])
    with torch.inference_mode():
        a, b = base(ids[:, -1:]), q8(ids[:, -1:])                 # one row: the hand-written kernel
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    out = lab.generate(q8, tok, "def add(a, b):\n", max_new_tokens=8, stop_at_eos=False)
    assert len(out.token_ids) == 8


@needs_kernel
def test_the_q8_path_runs_inside_a_compiled_step(tiny):
    model, tok = tiny
    q8 = lab.quantize_model(model, "int4", group_size=32)
    lab.use_q8_kernel(q8)
    eager = lab.generate(q8, tok, "def add(a, b):\n", max_new_tokens=6, stop_at_eos=False)
    compiled = lab.generate(q8, tok, "def add(a, b):\n", max_new_tokens=6, stop_at_eos=False, compile=True)
    assert compiled.token_ids == eager.token_ids            # the same kernel computes both, row by row


def test_use_q8_kernel_says_why_it_cannot(tiny, monkeypatch):
    model, _ = tiny
    with pytest.raises(ValueError, match="quantize it first"):
        lab.use_q8_kernel(model)
    monkeypatch.setattr(cpu_q8, "why_not", lambda: "this CPU has no AVX2 and FMA")
    with pytest.raises(ValueError, match="no AVX2"):
        lab.use_q8_kernel(lab.quantize_model(model, "int8"))


@needs_kernel
def test_a_new_build_replaces_older_ones(tmp_path):
    stale = tmp_path / "kernels" / "q8_dot-0000000000000000.so"
    stale.parent.mkdir()
    stale.write_bytes(b"an older build")
    out = tmp_path / "kernels" / "q8_dot-1111111111111111.so"
    cpu_q8._build(cpu_q8._compiler(), out)
    assert out.exists() and not stale.exists()


@needs_kernel
def test_a_bf16_model_runs_the_q8_path_from_fp32_copies_of_its_scales(tiny):
    model, tok = tiny
    model = copy.deepcopy(model).to(torch.bfloat16)              # Module.to is in place: the session model stays fp32
    base, q8 = (lab.quantize_model(model, "int4", group_size=64) for _ in range(2))
    assert lab.use_q8_kernel(q8) > 0
    ids = torch.tensor([tok.encode("def add(a, b):\n    return")])
    with torch.inference_mode():
        a, b = base(ids[:, -1:]).float(), q8(ids[:, -1:])
    assert b.dtype == torch.bfloat16                              # the layer's dtype, as PyTorch's paths give
    assert (a - b.float()).abs().max() < 0.05 * a.abs().max()


@needs_kernel
def test_operands_in_another_layout_are_refused_not_read():
    wq, s, z, _ = int4_layer_operands(8, 64, 64, 0)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="float32"):
        cpu_q8.q4_linear(x, wq, s.double(), z, 64)
    with pytest.raises(ValueError, match="not contiguous"):
        cpu_q8.q8w_linear(x, torch.zeros(64, 8, dtype=torch.int8).T, torch.ones(8))


@needs_kernel
def test_activations_round_half_to_even_as_the_reference_does():
    """An identity weight returns the quantized activations themselves: halves go to the even integer (lrintf's
    rule, and the reference's), in every lane of a block, one row alone or four together."""
    halves = torch.arange(31) - 15 + 0.5                                 # -14.5 ... 15.5: every lane a tie
    x = torch.cat([torch.tensor([127.0]), halves])[None].repeat(4, 1)    # amax 127: the scale d is exactly 1
    x[1] = -x[1]
    eye = torch.eye(32, dtype=torch.int8)
    want = torch.round(x)                                                # half to even
    assert torch.equal(cpu_q8.q8w_linear(x, eye, torch.ones(32)), want)
    assert torch.equal(cpu_q8.q8w_linear(x[1:2], eye, torch.ones(32)), want[1:2])
    assert torch.equal(cpu_q8.reference(x, eye.float()).float(), want)


@needs_kernel
def test_operands_off_the_cpu_are_refused_before_the_kernel_reads_memory():
    wq, s = torch.zeros(16, 32, dtype=torch.int8), torch.ones(16)
    with pytest.raises(ValueError, match="activations on the CPU, got them on meta"):
        cpu_q8.q8w_linear_eager(torch.zeros(1, 32, device="meta"), wq, s)
    with pytest.raises(ValueError, match="contiguous CPU operands of dtype torch.int8"):
        cpu_q8.q8w_linear_eager(torch.zeros(1, 32), wq.to("meta"), s)
    with pytest.raises(ValueError, match="not contiguous"):
        cpu_q8.q8w_linear_eager(torch.zeros(1, 32), torch.zeros(32, 16, dtype=torch.int8).t(), s)


needs_native = pytest.mark.skipif(cpu_q8.native_why_not() is not None, reason=f"{cpu_q8.native_why_not()}")


@needs_native
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(0, 9), blocks=st.integers(1, 6), n=st.integers(1, 40), group_blocks=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_the_cpp_operators_equal_the_python_ones_bit_for_bit(rows, blocks, n, group_blocks, seed):
    """The C++ registration calls the same kernel as the ctypes path: same bits, zero rows included."""
    K, G = 64 * group_blocks * blocks, 32 * group_blocks
    wq, s, z, _ = int4_layer_operands(n, K, G, seed)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed + 1))
    ops = torch.ops.infopt
    assert torch.equal(ops.q4_linear_native(x, wq, s, z, G), cpu_q8.q4_linear_eager(x, wq, s, z, G))
    w8 = torch.randint(-128, 128, (n, K), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    s8 = s[:, 0].contiguous()
    assert torch.equal(ops.q8w_linear_native(x, w8, s8), cpu_q8.q8w_linear_eager(x, w8, s8))
    assert torch.equal(ops.q8w_linear_native(x.double(), w8, s8), cpu_q8.q8w_linear_eager(x.double(), w8, s8))


@needs_native
@pytest.mark.parametrize("op", ["native", "python"])
def test_operands_the_kernel_cannot_read_are_refused_by_both_registrations(op):
    q4 = torch.ops.infopt.q4_linear_native if op == "native" else cpu_q8.q4_linear_eager
    q8w = torch.ops.infopt.q8w_linear_native if op == "native" else cpu_q8.q8w_linear_eager
    wq, s, z, _ = int4_layer_operands(8, 128, 64, 0)
    w8, s8 = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match=r"activations \[rows, 64\], got \[1, 96\]"):     # K unlike the weight's
        q8w(torch.zeros(1, 96), w8, s8)
    with pytest.raises(ValueError, match=r"activations \[rows, 128\]"):
        q4(torch.zeros(1, 64), wq, s, z, 64)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        q4(torch.zeros(1, 128), wq, s.double(), z, 64)
    with pytest.raises(ValueError, match="not contiguous"):
        q8w(torch.zeros(1, 8), torch.zeros(64, 8, dtype=torch.int8).T, s8)
    if op == "native":                            # shapes the Python registration leaves to the layer's own checks
        with pytest.raises(ValueError, match="one scale per output row"):
            q8w(torch.zeros(1, 64), w8, torch.ones(4))
        with pytest.raises(ValueError, match="group size that is a multiple of 32"):
            q4(torch.zeros(1, 128), wq, s, z, 48)
        with pytest.raises(ValueError, match=r"scales and zeros \[8, 2\]"):
            q4(torch.zeros(1, 128), wq, s[:, :1].contiguous(), z, 64)


def test_without_a_cpp_compiler_the_python_registration_is_used_and_the_reason_named(monkeypatch):
    monkeypatch.setattr(cpu_q8, "_cxx_compiler", lambda: None)
    loaded, why = cpu_q8._native.__wrapped__()            # the uncached call: this process's operators stay loaded
    assert not loaded and why is not None
    assert "no C++ compiler" in why or why == cpu_q8.why_not()


@needs_kernel
def test_a_compiled_step_on_the_python_registration_equals_eager(tiny, monkeypatch, capsys):
    """Where the C++ operators do not build, the compiled graph calls the Python-registered ones: same tokens,
    and switching says so in one line."""
    monkeypatch.setattr(cpu_q8, "_native", lambda: (False, "as on a machine without a C++ compiler"))
    model, tok = tiny
    q8 = lab.quantize_model(model, "int8")
    lab.use_q8_kernel(q8)
    assert "Python registration" in capsys.readouterr().out
    layer = next(m for m in q8.modules() if isinstance(m, QuantLinear))
    assert layer.kernels.paths[0].native is False
    copy.deepcopy(q8)                                            # a switched model still copies
    eager = lab.generate(q8, tok, "def add(a, b):\n", max_new_tokens=6, stop_at_eos=False)
    compiled = lab.generate(q8, tok, "def add(a, b):\n", max_new_tokens=6, stop_at_eos=False, compile=True)
    assert compiled.token_ids == eager.token_ids


# -- kernels/attention.c: infopt::one_query_attention ----------------------------------------------------------
@needs_native
@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 4), group=st.integers(1, 4), head_dim=st.integers(1, 80),
       capacity=st.integers(1, 300), at=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_one_query_attention_equals_pytorchs_kernel_and_reads_only_visible_positions(batch, kv_heads, group,
                                                                                    head_dim, capacity, at, seed):
    """Any head size (tails of fewer than eight lanes), grouped and plain heads, any position in the cache; the
    positions after it hold NaN, so reading one would show."""
    g = torch.Generator().manual_seed(seed)
    pos = min(int(at * capacity), capacity - 1)
    q = torch.randn(batch, kv_heads * group, 1, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, capacity, head_dim, generator=g) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=(torch.arange(capacity) <= pos)[None],
                                                            enable_gqa=group > 1)
    k[:, :, pos + 1:], v[:, :, pos + 1:] = float("nan"), float("nan")
    got = torch.ops.infopt.one_query_attention(q, k, v, torch.tensor([pos]))
    assert got.shape == q.shape and got.is_contiguous()
    assert (got - want).abs().max() <= 1e-5


@needs_native
def test_one_query_attention_refuses_what_it_cannot_read():
    q, kv = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 4, 8)
    call = torch.ops.infopt.one_query_attention
    for args, says in [((q, kv, kv, torch.tensor([4])), "outside the cache's 4 positions"),
                       ((q, kv, kv, torch.tensor([-1])), "outside the cache's 4 positions"),
                       ((q, kv, kv, torch.tensor([1, 2])), "one int64 position"),
                       ((q, kv, kv, torch.tensor([1.0])), "one int64 position"),
                       ((q.bfloat16(), kv, kv, torch.tensor([1])), "fp32 CPU q, k and v"),
                       ((torch.randn(1, 6, 2, 8), kv, kv, torch.tensor([1])), "one query per head"),
                       ((torch.randn(1, 5, 1, 8), kv, kv, torch.tensor([1])), "a multiple of H_kv"),
                       ((q, kv, torch.randn(1, 2, 5, 8), torch.tensor([1])), "of one shape")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            call(*args)
