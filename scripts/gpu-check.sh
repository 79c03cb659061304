#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine, in two steps, because that machine (issue 15: one
# H200, minutes at a time, no package registry, at most 64 MiB carried over) cannot build quern:
#
#   scripts/gpu-check.sh prepare   here, on the build machine: builds the CUDA-enabled binary and
#                                  the op tests (make CUDA=1) and gathers them (debug info
#                                  stripped) with the shared libraries they need that a bare CUDA
#                                  image lacks (both compressed), and a 6-layer dummy GGUF in gpu-carry/
#                                  (git-ignored; ~56 MB: what travels must stay under 64 MiB)
#   scripts/gpu-check.sh run       there (device tool: carry ["gpu-carry"]): each step under its
#                                  own timeout, everything into $OUT/gpu-check.txt (default
#                                  ./gpu-check-out), exit 0 only when every step passed:
#     - the GPU (nvidia-smi), libraries the binaries miss (ldd), `quern info`;
#     - test_cuda_dequant, test_cuda_pack; test_backend_ops with the CUDA backend required (QUERN_REQUIRE_CUDA=1):
#       every op against the double-precision reference (exact mode; matmuls also in the bf16
#       and q8 modes, the tensor-core kernels); test_cuda_model: a 6-layer dummy model's logits and greedy
#       tokens against the CPU backend's, and --tp 3 on the one GPU against --tp 1; test_comm:
#       the NCCL communicator (the toolkit's libnccl.so.2, else PyTorch's wheel) bitwise the CPU
#       one's, for as many ranks as there are GPUs (one here: the library, the chunk exchange,
#       the rank-order sum kernel and the all-gather, without peers);
#     - greedy text of --device cuda against --device cpu (both --matmul exact, and both q8 on
#       the GGUF: the devices' defaults differ): the 6-layer dummy GGUF prepare wrote
#       (gpu-carry/models/, real SmolLM2 width and tokenizer) and --dummy smollm2-135m (all 30
#       layers, the tokenizer from that file); --tp 3 on the one GPU (three backends, collectives
#       staged through host memory) against --tp 1; perplexity on the dummy, cuda within 0.5 %
#       of cpu (issue 19);
#     - the machine's HBM copy bandwidth and cuBLAS bf16 GEMM rate (PyTorch, which the GPU image
#       has); each matmul kernel timed alone (tools/bench_matmul: the packed tensor-core kernel in
#       16- and 64-token blocks, the GGUF-row kernels, cuBLAS on bf16 copies, the exact mode's
#       GEMV, the q8 mode's int8 tensor-core kernel; llama3-8b's shapes, 1 to 512 tokens); then
#       quern bench on --dummy smollm2-135m (batch 1 and batched, exact and bf16) and llama3-8b
#       (batch 1 exact, batched bf16 and q8), and
#       smollm2's batch sampled, temperature 0.8 / top_p 0.95, drawn on the device, against the
#       same batch greedy: issue 21's >= 95 %, in exact and bf16; the sampled batch with
#       log-probabilities (--logprobs 5) against it), llama3-8b batched with cuBLAS from 256 tokens
#       (QUERN_CUDA_CUBLAS_MIN=256), llama3-8b batch 1 with the weights as GGUF rows
#       (QUERN_CUDA_PACK=0) against the packed layout, batch 1 without CUDA graphs
#       (QUERN_CUDA_GRAPHS=0), and one 4,000-token context with attention split
#       over the KV length and without; the bf16 mode's attention on CUDA cores
#       (QUERN_CUDA_ATTN_MMA=0) against the tensor cores, batched and at 4,000 positions, and
#       the tensor cores' K/V read directly (QUERN_CUDA_ATTN_STAGE=0) against their cp.async
#       stages at 4,000 positions: the numbers the issues' goals are stated against.
#
#   scripts/gpu-check.sh rehearse  here, before a GPU session: `run` as it is, on the CUDA
#                                  emulator's build (make CUDA=emu: --device cuda runs the CUDA
#                                  backend's kernels on the CPU) and a dummy GGUF of its own, every
#                                  job shrunk (2 requests of 16 + 2 tokens, llama3-8b's jobs on
#                                  smollm2-135m, 4 tokens of text, --quick matmul timings); the
#                                  steps that need a GPU or PyTorch (nvidia-smi, the HBM and cuBLAS
#                                  rates) and the unit tests tests/e2e/cuda_emu.sh already runs on
#                                  the emulator are skipped. It checks the script itself: every
#                                  command line, flag, file and JSON field it uses, and that each
#                                  comparison holds; a GPU session then spends no minutes on a
#                                  typo. Numbers mean nothing there.
#
# Steps run most important first, so a run stopped at the device tool's limit (give it ~480 s of
# the 15 minutes, leaving room for a rerun) still returns the op test. The results go into
# docs/gpu/ with the date and this command.
set -uo pipefail
cd "$(dirname "$0")/.."
C=gpu-carry

prepare() {
    set -e
    make -j"$(nproc)" CUDA=1 all build/tests/test_backend_ops build/tests/test_cuda_dequant \
        build/tests/test_cuda_pack build/tests/test_cuda_model build/tests/test_comm \
        build/tools/dummy_gguf build/tools/bench_matmul
    rm -rf "$C"
    mkdir -p "$C/bin" "$C/lib" "$C/models"
    cp build/bin/quern build/tests/test_backend_ops build/tests/test_cuda_dequant \
        build/tests/test_cuda_pack build/tests/test_cuda_model build/tests/test_comm \
        build/tools/bench_matmul "$C/bin/"
    # Libraries outside glibc, libgcc and libstdc++ (which any CUDA image has).
    for b in "$C"/bin/*; do ldd "$b"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
        grep -v -E '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so' |
        while read -r lib; do cp -L "$lib" "$C/lib/"; done
    build/tools/dummy_gguf smollm2-135m 6 1 "$C/models/smollm2-6l-dummy.gguf"
    # what travels is limited to 64 MiB: no debug info, libraries compressed (ICU is half)
    strip --strip-debug "$C"/bin/*
    tar czf "$C/carry.tar.gz" -C "$C" lib bin
    rm -rf "$C/lib" "$C/bin"
    du -sh "$C"/*
    local total tree
    total=$(du -sb "$C" | cut -f1)
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    echo "gpu-carry: $total bytes, the tracked tree $tree (together at most 67108864)"
    [ $((total + tree)) -lt 66800000 ] || { echo "gpu-carry is too big to travel" >&2; exit 1; }
}

# A rehearsal's version of a command line (see `rehearse`): the same flags, small sizes.
shrink() {
    sed -E -e 's/--prompts [0-9]+/--prompts 2/g' -e 's/--input-len [0-9]+/--input-len 16/g' \
        -e 's/--output-len [0-9]+/--output-len 2/g' -e 's/--max-tokens [0-9]+/--max-tokens 4/g' \
        -e 's/--kv-mem [0-9]+G/--kv-mem 64M/g' -e 's/--threads [0-9]+/--threads 2/g' \
        -e 's/--ctx [0-9]+/--ctx 32/g' -e 's/--type q4_0/--type q4_0 --quick/g' \
        -e 's/llama3-8b/smollm2-135m/g' <<<"$1"
}

step() { # name, timeout seconds, command...
    local name=$1 secs=$2
    shift 2
    if [ -n "${REHEARSE:-}" ]; then
        case " $REHEARSE_SKIP " in
        *" $name "*)
            echo "=== $name: skipped (rehearsal)"
            return
            ;;
        esac
        local args=() arg
        for arg in "$@"; do args+=("$(shrink "$arg")"); done
        set -- "${args[@]}"
        secs=$((secs * 4)) # the emulator is slow
    fi
    echo "=== $name ($(date -u +%H:%M:%S))"
    timeout "$secs" "$@"
    local rc=$?
    echo "=== $name: exit $rc"
    [ $rc -eq 0 ] || failed="$failed $name"
}

same() { # name, two files that must be non-empty and equal
    step "$1" 10 bash -c "[ -s '$2' ] && [ -s '$3' ] && cmp '$2' '$3' && cat '$2'"
}

run() {
    local out=${OUT:-gpu-check-out}
    mkdir -p "$out"
    local libs B
    if [ -n "${REHEARSE:-}" ]; then
        B=$REHEARSE_BIN
    else
        libs=$(mktemp -d)
        tar xzf "$C/carry.tar.gz" -C "$libs" || exit 1
        export LD_LIBRARY_PATH="$libs/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        B=$libs/bin # the binaries, unpacked
    fi
    # cuBLAS is loaded at run time (dlopen libcublas.so.13): the toolkit's, else PyTorch's wheel
    local blas
    blas=$( (ls /usr/local/cuda/lib64/libcublas.so.13 2>/dev/null ||
        python3 -c 'import glob, os, torch; print("\n".join(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcublas.so.13"))))' 2>/dev/null) |
        head -1)
    [ -n "$blas" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$blas")"
    # NCCL likewise (dlopen libnccl.so.2, or QUERN_NCCL_LIB): the toolkit's, else PyTorch's wheel
    local nccl
    nccl=$( (ls /usr/local/cuda/lib64/libnccl.so.2 2>/dev/null ||
        python3 -c 'import glob, os, torch; print("\n".join(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libnccl.so.2"))))' 2>/dev/null) |
        head -1)
    [ -n "$nccl" ] && export QUERN_NCCL_LIB=$nccl
    failed=""
    {
        echo "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
        step nvidia-smi 20 nvidia-smi
        step ldd 30 bash -c "! ldd $B/* | grep 'not found'"
        echo "libcublas.so.13 (dlopen'ed for QUERN_CUDA_CUBLAS_MIN): ${blas:-not found}"
        echo "libnccl.so.2 (dlopen'ed for tensor parallelism over GPUs): ${nccl:-not found}"
        step info 30 "$B/quern" info
        # a binary that cannot use the GPU (a driver older than CUDA 13's, R580: error 35,
        # "insufficient driver") would fail every step below: stop here, the minutes kept
        if "$B/quern" info 2>&1 | grep -q "^cuda: .*no usable device"; then
            echo "=== STOP: $("$B/quern" info 2>&1 | grep '^cuda:'); the driver is in nvidia-smi's" \
                "output above (CUDA 13 needs R580 or newer: carry the cuda-compat libcuda, or build" \
                "with the toolkit that driver supports). No GPU step was run."
            echo "failed steps:$failed cuda-unusable"
            exit 0
        fi
        step dequant 60 "$B/test_cuda_dequant"
        step pack 60 "$B/test_cuda_pack"
        step backend-ops 180 env QUERN_REQUIRE_CUDA=1 "$B/test_backend_ops"
        step cuda-model 120 env QUERN_REQUIRE_CUDA=1 "$B/test_cuda_model"
        step comm 60 env QUERN_REQUIRE_NCCL=1 "$B/test_comm"
        local m=$C/models/smollm2-6l-dummy.gguf
        for spec in "file:--model $m" "dummy:--model $m --dummy smollm2-135m"; do
            local tag=${spec%%:*} flags=${spec#*:}
            # --matmul exact on both: the devices' defaults differ (CPU q8, or bf16 with AMX)
            for d in cpu cuda; do
                step "generate-$tag-$d" 60 bash -c "'$B/quern' generate $flags --device $d \
                    --threads 16 --matmul exact --chat 'Name three planets.' --temperature 0 \
                    --max-tokens 48 >'$out/gen-$tag-$d.txt'"
            done
            same "same-text-$tag" "$out/gen-$tag-cpu.txt" "$out/gen-$tag-cuda.txt"
        done
        # the q8 mode: the same 8-bit inputs on both (bitwise), int8 tensor cores on the GPU
        for d in cpu cuda; do
            step "generate-q8-$d" 60 bash -c "'$B/quern' generate --model $m --device $d \
                --threads 16 --matmul q8 --chat 'Name three planets.' --temperature 0 \
                --max-tokens 48 >'$out/gen-q8-$d.txt'"
        done
        same same-text-q8 "$out/gen-q8-cpu.txt" "$out/gen-q8-cuda.txt"
        step generate-dummy-cuda-tp3 90 bash -c "'$B/quern' generate --model $m \
            --dummy smollm2-135m --device cuda --tp 3 --chat 'Name three planets.' \
            --temperature 0 --max-tokens 48 >'$out/gen-dummy-cuda-tp3.txt'"
        same same-text-tp3 "$out/gen-dummy-cuda.txt" "$out/gen-dummy-cuda-tp3.txt"
        for d in cpu cuda; do
            step "perplexity-$d" 60 bash -c "'$B/quern' perplexity --model $m --dummy \
                smollm2-135m --file tests/fixtures/perplexity_text.txt --ctx 128 --device $d \
                --matmul exact --threads 16 --json >'$out/ppl-$d.json' && cat '$out/ppl-$d.json'"
        done
        step perplexity-cuda-vs-cpu 10 python3 - "$out/ppl-cpu.json" "$out/ppl-cuda.json" <<'PY'
import json, sys
c, g = (json.load(open(p)) for p in sys.argv[1:3])
rel = abs(g["perplexity"] / c["perplexity"] - 1)
print("perplexity cpu %.6f cuda %.6f: relative %.2e (goal < 5e-3)" % (c["perplexity"], g["perplexity"], rel))
assert rel < 5e-3
PY
        step hbm-and-gemm 60 python3 - <<'PY'
import torch, time
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): y.copy_(x)
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
print(f"HBM copy: {2 * x.numel() / dt / 1e12:.2f} TB/s (bytes read + written)")
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): a @ b
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
print(f"cuBLAS bf16 GEMM 8192^3: {2 * 8192 ** 3 / dt / 1e12:.0f} TFLOP/s")
PY
        # each matmul kernel alone: the 16-token blocks' weight GB/s at 1-8 tokens against the
        # HBM copy rate above (goal 70 %), the 64-token blocks' TFLOPS at 256 against cuBLAS
        # (goal 50 %), where 64-token blocks overtake 16-token ones (QUERN_CUDA_MMA_SMALL), and
        # the packed layout against the GGUF rows
        step bench-matmul 150 bash -c "'$B/bench_matmul' --type q4_0 >'$out/bench-matmul.tsv' \
            && cat '$out/bench-matmul.tsv'"
        for spec in "smollm2-b1:smollm2-135m:--max-seqs 1 --prompts 4 --input-len 128 --output-len 64" \
            "smollm2-batch:smollm2-135m:--prompts 256 --input-len 128 --output-len 64" \
            "smollm2-batch-sampled:smollm2-135m:--prompts 256 --input-len 128 --output-len 64 --temperature 0.8 --top-p 0.95" \
            "smollm2-batch-bf16:smollm2-135m:--prompts 256 --input-len 128 --output-len 64 --matmul bf16" \
            "smollm2-batch-bf16-sampled:smollm2-135m:--prompts 256 --input-len 128 --output-len 64 --matmul bf16 --temperature 0.8 --top-p 0.95" \
            "smollm2-batch-logprobs:smollm2-135m:--prompts 256 --input-len 128 --output-len 64 --temperature 0.8 --top-p 0.95 --logprobs 5" \
            "llama3-8b-b1:llama3-8b:--max-seqs 1 --prompts 2 --input-len 128 --output-len 32" \
            "llama3-8b-batch-bf16:llama3-8b:--prompts 64 --input-len 128 --output-len 32 --kv-mem 20G --matmul bf16" \
            "llama3-8b-batch-q8:llama3-8b:--prompts 64 --input-len 128 --output-len 32 --kv-mem 20G --matmul q8"; do
            IFS=: read -r tag preset flags <<<"$spec"
            step "bench-$tag" 90 bash -c "'$B/quern' bench --model $m --dummy $preset \
                --device cuda --peak-seconds 0 $flags >'$out/bench-$tag.json' && \
                cat '$out/bench-$tag.json'"
        done
        # the batched bench with matmuls of 256 tokens or more on cuBLAS (bf16 copies per call)
        step bench-llama3-8b-batch-bf16-cublas 90 bash -c "QUERN_CUDA_CUBLAS_MIN=256 \
            '$B/quern' bench --model $m --dummy llama3-8b --device cuda --peak-seconds 0 \
            --prompts 64 --input-len 128 --output-len 32 --kv-mem 20G --matmul bf16 \
            >'$out/bench-llama3-8b-batch-bf16-cublas.json' && \
            cat '$out/bench-llama3-8b-batch-bf16-cublas.json'"
        # batch 1 without CUDA graphs (QUERN_CUDA_GRAPHS=0): the launches' cost they save
        for spec in "smollm2-b1:smollm2-135m:--prompts 4 --input-len 128 --output-len 64" \
            "llama3-8b-b1:llama3-8b:--prompts 2 --input-len 128 --output-len 32"; do
            IFS=: read -r tag preset flags <<<"$spec"
            step "bench-$tag-nographs" 90 bash -c "QUERN_CUDA_GRAPHS=0 '$B/quern' bench \
                --model $m --dummy $preset --device cuda --peak-seconds 0 --max-seqs 1 $flags \
                >'$out/bench-$tag-nographs.json' && cat '$out/bench-$tag-nographs.json'"
        done
        # quern plan --device cuda against the device memory the llama3-8b batch-1 bench held
        # (the difference: the CUDA runtime's own context and the allocator's rounding, which
        # the plan's 5 % reserve stands for)
        step plan-vs-device 60 bash -c "'$B/quern' plan --model $m --dummy llama3-8b \
            --device cuda --max-seqs 1 --json >'$out/plan-llama3-8b.json' && python3 -c '
import json, sys
p = json.load(open(sys.argv[1])); u = json.load(open(sys.argv[2]))[\"device_mem_used_bytes\"]
c = p[\"rank_weights_bytes\"] + p[\"rank_activation_bytes\"] + p[\"rank_scratch_bytes\"] + p[\"kv_mem\"]
print(f\"plan {c} bytes, device in use {u}, runtime and rounding {u - c} ({(u - c) / 2**20:.0f} MiB)\")
' '$out/plan-llama3-8b.json' '$out/bench-llama3-8b-b1.json'"
        # batch 1 with the weights as GGUF rows (QUERN_CUDA_PACK=0): the packed layout's gain
        step bench-llama3-8b-b1-gguf 90 bash -c "QUERN_CUDA_PACK=0 '$B/quern' bench --model $m \
            --dummy llama3-8b --device cuda --peak-seconds 0 --max-seqs 1 --prompts 2 \
            --input-len 128 --output-len 32 >'$out/bench-llama3-8b-b1-gguf.json' && \
            cat '$out/bench-llama3-8b-b1-gguf.json'"
        # one sequence with a 4,000-token context: attention split over the KV length
        # (flash-decoding, the default) against one warp per head over all of it
        for split in 512 0; do
            step "bench-llama3-8b-long-split$split" 120 bash -c "QUERN_CUDA_ATTN_SPLIT=$split \
                '$B/quern' bench --model $m --dummy llama3-8b --device cuda --peak-seconds 0 \
                --max-seqs 1 --prompts 1 --input-len 4000 --output-len 32 --matmul bf16 \
                >'$out/bench-long-split$split.json' && cat '$out/bench-long-split$split.json'"
        done
        # the bf16 mode's attention on CUDA cores (QUERN_CUDA_ATTN_MMA=0) against the tensor
        # cores (the default): batched llama3-8b, and the 4,000-token context
        step bench-llama3-8b-batch-bf16-attnf32 90 bash -c "QUERN_CUDA_ATTN_MMA=0 '$B/quern' \
            bench --model $m --dummy llama3-8b --device cuda --peak-seconds 0 --prompts 64 \
            --input-len 128 --output-len 32 --kv-mem 20G --matmul bf16 \
            >'$out/bench-llama3-8b-batch-bf16-attnf32.json' && \
            cat '$out/bench-llama3-8b-batch-bf16-attnf32.json'"
        step bench-llama3-8b-long-attnf32 120 bash -c "QUERN_CUDA_ATTN_MMA=0 '$B/quern' bench \
            --model $m --dummy llama3-8b --device cuda --peak-seconds 0 --max-seqs 1 --prompts 1 \
            --input-len 4000 --output-len 32 --matmul bf16 >'$out/bench-long-attnf32.json' && \
            cat '$out/bench-long-attnf32.json'"
        # the tensor cores' K/V runs read by each lane directly (QUERN_CUDA_ATTN_STAGE=0)
        # against their cp.async stages (the default), at the 4,000-token context
        step bench-llama3-8b-long-unstaged 120 bash -c "QUERN_CUDA_ATTN_STAGE=0 '$B/quern' bench \
            --model $m --dummy llama3-8b --device cuda --peak-seconds 0 --max-seqs 1 --prompts 1 \
            --input-len 4000 --output-len 32 --matmul bf16 >'$out/bench-long-unstaged.json' && \
            cat '$out/bench-long-unstaged.json'"
        echo "failed steps:${failed:- none}"
    } 2>&1 | tee "$out/gpu-check.txt"
    grep -q "^failed steps: none$" "$out/gpu-check.txt"
}

# `run` on the CUDA emulator's build (EMU: its directory, default build-emu, which make test
# builds; the CPU tests from BUILD, default build), in a temporary directory that holds the
# binaries and the dummy GGUF; OUT as for run.
rehearse() {
    local emu=${EMU:-build-emu} cpu=${BUILD:-build} f
    for f in "$emu/bin/quern" "$emu/tests/test_backend_ops" "$emu/tests/test_cuda_model" \
        "$emu/tests/test_comm" "$emu/tools/bench_matmul" "$cpu/tests/test_cuda_dequant" \
        "$cpu/tests/test_cuda_pack" "$cpu/tools/dummy_gguf"; do
        [ -x "$f" ] || { echo "rehearse: $f is missing (make test-build and make cuda-emu build it)" >&2; exit 1; }
    done
    dir=$(mktemp -d) # (global: the trap reads it after rehearse returns)
    trap 'rm -rf "$dir"' EXIT
    mkdir -p "$dir/bin" "$dir/models"
    for f in "$emu/bin/quern" "$emu/tests/test_backend_ops" "$emu/tests/test_cuda_model" \
        "$emu/tests/test_comm" "$emu/tools/bench_matmul" "$cpu/tests/test_cuda_dequant" \
        "$cpu/tests/test_cuda_pack"; do
        ln -s "$(realpath "$f")" "$dir/bin/"
    done
    "$cpu/tools/dummy_gguf" smollm2-135m 6 1 "$dir/models/smollm2-6l-dummy.gguf" >/dev/null || exit 1
    REHEARSE=1 REHEARSE_BIN=$dir/bin C=$dir \
        REHEARSE_SKIP="nvidia-smi dequant pack backend-ops cuda-model comm hbm-and-gemm" run
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
rehearse) rehearse ;;
*)
    echo "usage: scripts/gpu-check.sh prepare|run|rehearse" >&2
    exit 2
    ;;
esac
