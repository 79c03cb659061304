#!/usr/bin/env bash
# End-to-end tests of `quern submit` on large and hostile inputs, with the real binary:
#  1. a submit killed with SIGKILL mid-way leaves nothing that `status` or runs see: status
#     lists no job, the same --name can be submitted again (after status, and straight away),
#     and the database then holds only the new jobs' items;
#  2. while a big submit runs, `status` shows its job as "submitting" (and does not delete it),
#     and another process takes the write lock (BEGIN IMMEDIATE, 5 s busy timeout) again and
#     again, each time within the timeout, and sees the item count grow between its locks: the
#     submit commits in bounded transactions instead of one for the whole input;
#  3. a .jsonl.zst of 1,000,000 blank lines and 2 good lines: 2 items, a small database, the
#     blank lines counted in the summary, not reported one by one; 50 bad lines: 50 failed
#     items, the first 20 reported and one line for the rest;
#  4. --strict with a bad line after more than 10,000 good ones: exit non-zero, and the
#     database holds no job and no item (the committed part is deleted again);
#  5. SIGINT mid-submit: exit non-zero, "nothing was submitted", no job and no item;
#  8. a file cut while read, no request in a file: exit 1, nothing submitted; a BOM alone on a
#     line is blank; names that are not UTF-8, and zip's UTF-8 names, come back in the records.
# Under sanitizers (QUERN_SANITIZE) the inputs are smaller.
set -euo pipefail
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
BIG=300000
BLANK=1000000
if [ -n "${QUERN_SANITIZE:-}" ]; then
    BIG=120000
    BLANK=200000
fi
tmp=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }

# sql DB QUERY: the first column of the first row, read with python's sqlite3 module.
sql() {
    python3 -c 'import sqlite3, sys
c = sqlite3.connect(sys.argv[1], timeout=30)
print(c.execute(sys.argv[2]).fetchone()[0])' "$1" "$2"
}

# lines FILE N PREFIX: N short prompt lines with custom_ids PREFIX0.. PREFIX(N-1).
lines() {
    python3 - "$1" "$2" "$3" <<'PY'
import sys
path, n, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, "w") as f:
    for i in range(n):
        f.write('{"custom_id":"%s%d","prompt":"p %d"}\n' % (prefix, i, i))
PY
}

# wait_items DB PID: wait until the submit PID has committed items of its (not yet ready) job;
# fail if it ends first.
wait_items() {
    python3 - "$1" "$2" <<'PY'
import os, sqlite3, sys, time
db, pid = sys.argv[1], int(sys.argv[2])
def alive():
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited between open and read
        return False
deadline = time.monotonic() + 120
while time.monotonic() < deadline and alive():
    try:
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        n = c.execute("SELECT count(*) FROM items JOIN jobs ON jobs.id = items.job_id"
                      " WHERE NOT jobs.ready").fetchone()[0]
        c.close()
        if n > 0:
            sys.exit(0)
    except sqlite3.OperationalError:
        pass  # not created yet
    time.sleep(0.02)
sys.exit("the submit ended (or stalled) before committing any item")
PY
}

lines big.jsonl "$BIG" c
lines small.jsonl 3 s

# 1. kill -9 mid-way
for name in big big2; do
    "$Q" submit --db k.db --model "$M" --name "$name" big.jsonl >/dev/null 2>k.err &
    pid=$!
    wait_items k.db "$pid" || fail "1: $name"
    kill -9 "$pid"
    wait "$pid" 2>/dev/null && fail "1: the submit finished before it was killed"
    n=$(sql k.db "SELECT count(*) FROM items JOIN jobs ON jobs.id = job_id WHERE name = '$name'")
    [ "$n" -gt 0 ] && [ "$n" -lt "$BIG" ] || fail "1: $n items committed at the kill"
    [ "$(sql k.db "SELECT ready FROM jobs WHERE name = '$name'")" = 0 ] || fail "1: job is ready"
    # (a crash-safety audit) commands that act on a job's items refuse the half-written job:
    # they reported "0 records", wrote a report, or "cancelled" its items
    for c in "cancel --job $name" "retry --job $name --failed" "export --job $name --out k.x.jsonl" \
        "report --job $name --out k.x.html"; do
        rc=0
        # shellcheck disable=SC2086
        "$Q" $c --db k.db >/dev/null 2>k.cmd || rc=$?
        [ $rc = 1 ] && grep -q "still being submitted" k.cmd || fail "1: $c: exit $rc $(cat k.cmd)"
    done
    [ ! -e k.x.jsonl ] && [ ! -e k.x.html ] || fail "1: an output of the half-written job"
    if [ "$name" = big ]; then
        # status deletes the dead submit's job and shows nothing
        "$Q" status --db k.db >k.status 2>&1 || fail "1: status"
        grep -qx "no jobs" k.status || { cat k.status; fail "1: status shows the killed job"; }
        [ "$(sql k.db "SELECT (SELECT count(*) FROM jobs) + (SELECT count(*) FROM items)")" = 0 ] ||
            fail "1: status left the killed job in the database"
    fi
    # submit itself deletes a dead submit's job holding the name
    "$Q" submit --db k.db --model "$M" --name "$name" small.jsonl >k.out 2>k.err ||
        { cat k.err; fail "1: resubmitting --name $name"; }
    [ "$(sql k.db "SELECT count(*) FROM items WHERE job_id = $(cat k.out)")" = 3 ] || fail "1: job"
done
[ "$(sql k.db "SELECT count(*) FROM items")" = 6 ] || fail "1: items of the killed submits remain"
[ "$(sql k.db "SELECT count(*) FROM jobs WHERE ready")" = 2 ] || fail "1: jobs"
"$Q" status --db k.db --json >k.json || fail "1: status --json"
python3 - k.json <<'PY' || fail "1: status --json"
import json, sys
jobs = json.load(open(sys.argv[1]))
assert [(j["name"], j["state"], j["items"]) for j in jobs] == [("big", "queued", 3),
                                                                ("big2", "queued", 3)], jobs
PY

# 2. another process gets the write lock while a big submit runs
"$Q" submit --db l.db --model "$M" --name lock big.jsonl >l.out 2>l.err &
pid=$!
# meanwhile status shows the job as "submitting" with its items so far, and leaves it alone
wait_items l.db "$pid" || fail "2"
"$Q" status --db l.db >l.status || fail "2: status"
grep -q "^job 1 'lock' \[submitting\]" l.status || { cat l.status; fail "2: status text"; }
"$Q" status --db l.db --json >l.json || fail "2: status --json"
python3 - l.json <<'PY' || fail "2: status --json of a job being submitted"
import json, sys
[j] = json.load(open(sys.argv[1]))
assert j["state"] == "submitting" and j["ready"] is False and j["items"] > 0, j
assert sum(j["by_state"].values()) == 0 and j["run_seconds"] == 0 and j["eta_s"] is None, j
PY
python3 - l.db "$pid" <<'PY' || fail "2: a writer waited too long for the lock during a submit"
import sqlite3, sys, time
db, pid = sys.argv[1], int(sys.argv[2])
def alive():
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited between open and read
        return False
def has_items_table():
    try:
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        ok = c.execute("SELECT count(*) FROM sqlite_master WHERE name = 'items'").fetchone()[0]
        c.close()
        return ok == 1
    except sqlite3.OperationalError:
        return False
while alive() and not has_items_table():
    time.sleep(0.01)
c = sqlite3.connect(db, timeout=5, isolation_level=None)
waits, seen = [], set()
while alive():
    t = time.monotonic()
    try:
        c.execute("BEGIN IMMEDIATE")
        seen.add(c.execute("SELECT count(*) FROM items").fetchone()[0])
        c.execute("COMMIT")
    except sqlite3.OperationalError as e:
        sys.exit(f"BEGIN IMMEDIATE failed after {time.monotonic() - t:.1f} s: {e}")
    waits.append(time.monotonic() - t)
    time.sleep(0.01)
if not waits:
    sys.exit("the submit ended before the first lock was tried (make its input larger)")
print(f"2: {len(waits)} write locks taken during the submit, longest wait {max(waits):.2f} s,"
      f" {len(seen)} different item counts seen under the lock")
# the lock was taken between the submit's transactions, not only before or after one big one:
# (how many times depends on the machine's speed; the submit has >= 6 transactions)
assert len(seen) >= 3, sorted(seen)
assert max(waits) < 5, max(waits)
PY
wait "$pid" || { cat l.err; fail "2: the submit failed"; }
[ "$(sql l.db "SELECT count(*) FROM items")" = "$BIG" ] || fail "2: items"
[ "$(sql l.db "SELECT ready FROM jobs")" = 1 ] || fail "2: the job is not ready"
sql l.db "SELECT exit_reason FROM runs WHERE kind = 'submit'" | grep -qx submitted ||
    fail "2: the submit run did not end as submitted"

# 3. blank lines are skipped, not items; bad lines are reported 20 at most
python3 - blank.jsonl "$BLANK" <<'PY'
import sys
n = int(sys.argv[2])
ws = ["", "", "", " ", "\t", "  \t ", "\r"]
with open(sys.argv[1], "w", newline="") as f:
    f.write('{"custom_id":"g1","prompt":"a"}\n')
    for i in range(n):
        f.write(ws[i % len(ws)] + "\n")
    f.write('{"custom_id":"g2","prompt":"b"}\n')
PY
zstd -q -19 --rm blank.jsonl -o blank.jsonl.zst
timeout 120 "$Q" submit --db b.db --model "$M" --name blank blank.jsonl.zst >b.out 2>b.err ||
    { head -30 b.err; fail "3: submit of blank lines"; }
[ "$(sql b.db "SELECT count(*) FROM items")" = 2 ] || fail "3: want 2 items"
[ "$(sql b.db "SELECT count(*) FROM items WHERE state = 'queued'")" = 2 ] || fail "3: queued"
grep -q "$BLANK blank lines skipped" b.err || { cat b.err; fail "3: blank lines not counted"; }
[ "$(wc -l <b.err)" -le 3 ] || { head b.err; fail "3: stderr has $(wc -l <b.err) lines"; }
size=$(python3 -c 'import os, sys; print(sum(os.path.getsize(p) for p in sys.argv[1:]
                                             if os.path.exists(p)))' b.db b.db-wal)
[ "$size" -lt 1048576 ] || fail "3: the database takes $size bytes"

python3 - bad.jsonl <<'PY'
with open("bad.jsonl", "w") as f:
    for i in range(50):
        f.write("not json %d\n" % i)
    f.write('{"custom_id":"g","prompt":"a"}\n')
PY
"$Q" submit --db w.db --model "$M" --name bad bad.jsonl >w.out 2>w.err || fail "3: bad lines"
[ "$(grep -c 'invalid_json' w.err)" = 20 ] || { cat w.err; fail "3: want 20 bad lines shown"; }
grep -q "30 more bad lines not shown" w.err || { cat w.err; fail "3: no count of the rest"; }
grep -q "1 queued, 50 invalid" w.err || { cat w.err; fail "3: summary"; }
# every bad line is an item that carries its error (queued until a run writes its record)
[ "$(sql w.db "SELECT count(*) FROM items WHERE error_code = 'invalid_json' AND payload IS NULL")" \
    = 50 ] || fail "3: rejected items"

# 4. --strict: a bad line after the first commits deletes everything
python3 - strict.jsonl <<'PY'
with open("strict.jsonl", "w") as f:
    for i in range(12000):
        f.write('{"custom_id":"c%d","prompt":"p"}\n' % i)
    f.write("not json\n")
    for i in range(12000, 12010):
        f.write('{"custom_id":"c%d","prompt":"p"}\n' % i)
PY
"$Q" submit --db s.db --model "$M" --name strict --strict strict.jsonl >s.out 2>s.err &&
    fail "4: --strict accepted a bad line"
grep -q "strict.jsonl:12001:" s.err || { cat s.err; fail "4: the bad line is not named"; }
grep -q "nothing was submitted" s.err || { cat s.err; fail "4: no 'nothing was submitted'"; }
[ "$(sql s.db "SELECT count(*) FROM jobs") $(sql s.db "SELECT count(*) FROM items")" = "0 0" ] ||
    fail "4: the failed submit left a job or items"
[ "$(sql s.db "SELECT exit_reason FROM runs WHERE kind = 'submit'")" = failed ] ||
    fail "4: the submit run did not end as failed"
[ -s s.out ] && fail "4: a job id was printed"

# 5. SIGINT mid-submit stops it cleanly
"$Q" submit --db i.db --model "$M" --name int big.jsonl >i.out 2>i.err &
pid=$!
wait_items i.db "$pid" || fail "5"
kill -INT "$pid"
rc=0
wait "$pid" || rc=$?
[ "$rc" = 1 ] || { cat i.err; fail "5: exit status $rc after SIGINT, want 1"; }
grep -q "interrupted by SIGINT" i.err || { cat i.err; fail "5: no interruption message"; }
grep -q "nothing was submitted" i.err || { cat i.err; fail "5: no 'nothing was submitted'"; }
[ "$(sql i.db "SELECT count(*) FROM jobs") $(sql i.db "SELECT count(*) FROM items")" = "0 0" ] ||
    fail "5: the interrupted submit left a job or items"
[ -s i.out ] && fail "5: a job id was printed"
# 6. (a CLI audit) an input that cannot be read is found before the queue file is made: a typo
# leaves nothing behind (it left an empty queue)
rc=0
"$Q" submit --db typo.db --model "$M" small.jsonl no-such-input.jsonl >/dev/null 2>typo.err || rc=$?
[ $rc = 1 ] && grep -q "no-such-input.jsonl" typo.err || fail "6: rc $rc: $(cat typo.err)"
ls typo.db* >/dev/null 2>&1 && fail "6: a failed submit left $(ls typo.db*)"
# 7. (a resource audit) more parts than open files: the error says to raise ulimit -n (it said
# "unable to open database file"), and nothing is left but the directory's submit lock
rc=0
(ulimit -n 40 && exec "$Q" submit --db fdP --partitions 40 --model "$M" small.jsonl >/dev/null 2>fd.err) ||
    rc=$?
[ $rc = 1 ] && grep -q "ulimit -n" fd.err || fail "7: exit $rc: $(cat fd.err)"
[ -z "$(ls fdP 2>/dev/null | grep -v '^\.')" ] || fail "7: left $(ls fdP)"

# 8. (found by an input audit, each silent before) a file cut while submit reads it; a file with
# no request in it (CR-only line ends); a BOM alone on a line; a file or zip member name that is
# not UTF-8 (its default custom_id came back altered and export refused the whole job) or is
# (a zip's UTF-8 name, unreadable in the C locale: the member was skipped)
python3 -c "
f = open('cut.jsonl', 'w')
for i in range(60000):
    f.write('{\"custom_id\": \"k%06d\", \"prompt\": \"p\"}\n' % i)"
rc=0
QUERN_FAULT=queue.commit:4:sleep=3 "$Q" submit --db cut.db --model "$M" cut.jsonl >/dev/null \
    2>cut.err &
pid=$!
for _ in $(seq 100); do grep -q "queue.commit #4: sleep" cut.err 2>/dev/null && break; sleep 0.1; done
truncate -s 1000000 cut.jsonl
wait $pid || rc=$?
[ $rc = 1 ] && grep -q "cut.jsonl changed while it was read" cut.err ||
    { cat cut.err; fail "8: a file cut during submit: exit $rc"; }
printf '{"prompt": "a"}\r{"prompt": "b"}\r' >cr.jsonl
rc=0; "$Q" submit --db cr.db --model "$M" cr.jsonl >/dev/null 2>cr.err || rc=$?
[ $rc = 1 ] && grep -q "no line of the input is a JSON object" cr.err ||
    { cat cr.err; fail "8: no request in the input: exit $rc"; }
# JSON objects that are all bad requests are a job of failed items, as any bad line is (it was
# refused as "not JSONL": an inbox retried such a file forever), one with a duplicate key too
# (a whole JSON object; such a file was still refused)
printf '{"prompt": "a", "max_token": 5}\n{"prompt": 7}\n' >allbad.jsonl
"$Q" submit --db allbad.db --name allbad --model "$M" allbad.jsonl >/dev/null 2>allbad.err ||
    { cat allbad.err; fail "8: a file of bad requests refused"; }
grep -q "every item of the job is a failed one" allbad.err || { cat allbad.err; fail "8: warning"; }
[ "$(sql allbad.db "SELECT count(*) FROM items WHERE error_code IS NOT NULL")" = 2 ] ||
    fail "8: the bad requests are not failed items"
printf '{"prompt": "a", "prompt": "b"}\n{"custom_id": "d", "custom_id": "e", "prompt": "c"}\n' \
    >dupkeys.jsonl
"$Q" submit --db allbad.db --name dupkeys --model "$M" dupkeys.jsonl >/dev/null 2>dup.err ||
    { cat dup.err; fail "8: a file of requests with duplicate keys refused"; }
[ "$(sql allbad.db "SELECT count(*) FROM items WHERE error_code = 'invalid_json'")" = 2 ] ||
    fail "8: the requests with duplicate keys are not failed items"
printf '\xef\xbb\xbf\r\n{"custom_id": "x", "prompt": "Hi", "max_tokens": 2}\r\n' >bom.jsonl
printf '{"prompt": "x", "max_tokens": 2}\n' >"$(printf 'caf\xe9.jsonl')"
python3 -c "
import zipfile
z = zipfile.ZipFile('names.zip', 'w')
z.writestr('caf\u00e9.jsonl', '{\"custom_id\": \"u1\", \"prompt\": \"z\", \"max_tokens\": 2}\n')
z.close()"
"$Q" submit --db names.db --name names --model "$M" bom.jsonl "$(printf 'caf\xe9.jsonl')" names.zip \
    >/dev/null 2>names.err || { cat names.err; fail "8: submit"; }
grep -q "4 lines, 3 queued, 0 invalid, 1 blank" names.err || { cat names.err; fail "8: $(cat names.err)"; }
"$Q" run --db names.db --out out --threads 1 >/dev/null 2>&1 || fail "8: run"
"$Q" export --db names.db --job names --out names.out.jsonl 2>/dev/null || fail "8: export"
python3 - <<'PY' || fail "8: the records' ids"
import json
ids = sorted(json.loads(l)["custom_id"] for l in open("names.out.jsonl"))
assert ids == ["caf%E9.jsonl:line-1", "u1", "x"], ids
PY
# (a line without custom_id whose default id another line took is told so, not "duplicate")
printf '{"custom_id": "line-2", "prompt": "a"}\n{"prompt": "b"}\n' >dflt.jsonl
"$Q" submit --db dflt.db --model "$M" dflt.jsonl >/dev/null 2>dflt.err || fail "8: submit dflt"
grep -q "dflt.jsonl:2: duplicate_custom_id: the line has no custom_id, and the one it gets by default, 'line-2', is another line's" dflt.err ||
    { cat dflt.err; fail "8: a taken default id"; }
# (- is standard input)
printf '{"prompt": "from a pipe"}\n' | "$Q" submit --db pipe.db --model "$M" - >/dev/null 2>pipe.err ||
    { cat pipe.err; fail "8: submit -"; }
grep -q "1 lines, 1 queued" pipe.err || fail "8: submit -: $(cat pipe.err)"
echo "e2e submit_reliability: ok"
