#!/usr/bin/env bash
# What the runtime's shape costs on the Redis path: the naive one-EVALSHA server with tokio's
# default runtime (a worker per core) and with one worker (TOKIO_WORKER_THREADS=1), and
# ratelimitd (Redis backend) with the default runtime without the worker gate
# (--worker-gate=false), with it (the default), and with one worker. Per request: server CPU,
# Redis CPU, context switches, and h2load's mean latency. Each server is started afresh and
# warmed with 2,000 calls; rounds alternate the shapes. With PROCS=N, also ratelimitd as N
# processes of one worker each with the load split evenly over them: what runtimes of one
# thread per core, with connections spread over them and a coalescing lane and Redis
# connection each, would cost (measured 2026-11-26).
#
#   scripts/runtimes.sh        tunables: ROUNDS (2), DURATION (6 s), CLIENTS (4), STREAMS (2),
#                              PROCS (none; CLIENTS must divide by it)
#
# Loopback only; every run bounded. Builds the release binary and the baseline if needed; needs
# h2load (apt-get install nghttp2-client).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-6}
CLIENTS=${CLIENTS:-4}
STREAMS=${STREAMS:-2}
PROCS=${PROCS:-}
[ -z "$PROCS" ] || [ $((CLIENTS % PROCS)) -eq 0 ] || { echo "runtimes: CLIENTS ($CLIENTS) must divide by PROCS ($PROCS)" >&2; exit 2; }
command -v h2load >/dev/null || { echo "runtimes: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
HZ=$(getconf CLK_TCK)
cargo build --release --quiet
BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
start_redis
"$BASELINE" --write-request "$WORK/request.bin"

# h2load's bench request against 127.0.0.1:$1, its per-request log in $2; more arguments follow.
load() {
  local port=$1 log=$2
  shift 2
  h2_bench "$port" "$WORK/request.bin" "$@" --log-file="$log" >/dev/null
}
# One run: LABEL, bench server NAME, PROCS processes (CLIENTS must divide by it), WORKERS (a
# number, or "default"), and for ratelimitd GATE (on, the default, or off).
run() {
  local label=$1 name=$2 procs=$3 workers=$4 gate=${5:-on} spids=() ports=() loads=() i port pid
  for i in $(seq "$procs"); do
    port=$(free_port)
    bench_server_cmd "$name" "$port" "redis://127.0.0.1:$REDIS_PORT"
    local envs=()
    [ "$workers" = default ] || envs+=(TOKIO_WORKER_THREADS="$workers")
    [ "$gate" = off ] && envs+=(RATELIMITD_WORKER_GATE=false)
    env -u TOKIO_WORKER_THREADS -u RATELIMITD_WORKER_GATE "${envs[@]}" "${SERVER_CMD[@]}" &
    pid=$!
    pids+=("$pid")
    spids+=("$pid")
    ports+=("$port")
  done
  for port in "${ports[@]}"; do
    wait_port "$port" 100
    load "$port" "$WORK/warm.log" -c1 -n 2000
  done
  local s0=0 c0=0 s1=0 c1=0 r0 r1
  for pid in "${spids[@]}"; do s0=$((s0 + $(cpu_ticks "$pid"))); c0=$((c0 + $(ctx_switches "$pid"))); done
  r0=$(cpu_ticks "$REDIS_PID")
  for i in "${!ports[@]}"; do
    load "${ports[$i]}" "$WORK/run.$i.log" -c$((CLIENTS / procs)) -m"$STREAMS" -D "$DURATION" &
    loads+=($!)
  done
  wait "${loads[@]}"
  for pid in "${spids[@]}"; do s1=$((s1 + $(cpu_ticks "$pid"))); c1=$((c1 + $(ctx_switches "$pid"))); done
  r1=$(cpu_ticks "$REDIS_PID")
  for pid in "${spids[@]}"; do kill "$pid"; wait "$pid" 2>/dev/null || true; done
  # Each line of h2load's log: start time, HTTP status, elapsed microseconds.
  cat "$WORK"/run.*.log | awk -v label="$label" -v s=$((s1 - s0)) -v r=$((r1 - r0)) -v c=$((c1 - c0)) \
    -v hz="$HZ" -v d="$DURATION" '{n++; sum += $3} END {
      printf "%-36s %8.0f %9.1f %9.1f %9.2f %9.3f\n", label, n / d, s / hz * 1e6 / n, r / hz * 1e6 / n, c / n, sum / n / 1000 }'
  rm -f "$WORK"/run.*.log
}
echo "h2load -c$CLIENTS -m$STREAMS (split over the processes), ${DURATION}s; per request:"
printf '%-36s %8s %9s %9s %9s %9s\n' "server (runtime)" "req/s" "server us" "Redis us" switches "mean ms"
for _ in $(seq "$ROUNDS"); do
  run "naive (default)" naive 1 default
  run "naive (1 worker)" naive 1 1
  run "ratelimitd (default, no gate)" redis 1 default off
  run "ratelimitd (default, gate)" redis 1 default on
  run "ratelimitd (1 worker)" redis 1 1
  [ -z "$PROCS" ] || run "ratelimitd ($PROCS processes x 1 worker)" redis "$PROCS" 1 off
done
