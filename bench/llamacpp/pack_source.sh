#!/usr/bin/env bash
# pack_source.sh - trim a llama.cpp source tree down to what a CUDA (or CPU) build of
# llama-bench needs and write it as .pack/llama-src.tar.xz (small enough to ship to the
# GPU test machine, which has no network).
#
#   bench/llamacpp/pack_source.sh [LLAMA_CPP_DIR] [OUT_TARBALL]
#
#   LLAMA_CPP_DIR  default /tmp/llamasrc/llama_cpp_python-0.3.36/vendor/llama.cpp
#                  (the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist)
#   OUT_TARBALL    default <repo>/.pack/llama-src.tar.xz   (.pack/ is git-ignored)
#
# What is kept: top CMakeLists.txt, LICENSE, licenses/, cmake/, include/, src/, common/,
# tools/llama-bench, vendor/{nlohmann,sheredom,cpp-httplib}, and ggml/ with only its
# CMake files, include/, the top-level ggml/src sources, ggml/src/ggml-cpu (x86 + arm
# arch code only) and ggml/src/ggml-cuda.  Every other backend (vulkan, sycl, metal,
# opencl, cann, musa, hip, webgpu, zdnn, ...), tests, examples, server, UI, docs, models
# and python are dropped.  Two CMake files are rewritten so the trimmed tree configures:
#   tools/CMakeLists.txt   adds only llama-bench
#   vendor/CMakeLists.txt  adds only the vendored libs common/ links (no miniaudio/stb/hash)
# Configure the result with -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF
# -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
# (device_build.sh does this).  The tarball unpacks to a single directory llama.cpp/.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
src=${1:-/tmp/llamasrc/llama_cpp_python-0.3.36/vendor/llama.cpp}
out=${2:-$repo/.pack/llama-src.tar.xz}

[[ -f $src/CMakeLists.txt && -d $src/ggml/src/ggml-cuda ]] || {
    echo "pack_source: $src does not look like a llama.cpp tree" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
dst=$stage/llama.cpp
mkdir -p "$dst"

copy() {  # copy paths (relative to $src) into the staging tree, keeping their layout
    (cd "$src" && cp -a --parents "$@" "$dst/")
}

copy CMakeLists.txt LICENSE licenses cmake include src common tools/llama-bench
for f in AUTHORS README.md; do [[ -e $src/$f ]] && copy "$f"; done
copy vendor/nlohmann vendor/sheredom vendor/cpp-httplib

# ggml: CMake files, headers, top-level sources, CPU and CUDA backends only
copy ggml/CMakeLists.txt ggml/cmake ggml/include
[[ -e $src/ggml/LICENSE ]] && copy ggml/LICENSE
(cd "$src" && find ggml/src -maxdepth 1 -type f) | while read -r f; do copy "$f"; done
copy ggml/src/ggml-cuda
(cd "$src" && find ggml/src/ggml-cpu -path 'ggml/src/ggml-cpu/arch' -prune -o \
     -path 'ggml/src/ggml-cpu/spacemit' -prune -o -type f -print) |
    while read -r f; do copy "$f"; done
copy ggml/src/ggml-cpu/arch/x86 ggml/src/ggml-cpu/arch/arm

# tools/: only llama-bench
cat > "$dst/tools/CMakeLists.txt" <<'CM'
# trimmed by strata bench/llamacpp/pack_source.sh: only llama-bench is shipped
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
CM

# vendor/: only what common/ links (nlohmann, sheredom, cpp-httplib)
cat > "$dst/vendor/CMakeLists.txt" <<'CM'
# trimmed by strata bench/llamacpp/pack_source.sh: mtmd-only vendored libs dropped
add_subdirectory(nlohmann)
add_subdirectory(sheredom)
if (LLAMA_BUILD_COMMON)
    add_subdirectory(cpp-httplib)
endif()
CM

{
    echo "llama.cpp source trimmed for a llama-bench build by strata bench/llamacpp/pack_source.sh"
    echo "from: $src"
    sdist=$(basename "$(dirname "$(dirname "$(cd "$src" && pwd)")")")
    if [[ $sdist == llama_cpp_python-* ]]; then echo "sdist: $sdist"; fi
} > "$dst/STRATA_PACK_INFO"

mkdir -p "$(dirname "$out")"
# fixed owner/mtime order so repeated packs of the same tree give the same bytes
tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner \
    --mtime='2024-01-01 00:00:00' -cf - llama.cpp | xz -9e -T0 > "$out.tmp"
mv "$out.tmp" "$out"

echo "pack_source: wrote $out ($(du -k "$out" | cut -f1) KiB; $(du -sk "$dst" | cut -f1) KiB unpacked," \
     "$(find "$dst" -type f | wc -l) files)"
