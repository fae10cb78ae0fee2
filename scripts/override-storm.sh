#!/usr/bin/env bash
# The request path during a storm of override changes against none: open-loop gRPC calls
# (loadgen --rate: each call's latency counts from when it was due) to a replica with N
# overrides in force (of the bench domain's `client` key, none of them a request's own value),
# while a client PUTs changes to its admin listener at PUTS a second (each replaces one of the
# N, so N stay in force), against the same run without the PUTs; interleaved round by round so
# both see the same machine. On the memory backend the overrides are in --overrides-file (each
# change written and synced); on Redis, with a second replica reading the changes, it also
# reports the bytes Redis sent per second (INFO total_net_output_bytes).
#
#   scripts/override-storm.sh            (tunables: N=10000, PUTS=230, RATE=2000 calls/s,
#                                         DURATION=10 s, ROUNDS=3, BACKENDS="memory redis";
#                                         RATELIMITD=path: that binary, e.g. an older build)
#
# Prints each run's p50/p99 and, per backend, the median ratio of p99 with the storm to p99
# without. Needs python3 and redis-server. Loopback only; every run bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
N=${N:-10000}
PUTS=${PUTS:-230}
RATE=${RATE:-2000}
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
BACKENDS=${BACKENDS:-memory redis}
cargo build --release --quiet
RATELIMITD=${RATELIMITD:-./target/release/ratelimitd}
LOADGEN=$(bench_bin loadgen)
[ -x "$LOADGEN" ] || { echo "override-storm: no loadgen" >&2; exit 1; }

WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
TOKEN=override-storm-0123456789
echo "bench:$TOKEN" > "$WORK/tokens"

# The PUT client: `preload ADMIN N` sets overrides c-0..c-(N-1) from eight threads as fast as
# they are answered; `storm ADMIN N PUTS SECONDS` replaces them one by one at PUTS a second.
# Prints "ok <n> failed <n>".
cat > "$WORK/put.py" <<'PY'
import http.client, json, sys, threading, time
mode, admin, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
host, port = admin.rsplit(":", 1)
token = open(sys.argv[-1]).read().split(":", 1)[1].strip()
counts = {"ok": 0, "failed": 0}
lock = threading.Lock()
def body(i):
    return json.dumps({"domain": "bench", "entries": [{"key": "client", "value": f"c-{i % n}"}],
        "limits": [{"requests_per_unit": 1000000, "unit": "second", "algorithm": "sliding_window"}],
        "reason": "override storm"})
def put(conn, i):
    try:
        conn.request("PUT", "/v1/overrides", body(i), {"Authorization": f"Bearer {token}",
            "Content-Type": "application/json"})
        r = conn.getresponse(); r.read()
        ok = r.status == 200
    except Exception:
        conn.close(); ok = False
    with lock:
        counts["ok" if ok else "failed"] += 1
def worker(k, threads, per_thread_rate, until):
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    i, start = k, time.monotonic()
    while True:
        if mode == "preload":
            if i >= n: break
        else:
            due = start + (i // threads) / per_thread_rate
            now = time.monotonic()
            if due >= until: break
            if due > now: time.sleep(due - now)
        put(conn, i); i += threads
threads = 8 if mode == "preload" else 4
rate = float(sys.argv[4]) / threads if mode == "storm" else 0
until = time.monotonic() + (float(sys.argv[5]) if mode == "storm" else 0)
ts = [threading.Thread(target=worker, args=(k, threads, rate, until)) for k in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
print(f"ok {counts['ok']} failed {counts['failed']}")
PY

# The N overrides as --overrides-file holds them.
python3 - "$N" > "$WORK/overrides.json" <<'PY'
import json, sys
n = int(sys.argv[1])
print(json.dumps({"overrides": [{
    "id": f"{i:016x}", "domain": "bench",
    "entries": [{"key": "client", "value": f"c-{i}"}],
    "limits": [{"requests_per_unit": 1000000, "unit": "second", "algorithm": "sliding_window"}],
    "expires_at_ms": None, "reason": "bench", "created_by": "bench", "created_at_ms": i,
} for i in range(n)]}))
PY

# Waits until the replica whose HTTP port is $1 has $2 overrides in force (60 s at most).
wait_overrides() {
  local i
  for i in $(seq 600); do
    [ "$(curl -sf "http://127.0.0.1:$1/metrics" | awk '$1 == "ratelimit_overrides" {print $2}')" = "$2" ] && return 0
    sleep 0.1
  done
  echo "override-storm: $2 overrides not in force on :$1" >&2
  return 1
}

# Starts a replica ($1: memory or redis) serving gRPC on $2, HTTP on $3, the admin listener on
# $4; its pid in STARTED.
replica() {
  local backend=$1 grpc=$2 http=$3 admin=$4 store=()
  if [ "$backend" = memory ]; then
    cp "$WORK/overrides.json" "$WORK/run.json"
    store=(--backend memory --overrides-file "$WORK/run.json")
  else
    store=(--backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-key-prefix storm:)
  fi
  "$RATELIMITD" --config benches/limits.yaml --grpc-addr "127.0.0.1:$grpc" \
    --http-addr "127.0.0.1:$http" --admin-addr "127.0.0.1:$admin" --admin-token-file "$WORK/tokens" \
    --log-level warn "${store[@]}" &
  STARTED=$!
  pids+=("$STARTED")
  wait_port "$http"
}

redis_sent() { redis-cli -p "$REDIS_PORT" INFO stats | awk -F: '/^total_net_output_bytes/ {print $2+0}'; }

# One run: backend $1, storm $2 (on or off). Prints "p50 p99 puts egress-bytes/s".
run() {
  local backend=$1 storm=$2 grpc http admin a b="" out sent0 sent1 puts="-" storm_pid=""
  grpc=$(free_port); http=$(free_port); admin=$(free_port)
  replica "$backend" "$grpc" "$http" "$admin"; a=$STARTED
  if [ "$backend" = redis ]; then
    local http_b; http_b=$(free_port)
    replica redis "$(free_port)" "$http_b" "$(free_port)"; b=$STARTED
    wait_overrides "$http_b" "$N"
  fi
  wait_overrides "$http" "$N"
  [ "$backend" = redis ] && sent0=$(redis_sent)
  if [ "$storm" = on ]; then
    python3 "$WORK/put.py" storm "127.0.0.1:$admin" "$N" "$PUTS" "$((DURATION + 2))" "$WORK/tokens" > "$WORK/storm.out" &
    storm_pid=$!
  fi
  out=$("$LOADGEN" --target "http://127.0.0.1:$grpc" --rate "$RATE" --duration "$DURATION" --warmup 1)
  [ "$backend" = redis ] && sent1=$(redis_sent)
  if [ -n "$storm_pid" ]; then wait "$storm_pid"; puts=$(awk '{print $2 "/" $2 + $4}' "$WORK/storm.out"); fi
  kill "$a" ${b:+"$b"} 2>/dev/null || true
  wait "$a" ${b:+"$b"} 2>/dev/null || true
  local egress="-"
  [ "$backend" = redis ] && egress=$(( (sent1 - sent0) / (DURATION + 1) ))
  echo "$out" | awk -v puts="$puts" -v egress="$egress" \
    '/^latency ms/ {print $4, $8, puts, egress}'
}

for backend in $BACKENDS; do
  if [ "$backend" = redis ]; then
    start_redis
    # The N overrides set once through the admin API; every run's replicas read them at start.
    grpc=$(free_port); http=$(free_port); admin=$(free_port)
    replica redis "$grpc" "$http" "$admin"; loader=$STARTED
    python3 "$WORK/put.py" preload "127.0.0.1:$admin" "$N" "$WORK/tokens" >/dev/null
    wait_overrides "$http" "$N"
    kill "$loader"; wait "$loader" 2>/dev/null || true
  fi
  echo "== $backend: $N overrides in force, $RATE calls/s, storm of $PUTS PUTs/s"
  echo "round storm p50_ms p99_ms puts_ok/sent redis_bytes_per_s"
  ratios=()
  for round in $(seq "$ROUNDS"); do
    read -r p50_off p99_off _ e_off < <(run "$backend" off)
    echo "$round off $p50_off $p99_off - $e_off"
    read -r p50_on p99_on puts e_on < <(run "$backend" on)
    echo "$round on $p50_on $p99_on $puts $e_on"
    ratios+=("$(awk -v a="$p99_on" -v b="$p99_off" 'BEGIN {printf "%.2f", a / b}')")
  done
  echo "$backend: p99 with the storm / without, median of $ROUNDS rounds: $(echo "${ratios[@]}" | median) (each: ${ratios[*]})"
done
