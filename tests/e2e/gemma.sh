#!/usr/bin/env bash
# End-to-end on the second model family: Gemma 3 270M (`make gemma`; QUERN_GEMMA) through the
# real binary. A factual completion (the packaged model is the base model, so a plain prompt),
# the chat template its vocabulary names (no template in the GGUF) with --chat-template, a
# 12-request job through submit/run/export (exactly once, valid shards), and `quern bench`.
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
G=${QUERN_GEMMA:-models/gemma-3-270m-q4_k_m.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -f "$G" ] || fail "no $G (run make gemma)"
Q=$(realpath "$Q")
G=$(realpath "$G")
M=$G
. "$(dirname "$0")/lib/common.sh"

# 1. A factual answer, greedy in exact mode (tests/test_gemma.c holds the logits).
"$Q" generate --model "$G" --prompt $'Question: What is the capital of France?\nAnswer:' \
    --temperature 0 --matmul exact --max-tokens 6 >"$tmp/paris.txt" 2>"$tmp/paris.err" ||
    { cat "$tmp/paris.err"; fail "generate exited non-zero"; }
grep -q "^ Paris" "$tmp/paris.txt" || { cat "$tmp/paris.txt"; fail "answer is not Paris"; }

# 2. The Gemma chat format, found from the vocabulary, and named explicitly: the same ids.
echo -n "Hi there" | "$Q" tokenize --model "$G" --chat >"$tmp/c1.json" 2>/dev/null
echo -n "Hi there" | "$Q" tokenize --model "$G" --chat --chat-template gemma >"$tmp/c2.json"
cmp -s "$tmp/c1.json" "$tmp/c2.json" || fail "vocabulary-detected format differs from gemma"
# <bos><start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n
python3 - "$tmp/c1.json" <<'PY' || fail "chat ids: $(cat "$tmp/c1.json")"
import json, sys
ids = json.load(open(sys.argv[1]))
assert ids[:4] == [2, 105, 2364, 107], ids
assert ids[-5:] == [106, 107, 105, 4368, 107], ids
PY
set +e
"$Q" tokenize --model "$G" --chat --chat-template vicuna </dev/null 2>"$tmp/e1"; rc=$?
set -e
[ $rc -eq 1 ] && grep -q "chatml, gemma, llama2, llama3, mistral, phi3" "$tmp/e1" || fail "unknown template: rc $rc"

# 3. A job: 12 example requests (chat and completion), every record once, shards valid.
head -n 12 examples/prompts.jsonl >"$tmp/in.jsonl"
cd "$tmp"
"$Q" submit --db q.db --model "$G" --name gj in.jsonl >/dev/null 2>&1 || fail "submit"
"$Q" run --db q.db --out out >run.json 2>run.log || { tail -5 run.log; fail "run"; }
check_job q.db gj 12
zstd -q -dc out/gj/results-*.jsonl.zst | python3 -c '
import json, sys
recs = [json.loads(l) for l in sys.stdin]
assert len(recs) == 12, len(recs)
for r in recs:
    b = r["response"]["body"]
    assert r["response"]["status_code"] == 200, r
    text = b["choices"][0].get("message", {}).get("content") or b["choices"][0].get("text")
    assert text, r
    assert b["usage"]["completion_tokens"] > 0, r
' || fail "result records"
cd "$OLDPWD"

# 4. bench: JSON with the throughput fields.
"$Q" bench --model "$G" --prompts 4 --input-len 32 --output-len 8 --peak-seconds 0 \
    >"$tmp/bench.json" 2>/dev/null || fail "bench"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["output_tok_s"] > 0 and d["requests"] == 4, d
' "$tmp/bench.json" || fail "bench JSON: $(head -c 300 "$tmp/bench.json")"
echo "gemma e2e: Paris, chat format, 12-record job, bench OK"
