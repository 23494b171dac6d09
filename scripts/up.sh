#!/usr/bin/env bash
# README's run command: installs what `kvfleet up` needs on a fresh machine (protoc for
# etcd-client's build, the default model), then builds and starts the embedded cluster
# on 127.0.0.1. Extra arguments go to `kvfleet up` (e.g. `--workers 3`, `--model tiny`).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "cargo is required (rustup: https://rustup.rs)" >&2; exit 1; }

# etcd-client's build script runs protoc.
if [ -z "${PROTOC:-}" ] && ! command -v protoc >/dev/null; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing protoc (Debian's protobuf-compiler)..."
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq protobuf-compiler >/dev/null
fi

bash scripts/fetch-model.sh

exec cargo run --release --locked -- up "$@"
