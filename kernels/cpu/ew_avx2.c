/* AVX2+FMA row operations (semantics in ew_ref.c): RMS norm with the sum of squares in four
 * double lanes, SwiGLU with a polynomial e^x. Fixed operation order: the same bits for the
 * same inputs. Only reached through kern_cpu_fns_get(). */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx2.h"

void kern_avx2_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps)
{
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        __m256d hi = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        s0 = _mm256_fmadd_pd(lo, lo, s0);
        s1 = _mm256_fmadd_pd(hi, hi, s1);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
    double ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < n; i++)
        ss += (double)x[i] * x[i];
    const float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    const __m256 sc = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sc),
                                              _mm256_loadu_ps(w + i)));
    for (; i < n; i++)
        y[i] = x[i] * scale * w[i];
}

void kern_avx2_swiglu(float *gate, const float *up, int64_t n)
{
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) { /* the tail through the same vector code, one lane used */
        float g[8] = {gate[i]}, u[8] = {up[i]};
        kern_avx2_swiglu(g, u, 8);
        gate[i] = g[0];
    }
}

/* gelu_tanh(g) * u as g / (1 + e^-2z) * u, z = sqrt(2/pi) (g + 0.044715 g^3). */
void kern_avx2_geglu(float *gate, const float *up, int64_t n)
{
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), k = _mm256_set1_ps(-1.5957691216057308f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 z = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), g),
                                                    _mm256_set1_ps(0.044715f), g));
        __m256 h = _mm256_div_ps(g, _mm256_add_ps(one, exp8(z)));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(h, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) { /* the tail through the same vector code, one lane used */
        float g[8] = {gate[i]}, u[8] = {up[i]};
        kern_avx2_geglu(g, u, 8);
        gate[i] = g[0];
    }
}
