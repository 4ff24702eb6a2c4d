"""The workloads the course serves, fixed before measuring: request lengths, arrivals, prompts, agent sessions.

`skewed_lengths`, `poisson_arrivals` and `code_prompts` build the batching lessons' requests; the
agentic workload below builds many multi-turn sessions (`engine.workload.run_sessions` serves them).

Many agent sessions run at once; each re-sends one long shared system prompt (a coding agent's
instructions and tool descriptions) and talks for a few turns. Turn t + 1 is the whole conversation so
far plus a new user message, so every prompt repeats a prefix the engine has already computed: the
workload that prefix caching is measured on. Sessions start at Poisson arrivals; everything is seeded.
"""
from __future__ import annotations

import ast
import functools
import random
from dataclasses import dataclass

import numpy as np

from . import validate

def skewed_lengths(n: int, short: tuple[int, int] = (8, 32), long: tuple[int, int] = (160, 256),
                   long_share: float = 0.125, seed: int = 0) -> list[int]:
    """Output lengths where most requests are short and a few are long, in a shuffled order."""
    n, long_share = validate.integer("n", n, low=0), validate.real("long_share", long_share, low=0, high=1)
    short = validate.integers("short", short, low=1, length=2)
    long = validate.integers("long", long, low=1, length=2)
    rng = random.Random(seed)
    n_long = max(1, round(n * long_share)) if n > 1 else 0
    lengths = [rng.randint(*long) for _ in range(n_long)] + [rng.randint(*short) for _ in range(n - n_long)]
    rng.shuffle(lengths)
    return lengths


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of n requests arriving at random at `rate_per_s` on average."""
    n, rate_per_s = validate.integer("n", n, low=0), validate.real("rate_per_s", rate_per_s, low=0, low_open=True)
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def code_prompts(tok, n: int, min_tokens: int = 48, max_tokens: int = 96, seed: int = 0,
                 split: str = "val") -> list[str]:
    """n prompts cut from files of one split of the corpus (validation by default) at line ends, min..max tokens."""
    from .data import read_texts
    rng = random.Random(seed)
    texts = [t for t in read_texts(split) if len(t) > 4000]
    prompts = []
    while len(prompts) < n:
        text = rng.choice(texts)
        lines = text[rng.randrange(len(text) // 2):].split("\n")[1:]
        prompt = ""
        for line in lines:
            candidate = f"{prompt}\n{line}" if prompt else line
            if len(tok.encode(candidate)) > max_tokens:
                break
            prompt = candidate
        if len(tok.encode(prompt)) >= min_tokens and prompt.strip():
            prompts.append(prompt)
    return prompts


# -- the agentic workload --------------------------------------------------------------------

INSTRUCTIONS = ("You are a coding agent working in a Python repository. Answer with code only, and call "
                "a tool by writing its name and arguments on one line. The tools you can call:\n\n")
TASKS = ("Explain what this code does:", "Find the bug in this code:", "Add type hints to this code:",
         "Write a unit test for this code:", "Refactor this code to be clearer:",
         "Give the variables in this code clearer names:")


@dataclass(frozen=True)
class Session:
    """One agent session: when its first turn arrives, and the user message of each turn."""

    start_s: float                          # arrival of the first turn, seconds after the clock starts
    user_ids: tuple[tuple[int, ...], ...]   # one user message per turn, token ids (no BOS)


@dataclass(frozen=True)
class AgenticWorkload:
    """Sessions sharing a system prompt, each a few turns of user tokens and `new_tokens` generated ones."""

    system_ids: tuple[int, ...]             # the shared system prompt, BOS first if the tokenizer adds one
    sessions: tuple[Session, ...]           # in arrival order
    new_tokens: int                         # max_new_tokens of every turn
    user_tokens: tuple[int, int]            # (lo, hi): each user message's length was drawn from [lo, hi]
    rate_per_s: float                       # mean session arrivals per second
    seed: int

    @property
    def turns(self) -> int:
        """Turns per session."""
        return len(self.sessions[0].user_ids)

    @property
    def total_turns(self) -> int:
        """Requests the workload sends when every turn is served."""
        return sum(len(s.user_ids) for s in self.sessions)

    @property
    def max_seq_tokens(self) -> int:
        """The longest conversation (last prompt + its new tokens): the context a model needs."""
        return len(self.system_ids) + max(sum(map(len, s.user_ids)) for s in self.sessions) \
            + self.turns * self.new_tokens

    def describe(self) -> str:
        """One line that states the whole workload."""
        lo, hi = self.user_tokens
        return (f"{len(self.sessions)} sessions x {self.turns} turns, system prompt {len(self.system_ids)} tokens, "
                f"user {lo}-{hi} tokens, {self.new_tokens} new tokens, Poisson arrivals at "
                f"{self.rate_per_s} sessions/s, seed {self.seed}")


def agentic_workload(tok, sessions: int = 16, turns: int = 3, system_tokens: int = 512,
                     user_tokens: tuple[int, int] = (10, 40), new_tokens: int = 32, rate_per_s: float = 2.0,
                     seed: int = 0) -> AgenticWorkload:
    """The agentic workload for `tok`: held-out code as system prompt and user turns, seeded arrivals and lengths."""
    sessions = validate.integer("sessions", sessions, low=1)
    turns = validate.integer("turns", turns, low=1)
    system_tokens = validate.integer("system_tokens", system_tokens, low=1)
    lo, hi = _user_range(user_tokens, _max_user_tokens())
    new_tokens = validate.integer("new_tokens", new_tokens, low=1)
    rate_per_s = validate.real("rate_per_s", rate_per_s, low=0, low_open=True)
    seed = validate.integer("seed", seed, low=0)
    system_ids = tok.encode(INSTRUCTIONS + tool_descriptions())
    if len(system_ids) < system_tokens:
        raise ValueError(f"system_tokens must be at most {len(system_ids)} (the tool descriptions the held-out "
                         f"corpus gives), got {system_tokens}")
    starts = poisson_arrivals(sessions, rate_per_s, seed)
    runs = []
    for i, start_s in enumerate(starts):
        rng = np.random.default_rng([seed, 1, i])    # one stream per session: session i never depends on n
        runs.append(Session(start_s, tuple(_user_turn(tok, rng, int(rng.integers(lo, hi + 1)))
                                           for _ in range(turns))))
    return AgenticWorkload(tuple(system_ids[:system_tokens]), tuple(runs), new_tokens, (lo, hi), rate_per_s, seed)


def _user_range(user_tokens, most: int) -> tuple[int, int]:
    """(lo, hi) with 1 <= lo <= hi <= most, else a clear error."""
    lo, hi = validate.integers("user_tokens", user_tokens, low=1, high=most, length=2)
    if lo > hi:
        raise ValueError(f"user_tokens must be a pair (lo, hi) with 1 <= lo <= hi <= {most}, got {user_tokens!r}")
    return lo, hi


@functools.lru_cache(maxsize=1)
def _held_out() -> tuple[str, ...]:
    """The held-out corpus files, read once per process."""
    from .data import read_texts
    return tuple(read_texts("val"))


@functools.lru_cache(maxsize=1)
def tool_descriptions() -> str:
    """Every public documented function of the held-out corpus, in file order: its signature and first paragraph."""
    tools = []
    for text in _held_out():
        defs = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(defs, key=lambda n: n.lineno):          # methods too, in source order
            doc = ast.get_docstring(node)
            if doc and not node.name.startswith("_"):
                summary = " ".join(doc.split("\n\n")[0].split())
                tools.append(f'def {node.name}({ast.unparse(node.args)}):\n    """{summary}"""\n')
    return "\n".join(tools)


def _span(n: int) -> int:
    """Characters of code to cut for an n-token user turn: far more than n tokens (code runs ~3 per token)."""
    return 16 * n + 256


def _max_user_tokens() -> int:
    """The longest user turn `_user_turn` can cut: twice its span must fit in the longest held-out file."""
    return ((max(map(len, _held_out())) - 1) // 2 - _span(0)) // 16


def _user_turn(tok, rng: np.random.Generator, n: int) -> tuple[int, ...]:
    """A request about a random slice of held-out code, n tokens long (no BOS)."""
    span = _span(n)
    texts = [t for t in _held_out() if len(t) > 2 * span]
    for _ in range(100):
        text = texts[int(rng.integers(len(texts)))]
        start = text.find("\n", int(rng.integers(len(text) - 2 * span))) + 1    # at a line start
        task = TASKS[int(rng.integers(len(TASKS)))]
        ids = tok.encode(f"\n\n{task}\n```python\n{text[start:start + span]}", add_special_tokens=False)
        if len(ids) >= n:
            return tuple(ids[:n])
    raise RuntimeError(f"no slice of the held-out corpus reached {n} tokens in 100 draws")
