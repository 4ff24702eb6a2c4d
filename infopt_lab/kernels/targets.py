"""The GPUs the course targets, what one thread block may use on each, and the tiles chosen to fit.

The interpreter hides these limits: a tile that runs on a CPU can need more shared memory than a
T4 gives one block, and then fails only at launch. So tiles are chosen here from the target's
shared memory per block (the opt-in maximum, CUDA C Programming Guide, "Compute Capabilities"),
the dtype and the head dim, and `aot.py` compiles every launch for every target to check it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

KB = 1024
# the most shared memory one block may ask for, by compute capability (major, minor)
SHARED_PER_BLOCK = {(7, 0): 96 * KB, (7, 5): 64 * KB, (8, 0): 163 * KB, (8, 6): 99 * KB, (8, 7): 163 * KB,
                    (8, 9): 99 * KB, (9, 0): 227 * KB}
TARGETS = {(7, 5): "T4", (8, 0): "A100", (8, 9): "L4", (9, 0): "H100"}   # what CI compiles for


class Tiles(NamedTuple):
    """A FlashAttention launch shape: tiles, warps and pipeline stages."""

    block_m: int                  # query rows per program
    block_n: int                  # keys per inner step
    num_warps: int
    num_stages: int               # K and V tiles in flight (software pipelining; 1 = none)


def shared_per_block(cap: tuple[int, int]) -> int:
    """Bytes of shared memory one block may use on a GPU of compute capability `cap` (newest known below it)."""
    known = [c for c in SHARED_PER_BLOCK if c <= tuple(cap)]
    if not known:
        raise ValueError(f"compute capability {cap[0]}.{cap[1]} is older than every one known "
                         f"({', '.join(f'{a}.{b}' for a, b in SHARED_PER_BLOCK)})")
    return SHARED_PER_BLOCK[max(known)]


def tensor_cores(itemsize: int, cap: tuple[int, int]) -> bool:
    """Whether tl.dot runs on tensor cores: 16-bit operands from Ampere on. fp32 ("ieee", exact) lowers
    to FMAs, and so does every dot on a T4 (measured: tests/test_aot_compile.py)."""
    return itemsize == 2 and tuple(cap) >= (8, 0)


def flash_shared_bytes(t: Tiles, D: int, itemsize: int, cap: tuple[int, int]) -> int:
    """Shared memory a FlashAttention launch needs: a K and a V tile per stage and the Q tile, and on FMA
    dots the P tile (the softmax weights, BLOCK_M x BLOCK_N) on its way into the second product.

    An upper bound on what Triton allocates (tests/test_aot_compile.py holds the two together).
    """
    p_tile = 0 if tensor_cores(itemsize, cap) else t.block_m * t.block_n
    return ((2 * max(t.num_stages, 1) * t.block_n + t.block_m) * D + p_tile) * itemsize


# (block_m, block_n, num_warps), largest first: wide tiles reuse each loaded K/V tile across more queries
_CANDIDATES = [(128, 64, 8), (128, 64, 4), (128, 32, 4), (64, 64, 4), (64, 32, 4), (32, 32, 8), (32, 32, 4),
               (32, 16, 8)]
# registers per thread the live fp32 tiles may take (accumulator, scores, Q): FMA dots hold far more per
# thread than tensor cores. Measured by compiling (tests/test_aot_compile.py): over these, tiles spill.
TENSOR_CORE_BUDGET, FMA_BUDGET = 128, 48


def flash_tiles(D: int, dtype: torch.dtype, cap: tuple[int, int] | None) -> Tiles:
    """The FlashAttention tiles for head dim D in `dtype` on capability `cap` (None: the interpreter).

    The largest candidate whose live tiles fit the register budget and whose shared memory, at
    as many pipeline stages as the GPU overlaps (3 from Ampere's asynchronous copies on, else 2),
    fits the target's per-block limit.
    """
    if cap is None:
        return Tiles(64, 64, 4, 1)                    # the interpreter: no shared memory, fixed tiles
    limit = shared_per_block(cap)
    itemsize = torch.empty((), dtype=dtype).element_size()
    budget = TENSOR_CORE_BUDGET if tensor_cores(itemsize, cap) else FMA_BUDGET
    for bm, bn, warps in _CANDIDATES:
        if _registers(bm, bn, warps, D, itemsize) > budget:
            continue
        for stages in ((3, 2) if tuple(cap) >= (8, 0) else (2,)):
            t = Tiles(bm, bn, warps, stages)
            if flash_shared_bytes(t, D, itemsize, cap) <= limit:
                return t
    raise ValueError(f"no FlashAttention tiles fit head dim {D} in {dtype} on compute capability {cap}")


def _registers(bm: int, bn: int, warps: int, D: int, itemsize: int) -> float:
    """fp32 registers per thread for the live tiles: the accumulator, the scores, and the Q tile held across the loop."""
    threads = warps * 32
    return (bm * D + bm * bn + bm * D * itemsize / 4) / threads
