/* The GPU's layout of quantized weights (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0), made from the GGUF
 * rows at load (kern_ops.prepare) and read by the packed matmul kernels (cuda_kernels.cu) with one
 * 16-byte load per lane (two for Q8_0) that yields, in registers, exactly the values a lane of
 * mma.sync m16n8k16 needs for its B fragments: no shared-memory staging, and no weight ever
 * expanded in device memory.
 * Written once for both sides like cuda_dequant.h: nvcc compiles the decoding into the kernels,
 * and tests/test_cuda_pack.c packs rows on the CPU and unpacks them with the same text, bit for
 * bit against the CPU's reference dequantization.
 *
 * A row's 32-element units (a Q4_0/Q4_1 block, an eighth of a Q4_K block) go in groups of four
 * (128 elements, half a Q4_K block); rows go in tiles of eight (an n8 tile of mma). With U the
 * units of a row and U4 = ceil(U / 4) its groups (units past U are zero), per (tile, group):
 *   - the quant plane holds 512 W bytes (W = kcu_p4_words: 1 for the 4-bit types, 2 for Q8_0):
 *     lane l = 4 g + t (g = row in the tile, t = 0..3) owns 16 W bytes, the W u32 words of each
 *     unit j = 0..3 in turn; value i (0..7; 4-bit: nibble i of the word, bits 4i..4i+3; Q8_0:
 *     byte i % 4 of word i / 4, signed) is the element at k = kcu_p4_k(t, i) of its unit: 2t,
 *     2t+1, 2t+8, 2t+9, then the same + 16 — mma's B fragment order (registers b0 = values 0,1
 *     and b1 = 2,3 for the unit's first 16 k, values 4..7 for its second);
 *   - Q5_0 and Q6_K keep their fifth and sixth bits in a high plane after the quant plane: per
 *     (tile, group) a lane owns 4 hb bytes (hb = kcu_p4_hbits, 1 or 2), unit j's bits at 8 hb j,
 *     value i's at hb i within them;
 *   - the scale plane holds the 8 rows' records of the group (kcu_p4_rec bytes each, u32 words,
 *     little-endian): Q4_0, Q5_0 and Q8_0 the four units' half d (two per word); Q6_K the block's
 *     d, then per unit its two int8 scales (of its first and second 16 values); Q4_1 per unit one
 * word, d low and m high; Q4_K word 0 the block's d (low) and dmin (high), word 1 the four 6-bit
 * scales, word 2 the four 6-bit mins (one byte per unit). Both planes of a tile's group are
 * contiguous, and tiles follow groups: (tile * U4 + group). A warp reading one (tile, group) reads
 * 512 W contiguous bytes. Sizes: Q4_0 4.5 bits per weight (as GGUF), Q4_1 5 (as GGUF), Q4_K 4.75
 * (GGUF 4.5), Q8_0 8.5 (as GGUF). */
#ifndef KERNELS_CUDA_CUDA_PACK_H
#define KERNELS_CUDA_CUDA_PACK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_dequant.h"

/* Sizes and offsets: host (prepare, launch grids) and device alike. */
#ifdef __CUDACC__
#define KCU_HD static __host__ __device__ __forceinline__
#else
#define KCU_HD static inline
#endif

#define KCU_P4_LANE 16                 /* bytes of a lane's load */
#define KCU_P4_TILE (32 * KCU_P4_LANE) /* bytes of a (tile, group) in the quant plane */

/* 1 for the types this layout holds. */
KCU_HD int kcu_p4_type(uint32_t type)
{
    return type == KCU_Q4_0 || type == KCU_Q4_1 || type == KCU_Q4_K || type == KCU_Q8_0 ||
           type == KCU_Q5_0 || type == KCU_Q6_K;
}

/* High bits per value above the low nibble, in the high plane: Q5_0 1, Q6_K 2, else 0. */
KCU_HD int kcu_p4_hbits(uint32_t type)
{
    return type == KCU_Q5_0 ? 1 : type == KCU_Q6_K ? 2 : 0;
}

/* u32 words per unit and lane: 8 values of 4 or 8 bits. */
KCU_HD int kcu_p4_words(uint32_t type)
{
    return type == KCU_Q8_0 ? 2 : 1;
}

/* Bytes of one row's record of a group in the scale plane. */
KCU_HD int kcu_p4_rec(uint32_t type)
{
    return type == KCU_Q4_0 || type == KCU_Q8_0 || type == KCU_Q5_0 ? 8
           : type == KCU_Q4_1                                       ? 16
                                                                    : 12;
}

KCU_HD int64_t kcu_p4_groups(int64_t ne0)
{
    return (ne0 / 32 + 3) / 4;
}

KCU_HD int64_t kcu_p4_tiles(int64_t ne1)
{
    return (ne1 + 7) / 8;
}

KCU_HD size_t kcu_p4_qbytes(uint32_t type, int64_t ne0, int64_t ne1)
{
    return (size_t)kcu_p4_tiles(ne1) * (size_t)kcu_p4_groups(ne0) * KCU_P4_TILE *
           (size_t)kcu_p4_words(type);
}

/* The high plane (at kcu_p4_qbytes): per (tile, group) 4 hbits bytes a lane. */
KCU_HD size_t kcu_p4_hbytes(uint32_t type, int64_t ne0, int64_t ne1)
{
    return (size_t)kcu_p4_tiles(ne1) * (size_t)kcu_p4_groups(ne0) * 32 * 4 *
           (size_t)kcu_p4_hbits(type);
}

/* K slices of the bf16 tensor-core matmuls (cuda_kernels.cu), a function of the shape alone,
 * never of the batch: returns ks (1, 2, 4 or 8) and sets *gps, the groups a slice takes
 * (consecutive; the last slice may be shorter and slices past the last group are empty). ks grows
 * while a one-token matmul (blocks of 128 / ks rows) has fewer than KCU_P4_SLICE_BLOCKS blocks
 * and every slice keeps at least 2 groups. */
#define KCU_P4_SLICES_MAX   8
#define KCU_P4_SLICE_BLOCKS 264 /* two a multiprocessor on an H100 or H200 (132) */
KCU_HD int kcu_p4_slices(int64_t ne0, int64_t ne1, int64_t *gps)
{
    const int64_t groups = kcu_p4_groups(ne0), tiles = kcu_p4_tiles(ne1);
    int ks = 1;
    while (ks < KCU_P4_SLICES_MAX && 4 * ks <= groups &&
           (tiles * ks + 15) / 16 < KCU_P4_SLICE_BLOCKS)
        ks *= 2;
    *gps = (groups + ks - 1) / ks;
    return ks;
}

/* Where the scale plane starts: after the quant and high planes. */
KCU_HD size_t kcu_p4_sbase(uint32_t type, int64_t ne0, int64_t ne1)
{
    return kcu_p4_qbytes(type, ne0, ne1) + kcu_p4_hbytes(type, ne0, ne1);
}

/* The three planes. */
KCU_HD size_t kcu_p4_bytes(uint32_t type, int64_t ne0, int64_t ne1)
{
    return kcu_p4_sbase(type, ne0, ne1) +
           (size_t)kcu_p4_tiles(ne1) * (size_t)kcu_p4_groups(ne0) * 8 * (size_t)kcu_p4_rec(type);
}

/* The k (0..31) within its unit of nibble i (0..7) of lane t's word. */
KCU_HD int kcu_p4_k(int t, int i)
{
    return 2 * t + (i & 1) + (i & 2) * 4 + (i & 4) * 4;
}

/* Unit j's high bits (hbits per value, value i at bit hbits i) from a lane's high field hw of
 * its group (Q5_0: one word, 8 bits a unit; Q6_K: two words, 16 bits a unit). */
KCU_FN uint32_t kcu_p4_hi(uint32_t type, const uint32_t *hw, int j)
{
    if (type == KCU_Q5_0)
        return (hw[0] >> (8 * j)) & 0xFF;
    if (type == KCU_Q6_K)
        return (hw[j / 2] >> (16 * (j % 2))) & 0xFFFF;
    return 0;
}

/* Value i (0..7) of a unit from its lane words w and high bits hi: a 4-bit q (0..15), Q5_0's
 * 5-bit and Q6_K's 6-bit q, or Q8_0's signed byte. */
KCU_FN int kcu_p4_q(uint32_t type, const uint32_t *w, uint32_t hi, int i)
{
    if (type == KCU_Q8_0)
        return (int)(int8_t)(uint8_t)(w[i / 4] >> (8 * (i % 4)));
    const int lo = (int)((w[0] >> (4 * i)) & 0xF);
    if (type == KCU_Q5_0)
        return lo | (int)((hi >> i) & 1) << 4;
    if (type == KCU_Q6_K)
        return lo | (int)((hi >> (2 * i)) & 3) << 4;
    return lo;
}

/* A unit's two parameters from its row's record words rw of the group, unit j (0..3) of it:
 * Q4_0, Q5_0 and Q8_0 a = d; Q4_1 a = d, b = m; Q4_K a = d * scale, b = dmin * min (the
 * reference's d1, m1); Q6_K a = d * the scale of the unit's first 16, b = of its second. */
KCU_FN void kcu_p4_par(uint32_t type, const uint32_t *rw, int j, float *a, float *b)
{
    if (type == KCU_Q6_K) {
        const float d = kcu_f16((uint16_t)rw[0]);
        const uint32_t sw = rw[1 + j / 2] >> (16 * (j % 2)); /* the unit's two int8 scales */
        *a = KCU_MUL(d, (float)(int8_t)(uint8_t)sw);
        *b = KCU_MUL(d, (float)(int8_t)(uint8_t)(sw >> 8));
    } else if (type == KCU_Q4_0 || type == KCU_Q8_0 || type == KCU_Q5_0) {
        *a = kcu_f16((uint16_t)(rw[j / 2] >> (16 * (j % 2))));
        *b = 0.0f;
    } else if (type == KCU_Q4_1) {
        *a = kcu_f16((uint16_t)rw[j]);
        *b = kcu_f16((uint16_t)(rw[j] >> 16));
    } else {
        *a = KCU_MUL(kcu_f16((uint16_t)rw[0]), (float)((rw[1] >> (8 * j)) & 0xFF));
        *b = KCU_MUL(kcu_f16((uint16_t)(rw[0] >> 16)), (float)((rw[2] >> (8 * j)) & 0xFF));
    }
}

/* The weight of value q (value i of its lane) with a unit's parameters, as cuda_dequant.h (and
 * the CPU) make it. */
KCU_FN float kcu_p4_val(uint32_t type, int q, float a, float b, int i)
{
    if (type == KCU_Q4_0)
        return KCU_MUL(a, (float)(q - 8));
    if (type == KCU_Q5_0)
        return KCU_MUL(a, (float)(q - 16));
    if (type == KCU_Q6_K)
        return KCU_MUL(i < 4 ? a : b, (float)(q - 32));
    if (type == KCU_Q8_0)
        return KCU_MUL(a, (float)q);
    if (type == KCU_Q4_1)
        return KCU_ADD(KCU_MUL(a, (float)q), b);
    return KCU_SUB(KCU_MUL(a, (float)q), b);
}

/* The q8 mode (8-bit activations, int8 tensor cores): value q (kcu_p4_q) as the signed integer
 * its unit's parameters scale (kcu_p4_par: w = a * this, less b for Q4_1/Q4_K's offset; Q6_K's
 * first four values take a, the rest b). */
KCU_FN int kcu_p4_int(uint32_t type, int q)
{
    return type == KCU_Q4_0 ? q - 8 : type == KCU_Q5_0 ? q - 16 : type == KCU_Q6_K ? q - 32 : q;
}

/* Where element k (0..31) of a 32-element block of activations sits in the q8 mode's quantized
 * rows: value i of lane t's unit words (element kcu_p4_k(t, i)) at byte 16 (i / 4) + 4t + i % 4,
 * so that the bytes mma.sync.m16n8k32 wants in one register (lane t: k 4t..4t+3, then
 * 16 + 4t..) are one aligned word and line up with the weights' values. */
KCU_HD int kcu_q8_pos(int k)
{
    const int r = k % 16; /* = 2t + (i & 1) + 8 ((i / 2) & 1) */
    return 16 * (k / 16) + 4 * ((r % 8) / 2) + (r & 1) + 2 * (r / 8);
}

/* Byte offsets of row r's lane t words of unit u (W words from there), and of row r's record
 * of group u / 4. */
KCU_HD size_t kcu_p4_qoff(uint32_t type, int64_t groups, int64_t r, int64_t u, int t)
{
    const size_t wb = 4 * (size_t)kcu_p4_words(type); /* bytes of a unit's words */
    return (((size_t)(r / 8) * (size_t)groups + (size_t)(u / 4)) * 32 + (size_t)(r % 8) * 4 +
            (size_t)t) *
               4 * wb +
           (size_t)(u % 4) * wb;
}

/* Byte offset within the high plane of row r's lane t field of group g4. */
KCU_HD size_t kcu_p4_hoff(uint32_t type, int64_t groups, int64_t r, int64_t g4, int t)
{
    return (((size_t)(r / 8) * (size_t)groups + (size_t)g4) * 32 + (size_t)(r % 8) * 4 +
            (size_t)t) *
           4 * (size_t)kcu_p4_hbits(type);
}

KCU_HD size_t kcu_p4_soff(uint32_t type, int64_t groups, int64_t r, int64_t g4)
{
    return (((size_t)(r / 8) * (size_t)groups + (size_t)g4) * 8 + (size_t)(r % 8)) *
           (size_t)kcu_p4_rec(type);
}

KCU_FN uint32_t kcu_p4_word(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Elements 32 u .. 32 u + 31 of row r from the packed planes (p: all three, the high plane at
 * hbase, the scale plane at sbase), into out[0..31]: bitwise kcu_dequant32 of the GGUF row. */
KCU_FN void kcu_p4_unit(uint32_t type, const uint8_t *p, size_t hbase, size_t sbase, int64_t ne0,
                        int64_t r, int64_t u, float *out)
{
    const int64_t groups = kcu_p4_groups(ne0);
    uint32_t rw[4];
    const uint8_t *rec = p + sbase + kcu_p4_soff(type, groups, r, u / 4);
    for (int w = 0; w < kcu_p4_rec(type) / 4; w++)
        rw[w] = kcu_p4_word(rec + 4 * w);
    float a, b;
    kcu_p4_par(type, rw, (int)(u % 4), &a, &b);
    for (int t = 0; t < 4; t++) {
        const uint8_t *wp = p + kcu_p4_qoff(type, groups, r, u, t);
        const uint32_t w[2] = {kcu_p4_word(wp), kcu_p4_words(type) > 1 ? kcu_p4_word(wp + 4) : 0};
        uint32_t hw[2] = {0, 0};
        for (int k = 0; k < kcu_p4_hbits(type); k++)
            hw[k] = kcu_p4_word(p + hbase + kcu_p4_hoff(type, groups, r, u / 4, t) + 4 * k);
        const uint32_t hi = kcu_p4_hi(type, hw, (int)(u % 4));
        for (int i = 0; i < 8; i++)
            out[kcu_p4_k(t, i)] = kcu_p4_val(type, kcu_p4_q(type, w, hi, i), a, b, i);
    }
}

#ifndef __CUDACC__
/* Host side: the packed planes of ne1 GGUF rows (row_bytes apart from src) into dst
 * (kcu_p4_bytes). */
static inline void kcu_p4_pack(uint32_t type, const uint8_t *src, size_t row_bytes, int64_t ne0,
                               int64_t ne1, uint8_t *dst)
{
    const int64_t groups = kcu_p4_groups(ne0), units = ne0 / 32;
    const size_t hbase = kcu_p4_qbytes(type, ne0, ne1), sbase = kcu_p4_sbase(type, ne0, ne1);
    memset(dst, 0, kcu_p4_bytes(type, ne0, ne1));
    for (int64_t r = 0; r < ne1; r++) {
        const uint8_t *row = src + (size_t)r * row_bytes;
        for (int64_t u = 0; u < units; u++) {
            uint8_t q[32]; /* the unit's values in element order (Q8_0: the signed bytes) */
            uint8_t *rec = dst + sbase + kcu_p4_soff(type, groups, r, u / 4);
            const int j = (int)(u % 4);
            if (type == KCU_Q8_0) {
                const uint8_t *b = row + u * 34;
                memcpy(q, b + 2, 32);
                memcpy(rec + 2 * j, b, 2);
            } else if (type == KCU_Q5_0) { /* d, qh (element i's fifth bit at bit i), nibbles */
                const uint8_t *b = row + u * 22;
                const uint32_t qh = kcu_p4_word(b + 2);
                for (int i = 0; i < 16; i++) {
                    q[i] = (uint8_t)((b[6 + i] & 0xF) | ((qh >> i) & 1) << 4);
                    q[i + 16] = (uint8_t)((b[6 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
                }
                memcpy(rec + 2 * j, b, 2);
            } else if (type == KCU_Q6_K) { /* ql[128], qh[64], int8 scales[16], d */
                const uint8_t *b = row + (u / 8) * 210;
                const int e0 = (int)(u % 8) * 32, h = e0 / 128, kq = (e0 % 128) / 32;
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                for (int l = 0; l < 32; l++) {
                    const int lo = ((kq % 2 ? ql[l + 32] : ql[l]) >> (kq / 2 ? 4 : 0)) & 0xF;
                    q[l] = (uint8_t)(lo | ((qh[l] >> (2 * kq)) & 3) << 4);
                }
                memcpy(rec, b + 208, 2); /* d: the same in both groups of the block */
                rec[4 + 2 * j] = b[192 + e0 / 16];
                rec[4 + 2 * j + 1] = b[192 + e0 / 16 + 1];
            } else if (type == KCU_Q4_0 || type == KCU_Q4_1) {
                const uint8_t *b = row + u * (type == KCU_Q4_0 ? 18 : 20);
                const uint8_t *qs = b + (type == KCU_Q4_0 ? 2 : 4);
                for (int i = 0; i < 16; i++) {
                    q[i] = qs[i] & 0xF;
                    q[i + 16] = qs[i] >> 4;
                }
                if (type == KCU_Q4_0)
                    memcpy(rec + 2 * j, b, 2);
                else
                    memcpy(rec + 4 * j, b, 4); /* d, m: already the record's low, high halves */
            } else {
                const uint8_t *b = row + (u / 8) * 144, *s = b + 4;
                const int sb = (int)(u % 8);
                int sc, m;
                kcu_q4k_scale_min(s, sb, &sc, &m);
                const uint8_t *qs = b + 16 + 32 * (sb / 2);
                for (int l = 0; l < 32; l++)
                    q[l] = (qs[l] >> (4 * (sb % 2))) & 0xF;
                memcpy(rec, b, 4); /* d, dmin: the same in every group of the block */
                rec[4 + j] = (uint8_t)sc;
                rec[8 + j] = (uint8_t)m;
            }
            for (int t = 0; t < 4; t++) {
                uint8_t *wp = dst + kcu_p4_qoff(type, groups, r, u, t);
                const int hb = kcu_p4_hbits(type);
                uint8_t *hp = dst + hbase + kcu_p4_hoff(type, groups, r, u / 4, t);
                for (int i = 0; i < 8; i++) {
                    const uint8_t v = q[kcu_p4_k(t, i)];
                    if (type == KCU_Q8_0) {
                        wp[4 * (i / 4) + i % 4] = v;
                        continue;
                    }
                    wp[i / 2] |= (uint8_t)((v & 0xF) << (4 * (i % 2)));
                    /* high bits: unit j's at bit 8 hb j of the lane's field, value i's at hb i */
                    const int bit = 8 * hb * j + hb * i;
                    if (hb)
                        hp[bit / 8] |= (uint8_t)((v >> 4) << (bit % 8));
                }
            }
        }
    }
}
#endif

#endif
