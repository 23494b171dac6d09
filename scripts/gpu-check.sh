#!/usr/bin/env bash
# Runs ON the GPU machine (CUDA 13 driver + toolkit + PyTorch, no Rust, no network), from
# the repository root, after scripts/gpu-build.sh filled gpu-bin/ here. Runs the GPU
# tests, the kernel benchmarks and PyTorch's SDPA on the same decode shape, then writes
# $OUT/gpu-report.md and $OUT/gpu-report.json (OUT defaults to ./gpu-out). Every step has
# a timeout; the whole run stays under 8 minutes. Exits non-zero if a test or a target
# fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
bin=gpu-bin
start=$(date +%s)
# cudarc dlopens libcuda.so.1, libnvrtc.so.13 and libcublas.so.13; add the toolkit's
# and PyTorch's library folders in case they are not in the loader's cache.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
pylib=$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in os.listdir(p) if os.path.isdir(os.path.join(p, s, "lib"))))' 2>/dev/null || true)
[ -n "$pylib" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$pylib"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/nvidia-smi.txt" 2>&1 || true

status=0
run() { # name timeout cmd...
  local name=$1 t=$2
  shift 2
  local s=$(date +%s)
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s" | tee -a "$OUT/steps.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}

run kernel-tests 50 "$bin/engine-kernel-tests" cuda:: --test-threads 1
run model-tests 140 "$bin/cuda-model-tests" --test-threads 1
run cuda-bench 140 "$bin/cuda_bench" --device cuda:0
grep '^{' "$OUT/cuda-bench.log" | tail -1 >"$OUT/cuda-bench.json"
run sdpa-bench 50 python3 scripts/gpu/sdpa_bench.py
grep '^{' "$OUT/sdpa-bench.log" | tail -1 >"$OUT/sdpa-bench.json"

# kvfleet up --device cuda:0 serving one completion.
{
  "$bin/kvfleet" up --http 127.0.0.1:0 --device cuda:0 --model small >"$OUT/up.stdout" 2>"$OUT/up.stderr" &
  pid=$!
  url=""
  for _ in $(seq 1 60); do
    url=$(grep -o 'http://[0-9.:]*' "$OUT/up.stdout" 2>/dev/null | head -1)
    [ -n "$url" ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  if [ -n "$url" ]; then
    timeout 15 curl -sf -X POST "$url/v1/completions" -H 'content-type: application/json' \
      -d '{"model":"small","prompt":"The GPU says","max_tokens":16}' >"$OUT/up-completion.json" &&
      grep -q '"choices"' "$OUT/up-completion.json"
    rc=$?
    echo "up rc=$rc" | tee -a "$OUT/steps.txt"
    [ $rc -eq 0 ] || status=1
  else
    echo "up rc=1 (no address)" | tee -a "$OUT/steps.txt"
    status=1
  fi
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
}

python3 - "$OUT" "$(( $(date +%s) - start ))" <<'PY' || status=1
import json, sys
out, elapsed = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        return json.load(open(f"{out}/{name}"))
    except Exception as e:
        return {"error": str(e)}
bench, sdpa = load("cuda-bench.json"), load("sdpa-bench.json")
steps = open(f"{out}/steps.txt").read()
report = {"elapsed_s": elapsed, "steps": steps.splitlines(), "cuda_bench": bench, "sdpa": sdpa, "targets": {}}
ok = True
try:
    frac = bench["paged_decode"]["fraction_of_copy_bandwidth"]
    report["targets"]["decode_vs_copy_bandwidth"] = {"value": frac, "target": ">= 0.70", "met": frac >= 0.70}
    ratio = bench["paged_decode"]["ms"] / sdpa["best_ms"]
    report["targets"]["decode_time_vs_sdpa"] = {"value": ratio, "target": "<= 1.2", "met": ratio <= 1.2}
    ok = ok and frac >= 0.70 and ratio <= 1.2
except Exception as e:
    report["targets"]["error"] = str(e)
    ok = False
ttft = bench.get("ttft", {}) if isinstance(bench, dict) else {}
json.dump(report, open(f"{out}/gpu-report.json", "w"), indent=2)
lines = ["# kvfleet GPU check", "", f"Elapsed: {elapsed} s", "", "## Steps (rc, seconds)", ""]
lines += [f"- {s}" for s in steps.splitlines()]
lines += ["", "## Paged decode (batch 64 x 4096, 32/8 heads, head_dim 128, block 16, bf16)", ""]
try:
    d, c = bench["paged_decode"], bench["d2d_copy"]
    lines += [f"- D2D copy: {c['gbps']:.0f} GB/s (read+write)",
              f"- paged decode: {d['ms']:.3f} ms, {d['gbps']:.0f} GB/s of K/V, {d['fraction_of_copy_bandwidth']:.2f} of copy bandwidth (target >= 0.70)",
              f"- PyTorch SDPA ({sdpa.get('best')}, contiguous K/V): {sdpa['best_ms']:.3f} ms; ours / SDPA = {d['ms'] / sdpa['best_ms']:.2f} (target <= 1.2)"]
except Exception as e:
    lines.append(f"- missing figures: {e}")
if ttft:
    lines += ["", "## Time to first token, 32k prompt", "",
              f"- model: {ttft.get('model')}",
              f"- cold: {ttft.get('cold_s', float('nan')):.3f} s; 32k prefix cached: {ttft.get('cached_s', float('nan')):.4f} s; speedup {ttft.get('speedup', float('nan')):.0f}x"]
lines += ["", f"Targets met: {ok}", ""]
open(f"{out}/gpu-report.md", "w").write("\n".join(lines))
print("\n".join(lines))
sys.exit(0 if ok else 1)
PY
exit $status
