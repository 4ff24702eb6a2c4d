"""Bad input never hangs, crashes, poisons an object or harms a file (property-based, with hypothesis).

Every entry point the notebooks and the README use gets wrong types, non-finite numbers, extreme sizes
and malformed tensors. Each call must either return a correct result or raise ValueError / TypeError
whose message names the argument; each runs under a time limit (a hang fails the test). Regression
tests for the cases found by hand follow.
"""
from __future__ import annotations

import hashlib
import math
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infopt_lab as lab
from infopt_lab import speculative as sp
from infopt_lab.bench import LADDER

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 20
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# anything a careless caller might pass where a number, a flag or a list is expected
not_integers = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                         st.lists(st.integers(-3, 3), max_size=3), st.just(np.float32("nan")))
junk = st.one_of(not_integers, st.integers(-10**12, 10**12), st.just(np.int64(3)))
# sizes of buffers: small, absurd, or not integers (mid-size values near free memory would really allocate)
sizes = st.one_of(st.integers(-1, 64), st.just(np.int64(4)), st.just(10**12), not_integers)


def within_limit(fn, *args, **kwargs):
    """Call fn under a time limit; return ("ok", result) or ("error", exception). A hang fails the test."""
    box = {}

    def run():
        try:
            box["ok"] = fn(*args, **kwargs)
        except BaseException as e:      # noqa: BLE001 - judged by the caller
            box["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    assert not thread.is_alive(), f"{fn.__name__} hung for {LIMIT_S} s on {args!r} {kwargs!r}"
    return ("error", box["error"]) if "error" in box else ("ok", box["ok"])


def asked_length(max_new_tokens) -> int:
    """The tokens a request asked for: max_new_tokens=None means "not given", SamplingParams' default."""
    return lab.SamplingParams().max_new_tokens if max_new_tokens is None else max_new_tokens


def clear_error(outcome, *names: str) -> bool:
    """True for a ValueError/TypeError naming one of the arguments; any other exception fails the test."""
    kind, value = outcome
    if kind == "ok":
        return False
    assert isinstance(value, (ValueError, TypeError)), f"unclear error {type(value).__name__}: {value}"
    assert any(n in str(value) for n in names), f"the error does not name {names}: {value}"
    return True


# -- generation ------------------------------------------------------------------------------------
@FAST
@given(max_new_tokens=junk, temperature=junk, top_k=junk, top_p=junk, seed=junk)
def test_sampling_params_accept_only_what_they_can_use(max_new_tokens, temperature, top_k, top_p, seed):
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    outcome = within_limit(lab.SamplingParams, **kw)
    if not clear_error(outcome, *kw):
        p = outcome[1]
        assert p.max_new_tokens >= 1 and math.isfinite(p.temperature) and p.temperature >= 0
        assert p.top_k is None or p.top_k >= 1
        assert p.top_p is None or 0 < p.top_p <= 1


@SLOW
@given(prompt=st.one_of(st.text(max_size=20), st.none(), st.integers(), st.just("\ud800 lone")),
       max_new_tokens=st.one_of(st.integers(-2, 8), st.just(10**9), junk), temperature=junk)
def test_generate_returns_what_it_was_asked_or_names_the_argument(tiny, prompt, max_new_tokens, temperature):
    model, tok = tiny
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_at_eos=False)
    outcome = within_limit(lab.generate, model, tok, prompt, **kw)
    if not clear_error(outcome, "prompt", "max_new_tokens", "temperature"):
        assert len(outcome[1].token_ids) == asked_length(max_new_tokens)


@SLOW
@given(settings_=st.fixed_dictionaries({}, optional={
    "max_batch_size": st.one_of(sizes, st.just(10**6)), "block_size": st.one_of(sizes, st.just(10**6)),
    "num_blocks": st.one_of(sizes, st.just(10**9)),
    "scheduler": st.sampled_from(["continuous", "static", "fifo", None])}))
def test_engine_settings_are_checked_before_anything_is_allocated(tiny, settings_):
    model, tok = tiny
    outcome = within_limit(lab.Engine, model, tok, **settings_)
    if not clear_error(outcome, *settings_, "KV pool"):
        assert outcome[1].cache.nbytes < 2**30


@SLOW
@given(prompts=st.lists(st.one_of(st.text(max_size=8), st.lists(st.integers(-5, 5000), max_size=4)), max_size=3),
       max_new_tokens=st.one_of(st.integers(-1, 6), junk), arrival=st.one_of(st.none(), st.lists(junk, max_size=3)),
       temperature=junk, seed=junk)
def test_engine_generate_fails_cleanly_and_stays_usable(tiny, prompts, max_new_tokens, arrival, temperature, seed):
    model, tok = tiny
    engine = lab.Engine(model, tok, max_batch_size=2, block_size=4, num_blocks=40)
    kw = dict(max_new_tokens=max_new_tokens, arrival_s=arrival, temperature=temperature, seed=seed,
              stop_at_eos=False)
    outcome = within_limit(engine.generate, prompts, **kw)
    if not clear_error(outcome, "max_new_tokens", "arrival_s", "temperature", "seed", "prompt"):
        assert len(outcome[1]) == len(prompts)
        assert all(o.error or len(o.token_ids) == asked_length(max_new_tokens) for o in outcome[1])
    assert engine.blocks.num_free == engine.blocks.capacity and not engine.has_unfinished()
    again = engine.generate(["x = 1"], max_new_tokens=3, stop_at_eos=False)
    fresh = lab.Engine(model, tok, max_batch_size=2, block_size=4, num_blocks=40).generate(
        ["x = 1"], max_new_tokens=3, stop_at_eos=False)
    assert again[0].token_ids == fresh[0].token_ids


@SLOW
@given(k=st.one_of(st.integers(-2, 6), junk), max_new_tokens=st.one_of(st.integers(-1, 6), junk),
       temperature=junk)
def test_speculative_generate_checks_k_and_sampling(tiny, k, max_new_tokens, temperature):
    model, tok = tiny
    ids = torch.tensor([tok.encode("def f():")])
    outcome = within_limit(sp.speculative_generate, model, model, ids, k=k, max_new_tokens=max_new_tokens,
                           temperature=temperature)
    if not clear_error(outcome, "k must", "max_new_tokens", "temperature"):
        assert len(outcome[1].token_ids) == asked_length(max_new_tokens)


probs_rows = st.lists(st.one_of(st.floats(-1, 2), st.just(float("nan")), st.just(0.25)), min_size=4, max_size=4)


@FAST
@given(tokens=st.lists(st.integers(-2, 6), min_size=1, max_size=3), q=st.lists(probs_rows, min_size=1, max_size=3),
       p=st.lists(probs_rows, min_size=1, max_size=4))
def test_verify_refuses_what_is_not_a_distribution(tokens, q, p):
    args = (torch.tensor(tokens), torch.tensor(q), torch.tensor(p))
    outcome = within_limit(sp.verify, *args, torch.Generator().manual_seed(0))
    if not clear_error(outcome, "draft_tokens", "draft_probs", "target_probs", "need draft_probs"):
        emitted, accepted = outcome[1]
        assert len(emitted) == accepted + 1 and all(0 <= t < 4 for t in emitted)


# -- quantization, quality, formulas --------------------------------------------------------------------
@SLOW
@given(scheme=st.one_of(st.sampled_from(["int8", "int4", "int2", ""]), junk),
       group_size=st.one_of(st.none(), st.integers(-8, 128), junk))
def test_quantize_model_checks_scheme_and_group_size(tiny, scheme, group_size):
    model, _ = tiny
    outcome = within_limit(lab.quantize_model, model, scheme, group_size=group_size)
    if not clear_error(outcome, "scheme", "group_size"):
        assert any(isinstance(m, lab.QuantLinear) for m in outcome[1].modules())


@SLOW
@given(seq_len=st.one_of(st.none(), st.integers(-2, 300), junk),
       max_tokens=st.one_of(st.integers(-2, 400), not_integers.filter(lambda x: x is not None)))  # None: the whole split, slow
def test_perplexity_refuses_settings_that_change_its_meaning(tiny, seq_len, max_tokens):
    model, tok = tiny
    outcome = within_limit(lab.evaluate, model, tok, "val", seq_len=seq_len, max_tokens=max_tokens)
    if not clear_error(outcome, "seq_len", "max_tokens"):
        assert outcome[1].perplexity > 1 and outcome[1].bits_per_byte > 0


@FAST
@given(seq_len=junk, batch_size=junk, bpe=junk, n=junk, b=junk, lengths=st.one_of(junk, st.lists(junk, max_size=4)))
def test_formulas_refuse_what_they_cannot_count(seq_len, batch_size, bpe, n, b, lengths):
    config = lab.get_preset("target")
    clear_error(within_limit(lab.kv_cache_bytes, config, seq_len, batch_size, bpe), "seq_len", "batch_size",
                "bytes_per_element") or None
    outcome = within_limit(lab.weight_memory_gb, n, b)
    if not clear_error(outcome, "num_params", "bytes_per_param"):
        assert outcome[1] == pytest.approx(n * b / 2**30)
    outcome = within_limit(lab.static_batch_utilization, lengths, batch_size)
    if not clear_error(outcome, "request_lengths", "request lengths", "batch_size"):
        assert 0 < outcome[1] <= 1


@SLOW
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=3, max_size=3),
       causal=st.one_of(st.booleans(), junk))
def test_flash_attention_checks_its_tensors(shapes, causal):
    q, k, v = (torch.randn(*s) if all(d > 0 for d in s) else torch.empty(*s) for s in shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # "Triton cannot run here" where it cannot
        outcome = within_limit(lab.flash_attention, q, k, v, causal=causal)
    clear_error(outcome, "q", "k", "v", "causal", "heads", "lengths", "keys")


@FAST
@given(name=st.one_of(st.text(max_size=12).filter(lambda s: "/" not in s), st.none(), st.integers()))
def test_load_model_names_what_it_can_load(name):
    outcome = within_limit(lab.load_model, name)
    if name in ("target", "draft"):
        assert outcome[0] == "ok"
    else:
        assert clear_error(outcome, "model", "name", "target")


# -- regressions: the cases found by hand -----------------------------------------------------------------
def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_regression_grade_never_overwrites_the_notebook_it_grades(tmp_path):
    from infopt_lab.cli import main
    one = tmp_path / "one"
    one.mkdir()
    alice = one / "alice.ipynb"
    shutil.copyfile(ROOT / "exercises" / "00_orientation.ipynb", alice)
    before = digest(alice)
    assert main(["grade", "--quiet", "--csv", str(alice), str(alice)]) == 2
    assert main(["grade", "--quiet", "--json", "/proc/x", str(alice)]) == 2
    assert digest(alice) == before and sorted(p.name for p in one.iterdir()) == ["alice.ipynb"]


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(seed="x"), dict(arrival_s=[float("inf"), 0]),
                                 dict(arrival_s=[float("nan"), 0])])
def test_regression_a_failed_call_does_not_poison_the_engine(tiny, bad):
    model, tok = tiny
    engine = lab.Engine(model, tok, max_batch_size=2)
    with pytest.raises((ValueError, TypeError)):
        engine.generate(["x = 1", "y = 2"], max_new_tokens=3, **bad)
    assert engine.generate(["x = 1"], max_new_tokens=2)[0].ok


def test_regression_far_future_arrivals_are_not_slept_through(tiny):
    model, tok = tiny
    outs = within_limit(lab.Engine(model, tok, scheduler="static").generate, ["x", "y"], max_new_tokens=2,
                        arrival_s=[0, 1e6], stop_at_eos=False)
    assert outs[0] == "ok" and all(o.ok for o in outs[1])
    assert outs[1][1].ttft_s < 60                          # measured from its (simulated) arrival


@pytest.mark.parametrize("settings_,name", [(dict(block_size=10**6), "block_size"),
                                            (dict(max_batch_size=10**6), "KV pool"),
                                            (dict(num_blocks=10**9), "KV pool")])
def test_regression_huge_engines_are_refused_before_allocation(tiny, settings_, name):
    model, tok = tiny
    with pytest.raises(ValueError, match=name):
        lab.Engine(model, tok, **settings_)


def test_regression_metrics_keep_their_meaning(tiny):
    model, tok = tiny
    for kw, name in [(dict(seq_len=10**4), "seq_len"), (dict(seq_len=0), "seq_len"), (dict(max_tokens=-1), "max_tokens"),
                     (dict(seq_len=64, max_tokens=32), "max_tokens")]:
        with pytest.raises(ValueError, match=name):
            lab.perplexity(model, tok, **kw)
        with pytest.raises(ValueError, match=name):
            lab.bits_per_byte(model, tok, **kw)


def test_regression_silently_wrong_cases_are_refused(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="temperature"):
        lab.generate(model, tok, "x", temperature=float("inf"))
    with pytest.raises(TypeError, match="max_new_tokens"):
        lab.generate(model, tok, "x", max_new_tokens=True)
    with pytest.raises(ValueError, match="already quantized"):
        lab.quantize_model(lab.quantize_model(model, "int8"), "int4")
    with pytest.raises(ValueError, match="target_probs"):
        sp.verify(torch.tensor([1]), torch.full((1, 4), 0.25), torch.tensor([[-0.5, 1.0, 0.5, 0.0]] * 2))
    with pytest.raises(ValueError, match="draft_tokens"):
        sp.verify(torch.tensor([9]), torch.full((1, 4), 0.25), torch.full((2, 4), 0.25))


def test_regression_unclear_errors_are_now_clear(tiny):
    model, tok = tiny
    assert lab.SamplingParams(max_new_tokens=np.int64(3)).max_new_tokens == 3
    with pytest.raises(TypeError, match="model must be a model"):
        lab.generate(None, tok, "x")
    with pytest.raises(TypeError, match="temperature"):
        lab.generate(model, tok, "x", temperature="0.5")
    with pytest.raises(ValueError, match="prompt holds a character"):
        lab.generate(model, tok, "x \ud800")
    with pytest.raises(ValueError, match="model name is empty"):
        lab.load_model("")


@FAST
@given(argv=st.one_of(
    st.tuples(st.just("card"), st.text(max_size=8)),
    st.tuples(st.just("bench"), st.just("--model"), st.sampled_from(["", " ", "nope", "./missing", "/tmp"])),
    st.tuples(st.just("bench"), st.just("--only"), st.text(max_size=6).filter(lambda s: s not in LADDER)),
    st.tuples(st.just("fetch"), st.text(max_size=8).filter(lambda s: s != "smollm2-135m" and not s.startswith("-"))),
    st.tuples(st.just("grade"), st.text(max_size=8).map(lambda s: f"/nonexistent/{s}")),
    st.tuples(st.just("assign"), st.just("--check"), st.just("--solutions"), st.text(max_size=6).map(lambda s: f"/no/{s}")),
    st.tuples(st.just("train"), st.just("--preset"), st.text(max_size=6), st.just("--out"), st.just("/tmp/x"))))
def test_command_line_bad_arguments_end_in_one_error_line(argv, capsys):
    """Every command refuses bad arguments with exit status 2 and a message, never a traceback."""
    from infopt_lab.cli import main
    if argv[0] == "card" and argv[1] in ("target", "draft"):
        return                                             # a valid card run writes model cards: not bad input
    try:
        code = main(list(argv))
    except SystemExit as e:                                # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err and "error" in err.lower()
