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

log="$(mktemp)"
"$BUILD/server/attnserve" --listen_address=127.0.0.1:0 --metrics_address= "$@" >"$log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do grep -q SERVING "$log" && break; sleep 0.1; done
TARGET="127.0.0.1:$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log" | head -1)"
bench() { "$BUILD/client/attnctl" bench --target="$TARGET" $BENCH_SHAPE --json "$@" 2>/dev/null; }
rss() { awk '/VmRSS/ {print $2}' "/proc/$PID/status"; }

bench --concurrency=32 --duration=3 >/dev/null  # warm-up
capacity_json="$(bench --concurrency=32 --duration="$DURATION")"
capacity="$(echo "$capacity_json" | sed -n 's/.*"throughput_rps":\([0-9.]*\).*/\1/p')"
echo "capacity $capacity_json"
echo "light $(bench --rate="$(awk -v c="$capacity" 'BEGIN {printf "%.2f", c * 0.1}')" --duration="$DURATION")"
rss_before="$(rss)"
rss_max="$rss_before"
( while kill -0 "$PID" 2>/dev/null; do rss >>"$log.rss"; sleep 1; done ) &
SAMPLER=$!
echo "overload $(bench --rate="$(awk -v c="$capacity" 'BEGIN {printf "%.2f", c * 4}')" --duration="$DURATION")"
kill "$SAMPLER" 2>/dev/null || true
rss_max="$(sort -n "$log.rss" | tail -1)"
rm -f "$log.rss"
alive=yes
kill -0 "$PID" 2>/dev/null || alive=no
echo "server alive $alive; RSS KiB before overload $rss_before, max during $rss_max, after $(rss 2>/dev/null || echo -)"
