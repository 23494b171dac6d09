#!/usr/bin/env bash
# Retakes docs/dashboard.png: runs tests/e2e_dashboard.rs (kvfleet up --workers 3 under
# test traffic, in real headless Chromium) and keeps the screenshot it takes.
# Needs what scripts/test.sh installs: Debian's chromium and tests/browser's npm packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! [ -d tests/browser/node_modules/playwright-core ]; then
  (cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)
fi
KVFLEET_DASHBOARD_SCREENSHOT=docs/dashboard.png \
  cargo test --workspace --locked --test e2e_dashboard -- --nocapture
echo "wrote docs/dashboard.png"
