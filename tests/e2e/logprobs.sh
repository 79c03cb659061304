#!/usr/bin/env bash
# End-to-end: logprobs and n > 1 through submit, run and the output records.
#  1. Against the independent float64 reference (tests/fixtures/logprobs_ref.json,
#     tools/ref_logprobs.py): greedy completions with logprobs 5 in exact mode give the
#     reference's tokens, every token's log-probability within 0.02 (mean within 2e-3: the
#     logits' tolerance in tests/test_model.c) and the same five alternatives where their
#     margins allow.
#  2. Shapes: every record validates as the OpenAI SDK's ChatCompletion / Completion (pydantic,
#     build-py from `make pydeps`); chat logprobs: the content's tokens spell the message,
#     bytes are the token's UTF-8, alternatives descend, greedy tokens are their own first
#     alternative; usage sums the choices.
#  3. n > 1: greedy choices are identical; sampled ones differ, and choice 0 equals the same
#     line with n = 1 (another job, same seed and custom_id).
#  4. Bad lines are refused at submit with a clear message.
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PYDEPS=${QUERN_PYDEPS:-build-py}
REF=tests/fixtures/logprobs_ref.json
[ -d "$PYDEPS" ] || { echo "FAIL: $PYDEPS missing (make pydeps)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

python3 - "$REF" >"$tmp/in.jsonl" <<'PY'
import json, sys
ref = json.load(open(sys.argv[1]))
for i, p in enumerate(ref["prompts"]):
    print(json.dumps({"custom_id": "ref-%d" % i, "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": p["prompt"], "max_tokens": len(p["tokens"]),
                               "temperature": 0, "logprobs": 5}}))
chat = lambda q: [{"role": "user", "content": q}]
print(json.dumps({"custom_id": "chat-lp", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": chat("Name three colours."), "max_completion_tokens": 16,
                           "temperature": 0, "logprobs": True, "top_logprobs": 3, "n": 2}}))
print(json.dumps({"custom_id": "chat-sampled", "messages": chat("Write a short poem about rain."),
                  "max_tokens": 16, "temperature": 1.0, "seed": 5, "n": 4,
                  "logprobs": True}))
print(json.dumps({"custom_id": "plain-n", "prompt": "Once upon a time", "max_tokens": 12,
                  "temperature": 0.9, "seed": 3, "n": 3}))
PY
"$Q" submit --db "$tmp/q.db" --model "$M" --name lp "$tmp/in.jsonl" >/dev/null 2>"$tmp/submit.err" ||
    { cat "$tmp/submit.err"; fail "submit"; }
"$Q" run --db "$tmp/q.db" --out "$tmp/out" --matmul exact >/dev/null 2>"$tmp/run.err" ||
    { cat "$tmp/run.err"; fail "run"; }
zstd -dcq "$tmp"/out/lp/results-*.jsonl.zst >"$tmp/out.jsonl"

# the same sampled line with n = 1, in a job of its own: its text is choice 0's
grep '"plain-n"' "$tmp/in.jsonl" | sed 's/"n": 3/"n": 1/' >"$tmp/one.jsonl"
"$Q" submit --db "$tmp/q.db" --model "$M" --name one "$tmp/one.jsonl" >/dev/null 2>&1 || fail "submit one"
"$Q" run --db "$tmp/q.db" --out "$tmp/out" --matmul exact >/dev/null 2>"$tmp/run1.err" ||
    { cat "$tmp/run1.err"; fail "run one"; }
zstd -dcq "$tmp"/out/one/results-*.jsonl.zst >"$tmp/one_out.jsonl"

PYTHONPATH="$PYDEPS" python3 - "$REF" "$tmp/out.jsonl" "$tmp/one_out.jsonl" <<'PY' || fail "records"
import json, math, sys
from openai.types import Completion
from openai.types.chat import ChatCompletion
ref = json.load(open(sys.argv[1]))
recs = {}
for line in open(sys.argv[2]):
    r = json.loads(line)
    assert r["error"] is None and r["response"]["status_code"] == 200, r
    body = r["response"]["body"]
    (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate(body)
    recs[r["custom_id"]] = body
assert len(recs) == len(ref["prompts"]) + 3, sorted(recs)

# 1. the reference
diffs = []
for i, p in enumerate(ref["prompts"]):
    lp = recs["ref-%d" % i]["choices"][0]["logprobs"]
    assert lp["tokens"] == [t["text"] for t in p["tokens"]], (lp["tokens"], p["prompt"])
    for t, got, top in zip(p["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        diffs.append(abs(got - t["logprob"]))
        # the alternatives: same strings wherever the reference's neighbours are 0.05 apart
        want = t["top"]
        for j, (tid, text, v) in enumerate(want):
            if text in top:
                diffs.append(abs(top[text] - v))
            else:
                gap = min([abs(v - w[2]) for w in want if w is not want[j]] + [1.0])
                assert j == 4 and gap < 0.05, (p["prompt"], text, top, want)
mx, mean = max(diffs), sum(diffs) / len(diffs)
print("  reference: %d log-probabilities, max |diff| %.2e, mean %.2e" % (len(diffs), mx, mean))
assert mx < 0.02 and mean < 2e-3, (mx, mean)

# 2. chat shapes
body = recs["chat-lp"]
ch = body["choices"]
assert len(ch) == 2 and [c["index"] for c in ch] == [0, 1]
assert ch[0]["message"]["content"] == ch[1]["message"]["content"], "greedy choices differ"
n_tok = 0
for c in ch:
    content = c["logprobs"]["content"]
    n_tok += len(content)
    if c["finish_reason"] == "length":
        assert "".join(e["token"] for e in content) == c["message"]["content"]
    for e in content:
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"], e
        alts = e["top_logprobs"]
        assert len(alts) == 3 and alts[0]["token"] == e["token"], e
        assert alts[0]["logprob"] == e["logprob"] and e["logprob"] <= 0
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(alts, alts[1:])), alts
        assert sum(math.exp(a["logprob"]) for a in alts) <= 1 + 1e-5
assert body["usage"]["completion_tokens"] == n_tok, (body["usage"], n_tok)
assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + n_tok

# 3. n > 1, sampled
body = recs["chat-sampled"]
texts = [c["message"]["content"] for c in body["choices"]]
assert len(texts) == 4 and len(set(texts)) >= 3, texts
assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in body["choices"])
for c in body["choices"]:
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in c["logprobs"]["content"])
body = recs["plain-n"]
texts = [c["text"] for c in body["choices"]]
assert len(set(texts)) >= 2 and all(c["logprobs"] is None for c in body["choices"]), texts
one = json.loads(open(sys.argv[3]).readline())["response"]["body"]
assert len(one["choices"]) == 1 and one["choices"][0]["text"] == texts[0], (one, texts)
print("  shapes, usage and choices: ok (%d records)" % len(recs))
PY

# 4. refused at submit
bad() { # line, expected message part
    echo "$1" >"$tmp/bad.jsonl"
    if "$Q" submit --db "$tmp/bad.db" --model "$M" --strict "$tmp/bad.jsonl" >"$tmp/bad.out" 2>&1; then
        fail "accepted: $1"
    fi
    grep -q -- "$2" "$tmp/bad.out" || { cat "$tmp/bad.out"; fail "message for $1"; }
}
bad '{"prompt":"x","n":129}' "n must be an integer in \[1, 128\]"
bad '{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}' "top_logprobs needs logprobs set to true"
bad '{"prompt":"x","logprobs":21}' "logprobs must be an integer in \[0, 20\]"
bad '{"prompt":"x","logprobs":"yes"}' "logprobs must be a boolean or an integer"
echo "e2e logprobs: ok"
