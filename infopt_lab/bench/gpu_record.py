"""The GPU check's record: what a lent GPU measured, kept as JSON beside the CPU results.

`scripts/gpu_check.sh` ends with `python -m infopt_lab.bench.gpu_record`, which runs the GPU rungs on
the bundled models (a lent machine has no network), each one even if another failed, and writes
`assets/results/gpu_check_<device>.json`: the device, the versions, every rung's rows and figures,
and a summary (our kernel's TFLOP/s against SDPA, decode tokens/s, the speculative speedup).
Notebooks 04 and 05 show the newest record, labelled with its device, beside their CPU run.
"""
from __future__ import annotations

import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "assets" / "results"
RUNGS = ("attention", "decode", "speculative", "engine")
PREFIX = "gpu_check_"


def machine() -> dict:
    """The device and the versions that produced a record."""
    import triton
    cap = torch.cuda.get_device_capability()
    return {"device": torch.cuda.get_device_name(), "capability": f"{cap[0]}.{cap[1]}",
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def summary(rungs: dict) -> dict:
    """The figures a reader looks for first, from the rungs that ran (None where one failed)."""
    def value(rung, *keys):
        v = rungs.get(rung, {}).get("values", {})
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v
    return {"ours_over_sdpa": value("attention", "ours_over_sdpa"),
            "attention_tflops": value("attention", "tflops"),
            "decode_tokens_per_s": value("decode", "tokens_per_s"),
            "speculative_speedup": value("speculative", "best_over_target"),
            "speculative_best_k": value("speculative", "best_k")}


def record(rungs: tuple[str, ...] = RUNGS) -> dict:
    """Run each rung on the bundled models; a rung that fails is recorded with its error and the rest still run."""
    from . import LADDER
    out = {}
    for name in rungs:
        start = time.perf_counter()
        try:
            result = LADDER[name]()
            out[name] = {"rows": result.rows, "values": result.values}
            print(result.render(), flush=True)
        except Exception as e:                   # one failing rung must not cost the others' figures
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        out[name]["seconds"] = round(time.perf_counter() - start, 1)
    return {"machine": machine(), "summary": summary(out), "rungs": out}


def record_path(device_name: str) -> Path:
    """Where a device's record goes: assets/results/gpu_check_<device>.json."""
    return RESULTS / f"{PREFIX}{re.sub(r'[^a-z0-9]+', '_', device_name.lower()).strip('_')}.json"


def newest_record() -> dict | None:
    """The newest GPU record committed to assets/results, or None (no GPU has run the check)."""
    paths = sorted(RESULTS.glob(f"{PREFIX}*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(paths[-1].read_text()) if paths else None


def main(argv: list[str]) -> int:
    """Write the record of this GPU; `--rungs a,b` picks rungs (default: all of RUNGS)."""
    if not torch.cuda.is_available():
        print("gpu_record: no CUDA device here; the record is for a GPU machine", file=sys.stderr)
        return 2
    rungs = tuple(argv[argv.index("--rungs") + 1].split(",")) if "--rungs" in argv else RUNGS
    rec = record(rungs)
    path = record_path(rec["machine"]["device"])
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in rec["rungs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
