#!/usr/bin/env bash
# The GPU checks in one go, on a CUDA machine whose python3 already holds PyTorch (and transformers):
# installs this checkout (no dependencies; the planner is compiled) into a scratch folder, then runs
# bench/gpu_single.py (with a breakdown by runtime piece) and the CUDA tests (tests/runtime/test_gpu.py).
# Logs and figures go to $1 (default: a temporary folder). CI has no GPU: this is run by hand.
#
# usage: bench/gpu_checks.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
site=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name(0))'; } 2>&1 | tee "$out/device.txt"
start=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" . >"$out/install.log" 2>&1 \
  || { tail -30 "$out/install.log"; echo "installing the package failed"; exit 1; }
echo "installed in $(($(date +%s) - start)) s"
status=0
timeout "${GPU_BENCH_TIMEOUT_S:-300}" python3 bench/gpu_single.py --repeats "${GPU_BENCH_REPEATS:-3}" \
  --pieces "${GPU_BENCH_PIECES:-off,no-snapshots}" --out "$out/gpu_single.json" 2>&1 | tee "$out/gpu_single.log" || status=1
timeout "${GPU_TESTS_TIMEOUT_S:-240}" python3 -m pytest -p no:cacheprovider -q --timeout 200 -m gpu tests/runtime/test_gpu.py \
  2>&1 | tee "$out/gpu_tests.log" || status=1
exit $status
