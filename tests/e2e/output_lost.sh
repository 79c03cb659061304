#!/usr/bin/env bash
# A job's output taken away under the queue (found by an environment audit):
#  1. the output directory deleted during a run: the run went on committing records into the
#     unlinked shard and marked every item done (30 of 40 records lost, `retry` could not
#     bring them back); now the first commit after the deletion fails (exit 1, the message
#     says what happened) and the unfinished items go back to the queue;
#  2. the output directory deleted between runs: the next run computed the rest, exited 0 and
#     wrote a manifest saying complete that listed the missing shard; now it stops before any
#     work (exit 1, the shard named with its committed bytes), and so does a run of a job that
#     was done before (it rewrote the manifest "complete" over nothing); an old queue's paths
#     relative to the directory its runs ran in are named as such, not as lost output;
#  3. a queue older than its output (a copy, a backup): refused before it computes or cuts.
set -euo pipefail
. "$(dirname "$0")/lib/common.sh"
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
fail() {
    echo "e2e output_lost: FAIL: $*" >&2
    exit 1
}
e2e_workdir
python3 -c '
for i in range(40):
    print("{\"custom_id\": \"c%02d\", \"prompt\": \"Tell me about the number %d.\", \"max_tokens\": 12}" % (i, i))' >p40.jsonl
count() { # count DB STATE
    "$Q" status --db "$1" --json | python3 -c "import json,sys; print(json.load(sys.stdin)[0]['by_state']['$2'])"
}
wait_done() { # wait_done DB N PID: until N items are done (or the run has exited; 60 s at most)
    for _ in $(seq 1 600); do
        [ "$(count "$1" done)" -ge "$2" ] && return 0
        kill -0 "$3" 2>/dev/null || return 0
        sleep 0.1
    done
}

# 1. deleted during a run (one sequence at a time, a commit per record: it runs for a while)
"$Q" submit --db a.db --name a --model "$M" --out aout p40.jsonl >/dev/null 2>&1 || fail "submit a"
"$Q" run --db a.db --threads 1 --max-seqs 1 --flush-records 1 >/dev/null 2>a.err &
pa=$!
pids+=("$pa")
wait_done a.db 3 "$pa"
rm -rf aout
rc=0; wait "$pa" || rc=$?
[ $rc = 1 ] && grep -q "the shard file was removed or replaced while this run wrote it" a.err ||
    { cat a.err; fail "1: a run whose output was deleted: exit $rc"; }
done_a=$(count a.db done)
[ "$done_a" -lt 40 ] && [ "$(count a.db queued)" = $((40 - done_a)) ] ||
    fail "1: items marked done after the deletion ($done_a done)"
echo "  1. output deleted mid-run: exit 1 at the next commit, $((40 - done_a)) items queued again"

# 2. deleted between runs
"$Q" submit --db b.db --name b --model "$M" --out bout p40.jsonl >/dev/null 2>&1 || fail "submit b"
"$Q" run --db b.db --threads 1 --max-seqs 1 --flush-records 1 --grace 0 >/dev/null 2>b1.err &
pb=$!
pids+=("$pb")
wait_done b.db 2 "$pb"
kill -TERM "$pb" 2>/dev/null || true
rc=0; wait "$pb" || rc=$?
[ $rc = 75 ] || { cat b1.err; fail "2: the first run: exit $rc (it finished before the signal?)"; }
done_b=$(count b.db done)
[ "$done_b" -gt 0 ] || fail "2: the first run committed nothing"
# (status names the job's output directory: only a run's log said where it went)
"$Q" status --db b.db --json | python3 -c '
import json, os, sys
assert json.load(sys.stdin)[0]["output_dir"] == os.getcwd() + "/bout/b"' || fail "2: status output_dir"
"$Q" status --db b.db | grep -qx "  output $PWD/bout/b" || fail "2: status's output line"
rm -rf bout
rc=0; "$Q" run --db b.db --threads 1 >/dev/null 2>b2.err || rc=$?
[ $rc = 1 ] && grep -q "results-00000.jsonl.zst is missing, but [0-9]* bytes ($done_b records)" b2.err ||
    { cat b2.err; fail "2: a run after the output was deleted: exit $rc"; }
[ "$(count b.db done)" = "$done_b" ] || fail "2: the run worked on"
[ ! -e bout/b/manifest.json ] || fail "2: a manifest was written"
# a job done before
"$Q" submit --db c.db --name c --model "$M" --out cout p40.jsonl >/dev/null 2>&1 || fail "submit c"
"$Q" run --db c.db --threads 1 >/dev/null 2>&1 || fail "2: run c"
rm cout/c/results-00000.jsonl.zst cout/c/manifest.json
rc=0; "$Q" run --db c.db --threads 1 >/dev/null 2>c.err || rc=$?
[ $rc = 1 ] && grep -q "is missing, but" c.err || { cat c.err; fail "2: a done job's run: exit $rc"; }
[ ! -e cout/c/manifest.json ] || fail "2: the done job's manifest was rewritten"
# (a review: the check read an older queue's shard paths, relative to its directory, from the
# working directory, and refused every run started elsewhere)
mkdir -p rq elsewhere
head -8 p40.jsonl >p8.jsonl
"$Q" submit --db rq/q.db --name r --model "$M" --out rq/out p8.jsonl >/dev/null 2>&1 || fail "submit r"
"$Q" run --db rq/q.db --threads 1 >/dev/null 2>&1 || fail "2: run r"
# as an older quern left it: DB's shard paths relative to BASE, its last item queued again, the
# job running (and its out_dir OUT, when given)
as_older() { # as_older DB BASE [OUT]
    python3 - "$@" <<'PY'
import os, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
for i, p in db.execute("SELECT id, path FROM shards").fetchall():
    db.execute("UPDATE shards SET path = ? WHERE id = ?", (os.path.relpath(p, os.path.abspath(sys.argv[2])), i))
db.execute("UPDATE items SET state = 'queued', shard_id = NULL, shard_record = NULL, finished = NULL"
           " WHERE id = (SELECT max(id) FROM items)")
db.execute("UPDATE jobs SET state = 'running', finished = NULL")
if len(sys.argv) > 3:
    db.execute("UPDATE jobs SET out_dir = ?", (sys.argv[3],))
db.commit()
PY
}
as_older rq/q.db rq
(cd elsewhere && "$Q" run --db ../rq/q.db --threads 1 >/dev/null 2>../rq.err) ||
    { cat rq.err; fail "2: a queue with relative shard paths, run from elsewhere"; }
# (an upgrade audit: quern before 2026-12-01 stored paths relative to the directory it ran in;
# a newer run from there said "committed output has been lost" and made an output directory
# beside the queue, which then stood in the way of moving the real one there)
mkdir -p wq wd
"$Q" submit --db wq/q.db --name w --model "$M" --out wd/out p8.jsonl >/dev/null 2>&1 || fail "submit w"
"$Q" run --db wq/q.db --threads 1 >/dev/null 2>&1 || fail "2: run w"
as_older wq/q.db wd out
rc=0; (cd wd && "$Q" run --db ../wq/q.db --threads 1 >/dev/null 2>../wq.err) || rc=$?
[ $rc = 1 ] && grep -q "stored the job's paths relative to the directory it ran in" wq.err &&
    [ ! -e wq/out ] || { cat wq.err; fail "2: shards under the old run's directory: exit $rc"; }
mv wd/out wq/
(cd wd && "$Q" run --db ../wq/q.db --threads 1 >/dev/null 2>../wq.err) ||
    { cat wq.err; fail "2: the output moved beside the queue"; }
"$Q" export --db wq/q.db --job w --out w.jsonl 2>/dev/null || fail "2: export w"
[ "$(python3 -c 'import json,sys; print(len({json.loads(l)["custom_id"] for l in open("w.jsonl")}))')" = 8 ] &&
    [ "$(wc -l <w.jsonl)" = 8 ] || fail "2: w's export"
echo "  2. output deleted between runs: the next run stops before any work, naming the shard"
# 3. a queue older than its output: (a) restored from a copy made before a run (its -wal
#    deleted after a kill does the same): the run computed the whole job, then failed at its
#    first shard ("a file is already there"), every run again; now it stops before any work.
#    (b) a backup taken during a run, run after the original finished: it cut the original's
#    closed shard back to what the backup knew (records the original counts done); now refused.
"$Q" submit --db d.db --name d --model "$M" --out dout p40.jsonl >/dev/null 2>&1 || fail "submit d"
cp d.db d.save
"$Q" run --db d.db --threads 1 >/dev/null 2>&1 || fail "3: run d"
cp d.save d.db
rm -f d.db-wal d.db-shm
rc=0; "$Q" run --db d.db --threads 1 >/dev/null 2>d.err || rc=$?
[ $rc = 1 ] && grep -q "the queue is older than the job's output" d.err && ! grep -q "progress:" d.err ||
    { cat d.err; fail "3a: a run of a stale queue: exit $rc"; }
"$Q" submit --db e.db --name e --model "$M" --out eout p40.jsonl >/dev/null 2>&1 || fail "submit e"
"$Q" run --db e.db --threads 1 --max-seqs 1 --flush-records 1 >/dev/null 2>&1 &
pe=$!
pids+=("$pe")
wait_done e.db 3 "$pe"
mkdir -p ecopy
sqlite3 e.db ".backup ecopy/e.db"
wait "$pe" || fail "3b: the original run"
rc=0; (cd ecopy && "$Q" run --db e.db --threads 1 >/dev/null 2>../e.err) || rc=$?
[ $rc = 1 ] && grep -q "another copy of the queue went on with this job" e.err ||
    { cat e.err; fail "3b: a run of a backup: exit $rc"; }
check_job e.db e 40 eout
echo "  3. a queue older than its output stops before any work; a backup cuts nothing"
echo "e2e output_lost: ok"
