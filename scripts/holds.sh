#!/usr/bin/env bash
# What a hold costs on Redis: server CPU and Redis CPU per call (µs, utime + stime from /proc)
# for calls that take a place under a new request id and release it (a concurrency limit,
# `loadgen --holds`: half the calls acquire, half release) against plain fixed-window
# admissions of one descriptor (`loadgen --plain`), the same loadgen, the two interleaved round
# by round so that both see the same machine. Ratios are against the plain admission of the
# same round; a request that holds a place makes two calls, so per request it costs twice the
# per-call figure. Usage: scripts/holds.sh. Loopback only; every run bounded. Tunables:
# ROUNDS (4), DURATION (6 s), CONCURRENCY (64 calls in flight), CONNECTIONS (4).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
ROUNDS=${ROUNDS:-4}
DURATION=${DURATION:-6}
CONCURRENCY=${CONCURRENCY:-64}
CONNECTIONS=${CONNECTIONS:-4}
HZ=$(getconf CLK_TCK)
cargo build --release --quiet
LOADGEN=$(bench_bin loadgen)
[ -x "$LOADGEN" ] || { echo "holds: no loadgen" >&2; exit 1; }

WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
start_redis

# One run of loadgen mode $1 (plain or holds) against a fresh server: prints
# "calls/s server-µs-per-call redis-µs-per-call".
run() {
  local mode=$1 grpc http pid s0 s1 r0 r1 out n
  grpc=127.0.0.1:$(free_port)
  http=127.0.0.1:$(free_port)
  ./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "$grpc" --http-addr "$http" \
    --log-level warn --backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT" \
    --redis-key-prefix "holds-$mode-$RANDOM:" --redis-timeout 1s &
  pid=$!
  until curl -sf "$http/healthcheck" >/dev/null; do kill -0 "$pid" || exit 1; sleep 0.05; done
  "$LOADGEN" --target "http://$grpc" --duration 1 --warmup 0 "--$mode" >/dev/null # warm
  s0=$(cpu_ticks "$pid"); r0=$(cpu_ticks "$REDIS_PID")
  out=$("$LOADGEN" --target "http://$grpc" --duration "$DURATION" --warmup 0 \
    --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" "--$mode")
  s1=$(cpu_ticks "$pid"); r1=$(cpu_ticks "$REDIS_PID")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  # Every call must be answered OK: a place is released before its worker takes the next.
  echo "$out" | grep -q 'over_limit 0  errors 0' || { echo "holds: $mode: $out" >&2; exit 1; }
  n=$(echo "$out" | awk '/^requests:/ {print $2}')
  awk -v n="$n" -v d="$DURATION" -v s=$((s1 - s0)) -v r=$((r1 - r0)) -v hz="$HZ" \
    'BEGIN { printf "%.0f %.1f %.1f\n", n / d, s / hz * 1e6 / n, r / hz * 1e6 / n }'
}

echo "loadgen: $CONCURRENCY calls in flight over $CONNECTIONS connections, ${DURATION}s per run, $ROUNDS rounds"
ratios_s=(); ratios_r=(); plain_s=(); plain_r=(); held_s=(); held_r=()
for round in $(seq "$ROUNDS"); do
  read -r prps ps pr <<<"$(run plain)"
  read -r hrps hs hr <<<"$(run holds)"
  plain_s+=("$ps"); plain_r+=("$pr"); held_s+=("$hs"); held_r+=("$hr")
  ratios_s+=("$(awk -v a="$hs" -v b="$ps" 'BEGIN {print a / b}')")
  ratios_r+=("$(awk -v a="$hr" -v b="$pr" 'BEGIN {print a / b}')")
  echo "round $round: plain $prps calls/s, server $ps µs, Redis $pr µs per call; holds $hrps calls/s, server $hs µs, Redis $hr µs per call"
done
echo "median per call: plain server $(echo "${plain_s[@]}" | median) µs, Redis $(echo "${plain_r[@]}" | median) µs;" \
  "acquire or release server $(echo "${held_s[@]}" | median) µs, Redis $(echo "${held_r[@]}" | median) µs"
echo "median ratio per call (holds / plain): server $(echo "${ratios_s[@]}" | median)×, Redis $(echo "${ratios_r[@]}" | median)×"
