/* Unit tests for kernels/cpu dot products: every ISA's quantized (q8 activations) and float dot
 * products against the scalar reference and float64 math on the dequantized values, extreme quant
 * bytes, alignment; weight rows times float activations (matvec); thread safety. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/test_kernels_util.h"
#include "tests/test_rand.h"

/* ---- quantized dot products ------------------------------------------------------------- */

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vec_dot_q8),
        cmocka_unit_test(test_vec_dot_q8_extremes),
        cmocka_unit_test(test_tolerance_catches_layout_bug),
        cmocka_unit_test(test_vec_dot_alignment_independent),
        cmocka_unit_test(test_vec_dot_f32),
        cmocka_unit_test(test_matvec_f32),
        cmocka_unit_test(test_matvec_grouping),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
