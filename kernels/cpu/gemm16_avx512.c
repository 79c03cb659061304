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
#include "kernels/cpu/simd_avx512.h"

#define G16_ROWS KERN_PANEL_ROWS /* rows per panel: the 16 lanes */
#define G16_TOK  8   /* tokens per tile */
#define G16_BLKS KERN_G16_BLKS /* expanded blocks on the stack (72 KiB); longer rows use
                                * the per-pair path */

struct g16_blk {
    int16_t q[16][32]; /* k-step s: lane r = row r's quants 2s, 2s + 1 */
    float d[16];       /* row scales */
    float m[16];       /* Q4_1 row offsets */
};

enum g16_kind { G16_Q4_0, G16_Q4_1, G16_Q8_0 };

/* Expands nb blocks of nr (<= 16) rows, or of the same panel's packed raw form (raw != NULL,
 * rows unused; see panel_raw); lanes past nr repeat the last row. The quant bytes are
 * transposed 16 rows at a time (lane r = dword s of row r), then each dword's bytes are spread
 * to two int16 pairs: for Q4 a dword holds elements 4s..4s+3 in its low nibbles and 16+4s..
 * in its high nibbles; for Q8_0 elements 4s..4s+3 (sign-extended). */
static ALWAYS_INLINE void g16_pack(const uint8_t *raw, const char *rows, size_t row_bytes, int nr,
                                   int64_t nb, struct g16_blk *dst, const enum g16_kind kind)
{
    const int nq = kind == G16_Q8_0 ? 8 : 4;
    const size_t bb = kind == G16_Q4_1   ? sizeof(struct kern_block_q4_1)
                      : kind == G16_Q4_0 ? sizeof(struct kern_block_q4_0)
                                         : sizeof(struct kern_block_q8_0);
    const size_t qoff = kind == G16_Q4_1   ? offsetof(struct kern_block_q4_1, qs)
                        : kind == G16_Q4_0 ? offsetof(struct kern_block_q4_0, qs)
                                           : offsetof(struct kern_block_q8_0, qs);
    /* per dword: bytes 0,1 (pair A) or 2,3 (pair B) into the low bytes of two words */
    const __m512i sh_a = _mm512_set4_epi32((int)0x800D800C, (int)0x80098008, (int)0x80058004,
                                           (int)0x80018000);
    const __m512i sh_b = _mm512_set4_epi32((int)0x800F800E, (int)0x800B800A, (int)0x80078006,
                                           (int)0x80038002);
    /* Q8_0: the same bytes into the high bytes of the words, then an arithmetic shift */
    const __m512i sh_a8 = _mm512_set4_epi32((int)0x0D800C80, (int)0x09800880, (int)0x05800480,
                                            (int)0x01800080);
    const __m512i sh_b8 = _mm512_set4_epi32((int)0x0F800E80, (int)0x0B800A80, (int)0x07800680,
                                            (int)0x03800280);
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi16(8);
    const __m512i offs = gq_row_offsets(row_bytes, nr);
    size_t roff[16];
    for (int r = 0; r < 16; r++)
        roff[r] = (size_t)(r < nr ? r : nr - 1) * row_bytes;
    for (int64_t b = 0; b < nb; b++) {
        struct g16_blk *o = &dst[b];
        __m512i dm, v[8];
        panel_raw(raw ? raw + (size_t)b * PANEL_RAW_BYTES(nq) : NULL,
                  raw ? NULL : (const uint8_t *)rows + (size_t)b * bb, offs, roff, qoff, nq, v,
                  &dm);
        _mm512_store_ps(o->d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
        if (kind == G16_Q4_1)
            _mm512_store_ps(o->m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
        if (kind == G16_Q8_0) {
            UNROLL
            for (int s = 0; s < 8; s++) {
                _mm512_store_si512((__m512i *)o->q[2 * s],
                                   _mm512_srai_epi16(_mm512_shuffle_epi8(v[s], sh_a8), 8));
                _mm512_store_si512((__m512i *)o->q[2 * s + 1],
                                   _mm512_srai_epi16(_mm512_shuffle_epi8(v[s], sh_b8), 8));
            }
        } else {
            UNROLL
            for (int s = 0; s < 4; s++) {
                __m512i lo = _mm512_and_si512(v[s], low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v[s], 4), low4);
                __m512i q[4] = {_mm512_shuffle_epi8(lo, sh_a), _mm512_shuffle_epi8(lo, sh_b),
                                _mm512_shuffle_epi8(hi, sh_a), _mm512_shuffle_epi8(hi, sh_b)};
                if (kind == G16_Q4_0)
                    for (int i = 0; i < 4; i++)
                        q[i] = _mm512_sub_epi16(q[i], eight);
                _mm512_store_si512((__m512i *)o->q[2 * s], q[0]);     /* elements 4s, 4s+1 */
                _mm512_store_si512((__m512i *)o->q[2 * s + 1], q[1]); /* 4s+2, 4s+3 */
                _mm512_store_si512((__m512i *)o->q[8 + 2 * s], q[2]); /* 16+4s, 16+4s+1 */
                _mm512_store_si512((__m512i *)o->q[9 + 2 * s], q[3]); /* 16+4s+2, 16+4s+3 */
            }
        }
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

/* raw: the packed form of w (then w is unused), or NULL. */
static ALWAYS_INLINE void g16_driver(const enum g16_kind kind, const uint8_t *raw,
                                     KERN_GEMM_Q16_ARGS)
{
    const int nq = kind == G16_Q8_0 ? 8 : 4;
    const int64_t nb = n / KERN_QK;
    _Alignas(64) struct g16_blk pk[G16_BLKS];
    assert(n % KERN_QK == 0 && nb <= G16_BLKS && nb > 0);
    for (int64_t r0 = 0; r0 < n_rows; r0 += G16_ROWS) {
        int nr = n_rows - r0 < G16_ROWS ? (int)(n_rows - r0) : G16_ROWS;
        if (raw)
            g16_pack(raw + (size_t)(r0 / G16_ROWS) * (size_t)nb * PANEL_RAW_BYTES(nq), NULL, 0, nr,
                     nb, pk, kind);
        else
            g16_pack(NULL, (const char *)w + (size_t)r0 * row_bytes, row_bytes, nr, nb, pk, kind);
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
            g16_driver(kind, NULL, w, row_bytes, n_rows, xq, ldxq, n_tok, n, y, ldy);              \
    }                                                                                              \
    void kern_avx512_gemm_##name##_q16_packed(KERN_GEMM_PK_ARGS(kern_q16))                         \
    {                                                                                              \
        g16_driver(kind, pk, NULL, 0, n_rows, xq, ldxq, n_tok, n, y, ldy);                         \
    }

G16_ENTRY(q4_0, G16_Q4_0)
G16_ENTRY(q4_1, G16_Q4_1)
G16_ENTRY(q8_0, G16_Q8_0)
