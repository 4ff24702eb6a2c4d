"""The driver that serves an agentic workload (`workloads.agentic_workload`) through the engine."""
from __future__ import annotations

from dataclasses import dataclass

from .. import validate
from ..metrics import percentiles
from ..sampling import SamplingParams, sampling_params
from ..workloads import AgenticWorkload, Session, agentic_workload  # noqa: F401  (re-exported: their old home)
from .llm_engine import Engine, EngineStats, RequestOutput


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
    validate.instance("engine", engine, Engine, "a lab.Engine")
    validate.instance("workload", workload, AgenticWorkload, "an AgenticWorkload (from agentic_workload)")
    params = sampling_params(params, max_new_tokens=workload.new_tokens)
    system = list(workload.system_ids)
    turn_of: dict[int, tuple[int, int]] = {}        # request id -> (session, turn)
    results: list[TurnResult] = []

    def add(session: int, turn: int, prompt: list[int], arrival_s: float) -> None:
        turn_of[engine.add_request(prompt, params, arrival_s)] = (session, turn)

    def first_turns() -> None:
        for i, s in enumerate(workload.sessions):
            add(i, 0, system + list(s.user_ids[0]), s.start_s)

    def next_turn(out: RequestOutput) -> None:
        i, t = turn_of[out.request_id]
        results.append(TurnResult(i, t, out.request_id, len(out.prompt_ids), out))
        user = workload.sessions[i].user_ids
        if out.ok and t + 1 < len(user):             # the agent answers at once: no think time
            add(i, t + 1, out.prompt_ids + out.token_ids + list(user[t + 1]), engine.now())

    engine.serve(first_turns, next_turn, total=workload.total_turns, progress=progress)
    results.sort(key=lambda r: (r.session, r.turn))
    return SessionRun(results, engine.stats)
