#!/usr/bin/env bash
# What a value's length and bytes cost to decide: server CPU per request (µs, utime + stime
# from /proc) for one descriptor whose value is 20 bytes, 20 bytes that are not UTF-8, 60 KiB
# (counted under its SHA-256) and 60 KiB that are not UTF-8, under the same h2load load, the
# cases interleaved round by round so that all see the same machine. Ratios are against the
# 20-byte value of the same round. Usage: scripts/values.sh [BINARY] (default: the release
# build). Loopback only; every run bounded. Tunables: ROUNDS (3), DURATION (5 s), CLIENTS (4),
# STREAMS (8), BACKENDS ("memory redis"), ALLOW_ERRORS (set: a failed call is counted and
# shown, not fatal, to measure a build that refuses some of the cases).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
BIN=$(realpath "${1:-target/release/ratelimitd}")
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
CLIENTS=${CLIENTS:-4}
STREAMS=${STREAMS:-8}
BACKENDS=${BACKENDS:-memory redis}
HZ=$(getconf CLK_TCK)
command -v h2load >/dev/null || { echo "values: h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
[ -x "$BIN" ] || { echo "values: no $BIN (make build)" >&2; exit 1; }

WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
start_redis
cat >"$WORK/limits.yaml" <<'EOF'
domain: values
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000000000}
EOF

# A protobuf varint of $1, as printf escapes.
varint() {
  local n=$1 out=""
  while [ "$n" -ge 128 ]; do
    out+=$(printf '\\x%02x' $(((n & 127) | 128)))
    n=$((n >> 7))
  done
  out+=$(printf '\\x%02x' "$n")
  printf '%s' "$out"
}

# A field $1 (its tag byte, as an escape) holding the bytes of file $2.
field() {
  printf "$1$(varint "$(stat -c %s "$2")")"
  cat "$2"
}

# The gRPC body of a request for domain `values` with one entry (user, the bytes of file $1),
# written to $2.
request() {
  local value=$1 out=$2
  { printf 'user' >"$WORK/key"; field '\x0a' "$WORK/key"; field '\x12' "$value"; } >"$WORK/entry"
  field '\x0a' "$WORK/entry" >"$WORK/descriptor"
  printf 'values' >"$WORK/domain"
  { field '\x0a' "$WORK/domain"; field '\x12' "$WORK/descriptor"; } >"$WORK/message"
  local len
  len=$(stat -c %s "$WORK/message")
  { printf '\x00'; printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x' $((len >> 24 & 255)) $((len >> 16 & 255)) $((len >> 8 & 255)) $((len & 255)))"; cat "$WORK/message"; } >"$out"
}

printf 'k-0123456789abcdefgh' >"$WORK/v20"
printf 'caf\xe9-\xff\xfe-0123456789ab' >"$WORK/v20x"
head -c 61440 /dev/zero | tr '\0' 'k' >"$WORK/v60k"
head -c 61440 /dev/zero | tr '\0' '\351' >"$WORK/v60kx"
CASES=(v20 v20x v60k v60kx)
declare -A NAME=([v20]="20 B" [v20x]="20 B, not UTF-8" [v60k]="60 KiB" [v60kx]="60 KiB, not UTF-8")
for c in "${CASES[@]}"; do request "$WORK/$c" "$WORK/$c.bin"; done

# One run of case $1 on backend $2: prints "requests/s server-µs-per-request".
run() {
  local case=$1 backend=$2 grpc http pid s0 s1 out n
  grpc=127.0.0.1:$(free_port)
  http=127.0.0.1:$(free_port)
  local flags=(--config "$WORK/limits.yaml" --grpc-addr "$grpc" --http-addr "$http" --log-level warn --backend "$backend")
  [ "$backend" = redis ] && flags+=(--redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s)
  "$BIN" "${flags[@]}" &
  pid=$!
  until curl -sf "$http/healthcheck" >/dev/null; do kill -0 "$pid" || exit 1; sleep 0.05; done
  local url="http://$grpc/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
  local h=(-d "$WORK/$case.bin" -H 'content-type: application/grpc' -H 'te: trailers')
  h2load -c1 -n 200 "${h[@]}" "$url" >/dev/null # warm
  s0=$(cpu_ticks "$pid")
  out=$(h2load -c"$CLIENTS" -m"$STREAMS" -t1 -D "$DURATION" "${h[@]}" "$url")
  s1=$(cpu_ticks "$pid")
  n=$(echo "$out" | awk '/^requests:/ {print $8}')
  # h2load counts a call that failed in its trailers as a success, and a message the server
  # cannot decode never reaches the service's error counter: every call not decided failed.
  local decided errors
  decided=$(curl -s "$http/metrics" | awk '/^ratelimit_decisions_total/ {s += $2} END {print s + 0}')
  # (A call decided after h2load stopped counting is not a failure: none below zero.)
  errors=$((200 + n - decided))
  [ "$errors" -gt 0 ] || errors=0
  kill "$pid"; wait "$pid" 2>/dev/null || true
  if [ "$errors" != 0 ] && [ -z "${ALLOW_ERRORS:-}" ]; then
    echo "values: $case on $backend: $errors calls failed" >&2
    exit 1
  fi
  awk -v n="$n" -v d="$DURATION" -v s=$((s1 - s0)) -v hz="$HZ" -v e="$errors" \
    'BEGIN { printf "%.0f %.1f %d\n", n / d, s / hz * 1e6 / n, e }'
}

echo "binary: $BIN"
echo "h2load -c$CLIENTS -m$STREAMS, ${DURATION}s per run, $ROUNDS rounds of every case"
for backend in $BACKENDS; do
  declare -A SUM=() RATIO=()
  for c in "${CASES[@]}"; do SUM[$c]=0; RATIO[$c]=0; done
  for round in $(seq "$ROUNDS"); do
    line="$backend round $round:"
    base=""
    for c in "${CASES[@]}"; do
      read -r rps us errors <<<"$(run "$c" "$backend")"
      [ -z "$base" ] && base=$us
      SUM[$c]=$(awk -v a="${SUM[$c]}" -v b="$us" 'BEGIN {print a + b}')
      RATIO[$c]=$(awk -v a="${RATIO[$c]}" -v b="$us" -v base="$base" 'BEGIN {print a + b / base}')
      line+=" ${NAME[$c]} ${us} µs ($rps/s${ALLOW_ERRORS:+, $errors failed});"
    done
    echo "$line"
  done
  for c in "${CASES[@]}"; do
    awk -v s="${SUM[$c]}" -v r="${RATIO[$c]}" -v n="$ROUNDS" -v name="${NAME[$c]}" -v b="$backend" \
      'BEGIN { printf "%s, %s: %.1f µs of server CPU per request, %.2f× the 20-byte value\n", b, name, s / n, r / n }'
  done
done
