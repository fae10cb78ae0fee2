#!/usr/bin/env bash
# `make worst`: what the costliest request the server accepts costs (release build, Redis
# backend): server and Redis CPU per request and Redis time per script call, then what a
# small-request victim sees beside a client keeping 8 of them in flight.
# Loopback only, on free ports; every run bounded (DURATION seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
DURATION=${DURATION:-10}
# The server measured: this checkout's release build, or RATELIMITD_BIN (another build, for an A/B).
BIN=${RATELIMITD_BIN:-target/release/ratelimitd}
GRPC=$(free_port)
HTTP=$(free_port)
REDIS_PORT=$(free_port)
HZ=$(getconf CLK_TCK)

cargo build --release --quiet
LOADGEN=$(bench_bin loadgen)
[ -x "$LOADGEN" ] || { echo "worst: loadgen did not build" >&2; exit 1; }
pids=()
trap cleanup_all EXIT

start_redis
rpid=$REDIS_PID
"$BIN" --config benches/limits.yaml --backend redis \
  --redis-url "redis://127.0.0.1:$REDIS_PORT" --grpc-addr "127.0.0.1:$GRPC" \
  --http-addr "127.0.0.1:$HTTP" --log-level error &
spid=$!; pids+=("$spid")
until curl -sf "127.0.0.1:$HTTP/healthcheck" >/dev/null; do sleep 0.05; done
load() { "$LOADGEN" --target "http://127.0.0.1:$GRPC" --connections 1 --warmup 1 "$@"; }

redis-cli -p "$REDIS_PORT" CONFIG RESETSTAT >/dev/null
s0=$(cpu_ticks "$spid"); r0=$(cpu_ticks "$rpid")
out=$(load --concurrency 1 --duration "$DURATION" --worst)
s1=$(cpu_ticks "$spid"); r1=$(cpu_ticks "$rpid")
n=$(echo "$out" | awk '/^requests:/ {print $2}')
echo "== one worst-case request at a time"
echo "$out" | sed -n 2,3p
echo "server $(echo "scale=2; ($s1-$s0)*1000/$HZ/$n" | bc) ms CPU/request, redis $(echo "scale=2; ($r1-$r0)*1000/$HZ/$n" | bc) ms CPU/request (warmup included)"
redis-cli -p "$REDIS_PORT" INFO commandstats | grep -E "evalsha|fcall" || true
echo "== victim alone (200/s, 2 descriptors)"
load --concurrency 4 --rate 200 --duration "$DURATION" | sed -n 2,3p
echo "== victim beside a client keeping 8 worst-case requests in flight"
"$LOADGEN" --target "http://127.0.0.1:$GRPC" --connections 1 --warmup 0 --concurrency 8 \
  --duration $((DURATION + 2)) --worst --allow-errors >/dev/null &
apid=$!
load --concurrency 4 --rate 200 --duration "$DURATION" --allow-errors | sed -n 2,3p
wait "$apid" || true
curl -s "127.0.0.1:$HTTP/metrics" | grep -E '^ratelimit_backend_errors_total' || true

# The same beside a light load, with the worker gate on and off.
./scripts/costly.sh
