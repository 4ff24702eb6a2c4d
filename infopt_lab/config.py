"""Model configuration: one dataclass, validated, with named presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from . import validate


@dataclass
class ModelConfig:
    """A Llama-style decoder's shape: widths, heads, layers, context, RoPE and norm settings (HF-compatible)."""

    vocab_size: int = 4096          # tokenizer size (byte-level BPE)
    dim: int = 256                  # residual stream width C
    n_layers: int = 4               # transformer blocks
    n_heads: int = 4                # query heads H
    n_kv_heads: int = 2             # key/value heads (grouped-query attention when < n_heads)
    intermediate_size: int = 704    # SwiGLU hidden width
    max_seq_len: int = 512          # longest context served (size of the RoPE table, the cache default)
    rope_theta: float = 10000.0     # rotary embedding base
    norm_eps: float = 1e-5          # RMSNorm epsilon
    tie_embeddings: bool = True     # share the token embedding with the output head
    qkv_bias: bool = False          # Qwen2-style bias on q, k, v projections
    bos_token_id: int = 0
    eos_token_id: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                     "intermediate_size", "max_seq_len"):
            setattr(self, name, validate.integer(name, getattr(self, name), low=1))
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    # -- Hugging Face Llama format ------------------------------------------------
    def to_hf(self, torch_dtype: str = "bfloat16") -> dict:
        """The config.json that transformers' LlamaForCausalLM reads."""
        family = "qwen2" if self.qkv_bias else "llama"
        return {
            "architectures": ["Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"],
            "model_type": family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
        }

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a Llama- or Qwen2-family config.json."""
        model_type = hf.get("model_type")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type must be 'llama' or 'qwen2', got {model_type!r}")
        rope = hf.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {rope!r} is not supported; only plain RoPE is")
        if model_type == "llama" and hf.get("attention_bias"):
            raise ValueError("Llama checkpoints with attention_bias=True are not supported")
        n_heads = hf["num_attention_heads"]
        dim = hf["hidden_size"]
        if hf.get("head_dim", dim // n_heads) != dim // n_heads:
            raise ValueError("head_dim must equal hidden_size / num_attention_heads")
        theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = hf.get("eos_token_id", 0)
        return cls(
            vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads", n_heads),
            intermediate_size=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=float(theta), norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2",
            bos_token_id=hf.get("bos_token_id") or 0,
            eos_token_id=eos[0] if isinstance(eos, list) else (eos or 0),
        )


PRESETS: dict[str, ModelConfig] = {
    # the bundled target: small enough to train on a laptop CPU, big enough to write Python
    "target": ModelConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=2, intermediate_size=704,
                          max_seq_len=1024),
    # the bundled draft: at most one eighth of the target's parameters
    "draft": ModelConfig(dim=96, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=256,
                         max_seq_len=1024),
    # SmolLM2-135M's draft: its tokenizer, RoPE base and special tokens; at most 1/8 of its parameters
    "smollm2-draft": ModelConfig(vocab_size=49152, dim=192, n_layers=6, n_heads=3, n_kv_heads=1,
                                 intermediate_size=768, max_seq_len=2048, rope_theta=100000.0,
                                 bos_token_id=1, eos_token_id=2),
    # a throwaway size for unit tests
    "tiny": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        intermediate_size=128, max_seq_len=128),
}


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name].to_dict())
