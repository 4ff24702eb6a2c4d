"""The cost model: FLOPs and bytes of a forward pass, arithmetic intensity, the roofline.

Counts follow `Transformer.forward` exactly: every projection is a matrix product
(2 FLOPs per multiply-add), attention scores q.k and the weighted sum of values each count
2 x D FLOPs per (query, key) pair per head, and the output head computes logits at
every position. Bytes are the minimum traffic to and from memory: every weight
read once per forward pass, the KV cache read up to the last position and written
at the new positions, and each matrix product reading its input and writing its
output once (norms, RoPE and other element-wise work are left out: a good engine
fuses them into the products). Shapes: B batch, T new tokens, S cached positions.

The roofline turns a cost into a time: a pass can go no faster than its FLOPs at
the device's peak FLOP/s, nor than its bytes at the device's memory bandwidth.
Everything here is arithmetic on given numbers; measuring a device or timing a
pass is `timing.py`'s (`measure_roofline`, `time_prefill`, `time_decode_step`).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import validate
from .config import ModelConfig


def _bytes(name: str, value) -> int | float:
    """A size in bytes per element or parameter (e.g. 4, 2, 1, 0.5): a finite number > 0, as a Python number."""
    value = validate.real(name, value, low=0, low_open=True)
    return int(value) if value.is_integer() else value      # an int keeps whole byte counts exact


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch_size: int = 1,
                   bytes_per_element: float = 2) -> int | float:
    """Bytes of the KV cache: 2 (K and V) x layers x KV heads x head dim x seq_len x batch x bytes."""
    validate.instance("config", config, ModelConfig, "a lab.ModelConfig (e.g. lab.get_preset('target') or "
                      "model.config)")
    seq_len = validate.integer("seq_len", seq_len, low=1)
    batch_size = validate.integer("batch_size", batch_size, low=1)
    bytes_per_element = _bytes("bytes_per_element", bytes_per_element)
    elements = 2 * config.n_layers * config.n_kv_heads * config.head_dim * seq_len * batch_size
    total = elements * bytes_per_element
    return int(total) if float(total).is_integer() else total


def arithmetic_intensity(m: int, k: int, n: int, bytes_per_element: float = 2) -> float:
    """FLOPs per byte of [m, k] @ [k, n]: 2mkn FLOPs over (mk + kn + mn) elements read or written once."""
    m, k, n = (validate.integer(name, value, low=1) for name, value in (("m", m), ("k", k), ("n", n)))
    bytes_per_element = _bytes("bytes_per_element", bytes_per_element)
    return 2 * m * k * n / ((m * k + k * n + m * n) * bytes_per_element)


def param_count(config: ModelConfig) -> int:
    """Parameters of a `Transformer` with this config (a tied output head counted once)."""
    C, D, H, H_kv, I = config.dim, config.head_dim, config.n_heads, config.n_kv_heads, config.intermediate_size
    attention = C * H * D + 2 * C * H_kv * D + H * D * C + (H * D + 2 * H_kv * D) * config.qkv_bias
    per_layer = attention + 3 * C * I + 2 * C                          # projections, MLP, two RMSNorms
    embeddings = config.vocab_size * C * (1 if config.tie_embeddings else 2)
    return embeddings + config.n_layers * per_layer + C                 # + the final norm


def llama_7b(n_kv_heads: int = 32, max_seq_len: int = 4096) -> ModelConfig:
    """The shape of a 7B Llama model (32 layers, width 4096, 32 heads of 128); fewer KV heads = GQA."""
    return ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=n_kv_heads,
                       intermediate_size=11008, max_seq_len=max_seq_len, tie_embeddings=False)


@dataclass(frozen=True)
class ForwardCost:
    """What one forward pass computes and moves."""

    linear_flops: float       # every projection and the output head
    attention_flops: float    # scores q.k and the weighted sum of values
    weight_bytes: float       # every weight read once
    kv_read_bytes: float      # cached keys and values read by attention
    kv_write_bytes: float     # new keys and values written to the cache
    activation_bytes: float   # inputs and outputs of the matrix products, logits included

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes


def forward_cost(config: ModelConfig, batch_size: int = 1, seq_len: int = 1, past_len: int = 0,
                 bytes_per_param: float = 2, bytes_per_element: float = 2,
                 use_cache: bool = True) -> ForwardCost:
    """Cost of one forward pass over `seq_len` new tokens per sequence after `past_len` cached ones."""
    validate.instance("config", config, ModelConfig, "a lab.ModelConfig (e.g. lab.get_preset('target') or "
                      "model.config)")
    B, T = validate.integer("batch_size", batch_size, low=1), validate.integer("seq_len", seq_len, low=1)
    past_len, use_cache = validate.integer("past_len", past_len, low=0), validate.boolean("use_cache", use_cache)
    if past_len and not use_cache:
        raise ValueError("past_len > 0 needs use_cache=True: without a cache there is no past to read")
    bytes_per_param = _bytes("bytes_per_param", bytes_per_param)
    bytes_per_element = _bytes("bytes_per_element", bytes_per_element)
    C, D, H, H_kv = config.dim, config.head_dim, config.n_heads, config.n_kv_heads
    I, V, L = config.intermediate_size, config.vocab_size, config.n_layers
    # per token: multiply-adds of the layer projections, then the output head
    layer_macs = C * H * D + 2 * C * H_kv * D + H * D * C + 3 * C * I
    linear_flops = 2 * B * T * (L * layer_macs + C * V)
    # query i of this call sees past_len + i + 1 keys (causal); scores and values each 2 D FLOPs per pair
    pairs = T * past_len + T * (T + 1) // 2
    attention_flops = 2 * 2 * B * L * H * D * pairs
    # activations: each product reads its input and writes its output once
    per_layer_io = (C + H * D) + 2 * (C + H_kv * D) + (H * D + C) + 2 * (C + I) + (I + C)
    activation_bytes = B * T * (L * per_layer_io + C + V) * bytes_per_element
    kv_read = kv_cache_bytes(config, past_len + T, B, bytes_per_element) if use_cache else 0
    kv_write = kv_cache_bytes(config, T, B, bytes_per_element) if use_cache else 0
    return ForwardCost(linear_flops=float(linear_flops), attention_flops=float(attention_flops),
                       weight_bytes=float(param_count(config) * bytes_per_param),
                       kv_read_bytes=float(kv_read), kv_write_bytes=float(kv_write),
                       activation_bytes=float(activation_bytes))


def prefill_cost(config: ModelConfig, prompt_len: int, batch_size: int = 1, **bytes_kw) -> ForwardCost:
    """The prompt's forward pass: `prompt_len` tokens per sequence, written to the cache."""
    return forward_cost(config, batch_size, prompt_len, 0, **bytes_kw)


def decode_cost(config: ModelConfig, context_len: int, batch_size: int = 1, **bytes_kw) -> ForwardCost:
    """One decode step: one new token per sequence after `context_len` cached positions."""
    return forward_cost(config, batch_size, 1, validate.integer("context_len", context_len, low=1), **bytes_kw)


def generation_cost(config: ModelConfig, prompt_len: int, new_tokens: int, use_cache: bool = True,
                    batch_size: int = 1, **bytes_kw) -> ForwardCost:
    """Total cost of a prompt plus `new_tokens` greedy steps, with the KV cache or recomputing everything."""
    prompt_len = validate.integer("prompt_len", prompt_len, low=1)
    new_tokens = validate.integer("new_tokens", new_tokens, low=1)
    if validate.boolean("use_cache", use_cache):    # prefill, then one-token steps at positions prompt_len .. prompt_len + new_tokens - 2
        passes = [prefill_cost(config, prompt_len, batch_size, **bytes_kw)]
        passes += [decode_cost(config, prompt_len + i, batch_size, **bytes_kw) for i in range(new_tokens - 1)]
    else:            # every step runs the whole sequence so far
        passes = [forward_cost(config, batch_size, prompt_len + i, use_cache=False, **bytes_kw)
                  for i in range(new_tokens)]
    fields = ForwardCost.__dataclass_fields__
    return ForwardCost(**{f: sum(getattr(p, f) for p in passes) for f in fields})


# -- the roofline ------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline:
    """A device as two numbers: peak FLOP/s and memory bandwidth in bytes/s."""

    peak_flops: float
    bandwidth: float

    def __post_init__(self):
        for name in ("peak_flops", "bandwidth"):
            object.__setattr__(self, name, validate.real(name, getattr(self, name), low=0, low_open=True))

    @property
    def ridge(self) -> float:
        """The intensity (FLOP/byte) where compute and memory take equal time."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """The best FLOP/s at this intensity: min(peak, bandwidth x intensity)."""
        return min(self.peak_flops, self.bandwidth * intensity)

    def time(self, cost: ForwardCost) -> float:
        """The shortest time a pass can take: the larger of compute time and memory time."""
        return max(cost.flops / self.peak_flops, cost.bytes / self.bandwidth)

    def bound(self, cost: ForwardCost) -> str:
        """'memory' or 'compute': which side of the ridge the pass sits on."""
        return "compute" if cost.intensity >= self.ridge else "memory"
