#!/usr/bin/env bash
# A full disk (a 2 MiB tmpfs in a private mount namespace, filled with a filler file):
#  1. runs whose queue's file system is full fail (exit 1, the message says the file system is
#     full) but give their items back without spending attempts: the WAL is checkpointed and
#     truncated to make room for the give-back (before, three such runs left every unfinished
#     item attempts_exhausted, and the next run with space answered them all with 500 errors);
#     once space is freed one run finishes the job, every line answered once with status 200;
#     1b: so do runs that fill the disk while they work (the queue's reserve file makes room);
#  2. with 0 bytes free, status says the file system is full (it cannot create the -shm file);
#  3. an export to a full file system fails and leaves the old export and no temporary file;
#  4. a queue on a read-only file system (a tmpfs remounted read-only): status, export and
#     report read it as stored, a partitioned one too (they failed: SQLite wants to create its
#     -shm file, or to lock the part), a run is
#     refused saying why; a queue whose WAL holds commits (its run killed) is refused with the
#     reason rather than read without them.
# Needs root (unshare -m, mount -t tmpfs); without it the script says NOT RUN and exits 0.
set -euo pipefail
. "$(dirname "$0")/lib/common.sh"
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
fail() {
    echo "e2e disk_full: FAIL: $*" >&2
    exit 1
}
if [ "$(id -u)" != 0 ] || ! unshare -m true 2>/dev/null; then
    echo "e2e disk_full: NOT RUN (needs root for a private tmpfs)"
    exit 0
fi
e2e_workdir
python3 -c '
for i in range(60):
    print("{\"custom_id\": \"p%03d\", \"prompt\": \"Write a short story number %d about a cat:\", \"max_tokens\": 32, \"temperature\": 0.7}" % (i, i))' >p60.jsonl
export Q M tmp
unshare -m bash -s <<'INNER' || exit 1
set -euo pipefail
fail() {
    echo "e2e disk_full: FAIL: $*" >&2
    exit 1
}
S=$tmp/small
mkdir -p "$S"
mount -t tmpfs -o size=2M tmpfs "$S"
# fill_to KIB: leave about KIB KiB free on $S
fill_to() {
    rm -f "$S/.filler"
    local n=$(($(df -k --output=avail "$S" | tail -1) - $1))
    [ "$n" -le 0 ] || fallocate -l "${n}K" "$S/.filler"
}
# attempts_unspent DB LABEL: after failed runs, no item leased or failed, every queued one at
# attempts 0 (prints the states)
attempts_unspent() {
    python3 - "$1" "$2" <<'PY'
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute(
    "SELECT state, attempts, count(*) FROM items GROUP BY 1, 2").fetchall()
print(sys.argv[2], "after the failed runs: (state, attempts, items)", rows)
assert all(a == 0 for s, a, n in rows if s == "queued"), rows
assert not [r for r in rows if r[0] in ("leased", "failed")], rows
PY
}
"$Q" submit --db "$S/q.db" --name j --model "$M" --out "$S/out" "$tmp/p60.jsonl" >/dev/null 2>&1 ||
    fail "submit"
fill_to 180
failed=0
for i in 1 2 3; do
    rc=0
    "$Q" run --db "$S/q.db" --threads 1 --flush-records 4 >/dev/null 2>"$tmp/run$i.err" || rc=$?
    [ "$rc" = 0 ] && break
    [ "$rc" = 1 ] || { cat "$tmp/run$i.err"; fail "1: run $i exited $rc"; }
    failed=$((failed + 1))
    grep -q "no space left on its file system" "$tmp/run$i.err" ||
        grep -q "No space left on device" "$tmp/run$i.err" ||
        { cat "$tmp/run$i.err"; fail "1: run $i does not say the disk is full"; }
done
[ "$failed" -ge 2 ] || fail "1: only $failed runs failed on the full disk (the test needs the disk to fill)"
attempts_unspent "$S/q.db" "  1." || fail "1: items spent attempts on a full disk"
rm -f "$S/.filler"
"$Q" run --db "$S/q.db" --threads 1 >/dev/null 2>"$tmp/runF.err" || { cat "$tmp/runF.err"; fail "1: run after freeing space"; }
"$Q" export --db "$S/q.db" --job j --out "$tmp/e.jsonl" 2>/dev/null || fail "1: export"
python3 - "$tmp/e.jsonl" <<'PY' || fail "1: the job's export"
import collections, json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
ids = collections.Counter(r["custom_id"] for r in recs)
assert sorted(ids) == ["p%03d" % i for i in range(60)] and max(ids.values()) == 1, ids
bad = [r["custom_id"] for r in recs if r["response"]["status_code"] != 200]
assert not bad, bad
PY
echo "  1. $failed runs failed on the full queue disk; the next one answered all 60 lines, status 200"
# 1b. runs each starting with 400 KiB free fill the disk while they work: the checkpoint that
# makes room must grow the database, which a full disk refuses, so the give-back failed and each
# run's items spent an attempt (3 such runs: attempts_exhausted, 500s for valid requests, exit
# 0). The run's reserve file beside the queue (deleted first to make room) keeps them.
"$Q" submit --db "$S/r.db" --name r --model "$M" --out "$S/rout" "$tmp/p60.jsonl" >/dev/null 2>&1 ||
    fail "1b: submit"
failed=0
for i in 1 2 3 4; do
    fill_to 400
    rc=0
    "$Q" run --db "$S/r.db" --threads 1 --flush-records 4 --max-seqs 8 >/dev/null \
        2>"$tmp/r$i.err" || rc=$?
    [ "$rc" = 0 ] && break
    failed=$((failed + 1))
done
[ "$failed" -ge 2 ] || fail "1b: only $failed runs failed on the full disk"
grep -q "the reserve file .*/.quern-reserve is deleted" "$tmp/r1.err" ||
    { cat "$tmp/r1.err"; fail "1b: no reserve used"; }
attempts_unspent "$S/r.db" "  1b." || fail "1b: items spent attempts on a disk that filled during runs"
rm -f "$S/.filler" "$S/r.db"* && rm -rf "$S/rout"
# 2. 0 bytes free: the queue cannot even be read (SQLite needs its -shm file)
fill_to 0
"$Q" status --db "$S/q.db" >/dev/null 2>"$tmp/st.err" && fail "2: status on a full disk succeeded?"
grep -q "no space left on its file system" "$tmp/st.err" || { cat "$tmp/st.err"; fail "2: status message"; }
rm -f "$S/.filler"
# 3. an export onto the full file system: fails, the old export stays, no temporary file
cp "$tmp/e.jsonl" "$S/e.jsonl"
cp "$S/q.db" "$tmp/q2.db" # (the queue elsewhere: the write of the export is what fails)
fill_to 4
"$Q" export --db "$tmp/q2.db" --job j --out "$S/e.jsonl" 2>"$tmp/ex.err" && fail "3: export onto a full disk succeeded?"
grep -q "No space left on device" "$tmp/ex.err" || { cat "$tmp/ex.err"; fail "3: export message"; }
cmp -s "$tmp/e.jsonl" "$S/e.jsonl" || fail "3: the old export changed"
ls "$S" | grep -q "tmp\." && fail "3: a temporary file is left"
echo "  2-3. status with 0 bytes free says so; an export onto a full disk fails and keeps the old one"
# 4. read-only media
R=$tmp/ro
mkdir -p "$R"
mount -t tmpfs -o size=8M tmpfs "$R"
head -8 "$tmp/p60.jsonl" >"$tmp/p8.jsonl"
"$Q" submit --db "$R/q.db" --model "$M" --name j "$tmp/p8.jsonl" >/dev/null 2>&1
"$Q" run --db "$R/q.db" --out "$R/out" --threads 1 >/dev/null 2>&1 || fail "4: run"
"$Q" export --db "$R/q.db" --job j --out "$tmp/rw.jsonl" 2>/dev/null || fail "4: export (writable)"
"$Q" submit --db "$R/P" --partitions 2 --model "$M" --name jp "$tmp/p8.jsonl" >/dev/null 2>&1
"$Q" run --db "$R/P" --threads 1 >/dev/null 2>&1 || fail "4: run of the parts"
"$Q" submit --db "$R/k.db" --model "$M" --name k "$tmp/p8.jsonl" >/dev/null 2>&1
rc=0
QUERN_FAULT=run.step:3:kill "$Q" run --db "$R/k.db" --out "$R/out" --threads 1 >/dev/null 2>&1 ||
    rc=$?
[ $rc = 137 ] || fail "4: the run meant to be killed exited $rc"
[ -s "$R/k.db-wal" ] || fail "4: the killed run left no WAL"
mount -o remount,ro "$R"
"$Q" status --db "$R/q.db" >"$tmp/ro.st" 2>"$tmp/ro.err" || { cat "$tmp/ro.err"; fail "4: status"; }
grep -q "^job 1 'j' \[done\]" "$tmp/ro.st" || { cat "$tmp/ro.st"; fail "4: status text"; }
grep -q "read-only file system: shown as stored" "$tmp/ro.err" || fail "4: status note"
"$Q" status --db "$R/q.db" --json 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)[0]
assert j["state"] == "done" and j["by_state"]["done"] == 8, j' || fail "4: status --json"
"$Q" export --db "$R/q.db" --job j --out "$tmp/ro.jsonl" 2>/dev/null || fail "4: export"
cmp -s "$tmp/rw.jsonl" "$tmp/ro.jsonl" || fail "4: the export differs from the one before"
"$Q" report --db "$R/q.db" --job j --out "$tmp/ro.html" 2>/dev/null || fail "4: report"
"$Q" status --db "$R/P" 2>/dev/null | grep -q "^job jp (2 parts in .*): done, 8/8 finished" ||
    fail "4: status of a partitioned queue"
"$Q" export --db "$R/P" --out "$tmp/rop.jsonl" 2>/dev/null && [ "$(wc -l <"$tmp/rop.jsonl")" = 8 ] ||
    fail "4: export of a partitioned queue"
rc=0
"$Q" run --db "$R/q.db" --out "$R/out" --threads 1 >/dev/null 2>"$tmp/ro.err" || rc=$?
[ $rc = 1 ] && grep -q "is on a read-only file system: this command writes the queue" "$tmp/ro.err" ||
    { cat "$tmp/ro.err"; fail "4: a run on read-only media: exit $rc"; }
rc=0
"$Q" status --db "$R/k.db" >/dev/null 2>"$tmp/ro.err" || rc=$?
[ $rc = 1 ] && grep -q "k.db-wal holds commits the database file lacks" "$tmp/ro.err" ||
    { cat "$tmp/ro.err"; fail "4: status of a queue with a WAL on read-only media: exit $rc"; }
echo "  4. a queue on a read-only file system: status, export and report read it; a run is refused"
INNER
echo "e2e disk_full: ok"
