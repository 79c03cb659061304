#!/usr/bin/env bash
# Provenance (docs/ARCHITECTURE.md): `quern --version` names the source revision; a job whose
# records come from two engines (a run in exact mode killed with -9, then a resume in q8) says
# so: the manifest lists which run wrote how many records of each shard and each run's engine,
# and `quern status` (text and --json) lists both engines and their runs; each exported record's
# system_fingerprint names its run's engine.
set -euo pipefail
. "$(dirname "$0")/lib/common.sh"
REPO=$(realpath "$(dirname "$0")/../..")
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
tmp=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }

# --version: the revision this binary was built from (a git checkout, as CI's is)
v=$("$Q" --version | head -1)
if head=$(git -C "$REPO" rev-parse --short=12 HEAD 2>/dev/null); then
    case "$v" in "quern $head"*) ;; *) fail "--version says '$v', HEAD is $head" ;; esac
fi
"$Q" version | head -1 | grep -qx "$v" || fail "'quern version' differs from --version"

# two engines: exact (paced on one thread, killed mid-job), then q8
make_small p.jsonl 120
"$Q" submit --db p.db --model "$M" --name p p.jsonl >/dev/null 2>&1
"$Q" run --db p.db --out out --max-seqs 4 --flush-secs 0.2 --threads 1 --matmul exact \
    >/dev/null 2>a.log &
pid=$!
for _ in $(seq 600); do
    [ "$(sqlite3 p.db "SELECT count(*) FROM items WHERE state = 'done'")" -ge 8 ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
done
kill -9 $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
left=$(sqlite3 p.db "SELECT count(*) FROM items WHERE state IN ('queued', 'leased')")
[ "$left" -gt 0 ] || fail "the exact run finished the job before it was killed (make it longer)"
grep -Eq "matmul exact, KV f16 in blocks of 16 \(a pool of [0-9]+ MiB, --kv-mem auto for [0-9]+ tokens\), quern ${v#quern }" a.log ||
    { cat a.log; fail "no engine line in the log"; }
"$Q" run --db p.db --out out --matmul q8 >/dev/null 2>b.log || { tail b.log; fail "resume"; }
check_job p.db p 120

"$Q" export --db p.db --job p --out p.export.jsonl 2>/dev/null || fail "export"
python3 - out/p/manifest.json p.db <<'PY' || fail "manifest provenance"
import json, sqlite3, sys
m = json.load(open(sys.argv[1]))
db = sqlite3.connect(sys.argv[2])
mode = {r["run"]: r["engine"]["matmul"] for r in m["runs"]}
assert sorted(mode.values()) == ["exact", "q8"], mode
# each shard's writers are the lease owners of the items whose record it holds
for s in m["shards"]:
    sid = db.execute("SELECT id FROM shards WHERE path LIKE ?", ("%/" + s["file"],)).fetchone()[0]
    want = dict(db.execute("SELECT lease_owner, count(*) FROM items WHERE shard_id = ?"
                           " AND state IN ('done', 'failed') GROUP BY 1", (sid,)).fetchall())
    assert {w["run"]: w["records"] for w in s["runs"]} == want, (s, want)
by_mode = {}
for s in m["shards"]:
    for w in s["runs"]:
        by_mode[mode[w["run"]]] = by_mode.get(mode[w["run"]], 0) + w["records"]
assert by_mode["exact"] >= 8 and by_mode["exact"] + by_mode["q8"] == 120, by_mode
# each record says which engine made it (system_fingerprint: the hash of its run's engine, as
# the manifest's runs list it)
import collections, hashlib
fp_mode = {}
for run, text in db.execute("SELECT id, engine_json FROM runs WHERE engine_json IS NOT NULL"):
    fp_mode["fp_" + hashlib.sha256(text.encode()).hexdigest()[:16]] = json.loads(text)["matmul"]
assert {r["fingerprint"]: r["engine"]["matmul"] for r in m["runs"]} == fp_mode, (m["runs"], fp_mode)
got = collections.Counter(fp_mode[json.loads(l)["response"]["body"]["system_fingerprint"]]
                          for l in open("p.export.jsonl"))
assert got == by_mode, (got, by_mode)
PY

"$Q" status --db p.db --job p >status.txt
grep -q "2 engines ran this job" status.txt || { cat status.txt; fail "status text: two engines"; }
grep -q "matmul exact" status.txt && grep -q "matmul q8" status.txt ||
    { cat status.txt; fail "status text: the engines' modes"; }
"$Q" status --db p.db --job p --json | python3 -c '
import json, sys
e = json.load(sys.stdin)[0]["engines"]
assert [x["engine"]["matmul"] for x in e] == ["exact", "q8"], e
assert all(len(x["runs"]) == 1 for x in e), e
' || fail "status --json engines"

# a run from before engines were recorded (queue version 4) that worked on the job: listed as
# not recorded, not left out (the manifest, rewritten, says null)
exact_run=$(sqlite3 p.db "SELECT id FROM runs WHERE engine_json LIKE '%\"exact\"%'")
sqlite3 p.db "UPDATE runs SET engine_json = NULL WHERE id = $exact_run"
"$Q" status --db p.db --job p >status2.txt
grep -q "^    not recorded (run $exact_run)$" status2.txt || { cat status2.txt; fail "status: not recorded"; }
grep -q "2 engines ran this job" status2.txt || { cat status2.txt; fail "status: two engines (one unknown)"; }
rm out/p/manifest.json
"$Q" run --db p.db --out out >/dev/null 2>&1 || fail "run of the done job"
python3 -c "
import json, sys
m = json.load(open('out/p/manifest.json'))
e = {r['run']: r['engine'] for r in m['runs']}
assert e[$exact_run] is None and sum(x is not None for x in e.values()) == 1, e
" || fail "manifest: the unrecorded engine as null"
# a run that computed nothing for a job (--no-wait, every item leased by a live run) is no
# engine of it (status warned that two engines ran it, their outputs possibly different)
python3 -c '
import json
for i in range(16):
    print(json.dumps({"custom_id": f"w{i}", "prompt": f"Tell a long story {i}.", "max_tokens": 400,
                      "temperature": 0}))' >w.jsonl
"$Q" submit --db w.db --model "$M" --name w w.jsonl >/dev/null 2>&1
# (it holds all 16, twice --max-seqs, and computes 8 at a time: minutes of work, paced)
"$Q" run --db w.db --out out --max-seqs 8 --threads 1 --matmul exact --grace 0 >/dev/null \
    2>w.log &
pid=$!
for _ in $(seq 600); do
    [ "$(sqlite3 w.db "SELECT count(*) FROM items WHERE state = 'leased'")" = 16 ] && break
    sleep 0.1
done
rc=0; "$Q" run --db w.db --out out --no-wait --matmul q8 >/dev/null 2>w2.log || rc=$?
[ $rc = 75 ] || { cat w2.log; fail "the --no-wait run exited $rc, want 75"; }
"$Q" status --db w.db --job w --json | python3 -c '
import json, sys
e = json.load(sys.stdin)[0]["engines"]
assert [x["engine"]["matmul"] for x in e] == ["exact"], e
' || fail "status: a run that computed nothing listed as an engine of the job"
kill -TERM $pid
wait $pid 2>/dev/null || true

# run --chat-template: chat prompts in a named format instead of the model's own (SmolLM2's
# ChatML without its default system turn: shorter prompts), recorded in the run's engine
printf '{"custom_id":"c","messages":[{"role":"user","content":"Say hi."}],"max_tokens":2}\n' >c.jsonl
for t in own chatml; do
    "$Q" submit --db "c$t.db" --model "$M" --name c c.jsonl >/dev/null 2>&1
    flag=()
    [ $t = own ] || flag=(--chat-template chatml)
    "$Q" run --db "c$t.db" --out "c$t" "${flag[@]}" >/dev/null 2>&1 || fail "run ${flag[*]}"
    "$Q" export --db "c$t.db" --job c --out "c$t.jsonl" 2>/dev/null || fail "export c$t"
done
python3 - cown/c/manifest.json cchatml/c/manifest.json cown.jsonl cchatml.jsonl <<'PY' ||
import json, sys
own, named = (json.load(open(f)) for f in sys.argv[1:3])
assert "chat_template" not in own["runs"][0]["engine"], own["runs"]
assert named["runs"][0]["engine"]["chat_template"] == "chatml", named["runs"]
a, b = (json.loads(open(f).read())["response"]["body"] for f in sys.argv[3:5])
assert b["usage"]["prompt_tokens"] < a["usage"]["prompt_tokens"], (a["usage"], b["usage"])
assert a["system_fingerprint"] != b["system_fingerprint"], (a, b)
PY
    fail "run --chat-template"
# a request's chat_template_kwargs survive submit (the queue keeps requests as parsed): under
# --chat-template qwen3, enable_thinking false adds the empty reasoning block to its prompt
printf '%s\n' '{"custom_id":"t","messages":[{"role":"user","content":"Hi"}],"max_tokens":1}' \
    '{"custom_id":"f","messages":[{"role":"user","content":"Hi"}],"max_tokens":1,"chat_template_kwargs":{"enable_thinking":false}}' >q3.jsonl
"$Q" submit --db q3.db --model "$M" --name q3 q3.jsonl >/dev/null 2>&1 || fail "submit q3"
"$Q" run --db q3.db --out q3 --chat-template qwen3 >/dev/null 2>&1 || fail "run --chat-template qwen3"
"$Q" export --db q3.db --job q3 --out q3.out.jsonl 2>/dev/null || fail "export q3"
python3 - q3.out.jsonl <<'PY' || fail "enable_thinking false lost on the way to the run"
import json, sys
u = {r["custom_id"]: r["response"]["body"]["usage"]["prompt_tokens"]
     for r in map(json.loads, open(sys.argv[1]))}
assert u["f"] > u["t"], u
PY
rc=0; "$Q" run --db cown.db --chat-template vicuna >/dev/null 2>c.err || rc=$?
[ $rc = 2 ] && grep -q "unknown 'vicuna'" c.err || fail "--chat-template vicuna: exit $rc"
echo "e2e provenance: ok"
