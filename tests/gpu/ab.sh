#!/usr/bin/env bash
# Interleaved A/B rounds of `strata bench` on one machine: variants alternate within each round,
# so a slow phase of the host (the CPU pool's jobs vary up to 2x between runs) hits every variant
# alike. A variant is NAME=ENV... (environment switches of one binary, split at spaces, or at '|'
# where a value holds spaces: "skip=STRATA_CUDA_SKIP=swiglu,matmul q8_0 2048x512|X=1") or
# NAME=@BINARY (another build: carry a second strata binary; the CUDA kernels live in the shared
# libst_backend.so).
#
#   tests/gpu/ab.sh [-r ROUNDS] [-b BIN] MODEL "BENCH ARGS" VARIANT...
#   e.g. tests/gpu/ab.sh -r 3 /tmp/m/q30.gguf "--gpu 0 --prompt 512 --decode 256 --resident-experts \
#          --vram-budget-gib 16" base=X=1 workers14=@gpu-pack/strata-old "yield=STRATA_X=1 STRATA_Y=2"
#
# Prints one line per run (decode and prompt tokens/s, the hit rate, the CPU pool's jobs and the
# GPU's wait for them) and a summary table last; logs in $OUT/ab (default /tmp/strata-ab).
set -uo pipefail
cd "$(dirname "$0")/../.."
rounds=2
bin=${STRATA_GPU_BUILD:-gpu-pack}/strata
while getopts "r:b:" o; do
  case $o in
    r) rounds=$OPTARG ;;
    b) bin=$OPTARG ;;
    *) sed -n 2,15p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 3 ] || { sed -n 2,15p "$0"; exit 2; }
model=$1 args=$2
shift 2
logs=${OUT:-/tmp/strata-ab}/ab
mkdir -p "$logs"
declare -A dec
for r in $(seq 1 "$rounds"); do
  for v in "$@"; do
    name=${v%%=*} spec=${v#*=} b=$bin envs=()
    if [[ $spec == @* ]]; then b=${spec#@}
    elif [[ $spec == *"|"* ]]; then IFS='|' read -ra envs <<<"$spec"
    else read -ra envs <<<"$spec"; fi
    log=$logs/$name-$r.txt
    # shellcheck disable=SC2086
    env "${envs[@]}" timeout 300 "$b" bench -m "$model" $args >"$log" 2>&1
    rc=$?
    d=$(awk '/^decode +[0-9]/ {print $NF}' "$log")
    p=$(awk '/^prompt +[0-9]/ {printf "%s ", $NF}' "$log")
    hit=$(grep -m1 -oE 'hit rate [0-9.]+%' "$log" | tail -1)
    pool=$(grep -E 'layer calls' "$log" | tail -1 | grep -oE '\([0-9]+ layer calls, [0-9]+ us each\)')
    wait=$(grep -oE 'GPU waited [0-9.]+ s' "$log" | tail -1)
    printf '%-14s r%d rc %d  decode %-8s prompt %-18s %s %s %s\n' "$name" "$r" "$rc" "${d:--}" "${p:--}" \
      "$hit" "$pool" "$wait"
    dec[$name]="${dec[$name]:-} ${d:--}"
  done
done
echo
echo "== decode tokens/s by variant ($rounds rounds, interleaved)"
for v in "$@"; do
  name=${v%%=*}
  printf '%-14s %s\n' "$name" "${dec[$name]}"
done
