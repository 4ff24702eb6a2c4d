"""Triton kernels equal their plain-PyTorch references: int4 matmul and the streaming softmax.

On a CPU the kernels run in Triton's interpreter (tests/conftest.py switches it on before anything imports
Triton); with CUDA they compile. The attention kernels are tested in test_attention.py.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import infopt_lab as lab
from infopt_lab.device import HAS_CUDA, HAS_TRITON
from infopt_lab.kernels.int4_matmul import int4_matmul, int4_matmul_reference
from infopt_lab.kernels.softmax import online_softmax_reference, softmax_triton
from infopt_lab.quantize import DEQUANT_MATMUL, TRITON_INT4

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed, so there is no kernel to run")
DEVICE = lab.get_device()
DTYPES = [torch.float32, torch.float16]          # what the interpreter runs (no bf16)
KERNELS = Path(lab.__file__).parent / "kernels"


def _random(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- every kernel argument is commented -----------------------------------------------------------------
def _jit_kernels():
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield path, node


def test_every_kernel_argument_is_commented():
    found = []
    for path, fn in _jit_kernels():
        lines = path.read_text().splitlines()
        args = fn.args.args
        found.append(fn.name)
        rows = [a.lineno for a in args]
        assert len(set(rows)) == len(rows), f"{path.name}: {fn.name} has several arguments on one line"
        for a in args:
            assert "#" in lines[a.lineno - 1], f"{path.name}: argument {a.arg} of {fn.name} has no comment"
    assert sorted(found) == ["_flash_attention_fwd", "_int4_matmul_kernel", "_paged_decode_kernel",
                             "_softmax_rows_kernel"]


# -- int4 matmul ------------------------------------------------------------------------------------------
# (rtol, atol as a share of the largest |output|): fp32 differs from the reference by summation order only;
# fp16 by a rounding of the output (2**-11) and, compiled, by the tf32 dot the kernel uses for fp16 activations.
INT4_TOL = {torch.float32: (1e-5, 2e-6), torch.float16: (1e-3, 1e-3)}
INT4_CASES = [  # (M, N, K, G): rows of x, output features, input features, group size
    (1, 48, 64, 32),      # one decode token; N not a multiple of BLOCK_N=32
    (5, 32, 128, 64),     # a group spans two BLOCK_K=32 steps
    (17, 40, 96, 32),     # M past one BLOCK_M=16 tile
    (3, 32, 80, 16),      # K not a multiple of BLOCK_K: the last step is masked; groups smaller than a step
    (4, 16, 64, 64),      # per-channel: one group per row (G = K)
]


def assert_int4_close(got, ref, dtype):
    rtol, atol = INT4_TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol * ref.float().abs().max().item())


def _int4_args(M, N, K, G, dtype, seed=0):
    """x [M, K] and a random W [N, K] quantized to int4, on DEVICE: (x, packed, scales, zeros)."""
    q, s, z = lab.quantize_asymmetric(_random(N, K, seed=seed), 4, G)
    x = _random(M, K, seed=seed + 1, dtype=dtype)
    return [t.to(DEVICE) for t in (x, lab.pack_int4(q), s.to(dtype), z)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K,G", INT4_CASES)
def test_int4_matmul_matches_reference(M, N, K, G, dtype):
    args = _int4_args(M, N, K, G, dtype)
    got, ref = int4_matmul(*args), int4_matmul_reference(*args)
    assert got.shape == (M, N) and got.dtype == dtype
    assert_int4_close(got, ref, dtype)


@needs_triton
def test_int4_matmul_follows_the_strides_of_x():
    x, packed, s, z = _int4_args(6, 32, 64, 32, torch.float32)
    x_t = x.T.contiguous().T                                   # the same values, column-major: strides (1, 6)
    assert x_t.stride() == (1, 6)
    assert_int4_close(int4_matmul(x_t, packed, s, z), int4_matmul_reference(x, packed, s, z), torch.float32)


@needs_triton
def test_int4_matmul_rejects_what_it_cannot_read():
    x, packed, s, z = _int4_args(2, 16, 64, 32, torch.float32)
    with pytest.raises(ValueError, match=r"packed must be uint8 \[N, K/2\] = \[16, 32\]"):
        int4_matmul(x, packed[:, :16], s, z)
    with pytest.raises(ValueError, match="scales and zeros must be"):
        int4_matmul(x, packed, s[:, :1], z)
    with pytest.raises(ValueError, match="share strides"):
        int4_matmul(x, packed, s, z.T.contiguous().T)


@needs_triton
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_quant_linear_triton_path_equals_dequantize_path(bias):
    torch.manual_seed(0)
    layer = lab.quantize_linear(torch.nn.Linear(64, 48, bias=bias), "int4", group_size=32).to(DEVICE)
    x = _random(2, 3, 64).to(DEVICE)                          # (B, T, K): the layer flattens and restores B, T
    layer.path = DEQUANT_MATMUL
    expected = layer(x)
    layer.path = TRITON_INT4                                   # what choose_path picks on CUDA
    assert_int4_close(layer(x), expected, torch.float32)


# -- streaming softmax ------------------------------------------------------------------------------------
def _softmax_input(kind: str, dtype: torch.dtype) -> torch.Tensor:
    inf = float("-inf")
    if kind == "one column":
        return _random(3, 1, dtype=dtype)
    if kind == "one block":
        return _random(4, 16, dtype=dtype)
    if kind == "ragged":                                       # 37 columns: the third block is masked
        return _random(5, 37, dtype=dtype)
    if kind == "strided rows":                                 # rows 64 apart, 37 columns used (sliced on the
        return _random(3, 64, dtype=dtype).to(DEVICE)[:, 5:42]  # device: a copy there would be contiguous)
    if kind in ("-1e4", "+1e4"):                               # without subtracting the max: 0/0 or inf/inf
        return (_random(3, 50) * 3 + float(kind)).to(dtype)
    if kind == "spread":                                       # most exp(x - max) underflow to exactly 0
        return (_random(3, 40) * 1e3).to(dtype)
    if kind == "masked":                                       # -inf: leading blocks, tail, every other, all but one
        x = _random(4, 40)
        x[0, :20], x[1, 30:], x[2, ::2], x[3, 1:] = inf, inf, inf, inf
        return x.to(dtype)
    if kind == "all masked":                                   # softmax of nothing: NaN, as in torch
        return torch.full((2, 20), inf, dtype=dtype)
    raise ValueError(kind)


SOFTMAX_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float16: dict(rtol=1e-3, atol=1e-5)}
SOFTMAX_CASES = ["one column", "one block", "ragged", "strided rows", "-1e4", "+1e4", "spread", "masked",
                 "all masked"]


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")   # "all masked": -inf - -inf
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", SOFTMAX_CASES)
def test_softmax_kernel_matches_torch(kind, dtype):
    x = _softmax_input(kind, dtype).to(DEVICE)
    got = softmax_triton(x, block=16)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), torch.softmax(x.float(), dim=-1), equal_nan=True, **SOFTMAX_TOL[dtype])


@needs_triton
@pytest.mark.parametrize("block", [1, 4, 64])
def test_softmax_kernel_is_the_same_for_every_block_size(block):
    x = _softmax_input("masked", torch.float32).to(DEVICE)
    torch.testing.assert_close(softmax_triton(x, block=block), torch.softmax(x, dim=-1), **SOFTMAX_TOL[torch.float32])


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="a compiled kernel prints from the GPU, in another format")
def test_softmax_kernel_prints_the_reference_trace(capfd):
    row = torch.tensor([2.0, 1.0, 3.0, 0.5, 5.0, -1.0, 4.0])       # the notebook's row: the max rises twice
    softmax_triton(torch.stack([row, -row]), block=2, verbose=True)   # prints row 0 only
    printed = capfd.readouterr().out
    values = lambda name: [float(v) for v in re.findall(rf"running {name}:\s*\[([^\]]+)\]", printed)]
    trace = online_softmax_reference(row, 2)[1]
    assert values("max") == [m for m, _ in trace]
    assert values("sum") == pytest.approx([l for _, l in trace], rel=1e-6)


@pytest.mark.parametrize("kind", ["ragged", "-1e4", "masked"])
def test_online_softmax_reference_matches_torch(kind):
    for row in _softmax_input(kind, torch.float32):
        probs, trace = online_softmax_reference(row, block=4)
        torch.testing.assert_close(probs, torch.softmax(row, dim=-1), rtol=1e-6, atol=1e-7)
        m, l = trace[-1]                                       # the final statistics: max and sum of exp(x - max)
        assert m == row.max().item()
        assert l == pytest.approx(torch.exp(row.double() - m).sum().item(), rel=1e-12)
        assert len(trace) == -(-row.numel() // 4)              # one entry per block


@needs_triton
def test_softmax_triton_rejects_bad_input():
    with pytest.raises(ValueError, match="block must be a power of two, got 12"):
        softmax_triton(torch.randn(2, 8), block=12)
    with pytest.raises(ValueError, match="2-D tensor contiguous in its last dim"):
        softmax_triton(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="2-D tensor contiguous in its last dim"):
        softmax_triton(torch.randn(8, 2).T)


# -- the interpreter switch -------------------------------------------------------------------------------
ORDER_CHECK = textwrap.dedent("""
    import sys
    if sys.argv[1] == "triton-first":
        import triton
    import torch
    import infopt_lab as lab
    import triton                                   # as transformers does when a model loads
    from infopt_lab.kernels.int4_matmul import int4_matmul, int4_matmul_reference
    q, s, z = lab.quantize_asymmetric(torch.randn(16, 64), 4, 32)
    args = (torch.randn(2, 64), lab.pack_int4(q), s, z)
    try:
        torch.testing.assert_close(int4_matmul(*args), int4_matmul_reference(*args), rtol=1e-4, atol=1e-4)
        print("ok")
    except RuntimeError as e:
        print("error:", e)
""")


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="the interpreter is only used without CUDA")
@pytest.mark.parametrize("order", ["package-first", "triton-first"])
def test_importing_triton_before_the_package_is_caught_with_a_clear_error(order):
    """Runs in a fresh interpreter, because what it checks is import order: Triton reads TRITON_INTERPRET once,
    when first imported, and this pytest process imported it (with the interpreter on) long ago. Importing the
    package first must leave the kernels working; importing Triton first must give the package's clear error.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", ORDER_CHECK, order], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if order == "package-first":
        assert out.stdout.strip() == "ok", out.stdout + out.stderr[-3000:]
    else:
        assert "error: Triton was imported before TRITON_INTERPRET=1" in out.stdout, out.stdout
