#!/usr/bin/env bash
# Where a server's CPU goes at a few calls in flight: per request, server and Redis CPU (user time
# apart), context switches summed over every thread (/proc/PID/task/*/status), requests per
# script call (Redis's INFO commandstats), and the server's threads that worked, each one's share
# of a core over the run (/proc/PID/task/*/stat), under h2load's bench request at issue 35's
# light shape (-c4 -m2). Each server is started afresh, warmed with 2,000 calls, then measured
# over one run; rounds alternate the servers.
#
#   scripts/wakeups.sh [SERVER ...]     (default: naive redis; also bare, memory)
#
# Tunables: ROUNDS (2), DURATION (5 s), CLIENTS (4), STREAMS (2); FLAGS, extra flags for
# ratelimitd (e.g. "--redis-max-batch 1"); TOKIO_WORKER_THREADS is passed on to every server.
#
# Loopback only; every run bounded. Builds the release binary and the baseline if needed; needs
# h2load (apt-get install nghttp2-client).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-5}
CLIENTS=${CLIENTS:-4}
STREAMS=${STREAMS:-2}
read -r -a EXTRA <<<"${FLAGS:-}"
[ $# -gt 0 ] || set -- naive redis
command -v h2load >/dev/null || { echo "wakeups: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
HZ=$(getconf CLK_TCK)
cargo build --release --quiet
BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
# Every thread of process $1: "tid ticks" (user + system).
thread_ticks() {
  local t
  for t in /proc/"$1"/task/*; do
    echo "${t##*/} $(awk '{print $14 + $15}' "$t/stat" 2>/dev/null || echo 0)"
  done
}
start_redis
"$BASELINE" --write-request "$WORK/request.bin"
echo "h2load -c$CLIENTS -m$STREAMS, ${DURATION}s${FLAGS:+, ratelimitd $FLAGS}${TOKIO_WORKER_THREADS:+, TOKIO_WORKER_THREADS=$TOKIO_WORKER_THREADS}; per request:"
printf '%-10s %9s %11s %9s %11s %9s %9s\n' server "CPU us" "(user us)" switches "Redis us" "(user us)" switches
for _ in $(seq "$ROUNDS"); do
  for name in "$@"; do
    port=$(free_port)
    bench_server_cmd "$name" "$port" "redis://127.0.0.1:$REDIS_PORT" || { echo "wakeups: unknown server $name" >&2; exit 2; }
    case $name in memory | redis) SERVER_CMD+=("${EXTRA[@]}") ;; esac
    "${SERVER_CMD[@]}" &
    pid=$!
    pids+=("$pid")
    wait_port "$port" 100
    h2_bench "$port" "$WORK/request.bin" -c1 -n 2000 >/dev/null
    redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
    read -r s0 u0 < <(cpu_ticks "$pid" user); read -r r0 v0 < <(cpu_ticks "$REDIS_PID" user)
    c0=$(ctx_switches "$pid"); d0=$(ctx_switches "$REDIS_PID")
    thread_ticks "$pid" >"$WORK/threads0"
    n=$(h2_bench "$port" "$WORK/request.bin" -c"$CLIENTS" -m"$STREAMS" -D "$DURATION" |
      awk '/status codes:/ {print $3}')
    read -r s1 u1 < <(cpu_ticks "$pid" user); read -r r1 v1 < <(cpu_ticks "$REDIS_PID" user)
    c1=$(ctx_switches "$pid"); d1=$(ctx_switches "$REDIS_PID")
    thread_ticks "$pid" >"$WORK/threads1"
    # The threads that ran more than 1% of the run, busiest first, as shares of a core.
    threads=$(awk -v hz="$HZ" -v d="$DURATION" 'NR == FNR { t0[$1] = $2; next }
      { x = ($2 - t0[$1]) / hz / d * 100; if (x > 1) printf "%.0f%%\n", x }' \
      "$WORK/threads0" "$WORK/threads1" | sort -rn | paste -sd' ')
    calls=$(redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r' |
      awk -F'[=,:]' '/^cmdstat_(evalsha|fcall):/ {s += $3} END {print s + 0}')
    kill "$pid"; wait "$pid" 2>/dev/null || true
    awk -v name="$name" -v n="$n" -v hz="$HZ" -v s=$((s1 - s0)) -v u=$((u1 - u0)) -v c=$((c1 - c0)) \
      -v r=$((r1 - r0)) -v v=$((v1 - v0)) -v d=$((d1 - d0)) -v calls="$calls" -v threads="$threads" 'BEGIN {
        us = 1e6 / hz / n
        printf "%-10s %9.1f %11.1f %9.2f %11.1f %9.1f %9.2f   %.2f requests per script call, threads %s\n",
          name, s * us, u * us, c / n, r * us, v * us, d / n, (calls > 0) ? n / calls : 0, threads }'
  done
done
