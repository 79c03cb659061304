/* AVX-512 (F/BW/VL/DQ) + VNNI kernels: activation quantization and dot products of weight rows
 * with activations, using vpdpbusd for the integer parts. Only reached through kern_cpu_fns_get(),
 * which checks the CPU first; kernels with nothing to gain here reuse the AVX2 ones. Each matches
 * the scalar reference in quant_ref.c (integer sums exactly, float sums up to rounding). */

/* The Makefile also passes -mavxvnni, which lets gcc encode 256-bit vpdpbusd with VEX: that form
 * needs the separate AVX-VNNI cpuid bit, which many AVX-512 VNNI CPUs (Ice Lake, Cascade Lake)
 * lack. Turn it off so every vpdpbusd here is EVEX (AVX512_VNNI + AVX512VL). */
#pragma GCC target("no-avxvnni")

#include <assert.h>
#include <float.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

/* ---- helpers ---- */

static inline float hsum256_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum512_ps(__m512 v)
{
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum256_ps(_mm256_add_ps(lo, hi));
}

static inline float f16_load(const uint16_t *p)
{
    return _cvtsh_ss(*p);
}

/* Element i of a 32-element nibble block (low nibble of qs[i], or high nibble of qs[i-16]) as
 * byte i, values 0..15: the 16 bytes are broadcast to both lanes by the load, lane 1 is shifted
 * right by 4 within each dword, and the mask drops the bits that came from the next byte. */
static inline __m256i nibbles_32(const uint8_t *qs)
{
    __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    both = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

static inline __m256i load_q(const struct kern_q8 *x)
{
    return _mm256_loadu_si256((const __m256i *)x->q);
}

/* Unsigned bytes a . signed bytes b in 8 groups of 4 (int32); no saturation. */
static inline __m256i dot_u8_i8(__m256i a, __m256i b)
{
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
}

/* Signed bytes a . signed bytes b in 8 groups of 4: |a| as unsigned times b with a's sign
 * (vpsignb, which zeroes b where a is 0). a may be -128 (|a| = 128 unsigned); b must not be. */
static inline __m256i dot_i8(__m256i a, __m256i b)
{
    return dot_u8_i8(_mm256_abs_epi8(a), _mm256_sign_epi8(b, a));
}

/* ---- activation quantization ---- */

/* roundf() of 16 floats with |v| < 2^31, as int32, bitwise as the scalar reference: truncate,
 * then step away from zero where the (exact) dropped fraction is at least one half. */
static inline __m512i round_away_epi32(__m512 v)
{
    __m512i i = _mm512_cvttps_epi32(v);
    __m512 frac = _mm512_sub_ps(v, _mm512_cvtepi32_ps(i));
    __mmask16 up = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __mmask16 down = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(-0.5f), _CMP_LE_OQ);
    i = _mm512_mask_add_epi32(i, up, i, _mm512_set1_epi32(1));
    return _mm512_mask_sub_epi32(i, down, i, _mm512_set1_epi32(1));
}

/* One block of 32 activations as kern_ref_quantize_q8/_q16 do it for levels qmax, bitwise:
 * q0, q1 = the two halves' integers; returns d, *sum = sum(q). */
static inline float quantize_block(const float *x, float qmax, __m512i *q0, __m512i *q1,
                                   int32_t *sum)
{
    __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float d = amax / qmax;
    if (!(d >= FLT_MIN))
        d = 0.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m512 vid = _mm512_set1_ps(id);
    *q0 = round_away_epi32(_mm512_mul_ps(v0, vid));
    *q1 = round_away_epi32(_mm512_mul_ps(v1, vid));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(*q0, *q1));
    return d;
}

static void avx512_quantize_q8(const float *x, struct kern_q8 *y, int64_t n)
{
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m512i q0, q1;
        int32_t sum;
        y[b].d = quantize_block(x, 127.0f, &q0, &q1, &sum);
        _mm_storeu_si128((__m128i *)y[b].q, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(y[b].q + 16), _mm512_cvtsepi32_epi8(q1));
        y[b].s = y[b].d * (float)sum;
    }
}

/* As kern_ref_quantize_q16, bitwise. */
void kern_avx512_quantize_q16(const float *x, struct kern_q16 *y, int64_t n)
{
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m512i q0, q1;
        int32_t sum;
        y[b].d = quantize_block(x, 32767.0f, &q0, &q1, &sum);
        _mm256_storeu_si256((__m256i *)y[b].q, _mm512_cvtsepi32_epi16(q0));
        _mm256_storeu_si256((__m256i *)(y[b].q + 16), _mm512_cvtsepi32_epi16(q1));
        y[b].s = y[b].d * (float)sum;
    }
}

/* ---- quantized weights . quantized activations ---- */

static float avx512_dot_q4_0_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q4_0 *w = vw;
    const __m256i eight = _mm256_set1_epi8(8);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t nb = n / KERN_QK, b = 0;
    assert(n % KERN_QK == 0);
    /* (q - 8) . x = q . x - 8 . x, both unsigned . signed */
    for (; b + 1 < nb; b += 2) {
        __m256i x0 = load_q(&x[b]), x1 = load_q(&x[b + 1]);
        __m256i p0 = _mm256_sub_epi32(dot_u8_i8(nibbles_32(w[b].qs), x0), dot_u8_i8(eight, x0));
        __m256i p1 = _mm256_sub_epi32(dot_u8_i8(nibbles_32(w[b + 1].qs), x1), dot_u8_i8(eight, x1));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f16_load(&w[b].d) * x[b].d),
                               acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                               _mm256_set1_ps(f16_load(&w[b + 1].d) * x[b + 1].d), acc1);
    }
    if (b < nb) {
        __m256i x0 = load_q(&x[b]);
        __m256i p0 = _mm256_sub_epi32(dot_u8_i8(nibbles_32(w[b].qs), x0), dot_u8_i8(eight, x0));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f16_load(&w[b].d) * x[b].d),
                               acc0);
    }
    return hsum256_ps(_mm256_add_ps(acc0, acc1));
}

/* Q4_1 is the hot path (the default model). The integer part of a block: its 16 nibble bytes
 * are broadcast to both 128-bit lanes and masked to the low nibbles (lane 0) and to the high
 * nibbles left in place, i.e. times 16 (lane 1); vpdpbusd sums them against the activations (no
 * saturation: 240*127*4 fits int32). The factor 16 stays in accumulator lanes 4..7 and is removed
 * once at the end by an exact multiply by 1/16, so no per-block shuffle or shift is needed. */
static inline __m256 q4_1_idot(const struct kern_block_q4_1 *w, const struct kern_q8 *x)
{
    const __m256i nib_mask =
        _mm256_setr_epi64x(0x0F0F0F0F0F0F0F0FLL, 0x0F0F0F0F0F0F0F0FLL,
                           (long long)0xF0F0F0F0F0F0F0F0ULL, (long long)0xF0F0F0F0F0F0F0F0ULL);
    __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->qs));
    return _mm256_cvtepi32_ps(dot_u8_i8(_mm256_and_si256(raw, nib_mask), load_q(x)));
}

/* The activation pairs (d, s) of blocks x0 and x1 as [d0, s0, d1, s1]. */
static inline __m128 q8_ds_pair(const struct kern_q8 *x0, const struct kern_q8 *x1)
{
    __m128 lo = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&x0->d));
    return _mm_loadh_pi(lo, (const __m64 *)&x1->d);
}

/* Scales come four blocks at a time: the fp16 pairs (d, m) of blocks b..b+3 (byte offsets 0, 20,
 * 40, 60) are dwords 0 and 5 of two 32-byte loads, converted together and multiplied by the
 * activation pairs (d, s), giving [d0*dx0, m0*s0, d1*dx1, m1*s1, ...]: even lanes scale the
 * integer dots, odd lanes are the offset terms m*s (summed once at the end). Only 256-bit
 * registers are used: 512-bit ops would shut down a vector port on most Intel cores. */
static float avx512_dot_q4_1_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q4_1 *w = vw;
    const __m256i pick_dm = _mm256_setr_epi32(0, 5, 8, 13, 0, 0, 0, 0);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; /* four independent chains */
    __m256 acc_m = a0;
    int64_t nb = n / KERN_QK, b = 0;
    assert(n % KERN_QK == 0);
    for (; b + 3 < nb; b += 4) {
        __m256i wa = _mm256_loadu_si256((const __m256i *)&w[b]);
        __m256i wb = _mm256_loadu_si256((const __m256i *)&w[b + 2]);
        __m128i dm = _mm256_castsi256_si128(_mm256_permutex2var_epi32(wa, pick_dm, wb));
        __m256 xds =
            _mm256_set_m128(q8_ds_pair(&x[b + 2], &x[b + 3]), q8_ds_pair(&x[b], &x[b + 1]));
        __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(dm), xds);
        acc_m = _mm256_add_ps(acc_m, prod);
        a0 = _mm256_fmadd_ps(q4_1_idot(&w[b], &x[b]),
                             _mm256_permutevar8x32_ps(prod, _mm256_set1_epi32(0)), a0);
        a1 = _mm256_fmadd_ps(q4_1_idot(&w[b + 1], &x[b + 1]),
                             _mm256_permutevar8x32_ps(prod, _mm256_set1_epi32(2)), a1);
        a2 = _mm256_fmadd_ps(q4_1_idot(&w[b + 2], &x[b + 2]),
                             _mm256_permutevar8x32_ps(prod, _mm256_set1_epi32(4)), a2);
        a3 = _mm256_fmadd_ps(q4_1_idot(&w[b + 3], &x[b + 3]),
                             _mm256_permutevar8x32_ps(prod, _mm256_set1_epi32(6)), a3);
    }
    for (; b < nb; b++) { /* the last 0..3 blocks one at a time */
        uint32_t dm_bits;
        memcpy(&dm_bits, &w[b].d, sizeof dm_bits);
        __m128 prod = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits)),
                                 _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&x[b].d)));
        a0 = _mm256_fmadd_ps(q4_1_idot(&w[b], &x[b]), _mm256_broadcastss_ps(prod), a0);
        acc_m = _mm256_add_ps(acc_m, _mm256_zextps128_ps256(prod));
    }
    const __m256 unscale = _mm256_setr_ps(1, 1, 1, 1, 0.0625f, 0.0625f, 0.0625f, 0.0625f);
    const __m256 odd = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
    __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    return hsum256_ps(_mm256_mul_ps(sum, unscale)) + hsum256_ps(_mm256_and_ps(acc_m, odd));
}

static float avx512_dot_q5_0_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q5_0 *w = vw;
    const __m256i sixteen = _mm256_set1_epi8(16);
    __m256 acc = _mm256_setzero_ps();
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        uint32_t qh;
        memcpy(&qh, w[b].qh, sizeof qh); /* bit j: bit 4 of element j (little-endian) */
        __m256i q = _mm256_or_si256(nibbles_32(w[b].qs), _mm256_maskz_mov_epi8(qh, sixteen));
        __m256i xq = load_q(&x[b]);
        /* (q - 16) . x = q . x - 16 . x */
        __m256i p = _mm256_sub_epi32(dot_u8_i8(q, xq), dot_u8_i8(sixteen, xq));
        acc =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(f16_load(&w[b].d) * x[b].d), acc);
    }
    return hsum256_ps(acc);
}

/* Q8_0 (the output head): two blocks per iteration on separate accumulators. */
static float avx512_dot_q8_0_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q8_0 *w = vw;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t nb = n / KERN_QK, b = 0;
    assert(n % KERN_QK == 0);
    for (; b + 1 < nb; b += 2) {
        __m256i p0 = dot_i8(_mm256_loadu_si256((const __m256i *)w[b].qs), load_q(&x[b]));
        __m256i p1 = dot_i8(_mm256_loadu_si256((const __m256i *)w[b + 1].qs), load_q(&x[b + 1]));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f16_load(&w[b].d) * x[b].d),
                               acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                               _mm256_set1_ps(f16_load(&w[b + 1].d) * x[b + 1].d), acc1);
    }
    if (b < nb) {
        __m256i p0 = dot_i8(_mm256_loadu_si256((const __m256i *)w[b].qs), load_q(&x[b]));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f16_load(&w[b].d) * x[b].d),
                               acc0);
    }
    return hsum256_ps(_mm256_add_ps(acc0, acc1));
}

/* Q4_K: as the AVX2 version (vector scales per super-block, broadcasts from memory), with
 * vpdpbusd for the integer dots. */
static float avx512_dot_q4_k_q8(const void *vw, const struct kern_q8 *x, int64_t n)
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
            __m256i p0 = dot_u8_i8(_mm256_and_si256(r0, lo_mask), load_q(&x[2 * g]));
            __m256i p1 = dot_u8_i8(_mm256_and_si256(_mm256_srli_epi16(r0, 4), lo_mask),
                                   load_q(&x[2 * g + 1]));
            __m256i p2 = dot_u8_i8(_mm256_and_si256(r1, lo_mask), load_q(&x[2 * g + 2]));
            __m256i p3 = dot_u8_i8(_mm256_and_si256(_mm256_srli_epi16(r1, 4), lo_mask),
                                   load_q(&x[2 * g + 3]));
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
    return hsum256_ps(sum) - hsum256_ps(acc_m);
}

/* Q6_K: two activation blocks (groups k and k+1 of a 128-element half) per 512-bit step. The
 * 6-bit values are built as unsigned bytes 0..63; (q - 32) . x = q . x - 32 . x per group of 4
 * (two vpdpbusd), then each int32 lane is weighted by its 16-element sub-block scale (vpmulld)
 * and by d*dx of its activation block in float. */
static float avx512_dot_q6_k_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q6_k *w = vw;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    const __m512i thirty_two = _mm512_set1_epi8(32);
    /* qh shifts that move bits 2k..2k+1 to bits 4..5: groups (0,1) left by 4,2; (2,3) right 0,2 */
    const __m512i shl01 = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i shr23 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    /* scale index per int32 lane: lanes 0-3, 4-7, 8-11, 12-15 cover 16-element sub-blocks
     * 0, 1, 2, 3 of the two activation blocks */
    const __m512i pick0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i pick_x0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc = _mm512_setzero_ps();
    assert(n % KERN_QK_K == 0);
    for (int64_t b = 0; b < n / KERN_QK_K; b++, x += 8) {
        float d = f16_load(&w[b].d);
        __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w[b].scales));
        float dx[8];
        for (int j = 0; j < 8; j++)
            dx[j] = d * x[j].d;
        __m512 dxs = _mm512_castps256_ps512(_mm256_loadu_ps(dx));
        __m512i pick = pick0, pick_x = pick_x0;
        for (int h = 0; h < 2; h++) {
            __m512i ql = _mm512_loadu_si512(w[b].ql + 64 * h); /* [ql[0..31] | ql[32..63]] */
            __m512i qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w[b].qh + 32 * h)));
            for (int pair = 0; pair < 2; pair++) { /* groups 2*pair, 2*pair+1 */
                __m512i low, high;
                if (pair == 0) {
                    low = _mm512_and_si512(ql, m4);
                    high = _mm512_sllv_epi64(qh, shl01);
                } else {
                    low = _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
                    high = _mm512_srlv_epi64(qh, shr23);
                }
                __m512i q = _mm512_or_si512(low, _mm512_and_si512(high, m2));
                const struct kern_q8 *xb = &x[4 * h + 2 * pair];
                __m512i xq =
                    _mm512_inserti64x4(_mm512_castsi256_si512(load_q(xb)), load_q(xb + 1), 1);
                __m512i p =
                    _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq),
                                     _mm512_dpbusd_epi32(_mm512_setzero_si512(), thirty_two, xq));
                p = _mm512_mullo_epi32(p, _mm512_permutexvar_epi32(pick, scales));
                pick = _mm512_add_epi32(pick, _mm512_set1_epi32(4));
                __m512 s = _mm512_permutexvar_ps(pick_x, dxs);
                pick_x = _mm512_add_epi32(pick_x, _mm512_set1_epi32(2));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc);
            }
        }
    }
    return hsum512_ps(acc);
}

/* ---- float weights . float activations ---- */

static inline __m512 load16_f32(const void *w, int64_t i)
{
    return _mm512_loadu_ps((const float *)w + i);
}

static inline __m512 load16_f16(const void *w, int64_t i)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
}

static inline __m512 load16_bf16(const void *w, int64_t i)
{
    __m512i v =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* Four accumulators over 64 elements per step, 16 at a time after, then a scalar tail. */
#define DOT_FLOAT_BODY(load16, scalar_w)                                                           \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                    \
    int64_t i = 0;                                                                                 \
    for (; i + 64 <= n; i += 64) {                                                                 \
        a0 = _mm512_fmadd_ps(load16(w, i), _mm512_loadu_ps(x + i), a0);                            \
        a1 = _mm512_fmadd_ps(load16(w, i + 16), _mm512_loadu_ps(x + i + 16), a1);                  \
        a2 = _mm512_fmadd_ps(load16(w, i + 32), _mm512_loadu_ps(x + i + 32), a2);                  \
        a3 = _mm512_fmadd_ps(load16(w, i + 48), _mm512_loadu_ps(x + i + 48), a3);                  \
    }                                                                                              \
    for (; i + 16 <= n; i += 16)                                                                   \
        a0 = _mm512_fmadd_ps(load16(w, i), _mm512_loadu_ps(x + i), a0);                            \
    float sum = hsum512_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));           \
    for (; i < n; i++)                                                                             \
        sum += (scalar_w)*x[i];                                                                    \
    return sum;

static float avx512_dot_f32_f32(const void *w, const float *x, int64_t n)
{
    DOT_FLOAT_BODY(load16_f32, ((const float *)w)[i])
}

static float avx512_dot_f16_f32(const void *w, const float *x, int64_t n)
{
    DOT_FLOAT_BODY(load16_f16, kern_f16_to_f32(((const uint16_t *)w)[i]))
}

static float avx512_dot_bf16_f32(const void *w, const float *x, int64_t n)
{
    DOT_FLOAT_BODY(load16_bf16, kern_bf16_to_f32(((const uint16_t *)w)[i]))
}

/* ---- weight rows . float activations (matvec) ----
 * 16 elements per 512-bit step. For the 4- and 5-bit types a block's (or Q4_K sub-block's) 16 or
 * 32 possible weight values are computed once, with the reference's float operations, into a
 * table of one or two registers, and each element's value is a vpermps/vpermt2ps lookup by its
 * quant (vpermps reads only the low 4 index bits, so the nibbles need no masking); Q8_0 converts
 * and scales. Values are bitwise the reference's; each is FMA'd into one of the row's two
 * accumulators (elements 0-15 and 16-31 of each 32). MATVEC_ROWS rows share each activation
 * load; leftover rows go singly through the same inlined body, so a row's result never depends
 * on its grouping. */

#define MATVEC_ROWS   4
#define ALWAYS_INLINE inline __attribute__((always_inline))
/* Loops over rows and vector parts are unrolled so the accumulators live in registers. */
#define UNROLL _Pragma("GCC unroll 8")

#define MATVEC_DRIVER(name, rows_fn)                                                               \
    static void name(KERN_MATVEC_ARGS)                                                             \
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

/* 16 bytes at p as 16 int32, zero-extended (vpmovzxbd with a memory operand). */
static inline __m512i load16_u8(const uint8_t *p)
{
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

static inline __m512 iota16(int base)
{
    return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_ps((float)base));
}

/* Q4_0 (x = d * (nibble - 8)) and Q4_1 (x = d * nibble + m): one 16-entry table per block. */
static ALWAYS_INLINE void q4_rows(const char *w, size_t rb, const int nr, const float *x, int64_t n,
                                  float *y, const int has_min)
{
    const __m512 q_vals = iota16(has_min ? 0 : -8);
    const size_t bb = has_min ? sizeof(struct kern_block_q4_1) : sizeof(struct kern_block_q4_0);
    const size_t qs_off =
        has_min ? offsetof(struct kern_block_q4_1, qs) : offsetof(struct kern_block_q4_0, qs);
    __m512 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        UNROLL
        for (int k = 0; k < nr; k++) {
            const char *blk = w + (size_t)k * rb + (size_t)b * bb;
            __m128 dm = f16x2_load(blk); /* d, and m for Q4_1 */
            __m512 tab = _mm512_mul_ps(_mm512_broadcastss_ps(dm), q_vals);
            if (has_min)
                tab = _mm512_add_ps(
                    tab, _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dm)));
            __m512i i0 = load16_u8((const uint8_t *)blk + qs_off); /* low nibble: element i */
            __m512i i1 = _mm512_srli_epi32(i0, 4);                 /* element i + 16 */
            acc[k][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i0, tab), x0, acc[k][0]);
            acc[k][1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i1, tab), x1, acc[k][1]);
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = _mm512_reduce_add_ps(_mm512_add_ps(acc[k][0], acc[k][1]));
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

MATVEC_DRIVER(avx512_matvec_q4_0_f32, q4_0_rows)
MATVEC_DRIVER(avx512_matvec_q4_1_f32, q4_1_rows)

/* Q5_0: x = d * (q5 - 16), a 32-entry table in two registers; qh bits become index bit 4. */
static ALWAYS_INLINE void q5_0_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    const __m512 q_lo = iota16(-16), q_hi = iota16(0);
    const __m512i lo_mask = _mm512_set1_epi32(0xF), sixteen = _mm512_set1_epi32(16);
    __m512 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        UNROLL
        for (int k = 0; k < nr; k++) {
            const struct kern_block_q5_0 *blk =
                (const struct kern_block_q5_0 *)(w + (size_t)k * rb) + b;
            __m512 d = _mm512_broadcastss_ps(f16x2_load(blk));
            __m512 t_lo = _mm512_mul_ps(d, q_lo), t_hi = _mm512_mul_ps(d, q_hi);
            uint32_t qh;
            memcpy(&qh, blk->qh, sizeof qh);
            __m512i raw = load16_u8(blk->qs);
            __m512i i0 = _mm512_and_si512(raw, lo_mask), i1 = _mm512_srli_epi32(raw, 4);
            i0 = _mm512_mask_or_epi32(i0, (__mmask16)qh, i0, sixteen);
            i1 = _mm512_mask_or_epi32(i1, (__mmask16)(qh >> 16), i1, sixteen);
            acc[k][0] = _mm512_fmadd_ps(_mm512_permutex2var_ps(t_lo, i0, t_hi), x0, acc[k][0]);
            acc[k][1] = _mm512_fmadd_ps(_mm512_permutex2var_ps(t_lo, i1, t_hi), x1, acc[k][1]);
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = _mm512_reduce_add_ps(_mm512_add_ps(acc[k][0], acc[k][1]));
}

MATVEC_DRIVER(avx512_matvec_q5_0_f32, q5_0_rows)

/* Q8_0 (the output head): x = d * q, converted 16 at a time. */
static ALWAYS_INLINE void q8_0_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    __m512 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / KERN_QK; b++, x += KERN_QK) {
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        UNROLL
        for (int k = 0; k < nr; k++) {
            const struct kern_block_q8_0 *blk =
                (const struct kern_block_q8_0 *)(w + (size_t)k * rb) + b;
            __m512 d = _mm512_broadcastss_ps(f16x2_load(blk));
            __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk->qs));
            __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk->qs + 16)));
            __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0));
            __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1));
            acc[k][0] = _mm512_fmadd_ps(w0, x0, acc[k][0]);
            acc[k][1] = _mm512_fmadd_ps(w1, x1, acc[k][1]);
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = _mm512_reduce_add_ps(_mm512_add_ps(acc[k][0], acc[k][1]));
}

MATVEC_DRIVER(avx512_matvec_q8_0_f32, q8_0_rows)

/* Q4_K: x = (d*sc) * nibble - dmin*m, a 16-entry table per 32-element sub-block; the 8 factors
 * of a super-block are computed as one vector each (the reference's single roundings). */
static ALWAYS_INLINE void q4_k_rows(const char *w, size_t rb, const int nr, const float *x,
                                    int64_t n, float *y)
{
    const __m512 q_vals = iota16(0);
    __m512 acc[MATVEC_ROWS][2];
    UNROLL
    for (int k = 0; k < nr; k++)
        acc[k][0] = acc[k][1] = _mm512_setzero_ps();
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
            for (int g = 0; g < 4; g++) { /* sub-blocks 2g (low nibbles), 2g+1 (high) */
                __m512i ia = load16_u8(blk->qs + 32 * g), ib = load16_u8(blk->qs + 32 * g + 16);
                UNROLL
                for (int h = 0; h < 2; h++) {
                    int j = 2 * g + h;
                    __m512 tab = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[j]), q_vals),
                                               _mm512_set1_ps(mins[j]));
                    __m512i i0 = h ? _mm512_srli_epi32(ia, 4) : ia;
                    __m512i i1 = h ? _mm512_srli_epi32(ib, 4) : ib;
                    const float *xs = x + 32 * j;
                    acc[k][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i0, tab), _mm512_loadu_ps(xs),
                                                acc[k][0]);
                    acc[k][1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i1, tab),
                                                _mm512_loadu_ps(xs + 16), acc[k][1]);
                }
            }
        }
    }
    UNROLL
    for (int k = 0; k < nr; k++)
        y[k] = _mm512_reduce_add_ps(_mm512_add_ps(acc[k][0], acc[k][1]));
}

MATVEC_DRIVER(avx512_matvec_q4_k_f32, q4_k_rows)

/* Float rows: one dot per row. */
#define MATVEC_FLOAT(name, dot)                                                                    \
    static void name(KERN_MATVEC_ARGS)                                                             \
    {                                                                                              \
        for (int64_t r = 0; r < n_rows; r++)                                                       \
            y[r] = dot((const char *)w + (size_t)r * row_bytes, x, n);                             \
    }

MATVEC_FLOAT(avx512_matvec_f32_f32, avx512_dot_f32_f32)
MATVEC_FLOAT(avx512_matvec_f16_f32, avx512_dot_f16_f32)
MATVEC_FLOAT(avx512_matvec_bf16_f32, avx512_dot_bf16_f32)

const struct kern_cpu_fns kern_cpu_fns_avx512 = {
    .isa = KERN_ISA_AVX512,
    .name = "avx512-vnni",
    .quantize_q8 = avx512_quantize_q8,
    .vec_dot_q8 =
        {
            [DTYPE_Q4_0] = avx512_dot_q4_0_q8,
            [DTYPE_Q4_1] = avx512_dot_q4_1_q8,
            [DTYPE_Q5_0] = avx512_dot_q5_0_q8,
            [DTYPE_Q8_0] = avx512_dot_q8_0_q8,
            [DTYPE_Q4_K] = avx512_dot_q4_k_q8,
            [DTYPE_Q6_K] = avx512_dot_q6_k_q8,
        },
    .vec_dot_f32 =
        {
            [DTYPE_F32] = avx512_dot_f32_f32,
            [DTYPE_F16] = avx512_dot_f16_f32,
            [DTYPE_BF16] = avx512_dot_bf16_f32,
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
            [DTYPE_F32] = avx512_matvec_f32_f32,
            [DTYPE_F16] = avx512_matvec_f16_f32,
            [DTYPE_BF16] = avx512_matvec_bf16_f32,
            [DTYPE_Q4_0] = avx512_matvec_q4_0_f32,
            [DTYPE_Q4_1] = avx512_matvec_q4_1_f32,
            [DTYPE_Q5_0] = avx512_matvec_q5_0_f32,
            [DTYPE_Q8_0] = avx512_matvec_q8_0_f32,
            [DTYPE_Q4_K] = avx512_matvec_q4_k_f32,
            [DTYPE_Q6_K] = kern_avx2_matvec_q6_k_f32,
        },
    .gemm_f32 =
        {
            [DTYPE_F32] = kern_avx512_gemm_f32_f32,
            [DTYPE_F16] = kern_avx512_gemm_f16_f32,
            [DTYPE_BF16] = kern_avx512_gemm_bf16_f32,
            [DTYPE_Q4_0] = kern_avx512_gemm_q4_0_f32,
            [DTYPE_Q4_1] = kern_avx512_gemm_q4_1_f32,
            [DTYPE_Q5_0] = kern_avx512_gemm_q5_0_f32,
            [DTYPE_Q8_0] = kern_avx512_gemm_q8_0_f32,
            [DTYPE_Q4_K] = kern_avx512_gemm_q4_k_f32,
            [DTYPE_Q6_K] = kern_avx512_gemm_q6_k_f32,
        },
    .gemm_q8 =
        {
            [DTYPE_Q4_0] = kern_avx512_gemm_q4_0_q8,
            [DTYPE_Q4_1] = kern_avx512_gemm_q4_1_q8,
            [DTYPE_Q5_0] = kern_avx512_gemm_q5_0_q8,
            [DTYPE_Q8_0] = kern_avx512_gemm_q8_0_q8,
            [DTYPE_Q4_K] = kern_avx512_gemm_q4_k_q8,
            [DTYPE_Q6_K] = kern_avx512_gemm_q6_k_q8,
        },
    .to_f16 = kern_avx2_to_f16,
    .kv_quant_q8 = kern_avx512_kv_quant_q8,
    .attn_group = kern_avx512_attn_group,
    .rmsnorm = kern_avx512_rmsnorm,
    .swiglu = kern_avx512_swiglu,
    .geglu = kern_avx512_geglu,
    .rope = kern_avx512_rope,
    .quantize_q16 = kern_avx512_quantize_q16,
    .gemm_q16 =
        {
            [DTYPE_Q4_0] = kern_avx512_gemm_q4_0_q16,
            [DTYPE_Q4_1] = kern_avx512_gemm_q4_1_q16,
            [DTYPE_Q8_0] = kern_avx512_gemm_q8_0_q16,
        },
    .panel_bytes = kern_avx512_panel_bytes,
    .panel_pack = kern_avx512_panel_pack,
    .gemm_f32_packed =
        {
            [DTYPE_Q4_0] = kern_avx512_gemm_q4_0_f32_packed,
            [DTYPE_Q4_1] = kern_avx512_gemm_q4_1_f32_packed,
            [DTYPE_Q8_0] = kern_avx512_gemm_q8_0_f32_packed,
        },
    .gemm_q8_packed =
        {
            [DTYPE_Q4_0] = kern_avx512_gemm_q4_0_q8_packed,
            [DTYPE_Q4_1] = kern_avx512_gemm_q4_1_q8_packed,
            [DTYPE_Q8_0] = kern_avx512_gemm_q8_0_q8_packed,
        },
    .gemm_q16_packed =
        {
            [DTYPE_Q4_0] = kern_avx512_gemm_q4_0_q16_packed,
            [DTYPE_Q4_1] = kern_avx512_gemm_q4_1_q16_packed,
            [DTYPE_Q8_0] = kern_avx512_gemm_q8_0_q16_packed,
        },
};
