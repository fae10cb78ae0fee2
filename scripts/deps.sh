#!/usr/bin/env bash
# Installs what `make test` needs on a fresh Debian machine with Rust: rustfmt and clippy, and
# redis-server / redis-cli / openssl for the tests, which start their own Redis processes on
# free loopback ports (nothing needs to be running). Idempotent and quiet when all is present.
set -euo pipefail

if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy
  else
    echo "deps: cargo fmt / cargo clippy missing and no rustup to install them" >&2
    exit 1
  fi
fi

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  # The package may start a system Redis on 6379; the tests never use it.
fi
