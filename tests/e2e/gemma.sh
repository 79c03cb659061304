#!/usr/bin/env bash
# End-to-end on the second model family: Gemma 3 270M (`make gemma`; QUERN_GEMMA) through the
# real binary. A factual completion (the packaged model is the base model, so a plain prompt),
# the chat template its vocabulary names (no template in the GGUF) with --chat-template (and
# mistral-v7's date: the job's submission day), a
# 12-request job through submit/run/export (exactly once, valid shards), `quern bench`, and the
# sliding-window KV pool (plan; a prompt longer than the window, as with one pool).
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
set +e # (an unknown template is a usage error: exit 2, before the model loads)
"$Q" tokenize --model "$G" --chat --chat-template vicuna </dev/null 2>"$tmp/e1"; rc=$?
set -e
[ $rc -eq 2 ] && grep -q "chatml, deepseek-r1, gemma, llama2, llama3, llama31, mistral, mistral-v3, mistral-v7, phi3, phi4, phi4-mini, qwen3" "$tmp/e1" || fail "unknown template: rc $rc"

# 2b. --chat-template mistral-v7 (Gemma's vocabulary has <s>; SmolLM2's does not) writes Mistral
# Small 3.2's default system prompt with a date: the day the job was submitted (jobs.created),
# on any day it runs. The same day: the same prompt (the same logprobs); another: another.
printf '{"custom_id":"d","messages":[{"role":"user","content":"Hi"}],"max_tokens":1,"temperature":0,"logprobs":true,"top_logprobs":3}\n' >"$tmp/d.jsonl"
for k in 1577836800000:a 1577923199000:b 1609459200000:c; do # 2020-01-01 00:00, 23:59, 2021-01-01
    "$Q" submit --db "$tmp/d${k#*:}.db" --model "$G" --name d "$tmp/d.jsonl" >/dev/null 2>&1 ||
        fail "submit d"
    sqlite3 "$tmp/d${k#*:}.db" "UPDATE jobs SET created = ${k%:*}" || fail "jobs.created"
    "$Q" run --db "$tmp/d${k#*:}.db" --out "$tmp/d${k#*:}" --chat-template mistral-v7 >/dev/null 2>&1 ||
        fail "run --chat-template mistral-v7"
    "$Q" export --db "$tmp/d${k#*:}.db" --job d --out "$tmp/d${k#*:}.jsonl" 2>/dev/null || fail "export d"
done
python3 - "$tmp/da.jsonl" "$tmp/db.jsonl" "$tmp/dc.jsonl" <<'PY' || fail "mistral-v7's date is not the job's"
import json, sys
lp = [json.loads(open(f).read())["response"]["body"]["choices"][0]["logprobs"] for f in sys.argv[1:]]
assert lp[0] == lp[1], lp
assert lp[0] != lp[2], lp
PY

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
python3 -c '
import json, sys
assert json.load(open(sys.argv[1]))["kv_window_blocks"] > 0
' "$tmp/bench.json" || fail "bench ran without the sliding-window pool"

# 5. The sliding-window pool: plan counts it (more 1,024-token sequences fit than in one pool),
# and a prompt longer than the window (its window blocks given back during the prefill chunks)
# generates what it generates with one pool.
# (a fixed budget: --kv-mem auto's pool can hold --max-seqs such sequences either way)
"$Q" plan --model "$G" --seq-len 1024 --kv-mem 1G --json >"$tmp/p1.json"
"$Q" plan --model "$G" --seq-len 1024 --kv-mem 1G --json --no-window-pool >"$tmp/p0.json"
python3 - "$tmp/p1.json" "$tmp/p0.json" <<'PY' || fail "plan: $(cat "$tmp/p1.json")"
import json, sys
w, o = (json.load(open(f)) for f in sys.argv[1:3])
assert w["kv_window"] == 512 and w["kv_window_layers"] == 15 and w["kv_window_blocks"] > 0, w
assert o["kv_window_blocks"] == 0 and w["sequences"] > o["sequences"], (w, o)
PY
# the pool a full-context sequence needs, as plan's warning states it, is one where it fits (the
# warning counted every layer's bytes: 576 MiB, though 512 MiB fit)
need=$("$Q" plan --model "$G" --kv-mem 100M 2>&1 >/dev/null |
       sed -n 's/.*32768 tokens need \([0-9.]*\) MiB.*/\1/p')
[ -n "$need" ] || fail "plan: no full-context warning at 100M"
"$Q" plan --model "$G" --kv-mem "$(python3 -c "import math; print(math.ceil($need) + 1)")M" --json |
    python3 -c 'import json, sys; assert json.load(sys.stdin)["full_context_fits"]' ||
    fail "plan: the stated need ($need MiB) does not fit a full-context sequence"
if [ -z "${QUERN_SANITIZE:-}" ]; then
    python3 - >"$tmp/long.jsonl" <<'PY'
import json
for i in range(3):
    long = " ".join("Step %d: the quick brown %s jumps over the lazy dog." % (k, ["fox", "cat", "owl"][i])
                    for k in range(50 + 10 * i))
    print(json.dumps({"custom_id": "long-%d" % i, "method": "POST", "url": "/v1/completions",
                      "body": {"model": "gemma", "prompt": long, "max_tokens": 8, "temperature": 0}}))
PY
    cd "$tmp"
    for pool in "" --no-window-pool; do
        "$Q" submit --db "l$pool.db" --model "$G" --name long long.jsonl >/dev/null 2>&1 ||
            fail "submit (long prompts $pool)"
        "$Q" run --db "l$pool.db" --out "lo$pool" --matmul exact --max-batch-tokens 256 $pool \
            >/dev/null 2>"l$pool.log" || { tail -5 "l$pool.log"; fail "run (long prompts $pool)"; }
        check_job "l$pool.db" long 3 "lo$pool"
        zstd -q -dc lo$pool/long/results-*.jsonl.zst | python3 -c '
import json, sys
recs = sorted((json.loads(l) for l in sys.stdin), key=lambda r: r["custom_id"])
for r in recs:
    u = r["response"]["body"]["usage"]
    assert u["prompt_tokens"] > 600, u  # past the 512-token window
    print(r["custom_id"], json.dumps(r["response"]["body"]["choices"][0]["text"]))
' >"texts$pool.txt" || fail "long-prompt records ($pool)"
    done
    cmp -s texts.txt texts--no-window-pool.txt ||
        fail "prompts past the window generate differently with the window pool: $(cat texts.txt)"
    cd "$OLDPWD"
fi

# 6. perplexity of a model that adds BOS, both window methods, against the float64 reference
# (tests/fixtures/perplexity_ref_gemma.json: tools/ref_perplexity.py --ids, the ids of `quern
# tokenize`): the sliding windows' first token is BOS as the default method's is (before, the
# windows after the first started mid-text without it: 175 against the reference's 21.0)
TXT=tests/fixtures/perplexity_text.txt
REF=tests/fixtures/perplexity_ref_gemma.json
for s in 0 48; do
    a=()
    [ $s -eq 0 ] || a=(--stride $s)
    "$Q" perplexity --model "$G" --file "$TXT" --ctx 64 --matmul exact --json "${a[@]}" \
        >"$tmp/ppl$s.json" 2>"$tmp/ppl$s.err" || { cat "$tmp/ppl$s.err"; fail "perplexity $s"; }
done
python3 - "$REF" "$TXT" "$tmp/ppl0.json" "$tmp/ppl48.json" <<'PY' || fail "perplexity against the reference"
import hashlib, json, sys
ref = json.load(open(sys.argv[1]))
assert hashlib.sha256(open(sys.argv[2], "rb").read()).hexdigest() == ref["text_sha256"]
assert ref["add_bos"] is True
for path, run in zip(sys.argv[3:], ref["runs"]):
    q = json.load(open(path))
    assert (q["stride"], q["windows"], q["tokens_scored"], q["text_tokens"]) == (
        run["stride"], run["windows"], run["tokens_scored"], ref["text_tokens"]), (q, run)
    rel = abs(q["perplexity"] - run["perplexity"]) / run["perplexity"]
    print("  gemma stride %d: perplexity %.5f, reference %.5f, relative %.1e"
          % (run["stride"], q["perplexity"], run["perplexity"], rel))
    assert rel < 3e-4, rel
PY
echo "gemma e2e: Paris, chat format, 12-record job, bench, window pool, perplexity OK"
