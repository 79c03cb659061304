/* AVX-512 (F/BW/VL/DQ) + VNNI batched matmul: weight rows times many activation rows at once,
 * for the throughput engine. Batch invariant by construction: every (row, token) pair is computed
 * by the same sequence of per-lane operations whatever tile it falls in, so n_tok, n_rows, the
 * position in the call and any split of the rows never change a bit. Only reached through
 * kern_cpu_fns_get(), which checks the CPU first. */
#pragma GCC target("no-avxvnni") /* every vpdpbusd EVEX-encoded (see dot_avx512.c) */

#include <assert.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx512.h"


/* ---- exact mode: f32 activations ----
 * A panel of GF_ROWS weight rows is dequantized (bitwise as dequant_row) into a stack buffer,
 * then multiplied with GF_TOK tokens at a time. Pair (r, t) owns one 16-lane accumulator:
 * acc = fma(w[k..k+15], x[k..k+15], acc) for k = 0, 16, 32, ... in order (a final partial step
 * with masked, zero-filled loads when n % 16 != 0), then one fixed horizontal sum. Edge tiles
 * (fewer rows or tokens) run the same inlined body with fewer pairs. Rows longer than GF_KC are
 * processed in chunks of GF_KC with the accumulators parked in memory, which keeps the order. */

#define GF_ROWS 6    /* rows per panel (6 x 4 accumulators + 4 activations in 32 registers) */
#define GF_TOK  4    /* tokens per tile */
#define GF_KC   4096 /* panel row length in floats; a multiple of KERN_QK_K */

static ALWAYS_INLINE void gf_tile(const float *wp, size_t ldw, const int nr, const float *x,
                                  size_t ldx, const int nt, int64_t kc, __m512 *accm)
{
    __m512 acc[GF_ROWS][GF_TOK];
    UNROLL
    for (int i = 0; i < nr; i++)
        UNROLL
    for (int j = 0; j < nt; j++)
        acc[i][j] = accm[i * GF_TOK + j];
    int64_t k = 0;
    for (; k + 16 <= kc; k += 16) {
        __m512 xv[GF_TOK];
        UNROLL
        for (int j = 0; j < nt; j++)
            xv[j] = _mm512_loadu_ps(x + (size_t)j * ldx + k);
        UNROLL
        for (int i = 0; i < nr; i++) {
            __m512 wv = _mm512_loadu_ps(wp + (size_t)i * ldw + k);
            UNROLL
            for (int j = 0; j < nt; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (k < kc) { /* float types only: n % 16 elements left */
        __mmask16 m = (__mmask16)((1u << (kc - k)) - 1);
        __m512 xv[GF_TOK];
        UNROLL
        for (int j = 0; j < nt; j++)
            xv[j] = _mm512_maskz_loadu_ps(m, x + (size_t)j * ldx + k);
        UNROLL
        for (int i = 0; i < nr; i++) {
            __m512 wv = _mm512_maskz_loadu_ps(m, wp + (size_t)i * ldw + k);
            UNROLL
            for (int j = 0; j < nt; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    UNROLL
    for (int i = 0; i < nr; i++)
        UNROLL
    for (int j = 0; j < nt; j++)
        accm[i * GF_TOK + j] = acc[i][j];
}

#define GF_CASE(R, T)                                                                              \
    case (R)*8 + (T):                                                                              \
        gf_tile(wp, ldw, R, x, ldx, T, kc, accm);                                                  \
        break;
#define GF_CASES(R) GF_CASE(R, 1) GF_CASE(R, 2) GF_CASE(R, 3) GF_CASE(R, 4)

/* One tile of nr x nt pairs, dispatched to a body specialized for those counts. */
static void gf_tile_any(const float *wp, size_t ldw, int nr, const float *x, size_t ldx, int nt,
                        int64_t kc, __m512 *accm)
{
    switch (nr * 8 + nt) {
        GF_CASES(1)
        GF_CASES(2)
        GF_CASES(3)
        GF_CASES(4)
        GF_CASES(5)
        GF_CASES(6)
    default:
        assert(0 && "bad tile");
    }
}

/* Panel dequantizers for the hot types, bitwise as the reference (the same float operations per
 * value: a block's 16 possible values are computed once, d * q (+ m), and looked up by nibble). */
static inline __m512 iota16(float base)
{
    return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_ps(base));
}

static ALWAYS_INLINE void deq_q4(const void *src, float *dst, int64_t n, const int has_min)
{
    const size_t bb = has_min ? sizeof(struct kern_block_q4_1) : sizeof(struct kern_block_q4_0);
    const size_t qoff =
        has_min ? offsetof(struct kern_block_q4_1, qs) : offsetof(struct kern_block_q4_0, qs);
    const __m512 q_vals = iota16(has_min ? 0.0f : -8.0f);
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        const uint8_t *blk = (const uint8_t *)src + (size_t)b * bb;
        __m128 dm = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk)); /* d, m (8 bytes) */
        __m512 tab = _mm512_mul_ps(_mm512_broadcastss_ps(dm), q_vals);
        if (has_min)
            tab = _mm512_add_ps(tab, _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
        __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + qoff)));
        _mm512_storeu_ps(dst, _mm512_permutexvar_ps(i0, tab)); /* low nibbles (index bits 0-3) */
        _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), tab));
    }
}

static void deq_q4_0(const void *src, float *dst, int64_t n)
{
    deq_q4(src, dst, n, 0);
}

static void deq_q4_1(const void *src, float *dst, int64_t n)
{
    deq_q4(src, dst, n, 1);
}

static void deq_q8_0(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q8_0 *w = src;
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        __m512 d = _mm512_set1_ps(_cvtsh_ss(w[b].d));
        __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w[b].qs));
        __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w[b].qs + 16)));
        _mm512_storeu_ps(dst, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0)));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1)));
    }
}

/* deq NULL: F32 rows are used in place (4-byte aligned, same values as a copy). */
static void gf_driver(void (*deq)(const void *, float *, int64_t), int be, size_t bb,
                      KERN_GEMM_F32_ARGS)
{
    _Alignas(64) float panel[GF_ROWS * GF_KC];
    __m512 accm[GF_ROWS * GF_TOK];
    const int one_chunk = n <= GF_KC;
    const size_t ldw = deq ? (one_chunk ? (size_t)((n + 15) & ~(int64_t)15) : GF_KC)
                           : row_bytes / sizeof(float);
    for (int64_t r0 = 0; r0 < n_rows; r0 += GF_ROWS) {
        int nr = n_rows - r0 < GF_ROWS ? (int)(n_rows - r0) : GF_ROWS;
        const char *wr = (const char *)w + (size_t)r0 * row_bytes;
        if (deq && one_chunk)
            for (int i = 0; i < nr; i++)
                deq(wr + (size_t)i * row_bytes, panel + (size_t)i * ldw, n);
        for (int64_t t0 = 0; t0 < n_tok; t0 += GF_TOK) {
            int nt = n_tok - t0 < GF_TOK ? (int)(n_tok - t0) : GF_TOK;
            for (int q = 0; q < GF_ROWS * GF_TOK; q++)
                accm[q] = _mm512_setzero_ps();
            for (int64_t k0 = 0; k0 < n; k0 += GF_KC) {
                int64_t kc = n - k0 < GF_KC ? n - k0 : GF_KC;
                const float *wp = panel;
                if (!deq)
                    wp = (const float *)wr + k0;
                else if (!one_chunk)
                    for (int i = 0; i < nr; i++)
                        deq(wr + (size_t)i * row_bytes + (size_t)(k0 / be) * bb,
                            panel + (size_t)i * ldw, kc);
                gf_tile_any(wp, ldw, nr, x + (size_t)t0 * ldx + k0, ldx, nt, kc, accm);
            }
            for (int i = 0; i < nr; i++)
                for (int j = 0; j < nt; j++)
                    y[(size_t)(t0 + j) * ldy + r0 + i] =
                        _mm512_reduce_add_ps(accm[i * GF_TOK + j]);
        }
    }
}

#define GF_ENTRY(name, type)                                                                       \
    void kern_avx512_gemm_##name##_f32(KERN_GEMM_F32_ARGS)                                         \
    {                                                                                              \
        const struct dtype_info *di = dtype_get(type);                                             \
        gf_driver(type == DTYPE_F32    ? NULL                                                      \
                  : type == DTYPE_Q4_0 ? deq_q4_0                                                  \
                  : type == DTYPE_Q4_1 ? deq_q4_1                                                  \
                  : type == DTYPE_Q8_0 ? deq_q8_0                                                  \
                                       : kern_cpu_fns_avx512.dequant_row[type],                    \
                  di->block_elems, (size_t)di->block_bytes, w, row_bytes, n_rows, x, ldx, n_tok,   \
                  n, y, ldy);                                                                      \
    }

GF_ENTRY(f32, DTYPE_F32)
GF_ENTRY(f16, DTYPE_F16)
GF_ENTRY(bf16, DTYPE_BF16)
GF_ENTRY(q4_0, DTYPE_Q4_0)
GF_ENTRY(q4_1, DTYPE_Q4_1)
GF_ENTRY(q5_0, DTYPE_Q5_0)
GF_ENTRY(q8_0, DTYPE_Q8_0)
GF_ENTRY(q4_k, DTYPE_Q4_K)
GF_ENTRY(q6_k, DTYPE_Q6_K)

/* ---- q8 mode: quantized activations, vpdpbusd ----
 * 16 weight rows are the 16 int32 lanes. A panel's blocks are repacked once into gq_blk: for
 * k-step s (activation dword s, i.e. elements 4s..4s+3 of the block), lane r holds row r's four
 * quants as unsigned bytes; then for each token, vpdpbusd with that token's dword s broadcast
 * accumulates the exact integer dot of all 16 rows at once. Signed weights are stored offset
 * (Q4_0: nibble = w + 8, Q8_0: w + 128) and the integer sum starts from -offset * sum(x_q) of the
 * block, so it is exact too. Per pair and block, in this order and in every tile:
 *   acc = fma((float)isum, d_w * d_x, acc);  Q4_1 only: acc = fma(m_w, s_x, acc)
 * and the pair's result is its lane of acc: no horizontal sum, no dependence on the tile. */

#define GQ_ROWS KERN_PANEL_ROWS /* rows per panel: the 16 lanes */
#define GQ_TOK  8   /* tokens per tile */
#define GQ_BLKS 144 /* packed blocks on the stack (92 KiB); longer rows use the per-pair path */
#define GQ_PPG  8   /* at most this many panels packed per group */

struct gq_blk {
    uint8_t q[8][64]; /* k-step s: lane r = row r's 4 quants (offset to unsigned) */
    float d[16];      /* row scales */
    float m[16];      /* Q4_1 row offsets (unused for the other types) */
};

enum gq_kind {
    GQ_Q4_1, /* unsigned nibbles, offset term m*s */
    GQ_Q4_0, /* nibbles offset by 8 */
    GQ_Q8_0, /* bytes offset by 128 */
};

static ALWAYS_INLINE int gq_nq(const enum gq_kind kind)
{
    return kind == GQ_Q8_0 ? 8 : 4;
}

/* Expands nb blocks of nr (<= 16) rows starting at rows, or of the same panel's packed raw form
 * (raw != NULL, rows unused; see panel_raw). */
static ALWAYS_INLINE void gq_pack(const uint8_t *raw, const char *rows, size_t row_bytes, int nr,
                                  int64_t nb, struct gq_blk *dst, const enum gq_kind kind)
{
    const size_t bb = kind == GQ_Q4_1   ? sizeof(struct kern_block_q4_1)
                      : kind == GQ_Q4_0 ? sizeof(struct kern_block_q4_0)
                                        : sizeof(struct kern_block_q8_0);
    const size_t qoff = kind == GQ_Q4_1   ? offsetof(struct kern_block_q4_1, qs)
                        : kind == GQ_Q4_0 ? offsetof(struct kern_block_q4_0, qs)
                                          : offsetof(struct kern_block_q8_0, qs);
    const int nq = gq_nq(kind);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i offs = gq_row_offsets(row_bytes, nr);
    size_t roff[16]; /* lanes past nr repeat the last row */
    for (int r = 0; r < 16; r++)
        roff[r] = (size_t)(r < nr ? r : nr - 1) * row_bytes;
    for (int64_t b = 0; b < nb; b++) {
        struct gq_blk *o = &dst[b];
        __m512i dm, v[8];
        panel_raw(raw ? raw + (size_t)b * PANEL_RAW_BYTES(nq) : NULL,
                  raw ? NULL : (const uint8_t *)rows + (size_t)b * bb, offs, roff, qoff, nq, v,
                  &dm);
        /* the scale dword (d, and m for Q4_1; else d and two quant bytes) of each row */
        _mm512_store_ps(o->d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
        if (kind == GQ_Q4_1)
            _mm512_store_ps(o->m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
        if (kind == GQ_Q8_0) {
            UNROLL
            for (int s = 0; s < 8; s++)
                _mm512_store_si512((__m512i *)o->q[s],
                                   _mm512_xor_si512(v[s], _mm512_set1_epi8((char)0x80)));
        } else {
            UNROLL
            for (int s = 0; s < 4; s++) {
                _mm512_store_si512((__m512i *)o->q[s], _mm512_and_si512(v[s], low4));
                _mm512_store_si512((__m512i *)o->q[s + 4],
                                   _mm512_and_si512(_mm512_srli_epi32(v[s], 4), low4));
            }
        }
    }
}

/* Sum of a block's 32 quantized activations. */
static inline int32_t q8_block_sum(const struct kern_q8 *xb)
{
    __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)xb->q),
                                 _mm256_set1_epi8((char)0x80)); /* q + 128, unsigned */
    __m256i s = _mm256_sad_epu8(u, _mm256_setzero_si256());
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t));
    return _mm_cvtsi128_si32(t) - 32 * 128;
}

/* One panel (16 rows) x nt tokens over nb blocks; out[j] lane r = pair (r, token j). corr[j*nb+b]
 * is the integer sum's starting value for signed kinds. The integer sums may use several chains
 * (exact, so the result does not depend on how many). */
static ALWAYS_INLINE void gq_tile(const struct gq_blk *pk, int64_t nb, const struct kern_q8 *x,
                                  size_t ldxq, const int nt, const int32_t *corr,
                                  const enum gq_kind kind, __m512 *out)
{
    enum { C_MAX = 4 };
    const int nc = nt == 1 ? 4 : nt == 2 ? 2 : 1;
    __m512 acc[GQ_TOK];
    UNROLL
    for (int j = 0; j < nt; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct gq_blk *p = pk + b;
        __m512i ia[GQ_TOK][C_MAX];
        UNROLL
        for (int j = 0; j < nt; j++)
            UNROLL
        for (int c = 0; c < nc; c++)
            ia[j][c] = c == 0 && kind != GQ_Q4_1 ? _mm512_set1_epi32(corr[j * nb + b])
                                                 : _mm512_setzero_si512();
        UNROLL
        for (int s = 0; s < 8; s++) {
            __m512i wv = _mm512_load_si512((const __m512i *)p->q[s]);
            UNROLL
            for (int j = 0; j < nt; j++) {
                int32_t xd;
                memcpy(&xd, x[(size_t)j * ldxq + b].q + 4 * s, sizeof xd);
                ia[j][s % nc] = _mm512_dpbusd_epi32(ia[j][s % nc], wv, _mm512_set1_epi32(xd));
            }
        }
        __m512 dw = _mm512_load_ps(p->d);
        UNROLL
        for (int j = 0; j < nt; j++) {
            const struct kern_q8 *xb = &x[(size_t)j * ldxq + b];
            __m512i isum = ia[j][0];
            UNROLL
            for (int c = 1; c < nc; c++)
                isum = _mm512_add_epi32(isum, ia[j][c]);
            __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(xb->d));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[j]);
            if (kind == GQ_Q4_1)
                acc[j] = _mm512_fmadd_ps(_mm512_load_ps(p->m), _mm512_set1_ps(xb->s), acc[j]);
        }
    }
    UNROLL
    for (int j = 0; j < nt; j++)
        out[j] = acc[j];
}

#define GQ_CASE(T)                                                                                 \
    case T:                                                                                        \
        gq_tile(pk, nb, x, ldxq, T, corr, kind, out);                                              \
        break;

static ALWAYS_INLINE void gq_tile_any(const struct gq_blk *pk, int64_t nb,
                                      const struct kern_q8 *x, size_t ldxq, int nt,
                                      const int32_t *corr, const enum gq_kind kind, __m512 *out)
{
    switch (nt) {
        GQ_CASE(1)
        GQ_CASE(2)
        GQ_CASE(3)
        GQ_CASE(4)
        GQ_CASE(5)
        GQ_CASE(6)
        GQ_CASE(7)
        GQ_CASE(8)
    default:
        assert(0 && "bad tile");
    }
}

/* raw: the packed form of w (then w is unused), or NULL. */
static ALWAYS_INLINE void gq_driver(const enum gq_kind kind, const uint8_t *raw, KERN_GEMM_Q8_ARGS)
{
    const int64_t nb = n / KERN_QK;
    _Alignas(64) struct gq_blk pk[GQ_BLKS];
    int32_t corr[GQ_TOK * GQ_BLKS];
    const int32_t off = kind == GQ_Q4_0 ? 8 : 128;
    int64_t ppg = GQ_BLKS / nb < GQ_PPG ? GQ_BLKS / nb : GQ_PPG;
    assert(n % KERN_QK == 0 && nb <= GQ_BLKS && nb > 0);
    assert(raw || row_bytes * GQ_ROWS + (size_t)n < (size_t)INT32_MAX); /* gather offsets */
    for (int64_t g0 = 0; g0 < n_rows; g0 += ppg * GQ_ROWS) {
        int64_t left = n_rows - g0;
        int np = (int)((left + GQ_ROWS - 1) / GQ_ROWS < ppg ? (left + GQ_ROWS - 1) / GQ_ROWS : ppg);
        for (int q = 0; q < np; q++) {
            int64_t r0 = g0 + (int64_t)q * GQ_ROWS;
            int nr = n_rows - r0 < GQ_ROWS ? (int)(n_rows - r0) : GQ_ROWS;
            if (raw)
                gq_pack(raw + (size_t)(r0 / GQ_ROWS) * (size_t)nb * PANEL_RAW_BYTES(gq_nq(kind)),
                        NULL, 0, nr, nb, pk + q * nb, kind);
            else
                gq_pack(NULL, (const char *)w + (size_t)r0 * row_bytes, row_bytes, nr, nb,
                        pk + q * nb, kind);
        }
        for (int64_t t0 = 0; t0 < n_tok; t0 += GQ_TOK) {
            int nt = n_tok - t0 < GQ_TOK ? (int)(n_tok - t0) : GQ_TOK;
            const struct kern_q8 *x = xq + (size_t)t0 * ldxq;
            if (kind != GQ_Q4_1)
                for (int j = 0; j < nt; j++)
                    for (int64_t b = 0; b < nb; b++)
                        corr[j * nb + b] = -off * q8_block_sum(&x[(size_t)j * ldxq + b]);
            for (int q = 0; q < np; q++) {
                int64_t r0 = g0 + (int64_t)q * GQ_ROWS;
                int nr = n_rows - r0 < GQ_ROWS ? (int)(n_rows - r0) : GQ_ROWS;
                __m512 out[GQ_TOK];
                gq_tile_any(pk + q * nb, nb, x, ldxq, nt, corr, kind, out);
                __mmask16 m = (__mmask16)((1u << nr) - 1);
                for (int j = 0; j < nt; j++)
                    _mm512_mask_storeu_ps(y + (size_t)(t0 + j) * ldy + r0, m, out[j]);
            }
        }
    }
}

/* Rows longer than the stack panel fall back to one vec_dot_q8 per pair: the choice depends on
 * n only, so a matrix always takes the same path. */
#define GQ_ENTRY(name, kind, type)                                                                 \
    void kern_avx512_gemm_##name##_q8(KERN_GEMM_Q8_ARGS)                                           \
    {                                                                                              \
        if (n / KERN_QK > GQ_BLKS || n < KERN_QK)                                                  \
            kern_gemm_q8_pairs(kern_cpu_fns_avx512.vec_dot_q8[type], w, row_bytes, n_rows, xq,     \
                               ldxq, n_tok, n, y, ldy);                                            \
        else                                                                                       \
            gq_driver(kind, NULL, w, row_bytes, n_rows, xq, ldxq, n_tok, n, y, ldy);               \
    }                                                                                              \
    void kern_avx512_gemm_##name##_q8_packed(KERN_GEMM_PK_ARGS(kern_q8))                           \
    {                                                                                              \
        gq_driver(kind, pk, NULL, 0, n_rows, xq, ldxq, n_tok, n, y, ldy);                          \
    }

GQ_ENTRY(q4_0, GQ_Q4_0, DTYPE_Q4_0)
GQ_ENTRY(q4_1, GQ_Q4_1, DTYPE_Q4_1)
GQ_ENTRY(q8_0, GQ_Q8_0, DTYPE_Q8_0)

/* The other types: one vec_dot_q8 per pair (batch invariant, not tiled). */
#define GQ_PAIRS(name, type)                                                                       \
    void kern_avx512_gemm_##name##_q8(KERN_GEMM_Q8_ARGS)                                           \
    {                                                                                              \
        kern_gemm_q8_pairs(kern_cpu_fns_avx512.vec_dot_q8[type], w, row_bytes, n_rows, xq, ldxq,   \
                           n_tok, n, y, ldy);                                                      \
    }

GQ_PAIRS(q5_0, DTYPE_Q5_0)
GQ_PAIRS(q4_k, DTYPE_Q4_K)
GQ_PAIRS(q6_k, DTYPE_Q6_K)

/* ---- weights packed once, at load ----
 * Per 16-row panel (rows past the matrix repeat its last row) and block, the raw form of
 * panel_raw: the transposed quant dwords and each row's scale dword. Same size as the panel's
 * GGUF blocks for Q4_0/Q4_1 (Q8_0: 32 bytes more); the GEMMs then expand it per call without
 * gathers or transposes, into exactly what they expand from the GGUF rows (bitwise the same
 * results). Q4_0, Q4_1 and Q8_0 with rows the expansion buffers hold (q8: GQ_BLKS blocks,
 * q16: KERN_G16_BLKS, exact: KERN_PANEL_F32_BLKS, bf16: KERN_PANEL_BF16_BLKS). */
static int panel_nq(uint32_t type)
{
    return type == DTYPE_Q8_0 ? 8 : (type == DTYPE_Q4_0 || type == DTYPE_Q4_1) ? 4 : 0;
}

size_t kern_avx512_panel_bytes(uint32_t type, int64_t n_rows, int64_t n, int act)
{
    int nq = panel_nq(type);
    int64_t nb = n / KERN_QK;
    int64_t most = act == 0   ? KERN_PANEL_F32_BLKS
                   : act == 2 ? KERN_G16_BLKS
                   : act == 3 ? KERN_PANEL_BF16_BLKS
                              : GQ_BLKS;
    if (!nq || n_rows < 1 || n % KERN_QK || nb < 1 || nb > most)
        return 0;
    return (size_t)((n_rows + GQ_ROWS - 1) / GQ_ROWS) * (size_t)nb * PANEL_RAW_BYTES(nq);
}

void kern_avx512_panel_pack(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows,
                            int64_t n, void *dst)
{
    const int nq = panel_nq(type);
    const size_t bb = dtype_row_bytes((enum dtype)type, KERN_QK);
    const size_t qoff = type == DTYPE_Q4_1 ? offsetof(struct kern_block_q4_1, qs)
                        : type == DTYPE_Q4_0 ? offsetof(struct kern_block_q4_0, qs)
                                             : offsetof(struct kern_block_q8_0, qs);
    const int64_t nb = n / KERN_QK;
    uint8_t *o = dst;
    assert(nq && row_bytes * GQ_ROWS + (size_t)n < (size_t)INT32_MAX);
    for (int64_t r0 = 0; r0 < n_rows; r0 += GQ_ROWS) {
        int nr = n_rows - r0 < GQ_ROWS ? (int)(n_rows - r0) : GQ_ROWS;
        const __m512i offs = gq_row_offsets(row_bytes, nr);
        size_t roff[16];
        for (int r = 0; r < 16; r++)
            roff[r] = (size_t)(r < nr ? r : nr - 1) * row_bytes;
        for (int64_t b = 0; b < nb; b++, o += PANEL_RAW_BYTES(nq)) {
            const uint8_t *base = (const uint8_t *)w + (size_t)r0 * row_bytes + (size_t)b * bb;
            __m512i dm, v[8];
            panel_raw(NULL, base, offs, roff, qoff, nq, v, &dm);
            for (int s = 0; s < nq; s++)
                _mm512_store_si512((__m512i *)(o + 64 * s), v[s]);
            _mm512_store_si512((__m512i *)(o + 64 * nq), dm);
        }
    }
}

/* ---- exact mode over packed panels ----
 * Each panel's blocks are dequantized (bitwise as dequant_row: d * q, then + m for Q4_1) into a
 * stack panel of n x 16 floats, lane r = row r. Pair (r, t) is lane r of its accumulators: per
 * 32-element block, blk = fma(w[k], x[t][k], blk) for the block's k in order from 0, then
 * acc = acc + blk, blocks in order. No horizontal sums, and the order depends on nothing but
 * n (per-block partial sums keep the rounding error near the reference's). Tiles are two panels (32 rows) x GP_TOK tokens, so even one
 * token has two independent FMA chains; a lone last panel runs the same per-pair order. Calls
 * of at most GP_FUSE_TOK tokens (single-sequence decode) dequantize in registers instead of
 * through the panel: the same values in the same order, so the same bits. */

#define GP_TOK 7 /* tokens per tile */

/* Element k (0..31) of a block for the 16 rows of a panel, bitwise as dequant_row: v = the
 * block's raw quant vectors (panel_raw), d and m its scales. */
static ALWAYS_INLINE __m512 gp_weight(const __m512i *v, __m512 d, __m512 m, const int k,
                                      const enum gq_kind kind)
{
    if (kind == GQ_Q8_0) {
        __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v[k / 4], 24 - 8 * (k % 4)), 24);
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
    }
    /* k < 16: low nibble of byte k; else high nibble of byte k - 16 */
    const int byte = k % 16, sh = 8 * (byte % 4) + 4 * (k / 16);
    __m512i q = _mm512_and_si512(_mm512_srli_epi32(v[byte / 4], sh), _mm512_set1_epi32(0x0F));
    if (kind == GQ_Q4_0)
        q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
    __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
    return kind == GQ_Q4_1 ? _mm512_add_ps(w, m) : w;
}

/* A block's raw vectors and scales. */
static ALWAYS_INLINE void gp_block(const uint8_t *raw, const enum gq_kind kind, __m512i *v,
                                   __m512 *d, __m512 *m)
{
    __m512i dm;
    panel_raw_load(raw, gq_nq(kind), v, &dm);
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    *m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
}

static ALWAYS_INLINE void gp_expand(const uint8_t *raw, int64_t nb, float *panel,
                                    const enum gq_kind kind)
{
    for (int64_t b = 0; b < nb; b++, raw += PANEL_RAW_BYTES(gq_nq(kind)), panel += KERN_QK * 16) {
        __m512i v[8];
        __m512 d, m;
        gp_block(raw, kind, v, &d, &m);
        UNROLL
        for (int k = 0; k < KERN_QK; k++)
            _mm512_store_ps(panel + k * 16, gp_weight(v, d, m, k, kind));
    }
}

/* One element k of every pair of a tile: blk[p][j] += w_p[k] * x[j][k] (p = panel 0, 1). */
static ALWAYS_INLINE void gp_step(__m512 w0, __m512 w1, const int two, const float *xk,
                                  size_t ldx, const int nt, __m512 (*blk)[GP_TOK])
{
    UNROLL
    for (int j = 0; j < nt; j++) {
        __m512 xv = _mm512_set1_ps(xk[(size_t)j * ldx]);
        blk[0][j] = _mm512_fmadd_ps(w0, xv, blk[0][j]);
        if (two)
            blk[1][j] = _mm512_fmadd_ps(w1, xv, blk[1][j]);
    }
}

/* The end of a block: acc += blk, and blk restarts from zero. */
static ALWAYS_INLINE void gp_fold(__m512 (*acc)[GP_TOK], __m512 (*blk)[GP_TOK], const int nt)
{
    UNROLL
    for (int j = 0; j < nt; j++) {
        acc[0][j] = _mm512_add_ps(acc[0][j], blk[0][j]);
        acc[1][j] = _mm512_add_ps(acc[1][j], blk[1][j]);
        blk[0][j] = blk[1][j] = _mm512_setzero_ps();
    }
}

/* Few tokens: the same pairs in the same order, weights dequantized in registers (no panel). */
#define GP_FUSE_TOK 2
static ALWAYS_INLINE void gp_fused(const uint8_t *r0, const uint8_t *r1, const int two,
                                   int64_t nb, const float *x, size_t ldx, const int nt,
                                   const enum gq_kind kind, __m512 *out)
{
    __m512 acc[2][GP_TOK], blk[2][GP_TOK];
    UNROLL
    for (int j = 0; j < nt; j++)
        acc[0][j] = acc[1][j] = blk[0][j] = blk[1][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const size_t off = (size_t)b * PANEL_RAW_BYTES(gq_nq(kind));
        __m512i v0[8], v1[8];
        __m512 d0, m0, d1 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
        gp_block(r0 + off, kind, v0, &d0, &m0);
        if (two)
            gp_block(r1 + off, kind, v1, &d1, &m1);
        UNROLL
        for (int k = 0; k < KERN_QK; k++) {
            __m512 w0 = gp_weight(v0, d0, m0, k, kind);
            gp_step(w0, two ? gp_weight(v1, d1, m1, k, kind) : w0, two,
                    x + (size_t)b * KERN_QK + (size_t)k, ldx, nt, blk);
        }
        gp_fold(acc, blk, nt);
    }
    UNROLL
    for (int j = 0; j < nt; j++) {
        out[j] = acc[0][j];
        out[GP_TOK + j] = acc[1][j];
    }
}

static ALWAYS_INLINE void gp_tile(const float *p0, const float *p1, const int two, int64_t n,
                                  const float *x, size_t ldx, const int nt, __m512 *out)
{
    __m512 acc[2][GP_TOK], blk[2][GP_TOK];
    UNROLL
    for (int j = 0; j < nt; j++)
        acc[0][j] = acc[1][j] = blk[0][j] = blk[1][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < n; k0 += KERN_QK) {
        for (int64_t k = k0; k < k0 + KERN_QK; k++) {
            __m512 w0 = _mm512_load_ps(p0 + (size_t)k * 16);
            gp_step(w0, two ? _mm512_load_ps(p1 + (size_t)k * 16) : w0, two, x + (size_t)k, ldx,
                    nt, blk);
        }
        gp_fold(acc, blk, nt);
    }
    UNROLL
    for (int j = 0; j < nt; j++) {
        out[j] = acc[0][j];
        out[GP_TOK + j] = acc[1][j];
    }
}

#define GP_CASE(T)                                                                                 \
    case T:                                                                                        \
        if (two)                                                                                   \
            gp_tile(p0, p1, 1, n, x, ldx, T, out);                                                 \
        else                                                                                       \
            gp_tile(p0, p0, 0, n, x, ldx, T, out);                                                 \
        break;

/* out[j]: pair (panel 0 row, token j); out[GP_TOK + j]: panel 1 (when two). */
static void gp_tile_any(const float *p0, const float *p1, int two, int64_t n, const float *x,
                        size_t ldx, int nt, __m512 *out)
{
    switch (nt) {
        GP_CASE(1)
        GP_CASE(2)
        GP_CASE(3)
        GP_CASE(4)
        GP_CASE(5)
        GP_CASE(6)
        GP_CASE(7)
    default:
        assert(0 && "bad tile");
    }
}

static ALWAYS_INLINE void gp_driver(const enum gq_kind kind, KERN_GEMM_PK_ARGS_F32)
{
    const int64_t nb = n / KERN_QK;
    const size_t pstride = (size_t)nb * PANEL_RAW_BYTES(gq_nq(kind));
    _Alignas(64) float panel[2][KERN_PANEL_F32_BLKS * KERN_QK * 16];
    assert(n % KERN_QK == 0 && nb > 0 && nb <= KERN_PANEL_F32_BLKS);
    for (int64_t r0 = 0; r0 < n_rows; r0 += 2 * GQ_ROWS) {
        const int two = r0 + GQ_ROWS < n_rows;
        int nr0 = n_rows - r0 < GQ_ROWS ? (int)(n_rows - r0) : GQ_ROWS;
        int nr1 = two ? (n_rows - r0 - GQ_ROWS < GQ_ROWS ? (int)(n_rows - r0 - GQ_ROWS) : GQ_ROWS) : 0;
        const uint8_t *src = (const uint8_t *)pk + (size_t)(r0 / GQ_ROWS) * pstride;
        const int fuse = n_tok <= GP_FUSE_TOK;
        if (!fuse) {
            gp_expand(src, nb, panel[0], kind);
            if (two)
                gp_expand(src + pstride, nb, panel[1], kind);
        }
        const __mmask16 m0 = (__mmask16)((1u << nr0) - 1), m1 = (__mmask16)((1u << nr1) - 1);
        for (int64_t t0 = 0; t0 < n_tok; t0 += GP_TOK) {
            int nt = n_tok - t0 < GP_TOK ? (int)(n_tok - t0) : GP_TOK;
            __m512 out[2 * GP_TOK];
            if (fuse && two && nt == 1)
                gp_fused(src, src + pstride, 1, nb, x + (size_t)t0 * ldx, ldx, 1, kind, out);
            else if (fuse && two)
                gp_fused(src, src + pstride, 1, nb, x + (size_t)t0 * ldx, ldx, 2, kind, out);
            else if (fuse && nt == 1)
                gp_fused(src, src, 0, nb, x + (size_t)t0 * ldx, ldx, 1, kind, out);
            else if (fuse)
                gp_fused(src, src, 0, nb, x + (size_t)t0 * ldx, ldx, 2, kind, out);
            else
                gp_tile_any(panel[0], panel[1], two, n, x + (size_t)t0 * ldx, ldx, nt, out);
            for (int j = 0; j < nt; j++) {
                float *yr = y + (size_t)(t0 + j) * ldy + r0;
                _mm512_mask_storeu_ps(yr, m0, out[j]);
                if (two)
                    _mm512_mask_storeu_ps(yr + GQ_ROWS, m1, out[GP_TOK + j]);
            }
        }
    }
}

void kern_avx512_gemm_q4_0_f32_packed(KERN_GEMM_PK_ARGS_F32)
{
    gp_driver(GQ_Q4_0, pk, n_rows, x, ldx, n_tok, n, y, ldy);
}

void kern_avx512_gemm_q4_1_f32_packed(KERN_GEMM_PK_ARGS_F32)
{
    gp_driver(GQ_Q4_1, pk, n_rows, x, ldx, n_tok, n, y, ldy);
}

void kern_avx512_gemm_q8_0_f32_packed(KERN_GEMM_PK_ARGS_F32)
{
    gp_driver(GQ_Q8_0, pk, n_rows, x, ldx, n_tok, n, y, ldy);
}

/* ---- exact mode on AMX-BF16 tiles (the AMX table) ----
 * The weights' integer quants are exact in bfloat16 (0..15, -8..7, -128..127), and every f32
 * activation is exactly the sum of three bfloat16 parts: hi = its top 16 bits, mid = the top
 * 16 bits of x - hi, lo = the rest (at most 8 significant bits left). So per 32-element block
 * tdpbf16ps computes the exact products q * part and sums them in f32 (3 products into one tile
 * per block); the block sum S is then scaled as the float kernels do, blocks in order:
 *   acc = fma(d, S, acc);  Q4_1 only: acc = fma(m, X, acc)   (X: the block's f32 element sum)
 * Tile rows are tokens, columns the 16 rows of a panel; a row's result does not depend on the
 * other rows of its tile (checked bit for bit by test_gemm_x3), so results are batch
 * invariant. Per 16-token group and block, prep_x3's layout is the hi, mid and lo tiles
 * (16 tokens x 32 bf16, 1 KiB each) and the 16 tokens' block sums X. */

#define X3_BLK_BYTES (3 * 1024 + 64) /* one group's block in prep_x3's output */
#define X3_BLKS      48              /* longest rows (in blocks): a panel's B tiles, 48 KiB */
#define AMX_BF16     __attribute__((target("amx-tile,amx-bf16")))

_Static_assert(KERN_X3_BYTES(16, 32) == X3_BLK_BYTES, "prep_x3 layout");

/* The upper halves of a's and b's 16 floats, in order: 32 bfloat16 (as words). */
static ALWAYS_INLINE __m512i x3_pack(__m512i a, __m512i b)
{
    const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                         35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9,
                                         7, 5, 3, 1);
    return _mm512_permutex2var_epi16(a, idx, b);
}

static void x3_prep(const float *x, size_t ldx, int64_t n_tok, int64_t n, void *xs)
{
    const int64_t nb = n / KERN_QK;
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    assert(n % KERN_QK == 0);
    for (int64_t g = 0; g * 16 < n_tok; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = (uint8_t *)xs + ((size_t)g * (size_t)nb + (size_t)b) * X3_BLK_BYTES;
            float *sum = (float *)(o + 3 * 1024);
            for (int j = 0; j < 16; j++) {
                const int64_t t = g * 16 + j;
                if (t >= n_tok) { /* padding rows: zero products, results not stored */
                    for (int p = 0; p < 3; p++)
                        _mm512_store_si512((__m512i *)(o + p * 1024 + j * 64),
                                           _mm512_setzero_si512());
                    sum[j] = 0;
                    continue;
                }
                const float *xr = x + (size_t)t * ldx + (size_t)b * KERN_QK;
                __m512 a = _mm512_loadu_ps(xr), c = _mm512_loadu_ps(xr + 16);
                __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
                __m512 ch = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(c), top));
                __m512 ar = _mm512_sub_ps(a, ah), cr = _mm512_sub_ps(c, ch);
                __m512 am = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(ar), top));
                __m512 cm = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(cr), top));
                __m512 al = _mm512_sub_ps(ar, am), cl = _mm512_sub_ps(cr, cm); /* exact bf16 */
                _mm512_store_si512((__m512i *)(o + j * 64),
                                   x3_pack(_mm512_castps_si512(ah), _mm512_castps_si512(ch)));
                _mm512_store_si512((__m512i *)(o + 1024 + j * 64),
                                   x3_pack(_mm512_castps_si512(am), _mm512_castps_si512(cm)));
                _mm512_store_si512((__m512i *)(o + 2048 + j * 64),
                                   x3_pack(_mm512_castps_si512(al), _mm512_castps_si512(cl)));
                sum[j] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
            }
        }
}

/* One block of a panel as the B tile (16 k-pairs x 16 rows x 2 bf16: row kp, lane r = row r's
 * quants 2kp, 2kp + 1), and its rows' scales and (Q4_1) offsets. */
static ALWAYS_INLINE void x3_expand(const uint8_t *raw, const enum gq_kind kind, __m512i lut,
                                    uint16_t *bt, float *d, float *m)
{
    __m512i v[8], dm;
    panel_raw_load(raw, gq_nq(kind), v, &dm);
    const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    _mm512_store_ps(d, dv);
    /* Q4_1's quants are centred like Q4_0's (q - 8, the lut) and the offset moves by 8 d:
     * d (q - 8) + (m + 8 d). The offset term is then small and cancels little of the sum. */
    _mm512_store_ps(m, _mm512_fmadd_ps(dv, _mm512_set1_ps(8.0f),
                                       _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)))));
    UNROLL
    for (int kp = 0; kp < 16; kp++) {
        const int k = 2 * kp;
        __m512i row;
        if (kind == GQ_Q8_0) { /* signed bytes k, k + 1 of dword k / 4 */
            __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(v[k / 4], 24 - 8 * (k % 4)), 24);
            __m512i hi = _mm512_srai_epi32(_mm512_slli_epi32(v[k / 4], 16 - 8 * (k % 4)), 24);
            __m512i flo = _mm512_castps_si512(_mm512_cvtepi32_ps(lo));
            __m512i fhi = _mm512_castps_si512(_mm512_cvtepi32_ps(hi));
            row = _mm512_or_si512(_mm512_srli_epi32(flo, 16),
                                  _mm512_and_si512(fhi, _mm512_set1_epi32((int)0xFFFF0000u)));
        } else { /* nibbles of bytes k % 16, k % 16 + 1 (high nibbles for k >= 16) */
            const int byte = k % 16, sh = 8 * (byte % 4) + 4 * (k / 16);
            __m512i t = _mm512_srli_epi32(v[byte / 4], sh);
            __m512i idx = _mm512_or_si512(_mm512_and_si512(t, _mm512_set1_epi32(0x0F)),
                                          _mm512_and_si512(_mm512_slli_epi32(t, 8),
                                                           _mm512_set1_epi32(0x0F0000)));
            row = _mm512_permutexvar_epi16(idx, lut);
        }
        _mm512_store_si512((__m512i *)(bt + 32 * kp), row);
    }
}

/* Tiles 0-1: C (tokens x 16 rows f32, even and odd blocks); 2-3: B (a panel's even and odd
 * block, 16 k-pairs); 4-6: A (the hi, mid and lo parts of the tokens' block). x3_cfg[r - 1]: r token rows, so a
 * group of fewer than 16 tokens loads, multiplies and stores only those. Static: the compiler
 * does not see ldtilecfg read its operand. */
#define X3_CFG(r)                                                                                  \
    {                                                                                              \
        .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64}, .rows = {r, r, 16, 16, r, r, r },     \
    }
static const struct amx_cfg x3_cfg[16] = {
    X3_CFG(1),  X3_CFG(2),  X3_CFG(3),  X3_CFG(4),  X3_CFG(5),  X3_CFG(6),  X3_CFG(7),  X3_CFG(8),
    X3_CFG(9),  X3_CFG(10), X3_CFG(11), X3_CFG(12), X3_CFG(13), X3_CFG(14), X3_CFG(15), X3_CFG(16),
};

/* The tile stores are opaque to the compiler: tell it which memory they write. */
#define X3_STORED(t, buf)                                                                          \
    do {                                                                                           \
        _tile_stored(t, buf, 64);                                                                  \
        __asm__ volatile("" : "+m"(*(float(*)[16][16])(buf)));                                     \
    } while (0)

/* Block b's product into tile C (B tile TB); stored and folded one block later, so the tile
 * unit works on the next block while the vector units fold this one. */
#define X3_ISSUE(C, TB, b)                                                                         \
    do {                                                                                           \
        const uint8_t *xb_ = xg + (size_t)(b) * X3_BLK_BYTES;                                      \
        _tile_zero(C);                                                                             \
        _tile_loadd(TB, bt + (size_t)(b) * 512, 64);                                               \
        _tile_loadd(4, xb_, 64);                                                                   \
        _tile_dpbf16ps(C, 4, TB);                                                                  \
        _tile_loadd(5, xb_ + 1024, 64);                                                            \
        _tile_dpbf16ps(C, 5, TB);                                                                  \
        _tile_loadd(6, xb_ + 2048, 64);                                                            \
        _tile_dpbf16ps(C, 6, TB);                                                                  \
    } while (0)

/* Block b's stored product c into the nt tokens' sums (acc = fma(d, S, acc), Q4_1 also
 * acc = fma(m, X, acc)); pf: the next panel group's weights to prefetch meanwhile, or NULL. */
static ALWAYS_INLINE void x3_fold(__m512 *acc, const float (*c)[16], const float *d,
                                  const float *m, const uint8_t *xg, int64_t b, const int nt,
                                  const uint8_t *pf, size_t bb, const enum gq_kind kind)
{
    const float *sum = (const float *)(xg + (size_t)b * X3_BLK_BYTES + 3 * 1024);
    const __m512 dv = _mm512_load_ps(d), mv = _mm512_load_ps(m);
    if (pf)
        for (size_t o = 0; o < bb; o += 64)
            _mm_prefetch((const char *)pf + (size_t)b * bb + o, _MM_HINT_T0);
    UNROLL
    for (int j = 0; j < 16; j++)
        if (j < nt) {
            acc[j] = _mm512_fmadd_ps(dv, _mm512_load_ps(c[j]), acc[j]);
            if (kind == GQ_Q4_1)
                acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sum[j]), acc[j]);
        }
}

/* One panel (expanded B tiles bt, scales bd / bm) times one token group (prep_x3 rows xg, nt
 * tokens, the tile configuration for nt rows loaded) into y's rows r0 .. r0 + nr - 1. The sums
 * stay in registers; the fold of block b overlaps the tile products of block b + 1. */
static ALWAYS_INLINE AMX_BF16 void x3_panel(const enum gq_kind kind, const uint16_t *bt,
                                            float (*bd)[16], float (*bm)[16], const uint8_t *xg,
                                            int64_t nb, const int nt, const uint8_t *pf,
                                            size_t bb, float *y, size_t ldy, int nr)
{
    _Alignas(64) float cb[2][16][16];
    __m512 acc[16];
    UNROLL
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_setzero_ps();
    X3_ISSUE(0, 2, 0);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb)
            X3_ISSUE(1, 3, b + 1);
        X3_STORED(0, cb[0]);
        x3_fold(acc, (const float(*)[16])cb[0], bd[b], bm[b], xg, b, nt, pf, bb, kind);
        if (b + 1 >= nb)
            break;
        if (b + 2 < nb)
            X3_ISSUE(0, 2, b + 2);
        X3_STORED(1, cb[1]);
        x3_fold(acc, (const float(*)[16])cb[1], bd[b + 1], bm[b + 1], xg, b + 1, nt, pf, bb,
                kind);
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    UNROLL
    for (int j = 0; j < 16; j++)
        if (j < nt)
            _mm512_mask_storeu_ps(y + (size_t)j * ldy, m, acc[j]);
}
#undef X3_ISSUE

/* Rows are taken in groups of panels whose B tiles (all blocks) fit in X3_BT_BYTES, expanded
 * once per call; then every 16-token group runs through each panel of the group. */
#define X3_BT_BYTES (256 * 1024)
#define X3_GROUP    8 /* panels per group at most */

static ALWAYS_INLINE AMX_BF16 void x3_driver(const enum gq_kind kind, const void *pk,
                                             int64_t n_rows, const void *xs, int64_t n_tok,
                                             int64_t n, float *y, size_t ldy)
{
    const int64_t nb = n / KERN_QK;
    const size_t bb = PANEL_RAW_BYTES(gq_nq(kind));
    const size_t pstride = (size_t)nb * bb;
    const size_t gstride = (size_t)nb * X3_BLK_BYTES;
    _Alignas(64) uint16_t bt[X3_BT_BYTES / sizeof(uint16_t)];
    _Alignas(64) float bd[X3_GROUP][X3_BLKS][16], bm[X3_GROUP][X3_BLKS][16];
    assert(n % KERN_QK == 0 && nb > 0 && nb <= X3_BLKS);
    int group = (int)(X3_BT_BYTES / (1024 * (size_t)nb));
    group = group < X3_GROUP ? group : X3_GROUP;
    if (n_tok <= 16) /* one token group: nothing to share; start computing sooner */
        group = 1;
    const __m512i q = _mm512_sub_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                                        3, 2, 1, 0),
                                       _mm512_set1_epi32(kind == GQ_Q8_0 ? 0 : 8));
    const __m512i lut = _mm512_zextsi256_si512(_mm512_cvtepi32_epi16(
        _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(q)), 16)));
    const int64_t n_panels = (n_rows + 15) / 16;
    int rows = 0; /* token rows of the loaded tile configuration */
    for (int64_t p0 = 0; p0 < n_panels; p0 += group) {
        const int np = n_panels - p0 < group ? (int)(n_panels - p0) : group;
        const uint8_t *raw = (const uint8_t *)pk + (size_t)p0 * pstride;
        for (int p = 0; p < np; p++)
            for (int64_t b = 0; b < nb; b++)
                x3_expand(raw + (size_t)p * pstride + (size_t)b * bb, kind, lut,
                          bt + ((size_t)p * (size_t)nb + (size_t)b) * 512, bd[p][b], bm[p][b]);
        AMX_FENCE();
        for (int64_t t0 = 0; t0 < n_tok; t0 += 16) {
            const int nt = n_tok - t0 < 16 ? (int)(n_tok - t0) : 16;
            const uint8_t *xg = (const uint8_t *)xs + (size_t)(t0 / 16) * gstride;
            if (nt != rows) {
                _tile_loadconfig(&x3_cfg[nt - 1]);
                rows = nt;
            }
            for (int p = 0; p < np; p++) {
                const int64_t r0 = (p0 + p) * 16;
                const int nr = n_rows - r0 < 16 ? (int)(n_rows - r0) : 16;
                /* while the first token group runs, the next group's weights stream in */
                const uint8_t *pf = t0 == 0 && p0 + np + p < n_panels
                                        ? raw + (size_t)(np + p) * pstride
                                        : NULL;
                const uint16_t *bp = bt + (size_t)p * (size_t)nb * 512;
                float *yr = y + (size_t)t0 * ldy + r0;
                if (nt == 16) /* the common case, unrolled with no row tests */
                    x3_panel(kind, bp, bd[p], bm[p], xg, nb, 16, pf, bb, yr, ldy, nr);
                else
                    x3_panel(kind, bp, bd[p], bm[p], xg, nb, nt, pf, bb, yr, ldy, nr);
            }
        }
    }
    _tile_release();
}

/* The AMX GEMM entry points: mode (x3, bf16)'s driver for one weight type. */
#define AMX_ENTRY(attr, mode, name, kind)                                                          \
    static attr void amx_gemm_##name##_##mode##_packed(const void *pk, int64_t n_rows,             \
                                                       const void *xs, int64_t n_tok, int64_t n,   \
                                                       float *y, size_t ldy)                       \
    {                                                                                              \
        mode##_driver(kind, pk, n_rows, xs, n_tok, n, y, ldy);                                     \
    }
AMX_ENTRY(AMX_BF16, x3, q4_0, GQ_Q4_0)
AMX_ENTRY(AMX_BF16, x3, q4_1, GQ_Q4_1)
AMX_ENTRY(AMX_BF16, x3, q8_0, GQ_Q8_0)

/* ---- bf16 mode on AMX-BF16 tiles (the AMX table) ----
 * Activations and dequantized weights are both rounded to bfloat16 (nearest even; subnormals
 * are flushed to zero by the conversion and the tile unit), and tdpbf16ps sums their exact
 * products in f32 over the whole row: the tile of sums stays in the tile unit from the first
 * block to the last, with no per-block scale fold (the scales are inside the weights). Within a
 * block, elements k and k + 16 form the pair one tile lane multiplies (Q4 keeps both in one
 * byte), the same order for every call. Tile rows are tokens, columns the 16 rows of a panel:
 * a (row, token) result depends on nothing else, so results are batch invariant.
 * prep_bf16's layout is row-major: token t's n values at xs + t * n (as bf16 words), each
 * 32-element block stored as the pairs (x[k], x[k + 16]), k = 0..15. */

#define AMX_BF16X __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define BF_GROUP  16 /* panels per group at most */

/* Words 0..15 of lo's and hi's values rounded to bfloat16, interleaved: dword i = (lo[i],
 * hi[i]). */
static ALWAYS_INLINE AMX_BF16X __m512i bf_pair(__m512 lo, __m512 hi)
{
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

static AMX_BF16X void bf_prep(const float *x, size_t ldx, int64_t n_tok, int64_t n, void *xs)
{
    assert(n % KERN_QK == 0);
    for (int64_t t = 0; t < n_tok; t++) {
        const float *xr = x + (size_t)t * ldx;
        uint16_t *o = (uint16_t *)xs + (size_t)t * (size_t)n;
        for (int64_t k = 0; k < n; k += KERN_QK)
            _mm512_storeu_si512((__m512i *)(o + k),
                                bf_pair(_mm512_loadu_ps(xr + k), _mm512_loadu_ps(xr + k + 16)));
    }
}

/* One block of a panel as a B tile: row kp, dword r = row r's weights kp and kp + 16 (as
 * dequant_row computes them) rounded to bfloat16. For Q4 both come from byte kp: the low
 * nibble q gives fma(d, q, m), the high one, kept in place as 16 q, fma(d / 16, 16 q, m); d q
 * and (d / 16)(16 q) are exact, so each is dequant_row's d q + m rounded once (Q4_0: m = -8 d,
 * d q - 8 d = d (q - 8) exactly). */
static ALWAYS_INLINE AMX_BF16X void bf_expand(const uint8_t *raw, const enum gq_kind kind,
                                              uint16_t *bt)
{
    __m512i v[8];
    __m512 d, m;
    gp_block(raw, kind, v, &d, &m);
    if (kind == GQ_Q8_0) {
        UNROLL
        for (int kp = 0; kp < 16; kp++)
            _mm512_store_si512((__m512i *)(bt + 32 * kp),
                               bf_pair(gp_weight(v, d, m, kp, kind),
                                       gp_weight(v, d, m, kp + 16, kind)));
        return;
    }
    if (kind == GQ_Q4_0)
        m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    const __m512 d16 = _mm512_mul_ps(d, _mm512_set1_ps(1.0f / 16));
    UNROLL
    for (int kp = 0; kp < 16; kp++) {
        const __m512i t = kp % 4 ? _mm512_srli_epi32(v[kp / 4], 8 * (kp % 4)) : v[kp / 4];
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(t, _mm512_set1_epi32(0x0F)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_and_si512(t, _mm512_set1_epi32(0xF0)));
        _mm512_store_si512((__m512i *)(bt + 32 * kp),
                           bf_pair(_mm512_fmadd_ps(d, lo, m), _mm512_fmadd_ps(d16, hi, m)));
    }
}

/* Tiles 0-1: C of the first token group (panels p, p + 1), 2-3: C of the second; 4-5: A (the
 * two token groups' block), 6-7: B (the two panels' block). bf_cfg[nt - 1]: nt (1..32) tokens,
 * the first group min(nt, 16) rows, the second the rest. */
#define BF_R0(t) ((t) < 16 ? (t) : 16)
#define BF_R1(t) ((t) > 16 ? (t) - 16 : 1)
#define BF_CFG(t)                                                                                  \
    {                                                                                              \
        .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64},                                   \
        .rows = {BF_R0(t), BF_R0(t), BF_R1(t), BF_R1(t), BF_R0(t), BF_R1(t), 16, 16},              \
    }
static const struct amx_cfg bf_cfg[32] = {
    BF_CFG(1),  BF_CFG(2),  BF_CFG(3),  BF_CFG(4),  BF_CFG(5),  BF_CFG(6),  BF_CFG(7),
    BF_CFG(8),  BF_CFG(9),  BF_CFG(10), BF_CFG(11), BF_CFG(12), BF_CFG(13), BF_CFG(14),
    BF_CFG(15), BF_CFG(16), BF_CFG(17), BF_CFG(18), BF_CFG(19), BF_CFG(20), BF_CFG(21),
    BF_CFG(22), BF_CFG(23), BF_CFG(24), BF_CFG(25), BF_CFG(26), BF_CFG(27), BF_CFG(28),
    BF_CFG(29), BF_CFG(30), BF_CFG(31), BF_CFG(32),
};

/* Tile C (nt token rows) into y's columns 0 .. nr - 1: straight from the tile when all 16
 * are ours, else through a buffer. */
#define BF_STORE(C, yp, nt, nr)                                                                    \
    do {                                                                                           \
        if ((nr) == 16) {                                                                          \
            _tile_stored(C, yp, ldy * sizeof(float));                                              \
        } else {                                                                                   \
            _Alignas(64) float cb_[16][16];                                                        \
            X3_STORED(C, cb_);                                                                     \
            for (int j_ = 0; j_ < (nt); j_++)                                                      \
                _mm512_mask_storeu_ps((yp) + (size_t)j_ * ldy, (__mmask16)((1u << (nr)) - 1),      \
                                      _mm512_load_ps(cb_[j_]));                                    \
        }                                                                                          \
    } while (0)

/* Panels b0 (and b1 when two) times the token groups at a (and a + 16 rows when g2) over all
 * nb blocks, into tiles 0-3; the tile configuration for these token rows is loaded. */
static ALWAYS_INLINE AMX_BF16X void bf_loop(const uint16_t *b0, const uint16_t *b1, const int two,
                                            const uint16_t *a, int64_t n, const int g2)
{
    const int64_t nb = n / KERN_QK;
    const size_t lda = (size_t)n * sizeof(uint16_t);
    const uint16_t *a1 = a + 16 * (size_t)n;
    _tile_zero(0);
    if (two)
        _tile_zero(1);
    if (g2) {
        _tile_zero(2);
        if (two)
            _tile_zero(3);
    }
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(4, a + b * KERN_QK, lda);
        _tile_stream_loadd(6, b0 + b * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_stream_loadd(7, b1 + b * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (g2) {
            _tile_loadd(5, a1 + b * KERN_QK, lda);
            _tile_dpbf16ps(2, 5, 6);
            if (two)
                _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* bf_loop, then its tiles into y (nt0 / nt1 token rows, nr0 / nr1 panel rows). */
static ALWAYS_INLINE AMX_BF16X void bf_tiles(const uint16_t *b0, const uint16_t *b1,
                                             const int two, const uint16_t *a, int64_t n,
                                             const int g2, int nt0, int nt1, float *y,
                                             size_t ldy, int nr0, int nr1)
{
    bf_loop(b0, b1, two, a, n, g2);
    BF_STORE(0, y, nt0, nr0);
    if (two)
        BF_STORE(1, y + 16, nt0, nr1);
    if (g2) {
        BF_STORE(2, y + 16 * ldy, nt1, nr0);
        if (two)
            BF_STORE(3, y + 16 * ldy + 16, nt1, nr1);
    }
    AMX_FENCE(); /* y was written behind the compiler's back */
}

/* Greedy epilogue: token rows 0 .. nt - 1 of tile C (panel rows row0 .. row0 + nr - 1 of the
 * matrix) into each token's running best (bv, bi): the largest value, NaN never winning, and
 * its first row. Rows reach a token in increasing order, so a strictly larger value is the only
 * update: ties keep the lower row. */
#define BF_ARGMAX(C, nt, nr, row0, bv, bi)                                                         \
    do {                                                                                           \
        _Alignas(64) float c_[16][16];                                                             \
        X3_STORED(C, c_);                                                                          \
        const __mmask16 rm_ = (__mmask16)((1u << (nr)) - 1);                                       \
        for (int j_ = 0; j_ < (nt); j_++) {                                                        \
            __m512 v_ = _mm512_load_ps(c_[j_]);                                                    \
            const __mmask16 ok_ = _mm512_cmp_ps_mask(v_, v_, _CMP_ORD_Q) & rm_;                   \
            v_ = _mm512_mask_mov_ps(_mm512_set1_ps(-1.0f / 0.0f), ok_, v_);                        \
            const float m_ = _mm512_reduce_max_ps(v_);                                             \
            if (m_ > (bv)[j_]) {                                                                   \
                (bv)[j_] = m_;                                                                     \
                (bi)[j_] = (int32_t)(row0) +                                                       \
                           __builtin_ctz(_mm512_cmp_ps_mask(v_, _mm512_set1_ps(m_), _CMP_EQ_OQ)); \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Rows in groups of panels whose B tiles fit in X3_BT_BYTES, expanded once per call; every
 * pair of 16-token groups then runs over the group's panels two at a time: the token pair's
 * activation tiles stay in L1 while the B tiles stream from L2 (loaded with the streaming
 * hint; ~8 % faster end to end than the other loop order, A streaming). */
static ALWAYS_INLINE AMX_BF16X void bf16_run(const enum gq_kind kind, const void *pk,
                                             int64_t n_rows, const void *xs, int64_t n_tok,
                                             int64_t n, float *y, size_t ldy, const int argmax,
                                             int64_t rbase, float *bv, int32_t *bi)
{
    const int64_t nb = n / KERN_QK;
    const size_t bb = PANEL_RAW_BYTES(gq_nq(kind));
    const size_t pstride = (size_t)nb * bb;
    _Alignas(64) uint16_t bt[X3_BT_BYTES / sizeof(uint16_t)];
    assert(n % KERN_QK == 0 && nb > 0 && nb <= KERN_PANEL_BF16_BLKS);
    int group = (int)(X3_BT_BYTES / (1024 * (size_t)nb)); /* >= 2 */
    group = group < BF_GROUP ? group : BF_GROUP;
    if (n_tok <= 32) /* one pass over the tokens: nothing to share, start computing sooner */
        group = 2;
    const int64_t n_panels = (n_rows + 15) / 16;
    int cfg = 0; /* tokens of the loaded tile configuration */
    for (int64_t p0 = 0; p0 < n_panels; p0 += group) {
        const int np = n_panels - p0 < group ? (int)(n_panels - p0) : group;
        const uint8_t *raw = (const uint8_t *)pk + (size_t)p0 * pstride;
        for (int p = 0; p < np; p++)
            for (int64_t b = 0; b < nb; b++)
                bf_expand(raw + (size_t)p * pstride + (size_t)b * bb, kind,
                          bt + ((size_t)p * (size_t)nb + (size_t)b) * 512);
        AMX_FENCE();
        for (int64_t t0 = 0; t0 < n_tok; t0 += 32) {
            const int nt = n_tok - t0 < 32 ? (int)(n_tok - t0) : 32;
            const int nt0 = nt < 16 ? nt : 16, nt1 = nt - nt0;
            const uint16_t *a = (const uint16_t *)xs + (size_t)t0 * (size_t)n;
            if (nt != cfg) {
                _tile_loadconfig(&bf_cfg[nt - 1]);
                cfg = nt;
            }
            for (int p = 0; p < np; p += 2) {
                const int64_t r0 = (p0 + p) * 16;
                const int two = p + 1 < np;
                const int nr0 = n_rows - r0 < 16 ? (int)(n_rows - r0) : 16;
                const int nr1 = two ? (n_rows - r0 - 16 < 16 ? (int)(n_rows - r0 - 16) : 16) : 0;
                const uint16_t *bp = bt + (size_t)p * (size_t)nb * 512;
                if (argmax) { /* per token: panel p's rows, then panel p + 1's */
                    bf_loop(bp, bp + nb * 512, two, a, n, nt1 > 0);
                    BF_ARGMAX(0, nt0, nr0, rbase + r0, bv + t0, bi + t0);
                    if (two)
                        BF_ARGMAX(1, nt0, nr1, rbase + r0 + 16, bv + t0, bi + t0);
                    if (nt1 > 0) {
                        BF_ARGMAX(2, nt1, nr0, rbase + r0, bv + t0 + 16, bi + t0 + 16);
                        if (two)
                            BF_ARGMAX(3, nt1, nr1, rbase + r0 + 16, bv + t0 + 16, bi + t0 + 16);
                    }
                    continue;
                }
                float *yr = y + (size_t)t0 * ldy + r0;
                if (nt == 32 && two) /* the common case */
                    bf_tiles(bp, bp + nb * 512, 1, a, n, 1, 16, 16, yr, ldy, nr0, nr1);
                else
                    bf_tiles(bp, bp + nb * 512, two, a, n, nt1 > 0, nt0, nt1, yr, ldy, nr0, nr1);
            }
        }
    }
    _tile_release();
}

/* gemm_bf16_packed: bf16_run storing its tiles into y. */
static ALWAYS_INLINE AMX_BF16X void bf16_driver(const enum gq_kind kind, const void *pk,
                                                int64_t n_rows, const void *xs, int64_t n_tok,
                                                int64_t n, float *y, size_t ldy)
{
    bf16_run(kind, pk, n_rows, xs, n_tok, n, y, ldy, 0, 0, NULL, NULL);
}

AMX_ENTRY(AMX_BF16X, bf16, q4_0, GQ_Q4_0)
AMX_ENTRY(AMX_BF16X, bf16, q4_1, GQ_Q4_1)
AMX_ENTRY(AMX_BF16X, bf16, q8_0, GQ_Q8_0)

#define AMX_ARGMAX_ENTRY(name, kind)                                                               \
    static AMX_BF16X void amx_gemm_##name##_bf16_argmax(const void *pk, int64_t n_rows,            \
                                                         const void *xs, int64_t n_tok, int64_t n, \
                                                         int64_t r0, float *bv, int32_t *bi)       \
    {                                                                                              \
        bf16_run(kind, pk, n_rows, xs, n_tok, n, NULL, 0, 1, r0, bv, bi);                         \
    }
AMX_ARGMAX_ENTRY(q4_0, GQ_Q4_0)
AMX_ARGMAX_ENTRY(q4_1, GQ_Q4_1)
AMX_ARGMAX_ENTRY(q8_0, GQ_Q8_0)

/* The SwiGLU of one token group's gate tile C (panel rows r0 ..) and up tile CU, as
 * prep_bf16 of the SwiGLU'd rows would write them: token j's value for row r is word
 * 2 (r % 16) + (r % 32) / 16 of its block r / 32 (r0 is a multiple of 16, so the 16 rows of
 * the panel fill the even or the odd words of one block). */
#define BF_SWIGLU_STORE(C, CU, o, nt, r0, ldo)                                                     \
    do {                                                                                           \
        _Alignas(64) float g_[16][16], u_[16][16];                                                 \
        X3_STORED(C, g_);                                                                          \
        X3_STORED(CU, u_);                                                                         \
        const int odd_ = (int)(((r0) / 16) % 2);                                                   \
        const __mmask32 wm_ = odd_ ? 0xAAAAAAAAu : 0x55555555u;                                    \
        uint16_t *ob_ = (uint16_t *)(o) + (size_t)(r0) / 32 * 32;                                  \
        for (int j_ = 0; j_ < (nt); j_++) {                                                        \
            const __m512 h_ = swiglu16(_mm512_load_ps(g_[j_]), _mm512_load_ps(u_[j_]));            \
            __m512i w_ = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(h_));                   \
            if (odd_)                                                                              \
                w_ = _mm512_slli_epi32(w_, 16);                                                    \
            _mm512_mask_storeu_epi16(ob_ + (size_t)j_ * (ldo), wm_, w_);                           \
        }                                                                                          \
    } while (0)

/* The fused first half of the FFN: for rows [0, n_rows) of gate and up (panels packed at load,
 * the same type), h = silu(gate x) * up x per token, written straight as the down projection's
 * prep_bf16 input (o: token t's n_ff words at o + t * ldo, this call's rows starting at row
 * r0 of it). Gate and up panels p run as a tile pair, so each (row, token) value is bitwise
 * what the two GEMMs, kern_avx512_swiglu and prep_bf16 compute one after another. */
static ALWAYS_INLINE AMX_BF16X void bf16_swiglu_driver(const enum gq_kind kind, const void *pg,
                                                       const void *pu, int64_t n_rows,
                                                       const void *xs, int64_t n_tok, int64_t n,
                                                       void *o, int64_t r0, size_t ldo)
{
    const int64_t nb = n / KERN_QK;
    const size_t bb = PANEL_RAW_BYTES(gq_nq(kind));
    const size_t pstride = (size_t)nb * bb;
    _Alignas(64) uint16_t bt[X3_BT_BYTES / sizeof(uint16_t)];
    assert(n % KERN_QK == 0 && nb > 0 && nb <= KERN_PANEL_BF16_BLKS);
    assert(n_rows % 16 == 0 && r0 % 16 == 0);
    int group = (int)(X3_BT_BYTES / (2048 * (size_t)nb)); /* panel pairs, >= 1 */
    group = group < BF_GROUP / 2 ? group : BF_GROUP / 2;
    if (n_tok <= 32)
        group = 1;
    const int64_t n_panels = n_rows / 16;
    int cfg = 0;
    for (int64_t p0 = 0; p0 < n_panels; p0 += group) {
        const int np = n_panels - p0 < group ? (int)(n_panels - p0) : group;
        for (int p = 0; p < np; p++)
            for (int64_t b = 0; b < nb; b++) {
                const size_t off = (size_t)(p0 + p) * pstride + (size_t)b * bb;
                uint16_t *dst = bt + ((size_t)(2 * p) * (size_t)nb + (size_t)b) * 512;
                bf_expand((const uint8_t *)pg + off, kind, dst);
                bf_expand((const uint8_t *)pu + off, kind, dst + (size_t)nb * 512);
            }
        AMX_FENCE();
        for (int64_t t0 = 0; t0 < n_tok; t0 += 32) {
            const int nt = n_tok - t0 < 32 ? (int)(n_tok - t0) : 32;
            const int nt0 = nt < 16 ? nt : 16, nt1 = nt - nt0;
            const uint16_t *a = (const uint16_t *)xs + (size_t)t0 * (size_t)n;
            uint16_t *ot = (uint16_t *)o + (size_t)t0 * ldo;
            if (nt != cfg) {
                _tile_loadconfig(&bf_cfg[nt - 1]);
                cfg = nt;
            }
            for (int p = 0; p < np; p++) {
                const uint16_t *bp = bt + (size_t)(2 * p) * (size_t)nb * 512;
                const int64_t r = r0 + (p0 + p) * 16;
                bf_loop(bp, bp + nb * 512, 1, a, n, nt1 > 0);
                BF_SWIGLU_STORE(0, 1, ot, nt0, r, ldo);
                if (nt1 > 0)
                    BF_SWIGLU_STORE(2, 3, ot + 16 * ldo, nt1, r, ldo);
            }
        }
    }
    _tile_release();
}

#define AMX_SWIGLU_ENTRY(name, kind)                                                               \
    static AMX_BF16X void amx_gemm_##name##_bf16_swiglu(const void *pg, const void *pu,            \
                                                         int64_t n_rows, const void *xs,           \
                                                         int64_t n_tok, int64_t n, void *o,        \
                                                         int64_t r0, size_t ldo)                   \
    {                                                                                              \
        bf16_swiglu_driver(kind, pg, pu, n_rows, xs, n_tok, n, o, r0, ldo);                        \
    }
AMX_SWIGLU_ENTRY(q4_0, GQ_Q4_0)
AMX_SWIGLU_ENTRY(q4_1, GQ_Q4_1)
AMX_SWIGLU_ENTRY(q8_0, GQ_Q8_0)

void kern_amx_patch(struct kern_cpu_fns *f)
{
    f->prep_bf16 = bf_prep;
    f->gemm_bf16_packed[DTYPE_Q4_0] = amx_gemm_q4_0_bf16_packed;
    f->gemm_bf16_packed[DTYPE_Q4_1] = amx_gemm_q4_1_bf16_packed;
    f->gemm_bf16_packed[DTYPE_Q8_0] = amx_gemm_q8_0_bf16_packed;
    f->gemm_bf16_argmax[DTYPE_Q4_0] = amx_gemm_q4_0_bf16_argmax;
    f->gemm_bf16_argmax[DTYPE_Q4_1] = amx_gemm_q4_1_bf16_argmax;
    f->gemm_bf16_argmax[DTYPE_Q8_0] = amx_gemm_q8_0_bf16_argmax;
    f->gemm_bf16_swiglu[DTYPE_Q4_0] = amx_gemm_q4_0_bf16_swiglu;
    f->gemm_bf16_swiglu[DTYPE_Q4_1] = amx_gemm_q4_1_bf16_swiglu;
    f->gemm_bf16_swiglu[DTYPE_Q8_0] = amx_gemm_q8_0_bf16_swiglu;
    f->prep_x3 = x3_prep;
    f->attn_tiles = kern_amx_attn_tiles;
    f->kv_store_tiles = kern_amx_kv_store_tiles;
    f->gemm_x3_packed[DTYPE_Q4_0] = amx_gemm_q4_0_x3_packed;
    f->gemm_x3_packed[DTYPE_Q4_1] = amx_gemm_q4_1_x3_packed;
    f->gemm_x3_packed[DTYPE_Q8_0] = amx_gemm_q8_0_x3_packed;
}

/* ---- int8 peak: vpdpbusd throughput ---- */

#define PEAK_CHAINS 16 /* independent accumulators: more than latency x throughput */

double kern_avx512_int8_peak(double seconds)
{
    volatile int seed = 3;
    __m512i a = _mm512_set1_epi8((char)(seed + 1)), b = _mm512_set1_epi8((char)(seed - 5));
    __m512i acc[PEAK_CHAINS];
    for (int k = 0; k < PEAK_CHAINS; k++)
        acc[k] = _mm512_set1_epi32(k);
    double t0 = kern_now_seconds(), t = t0;
    uint64_t macs = 0;
    while (t - t0 < seconds) {
        for (int it = 0; it < 4096; it++) {
            UNROLL
            for (int k = 0; k < PEAK_CHAINS; k++)
                acc[k] = _mm512_dpbusd_epi32(acc[k], a, b);
        }
        macs += (uint64_t)4096 * PEAK_CHAINS * 64;
        t = kern_now_seconds();
    }
    __m512i s = acc[0];
    for (int k = 1; k < PEAK_CHAINS; k++)
        s = _mm512_add_epi32(s, acc[k]);
    /* the sums wrap by design: fold them as unsigned so no signed overflow is implied */
    uint32_t lanes[16], fold = 0;
    _mm512_storeu_si512(lanes, s);
    for (int k = 0; k < 16; k++)
        fold += lanes[k];
    volatile uint32_t sink = fold;
    (void)sink;
    return 2.0 * (double)macs / (t - t0);
}

/* ---- AMX peaks: tdpbusd (int8) and tdpbf16ps (bf16) throughput ---- */

/* Four independent tile products in flight (tiles 0-3 += 4-5 x 6-7): 16 x 16 x 64 int8 or
 * 16 x 16 x 32 bf16 multiply-adds each. The config is static: the compiler does not see
 * ldtilecfg read it, and dropped the stores of a stack copy. */
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) double kern_amx_peak(int bf16,
                                                                           double seconds)
{
    static const struct amx_cfg cfg = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    static const uint8_t src[16 * 64] = {1, 2, 3, 4, 5, 6, 7, 8};
    _tile_loadconfig(&cfg);
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    _tile_loadd(6, src, 64);
    _tile_loadd(7, src, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    double t0 = kern_now_seconds(), t = t0;
    uint64_t macs = 0;
    while (t - t0 < seconds) {
        if (bf16)
            for (int it = 0; it < 1024; it++) {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        else
            for (int it = 0; it < 1024; it++) {
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 4, 7);
                _tile_dpbusd(2, 5, 6);
                _tile_dpbusd(3, 5, 7);
            }
        macs += (uint64_t)1024 * 4 * 16 * 16 * (bf16 ? 32 : 64);
        t = kern_now_seconds();
    }
    _Alignas(64) int32_t out[16 * 16];
    _tile_stored(0, out, 64);
    __asm__ volatile("" : "+m"(out)); /* the tile store is opaque to the compiler */
    volatile int32_t sink = out[0];
    (void)sink;
    _tile_release();
    return 2.0 * (double)macs / (t - t0);
}
