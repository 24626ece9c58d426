#!/usr/bin/env bash
# The CUDA checks, as one prepared run on a machine with a CUDA GPU (the device tool's H200, or any CUDA box):
#   1. the test suite's CUDA tests, and the session / store / server / tools test files run with the default
#      device, which is CUDA there: every session, slot and `deltaserve serve` of those tests runs on the GPU,
#   2. prefill / decode speed on random weights of the Qwen3.5-0.8B and 9B shapes, CPU-vs-CUDA parity,
#   3. (GPU_TRAIN=1) the demo model's tool training, scripts/demo/gpu_train.sh, in the background beside them.
# Results go to benchmarks/gpu/ (and to $OUT when that is set, as on the device tool's machine).
# Needs: torch with CUDA, transformers, tokenizers, jinja2, safetensors, numpy, pytest (+ pytest-xdist,
# pytest-timeout when present), and wheels for what the image lacks in .whl/ (gguf, fastapi, uvicorn, pydantic,
# openai, xgrammar, jsonschema, ...: `bash scripts/gpu_wheels.sh` writes them). Fixtures built here may be carried
# in .fixtures/. Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | grep -v "^WARNING" | tail -3
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=benchmarks/gpu; mkdir -p "$out"
res=${OUT:-$out}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"
lscpu | grep -m1 "Model name" | tee -a "$out/device.txt"

if [ "${GPU_TRAIN:-0}" = 1 ] && [ -f scripts/demo/gpu_train.sh ]; then
  echo "== demo tool training (background)"
  (bash scripts/demo/gpu_train.sh > /tmp/gpu_train.log 2>&1; echo "rc=$?" >> /tmp/gpu_train.log) &
  train_pid=$!
fi

echo "== CUDA tests"
xdist=""; python3 -c "import xdist" 2>/dev/null && xdist="-n ${GPU_TEST_WORKERS:-6}"
tmo=""; python3 -c "import pytest_timeout" 2>/dev/null && tmo="--timeout 240"
files=${GPU_TEST_FILES:-"tests/test_cuda.py tests/test_session.py tests/test_fallback.py tests/test_capacity.py
  tests/test_state_store.py tests/test_batching.py tests/test_shared_backend.py tests/test_server.py
  tests/test_server_store.py tests/test_structured_outputs.py tests/test_tools.py tests/test_demo_model.py
  tests/test_parity_transformers.py tests/test_run_cli.py"}
timeout "${GPU_TEST_SECONDS:-330}" python3 -m pytest -q -p no:cacheprovider $xdist $tmo -rfE $files \
  tests/test_quant.py::test_cuda_tensors_dequantize_on_the_device_bit_identically 2>&1 | tee "$out/tests.txt" | tail -60

echo "== speed"
timeout "${GPU_SPEED_SECONDS:-150}" python3 scripts/gpu_speed.py --out "$out" 2>&1 | tee "$out/speed.txt"

if [ -n "${train_pid:-}" ]; then
  echo "== waiting for the demo training"
  wait "$train_pid"
  tail -40 /tmp/gpu_train.log
  cp /tmp/gpu_train.log "$out/train.log"
fi
# one file back for all of this script's own results (the device tool returns at most 8 files)
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/gpu_check.tgz" -C "$out" . 2>/dev/null; fi
exit 0
