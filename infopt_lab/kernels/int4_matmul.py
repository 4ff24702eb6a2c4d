"""W4A16 matmul: y = x @ W.T where W is int4, packed two per byte, with a scale and zero point per group.

The plain-PyTorch reference unpacks and dequantizes the whole weight to floats,
then multiplies: it writes and re-reads N*K floats (4 or 2 bytes each) beyond the
N*K/2 bytes of packed weight. The Triton kernel dequantizes each [BLOCK_N, BLOCK_K]
tile in registers right after loading it, so only the packed bytes cross memory.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..device import HAS_TRITON, capability, check_dtype
from ..quant_format import dequantize, unpack_int4   # the format only: the quantizers import this module
from . import Launch, require_interpreter, require_same_device


def int4_matmul_reference(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """x [M, K] @ dequantized W.T -> [M, N]; packed [N, K/2] uint8, scales/zeros [N, K/G]."""
    w = dequantize(unpack_int4(packed), scales, zeros, dtype=torch.float32)   # (N, K)
    return (x.float() @ w.T).to(x.dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _int4_matmul_kernel(
        x_ptr,                     # activations x [M, K]
        w_ptr,                     # packed weight [N, K/2] uint8: w[n, k] is nibble k % 2 of byte k // 2
        s_ptr,                     # scales [N, K/G]
        z_ptr,                     # zero points [N, K/G] uint8, same strides as the scales
        y_ptr,                     # output y [M, N], in x's dtype
        M,                         # rows of x (tokens)
        N,                         # output features (rows of W)
        K,                         # input features (even: two per packed byte)
        stride_xm,                 # x stride over rows (elements)
        stride_xk,                 # x stride over input features
        stride_wn,                 # packed-weight stride over output features (bytes)
        stride_wk,                 # packed-weight stride over bytes along K
        stride_sn,                 # scale and zero stride over output features
        stride_sg,                 # scale and zero stride over groups
        stride_ym,                 # y stride over rows
        stride_yn,                 # y stride over output features
        GROUP: tl.constexpr,       # quantization group size G along K (K / number of scale columns)
        BLOCK_M: tl.constexpr,     # rows of x per program (a power of two, >= 16 for tl.dot)
        BLOCK_N: tl.constexpr,     # output features per program (a power of two, >= 16)
        BLOCK_K: tl.constexpr,     # input features per inner step (a power of two, >= 16)
        PRECISION: tl.constexpr,   # "ieee" for exact fp32 dots, "tf32" otherwise
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # rows of x and y
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # rows of W, columns of y
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)      # (BLOCK_M, BLOCK_K)
            wmask = (rn[:, None] < N) & (rk[None, :] < K)
            byte = tl.load(w_ptr + rn[:, None] * stride_wn + (rk[None, :] // 2) * stride_wk,
                           mask=wmask, other=0)                                  # (BLOCK_N, BLOCK_K) uint8
            q = (byte >> ((rk[None, :] % 2) * 4).to(tl.uint8)) & 0xF                # low nibble = even k
            g = rk[None, :] // GROUP
            s = tl.load(s_ptr + rn[:, None] * stride_sn + g * stride_sg, mask=wmask, other=0.0)
            z = tl.load(z_ptr + rn[:, None] * stride_sn + g * stride_sg, mask=wmask, other=0)
            w = (q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)         # (BLOCK_N, BLOCK_K)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=PRECISION)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
                 acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def plan_int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor, cap: tuple[int, int] | None,
                     block_m: int = 16, block_n: int = 32, block_k: int = 32) -> Launch:
    """The launch for compute capability `cap` (None: the interpreter): checks, grid over tiles of y, arguments."""
    require_same_device(x=x, packed=packed, scales=scales, zeros=zeros)
    M, K = x.shape
    N, half_k = packed.shape
    if packed.dtype != torch.uint8 or half_k * 2 != K:
        raise ValueError(f"packed must be uint8 [N, K/2] = [{N}, {K // 2}], got {packed.dtype} {tuple(packed.shape)}")
    if scales.shape != zeros.shape or scales.shape[0] != N or K % scales.shape[1]:
        raise ValueError(f"scales and zeros must be [N, K/G] with G dividing K={K}, got "
                         f"{tuple(scales.shape)} and {tuple(zeros.shape)}")
    if zeros.stride() != scales.stride():                          # the kernel reads both with one set of strides
        raise ValueError(f"scales and zeros must share strides, got {scales.stride()} and {zeros.stride()}; "
                         f"call .contiguous() on both")
    check_dtype(x.dtype, cap, "the int4 matmul kernel")
    group = K // scales.shape[1]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    return Launch(_int4_matmul_kernel, grid, (
        x, packed, scales, zeros, y, M, N, K,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1),
        scales.stride(0), scales.stride(1), y.stride(0), y.stride(1)), dict(
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32"), out=y)


def int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor,
                block_m: int = 16, block_n: int = 32, block_k: int = 32) -> Tensor:
    """The Triton kernel: x [M, K] @ dequantized W.T -> [M, N], same arguments as the reference."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed here; use int4_matmul_reference")
    if x.device.type != "cuda":
        require_interpreter()
    return plan_int4_matmul(x, packed, scales, zeros, capability(x.device), block_m, block_n, block_k).run()
