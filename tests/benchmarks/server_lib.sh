# Shared by the serving benchmark scripts (source it): start the real server on
# a free loopback port and read its memory. Needs BUILD (the build directory).

# start_server [flags...]: starts attnserve (metrics off; SERVER_ENV, e.g.
# "OMP_WAIT_POLICY=PASSIVE", in its environment) and waits until it is
# SERVING; sets PID, PORT and TARGET. Exits the script, killing the server,
# when it does not come up.
start_server() {
  local log
  log="$(mktemp)"
  # shellcheck disable=SC2086  # SERVER_ENV holds several assignments
  env ${SERVER_ENV:-} "$BUILD/server/attnserve" --listen_address=127.0.0.1:0 --metrics_address= "$@" >"$log" 2>&1 &
  PID=$!
  for _ in $(seq 100); do
    grep -q "attnserve: SERVING" "$log" && break
    sleep 0.1
  done
  PORT="$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log" | head -1)"
  if [[ -z "$PORT" ]] || ! grep -q "attnserve: SERVING" "$log"; then
    cat "$log" >&2
    rm -f "$log"
    kill "$PID" 2>/dev/null || true
    echo "server did not start" >&2
    exit 1
  fi
  rm -f "$log"
  TARGET="127.0.0.1:$PORT"
}

# rss: the server's resident memory in KiB.
rss() { awk '/VmRSS/ {print $2}' "/proc/$PID/status"; }

# json_number FIELD: the number FIELD holds in the JSON object on stdin.
json_number() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
