import pytest

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
    assert out.tokens_per_s == pytest.approx(1 / out.tpot_s)
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
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.2), r"top_p must be in \(0, 1\]"),
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
    with pytest.raises(ValueError, match="use 'target', 'draft', a local directory"):
        lab.load_model("targte")


def test_target_writes_python():
    model, tok = lab.load_model("target")
    out = lab.generate(model, tok, "def fib(n):", max_new_tokens=48)
    assert "return" in out.text or "\n    " in out.text
