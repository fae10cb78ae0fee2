#!/usr/bin/env bash
# Renders docs/dashboard.png: the chart's Grafana dashboard drawn from real data. Starts Redis,
# ratelimitd (release build, Redis backend, `local` failure mode, a memory bound small enough to
# be reached while Redis is away) and a Prometheus scraping it every second, then for about
# 150 s: h2load sends the bench request at 4,000/s against a 3,000/s limit (a quarter over the
# limit); at 40 s Redis is killed and at 70 s restarted (circuit open, the failure mode
# answering, backend errors); at 95 s a bad config file is written and at 115 s fixed (a failed
# reload, then a good one). Then scripts/dashboard_picture.py queries every panel as Grafana
# would and draws them. Loopback only, bounded. Needs h2load (nghttp2-client), prometheus
# (Debian's package) and python3 with matplotlib. Usage: scripts/dashboard-picture.sh [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
OUT=${1:-docs/dashboard.png}
for tool in h2load prometheus redis-server; do
  command -v "$tool" >/dev/null || { echo "dashboard: $tool missing" >&2; exit 1; }
done
python3 -c 'import matplotlib' 2>/dev/null || { echo "dashboard: python3 -m pip install matplotlib" >&2; exit 1; }
cargo build --release --quiet
BASELINE=$(bench_bin baseline)

WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

"$BASELINE" --write-request "$WORK/request.bin"
mkdir "$WORK/limits"
limits() { # CLIENT_LIMIT
  cat >"$WORK/limits/bench.yaml" <<EOF
domain: bench
descriptors:
  - key: client
    rate_limit: {unit: second, requests_per_unit: $1, algorithm: sliding_window}
  - key: route
    rate_limit: {unit: second, requests_per_unit: 100000000}
EOF
}
limits 3000

REDIS_PORT=$(free_port)
start_redis   # restarted on the same port at 70 s

GRPC=$(free_port)
HTTP=$(free_port)
./target/release/ratelimitd --config "$WORK/limits" --grpc-addr "127.0.0.1:$GRPC" \
  --http-addr "127.0.0.1:$HTTP" --log-level error --backend redis \
  --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-failure-mode local --memory-max-bytes 4KiB &
pids+=($!)
wait_port "$HTTP"

PROM=$(free_port)
cat >"$WORK/prometheus.yml" <<EOF
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: ratelimitd
    static_configs:
      - targets: ["127.0.0.1:$HTTP"]
        labels: {namespace: demo, pod: ratelimitd-0}
EOF
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM" --log.level=error >/dev/null 2>&1 &
pids+=($!)
wait_port "$PROM"

START=$(date +%s)
url="http://127.0.0.1:$GRPC/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
h2load -c4 -m4 --rps 1000 -D 150 -d "$WORK/request.bin" -H 'content-type: application/grpc' \
  -H 'te: trailers' "$url" >/dev/null &
LOAD=$!
pids+=("$LOAD")
at() { sleep $(( START + $1 - $(date +%s) )); }
at 40; echo "dashboard: Redis killed"; kill "$REDIS_PID"; wait "$REDIS_PID" 2>/dev/null || true
at 70; echo "dashboard: Redis back"; start_redis
at 95; echo "dashboard: a bad config"; echo "domain: bench
descriptors: [{key: client, rate_limit: {unit: fortnight}}]" >"$WORK/limits/bench.yaml"
at 115; echo "dashboard: fixed"; limits 3000
wait "$LOAD" || true
sleep 3
END=$(date +%s)
python3 scripts/dashboard_picture.py "http://127.0.0.1:$PROM" "$START" "$END" "$OUT"
echo "dashboard: wrote $OUT"
