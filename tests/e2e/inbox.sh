#!/usr/bin/env bash
# examples/quern-inbox.sh (what examples/crontab runs): files put in the inbox whole become jobs
# once, named in-<file>-<sha256> whatever the file is called (an all-digit name, spaces: the old
# one-liner left such files in the inbox for ever, failing every tick); a file changed in the
# last 2 minutes (maybe still being written) waits; a second tick submits nothing again.
set -euo pipefail
. "$(dirname "$0")/lib/common.sh"
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
INBOX=$(realpath examples/quern-inbox.sh)
fail() {
    echo "e2e inbox: FAIL: $*" >&2
    exit 1
}
e2e_workdir
mkdir inbox
for f in 2024 "a b" recent; do
    printf '%s\n' '{"prompt": "hi", "max_tokens": 1}' '{"prompt": "ho", "max_tokens": 1}' >"inbox/$f.jsonl"
done
touch -d '-5 minutes' inbox/2024.jsonl "inbox/a b.jsonl"
touch inbox/x.jsonl.part
bash "$INBOX" "$Q" q.db inbox out --model "$M" 2>inbox.log || { cat inbox.log; fail "the inbox script"; }
[ -e inbox/done/2024.jsonl ] && [ -e "inbox/done/a b.jsonl" ] || { cat inbox.log; fail "files not done"; }
[ -e inbox/recent.jsonl ] && [ -e inbox/x.jsonl.part ] || fail "a recent file or a .part was taken"
names=$(sqlite3 q.db "SELECT name FROM jobs ORDER BY id" | tr '\n' ' ')
[[ "$names" =~ in-2024-[0-9a-f]{12}\ in-a_b-[0-9a-f]{12} ]] || fail "job names: $names"
[ "$(sqlite3 q.db "SELECT count(*) FROM items")" = 4 ] || fail "items"
bash "$INBOX" "$Q" q.db inbox out --model "$M" 2>>inbox.log || fail "second tick"
[ "$(sqlite3 q.db "SELECT count(*) FROM items")" = 4 ] || fail "a second tick submitted again"
# a tick killed between the submit and the move (or a move that failed): the file is moved,
# not submitted again (with time in the job's name it was, every tick)
cp inbox/done/2024.jsonl inbox/2024.jsonl
touch -d '-5 minutes' inbox/2024.jsonl
bash "$INBOX" "$Q" q.db inbox out --model "$M" 2>>inbox.log || fail "third tick"
[ "$(sqlite3 q.db "SELECT count(*) FROM items")" = 4 ] && [ ! -e inbox/2024.jsonl ] ||
    { cat inbox.log; fail "a file already submitted was submitted again"; }
# a second file of the same name with other lines is a second job, and its archived copy does
# not replace the first's (mv replaced it: found by an audit)
printf '%s\n' '{"prompt": "new", "max_tokens": 1}' >inbox/2024.jsonl
touch -d '-5 minutes' inbox/2024.jsonl
bash "$INBOX" "$Q" q.db inbox out --model "$M" 2>>inbox.log || fail "fourth tick"
[ "$(sqlite3 q.db "SELECT count(*) FROM items")" = 5 ] || fail "the second 2024.jsonl was not a job"
[ "$(wc -l <inbox/done/2024.jsonl)" = 2 ] || fail "the first 2024.jsonl's archive was replaced"
ls inbox/done/2024.*.jsonl >/dev/null 2>&1 && grep -q new inbox/done/2024.*.jsonl ||
    fail "the second 2024.jsonl was not archived: $(ls inbox/done)"
# a file that is not JSONL (a JSON array) is refused once and moved to failed/, not retried
# every tick; one of bad requests is a job of failed items
printf '[{"prompt": "a"},\n {"prompt": "b"}]\n' >inbox/arr.jsonl
printf '%s\n' '{"prompt": "c", "max_token": 1}' >inbox/typo.jsonl
touch -d '-5 minutes' inbox/arr.jsonl inbox/typo.jsonl
bash "$INBOX" "$Q" q.db inbox out --model "$M" 2>>inbox.log || fail "fifth tick"
ls inbox/failed/arr.*.jsonl >/dev/null 2>&1 && [ ! -e inbox/arr.jsonl ] ||
    { cat inbox.log; fail "the JSON array was not moved to failed/"; }
grep -q "arr.jsonl is not JSONL" inbox.log || fail "no message for the JSON array"
[ -e inbox/done/typo.jsonl ] || { cat inbox.log; fail "the file of bad requests is not done"; }
[ "$(sqlite3 q.db "SELECT count(*) FROM items WHERE error_code = 'unknown_field'")" = 1 ] ||
    fail "the bad request is not a failed item"
echo "e2e inbox: ok"
