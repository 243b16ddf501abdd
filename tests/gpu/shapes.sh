#!/usr/bin/env bash
# A decode change measured on both synthetic model shapes in one call of the GPU machine: the
# Qwen3-30B-A3B and Qwen3-Next-80B-A3B shapes (LAYERS layers, Q4_K experts, made there unless
# present), optionally matching kernel tests under each variant, each variant's greedy tokens
# (md5 of 48), interleaved `strata bench` rounds (tests/gpu/ab.sh), optionally each variant's
# per-kernel trace (STRATA_CUDA_TRACE), and a summary last: mean decode tokens/s of each variant
# against the first one's.
#
#   tests/gpu/shapes.sh [-r ROUNDS] [-l LAYERS] [-s 30b|next|both] [-k PATTERN] [-t] NAME=ENV... ...
#     e.g. tests/gpu/shapes.sh -r 5 -k 'test_moe_fold' -t base=X=1 "old=STRATA_MOE_STAGE=0"
#   -k: test_cuda_quant's tests matching PATTERN (STRATA_TEST_ONLY) under each variant, first
#       (test_m* alone took ~55 s a variant on the H100: name the tests a change touches)
#   -t: a trace of each variant on each shape (the per-kernel table's rows of the layer's ops)
# Binaries from $STRATA_GPU_BUILD (default gpu-pack: tests/gpu/pack.sh), models in
# $STRATA_MODELS (default /tmp/m), logs in $OUT/shapes (default /tmp/strata-shapes).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
rounds=3 layers=16 shapes=both pattern="" trace=0
while getopts "r:l:s:k:t" o; do
  case $o in
    r) rounds=$OPTARG ;;
    l) layers=$OPTARG ;;
    s) shapes=$OPTARG ;;
    k) pattern=$OPTARG ;;
    t) trace=1 ;;
    *) sed -n 2,15p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n 2,15p "$0"; exit 2; }
for v in "$@"; do
  [[ $v == *=* ]] || { echo "shapes.sh: variant '$v' is not NAME=ENV..." >&2; exit 2; }
done
case $shapes in
  30b) presets=(qwen3-30b-a3b) ;;
  next) presets=(qwen3-next-80b-a3b) ;;
  both) presets=(qwen3-30b-a3b qwen3-next-80b-a3b) ;;
  *) echo "shapes.sh: -s takes 30b, next or both, not '$shapes'" >&2; exit 2 ;;
esac
B=${STRATA_GPU_BUILD:-gpu-pack}
[ -x "$B/strata" ] || { echo "shapes.sh: no $B/strata (tests/gpu/pack.sh, or set STRATA_GPU_BUILD)" >&2; exit 2; }
[ -d "$B/lib" ] && export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The gguf package synth_gguf.py needs, where the machine lacks it (carried as a wheel in .whl).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
M=${STRATA_MODELS:-/tmp/m}
logs=${OUT:-/tmp/strata-shapes}/shapes
mkdir -p "$M" "$logs"
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0)) s] $*"; }
rows=()
row() { rows+=("$(printf '%-34s %-9s %s' "$1" "$2" "$3")"); }
envs_of() { read -ra envs <<<"${1#*=}"; }

# The models, made in parallel while the kernel tests run.
pids=()
for p in "${presets[@]}"; do
  f=$M/$p-$layers.gguf
  [ -f "$f" ] && continue
  python3 tools/synth_gguf.py "$f.part" --preset "$p" --layers "$layers" --expert-type q4_K --vocab byte \
    --vocab-size 151936 -j 8 >"$logs/synth-$p.log" 2>&1 && mv "$f.part" "$f" &
  pids+=($!)
done

if [ -n "$pattern" ]; then
  for v in "$@"; do
    name=${v%%=*}
    envs_of "$v"
    log=$logs/test-$name.log
    env "${envs[@]}" STRATA_SOURCE_DIR="$PWD" STRATA_TEST_ONLY="$pattern" timeout 300 "$B/test_cuda_quant" >"$log" 2>&1
    rc=$?
    r=$([ $rc = 0 ] && echo pass || { [ $rc = 77 ] && echo skip; } || echo FAIL)
    row "test_cuda_quant $pattern ($name)" "$r" "$(grep -E 'PASSED|FAILED' "$log" | tail -1 | tr -s ' ')"
    say "tests $name: $r"
  done
fi
for pid in "${pids[@]}"; do wait "$pid"; done
say "models ready"

for p in "${presets[@]}"; do
  f=$M/$p-$layers.gguf
  if [ ! -f "$f" ]; then
    row "$p" FAIL "no model: $(tail -1 "$logs/synth-$p.log")"
    continue
  fi
  for v in "$@"; do
    name=${v%%=*}
    envs_of "$v"
    env "${envs[@]}" timeout 120 "$B/strata" generate -m "$f" --gpu 0 --temp 0 -n 48 -p "The quick brown fox" \
      >"$logs/gen-$p-$name.txt" 2>"$logs/gen-$p-$name.log"
    rc=$?
    if [ $rc = 0 ]; then
      row "tokens $p ($name)" "$(md5sum <"$logs/gen-$p-$name.txt" | cut -c1-8)" "md5 of 48 greedy tokens"
    else
      row "tokens $p ($name)" FAIL "rc $rc: $(tail -1 "$logs/gen-$p-$name.log")"
    fi
  done
  OUT=$logs/ab-$p tests/gpu/ab.sh -r "$rounds" -b "$B/strata" "$f" "--gpu 0 --prompt 0 --decode 256" "$@" \
    >"$logs/ab-$p.txt" 2>&1
  say "A/B $p done"
  # Mean decode tokens/s of each variant (ab.sh's summary: NAME v1 v2 ...) against the first's.
  base=""
  for v in "$@"; do
    name=${v%%=*}
    vals=$(awk -v n="$name" 'f && $1 == n {$1 = ""; print} /^== decode tokens/ {f = 1}' "$logs/ab-$p.txt")
    mean=$(echo "$vals" | awk '{s = 0; k = 0; for (i = 1; i <= NF; i++) if ($i + 0 > 0) {s += $i; k++}
                               if (k) printf "%.1f", s / k}')
    [ -z "$base" ] && base=${mean:-0}
    rel=$(awk -v m="${mean:-0}" -v b="$base" 'BEGIN {if (b > 0 && m > 0) printf "%+.1f%%", 100 * (m / b - 1)}')
    row "decode $p ($name)" "${mean:--}" "$rel  [$(xargs <<<"$vals")]"
  done
  if [ $trace = 1 ]; then
    for v in "$@"; do
      name=${v%%=*}
      envs_of "$v"
      log=$logs/trace-$p-$name.log
      env "${envs[@]}" STRATA_CUDA_TRACE=1 timeout 120 "$B/strata" bench -m "$f" --gpu 0 --prompt 0 --decode 64 \
        >"$log" 2>&1
      echo "== trace $p ($name)"
      grep -A12 "replays, " "$log" | cut -c1-230
    done
  fi
done

echo
echo "== summary (decode: mean tokens/s of --prompt 0 --decode 256, against the first variant)"
printf '%s\n' "${rows[@]}" | tee "$logs/summary.txt"
