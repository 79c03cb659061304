#!/usr/bin/env bash
# End-to-end: the CUDA backend on the CPU emulator (`make CUDA=emu`, kernels/cuda/emu/kemu.h),
# where no GPU is. The CUDA kernels compiled as C++ run thread by thread, switching where CUDA
# threads synchronise; the backend's host code is unchanged. Checked, with the CUDA backend
# required (QUERN_REQUIRE_CUDA=1): the op test in its three modes (exact f32 kernels, bf16 and
# q8 on the emulated tensor cores) against the double-precision reference; a 6-layer dummy model's logits
# and greedy tokens against the CPU backend, and its decode steps replayed from CUDA graphs
# bitwise as without, and at 3 ranks joined by NCCL (on 3 emulated devices) bitwise as through
# host memory (test_cuda_model); the communicators, NCCL's stand-in included, bitwise the CPU
# one's (test_comm); the default model's greedy text through `quern generate --device cuda`
# against --device cpu, and at --tp 3 (three backends on the one emulated device, collectives
# staged through host memory; and on three emulated devices joined by NCCL); a small `quern run`
# job (continuous batching, the paged KV cache, prefix sharing on the device, a sampled request
# with n = 2) whose records equal the CPU's (graphs on, the default); `quern plan --device cuda`
# against the device memory a run holds; --kv-mem auto's pool from the device's free memory
# (and its errors). What this does not show: speed, and what only a GPU
# does (scripts/gpu-check.sh).
# QUERN_EMU: the emulator build directory (make test sets it), or "none" when this machine has
# no CUDA toolkit headers to build it with (make says so).
set -euo pipefail
E=${QUERN_EMU:?set QUERN_EMU to the emulator build (make test does: build-emu)}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ "$E" = none ]; then
    echo "cuda_emu.sh: not run: no CUDA toolkit headers here to build the emulator with"
    exit 0
fi
Q=$E/bin/quern
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$Q" info --model "$M" 2>&1 | grep -q "^cuda 0: quern CUDA emulator (CPU)" ||
    fail "$Q is not an emulator build"
QUERN_CUDA_EMU_DEVICES=2 "$Q" info 2>&1 | grep -q "^nccl: NCCL .*--tp up to 2 on CUDA" ||
    fail "quern info does not report NCCL over the 2 emulated devices"

# 1. The op test, the CUDA backend required, with the threads of each block run first to last
#    and last to first (a missing barrier shows in one order or the other; under sanitizers,
#    which look for memory errors, first to last only: the order is checked in the normal
#    build); then the whole-model test.
orders="forward reverse"
if [ -n "${QUERN_SANITIZE:-}" ]; then orders=forward; fi
for order in $orders; do
    QUERN_CUDA_EMU_ORDER=$order QUERN_REQUIRE_CUDA=1 QUERN_MODEL=$M \
        "$E/tests/test_backend_ops" >"$tmp/ops.txt" 2>&1 ||
        { tail -30 "$tmp/ops.txt"; fail "test_backend_ops on the emulated CUDA backend ($order)"; }
    n=$(grep -c "quern CUDA emulator (CPU) .*: every op within tolerance" "$tmp/ops.txt" || true)
    [ "$n" = 3 ] || { cat "$tmp/ops.txt"; fail "op test ($order): $n of 3 CUDA modes passed"; }
done
QUERN_REQUIRE_CUDA=1 QUERN_REQUIRE_NCCL=1 "$E/tests/test_cuda_model" >"$tmp/model.txt" 2>&1 ||
    { cat "$tmp/model.txt"; fail "test_cuda_model on the emulated CUDA backend"; }
grep "cuda model:\|cuda graphs:\|cuda tp:" "$tmp/model.txt"
# the communicators, NCCL's on 4 emulated devices (its stand-in: kernels/cuda/cuda_nccl.cu)
QUERN_REQUIRE_NCCL=1 "$E/tests/test_comm" >"$tmp/comm.txt" 2>&1 ||
    { cat "$tmp/comm.txt"; fail "test_comm with the emulated devices"; }
grep "nccl:" "$tmp/comm.txt"

# 2. Greedy text: cuda = cpu, and cuda --tp 3 = cuda --tp 1.
gen() { # name, flags...
    local name=$1
    shift
    "$Q" generate --model "$M" --prompt "The capital of France is" --temperature 0 \
        --max-tokens 6 --matmul exact "$@" >"$tmp/$name.txt" 2>"$tmp/$name.err" ||
        { cat "$tmp/$name.err"; fail "generate $*"; }
}
gen cpu --device cpu
gen cuda --device cuda
grep -q "ISA cuda 0 quern CUDA emulator" "$tmp/cuda.err" || fail "--device cuda did not run on it"
[ -s "$tmp/cpu.txt" ] || fail "generate printed nothing"
cmp -s "$tmp/cpu.txt" "$tmp/cuda.txt" || fail "cuda text '$(cat "$tmp/cuda.txt")' != cpu '$(cat "$tmp/cpu.txt")'"
if [ -n "${QUERN_SANITIZE:-}" ]; then
    # Under sanitizers (8 minutes in all) the op and model tests and this one text are what
    # look for memory errors in every kernel; --tp 3 and the job run in the normal build only.
    echo "generate: cuda = cpu: $(tr '\n' ' ' <"$tmp/cpu.txt")"
    echo "cuda_emu.sh: passed (sanitizers: without --tp 3 and the job)"
    exit 0
fi
gen cuda3 --device cuda --tp 3
cmp -s "$tmp/cuda.txt" "$tmp/cuda3.txt" || fail "cuda --tp 3 text differs from --tp 1"
grep -q "3 ranks on CUDA device 0, joined through host memory" "$tmp/cuda3.err" ||
    fail "--tp 3 on one device did not stage through the host"
QUERN_CUDA_EMU_DEVICES=3 QUERN_TP_COMM=nccl gen cuda3n --device cuda --tp 3
grep -q "3 ranks on CUDA devices 0-2, joined by NCCL" "$tmp/cuda3n.err" ||
    fail "--tp 3 on 3 devices was not joined by NCCL"
cmp -s "$tmp/cuda.txt" "$tmp/cuda3n.txt" || fail "cuda --tp 3 over NCCL text differs from --tp 1"
# attention split over the positions (flash-decoding) every 4 positions: 2 to 3 splits here
QUERN_CUDA_ATTN_SPLIT=4 gen cuda_split --device cuda
cmp -s "$tmp/cuda.txt" "$tmp/cuda_split.txt" || fail "cuda text with split attention differs"
# the bf16 mode: attention on tensor cores (the default) and in f32 give the same text
gen cuda_bf16 --device cuda --matmul bf16
QUERN_CUDA_ATTN_MMA=0 gen cuda_bf16_f32 --device cuda --matmul bf16
[ -s "$tmp/cuda_bf16.txt" ] && cmp -s "$tmp/cuda_bf16.txt" "$tmp/cuda_bf16_f32.txt" ||
    fail "bf16 text with tensor-core attention '$(cat "$tmp/cuda_bf16.txt")' differs from f32 attention's"
echo "generate --matmul bf16: tensor-core attention = f32 attention: $(tr '\n' ' ' <"$tmp/cuda_bf16.txt")"
# the q8 mode: the same 8-bit inputs as the CPU's (bitwise), int8 tensor cores: the CPU's text
gen cpu_q8 --device cpu --matmul q8
gen cuda_q8 --device cuda --matmul q8
[ -s "$tmp/cpu_q8.txt" ] && cmp -s "$tmp/cpu_q8.txt" "$tmp/cuda_q8.txt" ||
    fail "q8 text on cuda '$(cat "$tmp/cuda_q8.txt")' differs from the cpu's '$(cat "$tmp/cpu_q8.txt")'"
echo "generate --matmul q8: cuda = cpu: $(tr '\n' ' ' <"$tmp/cpu_q8.txt")"
echo "generate: cuda = cpu = cuda --tp 3 (staged, NCCL) = cuda split attention: $(tr '\n' ' ' <"$tmp/cpu.txt")"

# 3. A job of three greedy chat requests, a sampled one with two choices and penalties, one with
#    top_k and log-probabilities and a json_object one (its grammar's masks go up with its rows),
#    all drawn on the device (kern_ops.sample), sharing the system prompt's blocks, as one batch. The log-probabilities' tokens must agree; their values within 5e-3 (the
#    two backends' logits differ by their sums' order; kern_ops.sample itself is checked bitwise
#    against the host sampler by the op test).
{
    for i in 1 2 3; do
        printf '{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Count to %d."}], "max_tokens": 4, "temperature": 0}}\n' "$i" "$i"
    done
    echo '{"custom_id": "s", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 4, "temperature": 0.8, "top_p": 0.9, "frequency_penalty": 0.5, "seed": 7, "n": 2}}'
    echo '{"custom_id": "k", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 1.0, "top_k": 20, "presence_penalty": 0.4, "seed": 3, "logprobs": true, "top_logprobs": 3}}'
    echo '{"custom_id": "j", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "A JSON object with a name."}], "max_tokens": 6, "temperature": 0.7, "seed": 5, "response_format": {"type": "json_object"}}}'
} >"$tmp/job.jsonl"
for d in cpu cuda; do
    "$Q" submit --db "$tmp/$d.db" --model "$M" --out "$tmp/$d-out" --name j "$tmp/job.jsonl" \
        >/dev/null 2>&1 || fail "submit ($d)"
    "$Q" run --db "$tmp/$d.db" --device $d --matmul exact >/dev/null 2>"$tmp/run-$d.log" ||
        { cat "$tmp/run-$d.log"; fail "run --device $d"; }
    "$Q" export --db "$tmp/$d.db" --job j --out "$tmp/$d.jsonl" --order input
    python3 - "$tmp/$d.jsonl" >"$tmp/$d.rec" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    body = r["response"]["body"]
    lp = []
    for c in body["choices"]:
        for t in (c.get("logprobs") or {}).get("content") or []:
            lp.append([t["token"], [a["token"] for a in t["top_logprobs"]]])
    u = dict(body["usage"])
    u.pop("prompt_tokens_details") # (prefix-cache hits follow the schedule)
    print(json.dumps([r["custom_id"], [c["message"] for c in body["choices"]], u, lp]))
PY
done
[ "$(wc -l <"$tmp/cuda.rec")" = 6 ] || fail "the cuda run wrote $(wc -l <"$tmp/cuda.rec") records, want 6"
cmp -s "$tmp/cpu.rec" "$tmp/cuda.rec" || { diff "$tmp/cpu.rec" "$tmp/cuda.rec"; fail "job records differ"; }
python3 - "$tmp/cpu.jsonl" "$tmp/cuda.jsonl" <<'PY' || fail "log-probabilities differ"
import json, sys
def lps(path):
    out = []
    for line in open(path):
        for c in json.loads(line)["response"]["body"]["choices"]:
            for t in (c.get("logprobs") or {}).get("content") or []:
                out += [t["logprob"]] + [a["logprob"] for a in t["top_logprobs"]]
    return out
a, b = lps(sys.argv[1]), lps(sys.argv[2])
assert len(a) == len(b) == 16, (len(a), len(b))
worst = max(abs(x - y) for x, y in zip(a, b))
assert worst <= 5e-3, worst  # the logits themselves differ by up to ~1e-3 (test_cuda_model)
print(f"logprobs: {len(a)} values, cuda - cpu at most {worst:.2g}")
PY
echo "run: 6 records (7 choices), cuda = cpu"

# 4. The device really draws: a sampled bench on the emulated device counts its rows (random
#    prompt ids make flat rows, whose nucleus can be beyond the device's ranking: those few come
#    back to the host).
"$Q" bench --model "$M" --device cuda --matmul exact --prompts 3 --input-len 8 --output-len 3 \
    --temperature 0.8 --top-p 0.9 --peak-seconds 0 >"$tmp/bench.json" 2>"$tmp/bench.log" ||
    { cat "$tmp/bench.log"; fail "bench --device cuda"; }
python3 - "$tmp/bench.json" <<'PY' || fail "the device drew no rows"
import json, sys
j = json.load(open(sys.argv[1]))
n = (j["sampled_backend"], j["sampled_host"])
assert n[0] >= 6 and n[0] + n[1] == 9, n
print(f"bench: {j['sampled_backend']} rows drawn on the device, {j['sampled_host']} on the host")
PY
# 5. tools/bench_matmul (which the GPU check times) runs each CUDA kernel choice: the packed
#    layout's GEMV, tensor-core and int8 kernels, the GGUF-row kernels and cuBLAS (speed means nothing
#    here).
"$E/tools/bench_matmul" --quick >"$tmp/mm.tsv" 2>"$tmp/mm.log" ||
    { cat "$tmp/mm.log"; fail "bench_matmul on the emulated device"; }
python3 - "$tmp/mm.tsv" <<'PY' || { cat "$tmp/mm.tsv"; fail "bench_matmul's table"; }
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
assert sorted({r[0] for r in rows}) == ["cublas", "gemv-exact", "gguf", "mma16", "mma64", "q8-int8"], rows
assert len(rows) == 18 and all(float(r[5]) > 0 for r in rows), rows
print(f"bench_matmul: {len(rows)} timings (mma16, mma64, gguf, cublas, gemv-exact, q8-int8)")
PY
# 6. `quern plan --device cuda` counts what the backend holds: its weights in the CUDA layout,
#    the engine's buffers, the backend's scratch and the KV pool, against the device memory a
#    greedy bench of the same limits has in use at its end (the emulator counts its live
#    allocations; a greedy run never makes the device sampler's scratch, which the plan
#    counts: at most 2 MiB here).
lim=(--dummy smollm2-135m --kv-mem 64M --max-batch-tokens 64 --max-seqs 8)
"$Q" bench --model "$M" "${lim[@]}" --device cuda --prompts 2 --input-len 6 --output-len 3 \
    --peak-seconds 0 >"$tmp/mem.json" 2>"$tmp/mem.err" || { cat "$tmp/mem.err"; fail "bench (memory)"; }
"$Q" plan --model "$M" "${lim[@]}" --device cuda --json >"$tmp/plan.json" 2>/dev/null ||
    fail "plan --device cuda"
python3 - "$tmp/mem.json" "$tmp/plan.json" <<'PY' || fail "plan --device cuda vs the device's use"
import json, sys
used = json.load(open(sys.argv[1]))["device_mem_used_bytes"]
p = json.load(open(sys.argv[2]))
assert p["device"] == "cuda", p
planned = p["rank_weights_bytes"] + p["rank_activation_bytes"] + p["rank_scratch_bytes"] + p["kv_mem"]
assert planned - (2 << 20) <= used <= planned, (used, planned, p)
print(f"plan --device cuda: {planned} bytes counted, {used} in use on the device")
PY
# 7. --kv-mem auto on the device: the buffers first, then the pool takes what the device has
#    free beside the runtime's reserve (256 MiB on the emulator's 1 GiB device) and the logits
#    rows and sampler scratch a step may add later, one rank, three
#    ranks on the one device and three on three devices; a device without room is an error
#    that says so (exit 1), as is a --kv-mem the device cannot hold.
auto_mem() { # name, environment ("A=1 B=2"), flags...
    local name=$1 vars=$2
    shift 2
    env $vars "$Q" bench --model "$M" --dummy smollm2-135m --device cuda --prompts 2 \
        --input-len 6 --output-len 3 --peak-seconds 0 "$@" >"$tmp/auto-$name.json" \
        2>"$tmp/auto-$name.err" || { cat "$tmp/auto-$name.err"; fail "bench --kv-mem auto ($name)"; }
}
auto_mem tp1 QUERN_CUDA_EMU_MEM=1G
auto_mem staged3 "QUERN_CUDA_EMU_MEM=1G QUERN_TP_COMM=staged" --tp 3
auto_mem nccl3 "QUERN_CUDA_EMU_MEM=1G QUERN_CUDA_EMU_DEVICES=3 QUERN_TP_COMM=nccl" --tp 3
python3 - "$tmp" <<'PY' || fail "--kv-mem auto on the emulated device"
import json, sys
block = 16 * 30 * 3 * 64 * 2 * 2  # a block of 16 tokens: layers x KV heads x head dim x K,V x f16
later = 2 * 256 * 49152 * 4  # 256 rows of logits and of the sampler's scratch, set aside
for name in ("tp1", "staged3", "nccl3"):
    j = json.load(open(f"{sys.argv[1]}/auto-{name}.json"))
    left = (1 << 30) - j["device_mem_used_bytes"]  # device 0 at the bench's end
    # what the pool left is the reserve and what is set aside for later (a greedy bench makes
    # none of it), less any small buffer made after it, within a block
    want = (256 << 20) + later
    assert want - (2 << 20) <= left <= want + block, (name, left, want)
    print(f"--kv-mem auto {name}: {j['kv_blocks']} blocks, {left / 2**20:.1f} MiB left on device 0")
PY
set +e
QUERN_CUDA_EMU_MEM=300M "$Q" bench --model "$M" --dummy smollm2-135m --device cuda --prompts 2 \
    --input-len 6 --output-len 3 --peak-seconds 0 >/dev/null 2>"$tmp/noroom.err"
rc=$?
"$Q" bench --model "$M" --dummy smollm2-135m --device cuda --prompts 2 --input-len 6 \
    --output-len 3 --peak-seconds 0 --kv-mem 2G >/dev/null 2>"$tmp/toobig.err"
rc2=$?
set -e
[ $rc = 1 ] && grep -q "no room for a KV cache" "$tmp/noroom.err" ||
    { cat "$tmp/noroom.err"; fail "a device without room: exit $rc"; }
[ $rc2 = 1 ] && grep -q "no device memory for a KV pool" "$tmp/toobig.err" ||
    { cat "$tmp/toobig.err"; fail "--kv-mem 2G on a 1 GiB device: exit $rc2"; }
echo "cuda_emu.sh: passed"
