"""Which lowering a compiled CPU step gives a float model's one-row products, measured once per machine.

compiled.py can compute `x @ W.T` for one token two ways: a multiply-and-sum that inductor writes itself,
over row-major weights, or a call to MKL, over column-major ones (eager code's layout). Neither wins
everywhere: in the course's runs the reduction was the faster on an AMD EPYC (Zen 1) and MKL on an Intel
Xeon. A probe of one product in isolation misleads (a head can stay in a large last-level cache where a
whole step's weights do not), so compiled.py times a whole compiled step each way on the model itself and
this module keeps the answer in the user cache, keyed by processor, thread count, torch and the model's shapes.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

LOWERINGS = ("reduction", "mkl")   # a CPU's one-row float products: inductor's reduction (row-major) or MKL (column)
LOWERING_FILE = "lowering.json"    # in the user cache: each machine's measured choice
SHORT_NAMES = {"reduction": "inductor's reduction", "mkl": "MKL"}
LAYOUTS = {"reduction": "row", "mkl": "column"}        # how each reads the weights fastest
LOWERING_NAMES = {k: f"{SHORT_NAMES[k]} over {LAYOUTS[k]}-major weights" for k in LOWERINGS}


@dataclass
class Verdict:
    lowering: str                # the faster of LOWERINGS here
    step_ms: dict[str, float]    # the median compiled step under each, as measured
    measured_now: bool           # False: read back from the user cache


def float_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def lowering_key(model: nn.Module) -> str:
    """What a verdict holds for: the processor (its name and a hash of its flags), the thread count, torch, and
    the model's float product shapes and dtype."""
    from .device import cpu_flags, cpu_name
    flags = " ".join(sorted(cpu_flags()))
    linears = float_linears(model)
    shapes = sorted({tuple(m.weight.shape) for m in linears})
    return (f"{cpu_name()} [{hashlib.sha256(flags.encode()).hexdigest()[:8]}], {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, {linears[0].weight.dtype} {shapes}")


def lay_out_for(model: nn.Module, lowering: str) -> None:
    """Re-lay a float model's linear weights as `lowering` reads them (row-major for the reduction, column-major
    for MKL), fused again, in place; nothing to do where they already are."""
    from .model import fuse_projections, set_weight_layout, weight_layout
    layout = LAYOUTS[lowering]
    if weight_layout(model) != layout:
        with torch.inference_mode(False), torch.no_grad():   # normal tensors, even when called while decoding
            set_weight_layout(model, layout)
            fuse_projections(model)


def verdict_path():
    from .hub import cache_root
    return cache_root() / LOWERING_FILE


def _verdicts() -> dict:
    try:
        verdicts = json.loads(verdict_path().read_text())
    except (OSError, ValueError):                              # none yet, or a damaged file: measured again
        return {}
    return verdicts if isinstance(verdicts, dict) else {}


def verdicts_summary() -> str:
    """One line for `infopt-lab doctor`: how many verdicts this machine keeps, which way they went, and how to
    measure again (a verdict timed while the machine was busy stays until then)."""
    kept = [v.get("lowering") for v in _verdicts().values() if isinstance(v, dict)]
    if not kept:
        return "no lowering measured yet (the first compile of a float model on a CPU times it)"
    counts = ", ".join(f"{SHORT_NAMES[k]} for {kept.count(k)}" for k in LOWERINGS if k in kept)
    return f"{len(kept)} lowering verdict(s) kept in {verdict_path()} ({counts}); delete the file to measure again"


def read_verdict(model: nn.Module) -> Verdict | None:
    """This machine's verdict for the model's shapes, from the user cache; None where none is kept."""
    known = _verdicts().get(lowering_key(model))
    if isinstance(known, dict) and known.get("lowering") in LOWERINGS:
        return Verdict(known["lowering"], known.get("step_ms", {}), measured_now=False)
    return None


def keep_verdict(model: nn.Module, step_ms: dict[str, float]) -> Verdict:
    """The faster of the measured lowerings, written to the user cache (whole or not at all; a cache that cannot
    be written is said, and the next compile measures again)."""
    verdict = Verdict(min(step_ms, key=step_ms.get), step_ms, measured_now=True)
    path, verdicts = verdict_path(), _verdicts()
    verdicts[lowering_key(model)] = {"lowering": verdict.lowering, "step_ms": {k: round(v, 3) for k, v in step_ms.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(verdicts, indent=1))
        part.replace(path)
    except OSError as e:
        print(f"compile: could not keep the lowering's verdict in {path} ({e}); it is measured again next time")
    return verdict
