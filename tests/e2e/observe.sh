#!/usr/bin/env bash
# What a run leaves for people and monitoring to look at, with the real binary and model:
#  1. --metrics-file: the file parses with prometheus_client's text-format parser while the
#     run works and after it (every metric typed, labels job/run/host), and its numbers are
#     the job's (items done = status --json's, items = the job's, KV blocks > 0);
#  2. the time series in status --json: a run killed with -9 and a second run that finishes
#     the job both left samples (the kill is visible as a run boundary), each run's counters
#     never go down and its times rise, the last sample has every item finished, and its
#     token counter equals the metrics file's;
#  3. every finished item keeps its time to first token and time per output token.
set -euo pipefail
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
PYDEPS=${QUERN_PYDEPS:+$(realpath "$QUERN_PYDEPS")}
. "$(dirname "$0")/lib/common.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }
e2e_workdir
[ -n "$PYDEPS" ] || fail "QUERN_PYDEPS (make pydeps) is needed for prometheus_client"
export PYTHONPATH="$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
# ~20 s on one thread here (more under sanitizers): the first run must still be working when
# it has left two samples, 5 s apart (kill_after_second_sample)
N=200
python3 - "$N" >in.jsonl <<'PY'
import json, sys
for i in range(int(sys.argv[1])):
    print(json.dumps({"custom_id": f"o{i}", "prompt": f"Item {i}: the number after {i} is",
                      "max_tokens": 4 + (i * 7) % 40, "temperature": 0}))
PY
"$Q" submit --db q.db --name jo --model "$M" in.jsonl >/dev/null 2>&1 || fail "submit"
RUN=(--threads 1 --max-seqs 8 --flush-records 2 --flush-secs 0.2 --metrics-file m/quern.prom)
mkdir m

# check_prom FILE: parses, every family typed, one sample each with the run's labels; prints
# {metric: value} as JSON.
check_prom() {
    python3 - "$1" <<'PY'
import json, sys
from prometheus_client.parser import text_string_to_metric_families
text = open(sys.argv[1]).read()
assert text.endswith("\n")
out = {}
for fam in text_string_to_metric_families(text):
    assert fam.type in ("gauge", "counter"), (fam.name, fam.type)
    assert fam.documentation, fam.name
    assert len(fam.samples) == 1, fam.name
    s = fam.samples[0]
    assert set(s.labels) == {"job", "run", "host"} and s.labels["job"] == "jo", s.labels
    out[s.name] = s.value
    out["run"] = int(s.labels["run"])
for need in ("quern_items_done", "quern_items", "quern_generated_tokens_total",
             "quern_kv_blocks", "quern_running_sequences", "quern_eta_seconds"):
    assert need in out, need
print(json.dumps(out))
PY
}

# ---- a run killed with -9 while the metrics file is being written --------------------------
"$Q" run --db q.db "${RUN[@]}" >r1.out 2>r1.err &
p1=$!
pids+=("$p1")
for _ in $(seq 1 300); do [ -s m/quern.prom ] && break; sleep 0.1; done
[ -s m/quern.prom ] || fail "no metrics file"
check_prom m/quern.prom >mid.json || fail "the metrics file written mid-run does not parse"
kill_after_second_sample q.db "$p1" 4
# (a kill during a write may leave the killed process's own temporary file, nothing else)
ls -A m | grep -v -e '^quern.prom$' -e "^\.quern\.prom\.tmp\.$p1\." -e "^\.quern\.prom\.tmp\..*\.$p1\$" &&
    fail "a file other than the killed run's temporary one beside the metrics file"

# ---- a second run finishes the job ---------------------------------------------------------
"$Q" run --db q.db "${RUN[@]}" >r2.out 2>r2.err || { cat r2.err >&2; fail "second run"; }
check_prom m/quern.prom >end.json || fail "the final metrics file does not parse"
ls -A m | grep -v -e '^quern.prom$' -e "^\.quern\.prom\.tmp\.$p1\." -e "^\.quern\.prom\.tmp\..*\.$p1\$" &&
    fail "the finishing run left a temporary file beside the metrics file"
"$Q" status --db q.db --json >st.json 2>/dev/null || fail "status --json"
python3 - "$N" <<'PY' || fail "metrics and time series"
import json, sys
n = int(sys.argv[1])
m = json.load(open("end.json"))
j = json.load(open("st.json"))[0]
assert m["quern_items"] == n and m["quern_items_done"] == j["by_state"]["done"] == n, (m, j["by_state"])
assert m["quern_kv_blocks"] > 0 and m["quern_running_sequences"] == 0 and m["quern_eta_seconds"] == 0, m
s = j["series"]
f = {name: i for i, name in enumerate(s["fields"])}
rows = s["rows"]
runs = sorted({r[f["run_id"]] for r in rows})
assert len(runs) == 2, f"samples from runs {runs}, want the killed one and the last"
assert m["run"] == runs[-1], (m["run"], runs)
first = [r for r in rows if r[f["run_id"]] == runs[0]]
assert len(first) >= 2, f"the killed run left {len(first)} samples"
for run in runs:
    rr = [r for r in rows if r[f["run_id"]] == run]
    for a, b in zip(rr, rr[1:]):
        assert b[f["t_ms"]] >= a[f["t_ms"]], "times go back"
        for c in ("gen_tokens", "prompt_tokens", "cached_tokens", "steps", "batch_tokens", "done"):
            assert b[f[c]] >= a[f[c]], (run, c, a[f[c]], b[f[c]])
    assert all(r[f["kv_total"]] > 0 and 0 <= r[f["kv_used"]] <= r[f["kv_total"]] for r in rr)
last = rows[-1]
assert last[f["done"]] == n and last[f["running"]] == 0, last
assert last[f["gen_tokens"]] == m["quern_generated_tokens_total"], (last, m)
assert last[f["steps"]] == m["quern_steps_total"] and last[f["batch_tokens"]] >= last[f["steps"]]
assert first[-1][f["done"]] < n, "the first run was killed after the job was finished"
PY
# every finished request keeps its latencies (for reports): time to first token, and time per
# output token where it has more than one
[ "$(sqlite3 q.db "SELECT count(*) FROM items WHERE state = 'done' AND ttft_ms > 0")" -eq "$N" ] ||
    fail "items without a time to first token"
[ "$(sqlite3 q.db "SELECT count(*) FROM items WHERE completion_tokens > 1 AND NOT tpot_ms > 0")" -eq 0 ] ||
    fail "items without a time per output token"
# a long series (days of samples, one each 5 s) is thinned in status --json to at most 2,000
# rows, each run's first and last kept (it was every row: 4 s and 247 MB at ten days); also
# when runs worked on the job at once, their samples interleaved (each row was then a run's
# "edge" and nothing was thinned)
cp q.db long.db
python3 - long.db <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
cols = [r[1] for r in db.execute("PRAGMA table_info(samples)") if r[1] != "id"]
last = db.execute("SELECT " + ", ".join(cols) + " FROM samples ORDER BY t DESC LIMIT 1").fetchone()
runs = [r[0] for r in db.execute("SELECT DISTINCT run_id FROM samples ORDER BY run_id")]
row = dict(zip(cols, last))
t0 = db.execute("SELECT min(t) FROM samples").fetchone()[0]
for i in range(1, 30001): # 30,000 earlier samples, the two runs' taking turns
    row["t"] = t0 - 2500 * i
    row["run_id"] = runs[i % len(runs)]
    db.execute("INSERT INTO samples (" + ", ".join(cols) + ") VALUES (" +
               ", ".join("?" * len(cols)) + ")", [row[c] for c in cols])
db.commit()
PY
"$Q" status --db long.db --json >long.json 2>/dev/null || fail "status --json, long series"
python3 - st.json long.json long.db <<'PY' || fail "a long series thinned"
import json, sqlite3, sys
short = json.load(open(sys.argv[1]))[0]["series"]
s = json.load(open(sys.argv[2]))[0]["series"]
rows = s["rows"]
db = sqlite3.connect(sys.argv[3])
runs = [r[0] for r in db.execute("SELECT DISTINCT run_id FROM samples")]
assert len(runs) == 2, runs
assert short["every"] == 1 and s["every"] == 16 and len(rows) <= 2000 + 2 * len(runs), (s["every"], len(rows))
assert rows[-1] == short["rows"][-1], "the last sample"
kept = {(r[0], r[1]) for r in rows}
for run in runs:
    ts = [r[0] for r in db.execute("SELECT t FROM samples WHERE run_id = ? ORDER BY t, id", (run,))]
    assert (ts[0], run) in kept and (ts[-1], run) in kept, f"run {run}: its first or last sample thinned"
PY
echo "observe: ok"
