#!/usr/bin/env bash
# Soak: the real server under an open-loop load at a fraction of its measured
# capacity for a long time, its RSS sampled every few seconds.
#
#   tests/benchmarks/soak.sh [build dir] [seconds, default 600] [fraction, default 0.7]
#   RATE=50 tests/benchmarks/soak.sh build 600      # a fixed rate instead
#   BENCH_SHAPE="--batch=1 --seq=128"  SERVER_FLAGS="--max_batch_tokens=4096"
#
# Capacity: a closed-loop run (32 calls outstanding, 15 s) just before. Prints
# the rate, the bench result (JSON), RSS at start (after warm-up), max and end,
# and exits 1 when a call failed or the server died. RSS samples go to
# $OUT (default /tmp/attnserve_soak_rss.csv): seconds,rss_kib.
set -euo pipefail
BUILD="${1:-build}"
SECONDS_TOTAL="${2:-600}"
FRACTION="${3:-0.7}"
BENCH_SHAPE="${BENCH_SHAPE:---batch=1 --seq=128}"
SERVER_FLAGS="${SERVER_FLAGS:-}"
OUT="${OUT:-/tmp/attnserve_soak_rss.csv}"

source "$(dirname "$0")/server_lib.sh"
start_server $SERVER_FLAGS
trap 'kill $PID 2>/dev/null || true' EXIT

if [[ -z "${RATE:-}" ]]; then
  capacity="$("$BUILD/client/attnctl" bench --target="$TARGET" --concurrency=32 --duration=15 \
    $BENCH_SHAPE --json 2>/dev/null | json_number throughput_rps)"
  RATE="$(awk -v c="$capacity" -v f="$FRACTION" 'BEGIN {printf "%.1f", c * f}')"
  echo "soak: capacity $capacity requests/s; rate $RATE/s ($FRACTION)"
fi

rss_start="$(rss)"
echo "seconds,rss_kib" >"$OUT"
(
  start=$(date +%s)
  while kill -0 "$PID" 2>/dev/null; do
    echo "$(( $(date +%s) - start )),$(rss)" >>"$OUT"
    sleep 5
  done
) &
SAMPLER=$!
result="$("$BUILD/client/attnctl" bench --target="$TARGET" --rate="$RATE" --duration="$SECONDS_TOTAL" \
  $BENCH_SHAPE --json 2>/dev/null)"
kill "$SAMPLER" 2>/dev/null || true
echo "soak: $result"
alive=yes
kill -0 "$PID" 2>/dev/null || alive=no
rss_end="$(rss 2>/dev/null || echo 0)"
rss_max="$(tail -n +2 "$OUT" | cut -d, -f2 | sort -n | tail -1)"
echo "soak: server alive $alive; RSS KiB start $rss_start, max $rss_max, end $rss_end," \
  "growth $(( rss_end - rss_start )) KiB; samples in $OUT"
errors="$(echo "$result" | sed -n 's/.*"errors":{\([^}]*\)}.*/\1/p')"
[[ "$alive" == yes && -z "$errors" ]]
