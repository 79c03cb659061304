#!/usr/bin/env bash
# Include-graph check (run by `make test` and `make unit`): fails on an include cycle between
# modules, on an include that goes up the layer order, and on a quoted include that is not a
# path from the repository root. A node is one file without its extension, so x/y.c and x/y.h
# are one node, and a private header x/y_internal.h belongs to x/y too. The layer order is the
# README's: runner -> batch -> jobs -> engine -> kernels; io and queue depend only on common; tests/ and
# tools/ may include anything. `--edges [FOLDER]` prints the node graph (edges from FOLDER's
# nodes only) instead of checking.
set -eu
cd "$(dirname "$0")/.."

# Folders each folder may include besides itself.
allowed_for() {
    case "$1" in
    common) echo "" ;;
    io | queue | kernels) echo "common" ;;
    engine) echo "common io kernels" ;;
    jobs) echo "common io kernels engine" ;;
    batch) echo "common io queue kernels engine jobs" ;;
    runner) echo "common io queue kernels engine jobs batch" ;;
    tests | tools) echo "*" ;;
    *) echo "?" ;;
    esac
}

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    files=$(git ls-files '*.c' '*.h')
else
    files=$(find . -path ./build -prune -o -path ./build-asan -prune -o -path ./build-fuzz -prune \
        -o \( -name '*.c' -o -name '*.h' \) -print | sed 's|^\./||')
fi

# "FILE TARGET" for every #include "TARGET".
edges=$(for f in $files; do
    sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f" |
        while read -r t; do echo "$f $t"; done
done)

node() {
    local n="${1%.[ch]}"
    echo "${n%_internal}"
}

if [ "${1:-}" = "--edges" ]; then
    echo "$edges" | while read -r f t; do
        [ -n "$f" ] || continue
        case "$f" in "${2:-}"*) ;; *) continue ;; esac
        a=$(node "$f") b=$(node "$t")
        [ "$a" = "$b" ] || echo "$a -> $b"
    done | sort -u
    exit 0
fi

fail=0
pairs=""
while read -r f t; do
    [ -n "$f" ] || continue
    if [ ! -f "$t" ]; then
        echo "check_includes: $f includes \"$t\", which is not a path from the repository root"
        fail=1
        continue
    fi
    from=${f%%/*} to=${t%%/*}
    allowed=$(allowed_for "$from")
    if [ "$allowed" = "?" ]; then
        echo "check_includes: $f is in folder $from, which has no place in the layer order"
        fail=1
    elif [ "$from" != "$to" ] && [ "$allowed" != "*" ] && ! [[ " $allowed " == *" $to "* ]]; then
        echo "check_includes: $f includes $t: $from may include only ${allowed:-nothing} (layer order)"
        fail=1
    fi
    pairs="$pairs$(node "$f") $(node "$t")"$'\n'
done <<<"$edges"

# tsort reports every loop it meets on stderr and exits non-zero.
if ! loops=$(printf '%s' "$pairs" | tsort 2>&1 >/dev/null); then
    echo "check_includes: include cycle between modules:"
    echo "$loops" | sed 's/^tsort: /  /'
    fail=1
fi

if [ $fail -ne 0 ]; then
    exit 1
fi
echo "check_includes: $(echo "$files" | wc -w) files, no cycles, no upward includes"
