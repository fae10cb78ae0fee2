#!/usr/bin/env bash
# `make day-two`: what a deploy, a crash and a fresh start let through, measured as an operator
# would: Envoy (examples/envoy/envoy.yaml: its 20 ms timeout, failure_mode_deny false) in front
# of this checkout's release build, h2load through Envoy, and a Service stand-in between Envoy
# and the replicas (scripts/balancer.py: new connections round robin over the replicas listed,
# a replica listed once its /healthcheck says 200 and taken off 1 s after SIGTERM). Every
# failed call is a request Envoy let through undecided. Per run it prints the calls failed
# open (Envoy's ratelimit.failure_mode_allowed) and the requests admitted (h2load's 2xx)
# against the budget; on memory each replica counts alone, so only the failed calls count.
#
#   rolling   two replicas, each replaced in turn (the new one ready, then SIGTERM to the old),
#             under RATE (1000) requests a second for 12 s on a per-minute budget of 6000
#   kill      one replica SIGKILLed under the same load, the next connection sent to it while
#             it is still listed (the budget as above)
#   burst     a replica and an Envoy just started (Envoy straight to the replica), then the
#             first wave: 64 streams at once on a budget of 30. (Beyond the first wave, 64
#             streams at full speed saturate a 2-core machine shared by h2load, Envoy,
#             ratelimitd and Redis: a second wave of 2,000 on a warm replica failed 185-241
#             calls past 20 ms too, so that is a capacity figure, not a start-up one.)
#
# RUNS (5) runs of each, on BACKENDS ("redis memory"); ENVOY (target/tools/envoy/1.40.0/envoy)
# with ENVOY_CONFIG (examples/envoy/envoy.yaml); BIN (this checkout's release build). An older
# build with its own checkout's example measures "before".
# Loopback only; every process ends with the script. Usage: scripts/day-two.sh [SCENARIO...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
# This script measures the drain: the binary's own default, not common.sh's none.
unset RATELIMITD_DRAIN_DELAY
RUNS=${RUNS:-5}
RATE=${RATE:-1000}
BACKENDS=${BACKENDS:-redis memory}
ENVOY=${ENVOY:-target/tools/envoy/1.40.0/envoy}
[ -x "$ENVOY" ] || { echo "no Envoy at $ENVOY (make deps installs it)" >&2; exit 2; }
SCENARIOS=("$@")
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=(rolling kill burst)
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet
  BIN=target/release/ratelimitd
fi
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
start_redis
mkdir -p "$WORK/limits"
cat >"$WORK/limits/day-two.yaml" <<'EOF'
domain: edge
descriptors:
  - key: api_key
    value: day-two
    rate_limit: {unit: minute, requests_per_unit: 6000, algorithm: sliding_log}
  - key: api_key
    value: burst
    rate_limit: {unit: minute, requests_per_unit: 30, algorithm: sliding_log}
EOF
UPSTREAM=$(free_port)
python3 examples/envoy/upstream.py "$UPSTREAM" >/dev/null 2>&1 &
pids+=($!)
LB=$(free_port)
CTL=$(free_port)
python3 scripts/balancer.py "$LB" "$CTL" &
pids+=($!)
wait_port "$UPSTREAM"
wait_port "$CTL"

ctl() { # COMMAND...: one command to the balancer, its answer on stdout
  local line
  exec 3<>"/dev/tcp/127.0.0.1/$CTL"
  echo "$*" >&3
  read -r line <&3
  exec 3>&-
  echo "$line"
}

# Starts a replica on backend $1; sets REPLICA_PID and REPLICA_GRPC once /healthcheck says 200.
replica() { # BACKEND
  local http
  REPLICA_GRPC=$(free_port)
  http=$(free_port)
  local backend=()
  [ "$1" = redis ] && backend=(--backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT")
  "$BIN" --config "$WORK/limits" --grpc-addr "127.0.0.1:$REPLICA_GRPC" \
    --http-addr "127.0.0.1:$http" --log-level warn "${backend[@]}" &
  REPLICA_PID=$!
  pids+=("$REPLICA_PID")
  for _ in $(seq 400); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/healthcheck")" = 200 ] && return
    sleep 0.02
  done
  echo "replica on $1 not ready" >&2
  return 1
}

# Starts Envoy with the example pointed at gRPC port $1 (the balancer's by default); sets
# ENVOY_PID, HTTP and ADMIN.
envoy_start() { # [RLS_PORT]
  local rls=${1:-$LB}
  HTTP=$(free_port)
  ADMIN=$(free_port)
  sed -e "s/port_value: 10000/port_value: $HTTP/; s/port_value: 9000/port_value: $UPSTREAM/" \
    -e "s/port_value: 8081/port_value: $rls/; s/address: 0.0.0.0/address: 127.0.0.1/" \
    "${ENVOY_CONFIG:-examples/envoy/envoy.yaml}" >"$WORK/envoy.yaml"
  printf '\nadmin:\n  address:\n    socket_address: { address: 127.0.0.1, port_value: %s }\n' \
    "$ADMIN" >>"$WORK/envoy.yaml"
  "$ENVOY" -c "$WORK/envoy.yaml" --disable-hot-restart --concurrency 2 -l error \
    --log-path "$WORK/envoy.log" &
  ENVOY_PID=$!
  pids+=("$ENVOY_PID")
  for _ in $(seq 200); do
    [ "$(curl -s "http://127.0.0.1:$ADMIN/ready")" = LIVE ] && return
    sleep 0.05
  done
  echo "Envoy not ready" >&2
  return 1
}

stat() { # NAME: one of Envoy's counters
  curl -s "http://127.0.0.1:$ADMIN/stats?filter=^cluster\.upstream\.ratelimit\.$1\$" |
    awk -F': ' '{print $2}' | head -1
}

# Ends a run: Envoy's figures and h2load's, one line; every process of the run stopped.
report() { # SCENARIO BACKEND RUN BUDGET H2LOAD_OUTPUT
  local failed admitted
  failed=$(stat failure_mode_allowed)
  admitted=$(awk '/^status codes:/ {print $3}' "$5")
  printf '%-8s %-7s run %s: %5s calls failed open, %6s admitted of a budget of %s\n' \
    "$1" "$2" "$3" "${failed:-0}" "$admitted" "$4"
  local p
  for p in "$ENVOY_PID" "${run_pids[@]}"; do
    kill -9 "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
}

load() { # KEY SECONDS OUTPUT: RATE requests a second through Envoy, in the background
  h2load -c 10 -m 1 --rps $((RATE / 10)) -D "$2" -H "x-api-key: $1" \
    "http://127.0.0.1:$HTTP/" >"$3" 2>&1 &
  LOAD_PID=$!
}

rolling() { # BACKEND RUN
  run_pids=()
  redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null
  replica "$1"; local a=$REPLICA_PID a_port=$REPLICA_GRPC
  replica "$1"; local b=$REPLICA_PID b_port=$REPLICA_GRPC
  add "$a_port"
  add "$b_port"
  envoy_start
  load day-two 12 "$WORK/h2load.txt"
  sleep 2
  for old in "$a:$a_port" "$b:$b_port"; do
    replica "$1"
    run_pids+=("$REPLICA_PID")
    add "$REPLICA_GRPC"
    kill -TERM "${old%%:*}"
    ctl next "${old##*:}" >/dev/null
    ctl remove "${old##*:}" 1 >/dev/null
    sleep 1
  done
  wait "$LOAD_PID" || true
  wait "$a" "$b" 2>/dev/null || true
  report rolling "$1" "$2" 6000 "$WORK/h2load.txt"
  unlist
}

kill_one() { # BACKEND RUN
  run_pids=()
  redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null
  replica "$1"; local a=$REPLICA_PID a_port=$REPLICA_GRPC
  add "$a_port"
  envoy_start
  load day-two 12 "$WORK/h2load.txt"
  sleep 1
  replica "$1"
  run_pids+=("$REPLICA_PID")
  add "$REPLICA_GRPC"
  sleep 1
  kill -KILL "$a"
  wait "$a" 2>/dev/null || true
  ctl next "$a_port" >/dev/null
  ctl remove "$a_port" 1 >/dev/null
  wait "$LOAD_PID" || true
  report kill "$1" "$2" 6000 "$WORK/h2load.txt"
  unlist
}

burst() { # BACKEND RUN
  run_pids=()
  redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null
  redis-cli -p "$REDIS_PORT" FUNCTION FLUSH >/dev/null
  redis-cli -p "$REDIS_PORT" SCRIPT FLUSH >/dev/null
  replica "$1"
  run_pids+=("$REPLICA_PID")
  # Straight to the replica: no balancer between them (its Python would be the bottleneck of
  # a burst at full speed).
  envoy_start "$REPLICA_GRPC"
  h2load -c 1 -m 64 -n 64 -H "x-api-key: burst" "http://127.0.0.1:$HTTP/" >"$WORK/h2load.txt" 2>&1
  report burst "$1" "$2" 30 "$WORK/h2load.txt"
  unlist
}

# Lists the replica on gRPC port $1 (it said 200), remembered for `unlist`.
listed_ports=()
add() { # PORT
  ctl add "$1" >/dev/null
  listed_ports+=("$1")
}

# Takes every replica of the run off the list (already removed or not).
unlist() {
  local p
  for p in "${listed_ports[@]}"; do ctl remove "$p" 0 >/dev/null; done
  listed_ports=()
  sleep 0.1
}

echo "Envoy $("$ENVOY" --version | grep -o 'version: [^/]*/[0-9.]*' | cut -d/ -f2), $(redis-server --version | cut -d' ' -f1-3), $(nproc) cores; $RATE requests/s"
for scenario in "${SCENARIOS[@]}"; do
  for backend in $BACKENDS; do
    for run in $(seq "$RUNS"); do
      case $scenario in
        rolling) rolling "$backend" "$run" ;;
        kill) kill_one "$backend" "$run" ;;
        burst) burst "$backend" "$run" ;;
        *) echo "unknown scenario $scenario" >&2; exit 2 ;;
      esac
    done
  done
done
