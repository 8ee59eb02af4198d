#!/usr/bin/env bash
# Configures and builds attnserve with CMake and Ninja.
#
#   deploy/build.sh [BUILD_DIR] [BUILD_TYPE] [ninja targets...]
#     BUILD_DIR   default: build (inside the repository)
#     BUILD_TYPE  default: RelWithDebInfo
# Extra CMake options can come in CMAKE_ARGS (e.g. CMAKE_ARGS=-DATTNSERVE_BUILD_TESTS=OFF).
# Warnings are errors only in CI (CI=true, as CI sets it, or ATTNSERVE_WERROR=ON):
# a warning of a newer compiler must never stop a user's build.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,9p' "$0"; exit 0 ;; esac

REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${1:-$REPO/build}"
BUILD_TYPE="${2:-RelWithDebInfo}"
shift $(( $# > 2 ? 2 : $# ))

if [ "${CI:-}" = true ]; then WERROR="${ATTNSERVE_WERROR:-ON}"; else WERROR="${ATTNSERVE_WERROR:-OFF}"; fi

# shellcheck disable=SC2086  # CMAKE_ARGS is a list of words on purpose
cmake -S "$REPO" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
  -DATTNSERVE_WERROR="$WERROR" ${CMAKE_ARGS:-} > "$BUILD_DIR.configure.log" 2>&1 \
  || { cat "$BUILD_DIR.configure.log"; exit 1; }
ninja -C "$BUILD_DIR" "$@"
