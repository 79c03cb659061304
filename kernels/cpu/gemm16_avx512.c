/* AVX-512 VNNI matmul with 16-bit activations (q16 mode): weights Q4_0 / Q4_1 / Q8_0 times
 * struct kern_q16 activations with vpdpwssd (16-bit pairs into 32-bit sums, exact). 16 weight
 * rows are the 16 int32 lanes: a panel's blocks are repacked once per call so that for k-step s
 * (activation elements 2s, 2s+1) lane r holds row r's two quants as int16; each token's dword s
 * is broadcast. Per pair and block, in block order and in every tile:
 *   acc = fma((float)isum, d_w * d_x, acc);  Q4_1 only: acc = fma(m_w, s_x, acc)
 * and the pair's result is its lane: no horizontal sum, no dependence on the batch. Only
 * reached through kern_cpu_fns_get(), which checks the CPU first. */
#include <assert.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))
#define UNROLL        _Pragma("GCC unroll 16")

#define G16_ROWS 16  /* rows per panel: the lanes */
#define G16_TOK  8   /* tokens per tile */
#define G16_BLKS 64  /* packed blocks on the stack (72 KiB); longer rows use the per-pair path */

struct g16_blk {
    int16_t q[16][32]; /* k-step s: lane r = row r's quants 2s, 2s + 1 */
    float d[16];       /* row scales */
    float m[16];       /* Q4_1 row offsets */
};

enum g16_kind { G16_Q4_0, G16_Q4_1, G16_Q8_0 };

/* Packs nb blocks of nr (<= 16) rows; lanes past nr repeat the last row. */
static ALWAYS_INLINE void g16_pack(const char *rows, size_t row_bytes, int nr, int64_t nb,
                                   struct g16_blk *dst, const enum g16_kind kind)
{
    const size_t bb = kind == G16_Q4_1   ? sizeof(struct kern_block_q4_1)
                      : kind == G16_Q4_0 ? sizeof(struct kern_block_q4_0)
                                         : sizeof(struct kern_block_q8_0);
    _Alignas(64) int16_t tmp[16][KERN_QK];
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)sizeof(tmp[0])));
    for (int64_t b = 0; b < nb; b++) {
        struct g16_blk *o = &dst[b];
        for (int r = 0; r < 16; r++) {
            const uint8_t *blk = (const uint8_t *)rows + (size_t)(r < nr ? r : nr - 1) * row_bytes +
                                 (size_t)b * bb;
            if (kind == G16_Q8_0) {
                const struct kern_block_q8_0 *q = (const void *)blk;
                o->d[r] = _cvtsh_ss(q->d);
                _mm512_store_si512((__m512i *)tmp[r],
                                   _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q->qs)));
            } else {
                const uint8_t *qs = blk + (kind == G16_Q4_1 ? offsetof(struct kern_block_q4_1, qs)
                                                            : offsetof(struct kern_block_q4_0, qs));
                uint16_t dh, mh;
                memcpy(&dh, blk, 2);
                o->d[r] = _cvtsh_ss(dh);
                if (kind == G16_Q4_1) {
                    memcpy(&mh, blk + 2, 2);
                    o->m[r] = _cvtsh_ss(mh);
                }
                __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
                __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
                __m256i hi = _mm256_srli_epi16(v, 4);
                if (kind == G16_Q4_0) {
                    lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(8));
                    hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(8));
                }
                _mm256_store_si256((__m256i *)tmp[r], lo);        /* elements 0-15 */
                _mm256_store_si256((__m256i *)(tmp[r] + 16), hi); /* elements 16-31 */
            }
        }
        UNROLL
        for (int s = 0; s < 16; s++)
            _mm512_store_si512((__m512i *)o->q[s],
                               _mm512_i32gather_epi32(idx, (const char *)tmp + 4 * s, 1));
    }
}

/* One panel x nt tokens over nb blocks; out[j] lane r = pair (r, token j). Two integer chains
 * per token (exact, so the split does not matter). */
static ALWAYS_INLINE void g16_tile(const struct g16_blk *pk, int64_t nb, const struct kern_q16 *x,
                                   size_t ldxq, const int nt, const enum g16_kind kind, __m512 *out)
{
    __m512 acc[G16_TOK];
    UNROLL
    for (int j = 0; j < nt; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct g16_blk *p = pk + b;
        __m512i ia[G16_TOK][2];
        UNROLL
        for (int j = 0; j < nt; j++)
            ia[j][0] = ia[j][1] = _mm512_setzero_si512();
        UNROLL
        for (int s = 0; s < 16; s++) {
            __m512i wv = _mm512_load_si512((const __m512i *)p->q[s]);
            UNROLL
            for (int j = 0; j < nt; j++) {
                int32_t xd;
                memcpy(&xd, x[(size_t)j * ldxq + b].q + 2 * s, sizeof xd);
                ia[j][s % 2] = _mm512_dpwssd_epi32(ia[j][s % 2], wv, _mm512_set1_epi32(xd));
            }
        }
        __m512 dw = _mm512_load_ps(p->d);
        UNROLL
        for (int j = 0; j < nt; j++) {
            const struct kern_q16 *xb = &x[(size_t)j * ldxq + b];
            __m512i isum = _mm512_add_epi32(ia[j][0], ia[j][1]);
            __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(xb->d));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[j]);
            if (kind == G16_Q4_1)
                acc[j] = _mm512_fmadd_ps(_mm512_load_ps(p->m), _mm512_set1_ps(xb->s), acc[j]);
        }
    }
    UNROLL
    for (int j = 0; j < nt; j++)
        out[j] = acc[j];
}

#define G16_CASE(T)                                                                                \
    case T:                                                                                        \
        g16_tile(pk, nb, x, ldxq, T, kind, out);                                                   \
        break;

static ALWAYS_INLINE void g16_tile_any(const struct g16_blk *pk, int64_t nb,
                                       const struct kern_q16 *x, size_t ldxq, int nt,
                                       const enum g16_kind kind, __m512 *out)
{
    switch (nt) {
        G16_CASE(1)
        G16_CASE(2)
        G16_CASE(3)
        G16_CASE(4)
        G16_CASE(5)
        G16_CASE(6)
        G16_CASE(7)
        G16_CASE(8)
    default:
        assert(0 && "bad tile");
    }
}

static ALWAYS_INLINE void g16_driver(const enum g16_kind kind, KERN_GEMM_Q16_ARGS)
{
    const int64_t nb = n / KERN_QK;
    _Alignas(64) struct g16_blk pk[G16_BLKS];
    assert(n % KERN_QK == 0 && nb <= G16_BLKS && nb > 0);
    for (int64_t r0 = 0; r0 < n_rows; r0 += G16_ROWS) {
        int nr = n_rows - r0 < G16_ROWS ? (int)(n_rows - r0) : G16_ROWS;
        g16_pack((const char *)w + (size_t)r0 * row_bytes, row_bytes, nr, nb, pk, kind);
        __mmask16 m = (__mmask16)((1u << nr) - 1);
        for (int64_t t0 = 0; t0 < n_tok; t0 += G16_TOK) {
            int nt = n_tok - t0 < G16_TOK ? (int)(n_tok - t0) : G16_TOK;
            __m512 out[G16_TOK];
            g16_tile_any(pk, nb, xq + (size_t)t0 * ldxq, ldxq, nt, kind, out);
            for (int j = 0; j < nt; j++)
                _mm512_mask_storeu_ps(y + (size_t)(t0 + j) * ldy + r0, m, out[j]);
        }
    }
}

/* Rows longer than the stack panel use the scalar reference per pair: the choice depends on n
 * only, so a matrix always takes the same path. */
#define G16_ENTRY(name, kind)                                                                      \
    void kern_avx512_gemm_##name##_q16(KERN_GEMM_Q16_ARGS)                                         \
    {                                                                                              \
        if (n / KERN_QK > G16_BLKS || n < KERN_QK)                                                 \
            kern_ref_gemm_##name##_q16(w, row_bytes, n_rows, xq, ldxq, n_tok, n, y, ldy);          \
        else                                                                                       \
            g16_driver(kind, w, row_bytes, n_rows, xq, ldxq, n_tok, n, y, ldy);                    \
    }

G16_ENTRY(q4_0, G16_Q4_0)
G16_ENTRY(q4_1, G16_Q4_1)
G16_ENTRY(q8_0, G16_Q8_0)
