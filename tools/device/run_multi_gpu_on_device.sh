#!/bin/bash
# The multi-GPU checks on a lent machine of 2 or 4 GPUs (nvidia-h100-x2 / -x4, nvidia-h200-x2 / -x4), from the repo
# root with the device tool; carry .carry/slim (tools/device/prepare_serving_carry.sh). Results in $OUT.
#   tests     pytest -m multigpu tests: the one-shot all-reduce against NCCL, and the engine's TP / EP / DP
#             attention layouts against one GPU's and HF transformers' greedy tokens (tests-multigpu.txt)
#   allreduce benchmarks/dev/bench_allreduce.py: NCCL against the symmetric-memory one-shot and two-shot kernels per
#             message size, in CUDA-graph replay, on every GPU (allreduce.{txt,json})
#   tp        V2-Lite (dummy) decode step, bench_one_batch at batch 1 and 64: one GPU, then --tp-size 2 (tp.txt)
# Usage: bash tools/device/run_multi_gpu_on_device.sh [tests] [allreduce] [tp]
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/slim/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpus.txt
v2lite="--model-preset deepseek-v2-lite --load-format dummy --input-len 256 --output-len 32 --prefill-attention-backend
  triton --enable-torch-compile --batch-size 1 64 --overlap"
for step in "$@"; do
  start=$SECONDS
  case $step in
    tests)
      timeout 540 python3 -m pytest -q -p no:cacheprovider -m multigpu -rA --durations=0 -o faulthandler_timeout=300 \
        tests/core/test_symmetric_all_reduce.py tests/runtime/test_engine_multi_gpu.py \
        > $OUT/tests-multigpu.txt 2>&1
      tail -n 3 $OUT/tests-multigpu.txt ;;
    allreduce)
      timeout 120 python3 -m benchmarks.dev.bench_allreduce --output $OUT/allreduce.json > $OUT/allreduce.txt 2>&1
      grep -v "^ \|Traceback\|Error" $OUT/allreduce.txt ;;
    tp)
      for tp in 1 2; do
        devices=$([ $tp = 1 ] && echo 0 || echo 0,1)
        CUDA_VISIBLE_DEVICES=$devices timeout 280 python3 -m benchmarks.bench_one_batch $v2lite --tp-size $tp \
          > $OUT/tp$tp.txt 2>&1
        echo "tp $tp (rc $?): $(grep '^all_reduce\|^Decode.  median' $OUT/tp$tp.txt | tr '\n' ' ')"
      done | tee $OUT/tp.txt ;;
  esac
  echo "[$step: $((SECONDS - start)) s]"
done
