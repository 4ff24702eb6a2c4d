"""The feature draft (EAGLE's idea): trained on the target's features, it proposes; the target's tokens come out.

A small draft for the bundled target is trained here in seconds on its own features, so that it proposes
tokens the target accepts; every guarantee is checked on held-out prompts with and without a stop token,
in `speculative_generate` and inside the engine, greedy and sampled.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import infopt_lab as lab
from infopt_lab import feature_draft as fd
from infopt_lab import feature_train as ft
from infopt_lab import speculative as sp
from infopt_lab.bench.exactness import heldout_prompts
from infopt_lab.exactness import compare

from draws import first_token_counts

COVERED = 384          # of the bundled target's 4,096 tokens: non-covered tokens are common


@pytest.fixture(scope="module")
def trained():
    """The fp32 bundled target, its tokenizer, and a feature draft trained on its features for a few seconds."""
    target, tok = lab.load_model("target", dtype=torch.float32)
    texts = lab.data.read_texts("train")[:40]
    sequences = [tok.encode(t)[:192] for t in texts if len(t) > 2000][:24]
    data = ft.build_features(target, sequences, None, window=96, progress=False)
    choices = ft.target_choices(target, data)
    ids = ft.frequent_tokens(choices, COVERED, always=[tok.eos_token_id])
    draft = fd.initial_draft(target, ids, seed=0)
    history = ft.train_draft(draft, data, steps=80, batch_size=8, lr=2e-3, warmup=10, progress=False,
                             eval_every=79)
    return target, tok, draft, history


def test_training_lowers_the_loss_and_raises_agreement(trained):
    *_, history = trained
    first, last = history[0], history[-1]
    assert last["loss"] < 0.8 * first["loss"], history
    assert last["top1_1"] > first["top1_1"] + 0.1, history


@pytest.mark.parametrize("stop_at_eos", [True, False])
def test_greedy_output_is_the_targets_on_held_out_prompts(trained, stop_at_eos):
    target, tok, draft, _ = trained
    accepted = 0
    for prompt in heldout_prompts(tok, 8, seed=29):
        want = lab.generate(target, tok, prompt, max_new_tokens=48, stop_at_eos=stop_at_eos).token_ids
        ids = torch.tensor([tok.encode(prompt)])
        for k in (1, 4):
            out = sp.speculative_generate(target, draft, ids, max_new_tokens=48, k=k, stop_at_eos=stop_at_eos)
            assert out.token_ids == want, (prompt, k)
            assert out.target_forwards == len(out.rounds) + 1
            accepted += sum(r.accepted for r in out.rounds)
    assert accepted > 0                           # the draft proposes tokens the target keeps


def test_compiled_verify_passes_give_the_eager_tokens_by_the_rule(trained):
    """compile=True runs the (k + 1)-token verify passes through compiled graphs: generate's tokens, stops included,
    except at rounding ties (fp32), for the feature draft and for a draft model."""
    target, tok, draft, _ = trained
    small, _ = lab.load_model("draft", dtype=torch.float32)
    prompts = heldout_prompts(tok, 4, seed=31)
    newline = tok.encode("\n", add_special_tokens=False)
    want = [lab.generate(target, tok, p, max_new_tokens=32, stop_token_ids=newline).token_ids for p in prompts]
    for d in (draft, small):
        got = [sp.speculative_generate(target, d, torch.tensor([tok.encode(p)]), max_new_tokens=32, k=3,
                                       stop_token_ids=newline, compile=True).token_ids for p in prompts]
        agreement = compare(target, [tok.encode(p) for p in prompts], want, got)
        assert agreement.holds, agreement.summary(tok)
    assert any(len(w) < 32 for w in want)                  # a stop token ended some output early

def test_a_forced_eos_inside_an_accepted_draft_ends_the_output_there(trained):
    """A stop id the draft proposes and the target accepts ends the output where generate ends it."""
    target, tok, draft, _ = trained
    for prompt in heldout_prompts(tok, 8, seed=29):
        ids = torch.tensor([tok.encode(prompt)])
        free = sp.speculative_generate(target, draft, ids, max_new_tokens=48, k=4, stop_at_eos=False)
        seen = set(tok.encode(prompt))
        for r in free.rounds:                     # a token first seen as an accepted draft token
            stop = next((t for t in r.emitted[:r.accepted] if t not in seen and t not in free.token_ids[
                :free.token_ids.index(t)]), None)
            if stop is not None:
                params = lab.SamplingParams(max_new_tokens=48, stop_token_ids=(stop,), stop_at_eos=False)
                want = lab.generate(target, tok, prompt, params).token_ids
                assert want[-1] == stop
                assert sp.speculative_generate(target, draft, ids, params, k=4).token_ids == want
                engine = lab.Engine(target, tok, draft=draft, num_speculative_tokens=4)
                assert engine.generate([prompt], params)[0].token_ids == want
                return
    pytest.fail("no accepted draft token was seen first")


@pytest.mark.parametrize("setting", [dict(max_batch_size=1), dict(max_batch_size=4),
                                     dict(max_batch_size=4, enable_prefix_caching=True)])
def test_the_engine_gives_the_tokens_it_gives_without_speculation(trained, setting):
    target, tok, draft, _ = trained
    prompts = heldout_prompts(tok, 8, seed=29)
    prompts += prompts[:3]                        # repeats: prefix-cache hits where caching is on
    plain = lab.Engine(target, tok, **setting).generate(prompts, max_new_tokens=48)
    engine = lab.Engine(target, tok, draft=draft, num_speculative_tokens=3, **setting)
    spec = engine.generate(prompts, max_new_tokens=48)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats.draft_tokens > 0 and engine.stats.accepted_tokens > 0


def test_the_engine_accepts_what_speculative_generate_accepts_at_batch_1(trained):
    """The engine's held features and catch-up give the draft the inputs the single-sequence loop gives it.

    Not to the token: the engine drafts fewer than k where a request has fewer tokens left, and its packed
    passes round differently, so near-ties in the draft may fall the other way; a feature read from the
    wrong position would lower the engine's acceptance far more than that.
    """
    target, tok, draft, _ = trained
    prompts = heldout_prompts(tok, 6, seed=29)
    alone = [sp.speculative_generate(target, draft, torch.tensor([tok.encode(p)]), max_new_tokens=48, k=3)
             for p in prompts]
    engine = lab.Engine(target, tok, max_batch_size=1, draft=draft, num_speculative_tokens=3)
    engine.generate(prompts, max_new_tokens=48)
    rounds = sp.SpeculativeOutput([], 3, [r for o in alone for r in o.rounds], 0, 0, 1.0)
    assert rounds.acceptance_rate > 0.1                       # a draft the target listens to
    assert engine.stats.acceptance_rate == pytest.approx(rounds.acceptance_rate, abs=0.05)


def _tv(p: torch.Tensor, q: torch.Tensor, covered: torch.Tensor, k: int, trials: int) -> float:
    """Draw k tokens from q, verify against p; total variation of the first emitted token from p, over buckets.

    Each token holding at least 0.5% of p or q is its own bucket; the other covered tokens share one and
    the other uncovered tokens (which q never proposes: only the fallback emits them) another. Over all
    4,096 tokens one by one, 20,000 draws of p itself would land about 0.04 from p: sampling noise alone.
    """
    counts = first_token_counts(p, q, k, trials, seed=29)
    own = (p >= 0.005) | (q >= 0.005)
    in_cover = torch.zeros_like(own)
    in_cover[covered] = True
    buckets = [own, ~own & in_cover, ~own & ~in_cover]
    got = torch.cat([counts[own] / trials] + [(counts[b].sum() / trials)[None] for b in buckets[1:]])
    want = torch.cat([p[own]] + [p[b].sum()[None] for b in buckets[1:]])
    return 0.5 * (got - want).abs().sum().item()


def test_sampling_keeps_the_targets_distribution_where_the_draft_covers_part_of_the_vocabulary(trained):
    """At temperature 0.8 the draft's q is zero off its covered tokens; verification still emits p."""
    target, tok, draft, _ = trained
    assert draft.coverage_size < target.config.vocab_size
    ids = torch.tensor([tok.encode("def parse(text):\n    ")])
    with torch.no_grad():
        h = target.hidden_states(ids)[0]
        p = lab.sampling.logits_to_probs(target.logits(h[-1]), 0.8, None, None)
        q = lab.sampling.logits_to_probs(draft.full_logits(draft.hidden(h[None, -2:-1], ids[:, -1:],
                                                                        torch.tensor([1])))[0, 0], 0.8, None, None)
    uncovered = torch.ones_like(p, dtype=torch.bool)
    uncovered[draft.token_ids] = False
    assert q[uncovered].sum() == 0 and p[uncovered].sum() > 0.01      # the fallback is exercised
    assert _tv(p, q, draft.token_ids, k=1, trials=20_000) <= 0.02
    assert _tv(p, q, draft.token_ids, k=3, trials=20_000) <= 0.02
    a = sp.speculative_generate(target, draft, ids, max_new_tokens=40, k=3, temperature=0.8, seed=5)
    b = sp.speculative_generate(target, draft, ids, max_new_tokens=40, k=3, temperature=0.8, seed=5)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40


def test_save_load_and_bad_input(trained, tmp_path):
    target, tok, draft, _ = trained
    draft.save_pretrained(tmp_path / "d", dtype=torch.float32)
    again = fd.FeatureDraft.from_pretrained(tmp_path / "d", target)
    assert torch.equal(again.token_ids, draft.token_ids)
    ids = torch.tensor([tok.encode("import os\n")])
    assert sp.speculative_generate(target, again, ids, max_new_tokens=24, k=3).token_ids == \
        sp.speculative_generate(target, draft, ids, max_new_tokens=24, k=3).token_ids
    other, _ = lab.load_model("target", dtype=torch.float32)
    with pytest.raises(ValueError, match="attach"):
        sp.speculative_generate(other, draft, ids, max_new_tokens=8)
    with pytest.raises(ValueError, match="distinct ids"):
        fd.FeatureDraft(target.config, torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match="distinct ids"):
        fd.FeatureDraft(target.config, torch.tensor([target.config.vocab_size]))
    with pytest.raises(ValueError, match="width"):
        fd.FeatureDraft(lab.get_preset("tiny"), torch.arange(8)).attach(target)
    with pytest.raises(RuntimeError, match="attach the target"):
        fd.FeatureDraft(target.config, torch.arange(8)).target
    with pytest.raises(ValueError, match="does not hold a feature draft"):
        fd.FeatureDraft.from_pretrained(lab.loading.resolve_model_dir("draft"))


def test_the_loss_regresses_in_the_space_asked_for_and_weighs_its_terms(trained):
    """normed=True compares the features after the target's final norm; the weights scale each term alone."""
    import torch.nn.functional as F
    target, tok, draft, _ = trained
    data = ft.build_features(target, [tok.encode("def add(a, b):\n    return a + b\n" * 3)], None, window=32,
                             progress=False)
    feats, tokens, lengths = data.features.float(), data.tokens.long(), data.lengths
    with torch.no_grad():
        guess = draft.hidden(feats[:, :-1], tokens[:, 1:], torch.arange(feats.shape[1] - 1))
        want = {normed: float(F.smooth_l1_loss(*(target.norm(t) if normed else t for t in (guess, feats[:, 1:]))))
                for normed in (False, True)}
        for normed in (False, True):
            total, stats = ft.draft_loss(draft, feats, tokens, lengths, unroll=1, normed=normed)
            assert stats["reg_1"] == pytest.approx(want[normed], rel=1e-5)
            only_cls, _ = ft.draft_loss(draft, feats, tokens, lengths, unroll=1, cls_weight=1.0, reg_weight=0.0,
                                        normed=normed)
            assert float(only_cls) == pytest.approx(stats["cls_1"], rel=1e-5)
    assert want[True] != pytest.approx(want[False], rel=0.01)     # two different spaces, not one by accident


@given(first=st.integers(0, 12), held=st.integers(0, 10), begin=st.integers(1, 25), extra=st.integers(0, 8))
def test_the_engines_catch_up_reads_the_feature_of_the_position_before(first, held, begin, extra):
    """Position j reads the held feature of position j - 1, zeros where none is held (a gap, a prefix hit)."""
    from infopt_lab.engine.spec_decode import _shifted_rows
    last = begin + extra
    features = torch.randn(held, 3)
    want = torch.stack([features[j - 1 - first] if 0 <= j - 1 - first < held else torch.zeros(3)
                        for j in range(begin, last + 1)])
    assert torch.equal(_shifted_rows(features, first, begin, last, 3), want)


def test_the_recipes_defaults_remake_the_bundled_draft():
    """`python scripts/train_feature_draft.py --out DIR`, as the README gives it, is the command on the card."""
    import importlib.util
    import json
    import shlex
    from pathlib import Path

    from infopt_lab.loading import ASSETS
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_feature_draft.py"
    spec = importlib.util.spec_from_file_location("train_feature_draft", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = module.build_parser()
    card = json.loads((ASSETS / fd.BUNDLED_NAME / "config.json").read_text())
    bundled = vars(parser.parse_args(shlex.split(card["command"])[2:]))
    defaults = vars(parser.parse_args(["--out", bundled["out"]]))
    assert defaults == bundled


def test_the_bench_times_both_layouts_in_one_run_and_the_layout_keeps_the_logits():
    """The feature-draft bench's row-major rows: the copy computes what the column-major model does (to fp32
    rounding), and `paired_pass_costs` gives each model's pass at every n from one interleaved run."""
    import copy

    from infopt_lab.bench.feature_draft import paired_pass_costs
    from infopt_lab.lowering import lay_out_for
    from infopt_lab.model import weight_layout
    target, _ = lab.load_model("target", dtype=torch.float32)
    row = copy.deepcopy(target)
    lay_out_for(row, "reduction")
    assert weight_layout(row) == "row"
    ids = torch.randint(0, target.config.vocab_size, (1, 9))
    torch.testing.assert_close(row(ids), target(ids), rtol=1e-4, atol=1e-4)
    a, b = paired_pass_costs(target, row, new_tokens=(1, 3), prefix=16, repeats=3)
    assert list(a) == list(b) == [1, 3]
    assert all(0 < s < 10 for s in (*a.values(), *b.values()))


@pytest.mark.parametrize("scheme, group_size", [("int8", None), ("int4", 32)])
def test_a_quantized_draft_proposes_for_the_target_and_leaves_the_float_draft_alone(trained, scheme, group_size):
    """`draft.quantized()` rounds the draft's own layers and its covered head: proposals may move, the tokens are
    still the target's (greedy, stop tokens, inside the engine), and the float draft is untouched."""
    from infopt_lab.quantize import QuantLinear
    target, tok, draft, _ = trained
    h = torch.randn(2, 5, target.config.dim)
    with torch.no_grad():
        before = draft.covered_logits(h)
    q = draft.quantized(scheme, group_size)
    assert q.quantization == (scheme, group_size) and draft.quantization is None
    assert isinstance(q.head, QuantLinear) and isinstance(q.fc, QuantLinear) and not isinstance(draft.fc, QuantLinear)
    assert q.num_parameters() == draft.num_parameters()
    with torch.no_grad():
        assert torch.equal(draft.covered_logits(h), before)
        err = (q.covered_logits(h) - before).abs().max() / before.abs().max()
    assert 0 < err < (0.05 if scheme == "int8" else 0.2), err
    newline = tok.encode("\n", add_special_tokens=False)
    accepted = {}
    for prompt in heldout_prompts(tok, 3 if scheme == "int8" else 1, seed=29):
        ids = torch.tensor([tok.encode(prompt)])
        for stops in ((), newline):
            want = lab.generate(target, tok, prompt, max_new_tokens=40, stop_token_ids=stops).token_ids
            for d in (draft, q):
                out = sp.speculative_generate(target, d, ids, max_new_tokens=40, k=3, stop_token_ids=stops)
                assert out.token_ids == want, (prompt, stops)
                accepted.setdefault(d is q, []).extend(out.rounds)
    rate = {quantized: sp.SpeculativeOutput([], 3, r, 0, 0, 1.0).acceptance_rate for quantized, r in accepted.items()}
    assert rate[True] > 0.5 * rate[False] > 0                      # rounding moves proposals, not the draft away
    with pytest.raises(ValueError, match="already quantized"):
        q.quantized()
    with pytest.raises(ValueError, match="quantize it after loading"):
        q.save_pretrained("unused")
    if scheme == "int4":
        return
    prompts = heldout_prompts(tok, 4, seed=31)
    plain = lab.Engine(target, tok, max_batch_size=4).generate(prompts, max_new_tokens=24)
    engine = lab.Engine(target, tok, max_batch_size=4, draft=q, num_speculative_tokens=3)
    assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=24)] == [o.token_ids for o in plain]
    assert engine.stats.accepted_tokens > 0
    with pytest.raises(ValueError, match="scheme"):
        draft.quantized("int3")


def test_the_interleaved_check_times_the_fastest_row_of_each_kind_prompt_by_prompt():
    """The bench's last word on speed: the target alone (eager, compiled) and the fastest eager, row-major and
    compiled rows, each decoding prompt i beside the others before prompt i + 1 comes."""
    import time

    from infopt_lab.bench.feature_draft import interleaved_rows
    from infopt_lab.bench.result import Result
    rows = {"feature k=2": 1.2, "feature int8 k=2": 1.3, "distilled k=3": 2.0, "feature k=2, row-major": 1.1,
            "feature int8 k=2, compiled": 1.5, "feature k=3, compiled": 1.4}
    rows = {label: {"measured": x} for label, x in rows.items()}
    calls = []

    def runner(label):
        return lambda i: lambda: (calls.append((label, i)), time.sleep(1e-4))

    runners = {label: runner(label) for label in ["target alone", "target alone, compiled", *rows]}
    ratios = interleaved_rows(Result("check"), runners, rows, n_prompts=3, repeats=2)
    assert list(ratios) == ["target alone", "target alone, compiled", "feature int8 k=2", "feature k=2, row-major",
                            "feature int8 k=2, compiled"]
    assert ratios["target alone"] == 1.0 and all(x > 0 for x in ratios.values())
    assert len(calls) == 2 * 3 * len(ratios)
    assert [i for _, i in calls[:3 * len(ratios)]] == [i for i in range(3) for _ in ratios]


def test_the_engine_ratio_runs_both_engines_in_turn_and_keeps_each_ones_fastest_run(trained, monkeypatch):
    """`engine_ratios`: the engine without speculation and the one with it alternate, `repeats` runs each, and the
    ratio is of their fastest runs; the tokens are compared and the acceptance read from the speculating engine."""
    from infopt_lab.bench import feature_draft as fdb
    from infopt_lab.engine import Engine
    target, tok, draft, _ = trained
    order = []
    real = Engine.generate

    def logged(self, prompts, **kw):
        if kw.get("max_new_tokens") != 4:                               # not the warm-up
            order.append("feature" if self.speculator is not None else "plain")
        return real(self, prompts, **kw)

    monkeypatch.setattr(Engine, "generate", logged)
    out = fdb.engine_ratios(target, tok, draft, heldout_prompts(tok, 3, seed=29), 3, 16, batch_sizes=(1, 2),
                            repeats=2)
    assert order == ["plain", "feature"] * 4
    for e in out.values():
        assert e["ratio"] == pytest.approx(e["feature_tok_s"] / e["plain_tok_s"])
        assert e["same_tokens"] and 0 < e["draft_yield"] <= 1


def test_the_engine_ratio_refuses_a_repeat_count_below_one(trained):
    from infopt_lab.bench import feature_draft as fdb
    target, tok, draft, _ = trained
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        fdb.engine_ratios(target, tok, draft, ["def f():"], 2, 4, batch_sizes=(1,), repeats=0)
