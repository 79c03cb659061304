#!/usr/bin/env bash
# End-to-end job runner tests with the real binary and model:
#  1. examples/prompts.jsonl: submit, run, export; every custom_id exactly once, every shard
#     a valid zstd stream, the manifest's counts and sha256 match the files;
#  2. SIGTERM mid-run exits 75 within the grace period, and a rerun completes the job;
#  3. kill -9 at random moments (QUERN_CRASH_TRIALS, default 20), resuming at once each time
#     with the default 300 s lease (a dead run on this host is taken over without waiting): the
#     final export has every item exactly once and no shard holds a partial line; a run
#     killed with an open shard: the next run closes that shard and completes the manifest;
#  4. two concurrent runs on one DB: no item processed twice;
#  5. a bad input file: valid lines complete, each bad line is reported with its number, a
#     blank line is skipped (no item, no record);
#  6. the same prompts as .tar.zst and .zip give the same results as .jsonl (6b: lines without
#     custom_id in archives get distinct default ids);
#  7. `quern cancel` of a job while a run works on it: the run drops its unfinished requests
#     from the engine (items_dropped in its summary) instead of computing them to the end;
#  8. a job cancelled after a run died between a frame's fsync and its commit: the next run
#     seals its output anyway (shard cut back, manifest complete and "cancelled");
#  9-10. big cancels and retries in transactions (9b: a cancel keeps the lines rejected at
#     submit as failed, with their records); out of memory making a second choice;
# 11. three jobs on one model: read and loaded once by one run; a changed model refused.
# 12. output that cannot reach standard output is exit 1; 13. users' text on terminals
#     without control characters, paths that are not UTF-8 text refused; 14. a KV pool too
#     small for a request is the run's error (500 kv_cache_too_small), retried with a larger one;
# 15. a job that fails does not keep a run from the other jobs (exit 1, its items uncounted);
# 16. a prompt longer than the context can hold in bytes is refused without tokenizing it.
# Under sanitizers (QUERN_SANITIZE, set by `make asan test`) the same checks run on the
# first 12 examples with 5 crash trials: ASan makes every run several times slower, and
# the full-size checks run in the normal suite of the same CI job.
set -euo pipefail
. "$(dirname "$0")/lib/common.sh"
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
EX=$(realpath examples/prompts.jsonl)
TRIALS=${QUERN_CRASH_TRIALS:-20}
tmp=$(mktemp -d)
if [ -n "${QUERN_SANITIZE:-}" ]; then
    TRIALS=${QUERN_CRASH_TRIALS:-5}
    head -12 "$EX" >"$tmp/examples12.jsonl"
    EX=$tmp/examples12.jsonl
fi
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. examples end to end
"$Q" submit --db ex.db --model "$M" --name examples "$EX" >/dev/null 2>&1
"$Q" run --db ex.db --out out >run.json 2>run.log || { cat run.log; fail "run exited non-zero"; }
n_ex=$(wc -l <"$EX")
check_job ex.db examples "$n_ex"
"$Q" status --db ex.db --job examples --json | python3 -c "
import json,sys; s=json.load(sys.stdin)[0]
assert s['state']=='done' and s['by_state']['done']==$n_ex, s" || fail "status after the examples"
grep -q '"exit_reason":"drained"' run.json || fail "run summary"

# 2. SIGTERM: exit 75 within grace, rerun completes
# (paced in exact mode on one thread, ~5 s of work: SIGTERM must find the job unfinished)
make_small small.jsonl 150
"$Q" submit --db term.db --model "$M" --name term small.jsonl >/dev/null 2>&1
"$Q" run --db term.db --out out --max-seqs 4 --max-batch-tokens 64 --grace 20 --flush-secs 0.2 \
    --threads 1 --matmul exact >/dev/null 2>term.log &
pid=$!
for _ in $(seq 100); do
    "$Q" status --db term.db --job term --json 2>/dev/null | grep -q '"done":[1-9]' && break
    sleep 0.2
done
t0=$(date +%s)
kill -TERM $pid
set +e; wait $pid; rc=$?; set -e
t1=$(date +%s)
[ $rc -eq 75 ] || { cat term.log; fail "SIGTERM: exit $rc, want 75"; }
[ $((t1 - t0)) -le 25 ] || fail "SIGTERM: took $((t1 - t0)) s (grace 20)"
"$Q" status --db term.db --job term --json | grep -q '"leased":0' || fail "SIGTERM left leases"
# (the job was begun, nothing works on it now: said so, not a bare [running])
"$Q" status --db term.db --job term | grep -q "^job .* \[running, no live run\]" ||
    fail "status: a stopped job's state"
"$Q" run --db term.db --out out >/dev/null 2>&1 || fail "rerun after SIGTERM"
check_job term.db term 150

# 3. kill -9 at random moments, resume each time (paced in exact mode on one thread, so that
# the job outlasts most of the trials: checked below)
make_small crash.jsonl 400
"$Q" submit --db crash.db --model "$M" --name crash crash.jsonl >/dev/null 2>&1
# (the moments drawn from a fixed seed, QUERN_TEST_SEED to change it: a failure reproduces)
seed=${QUERN_TEST_SEED:-3}
for i in $(seq "$TRIALS"); do
    "$Q" run --db crash.db --out out --max-seqs 8 --max-batch-tokens 64 --flush-secs 0 \
        --flush-records 3 --threads 1 --matmul exact >/dev/null 2>>crash.log &
    pid=$!
    sleep "$(python3 -c "import random; random.seed($seed * 1000 + $i); print(random.uniform(0.05, 1.5))")"
    kill -9 $pid 2>/dev/null || true
    wait $pid 2>/dev/null || true
done
# default --lease 300: the killed runs are dead because their processes are gone, not because
# they were silent, so this run takes over their items and open shards at once
timeout 120 "$Q" run --db crash.db --out out >/dev/null 2>>crash.log ||
    { tail crash.log; fail "final resume"; }
dead=$(sqlite3 crash.db "SELECT count(*) FROM runs WHERE exit_reason = 'dead'")
[ "$dead" -ge $((TRIALS / 2)) ] || fail "3: only $dead of $TRIALS runs were killed mid-job (seed $seed)"
check_job crash.db crash 400

# 3b. a run killed with an open shard holding records: a resume at once, with the default
# --lease 300, sees its process is gone, takes the shard over and completes the manifest
# (paced in exact mode on one thread: the kill must find the run alive)
make_small open.jsonl 60
"$Q" submit --db open.db --model "$M" --name open open.jsonl >/dev/null 2>&1
"$Q" run --db open.db --out out --max-seqs 2 --max-batch-tokens 64 --flush-secs 0 \
    --flush-records 1 --lease 2 --threads 1 --matmul exact >/dev/null 2>>open.log &
pid=$!
for _ in $(seq 300); do
    "$Q" status --db open.db --job open --json 2>/dev/null | grep -q '"done":[1-9]' && break
    sleep 0.1
done
kill -9 $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
[ "$(sqlite3 open.db "SELECT count(*) FROM runs WHERE kind = 'run' AND ended IS NULL")" = 1 ] ||
    fail "3b: the run ended before it was killed (make the job longer)"
"$Q" run --db open.db --out out >/dev/null 2>>open.log || fail "resume with the default lease"
grep -q "dead run(s) (processes gone on this host" open.log || fail "the killed run was not found dead"
check_job open.db open 60

# 4. two concurrent runs on one DB
make_small conc.jsonl 60
"$Q" submit --db conc.db --model "$M" --name conc conc.jsonl >/dev/null 2>&1
"$Q" run --db conc.db --out out --threads 1 --max-seqs 4 --max-batch-tokens 64 --claim 4 >c1.json 2>c1.log &
p1=$!
"$Q" run --db conc.db --out out --threads 1 --max-seqs 4 --max-batch-tokens 64 --claim 4 >c2.json 2>c2.log &
p2=$!
wait $p1 || fail "concurrent run 1"
wait $p2 || fail "concurrent run 2"
check_job conc.db conc 60
python3 - c1.json c2.json <<'PY' || fail "concurrent runs: item counts"
import json, sys
a, b = (json.load(open(p))["items_done"] for p in sys.argv[1:3])
assert a + b == 60, (a, b)
PY

# 5. bad input
python3 - bad.jsonl <<'PY'
import json
lines = [
    json.dumps({"custom_id": "ok1", "prompt": "One, two,", "max_tokens": 4, "temperature": 0}),
    '{"custom_id": "broken", "prompt": ',
    b'{"custom_id": "utf8", "prompt": "\xff\xfe"}'.decode("latin-1"),
    json.dumps({"custom_id": "types", "prompt": 42}),
    json.dumps({"custom_id": "ok1", "prompt": "duplicate id"}),
    json.dumps({"custom_id": "huge", "prompt": "x " * 600000, "max_tokens": 4}),
    "",
    json.dumps({"custom_id": "toolong", "prompt": "word " * 9000, "max_tokens": 4}),
    json.dumps({"custom_id": "ok2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}),
]
with open("bad.jsonl", "wb") as f:
    for l in lines:
        f.write(l.encode("latin-1") if l.startswith('{"custom_id": "utf8"') else l.encode())
        f.write(b"\n")
PY
"$Q" submit --db bad.db --model "$M" --name bad bad.jsonl >/dev/null 2>bad.err || fail "submit of bad input"
for n in 2 3 4 5; do grep -q "bad.jsonl:$n:" bad.err || { cat bad.err; fail "line $n not reported"; }; done
grep -q "bad.jsonl:7:" bad.err && fail "blank line 7 reported as bad"
grep -q "1 blank lines skipped" bad.err || { cat bad.err; fail "blank line 7 not counted"; }
# the rejected lines as if three runs had died holding them: still their own error records
# (they became attempts_exhausted with a null custom_id; found by a kill -9 chaos audit)
python3 -c 'import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute("UPDATE items SET attempts = max_attempts WHERE payload IS NULL"); c.commit()' bad.db
"$Q" run --db bad.db --out out >/dev/null 2>bad.run || { cat bad.run; fail "run on bad input"; }
"$Q" export --db bad.db --job bad --out bad.export.jsonl --order input 2>/dev/null
# --out - and /dev/stdout are standard output (appending where the shell appends); a FIFO is
# written directly, not renamed over (as root, a rename replaced /dev/full and /dev/stdout with
# regular files); a directory is refused
"$Q" export --db bad.db --job bad --out /dev/stdout --order input 2>/dev/null >bad.stdout.jsonl ||
    fail "export to /dev/stdout"
[ -L /dev/stdout ] || fail "export replaced /dev/stdout"
cmp -s bad.export.jsonl bad.stdout.jsonl || fail "export to /dev/stdout differs from the file's"
"$Q" export --db bad.db --job bad --out - --order input 2>/dev/null >>bad.stdout.jsonl ||
    fail "export to -"
[ "$(wc -l <bad.stdout.jsonl)" = $((2 * $(wc -l <bad.export.jsonl))) ] || fail "export to - >>"
"$Q" export --db bad.db --job bad --out /dev/stderr --order input 2>bad.stderr.jsonl ||
    fail "export to /dev/stderr"
[ -L /dev/stderr ] && grep -c '"custom_id"' bad.stderr.jsonl | grep -qx "$(wc -l <bad.export.jsonl)" ||
    fail "export to /dev/stderr"
mkfifo bad.fifo
cat bad.fifo >bad.fifo.jsonl &
"$Q" export --db bad.db --job bad --out bad.fifo --order input 2>/dev/null || fail "export to a FIFO"
wait $!
[ -p bad.fifo ] && cmp -s bad.export.jsonl bad.fifo.jsonl || fail "export to a FIFO"
mkdir bad.dir
"$Q" export --db bad.db --job bad --out bad.dir 2>bad.dir.err && fail "export to a directory"
grep -q "is a directory" bad.dir.err || { cat bad.dir.err; fail "export to a directory: message"; }
# a bad job name is a usage error found before the model is hashed or the queue made
rc=0
"$Q" submit --db badname.db --model "$M" --name 'bad name' bad.jsonl 2>/dev/null || rc=$?
[ "$rc" = 2 ] && [ ! -e badname.db ] || fail "submit --name 'bad name': exit $rc"
# an option of another command is refused (exit 2), not ignored
for args in "status --failed" "status --progress 5" "cancel --job bad --failed"; do
    rc=0
    "$Q" $args --db bad.db 2>/dev/null || rc=$?
    [ "$rc" = 2 ] || fail "$args: exit $rc, want 2"
done
# a compression quern does not write is refused (it wrote plain JSONL under .gz before)
rc=0
"$Q" export --db bad.db --job bad --out bad.jsonl.gz 2>/dev/null || rc=$?
[ "$rc" = 2 ] && [ ! -e bad.jsonl.gz ] || fail "export to .jsonl.gz: exit $rc"
python3 - bad.export.jsonl <<'PY' || fail "bad input: export"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert len(recs) == 8, len(recs)
ok = {r["custom_id"]: r for r in recs if r["response"] and r["response"]["status_code"] == 200}
assert set(ok) == {"ok1", "ok2"}, sorted(ok)
codes = {r["custom_id"]: r["response"]["body"]["error"]["code"] for r in recs
         if r["response"] and r["response"]["status_code"] == 400}
# a 1 MB line is accepted at submit; its 600k-token prompt cannot fit the 8k context
assert codes.get("huge") == "context_length_exceeded", codes
assert codes.get("toolong") == "context_length_exceeded", codes
# a line keeps its own custom_id when the scan read it whole, even if the line breaks later
assert codes.get("broken") == "invalid_json" and codes.get("utf8") == "invalid_utf8", codes
assert codes.get("types") == "invalid_type", codes
# a duplicate's record has a null custom_id (its first line's record owns the name), its error
# names the line and the id
dup = [r for r in recs if r["custom_id"] is None]
assert len(dup) == 1, dup
e = dup[0]["response"]["body"]["error"]
assert e["code"] == "duplicate_custom_id" and e["param"] == "custom_id", e
assert "bad.jsonl:5:" in e["message"] and "ok1" in e["message"], e
# each rejected line's error names the field it is about, as a run's parse error does (it was
# null: the field was not stored)
params = {r["custom_id"]: r["response"]["body"]["error"]["param"] for r in recs
          if r["response"] and r["response"]["status_code"] == 400}
assert params.get("types") == "prompt", params
# (lines 2 and 3 break inside the prompt's value: bad JSON there, bad UTF-8 there)
assert params.get("broken") == "prompt" and params.get("utf8") == "prompt", params
# (too long for the model, found by the run: the error names the prompt, as OpenAI's does; it
# was null, and the message blamed a max_tokens the line did not set when its prompt filled the
# context alone)
assert params.get("toolong") == "prompt" and params.get("huge") == "prompt", params
toolong = [r for r in recs if r["custom_id"] == "toolong"][0]["response"]["body"]["error"]
assert "leaves no room for output in the model context (8192)" in toolong["message"], toolong
# no two records share an id or a request_id
assert len({r["id"] for r in recs}) == len(recs), recs
assert len({r["response"]["request_id"] for r in recs}) == len(recs), recs
PY

# 5b. a bad line takes no name from the others: neither the custom_id a later line gives (a
# garbage line 2 was stored as "line-2", and the valid line named "line-2" was then refused as
# its duplicate), nor one an earlier line has (two records named "line-3")
python3 - names.jsonl <<'PY'
import json, sys
ok = lambda cid: json.dumps({"custom_id": cid, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
lines = [ok("line-3"), "garbage", json.dumps({"prompt": "x", "max_tokens": 0}), ok("line-2"),
         '{"custom_id": "kept", "prompt": "\\ud800"}', '{"custom_id": "taken", "prompt": "a",}',
         ok("taken")]
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY
"$Q" submit --db names.db --model "$M" --name names names.jsonl >/dev/null 2>names.err ||
    fail "5b: submit"
grep -q "duplicate" names.err && { cat names.err; fail "5b: a valid line was refused as a duplicate"; }
"$Q" run --db names.db --out out >/dev/null 2>&1 || fail "5b: run"
"$Q" export --db names.db --job names --out names.export.jsonl --order input 2>/dev/null ||
    fail "5b: export"
python3 - names.export.jsonl <<'PY' || fail "5b: records"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert len(recs) == 7, recs
ok = sorted(r["custom_id"] for r in recs if r["response"]["status_code"] == 200)
assert ok == ["line-2", "line-3", "taken"], ok  # (a valid line takes its id from a broken one)
err = {(r["custom_id"], r["response"]["body"]["error"]["code"],
        r["response"]["body"]["error"]["message"].split(" ")[0])
       for r in recs if r["response"]["status_code"] == 400}
assert err == {(None, "invalid_json", "names.jsonl:2:"), (None, "invalid_value", "names.jsonl:3:"),
               ("kept", "invalid_utf8", "names.jsonl:5:"), (None, "invalid_json", "names.jsonl:6:")}, err
assert len({r["id"] for r in recs}) == 7 and len({r["response"]["request_id"] for r in recs}) == 7
PY

# 5c. a line without max_tokens whose prompt leaves less room than the job's default runs with
# what the context leaves (it was refused: context_length_exceeded); one that gives max_tokens
# is still held to it
python3 - ctx.jsonl <<'PY'
import json, sys
msg = [{"role": "user", "content": "Reply with the single word: hi"}]
stop = [" ", "\n", ".", "!"]
with open(sys.argv[1], "w") as f:
    print(json.dumps({"custom_id": "dflt", "messages": msg, "temperature": 0, "stop": stop}), file=f)
    print(json.dumps({"custom_id": "given", "messages": msg, "temperature": 0, "stop": stop,
                      "max_tokens": 8190}), file=f)
    print(json.dumps({"custom_id": "full", "messages": [{"role": "user", "content": "word " * 9000}]}),
          file=f)
PY
"$Q" submit --db ctx.db --model "$M" --name ctx --max-tokens 8190 ctx.jsonl >/dev/null 2>&1 ||
    fail "5c: submit"
"$Q" run --db ctx.db --out out >/dev/null 2>&1 || fail "5c: run"
"$Q" export --db ctx.db --job ctx --out ctx.export.jsonl 2>/dev/null || fail "5c: export"
python3 - ctx.export.jsonl <<'PY' || fail "5c: records"
import json, sys
r = {json.loads(l)["custom_id"]: json.loads(l)["response"] for l in open(sys.argv[1])}
assert r["dflt"]["status_code"] == 200, r["dflt"]
assert r["given"]["status_code"] == 400, r["given"]
assert r["given"]["body"]["error"]["code"] == "context_length_exceeded", r["given"]
assert r["given"]["body"]["error"]["param"] == "messages", r["given"]  # (as OpenAI's)
e = r["full"]["body"]["error"]
assert e["param"] == "messages" and "leaves no room for output" in e["message"], e
PY

# 6. archives give the same results as plain JSONL
make_small arc.jsonl 12
mkdir -p arcdir && cp arc.jsonl arcdir/part.jsonl
tar --zstd -cf arc.tar.zst -C arcdir part.jsonl
(cd arcdir && python3 -c "import zipfile; z=zipfile.ZipFile('../arc.zip','w'); z.write('part.jsonl'); z.close()")
for f in arc.jsonl arc.tar.zst arc.zip; do
    name=a-${f//./-}
    "$Q" submit --db arc.db --model "$M" --name "$name" "$f" >/dev/null 2>&1
    "$Q" run --db arc.db --out out --job "$name" >/dev/null 2>&1 || fail "run $f"
    "$Q" export --db arc.db --job "$name" --out "$name.jsonl" --order input 2>/dev/null
done
python3 - a-arc-jsonl.jsonl a-arc-tar-zst.jsonl a-arc-zip.jsonl <<'PY' || fail "archives differ"
import json, sys
def texts(p):
    return {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"]["choices"][0]["text"]
            for l in open(p)}
base = texts(sys.argv[1])
assert len(base) == 12
for p in sys.argv[2:]:
    assert texts(p) == base, p
PY
# 6b. (found by an output audit) lines without custom_id in archives get distinct default ids:
# two members of one archive both had "line-1", as had one member name in two archives given
# together, and the second line was refused as a duplicate
mkdir -p noid d1 d2
echo '{"prompt": "hi", "max_tokens": 1}' >noid/a.jsonl
cp noid/a.jsonl noid/b.jsonl
tar -cf d1/day.tar -C noid a.jsonl b.jsonl
cp d1/day.tar d2/day.tar
"$Q" submit --db noid1.db --name n1 --model "$M" d1/day.tar >/dev/null 2>&1 || fail "6b: submit"
[ "$(sqlite3 noid1.db "SELECT group_concat(custom_id, ' ') FROM items WHERE error_code IS NULL")" = \
    "a.jsonl:line-1 b.jsonl:line-1" ] || fail "6b: the ids in one archive"
"$Q" submit --db noid2.db --name n2 --model "$M" d1/day.tar d2/day.tar >/dev/null 2>&1 ||
    fail "6b: submit of two archives"
[ "$(sqlite3 noid2.db "SELECT count(DISTINCT custom_id) FROM items WHERE error_code IS NULL")" = 4 ] ||
    fail "6b: the ids in two archives: $(sqlite3 noid2.db "SELECT custom_id, error_code FROM items")"

# 7. cancel while a run works: the run drops what it has in flight. 200 requests of 2 to 48
# tokens; the cancel comes once the first records are committed.
NC=200
python3 - $NC >cx.jsonl <<'PY'
import json, sys
for i in range(int(sys.argv[1])):
    print(json.dumps({"custom_id": f"c{i}", "prompt": f"Item {i}: the number after {i} is",
                      "max_tokens": 2 + (i * 7) % 47, "temperature": 0}))
PY
"$Q" submit --db cx.db --model "$M" --name cx cx.jsonl >/dev/null 2>&1
"$Q" run --db cx.db --out out --threads 1 --flush-records 2 --flush-secs 0.2 >cx.json 2>cx.log &
px=$!
for _ in $(seq 1 600); do
    d=$("$Q" status --db cx.db --json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["by_state"].get("done", 0))')
    [ "$d" -ge 1 ] && break
    kill -0 $px 2>/dev/null || break
    sleep 0.2
done
"$Q" cancel --db cx.db --job cx >/dev/null 2>&1 || fail "cancel of a running job"
wait $px || true
python3 - <<'PY' || { cat cx.log >&2; fail "the run computed a cancelled job on"; }
import json
s = json.load(open("cx.json"))
assert 0 < s["items_done"] and s["items_dropped"] > 0 and s["records_discarded"] >= 0, s
PY
grep -q "unfinished requests dropped" cx.log || fail "no drop in the run's log"
python3 -c "
import json; m = json.load(open('out/cx/manifest.json'))
assert m['complete'] is True and m.get('cancelled') is True, m" ||
    fail "7: the manifest written by the run that saw the cancel"
"$Q" status --db cx.db --json | python3 -c "
import json,sys; s=json.load(sys.stdin)[0]
assert s['state']=='cancelled' and s['by_state']['cancelled'] > 0, s" || fail "status after cancel"

# 8. a run killed between a frame's fsync and its queue commit, then the job cancelled: the next
# run still seals the output, cutting the dead run's shard back to what was committed and
# writing a manifest (complete, "cancelled"), so the files hold exactly the committed records
make_small kc.jsonl 40
"$Q" submit --db kc.db --model "$M" --name kc kc.jsonl >/dev/null 2>&1
set +e
# (at the third frame's fsync: written, not committed)
QUERN_FAULT=shard.fsync:3:kill "$Q" run --db kc.db --out out --threads 1 --max-seqs 4 \
    --flush-secs 0 --flush-records 4 >/dev/null 2>kc.log
rc=$?
set -e
[ $rc -eq 137 ] || { tail kc.log; fail "8: the run was not killed at its third frame ($rc)"; }
# the kill must leave an open shard longer than its committed part (else: move the point)
sqlite3 kc.db "SELECT path, committed_bytes FROM shards WHERE state = 'open'" | {
    IFS='|' read -r path committed || fail "8: no open shard after the kill"
    [ "$(stat -c %s "$path")" -gt "$committed" ] || fail "8: no uncommitted tail after the kill"
}
"$Q" cancel --db kc.db --job kc >/dev/null 2>&1 || fail "8: cancel"
"$Q" run --db kc.db --out out >/dev/null 2>>kc.log || { tail kc.log; fail "8: run after cancel"; }
python3 - kc.db out/kc <<'PY' || { tail kc.log; fail "8: the cancelled job's output is not sealed"; }
import json, sqlite3, subprocess, sys
db = sqlite3.connect(sys.argv[1])
assert db.execute("SELECT count(*) FROM shards WHERE state = 'open'").fetchone()[0] == 0
done = db.execute("SELECT count(*) FROM items WHERE state IN ('done', 'failed')").fetchone()[0]
m = json.load(open(sys.argv[2] + "/manifest.json"))
assert m["complete"] is True and m["cancelled"] is True, m
lines = 0
for sh in m["shards"]:
    out = subprocess.run(["zstd", "-q", "-dc", sys.argv[2] + "/" + sh["file"]], check=True,
                         capture_output=True).stdout.decode()
    assert out.count("\n") == sh["records"], (sh, out.count("\n"))
    lines += sh["records"]
assert 0 < done < 40 and lines == done, (lines, done)
PY
"$Q" status --db kc.db --job kc >/dev/null 2>&1 || fail "8: status"

# 9. a big cancel goes in transactions of 20,000 items (a single one held the queue's lock for
#    a minute at 5M items, and runs sharing the queue failed): killed after its first one, the
#    job is still live with 20,000 items cancelled, and a second cancel finishes it; the same
#    for retry --failed.
python3 -c '
for i in range(20005):
    print("{\"custom_id\": \"b%d\", \"prompt\": \"hi\", \"max_tokens\": 1}" % i)' >big.jsonl
"$Q" submit --db kb.db --name kb --model "$M" big.jsonl >/dev/null 2>&1 || fail "9: submit"
set +e
QUERN_FAULT=queue.cancel:1:kill "$Q" cancel --db kb.db --job kb >/dev/null 2>kb.log
rc=$?
set -e
[ $rc -eq 137 ] || { cat kb.log; fail "9: the cancel was not killed after its first batch ($rc)"; }
[ "$(sqlite3 kb.db "SELECT state FROM jobs")" = queued ] || fail "9: a half-done cancel ended the job"
[ "$(sqlite3 kb.db "SELECT count(*) FROM items WHERE state = 'cancelled'")" = 20000 ] ||
    fail "9: not 20,000 items cancelled by the first transaction"
"$Q" cancel --db kb.db --job kb 2>kb.log || { cat kb.log; fail "9: second cancel"; }
grep -q "5 items cancelled" kb.log || { cat kb.log; fail "9: the second cancel's count"; }
[ "$(sqlite3 kb.db "SELECT state FROM jobs")" = cancelled ] || fail "9: the job is not cancelled"
[ "$(sqlite3 kb.db "SELECT count(*) FROM items WHERE state <> 'cancelled'")" = 0 ] ||
    fail "9: items left uncancelled"
# retry --failed likewise (20,000 item ids per transaction): the same items made failed
sqlite3 kb.db "UPDATE items SET state = 'failed'; UPDATE jobs SET state = 'done'"
set +e
QUERN_FAULT=queue.retry:1:kill "$Q" retry --db kb.db --job kb --failed >/dev/null 2>kb.log
rc=$?
set -e
[ $rc -eq 137 ] || { cat kb.log; fail "9: the retry was not killed after its first batch ($rc)"; }
[ "$(sqlite3 kb.db "SELECT state, count(*) FROM items GROUP BY 1 ORDER BY 1" | tr '\n' ' ')" = \
    "failed|5 queued|20000 " ] || fail "9: not 20,000 items retried by the first transaction"
[ "$(sqlite3 kb.db "SELECT state FROM jobs")" = running ] || fail "9: the job was not reopened"
"$Q" retry --db kb.db --job kb --failed 2>kb.log || { cat kb.log; fail "9: second retry"; }
grep -q "5 items queued again" kb.log || { cat kb.log; fail "9: the second retry's count"; }

# 9b. (found by an output audit) a cancel keeps the lines rejected at submit: their error is
# their answer, not work to cancel (they became "cancelled" and their records were never written)
printf '%s\n' '{"custom_id": "bad1", "messages": "x"}' \
    '{"custom_id": "ok1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}' >cr.jsonl
"$Q" submit --db cr.db --name cr --model "$M" cr.jsonl >/dev/null 2>&1 || fail "9b: submit"
"$Q" cancel --db cr.db --job cr >/dev/null 2>&1 || fail "9b: cancel"
"$Q" run --db cr.db --out out >/dev/null 2>&1 || fail "9b: run"
"$Q" export --db cr.db --job cr --out cr.out.jsonl 2>/dev/null || fail "9b: export"
python3 - "$Q" <<'PY' || fail "9b: the rejected line's record after a cancel"
import json, subprocess, sys
recs = [json.loads(l) for l in open("cr.out.jsonl")]
assert [(r["custom_id"], r["response"]["status_code"]) for r in recs] == [("bad1", 400)], recs
assert recs[0]["response"]["body"]["error"]["code"] == "invalid_type", recs
s = json.loads(subprocess.run([sys.argv[1], "status", "--db", "cr.db", "--json"], check=True,
                              capture_output=True).stdout)[0]
assert s["state"] == "cancelled" and s["by_state"]["failed"] == 1 and s["by_state"]["cancelled"] == 1, s
PY
# (a bundle of it has no manifest: none is written for a job cancelled before any output, and
# export said a run would write one)
"$Q" export --db cr.db --job cr --out cr.tar 2>cr.tar.log || fail "9b: export of a bundle"
grep -q "cancelled before any run wrote its output" cr.tar.log || { cat cr.tar.log; fail "9b: bundle"; }

# 9c. a retry says why the lines rejected at submit stay failed (it printed "0 items queued
# again" and nothing more)
"$Q" submit --db rr.db --name rr --model "$M" cr.jsonl >/dev/null 2>&1 || fail "9c: submit"
"$Q" run --db rr.db --out out >/dev/null 2>&1 || fail "9c: run"
"$Q" retry --db rr.db --job rr --failed 2>rr.log || { cat rr.log; fail "9c: retry"; }
grep -q "0 items queued again" rr.log && grep -q "1 failed items stay failed: lines rejected at submit" rr.log ||
    { cat rr.log; fail "9c: the retry's message"; }

# 10. out of memory making a request's second choice (QUERN_FAULT=engine.seq_new: the run's
#     third request made, after its start-up's and the first choice's; n = 2): the
#     request fails with an error record and the run ends normally (the choice already made
#     was freed, and with it the choices' shared prompt gate, which was then read and freed
#     again: under ASan, a use after free)
echo '{"custom_id":"n2","prompt":"hi","max_tokens":3,"n":2,"temperature":1}' >n2.jsonl
"$Q" submit --db n2.db --name n2 --model "$M" n2.jsonl >/dev/null 2>&1 || fail "10: submit"
QUERN_FAULT=engine.seq_new:3:fail "$Q" run --db n2.db --out out --threads 1 >/dev/null \
    2>n2.log || { cat n2.log; fail "10: the run"; }
! grep -q -e AddressSanitizer -e 'runtime error' n2.log || { cat n2.log; fail "10: sanitizer"; }
"$Q" export --db n2.db --job n2 --out n2out.jsonl 2>/dev/null || fail "10: export"
grep -q '"custom_id":"n2".*"message":"no memory"' n2out.jsonl || fail "10: no error record"
# 10b. out of memory growing a sequence's tokens, text or log-probabilities during a step (an
#     audit: abort(), exit 134, the items' attempts spent until attempts_exhausted): the run
#     ends with exit 1 and gives its items back unspent; the next run finishes them
make_small oom.jsonl 4
"$Q" submit --db oom.db --name oom --model "$M" oom.jsonl >/dev/null 2>&1 || fail "10b: submit"
rc=0
QUERN_FAULT=engine.seq_room:5:fail "$Q" run --db oom.db --out out --threads 1 >/dev/null \
    2>oom.log || rc=$?
[ $rc = 1 ] && grep -q "out of memory for the generated tokens" oom.log || { cat oom.log; fail "10b: exit $rc"; }
[ "$(sqlite3 oom.db "SELECT count(*) FROM items WHERE state = 'queued' AND attempts = 0")" = 4 ] ||
    fail "10b: items not given back unspent: $(sqlite3 oom.db "SELECT state, attempts FROM items")"
"$Q" run --db oom.db --out out --threads 1 >/dev/null 2>&1 || fail "10b: the second run"
check_job oom.db oom 4
# 10c. the shell's limits (an audit): a soft stack limit of 256 KiB is raised (the kernels keep
#     256 KiB tiles on the stack: SIGSEGV); a soft CPU-time limit's SIGXCPU stops the run like
#     SIGTERM (exit 75, the items given back unspent; it killed the run, attempts spent); a
#     file-size limit the queue is past fails the run with exit 1 and a word on it (SIGXFSZ
#     killed it silently)
python3 -c 'import json
for i in range(48):
    print(json.dumps({"custom_id": f"x{i}", "prompt": f"Write a story about {i}.", "max_tokens": 64,
                      "temperature": 0}))' >xcpu.jsonl
"$Q" submit --db xcpu.db --name xcpu --model "$M" xcpu.jsonl >/dev/null 2>&1 || fail "10c: submit"
(ulimit -S -s 256 && "$Q" generate --model "$M" --prompt hi --max-tokens 2 --threads 2 >/dev/null 2>&1) ||
    fail "10c: generate under ulimit -S -s 256"
rc=0
(ulimit -S -t 1 && ulimit -H -t 60 &&
    exec "$Q" run --db xcpu.db --out out --threads 1 --max-seqs 4 >/dev/null 2>xcpu.log) || rc=$?
[ $rc = 75 ] || { cat xcpu.log; fail "10c: a run under a soft CPU-time limit: exit $rc, want 75"; }
[ "$(sqlite3 xcpu.db "SELECT count(*) FROM items WHERE state <> 'done' AND attempts > 0")" = 0 ] ||
    fail "10c: items' attempts spent: $(sqlite3 xcpu.db "SELECT state, attempts, count(*) FROM items GROUP BY 1, 2")"
rc=0
(ulimit -S -f 16 && exec "$Q" run --db xcpu.db --out out --threads 1 >/dev/null 2>fsize.log) || rc=$?
[ $rc = 1 ] && grep -q "file too large: the file-size limit" fsize.log ||
    { cat fsize.log; fail "10c: ulimit -f: exit $rc, want 1 and the reason"; }
# 11. three jobs on one model in one run: the file is read and loaded once (the queue knows it
# by its identity once hashed: submit and run skip it; the run keeps the model loaded), each
# job's records exactly once; a model file changed after submit is still refused
cp "$M" multi.gguf
sleep 2.2 # (a file changed within 2 s is hashed, not recorded)
for k in 1 2 3; do
    make_small multi$k.jsonl 3
    "$Q" submit --db multi.db --model multi.gguf --name m$k multi$k.jsonl >/dev/null 2>&1 ||
        fail "11: submit m$k"
done
"$Q" run --db multi.db --out out >/dev/null 2>multi.log || { cat multi.log; fail "11: the run"; }
grep -q "multi.gguf: unchanged since it was hashed" multi.log || { cat multi.log; fail "11: hashed"; }
[ "$(grep -c "multi.gguf still loaded" multi.log)" = 2 ] || { cat multi.log; fail "11: reloaded"; }
for k in 1 2 3; do check_job multi.db m$k 3; done
# a model file that changed while it was loaded (the fault site says so) is loaded again for
# the next job (that run crashed: the kept model had no path)
for k in 5 6; do
    "$Q" submit --db multi.db --model multi.gguf --name m$k multi1.jsonl >/dev/null 2>&1 ||
        fail "11: submit m$k"
done
QUERN_FAULT=run.model_changed:1:fail "$Q" run --db multi.db --out out >/dev/null 2>multi56.log ||
    { cat multi56.log; fail "11: the run after a model changed under its load"; }
! grep -q "still loaded" multi56.log || { cat multi56.log; fail "11: a changed model was kept"; }
for k in 5 6; do check_job multi.db m$k 3; done
"$Q" submit --db multi.db --model multi.gguf --name m4 multi1.jsonl >/dev/null 2>&1 ||
    fail "11: submit m4"
printf x >>multi.gguf
"$Q" run --db multi.db --out out >/dev/null 2>multi4.log && fail "11: a changed model was used"
grep -q "changed since the job was submitted" multi4.log || { cat multi4.log; fail "11: message"; }

# 12. (found by an environment audit) what a command prints must reach standard output: a full
# disk or a closed descriptor there was exit 0 (a submit's job id, status --json, a run's summary)
for args in "status --db multi.db --json" "status --db multi.db" "--version"; do
    rc=0; "$Q" $args >/dev/full 2>full.err || rc=$?
    [ $rc = 1 ] && grep -q "writing standard output" full.err || fail "12: $args >/dev/full: exit $rc"
done
rc=0; "$Q" submit --db full.db --model "$M" multi1.jsonl >&- 2>full.err || rc=$?
[ $rc = 1 ] || fail "12: submit with standard output closed: exit $rc"
# 13. (found by an output audit) users' text reaches a terminal without control characters (a
# custom_id or field name with ESC ] 0 ; set the title, OSC 52 the clipboard, newlines forged
# log lines), and a model path or output root that is not UTF-8 text is refused at submit (it
# made manifest.json and status --json invalid UTF-8)
printf '%s\n' '{"custom_id": "d\u001b]0;T\u0007", "prompt": "hi", "max_tokens": 1}' \
    '{"custom_id": "d\u001b]0;T\u0007", "prompt": "hi", "max_tokens": 1}' \
    '{"prompt": "x", "max_tokens": 1, "f\u001b[2J\n\u009b": 1}' >esc.jsonl
"$Q" submit --db esc.db --model "$M" esc.jsonl >/dev/null 2>esc.err || fail "13: submit"
python3 - <<'PY' || { cat -v esc.err; fail "13: control characters on the terminal"; }
err = open("esc.err", "rb").read()
assert not any(b < 0x20 and b not in (0x09, 0x0a) for b in err) and b"\xc2\x9b" not in err, err
assert err.count(b"\n") == 3, err  # two warnings and the summary: no forged lines
assert b"d\\x1b]0;T\\x07" in err and b"\\x0a\\u009b" in err, err
PY
cp "$M" "$(printf 'bad\xff.gguf')"
rc=0; "$Q" submit --db utf.db --model "$(printf 'bad\xff.gguf')" multi1.jsonl >/dev/null 2>utf.err || rc=$?
[ $rc = 1 ] && grep -q "is not UTF-8 text" utf.err || fail "13: a model path that is not UTF-8: exit $rc"
rm -f "$(printf 'bad\xff.gguf')"
# 14. (found by a CLI audit) a request the model's context holds but this run's --kv-mem pool
# cannot is the run's limit, not the request's: 500 kv_cache_too_small (it was a 400
# context_length_exceeded), answered by retry --failed and a run with a larger pool
echo '{"custom_id": "k1", "prompt": "hi", "max_tokens": 100}' >kv.jsonl
"$Q" submit --db kv.db --name kv --model "$M" kv.jsonl >/dev/null 2>&1 || fail "14: submit"
"$Q" run --db kv.db --out out --kv-mem 1M >/dev/null 2>&1 || fail "14: run with a small pool"
"$Q" export --db kv.db --job kv --out kv1.out.jsonl 2>/dev/null || fail "14: export"
grep -q '"status_code":500,.*"code":"kv_cache_too_small"' kv1.out.jsonl || fail "14: $(cat kv1.out.jsonl)"
"$Q" retry --db kv.db --job kv --failed 2>/dev/null && "$Q" run --db kv.db --out out >/dev/null 2>&1 ||
    fail "14: retry and run"
"$Q" export --db kv.db --job kv --out kv2.out.jsonl 2>/dev/null || fail "14: export after retry"
grep -q '"custom_id":"k1","response":{"status_code":200' kv2.out.jsonl || fail "14: $(cat kv2.out.jsonl)"
# 15. (found by a storage audit) a job that fails (here its model file is gone; a full or
# removed output directory the same) does not keep a run from the other jobs: they are done,
# the run exits 1 naming the failed job, whose items wait in the queue uncounted
cp "$M" gone.gguf
"$Q" submit --db two.db --name first --model gone.gguf kv.jsonl >/dev/null 2>&1 || fail "15: submit"
"$Q" submit --db two.db --name second --model "$M" kv.jsonl >/dev/null 2>&1 || fail "15: submit"
rm gone.gguf
rc=0; "$Q" run --db two.db --out out >/dev/null 2>two.err || rc=$?
[ $rc = 1 ] && grep -q "job first failed: .*going on with the other jobs" two.err ||
    { cat two.err; fail "15: a failing job: exit $rc"; }
"$Q" status --db two.db --json | python3 -c "
import json, sys
s = {j['name']: j for j in json.load(sys.stdin)}
assert s['second']['state'] == 'done' and s['second']['by_state']['done'] == 1, s
assert s['first']['by_state']['queued'] == 1, s" || fail "15: the other job was not run"
# (status says the last run failed and why, without its log)
"$Q" status --db two.db | grep -q "^last run [0-9]* on .* failed .* ago: job first: model .*gone.gguf" ||
    { "$Q" status --db two.db; fail "15: status does not say why the last run failed"; }
# 16. (input audit) a prompt more bytes than the context could hold at the longest token text is
# refused untokenized (a 64 MB one took 27 s and 2.2 GB to tokenize, only to be refused)
python3 -c "
import json
print(json.dumps({'custom_id': 'huge', 'prompt': 'word ' * 400000, 'max_tokens': 2}))" >huge.jsonl
"$Q" submit --db huge.db --name huge --model "$M" huge.jsonl >/dev/null 2>&1 || fail "16: submit"
"$Q" run --db huge.db --out out >/dev/null 2>&1 || fail "16: run"
"$Q" export --db huge.db --job huge --out huge.out.jsonl 2>/dev/null || fail "16: export"
grep -q '"message":"the prompt.s 2000000 bytes are more than the model.s context of 8192 tokens can hold.*"param":"prompt","code":"context_length_exceeded"' huge.out.jsonl ||
    fail "16: $(cut -c1-400 huge.out.jsonl)"

# 17. (found by an invariance audit: a run never said it preempted) a run whose KV pool is
# small for its load preempts sequences and computes them again later: its summary counts them,
# and its records are those of a run with room
head -16 "$EX" >pre.jsonl
for kv in 8M 256M; do
    "$Q" submit --db "pre$kv.db" --name pre --model "$M" pre.jsonl >/dev/null 2>&1 || fail "17: submit"
    "$Q" run --db "pre$kv.db" --out "pre$kv" --max-seqs 16 --kv-mem "$kv" --threads 1 \
        >"pre$kv.sum" 2>"pre$kv.log" || { cat "pre$kv.log"; fail "17: run --kv-mem $kv"; }
    "$Q" export --db "pre$kv.db" --job pre --order input --out "pre$kv.jsonl" 2>/dev/null ||
        fail "17: export"
done
python3 - <<'PY' || fail "17: preemptions"
import json
small = json.loads(open("pre8M.sum").read().strip().splitlines()[-1])
big = json.loads(open("pre256M.sum").read().strip().splitlines()[-1])
assert small["preemptions"] > 0 and big["preemptions"] == 0, (small, big)
def choices(name):
    return [(json.loads(l)["custom_id"], json.loads(l)["response"]["body"]["choices"])
            for l in open(name)]
assert choices("pre8M.jsonl") == choices("pre256M.jsonl"), "records differ"
PY
echo "e2e jobs: ok"
