#!/usr/bin/env bash
# Checks and measures opt-in GPU paths (environment switches that are off until a GPU run has
# shown them right and faster) in one call of the GPU machine: the kernel tests with each switch
# set, optionally the GPU-vs-CPU parity of whole models (tests/gpu/parity.py) under each, greedy
# tokens with and without, then interleaved A/B rounds of `strata bench` (tests/gpu/ab.sh) of
# every switch against the default. Summary last.
#
#   tests/gpu/optin.sh [-r ROUNDS] [-t] [-p] MODEL "NAME=ENV ..." ...
#     e.g. tests/gpu/optin.sh -r 3 -p /tmp/m/q30.gguf nocluster=STRATA_CLUSTER=0 \
#            "neither=STRATA_CLUSTER=0 STRATA_DN_FUSED=0"
#   -t: skip the kernel tests (a second model in the same call); -p: run the parity cases
# Binaries from $STRATA_GPU_BUILD (default gpu-pack: tests/gpu/pack.sh); logs in $OUT/optin.
set -uo pipefail
cd "$(dirname "$0")/../.."
rounds=3 tests=1 parity=0
while getopts "r:tp" o; do
  case $o in
    r) rounds=$OPTARG ;;
    t) tests=0 ;;
    p) parity=1 ;;
    *) sed -n 2,12p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || { sed -n 2,12p "$0"; exit 2; }
model=$1
shift
B=${STRATA_GPU_BUILD:-gpu-pack}
[ -d "$B/lib" ] && export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Python packages parity.py needs and the machine lacks (carried as wheels in .whl, as run.sh).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
logs=${OUT:-/tmp/strata-optin}/optin
mkdir -p "$logs"
rows=()
row() { rows+=("$(printf '%-44s %-6s %s' "$1" "$2" "$3")"); }
tag=$(basename "$model" .gguf)

envs_of() { local spec=${1#*=}; echo "$spec"; }
variants=("base=STRATA_OPTIN_BASE=1" "$@")

# Kernel tests under each variant (they read the switches like the engine does).
if [ $tests = 1 ]; then
  for v in "${variants[@]}"; do
    name=${v%%=*}
    read -ra envs <<<"$(envs_of "$v")"
    for t in test_cuda_ops test_cuda_quant; do
      [ -x "$B/$t" ] || continue
      log=$logs/$t-$name.log
      env "${envs[@]}" STRATA_SOURCE_DIR="$PWD" timeout 300 "$B/$t" >"$log" 2>&1
      rc=$?
      r=$([ $rc = 0 ] && echo pass || { [ $rc = 77 ] && echo skip; } || echo FAIL)
      row "$t ($name)" "$r" "$(grep -E 'PASSED|FAILED|usable GPU' "$log" | tail -1 | tr -s ' ')"
    done
  done
fi

# Whole models, GPU against CPU logits (the tiny model and random models of both shapes).
if [ $parity = 1 ]; then
  for v in "${variants[@]:1}"; do
    name=${v%%=*}
    read -ra envs <<<"$(envs_of "$v")"
    log=$logs/parity-$name.txt
    env "${envs[@]}" timeout 500 python3 tests/gpu/parity.py --bin "$B/strata" --out "/tmp/strata-parity-$name" >"$log" 2>&1
    rc=$?
    row "parity GPU vs CPU ($name)" "$([ $rc = 0 ] && echo pass || echo FAIL)" "$(tail -1 "$log")"
  done
fi

# Greedy tokens: the same prompt under each variant (the md5 of 48 tokens, as results quote it).
for v in "${variants[@]}"; do
  name=${v%%=*}
  read -ra envs <<<"$(envs_of "$v")"
  env "${envs[@]}" timeout 300 "$B/strata" generate -m "$model" --gpu 0 --temp 0 -n 48 \
    -p "The quick brown fox" >"$logs/gen-$tag-$name.txt" 2>"$logs/gen-$tag-$name.log"
  rc=$?
  if [ $rc = 0 ]; then
    row "tokens $tag ($name)" "$(md5sum <"$logs/gen-$tag-$name.txt" | cut -c1-8)" "md5 of 48 greedy tokens"
  else
    row "tokens $tag ($name)" FAIL "rc $rc: $(tail -1 "$logs/gen-$tag-$name.log")"
  fi
done

# Speed: interleaved rounds, decode 128 after the bench's short context, and prompt 512.
tests/gpu/ab.sh -r "$rounds" -b "$B/strata" "$model" "--gpu 0 --prompt 512 --decode 128" "${variants[@]}" \
  2>&1 | tee "$logs/ab-$tag.txt" | tail -$(( ${#variants[@]} + 2 ))
# A longer decode (the context split into up to 33 pieces: attention's two-level merge).
for v in "${variants[@]}"; do
  name=${v%%=*}
  read -ra envs <<<"$(envs_of "$v")"
  d=$(env "${envs[@]}" timeout 300 "$B/strata" bench -m "$model" --gpu 0 --prompt 0 --decode 1024 2>&1 |
      awk '/^decode +[0-9]/ {print $NF}')
  row "decode 1024 $tag ($name)" "${d:--}" "tokens/s"
done

echo
echo "== opt-in summary ($tag)"
printf '%s\n' "${rows[@]}" | tee "$logs/summary-$tag.txt"
