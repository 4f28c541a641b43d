#!/bin/bash
# Run on the GPU machine, in the project's root, with .carry/deepgemm/ carried (tools/device/prepare_deepgemm_carry.sh
# makes it here): builds DeepGEMM v2.6.1 into SITE/deep_gemm (default /tmp/site; use PYTHONPATH=SITE), a
# self-contained package: its _C extension and the kernel headers its JIT compiles against (deep_gemm's own,
# cutlass' cutlass/ and cute/). Then, unless --no-smoke, checks it in fresh processes: an fp8_gemm_nt against
# torch with libstdc++ preloaded (must pass), and plugserve's availability verdict with and without the
# preload, plus whether the first JIT kernel survives without it (reported, not required).
# Every step prints its duration; any failure stops the script with a message.
# Usage: tools/device/build_deepgemm.sh [--site DIR] [--build-dir DIR] [--no-smoke]
# Environment: PYTHON (python3), CUDA_HOME (/usr/local/cuda), LIBSTDCXX (/usr/lib/x86_64-linux-gnu/libstdc++.so.6)
set -euo pipefail
site=/tmp/site
build=/tmp/deepgemm-build
smoke=1
while [ $# -gt 0 ]; do
    case $1 in
        --site) site=$2; shift 2 ;;
        --build-dir) build=$2; shift 2 ;;
        --no-smoke) smoke=0; shift ;;
        *) echo "usage: $0 [--site DIR] [--build-dir DIR] [--no-smoke]" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
libstdcxx=${LIBSTDCXX:-/usr/lib/x86_64-linux-gnu/libstdc++.so.6}
archive=.carry/deepgemm/deepgemm-src.tar.xz
repo=$(pwd)

log() { echo "[build_deepgemm] $*"; }
fail() { echo "[build_deepgemm] FAILED: $*" >&2; exit 1; }
step() {  # step NAME COMMAND...: run, time, stop on failure
    local name=$1 start ms
    shift
    start=$(date +%s%N)
    log "$name ..."
    "$@" || fail "$name (exit $?)"
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    log "$name: $((ms / 1000)).$(printf %03d $((ms % 1000))) s"
}

[ -f "$archive" ] || fail "$archive is missing: run tools/device/prepare_deepgemm_carry.sh here and carry .carry/deepgemm"
[ -x "$CUDA_HOME/bin/nvcc" ] || fail "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)"
[ -f "$libstdcxx" ] || fail "no libstdc++ at $libstdcxx (set LIBSTDCXX)"
"$python" -c "import torch, setuptools, wheel, packaging" || fail "$python lacks torch, setuptools, wheel or packaging"
log "$("$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'), \
$("$CUDA_HOME/bin/nvcc" --version | tail -1), $(g++ --version | head -1)"

unpack() {  # and what setup.py's build_py would copy: the JIT includes <cute/...>, <cutlass/...> from deep_gemm/include
    local cutlass=$build/DeepGEMM/third-party/cutlass/include
    rm -rf "$build" && mkdir -p "$build" && tar -xJf "$archive" -C "$build" \
        && cp -r "$cutlass/cutlass" "$cutlass/cute" "$build/DeepGEMM/deep_gemm/include/"
}
compile_extension() {
    (cd "$build/DeepGEMM" && DG_USE_LOCAL_VERSION=0 "$python" setup.py build_ext --inplace > "$build/setup.log" 2>&1) \
        || { tail -40 "$build/setup.log" >&2; return 1; }
    ls "$build"/DeepGEMM/deep_gemm/_C*.so > /dev/null
}
install_package() {
    mkdir -p "$site" && rm -rf "$site/deep_gemm" && cp -r "$build/DeepGEMM/deep_gemm" "$site/"
}
import_check() {
    (cd / && PYTHONPATH="$site" "$python" -c 'import deep_gemm; print("deep_gemm", deep_gemm.__version__, "at", deep_gemm.__file__)')
}
step "unpack $archive into $build" unpack
step "compile the extension (setup.py build_ext --inplace; log: $build/setup.log)" compile_extension
step "install into $site" install_package
step "import deep_gemm" import_check
[ "$smoke" = 1 ] || exit 0

gemm_check() {  # one fp8_gemm_nt on sm90's float32 scales against torch
    (cd / && PYTHONPATH="$site" LD_PRELOAD="$libstdcxx" "$python" - <<'EOF'
import torch, deep_gemm
from deep_gemm.utils import per_block_cast_to_fp8, per_token_cast_to_fp8
m, n, k = 128, 2112, 7168
x, w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
deep_gemm.fp8_gemm_nt(per_token_cast_to_fp8(x, use_ue8m0=False), per_block_cast_to_fp8(w, use_ue8m0=False), out)
ref = x.float() @ w.float().t()
diff = 1 - 2 * (out.double() * ref.double()).sum() / (out.double().square().sum() + ref.double().square().sum())
print(f"fp8_gemm_nt {m}x{n}x{k}: 1 - similarity {diff.item():.2e}")
assert diff < 1e-3, "fp8_gemm_nt is off"
EOF
    )
}
step "fp8_gemm_nt with LD_PRELOAD=$libstdcxx" gemm_check

# plugserve's availability verdict for both DeepGEMM backends, in a fresh process.
verdict='
from plugserve.core.hardware import Hardware
from plugserve.plugins.gemm.deepgemm import DeepGemmFp8Gemm
from plugserve.plugins.moe.deepgemm import DeepGemmMoE
hardware = Hardware.detect()
for cls in (DeepGemmFp8Gemm, DeepGemmMoE):
    available = cls.availability(hardware)
    print(f"  {cls.kind}/{cls.name}:", "OK" if available else available.reason)'
# The first JIT kernel (a scale transpose) in a fresh process; a segfault shows as exit status 139.
first_jit='
import torch, deep_gemm
deep_gemm.get_mn_major_tma_aligned_tensor(torch.randn(130, 56, device="cuda"))
torch.cuda.synchronize()
print("  first JIT kernel ran")'
log "plugserve availability with LD_PRELOAD=$libstdcxx:"
LD_PRELOAD="$libstdcxx" PYTHONPATH="$site:$repo" "$python" -c "$verdict" || log "  (the verdict itself failed)"
log "plugserve availability without LD_PRELOAD:"
env -u LD_PRELOAD PYTHONPATH="$site:$repo" "$python" -c "$verdict" || log "  (the verdict itself failed)"
log "first JIT kernel without LD_PRELOAD (a crash here is what the verdict above must predict):"
rc=0
(cd / && env -u LD_PRELOAD PYTHONPATH="$site" "$python" -c "$first_jit") || rc=$?
log "  exit status $rc$([ "$rc" = 139 ] && echo ' (SIGSEGV)')"
