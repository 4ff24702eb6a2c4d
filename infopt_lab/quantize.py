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
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import validate
from .invariant import rowwise
from .quant_format import QuantEmbedding, dequantize, pack_int4, unpack_int4   # the stored format, its embedding
from .quant_format import (INT4_KERNEL_GROUPS, int4_kernel_group,  # noqa: F401  (re-exported: their old home)
                           pack_int4_for_cpu_kernel)
from .quant_kernels import (DEQUANT_MATMUL, INT4_KERNEL, INT8_KERNEL, Q8_KERNEL, KernelChoice, choose_kernels,
                            kernel_choice)
from .quant_kernels import (INT4_KERNEL_MAX_ROWS, INT8_GEMM_MIN_ROWS, INT8_GEMM_MIN_ROWS_TILED,  # noqa: F401
                            INT8_GEMM_TILE, INT8_KERNEL_MAX_ROWS, TRITON_INT4, cpu_kernels_fast,  # (re-exported:
                            int4_kernel_works, int8_kernel_works)                                 # their old home)

SCHEMES = ("int8", "int4")


# -- checks ----------------------------------------------------------------------------------------
def check_bits(bits: int) -> None:
    """Raise ValueError unless bits is 4 or 8."""
    validate.choice("bits", bits, (4, 8))


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


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored as integers + scales (+ zero points) and dequantized to compute.

    `path` names how forward computes: a weight-only kernel (INT8_KERNEL, INT4_KERNEL, TRITON_INT4) or
    DEQUANT_MATMUL, with `fallback_reason` saying why no kernel. On a CPU the kernels compute in bf16
    (`compute_dtype`): the input is rounded to bf16 and the output cast back to its dtype. Which kernel runs
    is `kernels` (quant_kernels.KernelChoice), chosen once for the device and dtype the layer is on and
    again when it moves (`.to`, `.cuda`, `.half`). The state_dict is the course's format (`quant_format.py`)
    on every path; what a kernel derives from it (the CPU int4 kernel's own packing of the same integers)
    is a cache beside it, rebuilt when weight_q, scales or zeros are replaced or changed in place.
    """

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int | None,
                 bias: Tensor | None, dtype: torch.dtype):
        super().__init__()
        validate.choice("scheme", scheme, SCHEMES)
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size, self.dtype = scheme, group_size, dtype
        device = bias.device if bias is not None else "cpu"
        self.kernels: KernelChoice = kernel_choice(self, DEQUANT_MATMUL, device, dtype)   # until choose_path
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, group_size: int | None = None) -> "QuantLinear":
        """Quantize an nn.Linear: int8 symmetric per-channel, or int4 asymmetric group-wise, packed."""
        w = linear.weight.detach().contiguous()      # row-major, whatever layout the model keeps
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
        m.choose_path(w.device, w.dtype)                          # the CPU int4 kernel's packing happens here
        return m

    def choose_path(self, device: torch.device, dtype: torch.dtype) -> str:
        """Pick the fastest correct path for this device and dtype (quant_kernels.choose_kernels); return its name."""
        self.kernels = choose_kernels(self, device, dtype)
        return self.path

    @property
    def path(self) -> str:
        """The path forward computes with: a kernel's name, or DEQUANT_MATMUL."""
        return self.kernels.path

    @path.setter
    def path(self, name: str) -> None:
        # forces a path without probing it (tests compare two paths on one layer)
        self.kernels = kernel_choice(self, name, self.weight_q.device, self.dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype on the kernel path: bf16 for the CPU kernels, else the layer's."""
        return self.kernels.compute_dtype

    @property
    def fallback_reason(self) -> str | None:
        """Why the layer has no kernel here, or None."""
        return self.kernels.fallback_reason

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)                               # .to / .cuda / .half: the buffers move or cast
        if "weight_q" in self._buffers:                           # (a layer QuantFusion is still building: later)
            self.dtype = self.scales.dtype                        # the float dtype follows the scales
            if (self.weight_q.device, self.dtype) != (self.kernels.device, self.kernels.dtype):
                self.choose_path(self.weight_q.device, self.dtype)
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)          # copies into the buffers in place
        self.kernels.forget()

    def dequantized_weight(self) -> Tensor:
        """The float weight [N, K] this layer computes with (the kernels: up to their bf16 rounding)."""
        if self.scheme == "int8":
            return dequantize(self.weight_q, self.scales[:, None], dtype=self.dtype)
        q = unpack_int4(self.weight_q, self.in_features)          # (N, K)
        return dequantize(q, self.scales, self.zeros, dtype=self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., K] -> [..., N], by the path that serves this many rows (one at a time in batch-invariant mode)
        return quantized_linear(x, self)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        how = f", compute_dtype={self.compute_dtype}" if self.path in (INT8_KERNEL, INT4_KERNEL) else ""
        why = f", fallback_reason={self.fallback_reason!r}" if self.fallback_reason else ""
        return f"{self.in_features}, {self.out_features}, {self.scheme}{g}, path={self.path!r}{how}{why}"


class QuantFusion:
    """QuantLinears that read the same input, run as one kernel call over buffers they all view into.

    The quantized twin of model.Fusion: scales are per output row (int8) or per row and group
    (int4), so stacking the layers' rows quantizes nothing differently; each layer keeps its own
    buffers, now slices of the stacked ones, and its state_dict entries.
    """

    BUFFERS = ("weight_q", "scales", "zeros", "bias")

    def __init__(self, layers: tuple[QuantLinear, ...]):
        first = layers[0]
        present = [name for name in self.BUFFERS if first._buffers.get(name) is not None]
        stacked = {name: torch.cat([layer._buffers[name] for layer in layers]) for name in present}
        self.sizes = [layer.out_features for layer in layers]
        self.frozen = False                      # whether it held when a step was last compiled (model.freeze_fusions)
        self.layer = QuantLinear(first.in_features, sum(self.sizes), first.scheme, first.group_size,
                                 stacked.pop("bias", None), first.dtype)
        for name, tensor in stacked.items():
            self.layer.register_buffer(name, tensor)
        self.layer.choose_path(first.weight_q.device, first.dtype)
        start = 0
        for layer, n in zip(layers, self.sizes):
            for name in present:
                layer._buffers[name] = self.layer._buffers[name][start:start + n]
            layer.kernels.forget()                        # the fused layer's operands serve them all
            start += n

    def holds(self, layers: tuple[nn.Module, ...]) -> bool:
        """Whether these are still unhooked QuantLinears on the fused path whose weights are its slices."""
        start, step = 0, self.layer.weight_q.stride(0) * self.layer.weight_q.element_size()
        base = self.layer.weight_q.data_ptr()
        for layer, n in zip(layers, self.sizes):
            if type(layer) is not QuantLinear or layer.weight_q.data_ptr() != base + start * step \
                    or layer.path != self.layer.path or layer.dtype != self.layer.dtype \
                    or layer._forward_hooks or layer._forward_pre_hooks:
                return False
            start += n
        return True

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        return self.layer(x).split(self.sizes, dim=-1)

    def __deepcopy__(self, memo) -> None:
        return None                                       # see model.Fusion.__deepcopy__


def fuse_quantized(model: nn.Module) -> nn.Module:
    """Give every attention and MLP whose projections are alike QuantLinears a QuantFusion, in place."""
    for module in model.modules():
        if not hasattr(module, "projections"):
            continue
        layers = module.projections()
        alike = all(type(l) is QuantLinear for l in layers) and \
            len({(l.scheme, l.group_size, l.in_features, l.dtype, l.bias is None) for l in layers}) == 1
        module.fused = QuantFusion(layers) if alike else None
    return model


@rowwise
def quantized_linear(x: Tensor, layer: QuantLinear) -> Tensor:
    """A quantized layer's product x [..., K] -> [..., N], by the kernel path that serves this many rows."""
    return layer.kernels.pick(x.numel() // layer.in_features).forward(x, layer)


def quantize_linear(linear: nn.Linear, scheme: str, group_size: int | None = None) -> QuantLinear:
    """A QuantLinear from an nn.Linear: "int8" (per-channel) or "int4" (group-wise, group_size | in_features)."""
    validate.instance("linear", linear, nn.Linear, "an nn.Linear (quantize_linear quantizes one layer)")
    return QuantLinear.from_linear(linear, scheme, group_size)


def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None,
                   skip: tuple[str, ...] = (), quantize_tied_head: bool = True,
                   head_scheme: str | None = None) -> nn.Module:
    """A deep copy of `model` with every nn.Linear swapped for a QuantLinear; the original is untouched.

    A head tied to the embedding is quantized too unless `quantize_tied_head=False`: it is the largest single
    matmul of a small model (49152 x 576 in SmolLM2-135M, a fifth of its weights). The embedding then gathers
    its rows from the head's integers (QuantEmbedding): no float table is kept, so both the bytes in memory
    and the bytes a step streams fall (`weight_bytes`), at the cost of embedding rows rounded like the head's.
    `head_scheme` gives the output head its own scheme (None: the same as the rest), as GGUF files often
    keep the embedding and head at 8 bits under 4-bit layers; an int4 head uses `group_size` too.
    """
    validate.instance("model", model, nn.Module, "a torch nn.Module (e.g. from lab.load_model)")
    validate.choice("scheme", scheme, SCHEMES)
    validate.choice("head_scheme", head_scheme, (*SCHEMES, None))     # None: the same as scheme
    head_scheme = scheme if head_scheme is None else head_scheme
    validate.boolean("quantize_tied_head", quantize_tied_head)
    done = sorted({m.scheme for m in model.modules() if isinstance(m, QuantLinear)})
    if done:
        raise ValueError(f"model is already quantized ({', '.join(done)}); quantize the float model instead "
                         "(quantizing twice would compound the rounding, or silently keep the first scheme)")
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError("model has no nn.Linear layer to quantize")
    new = copy.deepcopy(model)
    tied = {id(m.weight) for m in new.modules() if isinstance(m, nn.Embedding)}
    untied, heads = False, {}
    for name, module in list(new.named_modules()):
        if not isinstance(module, nn.Linear) or name in skip:
            continue
        if id(module.weight) in tied:
            if not quantize_tied_head:
                continue
            untied = True                                         # the embedding keeps the float Parameter
        is_head = id(module.weight) in tied or name == "lm_head"
        this, group = (scheme, group_size) if not is_head else \
            (head_scheme, group_size if head_scheme == "int4" else None)
        parent_name, _, child = name.rpartition(".")
        parent = new.get_submodule(parent_name) if parent_name else new
        setattr(parent, child, quantize_linear(module, this, group))
        if id(module.weight) in tied:
            heads[id(module.weight)] = getattr(parent, child)
    for name, module in list(new.named_modules()):                # a tied embedding reads the quantized head
        if isinstance(module, nn.Embedding) and id(module.weight) in heads:
            parent_name, _, child = name.rpartition(".")
            setattr(new.get_submodule(parent_name) if parent_name else new, child,
                    QuantEmbedding(heads[id(module.weight)]))
    fuse_quantized(new)                                           # q, k, v and gate, up: one kernel call each
    config = getattr(new, "config", None)
    if untied and getattr(config, "tie_embeddings", False):
        config.tie_embeddings = False                             # the copy's own config: the head is its own now
    return new


def use_q8_kernel(model: nn.Module) -> int:
    """Switch a quantized model's layers on a CPU to the hand-written int8-activation kernel (q8_path.Q8Kernel).

    Calls of up to cpu_q8.Q8_MAX_ROWS rows (decode steps, short prefills) run kernels/q8_dot.c: activations
    quantized to int8 in blocks of 32, as llama.cpp does, so its tokens are measured against PyTorch's kernels'.
    Longer calls keep the PyTorch paths. In place; returns how many layers switched (a layer of a shape it cannot
    take keeps its path). Raises ValueError where the kernel cannot run here, saying why; says how it is called.
    """
    from . import cpu_q8, q8_path  # noqa: F401  (q8_path registers the kernel's path)
    validate.instance("model", model, nn.Module, "a quantized model (from lab.quantize_model)")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    layers += [m.fused.layer for m in model.modules() if isinstance(getattr(m, "fused", None), QuantFusion)]
    if not layers:
        raise ValueError("model has no quantized layer: quantize it first (lab.quantize_model)")
    if cpu_q8.why_not() is not None:
        raise ValueError(f"the hand-written kernel cannot run here: {cpu_q8.why_not()}")
    switched = 0
    for layer in layers:
        try:
            layer.kernels = kernel_choice(layer, Q8_KERNEL, layer.weight_q.device, layer.dtype)
            switched += 1
        except ValueError:                                    # this layer's shape: it keeps its path
            pass
    if switched and (why := cpu_q8.native_why_not()) is not None:
        print(f"q8 kernel: called through its Python registration, tens of microseconds more a call ({why})")
    return switched


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


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights three ways: what saving writes, what sits in memory, what one decode step reads."""
    stored: int      # the state_dict, each shared tensor once
    resident: int    # stored, plus what kernels keep beside it (the CPU int4 kernel's own packing of the integers)
    streamed: int    # per decode step: every linear layer's weights (as its kernel reads them) and one embedding row


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Stored, resident and streamed bytes of a model's weights (float or quantized)."""
    stored = state_dict_bytes(model)
    derived, streamed, seen = 0, 0, set()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            own = sum(t.numel() * t.element_size() for t in m._buffers.values() if t is not None)
            kept = m.kernels.cached_bytes()
            derived += kept
            streamed += kept if m.path == INT4_KERNEL and kept else own
        elif isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            streamed += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, (nn.Embedding, QuantEmbedding)):
            dtype = m.weight.dtype if isinstance(m, nn.Embedding) else m.head.dtype
            streamed += m.embedding_dim * torch.empty((), dtype=dtype).element_size()
    for fusion in (getattr(m, "fused", None) for m in model.modules()):
        if isinstance(fusion, QuantFusion):          # the stacked layer's kernel operands serve its projections
            derived += fusion.layer.kernels.cached_bytes()
    return WeightBytes(stored, stored + derived, streamed)


def quant_paths(model: nn.Module) -> dict[str, int]:
    """How many QuantLinear layers of a model run each compute path."""
    paths: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            paths[m.path] = paths.get(m.path, 0) + 1
    return paths
