# Shared helpers for the end-to-end scripts (sourced, not run by tests/run_tests.sh).
# Needs: Q (quern binary), M (model), fail() defined by the caller, and a working directory
# holding out/<job>/ for each job.

# e2e_workdir: make $tmp, a fresh working directory, and cd into it; at exit every PID added to
# the array pids is killed and $tmp removed.
pids=()
e2e_workdir() {
    tmp=$(mktemp -d)
    trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
    cd "$tmp"
}

# check_job DB JOB N_EXPECTED [OUTROOT]: export, exactly-once ids, shard integrity, manifest.
# (Python, in the scripts below) provenance: every finished item's record is counted once, for
# the run that wrote it, and each such run is listed with its engine, from this quern
PY_PROVENANCE='
def check_provenance(m, n, version, part=lambda s: None):
    runs = {(r.get("part"), r["run"]): r for r in m["runs"]}
    total = 0
    for s in m["shards"]:
        got = sum(w["records"] for w in s["runs"])
        assert got + s["superseded"] == s["records"], (s["file"], got, s["superseded"], s["records"])
        for w in s["runs"]:
            assert (part(s), w["run"]) in runs, (s["file"], w, sorted(runs))
        total += got
    assert total == n, f"the runs wrote {total} records, want {n}"
    for r in runs.values():
        e = r["engine"]
        assert isinstance(e, dict) and set(e) == {"quern", "device", "matmul", "kv_dtype", "kv_block"}, r
        assert isinstance(e["kv_block"], int) and e["kv_block"] > 0, r
        assert version == "quern " + e["quern"], (version, e)
'

# (Python) a record's identity: its custom_id, or for a line whose id could not be read
# (custom_id null) the file and line its error message begins with
PY_RECORD_KEY='
import re
def record_key(r):
    if r["custom_id"] is not None:
        return r["custom_id"]
    e = ((r.get("response") or {}).get("body") or {}).get("error") or r.get("error") or {}
    m = re.match(r"(.+?:[0-9]+):", e.get("message") or "")
    return "null@" + (m.group(1) if m else (e.get("message") or ""))
'

check_job() {
    local db=$1 job=$2 n=$3 root=${4:-out}
    "$Q" export --db "$db" --job "$job" --out "$job.export.jsonl" 2>/dev/null ||
        fail "$job: export failed"
    PY_RECORD_KEY=$PY_RECORD_KEY python3 - "$job.export.jsonl" "$n" <<'PY' || fail "$job: export check"
import collections, json, os, sys
exec(os.environ["PY_RECORD_KEY"])
ids = [record_key(json.loads(l)) for l in open(sys.argv[1])]
dup = [k for k, v in collections.Counter(ids).items() if v > 1]
assert not dup, f"duplicated custom_ids: {dup[:5]}"
assert len(ids) == int(sys.argv[2]), f"{len(ids)} records, want {sys.argv[2]}"
PY
    local dir=$root/$job
    for f in "$dir"/*.jsonl.zst; do
        [ -e "$f" ] || continue
        zstd -q -t "$f" || fail "$f is not a valid zstd stream"
        zstd -q -dc "$f" | python3 -c '
import json, sys
for l in sys.stdin: json.loads(l)' || fail "$f holds a partial or invalid line"
    done
    PY_PROVENANCE=$PY_PROVENANCE python3 - "$dir" "$n" "$("$Q" --version | head -1)" <<'PY' || fail "$job: manifest does not match the shards"
import hashlib, json, os, sys, subprocess
exec(os.environ["PY_PROVENANCE"])
d = sys.argv[1]
m = json.load(open(os.path.join(d, "manifest.json")))
assert m["complete"] is True, "manifest not complete"
check_provenance(m, int(sys.argv[2]), sys.argv[3])
listed = set()
for s in m["shards"]:
    p = os.path.join(d, s["file"])
    data = open(p, "rb").read()
    assert len(data) == s["bytes"], (p, len(data), s["bytes"])
    assert hashlib.sha256(data).hexdigest() == s["sha256"], p
    lines = subprocess.run(["zstd", "-dc", p], capture_output=True, check=True).stdout.count(b"\n")
    assert lines == s["records"], (p, lines, s["records"])
    listed.add(s["file"])
on_disk = {f for f in os.listdir(d) if f.endswith(".jsonl.zst")}
assert on_disk == listed, (on_disk, listed)
PY
}

# check_partial DB JOB: whatever is committed so far is there exactly once and decodes.
check_partial() {
    local db=$1 job=$2
    "$Q" export --db "$db" --job "$job" --out "$job.partial.jsonl" 2>/dev/null ||
        fail "$job: export of a partial job failed"
    PY_RECORD_KEY=$PY_RECORD_KEY python3 - "$job.partial.jsonl" <<'PY' || fail "$job: partial export check"
import collections, json, os, sys
exec(os.environ["PY_RECORD_KEY"])
ids = [record_key(json.loads(l)) for l in open(sys.argv[1])]
dup = [k for k, v in collections.Counter(ids).items() if v > 1]
assert not dup, f"duplicated custom_ids: {dup[:5]}"
PY
}

# make_small FILE N: N short greedy prompts r0..r(N-1).
make_small() {
    python3 - "$1" "$2" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"Item {i}: the number after {i} is",
                            "max_tokens": 6, "temperature": 0}) + "\n")
PY
}

# kill_after_second_sample DB PID DONE: wait until DONE items of DB are finished and the first
# run has recorded its second time-series sample (BATCH_SAMPLE_S apart), then kill -9 PID. It
# fails if the run ends first or had no work left (the job is too short for this machine), or
# after 120 s.
kill_after_second_sample() {
    local db=$1 pid=$2 want=$3 ok=0
    for _ in $(seq 1 1200); do
        ok=$(sqlite3 "$db" "SELECT (SELECT count(*) FROM items WHERE state = 'done') >= $want
            AND (SELECT count(*) FROM samples WHERE run_id = (SELECT min(id) FROM runs
                 WHERE kind = 'run')) >= 2" 2>/dev/null || echo 0)
        [ "$ok" = 1 ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null || fail "the first run finished before it could be killed (make the job longer)"
    [ "$ok" = 1 ] || fail "no second sample from the first run within 120 s"
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    # the job's end writes a sample too: the kill must have left work undone
    [ "$(sqlite3 "$db" "SELECT count(*) FROM items WHERE state IN ('queued', 'leased')")" -gt 0 ] ||
        fail "the first run had finished the job when it was killed (make the job longer)"
}
