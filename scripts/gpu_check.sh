#!/usr/bin/env bash
# The GPU checks in one run, for a lent machine with CUDA and nothing else: no network, only this working
# tree (so the bundled models only, and perhaps no Jupyter). The kernel and engine tests compiled for real
# (not the interpreter), the compiled kernels against SDPA, then the GPU benchmarks, whose figures land in a
# JSON record in infopt_lab/assets/results/ (device, versions, TFLOP/s against SDPA, decode tokens/s,
# speculative speedup). Every step runs and is logged even when an earlier one failed; about 8 minutes on
# one H200. Usage:
#   bash scripts/gpu_check.sh [--dry-run] [OUT_DIR]   (default OUT_DIR: runs/gpu_check; a log per step lands there)
#   --dry-run lists the steps and exits 0, on any machine.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
out="${1:-runs/gpu_check}"

PYTEST="python -m pytest -q -p no:cacheprovider -n 0"
# name | seconds allowed | command
STEPS=(
  "device|30|python -c 'import torch, triton, infopt_lab as lab; assert torch.cuda.is_available(), \"no CUDA device: this script is for a GPU machine\"; print(torch.cuda.get_device_name(), \"capability\", torch.cuda.get_device_capability(), \"torch\", torch.__version__, \"triton\", triton.__version__, \"computes in\", lab.default_dtype(\"cuda\"))'"
  "kernel-tests|120|$PYTEST tests/test_kernels.py tests/test_attention.py tests/test_device.py tests/test_aot_compile.py"
  "engine-tests|150|$PYTEST tests/test_engine.py tests/test_spec_decode.py tests/test_prefix_caching.py tests/test_generate.py tests/test_speculative.py"
  "record|180|python -m infopt_lab.bench.gpu_record"
)

if (( dry_run )); then
  echo "gpu_check: ${#STEPS[@]} steps (logs would go to $out/)"
  for i in "${!STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "${STEPS[$i]}"
    echo "  $((i + 1)). $name (up to ${limit}s): $cmd"
  done
  exit 0
fi

mkdir -p "$out"
unset TRITON_INTERPRET                       # compiled kernels, not the interpreter
export HF_HUB_OFFLINE=1 MPLBACKEND=Agg
failed=()
for i in "${!STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<< "${STEPS[$i]}"
  log="$out/$((i + 1))_$name.log"
  echo "== $((i + 1)). $name (up to ${limit}s) -> $log"
  start=$SECONDS
  timeout "$limit" bash -c "$cmd" > "$log" 2>&1
  status=$?
  tail -n 5 "$log"
  echo "== $name: exit $status after $((SECONDS - start))s"
  (( status == 0 )) || failed+=("$name (exit $status)")
done
if (( ${#failed[@]} )); then
  echo "gpu_check: failed: ${failed[*]}"
  exit 1
fi
echo "gpu_check: every step passed"
