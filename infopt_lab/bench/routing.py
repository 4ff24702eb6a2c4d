"""Notebook 07's agentic section: a small model routing requests to tools, the big model taking the doubtful
ones, and the runtime checking what a model writes before anything acts on it.

The task: a request describes what a function does (a docstring's first paragraph from the held-out corpus);
the answer is which of a few tools (function names) serves it. Labels are known, so accuracy is measured.

Two ways to get a tool name from a model:
- **Scoring**: each candidate's signature is followed by the request as its docstring, and the candidate
  under which the request is most probable wins. The answer is always one of the candidates: the structure
  is enforced by construction.
- **Writing**: the model is asked to write JSON, `{"tool": "<name>"}`, and the runtime parses it and checks the
  name is a candidate before acting on it; what fails the check never reaches a tool.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from time import perf_counter

import torch

from ..workloads import tool_descriptions

TOOL = re.compile(r'def (\w+)\((.*?)\):\n\s+"""(.*?)"""', re.DOTALL)


@dataclass(frozen=True)
class Request:
    """One routing request: what is wanted, the candidate tools, and the right one."""

    text: str
    tools: tuple[str, ...]          # each a signature: "name(args)"
    answer: int

    def names(self) -> tuple[str, ...]:
        return tuple(t.split("(", 1)[0] for t in self.tools)


def tool_requests(n: int = 16, candidates: int = 6, seed: int = 0) -> list[Request]:
    """n requests from held-out docstrings, each with `candidates` distinct tool names, the right one among them."""
    tools = {}
    for name, args, summary in TOOL.findall(tool_descriptions()):
        if 4 <= len(summary.split()) <= 30 and len(args) <= 60:
            tools.setdefault(f"{name}({args})", summary)          # the first docstring of a repeated signature
    if len(tools) < max(n, candidates):
        raise ValueError(f"the held-out corpus has {len(tools)} documented tools; ask for at most that many")
    rng = random.Random(seed)
    names = sorted(tools)
    requests = []
    for name in rng.sample(names, n):
        options = rng.sample([x for x in names if x != name], candidates - 1) + [name]
        rng.shuffle(options)
        requests.append(Request(tools[name], tuple(options), options.index(name)))
    return requests


@torch.inference_mode()
def score(model, tok, request: Request) -> list[float]:
    """For each candidate tool, log P(request | the tool's signature): how well the request reads as that
    function's docstring, its tokens summed; all candidates in one batched pass."""
    heads = [tok.encode(f'def {tool}:\n    """') for tool in request.tools]
    rows = [tok.encode(f'def {tool}:\n    """{request.text}"""') for tool in request.tools]
    if any(r[:len(h)] != h for r, h in zip(rows, heads)):
        raise ValueError("a request's first token merges with the docstring's quotes")
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=next(model.parameters()).device)
    logp = torch.log_softmax(model(ids).float(), dim=-1)
    return [sum(logp[i, t - 1, r[t]].item() for t in range(len(h), len(r))) for i, (r, h) in
            enumerate(zip(rows, heads))]


@dataclass
class Scored:
    """A model's scored choices over requests."""

    choices: list[int]
    margins: list[float]        # log-prob of the best candidate minus the second best
    seconds: list[float]

    def accuracy(self, requests: list[Request]) -> float:
        return sum(c == r.answer for c, r in zip(self.choices, requests)) / len(requests)


def classify(model, tok, requests: list[Request]) -> Scored:
    """Each request's highest-scoring candidate, its margin and the time it took."""
    out = Scored([], [], [])
    for r in requests:
        started = perf_counter()
        s = score(model, tok, r)
        out.seconds.append(perf_counter() - started)
        best, second = sorted(s, reverse=True)[:2]
        out.choices.append(s.index(best))
        out.margins.append(best - second)
    return out


@dataclass(frozen=True)
class Cascade:
    """The small model answers when its margin reaches `threshold`; the big model answers the rest."""

    threshold: float
    accuracy: float
    escalated: float            # share of requests the big model answered
    seconds: float              # small on every request, big on the escalated ones


def cascade(small: Scored, big: Scored, requests: list[Request], threshold: float) -> Cascade:
    keep = [m >= threshold for m in small.margins]
    final = [s if k else b for s, b, k in zip(small.choices, big.choices, keep)]
    return Cascade(threshold, sum(f == r.answer for f, r in zip(final, requests)) / len(requests),
                   1 - sum(keep) / len(keep), sum(small.seconds) + sum(b for b, k in zip(big.seconds, keep) if not k))


def checked_tool(text: str, request: Request) -> str | None:
    """The tool a model's written answer names, if it is JSON `{"tool": <a candidate>}` (first object in the
    text); None when it is not, so nothing acts on it."""
    match = re.search(r"\{.*?\}", text, re.DOTALL)
    try:
        data = json.loads(match.group(0)) if match else None
    except json.JSONDecodeError:
        return None
    name = data.get("tool") if isinstance(data, dict) else None
    return name if name in request.names() else None


def written_answers(model, tok, requests: list[Request], max_new_tokens: int = 40) -> list[str]:
    """The model asked, in its chat template, to answer with JSON naming one tool; greedy."""
    from ..generate import generate
    texts = []
    for r in requests:
        ask = (f"Tools: {', '.join(r.names())}.\nRequest: {r.text}\nWhich tool serves the request? "
               'Answer with JSON only: {"tool": "<one of the tools>"}.')
        chat = tok.apply_chat_template([{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True)
        texts.append(generate(model, tok, chat, max_new_tokens=max_new_tokens).text)
    return texts
