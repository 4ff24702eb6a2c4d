"""Every Triton kernel, compiled ahead of time for a T4, an A100, an L4 and an H100, fits the GPU it targets.

No GPU is needed: `infopt_lab.kernels.aot` compiles each launch the package's own launchers produce
(grid, constexprs, warps, stages) for sm_75, sm_80, sm_89 and sm_90, in every dtype the target runs,
then reads shared memory from the compiled metadata and registers and stack from cuobjdump. It runs in
a process of its own with the interpreter off. Triton's cache (~/.triton/cache) keeps a warm run short.
"""
from __future__ import annotations

import pytest
import torch

from infopt_lab.device import supported_dtypes
from infopt_lab.kernels.aot import aot_unavailable
from infopt_lab.kernels.targets import KB, TARGETS, Tiles, flash_shared_bytes, flash_tiles, shared_per_block

needs_aot = pytest.mark.skipif(aot_unavailable() is not None, reason=str(aot_unavailable()))


@pytest.fixture(scope="module")
def compiled():
    from infopt_lab.kernels.aot import run_subprocess
    return run_subprocess()


@needs_aot
def test_every_kernel_compiles_and_fits_every_target(compiled):
    expected = {f"sm_{a}{b} ({name})": len(supported_dtypes((a, b))) * 6 for (a, b), name in TARGETS.items()}
    seen = {}
    for c in compiled:
        seen[c.target] = seen.get(c.target, 0) + 1
    assert seen == expected                     # 3 head dims of FlashAttention, paged, softmax, int4: per dtype
    bad = [f"{c.kernel} {c.dtype} {c.shape} on {c.target}: {c.error}" for c in compiled if not c.ok]
    assert not bad, "\n".join(bad)


@needs_aot
def test_flash_shared_estimate_bounds_what_triton_allocates(compiled):
    """The tile choice trusts flash_shared_bytes; it must never be below what the compiled kernel uses."""
    for c in compiled:
        if c.kernel != "flash_attention":
            continue
        cap = (int(c.target[3]), int(c.target[4]))
        D, dtype = int(c.shape.removeprefix("D=")), getattr(torch, c.dtype)
        tiles = flash_tiles(D, dtype, cap)
        assert c.shared <= flash_shared_bytes(tiles, D, dtype.itemsize, cap), (c, tiles)


def test_tiles_fit_each_target_by_its_own_limit():
    """An L4 (8.9) is not an A100 (8.0): fp16 at head dim 128 takes fewer stages there, within 99 KB."""
    assert shared_per_block((8, 9)) == 99 * KB and shared_per_block((8, 0)) == 163 * KB
    assert shared_per_block((8, 6)) == 99 * KB and shared_per_block((12, 0)) == 227 * KB   # newest known below
    a100, l4 = flash_tiles(128, torch.float16, (8, 0)), flash_tiles(128, torch.float16, (8, 9))
    assert flash_shared_bytes(a100, 128, 2, (8, 9)) > 99 * KB >= flash_shared_bytes(l4, 128, 2, (8, 9))
    for cap in TARGETS:
        for dtype in supported_dtypes(cap):
            for D in (16, 32, 64, 128):
                tiles = flash_tiles(D, dtype, cap)
                assert flash_shared_bytes(tiles, D, dtype.itemsize, cap) <= shared_per_block(cap)
    assert flash_tiles(64, torch.float32, None) == Tiles(64, 64, 4, 1)       # the interpreter
    with pytest.raises(ValueError, match="older than every one known"):
        shared_per_block((6, 1))
