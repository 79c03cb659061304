#!/usr/bin/env bash
# Top up a queue from an inbox directory (examples/crontab runs it every 5 minutes):
#   quern-inbox.sh QUERN_BIN DB INBOX OUT [submit options: --model M, --max-tokens N, ...]
# Every request file INBOX/*.jsonl becomes a job and is moved to INBOX/done/ only once `quern
# submit` has published it, so a file is never submitted twice and never lost: a submit that
# fails (exit 1: the queue busy, a disk full) leaves the file for the next tick, and a killed
# submit leaves nothing a run would take. A file quern refuses outright (exit 2) goes to
# INBOX/failed/ rather than being tried forever.
#
# Put files in whole: write them under another name (INBOX/x.jsonl.part, or elsewhere on the
# same file system) and `mv` them to INBOX/x.jsonl. A file still being written would be
# submitted as far as it got; as a guard, files changed in the last 2 minutes wait.
#
# The job is named in-<file name>-<UTC time> (job names are unique, of [A-Za-z0-9._-], at
# most 128 characters and not all digits, whatever the file is called).
set -u
q=$1 db=$2 inbox=$3 out=$4
shift 4
mkdir -p "$inbox/done" "$inbox/failed"
find "$inbox" -maxdepth 1 -type f -name '*.jsonl' -mmin +2 -print0 | sort -z |
    while IFS= read -r -d '' f; do
        base=$(basename "$f" .jsonl)
        base=$(printf '%s' "$base" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-90)
        name="in-$base-$(date -u +%Y%m%d-%H%M%S)"
        rc=0
        "$q" submit --db "$db" --name "$name" --out "$out" "$@" "$f" || rc=$?
        case $rc in
        0) mv "$f" "$inbox/done/" ;;
        2) mv "$f" "$inbox/failed/" && echo "quern-inbox: $f refused (exit 2): moved to $inbox/failed/" >&2 ;;
        *) echo "quern-inbox: $f: submit exit $rc; left for the next tick" >&2 ;;
        esac
    done
