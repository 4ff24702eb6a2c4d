"""Speculative decoding: a cheap drafter proposes k tokens, the target checks them all in one pass.

One round: the draft model (or a prompt lookup) proposes d_1..d_k; the target runs once over
[last token, d_1..d_k] and so gives its k + 1 next-token distributions p_0..p_k; `verify` keeps
the longest acceptable prefix and adds one token of the target's own. Every round emits between
1 and k + 1 tokens for a single target pass, and the output is the target's:

- greedy: d_i is kept while it equals argmax p_{i-1}; the first mismatch is replaced by the
  target's argmax, so the tokens are exactly the target's greedy tokens;
- sampling (Leviathan et al. 2023; Chen et al. 2023): d_i, drawn from the drafter's q, is kept
  with probability min(1, p(d_i) / q(d_i)); on rejection a token is drawn from the normalised
  max(0, p - q); if all k are kept, one more is drawn from p_k. The emitted tokens are then
  distributed exactly as if sampled from the target alone.

Both KV caches are rolled back to the accepted length simply by moving the write position:
entries past it are overwritten by the next round and never attended to.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import validate
from .device import synchronize
from .generate import Decoder, check_compile, finish_tokens
from .sampling import SamplingParams, check_request, draw, logits_to_probs, make_generator, sample, sampling_params


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Tokens emitted per target pass when each draft token is accepted with probability alpha: (1 - a^(k+1)) / (1 - a)."""
    alpha, k = validate.real("alpha", alpha, low=0, high=1), validate.speculation_length("k", k)
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Speedup over target-only decoding when a draft step costs `cost_ratio` target steps (verification ~ 1 step)."""
    cost_ratio = validate.real("cost_ratio", cost_ratio, low=0)
    return expected_tokens_per_pass(alpha, k) / (k * cost_ratio + 1)


def verify(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor,
           generator: torch.Generator | None = None,
           accept_generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The sampling acceptance rule. draft_tokens [k], draft_probs [k, V], target_probs [k + 1, V].

    Returns (emitted tokens, number of draft tokens accepted): the accepted prefix plus one
    token drawn from the residual max(0, p - q) at the first rejection, or from p_k if none.
    Tokens are drawn with `generator`; the acceptance coins with `accept_generator` when given
    (so that a draft equal to the target leaves the token draws exactly those of plain decoding).
    """
    validate.tensor("draft_tokens", draft_tokens, dims=1, dtypes=validate.TOKEN_DTYPES)
    validate.tensor("draft_probs", draft_probs, dims=2)
    validate.tensor("target_probs", target_probs, dims=2)
    k = draft_tokens.shape[0]
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1 or draft_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(f"need draft_probs [k, V] and target_probs [k + 1, V] for k={k}, got "
                         f"{tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
    validate.probabilities("draft_probs", draft_probs)
    validate.probabilities("target_probs", target_probs)
    vocab = target_probs.shape[1]
    if k and not 0 <= int(draft_tokens.min()) <= int(draft_tokens.max()) < vocab:
        raise ValueError(f"draft_tokens must be integer token ids in [0, {vocab}), got {draft_tokens.tolist()}")
    coins = generator if accept_generator is None else accept_generator
    emitted: list[int] = []
    for i in range(k):
        x = int(draft_tokens[i])
        p, q = target_probs[i, x].item(), draft_probs[i, x].item()
        u = torch.rand((), generator=coins, device=target_probs.device).item()
        if q > 0 and u < min(1.0, p / q):
            emitted.append(x)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)           # where the target wants more
        total = residual.sum()
        residual = residual / total if total > 0 else target_probs[i]
        emitted.append(int(draw(residual, generator)))
        return emitted, i
    emitted.append(int(draw(target_probs[k], generator)))
    return emitted, k


def verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance: keep draft tokens while they equal the target's argmax, then add the target's token."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return list(draft_tokens[:n]) + [target_argmax[n]], n


@dataclass
class Round:
    proposed: list[int]          # what the drafter proposed
    accepted: int                # how many of them the target kept
    emitted: list[int]           # accepted tokens + the target's own (a correction or a bonus)


@dataclass
class SpeculativeOutput:
    token_ids: list[int]
    k: int
    rounds: list[Round] = field(repr=False)
    target_forwards: int
    draft_forwards: int
    wall_s: float
    draft_s: float = 0.0         # time spent proposing (every draft step), prefill excluded
    verify_s: float = 0.0        # time spent in the target's verification passes and the acceptance rule

    @property
    def proposed(self) -> int:
        return sum(len(r.proposed) for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """alpha: the share of draft tokens the target judged that it accepted.

        A round judges its accepted tokens and, unless all were accepted, the first rejected
        one; tokens after a rejection are never judged. This is the per-token acceptance
        probability of the formula (its maximum-likelihood estimate).
        """
        judged = sum(r.accepted + (r.accepted < len(r.proposed)) for r in self.rounds)
        return sum(r.accepted for r in self.rounds) / judged if judged else float("nan")

    @property
    def draft_yield(self) -> float:
        """Accepted draft tokens / proposed draft tokens (the work of the drafter that was kept)."""
        return sum(r.accepted for r in self.rounds) / self.proposed if self.proposed else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of rounds whose draft token i was accepted, among rounds that proposed it and reached it."""
        rates = []
        for i in range(self.k):
            reached = [r for r in self.rounds if len(r.proposed) > i and r.accepted >= i]
            rates.append(sum(r.accepted > i for r in reached) / len(reached) if reached else float("nan"))
        return rates

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per target forward pass after the prefill (1.0 for plain decoding)."""
        return sum(len(r.emitted) for r in self.rounds) / max(1, len(self.rounds))

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the end-to-end time, prefill included (metrics.py's definition)."""
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else float("nan")


def _feed(decoder: Decoder, tokens: list[int]) -> Tensor:
    """Append tokens to one sequence's cache; their logits [len(tokens), V]."""
    return decoder.feed(torch.tensor([tokens], device=decoder.device))[0]


def _check_pair(target, draft, input_ids: Tensor, params: SamplingParams, k) -> int:
    """The models (`validate.draft`), k, input_ids [1, T], and the request for both models with room for k + 1 more."""
    validate.model("target", target)
    if draft is not None:
        validate.draft(target, draft)             # the context is checked per request below, with the draft positions
    k = validate.speculation_length("k", k)
    validate.tensor("input_ids", input_ids, dims=2, dtypes=validate.TOKEN_DTYPES)
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one sequence [1, T], got shape {tuple(input_ids.shape)}")
    for model in (target, draft) if draft is not None else (target,):
        check_request(input_ids[0].tolist(), params, model.config, extra_positions=k + 1)
    return k


def _stop_ids(target, params: SamplingParams, eos_id: int | None) -> frozenset[int]:
    """The tokens that end the output: the request's stop ids and, unless `stop_at_eos=False`, the target's EOS
    (`eos_id`, else the one its config names: the token `lab.generate` and the engine stop at)."""
    return params.stop_ids(target.config.eos_token_id if eos_id is None else eos_id)


def _propose(drf: Decoder, pending: list[int], k: int, params: SamplingParams,
             generator) -> tuple[list[int], list[Tensor]]:
    """The draft's k tokens after feeding `pending`; with sampling, also the distribution each was drawn from."""
    logits = _feed(drf, pending)[-1]
    proposed, q = [], []
    for i in range(k):
        if params.greedy:
            proposed.append(int(sample(logits, params)))
        else:
            q.append(logits_to_probs(logits, params.temperature, params.top_k, params.top_p))
            proposed.append(int(draw(q[-1], generator)))
        if i < k - 1:
            logits = _feed(drf, [proposed[-1]])[-1]
    return proposed, q


def speculative_generate(target, draft, input_ids: Tensor, params: SamplingParams | None = None, k: int = 4,
                         *, eos_id: int | None = None, batch_invariant: bool = False, compile: bool = False,
                         **overrides) -> SpeculativeOutput:
    """Decode with the draft proposing k tokens per round and the target verifying them in one pass.

    `draft`: a model sharing the target's tokenizer, or a feature draft (feature_draft.py) that reads
    the target's hidden states. Keyword overrides are SamplingParams fields (`max_new_tokens=64, ...`).
    `batch_invariant=True`: the k + 1 rows of a verify pass round as k + 1 one-row passes would
    (invariant.py), so greedy output equals `generate(..., batch_invariant=True)` bit for bit in every dtype.
    `compile=True`: the target's verify passes (k + 1 tokens) and a draft model's one-token steps run
    through compiled graphs (compiled.py; one compile per shape), tokens by the rule of exactness.py.
    """
    params = sampling_params(params, **overrides)
    compile = validate.boolean("compile", compile)
    batch_invariant = validate.boolean("batch_invariant", batch_invariant)
    if compile:
        check_compile(batch_invariant)
    from .feature_draft import FeatureDraft
    if isinstance(draft, FeatureDraft):
        return _speculate_with_features(target, draft, input_ids, params, k, eos_id, batch_invariant, compile)
    k = _check_pair(target, draft, input_ids, params, k)
    prompt = input_ids[0].tolist()
    capacity = len(prompt) + params.max_new_tokens + k + 1
    tgt, drf = (Decoder(m, 1, capacity, batch_invariant=batch_invariant, compile=compile) for m in (target, draft))
    tgt.compiled_widths = {k + 1}
    generator = make_generator(params.seed, input_ids.device)
    coins = make_generator(None if params.seed is None else params.seed + 1, input_ids.device)
    stops = _stop_ids(target, params, eos_id)
    synchronize(input_ids.device)
    start = time.perf_counter()
    out, done = finish_tokens([int(sample(_feed(tgt, prompt)[-1], params, generator))], 0,  # the target's prefill
                              params.max_new_tokens, stops)                                 # gives the first token
    if len(prompt) > 1:
        _feed(drf, prompt[:-1])
    pending = [prompt[-1], out[0]]                    # tokens the draft has not seen yet
    rounds: list[Round] = []
    draft_s = verify_s = 0.0        # each phase ends by reading token ids on the host, so its time is its own
    while not done:
        t0 = time.perf_counter()
        proposed, q = _propose(drf, pending, k, params, generator)
        t1 = time.perf_counter()
        p_logits = _feed(tgt, [out[-1]] + proposed)   # one target pass: p_0..p_k, [k + 1, V]
        if params.greedy:
            emitted, accepted = verify_greedy(proposed, sample(p_logits, params).tolist())
        else:
            p = logits_to_probs(p_logits, params.temperature, params.top_k, params.top_p)
            emitted, accepted = verify(torch.tensor(proposed), torch.stack(q), p, generator, coins)
        draft_s, verify_s = draft_s + t1 - t0, verify_s + time.perf_counter() - t1
        tgt.rollback(k - accepted)                    # keep [last, d_1..d_accepted]
        if accepted < k:
            drf.rollback(k - 1 - accepted)            # the draft fed d_1..d_{k-1}; keep d_1..d_accepted
            pending = [emitted[-1]]
        else:
            pending = [proposed[-1], emitted[-1]]     # d_k and the bonus token are new to the draft
        rounds.append(Round(proposed, accepted, emitted))
        kept, done = finish_tokens(emitted, len(out), params.max_new_tokens, stops)   # generate's rule, per round
        out += kept
    synchronize(input_ids.device)
    return SpeculativeOutput(out, k, rounds, tgt.forwards, drf.forwards, time.perf_counter() - start,
                             draft_s, verify_s)


def _speculate_with_features(target, draft, input_ids: Tensor, params: SamplingParams, k: int,
                             eos_id: int | None, batch_invariant: bool, compile: bool) -> SpeculativeOutput:
    """speculative_generate with a feature draft: it proposes from the target's hidden states (feature_draft.py).

    Each verify pass also gives the target's features at the tokens it keeps; the draft forgets its own
    guessed positions and reads those instead, so every proposal starts from the target's true state.
    """
    from .feature_draft import FeatureState
    k = _check_pair(target, None, input_ids, params, k)
    validate.draft(target, draft)
    draft.bind(target)
    prompt = input_ids[0].tolist()
    capacity = len(prompt) + params.max_new_tokens + k + 1
    tgt = Decoder(target, 1, capacity, batch_invariant=batch_invariant, compile=compile)
    tgt.compiled_widths = {k + 1}
    state = FeatureState(draft, capacity)
    generator = make_generator(params.seed, input_ids.device)
    coins = make_generator(None if params.seed is None else params.seed + 1, input_ids.device)
    probs = lambda logits: logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # noqa: E731
    stops = _stop_ids(target, params, eos_id)
    synchronize(input_ids.device)
    start = time.perf_counter()
    logits, h = tgt.feed_hidden(input_ids)                                  # the prefill: features of the prompt
    out, done = finish_tokens([int(sample(logits[0, -1], params, generator))], 0, params.max_new_tokens, stops)
    state.catch_up(h[0], prompt[1:] + out)           # feature after token i, paired with token i + 1
    rounds: list[Round] = []
    draft_s = verify_s = 0.0
    while not done:
        t0 = time.perf_counter()
        proposed, q = state.propose(k, params.greedy, probs, generator)
        t1 = time.perf_counter()
        p_logits, h = tgt.feed_hidden(torch.tensor([[out[-1]] + proposed], device=input_ids.device))
        p_logits, h = p_logits[0], h[0]                                     # (k + 1, V), (k + 1, C)
        if params.greedy:
            emitted, accepted = verify_greedy(proposed, sample(p_logits, params).tolist())
        else:
            emitted, accepted = verify(torch.tensor(proposed), torch.stack(q), probs(p_logits), generator, coins)
        draft_s, verify_s = draft_s + t1 - t0, verify_s + time.perf_counter() - t1
        tgt.rollback(k - accepted)
        state.settle()                                # the draft's guesses give way to the target's features
        state.catch_up(h[:accepted + 1], emitted)
        rounds.append(Round(proposed, accepted, emitted))
        kept, done = finish_tokens(emitted, len(out), params.max_new_tokens, stops)
        out += kept
    synchronize(input_ids.device)
    return SpeculativeOutput(out, k, rounds, tgt.forwards, state.forwards, time.perf_counter() - start,
                             draft_s, verify_s)


def lookup_draft(context: list[int], k: int = 4, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup proposal: the up-to-k tokens that followed the latest earlier match of the context's last n-gram."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):     # latest earlier occurrence first
            if context[i:i + n] == tail:
                return context[i + n:i + n + k]
    return []


def prompt_lookup_generate(target, input_ids: Tensor, params: SamplingParams | None = None, k: int = 4,
                           max_ngram: int = 3, *, eos_id: int | None = None, batch_invariant: bool = False,
                           **overrides) -> SpeculativeOutput:
    """Greedy speculative decoding with no draft model: proposals are copied from earlier in the context."""
    params = sampling_params(params, **overrides)
    if not params.greedy:
        raise ValueError(f"prompt lookup decodes greedily: temperature must be 0, got {params.temperature}")
    k = _check_pair(target, None, input_ids, params, k)
    max_ngram = validate.integer("max_ngram", max_ngram, low=1)
    prompt = input_ids[0].tolist()
    tgt = Decoder(target, 1, len(prompt) + params.max_new_tokens + k + 1,
                  batch_invariant=validate.boolean("batch_invariant", batch_invariant))
    stops = _stop_ids(target, params, eos_id)
    synchronize(input_ids.device)
    start = time.perf_counter()
    out, done = finish_tokens([int(sample(_feed(tgt, prompt)[-1], params))], 0, params.max_new_tokens, stops)
    rounds: list[Round] = []
    while not done:
        proposed = lookup_draft(prompt + out, k, max_ngram)
        p_logits = _feed(tgt, [out[-1]] + proposed)
        emitted, accepted = verify_greedy(proposed, sample(p_logits, params).tolist())
        tgt.rollback(len(proposed) - accepted)
        rounds.append(Round(proposed, accepted, emitted))
        kept, done = finish_tokens(emitted, len(out), params.max_new_tokens, stops)
        out += kept
    synchronize(input_ids.device)
    return SpeculativeOutput(out, k, rounds, tgt.forwards, 0, time.perf_counter() - start)
