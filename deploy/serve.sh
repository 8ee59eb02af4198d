#!/usr/bin/env bash
# Installs what serving needs (Debian packages, if missing), builds the server
# and attnctl (Release, in build-serve/), and runs the attnserve server on its
# built-in model: gRPC on 0.0.0.0:50051, Prometheus metrics on 0.0.0.0:9464.
#
#   deploy/serve.sh [attnserve flags...]   e.g. --listen_address=127.0.0.1:50051
#   deploy/serve.sh --help                 this text, and the server's flags once it is built
#
# Every argument goes to attnserve. Idempotent: a second run installs nothing
# and rebuilds only what changed. Test-only packages come with deploy/test.sh.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="$REPO/build-serve"
SERVER="$BUILD_DIR/server/attnserve"

for arg in "$@"; do
  case "$arg" in
    -h | --help | -help | --helpfull)
      sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
      if [ -x "$SERVER" ]; then
        echo
        exec "$SERVER" --help
      fi
      echo
      echo "The server's own flags: '$0 --help' once it is built (the first run without --help builds it)."
      exit 0 ;;
  esac
done

start=$(date +%s)
"$REPO/deploy/install_deps.sh" --build
packages=$(date +%s)
CMAKE_ARGS="-DATTNSERVE_BUILD_TESTS=OFF" "$REPO/deploy/build.sh" "$BUILD_DIR" Release attnserve attnctl
echo "serve.sh: packages checked/installed in $((packages - start)) s, built in $(($(date +%s) - packages)) s"
exec "$SERVER" "$@"
