/* Unit tests for kernels/cpu: half/bf16 conversion, the block layouts (hand-built blocks and a
 * fixture cross-checked against the gguf Python package), activation quantization, and every
 * ISA's dot products and dequantization against the scalar reference and against float math on
 * the dequantized values; also dispatch, determinism and thread safety. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernels.h"
#include "tests/test_rand.h"
#include "tests/test_util.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static const uint32_t quant_types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0,
                                       DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
static const uint32_t float_types[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16};
#define N_QUANT_TYPES (sizeof quant_types / sizeof quant_types[0])
#define N_FLOAT_TYPES (sizeof float_types / sizeof float_types[0])

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void put_f16_bits(uint8_t *p, uint16_t h)
{
    memcpy(p, &h, sizeof h);
}

/* n activations: roughly normal, block magnitudes spread over four decades, with an occasional
 * all-zero block and an occasional outlier. */
static void random_activations(float *x, int64_t n, struct rng *r)
{
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        float scale = powf(10.0f, rng_uniform(r, -3.0f, 1.0f));
        uint64_t kind = rng_u64(r) % 16;
        for (int j = 0; j < KERN_QK; j++) {
            float u = rng_uniform(r, -1, 1) + rng_uniform(r, -1, 1) + rng_uniform(r, -1, 1);
            x[b * KERN_QK + j] = kind == 0 ? 0.0f : u * scale;
        }
        if (kind == 1)
            x[b * KERN_QK + rng_u64(r) % KERN_QK] = 50.0f * scale;
    }
}

/* Exact dot of the dequantized weights with the dequantized activations (d * q), in double,
 * and the sum of |terms| that tolerances are measured against. */
static double float_dot(const float *w, const struct kern_q8 *x, int64_t n, double *mag)
{
    double sum = 0.0, abs_sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const struct kern_q8 *xb = &x[i / KERN_QK];
        double t = (double)w[i] * ((double)xb->d * xb->q[i % KERN_QK]);
        sum += t;
        abs_sum += fabs(t);
    }
    *mag = abs_sum;
    return sum;
}

/* |got - want| within rel of the magnitude of the terms (plus a floor for all-zero rows). */
static int close_enough(double got, double want, double mag, double rel)
{
    return fabs(got - want) <= rel * mag + 1e-30;
}

static const struct kern_cpu_fns *isa_fns(int isa)
{
    return kern_cpu_fns_get((enum kern_isa)isa);
}

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

/* ---- quantized dot products ------------------------------------------------------------- */

#define REL_TOL 1e-5 /* of sum |w_i x_i|; integer parts are exact, only float sums differ */

static void test_vec_dot_q8(void **state)
{
    (void)state;
    static const int64_t sizes32[] = {32, 64, 96, 128, 160, 576, 1536, 4096};
    static const int64_t sizesk[] = {256, 512, 4096};
    struct rng r = {2024};
    double worst[KERN_ISA_COUNT] = {0};
    int ran[KERN_ISA_COUNT] = {0};
    for (size_t t = 0; t < N_QUANT_TYPES; t++) {
        uint32_t type = quant_types[t];
        int k = dtype_get(type)->block_elems == KERN_QK_K;
        size_t n_sizes = k ? sizeof sizesk / sizeof sizesk[0] : sizeof sizes32 / sizeof sizes32[0];
        for (size_t si = 0; si < n_sizes; si++) {
            int64_t n = k ? sizesk[si] : sizes32[si];
            for (int rep = 0; rep < 4; rep++) {
                uint8_t *w = random_weights(type, n, &r);
                float *x = malloc(n * sizeof *x), *wf = malloc(n * sizeof *wf);
                struct kern_q8 *xq = malloc(n / KERN_QK * sizeof *xq);
                assert_true(x && wf && xq);
                random_activations(x, n, &r);
                kern_ref_quantize_q8(x, xq, n);
                kern_ref_dequant_row(type, w, wf, n);
                double mag;
                double exact = float_dot(wf, xq, n, &mag);
                float ref = kern_ref_vec_dot_q8(type, w, xq, n);
                if (!close_enough(ref, exact, mag, REL_TOL))
                    fail_msg("ref %s n=%lld: %.9g vs float dot %.9g (mag %.3g)",
                             dtype_get(type)->name, (long long)n, (double)ref, exact, mag);
                for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
                    const struct kern_cpu_fns *f = isa_fns(isa);
                    if (!f)
                        continue;
                    float got = f->vec_dot_q8[type](w, xq, n);
                    /* AVX-VNNI only swaps the integer products for vpdpbusd: the AVX2 bits */
                    if (isa == KERN_ISA_AVXVNNI) {
                        float avx2 = isa_fns(KERN_ISA_AVX2)->vec_dot_q8[type](w, xq, n);
                        if (f32_bits(got) != f32_bits(avx2))
                            fail_msg("avx-vnni %s n=%lld: %.9g, avx2 %.9g", dtype_get(type)->name,
                                     (long long)n, (double)got, (double)avx2);
                    }
                    if (!close_enough(got, ref, mag, REL_TOL))
                        fail_msg("%s %s n=%lld: %.9g vs reference %.9g (mag %.3g)", f->name,
                                 dtype_get(type)->name, (long long)n, (double)got, (double)ref,
                                 mag);
                    if (mag > 0 && fabs(got - ref) / mag > worst[isa])
                        worst[isa] = fabs(got - ref) / mag;
                    ran[isa]++;
                    /* deterministic: same bits again */
                    float again = f->vec_dot_q8[type](w, xq, n);
                    assert_int_equal(f32_bits(again), f32_bits(got));
                }
                free(w);
                free(x);
                free(wf);
                free(xq);
            }
        }
    }
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++)
        if (ran[isa])
            print_message("%s: %d dots, worst |err| / sum|terms| = %.2g\n",
                          kern_isa_name((enum kern_isa)isa), ran[isa], worst[isa]);
}

/* Whether byte off of a block of `type` is a fp16 scale field (kept sane by the extremes test). */
static int is_f16_field(uint32_t type, size_t off)
{
    switch (type) {
    case DTYPE_Q4_1:
    case DTYPE_Q4_K:
        return off < 4; /* d and m / dmin */
    case DTYPE_Q6_K:
        return off >= 208; /* d at the end */
    default:
        return off < 2; /* d */
    }
}

/* Weights and activations at the edges of their ranges, where int16/int8 intermediate sums
 * would saturate or wrap if a kernel got them wrong: every quant byte (packed scales and Q6_K
 * int8 scales included) set to 0x00, 0xFF, 0x55, 0xAA or 0x80 (Q8_0 -128), activations +-127. */
static void test_vec_dot_q8_extremes(void **state)
{
    (void)state;
    const int64_t n = 512;
    static const uint8_t fills[] = {0x00, 0xFF, 0x55, 0xAA, 0x80};
    struct rng r = {77};
    for (size_t t = 0; t < N_QUANT_TYPES; t++) {
        uint32_t type = quant_types[t];
        for (int pattern = 0; pattern < (int)sizeof fills; pattern++) {
            uint8_t *w = random_weights(type, n, &r);
            const struct dtype_info *di = dtype_get(type);
            size_t bytes = dtype_row_bytes(type, n);
            for (size_t i = 0; i < bytes; i++)
                if (!is_f16_field(type, i % (size_t)di->block_bytes))
                    w[i] = fills[pattern];
            struct kern_q8 *xq = malloc(n / KERN_QK * sizeof *xq);
            float *wf = malloc(n * sizeof *wf);
            assert_true(xq && wf);
            for (int64_t b = 0; b < n / KERN_QK; b++) {
                int sum = 0;
                for (int j = 0; j < KERN_QK; j++) {
                    /* all +127, all -127, or alternating, depending on the pattern */
                    int sgn = pattern == 1 ? 1 : pattern == 3 ? -1 : (j + b) % 2 ? -1 : 1;
                    xq[b].q[j] = (int8_t)(127 * sgn);
                    sum += xq[b].q[j];
                }
                xq[b].d = 0.01f;
                xq[b].s = xq[b].d * (float)sum;
            }
            kern_ref_dequant_row(type, w, wf, n);
            double mag;
            double exact = float_dot(wf, xq, n, &mag);
            float ref = kern_ref_vec_dot_q8(type, w, xq, n);
            if (!close_enough(ref, exact, mag, REL_TOL))
                fail_msg("ref %s pattern %d: %.9g vs %.9g", di->name, pattern, (double)ref, exact);
            for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
                const struct kern_cpu_fns *f = isa_fns(isa);
                if (!f)
                    continue;
                float got = f->vec_dot_q8[type](w, xq, n);
                if (!close_enough(got, ref, mag, REL_TOL))
                    fail_msg("%s %s pattern %d: %.9g vs reference %.9g", f->name, di->name, pattern,
                             (double)got, (double)ref);
            }
            free(w);
            free(xq);
            free(wf);
        }
    }
}

/* The tolerance is tight enough to see a layout slip: swapping the nibble halves of one block
 * (a plausible bug) moves the result well outside it. */
static void test_tolerance_catches_layout_bug(void **state)
{
    (void)state;
    struct rng r = {5};
    const int64_t n = 576;
    uint8_t *w = random_weights(DTYPE_Q4_1, n, &r);
    float x[576], wf[576];
    struct kern_q8 xq[576 / KERN_QK];
    random_activations(x, n, &r);
    for (int i = 0; i < KERN_QK; i++) /* make block 0 count */
        x[i] = 1.0f + (float)(i % 7);
    kern_ref_quantize_q8(x, xq, n);
    kern_ref_dequant_row(DTYPE_Q4_1, w, wf, n);
    double mag;
    double exact = float_dot(wf, xq, n, &mag);
    struct kern_block_q4_1 *blk = (struct kern_block_q4_1 *)w;
    for (int i = 0; i < 16; i++)
        blk[0].qs[i] = (uint8_t)(blk[0].qs[i] << 4 | blk[0].qs[i] >> 4);
    float bad = kern_ref_vec_dot_q8(DTYPE_Q4_1, w, xq, n);
    assert_false(close_enough(bad, exact, mag, REL_TOL));
    free(w);
}

/* The same dot from copies at other addresses (other alignments) gives the same bits. */
static void test_vec_dot_alignment_independent(void **state)
{
    (void)state;
    struct rng r = {31337};
    const int64_t n = 1024;
    for (size_t t = 0; t < N_QUANT_TYPES; t++) {
        uint32_t type = quant_types[t];
        size_t bytes = dtype_row_bytes(type, n);
        uint8_t *w = random_weights(type, n, &r);
        float x[1024];
        random_activations(x, n, &r);
        struct kern_q8 *xq = malloc(n / KERN_QK * sizeof *xq + 64);
        uint8_t *wbuf = malloc(bytes + 64);
        struct kern_q8 *xq2 = malloc(n / KERN_QK * sizeof *xq2 + 64);
        assert_true(xq && wbuf && xq2);
        kern_ref_quantize_q8(x, xq, n);
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            float base = f->vec_dot_q8[type](w, xq, n);
            for (int shift = 2; shift <= 14; shift += 6) { /* rows stay 2-byte aligned */
                memcpy(wbuf + shift, w, bytes);
                struct kern_q8 *xs = (struct kern_q8 *)((char *)xq2 + 2 * shift);
                memcpy(xs, xq, n / KERN_QK * sizeof *xq);
                float moved = f->vec_dot_q8[type](wbuf + shift, xs, n);
                assert_int_equal(f32_bits(moved), f32_bits(base));
            }
        }
        free(w);
        free(xq);
        free(wbuf);
        free(xq2);
    }
}

/* ---- float dot products ----------------------------------------------------------------- */

static void test_vec_dot_f32(void **state)
{
    (void)state;
    static const int64_t sizes[] = {32, 256, 576, 4096, 11, 100};
    struct rng r = {555};
    for (size_t t = 0; t < N_FLOAT_TYPES; t++) {
        uint32_t type = float_types[t];
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            int64_t n = sizes[si];
            uint8_t *w = random_weights(type, n, &r);
            float *x = malloc(n * sizeof *x), *wf = malloc(n * sizeof *wf);
            assert_true(x && wf);
            for (int64_t i = 0; i < n; i++)
                x[i] = rng_uniform(&r, -2.0f, 2.0f);
            kern_ref_dequant_row(type, w, wf, n);
            double exact = 0.0, mag = 0.0;
            for (int64_t i = 0; i < n; i++) {
                exact += (double)wf[i] * x[i];
                mag += fabs((double)wf[i] * x[i]);
            }
            float ref = kern_ref_vec_dot_f32(type, w, x, n);
            if (!close_enough(ref, exact, mag, 1e-4))
                fail_msg("ref %s n=%lld: %.9g vs %.9g", dtype_get(type)->name, (long long)n,
                         (double)ref, exact);
            for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
                const struct kern_cpu_fns *f = isa_fns(isa);
                if (!f)
                    continue;
                float got = f->vec_dot_f32[type](w, x, n);
                if (!close_enough(got, exact, mag, 1e-4))
                    fail_msg("%s %s n=%lld: %.9g vs %.9g", f->name, dtype_get(type)->name,
                             (long long)n, (double)got, exact);
                assert_int_equal(f32_bits(f->vec_dot_f32[type](w, x, n)), f32_bits(got));
            }
            free(w);
            free(x);
            free(wf);
        }
    }
}

/* ---- weight rows . float activations (matvec) ---------------------------------------- */

static const uint32_t all_types[] = {DTYPE_F32,  DTYPE_F16,  DTYPE_BF16, DTYPE_Q4_0, DTYPE_Q4_1,
                                     DTYPE_Q5_0, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
#define N_ALL_TYPES (sizeof all_types / sizeof all_types[0])

/* n_rows random rows of n weights, row_bytes = dtype_row_bytes + pad apart (pad a multiple of 4,
 * filled with 0xEE). With a fill pattern (>= 0) every quant byte (not the fp16 scales) is set to
 * it. Caller frees. */
static uint8_t *random_rows(uint32_t type, int64_t n, int64_t n_rows, size_t pad, int fill,
                            struct rng *r)
{
    size_t bytes = dtype_row_bytes(type, n), row_bytes = bytes + pad;
    const struct dtype_info *di = dtype_get(type);
    uint8_t *w = malloc(row_bytes * (size_t)n_rows);
    assert_non_null(w);
    memset(w, 0xEE, row_bytes * (size_t)n_rows);
    for (int64_t i = 0; i < n_rows; i++) {
        uint8_t *row = random_weights(type, n, r);
        if (fill >= 0 && di->block_elems > 1)
            for (size_t j = 0; j < bytes; j++)
                if (!is_f16_field(type, j % (size_t)di->block_bytes))
                    row[j] = (uint8_t)fill;
        memcpy(w + (size_t)i * row_bytes, row, bytes);
        free(row);
    }
    return w;
}

/* Every type on every ISA: the reference is bitwise dequant_row + the reference float dot, and
 * close to exact double math; each ISA's matvec is within rounding of the reference and of its
 * own dequant_row + vec_dot_f32, and repeatable. Includes extreme quant bytes and padded rows. */
static void test_matvec_f32(void **state)
{
    (void)state;
    static const int64_t sizes32[] = {32, 96, 576, 1536};
    static const int64_t sizesk[] = {256, 512, 1536};
    static const int64_t sizesf[] = {11, 100, 576};
    static const int fills[] = {-1, -1, 0x00, 0xFF, 0x80, 0x5A};
    const int64_t n_rows = 7;
    struct rng r = {4242};
    double worst[KERN_ISA_COUNT] = {0};
    for (size_t t = 0; t < N_ALL_TYPES; t++) {
        uint32_t type = all_types[t];
        int be = dtype_get(type)->block_elems;
        const int64_t *sizes = be == 1 ? sizesf : be == KERN_QK_K ? sizesk : sizes32;
        size_t n_sizes = be == KERN_QK ? sizeof sizes32 / sizeof sizes32[0] : 3;
        for (size_t si = 0; si < n_sizes; si++) {
            int64_t n = sizes[si];
            for (size_t fi = 0; fi < sizeof fills / sizeof fills[0]; fi++) {
                size_t pad = fi % 2 ? 8 : 0; /* keeps F32 rows 4-byte aligned */
                size_t row_bytes = dtype_row_bytes(type, n) + pad;
                uint8_t *w = random_rows(type, n, n_rows, pad, fills[fi], &r);
                float *x = malloc(n * sizeof *x), *wf = malloc(n * sizeof *wf);
                float y_ref[7], y[7];
                assert_true(x && wf);
                random_activations(x, n - n % KERN_QK, &r);
                for (int64_t i = n - n % KERN_QK; i < n; i++)
                    x[i] = rng_uniform(&r, -2.0f, 2.0f);
                kern_ref_matvec_f32(type, w, row_bytes, n_rows, x, n, y_ref);
                for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
                    const struct kern_cpu_fns *f = isa_fns(isa);
                    if (!f)
                        continue;
                    memset(y, 0, sizeof y);
                    f->matvec_f32[type](w, row_bytes, n_rows, x, n, y);
                    for (int64_t k = 0; k < n_rows; k++) {
                        const uint8_t *row = w + (size_t)k * row_bytes;
                        double exact = 0.0, mag = 0.0;
                        kern_ref_dequant_row(type, row, wf, n);
                        for (int64_t i = 0; i < n; i++) {
                            exact += (double)wf[i] * x[i];
                            mag += fabs((double)wf[i] * x[i]);
                        }
                        if (isa == 0) {
                            float want = kern_ref_vec_dot_f32(DTYPE_F32, wf, x, n);
                            if (f32_bits(y_ref[k]) != f32_bits(want))
                                fail_msg("ref matvec %s n=%lld row %lld: %.9g, dequant + dot "
                                         "%.9g",
                                         dtype_get(type)->name, (long long)n, (long long)k,
                                         (double)y_ref[k], (double)want);
                            if (!close_enough(y_ref[k], exact, mag, REL_TOL))
                                fail_msg("ref matvec %s n=%lld: %.9g vs exact %.9g (mag %.3g)",
                                         dtype_get(type)->name, (long long)n, (double)y_ref[k],
                                         exact, mag);
                        }
                        f->dequant_row[type](row, wf, n);
                        float old = f->vec_dot_f32[DTYPE_F32](wf, x, n);
                        if (!close_enough(y[k], y_ref[k], mag, REL_TOL) ||
                            !close_enough(y[k], old, mag, REL_TOL))
                            fail_msg("%s matvec %s n=%lld fill %d row %lld: %.9g vs reference "
                                     "%.9g, dequant + dot %.9g (mag %.3g)",
                                     f->name, dtype_get(type)->name, (long long)n, fills[fi],
                                     (long long)k, (double)y[k], (double)y_ref[k], (double)old,
                                     mag);
                        if (mag > 0 && fabs(y[k] - exact) / mag > worst[isa])
                            worst[isa] = fabs(y[k] - exact) / mag;
                    }
                    float again[7];
                    f->matvec_f32[type](w, row_bytes, n_rows, x, n, again);
                    assert_memory_equal(again, y, sizeof y);
                }
                free(w);
                free(x);
                free(wf);
            }
        }
    }
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++)
        if (isa_fns(isa))
            print_message("%s matvec: worst |err vs double| / sum|terms| = %.2g\n",
                          kern_isa_name((enum kern_isa)isa), worst[isa]);
}

/* A row's result is bitwise the same whether it is computed alone, in groups of 1..7 rows
 * starting at any offset, or in one call over all rows. */
static void test_matvec_grouping(void **state)
{
    (void)state;
    enum { ROWS = 13 };
    struct rng r = {1717};
    for (size_t t = 0; t < N_ALL_TYPES; t++) {
        uint32_t type = all_types[t];
        int64_t n = dtype_get(type)->block_elems == KERN_QK_K ? 512 : 576;
        size_t row_bytes = dtype_row_bytes(type, n);
        uint8_t *w = random_rows(type, n, ROWS, 0, -1, &r);
        float *x = malloc(n * sizeof *x);
        assert_non_null(x);
        random_activations(x, n, &r);
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            float alone[ROWS], y[ROWS];
            for (int k = 0; k < ROWS; k++)
                f->matvec_f32[type](w + (size_t)k * row_bytes, row_bytes, 1, x, n, &alone[k]);
            f->matvec_f32[type](w, row_bytes, ROWS, x, n, y);
            assert_memory_equal(y, alone, sizeof y);
            for (int g = 1; g <= 7; g++) {
                for (int start = 0; start < 4; start++) {
                    memset(y, 0, sizeof y);
                    for (int k = start; k < ROWS; k += g) {
                        int cnt = k + g <= ROWS ? g : ROWS - k;
                        f->matvec_f32[type](w + (size_t)k * row_bytes, row_bytes, cnt, x, n, &y[k]);
                    }
                    for (int k = start; k < ROWS; k++)
                        if (f32_bits(y[k]) != f32_bits(alone[k]))
                            fail_msg("%s matvec %s: row %d in groups of %d from %d: %.9g, "
                                     "alone %.9g",
                                     f->name, dtype_get(type)->name, k, g, start, (double)y[k],
                                     (double)alone[k]);
                }
            }
        }
        free(w);
        free(x);
    }
}

/* ---- batched matmul (gemm) --------------------------------------------------------------- */

/* Row length for a gemm test of `type`: base for 32-blocks, rounded for K-quants, and a
 * non-multiple of 16 for the float types (exercises the tails). */
static int64_t gemm_n(uint32_t type, int64_t base)
{
    int be = dtype_get(type)->block_elems;
    if (be == 1)
        return base + 5;
    return (base + be - 1) / be * be;
}

/* n_tok tokens of activations ldx apart, the padding set to NaN (must never be read as data). */
static float *gemm_acts(int64_t n, int64_t n_tok, size_t ldx, struct rng *r)
{
    float *x = malloc((size_t)n_tok * ldx * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < (size_t)n_tok * ldx; i++)
        x[i] = NAN;
    for (int64_t t = 0; t < n_tok; t++) {
        float *xt = x + (size_t)t * ldx;
        random_activations(xt, n - n % KERN_QK, r);
        for (int64_t i = n - n % KERN_QK; i < n; i++)
            xt[i] = rng_uniform(r, -2.0f, 2.0f);
    }
    return x;
}

/* Quantized activations of those tokens, ldxq blocks apart; token 1 (when there is one) is set to
 * +-127 everywhere, the extreme that int16 intermediate sums must survive. */
static struct kern_q8 *gemm_acts_q8(const float *x, int64_t n, int64_t n_tok, size_t ldx,
                                    size_t ldxq)
{
    struct kern_q8 *xq = calloc((size_t)n_tok * ldxq, sizeof *xq);
    assert_non_null(xq);
    for (int64_t t = 0; t < n_tok; t++)
        kern_ref_quantize_q8(x + (size_t)t * ldx, xq + (size_t)t * ldxq, n);
    if (n_tok > 1)
        for (int64_t b = 0; b < n / KERN_QK; b++) {
            struct kern_q8 *xb = &xq[ldxq + b];
            int sum = 0;
            for (int j = 0; j < KERN_QK; j++) {
                xb->q[j] = (int8_t)((j + b) % 3 ? 127 : -127);
                sum += xb->q[j];
            }
            xb->d = 0.01f;
            xb->s = xb->d * (float)sum;
        }
    return xq;
}

#define Y_SENTINEL 0x7FC0DEADu /* a NaN that no kernel computes */

/* Every type on every ISA: gemm_f32 and gemm_q8 against the scalar reference and float64 math,
 * with padded weight rows, strides larger than needed, extreme quant bytes and activations, rows
 * longer than the kernels' stack panels, and a check that nothing outside y's n_rows x n_tok
 * window is written. The scalar gemm must be bitwise the single-row references. */
static void test_gemm_vs_reference(void **state)
{
    (void)state;
    static const int64_t bases[] = {32, 96, 576, 1536, 8448};
    static const int fills[] = {-1, 0xFF, 0x80, 0x00};
    const int64_t n_rows = 19, n_tok = 11;
    struct rng r = {60606};
    double worst_f[KERN_ISA_COUNT] = {0}, worst_q[KERN_ISA_COUNT] = {0};
    for (size_t t = 0; t < N_ALL_TYPES; t++) {
        uint32_t type = all_types[t];
        int quant = dtype_get(type)->block_elems > 1;
        for (size_t si = 0; si < sizeof bases / sizeof bases[0]; si++) {
            int64_t n = gemm_n(type, bases[si]);
            if (si > 0 && gemm_n(type, bases[si - 1]) == n)
                continue;
            int64_t rows = n > 4096 ? 5 : n_rows; /* keep the scalar work small */
            for (size_t fi = 0; fi < (quant ? sizeof fills / sizeof fills[0] : 1); fi++) {
                size_t pad = 4 * (fi % 2) + 4;
                size_t row_bytes = dtype_row_bytes(type, n) + pad;
                uint8_t *w = random_rows(type, n, rows, pad, fills[fi], &r);
                size_t ldx = (size_t)n + 3, ldxq = (size_t)n / KERN_QK + 2, ldy = (size_t)rows + 5;
                float *x = gemm_acts(n, n_tok, ldx, &r);
                struct kern_q8 *xq = quant ? gemm_acts_q8(x, n, n_tok, ldx, ldxq) : NULL;
                float *wf = malloc(n * sizeof *wf), *xd = malloc(n * sizeof *xd);
                float *y = malloc((size_t)n_tok * ldy * sizeof *y);
                float *yq = malloc((size_t)n_tok * ldy * sizeof *yq);
                float *yq_avx2 = malloc((size_t)n_tok * ldy * sizeof *yq_avx2);
                assert_true(wf && xd && y && yq && yq_avx2);
                for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
                    const struct kern_cpu_fns *f = isa_fns(isa);
                    if (!f)
                        continue;
                    for (size_t i = 0; i < (size_t)n_tok * ldy; i++)
                        y[i] = yq[i] = f32_from_bits(Y_SENTINEL);
                    f->gemm_f32[type](w, row_bytes, rows, x, ldx, n_tok, n, y, ldy);
                    if (quant)
                        f->gemm_q8[type](w, row_bytes, rows, xq, ldxq, n_tok, n, yq, ldy);
                    else
                        assert_null(f->gemm_q8[type]);
                    /* AVX-VNNI only swaps the integer products for vpdpbusd: the AVX2 bits
                     * (the AVX2 table runs first, and exists wherever AVX-VNNI does) */
                    if (quant && isa == KERN_ISA_AVX2)
                        memcpy(yq_avx2, yq, (size_t)n_tok * ldy * sizeof *yq);
                    if (quant && isa == KERN_ISA_AVXVNNI &&
                        memcmp(yq_avx2, yq, (size_t)n_tok * ldy * sizeof *yq) != 0)
                        fail_msg("avx-vnni gemm_q8 %s n=%lld fill %d differs from avx2",
                                 dtype_get(type)->name, (long long)n, fills[fi]);
                    for (int64_t k = 0; k < rows; k++) {
                        const uint8_t *row = w + (size_t)k * row_bytes;
                        kern_ref_dequant_row(type, row, wf, n);
                        for (int64_t tk = 0; tk < n_tok; tk++) {
                            const float *xt = x + (size_t)tk * ldx;
                            float got = y[(size_t)tk * ldy + k];
                            double exact = 0.0, mag = 0.0;
                            for (int64_t i = 0; i < n; i++) {
                                exact += (double)wf[i] * xt[i];
                                mag += fabs((double)wf[i] * xt[i]);
                            }
                            if (isa == KERN_ISA_SCALAR) {
                                float want;
                                kern_ref_matvec_f32(type, row, row_bytes, 1, xt, n, &want);
                                if (f32_bits(got) != f32_bits(want))
                                    fail_msg("scalar gemm_f32 %s n=%lld (%lld, %lld): %.9g, "
                                             "matvec %.9g",
                                             dtype_get(type)->name, (long long)n, (long long)k,
                                             (long long)tk, (double)got, (double)want);
                            }
                            if (!close_enough(got, exact, mag, REL_TOL))
                                fail_msg("%s gemm_f32 %s n=%lld fill %d (%lld, %lld): %.9g vs "
                                         "exact %.9g (mag %.3g)",
                                         f->name, dtype_get(type)->name, (long long)n, fills[fi],
                                         (long long)k, (long long)tk, (double)got, exact, mag);
                            if (mag > 0 && fabs(got - exact) / mag > worst_f[isa])
                                worst_f[isa] = fabs(got - exact) / mag;
                            if (!quant)
                                continue;
                            const struct kern_q8 *xqt = xq + (size_t)tk * ldxq;
                            float gq = yq[(size_t)tk * ldy + k];
                            float ref = kern_ref_vec_dot_q8(type, row, xqt, n);
                            double qmag, qexact = float_dot(wf, xqt, n, &qmag);
                            if (isa == KERN_ISA_SCALAR && f32_bits(gq) != f32_bits(ref))
                                fail_msg("scalar gemm_q8 %s (%lld, %lld): %.9g, vec_dot %.9g",
                                         dtype_get(type)->name, (long long)k, (long long)tk,
                                         (double)gq, (double)ref);
                            if (!close_enough(gq, qexact, qmag, REL_TOL) ||
                                !close_enough(gq, ref, qmag, REL_TOL))
                                fail_msg("%s gemm_q8 %s n=%lld fill %d (%lld, %lld): %.9g vs "
                                         "reference %.9g, float dot %.9g (mag %.3g)",
                                         f->name, dtype_get(type)->name, (long long)n, fills[fi],
                                         (long long)k, (long long)tk, (double)gq, (double)ref,
                                         qexact, qmag);
                            if (qmag > 0 && fabs(gq - qexact) / qmag > worst_q[isa])
                                worst_q[isa] = fabs(gq - qexact) / qmag;
                        }
                    }
                    for (int64_t tk = 0; tk < n_tok; tk++)
                        for (size_t k = (size_t)rows; k < ldy; k++) {
                            assert_int_equal(f32_bits(y[(size_t)tk * ldy + k]), Y_SENTINEL);
                            assert_int_equal(f32_bits(yq[(size_t)tk * ldy + k]), Y_SENTINEL);
                        }
                }
                free(w);
                free(x);
                free(xq);
                free(wf);
                free(xd);
                free(y);
                free(yq);
                free(yq_avx2);
            }
        }
    }
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++)
        if (isa_fns(isa))
            print_message("%s gemm: worst |err vs double| / sum|terms| = %.2g (f32), %.2g (q8)\n",
                          kern_isa_name((enum kern_isa)isa), worst_f[isa], worst_q[isa]);
}

/* One gemm call (exact or q8) on rows [r0, r0 + nr) and tokens [t0, t0 + nt) of a test matrix. */
struct gemm_case {
    const struct kern_cpu_fns *f; /* table under test */
    uint32_t type;                /* weight type */
    int q8;                       /* gemm_q8 instead of gemm_f32 */
    const uint8_t *w;             /* weights, row_bytes apart */
    size_t row_bytes;             /* weight row stride */
    const float *x;               /* f32 activations, ldx apart */
    size_t ldx;                   /* activation stride */
    const struct kern_q8 *xq;     /* quantized activations, ldxq blocks apart */
    size_t ldxq;                  /* quantized activation stride */
    int64_t n;                    /* row length */
};

static void gemm_run(const struct gemm_case *c, int64_t r0, int64_t nr, int64_t t0, int64_t nt,
                     float *y, size_t ldy)
{
    const uint8_t *w = c->w + (size_t)r0 * c->row_bytes;
    if (c->q8)
        c->f->gemm_q8[c->type](w, c->row_bytes, nr, c->xq + (size_t)t0 * c->ldxq, c->ldxq, nt,
                               c->n, y, ldy);
    else
        c->f->gemm_f32[c->type](w, c->row_bytes, nr, c->x + (size_t)t0 * c->ldx, c->ldx, nt, c->n,
                                y, ldy);
}

/* Batch invariance: every y[t][r] is bitwise the n_tok = 1, n_rows = 1 result of the same ISA,
 * for n_tok in {1, 2, 3, 5, 8, 17, 64} at token offsets 0 and odd ones, and row counts
 * {1, 3, 4, 5, 13, 17, 24} at several row offsets (the tiles' full and edge paths), for every
 * type, both modes and every ISA; including rows longer than the kernels' stack panels. */
static void test_gemm_batch_invariance(void **state)
{
    (void)state;
    enum { ROWS = 31, TOK = 64 };
    static const int64_t tok_counts[] = {1, 2, 3, 5, 8, 17, 64};
    static const int64_t row_counts[] = {1, 3, 4, 5, 13, 17, 24};
    static const int64_t row_starts[] = {0, 1, 2, 7};
    static const int64_t bases[] = {576, 4352, 8448};
    struct rng r = {90909};
    /* under qemu (tests/e2e/isa_fallback.sh) only the 576-long rows: the emulator is ~150x
     * slower, and the long rows run natively in the same suite */
    const size_t n_bases = getenv("QUERN_EMULATED") ? 1 : sizeof bases / sizeof bases[0];
    for (size_t t = 0; t < N_ALL_TYPES; t++) {
        uint32_t type = all_types[t];
        int quant = dtype_get(type)->block_elems > 1;
        for (size_t bi = 0; bi < n_bases; bi++) {
            int64_t n = gemm_n(type, bases[bi]);
            int big = bi > 0; /* long rows: fewer combinations */
            int64_t n_tok_all = big ? 18 : TOK;
            size_t row_bytes = dtype_row_bytes(type, n) + 4;
            uint8_t *w = random_rows(type, n, ROWS, 4, -1, &r);
            size_t ldx = (size_t)n + 1, ldxq = (size_t)n / KERN_QK + 1;
            float *x = gemm_acts(n, n_tok_all, ldx, &r);
            struct kern_q8 *xq = quant ? gemm_acts_q8(x, n, n_tok_all, ldx, ldxq) : NULL;
            const size_t ldy = ROWS + 3;
            float *alone = malloc((size_t)ROWS * n_tok_all * sizeof *alone);
            float *y = malloc((size_t)TOK * ldy * sizeof *y);
            assert_true(alone && y);
            for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
                const struct kern_cpu_fns *f = isa_fns(isa);
                if (!f)
                    continue;
                for (int q8 = 0; q8 <= quant; q8++) {
                    struct gemm_case c = {f, type, q8, w, row_bytes, x, ldx, xq, ldxq, n};
                    const char *mode = q8 ? "gemm_q8" : "gemm_f32";
                    for (int64_t k = 0; k < ROWS; k++)
                        for (int64_t tk = 0; tk < n_tok_all; tk++)
                            gemm_run(&c, k, 1, tk, 1, &alone[tk * ROWS + k], 1);
                    for (size_t ti = 0; ti < sizeof tok_counts / sizeof tok_counts[0]; ti++) {
                        int64_t nt = tok_counts[ti];
                        if (nt > n_tok_all || (big && ti % 2))
                            continue;
                        for (int64_t t0 = 0; t0 + nt <= n_tok_all; t0 += nt > 8 ? 64 : 3 + nt) {
                            for (size_t ri = 0; ri < sizeof row_counts / sizeof row_counts[0];
                                 ri++) {
                                for (size_t si = 0; si < sizeof row_starts / sizeof row_starts[0];
                                     si++) {
                                    int64_t nr = row_counts[ri], r0 = row_starts[si];
                                    if (r0 + nr > ROWS || (big && si % 2))
                                        continue;
                                    for (size_t i = 0; i < (size_t)nt * ldy; i++)
                                        y[i] = f32_from_bits(Y_SENTINEL);
                                    gemm_run(&c, r0, nr, t0, nt, y, ldy);
                                    for (int64_t tk = 0; tk < nt; tk++)
                                        for (int64_t k = 0; k < nr; k++) {
                                            float got = y[(size_t)tk * ldy + k];
                                            float want = alone[(t0 + tk) * ROWS + r0 + k];
                                            if (f32_bits(got) != f32_bits(want))
                                                fail_msg("%s %s %s n=%lld: rows %lld+%lld, "
                                                         "tokens %lld+%lld: (%lld, %lld) = "
                                                         "%.9g, alone %.9g",
                                                         f->name, mode, dtype_get(type)->name,
                                                         (long long)n, (long long)r0,
                                                         (long long)nr, (long long)t0,
                                                         (long long)nt, (long long)k,
                                                         (long long)tk, (double)got,
                                                         (double)want);
                                        }
                                }
                            }
                        }
                    }
                    /* the whole matrix in one call, split into two row ranges at every point */
                    for (int64_t cut = 0; cut <= ROWS && !big; cut += 5) {
                        gemm_run(&c, 0, cut, 0, n_tok_all, y, ldy);
                        gemm_run(&c, cut, ROWS - cut, 0, n_tok_all, y + cut, ldy);
                        for (int64_t tk = 0; tk < n_tok_all; tk++)
                            for (int64_t k = 0; k < ROWS; k++)
                                if (f32_bits(y[(size_t)tk * ldy + k]) !=
                                    f32_bits(alone[tk * ROWS + k]))
                                    fail_msg("%s %s %s: split at %lld: (%lld, %lld) differs",
                                             f->name, mode, dtype_get(type)->name,
                                             (long long)cut, (long long)k, (long long)tk);
                    }
                }
            }
            free(w);
            free(x);
            free(xq);
            free(alone);
            free(y);
        }
    }
}

/* gemm_f32 dequantizes exactly: against one-hot activations (token t = unit vector e_t) every
 * output is a single weight times 1 plus zeros, which must equal dequant_row's value. */
static void test_gemm_f32_exact_weights(void **state)
{
    (void)state;
    struct rng r = {2718};
    const int64_t rows = 7;
    for (size_t t = 0; t < N_ALL_TYPES; t++) {
        uint32_t type = all_types[t];
        int64_t n = gemm_n(type, 64);
        size_t row_bytes = dtype_row_bytes(type, n) + 4;
        uint8_t *w = random_rows(type, n, rows, 4, -1, &r);
        float *x = calloc((size_t)n * n, sizeof *x), *y = malloc((size_t)n * rows * sizeof *y);
        float *wf = malloc(n * sizeof *wf);
        assert_true(x && y && wf);
        for (int64_t i = 0; i < n; i++)
            x[i * n + i] = 1.0f;
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            f->gemm_f32[type](w, row_bytes, rows, x, (size_t)n, n, n, y, (size_t)rows);
            for (int64_t k = 0; k < rows; k++) {
                kern_ref_dequant_row(type, w + (size_t)k * row_bytes, wf, n);
                for (int64_t i = 0; i < n; i++)
                    if (y[i * rows + k] != wf[i]) /* == : a -0 weight sums to +0 */
                        fail_msg("%s gemm_f32 %s: weight (%lld, %lld) = %.9g, dequant %.9g",
                                 f->name, dtype_get(type)->name, (long long)k, (long long)i,
                                 (double)y[i * rows + k], (double)wf[i]);
            }
        }
        free(w);
        free(x);
        free(y);
        free(wf);
    }
}

/* The batch-invariance check can fail: a "kernel" whose result depends on the token's position
 * (here, the reference with its tokens reversed in pairs) is caught by comparing with n_tok = 1. */
static void test_gemm_invariance_check_can_fail(void **state)
{
    (void)state;
    struct rng r = {4};
    const int64_t n = 96;
    uint8_t *w = random_weights(DTYPE_Q4_1, n, &r);
    float x[2 * 96], y2[2], y1[2];
    random_activations(x, 2 * n, &r);
    const struct kern_cpu_fns *f = isa_fns(KERN_ISA_SCALAR);
    f->gemm_f32[DTYPE_Q4_1](w, 0, 1, x + n, n, 1, n, &y2[0], 1); /* wrong token first */
    f->gemm_f32[DTYPE_Q4_1](w, 0, 1, x, n, 1, n, &y2[1], 1);
    f->gemm_f32[DTYPE_Q4_1](w, 0, 1, x, n, 2, n, y1, 1);
    assert_true(f32_bits(y1[0]) != f32_bits(y2[0]));
    free(w);
}

/* Concurrent gemm calls (as worker threads make them) give the same bits as a lone call. */
struct gemm_job {
    const struct gemm_case *c; /* problem */
    int64_t r0, nr;            /* this thread's rows */
    float *y;                  /* shared output (disjoint rows) */
    size_t ldy;                /* output stride */
};

static void *gemm_thread(void *arg)
{
    struct gemm_job *j = arg;
    for (int it = 0; it < 20; it++)
        gemm_run(j->c, j->r0, j->nr, 0, 9, j->y + j->r0, j->ldy);
    return NULL;
}

static void test_gemm_threads(void **state)
{
    (void)state;
    enum { ROWS = 40 };
    struct rng r = {123};
    const int64_t n = 576;
    const struct kern_cpu_fns *f = kern_cpu_fns_get(kern_cpu_detect());
    size_t row_bytes = dtype_row_bytes(DTYPE_Q4_1, n);
    uint8_t *w = random_rows(DTYPE_Q4_1, n, ROWS, 0, -1, &r);
    float *x = gemm_acts(n, 9, (size_t)n, &r);
    struct kern_q8 *xq = gemm_acts_q8(x, n, 9, (size_t)n, (size_t)n / KERN_QK);
    for (int q8 = 0; q8 <= 1; q8++) {
        struct gemm_case c = {f, DTYPE_Q4_1, q8, w, row_bytes, x, (size_t)n, xq, n / KERN_QK, n};
        float want[9 * ROWS], got[9 * ROWS];
        gemm_run(&c, 0, ROWS, 0, 9, want, ROWS);
        struct gemm_job jobs[3] = {{&c, 0, 11, got, ROWS}, {&c, 11, 16, got, ROWS},
                                   {&c, 27, 13, got, ROWS}};
        pthread_t th[3];
        for (int i = 0; i < 3; i++)
            assert_int_equal(pthread_create(&th[i], NULL, gemm_thread, &jobs[i]), 0);
        for (int i = 0; i < 3; i++)
            assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_memory_equal(got, want, sizeof want);
    }
    free(w);
    free(x);
    free(xq);
}

/* The int8 peak benchmark returns a positive, finite rate for every available ISA. */
static void test_int8_peak(void **state)
{
    (void)state;
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!f)
            continue;
        double ops = kern_cpu_int8_peak(f, 0.01);
        assert_true(ops > 0 && isfinite(ops));
        print_message("%s int8 peak (single thread, short run): %.1f GOP/s\n", f->name, ops * 1e-9);
    }
}

/* ---- thread safety ---------------------------------------------------------------------- */

struct dot_job {
    const struct kern_cpu_fns *fns; /* table under test */
    const uint8_t *w;               /* Q4_1 weights */
    const float *x;                 /* activations to quantize privately */
    int64_t n;                      /* elements */
    float result;                   /* last dot, written by the thread */
    int mismatches;                 /* dots that differed from the first */
};

static void *dot_thread(void *arg)
{
    struct dot_job *j = arg;
    struct kern_q8 xq[4096 / KERN_QK];
    for (int it = 0; it < 2000; it++) {
        j->fns->quantize_q8(j->x, xq, j->n);
        float v = j->fns->vec_dot_q8[DTYPE_Q4_1](j->w, xq, j->n);
        if (it > 0 && f32_bits(v) != f32_bits(j->result))
            j->mismatches++;
        j->result = v;
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    struct rng r = {8};
    const int64_t n = 576;
    uint8_t *w = random_weights(DTYPE_Q4_1, n, &r);
    float x[576];
    random_activations(x, n, &r);
    const struct kern_cpu_fns *f = kern_cpu_fns_get(kern_cpu_detect());
    struct dot_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (struct dot_job){f, w, x, n, 0.0f, 0};
        assert_int_equal(pthread_create(&th[i], NULL, dot_thread, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_join(th[i], NULL), 0);
    struct kern_q8 xq[576 / KERN_QK];
    f->quantize_q8(x, xq, n);
    float single = f->vec_dot_q8[DTYPE_Q4_1](w, xq, n);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(jobs[i].mismatches, 0);
        assert_int_equal(f32_bits(jobs[i].result), f32_bits(single));
    }
    free(w);
}

/* ---- attention over the paged KV cache (f16 and 8-bit) -------------------------------------- */

/* Element idx of a tile of pool (K or V) whose token is i, as stored (8-bit: quant times the
 * token's scale). */
static double kv_at(const struct kern_attn *a, const void *pool, size_t tile, size_t idx, int i)
{
    const int D = a->head_dim, B = a->block_size;
    const uint8_t *t = (const uint8_t *)pool + tile * KERN_KV_TILE_BYTES(a->kv.dtype, B, D);
    if (a->kv.dtype == KERN_KV_F16)
        return kern_f16_to_f32(((const uint16_t *)t)[idx]);
    float sc;
    memcpy(&sc, t + (size_t)D * B + 4 * (size_t)i, sizeof sc);
    return (double)((const int8_t *)t)[idx] * sc;
}

/* Key / value channel c of token i of a tile: keys channel-major, values token-major. */
static double kv_key(const struct kern_attn *a, size_t tile, int c, int i)
{
    return kv_at(a, a->kv.k, tile, (size_t)c * a->block_size + i, i);
}

static double kv_value(const struct kern_attn *a, size_t tile, int c, int i)
{
    return kv_at(a, a->kv.v, tile, (size_t)i * a->head_dim + c, i);
}

/* Straightforward float64 attention over the layout of struct kern_kv_layer: all scores, max,
 * exp, normalize, weighted sum. Independent of the kernels' run/online-softmax structure. */
static void naive_attention(const struct kern_attn *a, int t, double *out)
{
    const int D = a->head_dim, B = a->block_size, G = a->n_head / a->n_kv_head;
    const int n = a->pos[t] + 1;
    double *sc = malloc(sizeof(double) * (size_t)n);
    for (int h = 0; h < a->n_head; h++) {
        const int g = h / G;
        const float *q = a->q + ((size_t)t * a->n_head + h) * D;
        double mx = -INFINITY, sum = 0;
        for (int p = 0; p < n; p++) {
            size_t tile = (size_t)kern_block_row(&a->bt, t)[p / B] * a->n_kv_head + g;
            double d = 0;
            for (int c = 0; c < D; c++)
                d += (double)q[c] * kv_key(a, tile, c, p % B);
            sc[p] = d * a->scale;
            mx = sc[p] > mx ? sc[p] : mx;
        }
        for (int p = 0; p < n; p++)
            sum += (sc[p] = exp(sc[p] - mx));
        for (int c = 0; c < D; c++) {
            double acc = 0;
            for (int p = 0; p < n; p++) {
                size_t tile = (size_t)kern_block_row(&a->bt, t)[p / B] * a->n_kv_head + g;
                acc += sc[p] * kv_value(a, tile, c, p % B);
            }
            out[h * D + c] = acc / sum;
        }
    }
    free(sc);
}

/* Every table's kv_quant_q8 gives the reference's bytes and scale for x[0..n). */
static void check_kv_quant_tables(const float *x, int n, const int8_t *want, float want_sc)
{
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!f)
            continue;
        int8_t q[64];
        float sc = -1.0f;
        memset(q, 0x55, sizeof q);
        f->kv_quant_q8(x, n, q, &sc);
        if (memcmp(q, want, (size_t)n) != 0 || memcmp(&sc, &want_sc, sizeof sc) != 0)
            fail_msg("%s kv_quant_q8 (n %d) differs from the reference", f->name, n);
        for (int i = n; i < 64; i++)
            assert_int_equal(q[i], 0x55); /* nothing written past n */
    }
}

/* kern_kv_quant_q8: the largest magnitude maps to +-127, every value within half a step of
 * its quant times the scale, zeros stay zero. */
static void check_kv_quant(void)
{
    struct rng r = {0x0A8};
    float x[64], sc;
    int8_t q[64];
    for (int it = 0; it < 200; it++) {
        int n = 1 + (int)(rng_u64(&r) % 64);
        float amp = it % 2 ? 1e-3f : 40.0f, amax = 0;
        for (int i = 0; i < n; i++) {
            x[i] = rng_uniform(&r, -amp, amp);
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        }
        kern_kv_quant_q8(x, n, q, &sc);
        assert_true(sc == amax / 127.0f);
        check_kv_quant_tables(x, n, q, sc);
        int top = 0;
        for (int i = 0; i < n; i++) {
            if (!(fabs((double)x[i] - (double)q[i] * sc) <= 0.5001 * sc))
                fail_msg("kv quant: %g stored as %d x %g", (double)x[i], q[i], (double)sc);
            top |= q[i] == 127 || q[i] == -127;
        }
        assert_true(top);
    }
    memset(x, 0, sizeof x);
    kern_kv_quant_q8(x, 64, q, &sc);
    assert_true(sc == 0.0f);
    for (int i = 0; i < 64; i++)
        assert_int_equal(q[i], 0);
    check_kv_quant_tables(x, 64, q, sc);
    /* x * id within half an ulp of a half-integer: the product rounded before the add (as the
     * reference does) and a fused multiply-add give different quants; every table must round
     * twice */
    const float tie[4] = {0x1.6ad5acp+0f, 0x1.bb76eep+0f, 0x1.56ad5cp+1f, 0x1.7efdfcp+1f};
    memset(x, 0, sizeof x);
    x[0] = 40.0f; /* id = 127 / 40 */
    memcpy(x + 1, tie, sizeof tie);
    kern_kv_quant_q8(x, 5, q, &sc);
    assert_int_equal(q[1], 4); /* 4.4999... rounded to 4.5, then to even */
    check_kv_quant_tables(x, 5, q, sc);
    /* a row so small that 127 / max|x| overflows: zeros with the tiny scale, every table */
    memset(x, 0, sizeof x);
    x[3] = 1e-38f;
    x[40] = -5e-39f;
    kern_kv_quant_q8(x, 64, q, &sc);
    assert_true(sc == 1e-38f / 127.0f);
    for (int i = 0; i < 64; i++)
        assert_int_equal(q[i], 0);
    check_kv_quant_tables(x, 64, q, sc);
    /* a NaN is skipped by the maximum and stored as 0, in every table */
    for (int i = 0; i < 64; i++)
        x[i] = (float)(i - 20) * 0.25f;
    x[7] = NAN;
    kern_kv_quant_q8(x, 64, q, &sc);
    assert_true(sc == 43.0f * 0.25f / 127.0f);
    assert_int_equal(q[7], 0);
    assert_int_equal(q[63], 127);
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        int8_t q2[64];
        float sc2;
        if (!f)
            continue;
        f->kv_quant_q8(x, 64, q2, &sc2);
        assert_true(sc2 == sc);
        for (int i = 0; i < 64; i++)
            assert_int_equal(q2[i], q[i]);
    }
}

/* Random keys/values into a pool of n_tiles tiles: f16, or each token's row of one head
 * quantized by kern_kv_quant_q8 (the one quantizer the KV store uses). */
static void fill_kv_pool(struct kern_kv_layer *kv, int dtype, size_t n_tiles, int B, int D,
                         struct rng *r)
{
    const size_t tb = KERN_KV_TILE_BYTES(dtype, B, D);
    uint8_t *k = malloc(n_tiles * tb), *v = malloc(n_tiles * tb);
    float row[KERN_MAX_HEAD_DIM];
    int8_t q[KERN_MAX_HEAD_DIM];
    assert_true(k && v);
    for (size_t t = 0; t < n_tiles; t++)
        for (int i = 0; i < B; i++)
            for (int kvi = 0; kvi < 2; kvi++) {
                uint8_t *tile = (kvi ? v : k) + t * tb;
                for (int c = 0; c < D; c++)
                    row[c] = kvi ? rng_uniform(r, -1.0f, 1.0f) : rng_uniform(r, -2.0f, 2.0f);
                if (dtype == KERN_KV_F16) {
                    for (int c = 0; c < D; c++)
                        ((uint16_t *)tile)[kvi ? (size_t)i * D + c : (size_t)c * B + i] =
                            kern_f32_to_f16(row[c]);
                } else {
                    float sc;
                    kern_kv_quant_q8(row, D, q, &sc);
                    for (int c = 0; c < D; c++)
                        ((int8_t *)tile)[kvi ? (size_t)i * D + c : (size_t)c * B + i] = q[c];
                    memcpy(tile + (size_t)D * B + 4 * (size_t)i, &sc, sizeof sc);
                }
            }
    *kv = (struct kern_kv_layer){k, v, dtype};
}

/* Every table's attn_group against naive_attention, for several head shapes, block sizes
 * (multiples of 16 and not), sequence lengths (1 to past several blocks; partial runs), blocks
 * scattered in the pool, and both KV storage types. Scores are large enough that the softmax
 * is peaked, so the running-max rescale is exercised. */
static void test_attention_vs_naive(void **state)
{
    (void)state;
    static const struct {
        int n_head, n_kv_head, head_dim, block_size;
    } shapes[] = {{9, 3, 64, 16}, {8, 8, 64, 16}, {8, 1, 128, 32}, {6, 3, 64, 8},
                  {4, 2, 32, 16}, {3, 3, 10, 5},  {12, 4, 64, 48}};
    struct rng r = {0x51ED};
    check_kv_quant();
    for (int dtype = KERN_KV_F16; dtype <= KERN_KV_Q8; dtype++)
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int H = shapes[si].n_head, KV = shapes[si].n_kv_head, D = shapes[si].head_dim;
        const int B = shapes[si].block_size, n_blocks = 64, n_tok = 6;
        static const int lens[6] = {1, 2, 17, 33, 100, 257};
        struct kern_kv_layer kv;
        fill_kv_pool(&kv, dtype, (size_t)n_blocks * KV, B, D, &r);
        float *q = malloc(sizeof(float) * (size_t)n_tok * H * D);
        float *out = malloc(sizeof(float) * (size_t)n_tok * H * D);
        double *want = malloc(sizeof(double) * (size_t)H * D);
        for (int i = 0; i < n_tok * H * D; i++)
            q[i] = rng_uniform(&r, -1.5f, 1.5f);
        int32_t pos[6], tables[6][64];
        int32_t rows[6];
        for (int t = 0; t < n_tok; t++) {
            pos[t] = lens[t] - 1 < n_blocks * B - 1 ? lens[t] - 1 : n_blocks * B - 1;
            for (int b = 0; b < n_blocks; b++) /* a random permutation of the pool */
                tables[t][b] = b;
            for (int b = n_blocks - 1; b > 0; b--) {
                int j = (int)(rng_u64(&r) % (uint64_t)(b + 1));
                int32_t x = tables[t][b];
                tables[t][b] = tables[t][j];
                tables[t][j] = x;
            }
            rows[t] = t;
        }
        struct kern_attn a = {.n_tok = n_tok, .q = q, .out = out, .pos = pos,
                              .bt = {&tables[0][0], rows, 64},
                              .kv = kv, .block_size = B, .n_head = H, .n_kv_head = KV,
                              .head_dim = D, .scale = 1.0f / sqrtf((float)D) * 4.0f};
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            memset(out, 0xff, sizeof(float) * (size_t)n_tok * H * D); /* NaN: must be written */
            for (int t = 0; t < n_tok; t++) /* each call told the next one, as the backend does */
                for (int g = 0; g < KV; g++)
                    f->attn_group(&a, t, g, g + 1 < KV ? t : (t + 1 < n_tok ? t + 1 : -1),
                                  g + 1 < KV ? g + 1 : 0, t == 0 && g == 0);
            double worst = 0;
            for (int t = 0; t < n_tok; t++) {
                naive_attention(&a, t, want);
                for (int i = 0; i < H * D; i++) {
                    double d = fabs((double)out[(size_t)t * H * D + i] - want[i]);
                    if (!(d <= 2e-5))
                        fail_msg("%s %s shape %zu token %d (len %d) elem %d: %g vs %g", f->name,
                                 dtype ? "q8" : "f16", si, t, pos[t] + 1, i,
                                 (double)out[(size_t)t * H * D + i], want[i]);
                    worst = d > worst ? d : worst;
                }
            }
            print_message("attention %-12s %s H %2d KV %d D %3d B %2d: max |diff| %.2e\n",
                          f->name, dtype ? "q8 " : "f16", H, KV, D, B, worst);
        }
        free(kv.k);
        free(kv.v);
        free(q);
        free(out);
        free(want);
    }
}

/* The CPU backend's KV store deferred into the attention pass (kern_attn.store, kv_store's skip)
 * writes the same pool bytes and gives bitwise the same outputs as storing every token first:
 * a batch of 3 sequences (a 21-token prefill chunk starting mid-block, one decode token, a
 * 5-token chunk), each sequence's highest position deferred, both storage types, 2 threads. */
static void test_backend_deferred_kv_store(void **state)
{
    (void)state;
    enum { H = 9, KV = 3, D = 64, B = 16, NB = 24, N = 27 };
    struct rng r = {0xDEF};
    struct kern_backend *be;
    struct err_detail err = {0};
    struct kern_backend_opts ko = {.n_threads = 2};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    static const int seq_of[3] = {21, 1, 5}, start[3] = {37, 60, 3};
    int32_t pos[N], tables[3][8];
    int32_t rows[N];
    uint8_t last[N];
    for (int s = 0, t = 0; s < 3; s++) {
        for (int b = 0; b < 8; b++)
            tables[s][b] = s * 8 + (b * 5) % 8; /* the sequence's own 8 blocks, shuffled */
        for (int i = 0; i < seq_of[s]; i++, t++) {
            pos[t] = start[s] + i;
            rows[t] = s;
            last[t] = i == seq_of[s] - 1;
        }
    }
    float *q = malloc(sizeof(float) * N * H * D), *kk = malloc(sizeof(float) * N * KV * D);
    float *vv = malloc(sizeof(float) * N * KV * D);
    float *out0 = malloc(sizeof(float) * N * H * D), *out1 = malloc(sizeof(float) * N * H * D);
    assert_true(q && kk && vv && out0 && out1);
    for (int i = 0; i < N * H * D; i++)
        q[i] = rng_uniform(&r, -1.5f, 1.5f);
    for (int i = 0; i < N * KV * D; i++) {
        kk[i] = rng_uniform(&r, -2.0f, 2.0f);
        vv[i] = rng_uniform(&r, -1.0f, 1.0f);
    }
    for (int dtype = KERN_KV_F16; dtype <= KERN_KV_Q8; dtype++) {
        const size_t bytes = (size_t)NB * KV * KERN_KV_TILE_BYTES(dtype, B, D);
        struct kern_kv_layer kv[2];
        fill_kv_pool(&kv[0], dtype, (size_t)NB * KV, B, D, &r); /* earlier positions' KV */
        fill_kv_pool(&kv[1], dtype, (size_t)NB * KV, B, D, &r);
        memcpy(kv[1].k, kv[0].k, bytes);
        memcpy(kv[1].v, kv[0].v, bytes);
        for (int run = 0; run < 2; run++) {
            const uint8_t *defer = run ? last : NULL;
            float *out = run ? out1 : out0;
            memset(out, 0xff, sizeof(float) * N * H * D);
            const struct kern_block_table bt = {&tables[0][0], rows, 8};
            be->ops->kv_store(be, kv[run], &bt, pos, B, KV, D, kk, vv, N, defer);
            struct kern_attn a = {.n_tok = N, .q = q, .out = out, .pos = pos, .bt = bt,
                                  .kv = kv[run], .block_size = B, .n_head = H, .n_kv_head = KV,
                                  .head_dim = D, .scale = 1.0f / sqrtf((float)D),
                                  .store = defer, .k_new = kk, .v_new = vv};
            be->ops->attention(be, &a);
        }
        if (memcmp(kv[0].k, kv[1].k, bytes) || memcmp(kv[0].v, kv[1].v, bytes))
            fail_msg("%s pool differs with deferred stores", dtype ? "q8" : "f16");
        if (memcmp(out0, out1, sizeof(float) * N * H * D))
            fail_msg("%s attention differs with deferred stores", dtype ? "q8" : "f16");
        for (int i = 0; i < N * H * D; i++)
            assert_true(isfinite(out0[i]));
        for (int k = 0; k < 2; k++) {
            free(kv[k].k);
            free(kv[k].v);
        }
    }
    free(q);
    free(kk);
    free(vv);
    free(out0);
    free(out1);
    kern_backend_free(be);
}

/* ---- row operations ------------------------------------------------------------------------ */

/* rmsnorm and swiglu of every table against float64 formulas, over lengths that exercise the
 * vector bodies and tails, and inputs from tiny to large (SiLU saturates both ways). */
static void test_row_ops_vs_double(void **state)
{
    (void)state;
    struct rng r = {0xE1E1};
    static const int lens[] = {1, 7, 8, 15, 16, 17, 64, 576, 1000, 1536};
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
        const int n = lens[li];
        float *x = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * n);
        float *y = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
        float *up = malloc(sizeof(float) * n);
        for (int i = 0; i < n; i++) {
            x[i] = rng_uniform(&r, -3.0f, 3.0f);
            w[i] = rng_uniform(&r, -2.0f, 2.0f);
            up[i] = rng_uniform(&r, -2.0f, 2.0f);
        }
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            double ss = 0;
            for (int i = 0; i < n; i++)
                ss += (double)x[i] * x[i];
            double sc = 1.0 / sqrt(ss / n + 1e-5);
            f->rmsnorm(x, w, y, n, 1e-5f);
            for (int i = 0; i < n; i++) {
                double want = x[i] * sc * w[i];
                if (!(fabs(y[i] - want) <= 1e-6 * (fabs(want) + 1e-3)))
                    fail_msg("%s rmsnorm n %d [%d]: %g vs %g", f->name, n, i, (double)y[i], want);
            }
            for (int i = 0; i < n; i++) /* spread over [-100, 100]: exp under- and overflow */
                g[i] = (i % 3 == 0) ? rng_uniform(&r, -100.0f, 100.0f) : x[i];
            memcpy(y, g, sizeof(float) * n);
            f->swiglu(y, up, n);
            for (int i = 0; i < n; i++) {
                double want = g[i] / (1.0 + exp(-(double)g[i])) * up[i];
                if (!(fabs(y[i] - want) <= 1e-6 * fabs(want) + 1e-30))
                    fail_msg("%s swiglu n %d [%d] g %g: %g vs %g", f->name, n, i, (double)g[i],
                             (double)y[i], want);
            }
        }
        free(x);
        free(w);
        free(y);
        free(g);
        free(up);
    }
}

/* RoPE: every table bitwise equal to the formula x[2i] cos - x[2i+1] sin, x[2i] sin +
 * x[2i+1] cos computed here in float with each product rounded (the documented rounding), for
 * rotary widths that use the vector body, its tail and both, over several heads. */
static void test_rope_tables(void **state)
{
    (void)state;
    struct rng r = {0x2077};
    static const int dims[][2] = {{64, 64}, {64, 32}, {128, 128}, {10, 10}, {48, 40}, {64, 18}};
    for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
        const int hd = dims[di][0], rot = dims[di][1], H = 3;
        float x[3 * 128], want[3 * 128], got[3 * 128], cs[128];
        for (int i = 0; i < H * hd; i++)
            x[i] = rng_uniform(&r, -3.0f, 3.0f);
        for (int i = 0; i < rot; i += 2) {
            double ang = rng_uniform(&r, -100.0f, 100.0f);
            cs[i] = (float)cos(ang);
            cs[i + 1] = (float)sin(ang);
        }
        memcpy(want, x, sizeof(float) * (size_t)(H * hd));
        for (int h = 0; h < H; h++)
            for (int i = 0; i < rot; i += 2) {
                volatile float ac = x[h * hd + i] * cs[i], bs = x[h * hd + i + 1] * cs[i + 1];
                volatile float as = x[h * hd + i] * cs[i + 1], bc = x[h * hd + i + 1] * cs[i];
                want[h * hd + i] = ac - bs;
                want[h * hd + i + 1] = as + bc;
            }
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            assert_non_null(f->rope);
            memcpy(got, x, sizeof(float) * (size_t)(H * hd));
            f->rope(got, cs, H, hd, rot);
            for (int i = 0; i < H * hd; i++)
                if (f32_bits(got[i]) != f32_bits(want[i]))
                    fail_msg("%s rope head_dim %d rot %d elem %d: %.9g vs %.9g", f->name, hd, rot,
                             i, (double)got[i], (double)want[i]);
        }
    }
}

/* ---- q16: 16-bit activations ------------------------------------------------------------ */

/* quantize_q16 of every table is bitwise the reference (ties and extremes included); gemm_q16
 * of every table agrees with a float64 product of the dequantized weights and the quantized
 * activations, the scalar one bitwise with kern_ref_vec_dot_q16; and results do not depend on
 * how tokens and rows are split between calls. n = 4096 exercises the long-row fallback. */
static void test_gemm_q16(void **state)
{
    (void)state;
    static const uint32_t types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q8_0};
    static const int64_t ns[] = {32, 576, 1536, 4096};
    const int64_t rows = 19, n_tok = 11;
    struct rng r = {16161};
    for (size_t ti = 0; ti < 3; ti++) {
        const uint32_t type = types[ti];
        for (size_t ni = 0; ni < 4; ni++) {
            const int64_t n = ns[ni], nb = n / KERN_QK;
            const size_t row_bytes = dtype_row_bytes(type, n) + 4, ldx = (size_t)n + 3;
            const size_t ldxq = (size_t)nb + 2, ldy = (size_t)rows + 5;
            uint8_t *w = random_rows(type, n, rows, 4, -1, &r);
            float *x = gemm_acts(n, n_tok, ldx, &r);
            for (int i = 0; i < 64 && i < n; i++) /* exact .5 ties after scaling */
                x[i] = (i % 2 ? -0.5f : 0.5f) * (float)(2 * i + 1) / 65534.0f * 32767.0f;
            struct kern_q16 *xq = calloc((size_t)n_tok * ldxq, sizeof *xq);
            struct kern_q16 *xq2 = calloc((size_t)n_tok * ldxq, sizeof *xq2);
            float *y = malloc(sizeof(float) * (size_t)n_tok * ldy);
            float *y1 = malloc(sizeof(float) * (size_t)n_tok * ldy);
            float *wf = malloc(sizeof(float) * (size_t)n);
            for (int64_t t = 0; t < n_tok; t++)
                kern_ref_quantize_q16(x + (size_t)t * ldx, xq + (size_t)t * ldxq, n);
            for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
                const struct kern_cpu_fns *f = isa_fns(isa);
                if (!f)
                    continue;
                for (int64_t t = 0; t < n_tok; t++)
                    f->quantize_q16(x + (size_t)t * ldx, xq2 + (size_t)t * ldxq, n);
                for (int64_t t = 0; t < n_tok; t++)
                    assert_memory_equal(xq2 + (size_t)t * ldxq, xq + (size_t)t * ldxq,
                                        sizeof(*xq) * (size_t)nb);
                f->gemm_q16[type](w, row_bytes, rows, xq, ldxq, n_tok, n, y, ldy);
                /* every token alone, rows split 7 + 12 */
                for (int64_t t = 0; t < n_tok; t++) {
                    f->gemm_q16[type](w, row_bytes, 7, xq + (size_t)t * ldxq, ldxq, 1, n,
                                      y1 + (size_t)t * ldy, ldy);
                    f->gemm_q16[type](w + 7 * row_bytes, row_bytes, rows - 7,
                                      xq + (size_t)t * ldxq, ldxq, 1, n, y1 + (size_t)t * ldy + 7,
                                      ldy);
                }
                for (int64_t k = 0; k < rows; k++) {
                    const uint8_t *row = w + (size_t)k * row_bytes;
                    kern_ref_dequant_row(type, row, wf, n);
                    for (int64_t t = 0; t < n_tok; t++) {
                        const struct kern_q16 *xt = xq + (size_t)t * ldxq;
                        float got = y[(size_t)t * ldy + k];
                        double exact = 0, mag = 0;
                        for (int64_t i = 0; i < n; i++) {
                            double p = (double)wf[i] * ((double)xt[i / KERN_QK].d *
                                                        xt[i / KERN_QK].q[i % KERN_QK]);
                            exact += p;
                            mag += fabs(p);
                        }
                        if (!close_enough(got, exact, mag, REL_TOL))
                            fail_msg("%s gemm_q16 %s n=%lld (%lld, %lld): %.9g vs %.9g",
                                     f->name, dtype_get(type)->name, (long long)n, (long long)k,
                                     (long long)t, (double)got, exact);
                        if (isa == KERN_ISA_SCALAR)
                            assert_int_equal(f32_bits(got),
                                             f32_bits(kern_ref_vec_dot_q16(type, row, xt, n)));
                        assert_int_equal(f32_bits(got), f32_bits(y1[(size_t)t * ldy + k]));
                    }
                }
            }
            free(w);
            free(x);
            free(xq);
            free(xq2);
            free(y);
            free(y1);
            free(wf);
        }
    }
}

/* Weights packed at load: the packed q8 / q16 GEMMs give bitwise the unpacked GEMMs' results,
 * for the whole matrix and for a row range starting at a later panel (how the backend splits
 * rows across threads), rows not a multiple of the panel height, and every row length the
 * packed form accepts; longer rows are declined (panel_bytes 0), never packed wrongly. The
 * packed exact GEMM sums in its own order: it is checked against the float64 product of the
 * dequantized weights, and for batch invariance (each token alone, rows split at a panel,
 * bitwise equal to the whole call). */
/* Every (row, token) result of a GEMM y against the float64 product of the dequantized weight
 * row and the activations, within REL_TOL of the sum of |products|. */
/* A float rounded to bfloat16 as the bf16 matmul mode does: nearest even, subnormals to zero. */
static float bf16_round(float v)
{
    return fabsf(v) < FLT_MIN ? 0.0f : kern_bf16_to_f32(kern_f32_to_bf16(v));
}

/* y against the float64 product of the dequantized weights and x (both first rounded to
 * bfloat16 when bf16), within REL_TOL of sum |w x|. */
static void check_gemm_f64_as(const char *what, int bf16, uint32_t type, const uint8_t *w,
                              size_t row_bytes, int64_t rows, const float *x, size_t ldx,
                              int64_t n_tok, int64_t n, const float *y, size_t ldy)
{
    float *wf = malloc(sizeof(float) * (size_t)n);
    assert_non_null(wf);
    for (int64_t k = 0; k < rows; k++) {
        kern_ref_dequant_row(type, w + (size_t)k * row_bytes, wf, n);
        for (int64_t i = 0; bf16 && i < n; i++)
            wf[i] = bf16_round(wf[i]);
        for (int64_t t = 0; t < n_tok; t++) {
            double exact = 0, mag = 0;
            for (int64_t i = 0; i < n; i++) {
                float xi = x[(size_t)t * ldx + (size_t)i];
                double p = (double)wf[i] * (bf16 ? bf16_round(xi) : xi);
                exact += p;
                mag += fabs(p);
            }
            float got = y[(size_t)t * ldy + k];
            if (!close_enough(got, exact, mag, REL_TOL))
                fail_msg("%s %s n=%lld (%lld, %lld): %.9g vs %.9g", what,
                         dtype_get(type)->name, (long long)n, (long long)k, (long long)t,
                         (double)got, exact);
        }
    }
    free(wf);
}

static void check_gemm_f64(const char *what, uint32_t type, const uint8_t *w, size_t row_bytes,
                           int64_t rows, const float *x, size_t ldx, int64_t n_tok, int64_t n,
                           const float *y, size_t ldy)
{
    check_gemm_f64_as(what, 0, type, w, row_bytes, rows, x, ldx, n_tok, n, y, ldy);
}

static void test_gemm_packed(void **state)
{
    (void)state;
    static const uint32_t types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q8_0};
    static const int64_t ns[] = {32, 576, 1536, 2048, 4608, 8192};
    static const int64_t most[3] = {48, 144, 64}; /* blocks: exact, q8, q16 */
    const int64_t rows = 37, n_tok = 11, P = KERN_PANEL_ROWS;
    struct rng r = {90210};
    int packed_cases = 0;
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!f || !f->panel_pack)
            continue;
        for (size_t ti = 0; ti < 3; ti++) {
            const uint32_t type = types[ti];
            for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
                const int64_t n = ns[ni], nb = n / KERN_QK;
                const size_t row_bytes = dtype_row_bytes(type, n), ldx = (size_t)n + 3;
                const size_t ldxq = (size_t)nb + 1, ldy = (size_t)rows + 3;
                uint8_t *w = random_rows(type, n, rows, 0, -1, &r);
                float *x = gemm_acts(n, n_tok, ldx, &r);
                struct kern_q8 *xq = calloc((size_t)n_tok * ldxq, sizeof *xq);
                struct kern_q16 *xq16 = calloc((size_t)n_tok * ldxq, sizeof *xq16);
                float *y = calloc((size_t)n_tok * ldy, sizeof *y);
                float *yp = calloc((size_t)n_tok * ldy, sizeof *yp);
                for (int64_t t = 0; t < n_tok; t++) {
                    kern_ref_quantize_q8(x + (size_t)t * ldx, xq + (size_t)t * ldxq, n);
                    kern_ref_quantize_q16(x + (size_t)t * ldx, xq16 + (size_t)t * ldxq, n);
                }
                for (int act = 0; act < 3; act++) {
                    size_t bytes = f->panel_bytes(type, rows, n, act);
                    size_t panel = f->panel_bytes(type, P, n, act);
                    if (!bytes) { /* declined: only rows the expansion buffers cannot hold */
                        assert_true(nb > most[act]);
                        continue;
                    }
                    assert_int_equal(bytes, panel * (size_t)((rows + P - 1) / P));
                    uint8_t *pk = aligned_alloc(64, (bytes + 63) / 64 * 64);
                    assert_non_null(pk);
                    f->panel_pack(type, w, row_bytes, rows, n, pk);
                    memset(yp, 0xff, sizeof(*yp) * (size_t)n_tok * ldy);
                    if (act == 2) {
                        f->gemm_q16[type](w, row_bytes, rows, xq16, ldxq, n_tok, n, y, ldy);
                        f->gemm_q16_packed[type](pk, P, xq16, ldxq, n_tok, n, yp, ldy);
                        f->gemm_q16_packed[type](pk + panel, rows - P, xq16, ldxq, n_tok, n,
                                                 yp + P, ldy);
                    } else if (act == 1) {
                        f->gemm_q8[type](w, row_bytes, rows, xq, ldxq, n_tok, n, y, ldy);
                        f->gemm_q8_packed[type](pk, P, xq, ldxq, n_tok, n, yp, ldy);
                        f->gemm_q8_packed[type](pk + panel, rows - P, xq, ldxq, n_tok, n, yp + P,
                                                ldy);
                    } else {
                        f->gemm_f32_packed[type](pk, rows, x, ldx, n_tok, n, y, ldy);
                        /* two tokens (the in-register path), compared below via y */
                        f->gemm_f32_packed[type](pk, rows, x, ldx, 2, n, yp, ldy);
                        for (int64_t t = 0; t < 2; t++)
                            for (int64_t k = 0; k < rows; k++)
                                assert_int_equal(f32_bits(yp[(size_t)t * ldy + k]),
                                                 f32_bits(y[(size_t)t * ldy + k]));
                        for (int64_t t = 0; t < n_tok; t++) { /* each token alone, split */
                            f->gemm_f32_packed[type](pk, P, x + (size_t)t * ldx, ldx, 1, n,
                                                     yp + (size_t)t * ldy, ldy);
                            f->gemm_f32_packed[type](pk + panel, rows - P, x + (size_t)t * ldx,
                                                     ldx, 1, n, yp + (size_t)t * ldy + P, ldy);
                        }
                        check_gemm_f64(f->name, type, w, row_bytes, rows, x, ldx, n_tok, n, y,
                                       ldy);
                    }
                    for (int64_t t = 0; t < n_tok; t++)
                        for (int64_t k = 0; k < rows; k++)
                            if (f32_bits(y[(size_t)t * ldy + k]) != f32_bits(yp[(size_t)t * ldy + k]))
                                fail_msg("%s packed act %d %s n=%lld (%lld, %lld): %.9g vs %.9g",
                                         f->name, act, dtype_get(type)->name, (long long)n,
                                         (long long)k, (long long)t,
                                         (double)yp[(size_t)t * ldy + k],
                                         (double)y[(size_t)t * ldy + k]);
                    packed_cases++;
                    free(pk);
                }
                free(w);
                free(x);
                free(xq);
                free(xq16);
                free(y);
                free(yp);
            }
        }
    }
    print_message("packed weights: %d cases checked (q8/q16 bitwise equal to the unpacked GEMMs, "
                  "exact vs float64 and batch invariant)\n", packed_cases);
    /* per table that packs (AVX-512, and AMX which shares its packing): exact n <= 1536,
     * q8 <= 4608, q16 <= 2048 */
    assert_int_equal(packed_cases, (!!isa_fns(KERN_ISA_AVX512) + !!isa_fns(KERN_ISA_AMX)) * 3 *
                                       (3 + 5 + 4));
}

/* The AMX table's tile GEMMs, where the CPU has AMX-BF16. Exact mode (prep_x3 +
 * gemm_x3_packed) and bf16 mode (prep_bf16 + gemm_bf16_packed):
 * - prep_x3 splits every activation exactly: hi + mid + lo == x, each a bfloat16, in its tile;
 *   prep_bf16 stores each activation rounded to bfloat16, block elements k and k + 16 paired;
 * - a case with exact arithmetic only: Q8_0 weights of 1 times x = 1 + 2^-8 + 2^-16 comes out
 *   exact in exact mode (it fails if any of the three parts is dropped), and in bf16 mode as
 *   x rounded to 1 + 2^-7 with the weight 1 + 2^-10 (the scale) rounded to 1;
 * - random Q4_0 / Q4_1 / Q8_0 rows vs the float64 product of the dequantized weights (bf16: of
 *   both operands rounded to bfloat16);
 * - batch invariance: the whole call (37 tokens: two full 16-token groups and a partial one)
 *   equals each token alone, 2 tokens, and 17, with the rows split at a panel, bit for bit. */
static float bf16_at(const uint8_t *xs, int64_t nb, int64_t t, int64_t i, int part)
{
    const uint8_t *tile = xs + ((size_t)(t / 16) * (size_t)nb + (size_t)(i / KERN_QK)) *
                                   KERN_X3_BYTES(16, KERN_QK) + (size_t)part * 1024;
    uint16_t h;
    memcpy(&h, tile + (t % 16) * 64 + (i % KERN_QK) * 2, sizeof h);
    return kern_bf16_to_f32(h);
}

/* prep_bf16's value of activation i of token t (n per token). */
static float bf16_row_at(const uint8_t *xs, int64_t n, int64_t t, int64_t i)
{
    const int64_t k = i % KERN_QK, at = i - k + (k < 16 ? 2 * k : 2 * (k - 16) + 1);
    uint16_t h;
    memcpy(&h, xs + ((size_t)t * (size_t)n + (size_t)at) * 2, sizeof h);
    return kern_bf16_to_f32(h);
}

typedef void (*amx_prep_fn)(const float *x, size_t ldx, int64_t n_tok, int64_t n, void *xs);
typedef void (*amx_gemm_fn)(const void *pk, int64_t n_rows, const void *xs, int64_t n_tok,
                            int64_t n, float *y, size_t ldy);

static size_t amx_xs_bytes(int bf16, int64_t n_tok, int64_t n)
{
    return bf16 ? KERN_BF16_BYTES(n_tok, n) : KERN_X3_BYTES(n_tok, n);
}

static void amx_exact_case(const struct kern_cpu_fns *f, int bf16)
{
    const int64_t n = KERN_QK, P = KERN_PANEL_ROWS;
    const int act = bf16 ? KERN_ACT_BF16 : KERN_ACT_F32;
    amx_prep_fn prep = bf16 ? f->prep_bf16 : f->prep_x3;
    amx_gemm_fn gemm = bf16 ? f->gemm_bf16_packed[DTYPE_Q8_0] : f->gemm_x3_packed[DTYPE_Q8_0];
    struct kern_block_q8_0 blk[KERN_PANEL_ROWS];
    for (int k = 0; k < KERN_PANEL_ROWS; k++) {
        blk[k].d = kern_f32_to_f16(bf16 ? 1.0f + 0x1p-10f : 1.0f);
        memset(blk[k].qs, 1, sizeof(blk[k].qs));
    }
    float x[KERN_QK], y[KERN_PANEL_ROWS];
    for (int i = 0; i < KERN_QK; i++)
        x[i] = 1.0f + 0x1p-8f + 0x1p-16f;
    size_t bytes = f->panel_bytes(DTYPE_Q8_0, P, n, act);
    uint8_t *pk = aligned_alloc(64, (bytes + 63) / 64 * 64);
    uint8_t *xs = aligned_alloc(64, amx_xs_bytes(bf16, 16, n));
    assert_true(bytes > 0 && pk && xs);
    f->panel_pack(DTYPE_Q8_0, blk, sizeof(blk[0]), P, n, pk);
    prep(x, KERN_QK, 1, n, xs);
    gemm(pk, P, xs, 1, n, y, P);
    for (int k = 0; k < KERN_PANEL_ROWS; k++)
        assert_true(y[k] == (bf16 ? 32.0f * (1.0f + 0x1p-7f) : 32.0f * x[0]));
    free(pk);
    free(xs);
}

static void amx_random_case(const struct kern_cpu_fns *f, int bf16, uint32_t type, int64_t n,
                            struct rng *r)
{
    const int64_t rows = 37, n_tok = 37, P = KERN_PANEL_ROWS, nb = n / KERN_QK;
    const int act = bf16 ? KERN_ACT_BF16 : KERN_ACT_F32;
    const char *what = bf16 ? "amx bf16" : "amx x3";
    amx_prep_fn prep = bf16 ? f->prep_bf16 : f->prep_x3;
    amx_gemm_fn gemm = bf16 ? f->gemm_bf16_packed[type] : f->gemm_x3_packed[type];
    const size_t row_bytes = dtype_row_bytes(type, n), ldx = (size_t)n + 3;
    const size_t ldy = (size_t)rows + 3;
    uint8_t *w = random_rows(type, n, rows, 0, -1, r);
    float *x = gemm_acts(n, n_tok, ldx, r);
    float *y = calloc((size_t)n_tok * ldy, sizeof *y);
    float *yp = calloc((size_t)n_tok * ldy, sizeof *yp);
    uint8_t *xs = aligned_alloc(64, amx_xs_bytes(bf16, n_tok, n));
    size_t bytes = f->panel_bytes(type, rows, n, act);
    size_t panel = f->panel_bytes(type, P, n, act);
    uint8_t *pk = aligned_alloc(64, (bytes + 63) / 64 * 64);
    assert_true(bytes > 0 && pk && xs && gemm);
    f->panel_pack(type, w, row_bytes, rows, n, pk);

    prep(x, ldx, n_tok, n, xs);
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t i = 0; i < n; i++) {
            const float xi = x[(size_t)t * ldx + (size_t)i];
            double got = bf16 ? bf16_row_at(xs, n, t, i)
                              : (double)bf16_at(xs, nb, t, i, 0) + bf16_at(xs, nb, t, i, 1) +
                                    bf16_at(xs, nb, t, i, 2);
            if (got != (double)(bf16 ? bf16_round(xi) : xi))
                fail_msg("%s prep n=%lld (%lld, %lld): %.9g stored as %.9g", what, (long long)n,
                         (long long)t, (long long)i, (double)xi, got);
        }
    gemm(pk, rows, xs, n_tok, n, y, ldy);
    check_gemm_f64_as(what, bf16, type, w, row_bytes, rows, x, ldx, n_tok, n, y, ldy);
    /* batch invariance: 1, 2 and 17 tokens at a time, rows split after one panel */
    static const int64_t chunks[] = {1, 2, 17};
    for (size_t ci = 0; ci < 3; ci++) {
        memset(yp, 0xff, sizeof(*yp) * (size_t)n_tok * ldy);
        for (int64_t t0 = 0; t0 < n_tok; t0 += chunks[ci]) {
            int64_t nt = n_tok - t0 < chunks[ci] ? n_tok - t0 : chunks[ci];
            prep(x + (size_t)t0 * ldx, ldx, nt, n, xs);
            gemm(pk, P, xs, nt, n, yp + (size_t)t0 * ldy, ldy);
            gemm(pk + panel, rows - P, xs, nt, n, yp + (size_t)t0 * ldy + P, ldy);
        }
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t k = 0; k < rows; k++)
                if (f32_bits(y[(size_t)t * ldy + k]) != f32_bits(yp[(size_t)t * ldy + k]))
                    fail_msg("%s %s n=%lld chunks of %lld (%lld, %lld): %.9g vs %.9g", what,
                             dtype_get(type)->name, (long long)n, (long long)chunks[ci],
                             (long long)k, (long long)t, (double)yp[(size_t)t * ldy + k],
                             (double)y[(size_t)t * ldy + k]);
    }
    free(pk);
    free(xs);
    free(w);
    free(x);
    free(y);
    free(yp);
}

static void amx_mode_test(int bf16)
{
    const struct kern_cpu_fns *f = isa_fns(KERN_ISA_AMX);
    const char *mode = bf16 ? "bf16 mode" : "exact mode";
    if (!f) {
        print_message("AMX-BF16 %s: no AMX-BF16 on this CPU, not run\n", mode);
        return;
    }
    assert_non_null(bf16 ? (void *)f->prep_bf16 : (void *)f->prep_x3);
    static const uint32_t types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q8_0};
    /* 1, 3 (odd), 18, 48 blocks (the exact tiles' longest rows), 128 (bf16's longest) */
    static const int64_t ns[] = {32, 96, 576, 1536, 4096};
    struct rng r = {bf16 ? 0xBF16u : 0xB16u};
    int cases = 0;
    amx_exact_case(f, bf16);
    for (size_t ti = 0; ti < 3; ti++)
        for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++)
            if (bf16 || ns[ni] <= 1536) {
                amx_random_case(f, bf16, types[ti], ns[ni], &r);
                cases++;
            }
    print_message("AMX-BF16 %s: %d cases (prep, vs float64, batch invariant)\n", mode, cases);
    assert_int_equal(cases, bf16 ? 15 : 12);
}

static void test_gemm_x3(void **state)
{
    (void)state;
    amx_mode_test(0);
}

static void test_gemm_bf16(void **state)
{
    (void)state;
    amx_mode_test(1);
}

/* bf16 mode's fused FFN kernel: gate/up tiles, SwiGLU and the down projection's prep_bf16 in
 * one pass must give bitwise what gemm_bf16_packed of gate and up, the table's swiglu and
 * prep_bf16 give one after another: 37 tokens (two full token groups and a partial one) whole
 * and in chunks of 1 and 17, and the rows split after one panel (a range starting on the odd
 * half of a 32-row block). */
static void swiglu_fused_case(const struct kern_cpu_fns *f, uint32_t type, int64_t n, struct rng *r)
{
    const int64_t ff = 64, n_tok = 37, P = KERN_PANEL_ROWS;
    const size_t row_bytes = dtype_row_bytes(type, n), ldx = (size_t)n;
    uint8_t *wg = random_rows(type, n, ff, 0, -1, r), *wu = random_rows(type, n, ff, 0, -1, r);
    float *x = gemm_acts(n, n_tok, ldx, r);
    float *g = calloc((size_t)(n_tok * ff), sizeof *g), *u = calloc((size_t)(n_tok * ff), sizeof *u);
    size_t bytes = f->panel_bytes(type, ff, n, KERN_ACT_BF16);
    size_t panel = f->panel_bytes(type, P, n, KERN_ACT_BF16);
    uint8_t *pg = aligned_alloc(64, (bytes + 63) / 64 * 64), *pu = aligned_alloc(64, (bytes + 63) / 64 * 64);
    uint8_t *xs = aligned_alloc(64, KERN_BF16_BYTES(n_tok, n));
    uint8_t *want = aligned_alloc(64, KERN_BF16_BYTES(n_tok, ff));
    uint8_t *got = aligned_alloc(64, KERN_BF16_BYTES(n_tok, ff));
    assert_true(bytes && g && u && pg && pu && xs && want && got);
    f->panel_pack(type, wg, row_bytes, ff, n, pg);
    f->panel_pack(type, wu, row_bytes, ff, n, pu);
    f->prep_bf16(x, ldx, n_tok, n, xs);
    f->gemm_bf16_packed[type](pg, ff, xs, n_tok, n, g, (size_t)ff);
    f->gemm_bf16_packed[type](pu, ff, xs, n_tok, n, u, (size_t)ff);
    for (int64_t t = 0; t < n_tok; t++)
        f->swiglu(g + t * ff, u + t * ff, ff);
    f->prep_bf16(g, (size_t)ff, n_tok, ff, want);
    static const int64_t chunks[] = {37, 1, 17};
    for (size_t ci = 0; ci < 3; ci++) {
        memset(got, 0xff, KERN_BF16_BYTES(n_tok, ff));
        for (int64_t t0 = 0; t0 < n_tok; t0 += chunks[ci]) {
            int64_t nt = n_tok - t0 < chunks[ci] ? n_tok - t0 : chunks[ci];
            uint8_t *o = got + KERN_BF16_BYTES(t0, ff);
            f->prep_bf16(x + (size_t)t0 * ldx, ldx, nt, n, xs);
            f->gemm_bf16_swiglu[type](pg, pu, P, xs, nt, n, o, 0, (size_t)ff);
            f->gemm_bf16_swiglu[type](pg + panel, pu + panel, ff - P, xs, nt, n, o, P, (size_t)ff);
        }
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t k = 0; k < ff; k++)
                if (bf16_row_at(got, ff, t, k) != bf16_row_at(want, ff, t, k))
                    fail_msg("fused swiglu %s n=%lld chunks of %lld (token %lld, row %lld): %.9g, "
                             "unfused %.9g", dtype_get(type)->name, (long long)n,
                             (long long)chunks[ci], (long long)t, (long long)k,
                             (double)bf16_row_at(got, ff, t, k),
                             (double)bf16_row_at(want, ff, t, k));
        assert_memory_equal(got, want, KERN_BF16_BYTES(n_tok, ff));
    }
    free(wg);
    free(wu);
    free(x);
    free(g);
    free(u);
    free(pg);
    free(pu);
    free(xs);
    free(want);
    free(got);
}

/* bf16 mode's greedy output projection: the argmax epilogue must pick, per token, the first
 * row of the largest value gemm_bf16_packed writes, with rows split between two calls (merged
 * as the backend merges threads: a later range wins only when strictly larger). Rows 0..36 with
 * rows 20 and 33 copies of row 5, so exact ties between panels occur and must go to row 5. */
static int argmax_case(const struct kern_cpu_fns *f, uint32_t type, int64_t n, struct rng *r)
{
    const int64_t rows = 37, n_tok = 37, P = KERN_PANEL_ROWS;
    const size_t row_bytes = dtype_row_bytes(type, n);
    uint8_t *w = random_rows(type, n, rows, 0, -1, r);
    memcpy(w + 20 * row_bytes, w + 5 * row_bytes, row_bytes);
    memcpy(w + 33 * row_bytes, w + 5 * row_bytes, row_bytes);
    float *x = gemm_acts(n, n_tok, (size_t)n, r);
    float *y = calloc((size_t)(n_tok * rows), sizeof *y);
    size_t bytes = f->panel_bytes(type, rows, n, KERN_ACT_BF16);
    size_t panel = f->panel_bytes(type, P, n, KERN_ACT_BF16);
    uint8_t *pk = aligned_alloc(64, (bytes + 63) / 64 * 64);
    uint8_t *xs = aligned_alloc(64, KERN_BF16_BYTES(n_tok, n));
    assert_true(bytes && y && pk && xs);
    f->panel_pack(type, w, row_bytes, rows, n, pk);
    f->prep_bf16(x, (size_t)n, n_tok, n, xs);
    f->gemm_bf16_packed[type](pk, rows, xs, n_tok, n, y, (size_t)rows);
    /* make the tie real for some tokens: x . row 5 is then the maximum for them */
    int ties = 0;
    for (int64_t split = 0; split <= 1; split++) {
        float bv[2][37];
        int32_t bi[2][37];
        for (int k = 0; k < 2; k++)
            for (int64_t t = 0; t < n_tok; t++) {
                bv[k][t] = -1.0f / 0.0f;
                bi[k][t] = 0;
            }
        if (split) {
            f->gemm_bf16_argmax[type](pk, P, xs, n_tok, n, 0, bv[0], bi[0]);
            f->gemm_bf16_argmax[type](pk + panel, rows - P, xs, n_tok, n, P, bv[1], bi[1]);
        } else {
            f->gemm_bf16_argmax[type](pk, rows, xs, n_tok, n, 0, bv[0], bi[0]);
        }
        for (int64_t t = 0; t < n_tok; t++) {
            int32_t got = bi[0][t];
            if (split && bv[1][t] > bv[0][t])
                got = bi[1][t];
            int32_t want = 0;
            for (int64_t k = 1; k < rows; k++)
                if (y[t * rows + k] > y[t * rows + want])
                    want = (int32_t)k;
            ties += !split && want == 5;
            if (got != want)
                fail_msg("argmax %s n=%lld split %lld token %lld: row %d (%.9g), want %d (%.9g)",
                         dtype_get(type)->name, (long long)n, (long long)split, (long long)t,
                         got, (double)y[t * rows + got], want, (double)y[t * rows + want]);
        }
    }
    print_message("argmax %s n=%lld: %d tokens whose best row has tied copies\n",
                  dtype_get(type)->name, (long long)n, ties);
    free(w);
    free(x);
    free(y);
    free(pk);
    free(xs);
    return ties;
}

static void test_gemm_bf16_argmax(void **state)
{
    (void)state;
    const struct kern_cpu_fns *f = isa_fns(KERN_ISA_AMX);
    if (!f) {
        print_message("bf16 argmax: no AMX-BF16 on this CPU, not run\n");
        return;
    }
    static const uint32_t types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q8_0};
    struct rng r = {0xA59u};
    int ties = 0;
    for (size_t ti = 0; ti < 3; ti++) {
        ties += argmax_case(f, types[ti], 64, &r);
        ties += argmax_case(f, types[ti], 576, &r);
    }
    assert_true(ties > 0); /* the tie-breaking was exercised */
}

static void test_gemm_bf16_swiglu(void **state)
{
    (void)state;
    const struct kern_cpu_fns *f = isa_fns(KERN_ISA_AMX);
    if (!f) {
        print_message("fused bf16 SwiGLU: no AMX-BF16 on this CPU, not run\n");
        return;
    }
    static const uint32_t types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q8_0};
    struct rng r = {0x5A1u};
    for (size_t ti = 0; ti < 3; ti++) {
        swiglu_fused_case(f, types[ti], 32, &r);
        swiglu_fused_case(f, types[ti], 576, &r);
    }
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
        cmocka_unit_test(test_gemm_x3),
        cmocka_unit_test(test_gemm_bf16),
        cmocka_unit_test(test_gemm_bf16_swiglu),
        cmocka_unit_test(test_gemm_bf16_argmax),
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
        cmocka_unit_test(test_vec_dot_q8),
        cmocka_unit_test(test_vec_dot_q8_extremes),
        cmocka_unit_test(test_tolerance_catches_layout_bug),
        cmocka_unit_test(test_vec_dot_alignment_independent),
        cmocka_unit_test(test_vec_dot_f32),
        cmocka_unit_test(test_matvec_f32),
        cmocka_unit_test(test_matvec_grouping),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_gemm_vs_reference),
        cmocka_unit_test(test_gemm_batch_invariance),
        cmocka_unit_test(test_gemm_f32_exact_weights),
        cmocka_unit_test(test_gemm_invariance_check_can_fail),
        cmocka_unit_test(test_gemm_threads),
        cmocka_unit_test(test_int8_peak),
        cmocka_unit_test(test_attention_vs_naive),
        cmocka_unit_test(test_backend_deferred_kv_store),
        cmocka_unit_test(test_row_ops_vs_double),
        cmocka_unit_test(test_rope_tables),
        cmocka_unit_test(test_gemm_q16),
        cmocka_unit_test(test_gemm_packed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
