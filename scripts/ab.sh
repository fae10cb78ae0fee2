#!/usr/bin/env bash
# Interleaved A/B of two ratelimitd binaries: server CPU per request (µs, utime + stime from
# /proc; on the Redis backend Redis's CPU per request too) and throughput under the same h2load load (the bench domain's 2-descriptor request),
# runs alternating A, B, A, B... so that both see the same machine. Keep a change only if this
# shows it. Usage: scripts/ab.sh BINARY_A BINARY_B. Loopback only; every run bounded.
# Tunables: ROUNDS (3), DURATION (8 s), CLIENTS (16), STREAMS (32), BACKENDS ("memory redis"),
# FLAGS (more server flags for both, e.g. "--reference-metrics"), FLAGS_A and FLAGS_B (for one
# side only: the same binary twice with FLAGS_B="--statsd-addr 127.0.0.1:8125" measures what a
# flag costs), REQUEST (a gRPC-framed request file in place of the bench domain's).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
[ $# -eq 2 ] || { echo "usage: scripts/ab.sh BINARY_A BINARY_B" >&2; exit 2; }
A=$(realpath "$1")
B=$(realpath "$2")
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-8}
CLIENTS=${CLIENTS:-16}
STREAMS=${STREAMS:-32}
BACKENDS=${BACKENDS:-memory redis}
HZ=$(getconf CLK_TCK)
command -v h2load >/dev/null || { echo "ab: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }

BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
if [ -n "${REQUEST:-}" ]; then cp "$REQUEST" "$WORK/request.bin"; else "$BASELINE" --write-request "$WORK/request.bin"; fi
start_redis

# One run of binary $1 on backend $2: prints "requests/s server-µs-per-request redis-µs-per-request".
run() {
  local bin=$1 backend=$2 side=${3:-} grpc http pid s0 s1 r0 r1 out n
  grpc=127.0.0.1:$(free_port)
  http=127.0.0.1:$(free_port)
  local flags=(--config benches/limits.yaml --grpc-addr "$grpc" --http-addr "$http" --log-level warn --backend "$backend")
  [ "$backend" = redis ] && flags+=(--redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s)
  read -ra extra <<<"${FLAGS:-} $side"
  flags+=("${extra[@]}")
  "$bin" "${flags[@]}" &
  pid=$!
  until curl -sf "$http/healthcheck" >/dev/null; do kill -0 "$pid" || exit 1; sleep 0.05; done
  local url="http://$grpc/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
  local h=(-d "$WORK/request.bin" -H 'content-type: application/grpc' -H 'te: trailers')
  h2load -c1 -n 2000 "${h[@]}" "$url" >/dev/null # warm
  s0=$(cpu_ticks "$pid"); r0=$(cpu_ticks "$REDIS_PID")
  out=$(h2load -c"$CLIENTS" -m"$STREAMS" -t1 -D "$DURATION" "${h[@]}" "$url")
  s1=$(cpu_ticks "$pid"); r1=$(cpu_ticks "$REDIS_PID")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  n=$(echo "$out" | awk '/^requests:/ {print $8}')
  awk -v n="$n" -v d="$DURATION" -v s=$((s1 - s0)) -v r=$((r1 - r0)) -v hz="$HZ" \
    'BEGIN { printf "%.0f %.1f %.2f\n", n / d, s / hz * 1e6 / n, r / hz * 1e6 / n }'
}

echo "A: $A"
echo "B: $B"
echo "h2load -c$CLIENTS -m$STREAMS, ${DURATION}s per run, $ROUNDS rounds of A then B${FLAGS:+, server flags: $FLAGS}${FLAGS_A:+, A: $FLAGS_A}${FLAGS_B:+, B: $FLAGS_B}"
for backend in $BACKENDS; do
  sa=0; sb=0; xa=0; xb=0
  for r in $(seq "$ROUNDS"); do
    read -r ra ca da < <(run "$A" "$backend" "${FLAGS_A:-}")
    read -r rb cb db < <(run "$B" "$backend" "${FLAGS_B:-}")
    printf '%-7s round %d   A %7s req/s %6s us/req (redis %5s)   B %7s req/s %6s us/req (redis %5s)\n' \
      "$backend" "$r" "$ra" "$ca" "$da" "$rb" "$cb" "$db"
    sa=$(awk -v a="$sa" -v b="$ca" 'BEGIN {print a + b}')
    sb=$(awk -v a="$sb" -v b="$cb" 'BEGIN {print a + b}')
    xa=$(awk -v a="$xa" -v b="$da" 'BEGIN {print a + b}')
    xb=$(awk -v a="$xb" -v b="$db" 'BEGIN {print a + b}')
  done
  awk -v a="$sa" -v b="$sb" -v n="$ROUNDS" -v k="$backend" \
    'BEGIN { printf "%-7s mean      A %.1f us/req   B %.1f us/req   B/A %.2f\n", k, a / n, b / n, b / a }'
  if [ "$backend" = redis ]; then
    awk -v a="$xa" -v b="$xb" -v n="$ROUNDS" \
      'BEGIN { printf "redis   mean Redis CPU   A %.2f us/req   B %.2f us/req   B/A %.2f\n", a / n, b / n, (a > 0) ? b / a : 0 }'
  fi
done
