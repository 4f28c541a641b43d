#!/bin/bash
# Fill .carry/mg (git-ignored, about 31 MB) for tools/device/run_multi_gpu_on_device.sh: the serving wheels of
# .carry/slim (tools/device/prepare_serving_carry.sh) without the grammar tests' client side (openai,
# jsonschema_rs), so that they travel with the tree within a call's 64 MiB. FlashInfer (the all-reduce benchmark's
# FlashInfer rows) does not fit beside them: a carry folder holding flashinfer.tar.xz (.carry/fi) is untarred too.
# Usage, from the repo root: bash tools/device/prepare_multi_gpu_carry.sh
set -euo pipefail
out=.carry/mg
[ -e .carry/slim ] || { echo "prepare_multi_gpu_carry: run tools/device/prepare_serving_carry.sh first" >&2; exit 2; }
rm -rf $out && mkdir -p $out
cp .carry/slim/*.whl $out/
rm -f $out/jsonschema_rs-*.whl $out/openai-*.whl
du -sh $out
