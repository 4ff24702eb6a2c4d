"""Where int8 layers switch kernels on a CPU: row counts measured on a CPU and kept under its name.

On a CPU an int8 layer runs `aten._weight_int8pack_mm` for calls of few rows and tiled GEMMs over its
integers for more (`quant_kernels.Int8TiledGemm`: bf16 GEMMs where the CPU has bf16 in hardware, fp32 ones
elsewhere). Both take the same bf16 activations; which is faster depends on the CPU, so the row count where
the GEMMs take over is measured, not typed in: `scripts/measure_quant_thresholds.py` times both at rising row
counts and writes the crossover into `assets/results/quant_thresholds.json`, keyed by the CPU's model name
and vector unit. `cpu_thresholds` reads this CPU's record; a CPU without one gets the record of a CPU with
the same vector unit, else the one named as the default (the CPU the course was measured on); `source` says
which.
"""
from __future__ import annotations

import datetime
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from . import validate
from .device import cpu_name

THRESHOLDS_FILE = Path(__file__).parent / "assets" / "results" / "quant_thresholds.json"
MEASURE_COMMAND = "python scripts/measure_quant_thresholds.py"


@dataclass(frozen=True, slots=True)
class CpuThresholds:
    """From how many rows per call int8 layers on a CPU run tiled GEMMs instead of the int8 kernel."""
    int8_gemm_min_rows: int          # a layer of one GEMM tile (every projection of our models)
    int8_gemm_min_rows_tiled: int    # a layer of more than one tile (a vocabulary-sized head)
    measured_on: str                 # the CPU whose record these are: "model name, vector unit"
    source: str                      # where they come from, in a sentence: this CPU's record, or another's

    def __post_init__(self):
        for name in ("int8_gemm_min_rows", "int8_gemm_min_rows_tiled"):
            validate.integer(name, getattr(self, name), low=1)


def cpu_key() -> str:
    """This CPU as the records name it: its model name and the vector unit PyTorch runs on it ("AMD EPYC, AVX512")."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    return f"{cpu_name()}, {capability}"


def read_records(path: Path = THRESHOLDS_FILE) -> dict:
    """The thresholds file: {"default": cpu key, "cpus": {cpu key: record}}, empty where there is none."""
    path = Path(path)
    if not path.exists():
        return {"default": None, "cpus": {}}
    return json.loads(path.read_text())


@functools.cache
def cpu_thresholds(path: Path = THRESHOLDS_FILE) -> CpuThresholds:
    """This CPU's measured thresholds; where it has no record, those of a CPU with the same vector unit (the int8
    kernel's code and, in practice, whether bf16 is in hardware follow it), else the default CPU's; `source` says
    which."""
    records, key = read_records(path), cpu_key()
    unit = key.rsplit(", ", 1)[-1]
    alike = sorted(k for k in records["cpus"] if k.rsplit(", ", 1)[-1] == unit)
    if key in records["cpus"]:
        measured_on = key
        source = f"measured on this CPU ({key}) by {MEASURE_COMMAND}"
    elif alike or records["default"] in records["cpus"]:
        measured_on = alike[0] if alike else records["default"]
        source = (f"no record for this CPU ({key}): the values measured on {measured_on}"
                  f"{', the same vector unit' if alike else ''}; {MEASURE_COMMAND} measures this one")
    else:
        raise FileNotFoundError(f"{path} holds no thresholds for {key} and no default CPU's; "
                                f"run {MEASURE_COMMAND} to measure them")
    record = records["cpus"][measured_on]
    return CpuThresholds(record["int8_gemm_min_rows"], record["int8_gemm_min_rows_tiled"], measured_on, source)


def save_thresholds(min_rows: int, min_rows_tiled: int, timings: dict, path: Path = THRESHOLDS_FILE) -> dict:
    """Write this CPU's record (the thresholds and the timings they come from) beside the others'; return it.

    timings: per layer measured ("576x3072"), its row counts and each path's fastest microseconds at them.
    """
    CpuThresholds(min_rows, min_rows_tiled, cpu_key(), "checked before writing")
    records, key = read_records(path), cpu_key()
    records["cpus"][key] = {
        "int8_gemm_min_rows": min_rows, "int8_gemm_min_rows_tiled": min_rows_tiled,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "measured": datetime.date.today().isoformat(), "command": MEASURE_COMMAND,
        "timings": timings,
    }
    records["default"] = records["default"] or key       # the first CPU measured serves the ones never measured
    text = json.dumps(records, indent=1)
    text = re.sub(r"\[([^\[\]{}\"]*)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)   # a list: one line
    Path(path).write_text(text + "\n")
    cpu_thresholds.cache_clear()
    return records["cpus"][key]
