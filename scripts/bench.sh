#!/usr/bin/env bash
# `make bench`: ratelimitd against its baselines, all measured in one run on this machine.
#
# Servers, each driven in turn by the same client:
#   bare     a tonic RateLimitService that does no work (benches/baseline.rs --mode noop)
#   memory   ratelimitd, memory backend
#   naive    a tonic RLS doing one EVALSHA (INCRBY + EXPIRE per key) per request
#   redis    ratelimitd, Redis backend (standalone redis-server started here)
# and redis-benchmark running ratelimitd's own script, one call per request: the Redis ceiling.
#
# Headline: h2load (Debian's nghttp2-client, a neutral HTTP/2 client) sending the bench domain's
# two-descriptor request, closed loop, then paced at half of the server's own peak for latency.
# Key distributions: the project's loadgen (one hot key, 10k uniform keys, Zipf over 10k).
# CPU per request comes from /proc (utime + stime) of the server and of redis-server.
# Loopback only; every duration is bounded. Tunables: DURATION (s), CLIENTS, STREAMS, SERVERS.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
DURATION=${DURATION:-10}
CLIENTS=${CLIENTS:-16}
STREAMS=${STREAMS:-32}
SERVERS=${SERVERS:-bare memory naive redis}
CALLGRIND=${CALLGRIND:-1}
DISTS=${DISTS:-hot uniform zipf}

command -v h2load >/dev/null || { echo "bench: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

cargo build --release --quiet
LOADGEN=$(bench_bin loadgen)
BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK" "$_ports_given"; }
trap cleanup EXIT

echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(redis-server --version | cut -d' ' -f1-3), $(h2load --version | head -1)"
echo "h2load: -c$CLIENTS -m$STREAMS, ${DURATION}s per run, the same 2-descriptor request (bench domain)"

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
REDIS_PID=$!
pids+=("$REDIS_PID")
for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
"$BASELINE" --write-request "$WORK/request.bin"

SERVER_PID=
GRPC=
start_server() {
  local name=$1
  GRPC=127.0.0.1:$(free_port)
  local http=127.0.0.1:$(free_port)
  case $name in
    bare) "$BASELINE" --mode noop --addr "$GRPC" & ;;
    naive) "$BASELINE" --mode evalsha --addr "$GRPC" --redis "redis://127.0.0.1:$REDIS_PORT" & ;;
    memory) ./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "$GRPC" \
      --http-addr "$http" --log-level warn --backend memory & ;;
    redis) ./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "$GRPC" \
      --http-addr "$http" --log-level warn --backend redis \
      --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s & ;;
  esac
  SERVER_PID=$!
  pids+=("$SERVER_PID")
  for _ in $(seq 200); do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "bench: $name did not start" >&2; exit 1; }
    (exec 3<>"/dev/tcp/${GRPC%:*}/${GRPC#*:}") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "bench: $name did not listen" >&2; exit 1
}
stop_server() { kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }

# Runs h2load against $GRPC; prints "req/s p50_ms p99_ms server_us redis_us" for the run.
# Extra arguments go to h2load (e.g. --rps).
h2run() {
  local log=$WORK/h2.log
  rm -f "$log"
  local s0 r0 s1 r1 out
  s0=$(cpu_ticks "$SERVER_PID"); r0=$(cpu_ticks "$REDIS_PID")
  out=$(h2load -c"$CLIENTS" -m"$STREAMS" -t1 -D "$DURATION" --warm-up-time=1 "$@" \
    -d "$WORK/request.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
    --log-file="$log" "http://$GRPC/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
  s1=$(cpu_ticks "$SERVER_PID"); r1=$(cpu_ticks "$REDIS_PID")
  local ok
  ok=$(echo "$out" | awk '/status codes:/ {print $3}')
  # Each line of the log: start time, HTTP status, elapsed microseconds.
  local n p50 p99
  n=$(wc -l <"$log")
  read -r p50 p99 < <(cut -f3 "$log" | sort -n | awk -v n="$n" \
    'NR == int(n * 0.50) + 1 {p50 = $1} NR == int(n * 0.99) + 1 {p99 = $1} END {printf "%.2f %.2f\n", p50 / 1000, p99 / 1000}')
  # CPU ticks cover the warm-up second too: count its requests in by rate.
  awk -v n="$n" -v d="$DURATION" -v s=$((s1 - s0)) -v r=$((r1 - r0)) -v hz="$HZ" -v p50="$p50" -v p99="$p99" -v ok="$ok" \
    'BEGIN { total = n * (d + 1) / d; printf "%.0f %s %s %.1f %.1f %s\n", n / d, p50, p99, s / hz * 1e6 / total, r / hz * 1e6 / total, ok }'
}

declare -A RPS P50 P99 SCPU RCPU HP50 HP99 HRPS HALF_P99 HALF_RATE BASE_P99
for name in $SERVERS; do
  start_server "$name"
  h2load -c1 -n 2000 -d "$WORK/request.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
    "http://$GRPC/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" >/dev/null  # warm
  read -r RPS[$name] P50[$name] P99[$name] SCPU[$name] RCPU[$name] ok < <(h2run)
  [ "$ok" -gt 0 ] || { echo "bench: $name answered no 2xx" >&2; exit 1; }
  half=$(( ${RPS[$name]} / 2 / CLIENTS ))
  read -r HRPS[$name] HP50[$name] HP99[$name] _ _ _ < <(h2run --rps="$half")
  stop_server
  [ "$name" = naive ] && redis-cli -p "$REDIS_PORT" flushall >/dev/null
done

# redis-benchmark: ratelimitd's script with the request's two keys, one call per request.
sha=$(redis-cli -p "$REDIS_PORT" SCRIPT LOAD "$(cat src/limiter/redis/script.lua)")
rb_args=(EVALSHA "$sha" 2 "ratelimit:{bench}:client:c1:s1000000:0" "ratelimit:{bench}:route:/api/1:f1000000:0"
  decide 1 2 1 s 1000000 1000000 1000000 2 f 100000000 1000000 100000000 bench 0 2 1 1 E 2 1 E)
redis-cli -p "$REDIS_PORT" "${rb_args[@]}" >/dev/null || { echo "bench: redis-benchmark's script call fails" >&2; exit 1; }
r0=$(cpu_ticks "$REDIS_PID")
rb=$(redis-benchmark -p "$REDIS_PORT" -c 32 -n $((DURATION * 30000)) --csv "${rb_args[@]}" | tail -1)
r1=$(cpu_ticks "$REDIS_PID")
RB_RPS=$(echo "$rb" | awk -F'"' '{printf "%.0f", $4}')
RB_RCPU=$(awk -v r=$((r1 - r0)) -v hz="$HZ" -v n=$((DURATION * 30000)) 'BEGIN {printf "%.1f", r / hz * 1e6 / n}')

echo
printf '%-44s %9s %8s %8s %9s %9s %10s\n' "server (h2load closed loop)" "req/s" "p50 ms" "p99 ms" "server us" "redis us" "p99@half"
for name in $SERVERS; do
  case $name in
    bare) label="bare tonic RLS (no work)";; memory) label="ratelimitd, memory backend";;
    naive) label="naive: one EVALSHA per request";; redis) label="ratelimitd, Redis backend";;
  esac
  printf '%-44s %9s %8s %8s %9s %9s %7s ms\n' "$label" "${RPS[$name]}" "${P50[$name]}" "${P99[$name]}" \
    "${SCPU[$name]}" "${RCPU[$name]}" "${HP99[$name]}"
done
printf '%-44s %9s %8s %8s %9s %9s\n' "redis-benchmark, ratelimitd's script, -c 32" "$RB_RPS" - - - "$RB_RCPU"
echo
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
if [[ " $SERVERS " == *" memory "* && " $SERVERS " == *" bare "* ]]; then
  echo "memory server CPU/req vs bare tonic:          $(ratio "${SCPU[memory]}" "${SCPU[bare]}")x   (target <= 1.15)"
fi
if [[ " $SERVERS " == *" redis "* ]]; then
  echo "redis throughput vs redis-benchmark:          $(ratio "${RPS[redis]}" "$RB_RPS")x   (target >= 1.0)"
  if [[ " $SERVERS " == *" naive "* ]]; then
    echo "redis: Redis CPU/req vs naive server's:       $(ratio "${RCPU[redis]}" "${RCPU[naive]}")x   (target <= 0.5)"
    echo "redis: server CPU/req vs naive server's:      $(ratio "${SCPU[redis]}" "${SCPU[naive]}")x   (target <= 1.0)"
  fi
fi
for name in memory redis; do
  [[ " $SERVERS " == *" $name "* ]] && echo "$name: p99 at half of peak (h2load --rps, ${HRPS[$name]} req/s): ${HP99[$name]} ms"
done

# Key distributions through the project's loadgen (checks every answer; errors fail the run).
echo
printf '%-44s %9s %8s %8s %9s %9s\n' "loadgen, 64 calls over 4 connections" "req/s" "p50 ms" "p99 ms" "server us" "redis us"
for name in memory redis; do
  [[ " $SERVERS " == *" $name "* ]] || continue
  start_server "$name"
  peak=0
  for dist in $DISTS half; do
    case $dist in
      hot) flags=(--keys 1);; uniform) flags=(--keys 10000);; zipf) flags=(--keys 10000 --zipf 1.0);;
      # Open loop at half of the best closed-loop rate above: the latency target's setting.
      half) [ "$peak" -gt 0 ] || continue; HALF_RATE[$name]=$((peak / 2))
        flags=(--keys 10000 --rate $((peak / 2))); dist="uniform, paced at $((peak / 2))/s";;
    esac
    s0=$(cpu_ticks "$SERVER_PID"); r0=$(cpu_ticks "$REDIS_PID")
    out=$("$LOADGEN" --target "http://$GRPC" --duration "$DURATION" --warmup 0 --concurrency 64 --connections 4 "${flags[@]}")
    s1=$(cpu_ticks "$SERVER_PID"); r1=$(cpu_ticks "$REDIS_PID")
    n=$(echo "$out" | awk '/^requests:/ {print $2}')
    p50=$(echo "$out" | awk '/^latency/ {for (i = 1; i <= NF; i++) if ($i == "p50") print $(i + 1)}')
    p99=$(echo "$out" | awk '/^latency/ {for (i = 1; i <= NF; i++) if ($i == "p99") print $(i + 1)}')
    rate=$(awk -v n="$n" -v d="$DURATION" 'BEGIN {printf "%d", n / d}')
    if [[ $dist == *paced* ]]; then HALF_P99[$name]=$p99; elif [ "$rate" -gt "$peak" ]; then peak=$rate; fi
    awk -v l="$name, $dist" -v n="$n" -v d="$DURATION" -v s=$((s1 - s0)) -v r=$((r1 - r0)) -v hz="$HZ" -v p50="$p50" -v p99="$p99" \
      'BEGIN { printf "%-44s %9.0f %8s %8s %9.1f %9.1f\n", l, n / d, p50, p99, s / hz * 1e6 / n, r / hz * 1e6 / n }'
  done
  stop_server
done
# The baselines paced at the same rate: the latency floor of this machine for each path.
for pair in bare:memory naive:redis; do
  base=${pair%%:*}; name=${pair##*:}
  [[ " $SERVERS " == *" $base "* && -n "${HALF_RATE[$name]:-}" ]] || continue
  start_server "$base"
  out=$("$LOADGEN" --target "http://$GRPC" --duration "$DURATION" --warmup 0 --concurrency 64 --connections 4 --keys 10000 --rate "${HALF_RATE[$name]}")
  BASE_P99[$name]=$(echo "$out" | awk '/^latency/ {for (i = 1; i <= NF; i++) if ($i == "p99") print $(i + 1)}')
  n=$(echo "$out" | awk '/^requests:/ {print $2}')
  printf '%-44s %9.0f %8s %8s\n' "$base, uniform, paced at ${HALF_RATE[$name]}/s" "$(awk -v n="$n" -v d="$DURATION" 'BEGIN {print n / d}')" \
    "$(echo "$out" | awk '/^latency/ {for (i = 1; i <= NF; i++) if ($i == "p50") print $(i + 1)}')" "${BASE_P99[$name]}"
  stop_server
done
for name in memory redis; do
  if [ -n "${HALF_P99[$name]:-}" ]; then
    echo "$name: p99 at half of peak (loadgen, open loop): ${HALF_P99[$name]} ms   (target < 2; its baseline at that rate: ${BASE_P99[$name]:-n/a} ms)"
  fi
done

# Instructions per request: the server under callgrind, instrumented only while loadgen runs.
if [ "$CALLGRIND" = 1 ] && command -v valgrind >/dev/null; then
  echo
  echo "callgrind: server instructions per request (loadgen, 8 calls over 2 connections, 5 s)"
  declare -A INSTR
  for name in $SERVERS; do
    port=$(free_port)
    case $name in
      bare) cmd=("$BASELINE" --mode noop --addr "127.0.0.1:$port");;
      naive) cmd=("$BASELINE" --mode evalsha --addr "127.0.0.1:$port" --redis "redis://127.0.0.1:$REDIS_PORT");;
      memory) cmd=(./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "127.0.0.1:$port"
        --http-addr "127.0.0.1:$(free_port)" --log-level warn --backend memory);;
      redis) cmd=(./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "127.0.0.1:$port"
        --http-addr "127.0.0.1:$(free_port)" --log-level warn --backend redis
        --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 5s);;
    esac
    valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.$name.%p" --instr-atstart=no "${cmd[@]}" >/dev/null 2>&1 &
    SERVER_PID=$!
    pids+=("$SERVER_PID")
    for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
    "$LOADGEN" --target "http://127.0.0.1:$port" --duration 2 --warmup 0 --concurrency 8 --connections 2 >/dev/null
    callgrind_control -i on "$SERVER_PID" >/dev/null 2>&1
    n=$("$LOADGEN" --target "http://127.0.0.1:$port" --duration 5 --warmup 0 --concurrency 8 --connections 2 | awk '/^requests:/ {print $2}')
    callgrind_control -i off "$SERVER_PID" >/dev/null 2>&1
    callgrind_control -d "$SERVER_PID" >/dev/null 2>&1
    stop_server
    total=$(cat "$WORK"/cg."$name".*.1 | awk '/^totals:/ {print $2}')
    INSTR[$name]=$(awk -v t="$total" -v n="$n" 'BEGIN {printf "%.0f", t / n}')
    printf '%-44s %9s instructions per request (%s requests)\n' "$name" "${INSTR[$name]}" "$n"
  done
  if [ -n "${INSTR[memory]:-}" ] && [ -n "${INSTR[bare]:-}" ]; then
    echo "memory server instructions/req vs bare tonic:  $(ratio "${INSTR[memory]}" "${INSTR[bare]}")x   (target <= 1.15)"
  fi
  if [ -n "${INSTR[redis]:-}" ] && [ -n "${INSTR[naive]:-}" ]; then
    echo "redis server instructions/req vs naive's:      $(ratio "${INSTR[redis]}" "${INSTR[naive]}")x   (target <= 1.0)"
  fi
fi
