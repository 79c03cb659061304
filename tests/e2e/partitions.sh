#!/usr/bin/env bash
# Partitioned queues end to end, with the real binary and model, as a Slurm array uses them:
#  1. submit --partitions 3 deals the lines out by estimated tokens (the parts' estimates are
#     within one line's estimate of each other although their line counts differ), a repeated
#     custom_id lands in the part that has it and fails there as a duplicate, and the parts
#     are rollback-journal files marked with their index; a second submit into a directory
#     whose submit lock is held (a submit still writing) is refused and touches nothing;
#  2. three runs (one finding its part in SLURM_ARRAY_TASK_ID) work at once; two are killed
#     with -9 mid-run and restarted from another working directory (another "node", the
#     directory given by another path), and every custom_id is in the combined export
#     exactly once, every part's shards match its manifest, and the combined manifest lists
#     every part's shards with their bytes, sha256 and records, complete;
#  3. a part held by another process (a Python connection with SQLite's exclusive lock): run
#     --part on it exits 75 (try later) while no run reports from it, 0 (leaving it alone)
#     when its progress file is fresh; status shows it in use, retry and export refuse it,
#     cancel leaves a request file; opening a part file as a plain queue is refused;
#  4. take-over: a part whose run was killed is finished by the run of another part after its
#     own, and a part whose task never started is left alone;
#  5. cancel of a part in use: its run sees the request, cancels, drops what it has in flight
#     and exits; the part cancelled before any output gets an empty manifest from the cancel
#     itself, the combined manifest is complete and says "cancelled" as a single queue's does, and
#     `export` bundles every part's manifest, the empty part's too;
#  6. a directory that looks like NFS (QUERN_TEST_FS_MAGIC) is fine for parts;
#  7. examples/quern-array.sbatch under a simulated Slurm (a fake scontrol): USR1 (twice, to
#     skip the grace) stops the task with exit 75 and it requeues itself; the requeued task finishes its part, with
#     --max-runtime taken from SLURM_JOB_END_TIME;
#  8. a run stopped with a part left exits 75; a job with a part cancelled is "cancelled";
#  9-13. (below) parts a submit did not make, parts without lines, a part that cannot be
#     opened, a cancel waiting for a reader, a cancel while a part's run loads its model.
set -euo pipefail
Q=$(realpath "${QUERN_BIN:-bin/quern}")
SBATCH=$(realpath examples/quern-array.sbatch)
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
. "$(dirname "$0")/lib/common.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }
e2e_workdir
N=60 TOK=32
RUN=(--flush-records 2 --flush-secs 0.2 --threads 1 --max-batch-tokens 256)

# N requests whose first half is long (long prompt, more tokens) and second half short, and
# one line repeating r3's custom_id.
python3 - "$N" "$TOK" >in.jsonl <<'PY'
import json, sys
n, tok = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    big = i < n // 2
    p = f"Item {i}: " + ("tell me about the sea and the sky. " * 6 if big else "count on:")
    # lengths spread out, so that records are committed a few at a time all along a run
    print(json.dumps({"custom_id": f"r{i}", "prompt": p,
                      "max_tokens": 2 + (i * 7) % (tok if big else tok // 4), "temperature": 0}))
print(json.dumps({"custom_id": "r3", "prompt": "again", "max_tokens": 2}))
PY

# part_done DIR K: committed done+failed items of part K from its progress file (0 if none).
part_done() {
    python3 - "$1/part-$(printf %04d "$2").progress.json" <<'PY'
import json, sys
try:
    p = json.load(open(sys.argv[1]))
    print(p["done"] + p["failed"])
except Exception:
    print(0)
PY
}

# wait_done DIR K MIN PID: until part K has MIN items committed (or its run has exited).
wait_done() {
    for _ in $(seq 1 600); do
        [ "$(part_done "$1" "$2")" -ge "$3" ] && return 0
        kill -0 "$4" 2>/dev/null || return 0
        sleep 0.1
    done
    fail "part $2 made no progress"
}

# check_parts DIR JOB N: combined export exactly once, each part's shards and manifest, and
# the combined manifest against them.
check_parts() {
    local dir=$1 job=$2 n=$3
    "$Q" export --db "$dir" --out "$job.all.jsonl" 2>/dev/null || fail "$job: export failed"
    PY_PROVENANCE=$PY_PROVENANCE python3 - "$job.all.jsonl" "$n" "out/$job" \
        "$("$Q" --version | head -1)" <<'PY' || fail "$job: combined output check"
import collections, hashlib, json, os, subprocess, sys
exec(os.environ["PY_PROVENANCE"])
ids = [json.loads(l)["custom_id"] for l in open(sys.argv[1])]
dup = [k for k, v in collections.Counter(ids).items() if v > 1]
assert not dup, f"duplicated custom_ids: {dup[:5]}"
assert len(ids) == int(sys.argv[2]), f"{len(ids)} records, want {sys.argv[2]}"
root = sys.argv[3]
m = json.load(open(os.path.join(root, "manifest.json")))
assert m["complete"] is True and m["parts_incomplete"] == [], m["parts_incomplete"]
listed, recs = set(), 0
for s in m["shards"]:
    p = os.path.join(root, s["file"])
    assert s["file"].startswith("part-%04d/" % s["part"]), s["file"]
    data = open(p, "rb").read()
    assert len(data) == s["bytes"] and hashlib.sha256(data).hexdigest() == s["sha256"], p
    lines = subprocess.run(["zstd", "-dc", p], capture_output=True, check=True).stdout
    assert lines.count(b"\n") == s["records"], p
    for l in lines.splitlines():
        json.loads(l)
    listed.add(s["file"])
    recs += s["records"]
assert recs == len(ids) == m["totals"]["results"]["records"] + m["totals"]["errors"]["records"]
check_provenance(m, len(ids), sys.argv[4], lambda s: s["part"])
on_disk = set()
for k in range(m["parts"]):
    d = os.path.join(root, "part-%04d" % k)
    pm = json.load(open(os.path.join(d, "manifest.json")))
    assert pm["complete"] is True, d
    on_disk |= {"part-%04d/%s" % (k, f) for f in os.listdir(d) if f.endswith(".jsonl.zst")}
    assert {"part-%04d/%s" % (k, s["file"]) for s in pm["shards"]} <= listed, d
assert on_disk == listed, (on_disk, listed)
PY
}

# ---- 1. submit ---------------------------------------------------------------------------
"$Q" submit --db A --partitions 3 --name ja --model "$M" in.jsonl >submit.out 2>submit.err ||
    { cat submit.err >&2; fail "submit --partitions"; }
[ "$(cat submit.out)" = A ] || fail "submit printed $(cat submit.out), want the directory"
[ -f A/quern-parts.json ] || fail "no catalogue"
python3 - "$N" <<'PY' || fail "parts"
import json, re, sqlite3, sys
n = int(sys.argv[1])
cat = json.load(open("A/quern-parts.json"))
assert cat["job"] == "ja" and cat["parts"] == 3, cat
loads = [float(x) for x in re.search(r"per part: ([\d ]+)", open("submit.err").read()).group(1).split()]
counts, dups = [], 0
for k in range(3):
    db = sqlite3.connect(f"A/part-{k:04d}.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    meta = dict(db.execute("SELECT key, value FROM meta"))
    assert meta["part"] == str(k) and meta["parts"] == "3" and meta["part_set"] == cat["part_set"]
    counts.append(db.execute("SELECT count(*) FROM items").fetchone()[0])
    dups += db.execute("SELECT count(*) FROM items WHERE error_code = 'duplicate_custom_id'").fetchone()[0]
    if db.execute("SELECT count(*) FROM items WHERE custom_id = 'r3'").fetchone()[0]:
        assert db.execute("SELECT count(*) FROM items WHERE error_code = 'duplicate_custom_id'").fetchone()[0] == 1
    db.close()
assert sum(counts) == n + 1 and dups == 1, (counts, dups)
big = 0  # the largest single line's estimate bounds the imbalance of a greedy deal
for l in open("in.jsonl"):
    r = json.loads(l)
    big = max(big, len(l) / 4 + r["max_tokens"])
assert max(loads) - min(loads) <= big, (loads, big)
assert len(set(counts)) > 1, f"line counts {counts}: the deal should follow tokens, not lines"
PY
mkdir L
(exec 9>L/.quern-submit.lock && flock 9 && exec sleep 30) &
lk=$!
pids+=("$lk")
for _ in $(seq 1 100); do flock -n L/.quern-submit.lock true || break; sleep 0.05; done
if "$Q" submit --db L --partitions 2 --name jl --model "$M" in.jsonl >/dev/null 2>l.err; then
    fail "a submit into a directory another submit holds was accepted"
fi
grep -q "another submit is writing a job into L" l.err || { cat l.err >&2; fail "lock message"; }
[ -z "$(ls L)" ] || fail "the refused submit left files: $(ls L)"
kill "$lk" 2>/dev/null || true
wait "$lk" 2>/dev/null || true
"$Q" submit --db L --partitions 2 --name jl --model "$M" in.jsonl >/dev/null 2>l.err ||
    { cat l.err >&2; fail "submit once the lock is free"; }
[ -f L/quern-parts.json ] || fail "no catalogue in L"

# ---- 2. three runs, two killed with -9 and restarted elsewhere ---------------------------
# Parts 0 and 2 are killed (SIGKILL, common/fault.h) at their second shard write: after their
# first commit and before their last, wherever the machine's speed puts it.
QUERN_FAULT=shard.write:2:kill "$Q" run --db A --part 0 --no-take-over "${RUN[@]}" >r0.out 2>r0.err &
p0=$!
SLURM_ARRAY_TASK_ID=1 "$Q" run --db A --no-take-over "${RUN[@]}" >r1.out 2>r1.err &
p1=$!
QUERN_FAULT=shard.write:2:kill "$Q" run --db A --part 2 --no-take-over "${RUN[@]}" >r2.out 2>r2.err &
p2=$!
pids+=("$p0" "$p1" "$p2")
for p in "$p0" "$p2"; do
    rc=0; wait "$p" 2>/dev/null || rc=$?
    [ $rc -eq 137 ] || { cat r0.err r2.err >&2; fail "a run meant to be killed exited $rc"; }
done
"$Q" status --db A --json >st.json 2>/dev/null || fail "status while part 1 runs"
python3 - <<'PY' || fail "status of a running partitioned job"
import json
j = json.load(open("st.json"))[0]
assert j["name"] == "ja" and j["parts"] == 3 and len(j["part_status"]) == 3, j
assert j["items"] == sum(p["items"] for p in j["part_status"]), j
# a part in use shows its run's engine from its progress file (if it is still running, and
# past loading its model: a slow start may still be there)
for p in j["part_status"]:
    if p["in_use"] and p["state"] == "running" and not p.get("loading"):
        assert len(p["engines"]) == 1 and p["engines"][0]["engine"]["matmul"], p
# parts 0 and 2, whose runs were killed: held by no run, running, no live run
for k in (0, 2):
    p = j["part_status"][k]
    assert not p["in_use"] and p["live"] is False and p["state"] == "running", p
PY
"$Q" status --db A >st.txt 2>/dev/null || fail "status text while part 1 runs"
grep -q "part    0: running .* no live run" st.txt || { cat st.txt; fail "status: part 0's dead run"; }
grep -q "part 1 of 3" r1.err || fail "SLURM_ARRAY_TASK_ID did not choose part 1"
mkdir -p node2/work
# part 0's killed run as if it had been on another node (a Slurm requeue lands elsewhere): the
# restarted run holds the part, so that run is dead and its leases come back at once (with
# --no-wait a run still waiting for them would exit 75)
python3 - <<'PY' || fail "moving part 0's killed run to another host"
import sqlite3
db = sqlite3.connect("A/part-0000.db")
db.execute("PRAGMA journal_mode = DELETE")
n = db.execute("UPDATE runs SET host = 'node-gone' WHERE ended IS NULL").rowcount
db.commit()
states = dict(db.execute("SELECT state, count(*) FROM items GROUP BY state").fetchall())
runs = db.execute("SELECT id, host, ended, exit_reason FROM runs").fetchall()
assert n == 1 and states.get("leased", 0) > 0, (n, states, runs)
PY
(cd node2/work && "$Q" run --db ../../A/ --part 0 --no-take-over --no-wait "${RUN[@]}" >../r0b.out 2>../r0b.err) ||
    { cat node2/r0b.err >&2; fail "restarted part 0"; }
(cd node2/work && "$Q" run --db "$tmp/A" --part 2 --no-take-over "${RUN[@]}" >../r2b.out 2>../r2b.err) ||
    { cat node2/r2b.err >&2; fail "restarted part 2"; }
wait "$p1" || { cat r1.err >&2; fail "part 1's run"; }
# the kills came mid-run: each restarted run still had items to finish
for f in node2/r0b.out node2/r2b.out; do
    python3 -c 'import json,sys; s=json.loads(open(sys.argv[1]).read().splitlines()[-1]); assert s["items_done"] + s["items_failed"] > 0, s' "$f" ||
        fail "$f: the killed run had already finished its part (the test needs a slower run)"
done
check_parts A ja $((N + 1))
# a run killed between a part's manifest and the combined one: a later run of a done part
# rebuilds the combined manifest
rm out/ja/manifest.json
"$Q" run --db A --part 1 --no-take-over "${RUN[@]}" >r1c.out 2>r1c.err || fail "run of a done part"
check_parts A ja $((N + 1))
# --order input over the parts: the input's order, not part by part (the catalogue lists the
# inputs; each part's items keep their lines' numbers)
"$Q" export --db A --out a.input.jsonl --order input 2>/dev/null || fail "export --order input"
python3 - <<'PY' || fail "export --order input of a partitioned job"
import json
want, seen = [], set()
for l in open("in.jsonl"):
    c = json.loads(l)["custom_id"]
    if c not in seen:
        seen.add(c)
        want.append(c)
got = [json.loads(l)["custom_id"] for l in open("a.input.jsonl")]
assert [c for c in got if c is not None] == want, (got[:10], want[:10])
assert len(got) == len(want) + 1, len(got)  # and the duplicate's record (custom_id null)
PY
# several inputs, one an archive of two members, and a bad line: the input's order too
python3 - <<'PY'
import io, json, tarfile
def lines(p, n):
    return [json.dumps({"custom_id": "%s%02d" % (p, i), "prompt": "x" * (1 + (i * 7) % 13),
                        "max_tokens": 1}) for i in range(n)]
open("oa.jsonl", "w").write("\n".join(lines("a", 9) + ["not json"] + lines("b", 3)) + "\n")
open("oc.jsonl", "w").write("\n".join(lines("e", 7)) + "\n")
with tarfile.open("od.tar", "w") as t:
    for m, p in (("m1.jsonl", "c"), ("m2.jsonl", "d")):
        data = ("\n".join(lines(p, 6)) + "\n").encode()
        ti = tarfile.TarInfo(m)
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
PY
"$Q" submit --db O --partitions 3 --name jo --model "$M" oa.jsonl od.tar oc.jsonl >/dev/null 2>&1 ||
    fail "submit of several inputs"
"$Q" run --db O --threads 1 >/dev/null 2>&1 || fail "run of several inputs"
"$Q" export --db O --out o.input.jsonl --order input 2>/dev/null || fail "export --order input of O"
python3 - <<'PY' || fail "export --order input of several inputs"
import json
got = [json.loads(l)["custom_id"] for l in open("o.input.jsonl")]
want = (["a%02d" % i for i in range(9)] + [None] + ["b%02d" % i for i in range(3)] +
        ["c%02d" % i for i in range(6)] + ["d%02d" % i for i in range(6)] +
        ["e%02d" % i for i in range(7)])
assert got == want, got
PY
# (a review: the combined manifest, whose directory holds no marker, could be overwritten)
rc=0; "$Q" export --db A --out out/ja/manifest.json 2>/dev/null || rc=$?
[ $rc = 2 ] && python3 -c 'import json; json.load(open("out/ja/manifest.json"))["shards"]' ||
    fail "export over the combined manifest: exit $rc"
"$Q" export --db A --out a.tar 2>/dev/null || fail "export of parts as a bundle"
python3 - <<'PY' || fail "the bundle of a partitioned queue"
import json, tarfile
t = tarfile.open("a.tar")
names = set(t.getnames())
m = json.load(t.extractfile("ja/manifest.json"))
assert m["complete"] and m["parts"] == 3
for s in m["shards"]:
    assert t.extractfile("ja/" + s["file"]).read() == open("out/ja/" + s["file"], "rb").read(), s
for k in range(3):
    assert f"ja/part-{k:04d}/manifest.json" in names, names
PY
"$Q" status --db A --json >st2.json 2>/dev/null || fail "status after the runs"
python3 - "$N" <<'PY' || fail "final status"
import json, sys
j = json.load(open("st2.json"))[0]
assert j["state"] == "done" and j["done"] == int(sys.argv[1]) and j["failed"] == 1, j
assert all(p["state"] == "done" and not p["in_use"] for p in j["part_status"]), j
# one engine ran every part (same binary and options), and each part says which runs
assert len(j["engines"]) == 1 and j["engines"][0]["parts"] == [0, 1, 2], j["engines"]
assert all(p["engines"][0]["engine"] == j["engines"][0]["engine"] for p in j["part_status"])
PY
"$Q" status --db A | grep -q "^  engine: .*matmul .*(parts 0, 1, 2)$" || fail "status text: engine"

# ---- 3. a part held by another process ---------------------------------------------------
make_job() { # make_job DIR NAME PARTS N TOK
    python3 - "$4" "$5" >"$2.jsonl" <<'PY'
import json, sys
for i in range(int(sys.argv[1])):
    print(json.dumps({"custom_id": f"q{i}", "prompt": f"Item {i}: the number after {i} is",
                      "max_tokens": 2 + (i * 7) % int(sys.argv[2]), "temperature": 0}))
PY
    "$Q" submit --db "$1" --partitions "$3" --name "$2" --model "$M" "$2.jsonl" >/dev/null 2>&1 ||
        fail "submit $2"
}
make_job B jb 2 8 4
python3 -c '
import sqlite3, sys, time
db = sqlite3.connect("B/part-0001.db", isolation_level=None)
db.execute("PRAGMA locking_mode = EXCLUSIVE")
db.execute("BEGIN EXCLUSIVE")
open("held", "w").close()
time.sleep(600)' &
holder=$!
pids+=("$holder")
for _ in $(seq 1 100); do [ -e held ] && break; sleep 0.1; done
# held with no run reporting from it (a reader, or a crashed host's lock): exit 75, try later
rc=0; "$Q" run --db B --part 1 --no-take-over "${RUN[@]}" >/dev/null 2>busy.err || rc=$?
[ $rc -eq 75 ] || fail "run on a part locked without a run: exit $rc, want 75"
grep -q "no run reports progress" busy.err || fail "run on a locked part: $(cat busy.err)"
# a progress file that is recent but does not change (a run that just ended, a reader
# holding the part): no run reports, exit 75
echo '{}' >B/part-0001.progress.json
rc=0; "$Q" run --db B --part 1 --no-take-over "${RUN[@]}" >/dev/null 2>busy.err || rc=$?
[ $rc -eq 75 ] || fail "run on a locked part with a still progress file: exit $rc, want 75"
# held by a run that reports (its progress file replaced as a run does, every 0.3 s): that
# run's to finish, exit 0
(while :; do echo "{\"t\": $RANDOM}" >B/p.tmp && mv B/p.tmp B/part-0001.progress.json; sleep 0.3; done) &
reporter=$!
pids+=("$reporter")
"$Q" run --db B --part 1 --no-take-over "${RUN[@]}" >/dev/null 2>busy.err ||
    fail "run on a part in use: exit $?, want 0"
grep -q "in use by a run" busy.err || fail "run on a part in use: $(cat busy.err)"
kill "$reporter"; wait "$reporter" 2>/dev/null || true
rm B/part-0001.progress.json
"$Q" status --db B >st.txt 2>/dev/null || true
grep -q "part    1: unknown.*in use" st.txt || { cat st.txt >&2; fail "status of a part in use"; }
rc=0; "$Q" retry --db B --failed 2>retry.err || rc=$?
[ $rc -eq 1 ] && grep -q "in use" retry.err || fail "retry of a part in use: exit $rc"
rc=0; "$Q" export --db B --out b.jsonl 2>exp.err || rc=$?
[ $rc -eq 1 ] && grep -q "part 1 is in use" exp.err && [ ! -e b.jsonl ] ||
    fail "export of a part in use: exit $rc"
# cancel: a part whose run reports gets a request file, which its run acts on (exit 0) ...
(while :; do echo "{\"t\": $RANDOM}" >B/p.tmp && mv B/p.tmp B/part-0001.progress.json; sleep 0.3; done) &
reporter=$!
pids+=("$reporter")
"$Q" cancel --db B 2>cancel.err || fail "cancel with a part in use: $(cat cancel.err)"
kill "$reporter"; wait "$reporter" 2>/dev/null || true
rm B/part-0001.progress.json
grep -q "part 1 is in use: its run cancels it" cancel.err || fail "cancel: $(cat cancel.err)"
[ -e B/part-0001.cancel ] || fail "cancel left no request for the part in use"
# ... one locked with no run reporting is waited for (30 s), then exit 1, the request kept
rc=0; "$Q" cancel --db B 2>cancel.err || rc=$?
[ $rc -eq 1 ] && grep -q "part 1 is locked by another process and no run reports" cancel.err ||
    fail "cancel of a part locked by a non-run: exit $rc $(cat cancel.err)"
[ -e B/part-0001.cancel ] || fail "the request for the locked part was not kept"
rm -f B/part-0001.cancel
kill "$holder"; wait "$holder" 2>/dev/null || true
rc=0; "$Q" status --db B/part-0000.db 2>plain.err || rc=$?
[ $rc -eq 1 ] && grep -q "part 0 of a partitioned queue" plain.err ||
    fail "a part opened as a plain queue: exit $rc $(cat plain.err)"
[ "$(sqlite3 B/part-0000.db 'PRAGMA journal_mode')" = delete ] || fail "the refused part changed"

# ---- 4. take-over of a dead part, never of one not started -------------------------------
make_job C jc 3 30 "$TOK"
QUERN_FAULT=shard.write:2:kill "$Q" run --db C --part 1 --no-take-over "${RUN[@]}" >c1.out 2>c1.err &
pc=$!
pids+=("$pc")
rc=0; wait "$pc" 2>/dev/null || rc=$?
[ $rc -eq 137 ] || { cat c1.err >&2; fail "part 1's run, meant to be killed, exited $rc"; }
"$Q" run --db C --part 0 "${RUN[@]}" >c0.out 2>c0.err || { cat c0.err >&2; fail "part 0 + take-over"; }
grep -q "taking over part 1 of 3" c0.err || { cat c0.err >&2; fail "part 1 was not taken over"; }
grep -q "part 2 of 3" c0.err && fail "part 2 (never started) was taken over"
"$Q" status --db C --json >stc.json 2>/dev/null
python3 - <<'PY' || fail "take-over status"
import json
p = {x["part"]: x for x in json.load(open("stc.json"))[0]["part_status"]}
assert p[0]["state"] == "done" and p[1]["state"] == "done", p
assert p[2]["state"] == "queued" and p[2]["done"] == 0, p[2]
PY
"$Q" run --db C "${RUN[@]}" >/dev/null 2>c2.err || fail "run without --part"
grep -q "working on part 2 of 3" c2.err || fail "run without --part skipped part 2"
check_parts C jc 30

# check_jd_manifests WHEN: part 0 with its shards, part 1 empty, all complete and cancelled
check_jd_manifests() {
    python3 - <<'PY' || fail "the manifests of a cancelled partitioned job ($1)"
import json
m = json.load(open("out/jd/manifest.json"))
assert m["complete"] is True and m["parts_incomplete"] == [], m["parts_incomplete"]
assert m.get("cancelled") is True, "the combined manifest does not say cancelled"
p = [json.load(open(f"out/jd/part-{k:04d}/manifest.json")) for k in range(2)]
assert all(x["complete"] is True and x.get("cancelled") is True for x in p), p
assert p[0]["shards"] and p[1]["shards"] == [], (p[0]["shards"], p[1]["shards"])
assert [s["file"] for s in m["shards"]] == ["part-0000/" + s["file"] for s in p[0]["shards"]]
PY
}
# ---- 5. cancel reaches a part's run through its request file -----------------------------
make_job D jd 2 400 48 # ~30 s of work in part 0: the cancel must find it running
"$Q" run --db D --part 0 --no-take-over "${RUN[@]}" >d0.out 2>d0.err &
pd=$!
pids+=("$pd")
wait_done D 0 1 "$pd"
"$Q" cancel --db D 2>dcancel.err || fail "cancel: $(cat dcancel.err)"
wait "$pd" || { cat d0.err >&2; fail "the cancelled run failed"; }
grep -q "cancelled on request" d0.err || { cat d0.err >&2; fail "the run did not act on the cancel"; }
# ... and stopped computing: what it had in flight left the engine
grep -q "unfinished requests dropped" d0.err || { cat d0.err >&2; fail "the run computed on"; }
[ ! -e D/part-0000.cancel ] || fail "the request file stayed"
"$Q" status --db D --json >std.json 2>/dev/null
python3 - <<'PY' || fail "cancelled status"
import json
j = json.load(open("std.json"))[0]
assert j["state"] == "cancelled" and j["unfinished"] == 0 and j["cancelled"] > 0, j
PY
# part 1 was cancelled by `quern cancel` itself (not in use), before any output: the cancel
# sealed it (an empty manifest), and part 0's run the rest: the combined manifest is complete
# without another run (before, it waited for a run of part 1)
check_jd_manifests "after the cancel"
# its array task still runs, and finds nothing to do
"$Q" run --db D --part 1 --no-take-over "${RUN[@]}" >d1.out 2>d1.err ||
    { cat d1.err >&2; fail "the run of a part cancelled before any output"; }
check_jd_manifests "after the run of the cancelled part"
"$Q" export --db D --out d.tar 2>/dev/null || fail "export of the cancelled parts as a bundle"
python3 - <<'PY' || fail "the bundle of a cancelled partitioned job lacks a manifest"
import tarfile
names = set(tarfile.open("d.tar").getnames())
assert {"jd/manifest.json", "jd/part-0000/manifest.json", "jd/part-0001/manifest.json"} <= names, names
PY

# ---- 6. parts on a network file system -------------------------------------------------
QUERN_TEST_FS_MAGIC=0x6969 "$Q" submit --db E --partitions 2 --name je --model "$M" in.jsonl \
    >/dev/null 2>e.err || { cat e.err >&2; fail "submit --partitions on NFS"; }
QUERN_TEST_FS_MAGIC=0x6969 "$Q" status --db E >/dev/null 2>&1 || fail "status of parts on NFS"
# ---- 7. the Slurm array script, with Slurm's side played by the test -----------------------
mkdir -p fakebin
ln -s "$Q" fakebin/quern
printf '#!/bin/sh\necho "$@" >>"%s/scontrol.log"\n' "$tmp" >fakebin/scontrol
chmod +x fakebin/scontrol
# 700 items a part, more than a run ever holds (it claims up to twice --max-seqs 256 before its
# first step, and its first progress file follows that step), each of 2-4 tokens: the USR1s come
# as soon as the run reports, so items are left unclaimed however fast the machine (with 60
# items all were claimed at once and a fast CPU finished them between the two signals: exit 0)
make_job F jf 2 1400 3
PATH="$tmp/fakebin:$PATH" SLURM_ARRAY_JOB_ID=77 SLURM_ARRAY_TASK_ID=1 SLURM_CPUS_PER_TASK=1 \
    bash "$SBATCH" F >sb1.log 2>&1 &
ps=$!
pids+=("$ps")
# (its engine ready: a progress file that no longer says "loading")
working() { [ -e "$1" ] && ! grep -q '"loading":true' "$1"; }
wait_working() { # progress file, the task's pid: 0 once its run works, 1 if it never did
    for _ in $(seq 1 600); do
        working "$1" && return 0
        kill -0 "$2" 2>/dev/null || break
        sleep 0.1
    done
    working "$1"
}
wait_working F/part-0001.progress.json "$ps" ||
    { cat sb1.log >&2; fail "the array task's run never reported"; }
kill -USR1 "$ps" # stop admitting ...
sleep 0.5
# ... and skip the script's 90 s grace (unless the task has ended: its stop gave the requests
# not started back at once and the running ones, of 2-4 tokens, may finish within the 0.5 s)
kill -USR1 "$ps" 2>/dev/null || true
rc=0; wait "$ps" || rc=$?
[ $rc -eq 75 ] || { cat sb1.log >&2; fail "array task stopped by USR1: exit $rc, want 75"; }
grep -qx "requeue 77_1" scontrol.log || fail "the task did not requeue itself: $(cat scontrol.log)"
PATH="$tmp/fakebin:$PATH" SLURM_ARRAY_JOB_ID=77 SLURM_ARRAY_TASK_ID=1 SLURM_CPUS_PER_TASK=1 \
    SLURM_JOB_END_TIME=$(($(date +%s) + 3600)) bash "$SBATCH" F >sb2.log 2>&1 ||
    { cat sb2.log >&2; fail "requeued array task"; }
grep -q "SLURM_JOB_END_TIME: --max-runtime 34[0-9][0-9] s" sb2.log ||
    fail "the allocation's end did not set --max-runtime"
[ "$(wc -l <scontrol.log)" -eq 1 ] || fail "a finished task requeued itself"
# 7b. scancel or preemption: Slurm sends TERM to every process of the job and kills what is left
#     the moment the batch script exits. The script (its own process group here, as a job's)
#     waits through the TERM until quern has stopped (exit 75), does not requeue itself, and no
#     quern is left for that kill; before, the shell died at once (143) with quern in its grace.
#     The array is one task short of the parts: quern warns.
make_job G jg 2 1400 3
PATH="$tmp/fakebin:$PATH" SLURM_ARRAY_JOB_ID=78 SLURM_ARRAY_TASK_ID=0 SLURM_ARRAY_TASK_COUNT=1 \
    SLURM_CPUS_PER_TASK=1 setsid bash "$SBATCH" G >sb3.log 2>&1 &
ps=$!
pids+=("$ps")
wait_working G/part-0000.progress.json "$ps" ||
    { cat sb3.log >&2; fail "the array task's run (7b) never reported"; }
kill -TERM -- -"$ps" # the job's processes, the shell and quern alike
rc=0; wait "$ps" || rc=$?
[ $rc -eq 75 ] || { cat sb3.log >&2; fail "array task after Slurm's TERM: exit $rc, want 75"; }
! pgrep -g "$ps" >/dev/null || fail "a process of the job outlived its batch script"
grep -q "not requeued" sb3.log && [ "$(wc -l <scontrol.log)" -eq 1 ] ||
    { cat sb3.log scontrol.log >&2; fail "a task stopped by TERM requeued itself"; }
grep -q "this Slurm array has 1 task(s) from index 0, but G has 2 parts" sb3.log ||
    { cat sb3.log >&2; fail "no warning for an array short of the parts"; }

# 8. (found by a kill -9 chaos audit) a run without --part stopped by --max-runtime after its
# first part, with another part untouched, exits 75, not 0; a job with one part done and one
# cancelled is "cancelled" in status, as its combined manifest says (status said "done")
# (part 0's two items, 200 letters each by grammar, are in flight when --max-runtime stops the
# claims and finish in the grace: part 0 drained, its run exited 0, and so did quern run)
python3 -c '
import json
for i in range(4):
    print(json.dumps({"custom_id": "g%d" % i, "prompt": "Letters:", "max_tokens": 400,
                      "grammar": "root ::= ([a-z] \" \"){200}"}))' >jh.jsonl
"$Q" submit --db H --partitions 2 --name jh --model "$M" jh.jsonl >/dev/null 2>&1 || fail "8: submit"
rc=0
"$Q" run --db H --threads 1 --grace 60 --max-runtime 0.5 >/dev/null 2>h.log || rc=$?
[ $rc = 75 ] || { cat h.log; fail "8: a stopped run with a part left exited $rc"; }
make_job I ji 2 20 4
"$Q" run --db I --part 1 --no-take-over --threads 1 >/dev/null 2>i.log || { cat i.log; fail "8: part 1"; }
"$Q" cancel --db I 2>/dev/null || fail "8: cancel"
"$Q" run --db I --part 0 --threads 1 >/dev/null 2>>i.log || { cat i.log; fail "8: part 0"; }
"$Q" status --db I --json | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]
assert s["state"] == "cancelled" and s["cancelled"] > 0, (s["state"], s["cancelled"])
assert json.load(open("out/ji/manifest.json"))["cancelled"] is True' ||
    fail "8: the state of a job with a cancelled part"

# ---- 9. (found by a partitioned-queue audit) files a submit did not make --------------------
# a file at a new part's name was written into (a plain queue there became a broken part) or,
# when the submit then failed, deleted with whatever it held
mkdir -p K && echo precious >K/part-0001.db
rc=0
"$Q" submit --db K --partitions 2 --name jk --model "$M" jh.jsonl >/dev/null 2>k.log || rc=$?
[ $rc = 1 ] && grep -q "part-0001.db exists" k.log || { cat k.log; fail "9: submit over a file: $rc"; }
[ "$(cat K/part-0001.db)" = precious ] || fail "9: the file at a part's name was changed or deleted"
[ ! -e K/part-0000.db ] && [ ! -e K/quern-parts.json ] || fail "9: the refused submit left parts"

# ---- 10. more parts than lines: a run without --part finishes the job -----------------------
# (the parts that got no line stayed queued for ever, the combined manifest incomplete, and the
# run exited 0)
make_job P jp 5 2 4
"$Q" status --db P --json | python3 -c '
import json, sys
p = json.load(sys.stdin)[0]["part_status"]
assert sum(x["state"] == "done" for x in p) == 3, p' || fail "10: empty parts are not done"
"$Q" run --db P --threads 1 >/dev/null 2>p.log || { cat p.log; fail "10: run"; }
"$Q" status --db P --json | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]
assert s["state"] == "done" and s["done"] == 2, s
m = json.load(open("out/jp/manifest.json"))
assert m["complete"] is True and m["parts_incomplete"] == [], m
assert len(m["shards"]) >= 1' || fail "10: the job of an empty part"
# a cancel seals them too (they stayed out of the combined manifest), and parts an older quern
# left queued without items are finished by a run
make_job S js 3 1 4
"$Q" cancel --db S 2>/dev/null || fail "10: cancel"
python3 -c '
import json
m = json.load(open("out/js/manifest.json"))
assert m["complete"] is True and m["parts_incomplete"] == [] and m["cancelled"] is True, m' ||
    fail "10: the manifest of a cancelled job with empty parts"
make_job T jt 3 1 4
for k in 1 2; do sqlite3 T/part-000$k.db "UPDATE jobs SET state = 'queued', finished = NULL"; done
"$Q" run --db T --threads 1 >/dev/null 2>t.log || { cat t.log; fail "10: run of old empty parts"; }
python3 -c '
import json
m = json.load(open("out/jt/manifest.json"))
assert m["complete"] is True and m["parts_incomplete"] == [], m' ||
    fail "10: parts left queued without items"

# ---- 11. a part that cannot be opened fails the run (it exited 0, the part skipped) ---------
make_job N jn 3 6 4
rm N/part-0001.db
rc=0
"$Q" run --db N --threads 1 >/dev/null 2>n.log || rc=$?
[ $rc = 1 ] && grep -q "part 1: " n.log || { cat n.log; fail "11: a missing part: exit $rc"; }

# ---- 12. a cancel waits for a reader's lock on a part no run works on ----------------------
# (it left a request file for a run that never came: "part 1 is in use: its run cancels it",
# and the job stayed running)
make_job R jr 2 6 4
rm -f held
python3 -c '
import sqlite3, time
db = sqlite3.connect("R/part-0001.db", isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
open("held", "w").close()
time.sleep(8)' &
reader=$!
pids+=("$reader")
for _ in $(seq 1 100); do [ -e held ] && break; sleep 0.1; done
"$Q" cancel --db R 2>r.cancel || { cat r.cancel; fail "12: cancel"; }
wait "$reader" || true
"$Q" status --db R --json | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]
assert s["state"] == "cancelled" and s["unfinished"] == 0, s' || fail "12: the part was not cancelled"
[ ! -e R/part-0001.cancel ] || fail "12: the request file stayed"
# ---- 13. a cancel while a part's run loads its model -----------------------------------
# (the run published no progress before its engine was ready: the cancel took it for a
# reader, waited 30 s for the lock and exited 1 "cancel again later"; status said "unknown")
make_job LM jlm 2 6 4
QUERN_FAULT=run.model_load:1:sleep=20 "$Q" run --db LM --part 0 --no-take-over "${RUN[@]}" \
    >l0.out 2>l0.err &
pl=$!
pids+=("$pl")
for _ in $(seq 1 100); do
    grep -q "run.model_load #1: sleep" l0.err && [ -e LM/part-0000.progress.json ] && break
    sleep 0.1
done
"$Q" status --db LM >l.st 2>&1 || true
grep -q "part    0: running.*loading the model" l.st || { cat l.st; fail "13: status while loading"; }
t0=$(date +%s)
"$Q" cancel --db LM 2>l.cancel || { cat l.cancel; fail "13: cancel while the run loads"; }
[ $(($(date +%s) - t0)) -lt 15 ] || fail "13: the cancel waited for the lock ($(cat l.cancel))"
grep -q "part 0 is in use: its run cancels it" l.cancel || { cat l.cancel; fail "13: cancel"; }
wait "$pl" || { cat l0.err; fail "13: the loading run failed"; }
grep -q "cancelled on request" l0.err || { cat l0.err; fail "13: the run did not cancel"; }
"$Q" status --db LM --json | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]
assert s["state"] == "cancelled" and s["unfinished"] == 0, s' || fail "13: not cancelled"

echo "partitions: ok"
