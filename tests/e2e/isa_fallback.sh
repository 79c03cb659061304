#!/usr/bin/env bash
# The binary must run on x86-64 CPUs without AVX-512 (or without AVX at all): under qemu-user
# emulating a Haswell (AVX2) and a plain x86-64 CPU, run-time dispatch must pick avx2 / scalar
# and every kernel test must pass (QUERN_EMULATED=1 trims the batch-invariance sweep to short
# rows; the full sweep runs natively in the same suite). Not run in sanitizer builds: qemu-user cannot host the
# ASan runtime (the same test runs in the normal suite of the same CI job).
set -euo pipefail
Q=${QUERN_BIN:-bin/quern}
M=${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
D=$(dirname "$Q")/../tests
# every kernel test binary: tests/test_kernels.c and tests/test_kernels_*.c
K=$(for src in "$(dirname "$0")"/../test_kernels*.c; do echo "$D/$(basename "$src" .c)"; done)
fail() { echo "FAIL: $*" >&2; exit 1; }
if [ -n "${QUERN_SANITIZE:-}" ]; then
    echo "isa_fallback: not run under sanitizers (qemu-user cannot run ASan binaries)"
    exit 0
fi
command -v qemu-x86_64 >/dev/null || fail "qemu-x86_64 missing: run make deps (package qemu-user)"
for T in $K; do [ -x "$T" ] || fail "$T not built"; done
for cpu in Haswell:avx2 qemu64:scalar; do
    model=${cpu%%:*} want=${cpu##*:}
    got=$(qemu-x86_64 -cpu "$model" "$Q" info --model "$M" 2>/dev/null | sed -n 's/^cpu kernels: \([^ ]*\).*/\1/p')
    [ "$got" = "$want" ] || fail "-cpu $model: dispatch picked '$got', want '$want'"
    for T in $K; do
        QUERN_EMULATED=1 qemu-x86_64 -cpu "$model" "$T" >/tmp/isa_$$.log 2>&1 || { grep -v warning /tmp/isa_$$.log | tail -20; rm -f /tmp/isa_$$.log; fail "$(basename "$T") failed under -cpu $model"; }
    done
    rm -f /tmp/isa_$$.log
done
echo "e2e isa_fallback: ok (avx2 and scalar paths pass under emulation)"
