#!/bin/bash
# Train plugserve's embedded default model on one GPU, export it in DeepSeek-V3's block-FP8 format and check the
# export (training/README.md). Run from the repo root on the GPU machine, through the device tool, carrying
# .carry/training (python -m training.prepare_data) and .carry/slim (bash tools/device/prepare_serving_carry.sh):
#     bash training/run_on_device.sh
# Writes into $OUT: losses.json, loss_curve.png and model/ (6 files): 8 files, each under the tool's 16 MiB.
# TIME_BUDGET (seconds of training, evaluations included; default 240) and extra arguments of training.train
# pass through.
set -euo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:?OUT is not set: this script runs through the device tool}
data=.carry/training
for f in corpus.json train.bin val.bin tokenizer/tokenizer.json tokenizer/tokenizer_config.json; do
  [ -f "$data/$f" ] || { echo "FAILED: $data/$f is missing: run python -m training.prepare_data, carry $data" >&2; exit 1; }
done
ls .carry/slim/transformers-*.whl >/dev/null 2>&1 ||
  { echo "FAILED: .carry/slim has no wheels: run bash tools/device/prepare_serving_carry.sh, carry .carry/slim" >&2; exit 1; }

echo "== installing the carried wheels ($(ls .carry/slim | wc -l))"
# transformers 5.23 as here (the image's is older), and plugserve's own dependencies for the check.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/slim/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "
import torch, transformers, matplotlib
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__)
assert torch.cuda.is_available(), 'torch sees no GPU'
"

echo "== training, export, check"
python3 -m training.train --out "$out" --time-budget "${TIME_BUDGET:-240}" --verify "$@"
echo "== done; in \$OUT: $(cd "$out" && find . -type f | sort | tr '\n' ' ')"
