"""Time two versions of the q8 kernel (infopt_lab/kernels/q8_dot.c) side by side: a git revision's and the
working tree's, built with the same flags, called in turn over a SmolLM2-sized stack of weights.

The stack is SmolLM2-135M's products for one step (per layer q/k/v fused 960 x 576, o 576 x 576, gate/up fused
3072 x 576, down 576 x 1536; 30 layers and the 49152 x 576 head), random integers in the kernel's own layouts,
so one pass streams what a decode step streams. Each round times one pass of each build; the best round counts.
It also says whether the two builds' outputs are identical, bit for bit.
Kernel changes are judged by this ratio, measured on the CPU they are for, not by a whole decode step, which
adds everything else a step does.

usage: python scripts/q8_kernel_ab.py [--rev HEAD] [--rows 1] [--march native] [--rounds 15]
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from infopt_lab import cpu_q8

ROOT = Path(__file__).resolve().parents[1]
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]       # (N, K) of one layer's products
HEAD = (49152, 576)
GROUP = 64                                                        # the int4 group size the course uses


def build(source: Path, out: Path, march: str) -> ctypes.CDLL:
    """The source compiled as cpu_q8 builds it, with -march=`march`."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in cpu_q8.FLAGS]
    subprocess.run([cpu_q8._compiler() or "cc", *flags, str(source), "-o", str(out), *cpu_q8._openmp_flags(), "-lm"],
                   check=True)
    return ctypes.CDLL(str(out))


def step_operands(rows: int, seed: int = 0):
    """One step's int8 and int4 weights, and activations of `rows` rows, per product."""
    g = torch.Generator().manual_seed(seed)
    shapes = LAYER * 30 + [HEAD]
    w8 = [(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.01)
          for n, k in shapes]
    w4 = [(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8), torch.rand(n, k // GROUP, generator=g),
           torch.randint(0, 16, (n, k // GROUP), generator=g, dtype=torch.uint8)) for n, k in shapes]
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in shapes}}
    ys = {n: torch.empty(rows, n) for n in {n for n, _ in shapes}}
    return shapes, w8, w4, xs, ys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision whose q8_dot.c is 'old' (default HEAD)")
    ap.add_argument("--rows", type=int, default=1, help="activation rows per call (1: a decode step)")
    ap.add_argument("--march", default="native", help="gcc's -march for both builds (haswell: an AVX2-only CPU)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if args.rows < 1 or args.rounds < 1:
        ap.error("--rows and --rounds must be at least 1")
    threads = torch.get_num_threads()
    P, I = ctypes.c_void_p, ctypes.c_int64
    with tempfile.TemporaryDirectory() as tmp:
        old_source = Path(tmp) / "q8_old.c"
        old_source.write_text(subprocess.run(["git", "show", f"{args.rev}:infopt_lab/kernels/q8_dot.c"], cwd=ROOT,
                                             check=True, capture_output=True, text=True).stdout)
        libs = {args.rev: build(old_source, Path(tmp) / "old.so", args.march),
                "working tree": build(cpu_q8.SOURCE, Path(tmp) / "new.so", args.march)}
        shapes, w8, w4, xs, ys = step_operands(args.rows)

        def int8(lib, keep=None):
            for (n, k), (w, s) in zip(shapes, w8):
                lib.q8w_linear(P(xs[k].data_ptr()), I(args.rows), I(k), P(w.data_ptr()), P(s.data_ptr()), I(n),
                               P(ys[n].data_ptr()), threads)
                if keep is not None:
                    keep.append(ys[n].clone())

        def int4(lib, keep=None):
            for (n, k), (w, s, z) in zip(shapes, w4):
                lib.q4_linear(P(xs[k].data_ptr()), I(args.rows), I(k), P(w.data_ptr()), P(s.data_ptr()),
                              P(z.data_ptr()), I(n), I(GROUP), P(ys[n].data_ptr()), threads)
                if keep is not None:
                    keep.append(ys[n].clone())

        print(f"{args.rows} row(s) a call, {threads} threads, -march={args.march}, best of {args.rounds} rounds")
        for name, run, nbytes in (("int8", int8, sum(n * k for n, k in shapes)),
                                  ("int4", int4, sum(n * k // 2 for n, k in shapes))):
            best = {label: float("inf") for label in libs}
            for _ in range(args.rounds):
                for label, lib in libs.items():
                    start = time.perf_counter()
                    run(lib)
                    best[label] = min(best[label], time.perf_counter() - start)
            outputs = {label: [] for label in libs}
            for label, lib in libs.items():
                run(lib, outputs[label])
            same = all(torch.equal(a, b) for a, b in zip(*outputs.values()))
            old, new = best[args.rev], best["working tree"]
            print(f"  {name}: {nbytes / 1e6:.0f} MB of weights; {args.rev} {old * 1e3:.2f} ms, working tree "
                  f"{new * 1e3:.2f} ms ({new / old:.2f}x the time); outputs {'identical' if same else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
