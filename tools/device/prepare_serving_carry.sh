#!/bin/bash
# Fill .carry/slim (git-ignored) with the wheels plugserve's server and benchmarks need on the GPU machine
# (Python 3.12, torch / triton / numpy already there), dependencies resolved by pip for that interpreter, so
# that a newer release pulling a new dependency (fastapi -> opentelemetry) cannot break the device runs.
# Usage, from the repo root: bash tools/device/prepare_serving_carry.sh
set -euo pipefail
out=.carry/slim
mkdir -p $out
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d $out pluggy pydantic rich fastapi uvicorn prometheus_client tqdm safetensors "transformers==5.23.0" httpx \
  psutil jinja2 apache-tvm-ffi
# xgrammar without its dependencies (torch and triton among them: the machine has them).
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d $out xgrammar
# The grammar tests' client side (tools/device/run_grammar_on_device.sh):
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d $out pytest openai jsonschema_rs
# Provided by the machine's image, and far too big to carry:
rm -f $out/torch-* $out/triton-* $out/numpy-* $out/nvidia_* $out/cuda_* $out/hf_xet-*
du -sh $out
