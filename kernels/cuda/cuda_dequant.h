/* Dequantization of GGUF weight rows as the CUDA kernels do it, written once for both sides: nvcc
 * compiles it into the kernels (each function __device__), and the C tests compile the very same
 * text on the CPU and compare it bit for bit with the scalar reference (kern_ref_dequant_row).
 * Every product and sum is one IEEE operation in the reference's order: on the device through
 * __fmul_rn/__fadd_rn/__fsub_rn, which nvcc never contracts into an FMA. A row is read in units of
 * 32 consecutive elements (a "sub-block": a whole Q4_0/Q4_1/Q5_0/Q8_0 block, an eighth of a Q4_K
 * block, two scale groups of Q6_K, 32 plain floats), the unit the matmul lanes work on. */
#ifndef KERNELS_CUDA_CUDA_DEQUANT_H
#define KERNELS_CUDA_CUDA_DEQUANT_H

#include <stdint.h>

#ifdef __CUDACC__
#define KCU_FN static __device__ __forceinline__
#define KCU_MUL(a, b) __fmul_rn((a), (b))
#define KCU_ADD(a, b) __fadd_rn((a), (b))
#define KCU_SUB(a, b) __fsub_rn((a), (b))
#else
/* C11 (-std=c11) never contracts a * b + c, so plain operators are single IEEE operations. */
#define KCU_FN static inline
#define KCU_MUL(a, b) ((a) * (b))
#define KCU_ADD(a, b) ((a) + (b))
#define KCU_SUB(a, b) ((a) - (b))
#endif

/* GGUF type ids (common/dtype.h numbers them the same; repeated so that nvcc needs no C header). */
enum {
    KCU_F32 = 0,
    KCU_F16 = 1,
    KCU_Q4_0 = 2,
    KCU_Q4_1 = 3,
    KCU_Q5_0 = 6,
    KCU_Q8_0 = 8,
    KCU_Q4_K = 12,
    KCU_Q6_K = 14,
    KCU_BF16 = 30,
};

KCU_FN float kcu_bits_f32(uint32_t u)
{
    union {
        uint32_t u;
        float f;
    } v;
    v.u = u;
    return v.f;
}

KCU_FN uint16_t kcu_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

/* IEEE half to float, exact (subnormals as man * 2^-24, NaN payloads kept). */
KCU_FN float kcu_f16(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, ex = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (ex == 0x1F)
        return kcu_bits_f32(sign | 0x7F800000u | man << 13);
    if (ex != 0)
        return kcu_bits_f32(sign | (ex + 112) << 23 | man << 13);
    const float f = KCU_MUL((float)man, 5.9604644775390625e-8f); /* man * 2^-24, exact */
    return sign ? -f : f;
}

/* Q4_K sub-block sb's (0..7) 6-bit scale and min from the block's 12 packed bytes s. */
KCU_FN void kcu_q4k_scale_min(const uint8_t *s, int sb, int *sc, int *m)
{
    if (sb < 4) {
        *sc = s[sb] & 63;
        *m = s[sb + 4] & 63;
    } else {
        *sc = (s[sb + 4] & 0xF) | (s[sb - 4] >> 6) << 4;
        *m = (s[sb + 4] >> 4) | (s[sb] >> 6) << 4;
    }
}

/* Elements 32 j .. 32 j + 31 of a row of type `type` starting at byte `row`, into out[0..31]. */
KCU_FN void kcu_dequant32(uint32_t type, const uint8_t *row, int64_t j, float *out)
{
    switch (type) {
    case KCU_F32:
        for (int i = 0; i < 32; i++) {
            const uint8_t *p = row + (j * 32 + i) * 4;
            out[i] = kcu_bits_f32((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                                  (uint32_t)p[3] << 24);
        }
        break;
    case KCU_F16:
        for (int i = 0; i < 32; i++)
            out[i] = kcu_f16(kcu_u16(row + (j * 32 + i) * 2));
        break;
    case KCU_BF16:
        for (int i = 0; i < 32; i++)
            out[i] = kcu_bits_f32((uint32_t)kcu_u16(row + (j * 32 + i) * 2) << 16);
        break;
    case KCU_Q4_0: { /* 18 bytes: d, 16 bytes of nibbles (element i low, i + 16 high) */
        const uint8_t *b = row + j * 18;
        const float d = kcu_f16(kcu_u16(b));
        for (int i = 0; i < 16; i++) {
            out[i] = KCU_MUL(d, (float)((b[2 + i] & 0xF) - 8));
            out[i + 16] = KCU_MUL(d, (float)((b[2 + i] >> 4) - 8));
        }
        break;
    }
    case KCU_Q4_1: { /* 20 bytes: d, m, nibbles */
        const uint8_t *b = row + j * 20;
        const float d = kcu_f16(kcu_u16(b)), m = kcu_f16(kcu_u16(b + 2));
        for (int i = 0; i < 16; i++) {
            out[i] = KCU_ADD(KCU_MUL(d, (float)(b[4 + i] & 0xF)), m);
            out[i + 16] = KCU_ADD(KCU_MUL(d, (float)(b[4 + i] >> 4)), m);
        }
        break;
    }
    case KCU_Q5_0: { /* 22 bytes: d, 4 bytes of fifth bits (little-endian), nibbles */
        const uint8_t *b = row + j * 22;
        const float d = kcu_f16(kcu_u16(b));
        const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 |
                            (uint32_t)b[5] << 24;
        for (int i = 0; i < 16; i++) {
            const int lo = (b[6 + i] & 0xF) | (int)((qh >> i) & 1) << 4;
            const int hi = (b[6 + i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
            out[i] = KCU_MUL(d, (float)(lo - 16));
            out[i + 16] = KCU_MUL(d, (float)(hi - 16));
        }
        break;
    }
    case KCU_Q8_0: { /* 34 bytes: d, 32 signed bytes */
        const uint8_t *b = row + j * 34;
        const float d = kcu_f16(kcu_u16(b));
        for (int i = 0; i < 32; i++)
            out[i] = KCU_MUL(d, (float)(int8_t)b[2 + i]);
        break;
    }
    case KCU_Q4_K: { /* 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles */
        const uint8_t *b = row + (j / 8) * 144, *s = b + 4;
        const int sb = (int)(j % 8); /* sub-block: 32 elements of one scale and min */
        const float d = kcu_f16(kcu_u16(b)), dmin = kcu_f16(kcu_u16(b + 2));
        int sc, m;
        kcu_q4k_scale_min(s, sb, &sc, &m);
        const float d1 = KCU_MUL(d, (float)sc), m1 = KCU_MUL(dmin, (float)m);
        const uint8_t *qs = b + 16 + 32 * (sb / 2);
        const int shift = 4 * (sb % 2);
        for (int l = 0; l < 32; l++)
            out[l] = KCU_SUB(KCU_MUL(d1, (float)((qs[l] >> shift) & 0xF)), m1);
        break;
    }
    case KCU_Q6_K: { /* 210 bytes: ql[128], qh[64], int8 scales[16], d */
        const uint8_t *b = row + (j / 8) * 210;
        const float d = kcu_f16(kcu_u16(b + 208));
        const int e0 = (int)(j % 8) * 32; /* first element within the block */
        const int h = e0 / 128, k = (e0 % 128) / 32;
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        for (int l = 0; l < 32; l++) {
            const int lo = ((k % 2 ? ql[l + 32] : ql[l]) >> (k / 2 ? 4 : 0)) & 0xF;
            const int hi = (qh[l] >> (2 * k)) & 3;
            const float sc = (float)(int8_t)b[192 + (e0 + l) / 16];
            out[l] = KCU_MUL(KCU_MUL(d, sc), (float)((lo | hi << 4) - 32));
        }
        break;
    }
    default: /* the backend refuses other types at prepare */
        for (int i = 0; i < 32; i++)
            out[i] = 0.0f;
        break;
    }
}

/* 1 for the types kcu_dequant32 reads. */
KCU_FN int kcu_type_ok(uint32_t type)
{
    return type == KCU_F32 || type == KCU_F16 || type == KCU_BF16 || type == KCU_Q4_0 ||
           type == KCU_Q4_1 || type == KCU_Q5_0 || type == KCU_Q8_0 || type == KCU_Q4_K ||
           type == KCU_Q6_K;
}

/* The inverse scale of an 8-bit KV row with maximum |x| amax (as the CPU's kern_kv_quant_inv):
 * 127 / amax, or 0 for an all-zero row or one whose quotient overflows. */
KCU_FN float kcu_kv_quant_inv(float amax)
{
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    return id <= 3.40282347e+38f ? id : 0.0f;
}

#endif
