"""A Llama-style decoder in plain PyTorch, stored in the Hugging Face Llama format.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP.
Module names match transformers' LlamaForCausalLM, so saving is a key rename.
Shapes: B batch, T tokens in this call, S cached positions, C model width,
H query heads, H_kv key/value heads, D head width, V vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import NoCache
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalise in fp32 like transformers does, then cast back (both no-ops in fp32)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_cache(config: ModelConfig, device=None) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables, [max_seq_len, D], in the rotate-half layout transformers uses.

    transformers rotates a head as x * cos + cat(-x2, x1) * sin. Swapping the halves
    is a roll, so we store sin with its first half negated: x * cos + roll(x) * sin_signed.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    t = torch.arange(config.max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)                          # (S_max, D/2)
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)       # (S_max, D)
    sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return cos, sin_signed


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    # x: [B, H, T, D]; cos/sin_signed: [T, D]
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Fusion:
    """Linears that read the same input, run as one matrix product over a weight they all view into.

    `fuse_projections` builds one per attention (q, k, v) and MLP (gate, up): one large
    matrix-vector product streams faster than three small ones, and each projection keeps
    its own name and parameter (a slice of the shared weight). Anything that replaces a
    projection (quantization) or its weight (`.to()`, assignment), or hooks it, breaks the
    sharing, and `holds` then tells the caller to run the projections one by one.
    """

    def __init__(self, linears: tuple[nn.Linear, ...]):
        column = all(l.weight.stride(0) == 1 for l in linears)          # keep the layout they had
        with torch.no_grad():
            weight = torch.cat([l.weight.detach() for l in linears])    # (sum N_i, K)
            self.weight = weight.t().contiguous().t() if column else weight
            has_bias = [l.bias is not None for l in linears]
            self.bias = torch.cat([l.bias.detach() for l in linears]) if all(has_bias) else None
        if any(has_bias) and self.bias is None:
            raise ValueError("either all fused linears have a bias or none does")
        self.frozen = False                      # whether it held when a step was last compiled (freeze_fusions)
        self.sizes, start = [l.out_features for l in linears], 0
        for l, n in zip(linears, self.sizes):
            l.weight = nn.Parameter(self.weight[start:start + n], requires_grad=l.weight.requires_grad)
            if self.bias is not None:
                l.bias = nn.Parameter(self.bias[start:start + n], requires_grad=l.bias.requires_grad)
            start += n

    def holds(self, linears: tuple[nn.Module, ...]) -> bool:
        """Whether these are still plain, unhooked linears whose weights are the fused weight's slices.

        A forward hook on a projection (GPTQ's calibration, a student's probe) must see it called,
        so a hooked projection turns fusion off.
        """
        start, step = 0, self.weight.stride(0) * self.weight.element_size()
        base = self.weight.data_ptr()
        for l, n in zip(linears, self.sizes):
            if type(l) is not nn.Linear or l.weight.data_ptr() != base + start * step \
                    or l._forward_hooks or l._forward_pre_hooks:
                return False
            start += n
        return True

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def __deepcopy__(self, memo) -> None:
        # a deep copy clones each parameter on its own, so the copy's slices would view nothing:
        # the copy runs unfused (quantize_model fuses its own layers again) instead of holding a second weight
        return None


def fused_in_use(module: nn.Module) -> bool:
    """Whether an attention's or MLP's fused product (model.Fusion, quantize.QuantFusion) computes its projections.

    Eager code asks the fusion every call. A compiled step cannot read data pointers, so it reads the
    answer `freeze_fusions` wrote when the step was compiled (compiled.py): a graph guard, not a check.
    """
    fused = module.fused
    if fused is None:
        return False
    if torch.compiler.is_compiling():
        return fused.frozen
    return fused.holds(module.projections())


def freeze_fusions(model: nn.Module) -> None:
    """Record, on every fusion, whether it holds now: what a step compiled next will compute with."""
    for module in model.modules():
        if getattr(module, "fused", None) is not None:
            module.fused.frozen = module.fused.holds(module.projections())


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        C, D = config.dim, config.head_dim
        self.q_proj = nn.Linear(C, config.n_heads * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, config.n_kv_heads * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, config.n_kv_heads * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * D, C, bias=False)
        self.fused: Fusion | None = None            # q, k, v as one product (fuse_projections)

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """The projections that read the same input, in the fused weight's order."""
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, cache) -> Tensor:
        # cache: anything with `attend(layer, q, k, v, input_pos)` (attention.py's contract)
        B, T, C = x.shape
        if fused_in_use(self):
            q, k, v = self.fused(x)
        else:
            q, k, v = (p(x) for p in self.projections())
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # (B, H, T, D)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cache.attend(self.layer, q, k, v, input_pos)                                # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=False)
        self.fused: Fusion | None = None            # gate and up as one product (fuse_projections)

    def projections(self) -> tuple[nn.Module, nn.Module]:
        """The projections that read the same input, in the fused weight's order."""
        return self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if fused_in_use(self):
            gate, up = self.fused(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, input_pos, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, V]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_cache(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: Tensor, input_pos: Tensor | None = None, cache=None) -> Tensor:
        """Logits [B, T, V] of every position; `cache` keeps keys and values across calls (None: keep nothing)."""
        return self.logits(self.hidden_states(input_ids, input_pos, cache))

    def logits(self, h: Tensor) -> Tensor:
        """The final norm and the LM head: hidden states [..., C] -> logits [..., V]."""
        return self.lm_head(self.norm(h))

    def rope(self, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin rows [T, D] of positions [T], in the activations' dtype."""
        dtype = self.norm.weight.dtype
        return self.rope_cos[input_pos].to(dtype), self.rope_sin[input_pos].to(dtype)

    def hidden_states(self, input_ids: Tensor, input_pos: Tensor | None = None, cache=None) -> Tensor:
        """The decoder stack without the head: [B, T] token ids -> [B, T, C] (the engine picks rows first)."""
        # input_ids: [B, T]; input_pos: [T] absolute positions (default 0..T-1)
        B, T = input_ids.shape
        if input_pos is None:
            input_pos = torch.arange(T, device=input_ids.device)
        if not torch.compiler.is_compiling():     # a compiled step checks positions before it runs (compiled.py)
            last = int(input_pos.max())
            if last >= self.config.max_seq_len:
                raise ValueError(f"position {last} is past the model's context of "
                                 f"{self.config.max_seq_len} tokens")
        cos, sin = self.rope(input_pos)                                      # (T, D) each
        cache = NoCache() if cache is None else cache
        x = self.embed_tokens(input_ids)                                     # (B, T, C)
        for block in self.layers:
            x = block(x, cos, sin, input_pos, cache)
        return x                                                             # (B, T, C)

    # -- Hugging Face Llama format ---------------------------------------------------
    def hf_state_dict(self) -> dict[str, Tensor]:
        """Weights under transformers' names; a tied head is stored once."""
        out = {}
        for name, t in self.state_dict().items():
            if name == "lm_head.weight" and self.config.tie_embeddings:
                continue
            out[name if name.startswith("lm_head") else f"model.{name}"] = t
        return out

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16):
        """Write config.json and model.safetensors that transformers can load."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dtype_name = str(dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(self.config.to_hf(dtype_name), indent=2) + "\n")
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.hf_state_dict().items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "Transformer":
        """Load config.json and *.safetensors from a Hugging Face format directory."""
        from safetensors.torch import load_file
        path = Path(path)
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {path}")
        tensors = {}
        for f in files:
            tensors.update(load_file(str(f)))
        state = {k.removeprefix("model."): v for k, v in tensors.items()}
        if config.tie_embeddings:
            state.pop("lm_head.weight", None)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        cos, sin = rope_cache(config)
        model.rope_cos, model.rope_sin = cos, sin
        return model.to(device=device, dtype=dtype).eval()


def set_weight_layout(model: nn.Module, layout: str) -> nn.Module:
    """Store every linear weight W [N, K] "row" major (PyTorch's default) or "column" major, in place.

    Column-major keeps W's shape and values (it is the transpose of a contiguous [K, N] array),
    so everything that reads W is unchanged; only the matrix-vector product that decoding runs
    streams it differently: on a CPU, MKL's one-row product reads a column-major weight faster
    (`timing.matvec_bandwidth_gbs` measures it), so `load_model` uses it there. A head tied to the
    embedding keeps sharing its storage. Returns the model.
    """
    if layout not in ("row", "column"):
        raise ValueError(f"layout must be 'row' or 'column', got {layout!r}")
    relaid: dict[int, nn.Parameter] = {}            # old weight's id -> its re-laid parameter
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                w = module.weight
                if id(w) not in relaid:
                    data = w.detach().t().contiguous().t() if layout == "column" else w.detach().contiguous()
                    relaid[id(w)] = nn.Parameter(data, requires_grad=w.requires_grad)
                module.weight = relaid[id(w)]
        for module in model.modules():              # an embedding tied to a head follows it
            if isinstance(module, nn.Embedding) and id(module.weight) in relaid:
                module.weight = relaid[id(module.weight)]
    return model


def weight_layout(model: nn.Module) -> str:
    """"column" when the model's linear weights are stored column-major, else "row"."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return "column" if linears and all(m.weight.stride(0) == 1 for m in linears) else "row"


def fuse_projections(model: nn.Module) -> nn.Module:
    """Run each attention's q, k, v and each MLP's gate and up as one matrix product (see Fusion), in place.

    Same weights, same names, same state_dict; fewer, larger products. Apply it after
    `set_weight_layout`, whose new tensors would undo it. Returns the model.
    """
    for module in model.modules():
        if isinstance(module, (Attention, MLP)):
            module.fused = Fusion(module.projections())
    return model
