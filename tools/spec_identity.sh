#!/usr/bin/env bash
# Speculative decoding is lossless on a large varied job: N (default 1000) prompts (questions,
# lists, code, JSON records, translations; greedy, and every third one sampled with a seed) run
# through `quern run --matmul exact` with --spec off and with --spec auto --spec-budget all
# (every draft verified); every record's choices and usage must be identical. Prints the counts
# and the run summaries' spec numbers. Usage: tools/spec_identity.sh [BIN] [MODEL]; env N.
set -euo pipefail
Q=${1:-build/bin/quern}
M=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
N=${N:-1000}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$N" >"$tmp/in.jsonl" <<'PY'
import json, random, sys
rnd = random.Random(7)
topics = ["the sea", "volcanoes", "bees", "the Roman empire", "prime numbers", "coffee", "rain",
          "chess", "bridges", "the moon", "penguins", "jazz", "glass", "maps", "bread", "rivers"]
langs = ["Python", "C", "JavaScript", "SQL", "Rust", "Go"]
forms = [
    lambda i: "Explain %s in two sentences." % rnd.choice(topics),
    lambda i: "List five facts about %s, one per line." % rnd.choice(topics),
    lambda i: "Write a %s function that returns the %d-th Fibonacci number." % (rnd.choice(langs), i % 30),
    lambda i: "Give a JSON object with keys name, age and city for person number %d." % i,
    lambda i: "Translate 'good morning, how are you?' to %s." % rnd.choice(["French", "German", "Spanish", "Italian"]),
    lambda i: "Count from %d to %d, separated by commas." % (i % 50, i % 50 + 12),
    lambda i: "Write a haiku about %s." % rnd.choice(topics),
]
for i in range(int(sys.argv[1])):
    body = {"messages": [{"role": "user", "content": forms[i % len(forms)](i)}],
            "max_tokens": 48, "temperature": 0}
    if i % 3 == 2:
        body.update(temperature=0.8, top_p=0.95, seed=i)
    print(json.dumps({"custom_id": "id-%d" % i, **body}))
PY
for name in off all; do
    flags=(--spec off)
    [ "$name" = all ] && flags=(--spec auto --spec-budget all)
    "$Q" submit --db "$tmp/$name.db" --model "$M" --name j "$tmp/in.jsonl" >/dev/null 2>&1
    "$Q" run --db "$tmp/$name.db" --out "$tmp/$name" --matmul exact "${flags[@]}" \
        >"$tmp/$name.sum" 2>/dev/null
    zstd -dcq "$tmp/$name"/j/results-*.jsonl.zst >"$tmp/$name.jsonl"
done
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
def load(n):
    out = {}
    for line in open("%s/%s.jsonl" % (d, n)):
        r = json.loads(line)
        b = r["response"]["body"]
        out[r["custom_id"]] = (b["choices"], b["usage"])
    return out
off, on = load("off"), load("all")
assert off.keys() == on.keys()
bad = [k for k in off if off[k] != on[k]]
print("records: %d, identical: %d, different: %d" % (len(off), len(off) - len(bad), len(bad)))
for n in ("off", "all"):
    s = json.loads(open("%s/%s.sum" % (d, n)).read().strip().splitlines()[-1])
    print(n, "output_tok_s %.1f" % s["output_tok_s"], s.get("spec"))
sys.exit(1 if bad else 0)
PY
