#!/bin/bash
# Run here (no GPU needed), in the project's root: packs the sources tools/device/build_flashmla.sh compiles on the
# GPU machine into
#   .carry/flashmla/flashmla-src.tar.xz   (~1.2 MiB; /.carry/ is git-ignored)
# holding FlashMLA/ = deepseek-ai/FlashMLA at 9241ae3 (csrc/, the flash_mla/ Python package, LICENSE) with
# its cutlass submodule, NVIDIA/cutlass at 147f567, reduced to include/ and tools/util/include, at
# FlashMLA/csrc/cutlass/ where the submodule lives.
# Usage: tools/device/prepare_flashmla_carry.sh [FLASHMLA_GIT_DIR] [CUTLASS_GIT_DIR]
#   (git directories holding those commits; defaults: the mirrors the `fetch` tool makes under /work/.mirror)
set -euo pipefail
flashmla_git=${1:-/work/.mirror/deepseek-ai+FlashMLA/repo}
cutlass_git=${2:-/work/.mirror/NVIDIA+cutlass/repo}
flashmla_commit=9241ae3ef9bac614dd25e45e507e089f888280e0
cutlass_commit=147f5673d0c1c3dcf66f78d677fd647e4a020219
out=.carry/flashmla
archive=$out/flashmla-src.tar.xz

fail() { echo "prepare_flashmla_carry: $*" >&2; exit 1; }
git -C "$flashmla_git" cat-file -e "$flashmla_commit^{commit}" 2>/dev/null \
    || fail "$flashmla_git lacks FlashMLA $flashmla_commit (fetch github:deepseek-ai/FlashMLA)"
git -C "$cutlass_git" cat-file -e "$cutlass_commit^{commit}" 2>/dev/null \
    || fail "$cutlass_git lacks cutlass $cutlass_commit (fetch github:NVIDIA/cutlass)"
submodule=$(git -C "$flashmla_git" ls-tree "$flashmla_commit" csrc/cutlass | awk '{print $3}')
[ "$submodule" = "$cutlass_commit" ] || fail "FlashMLA $flashmla_commit pins cutlass $submodule, not $cutlass_commit"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "$0")/git_unpack.sh"
unpack "$flashmla_git" "$flashmla_commit" "$tmp/FlashMLA" csrc flash_mla LICENSE
unpack "$cutlass_git" "$cutlass_commit" "$tmp/FlashMLA/csrc/cutlass" include tools/util/include LICENSE.txt
printf 'deepseek-ai/FlashMLA %s\nNVIDIA/cutlass %s (include, tools/util/include)\n' \
    "$flashmla_commit" "$cutlass_commit" > "$tmp/FlashMLA/VERSIONS"

mkdir -p "$out"
tar -C "$tmp" --sort=name --owner=0 --group=0 --numeric-owner -cf - FlashMLA | xz -T0 -9 > "$archive.part"
mv "$archive.part" "$archive"
du -h "$archive"
