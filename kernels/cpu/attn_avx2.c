/* AVX2+FMA+F16C attention over the f16 paged KV cache (algorithm in attn_ref.c), and the
 * float -> half conversion of new KV rows. The heads of a query group are processed one after
 * another over the same key/value tiles (so the tiles come from cache after the first head);
 * a run of 16 keys is two 8-lane score vectors. head_dim must be a multiple of 8, otherwise
 * the scalar reference runs. Only reached through kern_cpu_fns_get(). */
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx2.h"

void kern_avx2_to_f16(const float *x, uint16_t *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        y[i] = kern_f32_to_f16(x[i]);
}

void kern_avx2_attn_group(const struct kern_attn *a, int t, int g, int tn, int gn, int cold)
{
    const int D = a->head_dim, B = a->block_size, G = a->n_head / a->n_kv_head;
    if (D % 8 || a->kv.dtype != KERN_KV_F16) { /* 8-bit KV: the scalar kernel */
        kern_ref_attn_group(a, t, g, tn, gn, cold);
        return;
    }
    const int32_t *table = kern_block_row(&a->bt, t);
    const int32_t n = a->pos[t] + 1;
    uint16_t kpad[KERN_MAX_HEAD_DIM * KERN_ATTN_RUN]; /* a partial run's keys, zero padded */
    _Alignas(32) float pw[KERN_ATTN_RUN];
    __m256 acc[KERN_MAX_HEAD_DIM / 8];
    for (int h = 0; h < G; h++) {
        const float *q = a->q + ((size_t)t * a->n_head + (size_t)g * G + h) * D;
        float *out = a->out + ((size_t)t * a->n_head + (size_t)g * G + h) * D;
        float m = -1.0f / 0.0f;
        __m256 lsum = _mm256_setzero_ps();
        for (int j = 0; j < D / 8; j++)
            acc[j] = _mm256_setzero_ps();
        for (int32_t p0 = kern_attn_first(a, t); p0 < n;) {
            const int i0 = p0 % B;
            int cnt = B - i0 < KERN_ATTN_RUN ? B - i0 : KERN_ATTN_RUN;
            cnt = n - p0 < cnt ? (int)(n - p0) : cnt;
            const size_t tile = (size_t)table[p0 / B] * a->n_kv_head + (size_t)g;
            const uint16_t *kt = (const uint16_t *)a->kv.k + tile * D * B + i0;
            const uint16_t *vt = (const uint16_t *)a->kv.v + (tile * B + i0) * D;
            if (h == 0 && i0 + cnt == B && p0 + cnt < n) {
                /* the next block's tiles: streamed from memory while this run computes */
                const size_t nt = (size_t)table[(p0 + cnt) / B] * a->n_kv_head + (size_t)g;
                const char *nk = (const char *)a->kv.k + nt * D * B * sizeof(uint16_t);
                const char *nv = (const char *)a->kv.v + nt * B * D * sizeof(uint16_t);
                for (size_t o = 0; o < (size_t)D * B * sizeof(uint16_t); o += 64) {
                    _mm_prefetch(nk + o, _MM_HINT_T0);
                    _mm_prefetch(nv + o, _MM_HINT_T0);
                }
            }
            size_t ks = (size_t)B; /* stride between channel rows of kt */
            if (cnt < KERN_ATTN_RUN) {
                memset(kpad, 0, sizeof(uint16_t) * (size_t)D * KERN_ATTN_RUN);
                for (int c = 0; c < D; c++)
                    memcpy(kpad + (size_t)c * KERN_ATTN_RUN, kt + (size_t)c * B,
                           sizeof(uint16_t) * (size_t)cnt);
                kt = kpad;
                ks = KERN_ATTN_RUN;
            }
            __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
            for (int c = 0; c < D; c += 2) {
                const uint16_t *k0 = kt + (size_t)c * ks, *k1 = k0 + ks;
                __m256 q0 = _mm256_set1_ps(q[c]), q1 = _mm256_set1_ps(q[c + 1]);
                lo0 =
                    _mm256_fmadd_ps(q0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)k0)), lo0);
                hi0 = _mm256_fmadd_ps(
                    q0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k0 + 8))), hi0);
                lo1 =
                    _mm256_fmadd_ps(q1, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)k1)), lo1);
                hi1 = _mm256_fmadd_ps(
                    q1, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k1 + 8))), hi1);
            }
            const __m256 scale = _mm256_set1_ps(a->scale), ninf = _mm256_set1_ps(-1.0f / 0.0f);
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            __m256 vlo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lane));
            __m256 vhi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt - 8), lane));
            __m256 slo = _mm256_mul_ps(_mm256_add_ps(lo0, lo1), scale);
            __m256 shi = _mm256_mul_ps(_mm256_add_ps(hi0, hi1), scale);
            if (a->softcap > 0) { /* Gemma 2: scalar tanhf, as the reference */
                _Alignas(32) float sv[16];
                _mm256_store_ps(sv, slo);
                _mm256_store_ps(sv + 8, shi);
                for (int i = 0; i < 16; i++)
                    sv[i] = kern_attn_softcap(sv[i], a->softcap);
                slo = _mm256_load_ps(sv);
                shi = _mm256_load_ps(sv + 8);
            }
            slo = _mm256_blendv_ps(ninf, slo, vlo);
            shi = _mm256_blendv_ps(ninf, shi, vhi);
            float bm = hmax_ps(_mm256_max_ps(slo, shi));
            if (bm > m) {
                __m256 r = _mm256_set1_ps(kern_attn_exp(m - bm)); /* 0 on the first run */
                lsum = _mm256_mul_ps(lsum, r);
                for (int j = 0; j < D / 8; j++)
                    acc[j] = _mm256_mul_ps(acc[j], r);
                m = bm;
            }
            __m256 mv = _mm256_set1_ps(m);
            __m256 plo = exp8(_mm256_sub_ps(slo, mv)), phi = exp8(_mm256_sub_ps(shi, mv));
            lsum = _mm256_add_ps(lsum, _mm256_add_ps(plo, phi));
            _mm256_store_ps(pw, plo);
            _mm256_store_ps(pw + 8, phi);
            for (int i = 0; i < cnt; i++) {
                const uint16_t *vr = vt + (size_t)i * D;
                __m256 w = _mm256_set1_ps(pw[i]);
                for (int j = 0; j < D / 8; j++)
                    acc[j] = _mm256_fmadd_ps(
                        w, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vr + 8 * j))), acc[j]);
            }
            p0 += cnt;
        }
        __m256 l = _mm256_set1_ps(hsum_ps(lsum));
        for (int j = 0; j < D / 8; j++)
            _mm256_storeu_ps(out + 8 * j, _mm256_div_ps(acc[j], l));
    }
}
