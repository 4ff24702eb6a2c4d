import pytest
import torch

import infopt_lab as lab


def test_cached_greedy_equals_recomputed_greedy_on_the_target():
    model, tok = lab.load_model("target")
    cached = lab.generate(model, tok, "def parse_args(argv):\n", max_new_tokens=40, stop_at_eos=False)
    plain = lab.generate(model, tok, "def parse_args(argv):\n", max_new_tokens=40, use_cache=False,
                         stop_at_eos=False)
    assert cached.token_ids == plain.token_ids
    assert len(cached.token_ids) == 40


def test_generation_output_carries_timings(tiny):
    model, tok = tiny
    out = lab.generate(model, tok, "import os", max_new_tokens=8, stop_at_eos=False)
    assert len(out.token_ids) == 8 and len(out.token_times_s) == 8
    assert out.ttft_s == out.token_times_s[0] and out.e2e_s == out.token_times_s[-1]
    assert out.tpot_s == pytest.approx((out.e2e_s - out.ttft_s) / 7)
    assert out.tokens_per_s == pytest.approx(8 / out.e2e_s)   # one definition: new tokens / end-to-end time
    assert out.text == tok.decode(out.token_ids)


def test_seeded_sampling_repeats_and_seeds_differ(tiny):
    model, tok = tiny
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95, stop_at_eos=False)
    a = lab.generate(model, tok, "x = ", seed=1, **kw)
    b = lab.generate(model, tok, "x = ", seed=1, **kw)
    c = lab.generate(model, tok, "x = ", seed=2, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_sampled_cached_equals_sampled_recomputed(tiny):
    model, tok = tiny
    kw = dict(max_new_tokens=10, temperature=0.7, top_k=20, seed=3, stop_at_eos=False)
    assert lab.generate(model, tok, "def", **kw).token_ids == \
        lab.generate(model, tok, "def", use_cache=False, **kw).token_ids


def test_stream_yields_the_same_text(tiny):
    model, tok = tiny
    pieces = list(lab.stream(model, tok, "class A:", max_new_tokens=10, stop_at_eos=False))
    assert "".join(pieces) == lab.generate(model, tok, "class A:", max_new_tokens=10,
                                           stop_at_eos=False).text


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=-3), "max_new_tokens must be an integer >= 1"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be a finite number in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.2), r"top_p must be a finite number in \(0, 1\]"),
    (dict(temperature=1.0, top_k=0), "top_k must be an integer >= 1"),
])
def test_bad_sampling_settings_are_named(tiny, kwargs, message):
    model, tok = tiny
    with pytest.raises(ValueError, match=message):
        lab.generate(model, tok, "x", **{"max_new_tokens": 4, **kwargs})


def test_prompt_longer_than_context_is_rejected(tiny):
    model, tok = tiny
    long_prompt = "x = 1\n" * model.config.max_seq_len
    with pytest.raises(ValueError, match="exceeds the model's context"):
        lab.generate(model, tok, long_prompt, max_new_tokens=4)


def test_empty_prompt_and_non_string_prompt(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="prompt is empty"):
        lab.generate(model, tok, "", max_new_tokens=4)
    with pytest.raises(TypeError, match="prompt must be a string"):
        lab.generate(model, tok, [1, 2, 3], max_new_tokens=4)


def test_unknown_model_name_lists_what_is_allowed():
    with pytest.raises(ValueError, match="use one of \\['target', 'draft', 'smollm2-135m', 'smollm2-135m-draft'\\], a local directory"):
        lab.load_model("targte")


def test_target_writes_python():
    model, tok = lab.load_model("target")
    out = lab.generate(model, tok, "def fib(n):", max_new_tokens=48)
    assert "return" in out.text or "\n    " in out.text


@pytest.mark.parametrize("params", [
    lab.SamplingParams(max_new_tokens=24, stop_at_eos=False),
    lab.SamplingParams(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=11, stop_at_eos=False),
], ids=["greedy", "sampled"])
def test_one_core_same_tokens_through_generate_engine_and_speculative(params):
    """One SamplingParams, one sampler, one request check: every entry point decodes the same tokens."""
    model, tok = lab.load_model("target", dtype=torch.float32)
    prompt, others = "def read_config(path):", ["import sys", "class Point:", "x = [1, 2, 3]"]
    want = lab.generate(model, tok, prompt, params).token_ids
    alone = lab.Engine(model, tok).generate([prompt], params)
    batched = lab.Engine(model, tok, max_batch_size=4).generate(others[:1] + [prompt] + others[1:], params)
    ids = torch.tensor([tok.encode(prompt)], device=lab.get_device())
    spec = lab.speculative_generate(model, model, ids, params, k=4)     # the target as its own draft
    assert len(want) == 24
    assert alone[0].token_ids == want and batched[1].token_ids == want
    assert spec.token_ids == want
    if not params.greedy:
        assert want != lab.generate(model, tok, prompt, params, seed=12).token_ids   # the seed matters


def test_engine_add_request_step_has_unfinished(tiny):
    """vLLM's loop by hand: add requests, step until none is unfinished; each output arrives once."""
    model, tok = tiny
    engine = lab.Engine(model, tok, max_batch_size=2)
    a = engine.add_request("x = 1", lab.SamplingParams(max_new_tokens=3, stop_at_eos=False))
    b = engine.add_request([1, 2, 3], lab.SamplingParams(max_new_tokens=5, stop_at_eos=False))
    bad = engine.add_request("", lab.SamplingParams(max_new_tokens=2))
    done, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in done
            done[out.request_id] = out
        steps += 1
    assert sorted(done) == [a, b, bad] and steps == 5       # prefill + 4 decode steps for the longest
    assert len(done[a].token_ids) == 3 and len(done[b].token_ids) == 5 and "empty" in done[bad].error
    assert engine.stats.completed == 2 and engine.stats.failed == 1 and engine.stats.generated_tokens == 8
    assert done[b].tokens_per_s == pytest.approx(5 / done[b].e2e_s)


def test_sampling_params_validate_and_override():
    p = lab.SamplingParams(max_new_tokens=8, temperature=0.5)
    assert lab.sampling.sampling_params(p, top_k=3) == lab.SamplingParams(max_new_tokens=8, temperature=0.5, top_k=3)
    assert p.stop_ids(7) == {7} and lab.SamplingParams(stop_token_ids=[3], stop_at_eos=False).stop_ids(7) == {3}
    import numpy as np
    assert lab.SamplingParams(max_new_tokens=np.int64(3)).max_new_tokens == 3
    with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
        lab.SamplingParams(max_new_tokens=True)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        lab.SamplingParams(temperature=float("inf"))
    with pytest.raises(TypeError, match="unknown sampling setting"):
        lab.sampling.sampling_params(None, temprature=1.0)
