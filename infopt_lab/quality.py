"""Does an optimized model still behave? Greedy agreement with a reference, and code that parses.

Perplexity (`lab.perplexity`) says how well a model predicts held-out text. These
two checks look at what it writes: the share of prompts whose first tokens match
the unoptimized model's greedy tokens exactly, and the share of completed
function bodies that Python still accepts (`ast.parse`).
"""
from __future__ import annotations

import ast
from collections.abc import Callable, Sequence

import torch

from .generate import decode_one_token, prefill
from .kv_cache import KVCache

# Function headers in the style of the standard library; each ends at the line's end (no newline),
# because the tokenizer joins a newline with the indent that follows it.
PROMPTS: tuple[str, ...] = (
    "def fib(n):", "def read_lines(path):", "def is_prime(n):", "def __repr__(self):",
    "def flatten(items):", "def parse_args(argv=None):", "def main():", "def __init__(self, name, value=None):",
    "def get(self, key, default=None):", "def close(self):", "def copy_file(src, dst):",
    "def count_words(text):", "def join_path(*parts):", "def __eq__(self, other):",
    "def to_bytes(s, encoding='utf-8'):", "def _check_type(value, expected):",
)


@torch.inference_mode()
def greedy_ids(model, tok, prompt: str, max_new_tokens: int,
               cache_factory: Callable = KVCache.for_model) -> list[int]:
    """Greedy tokens after `prompt` (BOS first), decoded with the cache `cache_factory(model, 1, len)` builds."""
    device = next(model.parameters()).device
    ids = torch.tensor([tok.encode(prompt)], device=device)      # (1, T)
    T = ids.shape[1]
    cache = cache_factory(model, 1, T + max_new_tokens)
    logits = prefill(model, ids, cache)                          # (1, V)
    out = []
    for i in range(max_new_tokens):
        token = logits.argmax(dim=-1)                            # (1,)
        out.append(int(token))
        if i < max_new_tokens - 1:
            logits = decode_one_token(model, token[:, None], T + i, cache)
    return out


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
