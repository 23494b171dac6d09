#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs, then runs every test.
# README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "cargo is required (rustup: https://rustup.rs)" >&2
  exit 1
fi

# The official OpenAI Python client, driven against `kvfleet up` by tests/e2e_openai_client.rs.
if ! python3 -c "import openai" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore openai
fi

# Tests run with optimised dependencies (see [profile.*] in Cargo.toml): the model tests
# do real matrix work and would crawl at opt-level 0.
cargo test --workspace --locked 2>&1
