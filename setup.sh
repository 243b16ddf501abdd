#!/usr/bin/env bash
# Strata set-up: installs what is missing (Debian packages, a Python virtual environment under
# the repository), then configures and builds. Safe to run again: it only does what changed.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)

QUIET=0
for a in "$@"; do
  case "$a" in
    --quiet) QUIET=1 ;;
    -h|--help)
      cat <<'USAGE'
usage: ./setup.sh [--quiet]
  Installs missing Debian packages (cmake, a C compiler, libmicrohttpd, jansson, PCRE2, cmocka),
  makes the Python environment .venv for tools and tests, and builds Strata into build/.
  --quiet   print only what is done, not what is already in place
USAGE
      exit 0 ;;
    *) echo "setup.sh: unknown option '$a' (see ./setup.sh --help)" >&2; exit 2 ;;
  esac
done
say() { echo "setup: $*"; }
note() { [ "$QUIET" = 1 ] || echo "setup: $*"; }

# ---- Debian packages
DEB_PKGS="cmake gcc make pkg-config python3 python3-venv libmicrohttpd-dev libjansson-dev libpcre2-dev libcmocka-dev clang libclang-rt-dev"
missing=""
for p in $DEB_PKGS; do
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
else
  note "Debian packages in place"
fi

# ---- Python environment for tools and tests
REQ=tools/requirements.txt
STAMP=.venv/.requirements.sha
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

# ---- build
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
if [ ! -f build/CMakeCache.txt ]; then
  say "configuring build/"
  cmake -S . -B build $GEN -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
note "building build/"
cmake --build build -j"$(nproc)" >/dev/null || { cmake --build build -j1; exit 1; }
note "built build/strata"
