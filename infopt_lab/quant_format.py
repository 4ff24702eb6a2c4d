"""How quantized weights are stored and read back: int4 values two per byte, and w ~ (q - zero) * scale.

The quantizers (`quantize.py`, `gptq.py`) write this format; `QuantLinear` and the int4
Triton kernel (`kernels/int4_matmul.py`) read it. It sits below all of them and imports
none of them, so the kernel can read the format without importing the quantizers that
dispatch to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INT4_KERNEL_GROUPS = (256, 128, 64, 32)   # the group sizes aten._weight_int4pack_mm_for_cpu takes


# -- int4 packing: two 4-bit values per byte -------------------------------------------------------
def pack_int4(q: Tensor) -> Tensor:
    """Pack values 0..15 along the last dim, two per byte (low nibble first): [..., K] -> [..., ceil(K/2)] uint8."""
    if q.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"pack_int4 takes an integer tensor, got {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"pack_int4 takes values 0..15, got values in {int(q.min())}..{int(q.max())}")
    q = q.to(torch.uint8)
    if q.shape[-1] % 2:                                           # odd length: pad one zero nibble
        q = F.pad(q, (0, 1))
    return q[..., 0::2] | (q[..., 1::2] << 4)                     # (..., ceil(K/2))


def unpack_int4(packed: Tensor, length: int | None = None) -> Tensor:
    """Inverse of pack_int4: [..., B] uint8 -> [..., length] uint8 (length defaults to 2*B)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 takes a uint8 tensor, got {packed.dtype}")
    n = packed.shape[-1] * 2
    length = n if length is None else length
    if not n - 1 <= length <= n:
        raise ValueError(f"length must be {n - 1} or {n} for {packed.shape[-1]} packed bytes, got {length}")
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1)        # (..., B, 2)
    return q.flatten(-2)[..., :length]                            # (..., length)


# -- integers back to floats -----------------------------------------------------------------------
def dequantize(q: Tensor, scale: Tensor, zero: Tensor | None = None,
               dtype: torch.dtype | None = None) -> Tensor:
    """w ~ (q - zero) * scale, with the group size read from the shapes: q [N, K], scale [N, K/G] -> [N, K]."""
    dtype = dtype or scale.dtype
    N, K = q.shape
    if scale.numel() == 1:                                        # per-tensor
        scale = scale.reshape(1, 1)
        zero = zero.reshape(1, 1) if zero is not None else None
        g = q.reshape(1, 1, -1).float()
    else:
        g = q.reshape(N, scale.shape[-1], -1).float()             # (N, K/G, G)
    if zero is not None:
        g = g - zero.float()[..., None]
    return (g * scale.float()[..., None]).reshape(N, K).to(dtype)


# -- the same int4 weights in the form of PyTorch's CPU int4 kernel --------------------------------
def int4_kernel_scales_and_zeros(scales: Tensor, zeros: Tensor, group_size: int, kernel_group: int,
                                 dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Our (scale, integer zero) per group as the (scale, float offset) pairs of aten._weight_int4pack_mm_for_cpu.

    The kernel reads w = (q - 8) * scale + offset; ours is w = (q - zero) * scale, so offset = (8 - zero) * scale,
    exact in real arithmetic. The kernel's groups may be finer than ours (`kernel_group` divides `group_size`):
    each of our groups' pair is repeated over the kernel groups it covers.
    scales, zeros [N, K/group_size] -> [K/kernel_group, N, 2] in `dtype` (the kernel takes bf16 here).
    """
    if group_size % kernel_group:
        raise ValueError(f"kernel_group must divide group_size {group_size}, got {kernel_group}")
    s = scales.float().repeat_interleave(group_size // kernel_group, dim=1)      # (N, K/kernel_group)
    z = zeros.float().repeat_interleave(group_size // kernel_group, dim=1)
    return torch.stack((s, (8.0 - z) * s), dim=-1).transpose(0, 1).contiguous().to(dtype)   # (K/kg, N, 2)


def int4_kernel_group(group_size: int) -> int | None:
    """The group size the CPU int4 kernel runs a layer of ours with: the largest of its sizes dividing ours, or None."""
    return next((g for g in INT4_KERNEL_GROUPS if group_size % g == 0), None)


def pack_int4_for_cpu_kernel(weight_q: Tensor, scales: Tensor, zeros: Tensor,
                             in_features: int) -> tuple[Tensor, Tensor, int]:
    """Our packed int4 layer as aten._weight_int4pack_mm_for_cpu's operands: (packed weight, scales and offsets, group).

    The integers are the same; the kernel's own packing (a tiled order of nibbles) is PyTorch's business, so it is
    done by PyTorch's converter. Raises ValueError where the kernel cannot take the layer.
    """
    N, K = weight_q.shape[0], in_features
    group_size = K // scales.shape[-1]
    kernel_group = int4_kernel_group(group_size)
    if kernel_group is None:
        raise ValueError(f"group size {group_size} is not a multiple of one the kernel takes {INT4_KERNEL_GROUPS}")
    if N % 16:
        raise ValueError(f"{N} output features are not a multiple of 16")
    q = unpack_int4(weight_q.cpu(), K).to(torch.int32)                               # (N, K) in 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)                 # (N, K/2) uint8, tiled
    sz = int4_kernel_scales_and_zeros(scales.cpu(), zeros.cpu(), group_size, kernel_group)   # (K/kg, N, 2) bf16
    return packed, sz, kernel_group


# -- an embedding tied to a quantized head ------------------------------------------------------------
class QuantEmbedding(nn.Module):
    """An embedding tied to a quantized head: it gathers rows of the head's integers and dequantizes only those.

    The head stays the one owner of the buffers (saved under lm_head); this module keeps a reference to it,
    not a copy, so a quantized model holds no float table of its vocabulary.
    """

    def __init__(self, head: nn.Module):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self._head = [head]                     # in a list: a reference, not a submodule (its buffers count once)

    @property
    def head(self) -> nn.Module:
        return self._head[0]

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [...] token ids -> [..., C] rows in the head's float dtype
        h, flat = self.head, ids.reshape(-1)
        if h.scheme == "int8":
            rows = dequantize(h.weight_q.index_select(0, flat), h.scales.index_select(0, flat)[:, None], dtype=h.dtype)
        else:
            q = unpack_int4(h.weight_q.index_select(0, flat), h.in_features)                 # (n, C)
            rows = dequantize(q, h.scales.index_select(0, flat), h.zeros.index_select(0, flat), dtype=h.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the {self.head.scheme} head"
