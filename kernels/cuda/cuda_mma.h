/* Where each lane of a warp finds its operands of mma.sync.m16n8k16 (bf16 in, f32 out) in
 * shared-memory tiles, and where its results go: written once for the tensor-core kernel
 * (cuda_kernels.cu) and a CPU test (tests/test_cuda_mma.c) that emulates the instruction from the
 * PTX ISA's fragment tables and checks these functions against a plain matrix product. Tiles
 * hold bfloat16 values as raw 16-bit patterns, row-major with `ld` elements per row: A as
 * tokens x k, B as weight rows x k (the GGUF layout: k contiguous, which is mma's "col" B).
 * g = lane / 4 and t = lane % 4 throughout. */
#ifndef KERNELS_CUDA_CUDA_MMA_H
#define KERNELS_CUDA_CUDA_MMA_H

#include <stdint.h>

#ifdef __CUDACC__
#define KCU_MMA_FN static __device__ __forceinline__
#else
#define KCU_MMA_FN static inline
#endif

/* Two consecutive bf16 of a tile as one register: the lower index in the low half. */
KCU_MMA_FN uint32_t kcu_pair(const uint16_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 16;
}

/* A's fragment for rows r0..r0+15, k ks..ks+15: rows r0 + g, r0 + g + 8; k 2t, 2t + 1 (regs 0, 1)
 * and 2t + 8, 2t + 9 (regs 2, 3). */
KCU_MMA_FN void kcu_frag_a(const uint16_t *a, int ld, int r0, int ks, int lane, uint32_t f[4])
{
    const int g = lane / 4, t = lane % 4;
    f[0] = kcu_pair(a + (r0 + g) * ld + ks + 2 * t);
    f[1] = kcu_pair(a + (r0 + g + 8) * ld + ks + 2 * t);
    f[2] = kcu_pair(a + (r0 + g) * ld + ks + 2 * t + 8);
    f[3] = kcu_pair(a + (r0 + g + 8) * ld + ks + 2 * t + 8);
}

/* The row lane l points ldmatrix.x4 at so that it returns kcu_frag_a's four registers (A in
 * shared memory, rows 16-byte aligned): row r0 + l % 16, k ks + 8 (l / 16). */
KCU_MMA_FN const uint16_t *kcu_ldsm_a(const uint16_t *a, int ld, int r0, int ks, int lane)
{
    return a + (r0 + lane % 16) * ld + ks + 8 * (lane / 16);
}

/* The row lane l points ldmatrix.x4.trans at so that it returns the B fragments (kcu_frag_b's
 * registers) of two n8 tiles, columns n0..n0+7 (registers 0, 1) and n0+8..n0+15 (2, 3), k
 * ks..ks+15, of a B stored k-major (element (k, n) at b[k * ld + n], rows 16-byte aligned): row
 * ks + l % 16, column n0 + 8 (l / 16). */
KCU_MMA_FN const uint16_t *kcu_ldsm_bt(const uint16_t *b, int ld, int n0, int ks, int lane)
{
    return b + (ks + lane % 16) * ld + n0 + 8 * (lane / 16);
}

/* kcu_frag_a with rows r0 + g and r0 + g + 8 of a row-major A in global memory at x0 and x1
 * (k from 0, n elements a row): zeros for a NULL row and for k >= n. */
KCU_MMA_FN void kcu_frag_a_rows(const uint16_t *x0, const uint16_t *x1, int64_t n, int64_t ks,
                                int lane, uint32_t f[4])
{
    const int64_t k = ks + 2 * (lane % 4);
    f[0] = x0 && k < n ? kcu_pair(x0 + k) : 0u;
    f[1] = x1 && k < n ? kcu_pair(x1 + k) : 0u;
    f[2] = x0 && k + 8 < n ? kcu_pair(x0 + k + 8) : 0u;
    f[3] = x1 && k + 8 < n ? kcu_pair(x1 + k + 8) : 0u;
}

/* B's fragment for weight rows n0..n0+7 (B's columns), k ks..ks+15: row n0 + g; k 2t, 2t + 1
 * (reg 0) and 2t + 8, 2t + 9 (reg 1). */
KCU_MMA_FN void kcu_frag_b(const uint16_t *b, int ld, int n0, int ks, int lane, uint32_t f[2])
{
    const int g = lane / 4, t = lane % 4;
    f[0] = kcu_pair(b + (n0 + g) * ld + ks + 2 * t);
    f[1] = kcu_pair(b + (n0 + g) * ld + ks + 2 * t + 8);
}

/* Result i (0..3) of a lane: the 16 x 8 tile's row (token) and column (weight row). */
KCU_MMA_FN void kcu_frag_c(int lane, int i, int *row, int *col)
{
    *row = lane / 4 + (i >= 2 ? 8 : 0);
    *col = 2 * (lane % 4) + (i & 1);
}

#endif
