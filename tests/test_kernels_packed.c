/* Unit tests for kernels/cpu GEMMs on weights packed at load: packed q8/q16/exact against the
 * unpacked ones and float64 math, the AMX exact (x3) and bf16 modes, the fused bf16 SwiGLU and
 * argmax. The AMX cases run only on CPUs with AMX-BF16 (the tests say when they do not). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/test_kernels_util.h"
#include "tests/test_rand.h"

/* ---- packed weights, AMX and bf16 modes ------------------------------------------------- */

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

/* Every (row, token) result of a GEMM y against the float64 product of the dequantized weight
 * row and the activations, within REL_TOL of the sum of |products|. */
static void check_gemm_f64(const char *what, uint32_t type, const uint8_t *w, size_t row_bytes,
                           int64_t rows, const float *x, size_t ldx, int64_t n_tok, int64_t n,
                           const float *y, size_t ldy)
{
    check_gemm_f64_as(what, 0, type, w, row_bytes, rows, x, ldx, n_tok, n, y, ldy);
}

/* Weights packed at load: the packed q8 / q16 GEMMs give bitwise the unpacked GEMMs' results,
 * for the whole matrix and for a row range starting at a later panel (how the backend splits
 * rows across threads), rows not a multiple of the panel height, and every row length the
 * packed form accepts; longer rows are declined (panel_bytes 0), never packed wrongly. The
 * packed exact GEMM sums in its own order: it is checked against the float64 product of the
 * dequantized weights, and for batch invariance (each token alone, rows split at a panel,
 * bitwise equal to the whole call). */
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
                    /* a table packs a mode iff it has that mode's packed GEMM */
                    const int packs = act == 2   ? f->gemm_q16_packed[type] != NULL
                                      : act == 1 ? f->gemm_q8_packed[type] != NULL
                                                 : f->gemm_f32_packed[type] != NULL;
                    if (!bytes) { /* declined: only rows the expansion buffers cannot hold */
                        assert_true(!packs || nb > most[act]);
                        continue;
                    }
                    assert_true(packs);
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
    /* per table that packs: AVX-512 and AMX (which shares its packing) exact n <= 1536, q8
     * <= 4608, q16 <= 2048; AVX2 and AVX-VNNI q8 only, every n (8192: two passes of blocks) */
    assert_int_equal(packed_cases,
                     (!!isa_fns(KERN_ISA_AVX512) + !!isa_fns(KERN_ISA_AMX)) * 3 * (3 + 5 + 4) +
                         (!!isa_fns(KERN_ISA_AVX2) + !!isa_fns(KERN_ISA_AVXVNNI)) * 3 * 6);
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
        cmocka_unit_test(test_gemm_x3),
        cmocka_unit_test(test_gemm_bf16),
        cmocka_unit_test(test_gemm_bf16_swiglu),
        cmocka_unit_test(test_gemm_bf16_argmax),
        cmocka_unit_test(test_gemm_packed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
