#!/usr/bin/env bash
# What one call of the Redis script costs Redis, in instructions (callgrind counts them: the same
# figure run after run, whatever else the machine does), for calls carrying K requests of the
# bench domain (sliding window + fixed window, the same keys: a hot key's coalesced requests),
# beside the naive one-EVALSHA-per-request script of benches/baseline.rs. The script is called
# as the service calls it, a function (FUNCTION LOAD once, then FCALL), and by EVALSHA (Redis 6,
# or an ACL without functions). For an A/B of a script change: SCRIPT=/tmp/other.lua
# scripts/script-cost.sh (same argument layout).
#
#   scripts/script-cost.sh [K ...]      (default: 1 8 60)
#
# KEEP=/some/dir keeps the callgrind files there (callgrind_annotate them to see where the
# instructions go).
#
# Needs valgrind, redis-server, redis-cli, perl. Loopback only; a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
SCRIPT=${SCRIPT:-src/limiter/redis/script.lua}
[ $# -gt 0 ] || set -- 1 8 60
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

# cost NAME CALLS LOAD GEN...: prints instructions per call in a fresh redis-server where LOAD
# (a function: `fcall` or `evalsha`) loads $SCRIPT_FILE and prints the name to call it by; GEN
# K N HOW NAME writes N calls in RESP. Measured over CALLS pipelined calls after 200 unmeasured.
cost() {
  local name=$1 calls=$2 load=$3 port pid total callee
  shift 3
  port=$(free_port)
  REDIS_WRAP="valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=$WORK/cg.$name" \
    redis_server "$port" &
  pid=$!
  for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  callee=$("$load" "$port")
  "$@" 1 "$callee" >"$WORK/one"
  redis-cli -p "$port" --pipe <"$WORK/one" | grep -q 'errors: 0' || { echo "script-cost: $name fails" >&2; kill "$pid"; exit 1; }
  "$@" 200 "$callee" | redis-cli -p "$port" --pipe >/dev/null
  "$@" "$calls" "$callee" >"$WORK/calls"
  callgrind_control -i on "$pid" >/dev/null 2>&1
  redis-cli -p "$port" --pipe <"$WORK/calls" >/dev/null
  callgrind_control -i off "$pid" >/dev/null 2>&1
  callgrind_control -d "$pid" >/dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
  total=$(awk '/^totals:/ {print $2}' "$WORK/cg.$name.1")
  echo $((total / calls))
}
# As the service loads it (src/limiter/redis/wire.rs, load_library).
fcall() {
  redis-cli -p "$1" FUNCTION LOAD "$(printf '#!lua name=ratelimitd_cost\nlocal FUNCTION = %s\n' "'ratelimitd_cost'"; cat "$SCRIPT_FILE")" >/dev/null
  echo ratelimitd_cost
}
evalsha() { redis-cli -p "$1" SCRIPT LOAD "$(cat "$SCRIPT_FILE")"; }
ours() { script_calls "$K" "$1" "$HOW" "$2"; } # N NAME
naive_calls() { # N SHA: the naive server's call for the bench request
  perl -e 'my ($n, $sha) = @ARGV; my @a = ("EVALSHA", $sha, 2, "naive:{bench}:client:c1", "naive:{bench}:route:/api/1", 1, 1);
    print(("*" . scalar(@a) . "\r\n" . join("", map { "\$" . length($_) . "\r\n$_\r\n" } @a)) x $n)' "$@"
}

# The naive server's own script, as benches/baseline.rs sends it.
sed -n '/^const NAIVE_SCRIPT/,/^";/p' benches/baseline.rs | sed '1d;$d' >"$WORK/naive.lua"
grep -q INCRBY "$WORK/naive.lua" || { echo "script-cost: NAIVE_SCRIPT not found in benches/baseline.rs" >&2; exit 1; }
SCRIPT_FILE="$WORK/naive.lua"
naive=$(cost naive 2000 evalsha naive_calls)
printf '%-44s %12s %12s\n' "script" "instr/call" "instr/request"
printf '%-44s %12s %12s\n' "naive (INCRBY + EXPIRE per key)" "$naive" "$naive"
SCRIPT_FILE=$SCRIPT
for HOW in FCALL EVALSHA; do
  load=fcall
  [ "$HOW" = EVALSHA ] && load=evalsha
  for K in "$@"; do
    per=$(cost "$HOW$K" $((8000 / (K + 3))) "$load" ours)
    printf '%-44s %12s %12s\n' "$HOW, $K identical requests" "$per" $((per / K))
  done
done
