#!/usr/bin/env bash
# Installs what `make test` needs on a fresh Debian machine with Rust: rustfmt and clippy.
# Idempotent and quiet when everything is present.
set -euo pipefail
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy
  else
    echo "deps: cargo fmt / cargo clippy missing and no rustup to install them" >&2
    exit 1
  fi
fi
