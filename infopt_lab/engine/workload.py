"""An agentic serving workload, fixed before measuring, and the driver that serves it through the engine.

Many agent sessions run at once; each re-sends one long shared system prompt (a coding agent's
instructions and tool descriptions) and talks for a few turns. Turn t + 1 is the whole conversation so
far plus a new user message, so every prompt repeats a prefix the engine has already computed: the
workload that prefix caching is measured on. Sessions start at Poisson arrivals; everything is seeded.
"""
from __future__ import annotations

import ast
import functools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from .. import validate
from ..batching import poisson_arrivals
from ..metrics import percentiles
from ..sampling import SamplingParams, sampling_params
from .llm_engine import Engine, EngineStats, RequestOutput, _progress

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
    system_ids = tok.encode(INSTRUCTIONS + _tool_descriptions())
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
    allowed = f"a pair (lo, hi) with 1 <= lo <= hi <= {most}"
    if isinstance(user_tokens, (str, bytes)) or not isinstance(user_tokens, Seq) or len(user_tokens) != 2:
        raise ValueError(f"user_tokens must be {allowed}, got {user_tokens!r}")
    lo = validate.integer("user_tokens[0]", user_tokens[0], low=1, high=most)
    hi = validate.integer("user_tokens[1]", user_tokens[1], low=1, high=most)
    if lo > hi:
        raise ValueError(f"user_tokens must be {allowed}, got {user_tokens!r}")
    return lo, hi


@functools.lru_cache(maxsize=1)
def _held_out() -> tuple[str, ...]:
    """The held-out corpus files, read once per process."""
    from ..data import read_texts
    return tuple(read_texts("val"))


@functools.lru_cache(maxsize=1)
def _tool_descriptions() -> str:
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


@dataclass
class TurnResult:
    """One served (or refused) turn of a session."""

    session: int
    turn: int
    request_id: int
    prompt_len: int                         # tokens: system prompt + the conversation so far
    output: RequestOutput


@dataclass
class SessionRun:
    """What `run_sessions` returns: every turn, in (session, turn) order, and the engine's stats of the run."""

    turns: list[TurnResult]
    stats: EngineStats

    @property
    def served(self) -> list[TurnResult]:
        """The turns the engine completed (refused ones left out)."""
        return [t for t in self.turns if t.output.ok]

    def ttft_s(self) -> list[float]:
        """Time to first token of every served turn, from its arrival."""
        return [t.output.ttft_s for t in self.served]

    def throughput_tok_s(self) -> float:
        """Generated tokens per second of the run's wall time."""
        return self.stats.throughput_tok_s

    def summary(self) -> str:
        """One line: turns served, TTFT p50 / p99, throughput."""
        ttft = self.ttft_s()
        p = percentiles(ttft, (50, 99)) if ttft else {"p50": float("nan"), "p99": float("nan")}
        return (f"{len(self.served)}/{len(self.turns)} turns served, TTFT p50 {p['p50'] * 1e3:.1f} ms, "
                f"p99 {p['p99'] * 1e3:.1f} ms, {self.throughput_tok_s():.1f} tok/s "
                f"({self.stats.generated_tokens} tokens in {self.stats.wall_s:.2f} s)")


def run_sessions(engine: Engine, workload: AgenticWorkload, params: SamplingParams | None = None,
                 progress: bool = False) -> SessionRun:
    """Serve every session's turns; turn t + 1 arrives as turn t finishes, its prompt the conversation so far.

    `params` sets how tokens are picked (greedy by default); every turn asks for `workload.new_tokens`.
    A refused turn ends its session. The engine must hold no unfinished request; it is reset first.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a lab.Engine, got {type(engine).__name__}")
    if not isinstance(workload, AgenticWorkload):
        raise TypeError(f"workload must be an AgenticWorkload (from agentic_workload), got {type(workload).__name__}")
    params = sampling_params(params, max_new_tokens=workload.new_tokens)
    if engine.has_unfinished():
        raise ValueError(f"the engine holds {len(engine.sequences)} request(s) added with add_request that have "
                         "not finished; step() until has_unfinished() is False, or call abort_all(), first")
    engine.abort_all()
    engine.reset_clock()
    system = list(workload.system_ids)
    turn_of: dict[int, tuple[int, int]] = {}        # request id -> (session, turn)
    results: list[TurnResult] = []
    bar = _progress(workload.total_turns, progress)

    def add(session: int, turn: int, prompt: list[int], arrival_s: float) -> None:
        turn_of[engine.add_request(prompt, params, arrival_s)] = (session, turn)

    try:
        for i, s in enumerate(workload.sessions):
            add(i, 0, system + list(s.user_ids[0]), s.start_s)
        while engine.has_unfinished():
            done = engine.step()
            for out in done:
                i, t = turn_of[out.request_id]
                results.append(TurnResult(i, t, out.request_id, len(out.prompt_ids), out))
                user = workload.sessions[i].user_ids
                if out.ok and t + 1 < len(user):     # the agent answers at once: no think time
                    add(i, t + 1, out.prompt_ids + out.token_ids + list(user[t + 1]), engine.now())
            if bar is not None:
                bar.update(len(done))
            if not done and engine.scheduler.has_work and not engine.scheduler.running:
                engine.wait_for_arrival()          # idle until the next session starts: skip ahead, never sleep
    except BaseException:
        engine.abort_all()                          # leave the engine as a new one: nothing queued, no blocks held
        raise
    finally:
        if bar is not None:
            bar.close()
    results.sort(key=lambda r: (r.session, r.turn))
    return SessionRun(results, engine.stats)
