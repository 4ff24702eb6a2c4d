"""How far many rows can go on this CPU: the q8 kernel's int8 product of a SmolLM2 step at 1 and at R rows,
beside the fastest this core multiplies int8 at all (scripts/q8_peak.c, built with the kernel's own flags).

At one row a decode step's products stream their weights from memory; at R rows each weight row is reused R
times from cache, so the products become bound by arithmetic. This prints, for R rows:
  - the measured product time and its multiply-adds a second;
  - the shortest time the same multiply-adds could take at the core's peak for the kernel's per-block
    instruction sequence, and at the peak of the byte products alone (no scales: not reachable by a kernel
    that keeps a scale per block of 32 activations);
  - with --step-ms (a one-row engine step's time, measured by `infopt-lab bench --only overhead`: 1000 / its
    batch-1 tokens/s), the most an engine step of R rows can give over one row, R x T(1) / T(R), with
    T(1) = p(1) + rest and T(R) >= p(R) + rest: the step's other work (`rest`, what is not these products)
    counted as if it did not grow with R at all, which only flatters the bound.
Issue 28's line "batch 8 >= 4x batch 1" asks R x T(1) / T(R) >= 4 at R = 8.

usage: python scripts/q8_batch_bound.py [--rows 8] [--rounds 7] [--step-ms MS]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from infopt_lab import cpu_q8
from infopt_lab.device import describe
from q8_kernel_ab import build, step_operands      # the SmolLM2 stack of products, and the kernel's build

HERE = Path(__file__).resolve().parent


def peaks(threads: int, tmp: Path) -> tuple[float, float, float]:
    """int8 multiply-adds a second (byte products alone), per-block steps a second, fp32 multiply-adds a second."""
    exe = tmp / "q8_peak"
    flags = [f for f in cpu_q8.C_FLAGS if f != "-fPIC"]
    subprocess.run([cpu_q8._compiler() or "cc", *flags, str(HERE / "q8_peak.c"), "-o", str(exe),
                    *cpu_q8._openmp_flags()], check=True)
    out = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout.split()
    return float(out[1]), float(out[2]), float(out[3])


def step_seconds(lib, rows: int, rounds: int) -> tuple[float, int]:
    """Best time of one pass over the step's int8 products at `rows` rows, and the multiply-adds of one row."""
    import ctypes
    P, I = ctypes.c_void_p, ctypes.c_int64
    shapes, w8, _, xs, ys = step_operands(rows)
    threads = torch.get_num_threads()
    best = float("inf")
    for _ in range(rounds + 1):                    # the first pass warms the caches and the thread pool
        start = time.perf_counter()
        for (n, k), (w, s) in zip(shapes, w8):
            lib.q8w_linear(P(xs[k].data_ptr()), I(rows), I(k), P(w.data_ptr()), P(s.data_ptr()), I(n),
                           P(ys[n].data_ptr()), threads)
        best = min(best, time.perf_counter() - start)
    return best, sum(n * k for n, k in shapes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8, help="activation rows of the batched call (default 8)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--step-ms", type=float, help="a one-row engine step's milliseconds, to bound the engine's gain")
    args = ap.parse_args()
    if args.rows < 2 or args.rounds < 1:
        ap.error("--rows must be at least 2 and --rounds at least 1")
    if args.step_ms is not None and args.step_ms <= 0:
        ap.error(f"--step-ms must be a positive number of milliseconds, got {args.step_ms}")
    threads, R = torch.get_num_threads(), args.rows
    print(f"{describe()['device']}, {threads} threads")
    with tempfile.TemporaryDirectory() as tmp:
        int_peak, block_peak, fma_peak = peaks(threads, Path(tmp))
        lib = build(cpu_q8.SOURCE, Path(tmp) / "q8.so", "native")
        t1, macs = step_seconds(lib, 1, args.rounds)
        tr, _ = step_seconds(lib, R, args.rounds)
    seq_peak = 32 * block_peak                    # a block is 32 multiply-adds
    print(f"peaks: int8 byte products {int_peak / 1e9:.1f} G multiply-adds/s, the kernel's per-block sequence "
          f"{seq_peak / 1e9:.1f} G/s, fp32 FMA {fma_peak / 1e9:.1f} G/s")
    print(f"one step's int8 products: {macs / 1e6:.1f} M weights (bytes, and multiply-adds a row)")
    print(f"  1 row : {t1 * 1e3:6.2f} ms ({macs / t1 / 1e9:.2f} GB/s of weights)")
    print(f"  {R} rows: {tr * 1e3:6.2f} ms ({R * macs / tr / 1e9:.2f} G multiply-adds/s), {tr / t1:.2f}x one row")
    step = args.step_ms / 1e3 if args.step_ms is not None else None
    if step is not None and step < t1:
        print(f"note: --step-ms {args.step_ms} is less than the products' own {t1 * 1e3:.2f} ms; rest taken as 0")
    rest = max(step - t1, 0.0) if step is not None else None
    for label, rate in (("the kernel's sequence at its peak", seq_peak), ("byte products alone at their peak", int_peak)):
        floor = R * macs / rate
        line = f"  {R} rows at {label}: >= {floor * 1e3:.2f} ms, {floor / t1:.2f}x one row"
        if rest is not None:
            line += (f"; a {R}-row engine step >= {(floor + rest) * 1e3:.2f} ms, so at most "
                     f"{R * (t1 + rest) / (floor + rest):.2f}x the tokens/s of a {args.step_ms:g} ms one-row step")
        print(line)
    if rest is None:
        print("  (give --step-ms, a one-row engine step's time, for the bound on the engine's batched gain)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
