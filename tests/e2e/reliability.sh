#!/usr/bin/env bash
# The runner reliability issue's reports, each reproduced as reported (each failed before its
# fix; export's record identity and submit are tested in export_identity.sh and
# submit_reliability.sh):
#  1. resume right after kill -9 gets straight back to work (no 300 s lease wait, not "drained")
#     and exits 0 only when every item is finished; with other runs holding items a run waits
#     for them (exit 0 after) or, with --no-wait, exits 75; 1c: a job submitted while a run
#     works is worked by it before it exits "drained";
#  2. retry --failed after a line rejected at submit: the rerun does not crash, the line is not
#     queued again, export accounts for both lines;
#  4. a shard taken over by another run (as a run on another host would after a missed lease):
#     the owner ends that shard, writes its records to a new one, and the job completes;
#  5. a run that stalls (SIGSTOP) past its own lease resumes without re-claiming its own items;
#  6. a run stalled past its lease while another run takes its items over drops them from its
#     engine when it resumes (it does not compute what it can no longer commit);
#  7. output location: shards stored absolute, resume from another directory, submit --out is
#     the job's output root, a resume with another --out is refused (no split), also when two
#     runs start together (7d);
#  8. no clobbering: a second database's job with the same name and --out is refused and the
#     first job's shards are untouched; a symlink planted at a shard path is not followed;
#  9. a done job whose manifest is missing or stale is given one by the next run or status; 9b:
#     two runs write a job's manifest one at a time, from the queue as it is then;
# 10. `run --db typo.db` is an error (no file created) unless --create; SIGHUP and SIGPIPE (a
#     closed stderr reader) stop a run like SIGTERM: leases given back;
# 11. a run stalled past its --lease, whose expired leases went back to the queue, claims its
#     own items again when it resumes: each is still computed and committed once;
# 12. a run SIGKILLed during its grace (a scheduler's KillWait) costs its items no attempt;
#     12b: the stop gives back at once the requests the engine had not started;
# 15. a run killed (-9) holds twice as many items as its engine runs: only those whose
#     computation had begun spend an attempt, and three such crashes in a row still fail the
#     requests in compute each time as attempts_exhausted, and no other (nor a line answered
#     with an error record not committed yet);
# hold_lock DB SECONDS: another process holds DB's write lock for SECONDS (in the background,
# $holder); returns once it does
hold_lock() {
    rm -f locked
    python3 - "$1" "$2" <<'PY' &
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
open("locked", "w").close()
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
PY
    holder=$!
    for _ in $(seq 100); do [ -e locked ] && return 0; sleep 0.1; done
    fail "no lock taken on $1"
}
# 13. a stop signal while another process holds the queue locked exits 75 at once;
# 14. `nohup quern run` ignores SIGHUP.
set -euo pipefail
. "$(dirname "$0")/lib/common.sh"
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
N1=240
[ -n "${QUERN_SANITIZE:-}" ] && N1=60
tmp=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }
json_field() { python3 -c "import json,sys; print(json.load(open('$1'))$2)"; }
wait_leased() { # wait_leased DB: until a run holds items of DB (30 s at most)
    for _ in $(seq 600); do
        [ "$(sqlite3 "$1" "SELECT count(*) FROM items WHERE state = 'leased'" 2>/dev/null)" \
            -gt 0 ] 2>/dev/null && return 0
        sleep 0.05
    done
}
wait_done() { # wait_done DB JOB MIN: until at least MIN items are done
    for _ in $(seq 600); do
        "$Q" status --db "$1" --job "$2" --json 2>/dev/null |
            python3 -c "import json,sys; sys.exit(0 if json.load(sys.stdin)[0]['by_state']['done'] >= $3 else 1)" &&
            return 0
        sleep 0.1
    done
    fail "$2: fewer than $3 items done in time"
}

# 1. kill -9, then resume at once with the default --lease 300
make_small one.jsonl $N1
"$Q" submit --db one.db --model "$M" --name one one.jsonl >/dev/null 2>&1
# (commits every 0.3 s: with the default 5 s a fast machine finished the whole job before its
# first commit, and there was nothing left to kill; paced in exact mode on one thread, ~4 s of
# work here: in the default mode the job took ~1.3 s and a CI machine finished it between the
# first commit being seen and the kill)
"$Q" run --db one.db --out out --max-seqs 16 --flush-secs 0.3 --threads 1 --matmul exact \
    >/dev/null 2>one.log &
pid=$!
wait_done one.db one 1
kill -9 $pid
wait $pid 2>/dev/null || true
# (read the file directly: status would already take the dead run's leases back)
python3 -c "import sqlite3; import sys; sys.exit(0 if sqlite3.connect('one.db').execute(
    \"SELECT count(*) FROM items WHERE state = 'leased'\").fetchone()[0] > 0 else 1)" ||
    fail "1: the killed run held no leases (test did not kill mid-run)"
t0=$(date +%s)
timeout 250 "$Q" run --db one.db --out out --max-seqs 16 >one.json 2>>one.log ||
    { tail one.log; fail "1: resume exited non-zero"; }
[ "$(json_field one.json "['exit_reason']")" = drained ] || fail "1: resume exit_reason"
[ "$(json_field one.json "['items_done']")" -gt 0 ] || fail "1: resume did no work"
grep -q "dead run(s) (processes gone on this host" one.log || fail "1: the dead run was not taken over"
check_job one.db one $N1
echo "1: resumed after kill -9 in $(($(date +%s) - t0)) s"

# 1b. items held by another live run: --no-wait exits 75, the default waits and exits 0
python3 - <<'PY'
import json
with open("wait.jsonl", "w") as f:
    for i in range(24):
        f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"Count: {i}, {i + 1}, {i + 2},",
                            "max_tokens": 64, "temperature": 0}) + "\n")
PY
"$Q" submit --db wait.db --model "$M" --name wait wait.jsonl >/dev/null 2>&1
# (24 x 64 tokens of counting, which never ends early, in exact mode on one thread: the run
# still holds leases when --no-wait looks)
"$Q" run --db wait.db --out out --max-seqs 32 --threads 1 --matmul exact >/dev/null 2>wait.log &
pa=$!
for _ in $(seq 300); do
    "$Q" status --db wait.db --job wait --json | grep -q '"queued":0' && break
    sleep 0.05
done
set +e
"$Q" run --db wait.db --out out --no-wait >nowait.json 2>>wait.log
rc=$?
set -e
if [ $rc -ne 75 ]; then
    tail wait.log
    "$Q" status --db wait.db --job wait --json | grep -q '"leased":0' &&
        fail "1b: the first run finished before --no-wait looked (make its job longer)"
    fail "1b: --no-wait exited $rc, want 75"
fi
[ "$(json_field nowait.json "['exit_reason']")" = work_remains ] || fail "1b: exit_reason"
"$Q" run --db wait.db --out out >waited.json 2>>wait.log || fail "1b: waiting run exited non-zero"
[ "$(json_field waited.json "['exit_reason']")" = drained ] || fail "1b: waiting run's exit_reason"
wait $pa || fail "1b: first run"
check_job wait.db wait 24

# 1c. a job submitted while a run without --job works is worked by that run before it says
# it drained the queue (it took the job list once at its start and exited 0 "drained" with the
# new job queued: found by an audit)
make_small onec.jsonl 240
"$Q" submit --db onec.db --model "$M" --name onec onec.jsonl >/dev/null 2>&1
"$Q" run --db onec.db --threads 1 --matmul exact --max-seqs 4 >onec.json 2>onec.log &
pid=$!
wait_leased onec.db
make_small onecb.jsonl 3
"$Q" submit --db onec.db --model "$M" --name onecb onecb.jsonl >/dev/null 2>&1
kill -0 $pid 2>/dev/null || fail "1c: the run ended before the second submit (make the job longer)"
wait $pid || fail "1c: the run exited non-zero"
[ "$(json_field onec.json '["exit_reason"]')" = drained ] || fail "1c: $(cat onec.json)"
[ "$(sqlite3 onec.db "SELECT count(*) FROM items WHERE state != 'done'")" = 0 ] ||
    fail "1c: items left: $(sqlite3 onec.db "SELECT job_id, state, count(*) FROM items GROUP BY 1, 2")"
check_job onec.db onecb 3

# 2. retry --failed with a line rejected at submit
printf '%s\n' '{"custom_id": "good", "prompt": "Hello", "max_tokens": 3, "temperature": 0}' \
    garbage >two.jsonl
"$Q" submit --db two.db --model "$M" --name two two.jsonl >/dev/null 2>&1
"$Q" run --db two.db --out out >/dev/null 2>two.log || fail "2: first run"
"$Q" retry --db two.db --job two --failed 2>two.retry || fail "2: retry"
grep -q ": 0 items queued again" two.retry || { cat two.retry; fail "2: the rejected line was queued again"; }
"$Q" run --db two.db --out out >/dev/null 2>>two.log || { tail two.log; fail "2: rerun"; }
check_job two.db two 2
python3 - two.export.jsonl <<'PY' || fail "2: records"
import json, sys
r = {json.loads(l)["custom_id"]: json.loads(l) for l in open(sys.argv[1])}
assert r["good"]["response"]["status_code"] == 200, r
assert r[None]["response"]["body"]["error"]["code"] == "invalid_json", r
assert "two.jsonl:2:" in r[None]["response"]["body"]["error"]["message"], r
PY
# the rejected line's record is in the job's errors shard itself, not only made up by export
zstd -q -dc out/two/errors-*.jsonl.zst | grep -q '"custom_id":null' ||
    fail "2: the rejected line is not in the errors shards"

# 4. the shard is taken over under the run (as by a run on another host that missed our
# heartbeats): the run must end that shard and write its records to a new one (paced in exact
# mode on one thread, ~4 s of work: the run must still be writing that shard after the take-over)
make_small four.jsonl 120
"$Q" submit --db four.db --model "$M" --name four four.jsonl >/dev/null 2>&1
"$Q" run --db four.db --out out --max-seqs 4 --max-batch-tokens 64 --flush-secs 0 \
    --flush-records 2 --threads 1 --matmul exact >four.json 2>four.log &
pid=$!
wait_done four.db four 4
python3 - four.db <<'PY' || fail "4: the run finished first (make the job longer)"
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], timeout=30)
now = int(time.time() * 1000)
cur = db.execute("INSERT INTO runs (host, pid, started, heartbeat, ended, exit_reason)"
                 " VALUES ('elsewhere', 1, ?, ?, ?, 'test')", (now, now, now))
moved = db.execute("UPDATE shards SET run_id = ? WHERE state = 'open' AND kind = 'results'",
                   (cur.lastrowid,)).rowcount
left = db.execute("SELECT count(*) FROM items WHERE state IN ('queued', 'leased')").fetchone()[0]
db.commit()
sys.exit(0 if moved == 1 and left > 0 else 1)
PY
wait $pid || { tail four.log; fail "4: the run whose shard was taken exited non-zero"; }
grep -q "ending this shard" four.log || fail "4: no shard-level conflict seen"
"$Q" run --db four.db --out out >/dev/null 2>>four.log || fail "4: closing run"
check_job four.db four 120

# 5. a run stalled past its own lease does not re-claim its own items (paced in exact mode on
# one thread: the stall must come before the job's end)
make_small five.jsonl 30
"$Q" submit --db five.db --model "$M" --name five five.jsonl >/dev/null 2>&1
"$Q" run --db five.db --out out --max-seqs 4 --max-batch-tokens 64 --lease 1 --claim 4 \
    --flush-secs 0 --flush-records 2 --threads 1 --matmul exact >/dev/null 2>five.log &
pid=$!
wait_done five.db five 2
kill -STOP $pid
[ "$(sqlite3 five.db "SELECT count(*) FROM items WHERE state IN ('queued', 'leased')")" -gt 0 ] ||
    { kill -CONT $pid; fail "5: the run finished before the stall (make the job longer)"; }
sleep 2.5
kill -CONT $pid
wait $pid || { tail five.log; fail "5: stalled run exited non-zero"; }
check_job five.db five 30

# 6. a run stalled past its lease while another run takes its items over: when it resumes it
# drops them (in flight at the stall: --claim 4 with 4 sequences running)
python3 - >six.jsonl <<'PY'
import json
for i in range(24):
    print(json.dumps({"custom_id": f"s{i}", "prompt": f"Item {i}: the number after {i} is",
                      "max_tokens": 16, "temperature": 0}))
PY
"$Q" submit --db six.db --model "$M" --name six six.jsonl >/dev/null 2>&1
"$Q" run --db six.db --out out --max-seqs 4 --max-batch-tokens 64 --lease 1 --claim 4 \
    --flush-secs 0 --flush-records 1 --threads 1 --matmul exact >/dev/null 2>six_a.log &
pa=$!
wait_done six.db six 2
kill -STOP $pa
# a stop inside one of its write transactions would hold the database (no run could take
# over): then it goes on a moment and is stopped again
for _ in 1 2 3 4 5; do
    python3 -c 'import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=1, isolation_level=None)
try:
    db.execute("BEGIN IMMEDIATE")
    db.execute("ROLLBACK")
except sqlite3.OperationalError:
    sys.exit(3)' six.db && break
    kill -CONT $pa
    sleep 0.05
    kill -STOP $pa
done
# the items the stalled run holds
python3 -c 'import sqlite3, sys; print(" ".join(str(r[0]) for r in sqlite3.connect(sys.argv[1],
    timeout=30).execute("SELECT id FROM items WHERE state = \x27leased\x27")))' six.db >six.held
[ -s six.held ] || { kill -CONT $pa; fail "6: the stalled run held nothing (make the job longer)"; }
"$Q" run --db six.db --out out --max-seqs 4 --max-batch-tokens 64 --claim 4 \
    --flush-secs 0 --flush-records 1 >/dev/null 2>six_b.log &
pb=$!
# until the second run holds one of them, or has finished it
python3 - six.db $(cat six.held) <<'PY' || { kill -CONT $pa; fail "6: the second run took nothing over"; }
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], timeout=30)
ids = ",".join(sys.argv[2:])
a = db.execute(f"SELECT lease_owner FROM items WHERE id = {sys.argv[2]}").fetchone()[0]
for _ in range(600):
    q = (f"SELECT count(*) FROM items WHERE id IN ({ids}) AND"
         f" ((state = 'leased' AND lease_owner <> {a}) OR state = 'done')")
    if db.execute(q).fetchone()[0]:
        sys.exit(0)
    time.sleep(0.1)
sys.exit(1)
PY
kill -CONT $pa
wait $pa || { tail six_a.log; fail "6: the stalled run exited non-zero"; }
wait $pb || { tail six_b.log; fail "6: the second run exited non-zero"; }
grep -q "unfinished requests dropped" six_a.log || { tail six_a.log; fail "6: nothing dropped"; }
check_job six.db six 24

# 7. output location
mkdir -p d7 elsewhere1 elsewhere2
make_small seven.jsonl 20
(cd d7 && "$Q" submit --db q.db --model "$M" --name seven --out results ../seven.jsonl >/dev/null 2>&1)
# (killed at its second shard write, after the first commit: a kill after seeing that commit
# could come after a fast machine had finished the job)
(cd elsewhere1 && QUERN_FAULT=shard.write:2:kill exec "$Q" run --db ../d7/q.db --max-seqs 2 \
    --flush-secs 0 --flush-records 2 >/dev/null 2>../seven.log) &
pid=$!
rc=0; wait $pid 2>/dev/null || rc=$?
[ $rc -eq 137 ] || { tail seven.log; fail "7: the run meant to be killed exited $rc"; }
[ "$(sqlite3 d7/q.db "SELECT count(*) FROM items WHERE state = 'done'")" -ge 1 ] ||
    fail "7: nothing was committed before the kill"
set +e
(cd elsewhere2 && "$Q" run --db ../d7/q.db --out other >/dev/null 2>>../seven.log)
rc=$?
set -e
[ $rc -eq 1 ] || fail "7: a resume with another --out exited $rc, want 1"
grep -q "would split it" seven.log || fail "7: no message about splitting the output"
[ ! -e elsewhere2/other/seven ] || fail "7: the refused run created output"
(cd elsewhere2 && "$Q" run --db ../d7/q.db >/dev/null 2>>../seven.log) || fail "7: resume"
python3 - d7/q.db <<'PY' || fail "7: shard paths not absolute"
import sqlite3, sys
paths = [r[0] for r in sqlite3.connect(sys.argv[1]).execute("SELECT path FROM shards")]
assert paths and all(p.startswith("/") for p in paths), paths
PY
check_job d7/q.db seven 20 d7/results
# 7b. ... also while a run works on the job (its first shard made, or not yet: then its
# marker and the items it holds say so): a run with another --out would split it, and is
# refused before it makes anything. A first run
# that stopped at once (its directory and marker, no shard, no items held) does not pin the
# job: a later run may take it to another --out.
make_small sevenb.jsonl 200
"$Q" submit --db q7b.db --model "$M" --name sevenb sevenb.jsonl >/dev/null 2>&1
"$Q" run --db q7b.db --out first --flush-secs 1000 --flush-records 100000 --threads 1 \
    --matmul exact --max-seqs 4 --claim 4 >/dev/null 2>sevenb.log &
pid=$!
wait_leased q7b.db
set +e
"$Q" run --db q7b.db --out second >/dev/null 2>sevenb2.log
rc=$?
set -e
kill -0 $pid 2>/dev/null || fail "7b: the first run ended before the second (make the job longer)"
kill -TERM $pid
wait $pid || true
[ $rc -eq 1 ] || fail "7b: a run with another --out exited $rc while the first one worked, want 1"
grep -q "would split it" sevenb2.log || fail "7b: no message about splitting the output"
[ ! -e second ] || fail "7b: the refused run created output"
"$Q" run --db q7b.db >/dev/null 2>>sevenb.log || fail "7b: resume"
check_job q7b.db sevenb 200 first
make_small sevenc.jsonl 4
"$Q" submit --db q7c.db --model "$M" --name sevenc sevenc.jsonl >/dev/null 2>&1
set +e
"$Q" run --db q7c.db --out first --max-runtime 0.001 >/dev/null 2>sevenc.log
rc=$?
set -e
[ $rc -eq 75 ] || { tail sevenc.log; fail "7b: the stopped run exited $rc, want 75"; }
[ -e first/sevenc/.quern-job.json ] || fail "7b: the first run made no output directory"
"$Q" run --db q7c.db --out ./moved >/dev/null 2>>sevenc.log || fail "7b: run to another --out"
check_job q7c.db sevenc 4 moved

# 7d. two runs started together with different --out, one still loading its model (no items
# held, no shard: 7b's refusal cannot see it): the run that makes the job's first shard keeps
# the job; the other stops when it would make one elsewhere (exit 1, its items given back), and
# a run without --out continues where the shards are (the job was split across both
# directories, and later runs refused it: found by an audit)
make_small sevend.jsonl 200
"$Q" submit --db q7d.db --model "$M" --name sevend sevend.jsonl >/dev/null 2>&1
QUERN_FAULT=run.model_load:1:sleep=6 "$Q" run --db q7d.db --threads 1 --max-seqs 4 \
    --matmul exact >/dev/null 2>sevend.log &
pida=$!
for _ in $(seq 200); do [ -e out/sevend/.quern-job.json ] && break; sleep 0.05; done
[ -e out/sevend/.quern-job.json ] || fail "7d: the loading run made no output directory"
"$Q" run --db q7d.db --out second --threads 1 --max-seqs 4 --matmul exact --flush-secs 0 \
    >/dev/null 2>sevend2.log &
pidb=$!
for _ in $(seq 1200); do # until a shard exists; then B stops, leaving work for A
    ls second/sevend/results-* out/sevend/results-* >/dev/null 2>&1 && break
    kill -0 $pidb 2>/dev/null || break
    sleep 0.05
done
! ls second/sevend/results-* >/dev/null 2>&1 || kill -TERM $pidb 2>/dev/null || true
set +e
wait $pida
rca=$?
wait $pidb
rcb=$?
set -e
win=second lose_rc=$rca lose_log=sevend.log # (usually: B commits at once, A is asleep)
if ls out/sevend/results-* >/dev/null 2>&1; then
    win=out lose_rc=$rcb lose_log=sevend2.log
    ! ls second/sevend/results-* >/dev/null 2>&1 || fail "7d: shards in both directories"
fi
[ "$lose_rc" -eq 1 ] || { tail $lose_log; fail "7d: the run that lost the first shard exited $lose_rc, want 1"; }
grep -q "would split it across directories" $lose_log || fail "7d: no word of the split"
"$Q" run --db q7d.db >/dev/null 2>>sevend.log || fail "7d: resume without --out"
check_job q7d.db sevend 200 $win

# 8. a second database's job of the same name and --out is refused; a planted symlink is not
# followed
make_small eight.jsonl 6
"$Q" submit --db e1.db --model "$M" --name eight eight.jsonl >/dev/null 2>&1
"$Q" run --db e1.db --out o8 >/dev/null 2>e8.log || fail "8: first run"
sha_before=$(cat o8/eight/*.jsonl.zst | sha256sum)
"$Q" submit --db e2.db --model "$M" --name eight eight.jsonl >/dev/null 2>&1
set +e
"$Q" run --db e2.db --out o8 >/dev/null 2>>e8.log
rc=$?
set -e
[ $rc -eq 1 ] || fail "8: a second database's run into the same directory exited $rc"
grep -q "belongs to job 'eight'" e8.log || fail "8: no message naming the owner"
[ "$(cat o8/eight/*.jsonl.zst | sha256sum)" = "$sha_before" ] || fail "8: first job's shards changed"
# (and a submit naming that directory is refused at once: every run of its job would fail)
rc=0; "$Q" submit --db e2b.db --model "$M" --name eight --out o8 eight.jsonl >/dev/null 2>>e8.log || rc=$?
[ $rc -eq 1 ] && grep -q "o8/eight holds the output of job 'eight'" e8.log && [ ! -e e2b.db ] ||
    fail "8: a submit into another job's output directory: exit $rc"
echo precious >victim.txt
"$Q" submit --db e3.db --model "$M" --name eight3 eight.jsonl >/dev/null 2>&1
mkdir -p o8b/eight3
ln -s "$PWD/victim.txt" o8b/eight3/results-00000.jsonl.zst
set +e
"$Q" run --db e3.db --out o8b >/dev/null 2>>e8.log
set -e
[ "$(cat victim.txt)" = precious ] || fail "8: the symlink's target was written"
rm o8b/eight3/results-00000.jsonl.zst
"$Q" run --db e3.db --out o8b >/dev/null 2>>e8.log || fail "8: run after removing the link"
[ "$(cat victim.txt)" = precious ] || fail "8: the symlink's target was written"
check_job e3.db eight3 6 o8b

# 9. the manifest of a done job is rewritten when it is missing: by a run, or by status
rm o8/eight/manifest.json
"$Q" run --db e1.db --out o8 >/dev/null 2>>e8.log || fail "9: rerun of a done job"
check_job e1.db eight 6 o8
echo '{"complete": false}' >o8/eight/manifest.json
"$Q" status --db e1.db >/dev/null 2>>e8.log || fail "9: status"
check_job e1.db eight 6 o8
# a job stopped before its first commit (its manifest says complete: false), then cancelled:
# the next run seals it (only status did, before)
echo '{"custom_id":"k","prompt":"Letters:","max_tokens":8000,"grammar":"root ::= (([a-z] \" \"){200}){20}"}' >nine.jsonl
"$Q" submit --db nine.db --name nine --model "$M" --out o9 nine.jsonl >/dev/null 2>&1 || fail "9: submit"
"$Q" run --db nine.db --threads 1 --grace 0 >/dev/null 2>>e8.log &
pid=$!
for _ in $(seq 600); do # (until its item is claimed)
    "$Q" status --db nine.db --job nine --json 2>/dev/null | grep -q '"leased":1' && break
    sleep 0.1
done
kill -TERM $pid
rc=0
wait $pid || rc=$?
[ $rc = 75 ] || fail "9: the stopped run exited $rc"
python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["complete"] is False' \
    o9/nine/manifest.json || fail "9: the stopped run wrote no manifest"
"$Q" cancel --db nine.db --job nine 2>/dev/null || fail "9: cancel"
"$Q" run --db nine.db >/dev/null 2>>e8.log || fail "9: run after the cancel"
python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); assert m["complete"] and m.get("cancelled"), m' \
    o9/nine/manifest.json || fail "9: the cancelled job's manifest was not sealed by run"

# 9b. two runs of one job write its manifest one at a time, each from the queue as it is then:
# a run stopping while the other still holds a shard open, its manifest write slow (fsync:
# seconds, by a fault), no longer renames its incomplete manifest over the complete one the
# other wrote when it drained the job (found by an audit)
python3 - >ninb.jsonl <<'PY'
import json
for i in range(60):
    print(json.dumps({"custom_id": f"n{i}", "prompt": f"Count {i}:", "max_tokens": 12,
                      "temperature": 0}))
PY
"$Q" submit --db ninb.db --name ninb --model "$M" --out o9b ninb.jsonl >/dev/null 2>&1
QUERN_FAULT=manifest.fsync:1:sleep=4 "$Q" run --db ninb.db --threads 1 --max-seqs 8 \
    --flush-records 4 --grace 0 >/dev/null 2>ninb1.log &
pid=$!
"$Q" run --db ninb.db --threads 1 --max-seqs 8 --flush-records 4 >/dev/null 2>ninb2.log &
pid2=$!
sleep 1.2
kill -TERM $pid
set +e
wait $pid2
rc2=$?
wait $pid
set -e
[ $rc2 = 0 ] || { tail ninb2.log; fail "9b: the draining run exited $rc2"; }
check_job ninb.db ninb 60 o9b

# 10a. run on a mistyped --db is an error and creates nothing; --create makes an empty queue
set +e
"$Q" run --db typo.db >/dev/null 2>typo.log
rc=$?
set -e
[ $rc -eq 1 ] || fail "10a: run on a missing database exited $rc"
[ ! -e typo.db ] || fail "10a: run created the missing database"
grep -q "does not exist" typo.log || fail "10a: no message about the missing database"
"$Q" run --db typo.db --create >typo.json 2>>typo.log || fail "10a: --create"
[ "$(json_field typo.json "['items_done']")" = 0 ] || fail "10a: --create summary"

# 10. SIGHUP, and SIGPIPE from a reader that went away, stop the run like SIGTERM
# (paced in exact mode on one thread, ~5 s of work: the signal must find the job unfinished)
make_small ten.jsonl 100
"$Q" submit --db ten.db --model "$M" --name ten ten.jsonl >/dev/null 2>&1
# (with HUP's default restored: where the suite itself runs with HUP ignored, under nohup, quern
# keeps it ignored, as section 14 checks, and bash cannot restore it)
python3 -c 'import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])' "$Q" run --db ten.db --out out --max-seqs 2 --flush-secs 0.2 \
    --grace 0 --threads 1 --matmul exact >/dev/null 2>ten.log &
pid=$!
wait_done ten.db ten 1
kill -HUP $pid
set +e
wait $pid
rc=$?
set -e
[ $rc -eq 75 ] || fail "10: SIGHUP: exit $rc, want 75"
"$Q" status --db ten.db --job ten --json | grep -q '"leased":0' || fail "10: SIGHUP left leases"
set +e
"$Q" run --db ten.db --out out --max-seqs 2 --flush-secs 0.2 --grace 0 --progress 0.1 2>&1 |
    head -c 1 >/dev/null
set -e
"$Q" status --db ten.db --job ten --json | grep -q '"leased":0' || fail "10: SIGPIPE left leases"
"$Q" run --db ten.db --out out >/dev/null 2>>ten.log || fail "10: final run"
check_job ten.db ten 100

# 11. a run stalled past its --lease while another run's claim put its expired leases back in
# the queue (taking none of them): resumed, the run claims its own items again, and each is
# still computed and committed once, the run ending well. Its finished records wait for the
# commit (--flush-secs 1000) when it stalls; paced in exact mode on one thread.
make_small eleven.jsonl 200
"$Q" submit --db eleven.db --model "$M" --name eleven eleven.jsonl >/dev/null 2>&1
"$Q" run --db eleven.db --out out --max-seqs 4 --claim 4 --lease 1 --flush-secs 1000 \
    --flush-records 100000 --progress 0.1 --threads 1 --matmul exact >/dev/null 2>eleven.log &
pid=$!
for _ in $(seq 600); do # until records are finished (in memory: nothing is committed yet)
    grep -qs "progress: .* done=[1-9]" eleven.log && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.05
done
kill -STOP $pid 2>/dev/null || fail "11: the run ended before the stall (make the job longer)"
grep -q "progress: .* done=[1-9]" eleven.log || { kill -CONT $pid; fail "11: no finished record"; }
# another run's claim sweeps expired leases (queue/schema.c QS_LEASE_EXPIRE), here by hand,
# once the stalled run is past its --lease; a stop inside one of its write transactions holds
# the database: then it goes on a moment and is stopped again
for try in 1 2 3 4 5; do
    sleep 1.5
    set +e
    python3 - eleven.db <<'PY'
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], timeout=2)
try:
    n = db.execute("UPDATE items SET state = 'queued', lease_owner = NULL, lease_expiry = NULL"
                   " WHERE state = 'leased' AND lease_expiry <= ?",
                   (int(time.time() * 1000),)).rowcount
    db.commit()
except sqlite3.OperationalError:
    sys.exit(3)
sys.exit(0 if n > 0 else 1)
PY
    rc=$?
    set -e
    [ $rc -eq 3 ] || break
    kill -CONT $pid
    sleep 0.05
    kill -STOP $pid
done
[ $rc -eq 0 ] || { kill -CONT $pid; fail "11: no lease expired ($rc; make the job longer)"; }
kill -CONT $pid
wait $pid || { tail eleven.log; fail "11: the resumed run exited non-zero"; }
check_job eleven.db eleven 200
# 12. a run killed during its grace (Slurm: SIGTERM, then SIGKILL after KillWait, 30 s, shorter
# than the examples' --grace 90) recorded its stop first: its items go back without costing an
# attempt (before, three preemptions made every in-flight item attempts_exhausted); paced in
# exact mode on one thread, each request longer than the test waits
python3 - <<'PY'
import json
with open("twelve.jsonl", "w") as f:
    for i in range(40):
        f.write(json.dumps({"custom_id": f"s{i}", "max_tokens": 400, "temperature": 0,
                            "messages": [{"role": "user",
                                          "content": f"Write a long story about dragon {i}."}]})
                + "\n")
PY
"$Q" submit --db twelve.db --model "$M" --name twelve twelve.jsonl >/dev/null 2>&1
"$Q" run --db twelve.db --out out --max-seqs 4 --grace 600 --threads 1 --matmul exact \
    >/dev/null 2>twelve.log &
pid=$!
leased() {
    python3 -c "import sqlite3; print(sqlite3.connect('twelve.db').execute(
        \"SELECT count(*) FROM items WHERE state = 'leased'\").fetchone()[0])"
}
# until it holds leases: 4 running and 4 more waiting in the engine (it keeps 2 x --max-seqs),
# as its live progress shows (the first step admits one request: the others wait for the
# shared chat-template block it computes; a stop before then gave back 7 and ran 1)
running() {
    python3 -c "import json, sqlite3; r = sqlite3.connect('twelve.db').execute(
        \"SELECT progress_json FROM runs WHERE progress_json IS NOT NULL\").fetchone();
print(json.loads(r[0]).get('running', 0) if r else 0)"
}
for _ in $(seq 600); do
    [ "$(leased)" -gt 4 ] && [ "$(running)" -eq 4 ] && break
    sleep 0.1
done
[ "$(leased)" -gt 4 ] && [ "$(running)" -eq 4 ] ||
    fail "12: the run holds $(leased) items and runs $(running), want 8 and 4"
kill -TERM $pid
for _ in $(seq 600); do # until the queue has its stop
    python3 -c "import sqlite3, sys; sys.exit(0 if sqlite3.connect('twelve.db').execute(
        \"SELECT count(*) FROM runs WHERE stopping IS NOT NULL\").fetchone()[0] > 0 else 1)" &&
        break
    sleep 0.1
done
# 12b. the stop gives the requests not started yet back at once (the grace is for those that
# run: before, the 4 waiting ones started in it, took compute from the 4 finishing, and were
# cut at its end)
for _ in $(seq 100); do
    grep -q "requests not started yet went back to the queue" twelve.log && break
    sleep 0.1
done
grep -q "4 requests not started yet went back to the queue; 4 run on" twelve.log ||
    { cat twelve.log; fail "12b: the unstarted requests were not given back at the stop"; }
[ "$(leased)" -le 4 ] || fail "12b: the stopping run still holds $(leased) items"
kill -0 $pid 2>/dev/null || fail "12: the run ended within its grace (make the requests longer)"
kill -9 $pid
wait $pid 2>/dev/null || true
"$Q" status --db twelve.db >/dev/null 2>&1 # finds the run dead: its leases go back
python3 - twelve.db <<'PY' || fail "12: a run killed during its grace cost its items attempts"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
rows = db.execute("SELECT state, attempts, count(*) FROM items GROUP BY 1, 2").fetchall()
assert ("leased" not in [r[0] for r in rows]), rows
assert all(a == 0 for st, a, n in rows if st == "queued"), rows
assert sum(n for st, a, n in rows if st == "queued") > 0, rows
PY
# 12c. the run summary's items_returned counts every item the stop gave back: with --grace 0
# too (it counted only the requests not started, given back before a grace: 0 here)
"$Q" submit --db twelvec.db --model "$M" --name twelvec twelve.jsonl >/dev/null 2>&1
"$Q" run --db twelvec.db --out out --max-seqs 4 --grace 0 --threads 1 --matmul exact \
    >twelvec.sum 2>twelvec.log &
pid=$!
for _ in $(seq 600); do
    [ "$(sqlite3 twelvec.db "SELECT count(*) FROM items WHERE state = 'leased'")" -gt 4 ] && break
    sleep 0.1
done
kill -TERM $pid
rc=0; wait $pid || rc=$?
[ $rc -eq 75 ] || { cat twelvec.log; fail "12c: the stopped run exited $rc, want 75"; }
python3 - twelvec.sum twelvec.log twelvec.db <<'PY' || fail "12c: items_returned"
import json, re, sqlite3, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
log = open(sys.argv[2]).read()
back = sum(int(n) for n in re.findall(r"(\d+) requests not started yet went back", log))
back += sum(int(n) for n in re.findall(r"released (\d+) unfinished items back", log))
db = sqlite3.connect(sys.argv[3])
assert db.execute("SELECT count(*) FROM items WHERE state = 'leased' OR attempts > 0").fetchone()[0] == 0
assert s["items_returned"] == back and back > 4, (s["items_returned"], back, log)
PY
# 13. a stop signal while another process holds the queue's write lock, before the run holds
# anything: exit 75 at once (it waited out SQLite's 30 s busy timeout, then exited 1, which
# Slurm scripts do not requeue)
hold_lock twelve.db 20
"$Q" run --db twelve.db --out out --threads 1 >/dev/null 2>thirteen.log &
pid=$!
# until it catches TERM (SigCgt bit 15; a slow start under ASan must not meet the default
# action), then a moment for it to reach the lock
for _ in $(seq 300); do
    cgt=$(awk '/^SigCgt:/ {print $2}' /proc/$pid/status 2>/dev/null || true)
    [ -n "$cgt" ] && (((0x$cgt >> 14) & 1)) && break
    sleep 0.05
done
sleep 1
t0=$(date +%s)
kill -TERM $pid
set +e
wait $pid
rc=$?
set -e
t1=$(date +%s)
kill $holder 2>/dev/null || true
wait $holder 2>/dev/null || true
[ $rc -eq 75 ] && [ $((t1 - t0)) -le 5 ] ||
    { cat thirteen.log; fail "13: TERM behind a locked queue: exit $rc after $((t1 - t0)) s"; }
# 13b. the same for a run waiting for items another run holds (it never held any): exit 75,
# not 1 (its end could not be recorded behind the lock: the next run or status ends it)
head -4 twelve.jsonl >thirteen.jsonl
"$Q" submit --db thirteen.db --model "$M" --name thirteen thirteen.jsonl >/dev/null 2>&1
"$Q" run --db thirteen.db --out out --max-seqs 4 --grace 1 --threads 1 --matmul exact \
    >/dev/null 2>thirteen_a.log &
pid_a=$!
for _ in $(seq 600); do # until run A holds every item
    python3 -c "import sqlite3, sys; sys.exit(0 if sqlite3.connect('thirteen.db').execute(
        \"SELECT count(*) FROM items WHERE state = 'leased'\").fetchone()[0] == 4 else 1)" && break
    sleep 0.1
done
"$Q" run --db thirteen.db --out out --threads 1 >/dev/null 2>thirteen_b.log &
pid_b=$!
for _ in $(seq 1200); do grep -q "waiting for" thirteen_b.log && break; sleep 0.1; done
grep -q "waiting for" thirteen_b.log || fail "13b: run B is not waiting (make the requests longer)"
hold_lock thirteen.db 8
sleep 1.5 # (B's next look at the queue meets the lock)
kill -TERM $pid_b
set +e
wait $pid_b
rc=$?
set -e
wait $holder 2>/dev/null || true
kill -TERM $pid_a
wait $pid_a 2>/dev/null || true
[ $rc -eq 75 ] || { cat thirteen_b.log; fail "13b: TERM to a waiting run behind a lock: exit $rc"; }
# 14. `nohup quern run`: the HUP it ignores stays ignored (it stopped the run before); TERM
# still stops it
make_small fourteen.jsonl 100
"$Q" submit --db fourteen.db --model "$M" --name fourteen fourteen.jsonl >/dev/null 2>&1
nohup "$Q" run --db fourteen.db --out out --max-seqs 2 --flush-secs 0.2 --grace 0 --threads 1 \
    --matmul exact >/dev/null 2>fourteen.log &
pid=$!
wait_done fourteen.db fourteen 1
kill -HUP $pid
sleep 1
kill -0 $pid 2>/dev/null || { cat fourteen.log; fail "14: nohup'd run stopped on SIGHUP"; }
kill -TERM $pid
set +e
wait $pid
rc=$?
set -e
[ $rc -eq 75 ] || fail "14: TERM after an ignored HUP: exit $rc, want 75"
# 15. kill -9 before a run's third step, three times (QUERN_FAULT=run.step:3:kill): each run
# claimed 2 x --max-seqs = 64 items and began 32 (admitted in its first step; 6 tokens each,
# none finished). Before, every held item spent an attempt: after three crashes 64 requests,
# half of which never ran, failed as attempts_exhausted.
# (first, a line too long for the context: answered with an error record at once, which a crash
# before its commit must not charge either: three made it attempts_exhausted)
python3 -c 'import json; print(json.dumps({"custom_id": "long", "prompt": "sea " * 9000,
                                           "max_tokens": 4}))' >fifteen.jsonl
make_small fifteen.more.jsonl 200
cat fifteen.more.jsonl >>fifteen.jsonl
"$Q" submit --db fifteen.db --model "$M" --name fifteen fifteen.jsonl >/dev/null 2>&1
for k in 1 2 3; do
    rc=0
    QUERN_FAULT=run.step:3:kill "$Q" run --db fifteen.db --out out --max-seqs 32 \
        --max-batch-tokens 2048 --threads 1 >/dev/null 2>fifteen.log || rc=$?
    [ $rc -eq 137 ] || { cat fifteen.log; fail "15: crash $k: exit $rc, want 137 (killed)"; }
    "$Q" status --db fifteen.db >/dev/null 2>&1 # finds the run dead: its leases go back
    python3 - fifteen.db $k <<'PY' || fail "15: crash $k spent the attempts of requests not begun"
import sqlite3, sys
k = int(sys.argv[2])
db = sqlite3.connect(sys.argv[1])
rows = dict(db.execute("SELECT attempts, count(*) FROM items WHERE state = 'queued' GROUP BY 1"))
assert sum(rows.values()) == 201, rows  # nothing finished, nothing leased
assert 1 <= rows.get(k, 0) <= 32 and sum(n for a, n in rows.items() if a not in (0, k)) == 0, rows
PY
done
"$Q" run --db fifteen.db --out out --max-seqs 32 --threads 1 >/dev/null 2>fifteen.log ||
    { cat fifteen.log; fail "15: the run after the crashes"; }
"$Q" export --db fifteen.db --job fifteen --out fifteen.out.jsonl 2>/dev/null || fail "15: export"
python3 - fifteen.out.jsonl <<'PY' || fail "15: the requests after three crashes"
import collections, json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert len(recs) == 201, len(recs)
by = collections.Counter("ok" if r["response"]["status_code"] == 200 else
                         r["response"]["body"]["error"]["code"] for r in recs)
assert set(by) == {"ok", "attempts_exhausted", "context_length_exceeded"}, by
assert 1 <= by["attempts_exhausted"] <= 32 and by["context_length_exceeded"] == 1, by
PY

# 16. a run killed with -9, and a status that cannot end it (its commit fails, as on a full
# disk): the run is shown dead, not live (before: a live run, its last rates counted, the job
# not "no live run"); the next status ends it and its items go back
for i in 1 2 3 4; do
    echo "{\"custom_id\":\"s$i\",\"prompt\":\"Count to ten: one, two,\",\"max_tokens\":64}"
done >sixteen.jsonl
"$Q" submit --db sixteen.db --model "$M" --name sixteen sixteen.jsonl >/dev/null 2>&1
rc=0
QUERN_FAULT=run.step:2:kill "$Q" run --db sixteen.db --out out --threads 1 >/dev/null 2>&1 || rc=$?
[ $rc -eq 137 ] || fail "16: exit $rc, want 137 (killed)"
QUERN_FAULT=queue.commit:1:fail "$Q" status --db sixteen.db --json 2>sixteen.log >sixteen.json ||
    { cat sixteen.log; fail "16: status whose commit fails"; }
grep -q "ending dead runs" sixteen.log || { cat sixteen.log; fail "16: no warning"; }
python3 - sixteen.json <<'PY' || fail "16: the dead run shown live"
import json, sys
j = json.load(open(sys.argv[1]))[0]
assert len(j["runs"]) == 1 and j["runs"][0]["dead"] is True, j["runs"]
assert j["live"]["runs"] == 0 and j["by_state"]["leased"] == 4, (j["live"], j["by_state"])
PY
QUERN_FAULT=queue.commit:1:fail "$Q" status --db sixteen.db 2>/dev/null | grep -q "no live run" ||
    fail "16: the text status counts the dead run"
"$Q" status --db sixteen.db --json 2>/dev/null >sixteen.json || fail "16: status"
python3 - sixteen.json <<'PY' || fail "16: the next status did not end the dead run"
import json, sys
j = json.load(open(sys.argv[1]))[0]
assert j["runs"] == [] and j["by_state"]["queued"] == 4, (j["runs"], j["by_state"])
PY
echo "e2e reliability: ok"
