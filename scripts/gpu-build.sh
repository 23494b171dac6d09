#!/usr/bin/env bash
# Builds, here (Rust, no GPU needed), everything scripts/gpu-check.sh runs on a GPU
# machine that has CUDA 13 and PyTorch but no Rust: the GPU test executables, the kernel
# benchmark and the kvfleet binary, stripped, in gpu-bin/ (git-ignored; small enough for
# the device tool to carry). See docs/gpu.md.
#
# The dev profile is used on purpose: dependencies are already optimised in it (see
# [profile.dev.package."*"] in Cargo.toml) and its build is shared with the test suite;
# the GPU does the heavy work.
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bin
rm -rf "$out"
mkdir -p "$out"

# GPU tests: kernel-vs-CPU unit tests (src/cuda/kernel_tests.rs, in the lib test
# executable) and whole-model tests (tests/cuda_model.rs).
# (--workspace with the feature named through the package keeps the workspace's feature
# set, so dependencies are not rebuilt; only libraries' unit tests and cuda_model link.)
cargo test --workspace --features kvfleet-engine/gpu-tests --lib --test cuda_model --no-run \
  --message-format=json-render-diagnostics >"$out/build.json"
python3 - "$out" <<'PY'
import json, shutil, sys
out = sys.argv[1]
names = {"lib": "engine-kernel-tests", "cuda_model": "cuda-model-tests"}
found = set()
for line in open(f"{out}/build.json"):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if not m["profile"]["test"] or m["package_id"].find("kvfleet-engine") < 0:
        continue
    kind = "lib" if "lib" in m["target"]["kind"] else m["target"]["name"]
    if kind in names:
        shutil.copy(m["executable"], f"{out}/{names[kind]}")
        found.add(kind)
missing = set(names) - found
if missing:
    sys.exit(f"test executables not found: {missing}")
PY
rm "$out/build.json"

cargo build --workspace --example cuda_bench
cp target/debug/examples/cuda_bench "$out/"
cargo build --bin kvfleet
cp target/debug/kvfleet "$out/"

strip --strip-debug "$out"/*
echo "gpu-bin/:"
ls -la "$out"
du -sh "$out"
