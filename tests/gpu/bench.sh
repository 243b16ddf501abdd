#!/usr/bin/env bash
# GPU benchmarks of whole models (issue 6): synthetic models with Q4_K experts at the shapes of
# Qwen3-30B-A3B and Qwen3-Next-80B-A3B (made here by synth_gguf.py; the disk holds one at a time)
# and the tiny model: decode tokens/s (batch 1, 128 tokens after a warm-up) and prompt tokens/s
# (512, 2048, 8192), each next to its bound; then llama.cpp's llama-bench on the same file (the
# whole model on the GPU) where one is at hand: $LLAMA_BENCH, or the binaries packed by
# bench/llamacpp/pack_binaries.sh (.pack/llama-bin.tar.xz, unpacked to /tmp/llama). Logs in $OUT.
#
#   tests/gpu/bench.sh BUILD_DIR [tiny] [30b] [80b]
set -uo pipefail
cd "$(dirname "$0")/../.."
B=$1; shift
OUT=${OUT:-/tmp/strata-gpu}
MODELS=${MODELS_DIR:-/tmp/strata-models}
mkdir -p "$OUT" "$MODELS"
LB=${LLAMA_BENCH:-}
if [ -z "$LB" ] && [ -f .pack/llama-bin.tar.xz ]; then
  tar -C /tmp -xJf .pack/llama-bin.tar.xz && LB=/tmp/llama/llama-bench
fi

bench() { # name file
  echo "== bench $1"
  "$B/strata" bench -m "$2" --gpu 0 --prompt 512,2048,8192 --batch 2048 --decode 128 2>&1 | tee "$OUT/bench-$1.txt"
  if [ -n "$LB" ]; then
    echo "== llama.cpp $1 (llama-bench -ngl 99 -fa 1)"
    LD_LIBRARY_PATH="$(dirname "$LB"):${LD_LIBRARY_PATH:-}" timeout 600 "$LB" -m "$2" -ngl 99 -fa 1 -p 512,2048,8192 \
      -n 128 -r 2 2>&1 | grep -E '^\||error' | tee "$OUT/llama-$1.txt"
  fi
  # Where decode and prompt time goes, per op (CUDA events around each op; graphs off).
  if [ -n "${STRATA_PROFILE:-}" ]; then
    STRATA_CUDA_PROFILE=1 "$B/strata" bench -m "$2" --gpu 0 --prompt 0 --decode 32 2>&1 | sed -n '/GPU time per op/,$p' \
      | head -40 | tee "$OUT/prof-$1-decode.txt"
    STRATA_CUDA_PROFILE=1 "$B/strata" bench -m "$2" --gpu 0 --prompt 2048 --batch 2048 --decode 0 2>&1 \
      | sed -n '/GPU time per op/,$p' | head -40 | tee "$OUT/prof-$1-prompt.txt"
  fi
}

for what in "$@"; do
  case $what in
    tiny) bench tiny-coder models/tiny-coder.gguf ;;
    30b|80b)
      preset=$([ $what = 30b ] && echo qwen3-30b-a3b || echo qwen3-next-80b-a3b)
      f="$MODELS/$preset-q4_K.gguf"
      t0=$(date +%s)
      # A byte-level vocabulary padded to Qwen3's 151,936 entries: the same embedding and head
      # sizes without carrying the real tokenizer (the benchmark never tokenizes text).
      python3 tools/synth_gguf.py "$f" --preset "$preset" --expert-type q4_K --vocab byte --vocab-size 151936 \
        -j "$(nproc)" > "$OUT/synth-$what.log" 2>&1 \
        || { echo "synth $preset failed"; tail -5 "$OUT/synth-$what.log"; continue; }
      echo "made $f in $(( $(date +%s) - t0 )) s ($(du -h "$f" | cut -f1))"
      bench "$what" "$f"
      rm -f "$f" ;;
    *) echo "bench.sh: unknown model '$what' (tiny, 30b, 80b)"; exit 2 ;;
  esac
done
