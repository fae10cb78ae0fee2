#!/usr/bin/env bash
# `make bench`: throughput and latency of a release ratelimitd on loopback, driven by the
# project's load generator (benches/loadgen.rs), on the memory backend and on a standalone
# redis-server this script starts; then redis-benchmark running the very same Lua script with
# the same two keys per call, measured in the same run: the ceiling the service can approach.
# Prints the machine's core count with the results. Loopback only; bounded durations.
# Tunables: DURATION (s), CONCURRENCY, CONNECTIONS, BACKENDS ("memory redis").
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
CONCURRENCY=${CONCURRENCY:-64}
CONNECTIONS=${CONNECTIONS:-4}
BACKENDS=${BACKENDS:-memory redis}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cargo build --release --quiet
cargo bench --bench loadgen --no-run --quiet 2>/dev/null || cargo bench --bench loadgen --no-run
echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(redis-server --version | cut -d' ' -f1-3)"
echo "load: $CONCURRENCY concurrent calls over $CONNECTIONS connections, ${DURATION}s, 2 descriptors per request"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
pids+=($!)
for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done

run_service() {
  local backend=$1; shift
  local grpc http
  grpc=127.0.0.1:$(free_port); http=127.0.0.1:$(free_port)
  ./target/release/ratelimitd --config benches/limits.yaml --grpc-addr "$grpc" --http-addr "$http" \
    --log-level warn --backend "$backend" "$@" &
  local server=$!
  pids+=($server)
  for _ in $(seq 100); do
    kill -0 "$server" 2>/dev/null || { echo "bench: ratelimitd did not start" >&2; exit 1; }
    curl -sf "http://$http/healthcheck" >/dev/null 2>&1 && break
    sleep 0.1
  done
  echo "--- ratelimitd, $backend backend"
  local before after out
  before=$(cpu_ticks "$server")
  out=$(cargo bench --quiet --bench loadgen -- --target "http://$grpc" \
    --duration "$DURATION" --warmup 0 --concurrency "$CONCURRENCY" --connections "$CONNECTIONS")
  after=$(cpu_ticks "$server")
  echo "$out"
  # Server CPU per request: throughput per core, whatever else shares the machine.
  local requests
  requests=$(echo "$out" | awk '/^requests:/ {print $2}')
  awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" -v n="$requests" -v rss="$(ps -o rss= -p "$server")" \
    'BEGIN { s = t / hz; printf "server: %.2f CPU-s for %d requests = %.1f us/request = %.0f requests per core-second; rss %d MiB\n", s, n, s * 1e6 / n, n / s, rss / 1024 }'
  kill "$server"; wait "$server" 2>/dev/null || true
}

for backend in $BACKENDS; do
  case $backend in
    memory) run_service memory ;;
    redis) run_service redis --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s ;;
  esac
done

if [[ " $BACKENDS " == *" redis "* ]]; then
  # The same script and arguments ratelimitd sends for one request of benches/limits.yaml:
  # a sliding_window client counter (10 000 distinct clients) and a fixed_window route counter.
  sha=$(redis-cli -p "$REDIS_PORT" SCRIPT LOAD "$(cat src/limiter/redis/script.lua)")
  requests=$((DURATION * 40000))
  echo "--- Redis MEMORY USAGE of one full counter (limit 100 per 60 s, 100 single-hit requests)"
  for algo in f s w b; do
    key="ratelimit:{edge}:remote_address:10.0.0.1:${algo}60000000:0"
    # Fill it with 100 requests; if a minute boundary fell inside (the 101st is admitted), again.
    for attempt in 1 2; do
      redis-cli -p "$REDIS_PORT" DEL "$key" >/dev/null
      for i in $(seq 100); do
        redis-cli -p "$REDIS_PORT" EVALSHA "$sha" 1 "$key" decide "$(printf '%016x.%x' $RANDOM$RANDOM "$i")" 0 \
          "$algo" 100 60000000 100 1 E >/dev/null
      done
      admitted=$(redis-cli -p "$REDIS_PORT" EVALSHA "$sha" 1 "$key" decide x 0 "$algo" 100 60000000 100 1 E | head -1)
      [ "$admitted" = 0 ] && break  # the 101st request is refused: full
    done
    case $algo in f) name=fixed_window;; s) name=sliding_window;; w) name=sliding_log;; b) name=token_bucket;; esac
    printf '%-15s %5s bytes  (full: %s; key %s, ttl %s ms)\n' "$name" \
      "$(redis-cli -p "$REDIS_PORT" MEMORY USAGE "$key" SAMPLES 0)" "$([ "$admitted" = 0 ] && echo yes || echo NO)" \
      "$(redis-cli -p "$REDIS_PORT" TYPE "$key")" "$(redis-cli -p "$REDIS_PORT" PTTL "$key")"
  done
  echo "--- redis-benchmark, EVALSHA of script.lua with the same 2 keys per call, $CONCURRENCY clients"
  redis-benchmark -p "$REDIS_PORT" -c "$CONCURRENCY" -n "$requests" -r 10000 --precision 3 \
    EVALSHA "$sha" 2 "ratelimit:{bench}:client:c__rand_int__:s1000000:0" \
    "ratelimit:{bench}:route:/api/__rand_int__:f1000000:0" \
    decide bench 0 s 1000000 1000000 1000000 1 E f 100000000 1000000 100000000 1 E \
    | tr '\r' '\n' | grep -A4 "Summary:" | grep -v "^ *$"
fi
