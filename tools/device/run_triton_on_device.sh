#!/bin/bash
# Run on the GPU machine from the repo root (device tool, carrying .carry/wheels and .carry/mpl):
#   bash tools/device/run_triton_on_device.sh kit       conformance kit at full DeepSeek-V3 shapes, Triton backends
#   bash tools/device/run_triton_on_device.sh shootout  every usable backend, same-run ceilings, auto's table
#   bash tools/device/run_triton_on_device.sh tune      --quick tuning of the FP8 GEMM and fused-MoE configs
# .carry/mpl: pip download --no-deps --only-binary=:all: --python-version 3.12 matplotlib contourpy cycler
#   fonttools kiwisolver pillow pyparsing python-dateutil six
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl .carry/mpl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0  # compiled kernels, whatever a conftest defaults to
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
for stage in "$@"; do
  case $stage in
    kit)
      for kind in attention gemm moe; do
        timeout 200 python3 -m pytest -q -p plugserve.conformance.plugin -p no:cacheprovider --pyargs plugserve.conformance \
          --plugserve-backend $kind:triton --plugserve-shapes full --plugserve-report $OUT/conformance-triton-$kind.json \
          2>&1 | tail -25 | tee $OUT/conformance-triton-$kind.txt
      done ;;
    shootout)
      timeout 400 python3 benchmarks/shootout.py --output-dir $OUT/shootout 2>&1 | tee $OUT/shootout.log ;;
    tune)
      python3 -m benchmarks.tune.tune_fp8_gemm --quick --output-dir $OUT/gemm_configs 2>&1 | tail -20 | tee $OUT/tune_gemm.log
      python3 -m benchmarks.tune.tune_fused_moe --quick --output-dir $OUT/moe_configs 2>&1 | tail -20 | tee $OUT/tune_moe.log ;;
  esac
done
