#!/usr/bin/env bash
# End-to-end: dummy models (--dummy PRESET). generate on a dummy SmolLM2 is repeatable, the same
# at --tp 3, and the same as the file build/tools/dummy_gguf writes for that preset and seed
# (the in-memory model is the file); a dummy's tokenizer from another GGUF (an 8-layer dummy
# file) gives the same text; bench reports the dummy; plan --dummy llama3-70b with --tp 8 and
# --mem gives per-rank numbers without touching 37 GiB of weights; a 2-layer Phi-3 mini file (Q,
# K, V in one matrix, head_dim 96, a vocabulary smaller than the tokenizer's) generates the same
# at --tp 2 as at --tp 1, and bench's synthetic prompts stay inside its vocabulary; one layer of
# Qwen3-30B-A3B and of Qwen1.5-MoE-A2.7B (mixtures of experts) score the same at --tp 2 in
# batches as at --tp 1 alone, and plan counts their experts; an unknown preset is exit 2.
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
T=$(dirname "$Q")/../tools/dummy_gguf
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -x "$T" ] || fail "no $T (make test builds it)"

gen() { # output file, then flags
    local out=$1
    shift
    "$Q" generate --model "$M" --prompt "The weather today" --temperature 0 --max-tokens 12 \
        "$@" >"$out" 2>"$out.err" || { cat "$out.err"; fail "generate $*"; }
}
gen "$tmp/a" --dummy smollm2-135m
gen "$tmp/b" --dummy smollm2-135m
gen "$tmp/tp3" --dummy smollm2-135m --tp 3
[ -s "$tmp/a" ] || fail "a dummy model wrote nothing"
cmp -s "$tmp/a" "$tmp/b" || fail "two runs of the same dummy differ"
cmp -s "$tmp/a" "$tmp/tp3" || fail "--tp 3 differs on the dummy"
grep -q "model dummy smollm2-135m (tokenizer of $M)" "$tmp/a.err" || fail "generate names the dummy"
! cmp -s "$tmp/a" <("$Q" generate --model "$M" --prompt "The weather today" --temperature 0 \
    --max-tokens 12 2>/dev/null) || fail "the dummy wrote the real model's text"

"$T" smollm2-135m 0 1 "$tmp/full.gguf" >/dev/null || fail "dummy_gguf (30 layers)"
"$T" smollm2-135m 8 1 "$tmp/l8.gguf" >/dev/null || fail "dummy_gguf (8 layers)"
gen "$tmp/file" --model "$tmp/full.gguf"
cmp -s "$tmp/a" "$tmp/file" || fail "the written file runs differently from --dummy"
gen "$tmp/tok8" --dummy smollm2-135m --model "$tmp/l8.gguf"
cmp -s "$tmp/a" "$tmp/tok8" || fail "the tokenizer of the 8-layer file gives other text"
size=$(stat -c %s "$tmp/l8.gguf")
[ "$size" -lt $((64 << 20)) ] || fail "the 8-layer file is $size bytes (the GPU check needs < 64 MiB)"

"$Q" bench --model "$M" --dummy smollm2-135m --prompts 4 --input-len 8 --output-len 4 \
    --peak-seconds 0 >"$tmp/bench.json" 2>/dev/null || fail "bench --dummy"
python3 - "$tmp/bench.json" <<'PY' || fail "bench JSON"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["model"].startswith("dummy smollm2-135m"), j["model"]
assert j["output_tokens"] == 16, j
PY

"$T" phi3-mini 2 1 "$tmp/phi3.gguf" >/dev/null || fail "dummy_gguf phi3-mini"
gen "$tmp/phi3" --model "$tmp/phi3.gguf"
gen "$tmp/phi3tp2" --model "$tmp/phi3.gguf" --tp 2
[ -s "$tmp/phi3" ] && cmp -s "$tmp/phi3" "$tmp/phi3tp2" || fail "phi3 --tp 2 differs"
grep -q "2 layers, 3072-dim, vocab 32064" "$tmp/phi3.err" || fail "phi3 dims"
"$Q" bench --model "$tmp/phi3.gguf" --prompts 4 --input-len 32 --output-len 2 \
    --peak-seconds 0 >"$tmp/bench3.json" 2>"$tmp/bench3.err" || { cat "$tmp/bench3.err"; fail "bench phi3"; }
python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); assert j["output_tokens"] == 8, j' \
    "$tmp/bench3.json" || fail "bench phi3: a prompt left the vocabulary"
rm -f "$tmp/phi3.gguf"
# Phi-3.5 mini: LongRoPE's factor sets (the short ones for these short requests), --tp 2
"$T" phi3.5-mini 2 1 "$tmp/phi35.gguf" >/dev/null || fail "dummy_gguf phi3.5-mini"
gen "$tmp/phi35" --model "$tmp/phi35.gguf"
gen "$tmp/phi35tp2" --model "$tmp/phi35.gguf" --tp 2
[ -s "$tmp/phi35" ] && cmp -s "$tmp/phi35" "$tmp/phi35tp2" || fail "phi3.5 --tp 2 differs"
"$Q" plan --dummy phi3.5-mini --model "$M" >"$tmp/plan35" 2>&1 || fail "plan --dummy phi3.5-mini"
grep -q "context: *131072 tokens" "$tmp/plan35" || fail "plan phi3.5: $(cat "$tmp/plan35")"
# (--kv-mem auto: one full-context sequence, 48 GiB, only where half the memory holds it)
python3 - "$tmp/plan35" <<'PY' || fail "plan phi3.5: a KV pool past half the memory"
import re, sys
pool = float(re.search(r"KV pool: *([0-9.]+) MiB", open(sys.argv[1]).read()).group(1))
avail = int(re.search(r"MemAvailable: *([0-9]+) kB", open("/proc/meminfo").read()).group(1)) / 1024
assert pool <= max(1024, avail / 2) * 1.05 + 64, (pool, avail)
PY
rm -f "$tmp/phi35.gguf"
# Mixtures of experts at real widths: one layer of Qwen3-30B-A3B (128 experts 768 wide, 8 a
# token; 0.7 GB) and of Qwen1.5-MoE-A2.7B (60 experts, 4 a token, not renormalized, and a shared
# expert 5632 wide): perplexity windows one at a time at --tp 1 and eight at a time at --tp 2
# score bitwise alike (a token's experts' sum does not depend on its batch), and plan
head -c 3000 "$(dirname "$0")/../../README.md" >"$tmp/ppl.txt"
for preset in qwen3-30b-a3b qwen1.5-moe-a2.7b; do
    "$T" $preset 1 1 "$tmp/moe.gguf" >/dev/null || fail "dummy_gguf $preset"
    for v in "1 1" "2 8"; do
        set -- $v
        "$Q" perplexity --model "$tmp/moe.gguf" --file "$tmp/ppl.txt" --ctx 64 --json --tp "$1" \
            --max-seqs "$2" >"$tmp/moe$1.json" 2>"$tmp/moe.err" ||
            { cat "$tmp/moe.err"; fail "perplexity $preset --tp $1"; }
    done
    python3 - "$tmp/moe1.json" "$tmp/moe2.json" <<'PY' || fail "$preset perplexity differs with --tp 2 in batches"
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
assert a["windows_in_flight"] == 1 and b["windows_in_flight"] == 8 and b["tp"] == 2, (a, b)
assert a["tokens_scored"] > 400 and a["mean_nll"] == b["mean_nll"], (a, b)
PY
    rm -f "$tmp/moe.gguf"
done
"$Q" plan --dummy qwen3-30b-a3b --model "$M" --json >"$tmp/planmoe.json" || fail "plan qwen3-30b-a3b"
"$Q" plan --dummy mixtral-8x7b --model "$M" >"$tmp/planmix" || fail "plan mixtral-8x7b"
grep -q "experts: *8 per layer, 2 a token, each 14336 wide" "$tmp/planmix" || fail "plan mixtral: $(cat "$tmp/planmix")"
python3 - "$tmp/planmoe.json" <<'PY' || fail "plan qwen3-30b-a3b numbers"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["experts"] == 128 and p["experts_used"] == 8, p
assert 16.5e9 < p["weights_bytes"] < 18e9, p  # 30.5B parameters at 4.5 bits
assert p["kv_bytes_per_token"] == 48 * 2 * 4 * 128 * 2, p
PY

"$Q" plan --model "$M" --dummy llama3-70b --tp 8 --mem 80G --json >"$tmp/plan.json" ||
    fail "plan --dummy llama3-70b"
"$Q" plan --model "$M" --dummy llama3-70b --mem 16G --json >"$tmp/plan16.json" 2>"$tmp/plan16.err" ||
    fail "plan --mem 16G"
python3 - "$tmp/plan.json" "$tmp/plan16.json" <<'PY' || fail "plan numbers"
import json, sys
p = json.load(open(sys.argv[1]))
# 80 layers x 2 x 8 KV heads x 128 x 2 bytes, an eighth per rank
assert p["kv_bytes_per_token"] == 327680 and p["rank_kv_bytes_per_token"] == 40960, p
assert p["tp"] == 8 and p["weights_fit"] is True, p
w, r = p["weights_bytes"], p["rank_weights_bytes"]
assert 36e9 < w < 42e9, w            # 70.6B parameters at 4.5 bits
assert w / 8 < r < w / 6, (w, r)     # an eighth of the layers + the replicated embedding and head
assert p["kv_tokens"] > 1000000, p   # 8 x (80 GiB - weights - reserve) / 320 KiB
q = json.load(open(sys.argv[2]))
assert q["weights_fit"] is False and q["kv_tokens"] == 0, q
PY
grep -q "does not hold the" "$tmp/plan16.err" || fail "plan --mem 16G does not warn"
# --device cuda: the weights as the CUDA backend holds them (Q4_0 at these widths packs to the
# file's size exactly), the engine's buffers (at least the logits rows: one for each of the 256
# sequence slots, of the 128,256-token vocabulary) and the KV pool from what is left
"$Q" plan --model "$M" --dummy llama3-8b --device cuda --mem 80G --json >"$tmp/planc.json" ||
    fail "plan --device cuda"
python3 - "$tmp/planc.json" <<'PY' || fail "plan --device cuda numbers"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["device"] == "cuda" and p["matmul"] == "exact", p
assert p["rank_weights_bytes"] == p["weights_bytes"], p
assert p["rank_activation_bytes"] > 256 * 128256 * 4, p
assert p["rank_scratch_bytes"] >= 64 << 20, p   # split attention's partials
held = p["rank_weights_bytes"] + p["rank_activation_bytes"] + p["rank_scratch_bytes"]
assert p["kv_mem"] == (80 << 30) - held - p["reserve_bytes"], p
PY
for bad in "--device tpu" "--device cuda --matmul q16"; do
    set +e
    # shellcheck disable=SC2086
    "$Q" plan --model "$M" --dummy llama3-8b $bad >/dev/null 2>"$tmp/bad.err"
    rc=$?
    set -e
    [ $rc -eq 2 ] || fail "plan $bad: exit $rc, want 2"
done

set +e
"$Q" generate --model "$M" --dummy llama3-9b --prompt hi >/dev/null 2>"$tmp/bad.err"
rc=$?
set -e
[ $rc -eq 2 ] || fail "unknown preset: exit $rc, want 2 (a usage error)"
grep -q "unknown --dummy 'llama3-9b' (smollm2-135m|llama3-8b|llama3-70b|qwen2.5-7b|qwen3-8b|gemma3-27b|gemma2-9b|phi3-mini|phi3.5-mini|qwen3-30b-a3b|mixtral-8x7b|qwen1.5-moe-a2.7b)" \
    "$tmp/bad.err" || { cat "$tmp/bad.err"; fail "unknown preset message"; }
echo "dummy.sh: ok"
