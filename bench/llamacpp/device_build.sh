#!/usr/bin/env bash
# device_build.sh - build llama.cpp's llama-bench with CUDA (sm_90, H100/H200) from the
# trimmed source tarball made by pack_source.sh.  Meant for the GPU test machine (no
# network): quiet, all cores, ninja when present, one log file, elapsed time printed.
#
#   bench/llamacpp/device_build.sh [TARBALL] [BUILD_DIR]
#
#   TARBALL    default .pack/llama-src.tar.xz (repo root; carry .pack to the machine)
#   BUILD_DIR  default build-llamacpp (repo root; /build*/ is git-ignored, so on a machine
#              that is still warm a second call finds it and only rebuilds what is missing)
#   env: CUDA_ARCH (default 90-real: sm_90 SASS only, no PTX)
#        BACKEND   cuda (default) | cpu  (cpu: a CPU-only build, for a local smoke test)
#        TIME_LIMIT seconds for the compile step (default 0 = none); when hit, the build
#                   stops cleanly (exit 124) and the same command resumes it
#        JOBS      parallel jobs (default nproc)
#        CONFIGURE_ONLY=1  stop after cmake's configure step
# Prints the path of the llama-bench binary on the last line (BUILD_DIR/bin/llama-bench).
#
# Build-time trimming (CMake options only, none changes the measured kernels):
#   only the llama-bench target; one CUDA arch with no PTX; GGML_CUDA_FA_QUANTS=f16-f16
#   (FlashAttention vector kernels for the default f16 KV cache only; llama-bench's
#   default -ctk/-ctv is f16); GGML_CUDA_COMPRESSION_MODE=none (no fatbin compression);
#   no NCCL (one GPU); no OpenSSL/ccache; no tests/examples/server/app.  The mmq/mmf and
#   fattn-mma/tile template instances cannot be dropped with options (the kernels that
#   dispatch them reference them all), so they are built.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
tarball=${1:-$repo/.pack/llama-src.tar.xz}
bdir=${2:-$repo/build-llamacpp}
backend=${BACKEND:-cuda}
arch=${CUDA_ARCH:-90-real}
jobs=${JOBS:-$(nproc)}
limit=${TIME_LIMIT:-0}

die() { echo "device_build: FAILED: $*" >&2; exit 1; }

[[ -f $tarball ]] || die "no source tarball at $tarball (make it with bench/llamacpp/pack_source.sh and carry .pack)"
command -v cmake >/dev/null || die "cmake not found"
mkdir -p "$bdir"
bdir=$(cd "$bdir" && pwd)
log=$bdir/build.log
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

# 1. extract, only when the tarball changed (re-extracting would touch every source and
#    force a full rebuild)
sum=$(cksum < "$tarball")
if [[ ! -f $bdir/src.stamp || $(cat "$bdir/src.stamp") != "$sum" ]]; then
    rm -rf "$bdir/src" "$bdir/obj"
    mkdir -p "$bdir/src"
    tar -C "$bdir/src" -xJf "$tarball" || die "could not extract $tarball"
    echo "$sum" > "$bdir/src.stamp"
    echo "device_build: extracted $(basename "$tarball") into $bdir/src ($(elapsed) s)"
fi
srcdir=$bdir/src/llama.cpp
[[ -f $srcdir/CMakeLists.txt ]] || die "$tarball does not hold llama.cpp/CMakeLists.txt"

# whether this machine has the CUDA driver (libcuda.so.1): the CPU machines do not
have_driver=false
ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' && have_driver=true

# 2. configure (once per option set)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
opts=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CCACHE=OFF
      -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
      -DLLAMA_OPENSSL=OFF)
case $backend in
cuda)
    if ! command -v nvcc >/dev/null; then
        for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
            [[ -x $d/nvcc ]] && { export PATH=$d:$PATH; break; }
        done
    fi
    command -v nvcc >/dev/null || die "nvcc not found (not on PATH nor in /usr/local/cuda*/bin)"
    opts+=(-DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER="$(command -v nvcc)"
           -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_CUDA_FA=ON
           -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_COMPRESSION_MODE=none
           -DGGML_CUDA_NCCL=OFF)
    # A machine without the driver (the CPU machines) cannot link llama-bench against
    # libggml-cuda, which needs libcuda.so.1: leave those symbols to the GPU machine's loader
    # (then pack_binaries.sh carries the build there).
    $have_driver || opts+=(-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined) ;;
cpu) opts+=(-DGGML_CUDA=OFF) ;;
*) die "BACKEND must be cuda or cpu, not '$backend'" ;;
esac
obj=$bdir/obj
cfg="${gen[*]} ${opts[*]}"
if [[ ! -f $obj/CMakeCache.txt || ! -f $bdir/cfg.stamp || $(cat "$bdir/cfg.stamp") != "$cfg" ]]; then
    rm -rf "$obj"
    echo "== configure: cmake ${opts[*]}" > "$log"
    if ! cmake -S "$srcdir" -B "$obj" "${gen[@]}" "${opts[@]}" >> "$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "cmake configure failed after $(elapsed) s (log: $log)"
    fi
    echo "$cfg" > "$bdir/cfg.stamp"
    echo "device_build: configured $backend ${gen[*]:-make} ($(elapsed) s)"
fi

if [[ ${CONFIGURE_ONLY:-0} == 1 ]]; then
    echo "device_build: configure OK ($(elapsed) s); CONFIGURE_ONLY=1, not compiling"
    exit 0
fi

# 3. build llama-bench only
echo "device_build: compiling llama-bench ($backend, -j$jobs${gen:+, ninja}); log $log"
echo "== build $(date -u +%FT%TZ) -j$jobs" >> "$log"
build=(cmake --build "$obj" --target llama-bench -j "$jobs")
rc=0
if [[ $limit -gt 0 ]]; then
    # SIGINT lets ninja/make stop their compilers and drop half-written objects
    timeout -s INT -k 20 "$limit" "${build[@]}" >> "$log" 2>&1 || rc=$?
else
    "${build[@]}" >> "$log" 2>&1 || rc=$?
fi
if [[ $rc -ne 0 ]]; then
    if [[ $rc -eq 124 ]]; then
        echo "device_build: stopped at TIME_LIMIT=$limit s ($(grep -c '^\[' "$log" || true) steps logged);" \
             "run the same command again on this machine to resume" >&2
        exit 124
    fi
    grep -E 'error|Error|FAILED' "$log" | head -n 20 >&2 || true
    tail -n 20 "$log" >&2
    die "build failed (rc $rc) after $(elapsed) s (log: $log)"
fi
bin=$obj/bin/llama-bench
[[ -x $bin ]] || die "build finished but $bin is missing"
# a stable path: BUILD_DIR/bin/llama-bench (libs found through the build RPATH)
mkdir -p "$bdir/bin"
ln -sf "$bin" "$bdir/bin/llama-bench"
if $have_driver || [[ $backend != cuda ]]; then
    "$bin" --help >/dev/null 2>&1 || die "$bin does not run (see: $bin --help)"
else
    echo "device_build: no CUDA driver here, so $bin was not run; bench/llamacpp/pack_binaries.sh packs it for the GPU machine"
fi
echo "device_build: OK in $(elapsed) s"
echo "$bdir/bin/llama-bench"
