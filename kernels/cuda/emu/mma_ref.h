/* mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (and .f16.f16) for a whole warp, from the PTX
 * ISA's fragment tables (docs/CUDA_NOTES.md §2.1), written independently of the kernel's helpers
 * (kernels/cuda/cuda_mma.h): the 32 lanes' registers are assembled into A (16 x 16) and B
 * (16 x 8), D = A B + C is formed in double precision and rounded to f32, and D is handed back
 * per the C table. Used by tests/test_cuda_mma.c and by the CPU emulator of the CUDA kernels
 * (kernels/cuda/emu/). Tables: A, row-major 16 x 16: element pair p (0..3) of lane (g, t) =
 * (lane / 4, lane % 4) covers row g + 8 * (p % 2), columns 2t + 8 * (p / 2) + {0, 1}. B, 16 (k)
 * x 8 (n): pair p covers k = 2t + 8p + {0, 1}, column n = g. C/D 16 x 8: element i covers row
 * g + 8 * (i / 2), column 2t + i % 2. Each register holds its pair's lower index in bits 0-15. */
#ifndef KERNELS_CUDA_EMU_MMA_REF_H
#define KERNELS_CUDA_EMU_MMA_REF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float kcu_ref_bf16(uint32_t reg, int hi)
{
    const uint32_t u = (hi ? reg >> 16 : reg & 0xFFFFu) << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* The IEEE half (binary16) in the low or high 16 bits of reg. */
static inline float kcu_ref_f16(uint32_t reg, int hi)
{
    const uint32_t h = hi ? reg >> 16 : reg & 0xFFFFu;
    const int e = (int)(h >> 10 & 31), m = (int)(h & 1023);
    const float v = e == 0    ? ldexpf((float)m, -24)
                    : e == 31 ? (m ? NAN : INFINITY)
                              : ldexpf((float)(m | 1024), e - 25);
    return h & 0x8000u ? -v : v;
}

/* f16: the inputs are IEEE halves (.f16.f16), else bfloat16. */
static inline void kcu_mma_ref(const uint32_t a[32][4], const uint32_t b[32][2], float c[32][4],
                               int f16)
{
    float (*const in)(uint32_t, int) = f16 ? kcu_ref_f16 : kcu_ref_bf16;
    float A[16][16], B[16][8], D[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int p = 0; p < 4; p++)
            for (int h = 0; h < 2; h++)
                A[g + 8 * (p % 2)][2 * t + 8 * (p / 2) + h] = in(a[lane][p], h);
        for (int p = 0; p < 2; p++)
            for (int h = 0; h < 2; h++)
                B[2 * t + 8 * p + h][g] = in(b[lane][p], h);
        for (int i = 0; i < 4; i++) /* C in, by the same table as D */
            D[g + 8 * (i / 2)][2 * t + i % 2] = c[lane][i];
    }
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            double s = D[m][n];
            for (int k = 0; k < 16; k++)
                s += (double)A[m][k] * B[k][n];
            D[m][n] = (float)s;
        }
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; i++)
            c[lane][i] = D[g + 8 * (i / 2)][2 * t + i % 2];
    }
}

/* mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 for a whole warp, from the PTX ISA's "Matrix
 * Fragments for mma.m16n8k32" (integer types; docs/CUDA_NOTES.md §2.1): each register holds four
 * signed bytes, the lowest k in bits 0-7. A, row-major 16 x 32: register p (0..3) of lane (g, t)
 * covers row g + 8 * (p % 2), k 4t + 16 * (p / 2) + {0..3}. B, 32 (k) x 8 (n): register p covers
 * k 4t + 16p + {0..3}, column n = g. C/D, 16 x 8 int32: as the f32 table above. D = A B + C in
 * 64-bit integers, wrapped to 32 bits as the hardware's (non-saturating) sums wrap. */
static inline void kcu_mma_ref_s8(const uint32_t a[32][4], const uint32_t b[32][2],
                                  int32_t c[32][4])
{
    int A[16][32], B[32][8];
    int64_t D[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int p = 0; p < 4; p++)
            for (int e = 0; e < 4; e++)
                A[g + 8 * (p % 2)][4 * t + 16 * (p / 2) + e] =
                    (int8_t)(uint8_t)(a[lane][p] >> (8 * e));
        for (int p = 0; p < 2; p++)
            for (int e = 0; e < 4; e++)
                B[4 * t + 16 * p + e][g] = (int8_t)(uint8_t)(b[lane][p] >> (8 * e));
        for (int i = 0; i < 4; i++)
            D[g + 8 * (i / 2)][2 * t + i % 2] = c[lane][i];
    }
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++)
            for (int k = 0; k < 32; k++)
                D[m][n] += (int64_t)A[m][k] * B[k][n];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; i++)
            c[lane][i] = (int32_t)(uint32_t)(uint64_t)D[g + 8 * (i / 2)][2 * t + i % 2];
    }
}

/* ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 for a whole warp (docs/CUDA_NOTES.md
 * §2.2): addr[l] is the address lane l supplies (row l % 8 of matrix l / 8; lanes past the
 * nmat matrices' 8 * nmat are ignored); out[l][m] is lane l's register for matrix m: row l / 4,
 * elements 2 (l % 4) and 2 (l % 4) + 1, the lower in bits 0-15; with trans, matrix m's column
 * l / 4, rows 2 (l % 4) and 2 (l % 4) + 1. */
static inline void kcu_ldmatrix_ref(const uint16_t *const addr[32], int nmat, int trans,
                                    uint32_t out[32][4])
{
    for (int lane = 0; lane < 32; lane++)
        for (int m = 0; m < nmat; m++) {
            uint16_t lo, hi;
            if (trans) {
                lo = addr[8 * m + 2 * (lane % 4)][lane / 4];
                hi = addr[8 * m + 2 * (lane % 4) + 1][lane / 4];
            } else {
                lo = addr[8 * m + lane / 4][2 * (lane % 4)];
                hi = addr[8 * m + lane / 4][2 * (lane % 4) + 1];
            }
            out[lane][m] = (uint32_t)lo | (uint32_t)hi << 16;
        }
}

#endif
