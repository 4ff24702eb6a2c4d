"""Measure, on this CPU, from how many rows int8 layers run tiled GEMMs instead of the int8 kernel.

Times both paths (quant_kernels.int8_gemm_crossover) on two int8 layers shaped like SmolLM2-135M's: its
fused gate and up projections (576 -> 3072, one GEMM tile) and its vocabulary head (576 -> 49152, twelve
tiles), with the GEMMs in the dtype this CPU gives them (bf16 where it has bf16 in hardware, fp32 elsewhere),
and writes the crossovers into infopt_lab/assets/results/quant_thresholds.json under this CPU's
name and vector unit (quant_thresholds.cpu_key). Takes under a minute on a 2-core CPU. Usage:
    python scripts/measure_quant_thresholds.py [--repeats N] [--out PATH]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

import infopt_lab as lab
from infopt_lab.quant_kernels import int8_gemm_crossover
from infopt_lab.quant_thresholds import THRESHOLDS_FILE, cpu_key, save_thresholds

LAYERS = {"one tile": (576, 3072), "tiled": (576, 49152)}   # (in, out) features
HEAD_ROWS = (1, 2, 4, 6, 7, 8, 9, 10, 12, 16, 24, 32, 64, 128)   # fewer: each call reads 28 MB


def idle_share(seconds: float = 1.0) -> float | None:
    """The share of the CPUs' time spent idle over the next `seconds` (Linux /proc/stat), or None elsewhere."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]      # user nice system idle iowait irq ...
        return ticks[3], sum(ticks)
    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return None
    return round((idle1 - idle0) / max(total1 - total0, 1), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds over all row counts (default 25)")
    parser.add_argument("--out", type=Path, default=THRESHOLDS_FILE,
                        help=f"the records file (default {THRESHOLDS_FILE})")
    args = parser.parse_args()
    idle = idle_share()
    if idle is not None and idle < 0.8:           # both paths run threaded: a busy CPU stalls them unevenly
        print(f"warning: the CPU is {idle:.0%} idle; other work skews these timings, so measure on a quiet machine")
    torch.manual_seed(0)
    start, found, timings = time.perf_counter(), {}, {}
    for name, (K, N) in LAYERS.items():
        layer = lab.quantize_linear(nn.Linear(K, N, bias=False), "int8")
        kwargs = {"rows": HEAD_ROWS} if name == "tiled" else {}
        found[name], seconds = int8_gemm_crossover(layer, repeats=args.repeats, **kwargs)
        us = {f"{path}_us": [round(t[path] * 1e6, 1) for t in seconds.values()] for path in ("kernel", "gemm")}
        timings[f"{K}x{N}"] = {"rows": list(seconds), **us}
        print(f"{name:8s} {K}x{N}: GEMMs from {found[name]} rows | "
              + ", ".join(f"{n}: {t['gemm'] / t['kernel']:.2f}x" for n, t in seconds.items()))
    timings["idle_before_after"] = [idle, idle_share()]         # how quiet the CPU was (Linux; else None)
    save_thresholds(found["one tile"], found["tiled"], timings, args.out)
    print(f"{cpu_key()}: int8_gemm_min_rows={found['one tile']}, int8_gemm_min_rows_tiled={found['tiled']} "
          f"-> {args.out} ({time.perf_counter() - start:.0f} s; ratios are GEMM time / kernel time)")


if __name__ == "__main__":
    main()
