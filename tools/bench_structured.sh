#!/usr/bin/env bash
# The cost of structured outputs: the same N chat requests (max_tokens 64, temperature 0.8,
# batch 64) as free text, as json_object and as one json_schema shared by all of them, each a
# job of its own through `quern run`; prints each job's output tok/s (from the run summary) and
# its ratio to free text. A job's first requests compute its grammar's masks (cold); later ones
# find them cached.
#   [ROUNDS=2] tools/bench_structured.sh [N] [extra quern run flags...]    (N default 256)
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
N=${1:-256}
shift || true
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$N" "$tmp" <<'PY'
import json, sys
n, d = int(sys.argv[1]), sys.argv[2]
topics = ["a book", "a city", "a cat", "an order", "a song", "a planet", "a car", "a tree"]
schema = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 0,
    "maximum": 2100}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "rating": {"type": "number", "minimum": 0}, "summary": {"type": "string"}},
    "required": ["name", "year", "tags", "rating", "summary"], "additionalProperties": False}
for kind in ("text", "json_object", "json_schema"):
    with open("%s/%s.jsonl" % (d, kind), "w") as f:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": "Describe %s number %d as a JSON "
                                  "record." % (topics[i % 8], i)}],
                    "max_tokens": 64, "temperature": 0.8, "seed": i}
            if kind == "json_object":
                body["response_format"] = {"type": "json_object"}
            if kind == "json_schema":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "record", "strict": True, "schema": schema}}
            f.write(json.dumps({"custom_id": "r%d" % i, **body}) + "\n")
PY
# ROUNDS rounds of the three jobs in turn (the machine's noise moves all three alike within a
# round); each round's ratios to its own free-text job, then the mean ratio
ROUNDS=${ROUNDS:-2}
for round in $(seq "$ROUNDS"); do
    for kind in text json_object json_schema; do
        "$Q" submit --db "$tmp/q.db" --model "$M" --name "$kind-$round" "$tmp/$kind.jsonl" \
            >/dev/null 2>&1
        "$Q" run --db "$tmp/q.db" --out "$tmp/out" --job "$kind-$round" --max-seqs 64 "$@" \
            >"$tmp/$kind-$round.json" 2>/dev/null
    done
done
python3 - "$tmp" "$ROUNDS" <<'PY'
import json, sys
d, rounds = sys.argv[1], int(sys.argv[2])
ratios = {"json_object": [], "json_schema": []}
for r in range(1, rounds + 1):
    base = json.load(open("%s/text-%d.json" % (d, r)))["output_tok_s"]
    for kind in ("text", "json_object", "json_schema"):
        j = json.load(open("%s/%s-%d.json" % (d, kind, r)))
        if kind != "text":
            ratios[kind].append(j["output_tok_s"] / base)
        print("round %d  %-12s %6d tokens  %7.1f output tok/s  %.3f x text"
              % (r, kind, j["completion_tokens"], j["output_tok_s"], j["output_tok_s"] / base))
for kind, v in ratios.items():
    print("mean %-12s %.3f x text" % (kind, sum(v) / len(v)))
PY
