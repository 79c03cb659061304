#!/usr/bin/env bash
# Speculative decoding's benchmarks (docs/BENCHMARKS.md), each with --spec off and --spec auto in
# one run of this script, alternating, ratios printed at the end:
#  full:  quern bench, 256 synthetic prompts x 128 in x 128 out (the saturated batch: the
#         load-aware budget must not lose throughput);
#  tail:  quern bench, the last few requests of a job: 4 chat prompts from examples/, 256 tokens
#         each (few sequences, long outputs);
#  templ: quern run end to end on a templated dataset job: N_TEMPL requests asking for the same
#         JSON record about different items (greedy).
# Each also as output tokens per CPU-second (all threads), steadier than wall time on a shared
# machine: "cpu" ratios compare work done per token.
# Usage: tools/bench_spec.sh [BIN] [MODEL]; env N_TEMPL (default 400), SKIP (names to skip).
set -euo pipefail
Q=${1:-build/bin/quern}
M=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
N_TEMPL=${N_TEMPL:-400}
SKIP=${SKIP:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d$2)" "$1"; }
declare -A R C

if [[ " $SKIP " != *" full "* ]]; then
    for sp in off auto; do
        "$Q" bench --model "$M" --prompts 256 --input-len 128 --output-len 128 --peak-seconds 0 \
            --spec $sp >"$tmp/full_$sp.json" 2>/dev/null
        R[full_$sp]=$(get "$tmp/full_$sp.json" '["output_tok_s"]')
        C[full_$sp]=$(get "$tmp/full_$sp.json" '["output_tokens"] / d["cpu_s"]')
        echo "full  --spec $sp: ${R[full_$sp]} output tok/s, ${C[full_$sp]} per CPU-s"
    done
    get "$tmp/full_auto.json" '.get("spec")'
fi

if [[ " $SKIP " != *" tail "* ]]; then
    grep '"explain-00[1-4]"' examples/prompts.jsonl >"$tmp/tail.jsonl"
    for sp in off auto; do
        "$Q" bench --model "$M" --input "$tmp/tail.jsonl" --output-len 256 --peak-seconds 0 \
            --spec $sp >"$tmp/tail_$sp.json" 2>/dev/null
        R[tail_$sp]=$(get "$tmp/tail_$sp.json" '["output_tok_s"]')
        C[tail_$sp]=$(get "$tmp/tail_$sp.json" '["output_tokens"] / d["cpu_s"]')
        echo "tail  --spec $sp: ${R[tail_$sp]} output tok/s, ${C[tail_$sp]} per CPU-s"
    done
    get "$tmp/tail_auto.json" '.get("spec")'
fi

if [[ " $SKIP " != *" templ "* ]]; then
    python3 - "$N_TEMPL" >"$tmp/templ.jsonl" <<'PY'
import json, sys
things = ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear",
          "plum", "kiwi", "lime", "melon", "fig", "date", "guava", "papaya", "apricot", "coconut",
          "olive"]
colours = ["red", "green", "blue", "yellow", "purple", "brown", "black", "white"]
for i in range(int(sys.argv[1])):
    item = "%s %s number %d" % (colours[i % 8], things[i % 20], i)
    q = ("Describe the %s as a JSON object with the keys \"name\", \"colour\", \"taste\", "
         "\"origin\" and \"uses\" (a list of three strings). Answer with the JSON only." % item)
    print(json.dumps({"custom_id": "t-%d" % i, "messages": [{"role": "user", "content": q}],
                      "max_tokens": 96, "temperature": 0}))
PY
    for sp in off auto; do
        "$Q" submit --db "$tmp/t_$sp.db" --model "$M" --name templ "$tmp/templ.jsonl" >/dev/null 2>&1
        /usr/bin/time -f "%e %U %S" -o "$tmp/templ_$sp.time" \
            "$Q" run --db "$tmp/t_$sp.db" --out "$tmp/t_$sp" --spec $sp >"$tmp/templ_$sp.sum" 2>/dev/null
        R[templ_$sp]=$(awk '{print $1}' "$tmp/templ_$sp.time")
        C[templ_$sp]=$(awk '{print $2 + $3}' "$tmp/templ_$sp.time")
        echo "templ --spec $sp: ${R[templ_$sp]} s end to end (${C[templ_$sp]} CPU-s), $(python3 -c "import json;print(json.loads(open('$tmp/templ_$sp.sum').read().strip().splitlines()[-1])['output_tok_s'])") output tok/s"
    done
    python3 -c "import json;print(json.loads(open('$tmp/templ_auto.sum').read().strip().splitlines()[-1]).get('spec'))"
    cmp <(zstd -dcq "$tmp"/t_off/templ/*.zst | python3 -c "import json,sys;[print(json.dumps(json.loads(l)['response']['body']['choices'])) for l in sys.stdin]" | sort) \
        <(zstd -dcq "$tmp"/t_auto/templ/*.zst | python3 -c "import json,sys;[print(json.dumps(json.loads(l)['response']['body']['choices'])) for l in sys.stdin]" | sort) &&
        echo "templ: outputs identical"
fi

echo "== ratios (auto / off)"
[ -n "${R[full_off]:-}" ] && python3 -c "print('full batch throughput: %.3f (cpu %.3f)' % (${R[full_auto]} / ${R[full_off]}, ${C[full_auto]} / ${C[full_off]}))"
[ -n "${R[tail_off]:-}" ] && python3 -c "print('tail throughput: %.3f (cpu %.3f)' % (${R[tail_auto]} / ${R[tail_off]}, ${C[tail_auto]} / ${C[tail_off]}))"
[ -n "${R[templ_off]:-}" ] && python3 -c "print('templated job speed-up (time off / auto): %.3f (cpu %.3f)' % (${R[templ_off]} / ${R[templ_auto]}, ${C[templ_off]} / ${C[templ_auto]}))"
exit 0
