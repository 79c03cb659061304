/* Tensor element types, numbered as GGUF/ggml number them, and their block geometry.
 * Shared by io/ (to validate tensor sizes) and kernels/ (to compute with them). */
#ifndef COMMON_DTYPE_H
#define COMMON_DTYPE_H

#include <stddef.h>
#include <stdint.h>

enum dtype {
    DTYPE_F32 = 0,
    DTYPE_F16 = 1,
    DTYPE_Q4_0 = 2,
    DTYPE_Q4_1 = 3,
    DTYPE_Q5_0 = 6,
    DTYPE_Q8_0 = 8,
    DTYPE_Q4_K = 12,
    DTYPE_Q6_K = 14,
    DTYPE_BF16 = 30,
    DTYPE_COUNT = 31, /* one past the largest id; array bound for per-type tables */
};

struct dtype_info {
    const char *name;  /* "Q4_1" */
    int block_elems;   /* elements per block (1 for plain float types) */
    int block_bytes;   /* bytes per block */
};

/* Geometry of a supported type, or NULL when t is unknown or unsupported. */
const struct dtype_info *dtype_get(uint32_t t);

/* Bytes of one row of n elements; 0 when n is not a multiple of the block size or t is
 * unsupported. */
size_t dtype_row_bytes(uint32_t t, int64_t n);

/* The first of n elements of type t at data (a whole number of blocks) whose value is not
 * finite (NaN or an infinity), or -1 when all are. For the block types, the blocks' float
 * scales decide (their integer parts cannot make a value infinite); the index is the first
 * element of the first such block. -1 too for an unsupported type (dtype_get says). */
int64_t dtype_first_nonfinite(uint32_t t, const void *data, int64_t n);

#endif
