/* Scalar reference kernels: half/bf16 conversion, activation quantization, row dequantization and
 * dot products for every supported type, plus the scalar function table. Written for clarity;
 * the SIMD files must reproduce these results (exactly for integer parts, to rounding otherwise).
 * Exact dequantization relies on gcc not contracting a*b+c into FMA, which -std=c11 ensures
 * (-ffp-contract=off); a GNU dialect would allow it. */
#include <assert.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float kern_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t man = h & 0x3FF;

    if (exp == 0x1F) /* inf or NaN: payload carried over */
        return f32_from_bits(sign | 0x7F800000u | (man << 13));
    if (exp != 0) /* normal: rebias 15 -> 127 */
        return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
    /* zero or subnormal: man * 2^-24, exact in float */
    return f32_from_bits(sign | f32_bits((float)man * 0x1p-24f));
}

uint16_t kern_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7FFFFFFFu;

    if (ax > 0x7F800000u) /* NaN: keep the top payload bits, force quiet */
        return sign | 0x7E00 | (uint16_t)((ax >> 13) & 0x3FF);
    if (ax >= 0x477FF000u) /* >= 65520 (and inf): rounds to inf */
        return sign | 0x7C00;
    if (ax >= 0x38800000u) { /* >= 2^-14: normal half; round the 13 dropped bits to even */
        uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1);
        return sign | (uint16_t)((r - (112u << 23)) >> 13);
    }
    /* Subnormal half (or zero): the result is round(|f| * 2^24), an integer in [0, 1024].
     * |f| = mant * 2^(e - 150), so |f| * 2^24 = mant >> (126 - e). */
    uint32_t e = ax >> 23;
    if (e < 102) /* |f| < 2^-25: rounds to zero */
        return sign;
    uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t r = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1)))
        r++;
    return sign | (uint16_t)r;
}

float kern_bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t kern_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: truncate and force quiet */
        return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

void kern_q4_k_scale_min(const uint8_t scales[12], int j, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = scales[j] & 63;
        *m = scales[j + 4] & 63;
    } else {
        *sc = (uint8_t)((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
        *m = (uint8_t)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

/* A type id the function does not handle: a programmer error. */
static _Noreturn void bad_type(const char *fn, uint32_t type)
{
    LOG_ERROR("%s: unsupported type %u", fn, (unsigned)type);
    abort();
}

/* ---- activation quantization ---- */

/* One block of KERN_QK activations to integers in [-qmax, qmax]: d = max|x| / qmax (0 when
 * that is below FLT_MIN: all zero, or so tiny that 1/d overflows), q = roundf(x / d). Returns
 * sum(q). */
static int32_t quantize_block(const float *xb, float qmax, int32_t q[KERN_QK], float *d_out)
{
    float amax = 0.0f;
    for (int j = 0; j < KERN_QK; j++) {
        float a = fabsf(xb[j]);
        if (a > amax)
            amax = a;
    }
    float d = amax / qmax;
    if (!(d >= FLT_MIN))
        d = 0.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < KERN_QK; j++) {
        float v = xb[j] * id;
        /* |v| <= qmax for finite input; the clamp only keeps non-finite input defined */
        if (!(v >= -qmax))
            v = v != v ? 0.0f : -qmax;
        if (v > qmax)
            v = qmax;
        q[j] = (int32_t)roundf(v);
        sum += q[j];
    }
    *d_out = d;
    return sum;
}

void kern_ref_quantize_q8(const float *x, struct kern_q8 *y, int64_t n)
{
    assert(n % KERN_QK == 0);
    int32_t q[KERN_QK];
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        int32_t sum = quantize_block(x + b * KERN_QK, 127.0f, q, &y[b].d);
        for (int j = 0; j < KERN_QK; j++)
            y[b].q[j] = (int8_t)q[j];
        y[b].s = y[b].d * (float)sum;
    }
}

void kern_ref_quantize_q16(const float *x, struct kern_q16 *y, int64_t n)
{
    assert(n % KERN_QK == 0);
    int32_t q[KERN_QK];
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        int32_t sum = quantize_block(x + b * KERN_QK, 32767.0f, q, &y[b].d);
        for (int j = 0; j < KERN_QK; j++)
            y[b].q[j] = (int16_t)q[j];
        y[b].s = y[b].d * (float)sum;
    }
}

/* ---- dequantization ---- */

void kern_ref_dequant_f32(const void *src, float *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

void kern_ref_dequant_f16(const void *src, float *dst, int64_t n)
{
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++)
        dst[i] = kern_f16_to_f32(h[i]);
}

void kern_ref_dequant_bf16(const void *src, float *dst, int64_t n)
{
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++)
        dst[i] = kern_bf16_to_f32(h[i]);
}

void kern_ref_dequant_q4_0(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q4_0 *w = src;
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        float d = kern_f16_to_f32(w[b].d);
        for (int i = 0; i < 16; i++) {
            dst[i] = d * (float)((w[b].qs[i] & 0xF) - 8);
            dst[i + 16] = d * (float)((w[b].qs[i] >> 4) - 8);
        }
    }
}

void kern_ref_dequant_q4_1(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q4_1 *w = src;
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        float d = kern_f16_to_f32(w[b].d);
        float m = kern_f16_to_f32(w[b].m);
        for (int i = 0; i < 16; i++) {
            dst[i] = d * (float)(w[b].qs[i] & 0xF) + m;
            dst[i + 16] = d * (float)(w[b].qs[i] >> 4) + m;
        }
    }
}

static uint32_t q5_0_high_bits(const struct kern_block_q5_0 *blk)
{
    return (uint32_t)blk->qh[0] | (uint32_t)blk->qh[1] << 8 | (uint32_t)blk->qh[2] << 16 |
           (uint32_t)blk->qh[3] << 24;
}

void kern_ref_dequant_q5_0(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q5_0 *w = src;
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        float d = kern_f16_to_f32(w[b].d);
        uint32_t qh = q5_0_high_bits(&w[b]);
        for (int i = 0; i < 16; i++) {
            int lo = (w[b].qs[i] & 0xF) | (int)((qh >> i) & 1) << 4;
            int hi = (w[b].qs[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
            dst[i] = d * (float)(lo - 16);
            dst[i + 16] = d * (float)(hi - 16);
        }
    }
}

void kern_ref_dequant_q8_0(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q8_0 *w = src;
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++, dst += KERN_QK) {
        float d = kern_f16_to_f32(w[b].d);
        for (int i = 0; i < KERN_QK; i++)
            dst[i] = d * (float)w[b].qs[i];
    }
}

void kern_ref_dequant_q4_k(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q4_k *w = src;
    assert(n % KERN_QK_K == 0);
    for (int64_t b = 0; b < n / KERN_QK_K; b++) {
        float d = kern_f16_to_f32(w[b].d);
        float dmin = kern_f16_to_f32(w[b].dmin);
        for (int j = 0; j < 8; j++) { /* sub-block j: 32 elements */
            uint8_t sc, m;
            kern_q4_k_scale_min(w[b].scales, j, &sc, &m);
            float d1 = d * (float)sc;
            float m1 = dmin * (float)m;
            const uint8_t *qs = w[b].qs + 32 * (j / 2);
            int shift = 4 * (j % 2);
            for (int l = 0; l < 32; l++)
                *dst++ = d1 * (float)((qs[l] >> shift) & 0xF) - m1;
        }
    }
}

/* Q6_K element e (0..255) of a block as a signed 6-bit value in [-32, 31]. Element e lies in
 * half h = e/128; within the half, group k = (e%128)/32 and lane l = e%32. */
static int q6_k_value(const struct kern_block_q6_k *blk, int e)
{
    int h = e / 128, k = (e % 128) / 32, l = e % 32;
    const uint8_t *ql = blk->ql + 64 * h;
    const uint8_t *qh = blk->qh + 32 * h;
    int lo = (k % 2 ? ql[l + 32] : ql[l]) >> (k / 2 ? 4 : 0) & 0xF;
    int hi = (qh[l] >> (2 * k)) & 3;
    return (lo | hi << 4) - 32;
}

void kern_ref_dequant_q6_k(const void *src, float *dst, int64_t n)
{
    const struct kern_block_q6_k *w = src;
    assert(n % KERN_QK_K == 0);
    for (int64_t b = 0; b < n / KERN_QK_K; b++) {
        float d = kern_f16_to_f32(w[b].d);
        for (int e = 0; e < KERN_QK_K; e++) /* scale index: 16 consecutive elements each */
            *dst++ = d * (float)w[b].scales[e / 16] * (float)q6_k_value(&w[b], e);
    }
}

void kern_ref_dequant_row(uint32_t type, const void *src, float *dst, int64_t n)
{
    void (*fn)(const void *, float *, int64_t) =
        type < DTYPE_COUNT ? kern_cpu_fns_scalar.dequant_row[type] : NULL;
    if (!fn)
        bad_type(__func__, type);
    fn(src, dst, n);
}

/* ---- dot products with quantized activations ----
 * Each sums integer products per block (exact), then scales in float. */

/* Q4_0, Q4_1 and Q8_0 are written once for both activation precisions (XT = q8: struct
 * kern_q8, q16: struct kern_q16); the integer sums are exact in either. */
#define REF_DOT_Q4_0(XT)                                                                           \
    float kern_ref_dot_q4_0_##XT(const void *vw, const struct kern_##XT *x, int64_t n)             \
    {                                                                                              \
        const struct kern_block_q4_0 *w = vw;                                                      \
        float sum = 0.0f;                                                                          \
        assert(n % KERN_QK == 0);                                                                  \
        for (int64_t b = 0; b < n / KERN_QK; b++) {                                                \
            int32_t isum = 0;                                                                      \
            for (int i = 0; i < 16; i++) {                                                         \
                isum += ((w[b].qs[i] & 0xF) - 8) * x[b].q[i];                                      \
                isum += ((w[b].qs[i] >> 4) - 8) * x[b].q[i + 16];                                  \
            }                                                                                      \
            sum += kern_f16_to_f32(w[b].d) * x[b].d * (float)isum;                                 \
        }                                                                                          \
        return sum;                                                                                \
    }

/* sum_i (d q_i + m)(dx qx_i) = d dx sum(q qx) + m s */
#define REF_DOT_Q4_1(XT)                                                                           \
    float kern_ref_dot_q4_1_##XT(const void *vw, const struct kern_##XT *x, int64_t n)             \
    {                                                                                              \
        const struct kern_block_q4_1 *w = vw;                                                      \
        float sum = 0.0f;                                                                          \
        assert(n % KERN_QK == 0);                                                                  \
        for (int64_t b = 0; b < n / KERN_QK; b++) {                                                \
            int32_t isum = 0;                                                                      \
            for (int i = 0; i < 16; i++) {                                                         \
                isum += (w[b].qs[i] & 0xF) * x[b].q[i];                                            \
                isum += (w[b].qs[i] >> 4) * x[b].q[i + 16];                                        \
            }                                                                                      \
            sum += kern_f16_to_f32(w[b].d) * x[b].d * (float)isum +                                \
                   kern_f16_to_f32(w[b].m) * x[b].s;                                               \
        }                                                                                          \
        return sum;                                                                                \
    }

#define REF_DOT_Q8_0(XT)                                                                           \
    float kern_ref_dot_q8_0_##XT(const void *vw, const struct kern_##XT *x, int64_t n)             \
    {                                                                                              \
        const struct kern_block_q8_0 *w = vw;                                                      \
        float sum = 0.0f;                                                                          \
        assert(n % KERN_QK == 0);                                                                  \
        for (int64_t b = 0; b < n / KERN_QK; b++) {                                                \
            int32_t isum = 0;                                                                      \
            for (int i = 0; i < KERN_QK; i++)                                                      \
                isum += w[b].qs[i] * x[b].q[i];                                                    \
            sum += kern_f16_to_f32(w[b].d) * x[b].d * (float)isum;                                 \
        }                                                                                          \
        return sum;                                                                                \
    }

REF_DOT_Q4_0(q8)
REF_DOT_Q4_0(q16)
REF_DOT_Q4_1(q8)
REF_DOT_Q4_1(q16)

float kern_ref_dot_q5_0_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q5_0 *w = vw;
    float sum = 0.0f;
    assert(n % KERN_QK == 0);
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        uint32_t qh = q5_0_high_bits(&w[b]);
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) {
            int lo = (w[b].qs[i] & 0xF) | (int)((qh >> i) & 1) << 4;
            int hi = (w[b].qs[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
            isum += (lo - 16) * x[b].q[i] + (hi - 16) * x[b].q[i + 16];
        }
        sum += kern_f16_to_f32(w[b].d) * x[b].d * (float)isum;
    }
    return sum;
}

REF_DOT_Q8_0(q8)
REF_DOT_Q8_0(q16)

float kern_ref_dot_q4_k_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q4_k *w = vw;
    float sum = 0.0f;
    assert(n % KERN_QK_K == 0);
    for (int64_t b = 0; b < n / KERN_QK_K; b++) {
        float d = kern_f16_to_f32(w[b].d);
        float dmin = kern_f16_to_f32(w[b].dmin);
        for (int j = 0; j < 8; j++) { /* sub-block j pairs with activation block 8b + j */
            const struct kern_q8 *xb = &x[8 * b + j];
            const uint8_t *qs = w[b].qs + 32 * (j / 2);
            int shift = 4 * (j % 2);
            uint8_t sc, m;
            kern_q4_k_scale_min(w[b].scales, j, &sc, &m);
            int32_t isum = 0;
            for (int l = 0; l < 32; l++)
                isum += ((qs[l] >> shift) & 0xF) * xb->q[l];
            /* sum_l (d sc q_l - dmin m)(dx qx_l) = d sc dx isum - dmin m s */
            sum += d * (float)sc * xb->d * (float)isum - dmin * (float)m * xb->s;
        }
    }
    return sum;
}

float kern_ref_dot_q6_k_q8(const void *vw, const struct kern_q8 *x, int64_t n)
{
    const struct kern_block_q6_k *w = vw;
    float sum = 0.0f;
    assert(n % KERN_QK_K == 0);
    for (int64_t b = 0; b < n / KERN_QK_K; b++) {
        float d = kern_f16_to_f32(w[b].d);
        for (int j = 0; j < 8; j++) { /* 32 elements = scale sub-blocks 2j and 2j+1 */
            const struct kern_q8 *xb = &x[8 * b + j];
            int32_t isum[2] = {0, 0};
            for (int l = 0; l < 32; l++)
                isum[l / 16] += q6_k_value(&w[b], 32 * j + l) * xb->q[l];
            int32_t scaled = w[b].scales[2 * j] * isum[0] + w[b].scales[2 * j + 1] * isum[1];
            sum += d * xb->d * (float)scaled;
        }
    }
    return sum;
}

float kern_ref_vec_dot_q8(uint32_t type, const void *w, const struct kern_q8 *x, int64_t n)
{
    float (*fn)(const void *, const struct kern_q8 *, int64_t) =
        type < DTYPE_COUNT ? kern_cpu_fns_scalar.vec_dot_q8[type] : NULL;
    if (!fn)
        bad_type(__func__, type);
    return fn(w, x, n);
}

/* ---- dot products of float weights with float activations (sequential float sum) ---- */

float kern_ref_dot_f32_f32(const void *vw, const float *x, int64_t n)
{
    const float *w = vw;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
        sum += w[i] * x[i];
    return sum;
}

float kern_ref_dot_f16_f32(const void *vw, const float *x, int64_t n)
{
    const uint16_t *w = vw;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
        sum += kern_f16_to_f32(w[i]) * x[i];
    return sum;
}

float kern_ref_dot_bf16_f32(const void *vw, const float *x, int64_t n)
{
    const uint16_t *w = vw;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
        sum += kern_bf16_to_f32(w[i]) * x[i];
    return sum;
}

float kern_ref_vec_dot_f32(uint32_t type, const void *w, const float *x, int64_t n)
{
    float (*fn)(const void *, const float *, int64_t) =
        type < DTYPE_COUNT ? kern_cpu_fns_scalar.vec_dot_f32[type] : NULL;
    if (!fn)
        bad_type(__func__, type);
    return fn(w, x, n);
}

/* ---- weight rows . float activations (matvec) ----
 * Each block is dequantized into a small buffer by the reference dequantizer and its products
 * added in element order, so a row's sum is bitwise that of dequant_row + kern_ref_dot_f32_f32. */

static void ref_matvec_blocks(void (*deq)(const void *, float *, int64_t), int block_elems,
                              size_t block_bytes, const void *w, size_t row_bytes, int64_t n_rows,
                              const float *x, int64_t n, float *y)
{
    float buf[KERN_QK_K];
    assert(block_elems <= KERN_QK_K && n % block_elems == 0);
    for (int64_t r = 0; r < n_rows; r++) {
        const char *row = (const char *)w + (size_t)r * row_bytes;
        float sum = 0.0f;
        for (int64_t b = 0; b < n / block_elems; b++) {
            deq(row + (size_t)b * block_bytes, buf, block_elems);
            for (int i = 0; i < block_elems; i++)
                sum += buf[i] * x[b * block_elems + i];
        }
        y[r] = sum;
    }
}

#define REF_MATVEC_QUANT(name, block, elems)                                                       \
    void kern_ref_matvec_##name##_f32(KERN_MATVEC_ARGS)                                            \
    {                                                                                              \
        ref_matvec_blocks(kern_ref_dequant_##name, elems, sizeof(struct block), w, row_bytes,      \
                          n_rows, x, n, y);                                                        \
    }

REF_MATVEC_QUANT(q4_0, kern_block_q4_0, KERN_QK)
REF_MATVEC_QUANT(q4_1, kern_block_q4_1, KERN_QK)
REF_MATVEC_QUANT(q5_0, kern_block_q5_0, KERN_QK)
REF_MATVEC_QUANT(q8_0, kern_block_q8_0, KERN_QK)
REF_MATVEC_QUANT(q4_k, kern_block_q4_k, KERN_QK_K)
REF_MATVEC_QUANT(q6_k, kern_block_q6_k, KERN_QK_K)

/* Float rows: one vec_dot_f32 per row (any n). */
#define REF_MATVEC_FLOAT(name)                                                                     \
    void kern_ref_matvec_##name##_f32(KERN_MATVEC_ARGS)                                            \
    {                                                                                              \
        for (int64_t r = 0; r < n_rows; r++)                                                       \
            y[r] = kern_ref_dot_##name##_f32((const char *)w + (size_t)r * row_bytes, x, n);       \
    }

REF_MATVEC_FLOAT(f32)
REF_MATVEC_FLOAT(f16)
REF_MATVEC_FLOAT(bf16)

void kern_ref_matvec_f32(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows,
                         const float *x, int64_t n, float *y)
{
    void (*fn)(const void *, size_t, int64_t, const float *, int64_t, float *) =
        type < DTYPE_COUNT ? kern_cpu_fns_scalar.matvec_f32[type] : NULL;
    if (!fn)
        bad_type(__func__, type);
    fn(w, row_bytes, n_rows, x, n, y);
}

/* ---- batched matmul (gemm) ----
 * The references compute every (row, token) pair exactly as the single-row kernels do (the exact
 * one as kern_ref_matvec_f32, the quantized one as kern_ref_vec_dot_q8), so they are trivially
 * batch invariant. The exact one dequantizes each block once per group of REF_GEMM_TOK tokens
 * instead of once per token. */

#define REF_GEMM_TOK 16

static void ref_gemm_blocks(void (*deq)(const void *, float *, int64_t), int block_elems,
                            size_t block_bytes, const void *w, size_t row_bytes, int64_t n_rows,
                            const float *x, size_t ldx, int64_t n_tok, int64_t n, float *y,
                            size_t ldy)
{
    float buf[KERN_QK_K];
    assert(block_elems <= KERN_QK_K && n % block_elems == 0);
    for (int64_t r = 0; r < n_rows; r++) {
        const char *row = (const char *)w + (size_t)r * row_bytes;
        for (int64_t t0 = 0; t0 < n_tok; t0 += REF_GEMM_TOK) {
            int nt = n_tok - t0 < REF_GEMM_TOK ? (int)(n_tok - t0) : REF_GEMM_TOK;
            float sum[REF_GEMM_TOK] = {0};
            for (int64_t b = 0; b < n / block_elems; b++) {
                deq(row + (size_t)b * block_bytes, buf, block_elems);
                for (int j = 0; j < nt; j++) {
                    const float *xb = x + (size_t)(t0 + j) * ldx + b * block_elems;
                    for (int i = 0; i < block_elems; i++)
                        sum[j] += buf[i] * xb[i];
                }
            }
            for (int j = 0; j < nt; j++)
                y[(size_t)(t0 + j) * ldy + r] = sum[j];
        }
    }
}

#define REF_GEMM_QUANT(name, block, elems)                                                         \
    void kern_ref_gemm_##name##_f32(KERN_GEMM_F32_ARGS)                                            \
    {                                                                                              \
        ref_gemm_blocks(kern_ref_dequant_##name, elems, sizeof(struct block), w, row_bytes,        \
                        n_rows, x, ldx, n_tok, n, y, ldy);                                         \
    }                                                                                              \
    void kern_ref_gemm_##name##_q8(KERN_GEMM_Q8_ARGS)                                              \
    {                                                                                              \
        kern_gemm_q8_pairs(kern_ref_dot_##name##_q8, w, row_bytes, n_rows, xq, ldxq, n_tok, n, y,  \
                           ldy);                                                                   \
    }

REF_GEMM_QUANT(q4_0, kern_block_q4_0, KERN_QK)
REF_GEMM_QUANT(q4_1, kern_block_q4_1, KERN_QK)
REF_GEMM_QUANT(q5_0, kern_block_q5_0, KERN_QK)
REF_GEMM_QUANT(q8_0, kern_block_q8_0, KERN_QK)
REF_GEMM_QUANT(q4_k, kern_block_q4_k, KERN_QK_K)
REF_GEMM_QUANT(q6_k, kern_block_q6_k, KERN_QK_K)

/* Float rows: one reference dot per pair (any n). */
#define REF_GEMM_FLOAT(name)                                                                       \
    void kern_ref_gemm_##name##_f32(KERN_GEMM_F32_ARGS)                                            \
    {                                                                                              \
        kern_gemm_f32_pairs(kern_ref_dot_##name##_f32, w, row_bytes, n_rows, x, ldx, n_tok, n, y,  \
                            ldy);                                                                  \
    }

REF_GEMM_FLOAT(f32)
REF_GEMM_FLOAT(f16)
REF_GEMM_FLOAT(bf16)

void kern_gemm_q8_pairs(float (*dot)(const void *, const struct kern_q8 *, int64_t),
                        KERN_GEMM_Q8_ARGS)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const void *row = (const char *)w + (size_t)r * row_bytes;
        for (int64_t t = 0; t < n_tok; t++)
            y[(size_t)t * ldy + r] = dot(row, xq + (size_t)t * ldxq, n);
    }
}

void kern_gemm_f32_pairs(float (*dot)(const void *, const float *, int64_t), KERN_GEMM_F32_ARGS)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const void *row = (const char *)w + (size_t)r * row_bytes;
        for (int64_t t = 0; t < n_tok; t++)
            y[(size_t)t * ldy + r] = dot(row, x + (size_t)t * ldx, n);
    }
}

/* The scalar int8 peak loop: independent int32 accumulators over int8 products. */
double kern_ref_int8_peak(double seconds)
{
    int8_t a[64], b[64];
    volatile int8_t seed = 3;
    for (int i = 0; i < 64; i++) {
        a[i] = (int8_t)(seed + i);
        b[i] = (int8_t)(seed - i);
    }
    int32_t acc[8] = {0};
    double t0 = kern_now_seconds(), t = t0;
    uint64_t macs = 0;
    while (t - t0 < seconds) {
        for (int it = 0; it < 4096; it++) {
            for (int i = 0; i < 64; i += 8)
                for (int k = 0; k < 8; k++)
                    acc[k] += a[i + k] * b[i + k];
            a[it & 63] ^= (int8_t)acc[it & 7]; /* a data dependence the compiler cannot hoist */
        }
        macs += 4096 * 64;
        t = kern_now_seconds();
    }
    volatile int32_t sink = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    (void)sink;
    return 2.0 * (double)macs / (t - t0);
}

const struct kern_cpu_fns kern_cpu_fns_scalar = {
    .isa = KERN_ISA_SCALAR,
    .name = "scalar",
    .quantize_q8 = kern_ref_quantize_q8,
    .vec_dot_q8 =
        {
            [DTYPE_Q4_0] = kern_ref_dot_q4_0_q8,
            [DTYPE_Q4_1] = kern_ref_dot_q4_1_q8,
            [DTYPE_Q5_0] = kern_ref_dot_q5_0_q8,
            [DTYPE_Q8_0] = kern_ref_dot_q8_0_q8,
            [DTYPE_Q4_K] = kern_ref_dot_q4_k_q8,
            [DTYPE_Q6_K] = kern_ref_dot_q6_k_q8,
        },
    .vec_dot_f32 =
        {
            [DTYPE_F32] = kern_ref_dot_f32_f32,
            [DTYPE_F16] = kern_ref_dot_f16_f32,
            [DTYPE_BF16] = kern_ref_dot_bf16_f32,
        },
    .dequant_row =
        {
            [DTYPE_F32] = kern_ref_dequant_f32,
            [DTYPE_F16] = kern_ref_dequant_f16,
            [DTYPE_BF16] = kern_ref_dequant_bf16,
            [DTYPE_Q4_0] = kern_ref_dequant_q4_0,
            [DTYPE_Q4_1] = kern_ref_dequant_q4_1,
            [DTYPE_Q5_0] = kern_ref_dequant_q5_0,
            [DTYPE_Q8_0] = kern_ref_dequant_q8_0,
            [DTYPE_Q4_K] = kern_ref_dequant_q4_k,
            [DTYPE_Q6_K] = kern_ref_dequant_q6_k,
        },
    .matvec_f32 =
        {
            [DTYPE_F32] = kern_ref_matvec_f32_f32,
            [DTYPE_F16] = kern_ref_matvec_f16_f32,
            [DTYPE_BF16] = kern_ref_matvec_bf16_f32,
            [DTYPE_Q4_0] = kern_ref_matvec_q4_0_f32,
            [DTYPE_Q4_1] = kern_ref_matvec_q4_1_f32,
            [DTYPE_Q5_0] = kern_ref_matvec_q5_0_f32,
            [DTYPE_Q8_0] = kern_ref_matvec_q8_0_f32,
            [DTYPE_Q4_K] = kern_ref_matvec_q4_k_f32,
            [DTYPE_Q6_K] = kern_ref_matvec_q6_k_f32,
        },
    .gemm_f32 =
        {
            [DTYPE_F32] = kern_ref_gemm_f32_f32,
            [DTYPE_F16] = kern_ref_gemm_f16_f32,
            [DTYPE_BF16] = kern_ref_gemm_bf16_f32,
            [DTYPE_Q4_0] = kern_ref_gemm_q4_0_f32,
            [DTYPE_Q4_1] = kern_ref_gemm_q4_1_f32,
            [DTYPE_Q5_0] = kern_ref_gemm_q5_0_f32,
            [DTYPE_Q8_0] = kern_ref_gemm_q8_0_f32,
            [DTYPE_Q4_K] = kern_ref_gemm_q4_k_f32,
            [DTYPE_Q6_K] = kern_ref_gemm_q6_k_f32,
        },
    .gemm_q8 =
        {
            [DTYPE_Q4_0] = kern_ref_gemm_q4_0_q8,
            [DTYPE_Q4_1] = kern_ref_gemm_q4_1_q8,
            [DTYPE_Q5_0] = kern_ref_gemm_q5_0_q8,
            [DTYPE_Q8_0] = kern_ref_gemm_q8_0_q8,
            [DTYPE_Q4_K] = kern_ref_gemm_q4_k_q8,
            [DTYPE_Q6_K] = kern_ref_gemm_q6_k_q8,
        },
    .to_f16 = kern_ref_to_f16,
    .kv_quant_q8 = kern_kv_quant_q8,
    .attn_group = kern_ref_attn_group,
    .rmsnorm = kern_ref_rmsnorm,
    .swiglu = kern_ref_swiglu,
    .geglu = kern_ref_geglu,
    .rope = kern_ref_rope,
    .quantize_q16 = kern_ref_quantize_q16,
    .gemm_q16 =
        {
            [DTYPE_Q4_0] = kern_ref_gemm_q4_0_q16,
            [DTYPE_Q4_1] = kern_ref_gemm_q4_1_q16,
            [DTYPE_Q8_0] = kern_ref_gemm_q8_0_q16,
        },
};
