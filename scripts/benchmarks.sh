#!/usr/bin/env bash
# Regenerates docs/benchmarks.md and docs/plots/*.svg:
#   1. builds kvfleet (release);
#   2. replays a small generated fork fan-out trace against a live
#      `kvfleet up --workers 4` (tiny model) and keeps the report;
#   3. runs `kvfleet bench matrix`: the simulator over traces x fleets x loads x policies,
#      the 100k-request x 1,000-worker scale run, and the replay-vs-simulator comparison;
#   4. runs `kvfleet bench router-scale` (docs/router-scale.md): the router's routing
#      decisions per second and their latency under a concurrent KV event stream;
#   5. runs `kvfleet bench sweep` (docs/policy-sweep.md): cache-aware against every other
#      policy over a family of generated traces at 8-256 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
MOONCAKE=${MOONCAKE:-traces/mooncake_synthetic_trace.jsonl}
OUT=${OUT:-target/benchmarks}
mkdir -p "$OUT" docs/plots
# PROFILE=dev reuses a debug build (the simulator crates are optimized there too).
PROFILE=${PROFILE:-release}
cargo build --profile "$PROFILE" --bin kvfleet
if [ "$PROFILE" = dev ]; then BIN=target/debug/kvfleet; else BIN=target/$PROFILE/kvfleet; fi

# 2. Replay vs. simulator.
"$BIN" bench gen --out "$OUT/replay-trace.jsonl" --sessions 6 --system-tokens 2048 \
  --tools-tokens 2048 --history-tokens 2048 --turn-tokens 512 --parent-turns 2 \
  --child-turns 2 --fork-k 4 --output-tokens 8 --session-rate 1 --turn-gap-ms 200
"$BIN" up --workers 4 --model tiny --http 127.0.0.1:0 > "$OUT/up.log" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  URL=$(grep -o 'http://[0-9.:]*' "$OUT/up.log" | head -1 || true)
  [ -n "$URL" ] && break
  sleep 0.1
done
[ -n "$URL" ] || { echo "kvfleet up did not start"; cat "$OUT/up.log"; exit 1; }
REPLAY_SETUP="\`kvfleet bench gen --sessions 6 --system-tokens 2048 --tools-tokens 2048 --history-tokens 2048 --turn-tokens 512 --parent-turns 2 --child-turns 2 --fork-k 4 --output-tokens 8 --session-rate 1 --turn-gap-ms 200\`, replayed with \`kvfleet bench replay --tokens-per-id 16\` against \`kvfleet up --workers 4\` (tiny model, 2,048 blocks of 16 tokens per worker, policy cache-aware); the simulator runs the same trace at 16 tokens per id, 4 workers × 2,048 blocks."
"$BIN" bench replay --trace "$OUT/replay-trace.jsonl" --target "$URL" --tokens-per-id 16 \
  --no-progress --json --out "$OUT/replay" > "$OUT/replay.json"
kill $UP 2>/dev/null || true
cp "$OUT/replay/ttft_cdf.svg" docs/plots/replay_ttft_cdf.svg
cp "$OUT/replay/hit_ratio.svg" docs/plots/replay_hit_ratio.svg
cp "$OUT/replay/worker_load.svg" docs/plots/replay_worker_load.svg

# 3. The matrix.
"$BIN" bench matrix --mooncake "$MOONCAKE" --doc docs/benchmarks.md --plots docs/plots \
  --replay-json "$OUT/replay.json" --replay-trace "$OUT/replay-trace.jsonl" \
  --replay-setup "$REPLAY_SETUP" --notes docs/benchmarks.notes.md "$@"

# 4. Router scale (about 5 minutes on 2 cores): 64-1,024 workers, 20k-30k requests/s, 0-2M event
#    blocks/s.
"$BIN" bench router-scale --doc docs/router-scale.md --json docs/bench/router-scale.json

# 5. The policy sweep: every policy over the generated trace family and Mooncake at
#    8-256 workers (docs/policy-sweep.md), and two held-out families (seeds 2 and 3) at
#    8 and 64, and the whole sweep on the CPU cost model, without pulls and in the
#    engine-faithful mode. About 7 minutes on 2 cores; SWEEP=0 skips it.
[ "${SWEEP:-1}" = 0 ] && exit 0
"$BIN" bench sweep --mooncake "$MOONCAKE" --doc docs/policy-sweep.md --json docs/bench/policy-sweep.json
"$BIN" bench sweep --mooncake "$MOONCAKE" --seed 2 --workers 8,64 --doc docs/policy-sweep-seed2.md \
  --json docs/bench/policy-sweep-seed2.json
"$BIN" bench sweep --mooncake "$MOONCAKE" --seed 3 --workers 8,64 --doc docs/policy-sweep-seed3.md \
  --json docs/bench/policy-sweep-seed3.json
# The same on the other cost model in the tree (a CPU engine: prefill 6x slower, decode
# dearer per sequence; docs/policy-sweep-cpu-small.md): defaults chosen on the H200
# estimate, checked on a model they were not tuned on.
"$BIN" bench sweep --mooncake "$MOONCAKE" --cost-model crates/kvfleet-bench/cost-models/cpu-small.json \
  --doc docs/policy-sweep-cpu-small.md --json docs/bench/policy-sweep-cpu-small.json
# The same with peer pulls off (`--peer-pull-min-blocks 0`, the router's default until
# 2026-12-04; docs/policy-sweep-no-pulls.md), to show what pulls are worth.
"$BIN" bench sweep --mooncake "$MOONCAKE" --peer-pull-min-blocks 0 \
  --doc docs/policy-sweep-no-pulls.md --json docs/bench/policy-sweep-no-pulls.json
# The same in the simulator's engine-faithful mode, the one checked against live fleets
# of `--engine sim` workers (docs/policy-sweep-engine.md): running sequences hold their
# blocks, hits are taken at admission, the engine's memory rule admits and preempts,
# and prefills share the decodes' steps.
"$BIN" bench sweep --mooncake "$MOONCAKE" --hold-blocks --hits-at-admission \
  --decode-reserve-ratio 0.3 --mixed-steps \
  --doc docs/policy-sweep-engine.md --json docs/bench/policy-sweep-engine.json
