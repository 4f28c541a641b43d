#!/bin/bash
# Every backend on the lent GPU machine: install what it lacks, build FlashMLA and DeepGEMM, run the
# conformance kit per backend at full DeepSeek-V3 shapes, the shootout of every usable backend.
# From the repo root, with the device tool; steps run in the order given:
#   setup                  slim wheels + FlashInfer (+ flash-attn-4 when call A staged it: see
#                          ../shared/device/README.md) into /tmp/site
#   build                  FlashMLA and DeepGEMM in the background (tools/device/build_*.sh; .carry/flashmla, .carry/deepgemm)
#   wait                   until both builds end
#   kit:KIND:NAME[:DTYPES] the kit at full shapes for one backend (default dtypes bfloat16)
#   backends               `plugserve backends --json --explain`
#   shootout[:KINDS]       benchmarks/shootout.py over every usable backend (KINDS comma-separated; more
#                          arguments in $SHOOTOUT_ARGS)
# Carry: .carry/slim .carry/c1 .carry/flashmla .carry/deepgemm .carry/cutlass (+ .carry/dsl_b for flash-attn-4).
# Kit and shootout steps end after $STEP_TIMEOUT seconds (240). Results go to $OUT/r and come back as one archive, $OUT/results.tgz (the tool returns few files).
# The machine keeps /tmp/site and the JIT caches while it stays warm, so calls made back to back can
# split the steps: setup build kit:... in one, wait kit:... shootout in the next.
set -uo pipefail
site=/tmp/site
res=$OUT/r
mkdir -p $site $res
export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages:$PWD TRITON_INTERPRET=0
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PLUGSERVE_CUTLASS_DIR=/tmp/cutlass PLUGSERVE_BUILD_DIR=/tmp/psbuild
# DeepGEMM's JIT segfaults in std::regex without the system libstdc++ first (see its backend's availability).
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
trap 'tar czf $OUT/results.tgz -C $OUT r' EXIT

for step in "$@"; do
  start=$SECONDS
  case $step in
    setup)
      python3 -m pip install -q --no-index --no-deps --target $site .carry/slim/*.whl 2>&1 | tail -2
      bash .carry/c1/install-on-device.sh > /dev/null
      if [[ -f .carry/cutlass/cutlass-include.tar.xz && ! -d /tmp/cutlass/include ]]; then
        mkdir -p /tmp/cutlass && tar -xJf .carry/cutlass/cutlass-include.tar.xz -C /tmp/cutlass
      fi
      nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $res/gpu.txt ;;
    build)
      setsid bash tools/device/build_flashmla.sh $res/build_flashmla.log $site < /dev/null > /dev/null 2>&1 &
      setsid bash -c "bash tools/device/build_deepgemm.sh --site $site > $res/build_deepgemm.log 2>&1; echo \$? > $res/build_deepgemm.log.rc" \
        < /dev/null > /dev/null 2>&1 & ;;
    wait)
      for b in flashmla deepgemm; do
        until [[ -e $res/build_$b.log.rc ]] || (( SECONDS - start > ${STEP_TIMEOUT:-240} )); do sleep 3; done
        echo "build $b: exit $(cat $res/build_$b.log.rc)"
      done ;;
    kit:*)
      IFS=: read -r _ kind name dtypes <<< "$step"
      tag=kit-$kind-$name
      (cd /tmp && timeout ${STEP_TIMEOUT:-240} python3 -m pytest -q -p plugserve.conformance.plugin -p no:cacheprovider --pyargs plugserve.conformance \
        --plugserve-backend $kind:$name --plugserve-shapes full --plugserve-dtypes ${dtypes:-bfloat16} \
        --plugserve-report $res/$tag.json > $res/$tag.txt 2>&1)
      echo "$tag: $(tail -n 1 $res/$tag.txt)" ;;
    backends)
      python3 -m plugserve.cli backends --json --explain > $res/backends.json 2> $res/backends.err
      python3 -m plugserve.cli backends --explain 2>&1 | tail -n 60 ;;
    shootout*)
      kinds=${step#shootout}; kinds=${kinds#:}
      timeout ${STEP_TIMEOUT:-240} python3 benchmarks/shootout.py ${kinds:+--kinds ${kinds//,/ }} ${SHOOTOUT_ARGS:-} \
        --output-dir $res/shootout-${kinds:-all} \
        > $res/shootout-${kinds:-all}.log 2>&1
      tail -n 3 $res/shootout-${kinds:-all}.log ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "[$step: $((SECONDS - start)) s]"
done
