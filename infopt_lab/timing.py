"""Measurement: timers, medians of repeated and interleaved runs, the bandwidth probe, the roofline.

Every helper takes a `clock` (seconds, `time.perf_counter` by default) so a test can
drive it with a fake clock and check exactly what was timed. Timers wait for the
GPU on both sides of the timed work (`device.synchronize`), so a CUDA kernel
launched inside the block is counted to its end, not to its launch.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import torch

from . import validate
from .costs import Roofline
from .device import default_dtype, get_device, synchronize

Clock = Callable[[], float]
K = TypeVar("K", bound=Hashable)


class Timer:
    """`with Timer() as t: ...` then `t.seconds`; waits for the GPU on entry and exit."""

    def __init__(self, device: torch.device | str | None = None, clock: Clock = time.perf_counter):
        self.device = device
        self.clock = clock
        self.seconds = float("nan")

    def __enter__(self) -> "Timer":
        """Wait for the device, then start the clock."""
        synchronize(self.device)
        self._start = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        """Wait for the device, then read the clock: `seconds` is the time in between."""
        synchronize(self.device)
        self.seconds = self.clock() - self._start


def median(values: Sequence[float]) -> float:
    """The median of a non-empty list of timings (the mean of the middle two for an even count)."""
    if len(values) == 0:
        raise ValueError("the median of an empty list is undefined")
    return float(statistics.median(values))


def time_runs(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
              device: torch.device | str | None = None, clock: Clock = time.perf_counter) -> list[float]:
    """Seconds of each of `repeats` timed runs of `fn()`, after `warmup` untimed runs."""
    repeats, warmup = validate.integer("repeats", repeats, low=1), validate.integer("warmup", warmup, low=0)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Timer(device, clock) as t:
            fn()
        times.append(t.seconds)
    return times


def time_fn(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
            device: torch.device | str | None = None, clock: Clock = time.perf_counter) -> float:
    """Median seconds of `fn()` over `repeats` runs, after `warmup` untimed runs."""
    return median(time_runs(fn, repeats, warmup, device, clock))


def interleaved_runs(fns: Mapping[K, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                     device: torch.device | str | None = None,
                     clock: Clock = time.perf_counter) -> dict[K, list[float]]:
    """Seconds of each contender's runs, taken in turn (a, b, a, b, ...) after `warmup` untimed rounds.

    Alternating the contenders means a machine whose speed drifts (turbo, thermal
    throttling, a neighbour process) slows all of them alike, so their ratio holds.
    """
    repeats, warmup = validate.integer("repeats", repeats, low=1), validate.integer("warmup", warmup, low=0)
    if not fns:
        raise ValueError("fns is empty: give at least one contender to time")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[K, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with Timer(device, clock) as t:
                fn()
            times[name].append(t.seconds)
    return times


def time_interleaved(fns: Mapping[K, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                     device: torch.device | str | None = None, clock: Clock = time.perf_counter) -> dict[K, float]:
    """Median seconds of each contender, the contenders run in turn (see `interleaved_runs`)."""
    return {name: median(runs) for name, runs in interleaved_runs(fns, repeats, warmup, device, clock).items()}


def fastest(fn: Callable[[], tuple[float, object]], repeats: int) -> tuple[float, object]:
    """`fn() -> (seconds, payload)`, run `repeats` times; the run with the fewest seconds."""
    repeats = validate.integer("repeats", repeats, low=1)
    return min((fn() for _ in range(repeats)), key=lambda r: r[0])


# -- the device: memory bandwidth and compute peak -------------------------------------------
def measure_bandwidth_gbs(size_mb: int = 256, repeats: int = 5, device: torch.device | str | None = None,
                          clock: Clock = time.perf_counter) -> float:
    """Measured memory bandwidth in GB/s (1e9 bytes/s): a large tensor copy reads and writes it."""
    device = torch.device(device) if device is not None else get_device()
    n = validate.integer("size_mb", size_mb, low=1) * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), repeats=repeats, warmup=2, device=device, clock=clock)
    return 2 * n * 4 / seconds / 1e9


def measure_matmul_flops(n: int | None = None, dtype: torch.dtype | None = None,
                         device: torch.device | str | None = None, repeats: int = 5,
                         clock: Clock = time.perf_counter) -> float:
    """Measured FLOP/s of a square n x n matrix product: the device's practical compute peak."""
    device = torch.device(device) if device is not None else get_device()
    dtype = dtype or default_dtype(device)
    n = validate.integer("n", n, low=1, allow_none=True) or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = time_fn(lambda: a @ b, repeats=repeats, warmup=2, device=device, clock=clock)
    return 2 * n ** 3 / seconds


def measure_roofline(device: torch.device | str | None = None, n: int | None = None, size_mb: int = 256,
                     clock: Clock = time.perf_counter) -> Roofline:
    """Peak FLOP/s from an n x n matrix product and bandwidth from a copy of size_mb MiB, on this device."""
    return Roofline(peak_flops=measure_matmul_flops(n, device=device, clock=clock),
                    bandwidth=measure_bandwidth_gbs(size_mb, device=device, clock=clock) * 1e9)


def matvec_bandwidth_gbs(model, repeats: int = 5) -> float:
    """GB/s at which one vector times the model's largest weight streams that weight (its layout as loaded)."""
    from torch import nn
    w = max((m.weight for m in model.modules() if isinstance(m, nn.Linear)), key=lambda t: t.numel())
    x = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
    with torch.no_grad():
        seconds = time_fn(lambda: torch.nn.functional.linear(x, w), repeats=repeats, warmup=2, device=w.device)
    return w.numel() * w.element_size() / seconds / 1e9


def bf16_supported() -> bool:
    """Whether this CPU has native bf16 dot products (AVX-512 BF16 or AMX); elsewhere bf16 matmuls crawl."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# -- the cost model's passes, timed on a real model ----------------------------------------------
def _random_ids(model, batch_size: int, length: int, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids [B, T] on the model's device."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (batch_size, length), generator=g)
    return ids.to(next(model.parameters()).device)                   # (B, T)


@torch.inference_mode()
def time_prefill(model, prompt_len: int, batch_size: int = 1, repeats: int = 3,
                 clock: Clock = time.perf_counter) -> float:
    """Median seconds of one prefill of `prompt_len` random tokens per sequence, cache included."""
    from .generate import prefill
    from .kv_cache import KVCache
    batch_size = validate.integer("batch_size", batch_size, low=1)
    prompt_len = validate.integer("prompt_len", prompt_len, low=1)
    ids = _random_ids(model, batch_size, prompt_len)
    cache = KVCache.for_model(model, batch_size, prompt_len)
    return time_fn(lambda: prefill(model, ids, cache), repeats=repeats, warmup=1, device=ids.device, clock=clock)


@torch.inference_mode()
def time_decode_step(model, batch_size: int = 1, context_len: int = 32, steps: int = 16,
                     repeats: int = 3, clock: Clock = time.perf_counter) -> float:
    """Median seconds of one decode step (batch_size new tokens) after `context_len` cached positions."""
    from .generate import decode_one_token, prefill
    from .kv_cache import KVCache
    batch_size = validate.integer("batch_size", batch_size, low=1)
    context_len = validate.integer("context_len", context_len, low=1)
    steps = validate.integer("steps", steps, low=1)
    ids = _random_ids(model, batch_size, context_len)
    cache = KVCache.for_model(model, batch_size, context_len + steps)
    token = prefill(model, ids, cache).argmax(-1, keepdim=True)                      # (B, 1)

    def run_steps():
        for i in range(steps):    # the same positions every repeat: the cache is overwritten in place
            decode_one_token(model, token, context_len + i, cache)

    return time_fn(run_steps, repeats=repeats, warmup=1, device=ids.device, clock=clock) / steps


@torch.inference_mode()
def time_cached_passes(model, sizes: Sequence[int] = (1, 2, 3, 5, 9), context_len: int = 64,
                       repeats: int = 5, clock: Clock = time.perf_counter) -> dict[int, float]:
    """Median seconds of one cached forward pass over n new tokens after `context_len` cached ones, per n.

    Speculative decoding verifies k drafted tokens in one pass over k + 1: what that pass costs
    against a one-token step is what it pays. The sizes run in turn, so drift hits them alike.
    """
    from .generate import prefill
    from .kv_cache import KVCache
    sizes = validate.integers("sizes", sizes, low=1)
    context_len = validate.integer("context_len", context_len, low=1)
    ids = _random_ids(model, 1, context_len + max(sizes))
    cache = KVCache.for_model(model, 1, context_len + max(sizes))
    prefill(model, ids[:, :context_len], cache)

    def run(n):            # the same positions every time: the cache is overwritten in place
        return lambda: model(ids[:, context_len:context_len + n],
                             torch.arange(context_len, context_len + n, device=ids.device), cache)

    return time_interleaved({n: run(n) for n in sizes}, repeats=repeats, warmup=1, device=ids.device, clock=clock)
