#!/usr/bin/env bash
# What answers cost (docs/performance.md, "Answers"): (1) the request path with no answer
# configured, this build (B) against OLD (A), interleaved (scripts/ab.sh, memory and Redis);
# (2) a rendered 429: this build on a request the bench domain always refuses, without (A)
# and with (B) --default-answer benches/answer.yaml (five headers and a JSON body), memory.
# Usage: scripts/answer-cost.sh OLD_BINARY [NEW_BINARY]. Tunables as scripts/ab.sh's.
# Loopback only; every run bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/answer-cost.sh OLD_BINARY [NEW_BINARY]" >&2; exit 2; }
OLD=$1
NEW=${2:-target/release/ratelimitd}
[ -n "${2:-}" ] || cargo build --release
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# RateLimitRequest{domain: "bench", descriptors: [{entries: [{key: "refused", value: "x"}]}]},
# framed as gRPC sends it.
python3 - "$WORK/refused.bin" <<'PY'
import struct, sys

def field(number, payload):
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload

request = field(1, b"bench") + field(2, field(1, field(1, b"refused") + field(2, b"x")))
open(sys.argv[1], "wb").write(b"\0" + struct.pack(">I", len(request)) + request)
PY
echo "== no answer configured: A $OLD, B $NEW"
scripts/ab.sh "$OLD" "$NEW"
echo "== a rendered 429: A without, B with --default-answer benches/answer.yaml ($NEW)"
REQUEST=$WORK/refused.bin FLAGS_B="--default-answer benches/answer.yaml" \
  BACKENDS=${ANSWER_BACKENDS:-memory} scripts/ab.sh "$NEW" "$NEW"
