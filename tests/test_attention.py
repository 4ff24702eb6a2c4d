"""Attention: the Triton kernels equal their plain-PyTorch references (under the interpreter on a CPU)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import infopt_lab as lab
from infopt_lab.device import HAS_CUDA, HAS_TRITON
from infopt_lab.kernels.attention_ref import causal_mask, peak_intermediate_bytes

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


def _qkv(B, H, H_kv, N, N_k, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((B, H, N, D), (B, H_kv, N_k, D), (B, H_kv, N_k, D))]


@pytest.mark.parametrize("N,N_k", [(1, 1), (77, 77), (130, 130), (1, 300), (20, 300)])
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_reference_and_sdpa_agree(N, N_k, causal):
    q, k, v = _qkv(2, 4, 2, N, N_k, 32)
    ref = lab.attention_reference(q, k, v, causal)
    tiled = lab.attention_tiled(q, k, v, causal, block_m=16, block_n=32)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(N, N_k) if causal else None, enable_gqa=True)
    torch.testing.assert_close(tiled, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=0)


def test_naive_memory_grows_quadratically_and_tiled_linearly():
    sizes = {N: [peak_intermediate_bytes(fn, *_qkv(1, 2, 2, N, N, 32)) for fn in (lab.attention_reference,
                                                                                 lab.attention_tiled)]
             for N in (256, 1024)}
    naive_growth = sizes[1024][0] / sizes[256][0]
    tiled_growth = sizes[1024][1] / sizes[256][1]
    assert 10 < naive_growth <= 16                # x4 in N: close to x16 for the N x N scores
    assert 2 < tiled_growth < 6                   # close to x4: linear in N


# The kernels run in a fresh interpreter: TRITON_INTERPRET must be set before any @triton.jit is defined.
KERNEL_CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    import infopt_lab as lab
    from infopt_lab.kernels.attention_ref import causal_mask
    from infopt_lab.kernels.flash_attention import flash_attention_triton
    from infopt_lab.kernels.paged_attention import paged_decode_attention, paged_attention_reference
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    worst = {}
    cases = [(N, N, D) for N in (1, 77, 130, 256) for D in (16, 32, 64, 128)] + [(1, 300, 64), (7, 300, 32)]
    for dtype, tol in [(torch.float32, 1e-5), (torch.float16, 2e-3)]:
        for N, N_k, D in cases:
            for causal in (True, False):
                q, k, v = [torch.randn(*s, generator=g).to(dtype).to(dev)
                           for s in ((2, 4, N, D), (2, 2, N_k, D), (2, 2, N_k, D))]
                out = flash_attention_triton(q, k, v, causal)
                assert out.shape == q.shape and out.dtype == dtype
                ref = lab.attention_reference(q.float(), k.float(), v.float(), causal)
                sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True,
                                                      attn_mask=causal_mask(N, N_k, dev) if causal else None)
                err = max((out.float() - ref).abs().max().item(), (out.float() - sdpa).abs().max().item())
                assert err <= tol, (dtype, N, N_k, D, causal, err)
                worst[dtype] = max(worst.get(dtype, 0.0), err)
    for dtype in (torch.float32, torch.float16):
        kc, vc = [torch.randn(40, 16, 2, 32, generator=g).to(dtype).to(dev) for _ in range(2)]
        lens = torch.tensor([1, 17, 64, 100, 33], device=dev)
        tables = torch.stack([torch.randperm(40, generator=g)[:7] for _ in range(5)]).to(dev)
        q = torch.randn(5, 8, 32, generator=g).to(dtype).to(dev)
        got, ref = paged_decode_attention(q, kc, vc, tables, lens), paged_attention_reference(q, kc, vc, tables, lens)
        assert (got.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-3)
    print("ok", {str(k): v for k, v in worst.items()})
""")


@needs_triton
def test_triton_kernels_match_references():
    env = dict(os.environ)
    if not HAS_CUDA:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


@needs_triton
def test_engine_with_the_paged_kernel_equals_the_gather_path(tiny):
    model, tok = tiny
    prompts, news = ["x = 1", "def f(a, b):", "import os"], [6, 3, 5]
    gather = lab.Engine(model, tok, max_batch_size=3, block_size=4).generate(prompts, max_new_tokens=news,
                                                                            stop_at_eos=False)
    engine = lab.Engine(model, tok, max_batch_size=3, block_size=4)
    engine.runner.paged_kernel = True                # the interpreter on a CPU
    kernel = engine.generate(prompts, max_new_tokens=news, stop_at_eos=False)
    assert [o.token_ids for o in kernel] == [o.token_ids for o in gather]


def test_flash_attention_reports_its_path_and_rejects_bad_input():
    q, k, v = _qkv(1, 4, 2, 8, 8, 32)
    assert lab.attention_path("cpu") in ("triton-interpreter", "reference")
    with pytest.raises(ValueError, match="multiple"):
        lab.flash_attention(q, k[:, :1].expand(1, 3, 8, 32), v[:, :1].expand(1, 3, 8, 32))
    with pytest.raises(ValueError, match="same shape"):
        lab.flash_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="dtype"):
        lab.flash_attention(q, k.double(), v.double())
    with pytest.raises(ValueError, match="at least as many keys"):
        lab.flash_attention(q, k[:, :, :4], v[:, :, :4], causal=True)
    if lab.attention_path("cpu") != "reference":
        with pytest.raises(ValueError, match="power of two"):
            lab.flash_attention(*_qkv(1, 2, 2, 8, 8, 48))
        with pytest.raises(ValueError, match="contiguous"):
            qt = torch.randn(1, 2, 32, 8).transpose(-1, -2)     # head dim not contiguous
            lab.flash_attention(qt, qt, qt)
