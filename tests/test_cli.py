import subprocess
import sys

from infopt_lab.bench import bench_decode
from infopt_lab.cli import main


def test_doctor_finds_no_problem(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "target :" in out and "draft  :" in out and "no problems found" in out
    assert "q8      : " in out                              # the hand-written kernel's state, whatever it is


def test_doctor_says_how_the_q8_kernel_runs(capsys, monkeypatch):
    from infopt_lab import cpu_q8
    monkeypatch.setattr(cpu_q8, "why_not", lambda: None)
    monkeypatch.setattr(cpu_q8, "native_why_not", lambda: "no C++ compiler")
    assert main(["doctor"]) == 0
    assert "through its Python registration (no C++ compiler)" in capsys.readouterr().out
    monkeypatch.setattr(cpu_q8, "why_not", lambda: "the CPU lacks AVX2")
    assert main(["doctor"]) == 0                                 # optional: never a problem
    assert "does not run here (the CPU lacks AVX2)" in capsys.readouterr().out


def test_doctor_says_which_lowerings_this_machine_keeps_and_how_to_measure_again(capsys, monkeypatch, tmp_path):
    import json
    monkeypatch.setenv("INFOPT_LAB_CACHE", str(tmp_path))
    assert main(["doctor"]) == 0
    assert "compile : no lowering measured yet" in capsys.readouterr().out
    kept = {"a": {"lowering": "mkl", "step_ms": {}}, "b": {"lowering": "reduction", "step_ms": {}},
            "c": {"lowering": "mkl", "step_ms": {}}}
    (tmp_path / "lowering.json").write_text(json.dumps(kept))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"compile : 3 lowering verdict(s) kept in {tmp_path / 'lowering.json'} (inductor's reduction for 1, " \
           "MKL for 2); delete the file to measure again" in out


def test_bench_decode_matches_transformers_tokens(tiny_dir):
    result = bench_decode(str(tiny_dir), new_tokens=8, repeats=1)
    assert result.values["same_tokens"] is True
    labels = [label for label, _ in result.rows]
    assert "speedup vs transformers" in labels and "weight-streaming bound" in labels


def test_console_script_rejects_unknown_bench():
    proc = subprocess.run([sys.executable, "-m", "infopt_lab.cli", "bench", "--only", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_bench_precision_and_batch_size_rungs_report_every_variant(tiny_dir):
    from infopt_lab.bench import bench_batch_size, bench_precision
    r = bench_precision(str(tiny_dir), context_len=8, steps=2, quality_tokens=256, n_prompts=2, new_tokens=4)
    assert {"fp32", "int8", "int4 g64"} <= set(r.values)
    assert r.values["fp32"]["exact_match"] == 1.0 and r.values["fp32"]["pass_cost"][1] == 1.0
    assert "int8 path" in r.render()
    b = bench_batch_size(str(tiny_dir), batch_sizes=(1, 2), new_tokens=4)
    assert set(b.values["throughput_tok_s"]) == {1, 2} and b.values["scaling"][1] == 1.0


def test_bench_speculative_reports_each_precision_against_the_same_target(tiny_dir):
    import pytest
    import torch
    from infopt_lab.bench import bench_speculative
    r = bench_speculative(str(tiny_dir), draft_name=str(tiny_dir), new_tokens=8, ks=(2,),
                          dtypes=(torch.float32, torch.bfloat16))
    assert set(r.values["by_precision"]) == {"fp32", "bf16"}
    assert all(v["same_tokens"] for v in r.values["by_precision"].values())
    assert "lookup_over_target" in r.values["by_precision"]["fp32"]          # prompt lookup on the first precision
    assert any(label.startswith("[bf16] speculative k=2") for label, _ in r.rows)
    with pytest.raises(ValueError, match="no bundled draft"):
        bench_speculative(str(tiny_dir))
