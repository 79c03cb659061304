#!/usr/bin/env bash
# `make eval`: the default model's perplexity on a fixed text for every matmul mode x KV type this
# machine runs, with the throughput of each (prompt tokens through `quern perplexity`, and output
# tokens of a `quern bench` run), as a markdown table for docs/BENCHMARKS.md.
#
# The text needs no download: five license texts every Debian system ships in
# /usr/share/common-licenses (GPL-3, GPL-2, LGPL-2.1, Apache-2.0, MPL-2.0: 107,855 bytes),
# concatenated in that order; each is checked against its SHA-256 below, so every machine scores
# the same bytes (a missing or different file is an error). Windows: llama.cpp's method, --ctx 512.
# Environment: QUERN_BIN, QUERN_MODEL, EVAL_THREADS (default: all CPUs), EVAL_MODES, EVAL_KV.
set -euo pipefail
cd "$(dirname "$0")/.."
Q=${QUERN_BIN:-build/bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=build/eval
mkdir -p "$OUT"
TEXT=$OUT/licenses.txt
: >"$TEXT.tmp"
while read -r sum name; do
    f=/usr/share/common-licenses/$name
    [ -f "$f" ] || { echo "eval: $f is missing (Debian's base-files ships it)" >&2; exit 1; }
    echo "$sum  $f" | sha256sum -c --quiet - || { echo "eval: $f is not the expected text" >&2; exit 1; }
    cat "$f" >>"$TEXT.tmp"
done <<'SUMS'
3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986 GPL-3
8177f97513213526df2cf6184d8ff986c675afb514d4e68a404010521b880643 GPL-2
dc626520dcd53a22f727af3ee42c770e56c97a64fe3adb063799d8ab032fe551 LGPL-2.1
cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30 Apache-2.0
fab3dd6bdab226f1c08630b1dd917e11fcb4ec5e1e020e2c16f83a0a13863e85 MPL-2.0
SUMS
mv "$TEXT.tmp" "$TEXT"
THREADS=${EVAL_THREADS:-$(nproc)}
echo "eval: $TEXT ($(wc -c <"$TEXT") bytes, sha256 $(sha256sum "$TEXT" | cut -c1-16)...), $M, $THREADS threads"
echo
echo "| matmul | KV | perplexity | vs exact f16 | perplexity tok/s | bench output tok/s |"
echo "|---|---|---|---|---|---|"
base=""
for mode in ${EVAL_MODES:-exact q16 q8 bf16}; do
    for kv in ${EVAL_KV:-f16 q8}; do
        if ! "$Q" perplexity --model "$M" --file "$TEXT" --ctx 512 --matmul "$mode" --kv-dtype "$kv" \
            --threads "$THREADS" --kv-mem 2G --json >"$OUT/ppl-$mode-$kv.json" 2>"$OUT/ppl-$mode-$kv.err"; then
            echo "| $mode | $kv | not on this machine: $(grep -o 'error: .*' "$OUT/ppl-$mode-$kv.err" | head -1 | cut -c8-90) | | | |"
            continue
        fi
        "$Q" bench --model "$M" --matmul "$mode" --kv-dtype "$kv" --threads "$THREADS" --prompts 64 \
            --input-len 128 --output-len 64 --peak-seconds 0 >"$OUT/bench-$mode-$kv.json" 2>/dev/null
        python3 - "$OUT/ppl-$mode-$kv.json" "$OUT/bench-$mode-$kv.json" "$base" <<'PY'
import json, sys
p = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
base = float(sys.argv[3]) if sys.argv[3] else p["perplexity"]
print("| %s | %s | %.4f +/- %.4f | %+.3f %% | %.0f | %.0f |" % (
    p["matmul"], p["kv_dtype"], p["perplexity"], p["perplexity_stderr"],
    100 * (p["perplexity"] / base - 1), p["tok_per_s"], b["output_tok_s"]))
PY
        [ -n "$base" ] || base=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["perplexity"])' "$OUT/ppl-$mode-$kv.json")
    done
done
echo
python3 -c 'import json,sys; p=json.load(open(sys.argv[1])); print("windows: %d of %d tokens (%s), %d tokens scored; standard errors are over tokens, and the modes score the same tokens, so their differences are far more precise than the +/- suggests" % (p["windows"], p["ctx"], p["method"], p["tokens_scored"]))' "$OUT/ppl-exact-f16.json"
