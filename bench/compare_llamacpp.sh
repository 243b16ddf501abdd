#!/usr/bin/env bash
# Strata and llama.cpp's llama-bench on the same GGUF, one after the other, on the CPU: prompt
# and decode tokens/s, for bench/results/. Timings on shared machines are noisy: compare the
# two within one run.
#
#   bench/compare_llamacpp.sh MODEL LLAMA_BENCH THREADS [PROMPT_TOKENS] [DECODE_TOKENS]
#
# LLAMA_BENCH: a llama-bench built from the llama-cpp-python source package
# (pip download --no-binary :all: --no-deps llama-cpp-python; vendor/llama.cpp; cmake
# -DGGML_NATIVE=ON -DLLAMA_CURL=OFF; target llama-bench).
set -euo pipefail
model=$1 llama=$2 threads=$3 prompt=${4:-512} decode=${5:-128}
strata=${STRATA_BIN:-$(dirname "$0")/../build/strata}
echo "== machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== model: $model ($(du -h "$model" | cut -f1))"
cat "$model" > /dev/null # both read it from the page cache
echo "== strata ($("$strata" help >/dev/null 2>&1; git -C "$(dirname "$0")" describe --always --dirty 2>/dev/null))"
"$strata" bench -m "$model" -t "$threads" --prompt "$prompt" --decode "$decode"
echo "== llama.cpp"
"$llama" -m "$model" -t "$threads" -p "$prompt" -n "$decode" -r 1 -o md
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
