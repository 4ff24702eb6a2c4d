"""The dtype policy by compute capability: one function decides, kernels refuse what a device cannot run."""
from __future__ import annotations

import pytest
import torch

import infopt_lab as lab
from infopt_lab.device import check_dtype, default_dtype, supported_dtypes

T4, A100, L4, H100 = (7, 5), (8, 0), (8, 9), (9, 0)


def test_bf16_only_where_the_gpu_has_it():
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda", T4) == torch.float16            # whatever torch.cuda.is_bf16_supported() says
    assert [default_dtype("cuda", cap) for cap in (A100, L4, H100)] == [torch.bfloat16] * 3
    assert torch.bfloat16 not in supported_dtypes(T4) and torch.bfloat16 not in supported_dtypes(None)
    assert supported_dtypes(H100) == (torch.float32, torch.float16, torch.bfloat16)


def test_a_dtype_the_device_cannot_run_is_refused_naming_what_it_can():
    with pytest.raises(ValueError, match=r"bfloat16 on a GPU of compute capability 7.5: allowed are float32, float16"):
        check_dtype(torch.bfloat16, T4, "the FlashAttention kernel")
    with pytest.raises(ValueError, match=r"on a CPU \(Triton's interpreter\): allowed are float32, float16"):
        check_dtype(torch.bfloat16, None)
    with pytest.raises(ValueError, match="allowed are float32, float16, bfloat16"):
        check_dtype(torch.float64, A100)
    check_dtype(torch.bfloat16, A100)


@pytest.mark.skipif(not lab.HAS_TRITON, reason="Triton is not installed, so there is no kernel to plan")
def test_kernel_launchers_refuse_bf16_on_a_t4():
    from infopt_lab.kernels.flash_attention import plan_flash_attention
    from infopt_lab.kernels.paged_attention import plan_paged_decode
    q = torch.zeros(1, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="FlashAttention kernel cannot run in torch.bfloat16 .* 7.5"):
        plan_flash_attention(q, q, q, True, T4)
    assert plan_flash_attention(q, q, q, True, A100).options["BLOCK_M"] == 128     # sm_80 takes it
    cache, tables, lens = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16), torch.zeros(1, 2), torch.ones(1)
    with pytest.raises(ValueError, match="paged decode kernel cannot run in torch.bfloat16"):
        plan_paged_decode(q[:, :, 0], cache, cache, tables, lens, T4)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_autocast_only_where_the_cpu_has_bf16(monkeypatch, native):
    """Emulated bf16 is many times slower than fp32 on a CPU without AVX512-BF16/AMX: training stays in fp32 there."""
    monkeypatch.setattr(lab.device, "cpu_has_native_bf16", lambda: native)
    with lab.device.bf16_autocast("cpu"):
        assert torch.is_autocast_enabled("cpu") is native
