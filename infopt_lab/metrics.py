"""Measurements: timers, latency metrics, memory calculators, bandwidth, model quality."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .device import synchronize

GiB = 1024 ** 3


class Timer:
    """`with Timer() as t: ...` then `t.seconds`; waits for the GPU on entry and exit."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.seconds = float("nan")

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._start


def time_fn(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
            device: torch.device | str | None = None) -> float:
    """Median seconds of `fn()` over `repeats` runs, after `warmup` untimed runs."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Timer(device) as t:
            fn()
        times.append(t.seconds)
    return float(np.median(times))


# -- latency metrics of one request ------------------------------------------------------
@dataclass
class RequestMetrics:
    ttft_s: float         # time to first token
    tpot_s: float         # time per output token after the first
    e2e_s: float          # end-to-end latency
    n_tokens: int

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token (1 / TPOT)."""
        return 1.0 / self.tpot_s if self.tpot_s > 0 else float("nan")


def request_metrics(start_s: float, token_times_s: Sequence[float]) -> RequestMetrics:
    """TTFT, TPOT and end-to-end latency from a request's start and its tokens' timestamps."""
    if len(token_times_s) == 0:
        raise ValueError("token_times_s is empty: a request needs at least one token")
    t = [x - start_s for x in token_times_s]
    if any(b < a for a, b in zip(t, t[1:])) or t[0] < 0:
        raise ValueError("token timestamps must be non-decreasing and not before the start")
    tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
    return RequestMetrics(ttft_s=t[0], tpot_s=tpot, e2e_s=t[-1], n_tokens=len(t))


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{'p50': ..., 'p90': ..., 'p99': ...} of a list of latencies."""
    if len(values) == 0:
        raise ValueError("percentiles of an empty list are undefined")
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


def throughput(n_tokens: int, seconds: float) -> float:
    """Tokens per second across all requests of a run."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return n_tokens / seconds


# -- memory ---------------------------------------------------------------------------------
def weight_memory_gb(num_params: float, bytes_per_param: float) -> float:
    """Memory of the weights in GB as this course counts it: params x bytes / 1024**3."""
    if num_params < 0 or bytes_per_param <= 0:
        raise ValueError(f"num_params must be >= 0 and bytes_per_param > 0, got "
                         f"{num_params} and {bytes_per_param}")
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


def measure_bandwidth_gbs(size_mb: int = 256, repeats: int = 5,
                          device: torch.device | str | None = None) -> float:
    """Measured memory bandwidth in GB/s (1e9 bytes/s): a large tensor copy reads and writes it."""
    from .device import get_device
    device = torch.device(device) if device is not None else get_device()
    n = size_mb * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), repeats=repeats, warmup=2, device=device)
    return 2 * n * 4 / seconds / 1e9


# -- quality ----------------------------------------------------------------------------------
@torch.no_grad()
def score_windows(model, windows: torch.Tensor, byte_lengths: torch.Tensor,
                  batch_size: int = 8) -> tuple[float, int, int]:
    """Summed next-token loss (nats), tokens scored and bytes they stand for, over windows [N, T + 1]."""
    device = next(model.parameters()).device
    nats, n_tok, n_bytes = 0.0, 0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size].to(device)
        logits = model(w[:, :-1]).float()                                    # (B, T, V)
        nats += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        n_tok += w[:, 1:].numel()
        n_bytes += int(byte_lengths[w[:, 1:].cpu()].sum())
    return nats, n_tok, n_bytes


def _split_score(model, tok, split: str, seq_len: int | None,
                 max_tokens: int | None) -> tuple[float, int, int]:
    from . import data
    tokens, _ = data.encode_split(tok, split)
    if max_tokens is not None:
        tokens = tokens[:max_tokens + 1]
    seq_len = min(seq_len or 512, model.config.max_seq_len)
    return score_windows(model, data.eval_windows(tokens, seq_len), data.token_byte_lengths(tok))


def perplexity(model, tok, split: str = "val", seq_len: int | None = None,
               max_tokens: int | None = None) -> float:
    """exp(mean next-token loss) over a split of the corpus, in windows of seq_len tokens."""
    nats, n_tok, _ = _split_score(model, tok, split, seq_len, max_tokens)
    return math.exp(nats / n_tok)


def bits_per_byte(model, tok, split: str = "val", seq_len: int | None = None,
                  max_tokens: int | None = None) -> float:
    """Bits the model needs per byte of text: comparable across tokenizers."""
    nats, _, n_bytes = _split_score(model, tok, split, seq_len, max_tokens)
    return nats / math.log(2) / n_bytes
