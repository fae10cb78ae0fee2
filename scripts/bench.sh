#!/usr/bin/env bash
# `make bench`: ratelimitd against its baselines, all measured in one run on this machine.
#
# Servers, each driven in turn by the same client:
#   bare     a tonic RateLimitService that does no work (benches/baseline.rs --mode noop)
#   memory   ratelimitd, memory backend
#   naive    a tonic RLS doing one EVALSHA (INCRBY + EXPIRE per key) per request
#   redis    ratelimitd, Redis backend (standalone redis-server started here)
# and ratelimitd's own script fed to Redis alone, one call per request: the Redis ceiling.
#
# Headline: h2load (Debian's nghttp2-client, a neutral HTTP/2 client) sending the bench domain's
# two-descriptor request, closed loop, under load (-c16 -m32) and at low concurrency (8 calls in
# flight: -c4 -m2). Then the project's loadgen: key distributions (one hot key, 10k uniform,
# Zipf over 10k); latency open loop at half of the peak, beside the matching baseline at the
# same rate; a fleet (1,000 connections of 4 streams) and memory per idle connection; key scale
# (1,000,000 live counters against 10,000); callgrind's instructions per request.
# CPU per request comes from /proc (utime + stime) of the server and of redis-server. The last
# table holds every target of docs/performance.md with its ratio and whether it is met.
# Loopback only; every duration is bounded. Tunables: DURATION (s), CLIENTS, STREAMS, SERVERS,
# CALLGRIND (0 skips it), DISTS, FLEET (connections), KEYS_BIG (counters), ROUNDS, LAT_ROUNDS
# and KEY_ROUNDS (rounds of each server in the closed-loop, latency and key-scale comparisons).
# LIGHT_CLIENTS and LIGHT_STREAMS (the light shape, 4 and 2), SECTIONS (what runs after the
# closed-loop table; SECTIONS="" runs that table and its targets alone).
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
FLEET=${FLEET:-1000}
KEYS_BIG=${KEYS_BIG:-1000000}
ROUNDS=${ROUNDS:-3}
# The light shape: a few calls in flight, as most replicas of a fleet see (4 Envoys, 2 each).
LIGHT_CLIENTS=${LIGHT_CLIENTS:-4}
LIGHT_STREAMS=${LIGHT_STREAMS:-2}
# What runs after the closed-loop table (all by default): script dists fleet keys callgrind.
SECTIONS=${SECTIONS-script dists fleet keys callgrind}
section() { [[ " $SECTIONS " == *" $1 "* ]]; }
LAT_ROUNDS=${LAT_ROUNDS:-3}
KEY_ROUNDS=${KEY_ROUNDS:-3}
# The fleet needs a descriptor per connection, in h2load and in the server.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

command -v h2load >/dev/null || { echo "bench: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
HZ=$(getconf CLK_TCK)

cargo build --release --quiet
LOADGEN=$(bench_bin loadgen)
BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(redis-server --version | cut -d' ' -f1-3), $(h2load --version | head -1)"
echo "h2load: -c$CLIENTS -m$STREAMS, ${DURATION}s per run, the same 2-descriptor request (bench domain)"

start_redis
"$BASELINE" --write-request "$WORK/request.bin"

SERVER_PID=
GRPC=
HTTP=
start_server() {
  local name=$1
  GRPC=127.0.0.1:$(free_port)
  HTTP=127.0.0.1:$(free_port)
  local http=$HTTP
  case $name in
    bare) "$BASELINE" --mode noop --addr "$GRPC" & ;;
    naive) "$BASELINE" --mode evalsha --addr "$GRPC" --redis "redis://127.0.0.1:$REDIS_PORT" & ;;
    memory) ./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "$GRPC" \
      --http-addr "$http" --log-level warn --backend memory & ;;
    # Room for KEYS_BIG live counters (about 250 B each) without a single eviction.
    keys) ./target/release/ratelimitd --config "$WORK/keys" --grpc-addr "$GRPC" \
      --http-addr "$http" --log-level warn --backend memory --memory-max-bytes 2GiB & ;;
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

# Runs h2load against $GRPC; prints "req/s p50_ms p99_ms server_us redis_us 2xx mean_ms" for the run.
# H2_CLIENTS and H2_STREAMS override -c and -m; extra arguments go to h2load.
h2run() {
  local log=$WORK/h2.log
  rm -f "$log"
  local s0 r0 s1 r1 out
  s0=$(cpu_ticks "$SERVER_PID"); r0=$(cpu_ticks "$REDIS_PID")
  local c=${H2_CLIENTS:-$CLIENTS} m=${H2_STREAMS:-$STREAMS}
  out=$(h2load -c"$c" -m"$m" -t1 -D "$DURATION" --warm-up-time=1 "$@" \
    -d "$WORK/request.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
    --log-file="$log" "http://$GRPC/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
  s1=$(cpu_ticks "$SERVER_PID"); r1=$(cpu_ticks "$REDIS_PID")
  local ok
  ok=$(echo "$out" | awk '/status codes:/ {print $3}')
  # Each line of the log: start time, HTTP status, elapsed microseconds.
  local n p50 p99 mean
  n=$(wc -l <"$log" 2>/dev/null || echo 0)
  if [ "$n" -eq 0 ]; then
    # No request completed: say what h2load said and whether the server still runs, rather
    # than dividing by zero below.
    local alive=no
    kill -0 "$SERVER_PID" 2>/dev/null && alive=yes
    echo "bench: no request completed against $GRPC (server process alive: $alive); h2load said:" >&2
    echo "$out" | tail -5 >&2
    exit 1
  fi
  read -r p50 p99 mean < <(cut -f3 "$log" | sort -n | awk -v n="$n" \
    'NR == int(n * 0.50) + 1 {p50 = $1} NR == int(n * 0.99) + 1 {p99 = $1} {sum += $1}
     END {printf "%.2f %.2f %.3f\n", p50 / 1000, p99 / 1000, (NR ? sum / NR : 0) / 1000}')
  # CPU ticks cover the warm-up second too: count its requests in by rate.
  awk -v n="$n" -v d="$DURATION" -v s=$((s1 - s0)) -v r=$((r1 - r0)) -v hz="$HZ" -v p50="$p50" -v p99="$p99" -v ok="$ok" -v mean="$mean" \
    'BEGIN { total = n * (d + 1) / d; printf "%.0f %s %s %.1f %.1f %s %s\n", n / d, p50, p99, s / hz * 1e6 / total, r / hz * 1e6 / total, ok, mean }'
}

# The fixed-window domain for key scale: the bench request's shape with hour windows, so every
# counter the fill creates is still live when measured.
mkdir -p "$WORK/keys"
cp benches/limits.yaml "$WORK/keys/"
cat >"$WORK/keys/keys.yaml" <<'YAML'
domain: keys
descriptors:
  - key: client
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
  - key: route
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
YAML

# Every server runs at once (an idle one costs nothing) and they are measured in turn, ROUNDS
# times over; each figure is the median of its server's rounds, so a stall of the VM during one
# run does not decide a ratio.
declare -A RPS P50 P99 SCPU RCPU LRPS LSCPU LRCPU LMEAN HALF_P99 HALF_RATE BASE_P99 SPID SGRPC RUNS LRUNS
for name in $SERVERS; do
  start_server "$name"
  SPID[$name]=$SERVER_PID SGRPC[$name]=$GRPC
  h2load -c1 -n 2000 -d "$WORK/request.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
    "http://$GRPC/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" >/dev/null  # warm
done
for round in $(seq "$ROUNDS"); do
  for name in $SERVERS; do
    SERVER_PID=${SPID[$name]} GRPC=${SGRPC[$name]}
    read -r rps p50 p99 scpu rcpu ok _ < <(h2run)
    [ "$ok" -gt 0 ] || { echo "bench: $name answered no 2xx" >&2; exit 1; }
    RUNS[$name]="${RUNS[$name]:-}$rps $p50 $p99 $scpu $rcpu;"
    read -r rps _ _ scpu rcpu _ mean < <(H2_CLIENTS=$LIGHT_CLIENTS H2_STREAMS=$LIGHT_STREAMS h2run)
    LRUNS[$name]="${LRUNS[$name]:-}$rps $scpu $rcpu $mean;"
    echo "round $round: $name: -c$CLIENTS -m$STREAMS $(echo "${RUNS[$name]}" | tr ';' '\n' | grep -v '^$' | tail -1 | awk '{printf "%s req/s, server %s us, redis %s us", $1, $4, $5}'); 8 in flight $scpu us, redis $rcpu us, mean $mean ms"
  done
done
# Column `col` (1-based) of a server's rounds, their median.
column_median() { echo "$1" | tr ';' '\n' | grep -v '^$' | awk -v c="$2" '{print $c}' | tr '\n' ' ' | median; }
for name in $SERVERS; do
  RPS[$name]=$(column_median "${RUNS[$name]}" 1); P50[$name]=$(column_median "${RUNS[$name]}" 2)
  P99[$name]=$(column_median "${RUNS[$name]}" 3); SCPU[$name]=$(column_median "${RUNS[$name]}" 4)
  RCPU[$name]=$(column_median "${RUNS[$name]}" 5)
  LRPS[$name]=$(column_median "${LRUNS[$name]}" 1); LSCPU[$name]=$(column_median "${LRUNS[$name]}" 2)
  LRCPU[$name]=$(column_median "${LRUNS[$name]}" 3); LMEAN[$name]=$(column_median "${LRUNS[$name]}" 4)
  SERVER_PID=${SPID[$name]}
  stop_server
done

# Ratelimitd's script with the request's two keys, one call per request, as a function, fed
# pipelined on one connection (redis-cli --pipe: the packed numbers are binary, which
# redis-benchmark cannot send): the Redis ceiling for one-call-per-request designs.
if section script; then
  redis-cli -p "$REDIS_PORT" FUNCTION LOAD REPLACE \
    "$(printf '#!lua name=ratelimitd_ceiling\nlocal FUNCTION = %s\n' "'ratelimitd_ceiling'"; cat src/limiter/redis/script.lua)" >/dev/null
  RB_N=$((DURATION * 30000))
  script_calls 1 "$RB_N" FCALL ratelimitd_ceiling >"$WORK/calls.resp"
  r0=$(cpu_ticks "$REDIS_PID")
  rb_start=$(date +%s.%N)
  redis-cli -p "$REDIS_PORT" --pipe <"$WORK/calls.resp" | grep -q 'errors: 0' || { echo "bench: the script's calls fail" >&2; exit 1; }
  rb_end=$(date +%s.%N)
  r1=$(cpu_ticks "$REDIS_PID")
  RB_RPS=$(awk -v n="$RB_N" -v a="$rb_start" -v b="$rb_end" 'BEGIN {printf "%.0f", n / (b - a)}')
  RB_RCPU=$(awk -v r=$((r1 - r0)) -v hz="$HZ" -v n="$RB_N" 'BEGIN {printf "%.1f", r / hz * 1e6 / n}')
fi

label_of() {
  case $1 in
    bare) echo "bare tonic RLS (no work)";; memory) echo "ratelimitd, memory backend";;
    naive) echo "naive: one EVALSHA per request";; redis) echo "ratelimitd, Redis backend";;
  esac
}
echo
printf '%-44s %9s %8s %8s %9s %9s | %9s %9s %9s %8s\n' "h2load closed loop" "req/s" "p50 ms" "p99 ms" \
  "server us" "redis us" "8: req/s" "server us" "redis us" "mean ms"
for name in $SERVERS; do
  printf '%-44s %9s %8s %8s %9s %9s | %9s %9s %9s %8s\n' "$(label_of "$name")" "${RPS[$name]}" "${P50[$name]}" \
    "${P99[$name]}" "${SCPU[$name]}" "${RCPU[$name]}" "${LRPS[$name]}" "${LSCPU[$name]}" "${LRCPU[$name]}" "${LMEAN[$name]}"
done
section script && printf '%-44s %9s %8s %8s %9s %9s\n' "ratelimitd's script alone, one per request" "$RB_RPS" - - - "$RB_RCPU"
echo "(left: -c$CLIENTS -m$STREAMS; right, '8:': 8 calls in flight, -c$LIGHT_CLIENTS -m$LIGHT_STREAMS)"

# loadgen against $GRPC with the given flags; prints "requests p50 p99 server_us redis_us".
loadgen_run() {
  local s0 r0 s1 r1 out n
  s0=$(cpu_ticks "$SERVER_PID"); r0=$(cpu_ticks "$REDIS_PID")
  out=$("$LOADGEN" --target "http://$GRPC" --duration "$DURATION" --warmup 0 "$@")
  s1=$(cpu_ticks "$SERVER_PID"); r1=$(cpu_ticks "$REDIS_PID")
  n=$(echo "$out" | awk '/^requests:/ {print $2}')
  awk -v n="$n" -v s=$((s1 - s0)) -v r=$((r1 - r0)) -v hz="$HZ" \
    -v p50="$(echo "$out" | awk '/^latency/ {for (i = 1; i <= NF; i++) if ($i == "p50") print $(i + 1)}')" \
    -v p99="$(echo "$out" | awk '/^latency/ {for (i = 1; i <= NF; i++) if ($i == "p99") print $(i + 1)}')" \
    'BEGIN { printf "%d %s %s %.1f %.1f\n", n, p50, p99, s / hz * 1e6 / n, r / hz * 1e6 / n }'
}

# Key distributions through the project's loadgen (checks every answer; errors fail the run).
# Then latency: open loop at half of the best closed-loop rate, ratelimitd and its baseline
# both running, measured in turn LAT_ROUNDS times each at that rate; each side's p99 is the
# median of its rounds, so one stall of the VM during one round does not decide the ratio.
if section dists; then
  echo
  printf '%-44s %9s %8s %8s %9s %9s\n' "loadgen, 64 calls over 4 connections" "req/s" "p50 ms" "p99 ms" "server us" "redis us"
  for pair in bare:memory naive:redis; do
    base=${pair%%:*}; name=${pair##*:}
    [[ " $SERVERS " == *" $name "* ]] || continue
    start_server "$name"
    OURS_PID=$SERVER_PID OURS_GRPC=$GRPC
    peak=0
    for dist in $DISTS; do
      case $dist in
        hot) flags=(--keys 1);; uniform) flags=(--keys 10000);; zipf) flags=(--keys 10000 --zipf 1.0);;
      esac
      read -r n p50 p99 scpu rcpu < <(loadgen_run --concurrency 64 --connections 4 "${flags[@]}")
      rate=$((n / DURATION))
      [ "$rate" -gt "$peak" ] && peak=$rate
      printf '%-44s %9s %8s %8s %9s %9s\n' "$name, $dist" "$rate" "$p50" "$p99" "$scpu" "$rcpu"
    done
    if [ "$peak" -gt 0 ] && [[ " $SERVERS " == *" $base "* ]]; then
      HALF_RATE[$name]=$((peak / 2))
      start_server "$base"
      BASE_PID=$SERVER_PID BASE_GRPC=$GRPC
      ours=() theirs=()
      for round in $(seq "$LAT_ROUNDS"); do
        for side in "$name" "$base"; do
          if [ "$side" = "$name" ]; then SERVER_PID=$OURS_PID GRPC=$OURS_GRPC; else SERVER_PID=$BASE_PID GRPC=$BASE_GRPC; fi
          read -r n p50 p99 scpu rcpu < <(loadgen_run --concurrency 64 --connections 4 --keys 10000 --rate "${HALF_RATE[$name]}")
          if [ "$side" = "$name" ]; then ours+=("$p99"); else theirs+=("$p99"); fi
          printf '%-44s %9s %8s %8s %9s %9s\n' "$side, open loop at ${HALF_RATE[$name]}/s, round $round" "$((n / DURATION))" "$p50" "$p99" "$scpu" "$rcpu"
        done
      done
      HALF_P99[$name]=$(echo "${ours[*]}" | median)
      BASE_P99[$name]=$(echo "${theirs[*]}" | median)
      echo "  p99, median of $LAT_ROUNDS rounds: $name ${HALF_P99[$name]} ms, $base ${BASE_P99[$name]} ms"
      stop_server
    fi
    SERVER_PID=$OURS_PID
    stop_server
  done
fi

# A fleet: FLEET connections of 4 streams each against 16 of 32 (the memory backend: no Redis
# cost to hide the connections' own), after memory per idle connection on the fresh server.
declare -A FCPU FRPS IDLE_KB
if section fleet && [[ " $SERVERS " == *" memory "* ]]; then
  echo
  printf '%-44s %9s %8s %8s %9s\n' "fleet: h2load closed loop" "req/s" "p50 ms" "p99 ms" "server us"
  for name in bare memory; do
    [[ " $SERVERS " == *" $name "* ]] || continue
    start_server "$name"
    # Idle first, on the fresh server: each connection makes one call, then holds still.
    before=$(rss_kib "$SERVER_PID")
    "$LOADGEN" --target "http://$GRPC" --idle-connections "$FLEET" --duration 30 >"$WORK/idle.out" &
    idle_pid=$!
    for _ in $(seq 600); do grep -q '^idle:' "$WORK/idle.out" && break; sleep 0.05; done
    grep -q '^idle:' "$WORK/idle.out" || { echo "bench: the idle connections did not open" >&2; exit 1; }
    sleep 1
    after=$(rss_kib "$SERVER_PID")
    kill "$idle_pid" 2>/dev/null || true; wait "$idle_pid" 2>/dev/null || true
    read -r FRPS[$name] p50 p99 FCPU[$name] _ ok _ < <(H2_CLIENTS=$FLEET H2_STREAMS=4 h2run)
    [ "$ok" -gt 0 ] || { echo "bench: $name answered no 2xx to the fleet" >&2; exit 1; }
    printf '%-44s %9s %8s %8s %9s\n' "$name, $FLEET connections x 4 streams" "${FRPS[$name]}" "$p50" "$p99" "${FCPU[$name]}"
    IDLE_KB[$name]=$(awk -v a="$after" -v b="$before" -v n="$FLEET" 'BEGIN {printf "%.1f", (a - b) / n}')
    echo "$name: resident memory per idle connection: ${IDLE_KB[$name]} KiB ($FLEET connections, RSS $before -> $after KiB)"
    stop_server
  done
fi

# Key scale: two memory-backend servers, one holding 10,000 live counters and one KEYS_BIG,
# measured in turn KEY_ROUNDS times each; each side's CPU per request is the median of its
# rounds, so one stall of the VM during one round does not decide the ratio.
declare -A KCPU
if section keys && [[ " $SERVERS " == *" memory "* ]]; then
  echo
  printf '%-44s %9s %8s %8s %9s\n' "key scale: loadgen, memory backend" "req/s" "p50 ms" "p99 ms" "server us"
  declare -A KPID KGRPC KHELD KRUNS
  for keys in 10000 "$KEYS_BIG"; do
    start_server keys
    KPID[$keys]=$SERVER_PID KGRPC[$keys]=$GRPC
    # Fill: every worker walks its own stretch of the keys, so each key is touched.
    "$LOADGEN" --target "http://$GRPC" --domain keys --keys "$keys" --concurrency 64 --connections 4 \
      --duration 600 --warmup 0 --fill >/dev/null
    KHELD[$keys]=$(curl -s "http://$HTTP/metrics" 2>/dev/null | awk '/^ratelimit_memory_bytes / {printf "%.0f MiB", $2 / 1048576}')
  done
  for round in $(seq "$KEY_ROUNDS"); do
    for keys in 10000 "$KEYS_BIG"; do
      SERVER_PID=${KPID[$keys]} GRPC=${KGRPC[$keys]}
      read -r n p50 p99 cpu _ < <(loadgen_run --domain keys --keys "$keys" --concurrency 64 --connections 4)
      KRUNS[$keys]="${KRUNS[$keys]:-} $cpu"
      printf '%-44s %9s %8s %8s %9s\n' "$keys keys${KHELD[$keys]:+ (${KHELD[$keys]} of counters)}, round $round" "$((n / DURATION))" "$p50" "$p99" "$cpu"
    done
  done
  for keys in 10000 "$KEYS_BIG"; do
    KCPU[$keys]=$(echo "${KRUNS[$keys]}" | median)
    SERVER_PID=${KPID[$keys]}
    stop_server
  done
  echo "  server us per request, median of $KEY_ROUNDS rounds: 10000 keys ${KCPU[10000]}, $KEYS_BIG keys ${KCPU[$KEYS_BIG]}"
fi
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
# Instructions per request: the server under callgrind, instrumented only while loadgen runs.
if [ "$CALLGRIND" = 1 ] && section callgrind && command -v valgrind >/dev/null; then
  echo
  echo "callgrind: server instructions per request (loadgen, 8 calls over 2 connections, 5 s)"
  declare -A INSTR
  for name in $SERVERS; do
    port=$(free_port)
    bench_server_cmd "$name" "$port" "redis://127.0.0.1:$REDIS_PORT" 5s
    valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.$name.%p" --instr-atstart=no "${SERVER_CMD[@]}" >/dev/null 2>&1 &
    SERVER_PID=$!
    pids+=("$SERVER_PID")
    wait_port "$port" 300 || true
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

# Every target of docs/performance.md: measured, its ratio, the target, met or not.
echo
echo "targets (ratios of figures measured above, in this run)"
printf '%-62s %18s %7s %8s %4s\n' "target" "measured" "ratio" "target" "met"
target() { # label a b max [unit]
  local label=$1 a=$2 b=$3 max=$4 unit=${5:-us}
  if [ -z "$a" ] || [ -z "$b" ]; then printf '%-62s %18s\n' "$label" "not measured"; return; fi
  awk -v l="$label" -v a="$a" -v b="$b" -v m="$max" -v u="$unit" 'BEGIN {
    r = (b > 0) ? a / b : 0
    printf "%-62s %18s %6.2fx %7s %4s\n", l, sprintf("%s / %s %s", a, b, u), r, "<=" m, (b > 0 && r <= m) ? "yes" : "no" }'
}
has() { [[ " $SERVERS " == *" $1 "* ]]; }
LIGHT="8 in flight (-c$LIGHT_CLIENTS -m$LIGHT_STREAMS)"
if has memory && has bare; then
  target "memory: server CPU/req vs bare tonic, -c$CLIENTS -m$STREAMS" "${SCPU[memory]}" "${SCPU[bare]}" 1.10
  target "memory: server CPU/req vs bare tonic, $LIGHT" "${LSCPU[memory]}" "${LSCPU[bare]}" 1.15
fi
if has redis && has naive; then
  target "redis: server CPU/req vs naive, -c$CLIENTS -m$STREAMS" "${SCPU[redis]}" "${SCPU[naive]}" 0.75
  target "redis: Redis CPU/req vs naive, -c$CLIENTS -m$STREAMS" "${RCPU[redis]}" "${RCPU[naive]}" 0.4
  target "redis: server CPU/req vs naive, $LIGHT" "${LSCPU[redis]}" "${LSCPU[naive]}" 1.0
  target "redis: Redis CPU/req vs naive, $LIGHT" "${LRCPU[redis]}" "${LRCPU[naive]}" 1.0
  target "redis: mean latency vs naive, $LIGHT" "${LMEAN[redis]}" "${LMEAN[naive]}" 1.1 ms
fi
if has memory && has bare; then
  target "memory: p99 open loop at ${HALF_RATE[memory]:-?}/s vs bare at that rate" "${HALF_P99[memory]:-}" "${BASE_P99[memory]:-}" 1.25 ms
fi
if has redis && has naive; then
  target "redis: p99 open loop at ${HALF_RATE[redis]:-?}/s vs naive at that rate" "${HALF_P99[redis]:-}" "${BASE_P99[redis]:-}" 1.25 ms
fi
if has memory; then
  target "fleet: memory CPU/req, $FLEET conns x 4 vs $CLIENTS x $STREAMS" "${FCPU[memory]:-}" "${SCPU[memory]}" 1.2
  target "keys: memory CPU/req, $KEYS_BIG counters vs 10000" "${KCPU[$KEYS_BIG]:-}" "${KCPU[10000]:-}" 1.1
  if [ -n "${IDLE_KB[memory]:-}" ]; then
    printf '%-62s %18s\n' "stated: resident memory per idle connection (memory)" "${IDLE_KB[memory]} KiB"
    has bare && printf '%-62s %18s\n' "  (bare tonic, for comparison)" "${IDLE_KB[bare]:-?} KiB"
  fi
fi
