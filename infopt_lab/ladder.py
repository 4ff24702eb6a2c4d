"""Moved to `infopt_lab.bench.ladder` and `infopt_lab.bench.decision`; their names stay importable here for
notebook 07 and exercise 07 (`from infopt_lab import ladder`)."""
from .bench.decision import GPUS, SCENARIOS, cost_per_million_tokens, gpu_estimate, misses, recommend
from .bench.ladder import (COMMITTED, RUNG_NAMES, Fit, Rung, committed_ladder, format_ladder, ladder_command,
                           memory_interplay, plot_ladder, run_ladder, serve_one_at_a_time)

__all__ = ["GPUS", "SCENARIOS", "cost_per_million_tokens", "gpu_estimate", "misses", "recommend", "COMMITTED",
           "RUNG_NAMES", "Fit", "Rung", "committed_ladder", "format_ladder", "ladder_command", "memory_interplay",
           "plot_ladder", "run_ladder", "serve_one_at_a_time"]
