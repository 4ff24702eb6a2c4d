"""infopt_lab.costs: KV-cache bytes, the FLOP/byte cost model and the roofline."""
from __future__ import annotations

import pytest
import torch

import infopt_lab as lab
from infopt_lab import costs

GiB, MiB = 1024**3, 1024**2


@pytest.mark.parametrize("preset, batch, seq_len, dtype", [
    ("target", 1, 1024, torch.float32), ("target", 3, 77, torch.bfloat16),
    ("draft", 2, 64, torch.float16), ("tiny", 5, 128, torch.float32),
])
def test_kv_cache_bytes_equals_the_allocated_cache(preset, batch, seq_len, dtype):
    config = lab.get_preset(preset)
    cache = lab.KVCache(config, batch_size=batch, max_seq_len=seq_len, dtype=dtype)
    element = torch.empty((), dtype=dtype).element_size()
    assert lab.kv_cache_bytes(config, seq_len, batch, element) == cache.nbytes


def test_kv_cache_bytes_of_a_model_built_from_its_config():
    model = lab.Transformer(lab.get_preset("tiny"))
    cache = lab.KVCache.for_model(model, batch_size=2, max_seq_len=40)
    assert lab.kv_cache_bytes(model.config, 40, 2, bytes_per_element=4) == cache.nbytes


def test_kv_cache_bytes_of_a_7b_model_with_and_without_gqa():
    assert lab.kv_cache_bytes(costs.llama_7b(n_kv_heads=32), 4096, 1, 2) == 2 * GiB
    assert lab.kv_cache_bytes(costs.llama_7b(n_kv_heads=8), 4096, 1, 2) == 512 * MiB
    assert lab.kv_cache_bytes(costs.llama_7b(), 4096, batch_size=16, bytes_per_element=0.5) == 8 * GiB


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(seq_len=0), ValueError, "seq_len must be an integer >= 1, got 0"),
    (dict(seq_len=-4), ValueError, "seq_len must be an integer >= 1, got -4"),
    (dict(seq_len=2.5), TypeError, "seq_len must be an integer >= 1, got 2.5"),      # a wrong type
    (dict(seq_len=True), TypeError, "seq_len must be an integer >= 1, got True"),
    (dict(batch_size=0), ValueError, "batch_size must be an integer >= 1"),
    (dict(batch_size=-1), ValueError, "batch_size must be an integer >= 1"),
    (dict(bytes_per_element=0), ValueError, "bytes_per_element must be a finite number > 0, got 0"),
    (dict(bytes_per_element=-2), ValueError, "bytes_per_element must be a finite number > 0"),
    (dict(bytes_per_element=float("inf")), ValueError, "bytes_per_element must be a finite number > 0"),
    (dict(bytes_per_element="2"), TypeError, "bytes_per_element must be a finite number > 0"),
])
def test_kv_cache_bytes_rejects_bad_input(kwargs, error, message):
    args = {"seq_len": 16, "batch_size": 1, "bytes_per_element": 2, **kwargs}
    with pytest.raises(error, match=message):
        lab.kv_cache_bytes(lab.get_preset("target"), **args)


def test_kv_cache_bytes_names_a_config_that_is_not_one():
    with pytest.raises(TypeError, match="config must be a lab.ModelConfig"):
        lab.kv_cache_bytes({"n_layers": 2}, 16)


@pytest.mark.parametrize("preset", ["tiny", "target", "draft"])
def test_param_count_equals_the_model(preset):
    config = lab.get_preset(preset)
    assert lab.param_count(config) == lab.Transformer(config).num_parameters()


def test_param_count_of_an_untied_qwen2_shape():
    config = lab.ModelConfig(vocab_size=300, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, intermediate_size=96,
                             tie_embeddings=False, qkv_bias=True)
    assert lab.param_count(config) == lab.Transformer(config).num_parameters()
    assert lab.param_count(costs.llama_7b()) == 6_738_415_616


def test_linear_flops_are_two_per_weight_per_token():
    config = lab.get_preset("target")
    c = lab.forward_cost(config, batch_size=3, seq_len=5)
    # every weight matrix (the tied embedding as the output head) does one multiply-add per token
    matrix_params = lab.param_count(config) - config.n_layers * 2 * config.dim - config.dim
    assert c.linear_flops == 2 * 3 * 5 * matrix_params


def test_attention_flops_count_causal_pairs():
    config = lab.get_preset("tiny")
    per_pair = 4 * config.n_layers * config.n_heads * config.head_dim
    assert lab.prefill_cost(config, 4).attention_flops == per_pair * (1 + 2 + 3 + 4)
    assert lab.decode_cost(config, 10).attention_flops == per_pair * 11
    assert lab.decode_cost(config, 10, batch_size=2).attention_flops == 2 * per_pair * 11


def test_decode_reads_every_weight_and_the_cache():
    config = lab.get_preset("target")
    c = lab.decode_cost(config, 100, bytes_per_param=4, bytes_per_element=2)
    assert c.weight_bytes == lab.param_count(config) * 4
    assert c.kv_read_bytes == lab.kv_cache_bytes(config, 101, 1, 2)
    assert c.kv_write_bytes == lab.kv_cache_bytes(config, 1, 1, 2)
    assert c.bytes == c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes + c.activation_bytes


def test_intensity_grows_with_tokens_per_pass():
    config = lab.get_preset("target")
    decode = [lab.decode_cost(config, 32, batch_size=b).intensity for b in (1, 2, 8, 32)]
    prefill = [lab.prefill_cost(config, t).intensity for t in (1, 16, 256)]
    assert decode == sorted(decode) and prefill == sorted(prefill)
    assert decode[0] < 1.5 < 8 < decode[-1]        # about one FLOP per 2-byte weight at batch 1
    # the same weights and the same tokens cost the same whether batched or prefilled
    assert lab.decode_cost(config, 1, batch_size=8).linear_flops == lab.forward_cost(config, 8, 1, 1).linear_flops


def test_weight_bytes_do_not_depend_on_the_batch():
    config = lab.get_preset("target")
    one, many = lab.decode_cost(config, 32, batch_size=1), lab.decode_cost(config, 32, batch_size=32)
    assert one.weight_bytes == many.weight_bytes


def test_generation_cost_sums_its_passes():
    config = lab.get_preset("tiny")
    cached = lab.generation_cost(config, 8, 3, use_cache=True)
    passes = [lab.prefill_cost(config, 8), lab.decode_cost(config, 8), lab.decode_cost(config, 9)]
    expected = sum(p.flops for p in passes)
    assert cached.flops == expected
    recomputed = lab.generation_cost(config, 8, 3, use_cache=False)
    assert recomputed.flops == sum(lab.forward_cost(config, 1, t, use_cache=False).flops for t in (8, 9, 10))
    assert recomputed.kv_read_bytes == 0
    big = lab.get_preset("target")
    ratio = lab.generation_cost(big, 32, 512, False).flops / lab.generation_cost(big, 32, 512, True).flops
    assert ratio > 100                         # recomputation does quadratically more work


def test_matvec_and_matmul_intensity():
    assert lab.arithmetic_intensity(4096, 4096, 1, 2) == pytest.approx(1.0, rel=1e-3)
    assert lab.arithmetic_intensity(4096, 4096, 4096, 2) == pytest.approx(4096 / 3)
    assert lab.arithmetic_intensity(3, 5, 7, 4) == 2 * 3 * 5 * 7 / ((15 + 35 + 21) * 4)


@pytest.mark.parametrize("call, error, message", [
    (lambda c: lab.forward_cost(c, batch_size=0), ValueError, "batch_size must be an integer >= 1"),
    (lambda c: lab.forward_cost(c, seq_len=0), ValueError, "seq_len must be an integer >= 1"),
    (lambda c: lab.forward_cost(c, past_len=-1), ValueError, "past_len must be an integer >= 0"),
    (lambda c: lab.forward_cost(c, past_len=1.0), TypeError, "past_len must be an integer >= 0, got 1.0"),
    (lambda c: lab.forward_cost(c, past_len=3, use_cache=False), ValueError, "needs use_cache=True"),
    (lambda c: lab.forward_cost(c, bytes_per_param=0), ValueError, "bytes_per_param must be a finite number > 0"),
    (lambda c: lab.forward_cost(c, bytes_per_element=-1), ValueError, "bytes_per_element must be a finite number > 0"),
    (lambda c: lab.forward_cost(c.to_dict()), TypeError, "config must be a lab.ModelConfig"),
    (lambda c: lab.prefill_cost(c, 0), ValueError, "seq_len must be an integer >= 1"),
    (lambda c: lab.decode_cost(c, 0), ValueError, "context_len must be an integer >= 1"),
    (lambda c: lab.generation_cost(c, 8, 0), ValueError, "new_tokens must be an integer >= 1"),
    (lambda c: lab.generation_cost(c, 8, 2, use_cache=1), TypeError, "use_cache must be True or False"),
    (lambda c: lab.arithmetic_intensity(0, 4, 4), ValueError, "m must be an integer >= 1"),
    (lambda c: lab.arithmetic_intensity(4, 4, 4, 0), ValueError, "bytes_per_element must be a finite number > 0"),
])
def test_cost_model_rejects_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call(lab.get_preset("tiny"))


def test_roofline_bound_and_ridge():
    roof = lab.Roofline(peak_flops=100e9, bandwidth=10e9)
    assert roof.ridge == 10
    assert roof.attainable(1) == 10e9 and roof.attainable(1000) == 100e9
    config = lab.get_preset("target")
    decode = lab.decode_cost(config, 32)
    assert roof.bound(decode) == "memory" and roof.time(decode) == decode.bytes / 10e9
    big_prefill = lab.prefill_cost(config, 1000)
    assert roof.bound(big_prefill) == "compute" and roof.time(big_prefill) == big_prefill.flops / 100e9
    with pytest.raises(ValueError, match="peak_flops must be a finite number > 0, got 0"):
        lab.Roofline(peak_flops=0, bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth must be a finite number > 0, got inf"):
        lab.Roofline(peak_flops=1e12, bandwidth=float("inf"))


def test_kv_comparison_gives_identical_tokens_on_a_tiny_model():
    from infopt_lab import bench
    model = lab.Transformer(lab.get_preset("tiny")).eval()
    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    c = bench.kv_comparison(model, ids, new_tokens=20)
    assert c.same_tokens and len(c.cached_ids) == 20 and c.prompt_len == 6
    assert len(c.cached_times_s) == len(c.recomputed_times_s) == 20
    assert c.cached_times_s == sorted(c.cached_times_s)
    assert sum(c.step_times(c.cached_times_s)) == pytest.approx(c.cached_s)


def test_kv_calculator_line_names_the_formula():
    from infopt_lab import widgets
    line = widgets.kv_cache_line(costs.llama_7b(n_kv_heads=8), 4096, 1, 2)
    assert line.endswith("= 0.500 GiB") and "8 KV heads" in line


def test_kv_prompt_must_fit_the_text():
    from infopt_lab import bench

    class Tok:                                   # a stand-in tokenizer: one token per character
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text)))

    assert bench.kv_prompt_ids(Tok(), 32).shape == (1, 32)
    with pytest.raises(ValueError, match="prompt_tokens must be an integer in \\[1, "):
        bench.kv_prompt_ids(Tok(), 0)
