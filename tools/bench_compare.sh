#!/usr/bin/env bash
# Compare `quern bench` with llama.cpp (tools/bench_llamacpp.py) on the same offline workload,
# one run after another on this machine: N requests of L random prompt tokens (same seed, so
# the same prompts), M greedy tokens each (EOS ignored), all arriving at once.
#
# usage: tools/bench_compare.sh [RESULTS_DIR]        (default /tmp/bench-results)
#
# Environment (defaults in brackets):
#   BENCH_N / BENCH_L / BENCH_M   requests, prompt length, output length [256 / 128 / 128]
#   BENCH_THREADS                 threads for both engines [2]
#   BENCH_SEED                    prompt seed [1]
#   QUERN                         quern binary [bin/quern]
#   QUERN_MAX_SEQS                batched quern --max-seqs [256]
#   QUERN_BATCH_TOKENS            quern --max-batch-tokens [512]
#   QUERN_KV_MEM                  batched quern --kv-mem [3G]
#   QUERN_MODES                   --matmul modes, each run batched and at --max-seqs 1
#                                 ["exact q16 bf16 q8", bf16 only where the CPU has AMX-BF16]
#   QUERN_KV_DTYPES               --kv-dtype values, each run with every mode (runs with q8 are
#                                 named ..._kvq8) ["f16"]
#   QUERN_SEQS1_N                 requests of the --max-seqs 1 runs (one sequence at a time:
#                                 its tok/s does not depend on the count) [16]
#   QUERN_PEAK_SECONDS            quern --peak-seconds [1]
#   QUERN_AVXVNNI                 1 = also run batched quern q8 with --isa avxvnni where the
#                                 CPU has AVX-VNNI [1]
#   QUERN_AVX2                    1 = also run batched quern q8 with --isa avx2, the ISA the
#                                 installed llama.cpp was built for [1]
#   QUERN_EXACT_ISAS              more --isa values to run exact mode with, batched and at
#                                 --max-seqs 1, e.g. "avx512" on an AMX machine []
#   LLAMA_PARALLEL                llama.cpp --parallel values to try ["32 64"]; 256 is much
#                                 slower per token (per-sequence KV streams) and takes >10 min
#   LLAMA_BATCH                   llama.cpp --batch (n_batch = n_ubatch) [512]
#   LLAMA_EXTRA                   extra bench_llamacpp.py flags, e.g. "--flash-attn off" []
#   PYTHON                        [python3]
#
# Each run's JSON goes to RESULTS_DIR/NAME.json and its stderr to RESULTS_DIR/NAME.log; a
# summary table (ratios against quern --max-seqs 1 in the same matmul mode, kernels and KV type,
# against the fastest --max-seqs 1 run of any mode, and against the best llama.cpp run; the
# fraction of the vpdpbusd int8 peak, matmul FLOPs only and with attention's, and of the AMX int8
# and AMX bf16 tile peaks where the CPU has them) goes to stdout and RESULTS_DIR/summary.txt.
set -u
cd "$(dirname "$0")/.." || exit 1

RES=${1:-/tmp/bench-results}
N=${BENCH_N:-256}
L=${BENCH_L:-128}
M=${BENCH_M:-128}
T=${BENCH_THREADS:-2}
SEED=${BENCH_SEED:-1}
QUERN=${QUERN:-bin/quern}
QSEQS=${QUERN_MAX_SEQS:-256}
QBATCH=${QUERN_BATCH_TOKENS:-512}
QKV=${QUERN_KV_MEM:-3G}
if [ -z "${QUERN_MODES:-}" ]; then
    QUERN_MODES="exact q16 q8"
    # bf16 needs AMX-BF16: try one tiny request
    if "$QUERN" bench --prompts 1 --input-len 8 --output-len 1 --peak-seconds 0 --matmul bf16 \
        >/dev/null 2>&1; then
        QUERN_MODES="exact q16 bf16 q8"
    fi
fi
QMODES=$QUERN_MODES
QKVS=${QUERN_KV_DTYPES:-f16}
QN1=${QUERN_SEQS1_N:-16}
QPEAK=${QUERN_PEAK_SECONDS:-1}
QAVX2=${QUERN_AVX2:-1}
QAVXVNNI=${QUERN_AVXVNNI:-1}
QEXACT_ISAS=${QUERN_EXACT_ISAS:-}
LPAR=${LLAMA_PARALLEL:-32 64}
LBATCH=${LLAMA_BATCH:-512}
LEXTRA=${LLAMA_EXTRA:-}
PY=${PYTHON:-python3}

mkdir -p "$RES" || exit 1
echo "workload: $N requests x $L prompt tokens x $M output tokens, $T threads, seed $SEED" >&2
echo "results:  $RES" >&2

RUNS=()
# run NAME CMD...: stdout -> NAME.json, stderr -> NAME.log
run() {
    local name=$1
    shift
    echo "== $name: $*" >&2
    local t0=$SECONDS
    if "$@" >"$RES/$name.json" 2>"$RES/$name.log"; then
        echo "   done in $((SECONDS - t0)) s" >&2
    else
        echo "   FAILED (exit $?), see $RES/$name.log" >&2
        tail -n 5 "$RES/$name.log" >&2
    fi
    RUNS+=("$name")
}

common_q=(bench --input-len "$L" --output-len "$M" --threads "$T" --seed "$SEED"
          --peak-seconds "$QPEAK")
if "$QUERN" bench --help >/dev/null 2>&1; then
    for kvd in $QKVS; do
        sfx=""
        [ "$kvd" = f16 ] || sfx="_kv$kvd"
        for mode in $QMODES; do
            run "quern_seqs1_$mode$sfx" "$QUERN" "${common_q[@]}" --prompts "$QN1" --max-seqs 1 \
                --max-batch-tokens "$QBATCH" --matmul "$mode" --kv-dtype "$kvd"
            run "quern_seqs${QSEQS}_$mode$sfx" "$QUERN" "${common_q[@]}" --prompts "$N" \
                --max-seqs "$QSEQS" --max-batch-tokens "$QBATCH" --kv-mem "$QKV" \
                --matmul "$mode" --kv-dtype "$kvd"
        done
    done
    for isa in $QEXACT_ISAS; do
        run "quern_seqs1_exact_$isa" "$QUERN" "${common_q[@]}" --prompts "$QN1" --max-seqs 1 \
            --max-batch-tokens "$QBATCH" --matmul exact --isa "$isa"
        run "quern_seqs${QSEQS}_exact_$isa" "$QUERN" "${common_q[@]}" --prompts "$N" \
            --max-seqs "$QSEQS" --max-batch-tokens "$QBATCH" --kv-mem "$QKV" --matmul exact \
            --isa "$isa"
    done
    if [ "$QAVX2" = 1 ]; then
        run "quern_seqs${QSEQS}_q8_avx2" "$QUERN" "${common_q[@]}" --prompts "$N" \
            --max-seqs "$QSEQS" --max-batch-tokens "$QBATCH" --kv-mem "$QKV" --matmul q8 \
            --isa avx2
    fi
    if [ "$QAVXVNNI" = 1 ] && "$QUERN" bench --prompts 1 --input-len 8 --output-len 1 \
        --peak-seconds 0 --isa avxvnni >/dev/null 2>&1; then
        run "quern_seqs${QSEQS}_q8_avxvnni" "$QUERN" "${common_q[@]}" --prompts "$N" \
            --max-seqs "$QSEQS" --max-batch-tokens "$QBATCH" --kv-mem "$QKV" --matmul q8 \
            --isa avxvnni
    fi
else
    echo "warning: '$QUERN bench' is not available (build it first); quern runs skipped" >&2
fi

for p in $LPAR; do
    # shellcheck disable=SC2086 # LEXTRA is a list of flags
    run "llamacpp_par$p" "$PY" tools/bench_llamacpp.py --prompts "$N" --input-len "$L" \
        --output-len "$M" --threads "$T" --seed "$SEED" --parallel "$p" --batch "$LBATCH" $LEXTRA
done

"$PY" - "$RES" "${RUNS[@]}" <<'EOF' | tee "$RES/summary.txt"
import json, os, sys
res, names = sys.argv[1], sys.argv[2:]
rows = []
for n in names:
    try:
        with open(os.path.join(res, n + ".json")) as f:
            rows.append((n, json.load(f)))
    except (OSError, ValueError):
        rows.append((n, None))
ok = [(n, j) for n, j in rows if j]
# each quern run is compared with the --max-seqs 1 run of its matmul mode, kernels and KV type
def key(j):
    return (j.get("matmul"), j.get("isa"), j.get("kv_dtype", "f16"))
base = {key(j): j["output_tok_s"] for n, j in ok if n.startswith("quern_seqs1_")}
llama = [j["output_tok_s"] for n, j in ok if n.startswith("llamacpp")]
best = max(llama) if llama else None
best1 = max(base.values()) if base else None
def ratio(x, d):
    return "%.2fx" % (x / d) if d else "-"
hdr = "%-28s %9s %11s %11s %9s %9s %9s %6s %7s %6s %6s  %s" % (
    "run", "elapsed_s", "out_tok/s", "total_tok/s", "vs_seqs1", "vs_best1", "vs_llama", "int8%",
    "+attn%", "amx8%", "amxbf%", "notes")
print(hdr)
print("-" * len(hdr))
for n, j in rows:
    if not j:
        print("%-26s %9s  (failed, see %s.log)" % (n, "-", n))
        continue
    if "engine" in j:
        note = "par %s, batch %s, fa %s, kv %s" % (j.get("parallel"), j.get("batch"),
                                                  j.get("flash_attn"),
                                                  "unified" if j.get("kv_unified") else "per-seq")
        c = j.get("check")
        if c:
            note += ", check %d/%d tok" % (c["matching_tokens"], c["tokens"])
    else:
        note = "seqs %s, batch %s, %s, isa %s, kv %s" % (
            j.get("max_seqs"), j.get("max_batch_tokens"), j.get("matmul"), j.get("isa"),
            j.get("kv_dtype", "f16"))
    quern = "engine" not in j
    frac = j.get("fraction_of_int8_peak")
    fraca = j.get("fraction_of_int8_peak_with_attention")
    famx = j.get("fraction_of_amx_int8_peak")
    fbf = j.get("fraction_of_amx_bf16_peak")
    print("%-28s %9.2f %11.1f %11.1f %9s %9s %9s %6s %7s %6s %6s  %s" % (
        n, j["elapsed_s"], j["output_tok_s"], j["total_tok_s"],
        ratio(j["output_tok_s"], base.get(key(j))) if quern else "-",
        ratio(j["output_tok_s"], best1) if quern else "-",
        ratio(j["output_tok_s"], best), "%.1f" % (100 * frac) if frac else "-",
        "%.1f" % (100 * fraca) if fraca else "-", "%.1f" % (100 * famx) if famx else "-",
        "%.1f" % (100 * fbf) if fbf else "-", note))
EOF
