#!/usr/bin/env bash
# Run every unit-test binary given on the command line, then every end-to-end script in
# tests/e2e/ (unless --unit-only). Needs QUERN_MODEL and QUERN_BIN in the environment.
# Exits non-zero if anything failed, after running everything; prints each test's time.
set -u
unit_only=0
if [ "${1:-}" = "--unit-only" ]; then unit_only=1; shift; fi
fail=0
failed=""
times=""
for t in "$@"; do
    echo "== $t"
    t0=$SECONDS
    if ! "$t"; then fail=1; failed="$failed $t"; fi
    times="$times\n$((SECONDS - t0)) s  $t"
done
if [ $unit_only -eq 0 ]; then
    for s in tests/e2e/*.sh; do
        [ -e "$s" ] || continue
        echo "== $s"
        t0=$SECONDS
        if ! bash "$s"; then fail=1; failed="$failed $s"; fi
        times="$times\n$((SECONDS - t0)) s  $s"
    done
fi
# the slowest first, so that the suite's time (CI: under ~25 minutes on 2 cores) can be watched
echo "== time per test"
printf "$times\n" | sort -rn | grep -v '^$' 
if [ $fail -ne 0 ]; then
    echo "FAILED:$failed"
    exit 1
fi
echo "ALL TESTS PASSED"
