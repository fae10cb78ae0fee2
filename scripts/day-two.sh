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
#   sentinel  two replicas on a master, its replica and a sentinel (down-after 400 ms); the
#   cluster   master SIGKILLed 3 s into a 10 s run at RATE (Redis only; MODE: the replicas'
#             --redis-failure-mode, share by default; SHARE_AFTER: --redis-share-after, the
#             binary's default if unset): also prints when the replica was
#             promoted, how long after it the failure mode still answered, and the outage as
#             Envoy saw it (first to last call failed open)
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
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=(rolling kill burst sentinel cluster)
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

# The flags that put a replica on backend $1 (memory: none; redis: the standalone Redis).
store() { # BACKEND
  if [ "$1" = redis ]; then echo "--backend redis --redis-url redis://127.0.0.1:$REDIS_PORT"; fi
}

# Starts a replica with the backend flags given; sets REPLICA_PID, REPLICA_GRPC and
# REPLICA_HTTP once /healthcheck says 200.
replica() { # FLAG...
  REPLICA_GRPC=$(free_port)
  REPLICA_HTTP=$(free_port)
  "$BIN" --config "$WORK/limits" --grpc-addr "127.0.0.1:$REPLICA_GRPC" \
    --http-addr "127.0.0.1:$REPLICA_HTTP" --log-level warn "$@" &
  REPLICA_PID=$!
  pids+=("$REPLICA_PID")
  for _ in $(seq 400); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$REPLICA_HTTP/healthcheck")" = 200 ] && return
    sleep 0.02
  done
  echo "replica ($*) not ready" >&2
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
  replica $(store "$1"); local a=$REPLICA_PID a_port=$REPLICA_GRPC
  replica $(store "$1"); local b=$REPLICA_PID b_port=$REPLICA_GRPC
  add "$a_port"
  add "$b_port"
  envoy_start
  load day-two 12 "$WORK/h2load.txt"
  sleep 2
  for old in "$a:$a_port" "$b:$b_port"; do
    replica $(store "$1")
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
  replica $(store "$1"); local a=$REPLICA_PID a_port=$REPLICA_GRPC
  add "$a_port"
  envoy_start
  load day-two 12 "$WORK/h2load.txt"
  sleep 1
  replica $(store "$1")
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
  replica $(store "$1")
  run_pids+=("$REPLICA_PID")
  # Straight to the replica: no balancer between them (its Python would be the bottleneck of
  # a burst at full speed).
  envoy_start "$REPLICA_GRPC"
  h2load -c 1 -m 64 -n 64 -H "x-api-key: burst" "http://127.0.0.1:$HTTP/" >"$WORK/h2load.txt" 2>&1
  report burst "$1" "$2" 30 "$WORK/h2load.txt"
  unlist
}

# Starts the Redis a failover run needs on shape $1, in $WORK/$1 (its processes in run_pids):
# sentinel: a master, its replica and a sentinel (down-after 400 ms) watching them as `main`;
# cluster: three masters with a replica each (node timeout 500 ms). Sets TARGET (the flags
# that point a replica at it) and MASTER_PID/MASTER_PORT (the master holding `{edge}`).
failover_redis() { # SHAPE
  local dir=$WORK/$1 p ports=()
  local -A node_pid=()
  rm -rf "$dir"; mkdir -p "$dir"
  case $1 in
    sentinel)
      local master replica sentinel
      master=$(free_port); replica=$(free_port); sentinel=$(free_port)
      (cd "$dir" && redis_server "$master" --repl-diskless-sync-delay 0) &
      MASTER_PID=$!; MASTER_PORT=$master; run_pids+=("$MASTER_PID")
      wait_port "$master" 100
      (cd "$dir" && redis_server "$replica" --replicaof 127.0.0.1 "$master") &
      run_pids+=($!)
      wait_port "$replica" 100
      printf 'port %s\nbind 127.0.0.1\nsentinel monitor main 127.0.0.1 %s 1\nsentinel down-after-milliseconds main 400\nsentinel failover-timeout main 2000\n' \
        "$sentinel" "$master" >"$dir/sentinel.conf"
      redis-server "$dir/sentinel.conf" --sentinel --logfile "$dir/sentinel.log" >/dev/null 2>&1 &
      run_pids+=($!)
      wait_port "$sentinel" 100
      until redis-cli -p "$replica" INFO replication | grep -q 'master_link_status:up'; do sleep 0.05; done
      TARGET=(--redis-sentinel-nodes "redis://127.0.0.1:$sentinel" --redis-sentinel-master main)
      PROMOTED_PORT=$replica
      ;;
    cluster)
      for _ in 1 2 3 4 5 6; do
        p=$(free_cluster_port)
        mkdir -p "$dir/$p"
        (cd "$dir/$p" && redis_server "$p" --cluster-enabled yes --cluster-config-file nodes.conf \
          --cluster-node-timeout 500 --repl-diskless-sync-delay 0) &
        run_pids+=($!)
        node_pid[$p]=$!
        ports+=("$p")
      done
      for p in "${ports[@]}"; do wait_port "$p" 100; done
      redis-cli --cluster create $(printf '127.0.0.1:%s ' "${ports[@]}") --cluster-replicas 1 \
        --cluster-yes >/dev/null
      for p in "${ports[@]}"; do
        until redis-cli -p "$p" CLUSTER INFO | grep -q 'cluster_state:ok'; do sleep 0.05; done
      done
      for p in "${ports[@]}"; do
        until redis-cli -p "$p" INFO replication | grep -Eq 'role:master|master_link_status:up'; do sleep 0.05; done
      done
      TARGET=(--redis-cluster-nodes "$(printf 'redis://127.0.0.1:%s,' "${ports[@]}" | sed 's/,$//')")
      # The master of {edge}'s slot (redis-cli -c follows the redirection to it).
      MASTER_PORT=$(redis-cli -c -p "${ports[0]}" --no-raw SET '{edge}probe' 1 >/dev/null;
        for p in "${ports[@]}"; do
          redis-cli -p "$p" EXISTS '{edge}probe' 2>/dev/null | grep -q '^1$' &&
            if redis-cli -p "$p" ROLE | head -1 | grep -q master; then echo "$p"; fi
        done | head -1 || true)
      MASTER_PID=${node_pid[$MASTER_PORT]}
      PROMOTED_PORT=
      for p in "${ports[@]}"; do
        if redis-cli -p "$p" ROLE | sed -n 3p | grep -qx "$MASTER_PORT"; then PROMOTED_PORT=$p; fi
      done
      ;;
  esac
}

now_ms() { date +%s%3N; }

# The master of `{edge}` SIGKILLed 3 s into a 10 s run of two replicas (failure mode MODE, by
# default share) on a Sentinel setup or a Cluster. Beside the figures of the other scenarios:
# the outage as Envoy saw it (first to last second with a call failed open, sampled every
# 50 ms), when the replica was promoted (its ROLE says master) after the kill, and when the
# replicas last answered by their failure mode (deciding alone, or failing) after promotion.
failover() { # SHAPE RUN
  run_pids=()
  local mode=${MODE:-share}
  failover_redis "$1"
  local share_after=()
  [ -z "${SHARE_AFTER:-}" ] || share_after=(--redis-share-after "$SHARE_AFTER")
  replica --backend redis "${TARGET[@]}" --redis-failure-mode "$mode" "${share_after[@]}"
  run_pids+=("$REPLICA_PID"); local a_http=$REPLICA_HTTP; add "$REPLICA_GRPC"
  replica --backend redis "${TARGET[@]}" --redis-failure-mode "$mode" "${share_after[@]}"
  run_pids+=("$REPLICA_PID"); local b_http=$REPLICA_HTTP; add "$REPLICA_GRPC"
  envoy_start
  load day-two 10 "$WORK/h2load.txt"
  sleep 3
  local killed promoted='' first='' last='' failed prev=0 decided_a decided_b alone_a=0 alone_b=0 t
  killed=$(now_ms)
  kill -9 "$MASTER_PID"
  while kill -0 "$LOAD_PID" 2>/dev/null; do
    t=$(now_ms)
    failed=$(stat failure_mode_allowed); failed=${failed:-0}
    if [ "$failed" != "$prev" ]; then
      [ -n "$first" ] || first=$t
      last=$t; prev=$failed
    fi
    if [ -z "$promoted" ] && redis-cli -p "$PROMOTED_PORT" ROLE 2>/dev/null | head -1 | grep -q master; then
      promoted=$t
    fi
    decided_a=$(curl -s "http://127.0.0.1:$a_http/metrics" | awk '/^ratelimit_failure_mode_decisions_total/ {s += $2} END {print s + 0}')
    decided_b=$(curl -s "http://127.0.0.1:$b_http/metrics" | awk '/^ratelimit_failure_mode_decisions_total/ {s += $2} END {print s + 0}')
    [ "$decided_a" != "${seen_a:-0}" ] && { seen_a=$decided_a; alone_a=$t; }
    [ "$decided_b" != "${seen_b:-0}" ] && { seen_b=$decided_b; alone_b=$t; }
    sleep 0.05
  done
  seen_a=0 seen_b=0
  local back=$((alone_a > alone_b ? alone_a : alone_b)) announced=''
  # Sentinel tells clients the new master only at +switch-master, after it has seen the
  # promoted replica report itself master (its next INFO, up to a second later).
  if [ -f "$WORK/$1/sentinel.log" ]; then
    announced=$(grep -m1 -- '+switch-master' "$WORK/$1/sentinel.log" | awk '{print $2, $3, $4, $5}' || true)
    [ -n "$announced" ] && announced="; Sentinel announced it $(($(date -d "$announced" +%s%3N) - promoted)) ms after promotion"
  fi
  printf '%-8s %-7s run %s: promoted %s ms after the kill%s; failure mode answered until %s ms after promotion; outage in Envoy %s\n' \
    "$1" "$mode" "$2" "$((promoted - killed))" "$announced" "$((back - promoted))" \
    "$([ -n "$first" ] && echo "$((first - killed))..$((last - killed)) ms after the kill" || echo none)"
  report "$1" "$mode" "$2" 6000 "$WORK/h2load.txt"
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
        sentinel | cluster) if [ "$backend" = redis ]; then failover "$scenario" "$run"; fi ;;
        *) echo "unknown scenario $scenario" >&2; exit 2 ;;
      esac
    done
  done
done
