/* The table of supported tensor types (sizes per the GGUF/ggml block layouts). */
#include "common/dtype.h"

static const struct dtype_info dtype_table[DTYPE_COUNT] = {
    [DTYPE_F32] = {"F32", 1, 4},
    [DTYPE_F16] = {"F16", 1, 2},
    [DTYPE_Q4_0] = {"Q4_0", 32, 2 + 16},
    [DTYPE_Q4_1] = {"Q4_1", 32, 2 + 2 + 16},
    [DTYPE_Q5_0] = {"Q5_0", 32, 2 + 4 + 16},
    [DTYPE_Q8_0] = {"Q8_0", 32, 2 + 32},
    [DTYPE_Q4_K] = {"Q4_K", 256, 2 + 2 + 12 + 128},
    [DTYPE_Q6_K] = {"Q6_K", 256, 128 + 64 + 16 + 2},
    [DTYPE_BF16] = {"BF16", 1, 2},
};

const struct dtype_info *dtype_get(uint32_t t)
{
    if (t >= DTYPE_COUNT || !dtype_table[t].name)
        return 0;
    return &dtype_table[t];
}

size_t dtype_row_bytes(uint32_t t, int64_t n)
{
    const struct dtype_info *di = dtype_get(t);
    if (!di || n < 0 || n % di->block_elems)
        return 0;
    return (size_t)(n / di->block_elems) * (size_t)di->block_bytes;
}
