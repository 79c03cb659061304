/* The table of supported tensor types (sizes per the GGUF/ggml block layouts). */
#include "common/dtype.h"

#include <string.h>

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

/* 1 when the IEEE half at p (little-endian) is NaN or infinite: exponent bits all ones. */
static int half_bad(const unsigned char *p)
{
    return (p[1] & 0x7c) == 0x7c;
}

int64_t dtype_first_nonfinite(uint32_t t, const void *data, int64_t n)
{
    const unsigned char *p = data;
    const struct dtype_info *di = dtype_get(t);
    if (!di)
        return -1;
    /* the offsets of a block's f16 scales (d, and the min where there is one) */
    int off[2] = {0, -1};
    switch (t) {
    case DTYPE_F32:
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, p + 4 * i, 4);
            if ((u & 0x7f800000u) == 0x7f800000u)
                return i;
        }
        return -1;
    case DTYPE_F16:
        for (int64_t i = 0; i < n; i++)
            if (half_bad(p + 2 * i))
                return i;
        return -1;
    case DTYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            if ((p[2 * i + 1] & 0x7f) == 0x7f && (p[2 * i] & 0x80))
                return i;
        return -1;
    case DTYPE_Q4_1:
    case DTYPE_Q4_K:
        off[1] = 2; /* d, then m / dmin */
        break;
    case DTYPE_Q6_K:
        off[0] = 128 + 64 + 16; /* ql, qh, scales, then d */
        break;
    default: /* Q4_0, Q5_0, Q8_0: d first */
        break;
    }
    const int64_t nb = n / di->block_elems;
    for (int64_t b = 0; b < nb; b++) {
        const unsigned char *blk = p + (size_t)b * (size_t)di->block_bytes;
        if (half_bad(blk + off[0]) || (off[1] >= 0 && half_bad(blk + off[1])))
            return b * di->block_elems;
    }
    return -1;
}
