#!/usr/bin/env bash
# End-to-end: `quern plan` arithmetic on the default model (30 layers x 2 x 3 KV heads x 64
# dims x 2 bytes (f16) = 23040 bytes per token; with --kv-dtype q8 30 x 2 x 3 x (64 + a 4-byte
# scale) = 12240) and a tiny `quern bench` whose JSON must account
# for every request and token. Numbers are checked for consistency, never for speed.
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
jget() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d' + sys.argv[2]))" "$@"; }

"$Q" plan --model "$M" --kv-mem 2G --kv-block 16 --seq-len 1000 --json >"$tmp/plan.json"
[ "$(jget "$tmp/plan.json" '["kv_bytes_per_token"]')" = 23040 ] || fail "kv bytes per token"
# 2 GiB / (23040 * 16) = 5825 blocks; 1000 tokens = 63 blocks -> 92 sequences
[ "$(jget "$tmp/plan.json" '["kv_blocks"]')" = 5825 ] || fail "kv blocks"
[ "$(jget "$tmp/plan.json" '["sequences"]')" = 92 ] || fail "sequences"
[ "$(jget "$tmp/plan.json" '["full_context_fits"]')" = True ] || fail "full context"
# the copy repacked at load for the default (q8) mode: about the size of the matrices (Q4_1
# panels as big as the blocks, Q8_0 +6 %) on every x86 table, AVX2 too
packed=$(jget "$tmp/plan.json" '["packed_weights_bytes"]')
[ "$packed" -gt 80000000 ] && [ "$packed" -lt 120000000 ] || fail "packed weights $packed"
p2=$(QUERN_ISA=avx2 "$Q" plan --model "$M" --json 2>/dev/null |
     python3 -c 'import json,sys; print(json.load(sys.stdin)["packed_weights_bytes"])')
[ "$p2" -gt 80000000 ] && [ "$p2" -lt 120000000 ] || fail "packed weights on avx2: $p2"
"$Q" plan --model "$M" --kv-mem 2G --kv-dtype q8 --seq-len 1000 --json >"$tmp/plan8.json"
[ "$(jget "$tmp/plan8.json" '["kv_bytes_per_token"]')" = 12240 ] || fail "q8 kv bytes per token"
# 2 GiB / (12240 * 16) = 10965 blocks; / 63 -> 174 sequences
[ "$(jget "$tmp/plan8.json" '["kv_blocks"]')" = 10965 ] || fail "q8 kv blocks"
[ "$(jget "$tmp/plan8.json" '["sequences"]')" = 174 ] || fail "q8 sequences"
"$Q" plan --model "$M" --kv-dtype q4 2>"$tmp/plan.err" >/dev/null && fail "--kv-dtype q4 accepted"
grep -q "f16|q8" "$tmp/plan.err" || fail "no explanation for a bad --kv-dtype"
"$Q" plan --model "$M" --kv-mem 100M 2>"$tmp/plan.err" >/dev/null
grep -q "cannot hold one full-context sequence" "$tmp/plan.err" || fail "no warning for a small pool"
# (a CLI audit) the engine runs at most --max-seqs at once; its batch checks as run's; the model
# path escaped in JSON; --no-prefix-cache is not plan's (it was accepted and ignored)
"$Q" plan --model "$M" --kv-mem 2G --seq-len 256 --max-seqs 100 --json >"$tmp/plan_s.json"
[ "$(jget "$tmp/plan_s.json" '["sequences"]')" = 100 ] || fail "plan ignores --max-seqs"
# (a resource audit) the engine's logits, --max-seqs rows of the vocabulary, are counted
"$Q" plan --model "$M" --max-seqs 8192 --max-batch-tokens 8192 --json >"$tmp/plan_l.json"
[ "$(jget "$tmp/plan_l.json" '["logits_bytes"]')" = $((8192 * 49152 * 4)) ] || fail "plan: logits bytes"
"$Q" plan --model "$M" --max-seqs 512 --max-batch-tokens 10 >/dev/null 2>&1 && fail "plan: bad batch"
"$Q" plan --model "$M" --no-prefix-cache >/dev/null 2>&1 && fail "plan --no-prefix-cache accepted"
for v in 0x10 1e3 " 2G" +2G; do
    "$Q" plan --model "$M" --kv-mem "$v" >/dev/null 2>&1 && fail "plan --kv-mem '$v' accepted"
done
mkdir -p "$tmp/a\"b\\c" && ln -s "$(realpath "$M")" "$tmp/a\"b\\c/m.gguf"
"$Q" plan --model "$tmp/a\"b\\c/m.gguf" --json >"$tmp/plan_q.json" || fail "plan, odd path"
[ "$(jget "$tmp/plan_q.json" '["model"]')" = "$tmp/a\"b\\c/m.gguf" ] || fail "plan JSON: the model path"

"$Q" bench --model "$M" --prompts 12 --input-len 20 --output-len 5 --max-seqs 8 \
    --max-batch-tokens 64 --peak-seconds 0.2 >"$tmp/bench.json"
[ "$(jget "$tmp/bench.json" '["requests"]')" = 12 ] || fail "requests"
[ "$(jget "$tmp/bench.json" '["input_tokens"]')" = 240 ] || fail "input tokens"
[ "$(jget "$tmp/bench.json" '["output_tokens"]')" = 60 ] || fail "output tokens"
[ "quern $(jget "$tmp/bench.json" '["quern"]')" = "$("$Q" --version | head -1)" ] || fail "quern"
python3 - "$tmp/bench.json" <<'PY' || fail "bench JSON inconsistent"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["mean_batch_seqs"] <= 8 and d["mean_batch_tokens"] <= 64, d
assert 0 < d["peak_kv_util"] <= 1
assert d["ttft_ms"]["p50"] <= d["ttft_ms"]["p90"] <= d["ttft_ms"]["p99"]
assert d["int8_peak_ops_s"] > 0 and 0 < d["fraction_of_int8_peak"] < 1
# the FLOPs the requests needed: below every token through the whole model (the output
# projection runs only for generated tokens), and the fractions are that over each peak
assert 0 < d["model_flops_s"] < d["model_flops_per_token"] * d["total_tok_s"], d
for k in ("int8_peak_ops_s", "amx_int8_peak_ops_s", "amx_bf16_peak_flops_s"):
    if k in d:
        f = "fraction_of_" + k.replace("_ops_s", "").replace("_flops_s", "")
        assert abs(d[f] - d["model_flops_s"] / d[k]) <= 1e-9 * d[f], (k, d)
assert abs(d["output_tok_s"] * d["elapsed_s"] - 60) < 1e-6 * 60 + 1e-9
# attention: 12 requests forward positions 0..23, position p attends to p + 1 keys (300 per
# request); 2 x 2 x 9 heads x 64 dims FLOPs per key per layer, 30 layers
want = 12 * 300 * 4 * 576 * 30
assert abs(d["attention_flops_s"] * d["elapsed_s"] - want) <= 1e-6 * want, d
assert d["fraction_of_int8_peak_with_attention"] > d["fraction_of_int8_peak"]
PY
"$Q" bench --model "$M" --prompts 4 --input-len 20 --output-len 5 --kv-dtype q8 \
    --peak-seconds 0 >"$tmp/bench8.json"
[ "$(jget "$tmp/bench8.json" '["kv_dtype"]')" = q8 ] || fail "bench kv_dtype"
[ "$(jget "$tmp/bench8.json" '["output_tokens"]')" = 20 ] || fail "q8 KV output tokens"
"$Q" bench --model "$M" --prompts 4 --input-len 20 --output-len 5 --temperature 0.8 \
    --top-p 0.9 --logprobs 3 --peak-seconds 0 >"$tmp/bench_lp.json" || fail "bench --logprobs"
[ "$(jget "$tmp/bench_lp.json" '["logprobs"]')" = 3 ] || fail "bench logprobs"
[ "$(jget "$tmp/bench_lp.json" '["output_tokens"]')" = 20 ] || fail "logprobs output tokens"
[ "$(jget "$tmp/bench.json" '["logprobs"]')" = -1 ] || fail "bench logprobs off by default"
"$Q" bench --model "$M" --prompts 2 --logprobs 21 >/dev/null 2>&1 && fail "--logprobs 21 accepted"
"$Q" bench --model "$M" --prompts 2 --max-seqs 600 >/dev/null 2>"$tmp/b.err" && fail "max-seqs > max-batch-tokens accepted"
grep -q "max-batch-tokens" "$tmp/b.err" || fail "no explanation for bad engine params"
# a prompt longer than the model context is skipped with a warning, the others still run
python3 - "$tmp/in.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    f.write(json.dumps({"prompt": "Name a colour."}) + "\n")
    f.write(json.dumps({"prompt": "word " * 9000}) + "\n")
    f.write(json.dumps({"prompt": "Name a fruit."}) + "\n")
PY
"$Q" bench --model "$M" --input "$tmp/in.jsonl" --output-len 4 --peak-seconds 0 \
    >"$tmp/bench_in.json" 2>"$tmp/bench_in.err" || fail "bench stopped at a too-long prompt"
[ "$(jget "$tmp/bench_in.json" '["requests"]')" = 2 ] || fail "requests with one rejected"
[ "$(jget "$tmp/bench_in.json" '["rejected_requests"]')" = 1 ] || fail "rejected_requests"
[ "$(jget "$tmp/bench_in.json" '["output_tokens"]')" = 8 ] || fail "output tokens with one rejected"
grep -q "request 1 skipped: .*leaves no room for output in the model context" "$tmp/bench_in.err" ||
    fail "no warning for the rejected request"
# synthetic prompts longer than the context: refused before any is made (a stop-48 audit:
# 100 x 1M-token prompts took 617 MB and 6 s before each was refused)
set +e
"$Q" bench --model "$M" --prompts 100 --input-len 1048576 --output-len 1 --peak-seconds 0 \
    >/dev/null 2>"$tmp/big.err"
rc=$?
set -e
[ $rc -eq 1 ] && grep -q "longer than the model's context (8192 tokens)" "$tmp/big.err" ||
    { cat "$tmp/big.err"; fail "bench with prompts past the context: rc $rc"; }
# a model path that is not UTF-8 (a symbolic link named with byte 0xFF): bench's JSON stays
# UTF-8, the byte a U+FFFD (it was written raw); plan warns of a --seq-len past the context
ln -s "$(realpath "$M")" "$tmp/$(printf 'x\xffy').gguf"
"$Q" bench --model "$tmp/$(printf 'x\xffy').gguf" --prompts 2 --input-len 8 --output-len 2 \
    --peak-seconds 0 >"$tmp/u8.json" 2>/dev/null || fail "bench on a non-UTF-8 path"
python3 -c 'import json, sys; assert json.load(open(sys.argv[1], encoding="utf-8"))["model"].endswith("x\ufffdy.gguf")' \
    "$tmp/u8.json" || fail "bench JSON with a non-UTF-8 model path"
# --input lines are read as submit reads them (a content that is no string was taken as empty,
# text after the JSON ignored, a line that is not JSON called one without a prompt)
printf '%s\n' '{"messages":[{"role":"user","content":5}]}' >"$tmp/bad5.jsonl"
printf '%s\n' '{"prompt":"hi"} trailing' >"$tmp/trail.jsonl"
for f in bad5:"must be a string or an array of text parts" trail:"expected the end of the line"; do
    set +e
    "$Q" bench --model "$M" --input "$tmp/${f%%:*}.jsonl" --output-len 2 --peak-seconds 0 \
        >/dev/null 2>"$tmp/in.err"
    rc=$?
    set -e
    [ $rc -eq 1 ] && grep -q "${f#*:}" "$tmp/in.err" || { cat "$tmp/in.err"; fail "bench --input ${f%%:*}: rc $rc"; }
done
# ... blank lines too: CRLF-only, white space, a BOM alone are skipped as submit skips them
# (bench called them "the line is empty"); a directory says why it cannot be read
printf '{"prompt":"a"}\r\n\r\n  \n\xef\xbb\xbf\n{"prompt":"b"}\n' >"$tmp/blank.jsonl"
"$Q" bench --model "$M" --input "$tmp/blank.jsonl" --output-len 2 --peak-seconds 0 \
    >"$tmp/blank.json" 2>"$tmp/blank.err" || { cat "$tmp/blank.err"; fail "bench --input with blank lines"; }
[ "$(jget "$tmp/blank.json" '["requests"]')" = 2 ] || fail "bench --input with blank lines: requests"
set +e
"$Q" bench --model "$M" --input "$tmp" --output-len 2 --peak-seconds 0 >/dev/null 2>"$tmp/dir.err"
rc=$?
set -e
[ $rc -eq 1 ] && grep -q "cannot read $tmp: Is a directory" "$tmp/dir.err" ||
    { cat "$tmp/dir.err"; fail "bench --input DIR: rc $rc"; }
"$Q" plan --model "$M" --seq-len 10000 2>&1 >/dev/null |
    grep -q "longer than the model's context (8192 tokens)" || fail "plan --seq-len past the context"
# --prompts with --input cycles the file's prompts (3 lines, one too long: 7 taken, 5 run,
# 2 rejected) or takes its first ones; --input-len with --input is refused
"$Q" bench --model "$M" --input "$tmp/in.jsonl" --prompts 7 --output-len 4 --peak-seconds 0 \
    >"$tmp/bench_cyc.json" 2>/dev/null || fail "bench --input --prompts 7"
[ "$(jget "$tmp/bench_cyc.json" '["requests"]')" = 5 ] &&
    [ "$(jget "$tmp/bench_cyc.json" '["rejected_requests"]')" = 2 ] || fail "--prompts 7 cycled"
"$Q" bench --model "$M" --input "$tmp/in.jsonl" --prompts 1 --output-len 4 --peak-seconds 0 \
    >"$tmp/bench_one.json" 2>/dev/null || fail "bench --input --prompts 1"
[ "$(jget "$tmp/bench_one.json" '["requests"]')" = 1 ] || fail "--prompts 1 with --input"
rc=0
"$Q" bench --model "$M" --input "$tmp/in.jsonl" --input-len 9 >/dev/null 2>&1 || rc=$?
[ $rc -eq 2 ] || fail "--input-len with --input: exit $rc, want 2"
# all rejected: an error, not an empty measurement
python3 -c 'import json; print(json.dumps({"prompt": "word " * 9000}))' >"$tmp/long.jsonl"
"$Q" bench --model "$M" --input "$tmp/long.jsonl" --output-len 4 --peak-seconds 0 \
    >/dev/null 2>&1 && fail "bench with every request rejected succeeded"
# the default --threads is the CPUs the process may use (it was every online CPU: under a
# one-CPU affinity mask two threads spun on it, 1.7x slower at batch 1; a throughput audit)
if command -v taskset >/dev/null; then
    t=$(taskset -c 0 "$Q" bench --model "$M" --prompts 2 --input-len 8 --output-len 2 \
        --peak-seconds 0 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["threads"])')
    [ "$t" = 1 ] || fail "bench under taskset -c 0: threads $t, want 1"
fi
echo "e2e bench/plan: ok"
