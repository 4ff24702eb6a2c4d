"""Triton kernels agree with their plain-PyTorch references (under the interpreter on a CPU)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from infopt_lab.device import HAS_CUDA, HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

# Run in a fresh interpreter: TRITON_INTERPRET must be set before any @triton.jit is defined,
# and another test may already have imported the kernels in this process.
INT4_CHECK = textwrap.dedent("""
    import torch
    import infopt_lab as lab
    from infopt_lab.kernels.int4_matmul import int4_matmul, int4_matmul_reference
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for M, N, K, G, dtype, tol in [(1, 48, 64, 32, torch.float32, 1e-4), (5, 32, 128, 64, torch.float32, 1e-4),
                                   (17, 40, 96, 32, torch.float16, 1e-2)]:
        w = torch.randn(N, K, generator=g)
        q, s, z = lab.quantize_asymmetric(w, 4, G)
        packed = lab.pack_int4(q)
        x = torch.randn(M, K, generator=g).to(dtype)
        args = [t.to(device) for t in (x, packed, s.to(dtype), z)]
        got, ref = int4_matmul(*args), int4_matmul_reference(*args)
        assert got.shape == (M, N) and got.dtype == dtype, (got.shape, got.dtype)
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    print("ok")
""")


def test_int4_matmul_matches_reference():
    env = dict(os.environ)
    if not HAS_CUDA:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", INT4_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


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


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter is only used without CUDA")
def test_importing_the_package_first_enables_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = lambda order: subprocess.run([sys.executable, "-c", ORDER_CHECK, order], capture_output=True,
                                       text=True, env=env, timeout=300)
    assert run("package-first").stdout.strip() == "ok"
    late = run("triton-first").stdout
    assert "error: Triton was imported before TRITON_INTERPRET=1" in late, late
