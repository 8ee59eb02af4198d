#!/usr/bin/env bash
# One served decode run as compare_decode_with_pytorch.py starts the server:
# a fresh attnserve on a free loopback port, 32 sessions prefilled with
# CONTEXT tokens (2048 unless given), then `attnctl bench --decode` for STEPS
# steps (a long decode: a short CONTEXT and many STEPS); prints attnctl's JSON
# summary (tokens_per_second, server_compute_ms, step_ms, ...). Extra server
# flags go in SERVER_ARGS (e.g. SERVER_ARGS=--openmp_spin_us=20), its
# environment in SERVER_ENV (server_lib.sh).
#
#   tests/benchmarks/served_decode_step.sh BUILD_DIR fp32|bf16 [STEPS] [CONTEXT]
set -euo pipefail
BUILD=$1
kv=$2
steps=${3:-64}
context=${4:-2048}
source "$(dirname "$0")/server_lib.sh"
# shellcheck disable=SC2086  # SERVER_ARGS holds several flags
start_server --compute_threads=2 --max_seq_len=2049 --max_session_tokens=32768 \
  --kv_cache_bytes=$((4 << 30)) --max_receive_message_bytes=2147483647 \
  --max_send_message_bytes=2147483647 --max_request_bytes=$((8 << 30)) \
  --max_transport_bytes=$((4 << 30)) ${SERVER_ARGS:-}
trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true' EXIT
"$BUILD/client/attnctl" bench --decode --target="$TARGET" --sessions=32 --context="$context" \
  --steps="$steps" --kv_dtype="$kv" --json --timeout_seconds=900 | tail -1
