#!/usr/bin/env bash
# Overload: one server, measured at its capacity (closed loop, 32 outstanding),
# then lightly loaded (open loop at 10% of capacity: the "unloaded" latency),
# then at 4x its capacity (open loop) while its RSS is sampled. Prints each
# run's JSON and the RSS range. Server flags as arguments.
#
#   tests/benchmarks/overload_bench.sh [build dir] [server flags...]
#   BENCH_SHAPE="--batch=1 --seq=128" DURATION=20 tests/benchmarks/overload_bench.sh build --max_queued_requests=8
set -euo pipefail
BUILD="${1:-build}"
shift || true
BENCH_SHAPE="${BENCH_SHAPE:---batch=1 --seq=128}"
DURATION="${DURATION:-20}"

source "$(dirname "$0")/server_lib.sh"
start_server "$@"
samples="$(mktemp)"
trap 'kill $PID 2>/dev/null || true; rm -f "$samples"' EXIT
bench() { "$BUILD/client/attnctl" bench --target="$TARGET" $BENCH_SHAPE --json "$@" 2>/dev/null; }

bench --concurrency=32 --duration=3 >/dev/null  # warm-up
capacity_json="$(bench --concurrency=32 --duration="$DURATION")"
capacity="$(echo "$capacity_json" | json_number throughput_rps)"
echo "capacity $capacity_json"
echo "light $(bench --rate="$(awk -v c="$capacity" 'BEGIN {printf "%.2f", c * 0.1}')" --duration="$DURATION")"
rss_before="$(rss)"
( while kill -0 "$PID" 2>/dev/null; do rss >>"$samples"; sleep 1; done ) &
SAMPLER=$!
echo "overload $(bench --rate="$(awk -v c="$capacity" 'BEGIN {printf "%.2f", c * 4}')" --duration="$DURATION")"
kill "$SAMPLER" 2>/dev/null || true
rss_max="$(sort -n "$samples" | tail -1)"
alive=yes
kill -0 "$PID" 2>/dev/null || alive=no
echo "server alive $alive; RSS KiB before overload $rss_before, max during $rss_max, after $(rss 2>/dev/null || echo -)"
