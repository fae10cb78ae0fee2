#!/usr/bin/env bash
# What one call of the Redis script costs Redis, in instructions (callgrind counts them: the same
# figure run after run, whatever else the machine does), for calls carrying K requests of the
# bench domain (sliding window + fixed window, the same keys: a hot key's coalesced requests),
# beside the naive one-EVALSHA-per-request script of benches/baseline.rs. For an A/B of a script
# change: SCRIPT=/tmp/other.lua scripts/script-cost.sh (same argument layout).
#
#   scripts/script-cost.sh [K ...]      (default: 1 8 60)
#
# Needs valgrind, redis-server, redis-benchmark. Loopback only; a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
SCRIPT=${SCRIPT:-src/limiter/redis/script.lua}
[ $# -gt 0 ] || set -- 1 8 60
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" "$_ports_given"' EXIT

# cost NAME CALLS ARGS...: prints instructions per call of ARGS (EVALSHA <sha> ...) in a fresh
# redis-server, measured over CALLS pipelined calls after 200 unmeasured ones.
cost() {
  local name=$1 calls=$2 port pid total
  shift 2
  port=$(free_port)
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/cg.$name" \
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  local sha
  sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat "$SCRIPT_FILE")")
  redis-cli -p "$port" EVALSHA "$sha" "$@" >/dev/null
  redis-benchmark -p "$port" -c 1 -P 16 -n 200 EVALSHA "$sha" "$@" >/dev/null
  callgrind_control -i on "$pid" >/dev/null 2>&1
  redis-benchmark -p "$port" -c 1 -P 16 -n "$calls" EVALSHA "$sha" "$@" >/dev/null
  callgrind_control -i off "$pid" >/dev/null 2>&1
  callgrind_control -d "$pid" >/dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
  total=$(awk '/^totals:/ {print $2}' "$WORK/cg.$name.1")
  echo $((total / calls))
}

# The naive server's own script, as benches/baseline.rs sends it.
sed -n '/^const NAIVE_SCRIPT/,/^";/p' benches/baseline.rs | sed '1d;$d' >"$WORK/naive.lua"
grep -q INCRBY "$WORK/naive.lua" || { echo "script-cost: NAIVE_SCRIPT not found in benches/baseline.rs" >&2; exit 1; }
SCRIPT_FILE="$WORK/naive.lua"
naive=$(cost naive 2000 2 "naive:{bench}:client:c1" "naive:{bench}:route:/api/1" 1 1)
printf '%-44s %12s %12s\n' "script" "instr/call" "instr/request"
printf '%-44s %12s %12s\n' "naive (INCRBY + EXPIRE per key)" "$naive" "$naive"
SCRIPT_FILE=$SCRIPT
for k in "$@"; do
  per=$(cost "k$k" $((8000 / (k + 3))) 2 "ratelimit:{bench}:client:c1:s1000000:0" "ratelimit:{bench}:route:/api/1:f1000000:0" \
    decide 1 2 1 s 1000000 1000000 1000000 2 f 100000000 1000000 100000000 "$k" 2 1 1 E 2 1 E)
  printf '%-44s %12s %12s\n' "$SCRIPT, $k identical requests" "$per" $((per / k))
done
