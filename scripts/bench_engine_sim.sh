#!/usr/bin/env bash
# A real router in front of many simulated workers on one machine: starts N
# `kvfleet worker --engine sim` processes (real gRPC service, scheduler, block pool,
# prefix cache and KV events; a cost model instead of the model's compute) and one
# `kvfleet router`, replays a generated trace through HTTP with `kvfleet bench
# replay`, runs `kvfleet sim` (policy cache-aware) on the same trace with the same
# workers, blocks per worker and block size in each of its four configurations (hits
# taken when a request is queued, the default, or at admission, `--hits-at-admission`;
# running sequences' blocks evictable, the default, or held, `--hold-blocks`) and with
# the engine's memory rule (held at admission, outputs growing into the pool, the
# decode reserve and preemption: `--decode-reserve-ratio`), alone and with prefills
# sharing the decodes' steps (`--mixed-steps`), prints each one's figures over the live
# fleet's (and its session moves beside the live fleet's: turns served away from the
# turn before), the last configuration's cached share over a spread of client round
# trips (see below), then, request by request against the last configuration, which turns
# each side moved and what they found cached, and stops every process it started.
#
#   bash scripts/bench_engine_sim.sh            # 64 workers × 256 blocks of 16 tokens
#   WORKERS=16 BLOCKS=512 SESSIONS=32 bash scripts/bench_engine_sim.sh
#   SHAPE=conversation WORKERS=4 BLOCKS=56 SESSIONS=24 bash scripts/bench_engine_sim.sh
#
# Env: SHAPE (`fork`, the default: fork fan-outs of ~120-token prompts, the sweep's
# `short`; or `conversation`: 8-turn conversations growing to ~380 tokens, the sweep's
# `conversation` shape at 16 tokens per hash id, with 64-token answers; or `herd`:
# `fork` with every session sharing its system prompt and tools), WORKERS,
# BLOCKS (KV blocks per worker), SESSIONS (trace sessions), SESSION_RATE (sessions
# started per second; higher queues more), BIN (a built kvfleet; default
# target/debug/kvfleet, built if missing), OUT (results directory), COST_MODEL (cost
# model file for the workers and the simulator), WORKER_ARGS (more `kvfleet worker`
# flags, e.g. `--decode-reserve-ratio 0`), SIM_RESERVE (the reserve ratio of the
# simulator's engine rule: 0.3, the workers' default), RTT (the client's round trip
# the simulator adds before a turn's child arrives, ms; default: measured on the live
# run, see below), SPREAD (round trips of the spread, 13; 0 skips it),
# CACHE_AWARE_CONFIG (`cache-aware`'s weights, JSON inline or a file, for the router
# and every simulation alike).
set -euo pipefail
cd "$(dirname "$0")/.."

SHAPE=${SHAPE:-fork}
WORKERS=${WORKERS:-64}
BLOCKS=${BLOCKS:-256}
SESSIONS=${SESSIONS:-48}
SESSION_RATE=${SESSION_RATE:-4}
BLOCK_SIZE=16
COST_MODEL=${COST_MODEL:-crates/kvfleet-bench/cost-models/h200-llama8b.json}
BIN=${BIN:-target/debug/kvfleet}
OUT=${OUT:-$(mktemp -d /tmp/kvfleet-engine-sim.XXXXXX)}
mkdir -p "$OUT"
[ -x "$BIN" ] || cargo build --bin kvfleet

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# The address a process printed on its first line after SCHEME, waiting up to 60 s.
addr_of() {
  local log=$1 scheme=$2 a=""
  for _ in $(seq 1 600); do
    a=$(grep -o "${scheme}[0-9.:]*" "$log" 2>/dev/null | head -1 || true)
    [ -n "$a" ] && { echo "${a#"$scheme"}"; return 0; }
    sleep 0.1
  done
  echo "no ${scheme} address in $log:" >&2
  cat "$log" >&2
  return 1
}

case "$SHAPE" in
  fork)
    GEN=(--system-tokens 1024 --tools-tokens 1024 --history-tokens 1024 --turn-tokens 256
      --parent-turns 2 --child-turns 1 --fork-k 4 --output-tokens 4 --turn-gap-ms 200) ;;
  conversation)
    GEN=(--system-tokens 2048 --tools-tokens 1024 --history-tokens 1024 --turn-tokens 768
      --parent-turns 8 --fork-k 0 --output-tokens 64 --turn-gap-ms 500) ;;
  herd)
    GEN=(--system-tokens 1024 --tools-tokens 1024 --history-tokens 1024 --turn-tokens 256
      --parent-turns 2 --child-turns 1 --fork-k 4 --output-tokens 4 --turn-gap-ms 200
      --shared-prefix) ;;
  *) echo "SHAPE must be fork, conversation or herd, not $SHAPE" >&2; exit 2 ;;
esac
"$BIN" bench gen --out "$OUT/trace.jsonl" --sessions "$SESSIONS" "${GEN[@]}" \
  --session-rate "$SESSION_RATE" > "$OUT/gen.log"

for i in $(seq 0 $((WORKERS - 1))); do
  # shellcheck disable=SC2086 # WORKER_ARGS is split on purpose
  RUST_LOG=warn "$BIN" worker --grpc 127.0.0.1:0 --worker-id "sim$i" --model tiny \
    --engine sim --cost-model "$COST_MODEL" --num-blocks "$BLOCKS" \
    --block-size "$BLOCK_SIZE" ${WORKER_ARGS:-} > "$OUT/worker$i.log" 2>&1 &
  PIDS+=($!)
done
ADDRS=()
for i in $(seq 0 $((WORKERS - 1))); do
  ADDRS+=("$(addr_of "$OUT/worker$i.log" grpc://)")
done
WORKER_LIST=$(IFS=,; echo "${ADDRS[*]}")

CA=()
[ -n "${CACHE_AWARE_CONFIG:-}" ] && CA=(--cache-aware-config "$CACHE_AWARE_CONFIG")
RUST_LOG=warn "$BIN" router --http 127.0.0.1:0 --model tiny --block-size "$BLOCK_SIZE" \
  --policy cache-aware --workers "$WORKER_LIST" "${CA[@]}" > "$OUT/router.log" 2>&1 &
PIDS+=($!)
URL="http://$(addr_of "$OUT/router.log" http://)"
echo "router $URL in front of $WORKERS sim workers ($BLOCKS blocks of $BLOCK_SIZE tokens each)"

"$BIN" bench replay --trace "$OUT/trace.jsonl" --target "$URL" \
  --tokens-per-id "$BLOCK_SIZE" --no-progress --json --out "$OUT/replay" > "$OUT/replay.json"
curl -s --max-time 10 "$URL/fleet" > "$OUT/fleet.json" || true
# The client's round trip on this machine, for the simulator's --client-rtt-ms (the
# time from a turn's last token at its worker to its child's arrival there): the
# median, over requests alone on their worker from send to first token (nothing else
# queued, prefilling or decoding there), of their TTFT over the prefill the cost
# model prices; 1 ms if too few ran alone. RTT=… overrides it.
if [ -z "${RTT:-}" ]; then
  RTT=$(python3 - "$OUT/replay/replay.json" "$COST_MODEL" <<'PY'
import json, statistics, sys
from collections import defaultdict
r = json.load(open(sys.argv[1]))
c = json.load(open(sys.argv[2]))
spans = defaultdict(list)
for o in r["outcomes"]:
    if o["ok"]:
        s = o["sent_s"] * 1000
        spans[o["worker"]].append((s, s + o["ttft_ms"], s + o["latency_ms"], o))
excess = []
for v in spans.values():
    for s, f, _, o in v:
        if any(s2 < f and e2 > s for s2, _, e2, o2 in v if o2 is not o):
            continue
        uncached = o["prompt_tokens"] - o["cached_tokens"]
        prefill = c["prefill_overhead_ms"] + uncached * 1000 / c["prefill_tokens_per_s"]
        excess.append(o["ttft_ms"] - prefill)
print(f"{max(statistics.median(excess), 0):.2f}" if len(excess) >= 10 else "1")
PY
)
fi
echo "client round trip: $RTT ms (the simulator's --client-rtt-ms)"
# The simulator in each configuration (see the header); the last one also writes its
# request outcomes, to compare with the live fleet's request by request.
SIMS=(sim "" sim-admission --hits-at-admission sim-hold --hold-blocks
  sim-both "--hold-blocks --hits-at-admission"
  sim-engine "--hold-blocks --hits-at-admission --decode-reserve-ratio ${SIM_RESERVE:-0.3}"
  sim-steps "--hold-blocks --hits-at-admission --decode-reserve-ratio ${SIM_RESERVE:-0.3} --mixed-steps")
LAST=$((${#SIMS[@]} - 2))
for ((k = 0; k < ${#SIMS[@]}; k += 2)); do
  OUTCOMES=()
  [ "$k" = "$LAST" ] && OUTCOMES=(--requests-out "$OUT/${SIMS[k]}.requests.jsonl")
  # shellcheck disable=SC2086 # the flags are split on purpose
  "$BIN" sim --trace "$OUT/trace.jsonl" --workers "$WORKERS" --cache-blocks "$BLOCKS" \
    --tokens-per-id "$BLOCK_SIZE" --policy cache-aware --cost-model "$COST_MODEL" \
    --peer-pull-min-blocks 0 --client-rtt-ms "$RTT" ${SIMS[k+1]} "${OUTCOMES[@]}" "${CA[@]}" \
    --json > "$OUT/${SIMS[k]}.json"
done
# The simulator's figures hang on the order of near-simultaneous events: a turn that
# arrives just before rather than just after a new session's (the two within a
# millisecond) changes where both go, and the change cascades through the rest of the
# trace. So the last configuration also runs at SPREAD round trips from 0.7 to 1.3 ×
# RTT (the live fleet's own round trip varied that much from run to run), and the
# median and range of its cached share over live are printed with the rest.
SPREAD=${SPREAD:-13}
mkdir -p "$OUT/spread"
for ((i = 0; i < SPREAD; i++)); do
  r=$(python3 -c "import sys; n, i, t = map(float, sys.argv[1:]); print(f'{t * (0.7 + 0.6 * i / max(n - 1, 1)):.3f}')" "$SPREAD" "$i" "$RTT")
  # shellcheck disable=SC2086 # the flags are split on purpose
  "$BIN" sim --trace "$OUT/trace.jsonl" --workers "$WORKERS" --cache-blocks "$BLOCKS" \
    --tokens-per-id "$BLOCK_SIZE" --policy cache-aware --cost-model "$COST_MODEL" \
    --peer-pull-min-blocks 0 --client-rtt-ms "$r" ${SIMS[LAST+1]} "${CA[@]}" \
    --json > "$OUT/spread/${i}_$r.json"
done
python3 - "$OUT" "${SIMS[@]}" <<'PY'
import json, sys
out = sys.argv[1]
# (file stem, flags) of each simulator run, as SIMS lists them.
sims = list(zip(sys.argv[2::2], sys.argv[3::2]))
r = json.load(open(f"{out}/replay.json"))
s = json.load(open(f"{out}/sim.json"))
x = s["results"][0]
b = s["bounds"]
print(f"replay (live router + sim workers): {r['ok']} ok, {r['failed']} failed; "
      f"cached tokens {r['cached_tokens']} / {r['prompt_tokens']} = {r['cached_token_ratio']:.4f}; "
      f"TTFT p50 / p99 {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} ms; "
      f"ITL mean {r['itl_ms']['mean']:.2f} ms; "
      f"latency p50 / p99 {r['latency_ms']['p50']:.0f} / {r['latency_ms']['p99']:.0f} ms; "
      f"session moves {r['session_moves']}")
print(f"kvfleet sim (cache-aware):          hit ratio {x['hit_ratio']:.4f} "
      f"({x['hit_blocks']} / {x['total_blocks']} blocks); cached tokens {x['cached_tokens']} / "
      f"{x['prompt_tokens']} = {x['cached_token_ratio']:.4f}; pooled {b['pooled']:.4f}, "
      f"ceiling {b['ceiling']:.4f}; TTFT p50 / p99 {x['ttft_ms']['p50']:.0f} / "
      f"{x['ttft_ms']['p99']:.0f} ms; {x['rejected']} refused (prompt larger than a pool)")
try:
    fleet = json.load(open(f"{out}/fleet.json"))
    pre = [w["load"]["preemptions"] for w in fleet["workers"]]
    print(f"live preemptions per worker: {pre} ({sum(pre)} in all); replay took {r['duration_s']:.1f} s")
except (OSError, ValueError, KeyError):
    print("live preemptions: /fleet not read")
# Side by side: each simulator configuration's figures over the live fleet's.
for stem, flags in sims:
    name = f"sim {flags}".strip()
    x = json.load(open(f"{out}/{stem}.json"))["results"][0]
    print(f"{name} / replay: cached-token share "
          f"{x['cached_token_ratio'] / max(r['cached_token_ratio'], 1e-9):.3f}, "
          f"TTFT p50 {x['ttft_ms']['p50'] / max(r['ttft_ms']['p50'], 1e-9):.3f}, "
          f"TTFT p99 {x['ttft_ms']['p99'] / max(r['ttft_ms']['p99'], 1e-9):.3f}, "
          f"ITL mean {x['itl_ms']['mean'] / max(r['itl_ms']['mean'], 1e-9):.3f}; "
          f"session moves {x['session_moves']} (live {r['session_moves']}), "
          f"preemptions {x['preemptions']}")
# The last configuration over the spread of round trips.
import glob, statistics
# Each file is named INDEX_RTT.json (the index keeps equal round trips apart: RTT=0).
spread = sorted((float(f.rsplit("_", 1)[1][:-5]),
                 json.load(open(f))["results"][0]["cached_token_ratio"] / max(r["cached_token_ratio"], 1e-9))
                for f in glob.glob(f"{out}/spread/*_*.json"))
if spread:
    shares = [v for _, v in spread]
    print(f"sim {sims[-1][1]} / replay over {len(spread)} round trips from {spread[0][0]} to "
          f"{spread[-1][0]} ms: cached-token share median {statistics.median(shares):.3f} "
          f"(min {min(shares):.3f}, max {max(shares):.3f})")
# Request by request, the last configuration against live: which turns each moved
# away from its session's previous worker, and the cached share of those turns. After
# the first reordering (see the spread above) the two runs place most requests
# differently, so these cells compare counts and shares, not the same decisions.
try:
    recs = [json.loads(l) for l in open(f"{out}/trace.jsonl")]
    live = {o["index"]: o for o in json.load(open(f"{out}/replay/replay.json"))["outcomes"]}
    sim = {o["index"]: o for o in map(json.loads, open(f"{out}/{sims[-1][0]}.requests.jsonl"))}
except (OSError, ValueError, KeyError):
    sys.exit(0)
prev, cells = {}, {}
for i, rec in enumerate(recs):
    s = rec.get("session_id")
    if s is None or i not in live or i not in sim or not live[i]["ok"]:
        continue
    if s in prev:
        pl, ps = prev[s]
        key = ("moved" if live[i]["worker"] != pl else "stayed",
               "moved" if sim[i]["worker"] != ps else "stayed")
        c = cells.setdefault(key, [0, 0, 0, 0])
        c[0] += 1
        c[1] += live[i]["cached_tokens"]
        c[2] += sim[i]["cached_tokens"]
        c[3] += live[i]["prompt_tokens"]
    prev[s] = (live[i]["worker"], sim[i]["worker"])
print(f"turns by where they went, live / {sims[-1][0]} (turns; cached share live, simulated):")
for (l, m), (n, cl, cs, p) in sorted(cells.items()):
    print(f"  live {l}, simulator {m}: {n}; {cl / max(p, 1):.3f}, {cs / max(p, 1):.3f}")
PY
echo "results in $OUT"
