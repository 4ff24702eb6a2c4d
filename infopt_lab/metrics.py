"""What a request and a model cost: TTFT, TPOT, end-to-end latency, tokens/s, percentiles, weight memory.

Each metric is defined once, from numbers already measured; timing work is
`timing.py`'s and scoring a model on text is `quality.py`'s.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import validate

GiB = 1024 ** 3


# -- latency metrics of one request ------------------------------------------------------
@dataclass
class RequestMetrics:
    ttft_s: float         # time to first token
    tpot_s: float         # time per output token after the first
    e2e_s: float          # end-to-end latency
    n_tokens: int

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of one request: new tokens over its end-to-end latency (first token's wait included)."""
        return self.n_tokens / self.e2e_s if self.e2e_s > 0 else float("nan")


def request_metrics(start_s: float, token_times_s: Sequence[float]) -> RequestMetrics:
    """TTFT, TPOT and end-to-end latency from a request's start and its tokens' timestamps."""
    start_s = validate.real("start_s", start_s)
    t = [x - start_s for x in validate.reals("token_times_s", token_times_s)]      # a request has >= 1 token
    if any(b < a for a, b in zip(t, t[1:])) or t[0] < 0:
        raise ValueError("token timestamps must be non-decreasing and not before the start")
    tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
    return RequestMetrics(ttft_s=t[0], tpot_s=tpot, e2e_s=t[-1], n_tokens=len(t))


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{'p50': ..., 'p90': ..., 'p99': ...} of a list of latencies."""
    qs = validate.reals("qs", qs, low=0, high=100)
    if len(values) == 0:
        raise ValueError("percentiles of an empty list are undefined")
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


def throughput(n_tokens: int, seconds: float) -> float:
    """Tokens per second across all requests of a run."""
    n_tokens = validate.real("n_tokens", n_tokens, low=0)
    return n_tokens / validate.real("seconds", seconds, low=0, low_open=True)


# -- memory ---------------------------------------------------------------------------------
def weight_memory_gb(num_params: float, bytes_per_param: float) -> float:
    """Memory of the weights in GB as this course counts it: params x bytes / 1024**3."""
    num_params = validate.real("num_params", num_params, low=0)
    bytes_per_param = validate.real("bytes_per_param", bytes_per_param, low=0, low_open=True)
    return num_params * bytes_per_param / GiB


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's distinct parameter and buffer storage (a tied weight counts once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
