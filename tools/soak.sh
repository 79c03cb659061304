#!/usr/bin/env bash
# Kill -9 soak of the job runner: TRIALS times, start RUNNERS `quern run` processes on one
# queue (and, every fourth trial, an `export` beside them), kill every one of them with
# SIGKILL at a random moment (startup/recovery, prefill, decode, flush, the final manifest,
# the export), and start again at once. Each job is checked when it is drained (every
# custom_id exactly once across results and errors, shards decode, manifest matches), a new
# job is queued and the trials go on. Also measured: how long a resumed run took to make
# progress (done count up) after a kill that left leases behind — on one host a dead run is
# taken over at once, so this stays far below the 300 s lease.
# Usage: tools/soak.sh [TRIALS [RUNNERS [ITEMS]]]   (defaults 100 1 120)
# Env: QUERN_BIN, QUERN_MODEL. Prints one summary line; exits 1 on any violation.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/tests/e2e/lib/common.sh"
TRIALS=${1:-100}
RUNNERS=${2:-1}
ITEMS=${3:-120}
Q=$(realpath "${QUERN_BIN:-$here/bin/quern}")
M=$(realpath "${QUERN_MODEL:-$here/models/SmolLM2-135M-Instruct.Q4_1.gguf}")
tmp=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }
counts() { # counts DB JOB -> "done failed leased queued", read from the file: `status`
    # would take a dead run's leases back itself
    python3 - "$1" "$2" <<'PY'
import sqlite3, sys
db = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, timeout=30)
n = dict(db.execute("SELECT i.state, count(*) FROM items i JOIN jobs j ON j.id = i.job_id"
                    " WHERE j.name = ? GROUP BY i.state", (sys.argv[2],)).fetchall())
print(n.get("done", 0), n.get("failed", 0), n.get("leased", 0), n.get("queued", 0))
PY
}
rand() { python3 -c "import random; print(random.uniform($1, $2))"; }

python3 - items.jsonl "$ITEMS" <<'PY'
import json, random, sys
random.seed(7)
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        if i % 40 == 39:
            f.write("not json\n")  # rejected at submit: an error record
            continue
        mt = 100000 if i % 53 == 52 else random.randint(2, 12)  # some exceed the context
        f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"Line {i}: tell me about {i}",
                            "max_tokens": mt, "temperature": 0.7, "seed": i}) + "\n")
PY
job=0
new_job() {
    job=$((job + 1))
    "$Q" submit --db q.db --model "$M" --name "j$job" items.jsonl >/dev/null 2>&1
}
new_job
jobs_checked=0
kills=0
exports_killed=0
progress_waits=""
for t in $(seq "$TRIALS"); do
    read -r d0 f0 l0 q0 <<<"$(counts q.db "j$job")"
    pids=()
    t0=$(date +%s.%N)
    for r in $(seq "$RUNNERS"); do
        "$Q" run --db q.db --out out --job "j$job" --max-seqs 8 --max-batch-tokens 128 \
            --threads 1 --flush-secs 0 --flush-records 3 >/dev/null 2>>"run-$t.log" &
        pids+=($!)
    done
    if [ $((t % 4)) -eq 0 ]; then
        "$Q" export --db q.db --job "j$job" --out "exp.jsonl" >/dev/null 2>&1 &
        pids+=($!)
        exports_killed=$((exports_killed + 1))
    fi
    # every third trial dies early (startup, recovery); the others once the resume has made
    # progress, plus a random extra delay
    if [ $((t % 3)) -eq 0 ]; then
        sleep "$(rand 0.05 1.2)"
    else
        for _ in $(seq 600); do
            read -r d f l q <<<"$(counts q.db "j$job")"
            [ $((d + f)) -gt $((d0 + f0)) ] && break
            [ "$q" -eq 0 ] && [ "$l" -eq 0 ] && break
            sleep 0.05
        done
        [ $((d + f)) -gt $((d0 + f0)) ] || [ "$q$l" = 00 ] ||
            fail "trial $t: no progress within 30 s after a resume"
        if [ "$l0" -gt 0 ]; then
            progress_waits="$progress_waits $(python3 -c "import time; print(round(time.time() - $t0, 2))")"
        fi
        sleep "$(rand 0 2)"
    fi
    kill -9 "${pids[@]}" 2>/dev/null || true
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    kills=$((kills + RUNNERS))
    # an interrupted export never leaves a partial file at its final path
    if [ -e exp.jsonl ]; then
        python3 -c "
import json, sys
for l in open('exp.jsonl'): json.loads(l)" || fail "trial $t: partial export at the final path"
        rm -f exp.jsonl
    fi
    read -r d f l q <<<"$(counts q.db "j$job")"
    if [ "$q" -eq 0 ] && [ "$l" -eq 0 ]; then
        # drained: one clean run seals shards and manifest, then the full check
        "$Q" run --db q.db --out out --job "j$job" >/dev/null 2>>final.log || fail "seal j$job"
        check_job q.db "j$job" "$ITEMS"
        jobs_checked=$((jobs_checked + 1))
        new_job
    else
        check_partial q.db "j$job"
    fi
done
timeout 600 "$Q" run --db q.db --out out --job "j$job" >/dev/null 2>>final.log ||
    fail "final resume"
check_job q.db "j$job" "$ITEMS"
jobs_checked=$((jobs_checked + 1))
python3 - "$TRIALS" "$RUNNERS" "$kills" "$exports_killed" "$jobs_checked" $progress_waits <<'PY'
import sys
t, r, k, e, j = sys.argv[1:6]
w = sorted(float(x) for x in sys.argv[6:])
pct = lambda p: w[min(len(w) - 1, int(p * len(w)))] if w else float("nan")
print(f"soak: {t} trials x {r} runners, {k} runs and {e} exports killed with SIGKILL, "
      f"{j} jobs checked: 0 lost, 0 duplicated; resume -> first progress after a kill that "
      f"left leases: n={len(w)} p50 {pct(0.5):.2f} s, max {max(w) if w else float('nan'):.2f} s")
PY
