#!/usr/bin/env bash
# `make bench`: start a release ratelimitd on loopback with benches/limits.yaml and drive it
# with the project's load generator. Prints the machine's core count with the results.
# Tunables: DURATION (s), CONCURRENCY, CONNECTIONS, PIN=1 (server on CPU 0, load on CPU 1).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
CONCURRENCY=${CONCURRENCY:-64}
CONNECTIONS=${CONNECTIONS:-4}
PIN=${PIN:-0}
GRPC=127.0.0.1:${BENCH_GRPC_PORT:-18081}
HTTP=127.0.0.1:${BENCH_HTTP_PORT:-18080}

cargo build --release --quiet
cargo bench --bench loadgen --no-run --quiet 2>/dev/null || cargo bench --bench loadgen --no-run
server_cpu=(); load_cpu=()
if [ "$PIN" = 1 ]; then server_cpu=(taskset -c 0); load_cpu=(taskset -c 1); fi

"${server_cpu[@]}" ./target/release/ratelimitd --config benches/limits.yaml \
  --grpc-addr "$GRPC" --http-addr "$HTTP" --log-level warn &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 100); do
  kill -0 "$server" 2>/dev/null || { echo "bench: ratelimitd did not start" >&2; exit 1; }
  curl -sf "http://$HTTP/healthcheck" >/dev/null 2>&1 && break
  sleep 0.1
done

echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); pinned: $PIN"
echo "backend: memory"
"${load_cpu[@]}" cargo bench --quiet --bench loadgen -- --target "http://$GRPC" \
  --duration "$DURATION" --concurrency "$CONCURRENCY" --connections "$CONNECTIONS"
ps -o rss=,time= -p "$server" | awk '{print "server: rss " $1/1024 " MiB, cpu time " $2}'
