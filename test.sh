#!/usr/bin/env bash
# Runs every test: the C unit tests (CTest) and the integration tests (pytest), both against an
# AddressSanitizer + UndefinedBehaviorSanitizer build, plus a short fuzz run of the GGUF reader.
# Ends with one line: "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")"
./setup.sh --quiet || { echo "test: setup failed"; echo "0 passed, 1 failed"; exit 1; }

GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
RESULTS=build-asan/results
mkdir -p "$RESULTS"
rm -f "$RESULTS"/*.xml
failed_steps=0

echo "test: building the sanitizer build (build-asan/)"
if [ ! -f build-asan/CMakeCache.txt ]; then
  cmake -S . -B build-asan $GEN -DCMAKE_BUILD_TYPE=Debug -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF >/dev/null
fi
if ! cmake --build build-asan -j"$(nproc)" >"$RESULTS/build.log" 2>&1; then
  cat "$RESULTS/build.log"; echo "test: the sanitizer build failed"; echo "0 passed, 1 failed"; exit 1
fi

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export STRATA_BIN="$PWD/build-asan/strata"
export STRATA_RELEASE_BIN="$PWD/build/strata"

echo "test: unit tests (ctest)"
(cd build-asan && ctest --output-on-failure --output-junit results/ctest.xml -j"$(nproc)") || failed_steps=$((failed_steps+1))

echo "test: integration tests (pytest)"
.venv/bin/python -m pytest -q tests/integration --junitxml="$RESULTS/pytest.xml"
rc=$?
[ $rc = 0 ] || [ $rc = 5 ] || failed_steps=$((failed_steps+1))

# A bounded libFuzzer run of the GGUF reader (clang build in build-fuzz/), counted as one test
# case; new inputs go to tests/fuzz/corpus-run/ (ignored), the seeds stay untouched. See
# docs/TESTING.md for long runs.
echo "test: fuzzing the GGUF reader (build-fuzz/, ${STRATA_FUZZ_RUNS:=20000} runs)"
fuzz_log="$RESULTS/fuzz_gguf.log"
fuzz_ok=0
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  CC=clang cmake -S . -B build-fuzz $GEN -DCMAKE_BUILD_TYPE=Debug -DSTRATA_FUZZ=ON -DSTRATA_CUDA=OFF >"$fuzz_log" 2>&1
fi
if cmake --build build-fuzz --target fuzz_gguf -j"$(nproc)" >>"$fuzz_log" 2>&1; then
  mkdir -p tests/fuzz/corpus-run/gguf
  build-fuzz/fuzz_gguf -runs="$STRATA_FUZZ_RUNS" -max_total_time=120 -max_len=4096 -artifact_prefix="$RESULTS/" \
    tests/fuzz/corpus-run/gguf tests/fuzz/corpus/gguf >>"$fuzz_log" 2>&1 && fuzz_ok=1
fi
.venv/bin/python - "$RESULTS/fuzz.xml" "$fuzz_log" "$fuzz_ok" <<'PY'
import sys
from xml.sax.saxutils import escape
out, log, ok = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
body = "" if ok else f'<failure message="fuzz_gguf failed">{escape(open(log, errors="replace").read()[-4000:])}</failure>'
open(out, "w").write(f'<testsuite name="fuzz"><testcase classname="fuzz" name="fuzz_gguf">{body}</testcase></testsuite>\n')
PY
[ $fuzz_ok = 1 ] || { tail -20 "$fuzz_log"; failed_steps=$((failed_steps+1)); }

.venv/bin/python - "$RESULTS" "$failed_steps" <<'PY'
import sys, glob, xml.etree.ElementTree as ET
passed = failed = skipped = 0
for f in glob.glob(sys.argv[1] + "/*.xml"):
    for case in ET.parse(f).getroot().iter("testcase"):
        kids = {c.tag for c in case}
        if kids & {"failure", "error"}: failed += 1
        elif "skipped" in kids: skipped += 1
        else: passed += 1
steps = int(sys.argv[2])
if steps and not failed: failed = steps  # a runner failed without a failing case (crash, build)
print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
sys.exit(1 if failed else 0)
PY
