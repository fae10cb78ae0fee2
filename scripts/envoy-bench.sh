#!/usr/bin/env bash
# Load through a real Envoy (not part of `make test`): h2load sends HTTP/2 requests to
# examples/envoy/envoy.yaml as shipped (its 20 ms ratelimit timeout, Envoy's two workers), in
# front of examples/envoy/upstream.py and the release binary, on memory and on Redis. Each
# request makes Envoy call ShouldRateLimit with the example's five descriptors; the limits are
# the example's rules raised far above the load, so every request is decided OK and reaches the
# upstream (the example's own limits would answer nearly all 429 from one client address).
#
# Reported per backend: the RLS call latency Envoy observed (p50/p99/p99.9 of its
# cluster.ratelimitd.upstream_rq_time histogram), the calls that failed or hit the timeout
# (ratelimit.error and failure_mode_allowed: each one a request let through without a
# decision), the service's own handling time (ratelimit_request_duration_seconds) beside it,
# and CPU per request of ratelimitd, Envoy and redis-server from /proc.
# Loopback only; each run lasts DURATION s. Tunables: ENVOY (binary, default the 1.40.0 that
# scripts/deps.sh installs), DURATION (10), CLIENTS and STREAMS (8 × 16 = 128 streams),
# BACKENDS ("memory redis"), RATE (requests/s in all, open loop: h2load's --rps per client;
# unset, h2load sends as fast as it is answered, which saturates the two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
ENVOY=${ENVOY:-target/tools/envoy/1.40.0/envoy}
DURATION=${DURATION:-10}
CLIENTS=${CLIENTS:-8}
STREAMS=${STREAMS:-16}
BACKENDS=${BACKENDS:-memory redis}
RATE=${RATE:-}
pace=()
[ -n "$RATE" ] && pace=(--rps "$((RATE / CLIENTS))")
command -v h2load >/dev/null || { echo "envoy-bench: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
[ -x "$ENVOY" ] || ./scripts/deps.sh
HZ=$(getconf CLK_TCK)
cargo build --release --quiet
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

# The example's rules, each limit raised to 10^9 (the rules, keys and algorithms unchanged).
mkdir -p "$WORK/limits"
sed -E 's/requests_per_unit: [0-9]+/requests_per_unit: 1000000000/; s/burst: [0-9]+/burst: 1000000000/' \
  examples/envoy/limits/config.yaml >"$WORK/limits/config.yaml"

up_port=$(free_port)
python3 examples/envoy/upstream.py "$up_port" >/dev/null &
pids+=($!)
wait_port "$up_port"

REDIS_PID=""
[[ " $BACKENDS " == *" redis "* ]] && start_redis

# The service's request-duration buckets (le, cumulative count), one per line.
buckets() { curl -s "127.0.0.1:$1/metrics" | sed -n 's/^ratelimit_request_duration_seconds_bucket{le="\([^"]*\)"} \(.*\)/\1 \2/p'; }
# The bound (ms) of the bucket holding the p99 of what was counted between two bucket lists.
p99_between() { # BEFORE_FILE AFTER_FILE
  paste -d' ' "$1" "$2" | awk '{le[NR] = $1; d[NR] = $4 - $2} END { for (i = 1; i <= NR; i++) if (d[i] >= 0.99 * d[NR]) { print (le[i] == "+Inf" ? "inf" : le[i] * 1000); exit } }'
}

echo "machine: $(nproc) cores; $("$ENVOY" --version | grep -o 'version: [^ ]*' | cut -d/ -f2); h2load -c$CLIENTS -m$STREAMS (≈$((CLIENTS * STREAMS)) streams) for ${DURATION}s${RATE:+ at $RATE req/s} through envoy.yaml (timeout 0.02s)"
printf '%-8s %10s %12s %12s %12s %8s %8s %10s %10s %10s %10s\n' backend requests rls_p50_ms rls_p99_ms rls_p999_ms errors allowed svc_p99_ms rl_us/req envoy_us/req redis_us/req
for backend in $BACKENDS; do
  grpc=$(free_port) http=$(free_port)
  args=(--config "$WORK/limits" --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" --log-level warn)
  [ "$backend" = redis ] && args+=(--backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT")
  ./target/release/ratelimitd "${args[@]}" &
  rl=$!
  pids+=("$rl")
  wait_port "$http"
  listen=$(free_port) admin=$(free_port)
  sed -e "s/port_value: 10000/port_value: $listen/; s/port_value: 9000/port_value: $up_port/; s/port_value: 8081/port_value: $grpc/; s/address: 0.0.0.0/address: 127.0.0.1/" \
    examples/envoy/envoy.yaml >"$WORK/envoy-$backend.yaml"
  printf 'admin:\n  address:\n    socket_address: { address: 127.0.0.1, port_value: %s }\nstats_flush_interval: 1s\n' "$admin" >>"$WORK/envoy-$backend.yaml"
  "$ENVOY" -c "$WORK/envoy-$backend.yaml" --disable-hot-restart --concurrency 2 -l error >"$WORK/envoy-$backend.log" 2>&1 &
  ev=$!
  pids+=("$ev")
  until curl -sf "127.0.0.1:$admin/ready" >/dev/null; do sleep 0.1; done
  # Warm up (connections to ratelimitd and the upstream), then measure from zeroed counters.
  h2load -n 500 -c "$CLIENTS" -m "$STREAMS" "http://127.0.0.1:$listen/bench" >/dev/null
  curl -sf -X POST "127.0.0.1:$admin/reset_counters" >/dev/null # counters; the latency histogram keeps the 500
  rl0=$(cpu_ticks "$rl") ev0=$(cpu_ticks "$ev") rd0=0
  [ "$backend" = redis ] && rd0=$(cpu_ticks "$REDIS_PID")
  buckets "$http" >"$WORK/before"
  out=$(h2load -D "$DURATION" -c "$CLIENTS" -m "$STREAMS" ${pace[@]+"${pace[@]}"} "http://127.0.0.1:$listen/bench")
  done_n=$(echo "$out" | awk '/^requests:/ {print $8}')
  rl1=$(cpu_ticks "$rl") ev1=$(cpu_ticks "$ev") rd1=0
  [ "$backend" = redis ] && rd1=$(cpu_ticks "$REDIS_PID")
  buckets "$http" >"$WORK/after"
  sleep 2 # histograms are read at Envoy's stats flush (every second here)
  stats=$(curl -s "127.0.0.1:$admin/stats?usedonly")
  hist=$(echo "$stats" | grep '^cluster.ratelimitd.upstream_rq_time:' || true)
  q() { echo "$hist" | grep -o "P$1([^)]*)" | sed -E 's/.*,([^)]*)\)/\1/' | awk '{printf "%.2f", $1}'; }
  errors=$(echo "$stats" | awk -F': ' '$1 == "cluster.upstream.ratelimit.error" {print $2}')
  allowed=$(echo "$stats" | awk -F': ' '$1 == "cluster.upstream.ratelimit.failure_mode_allowed" {print $2}')
  svc_p99=$(p99_between "$WORK/before" "$WORK/after")
  per() { awk -v a="$1" -v b="$2" -v n="$done_n" -v hz="$HZ" 'BEGIN { printf "%.1f", (b - a) / hz * 1e6 / (n > 0 ? n : 1) }'; }
  printf '%-8s %10s %12s %12s %12s %8s %8s %10s %10s %10s %10s\n' "$backend" "$done_n" "$(q 50)" "$(q 99)" "$(q 99.9)" "${errors:-0}" "${allowed:-0}" "${svc_p99:-?}" \
    "$(per "$rl0" "$rl1")" "$(per "$ev0" "$ev1")" "$(per "$rd0" "$rd1")"
  kill "$ev" "$rl" 2>/dev/null || true
  wait "$ev" "$rl" 2>/dev/null || true
done
echo "errors/allowed: calls Envoy counted as failed or late (each a request let through); svc_p99_ms: the bucket bound of the service's own p99"
