#!/bin/bash
# Run on a machine with internet, in the project's root: packs the CUTLASS headers the "cutlass" GEMM
# backend builds against (include/cutlass and include/cute of the nvidia-cutlass wheel) into
#   .carry/cutlass/cutlass-include.tar.xz   (~1 MiB; /.carry/ is git-ignored)
# for a machine without internet. There: tar -xJf .carry/cutlass/cutlass-include.tar.xz -C /tmp/cutlass
# and export PLUGSERVE_CUTLASS_DIR=/tmp/cutlass (the archive holds include/).
# Usage: tools/device/prepare_cutlass_carry.sh [VERSION]   (default 4.2.0.0, the newest nvidia-cutlass on PyPI)
set -euo pipefail
version=${1:-4.2.0.0}
out=.carry/cutlass
python=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==$version"
unzip -q "$tmp"/nvidia_cutlass-*.whl 'cutlass_library/source/include/*' -d "$tmp/wheel"
mkdir -p "$out"
tar -C "$tmp/wheel/cutlass_library/source" -cf - include | xz -T0 -9 > "$out/cutlass-include.tar.xz"
grep -E '#define CUTLASS_(MAJOR|MINOR|PATCH)' "$tmp/wheel/cutlass_library/source/include/cutlass/version.h"
du -h "$out/cutlass-include.tar.xz"
