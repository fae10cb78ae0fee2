#!/usr/bin/env bash
# Where the Redis backend's CPU goes at 8 calls in flight, beside the naive one-EVALSHA server:
# per request, server and Redis CPU (user time apart), context switches summed over every thread
# (/proc/PID/task/*/status) and requests per script call (Redis's INFO commandstats), under the
# project's loadgen (8 calls over 2 connections). Rounds alternate naive, ratelimitd.
#
#   scripts/wakeups.sh        tunables: ROUNDS (2), DURATION (5 s)
#
# Loopback only; every run bounded. Builds the release binary and the bench tools if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-5}
HZ=$(getconf CLK_TCK)
cargo build --release --quiet
BASELINE=$(bench_bin baseline)
LOADGEN=$(bench_bin loadgen)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -f "$_ports_given"; }
trap cleanup EXIT
REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
REDIS_PID=$!
pids+=("$REDIS_PID")
until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do sleep 0.05; done

switches() { cat /proc/"$1"/task/*/status | awk '/ctxt_switches/ {s += $2} END {print s}'; }
ticks() { awk '{print $14 + $15, $14}' "/proc/$1/stat"; }
echo "loadgen, 8 calls over 2 connections, ${DURATION}s; per request:"
printf '%-10s %9s %11s %9s %11s %9s %9s\n' server "CPU us" "(user us)" switches "Redis us" "(user us)" switches
for _ in $(seq "$ROUNDS"); do
  for name in naive ratelimitd; do
    port=$(free_port)
    case $name in
      naive) "$BASELINE" --mode evalsha --addr "127.0.0.1:$port" --redis "redis://127.0.0.1:$REDIS_PORT" & ;;
      ratelimitd) ./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "127.0.0.1:$port" \
        --http-addr "127.0.0.1:$(free_port)" --log-level warn --backend redis \
        --redis-url "redis://127.0.0.1:$REDIS_PORT" & ;;
    esac
    pid=$!
    pids+=("$pid")
    wait_port "$port" 100 || true
    "$LOADGEN" --target "http://127.0.0.1:$port" --duration 2 --warmup 0 --concurrency 8 --connections 2 >/dev/null
    redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
    read -r s0 u0 < <(ticks "$pid"); read -r r0 v0 < <(ticks "$REDIS_PID")
    c0=$(switches "$pid"); d0=$(switches "$REDIS_PID")
    n=$("$LOADGEN" --target "http://127.0.0.1:$port" --duration "$DURATION" --warmup 0 --concurrency 8 \
      --connections 2 | awk '/^requests:/ {print $2}')
    read -r s1 u1 < <(ticks "$pid"); read -r r1 v1 < <(ticks "$REDIS_PID")
    c1=$(switches "$pid"); d1=$(switches "$REDIS_PID")
    calls=$(redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r' |
      awk -F'[=,:]' '/^cmdstat_(evalsha|fcall):/ {s += $3} END {print s + 0}')
    kill "$pid"; wait "$pid" 2>/dev/null || true
    awk -v name="$name" -v n="$n" -v hz="$HZ" -v s=$((s1 - s0)) -v u=$((u1 - u0)) -v c=$((c1 - c0)) \
      -v r=$((r1 - r0)) -v v=$((v1 - v0)) -v d=$((d1 - d0)) -v calls="$calls" 'BEGIN {
        us = 1e6 / hz / n
        printf "%-10s %9.1f %11.1f %9.2f %11.1f %9.1f %9.2f   %.2f requests per script call\n",
          name, s * us, u * us, c / n, r * us, v * us, d / n, (calls > 0) ? n / calls : 0 }'
  done
done
