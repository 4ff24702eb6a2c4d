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
import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quant_format import (dequantize, int4_kernel_scales_and_zeros, pack_int4,   # the stored format, shared
                           unpack_int4)                                            # with the int4 kernels

SCHEMES = ("int8", "int4")
INT8_KERNEL = "aten._weight_int8pack_mm"            # int8 weights x bf16 activations on a CPU (x's dtype on CUDA)
INT4_KERNEL = "aten._weight_int4pack_mm_for_cpu"    # int4 weights x bf16 activations on a CPU, packed at quantization
DEQUANT_MATMUL = "dequantize+matmul"                # the fallback: a float copy of W, then F.linear
TRITON_INT4 = "triton int4 dequantize-matmul"
INT4_KERNEL_GROUPS = (256, 128, 64, 32)             # the group sizes aten._weight_int4pack_mm_for_cpu takes
# Up to how many rows (tokens) a call runs the weight-only kernel; more rows dequantize and run one float matmul.
# Dequantizing pays a fixed cost per call (a float copy of the whole weight), so the kernels win every decode
# and verify pass and short prefills; for long prefills the float matmul catches up and computes in the model's
# own dtype (no bf16 rounding of the activations). The limits are where a sweep over rows on a 2-core x86 CPU
# found the two paths even; `timing.time_cached_passes` times a model's passes on either side of them.
INT8_KERNEL_MAX_ROWS = 256
# The CPU int8 kernel walks the whole weight once per row. From INT8_GEMM_MIN_ROWS rows up, bf16 GEMMs over
# the integers (exact in bf16), INT8_GEMM_TILE output rows at a time so each tile's bf16 copy stays in cache,
# with the scales applied to the output, compute the same product faster. A layer of more than one tile (a
# vocabulary head) wins from INT8_GEMM_MIN_ROWS_TILED rows. Both are where a sweep over rows on a 2-core x86
# CPU found the two paths even, as for the limits above.
INT8_GEMM_MIN_ROWS = 17
INT8_GEMM_MIN_ROWS_TILED = 8
INT8_GEMM_TILE = 4096
INT4_KERNEL_MAX_ROWS = 512


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


# -- PyTorch's weight-only kernels -----------------------------------------------------------------
def cpu_kernels_fast() -> bool:
    """Whether this CPU runs the vectorized code of the weight-only kernels (AVX2/AVX-512 on x86, NEON on Arm).

    Elsewhere they fall back to scalar loops, slower than dequantize+matmul.
    """
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    return capability.startswith("AVX") or platform.machine().lower() in ("arm64", "aarch64")


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


@functools.cache
def int4_kernel_works() -> bool:
    """Whether aten._weight_int4pack_mm_for_cpu (and its converter) exist, run and agree with our dequantize on a CPU."""
    if not all(hasattr(torch.ops.aten, op) for op in ("_weight_int4pack_mm_for_cpu",
                                                      "_convert_weight_to_int4pack_for_cpu")):
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=g)
    q, s, z = quantize_asymmetric(w, 4, 64)
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    try:
        packed, sz, kg = pack_int4_for_cpu_kernel(pack_int4(q), s, z, 128)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, kg, sz)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    ref = x.float() @ dequantize(q, s, z).T
    return bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()))


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored as integers + scales (+ zero points) and dequantized to compute.

    `path` names how forward computes: a weight-only kernel (INT8_KERNEL, INT4_KERNEL, TRITON_INT4) or
    DEQUANT_MATMUL, with `fallback_reason` saying why no kernel. On a CPU the kernels compute in bf16
    (`compute_dtype`): the input is rounded to bf16 and the output cast back to its dtype. The state_dict is
    the course's format (`quant_format.py`) on every path; the CPU int4 kernel's own packing of the same
    integers is a cache beside it, rebuilt when weight_q, scales or zeros are replaced or changed in place.
    """

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int | None,
                 bias: Tensor | None, dtype: torch.dtype):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size, self.dtype = scheme, group_size, dtype
        self.path, self.compute_dtype, self.fallback_reason = DEQUANT_MATMUL, dtype, None
        self._kernel_cache = None                                 # (sources and their versions, kernel operands)
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
        """Pick the fastest correct path for this device and dtype, and record it in `self.path`.

        The reason for falling back to DEQUANT_MATMUL, if it does, goes in `self.fallback_reason`.
        """
        from .device import HAS_TRITON
        device = torch.device(device)
        path, compute, reason = DEQUANT_MATMUL, dtype, None
        if self.scheme == "int8":
            if device.type == "cpu":                              # fp32 activations: far slower than F.linear;
                if not int8_kernel_works("cpu", torch.bfloat16):  # bf16: faster than it
                    reason = f"{INT8_KERNEL} does not run correctly with bf16 activations (torch {torch.__version__})"
                elif not cpu_kernels_fast():
                    reason = "this CPU has no vectorized code for the int8 kernel"
                else:
                    path, compute = INT8_KERNEL, torch.bfloat16
            elif int8_kernel_works(device.type, dtype):
                path = INT8_KERNEL
            else:
                reason = f"{INT8_KERNEL} does not run correctly for {dtype} on {device.type}"
        elif device.type == "cuda":
            if HAS_TRITON:
                path = TRITON_INT4
            else:
                reason = "Triton is not installed"
        elif device.type == "cpu":
            if not int4_kernel_works():
                reason = f"torch {torch.__version__} has no working {INT4_KERNEL}"
            elif not cpu_kernels_fast():
                reason = "this CPU has no vectorized code for the int4 kernel"
            else:
                try:
                    self._kernel_cache = None
                    self._kernel_operands()                       # pack now: it also says whether the kernel can
                    path, compute = INT4_KERNEL, torch.bfloat16   # take this layer's shape and group size
                except ValueError as e:
                    reason = f"{INT4_KERNEL} cannot take this layer: {e}"
        else:
            reason = f"no weight-only int4 kernel for {device.type}"
        if path != INT4_KERNEL:
            self._kernel_cache = None                             # no second copy of the weights when unused
        self.path, self.compute_dtype, self.fallback_reason = path, compute, reason
        return self.path

    # -- the kernels' operands, derived from the stored format and cached -------------------------
    def _kernel_sources(self) -> tuple:
        """The stored tensors the kernel operands are made from, with their version counters."""
        b = self._buffers
        tensors = (b["weight_q"], b["scales"], b.get("zeros"))
        try:
            versions = tuple(t._version if t is not None else 0 for t in tensors)
        except RuntimeError:                                      # inference tensors keep no version counter
            versions = None
        return tensors, versions

    def _kernel_operands(self):
        """bf16 scales for the int8 kernel; (packed weight, scales and offsets, group) for the CPU int4 kernel."""
        tensors, versions = self._kernel_sources()
        cache = self._kernel_cache
        if cache is not None and cache[1] == versions and all(a is b for a, b in zip(cache[0], tensors)):
            return cache[2]
        if self.scheme == "int8":
            operands = self.scales.to(self.compute_dtype)
        else:
            operands = pack_int4_for_cpu_kernel(self.weight_q, self.scales, self.zeros, self.in_features)
        self._kernel_cache = (tensors, versions, operands)
        return operands

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)          # copies into the buffers in place
        self._kernel_cache = None

    def dequantized_weight(self) -> Tensor:
        """The float weight [N, K] this layer computes with (the kernels: up to their bf16 rounding)."""
        if self.scheme == "int8":
            return dequantize(self.weight_q, self.scales[:, None], dtype=self.dtype)
        q = unpack_int4(self.weight_q, self.in_features)          # (N, K)
        return dequantize(q, self.scales, self.zeros, dtype=self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., K] -> [..., N]
        rows = x.numel() // self.in_features
        if self.path == INT8_KERNEL and rows <= INT8_KERNEL_MAX_ROWS:
            x2 = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()   # (rows, K)
            if x.device.type == "cpu" and rows >= (INT8_GEMM_MIN_ROWS if self.out_features <= INT8_GEMM_TILE
                                                    else INT8_GEMM_MIN_ROWS_TILED):
                y = self._int8_gemm(x2)
            else:
                y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_q, self._kernel_operands())
        elif self.path == INT4_KERNEL and rows <= INT4_KERNEL_MAX_ROWS and x.device.type == "cpu":
            packed, scales_and_zeros, group = self._kernel_operands()
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()       # (rows, K)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scales_and_zeros)
        elif self.path == TRITON_INT4:
            from .kernels.int4_matmul import int4_matmul   # here, not at the top: it imports Triton
            y = int4_matmul(x.reshape(-1, self.in_features), self.weight_q, self.scales, self.zeros)
        else:
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def _int8_gemm(self, x2: Tensor) -> Tensor:
        """x2 [rows, K] (compute dtype) @ the int8 weight, as tiled GEMMs over its integers; scales after."""
        y = x2.new_empty(x2.shape[0], self.out_features)                                # (rows, N)
        for n in range(0, self.out_features, INT8_GEMM_TILE):
            tile = self.weight_q[n:n + INT8_GEMM_TILE].to(self.compute_dtype)           # (tile, K), exact
            torch.matmul(x2, tile.t(), out=y[:, n:n + INT8_GEMM_TILE])
        return y.mul_(self._kernel_operands())

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
        self.layer = QuantLinear(first.in_features, sum(self.sizes), first.scheme, first.group_size,
                                 stacked.pop("bias", None), first.dtype)
        for name, tensor in stacked.items():
            self.layer.register_buffer(name, tensor)
        self.layer.choose_path(first.weight_q.device, first.dtype)
        start = 0
        for layer, n in zip(layers, self.sizes):
            for name in present:
                layer._buffers[name] = self.layer._buffers[name][start:start + n]
            layer._kernel_cache = None                    # the fused layer's operands serve them all
            start += n

    def holds(self, layers: tuple[nn.Module, ...]) -> bool:
        """Whether these are still unhooked QuantLinears on the fused path whose weights are its slices."""
        start, step = 0, self.layer.weight_q.stride(0) * self.layer.weight_q.element_size()
        base = self.layer.weight_q.data_ptr()
        for layer, n in zip(layers, self.sizes):
            if type(layer) is not QuantLinear or layer.weight_q.data_ptr() != base + start * step \
                    or layer.path != self.layer.path or layer._forward_hooks or layer._forward_pre_hooks:
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


def quantize_linear(linear: nn.Linear, scheme: str, group_size: int | None = None) -> QuantLinear:
    """A QuantLinear from an nn.Linear: "int8" (per-channel) or "int4" (group-wise, group_size | in_features)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"quantize_linear takes an nn.Linear, got {type(linear).__name__}")
    return QuantLinear.from_linear(linear, scheme, group_size)


def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None,
                   skip: tuple[str, ...] = (), quantize_tied_head: bool = True,
                   head_scheme: str | None = None) -> nn.Module:
    """A deep copy of `model` with every nn.Linear swapped for a QuantLinear; the original is untouched.

    A head tied to the embedding is quantized too unless `quantize_tied_head=False`: it is the largest single
    matmul of a small model (49152 x 576 in SmolLM2-135M, a fifth of its weights). The copy is then untied: the
    embedding keeps its float table (a lookup gathers rows of it, nothing to multiply) and the head its integers,
    so the state_dict grows by the quantized head while decoding reads far fewer bytes per token.
    `head_scheme` gives the output head its own scheme (None: the same as the rest), as GGUF files often
    keep the embedding and head at 8 bits under 4-bit layers; an int4 head uses `group_size` too.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module (e.g. from lab.load_model), got {type(model).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    head_scheme = scheme if head_scheme is None else head_scheme
    if head_scheme not in SCHEMES:
        raise ValueError(f"head_scheme must be one of {list(SCHEMES)} or None (same as scheme), got {head_scheme!r}")
    if not isinstance(quantize_tied_head, bool):
        raise TypeError(f"quantize_tied_head must be True or False, got {quantize_tied_head!r}")
    done = sorted({m.scheme for m in model.modules() if isinstance(m, QuantLinear)})
    if done:
        raise ValueError(f"model is already quantized ({', '.join(done)}); quantize the float model instead "
                         "(quantizing twice would compound the rounding, or silently keep the first scheme)")
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError("model has no nn.Linear layer to quantize")
    new = copy.deepcopy(model)
    tied = {id(m.weight) for m in new.modules() if isinstance(m, nn.Embedding)}
    untied = False
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
    fuse_quantized(new)                                           # q, k, v and gate, up: one kernel call each
    config = getattr(new, "config", None)
    if untied and getattr(config, "tie_embeddings", False):
        config.tie_embeddings = False                             # the copy's own config: the head is its own now
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
