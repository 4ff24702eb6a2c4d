"""infopt-lab: LLM inference optimization, measured. `import infopt_lab as lab`."""
from . import kernels  # first: without CUDA it sets TRITON_INTERPRET=1 before anything imports triton
from . import batching, costs, data, kv_cache, metrics, quantize, sampling, speculative
from .batching import static_batch_utilization
from .config import PRESETS, ModelConfig, get_preset
from .costs import (ForwardCost, Roofline, arithmetic_intensity, decode_cost, forward_cost, generation_cost,
                    kv_cache_bytes, measure_matmul_flops, measure_roofline, param_count, prefill_cost)
from .engine import Engine, EngineStats, RequestOutput
from .device import HAS_CUDA, HAS_TRITON, default_dtype, get_device, synchronize
from .generate import GenerationOutput, decode_one_token, generate, prefill, stream
from .kernels.attention_ref import attention_reference, attention_tiled
from .kv_cache import KVCache
from .kv_quant import QuantizedKVCache
from .loading import load_model
from .metrics import (Timer, bits_per_byte, measure_bandwidth_gbs, model_weight_bytes,
                      percentiles, perplexity, request_metrics, throughput, time_fn,
                      weight_memory_gb)
from .model import Transformer
from .quantize import (QuantLinear, dequantize, pack_int4, quantization_error, quantize_asymmetric,
                       quantize_linear, quantize_model, quantize_symmetric, state_dict_bytes, unpack_int4)
from .sampling import SamplingParams, logits_to_probs, sample
from .speculative import expected_tokens_per_pass, prompt_lookup_generate, speculative_generate

__version__ = "0.1.0"


def __getattr__(name: str):
    """`lab.flash_attention` and `lab.attention_path` import Triton only when first used."""
    if name in ("flash_attention", "attention_path"):
        from .kernels import flash_attention as module
        return getattr(module, name)
    raise AttributeError(f"module 'infopt_lab' has no attribute {name!r}")
