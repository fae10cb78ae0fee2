#!/usr/bin/env bash
# `make soak`: ratelimitd (release) on a redis-server this script starts, under mixed load at
# half of the peak it measures first, for SOAK_SECONDS (default 600), while Redis is restarted
# every RESTART_EVERY seconds (60) and the config is rewritten every RELOAD_EVERY seconds (30).
# Prints, every REPORT_EVERY seconds (30), throughput, errors by gRPC code and latency
# percentiles; at the end the service's resident memory at start and end (flat within 10%)
# and its metrics for reloads and backend errors. Loopback only; every process it starts is
# stopped when it ends. Not part of `make test` or CI.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
SOAK_SECONDS=${SOAK_SECONDS:-600}
RESTART_EVERY=${RESTART_EVERY:-60}
RELOAD_EVERY=${RELOAD_EVERY:-30}
REPORT_EVERY=${REPORT_EVERY:-30}
FAILURE_MODE=${FAILURE_MODE:-error}
CONCURRENCY=${CONCURRENCY:-64}


cargo build --release --quiet
cargo bench --bench loadgen --no-run --quiet 2>/dev/null || cargo bench --bench loadgen --no-run
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

start_redis

mkdir -p "$WORK/limits"
limits() {
  cat >"$WORK/limits/soak.yaml.tmp" <<YAML
domain: bench
descriptors:
  - key: client
    rate_limits:
      - {unit: second, requests_per_unit: $1, algorithm: sliding_window}
      - {unit: hour, requests_per_unit: 100000000, algorithm: token_bucket}
  - key: route
    rate_limit: {unit: second, requests_per_unit: 100000000}
YAML
  mv "$WORK/limits/soak.yaml.tmp" "$WORK/limits/soak.yaml"
}
limits 1000000

GRPC=127.0.0.1:$(free_port)
HTTP=127.0.0.1:$(free_port)
./target/release/ratelimitd --config "$WORK/limits" --grpc-addr "$GRPC" --http-addr "$HTTP" \
  --log-level warn --backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT" \
  --redis-failure-mode "$FAILURE_MODE" 2>"$WORK/ratelimitd.log" &
server=$!
pids+=($server)
for _ in $(seq 100); do curl -sf "http://$HTTP/healthcheck" >/dev/null 2>&1 && break; sleep 0.1; done

echo "soak: $(nproc) cores, ${SOAK_SECONDS}s, Redis restarted every ${RESTART_EVERY}s, config reloaded every ${RELOAD_EVERY}s, failure mode $FAILURE_MODE"
peak=$(cargo bench --quiet --bench loadgen -- --target "http://$GRPC" --duration 5 --warmup 1 \
  --concurrency "$CONCURRENCY" | awk '/^requests:/ {gsub(/[(\/s)]/, "", $3); print int($3)}')
rate=$((peak / 2))
echo "peak (closed loop, $CONCURRENCY concurrent): $peak req/s; soaking at $rate req/s"
rss_start=$(rss_kib "$server")

(
  elapsed=0
  while [ "$elapsed" -lt "$SOAK_SECONDS" ]; do
    sleep "$RELOAD_EVERY"
    elapsed=$((elapsed + RELOAD_EVERY))
    limits $((1000000 + elapsed))
    if [ $((elapsed % RESTART_EVERY)) -eq 0 ] && [ "$elapsed" -lt "$SOAK_SECONDS" ]; then
      redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
      sleep 0.2
      redis_server "$REDIS_PORT" &
      echo "t=${elapsed}s: Redis restarted, config rewritten"
    else
      echo "t=${elapsed}s: config rewritten"
    fi
  done
) &
pids+=($!)

cargo bench --quiet --bench loadgen -- --target "http://$GRPC" --duration "$SOAK_SECONDS" \
  --warmup 0 --concurrency "$CONCURRENCY" --rate "$rate" --report-every "$REPORT_EVERY" --allow-errors
rss_end=$(rss_kib "$server")
awk -v a="$rss_start" -v b="$rss_end" 'BEGIN { printf "resident memory: %.1f MiB at start, %.1f MiB at end (%+.1f%%)\n", a/1024, b/1024, (b-a)*100/a }'
curl -s "http://$HTTP/metrics" | grep -E '^ratelimit_(config_loads_total|backend_errors_total|failure_mode|memory_bytes)' || true
redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
