#!/usr/bin/env bash
# Server instructions per request under h2load's bench request (the two-descriptor request of
# `make bench`), counted by callgrind: the same figure run after run, whatever else the machine
# does, so an A/B of two builds needs no rounds. Each server in turn, fresh, warmed up with
# WARMUP requests, then counted over N requests.
#
#   scripts/instructions.sh [SERVER ...]    SERVER: bare, memory, naive, redis, a path to a
#                                           ratelimitd binary (run on the memory backend), or
#                                           redis:PATH (that binary on the Redis backend)
#
# Default: bare memory. CLIENTS and STREAMS set h2load's -c and -m (default 2 and 4: 8 calls
# in flight); N (default 20000); KEEP=/some/dir keeps the callgrind files (callgrind_annotate
# them to see where the instructions go). The memory and Redis servers are this checkout's
# release build; bare and naive are benches/baseline.rs, built with the same profile.
#
# Needs valgrind and h2load (nghttp2-client); redis-server for naive and redis. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
CLIENTS=${CLIENTS:-2}
STREAMS=${STREAMS:-4}
N=${N:-20000}
WARMUP=${WARMUP:-4000}
[ $# -gt 0 ] || set -- bare memory
command -v valgrind >/dev/null || { echo "instructions: valgrind missing" >&2; exit 1; }
command -v h2load >/dev/null || { echo "instructions: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }

cargo build --release --quiet
BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
"$BASELINE" --write-request "$WORK/request.bin"

# One redis-server for the servers that need one, started here (not in a subshell, so that
# it is stopped with the rest).
REDIS_URL=
case " $* " in
  *" naive "* | *" redis "* | *" redis:"*)
    start_redis
    REDIS_URL=redis://127.0.0.1:$REDIS_PORT
    ;;
esac

for server in "$@"; do
  port=$(free_port)
  bench_server_cmd "$server" "$port" "$REDIS_URL" 5s ||
    { echo "instructions: no such server: $server" >&2; exit 2; }
  name=$(basename "$server")
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/cg.$name.%p" "${SERVER_CMD[@]}" >/dev/null 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_port "$port" 300 || true
  load() {
    h2load -c"$CLIENTS" -m"$STREAMS" -t1 -n "$1" -d "$WORK/request.bin" -H 'content-type: application/grpc' \
      -H 'te: trailers' "http://127.0.0.1:$port/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
  }
  load "$WARMUP" >/dev/null
  callgrind_control -i on "$pid" >/dev/null 2>&1
  ok=$(load "$N" | awk '/^status codes:/ {print $3}')
  callgrind_control -i off "$pid" >/dev/null 2>&1
  callgrind_control -d "$pid" >/dev/null 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  [ "$ok" = "$N" ] || { echo "instructions: $name answered $ok of $N requests with 2xx" >&2; exit 1; }
  total=$(cat "$WORK"/cg."$name".*.1 | awk '/^totals:/ {print $2}')
  printf '%-40s %9d instructions per request (h2load -c%s -m%s, %s requests)\n' "$name" \
    "$((total / N))" "$CLIENTS" "$STREAMS" "$N"
done
