"""Moved to `infopt_lab.bench.engine`; its names stay importable here for notebooks 03 and 05."""
from .bench.engine import (SpecPoint, bench_engine, crossover_batch, packed_step_cost, prefix_caching_rows,
                           prefix_caching_runs, speculation_points, speculation_rows)

__all__ = ["SpecPoint", "bench_engine", "crossover_batch", "packed_step_cost", "prefix_caching_rows",
           "prefix_caching_runs", "speculation_points", "speculation_rows"]
