#!/bin/bash
# The GPU fast path (issue 10) on the lent GPU machine, from the repo root with the device tool.
# Carry: .carry/slim (tools/device/prepare_serving_carry.sh: the serving wheels for Python 3.12), and for FlashInfer
# either .carry/c1 (../shared/device/prepare-carry.sh; with .carry/slim it no longer fits beside the tree in one
# call) or, instead of both, .carry/fi (tools/device/prepare_flashinfer_carry.sh: FlashInfer and the few wheels the
# benchmarks import). Steps run in the order given; results in $OUT/r, returned as $OUT/results.tgz.
#   setup                 the carried wheels and FlashInfer into /tmp/site
#   kit:NAME              the kit's CUDA-graph tests for attention backend NAME, full shapes, bf16
#   conf:TAG:ARGS         the kit (plugserve.conformance, against its float64 oracle) with pytest ARGS, e.g.
#                         --plugserve-backend,moe:triton,--plugserve-dtypes,bfloat16 -> conf-TAG.{txt,json}
#   decode:TAG:ARGS       benchmarks/bench_decode_vs_hf.py with ARGS (commas for spaces) -> decode-TAG.{json,txt}
#   profile:TAG:ARGS      benchmarks/dev/profile_decode.py with ARGS -> profile-TAG.txt (kernel time per decode step)
#   tune:TAG:ARGS         benchmarks/tune/tune_fused_moe.py with ARGS, configs into $res/moe-configs-TAG (which starts
#                         as a copy of the shipped ones, for --update) and into plugserve/plugins/moe/configs for
#                         the steps after it
#   gtune:TAG:ARGS        benchmarks/tune/tune_fp8_gemm.py with ARGS, configs into $res/gemm-configs-TAG (a copy of
#                         the shipped ones first, for --update) and into
#                         plugserve/plugins/gemm/configs for the steps after it
#   one:TAG:ARGS          benchmarks/bench_one_batch.py with ARGS -> one-TAG.{jsonl,txt}
#   specvs:TAG:ARGS       decode tokens/s without and with speculative decoding (CUDA graphs on both sides):
#                         bench_one_batch with ARGS, then with ARGS + $SPEC_FLAGS (default NEXTN, 3 steps)
#                         -> specvs-TAG-{base,spec}.{jsonl,txt} and the comparison specvs-TAG.txt
#   tests:TAG:ARGS        pytest with ARGS (this repo's tests that need a GPU, e.g. tests/core/test_distributed.py)
#                         -> tests-TAG.txt
#   accuracy:TAG:ARGS     benchmarks/accuracy.py with ARGS on the GPU (default: the embedded model, every backend)
#                         -> accuracy-TAG.{json,txt}
#   serving:TAG:ARGS      a server with ARGS + bench_serving (256 prompts 256/128, concurrency 64) -> serving-TAG.*
#   py:TAG:MODULE,ARGS    python3 -m benchmarks.MODULE ARGS (a sweep, bench or tuner: dev.sweep_triton_mla,
#                         tune.tune_fused_moe, ...; `{res}` in ARGS is the results folder) -> py-TAG.txt
#   env:NAME:VALUE        export NAME=VALUE (commas for spaces) for the steps after it (an empty VALUE unsets
#                         NAME), e.g. env:SPEC_FLAGS:--speculative-algorithm,NEXTN,--speculative-eagle-topk,4
# In ARGS a comma stands for a space and a doubled comma for a comma. Each step ends after $STEP_TIMEOUT
# seconds (300).
set -uo pipefail
site=/tmp/site
res=$OUT/r
mkdir -p $site $res
export PYTHONPATH=$site:$PWD TRITON_INTERPRET=0 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
trap 'tar czf $OUT/results.tgz -C $OUT r' EXIT
limit=${STEP_TIMEOUT:-300}
for step in "$@"; do
  start=$SECONDS
  IFS=: read -r kind tag args <<< "$step"
  args=${args//,,/$'\x1f'}  # a doubled comma is a literal one (e.g. --plugserve-dtypes,float16,,float32)
  args=${args//,/ }
  args=${args//$'\x1f'/,}
  case $kind in
    env)
      if [ -n "$args" ]; then export "$tag=$args"; else unset "$tag"; fi
      echo "env $tag=${args}" ;;
    setup)
      for carry in slim fi; do
        [ -d .carry/$carry ] && python3 -m pip install -q --no-index --no-deps --target $site .carry/$carry/*.whl 2>&1 | tail -2
      done
      [ -f .carry/c1/install-on-device.sh ] && bash .carry/c1/install-on-device.sh > /dev/null
      [ -f .carry/fi/flashinfer.tar.xz ] && [ ! -d $site/flashinfer ] && tar -xJf .carry/fi/flashinfer.tar.xz -C $site
      nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $res/gpu.txt ;;
    kit)
      (cd /tmp && timeout $limit python3 -m pytest -q -p plugserve.conformance.plugin -p no:cacheprovider --pyargs \
        plugserve.conformance --plugserve-backend attention:$tag --plugserve-shapes full --plugserve-dtypes bfloat16 \
        -k graph --plugserve-report $res/kit-graph-$tag.json > $res/kit-graph-$tag.txt 2>&1)
      echo "kit $tag: $(tail -n 1 $res/kit-graph-$tag.txt)" ;;
    conf)
      (cd /tmp && timeout $limit python3 -m pytest -q -p plugserve.conformance.plugin -p no:cacheprovider --pyargs \
        plugserve.conformance $args --plugserve-report $res/conf-$tag.json > $res/conf-$tag.txt 2>&1)
      echo "conf $tag: $(tail -n 1 $res/conf-$tag.txt)" ;;
    decode)
      timeout $limit python3 -m benchmarks.bench_decode_vs_hf $args --result-filename $res/decode-$tag.json \
        > $res/decode-$tag.txt 2>&1
      echo "decode $tag (rc $?):"; grep -v "INFO\|it/s]" $res/decode-$tag.txt | tail -n 14 ;;
    profile)
      timeout $limit python3 -m benchmarks.dev.profile_decode $args --output $res/profile-$tag.txt > $res/profile-$tag.log 2>&1
      echo "profile $tag:"; head -n 30 $res/profile-$tag.txt ;;
    tune)
      mkdir -p $res/moe-configs-$tag
      cp plugserve/plugins/moe/configs/*.json $res/moe-configs-$tag/
      timeout $limit python3 -m benchmarks.tune.tune_fused_moe $args --output-dir $res/moe-configs-$tag > $res/tune-$tag.log 2>&1
      cp $res/moe-configs-$tag/*.json plugserve/plugins/moe/configs/ 2>/dev/null
      echo "tune $tag:"; tail -n 5 $res/tune-$tag.log; ls $res/moe-configs-$tag ;;
    gtune)
      mkdir -p $res/gemm-configs-$tag
      cp plugserve/plugins/gemm/configs/*.json $res/gemm-configs-$tag/
      timeout $limit python3 -m benchmarks.tune.tune_fp8_gemm $args --output-dir $res/gemm-configs-$tag > $res/gtune-$tag.log 2>&1
      cp $res/gemm-configs-$tag/*.json plugserve/plugins/gemm/configs/ 2>/dev/null
      echo "gtune $tag:"; grep "M=\|wrote\|took" $res/gtune-$tag.log | tail -n 12 ;;
    one)
      timeout $limit python3 -m benchmarks.bench_one_batch $args --result-filename $res/one-$tag.jsonl \
        > $res/one-$tag.txt 2>&1
      echo "one $tag (rc $?):"; grep -i "^Decode.  median\|^Prefill\|backend\|error" $res/one-$tag.txt | tail -n 12 ;;
    specvs)
      spec_flags=${SPEC_FLAGS:---speculative-algorithm NEXTN --speculative-num-steps 3}
      for side in base spec; do
        extra=$([ $side = spec ] && echo "$spec_flags")
        timeout $limit python3 -m benchmarks.bench_one_batch $args $extra \
          --result-filename $res/specvs-$tag-$side.jsonl > $res/specvs-$tag-$side.txt 2>&1
        echo "specvs $tag $side (rc $?): $(grep '^cuda_graph' $res/specvs-$tag-$side.txt)"
      done
      python3 - $res/specvs-$tag-base.jsonl $res/specvs-$tag-spec.jsonl <<'PY' | tee $res/specvs-$tag.txt
import json, sys
base, spec = ({(r["batch_size"], r["input_len"]): r for r in map(json.loads, open(f))} for f in sys.argv[1:])
print(f"{'batch':>5} {'input':>5} {'base tok/s':>11} {'spec tok/s':>11} {'speedup':>7} {'accept':>6}")
for key in sorted(base.keys() & spec.keys()):
    b, s = base[key]["decode_throughput"], spec[key]["decode_throughput"]
    print(f"{key[0]:>5} {key[1]:>5} {b:>11.1f} {s:>11.1f} {s / b:>6.2f}x {spec[key]['accept_length']:>6.2f}")
PY
      ;;
    tests)
      timeout $limit python3 -m pytest -q -p no:cacheprovider $args > $res/tests-$tag.txt 2>&1
      echo "tests $tag: $(tail -n 1 $res/tests-$tag.txt)" ;;
    accuracy)
      timeout $limit python3 -m benchmarks.accuracy $args --device cuda --result-filename $res/accuracy-$tag.json \
        > $res/accuracy-$tag.txt 2>&1
      echo "accuracy $tag (rc $?):"; grep -v "INFO\|it/s]" $res/accuracy-$tag.txt | tail -n 24 ;;
    py)
      timeout $limit python3 -m benchmarks.${args//\{res\}/$res} > $res/py-$tag.txt 2>&1
      echo "py $tag (rc $?):"; tail -n 25 $res/py-$tag.txt ;;
    serving)
      python3 -m plugserve.server $args --port 30000 --log-level warning > $res/server-$tag.log 2>&1 &
      server=$!
      for i in $(seq $limit); do curl -sf localhost:30000/health > /dev/null && break; sleep 1; done
      timeout $limit python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 256 \
        --random-input-len 256 --random-output-len 128 --random-range-ratio 1 --max-concurrency 64 \
        --output-file $res/serving-$tag.jsonl --disable-tqdm > $res/serving-$tag.txt 2>&1
      curl -s localhost:30000/server_info > $res/server_info-$tag.json
      kill $server; wait $server 2>/dev/null
      echo "serving $tag:"; grep -i "throughput\|TPOT\|Successful" $res/serving-$tag.txt | head -8 ;;
  esac
  echo "[$step: $((SECONDS - start)) s]"
done
