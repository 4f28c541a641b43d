#!/bin/bash
# Fill .carry/fi (git-ignored, 22 MB): FlashInfer and what bench_one_batch imports that the GPU machine's image
# lacks, small enough to travel beside the tree in one device call (FlashInfer's usual carry with the serving
# wheels does not fit 64 MiB). FlashInfer's archive is repacked without the JIT sources of kernels
# our backends never build (its data/csrc folders for MoE, sampling, DSv4, KDA, GDN, Blackwell FP4 and the
# experimental ones: session 14's flashinfer_mla decode and prefill rows built from what is left).
# Takes FlashInfer's archive and its three small wheels from .carry/c1
# (../shared/device/prepare-carry.sh; the cuDNN frontend wheel stays out: MLA and prefill do not import it), and
# pydantic, uvicorn and their dependencies from .carry/slim (tools/device/prepare_serving_carry.sh).
# Beside .carry/flashmla as well (the shootout's attention rows; 64 MiB with the tree at session 14's size), leave
# out bench_one_batch's server wheels, which the shootout does not import: rm .carry/fi/{uvicorn,h11,click}-*.whl
# On the device: bash tools/device/run_fast_path_on_device.sh setup ... (it installs .carry/fi when present).
# Usage, from the repo root: bash tools/device/prepare_flashinfer_carry.sh
set -euo pipefail
out=.carry/fi
for needed in .carry/c1/flashinfer.tar.xz .carry/slim; do
  [ -e $needed ] || { echo "prepare_flashinfer_carry: $needed is missing (see this script's header)" >&2; exit 2; }
done
mkdir -p $out
cp .carry/c1/apache_tvm_ffi-*.whl .carry/c1/cuda_tile-*.whl .carry/c1/torch_c_dlpack_ext-*.whl $out/
work=$(mktemp -d)
trap 'rm -rf $work' EXIT
tar -xJf .carry/c1/flashinfer.tar.xz -C $work
csrc=$work/flashinfer/data/csrc
rm -rf $csrc/cake_dsv4 $csrc/cake_sampling $csrc/cake_fmha $csrc/cake_bgmv_moe $csrc/kda $csrc/gdn $csrc/fused_moe \
  $csrc/experimental $csrc/blackwell_bf16_fp4 $csrc/blackwell_msa $csrc/alphamoe_nvfp4_sm100.cu
(cd $work && tar -cf - *) | xz -T0 -6 > $out/flashinfer.tar.xz
for wheel in pydantic pydantic_core annotated_types typing_inspection uvicorn h11 click; do
  cp .carry/slim/${wheel}-[0-9]*.whl $out/
done
du -sh $out
