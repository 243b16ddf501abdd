#!/usr/bin/env bash
# pack_binaries.sh - packs a llama-bench build (device_build.sh, here on a CPU machine with nvcc)
# for the GPU machine: llama-bench and its shared libraries, stripped, in one folder `llama`,
# compressed to ~15 MB (sm_90 only), so a device call spends no time building llama.cpp.
#
#   bench/llamacpp/pack_binaries.sh [BUILD_DIR] [OUT]   (default /tmp/llb, .pack/llama-bin.tar.xz)
#
# There (carry .pack):
#   tar xJf .pack/llama-bin.tar.xz -C /tmp && LD_LIBRARY_PATH=/tmp/llama /tmp/llama/llama-bench ...
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
bdir=${1:-/tmp/llb}
out=${2:-$repo/.pack/llama-bin.tar.xz}
bin=$bdir/obj/bin
[[ -x $bin/llama-bench ]] || { echo "pack_binaries: no $bin/llama-bench (build it with device_build.sh)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/llama"
cp -a "$bin"/llama-bench "$bin"/*.so* "$tmp/llama/"
strip "$tmp/llama/llama-bench" "$tmp"/llama/*.so.* 2>/dev/null || true
mkdir -p "$(dirname "$out")"
tar -C "$tmp" -cJf "$out" llama
echo "pack_binaries: $out ($(du -h "$out" | cut -f1))"
