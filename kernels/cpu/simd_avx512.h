/* AVX-512 helpers shared by the *_avx512.c kernel files: gathering a panel of 16 weight rows
 * so that lane r of a vector holds row r (the GEMMs), and the polynomial e^x (attention,
 * SwiGLU). Include only from files compiled for AVX-512. */
#ifndef KERNELS_CPU_SIMD_AVX512_H
#define KERNELS_CPU_SIMD_AVX512_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/cpu/cpu_kernels_internal.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))
#define UNROLL        _Pragma("GCC unroll 16")

/* An AMX tile configuration (ldtilecfg's 64-byte operand). */
struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* The tile intrinsics are asm statements that do not tell the compiler which memory they touch:
 * a full compiler barrier before tiles load what C code wrote. */
#define AMX_FENCE() __asm__ volatile("" ::: "memory")

/* e^x on 16 lanes with the polynomial of kern_attn_exp: x clamped to at most 88, n = round(x /
 * ln2), degree-6 polynomial on the remainder, times 2^n by scalef. Lanes below -87 (and -inf,
 * NaN) give 0. Relative error < 3e-7. */
static inline __m512 exp16(__m512 x)
{
    const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_maskz_mov_ps(ok, x), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KERN_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KERN_EXP_LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(KERN_EXP_C6), _mm512_set1_ps(KERN_EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KERN_EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KERN_EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(ok, _mm512_scalef_ps(p, n));
}

/* silu(g) * u = g / (1 + e^-g) * u on 16 lanes: kern_avx512_swiglu's arithmetic, shared with
 * the fused SwiGLU of the bf16 FFN so both give the same bits. */
static inline __m512 swiglu16(__m512 g, __m512 u)
{
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* Row offsets of the 16 lanes relative to the panel's first row, for gathers; lanes past nr
 * repeat the last row (their results are never stored). */
static inline __m512i gq_row_offsets(size_t row_bytes, int nr)
{
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    lane = _mm512_min_epi32(lane, _mm512_set1_epi32(nr - 1));
    return _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)row_bytes));
}

/* 16 rows x 4 dwords (16 bytes at base + off[r]) -> v[s] lane r = dword s of row r. */
static ALWAYS_INLINE void transpose_16x4(const uint8_t *base, const size_t off[16], __m512i v[4])
{
#define LD4(r) _mm_loadu_si128((const __m128i *)(base + off[r]))
#define Z4(g)                                                                                      \
    _mm512_inserti32x4(                                                                            \
        _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(LD4(4 * (g))),               \
                                              LD4(4 * (g) + 1), 1),                                \
                           LD4(4 * (g) + 2), 2),                                                   \
        LD4(4 * (g) + 3), 3)
    __m512i z0 = Z4(0), z1 = Z4(1), z2 = Z4(2), z3 = Z4(3);
#undef Z4
#undef LD4
    const __m512i i01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i i23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    __m512i a01 = _mm512_permutex2var_epi32(z0, i01, z1); /* s0 rows 0-7 | s1 rows 0-7 */
    __m512i a23 = _mm512_permutex2var_epi32(z0, i23, z1);
    __m512i b01 = _mm512_permutex2var_epi32(z2, i01, z3); /* rows 8-15 */
    __m512i b23 = _mm512_permutex2var_epi32(z2, i23, z3);
    v[0] = _mm512_shuffle_i64x2(a01, b01, 0x44);
    v[1] = _mm512_shuffle_i64x2(a01, b01, 0xEE);
    v[2] = _mm512_shuffle_i64x2(a23, b23, 0x44);
    v[3] = _mm512_shuffle_i64x2(a23, b23, 0xEE);
}

/* 16 rows x 8 dwords (32 bytes at base + off[r]) -> v[s] lane r = dword s of row r. */
static ALWAYS_INLINE void transpose_16x8(const uint8_t *base, const size_t off[16], __m512i v[8])
{
    __m512i z[8]; /* rows 2g, 2g+1 */
    UNROLL
    for (int g = 0; g < 8; g++)
        z[g] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(base + off[2 * g]))),
            _mm256_loadu_si256((const __m256i *)(base + off[2 * g + 1])), 1);
    /* stage 1: rows 4h..4h+3, lane 4s' + i (s' = s or s - 4, i = row in the four) */
    const __m512i lo = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    __m512i c[4][2];
    UNROLL
    for (int h = 0; h < 4; h++) {
        c[h][0] = _mm512_permutex2var_epi32(z[2 * h], lo, z[2 * h + 1]);
        c[h][1] = _mm512_permutex2var_epi32(z[2 * h], hi, z[2 * h + 1]);
    }
    /* stage 2: rows 8q..8q+7, lane 8s'' + i for s pairs (0,1), (2,3) of each half */
    const __m512i e01 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i e23 = _mm512_add_epi32(e01, _mm512_set1_epi32(8));
    __m512i d[2][4];
    UNROLL
    for (int q = 0; q < 2; q++)
        UNROLL
    for (int half = 0; half < 2; half++) {
        d[q][2 * half] = _mm512_permutex2var_epi32(c[2 * q][half], e01, c[2 * q + 1][half]);
        d[q][2 * half + 1] = _mm512_permutex2var_epi32(c[2 * q][half], e23, c[2 * q + 1][half]);
    }
    /* stage 3: d[q][u] holds s = 2u (lanes 0-7) and 2u+1 (lanes 8-15) of rows 8q.. */
    UNROLL
    for (int u = 0; u < 4; u++) {
        v[2 * u] = _mm512_shuffle_i64x2(d[0][u], d[1][u], 0x44);
        v[2 * u + 1] = _mm512_shuffle_i64x2(d[0][u], d[1][u], 0xEE);
    }
}

/* Raw panel form of one block of a 16-row panel, the input of the q8 and q16 GEMMs' per-call
 * expansion: v[0..nq) the transposed quant dwords (nq = 4 for Q4_0/Q4_1, 8 for Q8_0), dm each
 * row's first dword (its f16 scale; then Q4_1's f16 offset, else two quant bytes). Read from the
 * GGUF rows (gathers and transposes) when raw is NULL, else from a copy packed at load
 * (kern_avx512_panel_pack: nq + 1 vectors per block, PANEL_RAW_BYTES). */
#define PANEL_RAW_BYTES(nq) (64 * ((size_t)(nq) + 1))

/* The packed case alone: nq quant vectors, then the scale dwords. */
static ALWAYS_INLINE void panel_raw_load(const uint8_t *raw, const int nq, __m512i *v, __m512i *dm)
{
    UNROLL
    for (int s = 0; s < nq; s++)
        v[s] = _mm512_load_si512((const __m512i *)(raw + 64 * s));
    *dm = _mm512_load_si512((const __m512i *)(raw + 64 * nq));
}

static ALWAYS_INLINE void panel_raw(const uint8_t *raw, const uint8_t *base, __m512i offs,
                                    const size_t off[16], size_t qoff, const int nq, __m512i *v,
                                    __m512i *dm)
{
    if (raw) {
        panel_raw_load(raw, nq, v, dm);
        return;
    }
    *dm = _mm512_i32gather_epi32(offs, base, 1);
    if (nq == 8)
        transpose_16x8(base + qoff, off, v);
    else
        transpose_16x4(base + qoff, off, v);
}

#endif
