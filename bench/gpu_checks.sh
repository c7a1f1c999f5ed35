#!/usr/bin/env bash
# The GPU checks in one go, on a CUDA machine whose python3 already holds PyTorch (and transformers):
# installs this checkout (no dependencies; the planner is compiled) into a scratch folder, then runs
# bench/gpu_single.py (3 rounds of the runtime, plain and plain-pinned, 40 steps each: three snapshot steps past
# the warm-up) and the CUDA tests (tests/runtime, marked gpu); on request also bench/gpu_capture.py (a snapshot
# capture's pieces) and bench/gpu_trace.py (where a step's time goes).
# On an H100 (2026-11-27) the install took 30-37 s, a 40-step run ~30 s (process start and model build included),
# a 60-step run ~36 s, the CUDA tests 17 s: the defaults fit one 600 s call of the device tool.
# Logs and figures go to $1 (default: a temporary folder). CI has no GPU: this is run by hand.
#
# usage: [GPU_WHEELS=build/gpu-wheels] [GPU_BENCHES='single capture trace'] [GPU_BENCH_PIECES=no-snapshots,off]
#        [GPU_BENCH_MODEL=gpt3-350m] bench/gpu_checks.sh [OUT_DIR]
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
if [ -n "${GPU_WHEELS:-}" ]; then
  # A device machine without an index: the runtime's dependencies from a folder of wheels made beside the
  # checkout (pip download). The small pure ones always go in (they shadow older copies); numpy and the
  # Hugging Face stack only where missing, so that the machine's torch keeps the numpy it was built with.
  wheels=()
  for wheel in "$GPU_WHEELS"/*.whl; do
    dist=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z' 'a-z')
    module=$dist; [ "$dist" = pyyaml ] && module=yaml
    case $dist in
      numpy | transformers | huggingface_hub | tokenizers | safetensors | regex | tqdm | requests | filelock | fsspec | \
        hf_xet | certifi | idna | urllib3 | charset_normalizer | packaging)
        python3 -c "import $module" 2>/dev/null && continue ;;
    esac
    wheels+=("$wheel")
  done
  python3 -m pip install -q --no-deps --no-index --no-compile --target "$site" "${wheels[@]}" >>"$out/install.log" 2>&1 \
    || { tail -30 "$out/install.log"; echo "installing the wheels failed"; exit 1; }
  echo "from wheels: ${#wheels[@]}"
fi
echo "installed in $(($(date +%s) - start)) s"
status=0
benches=${GPU_BENCHES:-single}
if [[ " $benches " == *" capture "* ]]; then
  timeout 120 python3 bench/gpu_capture.py --out "$out/gpu_capture.json" 2>&1 | tee "$out/gpu_capture.log" || status=1
fi
if [[ " $benches " == *" trace "* ]]; then
  timeout 180 python3 bench/gpu_trace.py --out "$out/gpu_trace.json" 2>&1 | tee "$out/gpu_trace.log" || status=1
fi
if [[ " $benches " == *" single "* ]]; then
  timeout "${GPU_BENCH_TIMEOUT_S:-400}" python3 bench/gpu_single.py --model "${GPU_BENCH_MODEL:-gpt2-medium}" --repeats "${GPU_BENCH_REPEATS:-3}" --warmup "${GPU_BENCH_WARMUP:-10}" \
    --steps "${GPU_BENCH_STEPS:-40}" --pieces "${GPU_BENCH_PIECES-}" --out "$out/gpu_single.json" 2>&1 \
    | tee "$out/gpu_single.log" || status=1
fi
PYTHONPATH="$PWD/devtools:$PYTHONPATH" timeout "${GPU_TESTS_TIMEOUT_S:-240}" python3 -m pytest -p no:cacheprovider -q --timeout 200 -m gpu tests/runtime/test_gpu.py tests/runtime/test_causes.py tests/runtime/test_profiler_metrics_cli.py \
  2>&1 | tee "$out/gpu_tests.log" || status=1
exit $status
