#!/usr/bin/env bash
# kvfleet vs llama.cpp vs torch on the default GGUF, side by side, medians of rounds.
#   bash scripts/bench/vs-llamacpp.sh [ROUNDS]      (writes docs/bench/real-model.json)
# Builds llama.cpp (scripts/bench/build-llamacpp.sh) and kvfleet (release) first. torch runs
# when KVFLEET_TORCH_PYTHON names a python with torch + transformers + gguf.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds="${1:-3}"
bash scripts/fetch-model.sh >/dev/null
cache="${KVFLEET_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/models}"
gguf="$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
bash scripts/bench/build-llamacpp.sh
cargo build --release --locked --bin kvfleet
mkdir -p docs/bench
torch_args=()
[ -n "${KVFLEET_TORCH_PYTHON:-}" ] && torch_args=(--torch-python "$KVFLEET_TORCH_PYTHON")
python3 scripts/bench/vs_llamacpp.py --kvfleet target/release/kvfleet \
  --llamacpp "${LLAMACPP_DIR:-$PWD/target/llamacpp}/bin" --gguf "$gguf" --rounds "$rounds" \
  --out docs/bench/real-model.json "${torch_args[@]}"
