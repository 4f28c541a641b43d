#!/bin/bash
# The multi-GPU checks on a lent machine of 2 or 4 GPUs (nvidia-h100-x2 / -x4, nvidia-h200-x2 / -x4), from the repo
# root with the device tool; carry .carry/slim (tools/device/prepare_serving_carry.sh). Results in $OUT.
#   tests     pytest -m multigpu tests: the one-shot all-reduce against NCCL, and the engine's TP / EP / DP
#             attention layouts (speculative decoding among them) against one GPU's and HF transformers' greedy
#             tokens (tests-multigpu.txt); the comm kit over two GPUs (comm-kit.txt)
#   allreduce benchmarks/dev/bench_allreduce.py: NCCL against the symmetric-memory one-shot and two-shot kernels per
#             message size, in CUDA-graph replay, on every GPU (allreduce.{txt,json})
#   tp        V2-Lite (dummy) decode step, bench_one_batch at batch 1 and 64: one GPU, then --tp-size 2 (tp.txt)
#   profile   where V2-Lite's batch-1 decode step goes, one GPU then --tp-size 2: benchmarks/dev/profile_decode with
#             --host-profile (profile-tp{1,2}.txt)
#   fp8kv     one-GPU checks side by side, GPU 0: the shootout's Triton MLA decode rows with a bf16 and an e4m3 KV
#             cache (fp8kv-shootout/); GPU 1: the conformance kit's Triton attention at full shapes (fp8kv-kit.txt)
#   tune      the Triton MoE's per-rank configs for V2-Lite at TP 2 (GPU 0) and TP 2 + EP 2 (GPU 1, after the one-GPU
#             baseline bench there), --quick at batch 1-64, into the package and $OUT/moe_configs.tar; then --tp-size 2 and
#             --tp-size 2 --ep-size 2 with them (tune-*.txt)
#   spec      bench_one_batch on the embedded model (V2-Lite has no NextN layer) with --speculative-algorithm NEXTN
#             over held-out text: a round's time and accept length, one GPU then --tp-size 2 (spec.txt)
# Usage: bash tools/device/run_multi_gpu_on_device.sh [tests] [allreduce] [tp] [profile] [fp8kv] [tune] [spec]
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site ${CARRY:-.carry/slim}/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpus.txt
v2lite="--model-preset deepseek-v2-lite --load-format dummy --input-len 256 --output-len 32 --prefill-attention-backend
  triton --enable-torch-compile --batch-size 1 64 --overlap"
for step in "$@"; do
  start=$SECONDS
  case $step in
    tests)
      timeout 540 python3 -m pytest -q -p no:cacheprovider -m multigpu -rA --durations=0 -o faulthandler_timeout=300 \
        tests/plugins/comm/test_symmetric_memory.py tests/runtime/test_engine_multi_gpu.py \
        > $OUT/tests-multigpu.txt 2>&1
      tail -n 3 $OUT/tests-multigpu.txt
      # The comm kit on two GPUs (NCCL): every comm backend against the oracle, in graph replay too.
      TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p plugserve.conformance.plugin -p no:cacheprovider \
        --pyargs plugserve.conformance -k comm -rA > $OUT/comm-kit.txt 2>&1
      tail -n 3 $OUT/comm-kit.txt ;;
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
    profile)
      for tp in 1 2; do
        devices=$([ $tp = 1 ] && echo 0 || echo 0,1)
        CUDA_VISIBLE_DEVICES=$devices timeout 200 python3 -m benchmarks.dev.profile_decode --model-preset \
          deepseek-v2-lite --load-format dummy --input-len 256 --batch-size 1 --prefill-attention-backend triton \
          --enable-torch-compile --tp-size $tp --host-profile --output $OUT/profile-tp$tp.txt > $OUT/profile-tp$tp.log 2>&1
        echo "tp $tp (rc $?): $(head -n 2 $OUT/profile-tp$tp.txt 2>/dev/null | tr '\n' ' ')"
      done ;;
    tune)
      sizes="--quick --batch-sizes 1 2 4 8 16 32 64 --output-dir $OUT/moe_configs"
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m benchmarks.tune.tune_fused_moe --model v2-lite --tp 2 $sizes \
        > $OUT/tune-tp2.txt 2>&1 &
      (CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m benchmarks.bench_one_batch $v2lite > $OUT/tune-tp1-bench.txt 2>&1
       CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m benchmarks.tune.tune_fused_moe --model v2-lite --tp 2 --ep 2 \
         $sizes > $OUT/tune-tp2-ep2.txt 2>&1)
      wait
      cp $OUT/moe_configs/*.json plugserve/plugins/moe/configs/
      tar -C $OUT -cf $OUT/moe_configs.tar moe_configs && rm -r $OUT/moe_configs  # the names' "=" and "," stay home
      for flags in "--tp-size 2" "--tp-size 2 --ep-size 2"; do
        name=tune-$(echo $flags | tr -d ' -' | sed 's/size//g')-bench
        timeout 200 python3 -m benchmarks.bench_one_batch $v2lite $flags > $OUT/$name.txt 2>&1
      done
      grep -h "^| \|^wrote" $OUT/tune-tp2*.txt
      for f in $OUT/tune-*-bench.txt; do echo "$f: $(grep '^Decode.  median' $f | tr '\n' ' ')"; done ;;
    fp8kv)
      CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/shootout.py --kinds attention --backends attention:triton \
        --kv-cache-dtype auto fp8_e4m3 --output-dir $OUT/fp8kv-shootout > $OUT/fp8kv-shootout.log 2>&1 &
      CUDA_VISIBLE_DEVICES=1 TRITON_INTERPRET=0 timeout 400 python3 -m pytest -q -p plugserve.conformance.plugin -p no:cacheprovider --pyargs \
        plugserve.conformance --plugserve-backend attention:triton --plugserve-shapes full \
        --plugserve-report $OUT/fp8kv-kit.json > $OUT/fp8kv-kit.txt 2>&1
      wait
      tail -n 3 $OUT/fp8kv-kit.txt; grep -i "fp8kv" $OUT/fp8kv-shootout.log | head -n 40 ;;
    spec)
      for tp in 1 2; do
        devices=$([ $tp = 1 ] && echo 0 || echo 0,1)
        CUDA_VISIBLE_DEVICES=$devices timeout 280 python3 -m benchmarks.bench_one_batch --input-len 256 \
          --output-len 32 --batch-size 1 64 --prompt-text benchmarks/data/heldout_docs.txt --tp-size $tp --speculative-algorithm NEXTN > $OUT/spec$tp.txt 2>&1
        echo "spec tp $tp (rc $?): $(grep '^Decode.  median' $OUT/spec$tp.txt | tr '\n' ' ')"
      done | tee $OUT/spec.txt ;;
  esac
  echo "[$step: $((SECONDS - start)) s]"
done
