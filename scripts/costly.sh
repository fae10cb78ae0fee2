#!/usr/bin/env bash
# One client keeping a costly request always in flight (the `worst` request: 64 descriptors,
# 256 sliding_log counters) beside a light load (a victim at 200 requests/s): the victim's
# latency with the worker gate on and off, on the Redis and the memory backend, interleaved
# rounds of servers started together in one run. The gate must not let one client's costly
# requests set another's latency (docs/operations.md, "Worker threads"): gate on within 1.5x of
# gate off. Release build (or RATELIMITD_BIN, another build, for an A/B). Needs redis-server.
# Loopback only, on free ports; every run bounded (DURATION seconds a round, ROUNDS rounds).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
BIN=${RATELIMITD_BIN:-target/release/ratelimitd}

cargo build --release --quiet
LOADGEN=$(bench_bin loadgen)
[ -x "$LOADGEN" ] || { echo "costly: loadgen did not build" >&2; exit 1; }
pids=()
trap cleanup_all EXIT

start_redis

declare -A grpc
for backend in redis memory; do
  for gate in on off; do
    grpc[$backend.$gate]=$(free_port)
    http=$(free_port)
    flag=true
    [ "$gate" = off ] && flag=false
    "$BIN" --config benches/limits.yaml --backend "$backend" \
      --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-key-prefix "$gate:" \
      --grpc-addr "127.0.0.1:${grpc[$backend.$gate]}" --http-addr "127.0.0.1:$http" \
      --log-level error --worker-gate="$flag" &
    pids+=("$!")
    until curl -sf "127.0.0.1:$http/healthcheck" >/dev/null; do sleep 0.05; done
  done
done
echo "== victim (200/s) beside one worst-case request always in flight: $BIN"
for backend in redis memory; do
  for round in $(seq "$ROUNDS"); do
    for gate in on off; do
      target="http://127.0.0.1:${grpc[$backend.$gate]}"
      "$LOADGEN" --target "$target" --connections 1 --warmup 0 --concurrency 1 \
        --duration $((DURATION + 2)) --worst --allow-errors >/dev/null &
      apid=$!
      sleep 1
      p=$("$LOADGEN" --target "$target" --connections 1 --warmup 1 --concurrency 4 \
        --rate 200 --duration "$DURATION" --allow-errors | sed -n 's/^latency ms: //p')
      wait "$apid" || true
      echo "$backend round $round gate $gate: $p"
    done
  done
done
