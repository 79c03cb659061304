/* Scalar row operations of the forward pass: RMS norm, the SwiGLU and GeGLU products and RoPE
 * (NORM and NEOX pairings). The SIMD
 * tables compute the same functions with vector partial sums and a polynomial exp (RoPE: the
 * same operations, so the same bits). */
#include <math.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

void kern_ref_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps)
{
    double ss = 0;
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (int64_t i = 0; i < n; i++)
        y[i] = x[i] * scale * w[i];
}

void kern_ref_swiglu(float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void kern_ref_geglu(float *gate, const float *up, int64_t n)
{
    /* 0.5 (1 + tanh z) = 1 / (1 + e^-2z): no cancellation where tanh z is near -1 */
    const float k = -1.5957691216057308f; /* -2 sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(k * (g + 0.044715f * g * g * g))) * up[i];
    }
}

void kern_ref_rope_neox(float *x, const float *cs, int n_head, int head_dim, int rot_dim)
{
    const int half = rot_dim / 2;
    for (int h = 0; h < n_head; h++) {
        float *v = x + (size_t)h * (size_t)head_dim;
        for (int i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half], co = cs[2 * i], sn = cs[2 * i + 1];
            v[i] = a * co - b * sn;
            v[i + half] = a * sn + b * co;
        }
    }
}

void kern_ref_rope(float *x, const float *cs, int n_head, int head_dim, int rot_dim)
{
    for (int h = 0; h < n_head; h++) {
        float *v = x + (size_t)h * (size_t)head_dim;
        for (int i = 0; i < rot_dim; i += 2) {
            const float a = v[i], b = v[i + 1], co = cs[i], sn = cs[i + 1];
            v[i] = a * co - b * sn;
            v[i + 1] = a * sn + b * co;
        }
    }
}
