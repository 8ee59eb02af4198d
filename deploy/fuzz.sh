#!/usr/bin/env bash
# Fuzzes AttendRequest parsing, validation and memory planning (or, with
# FUZZ_TARGET=safetensors_header, the checkpoint header parser; with
# FUZZ_TARGET=npy, the .npy parser that reads the explorer's uploads) with libFuzzer
# (clang-14, ASan + UBSan) for a number of minutes.
#
#   deploy/fuzz.sh [MINUTES] [libFuzzer options...]   default: 10 minutes
#   FUZZ_TARGET=safetensors_header deploy/fuzz.sh 5
#
# Builds with ATTNSERVE_FUZZ=ON into build-fuzz (BUILD_DIR overrides), starts
# from the target's seed corpus (tests/fuzz/corpus, safetensors_corpus, npy_corpus)
# and keeps what it finds in build-fuzz/corpus-<target> (the checked-in corpus
# is only read). Crashing inputs land in build-fuzz/artifacts/; add a fixed one
# to the seed corpus as a regression seed (CTest's fuzz_corpus_replay and
# safetensors_fuzz_corpus_replay replay those directories).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,15p' "$0"; exit 0 ;; esac
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO/build-fuzz}"
MINUTES="${1:-10}"
shift $(( $# > 0 ? 1 : 0 ))

"$REPO/deploy/install_deps.sh" --fuzz
# FUZZ_TARGET=safetensors_header fuzzes the checkpoint header parser instead.
TARGET="${FUZZ_TARGET:-attend_request}"
case "$TARGET" in
  attend_request) SEEDS="$REPO/tests/fuzz/corpus" ;;
  safetensors_header) SEEDS="$REPO/tests/fuzz/safetensors_corpus" ;;
  npy) SEEDS="$REPO/tests/fuzz/npy_corpus" ;;
  *) echo "fuzz.sh: unknown FUZZ_TARGET '$TARGET' (attend_request, safetensors_header, npy)" >&2; exit 2 ;;
esac
CC=clang-14 CXX=clang++-14 CMAKE_ARGS="-DATTNSERVE_FUZZ=ON -DATTNSERVE_BUILD_TESTS=ON" \
  "$REPO/deploy/build.sh" "$BUILD_DIR" RelWithDebInfo "${TARGET}_fuzzer"

mkdir -p "$BUILD_DIR/corpus-$TARGET" "$BUILD_DIR/artifacts"
# One process (2 cores; -jobs=2 -workers=2 uses both). Leaks are checked: the
# model registry is created once and stays reachable.
"$BUILD_DIR/tests/fuzz/${TARGET}_fuzzer" \
  -max_total_time=$(( MINUTES * 60 )) -print_final_stats=1 -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
  -artifact_prefix="$BUILD_DIR/artifacts/" "$@" \
  "$BUILD_DIR/corpus-$TARGET" "$SEEDS"
