#!/usr/bin/env bash
# `make pools`: a large RLQS quota pool beside RLS traffic, on the memory backend and on Redis
# (benches/pools.rs says what one round does). Each round starts a fresh server (and a fresh
# redis-server), so every round sees the same pool; the backends alternate round by round.
# Per backend, the medians of: the RLS client's p50 and p99 while the pool is quiet and while a
# report of REPORT new buckets joins a pool of MEMBERS (and the others report again), their
# ratio (target: p99 busy / quiet <= 1.25), how long the large report took to be answered, and
# the server's (and Redis's) CPU meanwhile. Loopback only; every phase is bounded.
# Tunables: ROUNDS, MEMBERS, REPORT, STREAMS, RLS_RATE (calls/s), WINDOW (s), BACKENDS.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
ROUNDS=${ROUNDS:-3}
MEMBERS=${MEMBERS:-30000}
REPORT=${REPORT:-10000}
STREAMS=${STREAMS:-4}
RLS_RATE=${RLS_RATE:-1000}
WINDOW=${WINDOW:-5}
BACKENDS=${BACKENDS:-memory redis}

cargo build --release --quiet
POOLS=$(bench_bin pools)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

echo "machine: $(nproc) cores, $(redis-server --version | cut -d' ' -f1-3)"
echo "a report of $REPORT new buckets joining a pool of $MEMBERS (the others on $STREAMS streams), RLS at $RLS_RATE/s, ${WINDOW}s windows, $ROUNDS rounds"
for round in $(seq "$ROUNDS"); do
  for backend in $BACKENDS; do
    redis_pid=""
    redis_url=""
    if [ "$backend" = redis ]; then
      rport=$(free_port)
      redis_server "$rport" &
      redis_pid=$!
      pids+=("$redis_pid")
      wait_port "$rport"
      redis_url="redis://127.0.0.1:$rport"
    fi
    port=$(free_port)
    bench_server_cmd "$backend" "$port" "$redis_url" 1s
    # Room for every member: about 1.9 KB each, a connection's streams a quarter of it.
    "${SERVER_CMD[@]}" --rlqs-max-bytes 512MiB >"$WORK/server.log" 2>&1 &
    spid=$!
    pids+=("$spid")
    wait_port "$port"
    line=$("$POOLS" --target "http://127.0.0.1:$port" --server-pid "$spid" \
      ${redis_pid:+--redis-pid "$redis_pid"} --members "$MEMBERS" --report "$REPORT" \
      --streams "$STREAMS" --rls-rate "$RLS_RATE" --window "$WINDOW")
    echo "round $round $backend: $line"
    echo "$line" >>"$WORK/$backend"
    kill "$spid" ${redis_pid:+"$redis_pid"} 2>/dev/null || true
    wait "$spid" ${redis_pid:+"$redis_pid"} 2>/dev/null || true
  done
done

field() { sed -n "s/.*\b$2=\([^ ]*\).*/\1/p" "$WORK/$1" | median; }
echo
printf '%-7s %9s %9s %9s %9s %11s %8s %10s %11s %10s %10s\n' backend quiet_p50 quiet_p99 busy_p50 busy_p99 p99_ratio target report_ms answered server_cpu redis_cpu
for backend in $BACKENDS; do
  qp99=$(field "$backend" quiet_p99)
  bp99=$(field "$backend" busy_p99)
  ratio=$(awk -v b="$bp99" -v q="$qp99" 'BEGIN {printf "%.2f", b / q}')
  met=$(awk -v r="$ratio" 'BEGIN {print (r <= 1.25) ? "met" : "MISSED"}')
  printf '%-7s %9s %9s %9s %9s %11s %8s %10s %11s %10s %10s\n' "$backend" \
    "$(field "$backend" quiet_p50)" "$qp99" "$(field "$backend" busy_p50)" "$bp99" \
    "${ratio}x" "$met" "$(field "$backend" report_ms)" "$(field "$backend" report_answered)" \
    "$(field "$backend" server_cpu_ms)" "$(field "$backend" redis_cpu_ms)"
done
