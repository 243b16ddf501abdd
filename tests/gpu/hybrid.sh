#!/usr/bin/env bash
# The hybrid expert cache on the GPU machine (issue 7): a smoke test on the tiny model at several
# cache sizes, the kernel test of split slot stacks, the hybrid parity cases, then benchmarks of
# a synthetic model at VRAM budgets (profile made first). Logs and a summary in $OUT.
#
#   tests/gpu/hybrid.sh BUILD_DIR [30b|80b ...]   (STRATA_BUDGETS="24 16 12" GiB by default)
set -uo pipefail
cd "$(dirname "$0")/../.."
B=$1; shift
OUT=${OUT:-/tmp/strata-gpu}
MODELS=${MODELS_DIR:-/tmp/strata-models}
BUDGETS=${STRATA_BUDGETS:-24 16 12}
mkdir -p "$OUT" "$MODELS"
rows=()
row() { rows+=("$(printf '%-40s %-6s %s' "$1" "$2" "$3")"); }

echo "== smoke: tiny-coder, greedy, cache sizes"
ref=""
[ -n "${SKIP_SMOKE:-}" ] || for c in auto 0 64 128; do
  txt=$(timeout 120 "$B/strata" generate -m models/tiny-coder.gguf --gpu 0 --expert-cache $c --adapt-every 0 -n 48 \
        -p "def fibonacci(n):" 2>"$OUT/smoke-$c.log")
  rc=$?
  echo "--- cache $c (rc $rc)"; echo "$txt" | head -5; grep -E "experts|error" "$OUT/smoke-$c.log" | head -3
  [ -z "$ref" ] && ref=$txt
  row "smoke tiny-coder cache $c" "$([ $rc = 0 ] && echo pass || echo FAIL)" "same text as auto: $([ "$txt" = "$ref" ] && echo yes || echo no)"
done

if [ -z "${SKIP_SMOKE:-}" ] && [ -x "$B/test_cuda_quant" ]; then
  echo "== test_cuda_quant"
  timeout 300 "$B/test_cuda_quant" >"$OUT/test_cuda_quant.log" 2>&1 && r=pass || r=FAIL
  row test_cuda_quant "$r" "$(grep -E 'PASSED|FAILED' "$OUT/test_cuda_quant.log" | tail -1)"
  grep -E "FAIL|split" "$OUT/test_cuda_quant.log" | head -5
fi

if [ -z "${SKIP_PARITY:-}" ]; then
  echo "== hybrid parity"
  timeout 420 python3 tests/gpu/parity.py --bin "$B/strata" --out /tmp/strata-parity --hybrid-only \
    --only "${PARITY_MODELS:-moe-f32,next-f32-mtp,tiny-coder,next-q8_0-q4_K-mtp,moe-shape-q8_0-q4_K}" >"$OUT/parity-hybrid.txt" 2>&1 \
    && r=pass || r=FAIL
  cat "$OUT/parity-hybrid.txt"
  row "parity hybrid (GPU cache vs CPU)" "$r" "$(tail -1 "$OUT/parity-hybrid.txt")"
fi

for what in "$@"; do
  preset=$([ $what = 30b ] && echo qwen3-30b-a3b || echo qwen3-next-80b-a3b)
  f="$MODELS/$preset-q4_K.gguf"
  t0=$(date +%s)
  [ -f "$f" ] || python3 tools/synth_gguf.py "$f" --preset "$preset" --expert-type q4_K --vocab byte --vocab-size 151936 \
      -j "$(nproc)" > "$OUT/synth-$what.log" 2>&1 || { echo "synth failed"; tail -5 "$OUT/synth-$what.log"; continue; }
  echo "made $f in $(( $(date +%s) - t0 )) s ($(du -h "$f" | cut -f1))"
  # A profile from text, on the whole GPU (routing counted on the device).
  cat README.md docs/*.md > /tmp/profile-text.txt
  t0=$(date +%s)
  "$B/strata" profile -m "$f" -f /tmp/profile-text.txt --ctx 8192 --batch 2048 -o "${f%.gguf}.profile" \
    > "$OUT/profile-$what.txt" 2>&1 && r=pass || r=FAIL
  row "profile $what" "$r" "$(( $(date +%s) - t0 )) s; $(grep -E '25%' "$OUT/profile-$what.txt" | head -1)"
  tail -6 "$OUT/profile-$what.txt"
  for bud in full $BUDGETS; do
    extra=()
    [ "$bud" != full ] && extra=(--vram-budget-gib "$bud")
    echo "== bench $what budget $bud"
    timeout 300 "$B/strata" bench -m "$f" --gpu 0 --prompt 2048 --batch 2048 --decode 128 ${ARENA:---resident-experts} "${extra[@]}" \
      > "$OUT/bench-$what-$bud.txt" 2>&1 && r=pass || r=FAIL
    cat "$OUT/bench-$what-$bud.txt" | grep -vE "^\s*$" | tail -12
    row "bench $what budget $bud" "$r" "$(grep -E '^prompt|^decode +[0-9]' "$OUT/bench-$what-$bud.txt" | awk '{printf "%s %s t/s; ", $1, $NF}')"
  done
  [ -n "${KEEP_MODELS:-}" ] || rm -f "$f"
done

echo
echo "== summary"
printf '%s\n' "${rows[@]}" | tee "$OUT/hybrid-summary.txt"
