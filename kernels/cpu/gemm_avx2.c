/* AVX2 + FMA + F16C batched matmul: weight rows times many activation rows at once, for the
 * throughput engine. The same scheme as gemm_avx512.c at half the width (see there): every
 * (row, token) pair is computed by the same per-lane operations whatever tile it falls in, so
 * results are batch invariant. Only reached through kern_cpu_fns_get(). */
#include <assert.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx2.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))
#define UNROLL        _Pragma("GCC unroll 16")

/* Lanes below n set (n in 0..8), as a maskload/maskstore mask. */
static inline __m256i lane_mask(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* ---- exact mode: f32 activations ----
 * Pair (r, t) owns one 8-lane accumulator: acc = fma(w[k..k+7], x[k..k+7], acc) for k = 0, 8,
 * ... in order (a final masked, zero-filled step when n % 8 != 0), then one fixed horizontal sum.
 * Panels of GF_ROWS rows are dequantized (bitwise as dequant_row) into a stack buffer. */

#define GF_ROWS 4    /* rows per panel (4 x 3 accumulators + 3 activations + 1 weight) */
#define GF_TOK  3    /* tokens per tile */
#define GF_KC   4096 /* panel row length in floats; a multiple of KERN_QK_K */

static ALWAYS_INLINE void gf_tile(const float *wp, size_t ldw, const int nr, const float *x,
                                  size_t ldx, const int nt, int64_t kc, __m256 *accm)
{
    __m256 acc[GF_ROWS][GF_TOK];
    UNROLL
    for (int i = 0; i < nr; i++)
        UNROLL
    for (int j = 0; j < nt; j++)
        acc[i][j] = accm[i * GF_TOK + j];
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
        __m256 xv[GF_TOK];
        UNROLL
        for (int j = 0; j < nt; j++)
            xv[j] = _mm256_loadu_ps(x + (size_t)j * ldx + k);
        UNROLL
        for (int i = 0; i < nr; i++) {
            __m256 wv = _mm256_loadu_ps(wp + (size_t)i * ldw + k);
            UNROLL
            for (int j = 0; j < nt; j++)
                acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (k < kc) { /* float types only: n % 8 elements left */
        __m256i m = lane_mask((int)(kc - k));
        __m256 xv[GF_TOK];
        UNROLL
        for (int j = 0; j < nt; j++)
            xv[j] = _mm256_maskload_ps(x + (size_t)j * ldx + k, m);
        UNROLL
        for (int i = 0; i < nr; i++) {
            __m256 wv = _mm256_maskload_ps(wp + (size_t)i * ldw + k, m);
            UNROLL
            for (int j = 0; j < nt; j++)
                acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
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
#define GF_CASES(R) GF_CASE(R, 1) GF_CASE(R, 2) GF_CASE(R, 3)

static void gf_tile_any(const float *wp, size_t ldw, int nr, const float *x, size_t ldx, int nt,
                        int64_t kc, __m256 *accm)
{
    switch (nr * 8 + nt) {
        GF_CASES(1)
        GF_CASES(2)
        GF_CASES(3)
        GF_CASES(4)
    default:
        assert(0 && "bad tile");
    }
}

/* deq NULL: F32 rows are used in place (4-byte aligned, same values as a copy). */
static void gf_driver(void (*deq)(const void *, float *, int64_t), int be, size_t bb,
                      KERN_GEMM_F32_ARGS)
{
    _Alignas(32) float panel[GF_ROWS * GF_KC];
    __m256 accm[GF_ROWS * GF_TOK];
    const int one_chunk = n <= GF_KC;
    const size_t ldw = deq ? (one_chunk ? (size_t)((n + 7) & ~(int64_t)7) : GF_KC)
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
                accm[q] = _mm256_setzero_ps();
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
                    y[(size_t)(t0 + j) * ldy + r0 + i] = hsum_ps(accm[i * GF_TOK + j]);
        }
    }
}

#define GF_ENTRY(name, type)                                                                       \
    void kern_avx2_gemm_##name##_f32(KERN_GEMM_F32_ARGS)                                           \
    {                                                                                              \
        const struct dtype_info *di = dtype_get(type);                                             \
        gf_driver(type == DTYPE_F32 ? NULL : kern_cpu_fns_avx2.dequant_row[type],                  \
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

/* ---- q8 mode: quantized activations ----
 * 8 weight rows are the 8 int32 lanes; a panel's blocks are repacked once (k-step s: lane r =
 * row r's quants for activation dword s), then per token and k-step dpbusd (simd_avx2.h) with
 * the token's broadcast dword accumulates the exact integer dots of all 8 rows. Q4_0
 * nibbles stay unsigned (w + 8) and the sum starts from -8 * sum(x_q); Q8_0 stores |w| and
 * applies w's sign to the activations (vpsignb), so no int16 sum can saturate. Per pair and
 * block, in every tile: acc = fma((float)isum, d_w * d_x, acc), then for Q4_1
 * acc = fma(m_w, s_x, acc); the pair's result is its lane. */

/* Without VNNI a dpbusd is three instructions, two of them multiplies. For Q4_0/Q4_1 the
 * nibbles are at most 15, so a block's 8 k-steps of vpmaddubsw pairs sum to at most
 * 8 * 2 * 15 * 128 = 30,720 in magnitude: gq_tile16 adds them in int16 (exact, no wrap) and
 * widens once per block with one vpmaddwd - the same integers, so the same bits, with 9 instead
 * of 16 multiplies per block and token. Q8_0's |w| <= 128 leaves no such room. */
#ifdef QUERN_AVXVNNI
#define GQ_I16 0
#else
#define GQ_I16 1
#endif

#define GQ_ROWS 8   /* rows per panel: the lanes */
#define GQ_TOK  4   /* tokens per tile */
#define GQ_BLKS 160 /* blocks per panel on the stack; longer rows go in passes of GQ_BLKS */
#define GQ_PPG  8   /* at most this many panels packed per group */

struct gq_blk {
    uint8_t q[8][32];   /* k-step s: lane r = row r's 4 quants (unsigned: nibbles, or |w|) */
    uint8_t sgn[8][32]; /* Q8_0: the signed weights, whose signs go onto the activations */
    float d[8];         /* row scales */
    float m[8];         /* Q4_1 row offsets */
};

enum gq_kind { GQ_Q4_1, GQ_Q4_0, GQ_Q8_0 };

static inline int gq_nq(const enum gq_kind kind)
{
    return kind == GQ_Q8_0 ? 8 : 4;
}

/* One block of a panel into dst, from its raw form: dm = each row's first dword (its f16
 * scale, then Q4_1's f16 offset), v[s] = each row's quant dword s (s < gq_nq). */
static ALWAYS_INLINE void gq_expand(__m256i dm, const __m256i *v, struct gq_blk *o,
                                    const enum gq_kind kind)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m128i d16 = _mm256_castsi256_si128(_mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(dm, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1,
                                                 -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1,
                                                 -1, -1, -1, -1, -1, -1)),
        0x08));
    _mm256_storeu_ps(o->d, _mm256_cvtph_ps(d16));
    if (kind == GQ_Q4_1) {
        __m256i mm = _mm256_srli_epi32(dm, 16);
        __m128i m16 = _mm256_castsi256_si128(_mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(mm, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1,
                                                     -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13,
                                                     -1, -1, -1, -1, -1, -1, -1, -1)),
            0x08));
        _mm256_storeu_ps(o->m, _mm256_cvtph_ps(m16));
    }
    if (kind == GQ_Q8_0) {
        for (int s = 0; s < 8; s++) {
            _mm256_storeu_si256((__m256i *)o->sgn[s], v[s]);
            _mm256_storeu_si256((__m256i *)o->q[s], _mm256_abs_epi8(v[s]));
        }
    } else {
        for (int s = 0; s < 4; s++) {
            _mm256_storeu_si256((__m256i *)o->q[s], _mm256_and_si256(v[s], low4));
            _mm256_storeu_si256((__m256i *)o->q[s + 4],
                                _mm256_and_si256(_mm256_srli_epi32(v[s], 4), low4));
        }
    }
}

static inline size_t gq_block_bytes(const enum gq_kind kind)
{
    return kind == GQ_Q4_1   ? sizeof(struct kern_block_q4_1)
           : kind == GQ_Q4_0 ? sizeof(struct kern_block_q4_0)
                             : sizeof(struct kern_block_q8_0);
}

static inline size_t gq_quant_offset(const enum gq_kind kind)
{
    return kind == GQ_Q4_1   ? offsetof(struct kern_block_q4_1, qs)
           : kind == GQ_Q4_0 ? offsetof(struct kern_block_q4_0, qs)
                             : offsetof(struct kern_block_q8_0, qs);
}

/* The raw form of block b of nr (<= 8) rows, gathered (rows past nr repeat row nr - 1). */
static ALWAYS_INLINE void gq_gather(const char *rows, size_t row_bytes, int nr, int64_t b,
                                    __m256i *dm, __m256i *v, const enum gq_kind kind)
{
    __m256i lane = _mm256_min_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                    _mm256_set1_epi32(nr - 1));
    const __m256i offs = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)row_bytes));
    const int base = (int)((size_t)b * gq_block_bytes(kind));
    *dm = _mm256_i32gather_epi32((const int *)(rows + base), offs, 1);
    const int *q = (const int *)(rows + base + gq_quant_offset(kind));
    for (int s = 0; s < gq_nq(kind); s++)
        v[s] = _mm256_i32gather_epi32(q + s, offs, 1);
}

static ALWAYS_INLINE void gq_pack(const char *rows, size_t row_bytes, int nr, int64_t nb,
                                  struct gq_blk *dst, const enum gq_kind kind)
{
    for (int64_t b = 0; b < nb; b++) {
        __m256i dm, v[8];
        gq_gather(rows, row_bytes, nr, b, &dm, v, kind);
        gq_expand(dm, v, &dst[b], kind);
    }
}

/* Weights packed once, at load (q8 mode): per KERN_PANEL_ROWS-row panel, its 8-row halves in
 * order, each as nb blocks of the raw form gq_gather makes per call (the scale dwords, then the
 * nq quant dwords; 32 bytes each, lane r = row r), rows past the matrix repeating its last
 * row. Same size as the GGUF blocks for Q4_0/Q4_1 (Q8_0: 16 bytes more per 8-row block). The
 * packed GEMMs expand it with plain loads (no gathers) into exactly what gq_pack makes from the
 * rows, so their results are bitwise gemm_q8's. */
#define GQ_RAW_BYTES(nq) ((size_t)32 * (size_t)((nq) + 1))

static ALWAYS_INLINE void gq_pack_raw(const uint8_t *raw, int64_t nb, struct gq_blk *dst,
                                      const enum gq_kind kind)
{
    const int nq = gq_nq(kind);
    for (int64_t b = 0; b < nb; b++, raw += GQ_RAW_BYTES(nq)) {
        __m256i v[8];
        __m256i dm = _mm256_load_si256((const __m256i *)raw);
        for (int s = 0; s < nq; s++)
            v[s] = _mm256_load_si256((const __m256i *)(raw + 32 * (size_t)(s + 1)));
        gq_expand(dm, v, &dst[b], kind);
    }
}

static inline int32_t q8_block_sum(const struct kern_q8 *xb)
{
    __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)xb->q),
                                 _mm256_set1_epi8((char)0x80)); /* q + 128, unsigned */
    __m256i s = _mm256_sad_epu8(u, _mm256_setzero_si256());
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t));
    return _mm_cvtsi128_si32(t) - 32 * 128;
}

/* A block's integer sums of 8 rows into one token's float accumulator: the scale product, then
 * Q4_1's offset term (every tile, so every path rounds alike). */
static ALWAYS_INLINE __m256 gq_block_acc(__m256 acc, __m256i isum, __m256 dw,
                                         const struct gq_blk *p, const struct kern_q8 *xb,
                                         const enum gq_kind kind)
{
    __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(xb->d));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc);
    if (kind == GQ_Q4_1)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(p->m), _mm256_set1_ps(xb->s), acc);
    return acc;
}

static ALWAYS_INLINE void gq_tile(const struct gq_blk *pk, int64_t nb, const struct kern_q8 *x,
                                  size_t ldxq, const int nt, const int32_t *corr,
                                  const enum gq_kind kind, __m256 *out)
{
    enum { C_MAX = 2 };
    const int nc = nt == 1 ? 2 : 1;
    __m256 acc[GQ_TOK]; /* from out: the sums of the blocks before this call's */
    UNROLL
    for (int j = 0; j < nt; j++)
        acc[j] = out[j];
    for (int64_t b = 0; b < nb; b++) {
        const struct gq_blk *p = pk + b;
        __m256i ia[GQ_TOK][C_MAX];
        UNROLL
        for (int j = 0; j < nt; j++)
            UNROLL
        for (int c = 0; c < nc; c++)
            ia[j][c] = c == 0 && kind == GQ_Q4_0 ? _mm256_set1_epi32(corr[j * nb + b])
                                                 : _mm256_setzero_si256();
        UNROLL
        for (int s = 0; s < 8; s++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)p->q[s]);
            __m256i sg = _mm256_setzero_si256();
            if (kind == GQ_Q8_0)
                sg = _mm256_loadu_si256((const __m256i *)p->sgn[s]);
            UNROLL
            for (int j = 0; j < nt; j++) {
                int32_t xd;
                memcpy(&xd, x[(size_t)j * ldxq + b].q + 4 * s, sizeof xd);
                __m256i xv = _mm256_set1_epi32(xd);
                if (kind == GQ_Q8_0)
                    xv = _mm256_sign_epi8(xv, sg);
                ia[j][s % nc] = dpbusd(ia[j][s % nc], wv, xv);
            }
        }
        __m256 dw = _mm256_loadu_ps(p->d);
        UNROLL
        for (int j = 0; j < nt; j++) {
            const struct kern_q8 *xb = &x[(size_t)j * ldxq + b];
            __m256i isum = ia[j][0];
            UNROLL
            for (int c = 1; c < nc; c++)
                isum = _mm256_add_epi32(isum, ia[j][c]);
            acc[j] = gq_block_acc(acc[j], isum, dw, p, xb, kind);
        }
    }
    UNROLL
    for (int j = 0; j < nt; j++)
        out[j] = acc[j];
}

/* The Q4 tile without VNNI (GQ_I16): per block and token, the 8 k-steps' vpmaddubsw pairs
 * summed in int16 (two chains), one vpmaddwd, then the same float steps as gq_tile - token by
 * token, so the sums stay in registers (loading each k-step's weights once for all the tile's
 * tokens instead measured 9 % slower on the AVX2 EPYC: gcc spills the accumulators). */
static ALWAYS_INLINE void gq_tile16(const struct gq_blk *pk, int64_t nb, const struct kern_q8 *x,
                                    size_t ldxq, const int nt, const int32_t *corr,
                                    const enum gq_kind kind, __m256 *out)
{
    __m256 acc[GQ_TOK]; /* from out: the sums of the blocks before this call's */
    UNROLL
    for (int j = 0; j < nt; j++)
        acc[j] = out[j];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const struct gq_blk *p = pk + b;
        const __m256 dw = _mm256_loadu_ps(p->d);
        UNROLL
        for (int j = 0; j < nt; j++) {
            const struct kern_q8 *xb = &x[(size_t)j * ldxq + b];
            __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            UNROLL
            for (int s = 0; s < 8; s++) {
                int32_t xd;
                memcpy(&xd, xb->q + 4 * s, sizeof xd);
                h[s & 1] = _mm256_add_epi16(
                    h[s & 1], _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)p->q[s]),
                                                   _mm256_set1_epi32(xd)));
            }
            __m256i isum = _mm256_madd_epi16(_mm256_add_epi16(h[0], h[1]), ones);
            if (kind == GQ_Q4_0)
                isum = _mm256_add_epi32(isum, _mm256_set1_epi32(corr[j * nb + b]));
            acc[j] = gq_block_acc(acc[j], isum, dw, p, xb, kind);
        }
    }
    UNROLL
    for (int j = 0; j < nt; j++)
        out[j] = acc[j];
}

#define GQ_CASE(T)                                                                                 \
    case T:                                                                                        \
        if (GQ_I16 && kind != GQ_Q8_0)                                                             \
            gq_tile16(pk, nb, x, ldxq, T, corr, kind, out);                                        \
        else                                                                                       \
            gq_tile(pk, nb, x, ldxq, T, corr, kind, out);                                          \
        break;

static ALWAYS_INLINE void gq_tile_any(const struct gq_blk *pk, int64_t nb,
                                      const struct kern_q8 *x, size_t ldxq, int nt,
                                      const int32_t *corr, const enum gq_kind kind, __m256 *out)
{
    switch (nt) {
        GQ_CASE(1)
        GQ_CASE(2)
        GQ_CASE(3)
        GQ_CASE(4)
    default:
        assert(0 && "bad tile");
    }
}

/* raw: the packed form of w (then w and row_bytes are unused), or NULL. */
static ALWAYS_INLINE void gq_driver(const enum gq_kind kind, const uint8_t *raw,
                                    KERN_GEMM_Q8_ARGS)
{
    const int64_t nb = n / KERN_QK;
    const int64_t kc = nb < GQ_BLKS ? nb : GQ_BLKS; /* blocks per pass over the tokens */
    const size_t rawb = GQ_RAW_BYTES(gq_nq(kind));
    _Alignas(32) struct gq_blk pk[GQ_BLKS];
    int32_t corr[GQ_TOK * GQ_BLKS];
    int64_t ppg = GQ_BLKS / kc < GQ_PPG ? GQ_BLKS / kc : GQ_PPG;
    assert(n % KERN_QK == 0 && nb > 0);
    assert(raw || row_bytes * GQ_ROWS + (size_t)n < (size_t)INT32_MAX); /* gather offsets */
    for (int64_t g0 = 0; g0 < n_rows; g0 += ppg * GQ_ROWS) {
        int64_t left = n_rows - g0;
        int np = (int)((left + GQ_ROWS - 1) / GQ_ROWS < ppg ? (left + GQ_ROWS - 1) / GQ_ROWS : ppg);
        /* rows longer than the stack panels go in passes of kc blocks: each pass continues
         * the sums the last one stored in y, so the order per pair is the blocks' order, as in
         * one pass (y holds the float accumulators exactly) */
        for (int64_t k0 = 0; k0 < nb; k0 += kc) {
            const int64_t kn = nb - k0 < kc ? nb - k0 : kc;
            for (int q = 0; q < np; q++) {
                int64_t r0 = g0 + (int64_t)q * GQ_ROWS;
                int nr = n_rows - r0 < GQ_ROWS ? (int)(n_rows - r0) : GQ_ROWS;
                if (raw)
                    gq_pack_raw(raw + ((size_t)(r0 / GQ_ROWS) * (size_t)nb + (size_t)k0) * rawb,
                                kn, pk + q * kc, kind);
                else
                    gq_pack((const char *)w + (size_t)r0 * row_bytes +
                                (size_t)k0 * gq_block_bytes(kind),
                            row_bytes, nr, kn, pk + q * kc, kind);
            }
            for (int64_t t0 = 0; t0 < n_tok; t0 += GQ_TOK) {
                int nt = n_tok - t0 < GQ_TOK ? (int)(n_tok - t0) : GQ_TOK;
                const struct kern_q8 *x = xq + (size_t)t0 * ldxq + k0;
                if (kind == GQ_Q4_0)
                    for (int j = 0; j < nt; j++)
                        for (int64_t b = 0; b < kn; b++)
                            corr[j * kn + b] = -8 * q8_block_sum(&x[(size_t)j * ldxq + b]);
                for (int q = 0; q < np; q++) {
                    int64_t r0 = g0 + (int64_t)q * GQ_ROWS;
                    int nr = n_rows - r0 < GQ_ROWS ? (int)(n_rows - r0) : GQ_ROWS;
                    __m256i m = lane_mask(nr);
                    __m256 out[GQ_TOK];
                    for (int j = 0; j < nt; j++)
                        out[j] = k0 ? _mm256_maskload_ps(y + (size_t)(t0 + j) * ldy + r0, m)
                                    : _mm256_setzero_ps();
                    gq_tile_any(pk + q * kc, kn, x, ldxq, nt, corr, kind, out);
                    for (int j = 0; j < nt; j++)
                        _mm256_maskstore_ps(y + (size_t)(t0 + j) * ldy + r0, m, out[j]);
                }
            }
        }
    }
}

#define GQ_ENTRY(name, kind, type)                                                                 \
    void kern_avx2_gemm_##name##_q8(KERN_GEMM_Q8_ARGS)                                             \
    {                                                                                              \
        if (n < KERN_QK)                                                                           \
            kern_gemm_q8_pairs(kern_cpu_fns_avx2.vec_dot_q8[type], w, row_bytes, n_rows, xq,       \
                               ldxq, n_tok, n, y, ldy);                                            \
        else                                                                                       \
            gq_driver(kind, NULL, w, row_bytes, n_rows, xq, ldxq, n_tok, n, y, ldy);               \
    }                                                                                              \
    void kern_avx2_gemm_##name##_q8_packed(KERN_GEMM_PK_ARGS(kern_q8))                             \
    {                                                                                              \
        assert(n >= KERN_QK);                                                                      \
        gq_driver(kind, pk, NULL, 0, n_rows, xq, ldxq, n_tok, n, y, ldy);                          \
    }

GQ_ENTRY(q4_0, GQ_Q4_0, DTYPE_Q4_0)
GQ_ENTRY(q4_1, GQ_Q4_1, DTYPE_Q4_1)
GQ_ENTRY(q8_0, GQ_Q8_0, DTYPE_Q8_0)

#define GQ_PAIRS(name, type)                                                                       \
    void kern_avx2_gemm_##name##_q8(KERN_GEMM_Q8_ARGS)                                             \
    {                                                                                              \
        kern_gemm_q8_pairs(kern_cpu_fns_avx2.vec_dot_q8[type], w, row_bytes, n_rows, xq, ldxq,     \
                           n_tok, n, y, ldy);                                                      \
    }

GQ_PAIRS(q5_0, DTYPE_Q5_0)
GQ_PAIRS(q4_k, DTYPE_Q4_K)
GQ_PAIRS(q6_k, DTYPE_Q6_K)

static int gq_kind_of(uint32_t type, enum gq_kind *kind)
{
    *kind = type == DTYPE_Q4_1 ? GQ_Q4_1 : type == DTYPE_Q4_0 ? GQ_Q4_0 : GQ_Q8_0;
    return type == DTYPE_Q4_1 || type == DTYPE_Q4_0 || type == DTYPE_Q8_0;
}

/* Packed for the q8 mode only (act 1), rows of any length. */
size_t kern_avx2_panel_bytes(uint32_t type, int64_t n_rows, int64_t n, int act)
{
    enum gq_kind kind;
    const int64_t nb = n / KERN_QK;
    if (act != 1 || !gq_kind_of(type, &kind) || n_rows < 1 || n % KERN_QK || nb < 1)
        return 0;
    const int64_t panels = (n_rows + KERN_PANEL_ROWS - 1) / KERN_PANEL_ROWS;
    return (size_t)panels * (KERN_PANEL_ROWS / GQ_ROWS) * (size_t)nb * GQ_RAW_BYTES(gq_nq(kind));
}

void kern_avx2_panel_pack(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows,
                          int64_t n, void *dst)
{
    enum gq_kind kind;
    int ok = gq_kind_of(type, &kind);
    const int64_t nb = n / KERN_QK;
    const int64_t halves = (n_rows + KERN_PANEL_ROWS - 1) / KERN_PANEL_ROWS *
                           (KERN_PANEL_ROWS / GQ_ROWS);
    uint8_t *o = dst;
    assert(ok && row_bytes * GQ_ROWS + (size_t)n < (size_t)INT32_MAX);
    (void)ok;
    for (int64_t h = 0; h < halves; h++) {
        int64_t r0 = h * GQ_ROWS < n_rows ? h * GQ_ROWS : n_rows - 1;
        int nr = n_rows - r0 < GQ_ROWS ? (int)(n_rows - r0) : GQ_ROWS;
        for (int64_t b = 0; b < nb; b++) {
            __m256i dm, v[8];
            gq_gather((const char *)w + (size_t)r0 * row_bytes, row_bytes, nr, b, &dm, v, kind);
            _mm256_store_si256((__m256i *)o, dm);
            for (int s = 0; s < gq_nq(kind); s++)
                _mm256_store_si256((__m256i *)(o + 32 * (size_t)(s + 1)), v[s]);
            o += GQ_RAW_BYTES(gq_nq(kind));
        }
    }
}

/* ---- int8 peak: vpdpbusd throughput with AVX-VNNI; without it, vpmaddubsw + vpaddw (int16
 * sums, as the Q4 GEMMs add a block's k-steps), the fastest exact int8 products AVX2 has ---- */

/* Independent accumulators: more than latency x throughput (a chain step is a 4-5 cycle
 * multiply plus an add; two multiplies start per cycle on current cores). Each chain has its
 * own operand in memory (a load per product, as the GEMMs' broadcasts are), and one register
 * operand an empty asm "changes" every round, so no product can be hoisted or shared. */
#define PEAK_CHAINS 12

double kern_avx2_int8_peak(double seconds)
{
    volatile int seed = 3;
    _Alignas(32) int8_t bm[PEAK_CHAINS][32];
    for (int k = 0; k < PEAK_CHAINS; k++)
        for (int i = 0; i < 32; i++)
            bm[k][i] = (int8_t)(seed + k - i);
    __m256i a = _mm256_set1_epi8((char)(seed - 5)), acc[PEAK_CHAINS];
    for (int k = 0; k < PEAK_CHAINS; k++)
        acc[k] = _mm256_set1_epi32(k);
    double t0 = kern_now_seconds(), t = t0;
    uint64_t macs = 0;
    while (t - t0 < seconds) {
        for (int it = 0; it < 4096; it++) {
            __asm__("" : "+x"(a));
            UNROLL
            for (int k = 0; k < PEAK_CHAINS; k++) {
                __m256i b = _mm256_load_si256((const __m256i *)bm[k]);
#ifdef QUERN_AVXVNNI
                acc[k] = dpbusd(acc[k], a, b);
#else /* the Q4 GEMMs' form (gq_tile16): vpmaddubsw pairs added in int16 */
                acc[k] = _mm256_add_epi16(acc[k], _mm256_maddubs_epi16(a, b));
#endif
            }
        }
        macs += (uint64_t)4096 * PEAK_CHAINS * 32;
        t = kern_now_seconds();
    }
    __m256i s = acc[0];
    for (int k = 1; k < PEAK_CHAINS; k++)
        s = _mm256_add_epi32(s, acc[k]);
    /* the sums wrap by design: fold them as unsigned so no signed overflow is implied */
    volatile uint32_t sink =
        (uint32_t)_mm256_extract_epi32(s, 0) + (uint32_t)_mm256_extract_epi32(s, 7);
    (void)sink;
    return 2.0 * (double)macs / (t - t0);
}
