/* Unit tests for kernels/cpu batched matmuls: every ISA's gemm_f32 and gemm_q8 against the
 * scalar reference and float64 math, batch invariance (results independent of how tokens and
 * rows are split), f32 exact weights, threads, the int8 peak; q16 (16-bit activations). */
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

/* Quantized activations of those tokens, ldxq blocks apart; token 1 (when there is one) is set to
 * +-127 everywhere, the extreme that int16 intermediate sums must survive. */
static struct kern_q8 *gemm_acts_q8(const float *x, int64_t n, int64_t n_tok, size_t ldx,
                                    size_t ldxq)
{
    struct kern_q8 *xq = calloc((size_t)n_tok * ldxq, sizeof *xq);
    assert_non_null(xq);
    for (int64_t t = 0; t < n_tok; t++)
        kern_ref_quantize_q8(x + (size_t)t * ldx, xq + (size_t)t * ldxq, n);
    /* token 1: extreme values of both signs; token 2: every value 127, so with the 0xFF fill
     * (every nibble 15) a block's products reach their largest sum, 32 * 15 * 127 = 60,960,
     * and its 8 k-steps of pairs 30,480 (the AVX2 Q4 kernels add those in int16) */
    for (int64_t t = 1; t < n_tok && t <= 2; t++)
        for (int64_t b = 0; b < n / KERN_QK; b++) {
            struct kern_q8 *xb = &xq[(size_t)t * ldxq + b];
            int sum = 0;
            for (int j = 0; j < KERN_QK; j++) {
                xb->q[j] = (int8_t)(t == 2 || (j + b) % 3 ? 127 : -127);
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm_vs_reference),
        cmocka_unit_test(test_gemm_batch_invariance),
        cmocka_unit_test(test_gemm_f32_exact_weights),
        cmocka_unit_test(test_gemm_invariance_check_can_fail),
        cmocka_unit_test(test_gemm_threads),
        cmocka_unit_test(test_int8_peak),
        cmocka_unit_test(test_gemm_q16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
