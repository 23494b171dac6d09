#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/fuzz_targets) for SECONDS (default 60) each on
# its committed seed corpus, then prints executions and crashes per target from
# libFuzzer's final stats. Only the stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets
# it take the nightly-only sanitizer flags cargo-fuzz passes.
# Usage: bash scripts/fuzz.sh [seconds]. Installs cargo-fuzz when missing.
set -uo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
targets=(chat_request trace_line proto_decode event_apply gguf_header)
status=0
printf '%-14s %12s %8s\n' target executions crashes
for t in "${targets[@]}"; do
  log="fuzz/artifacts/$t.log"
  mkdir -p fuzz/artifacts "fuzz/corpus/$t"
  # A scratch copy of the corpus: new inputs found while fuzzing stay out of git.
  work=$(mktemp -d)
  cp "fuzz/corpus/$t"/* "$work"/ 2>/dev/null || true
  cargo fuzz run --fuzz-dir fuzz "$t" "$work" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1
  rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  crashes=$(ls "fuzz/artifacts/$t"/crash-* "fuzz/artifacts/$t"/oom-* "fuzz/artifacts/$t"/timeout-* 2>/dev/null | wc -l)
  if [[ $rc -ne 0 && $crashes -eq 0 ]]; then crashes="error(rc=$rc, see $log)"; status=1; fi
  [[ "$crashes" != 0 ]] && status=1
  printf '%-14s %12s %8s\n' "$t" "${execs:-?}" "$crashes"
  rm -rf "$work"
done
exit $status
