#!/usr/bin/env bash
# End-to-end: structured outputs. Random JSON schemas (tests/e2e/gen_schemas.py: nested objects,
# arrays with bounds, enums, optional properties, anyOf, $ref, string formats, integer bounds)
# as response_format json_schema requests, plus json_object requests, through submit and run:
# every output that ended by itself ("stop") parses and validates against its schema with
# Python's jsonschema (formats checked), every json_object output is a JSON object, outputs cut
# by max_tokens say "length". The grammar field: outputs are sentences of their grammar. Submit
# refuses a schema quern cannot guarantee, naming the line, the place in the schema and the
# keyword. 300 schemas (24 under sanitizers).
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PYDEPS=${QUERN_PYDEPS:-build-py}
[ -d "$PYDEPS" ] || { echo "FAIL: $PYDEPS missing (make pydeps)" >&2; exit 1; }
N=300
[ -n "${QUERN_SANITIZE:-}" ] && N=24
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

python3 tests/e2e/gen_schemas.py "$N" 7 >"$tmp/in.jsonl"
"$Q" submit --db "$tmp/q.db" --model "$M" --name so --strict "$tmp/in.jsonl" >/dev/null \
    2>"$tmp/submit.err" || { cat "$tmp/submit.err"; fail "submit"; }
"$Q" run --db "$tmp/q.db" --out "$tmp/out" --max-seqs 64 >"$tmp/run.json" 2>"$tmp/run.err" ||
    { cat "$tmp/run.err"; fail "run"; }
zstd -dcq "$tmp"/out/so/results-*.jsonl.zst >"$tmp/out.jsonl"
PYTHONPATH="$PYDEPS" python3 - "$tmp/in.jsonl" "$tmp/out.jsonl" "$tmp/run.json" <<'PY' || fail "validation"
import json, sys
import jsonschema
req = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    req[d["custom_id"]] = d.get("body", d)["response_format"]
counts = {"stop": 0, "length": 0}
for line in open(sys.argv[2]):
    d = json.loads(line)
    assert d["response"]["status_code"] == 200, d
    c = d["response"]["body"]["choices"][0]
    counts[c["finish_reason"]] += 1
    if c["finish_reason"] != "stop":
        continue
    v = json.loads(c["message"]["content"])
    rf = req.pop(d["custom_id"])
    if rf["type"] == "json_schema":
        # (2020-12's format checker: the generic FormatChecker reads "time" as draft 3's)
        jsonschema.Draft202012Validator(
            rf["json_schema"]["schema"],
            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(v)
    else:
        assert isinstance(v, dict), v
run = json.load(open(sys.argv[3]))
assert run["items_done"] == counts["stop"] + counts["length"], (run, counts)
assert counts["stop"] >= counts["length"], counts  # most records finish within 96 tokens
print("  %d outputs ended by themselves, all valid; %d cut by max_tokens; %.0f tok/s"
      % (counts["stop"], counts["length"], run["output_tok_s"]))
PY

# the grammar field: outputs that end by themselves are sentences of the grammar (checked with
# an equivalent Python regular expression)
python3 - >"$tmp/g.jsonl" <<'PY'
import json
grammars = [
    ('root ::= ("yes" | "no") "." ', r"(yes|no)\."),
    ('root ::= header row{2,3}\nheader ::= "a,b,c\\n"\nrow ::= num "," num "," num "\\n"\n'
     'num ::= "0" | [1-9] [0-9]{0,3}', r"a,b,c\n((0|[1-9][0-9]{0,3}),(0|[1-9][0-9]{0,3}),(0|[1-9][0-9]{0,3})\n){2,3}"),
    ('root ::= [A-Z] [a-z]+ (" " [a-z]+)* "."', r"[A-Z][a-z]+( [a-z]+)*\."),
]
for i in range(24):
    g, rx = grammars[i % 3]
    print(json.dumps({"custom_id": "g%d" % i, "metadata": {"rx": rx}, "messages": [{"role": "user", "content":
        ["Is water wet?", "Write a CSV with columns a,b,c.", "Say something about cats."][i % 3]}],
        "max_tokens": 48, "temperature": 0.9, "seed": i, "grammar": g}))
PY
"$Q" submit --db "$tmp/q.db" --model "$M" --name gr --strict "$tmp/g.jsonl" >/dev/null \
    2>"$tmp/submit.err" || { cat "$tmp/submit.err"; fail "submit grammar"; }
"$Q" run --db "$tmp/q.db" --out "$tmp/out" --job gr >/dev/null 2>"$tmp/run.err" ||
    { cat "$tmp/run.err"; fail "run grammar"; }
zstd -dcq "$tmp"/out/gr/results-*.jsonl.zst >"$tmp/g_out.jsonl"
python3 - "$tmp/g.jsonl" "$tmp/g_out.jsonl" <<'PY' || fail "grammar outputs"
import json, re, sys
rx = {json.loads(l)["custom_id"]: json.loads(l)["metadata"]["rx"] for l in open(sys.argv[1])}
stop = 0
for line in open(sys.argv[2]):
    d = json.loads(line)
    c = d["response"]["body"]["choices"][0]
    if c["finish_reason"] == "stop":
        stop += 1
        assert re.fullmatch(rx[d["custom_id"]], c["message"]["content"]), (d["custom_id"], c)
assert stop >= 12, stop
print("  grammar field: %d of 24 outputs ended by themselves, all sentences of their grammar" % stop)
PY

# grammars too ambiguous to follow (17 nested repetitions: past the stack bound after a few
# bytes; ~4,000 parses through every letter: the first token mask past its work bound): those
# requests get an error record (grammar_too_ambiguous), quickly; the job's other request is
# answered
printf '%s\n' '{"custom_id":"amb","prompt":"Write:","max_tokens":40,"temperature":0.8,"grammar":"root ::= .+++++++++++++++++"}' \
    '{"custom_id":"amb2","prompt":"Write:","max_tokens":40,"temperature":0.8,"grammar":"root ::= ([a-z ]?{100}){40}"}' \
    '{"custom_id":"fine","prompt":"Say yes","max_tokens":8,"temperature":0,"grammar":"root ::= \"yes\" | \"no\""}' \
    >"$tmp/amb.jsonl"
"$Q" submit --db "$tmp/q.db" --model "$M" --name amb --strict "$tmp/amb.jsonl" >/dev/null 2>&1 ||
    fail "submit ambiguous"
"$Q" run --db "$tmp/q.db" --out "$tmp/out" --job amb >"$tmp/amb.json" 2>"$tmp/run.err" ||
    { cat "$tmp/run.err"; fail "run ambiguous"; }
grep -q '"items_failed":2' "$tmp/amb.json" || fail "the ambiguous items are not failed"
for id in amb amb2; do
    zstd -dcq "$tmp"/out/amb/errors-*.jsonl.zst | grep -q "\"custom_id\":\"$id\".*grammar_too_ambiguous" ||
        fail "no grammar_too_ambiguous error record for $id"
done
zstd -dcq "$tmp"/out/amb/results-*.jsonl.zst | grep -q '"custom_id":"fine".*"text":"\(yes\|no\)"' ||
    fail "the other request was not answered"

# refused at submit: line number, place in the schema, keyword
cat >"$tmp/bad.jsonl" <<'JSONL'
{"prompt":"ok","response_format":{"type":"json_object"}}
{"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"object","properties":{"a":{"type":"array","items":{"type":"string","pattern":"^[a-z]+$"}}}}}}}
JSONL
"$Q" submit --db "$tmp/bad.db" --model "$M" --strict "$tmp/bad.jsonl" >"$tmp/bad.out" 2>&1 &&
    fail "pattern accepted"
grep -q "bad.jsonl:2: unsupported: response_format.json_schema.schema: properties.a.items: keyword 'pattern' is not supported" "$tmp/bad.out" ||
    { cat "$tmp/bad.out"; fail "message for pattern"; }
echo '{"prompt":"x","response_format":{"type":"xml"}}' >"$tmp/bad2.jsonl"
"$Q" submit --db "$tmp/bad.db" --model "$M" --strict "$tmp/bad2.jsonl" >"$tmp/bad.out" 2>&1 &&
    fail "type xml accepted"
grep -q 'response_format.type must be "text", "json_object" or "json_schema"' "$tmp/bad.out" ||
    { cat "$tmp/bad.out"; fail "message for xml"; }
echo "e2e structured: ok"
