#!/usr/bin/env bash
# A rolling restart on the quota path, measured through a real Envoy (not part of `make test`):
# examples/envoy/rlqs.yaml (domain renamed `rolling`) in front of examples/envoy/upstream.py and
# the release binary, one bucket (x-api-key: tenant) in a pool of 10^9 a second, far above the
# load. h2load drives DURATION s through a first Envoy, which is then killed (SIGKILL, its grant
# still leased), and DURATION s through the Envoy that replaces it, from its first request. For
# each Envoy: the 2xx and 4xx (429) answers and the share admitted; a pool far from its limit
# must admit the newcomer's traffic (docs/rlqs.md, "Fair shares").
# Loopback only. Tunables: ENVOY (default the 1.40.0 that scripts/deps.sh installs), DURATION
# (3), CLIENTS and STREAMS (4 × 16), BACKENDS ("memory redis"), RATELIMITD (a binary to measure
# instead of this tree's release build, e.g. an older commit's).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
ENVOY=${ENVOY:-target/tools/envoy/1.40.0/envoy}
DURATION=${DURATION:-3}
CLIENTS=${CLIENTS:-4}
STREAMS=${STREAMS:-16}
BACKENDS=${BACKENDS:-memory redis}
command -v h2load >/dev/null || { echo "rlqs-restart: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
[ -x "$ENVOY" ] || ./scripts/deps.sh
RATELIMITD=${RATELIMITD:-}
[ -n "$RATELIMITD" ] || { cargo build --release --quiet; RATELIMITD=target/release/ratelimitd; }
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

mkdir -p "$WORK/limits"
printf 'domain: rolling\ndescriptors:\n  - key: api_key\n    rate_limit: { unit: second, requests_per_unit: 1000000000 }\n' \
  >"$WORK/limits/rolling.yaml"
up_port=$(free_port)
python3 examples/envoy/upstream.py "$up_port" >/dev/null &
pids+=($!)
wait_port "$up_port"
REDIS_PID=""
[[ " $BACKENDS " == *" redis "* ]] && start_redis

# Envoy on the example, its ports rewritten; prints its PID and listener port.
start_envoy() { # NAME GRPC_PORT
  local listen admin
  listen=$(free_port) admin=$(free_port)
  sed -e "s/port_value: 10000/port_value: $listen/; s/port_value: 9000/port_value: $up_port/; s/port_value: 8081/port_value: $2/; s/address: 0.0.0.0/address: 127.0.0.1/; s/domain: edge/domain: rolling/" \
    examples/envoy/rlqs.yaml >"$WORK/$1.yaml"
  printf 'admin:\n  address:\n    socket_address: { address: 127.0.0.1, port_value: %s }\n' "$admin" >>"$WORK/$1.yaml"
  "$ENVOY" -c "$WORK/$1.yaml" --disable-hot-restart --concurrency 2 -l error >"$WORK/$1.log" 2>&1 &
  local pid=$!
  until curl -sf "127.0.0.1:$admin/ready" >/dev/null; do sleep 0.1; done
  echo "$pid $listen"
}
# h2load's 2xx and 4xx answers.
load() { # PORT
  h2load -D "$DURATION" -c "$CLIENTS" -m "$STREAMS" -H 'x-api-key: tenant' "http://127.0.0.1:$1/r" |
    awk '/^status codes:/ {print $3, $7}'
}

echo "machine: $(nproc) cores; $("$ENVOY" --version | grep -o 'version: [^ ]*' | cut -d/ -f2); h2load -c$CLIENTS -m$STREAMS for ${DURATION}s per Envoy"
printf '%-8s %-12s %10s %10s %9s\n' backend envoy 2xx 429 admitted
for backend in $BACKENDS; do
  grpc=$(free_port) http=$(free_port)
  args=(--config "$WORK/limits" --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" --log-level warn)
  [ "$backend" = redis ] && args+=(--backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT")
  "$RATELIMITD" "${args[@]}" &
  rl=$!
  pids+=("$rl")
  wait_port "$http"
  for envoy in first replacement; do
    read -r ev listen < <(start_envoy "$envoy-$backend" "$grpc")
    pids+=("$ev")
    read -r ok bad < <(load "$listen")
    printf '%-8s %-12s %10s %10s %8s%%\n' "$backend" "$envoy" "$ok" "$bad" \
      "$(awk -v a="$ok" -v b="$bad" 'BEGIN { printf "%.1f", (a + b > 0 ? 100 * a / (a + b) : 0) }')"
    kill -9 "$ev"
    wait "$ev" 2>/dev/null || true
  done
  kill "$rl" 2>/dev/null || true
  wait "$rl" 2>/dev/null || true
done
