/* AVX2 helpers shared by the *_avx2.c kernel files: horizontal sums and maxima in a fixed
 * order, and the polynomial e^x of the attention and SwiGLU kernels. Include only from files
 * compiled for AVX2. */
#ifndef KERNELS_CPU_SIMD_AVX2_H
#define KERNELS_CPU_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#include "kernels/cpu/cpu_kernels_internal.h"

/* acc + the dot products of 4 unsigned bytes of u with 4 signed bytes of s, per int32 lane:
 * vpdpbusd where the file is compiled for AVX-VNNI (QUERN_AVXVNNI, the "avx-vnni" table), else
 * vpmaddubsw + vpmaddwd + vpaddd. The same integers whenever no pair of adjacent products
 * exceeds the int16 range (vpmaddubsw saturates), which every caller ensures. */
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s)
{
#ifdef QUERN_AVXVNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

static inline float hsum_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline float hmax_ps(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* e^x on 8 lanes with the polynomial of kern_attn_exp: x clamped to at most 88, n = round(x /
 * ln2), degree-6 polynomial on the remainder, times 2^n in the exponent bits. Lanes below -87
 * (and -inf, NaN) give 0. Relative error < 3e-7. */
static inline __m256 exp8(__m256 x)
{
    const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_and_ps(x, ok), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KERN_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KERN_EXP_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(KERN_EXP_C6), _mm256_set1_ps(KERN_EXP_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KERN_EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KERN_EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n for n in [-126, 127] built in the exponent; p in [0.7, 1.5] keeps it normal except
     * right at the bottom, where e^x < 2^-125 is flushed by the mask anyway */
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    __m256 v = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    return _mm256_and_ps(v, ok);
}

#endif
