#!/usr/bin/env bash
# One GPU-machine call for issue 7: llama.cpp's llama-bench is built (CUDA) in the background
# while the hybrid tests run, then a synthetic Qwen3-30B-A3B-shape model is benchmarked by Strata
# and by llama.cpp (--n-cpu-moe picked per budget) at the same VRAM budgets. Carry .pack and .whl.
#
#   tests/gpu/hybrid_vs_llama.sh [PRESET=30b] [BUDGETS="24 16 12"] [PARITY_MODELS=tiny-coder,...]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/strata-gpu}
mkdir -p "$OUT"
what=${1:-30b}
BUDGETS=${2:-24 16 12}
tar xJf .pack/gpu-pack.tar.xz && export LD_LIBRARY_PATH=$PWD/gpu-pack/lib
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
T0=$(date +%s)
( TIME_LIMIT=${LLAMA_BUILD_S:-400} bench/llamacpp/device_build.sh > "$OUT/llama-build.log" 2>&1; echo "exit $?" >> "$OUT/llama-build.log" ) &
BUILD=$!
# Correctness first (the build slows these down; they are not timed).
OUT=$OUT SKIP_PARITY=${SKIP_PARITY:-} STRATA_BUDGETS="" tests/gpu/hybrid.sh gpu-pack > "$OUT/hybrid-tests.txt" 2>&1
tail -12 "$OUT/hybrid-tests.txt"
preset=$([ "$what" = 30b ] && echo qwen3-30b-a3b || echo qwen3-next-80b-a3b)
f=/tmp/strata-models/$preset-q4_K.gguf
mkdir -p /tmp/strata-models
python3 tools/synth_gguf.py "$f" --preset "$preset" --expert-type q4_K --vocab byte --vocab-size 151936 -j "$(nproc)" \
  > "$OUT/synth.log" 2>&1 || { echo "synth failed"; tail -3 "$OUT/synth.log"; }
echo "synth done at $(( $(date +%s) - T0 )) s"
wait $BUILD
tail -3 "$OUT/llama-build.log"
echo "llama.cpp build done at $(( $(date +%s) - T0 )) s"
# Strata at each budget (profile first), then llama.cpp at the same budgets.
OUT=$OUT SKIP_PARITY=1 SKIP_SMOKE=1 KEEP_MODELS=1 STRATA_BUDGETS="$BUDGETS" tests/gpu/hybrid.sh gpu-pack "$what" \
  > "$OUT/hybrid-bench.txt" 2>&1
tail -8 "$OUT/hybrid-bench.txt"
echo "strata done at $(( $(date +%s) - T0 )) s"
if [ -x build-llamacpp/bin/llama-bench ]; then
  OUT=$OUT bench/llamacpp/offload_bench.sh "$f" build-llamacpp/bin/llama-bench "$(echo $BUDGETS | tr ' ' ',')" 2048 128 \
    > "$OUT/llama-offload.txt" 2>&1
  tail -8 "$OUT/llama-offload.txt"
fi
echo "all done at $(( $(date +%s) - T0 )) s"
