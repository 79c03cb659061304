#!/usr/bin/env bash
# Top up a queue from an inbox directory (examples/crontab runs it every 5 minutes):
#   quern-inbox.sh QUERN_BIN DB INBOX OUT [submit options: --model M, --max-tokens N, ...]
# Every request file INBOX/*.jsonl becomes a job and is moved to INBOX/done/ once `quern
# submit` has published it (as NAME.<12 hex digits>.jsonl when done/ holds another
# NAME.jsonl). The job is named after the file and its content,
# in-<file name>-<12 hex digits of its sha256> (job names are unique, of [A-Za-z0-9._-], at
# most 128 characters and not all digits, whatever the file is called), so a file is never
# submitted twice: one whose job is already in the queue (a tick killed between the submit and
# the move, a move that failed) is only moved. A submit that fails (the queue busy, a disk
# full, a bad option) leaves the file for the next tick, and a killed submit leaves nothing a
# run would take. Lines that are not valid requests do not stop a file: they become error
# records of its job (do not pass --strict here, or such a file is retried every tick); a file
# none of whose lines is a JSON object (not JSONL: a JSON array, UTF-16) is refused by submit
# and moved to INBOX/failed/, with the reason on stderr.
#
# Put files in whole: write them under another name (INBOX/x.jsonl.part, or elsewhere on the
# same file system) and `mv` them to INBOX/x.jsonl. A file still being written would be
# submitted as far as it got; as a guard, files changed in the last 2 minutes wait.
set -u
q=$1 db=$2 inbox=$3 out=$4
shift 4
mkdir -p "$inbox/done" "$inbox/failed"
# move a submitted file to done/, under its own name unless a different file has it (a second
# daily.jsonl): then with the 12 hex digits of its sha256 added, so no archived file is lost
done_mv() {
    local dest
    dest="$inbox/done/$(basename "$1")"
    [ -e "$dest" ] && ! cmp -s -- "$1" "$dest" && dest="$inbox/done/$(basename "$1" .jsonl).$2.jsonl"
    mv -- "$1" "$dest"
}
find "$inbox" -maxdepth 1 -type f -name '*.jsonl' -mmin +2 -print0 | sort -z |
    while IFS= read -r -d '' f; do
        base=$(basename "$f" .jsonl)
        base=$(printf '%s' "$base" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-90)
        [ -e "$f" ] || continue # (an overlapping tick, run without --lock, took it)
        sum=$(sha256sum -- "$f") && [ ${#sum} -ge 64 ] ||
            { [ -e "$f" ] && echo "quern-inbox: $f: cannot hash it (sha256sum); left" >&2; continue; }
        sum=${sum:0:12}
        name="in-$base-$sum"
        if "$q" status --db "$db" --job "$name" --json 2>/dev/null | grep -q '"ready":true'; then
            echo "quern-inbox: $f is job $name already; moving it" >&2
            done_mv "$f" "$sum" || echo "quern-inbox: cannot move $f" >&2
            continue
        fi
        rc=0
        { err=$("$q" submit --db "$db" --name "$name" --out "$out" "$@" "$f" 2>&1 1>&3) || rc=$?; } 3>&1
        [ -z "$err" ] || printf '%s\n' "$err" >&2
        if [ $rc = 0 ]; then
            done_mv "$f" "$sum" || echo "quern-inbox: $f submitted as $name; cannot move it" >&2
        elif [ $rc = 1 ] && [[ "$err" == *"no line of the input is a JSON object"* ]]; then
            echo "quern-inbox: $f is not JSONL; moved to $inbox/failed/" >&2
            mv -- "$f" "$inbox/failed/$(basename "$f" .jsonl).$sum.jsonl" ||
                echo "quern-inbox: cannot move $f" >&2
        else
            echo "quern-inbox: $f: submit exit $rc; left for the next tick" >&2
        fi
    done
