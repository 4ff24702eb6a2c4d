"""The road to a production engine: our engine's settings translated to vLLM's arguments.

`vllm_arguments` is a plain function, tested here, so the notebook cell that runs the
same workload through vLLM (on a CUDA machine where it is installed) cannot drift from
the settings it claims to mirror.
"""
from __future__ import annotations

from . import validate
from .sampling import SamplingParams, sampling_params

# our name -> vLLM's, with what changes on the way (shown in notebook 07's table)
KNOBS = (
    ("lab.Engine(model, tok)", "vllm.LLM(model=...)", "vLLM loads the checkpoint itself, by path or hub id"),
    ("SamplingParams(max_new_tokens=...)", "SamplingParams(max_tokens=...)", "the other fields keep their names"),
    ("max_batch_size", "max_num_seqs", "sequences scheduled at once"),
    ("max_num_batched_tokens", "max_num_batched_tokens", "the token budget of one step (chunked prefill)"),
    ("block_size", "block_size", "tokens per KV block; vLLM's GPU kernels take 16 (or 32)"),
    ("num_blocks", "gpu_memory_utilization", "vLLM sizes the pool from a share of GPU memory instead"),
    ("max_model_len", "max_model_len", "the longest prompt + output"),
    ("enable_prefix_caching", "enable_prefix_caching", "on by default in vLLM's V1 engine"),
    ("draft=model, num_speculative_tokens=k", 'speculative_config={"model": ..., "num_speculative_tokens": k}',
     "the draft is a checkpoint path"),
    ('draft="ngram"', 'speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}',
     "prompt lookup"),
    ("cascade_attention=True", "disable_cascade_attn=False",
     "vLLM's V1 engine decides step by step whether a shared prefix is worth it; the flag only turns it off"),
    ('kv_cache_dtype="int8"', 'kv_cache_dtype="fp8"', "vLLM's 8-bit KV cache is fp8, not int8"),
    ('quantize_model(model, "int8")', 'quantization="fp8"', "8-bit weights quantized at load time (fp8 on GPUs)"),
    ('quantize_model(model, "int4", group_size=128)', 'quantization="gptq" or "awq"',
     "needs a checkpoint quantized ahead of time"),
    ("(one device)", "tensor_parallel_size, pipeline_parallel_size",
     "split each layer across GPUs (tensor), or the layers across GPUs or machines (pipeline)"),
)

WEIGHT_QUANTIZATION = {None: None, "int8": "fp8", "int4": "gptq"}
KV_CACHE_DTYPE = {"auto": "auto", "int8": "fp8"}


def vllm_arguments(model: str, *, max_batch_size: int = 8, block_size: int = 16, max_model_len: int | None = None,
                   max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = False,
                   draft: str | None = None, num_speculative_tokens: int = 0, kv_cache_dtype: str = "auto",
                   weights: str | None = None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                   params: SamplingParams | None = None) -> dict[str, dict]:
    """{"LLM": kwargs for vllm.LLM, "SamplingParams": kwargs for vllm.SamplingParams} matching our settings.

    `model` and `draft` are checkpoint paths or hub ids (`draft="ngram"` for prompt lookup); `weights` is
    None, "int8" or "int4" (as passed to `lab.quantize_model`).
    """
    validate.text("model", model)                 # a checkpoint path or hub id
    validate.choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPE)
    validate.choice("weights", weights, WEIGHT_QUANTIZATION)
    num_speculative_tokens = validate.speculation_length("num_speculative_tokens", num_speculative_tokens, low=0)
    if (draft is None) != (num_speculative_tokens == 0):
        raise ValueError("give both a draft and num_speculative_tokens >= 1, or neither "
                         f"(got draft={draft!r}, num_speculative_tokens={num_speculative_tokens!r})")
    llm = {"model": model, "max_num_seqs": max_batch_size, "block_size": block_size,
           "enable_prefix_caching": enable_prefix_caching, "kv_cache_dtype": KV_CACHE_DTYPE[kv_cache_dtype],
           "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    if max_model_len is not None:
        llm["max_model_len"] = max_model_len
    if max_num_batched_tokens is not None:
        llm["max_num_batched_tokens"] = max_num_batched_tokens
    if weights is not None:
        llm["quantization"] = WEIGHT_QUANTIZATION[weights]
    if draft == "ngram":
        llm["speculative_config"] = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                                     "prompt_lookup_max": 3}
    elif draft is not None:
        llm["speculative_config"] = {"model": draft, "num_speculative_tokens": num_speculative_tokens}
    p = sampling_params(params)
    sampling = {"max_tokens": p.max_new_tokens, "temperature": p.temperature, "seed": p.seed,
                "ignore_eos": not p.stop_at_eos}
    if p.top_k is not None:
        sampling["top_k"] = p.top_k
    if p.top_p is not None:
        sampling["top_p"] = p.top_p
    if p.stop_token_ids:
        sampling["stop_token_ids"] = list(p.stop_token_ids)
    return {"LLM": llm, "SamplingParams": sampling}
