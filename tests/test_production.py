"""Our engine's settings in vLLM's words: the translation the notebook's vLLM cell relies on."""
import pytest

import infopt_lab as lab
from infopt_lab.production import KNOBS, vllm_arguments


def test_every_knob_reaches_its_vllm_argument():
    params = lab.SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=3, stop_token_ids=(2,))
    args = vllm_arguments("HuggingFaceTB/SmolLM2-135M-Instruct", max_batch_size=16, block_size=32, max_model_len=1024,
                          max_num_batched_tokens=512, enable_prefix_caching=True, draft="path/to/draft",
                          num_speculative_tokens=2, kv_cache_dtype="int8", weights="int8",
                          tensor_parallel_size=2, pipeline_parallel_size=2, params=params)
    assert args["LLM"] == {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "max_num_seqs": 16, "block_size": 32,
        "enable_prefix_caching": True, "kv_cache_dtype": "fp8", "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2, "max_model_len": 1024, "max_num_batched_tokens": 512, "quantization": "fp8",
        "speculative_config": {"model": "path/to/draft", "num_speculative_tokens": 2}}
    assert args["SamplingParams"] == {"max_tokens": 32, "temperature": 0.7, "seed": 3, "ignore_eos": False,
                                      "top_p": 0.9, "stop_token_ids": [2]}


def test_defaults_prompt_lookup_and_int4():
    plain = vllm_arguments("m")
    assert "speculative_config" not in plain["LLM"] and "quantization" not in plain["LLM"]
    assert plain["LLM"]["kv_cache_dtype"] == "auto" and plain["SamplingParams"]["temperature"] == 0.0
    lookup = vllm_arguments("m", draft="ngram", num_speculative_tokens=4, weights="int4")
    assert lookup["LLM"]["speculative_config"]["method"] == "ngram" and lookup["LLM"]["quantization"] == "gptq"


@pytest.mark.parametrize("kwargs, match", [
    (dict(draft="d"), "both a draft"), (dict(num_speculative_tokens=2), "both a draft"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype"), (dict(weights="int3"), "weights"),
])
def test_settings_vllm_cannot_take_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vllm_arguments("m", **kwargs)


def test_the_knob_table_names_vllm_arguments_the_function_writes():
    args = vllm_arguments("m", draft="d", num_speculative_tokens=1, weights="int8", max_model_len=8,
                          max_num_batched_tokens=8)["LLM"]
    table = " ".join(vllm for _, vllm, _ in KNOBS)
    assert all(name in table for name in args if name != "model")
