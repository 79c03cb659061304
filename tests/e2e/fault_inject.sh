#!/usr/bin/env bash
# Fault injection of the commit protocol (common/fault.h): every shard write (also torn in
# half), shard fsync, directory fsync, SQLite commit and manifest write/fsync/rename of a run is
# made to fail, or the process killed right there, in turn (QUERN_FAULT=SITE:N:ACTION); each
# time, what is committed so far must be there exactly once, and a resume on the same database
# must finish the job with every custom_id exactly once across the results and errors shards,
# every shard decoding, and a complete manifest that matches the files. The job mixes results
# and errors (a request too long for the context, a line rejected at submit) and flushes every
# 2 records, so each run makes several commits and both kinds of shards.
# Under sanitizers (QUERN_SANITIZE) fewer points (the error paths must not leak either);
# QUERN_FAULT_FULL=1 runs many more points (a longer check before changing the protocol).
set -euo pipefail
. "$(dirname "$0")/lib/common.sh"
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }

python3 - job.jsonl <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(6):
        f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"Count: {i},", "max_tokens": 3,
                            "temperature": 0}) + "\n")
    f.write(json.dumps({"custom_id": "long", "prompt": "x", "max_tokens": 100000}) + "\n")
    f.write("garbage\n")
PY
N=8
"$Q" submit --db base.db --model "$M" --name job job.jsonl >/dev/null 2>&1 || fail "submit"
RUN=(--max-seqs 2 --max-batch-tokens 64 --threads 1 --flush-secs 0 --flush-records 2)

# points per action: the Nth call of each site (QUERN_FAULT_FULL=1: more of them, ~4 min)
KILL_POINTS="1 2"
FAIL_POINTS="1"
COMMIT_POINTS="1 3 6 10"
if [ -n "${QUERN_FAULT_FULL:-}" ]; then
    KILL_POINTS="1 2 3 4"
    FAIL_POINTS="1 2 3"
    COMMIT_POINTS="1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16"
elif [ -n "${QUERN_SANITIZE:-}" ]; then
    KILL_POINTS="1"
    FAIL_POINTS="1"
    COMMIT_POINTS="4"
fi
trials=0
fired=0
for site in shard.write shard.torn shard.fsync dir.fsync queue.commit manifest.write \
    manifest.fsync manifest.rename; do
    for action in kill fail; do
        points=$KILL_POINTS
        [ $action = fail ] && points=$FAIL_POINTS
        [ "$site" = queue.commit ] && [ -n "$points" ] && points=$COMMIT_POINTS
        for n in $points; do
            t="$site-$n-$action"
            cp base.db "$t.db"
            set +e
            (QUERN_FAULT="$site:$n:$action" exec "$Q" run --db "$t.db" --out "out-$t" \
                "${RUN[@]}" >/dev/null 2>"$t.log")
            rc=$?
            set -e
            trials=$((trials + 1))
            if grep -q "quern fault: $site #$n" "$t.log"; then
                fired=$((fired + 1))
                [ "$action" = kill ] && [ $rc -ne 137 ] && fail "$t: killed run exited $rc"
                [ "$action" = fail ] && [ $rc -eq 0 ] && fail "$t: failed run exited 0"
                [ $rc -ge 128 ] && [ $rc -ne 137 ] && { cat "$t.log"; fail "$t: crashed ($rc)"; }
                check_partial "$t.db" job
            else
                [ $rc -eq 0 ] || { cat "$t.log"; fail "$t: exited $rc without the fault"; }
            fi
            # resume at once: the dead or failed run is taken over without waiting
            timeout 120 "$Q" run --db "$t.db" --out "out-$t" "${RUN[@]}" >/dev/null \
                2>>"$t.log" || { tail -20 "$t.log"; fail "$t: resume"; }
            check_job "$t.db" job $N "out-$t"
            rm -rf "$t.db" "$t.db-wal" "$t.db-shm" "out-$t"
        done
    done
done
[ $fired -ge $((trials / 2)) ] || fail "only $fired of $trials faults fired"

# runs that fail (here: their first shard write) give their items back uncounted: four of them
# in a row use up no attempts (3 per item), and the resume fails no item as attempts_exhausted
cp base.db fails.db
for i in 1 2 3 4; do
    set +e
    QUERN_FAULT=shard.write:1:fail "$Q" run --db fails.db --out out-fails "${RUN[@]}" \
        >/dev/null 2>>fails.log
    rc=$?
    set -e
    [ $rc -eq 1 ] || { tail fails.log; fail "failing run $i exited $rc"; }
done
[ "$(sqlite3 fails.db "SELECT count(*) FROM items WHERE state = 'leased' OR attempts > 0")" = 0 ] ||
    fail "failed runs left leases or counted attempts"
timeout 120 "$Q" run --db fails.db --out out-fails "${RUN[@]}" >/dev/null 2>>fails.log ||
    { tail -20 fails.log; fail "resume after failing runs"; }
[ "$(sqlite3 fails.db "SELECT count(*) FROM items WHERE error_code = 'attempts_exhausted'")" = 0 ] ||
    fail "items failed as attempts_exhausted after runs that failed"
check_job fails.db job $N out-fails
# a checkpoint that fails at the run's end (an fsync's EIO: SQLite's own checkpoints swallow it)
# is exit 1 with the disk named, nothing lost (before: exit 0, nothing said)
"$Q" submit --db ck.db --name job --model "$M" job.jsonl >/dev/null 2>&1 || fail "ck: submit"
rc=0
QUERN_FAULT=queue.checkpoint:1:fail "$Q" run --db ck.db --out out-ck "${RUN[@]}" >/dev/null \
    2>ck.log || rc=$?
[ $rc = 1 ] && grep -q "but the disk failed: .*disk I/O error" ck.log ||
    { cat ck.log; fail "ck: a failed checkpoint: exit $rc"; }
check_job ck.db job $N out-ck
echo "e2e fault injection: ok ($trials trials, $fired faults fired)"
