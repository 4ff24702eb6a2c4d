"""Speculative decoding measured side by side: pass costs, each k, prompt lookup, transformers' versions.

`infopt-lab bench --only speculative` and notebook 05 both call these, so the command line
and the notebook report the same measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .timing import Timer, fastest, time_interleaved


SPEC_PROMPTS = ("import os\n\n\ndef walk_files(root):", "class Stack:\n    def __init__(self):",
                "def parse_args(argv=None):", "    for i in range(len(items)):")
REPEAT_PROMPT = ("def area(shape):\n    if shape.kind == 'circle':\n        return 3.14159 * shape.r * shape.r\n"
                 "    if shape.kind == 'square':\n        return shape.side * shape.side\n    return 0\n\n\n"
                 "def perimeter(shape):\n    if shape.kind == 'circle':\n")


@dataclass
class SpecRun:
    name: str
    tokens: int
    seconds: float
    token_ids: list[list[int]]
    alpha: float | None = None
    tokens_per_pass: float | None = None
    rounds: int = 0                    # target verification passes (speculative runs)
    draft_s: float = 0.0               # of `seconds`: proposing, verifying (speculative_generate's split)
    verify_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@torch.inference_mode()
def pass_costs(target, draft, new_tokens=(1, 2, 3, 4, 5, 7, 9), prefix: int = 200,
               repeats: int = 60) -> tuple[dict[int, float], float]:
    """Median seconds of a target pass over n new tokens after a cached prefix, for each n, and of a draft step.

    The calls are interleaved (every n once per repeat), so a machine whose speed drifts
    affects all of them alike and their ratios stay meaningful.
    """
    device = next(target.parameters()).device
    caches = {}
    for name, model in (("target", target), ("draft", draft)):
        caches[name] = KVCache.for_model(model, 1, prefix + max(new_tokens) + 1)
        model(torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device), caches[name])

    def one_pass(model, cache, m: int):
        """A call of `model` on m new tokens after the prefix, ready to time."""
        x = torch.randint(0, 100, (1, m), device=device)                 # (1, m)
        pos = torch.arange(prefix, prefix + m, device=device)            # the same positions every run
        return lambda: model(x, pos, cache)

    passes = {n: one_pass(target, caches["target"], n) for n in new_tokens}
    passes["draft"] = one_pass(draft, caches["draft"], 1)
    med = time_interleaved(passes, repeats=repeats, warmup=1, device=device)
    return {n: med[n] for n in new_tokens}, med["draft"]


def speculative_runs(target, draft, tok, prompts, new_tokens: int = 128, ks=(1, 2, 3, 4, 6),
                     hf_pair=None, repeats: int = 2) -> dict[str, SpecRun]:
    """Target-only greedy, speculative greedy at each k, and transformers' assisted generation, same prompts."""
    from .generate import generate
    from .speculative import SpeculativeOutput, speculative_generate
    ids = [torch.tensor([tok.encode(p)], device=next(target.parameters()).device) for p in prompts]
    runs = {}

    def target_only():
        outs = [generate(target, tok, p, max_new_tokens=new_tokens, stop_at_eos=False) for p in prompts]
        return sum(o.e2e_s for o in outs), [o.token_ids for o in outs]
    secs, toks = fastest(target_only, repeats)
    runs["target"] = SpecRun("target only", len(prompts) * new_tokens, secs, toks, None, 1.0)
    for k in ks:
        def spec(k=k):
            outs = [speculative_generate(target, draft, x, max_new_tokens=new_tokens, k=k) for x in ids]
            return sum(o.wall_s for o in outs), outs
        secs, outs = fastest(spec, repeats)
        agg = SpeculativeOutput([], k, [r for o in outs for r in o.rounds], 0, 0, secs)
        runs[f"k={k}"] = SpecRun(f"speculative k={k}", len(prompts) * new_tokens, secs, [o.token_ids for o in outs],
                                 agg.acceptance_rate, agg.tokens_per_pass, len(agg.rounds),
                                 sum(o.draft_s for o in outs), sum(o.verify_s for o in outs))
    if hf_pair is not None:
        hf_target, hf_draft = hf_pair
        best = max((r for r in runs.values() if r.alpha is not None), key=lambda r: r.tokens_per_s)
        k = int(best.name.split("=")[1])
        hf_draft.generation_config.num_assistant_tokens = k
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"

        def assisted():
            """Seconds and tokens of transformers' assisted generation over every prompt."""
            toks = []
            with Timer(ids[0].device) as t:
                for x in ids:
                    with torch.no_grad():
                        out = hf_target.generate(x, attention_mask=torch.ones_like(x), assistant_model=hf_draft,
                                                 do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
                    toks.append(out[0, x.shape[1]:].tolist())
            return t.seconds, toks
        secs, toks = fastest(assisted, repeats)
        runs["transformers"] = SpecRun(f"transformers assisted k={k}", sum(map(len, toks)), secs, toks)
    return runs


def prompt_lookup_runs(target, tok, prompt: str = REPEAT_PROMPT, new_tokens: int = 128, k: int = 6,
                       hf_target=None, repeats: int = 2) -> dict[str, SpecRun]:
    """Target-only greedy vs prompt-lookup speculation (ours, and transformers' if given) on one prompt."""
    from .generate import generate
    from .speculative import prompt_lookup_generate
    x = torch.tensor([tok.encode(prompt)], device=next(target.parameters()).device)

    def target_only():
        o = generate(target, tok, prompt, max_new_tokens=new_tokens, stop_at_eos=False)
        return o.e2e_s, [o.token_ids]

    def lookup():
        o = prompt_lookup_generate(target, x, max_new_tokens=new_tokens, k=k)
        return o.wall_s, o
    runs = {"target": SpecRun("target only", new_tokens, *fastest(target_only, repeats), None, 1.0)}
    secs, o = fastest(lookup, repeats)
    runs["lookup"] = SpecRun(f"prompt lookup k={k}", new_tokens, secs, [o.token_ids], o.acceptance_rate,
                             o.tokens_per_pass)
    if hf_target is not None:
        def hf_lookup():
            """Seconds and tokens of transformers' prompt-lookup generation."""
            with Timer(x.device) as t, torch.no_grad():
                out = hf_target.generate(x, attention_mask=torch.ones_like(x), prompt_lookup_num_tokens=k,
                                         do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
            return t.seconds, [out[0, x.shape[1]:].tolist()]
        secs, toks = fastest(hf_lookup, repeats)
        runs["transformers"] = SpecRun(f"transformers prompt lookup k={k}", len(toks[0]), secs, toks)
    return runs
