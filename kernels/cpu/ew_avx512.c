/* AVX-512 row operations (semantics in ew_ref.c): RMS norm with the sum of squares in eight
 * double lanes, SwiGLU with a polynomial e^x. Fixed operation order: the same bits for the
 * same inputs. Only reached through kern_cpu_fns_get(). */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx512.h"

void kern_avx512_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps)
{
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        s0 = _mm512_fmadd_pd(lo, lo, s0);
        s1 = _mm512_fmadd_pd(hi, hi, s1);
    }
    double ss = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    for (; i < n; i++)
        ss += (double)x[i] * x[i];
    const float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    const __m512 sc = _mm512_set1_ps(scale);
    for (i = 0; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), sc),
                                              _mm512_loadu_ps(w + i)));
    for (; i < n; i++)
        y[i] = x[i] * scale * w[i];
}

void kern_avx512_swiglu(float *gate, const float *up, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(gate + i, swiglu16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(gate + i, m, swiglu16(_mm512_maskz_loadu_ps(m, gate + i),
                                                    _mm512_maskz_loadu_ps(m, up + i)));
    }
}

/* gelu_tanh(g) * u as g / (1 + e^-2z) * u, z = sqrt(2/pi) (g + 0.044715 g^3). */
static inline __m512 geglu16(__m512 g, __m512 u)
{
    const __m512 z = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f), /* -2 sqrt(2/pi) */
                                   _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(g, g), g),
                                                   _mm512_set1_ps(0.044715f), g));
    const __m512 e = exp16(z);
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

void kern_avx512_geglu(float *gate, const float *up, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(gate + i, geglu16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(gate + i, m, geglu16(_mm512_maskz_loadu_ps(m, gate + i),
                                                   _mm512_maskz_loadu_ps(m, up + i)));
    }
}

/* Eight pairs at a time: with v = (a, b) pairs and cs = (cos, sin) pairs, the products a cos,
 * b cos (v times the cosines duplicated) and b sin, a sin (v's pairs swapped times the sines
 * duplicated), then difference in the even lanes and sum in the odd ones: each output rounded
 * as kern_ref_rope's a cos - b sin and a sin + b cos. */
void kern_avx512_rope(float *x, const float *cs, int n_head, int head_dim, int rot_dim)
{
    const int nv = rot_dim / 16 * 16;
    for (int h = 0; h < n_head; h++) {
        float *v = x + (size_t)h * (size_t)head_dim;
        for (int i = 0; i < nv; i += 16) {
            const __m512 xv = _mm512_loadu_ps(v + i), c = _mm512_loadu_ps(cs + i);
            const __m512 p = _mm512_mul_ps(xv, _mm512_moveldup_ps(c));
            const __m512 r = _mm512_mul_ps(_mm512_permute_ps(xv, 0xB1), _mm512_movehdup_ps(c));
            _mm512_storeu_ps(v + i, _mm512_mask_add_ps(_mm512_sub_ps(p, r), 0xAAAA, p, r));
        }
        if (nv < rot_dim)
            kern_ref_rope(v + nv, cs + nv, 1, head_dim, rot_dim - nv);
    }
}
