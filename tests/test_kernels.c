/* Unit tests for kernels/cpu: half/bf16 conversion, dispatch (ISA detection, AMX), the block
 * layouts (hand-built blocks and a fixture cross-checked against the gguf Python package),
 * activation quantization and every ISA's dequantization against the scalar reference. The dot
 * products, GEMMs, packed/AMX/bf16 modes and attention are in test_kernels_*.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/test_kernels_util.h"
#include "tests/test_rand.h"
#include "tests/test_util.h"

/* ---- half and bfloat16 ------------------------------------------------------------------ */

static void test_f16_known_values(void **state)
{
    (void)state;
    static const struct {
        float f;
        uint16_t h;
    } cases[] = {
        {1.0f, 0x3C00},        {-2.0f, 0xC000},      {0.5f, 0x3800},
        {65504.0f, 0x7BFF},    {65519.99f, 0x7BFF},  {65520.0f, 0x7C00}, /* rounds to inf */
        {0x1p-14f, 0x0400},    {0x1p-24f, 0x0001},   {0x1p-25f, 0x0000}, /* tie -> even 0 */
        {0x1.8p-25f, 0x0001},  {0x1.8p-24f, 0x0002}, /* 1.5 ulp: tie -> even 2 */
        {0x1.002p0f, 0x3C00},                        /* 1 + 2^-11: tie -> even */
        {0x1.006p0f, 0x3C02},                        /* 1 + 3*2^-11: tie -> even (up) */
        {0x1.0021p0f, 0x3C01},                       /* just above the tie */
        {0.1f, 0x2E66},        {-0.0f, 0x8000},      {INFINITY, 0x7C00},
        {-INFINITY, 0xFC00},   {1e10f, 0x7C00},      {1e-10f, 0x0000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t h = kern_f32_to_f16(cases[i].f);
        if (h != cases[i].h)
            fail_msg("f32_to_f16(%a) = 0x%04x, want 0x%04x", (double)cases[i].f, h, cases[i].h);
    }
    assert_true(kern_f16_to_f32(0x3C00) == 1.0f);
    assert_true(kern_f16_to_f32(0xC000) == -2.0f);
    assert_true(kern_f16_to_f32(0x7BFF) == 65504.0f);
    assert_true(kern_f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(kern_f16_to_f32(0x03FF) == 0x3FFp-24f);
    assert_true(kern_f16_to_f32(0x7C00) == INFINITY);
    assert_int_equal(f32_bits(kern_f16_to_f32(0x8000)), 0x80000000u);
    assert_true(isnan(kern_f16_to_f32(0x7E00)));
    assert_true(isnan(kern_f16_to_f32(0xFC01)));
    uint16_t hn = kern_f32_to_f16(NAN);
    assert_true((hn & 0x7C00) == 0x7C00 && (hn & 0x3FF) != 0);
}

static void test_f16_roundtrip_all(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kern_f16_to_f32((uint16_t)h);
        uint16_t back = kern_f32_to_f16(f);
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) { /* NaN stays NaN, sign kept */
            if (!isnan(f) || !isnan(kern_f16_to_f32(back)) || (back & 0x8000) != (h & 0x8000))
                fail_msg("NaN 0x%04x -> %a -> 0x%04x", h, (double)f, back);
            continue;
        }
        if (back != h)
            fail_msg("0x%04x -> %a -> 0x%04x", h, (double)f, back);
#ifdef __FLT16_MAX__
        _Float16 oracle; /* the compiler's own conversion */
        memcpy(&oracle, &h, sizeof oracle);
        if (f32_bits((float)oracle) != f32_bits(f))
            fail_msg("f16_to_f32(0x%04x) = %a, compiler says %a", h, (double)f, (double)oracle);
#endif
    }
}

#ifdef __FLT16_MAX__
/* Rounding of arbitrary floats against the compiler's float -> _Float16 conversion. */
static void test_f16_rounding_vs_compiler(void **state)
{
    (void)state;
    struct rng r = {42};
    for (int i = 0; i < 2000000; i++) {
        uint32_t bits;
        if (i < 1000000) /* random bit patterns: mostly out of half range */
            bits = (uint32_t)rng_u64(&r);
        else /* exponents around the half range, including subnormal halves */
            bits = (uint32_t)(rng_u64(&r) & 0x807FFFFFu) | (uint32_t)(96 + i % 50) << 23;
        float f = f32_from_bits(bits);
        if (isnan(f))
            continue;
        _Float16 oracle = (_Float16)f;
        uint16_t want;
        memcpy(&want, &oracle, sizeof want);
        uint16_t got = kern_f32_to_f16(f);
        if (got != want)
            fail_msg("f32_to_f16(%a) = 0x%04x, compiler says 0x%04x", (double)f, got, want);
    }
}
#endif

/* Value of a bf16 pattern, with the one-past-max pattern 0x7F80 taken as 2^128 so the
 * round-to-nearest oracle below can measure distances to it. */
static double bf16_value(uint32_t hi16)
{
    if ((hi16 & 0x7FFF) == 0x7F80)
        return (hi16 & 0x8000) ? -0x1p128 : 0x1p128;
    return (double)f32_from_bits(hi16 << 16);
}

static void test_bf16(void **state)
{
    (void)state;
    assert_int_equal(kern_f32_to_bf16(1.0f), 0x3F80);
    assert_int_equal(kern_f32_to_bf16(-3.0f), 0xC040);
    assert_int_equal(kern_f32_to_bf16(0x1.01p0f), 0x3F80); /* tie -> even (down) */
    assert_int_equal(kern_f32_to_bf16(0x1.03p0f), 0x3F82); /* tie -> even (up) */
    assert_int_equal(kern_f32_to_bf16(FLT_MAX), 0x7F80);   /* rounds to inf */
    assert_int_equal(kern_f32_to_bf16(INFINITY), 0x7F80);
    assert_true(kern_bf16_to_f32(0x3F80) == 1.0f);
    assert_true(kern_bf16_to_f32(0xC040) == -3.0f);
    assert_true(isnan(kern_bf16_to_f32(kern_f32_to_bf16(f32_from_bits(0x7F800001u)))));

    for (uint32_t h = 0; h < 65536; h++) {
        float f = kern_bf16_to_f32((uint16_t)h);
        uint16_t back = kern_f32_to_bf16(f);
        if ((h & 0x7F80) == 0x7F80 && (h & 0x7F)) {
            if (!isnan(f) || !isnan(kern_bf16_to_f32(back)) || (back & 0x8000) != (h & 0x8000))
                fail_msg("bf16 NaN 0x%04x -> 0x%04x", h, back);
            continue;
        }
        if (back != h)
            fail_msg("bf16 0x%04x -> %a -> 0x%04x", h, (double)f, back);
    }

    /* nearest-even against distances measured in double */
    struct rng r = {7};
    for (int i = 0; i < 1000000; i++) {
        uint32_t bits = (uint32_t)rng_u64(&r);
        if (i % 4 == 0)
            bits = (bits & 0xFFFF0000u) | 0x8000u; /* exact ties */
        float f = f32_from_bits(bits);
        if (isnan(f))
            continue;
        uint32_t lo = bits >> 16, up = lo + 1; /* truncation and the next pattern outward */
        double dlo = fabs((double)f - bf16_value(lo)), dup = fabs(bf16_value(up) - (double)f);
        uint32_t want = dlo < dup ? lo : dup < dlo ? up : (lo & 1) ? up : lo;
        if ((bits & 0x7FFFFFFFu) == 0x7F800000u)
            want = lo; /* inf stays inf */
        uint16_t got = kern_f32_to_bf16(f);
        if (got != want)
            fail_msg("f32_to_bf16(%a) = 0x%04x, want 0x%04x", (double)f, got, want);
    }
}

/* ---- dispatch --------------------------------------------------------------------------- */

static void test_dispatch(void **state)
{
    (void)state;
    /* cpuid as the compiler's runtime sees it (it checks OS register state too) */
    enum kern_isa want = KERN_ISA_SCALAR;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        want = __builtin_cpu_supports("avxvnni") ? KERN_ISA_AVXVNNI : KERN_ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vnni")) {
            want = KERN_ISA_AVX512;
            /* AMX also needs the OS to enable tile state (the compiler's check covers XCR0)
             * and to grant it to the process, which Linux does on request */
            if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0)
                want = KERN_ISA_AMX;
        }
    }
    assert_int_equal(kern_cpu_detect(), want);
    print_message("CPU kernels: detected %s\n", kern_isa_name(kern_cpu_detect()));

    /* every table up to the best, except AVX-VNNI, which AVX-512 VNNI does not imply */
    const int vnni = want >= KERN_ISA_AVX2 && __builtin_cpu_supports("avxvnni");
    int sup[KERN_ISA_COUNT];
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++)
        sup[isa] = isa == KERN_ISA_AVXVNNI ? vnni : isa <= (int)want;
    static const char *const names[] = {"scalar", "avx2", "avx-vnni", "avx512-vnni", "amx"};
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!sup[isa]) {
            assert_null(f);
            continue;
        }
        assert_non_null(f);
        assert_int_equal(f->isa, isa);
        assert_string_equal(f->name, names[isa]);
        assert_non_null(f->quantize_q8);
        assert_int_equal(f->prep_x3 != NULL, isa == KERN_ISA_AMX);
        assert_int_equal(f->prep_bf16 != NULL, isa == KERN_ISA_AMX);
        for (uint32_t t = 0; t < DTYPE_COUNT; t++) {
            int is_quant = 0, is_float = 0;
            for (size_t k = 0; k < N_QUANT_TYPES; k++)
                is_quant |= quant_types[k] == t;
            for (size_t k = 0; k < N_FLOAT_TYPES; k++)
                is_float |= float_types[k] == t;
            assert_int_equal(f->vec_dot_q8[t] != NULL, is_quant);
            assert_int_equal(f->vec_dot_f32[t] != NULL, is_float);
            assert_int_equal(f->dequant_row[t] != NULL, is_quant || is_float);
            assert_int_equal(f->matvec_f32[t] != NULL, is_quant || is_float);
        }
    }
    assert_null(kern_cpu_fns_get(KERN_ISA_COUNT));
    assert_null(kern_cpu_fns_get((enum kern_isa) - 1));

    /* QUERN_ISA picks a supported ISA, and falls back to the best otherwise */
    const struct kern_cpu_fns *best = isa_fns(want);
    assert_int_equal(unsetenv("QUERN_ISA"), 0);
    assert_ptr_equal(kern_cpu_fns_best(), best);
    static const char *const env[] = {"scalar", "avx2", "avxvnni", "avx512", "amx"};
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        assert_int_equal(setenv("QUERN_ISA", env[isa], 1), 0);
        assert_ptr_equal(kern_cpu_fns_best(), sup[isa] ? isa_fns(isa) : best);
    }
    assert_int_equal(setenv("QUERN_ISA", "sse9", 1), 0);
    assert_ptr_equal(kern_cpu_fns_best(), best);
    assert_int_equal(unsetenv("QUERN_ISA"), 0);
}

/* The AMX peak loops run exactly where the CPU has AMX-INT8 / AMX-BF16 (and the OS grants tile
 * state, as Linux does on request), and report 0 elsewhere. */
static void test_amx_detect(void **state)
{
    (void)state;
    int cpu = kern_cpu_detect() >= KERN_ISA_AVX512 && __builtin_cpu_supports("amx-tile") &&
              __builtin_cpu_supports("amx-int8");
    print_message("AMX-INT8: %s\n", kern_cpu_has_amx() ? "present" : "absent");
    if (!cpu)
        assert_int_equal(kern_cpu_has_amx(), 0);
    if (kern_cpu_has_amx())
        assert_true(cpu && kern_cpu_amx_int8_peak(0.01) > 0.0);
    else
        assert_true(kern_cpu_amx_int8_peak(0.01) == 0.0);
    /* the bf16 tile loop exactly where the AMX table (AMX-BF16 + AVX512-BF16) is */
    if (kern_cpu_detect() == KERN_ISA_AMX)
        assert_true(__builtin_cpu_supports("amx-bf16") && kern_cpu_amx_bf16_peak(0.01) > 0.0);
    else
        assert_true(kern_cpu_amx_bf16_peak(0.01) == 0.0);
}

/* ---- block layouts: hand-built blocks -------------------------------------------------- */

/* Dequantize the block with every ISA's dequant_row and compare with want exactly; then dot it
 * with activations of d = 1 and small integer q (all sums exact in float) and compare each ISA's
 * vec_dot_q8 with the exact value. */
static void check_known(uint32_t type, const void *blk, const float *want, int n)
{
    float got[KERN_QK_K];
    struct kern_q8 x[KERN_QK_K / KERN_QK];
    double exact = 0.0;
    for (int b = 0; b < n / KERN_QK; b++) {
        int sum = 0;
        for (int j = 0; j < KERN_QK; j++) {
            x[b].q[j] = (int8_t)((b * 7 + j * 3) % 5 - 2);
            sum += x[b].q[j];
        }
        x[b].d = 1.0f;
        x[b].s = (float)sum;
    }
    for (int i = 0; i < n; i++)
        exact += (double)want[i] * x[i / KERN_QK].q[i % KERN_QK];

    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!f)
            continue;
        f->dequant_row[type](blk, got, n);
        for (int i = 0; i < n; i++)
            if (f32_bits(got[i]) != f32_bits(want[i]))
                fail_msg("%s %s element %d = %a, want %a", f->name, dtype_get(type)->name, i,
                         (double)got[i], (double)want[i]);
        float dot = f->vec_dot_q8[type](blk, x, n);
        if ((double)dot != exact)
            fail_msg("%s %s dot = %.9g, want %.9g", f->name, dtype_get(type)->name, (double)dot,
                     exact);
    }
}

static void test_known_q4_0(void **state)
{
    (void)state;
    struct kern_block_q4_0 blk;
    put_f16_bits((uint8_t *)&blk.d, 0x3800); /* 0.5 */
    for (int i = 0; i < 16; i++)
        blk.qs[i] = (uint8_t)(i | (15 - i) << 4);
    static const float want[32] = {
        -4.0f, -3.5f, -3.0f, -2.5f, -2.0f, -1.5f, -1.0f, -0.5f,
        0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  2.5f,  3.0f,  3.5f, /* low nibbles 0..15 */
        3.5f,  3.0f,  2.5f,  2.0f,  1.5f,  1.0f,  0.5f,  0.0f,
        -0.5f, -1.0f, -1.5f, -2.0f, -2.5f, -3.0f, -3.5f, -4.0f, /* high nibbles 15..0 */
    };
    check_known(DTYPE_Q4_0, &blk, want, 32);
}

static void test_known_q4_1(void **state)
{
    (void)state;
    struct kern_block_q4_1 blk;
    put_f16_bits((uint8_t *)&blk.d, 0x3400); /* 0.25 */
    put_f16_bits((uint8_t *)&blk.m, 0xBC00); /* -1 */
    for (int i = 0; i < 16; i++)
        blk.qs[i] = (uint8_t)(i | ((i + 3) & 15) << 4);
    static const float want[32] = {
        -1.0f,  -0.75f, -0.5f, -0.25f, 0.0f,  0.25f, 0.5f,   0.75f,
        1.0f,   1.25f,  1.5f,  1.75f,  2.0f,  2.25f, 2.5f,   2.75f, /* nibbles 0..15 */
        -0.25f, 0.0f,   0.25f, 0.5f,   0.75f, 1.0f,  1.25f,  1.5f,
        1.75f,  2.0f,   2.25f, 2.5f,   2.75f, -1.0f, -0.75f, -0.5f, /* nibbles 3..15, 0..2 */
    };
    check_known(DTYPE_Q4_1, &blk, want, 32);
}

static void test_known_q5_0(void **state)
{
    (void)state;
    struct kern_block_q5_0 blk;
    put_f16_bits((uint8_t *)&blk.d, 0x3C00); /* 1 */
    for (int i = 0; i < 16; i++)
        blk.qs[i] = (uint8_t)(i | (15 - i) << 4);
    /* qh = 0xCC33F00F little-endian: elements 0-3 and 12-15, 16-17, 20-21, 26-27, 30-31 get
     * the fifth bit */
    blk.qh[0] = 0x0F;
    blk.qh[1] = 0xF0;
    blk.qh[2] = 0x33;
    blk.qh[3] = 0xCC;
    static const float want[32] = {
        0,  1,  2,  3,  -12, -11, -10, -9, -8, -7,  -6, -5, 12,  13,  14, 15,
        15, 14, -3, -4, 11,  10,  -7,  -8, -9, -10, 5,  4,  -13, -14, 1,  0,
    };
    check_known(DTYPE_Q5_0, &blk, want, 32);
}

static void test_known_q8_0(void **state)
{
    (void)state;
    struct kern_block_q8_0 blk;
    put_f16_bits((uint8_t *)&blk.d, 0x3800); /* 0.5 */
    float want[32];
    for (int i = 0; i < 32; i++) {
        blk.qs[i] = (int8_t)(i * 8 - 128); /* -128, -120, ..., 120 */
        want[i] = (float)(i * 4 - 64);
    }
    assert_true(want[0] == -64.0f && want[31] == 60.0f);
    check_known(DTYPE_Q8_0, &blk, want, 32);
}

static void test_known_q4_k(void **state)
{
    (void)state;
    /* sub-block scales and mins, and their 12-byte packing worked out by hand */
    static const uint8_t sc[8] = {1, 2, 3, 4, 33, 45, 60, 63};
    static const uint8_t mn[8] = {0, 5, 10, 63, 17, 32, 48, 1};
    static const uint8_t packed[12] = {0x81, 0x82, 0xC3, 0xC4, 0x40, 0x85,
                                       0xCA, 0x3F, 0x11, 0x0D, 0x0C, 0x1F};
    struct kern_block_q4_k blk;
    put_f16_bits((uint8_t *)&blk.d, 0x3C00);    /* 1 */
    put_f16_bits((uint8_t *)&blk.dmin, 0x3800); /* 0.5 */
    memcpy(blk.scales, packed, sizeof packed);
    for (int j = 0; j < 8; j++) {
        uint8_t s, m;
        kern_q4_k_scale_min(blk.scales, j, &s, &m);
        assert_int_equal(s, sc[j]);
        assert_int_equal(m, mn[j]);
    }
    /* group g = qs[32g..32g+31]: low nibble l%16 (sub-block 2g), high nibble 15 - l%16 (2g+1) */
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++)
            blk.qs[32 * g + l] = (uint8_t)((l & 15) | (15 - (l & 15)) << 4);
    float want[256];
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 32; l++) {
            int q = j % 2 ? 15 - (l & 15) : (l & 15);
            want[32 * j + l] = 1.0f * sc[j] * q - 0.5f * mn[j];
        }
    assert_true(want[32 * 5 + 3] == 524.0f); /* 45 * 12 - 0.5 * 32 */
    assert_true(want[32 * 3 + 0] == 60.0f - 31.5f);
    check_known(DTYPE_Q4_K, &blk, want, 256);
}

static void test_known_q6_k(void **state)
{
    (void)state;
    /* element e gets the 6-bit value v(e) = (7e + 3) % 64, stored as v - 32 */
    struct kern_block_q6_k blk;
    memset(&blk, 0, sizeof blk);
    put_f16_bits((uint8_t *)&blk.d, 0x3800); /* 0.5 */
    for (int k = 0; k < 16; k++)
        blk.scales[k] = (int8_t)(k % 2 ? -(k + 1) : k + 1); /* 1, -2, 3, -4, ... */
    /* the layout, written out: in half h, for l < 32, elements l, l+32, l+64, l+96 take the
     * low nibble of ql[l], low of ql[l+32], high of ql[l], high of ql[l+32], and bits 0-1, 2-3,
     * 4-5, 6-7 of qh[l] as their top two bits */
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            int v[4];
            for (int k = 0; k < 4; k++)
                v[k] = (7 * (128 * h + 32 * k + l) + 3) % 64;
            blk.ql[64 * h + l] = (uint8_t)((v[0] & 15) | (v[2] & 15) << 4);
            blk.ql[64 * h + l + 32] = (uint8_t)((v[1] & 15) | (v[3] & 15) << 4);
            blk.qh[32 * h + l] =
                (uint8_t)((v[0] >> 4) | (v[1] >> 4) << 2 | (v[2] >> 4) << 4 | (v[3] >> 4) << 6);
        }
    float want[256];
    for (int e = 0; e < 256; e++)
        want[e] = 0.5f * blk.scales[e / 16] * (float)((7 * e + 3) % 64 - 32);
    assert_true(want[0] == 0.5f * 1 * -29);
    assert_true(want[255] == 0.5f * -16 * ((7 * 255 + 3) % 64 - 32));
    check_known(DTYPE_Q6_K, &blk, want, 256);
}

static void test_known_float_types(void **state)
{
    (void)state;
    static const uint16_t h[4] = {0x3C00, 0xC000, 0x7BFF, 0x0001};
    static const float hf[4] = {1.0f, -2.0f, 65504.0f, 0x1p-24f};
    static const uint16_t bf[4] = {0x3F80, 0xC040, 0x4049, 0x0000};
    static const float bff[4] = {1.0f, -3.0f, 3.140625f, 0.0f};
    static const float f32[4] = {1.5f, -0.25f, 1e30f, -7.0f};
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!f)
            continue;
        float got[4];
        f->dequant_row[DTYPE_F16](h, got, 4);
        assert_memory_equal(got, hf, sizeof got);
        f->dequant_row[DTYPE_BF16](bf, got, 4);
        assert_memory_equal(got, bff, sizeof got);
        f->dequant_row[DTYPE_F32](f32, got, 4);
        assert_memory_equal(got, f32, sizeof got);
        static const float x[4] = {2.0f, 1.0f, 0.0f, 1.0f};
        assert_true(f->vec_dot_f32[DTYPE_F16](h, x, 4) == 2.0f - 2.0f + 0x1p-24f);
        assert_true(f->vec_dot_f32[DTYPE_BF16](bf, x, 4) == 2.0f - 3.0f);
        assert_true(f->vec_dot_f32[DTYPE_F32](f32, x, 4) == 3.0f - 0.25f - 7.0f);
    }
}

/* ---- block layouts: cross-check with the gguf Python package ----------------------------
 * Random block bytes (fp16 scale fields set to sane values), dequantized by
 * gguf.quants.dequantize (gguf-py, numpy float32); the FNV-1a of the float32 output and its
 * first values are recorded here. Any change must be re-derived from gguf, not from our code:
 *   rng = np.random.default_rng(20240611)
 *   for (type, block_bytes, n_blocks, f16_offsets) in [(Q4_0, 18, 2, [0]), (Q4_1, 20, 2, [0, 2]),
 *           (Q5_0, 22, 2, [0]), (Q8_0, 34, 2, [0]), (Q4_K, 144, 1, [0, 2]), (Q6_K, 210, 1, [208])]:
 *       raw = bytearray(rng.integers(0, 256, size=block_bytes * n_blocks, dtype=np.uint8))
 *       for b in range(n_blocks):
 *           for o in f16_offsets:
 *               v = rng.uniform(0.01, 0.5) * (1 if o == 0 or rng.integers(2) else -1)
 *               raw[b * block_bytes + o : +2] = np.float16(v) bytes
 *       out = gguf.quants.dequantize(np.frombuffer(raw, np.uint8).reshape(n_blocks, -1), type)
 *       record raw.hex(), fnv1a64(out.astype('<f4').tobytes()), out[:4] */
struct gguf_case {
    uint32_t type;   /* weight type */
    int blocks;      /* blocks in hex */
    const char *hex; /* block bytes */
    uint64_t fnv;    /* FNV-1a 64 of gguf's dequantized float32 values (little-endian) */
    float first[4];  /* gguf's first four values, for readable failures */
};

static const struct gguf_case gguf_cases[] = {
    {DTYPE_Q4_0,
     2,
     "2b2c9c794b4e8c30ec1fdf814091f7ff127653369e682f961aede8f7d625c9d54d64743e",
     0xacef1db0ce4025a2ULL,
     {0x1.0acp-2f, 0x1.0acp-4f, 0x1.902p-3f, 0x1.902p-2f}},
    {DTYPE_Q4_1,
     2,
     "78354b36bf07d32726ed1a8578af07073e01afefcf305eb6c018fda4fec18845e4ba1a32dfe93bc1",
     0x3c582a2ef62bad66ULL,
     {0x1.614cp+2f, 0x1.6498p+1f, 0x1.6b3p+0f, 0x1.6498p+1f}},
    {DTYPE_Q5_0,
     2,
     "a82ce36bb10fc4cab362d4d83903eb6431a52b985614643761de2828a8626b0d616b0def63102f945be575a5",
     0x0cbc6bb9175988aaULL,
     {0x1.2ap-2f, 0x1.748p-1f, -0x1.e44p-1f, -0x1.04cp+0f}},
    {DTYPE_Q8_0,
     2,
     "432d9a4b2887e0e53ca3324316b77c58f59207529f10afe227bfba76f0e3444784f2912f43d787b107902674e0"
     "77f90ddf64bad031e46552454fdcba4cc6874bb9d296ff",
     0x209b70149affc179ULL,
     {-0x1.0c59p+3f, 0x1.8aa1p+2f, 0x1.a4fp+1f, -0x1.3e558p+3f}},
    {DTYPE_Q4_K,
     1,
     "2531dea6ee2f5ad9d0fda2772d94f1edee489afdf2d960371f47dd8baaef20dce5411f0f66a7a0689a886e808c"
     "db77935ba5e17dc541d453bd7d6f12406f2a2dfb47c26e5ce726c31b38fa87c6491778ea543d5d93e33bae95a6"
     "c550123de560acd710c77dbd0d692558c9a256ed977cf548ebb00f0d7ccce84b36e05f494742a1dc80ac63cedb"
     "f570b7017c1fa9bf3f",
     0x9d707288a946ab38ULL,
     {0x1.9fdap+6f, 0x1.dcbbp+5f, 0x1.2987p+6f, 0x1.82454p+6f}},
    {DTYPE_Q6_K,
     1,
     "41bbf29f1943c00b200f7006fc6700b3f436a0d175f1afa97d35d8210e4085544a5af1853d99ff77c257408fa1"
     "47b5f2e96b102eb5e228f1b21b93b306403929a6024b8145a9a1c1c43b66e6639c9517c5bbe47a33edc7c70561"
     "6c110fa54f801cfde18ade3274613ed4c04ae17beab9a0b256b9c6753f8e2538489c033b32cc7576d2c392c000"
     "d4f5327c380a63864a7e9d21990db852b7f702a6f504b1d437e68354198cbca08039dbdcff8ef197524a8222b1"
     "12196e70e12de4a82b0e7cc67fa2f720d619216d6be91f6fb31492fbd3b1",
     0x8cd49fd84e9cea52ULL,
     {0x1.5ab918p+8f, -0x1.fc86fp+7f, -0x1.71d68p+5f, -0x1.6647ccp+9f}},
};

static void test_gguf_fixture(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof gguf_cases / sizeof gguf_cases[0]; c++) {
        const struct gguf_case *gc = &gguf_cases[c];
        const struct dtype_info *di = dtype_get(gc->type);
        size_t nbytes = (size_t)gc->blocks * (size_t)di->block_bytes;
        assert_int_equal(strlen(gc->hex), 2 * nbytes);
        uint16_t storage[512]; /* 2-byte aligned, as weight rows are */
        uint8_t *raw = (uint8_t *)storage;
        assert_true(nbytes <= sizeof storage);
        for (size_t i = 0; i < nbytes; i++) {
            unsigned v;
            assert_int_equal(sscanf(gc->hex + 2 * i, "%2x", &v), 1);
            raw[i] = (uint8_t)v;
        }
        int64_t n = (int64_t)gc->blocks * di->block_elems;
        float out[512];
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            memset(out, 0, sizeof out);
            f->dequant_row[gc->type](raw, out, n);
            for (int i = 0; i < 4; i++)
                if (f32_bits(out[i]) != f32_bits(gc->first[i]))
                    fail_msg("%s %s: element %d = %a, gguf says %a", f->name, di->name, i,
                             (double)out[i], (double)gc->first[i]);
            uint64_t h = test_fnv1a64(out, (size_t)n * sizeof(float));
            if (h != gc->fnv)
                fail_msg("%s %s: dequantized values differ from gguf's (hash %016llx)", f->name,
                         di->name, (unsigned long long)h);
        }
    }
}

/* ---- activation quantization ------------------------------------------------------------ */

static void check_q8_invariants(const float *x, const struct kern_q8 *y, int64_t n)
{
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        float amax = 0.0f;
        int sum = 0;
        for (int j = 0; j < KERN_QK; j++) {
            amax = fmaxf(amax, fabsf(x[b * KERN_QK + j]));
            assert_true(y[b].q[j] >= -127 && y[b].q[j] <= 127);
            sum += y[b].q[j];
        }
        assert_true(y[b].d == amax / 127.0f);
        assert_true(y[b].s == y[b].d * (float)sum);
        for (int j = 0; j < KERN_QK; j++) /* within half a step of the input */
            assert_true(fabsf(y[b].d * y[b].q[j] - x[b * KERN_QK + j]) <= 0.5001f * y[b].d);
    }
}

static void test_quantize_q8_known(void **state)
{
    (void)state;
    float x[32] = {127.0f, 0.5f, 1.5f, -2.5f, -0.5f, 2.49f, -126.5f, 0.0f};
    /* amax 127: d = 1, so the ratios are the inputs and halves round away from zero */
    static const int8_t want[8] = {127, 1, 2, -3, -1, 2, -127, 0};
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!f)
            continue;
        struct kern_q8 y;
        f->quantize_q8(x, &y, 32);
        assert_true(y.d == 1.0f);
        assert_memory_equal(y.q, want, sizeof want);
        assert_true(y.s == 127 + 1 + 2 - 3 - 1 + 2 - 127);
        float zeros[32] = {0}, tiny[32] = {1e-44f}; /* 1/d would overflow: stored as zeros */
        f->quantize_q8(zeros, &y, 32);
        assert_true(y.d == 0.0f && y.s == 0.0f);
        f->quantize_q8(tiny, &y, 32);
        assert_true(y.d == 0.0f && y.q[0] == 0);
    }

    /* gguf's Q8_0 quantizer (float32 numpy, roundf semantics) gives these q for this input */
    float in[256];
    for (int i = 0; i < 256; i++)
        in[i] = (float)((i * 37) % 101 - 50) / 7.0f;
    struct kern_q8 y[8];
    kern_ref_quantize_q8(in, y, 256);
    int8_t q[256];
    for (int b = 0; b < 8; b++)
        memcpy(q + 32 * b, y[b].q, 32);
    assert_int_equal(test_fnv1a64(q, sizeof q), 0xa0026dc003548b53ULL);
}

static void test_quantize_q8_isa(void **state)
{
    (void)state;
    struct rng r = {1234};
    const int64_t n = 4096;
    float *x = malloc(n * sizeof *x);
    struct kern_q8 *want = malloc(n / KERN_QK * sizeof *want);
    struct kern_q8 *got = malloc(n / KERN_QK * sizeof *got);
    assert_true(x && want && got);
    for (int round = 0; round < 20; round++) {
        random_activations(x, n, &r);
        if (round % 2) /* blocks whose scaled values hit exact .5 ties */
            for (int64_t i = 0; i < n; i++)
                x[i] = i % KERN_QK == 0 ? 127.0f : (float)((int)(rng_u64(&r) % 254) - 127) * 0.5f;
        kern_ref_quantize_q8(x, want, n);
        check_q8_invariants(x, want, n);
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            memset(got, 0x55, n / KERN_QK * sizeof *got);
            f->quantize_q8(x, got, n);
            /* the SIMD versions reproduce roundf exactly, ties included */
            for (int64_t b = 0; b < n / KERN_QK; b++) {
                if (f32_bits(got[b].d) != f32_bits(want[b].d) ||
                    f32_bits(got[b].s) != f32_bits(want[b].s) ||
                    memcmp(got[b].q, want[b].q, KERN_QK) != 0)
                    fail_msg("%s quantize_q8 block %lld differs", f->name, (long long)b);
            }
        }
    }
    free(x);
    free(want);
    free(got);
}

/* ---- dequantization, all ISAs vs reference ---------------------------------------------- */

static void test_dequant_isa(void **state)
{
    (void)state;
    struct rng r = {99};
    const uint32_t types[] = {DTYPE_F32,  DTYPE_F16,  DTYPE_BF16, DTYPE_Q4_0, DTYPE_Q4_1,
                              DTYPE_Q5_0, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
    const int64_t n = 4096;
    float *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
    assert_true(want && got);
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        uint8_t *w = random_weights(types[t], n, &r);
        kern_ref_dequant_row(types[t], w, want, n);
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            memset(got, 0, n * sizeof *got);
            f->dequant_row[types[t]](w, got, n);
            if (memcmp(got, want, n * sizeof *got) != 0)
                fail_msg("%s dequant %s differs from the reference", f->name,
                         dtype_get(types[t])->name);
        }
        free(w);
    }
    free(want);
    free(got);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_known_values),
        cmocka_unit_test(test_f16_roundtrip_all),
#ifdef __FLT16_MAX__
        cmocka_unit_test(test_f16_rounding_vs_compiler),
#endif
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_dispatch),
        cmocka_unit_test(test_amx_detect),
        cmocka_unit_test(test_known_q4_0),
        cmocka_unit_test(test_known_q4_1),
        cmocka_unit_test(test_known_q5_0),
        cmocka_unit_test(test_known_q8_0),
        cmocka_unit_test(test_known_q4_k),
        cmocka_unit_test(test_known_q6_k),
        cmocka_unit_test(test_known_float_types),
        cmocka_unit_test(test_gguf_fixture),
        cmocka_unit_test(test_quantize_q8_known),
        cmocka_unit_test(test_quantize_q8_isa),
        cmocka_unit_test(test_dequant_isa),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
