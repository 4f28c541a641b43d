#!/bin/bash
# Fill .carry/fi (git-ignored, 23 MB): FlashInfer and what bench_one_batch imports that the GPU machine's image
# lacks, small enough to travel beside the tree in one device call (FlashInfer's usual carry with the serving
# wheels does not fit 64 MiB). Takes FlashInfer's archive and its three small wheels from .carry/c1
# (../shared/device/prepare-carry.sh; the cuDNN frontend wheel stays out: MLA and prefill do not import it), and
# pydantic, uvicorn and their dependencies from .carry/slim (tools/prepare_serving_carry.sh).
# On the device: bash benchmarks/run_fast_path_on_device.sh setup ... (it installs .carry/fi when present).
# Usage, from the repo root: bash tools/prepare_flashinfer_carry.sh
set -euo pipefail
out=.carry/fi
for needed in .carry/c1/flashinfer.tar.xz .carry/slim; do
  [ -e $needed ] || { echo "prepare_flashinfer_carry: $needed is missing (see this script's header)" >&2; exit 2; }
done
mkdir -p $out
cp .carry/c1/flashinfer.tar.xz .carry/c1/apache_tvm_ffi-*.whl .carry/c1/cuda_tile-*.whl \
  .carry/c1/torch_c_dlpack_ext-*.whl $out/
for wheel in pydantic pydantic_core annotated_types typing_inspection uvicorn h11 click; do
  cp .carry/slim/${wheel}-[0-9]*.whl $out/
done
du -sh $out
