#!/usr/bin/env bash
# What a removed concurrency rule costs while its places may still be released: a config of
# DESCRIPTORS descriptors (40,000) with one one-day concurrency rule, renamed at each of RELOADS
# (5) reloads, on the memory backend. Prints the resident memory (VmRSS) after the first load
# and after each reload, for each binary given (e.g. today's main and this tree's release
# build), one after the other. Loopback only; every wait bounded.
# Usage: scripts/retired-memory.sh BINARY [BINARY...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
[ $# -ge 1 ] || { echo "usage: scripts/retired-memory.sh BINARY [BINARY...]" >&2; exit 2; }
DESCRIPTORS=${DESCRIPTORS:-40000}
RELOADS=${RELOADS:-5}
WORK=$(mktemp -d)
pids=()
trap cleanup_all EXIT

config() { # RULE-NAME
  {
    printf 'domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: %s\n' "$1"
    printf '        hold_key: request_id\n'
    printf '        rate_limit: {algorithm: concurrency, unit: day, requests_per_unit: 5}\n'
    for i in $(seq "$DESCRIPTORS"); do
      printf '  - key: customer\n    value: c%d\n    rate_limit: {unit: second, requests_per_unit: 10}\n' "$i"
    done
  } >"$WORK/next.yaml"
  mv "$WORK/next.yaml" "$WORK/config/d.yaml"
}

loads() { # HTTP
  curl -sf "$1/metrics" | awk '/^ratelimit_config_loads_total\{result="success"\}/ {print $2}'
}

for bin in "$@"; do
  rm -rf "$WORK/config" && mkdir -p "$WORK/config"
  config llm
  http=127.0.0.1:$(free_port)
  "$bin" --config "$WORK/config" --grpc-addr "127.0.0.1:$(free_port)" --http-addr "$http" --log-level warn &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 600); do curl -sf "$http/healthcheck" >/dev/null && break; kill -0 "$pid"; sleep 0.1; done
  line="$(basename "$bin"): first load $(($(rss_kib "$pid") / 1024)) MiB"
  for r in $(seq "$RELOADS"); do
    before=$(loads "$http")
    config "llm$r"
    for _ in $(seq 1200); do
      now=$(loads "$http")
      [ "${now%.*}" -gt "${before%.*}" ] && break
      sleep 0.1
    done
    sleep 1 # the earlier snapshot dropped by the requests that held it
    line+=", reload $r: $(($(rss_kib "$pid") / 1024)) MiB"
  done
  echo "$line"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
