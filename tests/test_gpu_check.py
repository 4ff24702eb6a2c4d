"""scripts/gpu_check.sh and its record: every step listed and runnable from the working tree alone."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

from infopt_lab.bench import LADDER
from infopt_lab.bench.gpu_record import RUNGS, main, record_path, summary

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["device", "kernel-tests", "engine-tests", "record"]


def test_dry_run_lists_every_step_and_exits_0():
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^\s+\d+\. (\S+) \(up to (\d+)s\)", out.stdout, flags=re.M)
    assert [name for name, _ in listed] == STEPS
    assert sum(int(limit) for _, limit in listed) <= 8 * 60           # fits the lent machine's 8 minutes
    for test_file in re.findall(r"tests/\S+\.py", out.stdout):       # what it runs ships in the working tree
        assert (ROOT / test_file).exists(), test_file


def test_the_record_names_its_device_and_keeps_going_past_a_failed_rung():
    assert set(RUNGS) <= set(LADDER)
    assert record_path("NVIDIA H200").name == "gpu_check_nvidia_h200.json"
    rungs = {"attention": {"values": {"ours_over_sdpa": {512: 0.8}, "tflops": {}}},
             "decode": {"error": "RuntimeError: boom"},
             "speculative": {"values": {"best_over_target": 1.7, "best_k": "k=3"}}}
    s = summary(rungs)
    assert s["ours_over_sdpa"] == {512: 0.8} and s["decode_tokens_per_s"] is None
    assert s["speculative_speedup"] == 1.7


def test_the_record_is_refused_without_a_gpu():
    if not torch.cuda.is_available():
        assert main([]) == 2
