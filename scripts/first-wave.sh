#!/usr/bin/env bash
# The first burst a fresh replica meets, as a just-started Envoy sends it: ratelimitd started
# on a fresh Redis (flushed: no counter, no function or script loaded), its /healthcheck
# answering 200, then IDLE seconds (1: a replica waits for its first Envoy, and memory the
# allocator gives back after an idle second is faulted in again), then 64 streams at once on
# one new connection (h2load -c1 -m64 -n64), then 64 more on another. Prints per run the
# slowest call of each wave, in ms: Envoy's timeout is 20 ms, and a call past it lets its
# request through undecided. RUNS (5) runs per binary, interleaved. Loopback only; bounded.
# Usage: scripts/first-wave.sh [BINARY...] (default: this checkout's release build).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
RUNS=${RUNS:-5}
IDLE=${IDLE:-1}
if [ $# -eq 0 ]; then
  cargo build --release --quiet
  set -- target/release/ratelimitd
fi
BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
start_redis
"$BASELINE" --write-request "$WORK/request.bin"

# The slowest request of an h2load run, in ms (its "time for request" max).
slowest() {
  awk '/time for request:/ {v = $5; u = $5; sub(/[0-9.]+/, "", u); sub(/[a-z]+$/, "", v);
    print (u == "us") ? v / 1000 : (u == "s") ? v * 1000 : v}'
}

echo "first wave (64 streams at once on a fresh replica and a fresh Redis), slowest call in ms"
printf '%-40s %s\n' "binary" "run: first wave / second wave"
for run in $(seq "$RUNS"); do
  for bin in "$@"; do
    redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null
    redis-cli -p "$REDIS_PORT" FUNCTION FLUSH >/dev/null 2>&1 || true
    redis-cli -p "$REDIS_PORT" SCRIPT FLUSH >/dev/null
    grpc=$(free_port)
    http=$(free_port)
    "$bin" --config benches/limits.yaml --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" \
      --log-level warn --backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT" &
    pid=$!
    for _ in $(seq 200); do
      [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/healthcheck")" = 200 ] && break
      sleep 0.05
    done
    sleep "$IDLE"
    first=$(h2_bench "$grpc" "$WORK/request.bin" -c1 -m64 -n64 | slowest)
    second=$(h2_bench "$grpc" "$WORK/request.bin" -c1 -m64 -n64 | slowest)
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    printf '%-40s %s: %s / %s\n' "$bin" "$run" "$first" "$second"
  done
done
