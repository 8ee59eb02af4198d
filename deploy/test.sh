#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: unit,
# integration (the server on a real port) and end-to-end (the real binary
# called from Python), plus the deployment checks.
# Before them, the README's serve command exactly as written (it builds
# build-serve/, Release, and must reach SERVING, answer and exit 0 on SIGTERM);
# SERVE_CHECK=none skips it.
# Then the tests labelled `asan` again under ASan + UBSan, and those labelled
# `tsan` under ThreadSanitizer (deploy/sanitize.sh all; SANITIZE=none skips
# both, SANITIZE=asan or tsan runs one).
# Then the integration and end-to-end tests while stress-ng keeps every core
# busy (STRESS=none skips it): they must not depend on timing. Last, the rest
# of the suite (all of it with STRESS=none).
# Extra arguments go to that last ctest (e.g. -L unit, -R Attention).
# The builds go through ccache when it is installed (it is a test dependency):
# the core-only build then reuses the main build's objects.
# In CI (CI=true) warnings are errors, and a test that skipped although the
# machine has the CPU features it needs fails the run.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,18p' "$0"; exit 0 ;; esac
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO/build}"
"$REPO/deploy/install_deps.sh"
if command -v ccache > /dev/null; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
  # Objects are shared between build folders (paths relative to the repository).
  export CCACHE_BASEDIR="$REPO" CCACHE_NOHASHDIR=true
fi
start=$(date +%s)
"$REPO/deploy/build.sh" "$BUILD_DIR" RelWithDebInfo
echo "test.sh: built in $(( $(date +%s) - start )) s"
"$REPO/deploy/check_runtime_deps.sh" "$BUILD_DIR"

# A newcomer's first command as the README writes it (deploy/serve.sh, read from the
# README by the test, so it checks whatever the README says).
if [ "${SERVE_CHECK:-run}" != none ]; then
  start=$(date +%s)
  # As a newcomer runs it: without the test builds' ccache.
  env -u CMAKE_C_COMPILER_LAUNCHER -u CMAKE_CXX_COMPILER_LAUNCHER -u CCACHE_BASEDIR -u CCACHE_NOHASHDIR \
    /usr/bin/python3 "$REPO/tests/e2e/serve_command_test.py" --repo "$REPO"
  echo "test.sh: the README's serve command checked in $(( $(date +%s) - start )) s"
fi

# core/ must build and pass its tests without gRPC, protobuf or Prometheus.
CMAKE_ARGS="-DATTNSERVE_BUILD_SERVER=OFF" "$REPO/deploy/build.sh" "$BUILD_DIR-core-only" RelWithDebInfo
ctest --test-dir "$BUILD_DIR-core-only" --output-on-failure --timeout 600 -j2 > "$BUILD_DIR-core-only.ctest.log" \
  || { cat "$BUILD_DIR-core-only.ctest.log"; exit 1; }
echo "test.sh: core-only build: $(grep 'tests passed' "$BUILD_DIR-core-only.ctest.log")"

# The unit and integration tests again under ASan+UBSan, the `tsan` tests
# under TSan (see deploy/sanitize.sh).
if [ "${SANITIZE:-all}" != none ]; then
  start=$(date +%s)
  BUILD_ROOT="$(dirname "$BUILD_DIR")" "$REPO/deploy/sanitize.sh" "${SANITIZE:-all}"
  echo "test.sh: sanitizers took $(( $(date +%s) - start )) s"
fi

# The tests that talk to a real server, on a machine whose cores are all busy.
final_args=()
rm -f "$BUILD_DIR.stress.ctest.log"
if [ "${STRESS:-run}" != none ]; then
  start=$(date +%s)
  stress-ng --cpu "$(nproc)" --timeout 1800s --quiet &
  stress=$!
  status=0
  ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 -j2 -L "integration|e2e" -LE slow \
    > "$BUILD_DIR.stress.ctest.log" 2>&1 || status=$?
  kill "$stress" 2> /dev/null || true
  wait "$stress" 2> /dev/null || true
  if [ "$status" -ne 0 ]; then cat "$BUILD_DIR.stress.ctest.log"; exit 1; fi
  echo "test.sh: under stress-ng --cpu $(nproc): $(grep 'tests passed' "$BUILD_DIR.stress.ctest.log")" \
    "in $(( $(date +%s) - start )) s"
  # Those passed on a busy machine: the last run leaves them out (by name).
  mapfile -t stressed < <(ctest --test-dir "$BUILD_DIR" -N -L "integration|e2e" -LE slow \
    | sed -nE 's/^ *Test +#[0-9]+: (.*)$/\1/p')
  final_args=(-E "^($(printf '%s\n' "${stressed[@]}" | sed 's/[][\.*^$+?(){}|]/\\&/g' | paste -sd'|'))\$")
fi

# The rest of the suite last, so its summary closes the output.
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 600 -j2 "${final_args[@]}" "$@" \
  | tee "$BUILD_DIR.ctest.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || exit "$status"

# A test that skips on a machine that has what it needs hides lost coverage:
# tests skip only for CPU features (BF16 tests without AVX512-BF16 or with the
# ISA capped, the own AVX-512 kernels' tests without AVX-512), and in CI any
# other skip fails the run.
skipped="$(cat "$BUILD_DIR.ctest.log" "$BUILD_DIR.stress.ctest.log" 2> /dev/null | grep '(Skipped)$' | sed -E 's/^[[:space:]]*[0-9]+ - ([^ ]+).*/\1/' || true)"
if [ -n "$skipped" ]; then
  allowed='^$'  # AVX-512 with AVX512-BF16 and no ISA cap: nothing may skip
  if ! grep -qw avx512_bf16 /proc/cpuinfo || [ -n "${ONEDNN_MAX_CPU_ISA:-}" ]; then allowed='Bf16'; fi
  if ! grep -qw avx512f /proc/cpuinfo; then allowed='Bf16|BlockKernels'; fi
  unexpected="$(grep -vE "$allowed" <<< "$skipped" || true)"
  if [ "${CI:-}" = true ] && [ -n "$unexpected" ]; then
    echo "test.sh: skipped although this machine has what they need:" >&2
    echo "$unexpected" >&2
    exit 1
  fi
fi
