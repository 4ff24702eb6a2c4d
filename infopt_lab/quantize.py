"""Weight quantization: floats -> small integers and a scale, and back.

A weight matrix W [N, K] (N output rows, K input features) is cut into groups of
G consecutive input features per row: W viewed as [N, K/G, G]. Each group gets a
scale (and, for asymmetric schemes, a zero point), and each weight becomes
q = round(w / scale) (+ zero), clamped to the integer range of `bits`.
Per-channel is one group per row (G = K); per-tensor is one group for all of W.
How the result is stored and read back (int4 packing, dequantize) is `quant_format.py`.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quant_format import dequantize, pack_int4, unpack_int4   # the stored format, shared with the int4 kernel

SCHEMES = ("int8", "int4")
INT8_KERNEL = "aten._weight_int8pack_mm"
DEQUANT_MATMUL = "dequantize+matmul"
TRITON_INT4 = "triton int4 dequantize-matmul"
INT8_KERNEL_MAX_ROWS = 16   # the fused int8 kernel wins at decode (few rows); prefill dequantizes once


# -- checks ----------------------------------------------------------------------------------------
def check_bits(bits: int) -> None:
    """Raise ValueError unless bits is 4 or 8."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")


def check_float(w: Tensor) -> None:
    """Raise TypeError unless w is a floating-point tensor."""
    if not isinstance(w, Tensor) or not w.is_floating_point():
        what = w.dtype if isinstance(w, Tensor) else type(w).__name__
        raise TypeError(f"only floating-point weights can be quantized (fp32, fp16, bf16), got {what}")


def group_size_for(w: Tensor, group_size: int | None) -> int:
    """The group size to use on w [N, K]: K for per-channel (None), else a divisor of K."""
    K = w.shape[-1]
    if group_size is None:
        return K
    if not isinstance(group_size, int) or group_size < 1 or K % group_size:
        divisors = [g for g in (16, 32, 64, 128, 256) if K % g == 0]
        raise ValueError(f"group_size must divide the {K} input features, got {group_size}; "
                         f"allowed here: {divisors} or None (one group per row)")
    return group_size


def _groups(w: Tensor, group_size: int | None, per_tensor: bool) -> Tensor:
    """w [N, K] viewed as [N, K/G, G] (per-tensor: [1, 1, N*K])."""
    check_float(w)
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if per_tensor:
        return w.reshape(1, 1, -1)
    G = group_size_for(w, group_size)
    return w.reshape(w.shape[0], -1, G)                          # (N, K/G, G)


# -- symmetric (absmax) ----------------------------------------------------------------------------
def quantize_symmetric(w: Tensor, bits: int = 8, group_size: int | None = None,
                       per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """Absmax quantization: q = round(w / scale), scale = max|w| / (2**(bits-1) - 1); (q int8 [N, K], scale [N, K/G])."""
    check_bits(bits)
    g = _groups(w, group_size, per_tensor).float()               # (N, K/G, G)
    qmax = 2 ** (bits - 1) - 1                                    # 127 or 7: the range stays symmetric
    scale = g.abs().amax(dim=-1).clamp(min=1e-8) / qmax           # (N, K/G)
    q = torch.round(g / scale[..., None]).clamp(-qmax, qmax)
    return q.to(torch.int8).reshape(w.shape), scale.to(w.dtype)


# -- asymmetric (zero point) -----------------------------------------------------------------------
def quantize_asymmetric(w: Tensor, bits: int = 4, group_size: int | None = None,
                        per_tensor: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Min-max quantization onto 0..2**bits-1: (q uint8 [N, K], scale [N, K/G], zero uint8 [N, K/G])."""
    check_bits(bits)
    g = _groups(w, group_size, per_tensor).float()               # (N, K/G, G)
    qmax = 2 ** bits - 1                                          # 255 or 15
    lo = g.amin(dim=-1).clamp(max=0.0)                            # the range holds 0, so 0.0 stays exact
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = ((hi - lo) / qmax).clamp(min=1e-8)                    # (N, K/G)
    zero = torch.round(-lo / scale).clamp(0, qmax)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, qmax)
    return q.to(torch.uint8).reshape(w.shape), scale.to(w.dtype), zero.to(torch.uint8)


def quantization_error(w: Tensor, w_hat: Tensor) -> dict[str, float]:
    """How far the round trip moved the weights: max and mean absolute error, relative RMS error."""
    d = (w.float() - w_hat.float())
    rel = d.pow(2).mean().sqrt() / w.float().pow(2).mean().sqrt().clamp(min=1e-12)
    return {"max_abs": d.abs().max().item(), "mean_abs": d.abs().mean().item(), "rel_rms": rel.item()}


# -- the int8 weight-only kernel -------------------------------------------------------------------
@functools.cache
def int8_kernel_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether aten._weight_int8pack_mm runs and is correct for activations of this device and dtype."""
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return False
    x = torch.randn(2, 64, device=device_type).to(dtype)
    wq = torch.randint(-127, 128, (32, 64), dtype=torch.int8, device=device_type)
    s = torch.rand(32, device=device_type).to(dtype)
    try:
        y = op(x, wq, s)
    except (RuntimeError, NotImplementedError):
        return False
    ref = x.float() @ (wq.float() * s.float()[:, None]).T
    return bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()))


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored as integers + scales (+ zero points) and dequantized to compute."""

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int | None,
                 bias: Tensor | None, dtype: torch.dtype):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size, self.dtype = scheme, group_size, dtype
        self.path = DEQUANT_MATMUL
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, group_size: int | None = None) -> "QuantLinear":
        """Quantize an nn.Linear: int8 symmetric per-channel, or int4 asymmetric group-wise, packed."""
        w = linear.weight.detach()
        check_float(w)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        m = cls(linear.in_features, linear.out_features, scheme, group_size, bias, w.dtype)
        if scheme == "int8":
            if group_size is not None:
                raise ValueError(f"int8 uses one scale per output row: group_size must be None, got {group_size}")
            q, scale = quantize_symmetric(w, 8)
            m.register_buffer("weight_q", q)                      # (N, K) int8
            m.register_buffer("scales", scale.reshape(-1))        # (N,)
        else:
            q, scale, zero = quantize_asymmetric(w, 4, group_size)
            m.register_buffer("weight_q", pack_int4(q))           # (N, K/2) uint8
            m.register_buffer("scales", scale)                    # (N, K/G)
            m.register_buffer("zeros", zero)                      # (N, K/G) uint8
        m.choose_path(w.device, w.dtype)
        return m

    def choose_path(self, device: torch.device, dtype: torch.dtype) -> str:
        """Pick the fastest correct path for this device and dtype, and record it in `self.path`."""
        from .device import HAS_TRITON
        if self.scheme == "int8" and int8_kernel_works(device.type, dtype):
            self.path = INT8_KERNEL
        elif self.scheme == "int4" and device.type == "cuda" and HAS_TRITON:
            self.path = TRITON_INT4
        else:
            self.path = DEQUANT_MATMUL
        return self.path

    def dequantized_weight(self) -> Tensor:
        """The float weight [N, K] this layer computes with."""
        if self.scheme == "int8":
            return dequantize(self.weight_q, self.scales[:, None], dtype=self.dtype)
        q = unpack_int4(self.weight_q, self.in_features)          # (N, K)
        return dequantize(q, self.scales, self.zeros, dtype=self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., K] -> [..., N]
        rows = x.numel() // self.in_features
        if self.path == INT8_KERNEL and rows <= INT8_KERNEL_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_q,
                                                   self.scales.to(x.dtype))
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        if self.path == TRITON_INT4:
            from .kernels.int4_matmul import int4_matmul   # here, not at the top: it imports Triton
            y = int4_matmul(x.reshape(-1, self.in_features), self.weight_q, self.scales, self.zeros)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        return f"{self.in_features}, {self.out_features}, {self.scheme}{g}, path={self.path!r}"


def quantize_linear(linear: nn.Linear, scheme: str, group_size: int | None = None) -> QuantLinear:
    """A QuantLinear from an nn.Linear: "int8" (per-channel) or "int4" (group-wise, group_size | in_features)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"quantize_linear takes an nn.Linear, got {type(linear).__name__}")
    return QuantLinear.from_linear(linear, scheme, group_size)


def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None,
                   skip: tuple[str, ...] = ()) -> nn.Module:
    """A deep copy of `model` with every nn.Linear swapped for a QuantLinear; the original is untouched.

    A head tied to the embedding stays in float (the embedding lookup needs the float table anyway).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module (e.g. from lab.load_model), got {type(model).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    done = sorted({m.scheme for m in model.modules() if isinstance(m, QuantLinear)})
    if done:
        raise ValueError(f"model is already quantized ({', '.join(done)}); quantize the float model instead "
                         "(quantizing twice would compound the rounding, or silently keep the first scheme)")
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError("model has no nn.Linear layer to quantize")
    new = copy.deepcopy(model)
    tied = {id(m.weight) for m in new.modules() if isinstance(m, nn.Embedding)}
    for name, module in list(new.named_modules()):
        if not isinstance(module, nn.Linear) or name in skip or id(module.weight) in tied:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = new.get_submodule(parent_name) if parent_name else new
        setattr(parent, child, quantize_linear(module, scheme, group_size))
    return new


def state_dict_bytes(module: nn.Module) -> int:
    """Bytes of a module's state_dict, each shared storage counted once: what saving it would write."""
    seen, total = set(), 0
    for t in module.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def quant_paths(model: nn.Module) -> dict[str, int]:
    """How many QuantLinear layers of a model run each compute path."""
    paths: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            paths[m.path] = paths.get(m.path, 0) + 1
    return paths
