"""`GET /metrics`: the server's state and latency histograms in Prometheus' text format, under vLLM's metric names.

A dashboard built for `vllm serve` reads ours unchanged: running and waiting requests, KV cache usage,
prefix cache queries and hits (tokens), token counters, and TTFT / TPOT / end-to-end histograms
(seconds, measured by the engine from each request's arrival).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ..engine.llm_engine import LLMEngine, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)                       # vLLM's, seconds
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # vLLM's, with three below 10 ms for the bundled model
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class Histogram:
    """Counts of observations at or below each bucket's bound (cumulative when written), their sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Count one observation."""
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        """The histogram's sample lines: cumulative buckets, +Inf, sum and count."""
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        return out + [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.count}"]


@dataclass
class ServerMetrics:
    """What the server counts beside the engine's own stats; written by the engine thread only."""

    running: int = 0
    aborted: int = 0
    finished: dict[str, int] = field(default_factory=dict)     # finish reason -> requests
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def observe(self, out: RequestOutput, reason: str = "stop") -> None:
        """Count a finished request and its latencies."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += len(out.prompt_ids)
        self.generation_tokens += len(out.token_ids)
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
            self.e2e.observe(out.e2e_s)
            if len(out.token_ids) > 1:
                self.tpot.observe(out.tpot_s)

    def render(self, engine: LLMEngine, model_name: str, num_waiting: int) -> str:
        """Every metric in Prometheus' text exposition format (version 0.0.4)."""
        labels = f'model_name="{model_name}"'
        stats, blocks = engine.stats, engine.blocks
        gauges = [("vllm:num_requests_running", "Requests in the running batch.", self.running),
                  ("vllm:num_requests_waiting", "Requests waiting to be admitted.", num_waiting),
                  ("vllm:kv_cache_usage_perc", "KV cache usage, 1 means every block in use.",
                   blocks.num_used / blocks.capacity)]
        counters = [("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     stats.prefix_lookup_tokens),
                    ("vllm:prefix_cache_hits", "Of those, tokens found cached.", stats.prefix_hit_tokens),
                    ("vllm:prompt_tokens", "Prompt tokens of finished requests.", self.prompt_tokens),
                    ("vllm:generation_tokens", "Tokens generated for finished requests.", self.generation_tokens),
                    ("vllm:num_preemptions", "Requests preempted under KV pressure.", engine.scheduler.preemptions),
                    ("infopt:request_aborted", "Requests whose client hung up.", self.aborted)]
        out = []
        for name, help_, value in gauges:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {_number(value)}"]
        for name, help_, value in counters:
            out += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter", f"{name}_total{{{labels}}} {value}"]
        out += ["# HELP vllm:request_success_total Finished requests by finish reason.",
                "# TYPE vllm:request_success_total counter"]
        out += [f'vllm:request_success_total{{{labels},finished_reason="{r}"}} {n}'
                for r, n in sorted(self.finished.items())]
        for name, help_, hist in (("vllm:time_to_first_token_seconds", "Time to first token.", self.ttft),
                                  ("vllm:time_per_output_token_seconds", "Time per output token after the first.",
                                   self.tpot),
                                  ("vllm:e2e_request_latency_seconds", "End-to-end request latency.", self.e2e)):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + hist.lines(name, labels)
        return "\n".join(out) + "\n"


def _number(x: float) -> str:
    return "NaN" if isinstance(x, float) and math.isnan(x) else f"{x}"
