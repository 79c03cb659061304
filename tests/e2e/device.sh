#!/usr/bin/env bash
# End-to-end: device selection. Whatever this build holds (the CUDA backend when nvcc was found,
# see `quern info`), on a machine without a usable GPU: --device auto and cpu run on the CPU and
# give the same text, a CUDA-enabled binary says once why it is on the CPU; --device cuda fails
# with a clear error and exit 1 before it touches a job (the items stay queued), also with
# --tp 3; an unknown device is a usage error (exit 2). On a machine with a GPU this test
# is not the check: scripts/gpu-check.sh is.
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$Q" info --model "$M" >"$tmp/info.txt" 2>&1 || fail "quern info"
cuda_line=$(grep '^cuda' "$tmp/info.txt" | head -1)
[ -n "$cuda_line" ] || fail "quern info has no cuda line"
case "$cuda_line" in
"cuda: built in; no usable device here ("*) built=1 ;;
"cuda: not built in"*) built=0 ;;
"cuda 0: "*) echo "device.sh: a GPU is here ($cuda_line): scripts/gpu-check.sh checks it"; exit 0 ;;
*) fail "unexpected cuda line: $cuda_line" ;;
esac

# 1. auto and cpu: the same text; with CUDA built in, exactly one line says why the CPU runs.
for d in auto cpu; do
    "$Q" generate --model "$M" --device $d --chat "Say hi." --temperature 0 --max-tokens 12 \
        >"$tmp/$d.txt" 2>"$tmp/$d.err" || { cat "$tmp/$d.err"; fail "generate --device $d"; }
done
cmp -s "$tmp/auto.txt" "$tmp/cpu.txt" || fail "--device auto and cpu gave different text"
[ -s "$tmp/auto.txt" ] || fail "generate printed nothing"
n=$(grep -c "running on the CPU" "$tmp/auto.err" || true)
if [ $built = 1 ]; then
    [ "$n" = 1 ] || { cat "$tmp/auto.err"; fail "auto: $n lines saying why the CPU runs, want 1"; }
    grep -q "no CUDA device usable (" "$tmp/auto.err" || fail "auto: the reason is missing"
else
    [ "$n" = 0 ] || fail "a build without CUDA talks about it"
fi
! grep -q "running on the CPU" "$tmp/cpu.err" || fail "--device cpu logs the device choice"

# 2. --device cuda: exit 1 and a clear message, for generate, bench and run (queue untouched).
expect_fail() { # what to grep, then the command
    local want=$1
    shift
    set +e
    "$@" >/dev/null 2>"$tmp/err"
    local rc=$?
    set -e
    [ $rc -eq 1 ] || { cat "$tmp/err"; fail "$* exited $rc, want 1"; }
    grep -q -- "$want" "$tmp/err" || { cat "$tmp/err"; fail "$*: no '$want' in the error"; }
}
if [ $built = 1 ]; then
    why="--device cuda: no usable CUDA device ("
else
    why="--device cuda: this build has no CUDA backend"
fi
expect_fail "$why" "$Q" generate --model "$M" --device cuda --prompt hi --max-tokens 2
expect_fail "$why" "$Q" bench --model "$M" --device cuda --prompts 2 --output-len 2 --peak-seconds 0
printf '{"custom_id":"a","messages":[{"role":"user","content":"hi"}],"max_tokens":2}\n' \
    >"$tmp/in.jsonl"
"$Q" submit --db "$tmp/q.db" --model "$M" --out "$tmp/out" "$tmp/in.jsonl" >/dev/null 2>"$tmp/sub.err" ||
    { cat "$tmp/sub.err"; fail "submit"; }
expect_fail "$why" "$Q" run --db "$tmp/q.db" --device cuda
"$Q" status --db "$tmp/q.db" --json >"$tmp/st.json" 2>/dev/null || fail "status"
python3 - "$tmp/st.json" <<'PY' || fail "the job changed after a failed --device cuda run"
import json, sys
s = json.load(open(sys.argv[1]))
c = s[0]["by_state"]
assert c["queued"] == 1 and c["done"] == 0 and c["leased"] == 0, c
PY

# 3. CUDA with tensor parallelism fails the same way, and an unknown device is named.
expect_fail "$why" "$Q" generate --model "$M" --device cuda --tp 3 --prompt hi --max-tokens 2
# (a name that is none is a usage error, exit 2, found before the model is loaded)
set +e
"$Q" generate --model "$M" --device tpu --prompt hi --max-tokens 2 >/dev/null 2>"$tmp/err"
rc=$?
set -e
[ $rc -eq 2 ] && grep -q -- "unknown --device 'tpu'" "$tmp/err" || { cat "$tmp/err"; fail "--device tpu exited $rc"; }
echo "device.sh: ok (CUDA built in: $built)"
