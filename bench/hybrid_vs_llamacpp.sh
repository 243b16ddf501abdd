#!/usr/bin/env bash
# Strata's hybrid decode and prompt next to llama.cpp's best --n-cpu-moe at each GPU budget, on
# one model in one call of the GPU machine (issue 7's benchmark: only same-run ratios count, since
# both engines' CPU shares move with the host). Builds llama.cpp's llama-bench from the carried
# source first (bench/llamacpp/device_build.sh) unless LLAMA_BENCH names one, runs
# bench/llamacpp/offload_bench.sh, then `strata bench --resident-experts --vram-budget-gib B`
# ROUNDS times a budget (interleaved), and prints one table with the ratios last.
#
#   bench/hybrid_vs_llamacpp.sh MODEL BUDGETS [PROMPT=512] [DECODE=256]
#   e.g. bench/hybrid_vs_llamacpp.sh /tmp/m/q30.gguf 16,12
#
# env (paths from the repository's root): STRATA (default gpu-pack/strata, else build/strata), LLAMA_BENCH (a built llama-bench: no
# build), ROUNDS (Strata runs a budget, default 2), LLAMA_REPS (llama-bench's -r, default 1), STRATA_ARGS (more `strata bench` flags, e.g.
# --expert-profile F; a profile next to the model, MODEL minus .gguf plus .profile, is used when
# present), OUT (logs under $OUT/hybrid-vs-llamacpp, default ./hybrid-vs-llamacpp-logs).
# llama-bench runs -p PROMPT -n 128 (its decode test), Strata --prompt PROMPT --decode DECODE.
set -uo pipefail
[[ $# -ge 2 ]] || { sed -n 2,17p "$0" >&2; exit 2; }
model=$1 budgets=$2 prompt=${3:-512} decode=${4:-256}
[[ -f $model ]] || { echo "hybrid_vs_llamacpp: no model at $model" >&2; exit 2; }
model=$(realpath "$model")
[[ $budgets =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "hybrid_vs_llamacpp: BUDGETS must be like 16,12" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 2
rounds=${ROUNDS:-2}
strata=${STRATA:-}
[[ -n $strata ]] || { [[ -x gpu-pack/strata ]] && strata=gpu-pack/strata || strata=build/strata; }
[[ -x $strata ]] || { echo "hybrid_vs_llamacpp: no strata binary at $strata (set STRATA)" >&2; exit 2; }
logs=${OUT:-./hybrid-vs-llamacpp-logs}/hybrid-vs-llamacpp
mkdir -p "$logs"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }

lb=${LLAMA_BENCH:-}
if [[ -z $lb ]]; then
  echo "== building llama.cpp (log: $logs/llama-build.log)"
  bench/llamacpp/device_build.sh >"$logs/llama-build.log" 2>&1 || { tail -5 "$logs/llama-build.log"; exit 1; }
  lb=$(tail -1 "$logs/llama-build.log")
  echo "   built in $(el) s: $lb"
fi
[[ -x $lb ]] || { echo "hybrid_vs_llamacpp: no llama-bench at $lb" >&2; exit 1; }

echo "== llama.cpp (bench/llamacpp/offload_bench.sh)"
OUT=$logs REPS=${LLAMA_REPS:-1} bench/llamacpp/offload_bench.sh "$model" "$lb" "$budgets" "$prompt" 128 >"$logs/llama.txt" 2>&1
sed -n '/offload summary/,$p' "$logs/llama.txt"

profile=${model%.gguf}.profile
args="--gpu 0 --resident-experts --prompt $prompt --decode $decode ${STRATA_ARGS:-}"
[[ -f $profile && ${STRATA_ARGS:-} != *--expert-profile* ]] && args="$args --expert-profile $profile"
declare -A dec pp
echo "== Strata ($strata $args), $rounds rounds"
for r in $(seq 1 "$rounds"); do
  for b in ${budgets//,/ }; do
    log=$logs/strata-$b-$r.txt
    # shellcheck disable=SC2086
    timeout 300 "$strata" bench -m "$model" $args --vram-budget-gib "$b" >"$log" 2>&1
    d=$(awk '/^decode +[0-9]/ {print $NF}' "$log")
    p=$(awk '/^prompt +[0-9]/ {print $NF}' "$log")
    printf '   %s GiB r%d: decode %s prompt %s | %s | %s\n' "$b" "$r" "${d:--}" "${p:--}" \
      "$(grep -m1 -oE 'the rest from [a-z -]+' "$log")" "$(grep -oE 'hit rate [0-9.]+%' "$log" | tail -1)"
    dec[$b]="${dec[$b]:-} ${d:--}"
    pp[$b]="${pp[$b]:-} ${p:--}"
  done
done

echo
echo "== summary: $(basename "$model"), prompt $prompt, decode $decode (llama.cpp tg128), $(el) s"
printf '%-7s %-22s %-24s %-10s %-10s %-8s %-8s\n' budget strata_decode strata_prompt llama_tg llama_pp decode_x prompt_x
for b in ${budgets//,/ }; do
  row=$(awk -v b="$b" '$1 == b && NF >= 6 {print $5, $6}' <(sed -n '/^budget_gib/,$p' "$logs/llama.txt"))
  lpp=${row% *} ltg=${row#* }
  best_d=$(tr ' ' '\n' <<<"${dec[$b]}" | grep -E '^[0-9.]+$' | sort -g | tail -1)
  best_p=$(tr ' ' '\n' <<<"${pp[$b]}" | grep -E '^[0-9.]+$' | sort -g | tail -1)
  rx() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else printf "-" }'; }
  printf '%-7s %-22s %-24s %-10s %-10s %-8s %-8s\n' "$b" "${dec[$b]# }" "${pp[$b]# }" "${ltg:--}" "${lpp:--}" \
    "$(rx "${best_d:-0}" "${ltg:-0}")" "$(rx "${best_p:-0}" "${lpp:-0}")"
done
echo "(ratios: Strata's best round over llama.cpp's run; every Strata round is listed)"
