#!/usr/bin/env bash
# The request path's cost with N operator overrides in force against none: server instructions
# per request (callgrind, scripts/instructions.sh: the same figure run after run) under the
# bench request, on the memory backend, the overrides read from --overrides-file. They are of
# the bench domain, on the bench request's `client` key, none of them its own value (as most
# requests of a service with overrides find none); HIT=1 adds one for its own value (the same
# limit as the config's, so the same decisions), to count the path of a request that finds one.
#
#   scripts/overrides.sh [N]     (default 10000; BIN=path: that ratelimitd binary, else this
#                                checkout's release build)
#
# Needs valgrind, h2load (nghttp2-client) and python3. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 - "$N" "${HIT:-0}" > "$WORK/overrides.json" <<'PY'
import json, sys
n, hit = int(sys.argv[1]), sys.argv[2] == "1"
values = [f"c-{i}" for i in range(n)] + (["c1"] if hit else [])
print(json.dumps({"overrides": [{
    "id": f"{i:016x}", "domain": "bench",
    "entries": [{"key": "client", "value": v}],
    "limits": [{"requests_per_unit": 1000000, "unit": "second", "algorithm": "sliding_window"}],
    "expires_at_ms": None, "reason": "bench", "created_by": "bench", "created_at_ms": i,
} for i, v in enumerate(values)]}))
PY
echo "== no override"
scripts/instructions.sh "${BIN:-memory}"
echo "== $N overrides$([ "${HIT:-0}" = 1 ] && echo ', one of them the request'"'"'s')"
RATELIMITD_OVERRIDES_FILE="$WORK/overrides.json" scripts/instructions.sh "${BIN:-memory}"
