/* Scalar attention over the paged KV cache (f16 or 8-bit): the algorithm every SIMD table follows,
 * and the fallback for shapes the SIMD kernels do not specialize. For one token and one KV head g,
 * the G query heads of the group walk the sequence's keys in runs of at most KERN_ATTN_RUN
 * tokens inside one block (so a run is one contiguous slice of every channel row of the key
 * tile). Per run and head: scores s_i = (q . k_i) * scale, run maximum, and when it exceeds the
 * running maximum m the accumulators and the running sum are scaled by exp(m_old - m_new);
 * then p_i = exp(s_i - m), sum += p_i, acc += p_i * v_i. The output is acc / sum. With 8-bit
 * KV a key's dot is taken with its quants and then times its scale, and a value's weight is
 * p_i times its scale. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

void kern_ref_to_f16(const float *x, uint16_t *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = kern_f32_to_f16(x[i]);
}

void kern_kv_quant_q8(const float *x, int n, int8_t *q, float *scale)
{
    /* plain compares and the 1.5 * 2^23 trick (round to nearest even for |v| < 2^22) instead
     * of fmaxf/lrintf: the same values, and the compiler can inline and vectorize them */
    const float magic = 12582912.0f;
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = x[i] < 0.0f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
    }
    const float id = kern_kv_quant_inv(amax);
    for (int i = 0; i < n; i++) {
        const float v = (x[i] * id + magic) - magic;
        q[i] = v == v ? (int8_t)(int)v : 0; /* NaN: 0, as the vector conversions give */
    }
    *scale = amax / 127.0f;
}

/* Token i's scale in an 8-bit tile. */
static float kv_scale(const uint8_t *tile, int B, int D, int i)
{
    float sc;
    memcpy(&sc, tile + (size_t)D * B + 4 * (size_t)i, sizeof sc);
    return sc;
}

void kern_ref_attn_group(const struct kern_attn *a, int t, int g, int tn, int gn, int cold)
{
    (void)tn;
    (void)gn;
    (void)cold;
    const int D = a->head_dim, B = a->block_size, G = a->n_head / a->n_kv_head;
    const int32_t *table = kern_block_row(&a->bt, t);
    const int32_t n = a->pos[t] + 1;
    float acc[KERN_MAX_HEAD_DIM], s[KERN_ATTN_RUN];
    for (int h = 0; h < G; h++) {
        const float *q = a->q + ((size_t)t * a->n_head + (size_t)g * G + h) * D;
        float *out = a->out + ((size_t)t * a->n_head + (size_t)g * G + h) * D;
        float m = -1.0f / 0.0f, l = 0.0f;
        for (int c = 0; c < D; c++)
            acc[c] = 0.0f;
        for (int32_t p0 = kern_attn_first(a, t); p0 < n;) {
            const int i0 = p0 % B;
            int cnt = B - i0 < KERN_ATTN_RUN ? B - i0 : KERN_ATTN_RUN;
            cnt = n - p0 < cnt ? (int)(n - p0) : cnt;
            const size_t tile = (size_t)table[p0 / B] * a->n_kv_head + (size_t)g;
            const size_t tb = KERN_KV_TILE_BYTES(a->kv.dtype, B, D);
            const uint8_t *kb = (const uint8_t *)a->kv.k + tile * tb; /* the key tile */
            const uint8_t *vb = (const uint8_t *)a->kv.v + tile * tb; /* the value tile */
            const int q8 = a->kv.dtype == KERN_KV_Q8;
            float bm = -1.0f / 0.0f;
            for (int i = 0; i < cnt; i++) {
                float d = 0.0f;
                for (int c = 0; c < D; c++) /* channel c at [c * B + i0 + i] */
                    d += q[c] *
                         (q8 ? (float)((const int8_t *)kb)[(size_t)c * B + i0 + i]
                             : kern_f16_to_f32(((const uint16_t *)kb)[(size_t)c * B + i0 + i]));
                if (q8)
                    d *= kv_scale(kb, B, D, i0 + i);
                s[i] = d * a->scale;
                if (a->softcap > 0)
                    s[i] = kern_attn_softcap(s[i], a->softcap);
                bm = s[i] > bm ? s[i] : bm;
            }
            if (bm > m) {
                float r = kern_attn_exp(m - bm); /* 0 on the first run */
                l *= r;
                for (int c = 0; c < D; c++)
                    acc[c] *= r;
                m = bm;
            }
            for (int i = 0; i < cnt; i++) {
                const size_t row = (size_t)(i0 + i) * D; /* token i0 + i at [row + c] */
                float p = kern_attn_exp(s[i] - m);
                l += p;
                if (q8) {
                    const float pv = p * kv_scale(vb, B, D, i0 + i);
                    for (int c = 0; c < D; c++)
                        acc[c] += pv * (float)((const int8_t *)vb)[row + c];
                } else {
                    for (int c = 0; c < D; c++)
                        acc[c] += p * kern_f16_to_f32(((const uint16_t *)vb)[row + c]);
                }
            }
            p0 += cnt;
        }
        for (int c = 0; c < D; c++)
            out[c] = acc[c] / l;
    }
}
