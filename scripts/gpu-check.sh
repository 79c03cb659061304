#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine, in two steps, because that machine (issue 15: one
# H200, minutes at a time, no package registry, at most 64 MiB carried over) cannot build quern:
#
#   scripts/gpu-check.sh prepare   here, on the build machine: builds the CUDA-enabled binary and
#                                  the op tests (make CUDA=1) and gathers them, with the shared
#                                  libraries they need that a bare CUDA image lacks, in gpu-carry/
#                                  (git-ignored; its size is printed: it must stay under 64 MiB)
#   scripts/gpu-check.sh run       there (device tool: carry ["gpu-carry"]): each step under its
#                                  own timeout, everything into $OUT/gpu-check.txt (default
#                                  ./gpu-check-out): the GPU, missing libraries, `quern info`, the
#                                  device dequantization test, the op test with the CUDA backend
#                                  required (QUERN_REQUIRE_CUDA=1), and, when gpu-carry/models/
#                                  holds a GGUF, greedy text from --device cuda against --device
#                                  cpu on it. Exit status: 0 only when every step passed.
#
# The results go into docs/gpu/ with the date and this command.
set -uo pipefail
cd "$(dirname "$0")/.."
C=gpu-carry

prepare() {
    set -e
    make -j"$(nproc)" CUDA=1 all build/tests/test_backend_ops build/tests/test_cuda_dequant
    rm -rf "$C"
    mkdir -p "$C/bin" "$C/lib" "$C/models"
    cp build/bin/quern build/tests/test_backend_ops build/tests/test_cuda_dequant "$C/bin/"
    # Libraries outside glibc, libgcc and libstdc++ (which any CUDA image has).
    for b in "$C"/bin/*; do ldd "$b"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
        grep -v -E '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so' |
        while read -r lib; do cp -L "$lib" "$C/lib/"; done
    for f in ${GPU_CHECK_MODELS:-}; do cp "$f" "$C/models/"; done # GGUF files, space-separated
    du -sh "$C"
    du -sh "$C"/*
}

step() { # name, timeout seconds, command...
    local name=$1 secs=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S))"
    timeout "$secs" "$@"
    local rc=$?
    echo "=== $name: exit $rc"
    [ $rc -eq 0 ] || failed="$failed $name"
}

run() {
    local out=${OUT:-gpu-check-out}
    mkdir -p "$out"
    export LD_LIBRARY_PATH="$PWD/$C/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    failed=""
    {
        echo "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
        step nvidia-smi 30 nvidia-smi
        step ldd 30 bash -c "! ldd $C/bin/* | grep 'not found'"
        step info 60 "$C/bin/quern" info
        step dequant 120 "$C/bin/test_cuda_dequant"
        step backend-ops 300 env QUERN_REQUIRE_CUDA=1 "$C/bin/test_backend_ops"
        for m in "$C"/models/*.gguf; do
            [ -f "$m" ] || continue
            for d in cpu cuda; do
                step "generate-$d-$(basename "$m")" 120 bash -c "'$C/bin/quern' generate --model '$m' \
                    --device $d --chat 'Name three planets.' --temperature 0 --max-tokens 48 \
                    >'$out/gen-$d.txt'"
            done
            step "same-text-$(basename "$m")" 10 cmp "$out/gen-cpu.txt" "$out/gen-cuda.txt"
        done
        echo "failed steps:${failed:- none}"
    } 2>&1 | tee "$out/gpu-check.txt"
    ! grep -q "^failed steps: [^n]" "$out/gpu-check.txt"
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
*)
    echo "usage: scripts/gpu-check.sh prepare|run" >&2
    exit 2
    ;;
esac
