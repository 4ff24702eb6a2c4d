#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA: the kernel tests compiled for real (not the
# interpreter), then the benchmarks whose figures only mean something on a GPU. Usage:
#   bash scripts/gpu_check.sh [OUT_DIR]     (default: runs/gpu_check; a log of everything lands there)
set -euo pipefail
out="${1:-runs/gpu_check}"
mkdir -p "$out"
python - <<'PY' 2>&1 | tee "$out/device.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
print(torch.cuda.get_device_name(), torch.__version__, "bf16:", torch.cuda.is_bf16_supported())
PY
unset TRITON_INTERPRET
export HF_HUB_OFFLINE=1 MPLBACKEND=Agg
python -m pytest -q -p no:cacheprovider -n 0 tests/test_kernels.py tests/test_attention.py tests/test_engine.py \
  tests/test_speculative.py tests/test_generate.py tests/test_prefix_caching.py tests/test_spec_decode.py 2>&1 | tee "$out/tests.txt"
infopt-lab bench --only attention decode batching speculative engine 2>&1 | tee "$out/bench.txt"
