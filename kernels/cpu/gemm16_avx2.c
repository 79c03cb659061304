/* AVX2 matmul with 16-bit activations (q16 mode), as gemm16_avx512.c with 8 weight rows as the
 * 8 int32 lanes and vpmaddwd + vpaddd for the pairs: for k-step s (activation elements 2s,
 * 2s+1) lane r holds row r's two quants as int16. Per pair and block, in block order and in
 * every tile: acc = fma((float)isum, d_w * d_x, acc); Q4_1 only: acc = fma(m_w, s_x, acc).
 * Integer sums are exact, so results agree with the AVX-512 kernel up to nothing but the
 * order of these float steps (the same). Only reached through kern_cpu_fns_get(). */
#include <assert.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))
#define UNROLL        _Pragma("GCC unroll 16")

#define H16_ROWS 8  /* rows per panel: the lanes */
#define H16_TOK  4  /* tokens per tile */
#define H16_BLKS 64 /* packed blocks on the stack (36 KiB); longer rows use the per-pair path */

struct h16_blk {
    int16_t q[16][16]; /* k-step s: lane r = row r's quants 2s, 2s + 1 */
    float d[8];        /* row scales */
    float m[8];        /* Q4_1 row offsets */
};

enum h16_kind { H16_Q4_0, H16_Q4_1, H16_Q8_0 };

/* 8 x 8 transpose of 32-bit elements. */
static ALWAYS_INLINE void transpose8(__m256i r[8])
{
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

/* Packs nb blocks of nr (<= 8) rows; lanes past nr repeat the last row. */
static ALWAYS_INLINE void h16_pack(const char *rows, size_t row_bytes, int nr, int64_t nb,
                                   struct h16_blk *dst, const enum h16_kind kind)
{
    const size_t bb = kind == H16_Q4_1   ? sizeof(struct kern_block_q4_1)
                      : kind == H16_Q4_0 ? sizeof(struct kern_block_q4_0)
                                         : sizeof(struct kern_block_q8_0);
    for (int64_t b = 0; b < nb; b++) {
        struct h16_blk *o = &dst[b];
        __m256i lo[8], hi[8]; /* row r: int16 quants 0-15 and 16-31, i.e. dwords = k-steps */
        for (int r = 0; r < 8; r++) {
            const uint8_t *blk =
                (const uint8_t *)rows + (size_t)(r < nr ? r : nr - 1) * row_bytes + (size_t)b * bb;
            uint16_t h;
            memcpy(&h, blk, 2);
            o->d[r] = _cvtsh_ss(h);
            if (kind == H16_Q8_0) {
                const int8_t *qs = (const int8_t *)blk + offsetof(struct kern_block_q8_0, qs);
                lo[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
                hi[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
            } else {
                size_t qo = kind == H16_Q4_1 ? offsetof(struct kern_block_q4_1, qs)
                                             : offsetof(struct kern_block_q4_0, qs);
                if (kind == H16_Q4_1) {
                    memcpy(&h, blk + 2, 2);
                    o->m[r] = _cvtsh_ss(h);
                }
                __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + qo)));
                lo[r] = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
                hi[r] = _mm256_srli_epi16(v, 4);
                if (kind == H16_Q4_0) {
                    lo[r] = _mm256_sub_epi16(lo[r], _mm256_set1_epi16(8));
                    hi[r] = _mm256_sub_epi16(hi[r], _mm256_set1_epi16(8));
                }
            }
        }
        transpose8(lo); /* lo[s] lane r = dword s of row r = elements 2s, 2s + 1 */
        transpose8(hi); /* k-steps 8..15 */
        for (int s = 0; s < 8; s++) {
            _mm256_store_si256((__m256i *)o->q[s], lo[s]);
            _mm256_store_si256((__m256i *)o->q[8 + s], hi[s]);
        }
    }
}

static ALWAYS_INLINE void h16_tile(const struct h16_blk *pk, int64_t nb, const struct kern_q16 *x,
                                   size_t ldxq, const int nt, const enum h16_kind kind, __m256 *out)
{
    __m256 acc[H16_TOK];
    UNROLL
    for (int j = 0; j < nt; j++)
        acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct h16_blk *p = pk + b;
        __m256i ia[H16_TOK];
        UNROLL
        for (int j = 0; j < nt; j++)
            ia[j] = _mm256_setzero_si256();
        UNROLL
        for (int s = 0; s < 16; s++) {
            __m256i wv = _mm256_load_si256((const __m256i *)p->q[s]);
            UNROLL
            for (int j = 0; j < nt; j++) {
                int32_t xd;
                memcpy(&xd, x[(size_t)j * ldxq + b].q + 2 * s, sizeof xd);
                ia[j] = _mm256_add_epi32(ia[j], _mm256_madd_epi16(wv, _mm256_set1_epi32(xd)));
            }
        }
        __m256 dw = _mm256_load_ps(p->d);
        UNROLL
        for (int j = 0; j < nt; j++) {
            const struct kern_q16 *xb = &x[(size_t)j * ldxq + b];
            __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(xb->d));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j]), sc, acc[j]);
            if (kind == H16_Q4_1)
                acc[j] = _mm256_fmadd_ps(_mm256_load_ps(p->m), _mm256_set1_ps(xb->s), acc[j]);
        }
    }
    UNROLL
    for (int j = 0; j < nt; j++)
        out[j] = acc[j];
}

#define H16_CASE(T)                                                                                \
    case T:                                                                                        \
        h16_tile(pk, nb, x, ldxq, T, kind, out);                                                   \
        break;

static ALWAYS_INLINE void h16_driver(const enum h16_kind kind, KERN_GEMM_Q16_ARGS)
{
    const int64_t nb = n / KERN_QK;
    _Alignas(32) struct h16_blk pk[H16_BLKS];
    assert(n % KERN_QK == 0 && nb <= H16_BLKS && nb > 0);
    for (int64_t r0 = 0; r0 < n_rows; r0 += H16_ROWS) {
        int nr = n_rows - r0 < H16_ROWS ? (int)(n_rows - r0) : H16_ROWS;
        h16_pack((const char *)w + (size_t)r0 * row_bytes, row_bytes, nr, nb, pk, kind);
        for (int64_t t0 = 0; t0 < n_tok; t0 += H16_TOK) {
            int nt = n_tok - t0 < H16_TOK ? (int)(n_tok - t0) : H16_TOK;
            const struct kern_q16 *x = xq + (size_t)t0 * ldxq;
            __m256 out[H16_TOK];
            switch (nt) {
                H16_CASE(1)
                H16_CASE(2)
                H16_CASE(3)
                H16_CASE(4)
            default:
                assert(0 && "bad tile");
            }
            for (int j = 0; j < nt; j++) {
                _Alignas(32) float v[8];
                _mm256_store_ps(v, out[j]);
                memcpy(y + (size_t)(t0 + j) * ldy + r0, v, sizeof(float) * (size_t)nr);
            }
        }
    }
}

#define H16_ENTRY(name, kind)                                                                      \
    void kern_avx2_gemm_##name##_q16(KERN_GEMM_Q16_ARGS)                                           \
    {                                                                                              \
        if (n / KERN_QK > H16_BLKS || n < KERN_QK)                                                 \
            kern_ref_gemm_##name##_q16(w, row_bytes, n_rows, xq, ldxq, n_tok, n, y, ldy);          \
        else                                                                                       \
            h16_driver(kind, w, row_bytes, n_rows, xq, ldxq, n_tok, n, y, ldy);                    \
    }

H16_ENTRY(q4_0, H16_Q4_0)
H16_ENTRY(q4_1, H16_Q4_1)
H16_ENTRY(q8_0, H16_Q8_0)
