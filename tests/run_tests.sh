#!/usr/bin/env bash
# Run every unit-test binary given on the command line, then every end-to-end script in
# tests/e2e/ (unless --unit-only). Needs QUERN_MODEL and QUERN_BIN in the environment.
# Exits non-zero if anything failed, after running everything; prints each test's time, and
# at the end the last lines each failed test printed (CI keeps only the tail of the output).
set -u
unit_only=0
if [ "${1:-}" = "--unit-only" ]; then unit_only=1; shift; fi
fail=0
failed=""
times=""
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# run_one NAME CMD...: runs it, its output kept in $logs and shown when it ends (a file, not a
# pipe: a process a test left behind cannot hold the suite up); a failure is recorded.
run_one() {
    local name=$1 log
    shift
    log="$logs/$(echo "$name" | tr / _).log"
    echo "== $name"
    t0=$SECONDS
    if ! "$@" >"$log" 2>&1; then
        cat "$log"
        fail=1
        failed="$failed $name"
    else
        cat "$log"
        rm -f "$log"
    fi
    times="$times\n$((SECONDS - t0)) s  $name"
}
for t in "$@"; do
    run_one "$t" "$t"
done
if [ $unit_only -eq 0 ]; then
    for s in tests/e2e/*.sh; do
        [ -e "$s" ] || continue
        run_one "$s" bash "$s"
    done
fi
# the slowest first, so that the suite's time (CI: under ~25 minutes on 2 cores) can be watched
echo "== time per test"
printf "$times\n" | sort -rn | grep -v '^$' 
if [ $fail -ne 0 ]; then
    for t in $failed; do
        echo "== the last lines $t printed"
        tail -n 40 "$logs/$(echo "$t" | tr / _).log"
    done
    echo "FAILED:$failed"
    exit 1
fi
echo "ALL TESTS PASSED"
