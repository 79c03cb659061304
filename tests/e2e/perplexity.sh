#!/usr/bin/env bash
# End-to-end: quern perplexity. On a short fixed text (tests/fixtures/perplexity_text.txt, the
# start of the GPL-3), both window methods against the independent float64 reference
# (tests/fixtures/perplexity_ref.json, tools/ref_perplexity.py): the same windows and tokens
# scored, perplexity within a relative 1e-4 in exact mode; the default mode is q8 (bf16 on
# AMX-BF16 CPUs). Batch
# invariance: one window at a time,
# all at once and small steps give the same mean NLL to the last digit printed; --tp 3 on a dummy
# model equals one rank. Clear errors: text that is not UTF-8, too short for a window, a stride
# that leaves no context.
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
TXT=tests/fixtures/perplexity_text.txt
REF=tests/fixtures/perplexity_ref.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

ppl() { # output json, then flags
    local out=$1
    shift
    "$Q" perplexity --model "$M" --file "$TXT" --ctx 128 --json "$@" >"$out" 2>"$out.err" ||
        { cat "$out.err"; fail "perplexity $*"; }
}
ppl "$tmp/chunks.json" --matmul exact
ppl "$tmp/sliding.json" --matmul exact --stride 96
python3 - "$REF" "$TXT" "$tmp/chunks.json" "$tmp/sliding.json" <<'PY' || fail "against the reference"
import hashlib, json, sys
ref = json.load(open(sys.argv[1]))
assert hashlib.sha256(open(sys.argv[2], "rb").read()).hexdigest() == ref["text_sha256"], "text changed"
for path, run in zip(sys.argv[3:], ref["runs"]):
    q = json.load(open(path))
    assert q["stride"] == run["stride"] and q["ctx"] == run["ctx"], (q, run)
    assert q["text_tokens"] == ref["text_tokens"], (q["text_tokens"], ref["text_tokens"])
    assert q["windows"] == run["windows"] and q["tokens_scored"] == run["tokens_scored"], (q, run)
    rel = abs(q["perplexity"] - run["perplexity"]) / run["perplexity"]
    print("  stride %d: %d windows, %d tokens, perplexity %.6f, reference %.6f, relative %.1e"
          % (run["stride"], q["windows"], q["tokens_scored"], q["perplexity"], run["perplexity"], rel))
    # 5-6e-5 on AVX-512 machines, 1.4e-4 on an AVX2-only EPYC (the f16 KV rounding, as in
    # test_model.c's tolerance)
    assert rel < 3e-4, rel
    assert q["nll_stderr"] > 0 and q["tok_per_s"] > 0, q
PY
[ "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["method"])' "$tmp/sliding.json")" = sliding ] ||
    fail "method name"

# batch invariance: the same numbers whatever the windows' batching (the normal build; under
# sanitizers these two runs would add time and no memory path)
field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
[ "$(field "$tmp/chunks.json" windows_in_flight)" = 4 ] || fail "the 4 windows did not run at once"
if [ -z "${QUERN_SANITIZE:-}" ]; then
    ppl "$tmp/one.json" --matmul exact --max-seqs 1
    ppl "$tmp/small.json" --matmul exact --max-batch-tokens 40
    [ "$(field "$tmp/one.json" windows_in_flight)" = 1 ] || fail "--max-seqs 1 ran $(field "$tmp/one.json" windows_in_flight) at once"
    for f in one small; do
        [ "$(field "$tmp/$f.json" mean_nll)" = "$(field "$tmp/chunks.json" mean_nll)" ] ||
            fail "batching changed the result ($f)"
    done
fi
# the default mode on the CPU is q8 (make eval: within 0.5 % of exact on its text), and bf16
# where the kernels run on AMX-BF16 tiles (as fast and exact's quality there): `quern info`
# says which, and only a CPU with amx_bf16 may say bf16
want=$("$Q" info 2>/dev/null | sed -n 's/^cpu kernels: .*; default matmul mode \([a-z0-9]*\)$/\1/p')
case "$want" in
q8) ;;
bf16) grep -qw amx_bf16 /proc/cpuinfo || fail "quern info says bf16 by default on a CPU without amx_bf16" ;;
*) fail "quern info names no default matmul mode ('$want')" ;;
esac
ppl "$tmp/default.json"
[ "$(field "$tmp/default.json" matmul)" = "$want" ] || fail "the default matmul mode is $(field "$tmp/default.json" matmul), quern info says $want"
# tensor parallelism on a dummy model: the same as one rank
ppl "$tmp/d1.json" --dummy smollm2-135m
ppl "$tmp/d3.json" --dummy smollm2-135m --tp 3
[ "$(field "$tmp/d1.json" mean_nll)" = "$(field "$tmp/d3.json" mean_nll)" ] || fail "--tp 3 differs"

# errors
expect() { # exit code, text, then the command
    local want_rc=$1 want=$2
    shift 2
    set +e
    "$@" >/dev/null 2>"$tmp/err"
    local rc=$?
    set -e
    [ $rc -eq "$want_rc" ] || { cat "$tmp/err"; fail "$* exited $rc, want $want_rc"; }
    grep -q -- "$want" "$tmp/err" || { cat "$tmp/err"; fail "$*: no '$want'"; }
}
printf 'valid text then \xff\xfe bad bytes' >"$tmp/bad.txt"
expect 1 "is not UTF-8: byte 16" "$Q" perplexity --model "$M" --file "$tmp/bad.txt"
expect 1 "too short for one window of --ctx 1024" "$Q" perplexity --model "$M" --file "$TXT" --ctx 1024
# (a long-context audit: --ctx 9000 failed with "sequence 0 holds 563 KV blocks, more than 513"
# and --ctx 8200 scored positions past the trained context without a word)
expect 2 "--ctx 8200 is longer than the model's context (8192 tokens)" "$Q" perplexity --model "$M" \
    --file "$TXT" --ctx 8200
expect 2 "must be shorter than --ctx" "$Q" perplexity --model "$M" --file "$TXT" --ctx 128 --stride 128
expect 2 "--file is required" "$Q" perplexity --model "$M"
expect 1 "cannot open" "$Q" perplexity --model "$M" --file "$tmp/missing.txt"
echo "perplexity.sh: ok"
