#!/usr/bin/env bash
# Serving benchmarks: the real attnserve binary under `attnctl bench`, one
# server at a time (two idle servers' OpenMP threads would compete), variants
# alternated and repeated so a busy machine hits them alike. Prints one JSON
# line per run, prefixed with the variant name.
#
#   tests/benchmarks/serving_bench.sh [build dir] [reps]
#   (a variant is name:flags, its flags separated by commas)
#   VARIANTS="batched:--max_batch_tokens=4096 solo:--max_batch_tokens=0" \
#   BENCH="--concurrency=32 --batch=1 --seq=128 --duration=10" tests/benchmarks/serving_bench.sh
#
# SERVER_ENV (e.g. "OMP_WAIT_POLICY=PASSIVE") is set for the server only.
set -euo pipefail
BUILD="${1:-build}"
REPS="${2:-3}"
VARIANTS="${VARIANTS:-batched:--max_batch_tokens=4096 solo:--max_batch_tokens=0}"
BENCH="${BENCH:---concurrency=32 --batch=1 --seq=128 --duration=10}"
SERVER_ENV="${SERVER_ENV:-}"

source "$(dirname "$0")/server_lib.sh"

for rep in $(seq "$REPS"); do
  for variant in $VARIANTS; do
    name="${variant%%:*}"
    flags="${variant#*:}"
    start_server ${flags//,/ }
    # A short warm-up, so each batch shape's primitives exist before timing.
    "$BUILD/client/attnctl" bench --target="127.0.0.1:$PORT" $BENCH --duration=2 --requests=0 \
      >/dev/null 2>&1 || true
    echo "$name rep$rep $("$BUILD/client/attnctl" bench --target="127.0.0.1:$PORT" $BENCH --json 2>/dev/null)"
    kill "$PID"
    wait "$PID" || true
  done
done
