/* Scalar reference of the q16 matmul mode: activations quantized to 16 bits per block of 32
 * (struct kern_q16; its quantization and dot products are in quant_ref.c, shared with q8), multiplied with Q4_0 / Q4_1 / Q8_0 weight quants in exact integer sums,
 * then scaled per block: sum_b d_w d_x isum_b (+ m_w s_x for Q4_1), in block order. */
#include <assert.h>
#include <stdlib.h>

#include "common/log.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

float kern_ref_vec_dot_q16(uint32_t type, const void *w, const struct kern_q16 *x, int64_t n)
{
    assert(n % KERN_QK == 0);
    switch (type) {
    case DTYPE_Q4_0:
        return kern_ref_dot_q4_0_q16(w, x, n);
    case DTYPE_Q4_1:
        return kern_ref_dot_q4_1_q16(w, x, n);
    case DTYPE_Q8_0:
        return kern_ref_dot_q8_0_q16(w, x, n);
    default:
        LOG_ERROR("kern_ref_vec_dot_q16: unsupported type %u", (unsigned)type);
        abort();
    }
}

#define REF_GEMM_Q16(name)                                                                         \
    void kern_ref_gemm_##name##_q16(KERN_GEMM_Q16_ARGS)                                            \
    {                                                                                              \
        for (int64_t r = 0; r < n_rows; r++) {                                                     \
            const void *row = (const char *)w + (size_t)r * row_bytes;                             \
            for (int64_t t = 0; t < n_tok; t++)                                                    \
                y[(size_t)t * ldy + r] = kern_ref_dot_##name##_q16(row, xq + (size_t)t * ldxq, n);          \
        }                                                                                          \
    }

REF_GEMM_Q16(q4_0)
REF_GEMM_Q16(q4_1)
REF_GEMM_Q16(q8_0)
