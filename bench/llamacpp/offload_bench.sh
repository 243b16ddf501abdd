#!/usr/bin/env bash
# offload_bench.sh - llama.cpp's llama-bench on a MoE GGUF with partial expert offload at a
# list of GPU memory budgets: for each budget, the smallest --n-cpu-moe N (experts of
# layers 0..N-1 stay in host memory, all else on the GPU) whose estimated GPU use fits,
# then one llama-bench run, with the peak GPU memory measured by nvidia-smi.
#
#   bench/llamacpp/offload_bench.sh MODEL LLAMA_BENCH BUDGETS_GIB [PROMPT=2048] [DECODE=128]
#   e.g. bench/llamacpp/offload_bench.sh /tmp/m/next80b.gguf build-llamacpp/bin/llama-bench 16,24,32,48
#
# Each run: llama-bench -m MODEL -ngl 99 --n-cpu-moe N -p PROMPT -n DECODE -r 2 -fa 1
#           -t <physical cores> -o md -v   (stdout, the md table, is echoed; stderr to a log)
# If a run fails (e.g. out of GPU memory), it is retried with N+2 (up to the layer count),
# and the summary says so.  One summary line per budget at the end:
#   budget_gib  n_cpu_moe  est_gib  peak_gib  pp_tps  tg_tps  note
#
# GPU memory estimate (bytes, from the GGUF's tensor table; the gguf Python package, or a
# built-in header reader when it is missing):
#   dense    every tensor that is not a routed-expert tensor (name matches llama.cpp's
#            --n-cpu-moe regex blk.<i>.ffn_(up|down|gate|gate_up)_(ch|)exps), except
#            token_embd (llama.cpp keeps the input embedding in host memory; when output.weight
#            is absent the tied embedding's output copy is counted instead)
#  +experts  the expert tensors of layers N..L-1
#  +KV       f16 K and V for every attention layer, n_ctx = max(PROMPT, DECODE) padded to 256
#            (llama-bench makes one context per test: pp uses n_ctx=PROMPT, tg n_ctx=DECODE),
#            plus the f32 recurrent state of qwen3next's linear-attention layers (1 sequence)
#  +overhead OVERHEAD_GIB (default 1.5): CUDA context + cuBLAS workspace (~0.5 GiB) and
#            llama.cpp's compute buffer at the default ubatch 512 (~0.3-1 GiB, the output
#            logits alone are 512 x n_vocab x 4 B)
#  +offload  when N > 0: the largest one-layer expert set among layers 0..N-1, since for the
#            prompt (batch >= 32) ggml copies the host-resident expert weights of a layer
#            into the CUDA compute buffer and runs the matmul there (op offload)
# The log of each run keeps llama.cpp's own "CUDA0 model/KV/compute buffer size" lines (-v),
# which the summary also shows (as cuda_buf_gib), to check the estimate against.
#
# env: OVERHEAD_GIB (1.5)  REPS (2)  THREADS (physical cores)  GPU_INDEX (0, for nvidia-smi)
#      LOG_DIR (default $OUT/llamacpp-offload when $OUT is set, else ./llamacpp-offload-logs)
#      EXTRA_ARGS (more llama-bench arguments, word-split)  PYTHON (.venv/bin/python, else python3)
#      DRY_RUN=1 (print the N table and the chosen N per budget, run nothing)
set -euo pipefail

usage() { sed -n '2,12p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
model=$1 bench=$2 budgets=$3 prompt=${4:-2048} decode=${5:-128}
[[ -f $model ]] || { echo "offload_bench: no model at $model" >&2; exit 2; }
[[ ${DRY_RUN:-0} == 1 || -x $bench ]] || { echo "offload_bench: $bench is not an executable" >&2; exit 2; }
[[ $prompt =~ ^[0-9]+$ && $decode =~ ^[0-9]+$ ]] || usage

overhead=${OVERHEAD_GIB:-1.5}
reps=${REPS:-2}
gpu=${GPU_INDEX:-0}
if [[ -z ${THREADS:-} ]]; then
    THREADS=$(lscpu -p=Core,Socket 2>/dev/null | grep -v '^#' | sort -u | wc -l || true)
    [[ $THREADS -gt 0 ]] || THREADS=$(nproc)
fi
if [[ -z ${LOG_DIR:-} ]]; then
    if [[ -n ${OUT:-} ]]; then LOG_DIR=$OUT/llamacpp-offload; else LOG_DIR=./llamacpp-offload-logs; fi
fi
mkdir -p "$LOG_DIR"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
[[ -z ${PYTHON:-} && -x $repo/.venv/bin/python ]] && py=$repo/.venv/bin/python
# the gguf wheel the project carries to the GPU machine (.whl), when python lacks gguf
if ! "$py" -c 'import gguf' 2>/dev/null && ls "$repo"/.whl/gguf-*.whl >/dev/null 2>&1; then
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
           "$repo"/.whl/gguf-*.whl >/dev/null 2>&1; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi

ctx=$(( prompt > decode ? prompt : decode ))
ctx=$(( (ctx + 255) / 256 * 256 ))
stem=$(basename "$model" .gguf)
table=$LOG_DIR/$stem.estimate.tsv

# --- estimate: writes "N<TAB>bytes" for N = 0..L to $table, prints a summary line
"$py" - "$model" "$ctx" "$overhead" "$table" <<'PY'
import os, re, struct, sys
path, n_ctx, overhead_gib, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
EXP = re.compile(r"blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")

def read_with_gguf(p):
    import gguf
    r = gguf.GGUFReader(p)
    meta = {}
    for k, f in r.fields.items():
        try:
            v = f.contents()
        except Exception:
            continue
        if not isinstance(v, list):
            meta[k] = v
    return meta, [(t.name, int(t.n_bytes)) for t in r.tensors], "gguf package"

def read_header(p):   # stdlib only: sizes from the gaps between tensor offsets
    f = open(p, "rb")
    rd = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]
    rs = lambda: f.read(rd("Q")).decode("utf-8", "replace")
    if f.read(4) != b"GGUF":
        raise SystemExit("offload_bench: %s is not a GGUF file" % p)
    ver = rd("I"); n_t = rd("Q"); n_kv = rd("Q")
    S = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    def val(t):
        if t == 8: return rs()
        if t == 9:
            et = rd("I"); n = rd("Q")
            if et in S and et != 8:
                f.seek(n * struct.calcsize(S[et]), 1); return None
            for _ in range(n): val(et)
            return None
        return rd(S[t])
    meta = {}
    for _ in range(n_kv):
        k = rs(); v = val(rd("I"))
        if v is not None: meta[k] = v
    infos = []
    for _ in range(n_t):
        name = rs(); nd = rd("I"); f.seek(8 * nd, 1); rd("I"); infos.append((name, rd("Q")))
    align = int(meta.get("general.alignment", 32))
    start = (f.tell() + align - 1) // align * align
    end = os.path.getsize(p) - start
    infos.sort(key=lambda x: x[1])
    tensors = [(n, (infos[i + 1][1] if i + 1 < len(infos) else end) - o) for i, (n, o) in enumerate(infos)]
    return meta, tensors, "built-in GGUF reader"

try:
    meta, tensors, how = read_with_gguf(path)
except ImportError:
    meta, tensors, how = read_header(path)

arch = meta["general.architecture"]
g = lambda k, d=None: meta.get(f"{arch}.{k}", d)
L = int(g("block_count"))
names = {n for n, _ in tensors}
exp = [0] * L
dense = 0
for n, b in tensors:
    m = EXP.search(n)
    if m and int(m.group(1)) < L:
        exp[int(m.group(1))] += b
    elif n.startswith("token_embd."):
        if n == "token_embd.weight" and "output.weight" not in names:
            dense += b          # tied output: llama.cpp puts a copy on the output (GPU) layer
    else:
        dense += b

n_head_kv = int(g("attention.head_count_kv", g("attention.head_count")))
hk = int(g("attention.key_length", int(g("embedding_length")) // int(g("attention.head_count"))))
hv = int(g("attention.value_length", hk))
interval = int(g("full_attention_interval", 1) or 1)
attn = [il for il in range(L) if arch != "qwen3next" or (il + 1) % interval == 0]
kv = len(attn) * n_ctx * n_head_kv * (hk + hv) * 2
rs = 0
if arch == "qwen3next":
    d_conv, d_state = int(g("ssm.conv_kernel")), int(g("ssm.state_size"))
    n_group, d_inner = int(g("ssm.group_count")), int(g("ssm.inner_size"))
    rs = (L - len(attn)) * 4 * ((d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner)
over = int(overhead_gib * 2**30)
with open(out, "w") as f:
    for N in range(L + 1):
        est = dense + sum(exp[N:]) + kv + rs + over + (max(exp[:N]) if N else 0)
        f.write(f"{N}\t{est}\n")
G = 2**30
print(f"model {os.path.basename(path)}: {arch}, {L} layers, read with the {how}; dense on GPU "
      f"{dense/G:.2f} GiB, experts {sum(exp)/G:.2f} GiB ({max(exp)/G:.3f} GiB/layer max), "
      f"KV+state {(kv+rs)/G:.3f} GiB at n_ctx {n_ctx}, overhead {overhead_gib} GiB")
PY

L=$(( $(wc -l < "$table") - 1 ))
est_of() { awk -F'\t' -v n="$1" '$1 == n { print $2 }' "$table"; }
gib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1073741824 }'; }
pick_n() {  # smallest N whose estimate fits $1 GiB, or -1
    awk -F'\t' -v cap="$1" 'BEGIN { cap *= 1073741824 } $2 <= cap { print $1; found = 1; exit }
                            END { if (!found) print -1 }' "$table"
}

echo "offload_bench: threads $THREADS, n_ctx $ctx, logs in $LOG_DIR"
printf 'estimate by --n-cpu-moe: '
for ((n = 0; n < L; n += (L > 16 ? L / 8 : 1))); do printf 'N=%d %s GiB  ' "$n" "$(gib "$(est_of $n)")"; done
printf 'N=%d %s GiB\n' "$L" "$(gib "$(est_of "$L")")"

have_smi=0
command -v nvidia-smi >/dev/null && nvidia-smi -i "$gpu" >/dev/null 2>&1 && have_smi=1
[[ $have_smi == 1 ]] || echo "offload_bench: nvidia-smi not usable: no measured peak"

# md table cell of test "$2" (e.g. pp2048) in file $1: the mean t/s
tps() { awk -F'|' -v t="$2" '{ for (i = 2; i < NF; i++) { c = $i; gsub(/ /, "", c); if (c == t) { v = $(NF-1); sub(/±.*/, "", v); gsub(/ /, "", v); print v; exit } } }' "$1"; }

summary=()
IFS=',' read -r -a blist <<< "$budgets"
for budget in "${blist[@]}"; do
    budget=${budget// /}
    n=$(pick_n "$budget")
    note=""
    if [[ $n -lt 0 ]]; then
        n=$L; note="does not fit even with all experts on the CPU; using N=$L"
    fi
    est=$(gib "$(est_of "$n")")
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        summary+=("$(printf '%-8s %-6s %-8s %-8s %-10s %-10s %s' "$budget" "$n" "$est" - - - "dry run${note:+; $note}")")
        continue
    fi
    while :; do
        tag=${stem}_b${budget}_n$n
        md=$LOG_DIR/$tag.md errlog=$LOG_DIR/$tag.log smi=$LOG_DIR/$tag.smi
        cmd=("$bench" -m "$model" -ngl 99 --n-cpu-moe "$n" -p "$prompt" -n "$decode" -r "$reps"
             -fa 1 -t "$THREADS" -o md -v)
        # shellcheck disable=SC2206
        [[ -n ${EXTRA_ARGS:-} ]] && cmd+=($EXTRA_ARGS)
        echo "== budget $budget GiB: --n-cpu-moe $n (est $est GiB): ${cmd[*]}"
        base=0 smipid=""
        if [[ $have_smi == 1 ]]; then
            base=$(nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
            nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$smi" 2>/dev/null &
            smipid=$!
        fi
        t0=$(date +%s); rc=0
        "${cmd[@]}" > "$md" 2> "$errlog" || rc=$?
        secs=$(( $(date +%s) - t0 ))
        peak=-
        if [[ -n $smipid ]]; then
            kill "$smipid" 2>/dev/null || true; wait "$smipid" 2>/dev/null || true
            peak=$(awk -v b="$base" '$1+0 > m { m = $1+0 } END { printf "%.2f", (m - b) / 1024 }' "$smi")
        fi
        cat "$md"
        pp=$(tps "$md" "pp$prompt"); tg=$(tps "$md" "tg$decode")
        if [[ $rc -eq 0 && -n $pp$tg ]]; then
            # llama.cpp's own CUDA0 buffers: model + KV + RS + compute, each the largest of
            # the contexts llama-bench made (one per test)
            buf=$(awk '/CUDA0 +[A-Za-z]+ buffer size =/ { for (i = 1; i < NF; i++) if ($i == "CUDA0") k = $(i+1);
                         for (i = 1; i < NF; i++) if ($(i+1) == "MiB" && $i + 0 > m[k]) m[k] = $i + 0 }
                       END { for (k in m) s += m[k]; if (s) printf "%.2f", s / 1024 }' "$errlog")
            summary+=("$(printf '%-8s %-6s %-8s %-8s %-10s %-10s %s' "$budget" "$n" "$est" "$peak" "${pp:--}" "${tg:--}" \
                      "${secs}s${buf:+ cuda_buf_gib=$buf}${note:+; $note}")")
            break
        fi
        echo "offload_bench: run failed (rc $rc); last lines of $errlog:" >&2
        grep -iE 'out of memory|error|failed' "$errlog" | tail -n 5 >&2 || tail -n 5 "$errlog" >&2
        if [[ $n -ge $L ]]; then
            summary+=("$(printf '%-8s %-6s %-8s %-8s %-10s %-10s %s' "$budget" "$n" "$est" "$peak" - - "FAILED rc $rc${note:+; $note}")")
            break
        fi
        note="${note:+$note; }N=$n failed (rc $rc), retried N=$(( n + 2 > L ? L : n + 2 ))"
        n=$(( n + 2 > L ? L : n + 2 ))
        est=$(gib "$(est_of "$n")")
    done
done

echo
echo "== llama.cpp offload summary: $(basename "$model"), pp$prompt tg$decode, -r $reps, -t $THREADS, overhead $overhead GiB"
printf '%-8s %-6s %-8s %-8s %-10s %-10s %s\n' budget_gib N est_gib peak_gib pp_tps tg_tps note
printf '%s\n' "${summary[@]}"
