#!/usr/bin/env bash
# Strata set-up: installs what is missing (Debian packages, a Python virtual environment under
# the repository), lists the NVIDIA GPUs, builds for their architectures, writes the server's
# config strata-<model>.json and starts `strata serve` with it. Safe to run again: it only does
# what changed, and a kept config starts at once. `--quiet` (test.sh) only sets up and builds.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)

usage() {
  cat <<'USAGE'
usage: ./setup.sh [--yes] [--no-start] [--model FILE] [--gpu N|cpu|auto] [--port N]
       ./setup.sh --quiet
  Installs missing Debian packages (cmake, a C compiler, libmicrohttpd, jansson, PCRE2, cmocka,
  chromium for the browser test), makes the Python environment .venv for tools and tests, lists
  your NVIDIA GPUs and builds Strata into build/ for their architectures. Then it writes the
  server's config strata-<model>.json and starts `build/strata serve --config strata-<model>.json`,
  printing the address of the chat page. A second run finds the kept config and starts at once.

  --model FILE     the GGUF model to serve (default: the embedded models/tiny-coder.gguf, or the
                   newest kept strata-*.json when there is one)
  --gpu N|cpu|auto the GPU to use (its nvidia-smi index), the CPU only, or auto (every usable GPU);
                   default: the one usable GPU, auto with several, cpu with none
  --port N         the server's port (default 8080; the host is 127.0.0.1)
  -y, --yes        take the defaults without asking (also when stdin is not a terminal)
  --no-start       stop after set-up: write the config but do not start the server
  --quiet          set up and build only (what test.sh runs): print only what is done, never ask,
                   never start the server
  -h, --help       this text
See docs/SETUP.md.
USAGE
}

die() { echo "setup.sh: $*" >&2; exit 2; }
QUIET=0 YES=0 START=1 MODEL="" GPU="" PORT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quiet) QUIET=1 ;;
    -y|--yes) YES=1 ;;
    --no-start) START=0 ;;
    --model|--gpu|--port)
      [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value (see ./setup.sh --help)"
      case "$1" in --model) MODEL=$2 ;; --gpu) GPU=$2 ;; --port) PORT=$2 ;; esac
      shift ;;
    --model=*|--gpu=*|--port=*)
      v=${1#*=}; [ -n "$v" ] || die "${1%%=*} needs a value (see ./setup.sh --help)"
      case "$1" in --model=*) MODEL=$v ;; --gpu=*) GPU=$v ;; --port=*) PORT=$v ;; esac ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see ./setup.sh --help)" ;;
  esac
  shift
done
if [ "$QUIET" = 1 ] && [ -n "$MODEL$GPU$PORT" ]; then
  die "--quiet only sets up and builds; it takes no --model, --gpu or --port"
fi
if [ -n "$MODEL" ]; then
  [ -f "$MODEL" ] || die "--model: no such file '$MODEL'"
  case "$MODEL" in *.gguf|*.GGUF) ;; *) die "--model: '$MODEL' is not a .gguf file" ;; esac
  MODEL=$(realpath "$MODEL")
fi
case "$GPU" in
  ""|cpu|auto) ;;
  *[!0-9]*) die "--gpu: '$GPU' is not a GPU index, cpu or auto" ;;
esac
if [ -n "$PORT" ]; then
  case "$PORT" in *[!0-9]*) die "--port: '$PORT' is not a number" ;; esac
  [ "${#PORT}" -le 5 ] && [ "$PORT" -ge 1 ] && [ "$PORT" -le 65535 ] || die "--port: $PORT is not in 1..65535"
fi
ASK=0
[ "$YES" = 0 ] && [ "$QUIET" = 0 ] && [ -t 0 ] && ASK=1

say() { echo "setup: $*"; }
note() { [ "$QUIET" = 1 ] || echo "setup: $*"; }

# STRATA_SETUP_SKIP_BUILD=1 skips the packages, .venv and the build (tests/integration/test_setup.py
# checks the flags, the GPU list and the config this way, in seconds).
SKIP_BUILD=${STRATA_SETUP_SKIP_BUILD:-0}

# ---- Debian packages
DEB_PKGS="cmake gcc make pkg-config python3 python3-venv libmicrohttpd-dev libjansson-dev libpcre2-dev libcmocka-dev clang libclang-rt-dev chromium chromium-driver"
missing=""
[ "$SKIP_BUILD" = 1 ] || for p in $DEB_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null; then SUDO=sudo; else
      say "missing Debian packages:$missing"; say "install them as root: apt-get install$missing"; exit 1
    fi
  fi
  say "installing Debian packages:$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
elif [ "$SKIP_BUILD" = 0 ]; then
  note "Debian packages in place"
fi

# ---- Python environment for tools and tests
REQ=tools/requirements.txt
STAMP=.venv/.requirements.sha
if [ "$SKIP_BUILD" = 0 ]; then
  want=$(sha256sum "$REQ" | cut -d' ' -f1)
  if [ ! -x .venv/bin/python ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    say "preparing the Python environment .venv ($REQ)"
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -r "$REQ"
    echo "$want" > "$STAMP"
  else
    note "Python environment in place"
  fi
fi

# ---- NVIDIA GPUs: index|name|MiB|compute capability per line, from nvidia-smi
GPUS=""
if command -v nvidia-smi >/dev/null; then
  GPUS=$(nvidia-smi --query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits 2>/dev/null |
    awk -F', *' 'NF >= 4 { printf "%s|%s|%s|%s\n", $1, $2, $3, $4 }') || GPUS=""
fi
gpu_label() {   # "GPU 0 (NVIDIA GeForce RTX 5080, 16 GB)"
  awk -F'|' -v i="$1" '$1 == i { printf "GPU %s (%s, %d GB)", $1, $2, ($3 + 512) / 1024 }' <<< "$GPUS"
}
cc_ok() { awk -v c="$1" 'BEGIN { split(c, v, "."); exit !(v[1] > 7 || (v[1] == 7 && v[2] >= 5)) }'; }
USABLE=""   # indices Strata can use, in nvidia-smi's order
ARCHS=""    # "86;90": the usable GPUs' architectures, for -DSTRATA_CUDA_ARCHS
while IFS='|' read -r idx name mib cc; do
  [ -n "$idx" ] || continue
  if cc_ok "$cc"; then
    USABLE="$USABLE $idx"
    a=${cc/./}
    case ";$ARCHS;" in *";$a;"*) ;; *) ARCHS="${ARCHS:+$ARCHS;}$a" ;; esac
  fi
done <<< "$GPUS"
USABLE=${USABLE# }
ARCHS=$(tr ';' '\n' <<< "$ARCHS" | sort -n | paste -sd';')

# ---- build (for the usable GPUs' architectures; without GPUs, CMake's default list)
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
if [ "$SKIP_BUILD" = 1 ]; then
  [ -z "$ARCHS" ] || note "CUDA architectures: $ARCHS"
else
  ARCH_ARG=()
  if [ -n "$ARCHS" ]; then
    ARCH_ARG=(-DSTRATA_CUDA_ARCHS="$ARCHS")
    if [ -f build/CMakeCache.txt ] && ! grep -qx "STRATA_CUDA_ARCHS:STRING=$ARCHS" build/CMakeCache.txt; then
      say "configuring build/ for CUDA architectures $ARCHS"
      cmake -S . -B build "${ARCH_ARG[@]}" >/dev/null
    fi
  fi
  if [ ! -f build/CMakeCache.txt ]; then
    say "configuring build/${ARCHS:+ for CUDA architectures $ARCHS}"
    cmake -S . -B build $GEN -DCMAKE_BUILD_TYPE=Release "${ARCH_ARG[@]}" >/dev/null
  fi
  note "building build/"
  cmake --build build -j"$(nproc)" >/dev/null || { cmake --build build -j1; exit 1; }
  note "built build/strata"
fi
[ "$QUIET" = 1 ] && exit 0

# ---- the GPU list, in the words of docs/SETUP.md
BIN=build/strata
echo
devs=""
if [ -x "$BIN" ]; then devs=$("$BIN" devices --brief 2>/dev/null | grep '^GPU ' || true); fi
if [ -n "$devs" ]; then
  # strata devices asks the CUDA runtime itself: its word on what can be used is the one kept
  echo "Your NVIDIA GPUs:"
  echo "$devs"
  USABLE=$(sed -nE 's/^GPU ([0-9]+):.* - can be used$/\1/p' <<< "$devs" | paste -sd' ')
elif [ -n "$GPUS" ]; then
  echo "Your NVIDIA GPUs:"
  while IFS='|' read -r idx name mib cc; do
    [ -n "$idx" ] || continue
    gb=$(( (mib + 512) / 1024 ))
    if cc_ok "$cc"; then
      echo "GPU $idx: $name, $gb GB VRAM - can be used"
    else
      echo "GPU $idx: $name, $gb GB VRAM - not supported - older than the RTX 20 series (compute capability $cc; Strata needs 7.5 or newer)"
    fi
  done <<< "$GPUS"
else
  say "no NVIDIA GPU found (no nvidia-smi, or it lists none)"
fi
HAVE_CUDA=1
if [ "$SKIP_BUILD" = 0 ] && ! compgen -G "build/CMakeFiles/*/CMakeCUDACompiler.cmake" >/dev/null; then HAVE_CUDA=0; fi
# Why the build has no CUDA backend, in CMake's words (cmake/cuda_toolkit.cmake: no nvcc, a
# toolkit older than 12.0, ...).
NO_CUDA_WHY=$(sed -n 's/^STRATA_NO_CUDA_WHY:INTERNAL=//p' build/CMakeCache.txt 2>/dev/null || true)
[ -z "$NO_CUDA_WHY" ] || HAVE_CUDA=0

# ---- the config: strata-<model>.json, named after the GGUF file (shard suffix dropped)
model_name() {
  local b
  b=$(basename "$1"); b=${b%.[gG][gG][uU][fF]}
  b=$(sed -E 's/-[0-9]{5}-of-[0-9]{5}$//' <<< "$b")
  tr -c 'A-Za-z0-9._\n-' '-' <<< "$b"
}
CONFIG=""
if [ -z "$MODEL" ]; then
  CONFIG=$(ls -t strata-*.json 2>/dev/null | head -n1 || true)
  [ -n "$CONFIG" ] || MODEL="$ROOT/models/tiny-coder.gguf"
fi
[ -n "$CONFIG" ] || CONFIG="strata-$(model_name "$MODEL").json"

if [ -f "$CONFIG" ] && [ -z "$GPU$PORT" ]; then
  say "using the kept config $CONFIG (delete it, or pass --gpu / --port, to choose again)"
else
  if [ -z "$GPU" ] && [ -f "$CONFIG" ]; then
    GPU=$(python3 -c 'import json,sys; g=json.load(open(sys.argv[1])).get("gpu","auto"); print(g)' "$CONFIG")
  fi
  if [ -z "$GPU" ]; then
    set -- $USABLE
    if [ $# = 0 ] || [ "$HAVE_CUDA" = 0 ]; then
      GPU=cpu
    elif [ $# = 1 ]; then
      GPU=$1
    else
      GPU=auto
      if [ "$ASK" = 1 ]; then
        labels=(); for g in "$@"; do labels+=("$(gpu_label "$g")"); done
        joined=$(printf ' + %s' "${labels[@]}")
        echo "1) ${joined:3} together (recommended)"
        n=1; for l in "${labels[@]}"; do n=$((n + 1)); echo "$n) $l only"; done
        echo "$((n + 1))) the CPU only"
        while :; do
          read -r -p "Which GPUs? [1]: " ans || ans=""
          ans=${ans:-1}
          case "$ans" in *[!0-9]*|"") ;; *)
            if [ "$ans" = 1 ]; then GPU=auto; break
            elif [ "$ans" -le "$n" ]; then shift $((ans - 2)); GPU=$1; break
            elif [ "$ans" = $((n + 1)) ]; then GPU=cpu; break; fi ;;
          esac
          echo "Answer a number from 1 to $((n + 1))."
        done
      fi
    fi
  elif [ "$GPU" != cpu ] && [ "$GPU" != auto ] && ! grep -qw "$GPU" <<< "$USABLE"; then
    die "--gpu $GPU: not a usable GPU here (usable: ${USABLE:-none})"
  fi
  [ -n "$MODEL" ] || MODEL=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["model"])' "$CONFIG")
  python3 - "$CONFIG" "$MODEL" "$GPU" "${PORT:-}" <<'PY'
import json, os, sys
path, model, gpu, port = sys.argv[1:5]
cfg = {"model": model, "gpu": "auto", "host": "127.0.0.1", "port": 8080, "parallel": 1, "ctx": 0, "args": []}
if os.path.exists(path):
    cfg.update(json.load(open(path)))   # keeps what was edited by hand
cfg["model"] = model
cfg["gpu"] = int(gpu) if gpu.isdigit() else gpu
if port:
    cfg["port"] = int(port)
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(cfg, f, indent=2)
    f.write("\n")
os.replace(tmp, path)
PY
  say "wrote $CONFIG"
fi
GPU_NOW=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("gpu","auto"))' "$CONFIG")
if [ "$GPU_NOW" = cpu ] || [ -z "$USABLE" ] || [ "$HAVE_CUDA" = 0 ]; then
  if [ -n "$USABLE" ] && [ "$HAVE_CUDA" = 0 ]; then
    say "this build has no CUDA backend (${NO_CUDA_WHY:-nvcc was not found}): Strata will run on the CPU"
  elif [ -z "$USABLE" ]; then
    say "no NVIDIA GPU that Strata can use: it will run on the CPU"
  else
    say "Strata will run on the CPU (\"gpu\": \"cpu\" in $CONFIG)"
  fi
elif [ "$GPU_NOW" = auto ]; then
  say "Strata will use every usable GPU: $USABLE (\"gpu\": \"auto\" in $CONFIG)"
else
  say "Strata will use GPU $GPU_NOW (\"gpu\" in $CONFIG)"
fi

# ---- start
if [ "$START" = 0 ]; then
  say "set-up done; start the server with: $BIN serve --config $CONFIG"
  exit 0
fi
if ! "$BIN" serve --help >/dev/null 2>&1; then
  say "this build of strata has no server yet (strata serve); the config is ready: $CONFIG"
  exit 1
fi
read -r HOST PORT_NOW < <(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("host","127.0.0.1"), c.get("port",8080))' "$CONFIG")
case "$HOST" in 0.0.0.0|::|"") HOST=127.0.0.1 ;; esac
case "$HOST" in *:*) HOST="[$HOST]" ;; esac
say "starting the server: $BIN serve --config $CONFIG"
say "chat in your browser at http://$HOST:$PORT_NOW/ (Ctrl-C stops the server)"
exec "$BIN" serve --config "$CONFIG"
