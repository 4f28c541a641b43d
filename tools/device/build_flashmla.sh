#!/bin/bash
# Runs ON THE GPU MACHINE, in the project's root. Builds FlashMLA's dense sm90a MLA decode as the module
# `flash_mla.cuda` with torch.utils.cpp_extension.load: tools/device/flashmla_binding.cpp (binds dense_decode_fwd alone)
# plus the three .cu files dense decode needs; no sm100, sparse or fp16 kernels (about 1.5 min at MAX_JOBS=8).
# Sources: .carry/flashmla/flashmla-src.tar.xz, made by tools/device/prepare_flashmla_carry.sh (FlashMLA 9241ae3 with
# cutlass 147f567). Installs FlashMLA's own Python package beside the module as TARGET/flash_mla, so that with
# PYTHONPATH=TARGET `flash_mla.get_mla_metadata` and `flash_mla.flash_mla_with_kvcache` work; then, on an sm90
# GPU, runs one decode call against torch. Everything goes to LOG; LOG.rc holds the exit status at the end, and
# the outcome line (with the log's tail on failure) also goes to the caller's stderr. In the background:
#   setsid bash tools/device/build_flashmla.sh "$OUT/build_flashmla.log" /tmp/site < /dev/null &
#   ... other work ...
#   until [ -e "$OUT/build_flashmla.log.rc" ]; do sleep 5; done; [ "$(cat "$OUT/build_flashmla.log.rc")" = 0 ]
# Usage: tools/device/build_flashmla.sh [LOG] [TARGET]
#   LOG     default $OUT/build_flashmla.log
#   TARGET  default /tmp/site (TARGET/flash_mla is replaced)
# Environment: PYTHON (python3), MAX_JOBS (8), NVCC_THREADS (2), CUDA_HOME (/usr/local/cuda),
#   FLASHMLA_ARCHIVE (.carry/flashmla/flashmla-src.tar.xz), FLASHMLA_WORK (/tmp/flashmla: sources and build).
set -euo pipefail

log=${1:-${OUT:+$OUT/build_flashmla.log}}
[ -n "$log" ] || { echo "build_flashmla: give a LOG path or set OUT" >&2; exit 2; }
target=${2:-/tmp/site}
python=${PYTHON:-python3}
archive=${FLASHMLA_ARCHIVE:-.carry/flashmla/flashmla-src.tar.xz}
work=${FLASHMLA_WORK:-/tmp/flashmla}
binding=$PWD/tools/device/flashmla_binding.cpp
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-8}
export NVCC_THREADS=${NVCC_THREADS:-2}

mkdir -p "$(dirname "$log")"
rm -f "$log.rc"
exec 3>&2 >"$log" 2>&1
current=setup
report() {
    local rc=$? outcome
    if [ "$rc" -eq 0 ]; then
        outcome="build_flashmla: OK in ${SECONDS} s; flash_mla is in $target (PYTHONPATH=$target)"
    else
        outcome="build_flashmla: FAILED (exit $rc) in step '$current' after ${SECONDS} s; log: $log"
    fi
    [ "$rc" -eq 0 ] || tail -n 40 "$log" >&3
    echo "$outcome"
    echo "$outcome" >&3
    echo "$rc" > "$log.rc"
}
trap report EXIT

timed() {  # timed STEP COMMAND...: runs COMMAND, printing the step's wall time; a failure ends the script
    local start
    current=$1
    shift
    start=$(date +%s.%N)
    echo "== [$(date +%T)] $current"
    "$@"
    echo "== $current: $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
}

check_tools() {
    [ -f "$archive" ] || { echo "no $archive: run tools/device/prepare_flashmla_carry.sh where the sources are, carry it"; return 1; }
    [ -f "$binding" ] || { echo "no $binding: run this from the project's root"; return 1; }
    [ -x "$CUDA_HOME/bin/nvcc" ] || { echo "no nvcc at $CUDA_HOME/bin/nvcc: set CUDA_HOME"; return 1; }
    "$CUDA_HOME/bin/nvcc" --version | tail -n 2
    "$python" -c "
import torch, torch.utils.cpp_extension as ext
ext.verify_ninja_availability()
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ninja ok;', 'MAX_JOBS', '$MAX_JOBS')"
}

unpack() {
    rm -rf "$work"
    mkdir -p "$work/build"
    tar -xJf "$archive" -C "$work"
    cat "$work/FlashMLA/VERSIONS"
}

compile() {
    SRC=$work/FlashMLA BUILD=$work/build BINDING=$binding "$python" - <<'EOF'
import os

from torch.utils.cpp_extension import load

csrc = os.path.join(os.environ["SRC"], "csrc")
includes = [csrc, f"{csrc}/kerutils/include", f"{csrc}/sm90", f"{csrc}/cutlass/include",
            f"{csrc}/cutlass/tools/util/include"]
cccl = os.path.join(os.environ["CUDA_HOME"], "include", "cccl")  # CUDA 13 moved cuda/std/* there
if os.path.isdir(cccl):
    includes.append(cccl)
features = ["-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16"]  # the fp16 kernels are not built: bf16 only
module = load(
    name="cuda",  # PyInit_cuda: importable as flash_mla.cuda, the name FlashMLA's Python package imports
    sources=[
        os.environ["BINDING"],
        f"{csrc}/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
        f"{csrc}/smxx/decode/combine/combine.cu",
        f"{csrc}/sm90/decode/dense/instantiations/bf16.cu",
    ],
    extra_include_paths=includes,
    extra_cflags=["-O3", "-std=c++20", "-Wno-deprecated-declarations", *features],
    extra_cuda_cflags=[
        "-O3", "-std=c++20", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        # FlashMLA's setup.py undoes these torch defaults, which hide the half/bfloat16 operators CUTLASS uses.
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", *features,
        # wgmma needs the "a" target; an explicit -gencode also stops torch adding its own arch flags.
        "-gencode", "arch=compute_90a,code=sm_90a", "--threads", os.environ["NVCC_THREADS"],
    ],
    build_directory=os.environ["BUILD"],
    verbose=True,
)
print("built and loaded", module.__file__)
EOF
}

install_package() {
    rm -rf "$target/flash_mla"
    mkdir -p "$target/flash_mla"
    cp "$work"/FlashMLA/flash_mla/*.py "$target/flash_mla/"
    cp "$work/build/cuda.so" "$target/flash_mla/cuda.so"
    { cat "$work/FlashMLA/VERSIONS"; echo "built $(date -u +%FT%TZ) by plugserve tools/device/build_flashmla.sh:" \
        "dense sm90a bf16 decode only"; "$python" -c "import torch; print('torch', torch.__version__)"; } \
        > "$target/flash_mla/BUILD_INFO"
    ls -l "$target/flash_mla"
}

smoke_test() {  # one causal 2-token decode of 2 requests against torch in float32
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$python" - <<'EOF'
import torch

import flash_mla

print("imported", flash_mla.__file__)
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    print("no sm90 GPU here: the kernels were not run")
    raise SystemExit(0)
torch.manual_seed(0)
b, s_q, h, d, dv, page = 2, 2, 16, 576, 512, 64
seq_lens = [100, 37]
cache = torch.randn(8, page, 1, d, device="cuda", dtype=torch.bfloat16)
block_table = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32, device="cuda")
q = torch.randn(b, s_q, h, d, device="cuda", dtype=torch.bfloat16)
meta, splits = flash_mla.get_mla_metadata()
out, _ = flash_mla.flash_mla_with_kvcache(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32,
                                          device="cuda"), dv, meta, splits, softmax_scale=0.1, causal=True)
for i, n in enumerate(seq_lens):
    kv = cache[block_table[i]].reshape(-1, d)[:n].float()
    scores = torch.einsum("qhd,kd->qhk", q[i].float(), kv) * 0.1
    visible = torch.arange(n, device="cuda") <= torch.arange(n - s_q, n, device="cuda")[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    expected = torch.einsum("qhk,kd->qhd", scores.softmax(-1), kv[:, :dv])
    error = (out[i].float() - expected).abs().max().item()
    print(f"request {i}: max abs error {error:.2e}")
    assert error < 2e-2, f"flash_mla disagrees with torch: max abs error {error}"
EOF
}

timed check check_tools
timed unpack unpack
timed compile compile
timed install install_package
timed smoke smoke_test
current=done
