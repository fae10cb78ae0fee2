#!/usr/bin/env bash
# A CPU profile of this checkout's release build under h2load's load (the bench domain's
# 2-descriptor request), taken from its own debug port (/debug/pprof/profile, pprof's format)
# and summarised by scripts/pprof_top.py: where the samples stopped, and what was on their
# stacks. `go tool pprof PROFILE` reads the same file where Go is installed.
# Usage: scripts/profile.sh [memory|redis]. Tunables: CLIENTS (4) and STREAMS (2), i.e. 8 in
# flight; PROFILE_SECONDS (10, at most 20); TOP (30); OUT (where the profile is kept,
# target/profile-<backend>.pb). Loopback only; every run bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
backend=${1:-memory}
case $backend in memory | redis) ;; *) echo "usage: scripts/profile.sh [memory|redis]" >&2; exit 2 ;; esac
CLIENTS=${CLIENTS:-4}
STREAMS=${STREAMS:-2}
PROFILE_SECONDS=${PROFILE_SECONDS:-10}
TOP=${TOP:-30}
OUT=${OUT:-target/profile-$backend.pb}
command -v h2load >/dev/null || { echo "profile: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }

cargo build --release -q
BASELINE=$(bench_bin baseline)
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
"$BASELINE" --write-request "$WORK/request.bin"
REDIS_PORT=$(free_port)
if [ "$backend" = redis ]; then
  start_redis
fi
grpc=$(free_port)
debug=$(free_port)
bench_server_cmd "$backend" "$grpc" "redis://127.0.0.1:$REDIS_PORT"
"${SERVER_CMD[@]}" --debug-addr "127.0.0.1:$debug" &
pids+=($!)
wait_port "$grpc"
wait_port "$debug"
url="http://127.0.0.1:$grpc/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
h=(-d "$WORK/request.bin" -H 'content-type: application/grpc' -H 'te: trailers')
h2load -c1 -n 2000 "${h[@]}" "$url" >/dev/null # warm
h2load -c"$CLIENTS" -m"$STREAMS" -t1 -D $((PROFILE_SECONDS + 4)) "${h[@]}" "$url" >"$WORK/h2load" &
load=$!
sleep 2
curl -sf -o "$OUT" "http://127.0.0.1:$debug/debug/pprof/profile?seconds=$PROFILE_SECONDS"
wait "$load"
echo "$backend, h2load -c$CLIENTS -m$STREAMS: $(awk '/^finished in/ {print $4, $5}' "$WORK/h2load" | tr -d ,); profile of ${PROFILE_SECONDS}s in $OUT"
python3 scripts/pprof_top.py "$OUT" --top "$TOP"
