#!/usr/bin/env bash
# End-to-end: speculative decoding is lossless. The 57 examples (greedy) and the same prompts
# sampled (temperature 0.8, top_p 0.95, a seed each) run with --spec off and with --spec auto
# (both drafters; --spec-budget all so that every draft is verified, and the default load-aware
# budget) and with --spec model (the model drafting for itself, every draft verified; and a
# coarser copy of it, its blocks' weights requantized to Q4_0 by build/tools/gguf_draft, whose
# drafts, drawn and argmax, are rejected often) in --matmul exact: every record's choices and
# usage are identical, and the run summary reports the drafts (accepted ones among them; with
# the copy, sampled requests' paths of both kinds). Under sanitizers: the first 4 prompts,
# without the default-budget run.
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
n=57
[ -n "${QUERN_SANITIZE:-}" ] && n=4

python3 - "$n" >"$tmp/in.jsonl" <<'PY'
import json, sys
n = int(sys.argv[1])
lines = [json.loads(l) for l in open("examples/prompts.jsonl")][:n]
for l in lines:
    print(json.dumps(l))
for i, l in enumerate(lines):
    l["custom_id"] += "-sampled"
    (l["body"] if "body" in l else l).update(temperature=0.8, top_p=0.95, seed=i)
    print(json.dumps(l))
PY

run() { # name, flags...
    local name=$1
    shift
    "$Q" submit --db "$tmp/$name.db" --model "$M" --name j "$tmp/in.jsonl" >/dev/null 2>&1 ||
        fail "submit $name"
    "$Q" run --db "$tmp/$name.db" --out "$tmp/$name" --matmul exact "$@" >"$tmp/$name.sum" \
        2>"$tmp/$name.err" || { cat "$tmp/$name.err"; fail "run $name"; }
    zstd -dcq "$tmp/$name"/j/results-*.jsonl.zst >"$tmp/$name.jsonl"
}
run off --spec off
run all --spec auto --spec-budget all
run model --spec model --draft-model "$M" --spec-max-k 3 --spec-budget all
"$(dirname "$Q")/../tools/gguf_draft" "$M" "$tmp/q4_0.gguf" 0 -1 q4_0 >/dev/null ||
    fail "gguf_draft (a Q4_0 copy of the model)"
run copy --spec model --draft-model "$tmp/q4_0.gguf" --spec-max-k 3 --spec-budget all
[ -n "${QUERN_SANITIZE:-}" ] || run auto --spec auto

python3 - "$tmp" <<'PY' || fail "outputs differ"
import json, sys
d = sys.argv[1]
def load(name):
    out = {}
    for line in open("%s/%s.jsonl" % (d, name)):
        r = json.loads(line)
        assert r["error"] is None, r
        b = r["response"]["body"]
        u = dict(b["usage"])
        u.pop("prompt_tokens_details") # (prefix-cache hits follow the schedule)
        out[r["custom_id"]] = (b["choices"], u)
    return out
off = load("off")
import os
for name in ("all", "auto", "model", "copy"):
    if not os.path.exists("%s/%s.jsonl" % (d, name)):
        continue
    on = load(name)
    assert on.keys() == off.keys(), name
    bad = [k for k in off if on[k] != off[k]]
    assert not bad, (name, bad[:5])
    s = json.loads(open("%s/%s.sum" % (d, name)).read().strip().splitlines()[-1])
    sp = s.get("spec")
    if name in ("all", "model", "copy"):
        assert sp and sp["drafted"] > 0 and 0 < sp["accepted"] < sp["drafted"], s
    if name == "copy":
        assert sp["draft_model_drawn"] > 0 and sp["draft_model_argmax"] > 0, s
    print("  --spec %s: %d records identical to --spec off; spec %s" % (name, len(on), sp))
PY

# A job of another vocabulary (Gemma 3) before one of the draft model's own: with --spec model
# the run does the Gemma job without drafting (a warning) and the other with it; it stopped the
# whole run (exit 1, both jobs left queued) before.
G=${QUERN_GEMMA:-models/gemma-3-270m-q4_k_m.gguf}
if [ -f "$G" ]; then
    printf '{"custom_id":"g%d","prompt":"1, 2, 3, 4,","max_tokens":4}\n' 1 2 >"$tmp/g.jsonl"
    "$Q" submit --db "$tmp/two.db" --model "$G" --name g --out "$tmp/two" "$tmp/g.jsonl" \
        >/dev/null 2>&1 || fail "submit the Gemma job"
    "$Q" submit --db "$tmp/two.db" --model "$M" --name s --out "$tmp/two" "$tmp/g.jsonl" \
        >/dev/null 2>&1 || fail "submit the SmolLM2 job"
    "$Q" run --db "$tmp/two.db" --spec model --draft-model "$M" >"$tmp/two.sum" 2>"$tmp/two.err" ||
        { cat "$tmp/two.err"; fail "a run over a job of another vocabulary than the draft model's"; }
    grep -q "job g: the draft model's vocabulary is not the job's model's (49152 tokens against 262144)" \
        "$tmp/two.err" || { cat "$tmp/two.err"; fail "no warning for the Gemma job"; }
    [ "$(sqlite3 "$tmp/two.db" "SELECT count(*) FROM items WHERE state = 'done'")" = 4 ] ||
        fail "the two jobs are not done"
    echo "  --spec model over a job of another vocabulary: that job without it, the run goes on"
fi
echo "spec: OK"
