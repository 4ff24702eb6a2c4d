"""When "identical tokens" holds, and how close two outputs are when it does not (the rule of exactness).

Two ways of computing the same greedy output (speculative against plain decoding, a batched engine
against one request alone, cached against recomputed) multiply the same numbers over different row
counts. Where a pass over many rows rounds like one-row passes, the tokens are identical; where it
does not, a near tie between the target's two best tokens can flip one token and, with it, all
that follows. The rule this package states and tests:

- under `batch_invariant=True` (invariant.py) outputs claimed identical are identical, bit for bit,
  in every dtype;
- in the default mode, in fp32, they agree token for token except at rounding ties: a first
  divergence where the reference's top-2 logit margin is below `TIE_MARGIN`. `compare` finds each
  first divergence, measures the margin there and reports an agreement rate;
- in bf16 and the quantized paths a many-row pass drifts by tenths of a logit (`row_count_drift`),
  so the default mode can part from the reference where the margin is well above `TIE_MARGIN`:
  there agreement is measured, never promised, and identical tokens are claimed in invariant mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import validate
from .generate import recompute
from .quantize import QuantLinear

TIE_MARGIN = 1e-4     # a first divergence whose top-2 logit margin is below this is a rounding tie


@dataclass(frozen=True)
class ExactTokens:
    """How to get identical tokens from a model on its device, and why (what a notebook prints before asserting)."""
    batch_invariant: bool     # pass this to generate / speculative_generate / Engine for identical tokens
    reason: str

    @property
    def in_default_mode(self) -> bool:
        """True where the default mode's tokens are asserted identical (fp32 on a CPU); timed runs check only then."""
        return not self.batch_invariant


def exact_tokens(model) -> ExactTokens:
    """The mode under which identical-token claims are asserted for `model`: the default on fp32 CPU, else invariant.

    fp32 on a CPU keeps the default (the fast mode the timings measure): its row-count drift is far below
    the logit gaps greedy decoding meets on almost every prompt. Everywhere else (bf16, fp16, quantized
    kernels, a GPU's fp32 with its own kernels per shape) the drift reaches tenths of a logit.
    """
    validate.model("model", model)
    p = next(model.parameters())
    quantized = any(isinstance(m, QuantLinear) for m in model.modules())
    where = f"{str(p.dtype).removeprefix('torch.')} on {p.device.type}" + (", quantized layers" if quantized else "")
    if p.dtype == torch.float32 and p.device.type == "cpu" and not quantized:
        return ExactTokens(False, f"{where}: a many-row pass differs from one-row passes only in the last bits of a "
                                  "logit (about 1e-4 at most, measured), so only a near tie could flip a token; "
                                  "identical tokens are asserted in the default mode (a failure would be such a "
                                  "tie: lab.exactness.compare shows its margin)")
    return ExactTokens(True, f"{where}: a many-row pass may round unlike one-row passes and flip a near tie, so "
                             "identical tokens are asserted with batch_invariant=True (timed runs report agreement)")


@dataclass(frozen=True)
class Divergence:
    """The first new token where an output parts from its reference, and the reference's top-2 margin there."""
    index: int          # which output
    position: int       # index of the first differing new token
    want: int | None    # the reference's token there (None: the reference ended)
    got: int | None     # the output's token there (None: the output ended)
    margin: float       # top-1 minus top-2 logit of the model at that position, each row computed alone

    @property
    def tie(self) -> bool:
        """A rounding tie under the rule: both outputs go on there, and the two best logits nearly coincide."""
        return self.want is not None and self.got is not None and self.margin < TIE_MARGIN

    def describe(self, tok=None) -> str:
        """One line: where, which tokens, the margin, and whether that is a tie."""
        name = (lambda t: "end" if t is None else repr(tok.decode([t])) if tok is not None else str(t))
        kind = "a rounding tie" if self.tie else "NOT a tie"
        return (f"output {self.index}: first divergence at new token {self.position}, {name(self.want)} -> "
                f"{name(self.got)}, top-2 margin {self.margin:.2e} ({kind})")


@dataclass
class Agreement:
    """Outputs compared with their references: how many agree exactly, and every first divergence."""
    total: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Share of outputs identical to their reference, length included."""
        return (self.total - len(self.divergences)) / self.total if self.total else 1.0

    @property
    def holds(self) -> bool:
        """The rule: every divergence is a rounding tie."""
        return all(d.tie for d in self.divergences)

    def summary(self, tok=None) -> str:
        """The agreement rate, then one line per divergence."""
        ties = sum(d.tie for d in self.divergences)
        head = (f"{self.total - len(self.divergences)}/{self.total} outputs identical ({self.rate:.0%}); "
                + (f"{len(self.divergences)} diverged, {ties} of them at rounding ties" if self.divergences
                   else "no divergence"))
        return "\n".join([head] + ["  " + d.describe(tok) for d in self.divergences])


def first_difference(want: list[int], got: list[int]) -> int | None:
    """Index of the first position where two token lists differ, length included; None if equal."""
    if want == got:
        return None
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))


def top2_margin(model, ids: list[int]) -> float:
    """Top-1 minus top-2 logit for the token after `ids`, every row computed as if alone (as one-token steps do)."""
    device = next(model.parameters()).device
    logits = recompute(model, torch.tensor([ids], device=device), batch_invariant=True)[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(model, prompts: list[list[int]], want: list[list[int]], got: list[list[int]]) -> Agreement:
    """Each output in `got` against its reference in `want` (new tokens after each prompt's ids), by the rule."""
    if not len(prompts) == len(want) == len(got):
        raise ValueError(f"prompts, want and got must have one entry each per output, got "
                         f"{len(prompts)}, {len(want)} and {len(got)}")
    result = Agreement(len(want))
    for i, (ids, w, g) in enumerate(zip(prompts, want, got)):
        at = first_difference(list(w), list(g))
        if at is None:
            continue
        margin = top2_margin(model, list(ids) + list(w[:at]))
        token = (lambda seq: seq[at] if at < len(seq) else None)
        result.divergences.append(Divergence(i, at, token(w), token(g), margin))
    return result


@torch.inference_mode()
def row_count_drift(model, ids: list[int], rows: int, batch_invariant: bool = False) -> float:
    """Largest logit difference between one pass over the last `rows` of `ids` and the same rows fed one at a time.

    Both runs first cache the same prefix; only the number of rows per pass differs, so any difference
    is rounding that depends on how many rows share a pass. Zero, bit for bit, under `batch_invariant`.
    """
    from .invariant import invariant
    from .kv_cache import KVCache
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)                                          # (1, T)
    T, p = x.shape[1], x.shape[1] - rows
    if not 0 < rows < T:
        raise ValueError(f"rows must be between 1 and {T - 1} (the prompt has {T} tokens), got {rows}")
    many_cache, one_cache = KVCache.for_model(model, 1, T), KVCache.for_model(model, 1, T)
    with invariant(batch_invariant):
        for cache in (many_cache, one_cache):
            model(x[:, :p], torch.arange(p, device=device), cache)
        many = model(x[:, p:], torch.arange(p, T, device=device), many_cache)[0]   # (rows, V), one pass
        one = torch.cat([model(x[:, i:i + 1], torch.tensor([i], device=device), one_cache)[0] for i in range(p, T)])
    return float((many.float() - one.float()).abs().max())
