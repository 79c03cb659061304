#!/usr/bin/env bash
# Run every unit-test binary given on the command line, then every end-to-end script in
# tests/e2e/ (unless --unit-only). Needs QUERN_MODEL and QUERN_BIN in the environment.
# Exits non-zero if anything failed, after running everything.
set -u
unit_only=0
if [ "${1:-}" = "--unit-only" ]; then unit_only=1; shift; fi
fail=0
failed=""
for t in "$@"; do
    echo "== $t"
    if ! "$t"; then fail=1; failed="$failed $t"; fi
done
if [ $unit_only -eq 0 ]; then
    for s in tests/e2e/*.sh; do
        [ -e "$s" ] || continue
        echo "== $s"
        if ! bash "$s"; then fail=1; failed="$failed $s"; fi
    done
fi
if [ $fail -ne 0 ]; then
    echo "FAILED:$failed"
    exit 1
fi
echo "ALL TESTS PASSED"
