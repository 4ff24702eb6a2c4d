"""Does an optimized model still behave? Perplexity and bits per byte, greedy agreement, code that parses.

Perplexity and bits per byte (`evaluate`, `lab.perplexity`, `lab.bits_per_byte`) say
how well a model predicts held-out text; both come from one pass over the split,
which is tokenized once per tokenizer. The other checks look at what it writes:
the share of prompts whose first tokens match the unoptimized model's greedy
tokens exactly, and the share of completed function bodies that Python still
accepts (`ast.parse`).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import data, validate
from .generate import generate_tokens
from .kv_cache import KVCache
from .sampling import SamplingParams

# Function headers in the style of the standard library; each ends at the line's end (no newline),
# because the tokenizer joins a newline with the indent that follows it.
PROMPTS: tuple[str, ...] = (
    "def fib(n):", "def read_lines(path):", "def is_prime(n):", "def __repr__(self):",
    "def flatten(items):", "def parse_args(argv=None):", "def main():", "def __init__(self, name, value=None):",
    "def get(self, key, default=None):", "def close(self):", "def copy_file(src, dst):",
    "def count_words(text):", "def join_path(*parts):", "def __eq__(self, other):",
    "def to_bytes(s, encoding='utf-8'):", "def _check_type(value, expected):",
)


def greedy_ids(model, tok, prompt: str, max_new_tokens: int,
               cache_factory: Callable = KVCache.for_model) -> list[int]:
    """Greedy tokens after `prompt` (BOS first), decoded with the cache `cache_factory(model, 1, len)` builds."""
    device = next(model.parameters()).device
    ids = torch.tensor([tok.encode(prompt)], device=device)      # (1, T)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_at_eos=False)
    return [int(t) for t in generate_tokens(model, ids, params, cache_factory=cache_factory)]


def exact_match(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]], n: int = 32) -> float:
    """Share of prompts whose first n candidate tokens equal the reference's first n."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError(f"need equally many non-empty token lists, got {len(reference)} and {len(candidate)}")
    return sum(list(r[:n]) == list(c[:n]) for r, c in zip(reference, candidate)) / len(reference)


def matched_prefix(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> float:
    """Mean number of leading tokens the candidate shares with the reference, before the first difference."""
    def prefix(r, c):
        n = 0
        while n < min(len(r), len(c)) and r[n] == c[n]:
            n += 1
        return n
    return sum(prefix(r, c) for r, c in zip(reference, candidate)) / max(len(reference), 1)


def function_source(prompt: str, completion: str) -> str:
    """The prompt's function as completed: whole lines only, up to the first line back at column 0."""
    lines = (prompt + completion).split("\n")
    if not completion.endswith("\n"):
        lines = lines[:-1] if len(lines) > 1 else lines          # drop a line cut off mid-way
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            break                                                # the function has ended
        body.append(line)
    return "\n".join(body) + "\n"


def parses(source: str) -> bool:
    """Whether Python accepts `source` (ast.parse)."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def parse_rate(prompts: Sequence[str], completions: Sequence[str]) -> float:
    """Share of completed functions that parse as Python."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need equally many prompts and completions, got {len(prompts)} and {len(completions)}")
    return sum(parses(function_source(p, c)) for p, c in zip(prompts, completions)) / len(prompts)


def quality_report(model, tok, reference_ids: Sequence[Sequence[int]] | None = None,
                   prompts: Sequence[str] = PROMPTS, max_new_tokens: int = 64, n_match: int = 32,
                   cache_factory: Callable = KVCache.for_model) -> dict[str, float | list]:
    """Greedy completions of `prompts`, their parse rate, and exact-match vs `reference_ids` when given."""
    ids = [greedy_ids(model, tok, p, max_new_tokens, cache_factory) for p in prompts]
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
    report: dict[str, float | list] = {"token_ids": ids, "texts": texts, "parse_rate": parse_rate(prompts, texts)}
    if reference_ids is not None:
        report["exact_match"] = exact_match(reference_ids, ids, n_match)
        report["matched_prefix"] = matched_prefix(reference_ids, ids)
    return report


# -- perplexity and bits per byte over a split of the corpus --------------------------------------
class _ByContent:
    """A tokenizer as a cache key: equal when the tokenizers are, so the bundled target and draft share one entry."""

    def __init__(self, tok):
        self.tok = tok
        backend = getattr(tok, "backend_tokenizer", tok)
        self.digest = hashlib.sha256(backend.to_str().encode()).hexdigest()

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, _ByContent) and self.digest == other.digest


@functools.lru_cache(maxsize=8)
def _tokenize_split(key: _ByContent, split: str) -> tuple[np.ndarray, torch.Tensor]:
    """The split's tokens (read-only) and the tokenizer's byte length per token id, computed once per key."""
    tokens, _ = data.encode_split(key.tok, split)
    tokens.flags.writeable = False                     # shared by every caller: nobody may edit it in place
    return tokens, data.token_byte_lengths(key.tok)


def split_tokens(tok, split: str = "val") -> tuple[np.ndarray, torch.Tensor]:
    """A split as one token stream ([N], read-only) and UTF-8 bytes per token id ([V]); tokenized once per tokenizer."""
    return _tokenize_split(_ByContent(tok), split)


@torch.no_grad()
def score_windows(model, windows: torch.Tensor, byte_lengths: torch.Tensor,
                  batch_size: int = 8) -> tuple[float, int, int]:
    """Summed next-token loss (nats), tokens scored and bytes they stand for, over windows [N, T + 1]."""
    device = next(model.parameters()).device
    nats, n_tok, n_bytes = 0.0, 0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size].to(device)                            # (B, T + 1)
        logits = model(w[:, :-1]).float()                                    # (B, T, V)
        nats += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        n_tok += w[:, 1:].numel()
        n_bytes += int(byte_lengths[w[:, 1:].cpu()].sum())
    return nats, n_tok, n_bytes


@dataclass(frozen=True)
class Evaluation:
    """A model scored on a split: perplexity per token, bits per byte of text, and what was scored."""

    perplexity: float     # exp(mean next-token loss)
    bits_per_byte: float  # summed loss in bits over the UTF-8 bytes of the scored tokens
    n_tokens: int         # tokens scored
    n_bytes: int          # bytes of text they stand for


def evaluate(model, tok, split: str = "val", seq_len: int | None = None,
             max_tokens: int | None = None) -> Evaluation:
    """Perplexity and bits per byte over a split, in one pass of windows of seq_len tokens (512 by default)."""
    validate.model("model", model)
    validate.choice("split", split, ("train", "val"))
    context = model.config.max_seq_len
    seq_len = min(512, context) if seq_len is None else validate.integer("seq_len", seq_len, low=1, high=context)
    max_tokens = validate.integer("max_tokens", max_tokens, low=1, allow_none=True)
    tokens, byte_lengths = split_tokens(tok, split)
    if max_tokens is not None:
        tokens = tokens[:max_tokens + 1]
    windows = data.eval_windows(tokens, seq_len)                             # (N, T + 1)
    if len(windows) == 0:
        raise ValueError(f"no window of seq_len={seq_len} tokens fits in the {len(tokens)} tokens scored: "
                         f"give max_tokens >= seq_len (or a smaller seq_len)")
    nats, n_tok, n_bytes = score_windows(model, windows, byte_lengths)
    return Evaluation(perplexity=math.exp(nats / n_tok), bits_per_byte=nats / math.log(2) / n_bytes,
                      n_tokens=n_tok, n_bytes=n_bytes)


def perplexity(model, tok, split: str = "val", seq_len: int | None = None,
               max_tokens: int | None = None) -> float:
    """exp(mean next-token loss) over a split of the corpus, in windows of seq_len tokens."""
    return evaluate(model, tok, split, seq_len, max_tokens).perplexity


def bits_per_byte(model, tok, split: str = "val", seq_len: int | None = None,
                  max_tokens: int | None = None) -> float:
    """Bits the model needs per byte of text: comparable across tokenizers."""
    return evaluate(model, tok, split, seq_len, max_tokens).bits_per_byte
