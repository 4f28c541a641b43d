#!/bin/bash
# Run here (no GPU needed), in the project's root: packs the sources tools/device/build_deepgemm.sh compiles on the
# GPU machine into
#   .carry/deepgemm/deepgemm-src.tar.xz   (/.carry/ is git-ignored)
# holding DeepGEMM/ = deepseek-ai/DeepGEMM at 54e2261 (v2.6.1: setup.py, scripts/, csrc/, the deep_gemm/ Python
# package with its kernel headers, LICENSE) with its two submodules where they live, reduced to their headers:
# third-party/cutlass/include = NVIDIA/cutlass at f3fde58, third-party/fmt/include = fmtlib/fmt at 553ec11.
# Usage: tools/device/prepare_deepgemm_carry.sh [DEEPGEMM_GIT_DIR] [CUTLASS_GIT_DIR] [FMT_GIT_DIR]
#   (git directories holding those commits; defaults: the mirrors the `fetch` tool makes under /work/.mirror)
set -euo pipefail
deepgemm_git=${1:-/work/.mirror/deepseek-ai+DeepGEMM/repo}
cutlass_git=${2:-/work/.mirror/NVIDIA+cutlass/repo}
fmt_git=${3:-/work/.mirror/fmtlib+fmt/repo}
deepgemm_commit=54e22612409371d6364144b69086735beb54e98b
cutlass_commit=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8
fmt_commit=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28
out=.carry/deepgemm
archive=$out/deepgemm-src.tar.xz

fail() { echo "prepare_deepgemm_carry: $*" >&2; exit 1; }
has_commit() { git -C "$1" cat-file -e "$2^{commit}" 2>/dev/null; }
has_commit "$deepgemm_git" "$deepgemm_commit" || fail "$deepgemm_git lacks DeepGEMM $deepgemm_commit (fetch github:deepseek-ai/DeepGEMM)"
has_commit "$cutlass_git" "$cutlass_commit" || fail "$cutlass_git lacks cutlass $cutlass_commit (fetch github:NVIDIA/cutlass)"
has_commit "$fmt_git" "$fmt_commit" || fail "$fmt_git lacks fmt $fmt_commit (fetch github:fmtlib/fmt)"
pinned() { git -C "$deepgemm_git" ls-tree "$deepgemm_commit" "$1" | awk '{print $3}'; }
[ "$(pinned third-party/cutlass)" = "$cutlass_commit" ] || fail "DeepGEMM pins cutlass $(pinned third-party/cutlass)"
[ "$(pinned third-party/fmt)" = "$fmt_commit" ] || fail "DeepGEMM pins fmt $(pinned third-party/fmt)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "$0")/git_unpack.sh"
unpack "$deepgemm_git" "$deepgemm_commit" "$tmp/DeepGEMM" setup.py scripts csrc deep_gemm LICENSE
unpack "$cutlass_git" "$cutlass_commit" "$tmp/DeepGEMM/third-party/cutlass" include LICENSE.txt
unpack "$fmt_git" "$fmt_commit" "$tmp/DeepGEMM/third-party/fmt" include LICENSE
printf 'deepseek-ai/DeepGEMM %s\nNVIDIA/cutlass %s (include)\nfmtlib/fmt %s (include)\n' \
    "$deepgemm_commit" "$cutlass_commit" "$fmt_commit" > "$tmp/DeepGEMM/VERSIONS"

mkdir -p "$out"
tar -C "$tmp" --sort=name --owner=0 --group=0 --numeric-owner -cf - DeepGEMM | xz -T0 -9 > "$archive.part"
mv "$archive.part" "$archive"
du -h "$archive"
