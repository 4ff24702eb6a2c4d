"""What the benchmarks report: a rung's table (`Result`) and one measured run of a set of requests (`Run`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import EngineStats


@dataclass
class Result:
    """One rung of `infopt-lab bench`: labelled rows to print, and the raw figures behind them."""

    name: str
    rows: list[tuple[str, str]] = field(default_factory=list)   # (label, formatted value)
    values: dict = field(default_factory=dict)                  # raw figures, for tests and notebooks

    def add(self, label: str, value: str) -> None:
        """Append one row."""
        self.rows.append((label, value))

    def render(self) -> str:
        """The rung as aligned text under its name."""
        width = max((len(label) for label, _ in self.rows), default=0)
        lines = [f"== {self.name} =="] + [f"  {label:<{width}} : {value}" for label, value in self.rows]
        return "\n".join(lines)


@dataclass
class Run:
    """A set of requests served one way: each request's new tokens and latencies, and the run's wall time.

    `throughput_tok_s` is the run-level figure: every request's new tokens over the run's wall time.
    (A request's own `tokens_per_s`, new tokens over its end-to-end latency, is metrics.py's.)
    """

    name: str
    token_ids: list[list[int]]                              # each request's new tokens, in request order
    wall_s: float                                           # the run's wall time, first request in to last token out
    ttft_s: list[float] = field(default_factory=list)       # per request, where the server reports it
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    stats: EngineStats | None = None                        # our engine's record of the run; None elsewhere

    @property
    def new_tokens(self) -> int:
        """New tokens of all requests together."""
        return sum(map(len, self.token_ids))

    @property
    def throughput_tok_s(self) -> float:
        """Generated tokens / wall time of the run."""
        return self.new_tokens / self.wall_s


def describe_model(model_name: str, model, device) -> str:
    """'target (5.28M params, torch.float32, cpu)': a Result's model row."""
    return f"{model_name} ({model.num_parameters() / 1e6:.2f}M params, {next(model.parameters()).dtype}, {device})"
