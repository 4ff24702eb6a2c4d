"""The hand-written kernel (cpu_q8.py, kernels/q8_dot.c) as a path a quantized layer computes with
(quant_kernels.KernelChoice): `quantize.use_q8_kernel` switches a model's layers to it.

Importing this module registers the path: kernel_choice(layer, Q8_KERNEL, ...) works from then on.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_q8
from .quant_kernels import PATHS, Q8_KERNEL, DerivedOperands, KernelPath, int4_cpu_paths, int8_paths


class Q8Kernel(KernelPath):
    """The hand-written CPU kernel (kernels/q8_dot.c): activations quantized to int8 in blocks of 32,
    byte products summed 32 at a time, the layer's own integers read as stored. Each row alone: batch-invariant."""
    name = Q8_KERNEL

    def __init__(self, max_rows: int):
        super().__init__(0, max_rows)
        self.scales = DerivedOperands(("scales",), lambda s: s.float().contiguous())     # (N,) or (N, K/G) fp32
        self.native = cpu_q8.native_why_not() is None   # chosen here, outside any trace, where a build may start

    def matmul(self, x2: Tensor, layer) -> Tensor:
        scales = layer.scales
        if scales.dtype != torch.float32 or not scales.is_contiguous():     # a bf16 model: an fp32 copy, kept
            scales = self.scales.get(layer)
        ops = torch.ops.infopt                   # looked up per call: an operator object cannot be deep-copied
        if layer.scheme == "int8":
            q8w = ops.q8w_linear_native if self.native else ops.q8w_linear
            return q8w(x2, layer.weight_q, scales)
        q4 = ops.q4_linear_native if self.native else ops.q4_linear
        return q4(x2, layer.weight_q, scales, layer.zeros, layer.group_size)

    def forget(self) -> None:
        self.scales.forget()

    def cached_bytes(self) -> int:
        return self.scales.nbytes()


def q8_paths(layer, device: torch.device, dtype: torch.dtype) -> tuple[tuple[KernelPath, ...], torch.dtype]:
    """The hand-written kernel for calls of few rows, then the layer's PyTorch paths; ValueError where it cannot run."""
    if device.type != "cpu":
        raise ValueError(f"the hand-written kernel runs on a CPU, not {device.type}")
    reason = cpu_q8.why_not() or cpu_q8.takes(layer.in_features, layer.group_size if layer.scheme == "int4" else None)
    if reason is not None:
        raise ValueError(reason)
    limit = cpu_q8.Q8_MAX_ROWS[layer.scheme]
    try:
        rest, compute = (int8_paths if layer.scheme == "int8" else int4_cpu_paths)(layer, device, dtype)
    except ValueError:                                    # PyTorch's int4 kernel cannot take the shape
        rest, compute = (), dtype
    rest = tuple(p for p in rest if p.max_rows is None or p.max_rows > limit)
    for p in rest:
        p.min_rows = max(p.min_rows, limit + 1)
    return (Q8Kernel(limit), *rest), compute


PATHS[Q8_KERNEL] = q8_paths      # kernel_choice(layer, Q8_KERNEL, ...) once this module is imported
