#!/usr/bin/env bash
# Installs what is missing, builds, and runs the attnserve server on its
# built-in model (gRPC on 0.0.0.0:50051 unless --listen_address says else).
# Every argument goes to attnserve (try --help).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
"$REPO/deploy/install_deps.sh"
CMAKE_ARGS="-DATTNSERVE_BUILD_TESTS=OFF" "$REPO/deploy/build.sh" "$REPO/build-serve" Release attnserve attnctl
exec "$REPO/build-serve/server/attnserve" "$@"
