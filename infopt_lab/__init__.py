"""infopt-lab: LLM inference optimization, measured. `import infopt_lab as lab`."""
from . import data, generate as generation, kv_cache, metrics, sampling
from .config import PRESETS, ModelConfig, get_preset
from .device import HAS_CUDA, HAS_TRITON, default_dtype, get_device, synchronize
from .generate import GenerationOutput, decode_one_token, generate, prefill, stream
from .kv_cache import KVCache
from .loading import load_model
from .metrics import (Timer, bits_per_byte, measure_bandwidth_gbs, model_weight_bytes,
                      percentiles, perplexity, request_metrics, throughput, time_fn,
                      weight_memory_gb)
from .model import Transformer
from .sampling import SamplingParams, logits_to_probs, sample

__version__ = "0.1.0"
