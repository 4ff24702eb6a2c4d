"""`infopt-lab bench --only exactness`: speculative output against `generate` on held-out prompts, by the rule.

The prompts are drawn, by a seed, from the corpus's validation files (code cut at line ends) and,
where the tokenizer has a chat template, from questions about held-out functions (answers that end
at the end-of-sequence token inside the window). None of them is written in the repository, so no
one tuned them. Each output is compared with `generate`'s, length included, with EOS stopping on
and off; every first divergence is shown with the target's top-2 logit margin there.
"""
from __future__ import annotations

import random

from ..device import get_device
from ..exactness import Agreement, compare, exact_tokens
from ..generate import encode_prompt, generate
from ..loading import DRAFT_OF, load_model
from ..speculative import prompt_lookup_generate, speculative_generate
from ..workloads import code_prompts, tool_descriptions
from .result import Result, describe_model

QUESTION = "What does this Python function do? Answer in one short sentence.\n\n"


def heldout_prompts(tok, n: int = 8, seed: int = 26) -> list[str]:
    """n prompts nobody wrote down: half code from validation files, half chat questions (if the tokenizer chats)."""
    chats = n // 2 if getattr(tok, "chat_template", None) else 0
    prompts = code_prompts(tok, n - chats, min_tokens=16, max_tokens=48, seed=seed)
    tools = tool_descriptions().split("\n\n")
    for tool in random.Random(seed).sample(tools, chats):
        message = [{"role": "user", "content": QUESTION + tool.strip()}]
        prompts.append(tok.apply_chat_template(message, tokenize=False, add_generation_prompt=True))
    return prompts


def speculative_agreement(target, draft, tok, prompts: list[str], ks=(2, 3, 5), new_tokens: int = 64,
                          stop_at_eos: bool = True, batch_invariant: bool = False,
                          lookup: bool = True) -> dict[str, Agreement]:
    """For each k (and, with `lookup`, prompt lookup at the largest), speculative output against `generate`'s,
    by the rule."""
    ids = [encode_prompt(target, tok, p) for p in prompts]
    kw = dict(max_new_tokens=new_tokens, stop_at_eos=stop_at_eos, batch_invariant=batch_invariant)
    want = [generate(target, tok, p, **kw).token_ids for p in prompts]
    lists = [x[0].tolist() for x in ids]
    out = {}
    for k in ks:
        got = [speculative_generate(target, draft, x, k=k, **kw).token_ids for x in ids]
        out[f"k={k}"] = compare(target, lists, want, got)
    if lookup:
        got = [prompt_lookup_generate(target, x, k=max(ks), **kw).token_ids for x in ids]
        out[f"lookup k={max(ks)}"] = compare(target, lists, want, got)
    out["ended at EOS"] = sum(len(w) < new_tokens for w in want)        # how many references stopped early
    return out


def bench_exactness(model_name: str = "target", n_prompts: int = 8, new_tokens: int = 64, seed: int = 26) -> Result:
    """Speculative decoding against generate on held-out prompts, EOS stopping on and off, every divergence's margin."""
    if model_name not in DRAFT_OF:
        raise ValueError(f"no bundled draft shares {model_name!r}'s tokenizer; choose from {list(DRAFT_OF)}")
    device = get_device()
    target, tok = load_model(model_name, device=device)
    draft, _ = load_model(DRAFT_OF[model_name], device=device, dtype=next(target.parameters()).dtype)
    exact = exact_tokens(target)
    prompts = heldout_prompts(tok, n_prompts, seed)
    r = Result("exactness: speculative decoding against generate on held-out prompts, by the rule of exactness")
    r.add("model", describe_model(model_name, target, device) + f"; draft {DRAFT_OF[model_name]}")
    r.add("mode", f"default (batch_invariant=False); {exact.reason}")
    r.add("prompts", f"{len(prompts)} held-out (seed {seed}), {new_tokens} new tokens, greedy")
    for eos in (True, False):
        found = speculative_agreement(target, draft, tok, prompts, new_tokens=new_tokens, stop_at_eos=eos)
        ended = found.pop("ended at EOS")
        for name, agreement in found.items():
            r.add(f"EOS {'on ' if eos else 'off'} {name}", agreement.summary(tok).replace("\n", "\n    "))
            r.values[f"eos={eos} {name}"] = {"rate": agreement.rate, "holds": agreement.holds,
                                            "margins": [d.margin for d in agreement.divergences]}
        r.add(f"EOS {'on ' if eos else 'off'} references", f"{ended} of {len(prompts)} ended at EOS inside the window")
    return r
