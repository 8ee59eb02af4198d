#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: unit,
# integration (the server on a real port) and end-to-end (the real binary
# called from Python), plus the deployment checks.
# Then the unit and integration tests again under ASan + UBSan, and the tests
# labelled `tsan` under ThreadSanitizer (deploy/sanitize.sh all; SANITIZE=none
# skips both, SANITIZE=asan or tsan runs one).
# Extra arguments go to ctest (e.g. -L unit, -R Attention).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO/build}"
"$REPO/deploy/install_deps.sh"
start=$(date +%s)
"$REPO/deploy/build.sh" "$BUILD_DIR" RelWithDebInfo
echo "test.sh: built in $(( $(date +%s) - start )) s"
"$REPO/deploy/check_runtime_deps.sh" "$BUILD_DIR"
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
# The whole suite last, so its summary closes the output.
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 600 -j2 "$@"
