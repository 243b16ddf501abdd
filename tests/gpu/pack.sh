#!/usr/bin/env bash
# Packs a CUDA build for the GPU machine into .pack/gpu-pack.tar.xz (ignored; the tree that
# travels is capped at 64 MiB): the strata binary, every test binary (stripped), and the shared
# libraries that machine may lack (everything but libc's and CUDA's). Then, there:
#   tar xJf .pack/gpu-pack.tar.xz && STRATA_GPU_BUILD=gpu-pack tests/gpu/run.sh
# carrying .pack and .whl (and .tok, the Qwen3 tokenizer, for the 30b / 80b benchmarks).
#
#   tests/gpu/pack.sh [BUILD_DIR] [WHAT...]   (default build-pack, configured here for sm_90 if new,
#                                             with the kernels in a shared st_backend carried once)
# WHAT: strata, cuda-tests (test_cuda_*), a test binary by name (test_cuda_quant), cpu-tests (the CPU tests small enough to carry; those
# linking the whole engine, such as the server's, run in CI); default all three. A build with a
# static st_backend puts the kernels (~12 MB compressed) into each CUDA binary, so a pack of
# several may not fit the 64 MiB that travels; the default build shares them.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-pack}
shift || true
WHAT=" ${*:-strata cuda-tests cpu-tests} "
if [ ! -f "$B/CMakeCache.txt" ]; then
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON -DSTRATA_CUDA_ARCHS="${STRATA_CUDA_ARCHS:-90}" \
    -DSTRATA_SHARED_BACKEND=ON >/dev/null
fi
# Only the targets named (strata is strata_cli), unless whole groups of tests are asked for.
targets=()
if [[ "$WHAT" != *" cuda-tests "* && "$WHAT" != *" cpu-tests "* ]]; then
  for w in $WHAT; do targets+=(--target "$([ "$w" = strata ] && echo strata_cli || echo "$w")"); done
fi
cmake --build "$B" -j"$(nproc)" "${targets[@]}"
rm -rf gpu-pack && mkdir -p gpu-pack/lib
[[ "$WHAT" == *" strata "* ]] && cp "$B"/strata gpu-pack/
[[ "$WHAT" == *" cuda-tests "* ]] && cp "$B"/test_cuda_* gpu-pack/
for w in $WHAT; do [[ $w == test_* && -x "$B/$w" ]] && cp "$B/$w" gpu-pack/; done
if [[ "$WHAT" == *" cpu-tests "* ]]; then
  for t in "$B"/test_*; do [ "$(stat -c %s "$t")" -lt 4000000 ] && cp "$t" gpu-pack/; done
fi
find gpu-pack -maxdepth 1 -type f -exec ldd {} + 2>/dev/null | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux[^/]*|libcudart|libcublas[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" gpu-pack/lib/; done || true
find gpu-pack -maxdepth 1 -type f -exec strip {} +
mkdir -p .pack && tar cJf .pack/gpu-pack.tar.xz gpu-pack && rm -rf gpu-pack
ls -la .pack/gpu-pack.tar.xz
