#!/bin/bash
# The multi-GPU checks on a lent machine of 2 or 4 GPUs (nvidia-h100-x2 / -x4, nvidia-h200-x2 / -x4), from the repo
# root with the device tool; carry .carry/mg (tools/device/prepare_multi_gpu_carry.sh: the serving wheels; a
# folder with FlashInfer in CARRY too). Results in $OUT. Steps that need one GPU run on GPU $GPU (default 0), so
# that several can run side by side on a 4-GPU machine (`GPU=2 bash ... kits & GPU=3 bash ... serving & wait`).
#   tests     pytest -m multigpu tests on every visible GPU: the one-shot all-reduce against NCCL, and the engine's
#             TP / EP / DP attention layouts (speculative decoding among them) at 2 and 4 ranks against one GPU's and
#             HF transformers' greedy tokens (tests-multigpu.txt; TESTS_K selects with -k)
#   comm-kit  the conformance kit's comm cases over two GPUs and, where visible, four (comm-kit.txt)
#   comm-shootout  the shootout's comm rows (every comm backend per message size at each world the GPUs allow),
#             merged into this GPU's selection table, copied to $OUT (comm-shootout*)
#   allreduce benchmarks/dev/bench_allreduce.py: NCCL against the symmetric-memory one-shot and two-shot kernels and
#             FlashInfer's (alone and fused with the residual add and RMSNorm) per message size, in CUDA-graph replay,
#             on every visible GPU (allreduce.{txt,json})
#   tp        V2-Lite (dummy) decode step, bench_one_batch at batch 1 and 64: one GPU, then --tp-size 2 (tp.txt)
#   v3        V3 FP8 (dummy, 20 layers) on four GPUs, bench_one_batch at batch 1, 32 and 256: --tp-size 4, then DP
#             attention 4 + EP 4 (v3-*.txt; V3_LAYOUTS="tp4" runs the first alone, "tp4-sef" is TP 4 with
#             --enable-shared-experts-fusion)
#   v3-profile where TP 4's step goes at batch $V3_PROFILE_BATCH (default 1), with $V3_PROFILE_FLAGS more (e.g.
#             --no-pdl, or DP attention's): benchmarks/dev/profile_decode (v3-profile-$V3_PROFILE_NAME.txt)
#   profile   where V2-Lite's batch-1 decode step goes, one GPU then --tp-size 2: benchmarks/dev/profile_decode with
#             --host-profile (profile-tp{1,2}.txt)
#   fp8kv     one-GPU checks side by side, GPU 0: the shootout's Triton MLA decode rows with a bf16 and an e4m3 KV
#             cache (fp8kv-shootout/); GPU 1: the conformance kit's Triton attention at full shapes (fp8kv-kit.txt)
#   tune-v3   the Triton MoE's and FP8 GEMM's configs for V3's per-rank shapes at TP 4 and EP 4, GPUs 0-2 at once,
#             --quick at batch 1, 8, 32 and 256 (tune-v3-*.txt, v3_configs.tar); run v3 after it to use them
#   ncu-fp8kv GPU $GPU: ncu on the Triton MLA decode at batch 64 x 8192 keys, 128 heads, from a bf16 and from an e4m3
#             KV cache (benchmarks/dev/profile_triton_kernels.py; ncu-mla-*.txt)
#   accuracy  GPU $GPU: the embedded model's perplexity over a bf16 and an e4m3 KV cache through the Triton attention,
#             against the float32 reference (benchmarks/accuracy.py --cached; accuracy-fp8kv.*)
#   kits      GPU $GPU: the kit's batch-invariance cases of the Triton attention, GEMM and MoE in bfloat16, compiled,
#             and the batch-invariant mode's tests (kits-invariant.txt)
#   determinism-tests GPU $GPU: the deterministic-inference tests on the GPU (graphs, overlap)
#   determinism GPU $GPU: V2-Lite's decode step with and without --enable-deterministic-inference (determinism-*.txt)
#   serving   GPU $GPU: V2-Lite (dummy) served, time to /health cold then warm (a second start), bench_serving 256
#             prompts 256 in / 128 out at concurrency 64: plain, JSON schema, and with --enable-mixed-chunk
#             (serving-gpu$GPU.tgz: logs, bench outputs; SERVING_RUNS="cold" runs the first server alone)
#   serving-profile GPU $GPU: V2-Lite served, /start_profile over 40 steps of a concurrency-64 bench, plain then
#             under a JSON schema: where a constrained step's time goes (profiles-gpu$GPU.tgz)
#   serving-scale all four GPUs: bench_serving at concurrency 64, 256 and 1024 on V3 FP8 (20 layers) and V2-Lite,
#             TP 4 against DP attention 4 + EP 4 (serving-scale.tgz; SCALE_MODELS, SCALE_LAYOUTS, SCALE_CONCURRENCY)
#   tune-gemm GPU $GPU: the FP8 GEMM configs of the per-rank shapes $GEMM_SHAPES ("N,K ..."), --quick at batch 1, 32
#             and 256 (tune-gemm-gpu$GPU.txt, gemm_configs-gpu$GPU.tar)
#   tune      the Triton MoE's per-rank configs for V2-Lite at TP 2 (GPU 0) and TP 2 + EP 2 (GPU 1, after the one-GPU
#             baseline bench there), --quick at batch 1-64, into the package and $OUT/moe_configs.tar; then --tp-size 2 and
#             --tp-size 2 --ep-size 2 with them (tune-*.txt)
#   spec      bench_one_batch on the embedded model (V2-Lite has no NextN layer) with --speculative-algorithm NEXTN
#             over held-out text: a round's time and accept length, one GPU then --tp-size 2 (spec.txt)
# Usage: bash tools/device/run_multi_gpu_on_device.sh [STEP ...]
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD
carry=${CARRY:-.carry/mg}
extra=${CARRY_EXTRA:-.carry/extra}  # where carried: the openai client (server tests) and py-spy (serving-profile)
if [ ! -e /tmp/site/.installed ]; then  # once per machine: steps may run side by side
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $carry/*.whl $(ls $extra/*.whl 2>/dev/null) 2>&1 \
    | tail -1
  [ -f $carry/flashinfer.tar.xz ] && tar -xJf $carry/flashinfer.tar.xz -C /tmp/site
  # The package's bytecode, as an install writes it (a fresh copy of the tree has none: 3.3 s of a cold start).
  python3 -m compileall -q plugserve | tail -1
  touch /tmp/site/.installed
fi
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
gpu=${GPU:-0}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpus.txt
v3="--model-preset deepseek-v3 --num-layers 20 --load-format dummy --input-len 256 --output-len 32
  --prefill-attention-backend triton --enable-torch-compile --overlap --tp-size 4"
v2lite="--model-preset deepseek-v2-lite --load-format dummy --input-len 256 --output-len 32 --prefill-attention-backend
  triton --enable-torch-compile --batch-size 1 64 --overlap"
schema='{"type": "object", "properties": {"answer": {"type": "string", "minLength": 4096}}, "required": ["answer"],
  "additionalProperties": false}'
# start_server NAME PORT DEVICES FLAGS...: `plugserve serve FLAGS` on DEVICES in the background ($server), then wait for
# /health (or its death); logs to serving-NAME-server.log.
start_server() {
  local name=$1 port=$2 devices=$3 started=$SECONDS; shift 3
  CUDA_VISIBLE_DEVICES=$devices python3 -m plugserve serve --port $port "$@" > $OUT/serving-$name-server.log 2>&1 &
  server=$!
  for i in $(seq 900); do
    curl -s localhost:$port/health | grep -q ok && break
    kill -0 $server 2>/dev/null || break
    sleep 0.5
  done
  echo "$name start: $((SECONDS - started)) s to /health ok"
}
# bench NAME PORT CONCURRENCY PROMPTS [FLAGS...]: bench_serving's random prompts of 256 in / 128 out (serving-NAME.*).
bench() {
  local name=$1 port=$2 conc=$3 prompts=$4; shift 4
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:$port \
    --backend openai-chat --num-prompts $prompts --random-input-len 256 --random-output-len 128 \
    --random-range-ratio 1 --max-concurrency $conc --disable-tqdm "$@" \
    --output-file $OUT/serving-$name.jsonl > $OUT/serving-$name.txt 2>&1
  echo "$name: $(grep -i 'output token throughput\|median tpot\|median ttft' $OUT/serving-$name.txt \
    | tr -s ' ' | tr '\n' ';')"
}
for step in "$@"; do
  start=$SECONDS
  case $step in
    tests)
      timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -m multigpu -rA --durations=0 \
        -o faulthandler_timeout=300 ${TESTS_K:+-k "$TESTS_K"} tests/plugins/comm/test_symmetric_memory.py \
        tests/runtime/test_engine_multi_gpu.py > $OUT/tests-multigpu${TESTS_K:+-$TESTS_K}.txt 2>&1
      tail -n 3 $OUT/tests-multigpu${TESTS_K:+-$TESTS_K}.txt ;;
    comm-kit)
      # Every comm backend against the oracle at two ranks and, with four GPUs visible, four; graph replay too.
      TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p plugserve.conformance.plugin -p no:cacheprovider \
        --pyargs plugserve.conformance -k comm -rA > $OUT/comm-kit.txt 2>&1
      tail -n 3 $OUT/comm-kit.txt ;;
    comm-shootout)
      # Every comm backend per message size at 2 and 4 ranks, ranked into this GPU's selection table (copied to
      # $OUT), which the runs after it in the same call read.
      table=plugserve/tables/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr ' ' _).json
      timeout ${COMM_TIMEOUT:-200} python3 benchmarks/shootout.py --kinds comm --output-dir $OUT/comm-shootout \
        --merge-into $table > $OUT/comm-shootout.txt 2>&1
      cp $table $OUT/
      grep -i "order\|^ *w[0-9]\|error" $OUT/comm-shootout.txt | head -n 40 ;;
    allreduce)
      timeout ${ALLREDUCE_TIMEOUT:-240} python3 -m benchmarks.dev.bench_allreduce --output $OUT/allreduce.json \
        > $OUT/allreduce.txt 2>&1
      grep -v "^ \|Traceback\|Error" $OUT/allreduce.txt ;;
    v3)
      for layout in ${V3_LAYOUTS:-tp4 dp4-ep4}; do
        case $layout in
          dp4-ep4) flags="--enable-dp-attention --dp-size 4 --ep-size 4" ;;
          tp4-sef) flags=--enable-shared-experts-fusion ;;
          *) flags= ;;
        esac
        timeout 240 python3 -m benchmarks.bench_one_batch $v3 --batch-size 1 32 256 $flags > $OUT/v3-$layout.txt 2>&1
        echo "v3 $layout (rc $?): $(grep '^all_reduce\|^Decode.  median' $OUT/v3-$layout.txt | tr '\n' ' ')"
      done ;;
    v3-profile)
      name=v3-profile-${V3_PROFILE_NAME:-tp4}
      timeout 150 python3 -m benchmarks.dev.profile_decode $v3 --batch-size ${V3_PROFILE_BATCH:-1} \
        ${V3_PROFILE_FLAGS:-} --output $OUT/$name.txt > $OUT/$name.log 2>&1
      echo "$name (rc $?): $(head -n 2 $OUT/$name.txt 2>/dev/null | tr '\n' ' ')" ;;
    tune-v3)
      # GPUs 0-2 at once: the MoE at TP 4 and at EP 4, the per-rank FP8 GEMM shapes at TP 4 (DP 4 + EP 4 shares
      # them); into the package's config folders (where bench_one_batch reads them) and $OUT/v3_configs.tar.
      quick="--quick --batch-sizes 1 8 32 256"
      moe="timeout ${TUNE_TIMEOUT:-240} python3 -m benchmarks.tune.tune_fused_moe --model v3 --tp 4"
      CUDA_VISIBLE_DEVICES=0 $moe $quick > $OUT/tune-v3-moe-tp4.txt 2>&1 &
      CUDA_VISIBLE_DEVICES=1 $moe --ep 4 $quick > $OUT/tune-v3-moe-ep4.txt 2>&1 &
      CUDA_VISIBLE_DEVICES=2 timeout ${TUNE_TIMEOUT:-240} python3 -m benchmarks.tune.tune_fp8_gemm --shapes \
        6144,1536 7168,4096 1024,7168 7168,512 8192,512 256,512 9216,7168 7168,4608 --quick --batch-sizes 1 32 256 \
        > $OUT/tune-v3-gemm-tp4.txt 2>&1 &
      wait
      # The names hold a space ("block_shape=[128, 128]"): NUL-separated.
      git ls-files -z -o --exclude-standard plugserve/plugins/moe/configs plugserve/plugins/gemm/configs \
        | tar --null -T - -cf $OUT/v3_configs.tar
      echo "tuned: $(tar -tf $OUT/v3_configs.tar | wc -l) files"; tail -n 2 $OUT/tune-v3-*.txt ;;
    tune-gemm)
      CUDA_VISIBLE_DEVICES=$gpu timeout ${TUNE_TIMEOUT:-400} python3 -m benchmarks.tune.tune_fp8_gemm --shapes \
        $GEMM_SHAPES --quick --batch-sizes 1 32 256 > $OUT/tune-gemm-gpu$gpu.txt 2>&1
      git ls-files -z -o --exclude-standard plugserve/plugins/gemm/configs | tar --null -T - -cf $OUT/gemm_configs-gpu$gpu.tar
      echo "tuned: $(tar -tf $OUT/gemm_configs-gpu$gpu.tar | wc -l) files"; tail -n 2 $OUT/tune-gemm-gpu$gpu.txt ;;
    ncu-fp8kv)
      ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
      for kv in auto fp8_e4m3; do
        CUDA_VISIBLE_DEVICES=$gpu timeout 240 $ncu --section SpeedOfLight --section ComputeWorkloadAnalysis \
          --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy -k regex:'mla_kernel' -c 2 \
          python3 benchmarks/dev/profile_triton_kernels.py --kv-cache-dtype $kv > $OUT/ncu-mla-$kv.txt 2>&1
        echo "$kv (rc $?): $(grep -E '^\s+(Duration|Compute \(SM\) Throughput|Memory Throughput)' \
          $OUT/ncu-mla-$kv.txt | tail -n 3 | tr -s ' ' | tr '\n' ';')"
      done ;;
    accuracy)
      CUDA_VISIBLE_DEVICES=$gpu timeout 240 python3 -m benchmarks.accuracy --device cuda --cached --combos \
        attention=triton,dtype=bfloat16 attention=triton,dtype=bfloat16,kv=fp8_e4m3 --max-text-tokens 2048 \
        --window 512 --text-batch 4 --result-filename $OUT/accuracy-fp8kv.json > $OUT/accuracy-fp8kv.txt 2>&1
      tail -n 8 $OUT/accuracy-fp8kv.txt ;;
    kits)
      CUDA_VISIBLE_DEVICES=$gpu TRITON_INTERPRET=0 timeout 400 python3 -m pytest -q -p plugserve.conformance.plugin \
        -p no:cacheprovider --pyargs plugserve.conformance --plugserve-backend attention:triton --plugserve-backend \
        gemm:triton --plugserve-backend moe:triton --plugserve-dtypes bfloat16 -k batch_invariant -rf \
        > $OUT/kits-invariant.txt 2>&1
      tail -n 3 $OUT/kits-invariant.txt
      CUDA_VISIBLE_DEVICES=$gpu timeout 200 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/core/test_batch_invariant.py >> $OUT/kits-invariant.txt 2>&1
      tail -n 3 $OUT/kits-invariant.txt ;;
    determinism-tests)
      # The end-to-end checks on the GPU (the embedded model on cuda: CUDA graphs, overlap): the same greedy request
      # cold, cached, batched, streamed gives the same tokens and logprobs under --enable-deterministic-inference.
      CUDA_VISIBLE_DEVICES=$gpu timeout 300 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/runtime/test_deterministic_inference.py tests/server/test_deterministic_inference.py \
        > $OUT/determinism-tests.txt 2>&1
      tail -n 3 $OUT/determinism-tests.txt ;;
    determinism)
      for mode in default deterministic; do
        flags=$([ $mode = deterministic ] && echo --enable-deterministic-inference)
        CUDA_VISIBLE_DEVICES=$gpu timeout 280 python3 -m benchmarks.bench_one_batch $v2lite $flags \
          > $OUT/determinism-$mode.txt 2>&1
        echo "$mode (rc $?): $(grep '^Decode.  median' $OUT/determinism-$mode.txt | tr '\n' ' ')"
      done ;;
    serving)
      # A string no 128 tokens can close: every request runs its 128 tokens under the grammar, as the plain run does.
      for run in ${SERVING_RUNS:-cold warm mixed}; do
        flags=$([ $run = mixed ] && echo --enable-mixed-chunk)
        start_server $run $((30000 + gpu)) $gpu --model-preset deepseek-v2-lite --load-format dummy $flags
        bench $run-plain $((30000 + gpu)) 64 256
        [ $run = cold ] && bench $run-json $((30000 + gpu)) 64 256 --json-schema "$schema"
        kill $server; wait $server
      done
      tar -C $OUT -czf $OUT/serving-gpu$gpu.tgz $(cd $OUT && ls serving-*.txt serving-*.log serving-*.jsonl) && \
        rm $OUT/serving-*.txt $OUT/serving-*.log $OUT/serving-*.jsonl ;;
    serving-profile)
      # /start_profile over 40 steps of steady decoding in a bench of 512 prompts at concurrency 64, plain then under
      # the JSON schema:
      # torch's profiler on the server's scheduler thread and GPU (tables and traces in profiles-gpu$GPU.tgz).
      port=$((30100 + gpu))
      start_server profile $port $gpu --model-preset deepseek-v2-lite --load-format dummy
      for run in plain json; do
        extra=(); [ $run = json ] && extra=(--json-schema "$schema")
        bench profile-$run $port 64 512 "${extra[@]}" &
        running=$!
        # Steady decoding: all 64 running (the client's warm-up request and the first prefills past), then a
        # little more.
        for i in $(seq 240); do
          n=$(curl -s localhost:$port/metrics | awk '/^plugserve_num_running_requests/ {print int($2)}')
          [ "${n:-0}" -ge 64 ] && break
          sleep 0.25
        done
        sleep ${PROFILE_AFTER:-3}
        # Where py-spy is installed (a carried wheel), a sample of every thread's Python stacks first.
        spy=$(command -v py-spy || ls /tmp/site/bin/py-spy 2>/dev/null)
        # Every thread's stacks, then only the GIL holder's (who keeps the others waiting).
        [ -n "$spy" ] && for gil in "" --gil; do
          timeout 20 $spy record -p $server -d 3 -r 500 --threads $gil -f raw \
            -o $OUT/profile-$run${gil:+-gil}-pyspy.txt >> $OUT/profile-$run-pyspy.log 2>&1
        done
        curl -s -X POST localhost:$port/start_profile -H 'Content-Type: application/json' \
          -d "{\"output_dir\": \"$OUT/profile-$run\", \"num_steps\": 40}"; echo
        wait $running
        head -n 1 $OUT/profile-$run/*.txt
      done
      kill $server; wait $server
      tar -C $OUT -czf $OUT/profiles-gpu$gpu.tgz profile-plain profile-json $(cd $OUT && ls serving-profile-* \
        profile-*-pyspy.*) && rm -r $OUT/profile-plain $OUT/profile-json $OUT/serving-profile-* $OUT/profile-*-pyspy.* ;;
    serving-scale)
      # bench_serving on the four GPUs: V3 FP8 (20 layers) and V2-Lite, dummy weights, TP 4 against DP attention 4 +
      # EP 4, at concurrency 64, 256 and 1024 (256, 512 and 1024 prompts of 256 in / 128 out); up to 1024 requests
      # running, decode graphs up to 256 (serving-scale.tgz).
      for model in ${SCALE_MODELS:-v3 v2lite}; do
        weights=$([ $model = v3 ] && echo --model-preset deepseek-v3 --num-layers 20 \
          || echo --model-preset deepseek-v2-lite)
        for layout in ${SCALE_LAYOUTS:-tp4 dp4-ep4}; do
          flags=$([ $layout = dp4-ep4 ] && echo --enable-dp-attention --dp-size 4 --ep-size 4)
          start_server $model-$layout 30200 0,1,2,3 $weights --load-format dummy --tp-size 4 $flags \
            --max-running-requests 1024 --cuda-graph-max-bs 256
          for conc in ${SCALE_CONCURRENCY:-64 256 1024}; do
            bench $model-$layout-c$conc 30200 $conc $([ $conc = 64 ] && echo 256 || echo $((conc > 512 ? conc : 512)))
          done
          kill $server; wait $server
        done
      done
      tar -C $OUT -czf $OUT/serving-scale.tgz $(cd $OUT && ls serving-v3-* serving-v2lite-* 2>/dev/null) && \
        rm -f $OUT/serving-v3-* $OUT/serving-v2lite-* ;;
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
