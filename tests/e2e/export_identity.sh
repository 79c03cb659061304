#!/usr/bin/env bash
# End-to-end tests of `quern export`: a record's identity is its place (shard, record number),
# and the output file is written atomically.
#  1. the reported repro: 5 requests whose max_tokens exceeds the context among many small
#     ones, `retry --failed` while the run is still active, so the same run appends the 5 error
#     records again to its open errors shard: every custom_id exactly once, as many records as
#     input lines, in both --order shard and --order input, .jsonl and .jsonl.zst;
#  2. atomic output: a symlink planted at the old fixed temp name (<out>.tmp) is not followed,
#     a symlink at the final path is replaced (its target untouched), a missing directory
#     creates nothing, and an export that fails midway (a shard cut short) leaves the previous
#     output byte-identical and no temp file, for .jsonl and .tar.zst alike; an export
#     interrupted while it reads (a shard replaced by a FIFO) by SIGTERM leaves nothing, by
#     SIGKILL only its temp file, never a file at the final path;
#  3. an errors shard holding lines no item names (custom_id null, or an unknown id) exports
#     cleanly, and items without a record number (schema v1) fall back to custom_id, one record
#     each;
#  4. --order input over several input files follows the order they were submitted in.
# Under sanitizers (QUERN_SANITIZE) the same checks run on 60 small requests instead of 300.
set -euo pipefail
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
N=300
[ -n "${QUERN_SANITIZE:-}" ] && N=60
tmp=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }

# state_count DB JOB STATE: the job's item count in STATE, from `quern status --json`
state_count() {
    "$Q" status --db "$1" --job "$2" --json 2>/dev/null |
        python3 -c "import json,sys; print(json.load(sys.stdin)[0]['by_state']['$3'])" \
            2>/dev/null || echo 0
}

# check_export FILE: every input custom_id exactly once, the 5 big ones as context errors
check_export() {
    python3 - "$1" in.jsonl <<'PY' || fail "$1: export check"
import collections, json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
want = [json.loads(l)["custom_id"] for l in open(sys.argv[2])]
ids = [r["custom_id"] for r in recs]
dup = [k for k, v in collections.Counter(ids).items() if v > 1]
assert not dup, f"{len(recs)} records, {len(set(ids))} ids; duplicated: {dup[:5]}"
assert len(recs) == len(want), f"{len(recs)} records, want {len(want)}"
assert set(ids) == set(want), set(ids) ^ set(want)
for r in recs:
    if r["custom_id"].startswith("big"):
        assert r["response"]["body"]["error"]["code"] == "context_length_exceeded", r
    else:
        assert r["response"]["status_code"] == 200, r
PY
}

# 1. the repro: retry while the run that failed the items is still claiming
python3 - in.jsonl "$N" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(5):  # first, so they fail (at admission) while most of the work is ahead
        f.write(json.dumps({"custom_id": f"big{i}", "prompt": "Hello", "max_tokens": 9000,
                            "temperature": 0}) + "\n")
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"{i} +", "max_tokens": 2,
                            "temperature": 0}) + "\n")
PY
n_in=$(wc -l <in.jsonl)
"$Q" submit --db q.db --model "$M" --name idj in.jsonl >/dev/null 2>&1 || fail "submit"
"$Q" run --db q.db --out out --max-seqs 2 --flush-secs 0.2 >run.json 2>run.log &
pid=$!
for _ in $(seq 600); do
    [ "$(state_count q.db idj failed)" -ge 5 ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
done
[ "$(state_count q.db idj failed)" -ge 5 ] || { cat run.log; fail "the 5 errors never committed"; }
"$Q" retry --db q.db --job idj --failed >/dev/null 2>&1 || fail "retry"
wait $pid || { cat run.log; fail "run exited non-zero"; }
if [ "$(state_count q.db idj queued)" -ne 0 ]; then # it drained before re-claiming them
    echo "note: the run ended before re-claiming the retried items; running again" >&2
    "$Q" run --db q.db --out out >/dev/null 2>>run.log || fail "second run"
fi
[ "$(state_count q.db idj failed)" -eq 5 ] || fail "want 5 failed items"
[ "$(state_count q.db idj done)" -eq "$N" ] || fail "want $N done items"
err_lines=$(cat out/idj/errors-*.jsonl.zst | zstd -dc | wc -l)
[ "$err_lines" -eq 10 ] || echo "note: $err_lines error records, the repro wants 10" >&2
"$Q" export --db q.db --job idj --out all.jsonl 2>export.log || { cat export.log; fail export; }
check_export all.jsonl
"$Q" export --db q.db --job idj --out input.jsonl --order input 2>/dev/null ||
    fail "export --order input"
check_export input.jsonl
python3 - input.jsonl in.jsonl <<'PY' || fail "--order input is not the input order"
import json, sys
got = [json.loads(l)["custom_id"] for l in open(sys.argv[1])]
assert got == [json.loads(l)["custom_id"] for l in open(sys.argv[2])]
PY
"$Q" export --db q.db --job idj --out all.jsonl.zst 2>/dev/null || fail "export .jsonl.zst"
zstd -q -dc all.jsonl.zst >unz.jsonl || fail "all.jsonl.zst is not zstd"
cmp -s unz.jsonl all.jsonl || fail ".jsonl.zst and .jsonl differ"
"$Q" export --db q.db --job idj --out all.tar.zst 2>/dev/null || fail "export .tar.zst"
tar --zstd -tf all.tar.zst >tar.list || fail "all.tar.zst does not list"
grep -qx "idj/manifest.json" tar.list || fail "no manifest in the bundle"
grep -qx "idj/results-00000.jsonl.zst" tar.list || fail "no results shard in the bundle"

# 2. atomic output
res0=$(ls out/idj/results-*.jsonl.zst | head -1)
cp "$res0" res0.save
echo victim >victim
ln -s "$tmp/victim" sym.jsonl.tmp # the temp name the old export opened with fopen "wb"
"$Q" export --db q.db --job idj --out sym.jsonl 2>/dev/null || fail "export beside a symlink"
[ "$(cat victim)" = victim ] || fail "export wrote through a symlink at <out>.tmp"
cmp -s sym.jsonl all.jsonl || fail "sym.jsonl differs from all.jsonl"
echo victim2 >victim2
ln -s "$tmp/victim2" link.jsonl
"$Q" export --db q.db --job idj --out link.jsonl 2>/dev/null || fail "export over a symlink"
[ "$(cat victim2)" = victim2 ] || fail "export wrote into a symlink's target"
[ -f link.jsonl ] && [ ! -L link.jsonl ] || fail "link.jsonl is not a new regular file"
cmp -s link.jsonl all.jsonl || fail "link.jsonl differs from all.jsonl"
if "$Q" export --db q.db --job idj --out "$tmp/no-such-dir/x.jsonl" 2>/dev/null; then
    fail "export into a missing directory succeeded"
fi
[ ! -e no-such-dir ] || fail "export created the missing directory"
ls ./*.tmp.* >/dev/null 2>&1 && fail "temp files left behind: $(ls ./*.tmp.*)"

# 2b. (found by a CLI audit) an output that names the queue or a job's own files is refused
# before anything is written: `export --out q.db` replaced the queue with JSONL (exit 0, every
# job lost), as did `report --out q.db` and `run --metrics-file q.db`
cp q.db q.save
man=$(cat out/idj/manifest.json)
for o in q.db ./q.db-wal q.db-journal out/idj/manifest.json "$res0"; do
    rc=0; "$Q" export --db q.db --job idj --out "$o" 2>o.err || rc=$?
    [ $rc = 2 ] && grep -q "write it elsewhere" o.err || fail "export --out $o: exit $rc $(cat o.err)"
done
rc=0; "$Q" report --db q.db --job idj --out q.db 2>o.err || rc=$?
[ $rc = 2 ] || fail "report --out q.db: exit $rc"
rc=0; "$Q" run --db q.db --threads 1 --metrics-file q.db 2>o.err || rc=$?
[ $rc = 2 ] || fail "run --metrics-file q.db: exit $rc"
# (a crash-safety audit) through a symlinked --db the queue's -wal and -shm are refused too
# (SQLite names them after the real file; an export was renamed over the live WAL), and a name
# quern puts in a job directory a run has not made yet (run --metrics-file
# out/<job>/manifest.json replaced the manifest with metrics)
ln -s q.db qlink.db
for o in q.db-wal q.db-shm; do
    rc=0; "$Q" export --db qlink.db --job idj --out "$o" 2>o.err || rc=$?
    [ $rc = 2 ] && grep -q "write it elsewhere" o.err || fail "export --db qlink.db --out $o: exit $rc"
done
for d in newjob madejob; do
    [ $d = madejob ] && mkdir out/madejob # (made before the run, still without a marker)
    rc=0; "$Q" run --db q.db --threads 1 --metrics-file out/$d/manifest.json 2>o.err || rc=$?
    [ $rc = 2 ] && [ ! -e out/$d/manifest.json ] || fail "run --metrics-file out/$d/manifest.json: exit $rc"
done
rmdir out/madejob
cmp -s q.db q.save && [ "$(cat out/idj/manifest.json)" = "$man" ] && cmp -s "$res0" res0.save ||
    fail "a refused output changed the queue or the job's files"
"$Q" export --db q.db --job idj --out out/idj/all.jsonl 2>/dev/null && rm out/idj/all.jsonl ||
    fail "an export of another name into the job's directory"

# 2c. an export interrupted midway: the results shard replaced by a FIFO, so the export blocks
# reading it once its temp file exists. SIGTERM removes the temp file; SIGKILL cannot, but
# leaves nothing at the final path.
res=$(ls out/idj/results-*.jsonl.zst | head -1)
mv "$res" res.save
mkfifo "$res"
# interrupt OUT SIGNAL: start an export to OUT, wait for its temp file, send SIGNAL
interrupt() {
    "$Q" export --db q.db --job idj --out "$1" 2>/dev/null &
    local p=$! i
    for i in $(seq 200); do
        ls "$1".tmp.* >/dev/null 2>&1 && break
        sleep 0.05
    done
    ls "$1".tmp.* >/dev/null 2>&1 || fail "$1: no temp file while the export runs"
    kill -"$2" $p
    wait $p 2>/dev/null && fail "$1: export interrupted by SIG$2 exited 0"
    [ ! -e "$1" ] || fail "$1: an interrupted export left a file at the final path"
}
interrupt term.jsonl TERM
ls term.jsonl* >/dev/null 2>&1 && fail "SIGTERM left $(ls term.jsonl*)"
interrupt kill.tar.zst KILL
rm -f "$res"
mv res.save "$res"
# the next export to that name removes the killed export's temp file (its tag names a process
# gone from this host) and keeps those of a live process (this shell) and of another host
ls kill.tar.zst.tmp.* >/dev/null 2>&1 || fail "SIGKILL left no temp file to clean up"
ns=$(readlink /proc/$$/ns/pid | tr -dc 0-9)
boot=$(head -c 12 /proc/sys/kernel/random/boot_id)
ticks=$(sed 's/.*) //' /proc/$$/stat | cut -d' ' -f20)
live="kill.tar.zst.tmp.AAAAAA.$$.$ticks.$ns.$boot.$(hostname)"
other="kill.tar.zst.tmp.BBBBBB.$$.$ticks.$ns.$boot.not-$(hostname)"
touch "$live" "$other"
"$Q" export --db q.db --job idj --out kill.tar.zst 2>sweep.err || fail "export after a SIGKILL"
grep -q "left by an export that was killed" sweep.err || fail "no word of the removed temp file"
[ "$(ls kill.tar.zst.tmp.* | sort | tr '\n' ' ')" = "$live $other " ] ||
    fail "temp files after the sweep: $(ls kill.tar.zst.tmp.*)"
rm -f "$live" "$other"

# 3. lines no item names: a crafted errors shard with a custom_id null line and an unknown id
# in front of its records (committed length, record count and the items' numbers moved on)
cp all.jsonl before.jsonl
python3 - q.db <<'PY' || fail "crafting the errors shard"
import json, sqlite3, subprocess, sys
db = sqlite3.connect(sys.argv[1])
sid, path, nbytes = db.execute(
    "SELECT id, path, committed_bytes FROM shards WHERE kind = 'errors'").fetchone()
data = subprocess.run(["zstd", "-dc", path], capture_output=True, check=True).stdout
old = data.count(b"\n")
extra = [{"custom_id": None, "response": None, "error": {"code": "x", "message": "orphan"}},
         {"custom_id": "nobody", "response": None, "error": {"code": "x", "message": "orphan"}}]
data = b"".join(json.dumps(e).encode() + b"\n" for e in extra) + data
z = subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout
open(path, "wb").write(z)
db.execute("UPDATE shards SET committed_bytes = ?, records = ? WHERE id = ?",
           (len(z), old + len(extra), sid))
db.execute("UPDATE items SET shard_record = shard_record + ? WHERE shard_id = ?",
           (len(extra), sid))
db.commit()
PY
"$Q" export --db q.db --job idj --out all.jsonl 2>export.log ||
    { cat export.log; fail "export with orphan lines in an errors shard"; }
check_export all.jsonl
"$Q" export --db q.db --job idj --out input.jsonl --order input 2>/dev/null ||
    fail "export --order input with orphan lines"
check_export input.jsonl
# the same shard as a schema v1 queue left it: no record numbers, custom_id decides, and an
# item whose id appears twice in its shard still gets one record
python3 -c "
import sqlite3, sys
db = sqlite3.connect('q.db')
db.execute(\"UPDATE items SET shard_record = NULL WHERE custom_id LIKE 'big%' OR custom_id = 'r0'\")
db.commit()" || fail "clearing record numbers"
"$Q" export --db q.db --job idj --out legacy.jsonl 2>export.log ||
    { cat export.log; fail "export of items without record numbers"; }
check_export legacy.jsonl
"$Q" export --db q.db --job idj --out legacy-in.jsonl --order input 2>/dev/null ||
    fail "legacy export --order input"
check_export legacy-in.jsonl

# 2b. an export that fails midway: a results shard cut short. The previous output stays as it
# was, and neither a temp file nor a partial bundle is left.
cp all.jsonl good.jsonl
cp all.tar.zst good.tar.zst
res=$(ls out/idj/results-*.jsonl.zst | head -1)
truncate -s -10 "$res"
if "$Q" export --db q.db --job idj --out all.jsonl 2>/dev/null; then
    fail "export of a cut shard succeeded"
fi
cmp -s all.jsonl good.jsonl || fail "a failed export changed the previous all.jsonl"
if "$Q" export --db q.db --job idj --out all.tar.zst 2>/dev/null; then
    fail "bundle of a cut shard succeeded"
fi
cmp -s all.tar.zst good.tar.zst || fail "a failed bundle changed the previous all.tar.zst"
if "$Q" export --db q.db --job idj --out fresh.tar 2>/dev/null; then
    fail "bundle of a cut shard succeeded"
fi
[ ! -e fresh.tar ] || fail "a failed bundle left a partial fresh.tar"
ls ./*.tmp.* >/dev/null 2>&1 && fail "temp files left behind: $(ls ./*.tmp.*)"
# 4. --order input with several input files is the order they were given in (not their names')
for f in zz aa; do
    python3 -c 'import json, sys
for i in range(3):
    print(json.dumps({"custom_id": f"{sys.argv[1]}{i}", "prompt": "Hi", "max_tokens": 1}))' \
        "$f" >"$f.jsonl"
done
"$Q" submit --db two.db --model "$M" --name two zz.jsonl aa.jsonl >/dev/null 2>&1 || fail "4: submit"
"$Q" run --db two.db --out out >/dev/null 2>&1 || fail "4: run"
"$Q" export --db two.db --job two --out two.jsonl --order input 2>/dev/null || fail "4: export"
got=$(python3 -c 'import json, sys; print(" ".join(json.loads(l)["custom_id"] for l in open(sys.argv[1])))' two.jsonl)
[ "$got" = "zz0 zz1 zz2 aa0 aa1 aa2" ] || fail "4: --order input gave $got"
# 5. (a CLI audit) the format by the suffix in any case (.JSONL.ZST was plain text), --order
# input refused for a bundle (it was ignored), and an export of a job with items left warns
# how many (it said nothing)
"$Q" export --db two.db --job two --out TWO.JSONL.ZST 2>/dev/null || fail "5: export .ZST"
[ "$(zstd -dcq TWO.JSONL.ZST | wc -l)" = 6 ] || fail "5: TWO.JSONL.ZST is not zstd JSONL"
"$Q" export --db two.db --job two --out two.zstd 2>/dev/null && zstd -t -q two.zstd ||
    fail "5: .zstd is not zstd"
rc=0
"$Q" export --db two.db --job two --out two.tar --order input 2>e5 || rc=$?
[ $rc = 2 ] && grep -q "bundle" e5 && [ ! -e two.tar ] || fail "5: --order input with a bundle: rc $rc"
python3 -c 'import json
for i in range(2):
    print(json.dumps({"custom_id": f"w{i}", "prompt": "Hi", "max_tokens": 1}))' >w.jsonl
"$Q" submit --db two.db --model "$M" --name waiting w.jsonl >/dev/null 2>&1 || fail "5: submit"
"$Q" export --db two.db --job waiting --out w.export.jsonl 2>e5 || fail "5: export of a waiting job"
grep -q "2 items are not finished" e5 || fail "5: no warning of the unfinished items: $(cat e5)"
echo "export_identity: OK"
