"""Attention: the Triton kernels equal their plain-PyTorch references (under the interpreter on a CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import infopt_lab as lab
from infopt_lab.device import HAS_CUDA, HAS_TRITON
from infopt_lab.kernels.attention_ref import causal_mask, peak_intermediate_bytes
from infopt_lab.kernels.flash_attention import flash_attention_triton
from infopt_lab.kernels.paged_attention import paged_attention_reference, paged_decode_attention

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed, so there is no kernel to run")


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


# -- the Triton kernels (interpreted on a CPU: tests/conftest.py switches the interpreter on) --------------
DEVICE = lab.get_device()
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3}   # fp16: the output's rounding (2**-11 near 1), and fp16 dots
FLASH_CASES = [  # (N, N_k, D): queries, keys, head dim
    (1, 1, 16),          # one query, one key
    (77, 77, 32),        # neither length a multiple of the 64-row blocks
    (130, 130, 64),      # three query blocks, the last with two rows
    (256, 256, 128),     # full blocks only, the largest head dim
    (1, 300, 64),        # a decode step: one query after cached keys
    (7, 300, 32),        # a chunk after cached keys: the causal mask is aligned bottom-right
]


def _on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def assert_attention_close(out, q, k, v, causal):
    """out equals attention_reference in fp32 on the same (rounded) inputs, within out's dtype's tolerance."""
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = lab.attention_reference(q.float(), k.float(), v.float(), causal)
    torch.testing.assert_close(out.float(), ref, atol=ATOL[q.dtype], rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("N,N_k,D", FLASH_CASES)
def test_flash_attention_kernel_matches_reference(N, N_k, D, causal, dtype):
    q, k, v = _on_device(*_qkv(2, 4, 2, N, N_k, D, dtype))          # grouped-query: two query heads per KV head
    assert_attention_close(flash_attention_triton(q, k, v, causal), q, k, v, causal)


@needs_triton
@pytest.mark.parametrize("layout", ["one KV head per query head", "one KV head for all", "model layout",
                                    "small blocks"])
def test_flash_attention_kernel_heads_strides_and_blocks(layout):
    B, H, N, D = 2, 4, 45, 32
    H_kv = {"one KV head per query head": 4, "one KV head for all": 1}.get(layout, 2)
    q, k, v = _on_device(*_qkv(B, H, H_kv, N, N, D))
    blocks = {}
    if layout == "model layout":                    # [B, N, H, D] transposed to [B, H, N, D]: not contiguous
        q, k, v = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        assert not q.is_contiguous()
    if layout == "small blocks":                    # several query and key tiles, each with a tail
        blocks = dict(block_m=16, block_n=32)
    assert_attention_close(flash_attention_triton(q, k, v, True, **blocks), q, k, v, True)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("H,H_kv,block_size", [(8, 2, 16), (4, 4, 4), (4, 1, 8)])
def test_paged_decode_kernel_matches_gather_reference(H, H_kv, block_size, dtype):
    g = torch.Generator().manual_seed(0)
    n_blocks, D, max_blocks = 40, 32, 100 // block_size + 1
    k_cache, v_cache = [torch.randn(n_blocks, block_size, H_kv, D, generator=g).to(dtype) for _ in range(2)]
    lens = torch.tensor([1, block_size, 2 * block_size + 1, 100, 33])   # one token, a full block, a tail, ...
    tables = torch.stack([torch.randperm(n_blocks, generator=g)[:max_blocks] for _ in lens])   # scattered blocks
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    args = _on_device(q, k_cache, v_cache, tables, lens)
    got, ref = paged_decode_attention(*args), paged_attention_reference(*args)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=ATOL[dtype], rtol=0)


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


@pytest.mark.filterwarnings("ignore:Triton cannot run here")
def test_attention_path_names_what_runs_here():
    # conftest.py turns the interpreter on exactly when there is no CUDA; with CUDA a CPU tensor has no kernel
    assert lab.attention_path("cpu") == ("triton-interpreter" if HAS_TRITON and not HAS_CUDA else "reference")
    if HAS_CUDA:
        assert lab.attention_path("cuda") == ("triton-compiled" if HAS_TRITON else "reference")
    q, k, v = _on_device(*_qkv(1, 4, 2, 9, 9, 32))
    torch.testing.assert_close(lab.flash_attention(q, k, v), lab.attention_reference(q, k, v), atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:Triton cannot run here")
def test_flash_attention_rejects_bad_input():
    q, k, v = _qkv(1, 4, 2, 8, 8, 32)
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


@pytest.mark.parametrize("H, H_kv, T", [(4, 4, 1), (6, 2, 1), (6, 3, 3)])
def test_shared_prefix_attention_equals_attention_over_the_concatenation(H, H_kv, T):
    from infopt_lab.attention import shared_prefix_attend
    B, D, P, S = 4, 16, 12, 9
    q, k, v = _qkv(B, H, H_kv, T, S, D)
    _, kp, vp = _qkv(1, H, H_kv, T, P, D, seed=1)
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(T, S + 1, (B,), generator=g)                        # each sequence's own keys
    qpos = lens[:, None] - T + torch.arange(T)[None]                          # (B, T) query positions after the prefix
    allowed = (torch.arange(S)[None, None, :] <= qpos[:, :, None])[:, None]   # (B, 1, T, S)
    got = shared_prefix_attend(q, kp, vp, k, v, allowed)
    keys = torch.cat([kp.expand(B, -1, -1, -1), k], 2)
    values = torch.cat([vp.expand(B, -1, -1, -1), v], 2)
    mask = torch.cat([torch.ones(B, 1, T, P, dtype=torch.bool), allowed], -1)
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=H != H_kv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
