#!/usr/bin/env bash
# Whether one tenant's holds cost other tenants their counters on the memory backend: TENANTS
# (16) tenants each keep HOLDS (10,000) open reservations (36-byte request ids, Envoy's
# x-request-id) at the default --memory-max-bytes (64 MiB), beside VICTIMS (32) tenants whose
# monthly budget is spent; then every victim asks again. Prints, per binary given, the state
# held, the counters given up, the holds dropped and how many victims were admitted again
# (each one a spent budget forgotten). Through POST /json, python3's standard library only.
# Loopback only; bounded. Usage: scripts/holds-crowd.sh BINARY [BINARY...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
[ $# -ge 1 ] || { echo "usage: scripts/holds-crowd.sh BINARY [BINARY...]" >&2; exit 2; }
TENANTS=${TENANTS:-16}
HOLDS=${HOLDS:-10000}
VICTIMS=${VICTIMS:-32}
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT
mkdir -p "$WORK/config"
cat >"$WORK/config/crowd.yaml" <<'EOF'
domain: crowd
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limit: {unit: month, requests_per_unit: 100000000}
  - key: victim
    rate_limit: {unit: month, requests_per_unit: 1}
EOF

for bin in "$@"; do
  http=127.0.0.1:$(free_port)
  "$bin" --config "$WORK/config" --grpc-addr "127.0.0.1:$(free_port)" --http-addr "$http" --log-level warn &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 600); do curl -sf "$http/healthcheck" >/dev/null && break; kill -0 "$pid"; sleep 0.1; done
  result=$(python3 - "$http" "$TENANTS" "$HOLDS" "$VICTIMS" <<'EOF'
import http.client, json, sys, threading, uuid
addr, tenants, holds, victims = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
host, port = addr.split(":")

def ask(conn, entries):
    body = json.dumps({"domain": "crowd", "descriptors": [{"entries": entries}]})
    conn.request("POST", "/json", body)
    answer = conn.getresponse()
    answer.read()
    return answer.status

conn = http.client.HTTPConnection(host, int(port))
for v in range(victims):
    ask(conn, [{"key": "victim", "value": f"victim-{v}"}])
def tenant(t):
    c = http.client.HTTPConnection(host, int(port))
    for _ in range(holds):
        ask(c, [{"key": "tenant", "value": f"tenant-{t}"}, {"key": "request_id", "value": str(uuid.uuid4())}])
threads = [threading.Thread(target=tenant, args=(t,)) for t in range(tenants)]
for t in threads: t.start()
for t in threads: t.join()
conn = http.client.HTTPConnection(host, int(port))  # the first sat idle past the idle timeout
again = sum(ask(conn, [{"key": "victim", "value": f"victim-{v}"}]) == 200 for v in range(victims))
conn.request("GET", "/metrics")
metrics = conn.getresponse().read().decode()
def metric(name):
    return next((l.split()[-1] for l in metrics.splitlines() if l.startswith(name + " ")), "0")
print(f"{metric('ratelimit_memory_bytes')} bytes held, {metric('ratelimit_memory_evictions_total')} counters given up, "
      f"{metric('ratelimit_memory_holds_dropped_total')} holds dropped, {again} of {victims} spent victims admitted again")
EOF
)
  echo "$(basename "$bin"): $TENANTS tenants x $HOLDS holds: $result"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
