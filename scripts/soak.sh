#!/usr/bin/env bash
# Soak: `kvfleet up` under an open-loop load at RATE_FACTOR (default 2) x its measured
# sustainable rate for SOAK_SECONDS (default 600), sampling its RSS every second.
# Writes docs/soak.json and docs/plots/soak-rss.svg; fails if a request is lost or
# the server died. Usage: SOAK_SECONDS=90 bash scripts/soak.sh
# KVFLEET_BIN overrides the binary (default: a release build, built here).
# SOAK_UP_ARGS: admission bounds of the server under test (default: 64 running, 64
# queued, 10 s queue wait; beyond them it answers 429 with Retry-After). The client's
# own in-flight cap (MAX_INFLIGHT, 1024) sits far above them, so overload reaches the
# server and is refused there, not shed by the client.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${SOAK_SECONDS:=600}"
if [[ -z "${KVFLEET_BIN:-}" ]]; then
  cargo build --release --locked --bin kvfleet
  KVFLEET_BIN=target/release/kvfleet
fi
log=$(mktemp)
# shellcheck disable=SC2086 # word-splitting the flag list is intended
"$KVFLEET_BIN" up --http 127.0.0.1:0 --workers 2 --model tiny \
  ${SOAK_UP_ARGS:---max-inflight 64 --max-queued 64 --queue-timeout-s 10} >"$log" 2>/dev/null &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
url=""
for _ in $(seq 1 600); do
  url=$(grep -o 'http://[0-9.:]*' "$log" | head -1 || true)
  [[ -n "$url" ]] && curl -sf "$url/health" >/dev/null && break
  sleep 0.1
done
[[ -n "$url" ]] || { echo "kvfleet up did not start" >&2; exit 1; }
echo "kvfleet up (pid $pid) at $url; soak ${SOAK_SECONDS}s"
SOAK_URL="$url" SOAK_PID="$pid" SOAK_SECONDS="$SOAK_SECONDS" python3 scripts/soak.py
kill -0 "$pid" && echo "server alive at the end"
# A clean drain on SIGTERM is part of the soak.
kill -TERM "$pid"
wait "$pid" && echo "server drained and exited 0"
