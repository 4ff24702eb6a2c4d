"""Speculative decoding: greedy output is the target's, sampling preserves its distribution, the formula holds."""
import copy

import pytest
import torch

import infopt_lab as lab
from infopt_lab import speculative as sp

from draws import first_token_counts

PROMPTS = ["def fib(n):", "import os\n\n\ndef read_file(path):", "class Stack:\n    def __init__(self):",
           "    for i in range(len(items)):", "x = 1", "def main():\n    args = parse_args()", "import sys",
           "    return self._cache[key]", "try:\n    import threading", "def _check(value, name):",
           "class Error(Exception):", "    @property", "SEP = '/'", "def join(a, *p):",
           "    if not isinstance(path, str):", "from collections import deque", "    def __repr__(self):",
           "while True:", "def copyfile(src, dst):", "    raise ValueError("]


@pytest.fixture(scope="module")
def pair():
    # fp32 on every device: equality with plain greedy decoding is exact only without 16-bit rounding
    target, tok = lab.load_model("target", dtype=torch.float32)
    draft, _ = lab.load_model("draft", dtype=torch.float32)
    return target, draft, tok


def assert_every_path_gives(target, draft, ids, want, stop_at_eos, prompt):
    for k in (1, 3, 8):                                                 # one, odd, past most accepted runs
        out = sp.speculative_generate(target, draft, ids, max_new_tokens=64, k=k, stop_at_eos=stop_at_eos)
        assert out.token_ids == want, (prompt, k)
        assert out.target_forwards == len(out.rounds) + 1              # one pass per round, plus the prefill
    look = sp.prompt_lookup_generate(target, ids, max_new_tokens=64, k=4, stop_at_eos=stop_at_eos)
    assert look.token_ids == want, prompt


def test_greedy_speculative_equals_target_greedy(pair):
    """Every prompt, decoding the whole window (an end-of-sequence token is a token like any other)."""
    target, draft, tok = pair
    assert len(PROMPTS) == 20
    for prompt in PROMPTS:
        want = lab.generate(target, tok, prompt, max_new_tokens=64, stop_at_eos=False).token_ids
        assert_every_path_gives(target, draft, torch.tensor([tok.encode(prompt)], device=lab.get_device()), want,
                                False, prompt)


def test_greedy_speculative_stops_where_generate_stops(pair):
    """The prompts whose greedy answer ends inside the window: every path ends on the same token, none runs past it.

    The others would repeat the test above token for token (stopping at the end-of-sequence token changes nothing
    where there is none), so they are not run again."""
    target, draft, tok = pair
    ending = []
    for prompt in PROMPTS:
        want = lab.generate(target, tok, prompt, max_new_tokens=64, stop_at_eos=True).token_ids
        if len(want) < 64:
            assert want[-1] == tok.eos_token_id
            ending.append((prompt, want))
    assert ending                                                       # the case is exercised
    for prompt, want in ending:
        assert_every_path_gives(target, draft, torch.tensor([tok.encode(prompt)], device=lab.get_device()), want,
                                True, prompt)


def stops_by_place(run: sp.SpeculativeOutput) -> dict[str, int]:
    """A token whose first appearance in the output is an accepted draft token, and one whose first is a bonus token."""
    first, place, n = {}, {}, len(run.token_ids) - sum(len(r.emitted) for r in run.rounds)   # n: the prefill's
    for r in run.rounds:
        for i, t in enumerate(r.emitted):
            if t not in first and t not in run.token_ids[:n]:
                first[t] = "draft" if i < r.accepted else "bonus"
            n += 1
    for t, where in first.items():
        place.setdefault(where, t)
    return place


@pytest.mark.parametrize("where", ["draft", "bonus"])
def test_a_stop_token_ends_the_output_where_generate_ends_it(pair, where):
    """A stop id that speculation meets inside an accepted draft, or as the bonus token, ends the output there."""
    target, draft, tok = pair
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)], device=lab.get_device())
        free = sp.speculative_generate(target, draft, ids, max_new_tokens=64, k=4, stop_at_eos=False)
        stop = stops_by_place(free).get(where)
        if stop is None:
            continue
        params = lab.SamplingParams(max_new_tokens=64, stop_token_ids=(stop,), stop_at_eos=False)
        want = lab.generate(target, tok, prompt, params).token_ids
        assert want[-1] == stop and len(want) < 64
        assert sp.speculative_generate(target, draft, ids, params, k=4).token_ids == want
        engine = lab.Engine(target, tok, draft=draft, num_speculative_tokens=4)
        assert engine.generate([prompt], params)[0].token_ids == want
        return
    pytest.fail(f"no prompt put a first-seen token at a {where} position")


def test_a_forced_eos_ends_speculation_like_generation(pair):
    """The target's EOS, read from its config when no eos_id is given, ends speculative output as it ends generate's."""
    target, draft, tok = pair
    assert target.config.eos_token_id == tok.eos_token_id
    forced = copy.deepcopy(target)
    prompt = PROMPTS[0]
    free = lab.generate(target, tok, prompt, max_new_tokens=40, stop_at_eos=False).token_ids
    with torch.no_grad():                    # make the target's 12th token its EOS: swap two rows of its own head
        a, b = free[11], tok.eos_token_id
        forced.lm_head.weight = torch.nn.Parameter(forced.lm_head.weight.detach().clone())   # untied if tied
        forced.lm_head.weight[[a, b]] = forced.lm_head.weight[[b, a]]
    want = lab.generate(forced, tok, prompt, max_new_tokens=40).token_ids
    assert want[-1] == tok.eos_token_id and len(want) <= 12
    ids = torch.tensor([tok.encode(prompt)], device=lab.get_device())
    for k in (1, 2, 3, 5):
        assert sp.speculative_generate(forced, draft, ids, max_new_tokens=40, k=k).token_ids == want, k
    assert sp.prompt_lookup_generate(forced, ids, max_new_tokens=40, k=3).token_ids == want


def test_tokens_per_pass_follow_the_formula(pair):
    target, draft, tok = pair
    for k in (2, 4):
        rounds = []
        for prompt in PROMPTS[:6]:
            ids = torch.tensor([tok.encode(prompt)], device=lab.get_device())
            rounds += sp.speculative_generate(target, draft, ids, max_new_tokens=96, k=k).rounds
        run = sp.SpeculativeOutput([], k, rounds, 0, 0, 1.0)
        predicted = lab.expected_tokens_per_pass(run.acceptance_rate, k)
        assert abs(run.tokens_per_pass / predicted - 1) <= 0.10, (k, run.tokens_per_pass, predicted)
        assert 0 < run.draft_yield <= run.acceptance_rate <= 1


def _tv_of_first_token(p: torch.Tensor, q: torch.Tensor, k: int, trials: int = 10_000) -> float:
    """TV distance to p of the first token verification emits when k draft tokens are drawn from q."""
    counts = first_token_counts(p, q, k, trials, seed=1234)
    return 0.5 * (counts / trials - p).abs().sum().item()


@pytest.mark.parametrize("p,q", [
    ([0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]),          # p = 0 where q > 0
    ([0.1, 0.2, 0.3, 0.4], [0.7, 0.3, 0.0, 0.0]),              # q = 0 where p > 0
    ([0.0, 0.0, 0.6, 0.4], [0.5, 0.5, 0.0, 0.0]),              # disjoint: every draft token rejected
    ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]),      # equal: every draft token accepted
])
def test_verify_samples_from_the_target_distribution(p, q):
    p, q = torch.tensor(p), torch.tensor(q)
    assert _tv_of_first_token(p, q, k=1) <= 0.02                # sampling noise alone: about 0.007 at 10,000 draws
    assert _tv_of_first_token(p, q, k=3, trials=4_000) <= 0.04   # fewer trials: a looser bound, same property


def test_sampled_speculative_run_is_seeded_and_valid(pair):
    target, draft, tok = pair
    ids = torch.tensor([tok.encode("def parse(text):")], device=lab.get_device())
    a = sp.speculative_generate(target, draft, ids, max_new_tokens=40, k=3, temperature=0.8, seed=5)
    b = sp.speculative_generate(target, draft, ids, max_new_tokens=40, k=3, temperature=0.8, seed=5)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40


def test_prompt_lookup_copies_repeated_code_and_keeps_greedy_tokens(pair):
    target, _, tok = pair
    prompt = ("def area(shape):\n    if shape.kind == 'circle':\n        return 3.14159 * shape.r * shape.r\n"
              "    if shape.kind == 'square':\n        return shape.side * shape.side\n    return 0\n\n\n"
              "def perimeter(shape):\n    if shape.kind == 'circle':\n")
    want = lab.generate(target, tok, prompt, max_new_tokens=64, stop_at_eos=False).token_ids
    ids = torch.tensor([tok.encode(prompt)], device=lab.get_device())
    out = sp.prompt_lookup_generate(target, ids, max_new_tokens=64, k=6)
    assert out.token_ids == want
    assert out.tokens_per_pass > 1.5 and out.draft_forwards == 0


def test_formula_and_lookup():
    assert lab.expected_tokens_per_pass(0.0, 4) == 1.0
    assert lab.expected_tokens_per_pass(1.0, 4) == 5.0
    assert lab.expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)
    assert sp.expected_speedup(0.8, 4, 0.0) == pytest.approx(lab.expected_tokens_per_pass(0.8, 4))
    assert sp.lookup_draft([1, 2, 3, 9, 1, 2], k=3) == [3, 9, 1]
    assert sp.lookup_draft([5, 6, 7], k=3) == []
    assert sp.verify_greedy([4, 5, 6], [4, 5, 7, 8]) == ([4, 5, 7], 2)
    assert sp.verify_greedy([4, 5], [4, 5, 9]) == ([4, 5, 9], 2)


def test_bad_input_is_refused(pair, tiny):
    target, draft, tok = pair
    ids = torch.tensor([tok.encode("x = 1")], device=lab.get_device())
    with pytest.raises(ValueError, match="k must be"):
        sp.speculative_generate(target, draft, ids, max_new_tokens=8, k=0)
    with pytest.raises(ValueError, match="temperature"):
        sp.speculative_generate(target, draft, ids, max_new_tokens=8, temperature=-0.5)
    small = lab.Transformer(lab.get_preset("tiny"))             # a 512-token vocabulary
    with pytest.raises(ValueError, match="vocabulary"):
        sp.speculative_generate(target, small, ids, max_new_tokens=8)
    with pytest.raises(ValueError, match="alpha"):
        lab.expected_tokens_per_pass(1.5, 4)
    with pytest.raises(ValueError, match="k must be"):
        lab.expected_tokens_per_pass(0.5, 0)


def test_a_run_splits_its_time_into_proposing_and_verifying(pair):
    target, draft, tok = pair
    x = torch.tensor([tok.encode("def fib(n):")])
    out = lab.speculative_generate(target, draft, x, max_new_tokens=24, k=3)
    assert out.draft_s > 0 and out.verify_s > 0
    assert out.draft_s + out.verify_s < out.wall_s                # the prefill and the bookkeeping are neither


def test_smollm2_speculation_stops_at_the_eos_generate_stops_at():
    """The real pair, fp32: on a prompt whose answer ends inside the window, every path ends where generate does."""
    target, tok = lab.load_model("smollm2-135m", dtype=torch.float32)
    draft, _ = lab.load_model("smollm2-135m-draft", dtype=torch.float32)
    prompt = "The capital of France is"                             # a short answer, then <|im_end|>
    params = lab.SamplingParams(max_new_tokens=64, temperature=0.0)
    want = lab.generate(target, tok, prompt, params).token_ids
    assert want[-1] == tok.eos_token_id and len(want) < 64          # the end-of-sequence token inside the window
    ids = torch.tensor([tok.encode(prompt)], device=lab.get_device())
    for k in (1, 2, 3):
        assert sp.speculative_generate(target, draft, ids, params, k=k).token_ids == want, k
    assert sp.prompt_lookup_generate(target, ids, params, k=3).token_ids == want
    engine = lab.Engine(target, tok, max_batch_size=2, max_model_len=256, draft=draft, num_speculative_tokens=3)
    assert engine.generate([prompt], params)[0].token_ids == want


def test_the_speculative_bench_takes_each_prompt_in_turn_and_keeps_each_prompts_fastest_run():
    from infopt_lab.bench.speculative import prompt_by_prompt
    calls, secs = [], iter([3, 1, 2, 5, 1, 4, 6, 1])

    def contender(name):
        def run(i):
            calls.append((name, i))
            return next(secs), f"{name}{i}"
        return run
    done = prompt_by_prompt({"a": contender("a"), "b": contender("b")}, 2, repeats=2)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)] * 2       # every prompt by each in turn, twice
    assert done == {"a": (1 + 2, ["a0", "a1"]), "b": (1 + 1, ["b0", "b1"])}
    with pytest.raises(ValueError, match="repeats"):
        prompt_by_prompt({"a": contender("a")}, 1, repeats=0)


def test_speculative_runs_give_the_targets_tokens_at_every_k(pair):
    from infopt_lab.bench.speculative import prompt_lookup_runs, speculative_runs
    from infopt_lab.bench.baselines import load_transformers
    target, draft, tok = pair
    hf_pair = (load_transformers("target", torch.float32, target.lm_head.weight.device),
               load_transformers("draft", torch.float32, target.lm_head.weight.device))
    runs = speculative_runs(target, draft, tok, PROMPTS[:3], new_tokens=16, ks=(2, 4), hf_pair=hf_pair, repeats=1)
    want = [lab.generate(target, tok, p, max_new_tokens=16, stop_at_eos=False).token_ids for p in PROMPTS[:3]]
    assert runs["target"].token_ids == runs["k=2"].token_ids == runs["k=4"].token_ids == want
    assert all(runs[f"k={k}"].rounds > 0 and 0 <= runs[f"k={k}"].alpha <= 1 for k in (2, 4))
    best = max((2, 4), key=lambda k: runs[f"k={k}"].throughput_tok_s)
    assert runs["transformers"].name == f"transformers assisted k={best}"
    assert runs["transformers"].token_ids == want                      # one token list per prompt, in order
    look = prompt_lookup_runs(target, tok, new_tokens=16, k=4, hf_target=hf_pair[0], repeats=1)
    assert look["lookup"].token_ids == look["target"].token_ids == look["transformers"].token_ids
