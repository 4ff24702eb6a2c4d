import subprocess
import sys

from infopt_lab.bench import bench_decode
from infopt_lab.cli import main


def test_doctor_finds_no_problem(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "target :" in out and "draft  :" in out and "no problems found" in out


def test_bench_decode_matches_transformers_tokens(tiny_dir):
    result = bench_decode(str(tiny_dir), new_tokens=8, repeats=1)
    assert result.values["same_tokens"] is True
    labels = [label for label, _ in result.rows]
    assert "speedup vs transformers" in labels and "weight-streaming bound" in labels


def test_console_script_rejects_unknown_bench():
    proc = subprocess.run([sys.executable, "-m", "infopt_lab.cli", "bench", "--only", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
