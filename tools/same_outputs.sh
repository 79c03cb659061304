#!/usr/bin/env bash
# Runs the example prompts through two quern binaries and compares what they generated
# (each record's custom_id and response body choices; ids and timestamps differ by design).
# usage: tools/same_outputs.sh OLD_BIN NEW_BIN [MODEL] [extra `quern run` flags...]
# SUBMIT_FLAGS (environment) go to `quern submit`, e.g. "--temperature 0" for greedy; the
# default is the job defaults (temperature 1, seeded per request). NEW_RUN_FLAGS go to the new
# binary's run only (to see the script fail: NEW_RUN_FLAGS="--matmul exact").
# Prints "same: N records" or the first differences; exits 1 when they differ.
set -euo pipefail
old=$1 new=$2 model=${3:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
shift $(($# < 3 ? $# : 3))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for side in old new; do
    bin=${!side}
    # shellcheck disable=SC2086
    "$bin" submit --db "$tmp/$side.db" --model "$model" --out "$tmp/$side-out" \
        --name ex ${SUBMIT_FLAGS:-} examples/prompts.jsonl >/dev/null 2>&1
    extra=
    [ "$side" = new ] && extra=${NEW_RUN_FLAGS:-}
    # shellcheck disable=SC2086
    "$bin" run --db "$tmp/$side.db" "$@" $extra >/dev/null 2>"$tmp/$side.log" ||
        { cat "$tmp/$side.log" >&2; exit 2; }
    "$bin" export --db "$tmp/$side.db" --job ex --out "$tmp/$side.jsonl" --order input
    python3 - "$tmp/$side.jsonl" >"$tmp/$side.txt" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    body = (r.get("response") or {}).get("body") or {}
    out = [c.get("message", c.get("text")) for c in body.get("choices", [])]
    print(json.dumps([r["custom_id"], out, r.get("error")], sort_keys=True))
PY
done
if cmp -s "$tmp/old.txt" "$tmp/new.txt"; then
    echo "same: $(wc -l <"$tmp/new.txt") records"
else
    diff "$tmp/old.txt" "$tmp/new.txt" | head -20
    exit 1
fi
