#!/usr/bin/env bash
# The CUDA checks, as one prepared run on a machine with a CUDA GPU (see issue "accelerator route"):
#   1. the test suite's CUDA tests (CUDA route of the session, dequantization on the device),
#   2. CPU-vs-CUDA parity on the fixtures and the parity guard's verdict,
#   3. prefill / decode speed on random weights of the Qwen3.5-0.8B and 9B shapes.
# Results go to benchmarks/gpu/ (and to $OUT when that is set, as on the device tool's machine).
# Needs: torch with CUDA, transformers, tokenizers, jinja2, safetensors, numpy (present on the lent H200
# image) and the wheels of gguf (carried: .whl/). Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DELTASERVE_FIXTURES=/tmp/fixtures
out=benchmarks/gpu; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"
echo "== CUDA tests"
timeout 300 python3 -m pytest -q tests/test_cuda.py tests/test_quant.py -k "cuda or CUDA" 2>&1 | tee "$out/tests.txt"
echo "== speed"
timeout 600 python3 scripts/gpu_speed.py --out "$out" 2>&1 | tee "$out/speed.txt"
if [ -n "${OUT:-}" ]; then cp "$out"/* "$OUT"/ 2>/dev/null; fi
