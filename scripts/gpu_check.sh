#!/usr/bin/env bash
# The CUDA checks, as one prepared run on a machine with a CUDA GPU (the device tool's H200, or any CUDA box):
#   1. the test suite's CUDA tests, and the session / store / server / tools test files run with the default
#      device, which is CUDA there: every session, slot and `deltaserve serve` of those tests runs on the GPU,
#   2. prefill / decode speed on random weights of the Qwen3.5-0.8B and 9B shapes, CPU-vs-CUDA parity,
#   3. (GPU_TRAIN=1) the demo model's tool training, scripts/demo/gpu_train.sh,
# all three at once (one GPU of 80+ GiB holds them; 16 cores). Results go to benchmarks/gpu/ and, when $OUT is set
# (the device tool's machine), to $OUT as gpu_check.tgz (+ train.tgz and the trained GGUFs): at most 8 files.
# Needs: torch with CUDA, transformers, tokenizers, jinja2, safetensors, numpy, pytest (+ pytest-xdist,
# pytest-timeout when present), and wheels for what the image lacks in .whl/ (`bash scripts/gpu_wheels.sh`).
# Fixtures built on a CPU machine may be carried in .fixtures/ (the llama.cpp-quantized demo files need llama.cpp).
# Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | grep -v "^WARNING" | tail -3
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=benchmarks/gpu; mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  lscpu | grep -m1 "Model name"; nproc; } 2>&1 | tee "$out/device.txt"
# the native CPU kernels compile once per machine: before the parallel jobs race for it
python3 -c "import deltaserve; deltaserve.load()" > /dev/null 2>&1

if [ "${GPU_TRAIN:-0}" = 1 ] && [ -f scripts/demo/gpu_train.sh ]; then
  (OUT=/tmp/train_out bash scripts/demo/gpu_train.sh > /tmp/gpu_train.log 2>&1; echo "rc=$?" >> /tmp/gpu_train.log) &
  train_pid=$!
fi

echo "== speed (background)"
(timeout "${GPU_SPEED_SECONDS:-300}" python3 scripts/gpu_speed.py --out "$out" > "$out/speed.txt" 2>&1) &
speed_pid=$!

echo "== CUDA tests"
xdist=""; python3 -c "import xdist" 2>/dev/null && xdist="-n ${GPU_TEST_WORKERS:-6}"
tmo=""; python3 -c "import pytest_timeout" 2>/dev/null && tmo="--timeout 240"
files=${GPU_TEST_FILES:-"tests/test_cuda.py tests/test_session.py tests/test_fallback.py tests/test_capacity.py
  tests/test_state_store.py tests/test_batching.py tests/test_shared_backend.py tests/test_server.py
  tests/test_server_store.py tests/test_structured_outputs.py tests/test_tools.py tests/test_demo_model.py
  tests/test_parity_transformers.py tests/test_run_cli.py
  tests/test_quant.py::test_cuda_tensors_dequantize_on_the_device_bit_identically"}
# the servers these files start, and their shared fixture model, on the GPU (tests/server_proc.py: the CPU otherwise)
# and their decode steps as CUDA graphs (engine/graph.py: off by default until a GPU run like this one has passed)
DELTASERVE_CUDA_GRAPH=${GPU_CUDA_GRAPH:-on} DELTASERVE_TEST_DEVICE=${GPU_TEST_DEVICE:-cuda} timeout "${GPU_TEST_SECONDS:-330}" python3 -m pytest ${GPU_TEST_VERBOSITY:--q} -p no:cacheprovider $xdist $tmo -rfE $files \
  > "$out/tests.txt" 2>&1
tail -45 "$out/tests.txt"

wait "$speed_pid"
echo "== speed"; cat "$out/speed.txt"
if [ -n "${train_pid:-}" ]; then
  wait "$train_pid"
  echo "== demo training"; tail -30 /tmp/gpu_train.log
  cp /tmp/gpu_train.log "$out/train.log"
  if [ -n "${OUT:-}" ]; then
    cp /tmp/train_out/*.gguf "$OUT"/ 2>/dev/null
    tar -czf "$OUT/train.tgz" --exclude='*.gguf' -C /tmp/train_out . 2>/dev/null
  fi
fi
echo "== done in $(( $(date +%s) - T0 )) s"
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/gpu_check.tgz" -C "$out" . 2>/dev/null; fi
exit 0
