/* AVX2+FMA helpers for the CPU attention kernel (backend_cpu.c): scores of one query
 * against a run of keys, and the weighted sum of values. Only called after dispatch has
 * checked the CPU; head_dim must be a multiple of 8. Fixed summation order, so results do
 * not depend on anything but the inputs. */
#include <immintrin.h>

#include "kernels/cpu/cpu_kernels_internal.h"

void kern_avx2_attn_scores(const float *q, const float *const *k, int n, int hd, float scale,
                           float *out)
{
    for (int i = 0; i < n; i++) {
        __m256 s = _mm256_setzero_ps();
        for (int c = 0; c < hd; c += 8)
            s = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k[i] + c), s);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[i] = _mm_cvtss_f32(h) * scale;
    }
}

void kern_avx2_attn_accum(float *acc, const float *const *v, const float *w, int n, int hd)
{
    for (int c = 0; c < hd; c += 8) {
        __m256 a = _mm256_loadu_ps(acc + c);
        for (int i = 0; i < n; i++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), _mm256_loadu_ps(v[i] + c), a);
        _mm256_storeu_ps(acc + c, a);
    }
}
