#!/usr/bin/env bash
# Issue 2 on the GPU machine's Xeon in one call: the CPU kernel tests on every path (AVX-512
# included, which CI's CPUs lack), `strata bench kernels` for the AVX2 and AVX-512 paths at the
# expert shape and the bandwidth-bound shape, and llama.cpp's CPU matrix-vector product on the
# same shapes (bench/llamacpp_matvec.c against a CPU-only llama.cpp built there), then one table.
#
#   tests/gpu/cpu_kernels.sh BUILD_DIR      (a build with strata and test_quant_simd; carry .pack
#                                            with llama-src.tar.xz for the llama.cpp side)
# env: TYPES (default all computable types), TIME (seconds a measurement, 0.1)
set -uo pipefail
cd "$(dirname "$0")/../.."
B=$1
OUT=${OUT:-/tmp/strata-gpu}
mkdir -p "$OUT"
TYPES=${TYPES:-q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl,q2_K,q3_K,q4_K,q5_K,q6_K,iq4_xs,iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s,iq1_s,iq1_m,f16,bf16,f32}
TIME=${TIME:-0.1}
T=$(nproc)

# The llama.cpp side builds while the tests run (they are not timed).
( BACKEND=cpu bench/llamacpp/device_build.sh .pack/llama-src.tar.xz /tmp/build-llamacpp-cpu > "$OUT/llama-cpu-build.log" 2>&1
  echo "exit $?" >> "$OUT/llama-cpu-build.log" ) &
BUILD=$!
echo "== test_quant_simd (every path this CPU runs)"
"$B/test_quant_simd" > "$OUT/test_quant_simd.txt" 2>&1 && r=pass || r=FAIL
grep -E "INFO|PASSED|FAILED|FAIL" "$OUT/test_quant_simd.txt"
echo "test_quant_simd: $r"
wait $BUILD
tail -2 "$OUT/llama-cpu-build.log"

for p in avx2 avx512; do
  for s in 768x2048 big; do
    "$B/strata" bench kernels -t "$T" --type "$TYPES" --path $p --shape $s --time "$TIME" > "$OUT/k-$p-$s.txt" 2>&1
  done
done
L=/tmp/build-llamacpp-cpu
src=$(ls -d $L/src/*/ 2>/dev/null | head -1)
if cc -O2 bench/llamacpp_matvec.c -I"$src/ggml/include" -L$L/obj/bin -lggml -lggml-base -lggml-cpu \
     -Wl,-rpath,$L/obj/bin -o /tmp/llamacpp_matvec 2> "$OUT/lmv-cc.txt"; then
  /tmp/llamacpp_matvec "$T" 1200 "$TYPES" "$TIME" > "$OUT/lmv.txt" 2>&1
else
  echo "llamacpp_matvec did not build:"; head -5 "$OUT/lmv-cc.txt"
fi

# One table: type, strata avx2 / avx512 and llama.cpp at both shapes (N threads), and the
# better strata path over llama.cpp at the bandwidth-bound shape.
python3 - "$OUT" "$TYPES" <<'PY'
import re, sys, os
out, types = sys.argv[1], sys.argv[2].split(",")
def strata(p, s):
    r = {}
    for line in open(os.path.join(out, f"k-{p}-{s}.txt"), errors="replace"):
        c = [x.strip() for x in line.split("|")]
        if len(c) > 6 and c[2] == p: r[c[1]] = float(c[6])
    return r
llama = {}
try:
    for line in open(os.path.join(out, "lmv.txt"), errors="replace"):
        c = [x.strip() for x in line.split("|")]
        if len(c) > 5 and re.match(r"\d+x\d+", c[2] or ""):
            big = int(c[2].split("x")[0]) > 100000
            llama[(c[1], "big" if big else c[2])] = float(c[5])
except OSError:
    pass
s = {(p, sh): strata(p, sh) for p in ("avx2", "avx512") for sh in ("768x2048", "big")}
print(f"{'type':8} | {'avx2 exp':>9} {'avx512 exp':>10} {'llama exp':>9} | {'avx2 big':>9} {'avx512 big':>10} {'llama big':>9} | best/llama big")
for t in types:
    v = [s[("avx2", "768x2048")].get(t), s[("avx512", "768x2048")].get(t), llama.get((t, "768x2048")),
         s[("avx2", "big")].get(t), s[("avx512", "big")].get(t), llama.get((t, "big"))]
    f = lambda x: f"{x:9.1f}" if x is not None else f"{'-':>9}"
    best = max([x for x in v[3:5] if x is not None], default=None)
    ratio = f"{best / v[5]:.2f}" if best and v[5] else "-"
    print(f"{t:8} | {f(v[0])} {f(v[1]):>10} {f(v[2])} | {f(v[3])} {f(v[4]):>10} {f(v[5])} | {ratio}")
PY
