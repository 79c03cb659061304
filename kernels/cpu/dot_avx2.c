/* AVX2 + FMA + F16C kernels: activation quantization and dot products of weight rows with
 * activations. Compiled with -mavx2 -mfma -mf16c; only reached through kern_cpu_fns_get(), which
 * checks the CPU first. Each kernel matches the scalar reference in quant_ref.c (integer sums
 * exactly; float sums up to rounding, since lanes are summed in a different, fixed order). */
#include <assert.h>
#include <float.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx2.h"

/* ---- helpers ---- */


static inline float f16_load(const uint16_t *p)
{
    return _cvtsh_ss(*p);
}

/* The 16 bytes of a 32-element nibble block as 32 bytes 0..15: element i (low nibble of qs[i])
 * at byte i, element i+16 (high nibble) at byte i+16. */
static inline __m256i nibbles_32(const uint8_t *qs)
{
    /* both lanes load the same 16 bytes (a load-port broadcast, no shuffle); lane 1 is shifted
     * right by 4 within each dword, which brings every byte's high nibble down to its low bits
     * (the bits that come in from the next byte are masked off) */
    __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    both = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* Signed bytes a . signed bytes b, summed in 8 groups of 4 (int32). |a| may be 128, b must not. */
static inline __m256i dot_i8(__m256i a, __m256i b)
{
    return dpbusd(_mm256_setzero_si256(), _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

/* Unsigned bytes a (< 128) . signed bytes b, summed in 8 groups of 4 (int32). */
static inline __m256i dot_u8_i8(__m256i a, __m256i b)
{
    return dpbusd(_mm256_setzero_si256(), a, b);
}

/* roundf() of 8 floats with |v| < 2^31, as int32: truncate, then step away from zero when the
 * dropped fraction (exact) is at least one half. Bitwise the same as the scalar reference. */
static inline __m256i round_away_epi32(__m256 v)
{
    __m256i i = _mm256_cvttps_epi32(v);
    __m256 frac = _mm256_sub_ps(v, _mm256_cvtepi32_ps(i));
    __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 down = _mm256_cmp_ps(frac, _mm256_set1_ps(-0.5f), _CMP_LE_OQ);
    i = _mm256_sub_epi32(i, _mm256_castps_si256(up)); /* mask is -1 where true */
    return _mm256_add_epi32(i, _mm256_castps_si256(down));
}

/* ---- activation quantization ---- */

/* One block of 32 activations as kern_ref_quantize_q8/_q16 do it for levels qmax, bitwise:
 * q[0..3] = the integers of elements 8k..8k+7; returns d, *sum = sum(q). */
static inline float quantize_block(const float *x, float qmax, __m256i q[4], int32_t *sum)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4];
    for (int k = 0; k < 4; k++)
        v[k] = _mm256_loadu_ps(x + 8 * k);
    __m256 m01 = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
    __m256 m23 = _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask));
    float amax = hmax_ps(_mm256_max_ps(m01, m23));
    float d = amax / qmax;
    if (!(d >= FLT_MIN))
        d = 0.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256 vid = _mm256_set1_ps(id);
    for (int k = 0; k < 4; k++)
        q[k] = round_away_epi32(_mm256_mul_ps(v[k], vid));
    *sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    return d;
}

static void avx2_quantize_q8(const float *x, struct kern_q8 *y, int64_t n)
{
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m256i q[4];
        int32_t sum;
        y[b].d = quantize_block(x, 127.0f, q, &sum);
        /* int32 -> int8; the packs interleave 128-bit lanes, the permute restores order */
        __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
        __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)y[b].q, p);
        y[b].s = y[b].d * (float)sum;
    }
}

/* As kern_ref_quantize_q16, bitwise. */
void kern_avx2_quantize_q16(const float *x, struct kern_q16 *y, int64_t n)
{
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m256i q[4];
        int32_t sum;
        y[b].d = quantize_block(x, 32767.0f, q, &sum);
        /* int32 -> int16; packs interleave 128-bit lanes, permute4x64 restores order */
        __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
        __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)y[b].q, p01);
        _mm256_storeu_si256((__m256i *)(y[b].q + 16), p23);
        y[b].s = y[b].d * (float)sum;
    }
}

/* ---- quantized weights . quantized activations ---- */

float kern_avx2_dot_q4_0_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q4_0 *w = vw;
    const __m256i eight = _mm256_set1_epi8(8);
    __m256 acc = _mm256_setzero_ps();
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        __m256i q = _mm256_sub_epi8(nibbles_32(w[b].qs), eight);
        __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].q);
        __m256 s = _mm256_set1_ps(f16_load(&w[b].d) * x[b].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(q, xq)), s, acc);
    }
    return hsum_ps(acc);
}

/* Hot path (the default model is Q4_1): two blocks per iteration on separate accumulators. The
 * fp16 pair (d, m) is converted at once and multiplied by the activation pair (d, s), giving
 * (d*dx, m*s): lane 0 scales the integer dot, lane 1 is the block's offset term. */
static inline void q4_1_block(const struct kern_block_q4_1 *w, const struct kern_q8 *x, __m256 *acc,
                              __m128 *acc_m)
{
    uint32_t dm_bits;
    memcpy(&dm_bits, &w->d, sizeof dm_bits);
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));
    __m128 xds = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&x->d));
    __m128 prod = _mm_mul_ps(dm, xds);
    __m256i xq = _mm256_loadu_si256((const __m256i *)x->q);
    __m256i p = dot_u8_i8(nibbles_32(w->qs), xq);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(prod), *acc);
    *acc_m = _mm_add_ps(*acc_m, prod);
}

float kern_avx2_dot_q4_1_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q4_1 *w = vw;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 acc_m0 = _mm_setzero_ps(), acc_m1 = _mm_setzero_ps();
    int64_t nb = n / KERN_QK, b = 0;
    assert(n % KERN_QK == 0);
    for (; b + 1 < nb; b += 2) {
        q4_1_block(&w[b], &x[b], &acc0, &acc_m0);
        q4_1_block(&w[b + 1], &x[b + 1], &acc1, &acc_m1);
    }
    if (b < nb)
        q4_1_block(&w[b], &x[b], &acc0, &acc_m0);
    __m128 m = _mm_add_ps(acc_m0, acc_m1);
    return hsum_ps(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(_mm_movehdup_ps(m));
}

/* The 32 bits of a Q5_0 qh as 32 bytes: 0x10 where the bit is set, else 0. */
static inline __m256i q5_high_bytes(const uint8_t qh_bytes[4])
{
    uint32_t qh;
    memcpy(&qh, qh_bytes, sizeof qh); /* x86 is little-endian, as the format is */
    __m256i v = _mm256_set1_epi32((int)qh);
    /* byte j takes source byte j/8 (each 128-bit lane sees the same 4 source bytes) */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                            2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL); /* byte j tests bit j%8 */
    v = _mm256_and_si256(_mm256_shuffle_epi8(v, spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

float kern_avx2_dot_q5_0_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q5_0 *w = vw;
    const __m256i sixteen = _mm256_set1_epi8(16);
    __m256 acc = _mm256_setzero_ps();
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        __m256i q = _mm256_or_si256(nibbles_32(w[b].qs), q5_high_bytes(w[b].qh));
        q = _mm256_sub_epi8(q, sixteen);
        __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].q);
        __m256 s = _mm256_set1_ps(f16_load(&w[b].d) * x[b].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(q, xq)), s, acc);
    }
    return hsum_ps(acc);
}

float kern_avx2_dot_q8_0_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q8_0 *w = vw;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t nb = n / KERN_QK, b = 0;
    assert(n % KERN_QK == 0);
    for (; b + 1 < nb; b += 2) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)w[b].qs);
        __m256i w1 = _mm256_loadu_si256((const __m256i *)w[b + 1].qs);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)x[b].q);
        __m256i x1 = _mm256_loadu_si256((const __m256i *)x[b + 1].q);
        __m256 s0 = _mm256_set1_ps(f16_load(&w[b].d) * x[b].d);
        __m256 s1 = _mm256_set1_ps(f16_load(&w[b + 1].d) * x[b + 1].d);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(w0, x0)), s0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(w1, x1)), s1, acc1);
    }
    if (b < nb) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)w[b].qs);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)x[b].q);
        __m256 s0 = _mm256_set1_ps(f16_load(&w[b].d) * x[b].d);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(w0, x0)), s0, acc0);
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1));
}

/* Q4_K: per super-block, the 8 float scales d*sc[j]*dx[j] and the min term dmin*m[j]*s[j] are
 * computed as vectors; each 32-byte qs group then gives sub-blocks 2g (low nibbles) and 2g+1
 * (high nibbles), whose integer dots are scaled by a broadcast from memory (no shuffle). */
float kern_avx2_dot_q4_k_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q4_k *w = vw;
    const __m256i lo_mask = _mm256_set1_epi8(0x0F);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, acc_m = a0;
    assert(n % KERN_QK_K == 0);
    for (int64_t b = 0; b < n / KERN_QK_K; b++, x += 8) {
        uint8_t sm[16];
        kern_q4_k_unpack(w[b].scales, sm);
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
        __m256 mn =
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8))));
        __m256 dx = _mm256_setr_ps(x[0].d, x[1].d, x[2].d, x[3].d, x[4].d, x[5].d, x[6].d, x[7].d);
        __m256 sx = _mm256_setr_ps(x[0].s, x[1].s, x[2].s, x[3].s, x[4].s, x[5].s, x[6].s, x[7].s);
        float scale[8];
        _mm256_storeu_ps(scale,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(f16_load(&w[b].d)), sc), dx));
        acc_m = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(f16_load(&w[b].dmin)), mn), sx, acc_m);
        for (int g = 0; g < 4; g += 2) { /* two 32-byte groups per step, four chains */
            __m256i r0 = _mm256_loadu_si256((const __m256i *)(w[b].qs + 32 * g));
            __m256i r1 = _mm256_loadu_si256((const __m256i *)(w[b].qs + 32 * g + 32));
            __m256i p0 = dot_u8_i8(_mm256_and_si256(r0, lo_mask),
                                   _mm256_loadu_si256((const __m256i *)x[2 * g].q));
            __m256i p1 = dot_u8_i8(_mm256_and_si256(_mm256_srli_epi16(r0, 4), lo_mask),
                                   _mm256_loadu_si256((const __m256i *)x[2 * g + 1].q));
            __m256i p2 = dot_u8_i8(_mm256_and_si256(r1, lo_mask),
                                   _mm256_loadu_si256((const __m256i *)x[2 * g + 2].q));
            __m256i p3 = dot_u8_i8(_mm256_and_si256(_mm256_srli_epi16(r1, 4), lo_mask),
                                   _mm256_loadu_si256((const __m256i *)x[2 * g + 3].q));
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(&scale[2 * g]), a0);
            a1 =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(&scale[2 * g + 1]), a1);
            a2 =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_broadcast_ss(&scale[2 * g + 2]), a2);
            a3 =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(p3), _mm256_broadcast_ss(&scale[2 * g + 3]), a3);
        }
    }
    __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    return hsum_ps(sum) - hsum_ps(acc_m);
}

/* Q6_K: the 6-bit values of 32 elements as unsigned bytes 0..63, group k of a 128-element half.
 * ql_lo/ql_hi are ql[0..31]/ql[32..63] of the half, qh its 32 high-bit bytes. */
static inline __m256i q6_group(__m256i ql_lo, __m256i ql_hi, __m256i qh, int k)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    __m256i ql = k % 2 ? ql_hi : ql_lo;
    __m256i low = k / 2 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) : _mm256_and_si256(ql, m4);
    __m256i high;
    switch (k) { /* bits 2k..2k+1 of qh moved to bits 4..5 */
    case 0:
        high = _mm256_slli_epi16(qh, 4);
        break;
    case 1:
        high = _mm256_slli_epi16(qh, 2);
        break;
    case 2:
        high = qh;
        break;
    default:
        high = _mm256_srli_epi16(qh, 2);
        break;
    }
    return _mm256_or_si256(low, _mm256_and_si256(high, m2));
}

float kern_avx2_dot_q6_k_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q6_k *w = vw;
    const __m256i thirty_two = _mm256_set1_epi8(32);
    /* scale-byte selectors: bytes 0..7 take scale 2j, bytes 8..15 take scale 2j+1 */
    const __m128i sel0 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m256 acc = _mm256_setzero_ps();
    assert(n % KERN_QK_K == 0);
    for (int64_t b = 0; b < n / KERN_QK_K; b++, x += 8) {
        float d = f16_load(&w[b].d);
        __m128i scales = _mm_loadu_si128((const __m128i *)w[b].scales);
        __m128i sel = sel0;
        for (int h = 0; h < 2; h++) {
            __m256i ql_lo = _mm256_loadu_si256((const __m256i *)(w[b].ql + 64 * h));
            __m256i ql_hi = _mm256_loadu_si256((const __m256i *)(w[b].ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(w[b].qh + 32 * h));
            for (int k = 0; k < 4; k++) {
                const struct kern_q8 *xb = &x[4 * h + k];
                __m256i xq = _mm256_loadu_si256((const __m256i *)xb->q);
                __m256i q = q6_group(ql_lo, ql_hi, qh, k);
                /* (q - 32) . x as int16 pairs: |.| <= 63*127*2 + 32*127*2, fits */
                __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q, xq),
                                               _mm256_maddubs_epi16(thirty_two, xq));
                __m256i sc16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, sel));
                sel = _mm_add_epi8(sel, _mm_set1_epi8(2));
                __m256i p = _mm256_madd_epi16(p16, sc16);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xb->d), acc);
            }
        }
    }
    return hsum_ps(acc);
}

/* ---- float weights . float activations ---- */

/* 8 weights as floats; the caller-supplied loader decides the storage type. */
static inline __m256 load8_f32(const void *w, int64_t i)
{
    return _mm256_loadu_ps((const float *)w + i);
}

static inline __m256 load8_f16(const void *w, int64_t i)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
}

static inline __m256 load8_bf16(const void *w, int64_t i)
{
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* Four accumulators over 32 elements per step, then a scalar tail in the reference order. */
#define DOT_FLOAT_BODY(load8, scalar_w)                                                            \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                    \
    int64_t i = 0;                                                                                 \
    for (; i + 32 <= n; i += 32) {                                                                 \
        a0 = _mm256_fmadd_ps(load8(w, i), _mm256_loadu_ps(x + i), a0);                             \
        a1 = _mm256_fmadd_ps(load8(w, i + 8), _mm256_loadu_ps(x + i + 8), a1);                     \
        a2 = _mm256_fmadd_ps(load8(w, i + 16), _mm256_loadu_ps(x + i + 16), a2);                   \
        a3 = _mm256_fmadd_ps(load8(w, i + 24), _mm256_loadu_ps(x + i + 24), a3);                   \
    }                                                                                              \
    for (; i + 8 <= n; i += 8)                                                                     \
        a0 = _mm256_fmadd_ps(load8(w, i), _mm256_loadu_ps(x + i), a0);                             \
    float sum = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));              \
    for (; i < n; i++)                                                                             \
        sum += (scalar_w)*x[i];                                                                    \
    return sum;

float kern_avx2_dot_f32_f32(const void *w, const float *x, int64_t n)
{
    DOT_FLOAT_BODY(load8_f32, ((const float *)w)[i])
}

float kern_avx2_dot_f16_f32(const void *w, const float *x, int64_t n)
{
    DOT_FLOAT_BODY(load8_f16, kern_f16_to_f32(((const uint16_t *)w)[i]))
}

float kern_avx2_dot_bf16_f32(const void *w, const float *x, int64_t n)
{
    DOT_FLOAT_BODY(load8_bf16, kern_bf16_to_f32(((const uint16_t *)w)[i]))
}

/* ---- dequantization (exact: same float operations as the reference) ---- */

void kern_avx2_dequant_f16(const void *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, load8_f16(src, i));
    for (; i < n; i++)
        dst[i] = kern_f16_to_f32(((const uint16_t *)src)[i]);
}

void kern_avx2_dequant_q4_1(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q4_1 *w = src;
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        __m256 d = _mm256_set1_ps(f16_load(&w[b].d));
        __m256 m = _mm256_set1_ps(f16_load(&w[b].m));
        __m256i q = nibbles_32(w[b].qs);
        __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        for (int k = 0; k < 4; k++) { /* elements 8k..8k+7 */
            __m128i q8 = k % 2 ? _mm_srli_si128(half[k / 2], 8) : half[k / 2];
            __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
            /* mul then add, not FMA: the reference rounds twice */
            _mm256_storeu_ps(dst + 8 * k, _mm256_add_ps(_mm256_mul_ps(d, qf), m));
        }
    }
}

void kern_avx2_dequant_q8_0(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q8_0 *w = src;
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        __m256 d = _mm256_set1_ps(f16_load(&w[b].d));
        for (int k = 0; k < 4; k++) {
            __m256i q32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w[b].qs + 8 * k)));
            _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q32)));
        }
    }
}

/* ---- weight rows . float activations (matvec) ----
 * Each weight is dequantized in registers with the reference's float operations (convert, then
 * mul/add, never FMA, so the value is bitwise the reference's) and FMA'd into the row's two
 * accumulators. MATVEC_ROWS rows are done at once so each activation load serves them all; the
 * leftover rows go one at a time through the same inlined body, whose per-row operations do not
 * depend on how many rows share a pass: a row's result never depends on its grouping. */

#define MATVEC_ROWS   4
#define ALWAYS_INLINE inline __attribute__((always_inline))
/* Loops over rows and vector parts are unrolled so the accumulators live in registers. */
#define UNROLL _Pragma("GCC unroll 8")

/* The matvec entry point `name`: rows in groups of MATVEC_ROWS, then singly, through
 * rows_fn(w, row_bytes, n_rows_in_pass, x, n, y), which must be always-inlined. */
#define MATVEC_DRIVER(storage, name, rows_fn)                                                      \
    storage void name(KERN_MATVEC_ARGS)                                                            \
    {                                                                                              \
        int64_t r = 0;                                                                             \
        for (; r + MATVEC_ROWS <= n_rows; r += MATVEC_ROWS)                                        \
            rows_fn((const char *)w + (size_t)r * row_bytes, row_bytes, MATVEC_ROWS, x, n, y + r); \
        for (; r < n_rows; r++)                                                                    \
            rows_fn((const char *)w + (size_t)r * row_bytes, row_bytes, 1, x, n, y + r);           \
    }

/* The fp16 at p and the one after it as floats in lanes 0 and 1 (one vcvtph2ps from memory,
 * cheaper than two scalar conversions). Reads 8 bytes: callers pass a block's leading scale
 * field, and every block is longer than that. */
static inline __m128 f16x2_load(const void *p)
{
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
}

/* 8 bytes at p as 8 int32, zero-extended (vpmovzxbd with a memory operand). */
static inline __m256i load8_u8(const uint8_t *p)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Q4_0 and Q4_1 share a body: x = d * (nibble - 8), or x = d * nibble + m. */
static ALWAYS_INLINE void q4_rows(const char *w, size_t rb, const int nr, const float *x, int64_t n,
                                  float *y, const int has_min)
{
    const __m256i lo_mask = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
    const size_t bb = has_min ? sizeof(struct kern_block_q4_1) : sizeof(struct kern_block_q4_0);
    const size_t qs_off =
        has_min ? offsetof(struct kern_block_q4_1, qs) : offsetof(struct kern_block_q4_0, qs);
    __m256 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m256 xv[4];
        UNROLL
        for (int p = 0; p < 4; p++)
            xv[p] = _mm256_loadu_ps(x + 8 * p);
        UNROLL
        for (int k = 0; k < nr; k++) {
            const char *blk = w + (size_t)k * rb + (size_t)b * bb;
            const uint8_t *qs = (const uint8_t *)blk + qs_off;
            __m128 dm = f16x2_load(blk); /* d, and m for Q4_1 */
            __m256 d = _mm256_broadcastss_ps(dm);
            __m256i raw0 = load8_u8(qs), raw1 = load8_u8(qs + 8);
            /* elements 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles) */
            __m256i q[4] = {_mm256_and_si256(raw0, lo_mask), _mm256_and_si256(raw1, lo_mask),
                            _mm256_srli_epi32(raw0, 4), _mm256_srli_epi32(raw1, 4)};
            UNROLL
            for (int p = 0; p < 4; p++) {
                __m256 v;
                if (has_min) {
                    __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                    v = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[p])), m);
                } else {
                    v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[p], eight)));
                }
                acc[k][p % 2] = _mm256_fmadd_ps(v, xv[p], acc[k][p % 2]);
            }
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = hsum_ps(_mm256_add_ps(acc[k][0], acc[k][1]));
}

static ALWAYS_INLINE void q4_0_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    q4_rows(w, rb, nr, x, n, y, 0);
}

static ALWAYS_INLINE void q4_1_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    q4_rows(w, rb, nr, x, n, y, 1);
}

MATVEC_DRIVER(static, avx2_matvec_q4_0_f32, q4_0_rows)
MATVEC_DRIVER(static, avx2_matvec_q4_1_f32, q4_1_rows)

/* Q5_0: the fifth bit of element j is bit j of qh, moved to bit 4 with a variable shift. */
static ALWAYS_INLINE void q5_0_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    const __m256i lo_mask = _mm256_set1_epi32(0xF);
    const __m256i sixteen = _mm256_set1_epi32(16);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    __m256 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m256 xv[4];
        UNROLL
        for (int p = 0; p < 4; p++)
            xv[p] = _mm256_loadu_ps(x + 8 * p);
        UNROLL
        for (int k = 0; k < nr; k++) {
            const struct kern_block_q5_0 *blk =
                (const struct kern_block_q5_0 *)(w + (size_t)k * rb) + b;
            __m256 d = _mm256_broadcastss_ps(f16x2_load(blk));
            uint32_t qh;
            memcpy(&qh, blk->qh, sizeof qh);
            __m256i vqh = _mm256_set1_epi32((int)qh);
            __m256i raw0 = load8_u8(blk->qs), raw1 = load8_u8(blk->qs + 8);
            __m256i q[4] = {_mm256_and_si256(raw0, lo_mask), _mm256_and_si256(raw1, lo_mask),
                            _mm256_srli_epi32(raw0, 4), _mm256_srli_epi32(raw1, 4)};
            UNROLL
            for (int p = 0; p < 4; p++) {
                /* lane l takes bit 8p + l of qh, moved to bit 4 */
                __m256i sh = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * p));
                __m256i h = _mm256_and_si256(_mm256_srlv_epi32(vqh, sh), one);
                __m256i v =
                    _mm256_sub_epi32(_mm256_or_si256(q[p], _mm256_slli_epi32(h, 4)), sixteen);
                __m256 wv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
                acc[k][p % 2] = _mm256_fmadd_ps(wv, xv[p], acc[k][p % 2]);
            }
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = hsum_ps(_mm256_add_ps(acc[k][0], acc[k][1]));
}

MATVEC_DRIVER(static, avx2_matvec_q5_0_f32, q5_0_rows)

/* Q8_0: x = d * q. */
static ALWAYS_INLINE void q8_0_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    __m256 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m256 xv[4];
        UNROLL
        for (int p = 0; p < 4; p++)
            xv[p] = _mm256_loadu_ps(x + 8 * p);
        UNROLL
        for (int k = 0; k < nr; k++) {
            const struct kern_block_q8_0 *blk =
                (const struct kern_block_q8_0 *)(w + (size_t)k * rb) + b;
            __m256 d = _mm256_broadcastss_ps(f16x2_load(blk));
            UNROLL
            for (int p = 0; p < 4; p++) {
                __m256i q =
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk->qs + 8 * p)));
                __m256 wv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
                acc[k][p % 2] = _mm256_fmadd_ps(wv, xv[p], acc[k][p % 2]);
            }
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = hsum_ps(_mm256_add_ps(acc[k][0], acc[k][1]));
}

MATVEC_DRIVER(static, avx2_matvec_q8_0_f32, q8_0_rows)

/* Q4_K: per super-block and row, the 8 sub-block factors d*sc and dmin*m are computed as one
 * vector each (the reference's single roundings) and read back as broadcasts; then
 * x = (d*sc) * nibble - dmin*m. */
static ALWAYS_INLINE void q4_k_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    const __m256i lo_mask = _mm256_set1_epi32(0xF);
    __m256 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK_K; b++, x += KERN_QK_K) {
        UNROLL
        for (int k = 0; k < nr; k++) {
            const struct kern_block_q4_k *blk =
                (const struct kern_block_q4_k *)(w + (size_t)k * rb) + b;
            uint8_t sm[16];
            kern_q4_k_unpack(blk->scales, sm);
            float scale[8], mins[8];
            __m256 sc =
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
            __m256 mn = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8))));
            _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(f16_load(&blk->d)), sc));
            _mm256_storeu_ps(mins, _mm256_mul_ps(_mm256_set1_ps(f16_load(&blk->dmin)), mn));
            UNROLL
            for (int j = 0; j < 8; j++) { /* sub-block j: elements 32j..32j+31 */
                const uint8_t *qs = blk->qs + 32 * (j / 2);
                __m256 d1 = _mm256_broadcast_ss(&scale[j]), m1 = _mm256_broadcast_ss(&mins[j]);
                UNROLL
                for (int p = 0; p < 4; p++) {
                    __m256i q = load8_u8(qs + 8 * p);
                    q = j % 2 ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, lo_mask);
                    __m256 wv = _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(q)), m1);
                    acc[k][p % 2] =
                        _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 32 * j + 8 * p), acc[k][p % 2]);
                }
            }
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = hsum_ps(_mm256_add_ps(acc[k][0], acc[k][1]));
}

MATVEC_DRIVER(static, avx2_matvec_q4_k_f32, q4_k_rows)

/* Q6_K: x = (d * scale) * (q6 - 32), the factor d*scale per 16 elements as in the reference. */
static ALWAYS_INLINE void q6_k_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    const __m256i m4 = _mm256_set1_epi32(0xF), m2 = _mm256_set1_epi32(3);
    const __m256i thirty_two = _mm256_set1_epi32(32);
    __m256 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK_K; b++, x += KERN_QK_K) {
        UNROLL
        for (int k = 0; k < nr; k++) {
            const struct kern_block_q6_k *blk =
                (const struct kern_block_q6_k *)(w + (size_t)k * rb) + b;
            float scale[16];
            __m256 d = _mm256_set1_ps(f16_load(&blk->d)); /* d is at the block end */
            UNROLL
            for (int h = 0; h < 2; h++) {
                __m128i s8 = _mm_loadl_epi64((const __m128i *)(blk->scales + 8 * h));
                _mm256_storeu_ps(scale + 8 * h,
                                 _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
            }
            UNROLL
            for (int g = 0; g < 8; g++) { /* 32 elements: half g/4, group g%4 */
                int h = g / 4, gk = g % 4;
                const uint8_t *ql = blk->ql + 64 * h + 32 * (gk % 2);
                const uint8_t *qh = blk->qh + 32 * h;
                UNROLL
                for (int p = 0; p < 4; p++) {
                    __m256i lo = load8_u8(ql + 8 * p), hi = load8_u8(qh + 8 * p);
                    lo = _mm256_and_si256(_mm256_srli_epi32(lo, 4 * (gk / 2)), m4);
                    hi = _mm256_and_si256(_mm256_srli_epi32(hi, 2 * gk), m2);
                    __m256i q =
                        _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), thirty_two);
                    __m256 s = _mm256_broadcast_ss(&scale[2 * g + p / 2]);
                    __m256 wv = _mm256_mul_ps(s, _mm256_cvtepi32_ps(q));
                    acc[k][p % 2] =
                        _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 32 * g + 8 * p), acc[k][p % 2]);
                }
            }
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = hsum_ps(_mm256_add_ps(acc[k][0], acc[k][1]));
}

MATVEC_DRIVER(, kern_avx2_matvec_q6_k_f32, q6_k_rows)

/* Float rows: one dot per row. */
#define MATVEC_FLOAT(name, dot)                                                                    \
    static void name(KERN_MATVEC_ARGS)                                                             \
    {                                                                                              \
        for (int64_t r = 0; r < n_rows; r++)                                                       \
            y[r] = dot((const char *)w + (size_t)r * row_bytes, x, n);                             \
    }

MATVEC_FLOAT(avx2_matvec_f32_f32, kern_avx2_dot_f32_f32)
MATVEC_FLOAT(avx2_matvec_f16_f32, kern_avx2_dot_f16_f32)
MATVEC_FLOAT(avx2_matvec_bf16_f32, kern_avx2_dot_bf16_f32)

/* dot_avxvnni.c compiles this file again as the "avx-vnni" table (avxvnni_names.h) */
#ifndef AVX2_TABLE_ISA
#define AVX2_TABLE_ISA  KERN_ISA_AVX2
#define AVX2_TABLE_NAME "avx2"
#endif

const struct kern_cpu_fns kern_cpu_fns_avx2 = {
    .isa = AVX2_TABLE_ISA,
    .name = AVX2_TABLE_NAME,
    .quantize_q8 = avx2_quantize_q8,
    .vec_dot_q8 =
        {
            [DTYPE_Q4_0] = kern_avx2_dot_q4_0_q8,
            [DTYPE_Q4_1] = kern_avx2_dot_q4_1_q8,
            [DTYPE_Q5_0] = kern_avx2_dot_q5_0_q8,
            [DTYPE_Q8_0] = kern_avx2_dot_q8_0_q8,
            [DTYPE_Q4_K] = kern_avx2_dot_q4_k_q8,
            [DTYPE_Q6_K] = kern_avx2_dot_q6_k_q8,
        },
    .vec_dot_f32 =
        {
            [DTYPE_F32] = kern_avx2_dot_f32_f32,
            [DTYPE_F16] = kern_avx2_dot_f16_f32,
            [DTYPE_BF16] = kern_avx2_dot_bf16_f32,
        },
    .dequant_row =
        {
            [DTYPE_F32] = kern_ref_dequant_f32,
            [DTYPE_F16] = kern_avx2_dequant_f16,
            [DTYPE_BF16] = kern_ref_dequant_bf16,
            [DTYPE_Q4_0] = kern_ref_dequant_q4_0,
            [DTYPE_Q4_1] = kern_avx2_dequant_q4_1,
            [DTYPE_Q5_0] = kern_ref_dequant_q5_0,
            [DTYPE_Q8_0] = kern_avx2_dequant_q8_0,
            [DTYPE_Q4_K] = kern_ref_dequant_q4_k,
            [DTYPE_Q6_K] = kern_ref_dequant_q6_k,
        },

    .matvec_f32 =
        {
            [DTYPE_F32] = avx2_matvec_f32_f32,
            [DTYPE_F16] = avx2_matvec_f16_f32,
            [DTYPE_BF16] = avx2_matvec_bf16_f32,
            [DTYPE_Q4_0] = avx2_matvec_q4_0_f32,
            [DTYPE_Q4_1] = avx2_matvec_q4_1_f32,
            [DTYPE_Q5_0] = avx2_matvec_q5_0_f32,
            [DTYPE_Q8_0] = avx2_matvec_q8_0_f32,
            [DTYPE_Q4_K] = avx2_matvec_q4_k_f32,
            [DTYPE_Q6_K] = kern_avx2_matvec_q6_k_f32,
        },
    .gemm_f32 =
        {
            [DTYPE_F32] = kern_avx2_gemm_f32_f32,
            [DTYPE_F16] = kern_avx2_gemm_f16_f32,
            [DTYPE_BF16] = kern_avx2_gemm_bf16_f32,
            [DTYPE_Q4_0] = kern_avx2_gemm_q4_0_f32,
            [DTYPE_Q4_1] = kern_avx2_gemm_q4_1_f32,
            [DTYPE_Q5_0] = kern_avx2_gemm_q5_0_f32,
            [DTYPE_Q8_0] = kern_avx2_gemm_q8_0_f32,
            [DTYPE_Q4_K] = kern_avx2_gemm_q4_k_f32,
            [DTYPE_Q6_K] = kern_avx2_gemm_q6_k_f32,
        },
    .gemm_q8 =
        {
            [DTYPE_Q4_0] = kern_avx2_gemm_q4_0_q8,
            [DTYPE_Q4_1] = kern_avx2_gemm_q4_1_q8,
            [DTYPE_Q5_0] = kern_avx2_gemm_q5_0_q8,
            [DTYPE_Q8_0] = kern_avx2_gemm_q8_0_q8,
            [DTYPE_Q4_K] = kern_avx2_gemm_q4_k_q8,
            [DTYPE_Q6_K] = kern_avx2_gemm_q6_k_q8,
        },
    .panel_bytes = kern_avx2_panel_bytes,
    .panel_pack = kern_avx2_panel_pack,
    .gemm_q8_packed =
        {
            [DTYPE_Q4_0] = kern_avx2_gemm_q4_0_q8_packed,
            [DTYPE_Q4_1] = kern_avx2_gemm_q4_1_q8_packed,
            [DTYPE_Q8_0] = kern_avx2_gemm_q8_0_q8_packed,
        },
    .to_f16 = kern_avx2_to_f16,
    .kv_quant_q8 = kern_kv_quant_q8,
    .attn_group = kern_avx2_attn_group,
    .rmsnorm = kern_avx2_rmsnorm,
    .swiglu = kern_avx2_swiglu,
    .geglu = kern_avx2_geglu,
    .rope = kern_ref_rope,
    .quantize_q16 = kern_avx2_quantize_q16,
    .gemm_q16 =
        {
            [DTYPE_Q4_0] = kern_avx2_gemm_q4_0_q16,
            [DTYPE_Q4_1] = kern_avx2_gemm_q4_1_q16,
            [DTYPE_Q8_0] = kern_avx2_gemm_q8_0_q16,
        },
};
