#!/usr/bin/env bash
# Fuzzes AttendRequest parsing, validation and memory planning with libFuzzer
# (clang-14, ASan + UBSan) for a number of minutes.
#
#   deploy/fuzz.sh [MINUTES] [libFuzzer options...]   default: 10 minutes
#
# Builds with ATTNSERVE_FUZZ=ON into build-fuzz (BUILD_DIR overrides), starts
# from the seed corpus tests/fuzz/corpus and keeps what it finds in
# build-fuzz/corpus (the checked-in corpus is only read). Crashing inputs land
# in build-fuzz/artifacts/; add a fixed one to tests/fuzz/corpus as a
# regression seed (the fuzz_corpus_replay test replays that directory).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,11p' "$0"; exit 0 ;; esac
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO/build-fuzz}"
MINUTES="${1:-10}"
shift $(( $# > 0 ? 1 : 0 ))

"$REPO/deploy/install_deps.sh" --fuzz
CC=clang-14 CXX=clang++-14 CMAKE_ARGS="-DATTNSERVE_FUZZ=ON -DATTNSERVE_BUILD_TESTS=ON" \
  "$REPO/deploy/build.sh" "$BUILD_DIR" RelWithDebInfo attend_request_fuzzer

mkdir -p "$BUILD_DIR/corpus" "$BUILD_DIR/artifacts"
# One process (2 cores; -jobs=2 -workers=2 uses both). Leaks are checked: the
# model registry is created once and stays reachable.
"$BUILD_DIR/tests/fuzz/attend_request_fuzzer" \
  -max_total_time=$(( MINUTES * 60 )) -print_final_stats=1 -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
  -artifact_prefix="$BUILD_DIR/artifacts/" "$@" \
  "$BUILD_DIR/corpus" "$REPO/tests/fuzz/corpus"
