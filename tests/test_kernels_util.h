/* Helpers shared by the kernel tests (test_kernels.c, test_kernels_dot.c, test_kernels_gemm.c,
 * test_kernels_packed.c, test_kernels_attn.c): the type lists, float bit views, random
 * activations and weight rows, the float64 dot and the tolerance results are held to. */
#ifndef TESTS_TEST_KERNELS_UTIL_H
#define TESTS_TEST_KERNELS_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/test_rand.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static const uint32_t quant_types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0,
                                       DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
static const uint32_t float_types[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16};
#define N_QUANT_TYPES (sizeof quant_types / sizeof quant_types[0])
#define N_FLOAT_TYPES (sizeof float_types / sizeof float_types[0])

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void put_f16_bits(uint8_t *p, uint16_t h)
{
    memcpy(p, &h, sizeof h);
}

/* n activations: roughly normal, block magnitudes spread over four decades, with an occasional
 * all-zero block and an occasional outlier. */
static inline void random_activations(float *x, int64_t n, struct rng *r)
{
    for (int64_t b = 0; b < n / KERN_QK; b++) {
        float scale = powf(10.0f, rng_uniform(r, -3.0f, 1.0f));
        uint64_t kind = rng_u64(r) % 16;
        for (int j = 0; j < KERN_QK; j++) {
            float u = rng_uniform(r, -1, 1) + rng_uniform(r, -1, 1) + rng_uniform(r, -1, 1);
            x[b * KERN_QK + j] = kind == 0 ? 0.0f : u * scale;
        }
        if (kind == 1)
            x[b * KERN_QK + rng_u64(r) % KERN_QK] = 50.0f * scale;
    }
}

/* Exact dot of the dequantized weights with the dequantized activations (d * q), in double,
 * and the sum of |terms| that tolerances are measured against. */
static inline double float_dot(const float *w, const struct kern_q8 *x, int64_t n, double *mag)
{
    double sum = 0.0, abs_sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const struct kern_q8 *xb = &x[i / KERN_QK];
        double t = (double)w[i] * ((double)xb->d * xb->q[i % KERN_QK]);
        sum += t;
        abs_sum += fabs(t);
    }
    *mag = abs_sum;
    return sum;
}

/* |got - want| within rel of the magnitude of the terms (plus a floor for all-zero rows). */
static inline int close_enough(double got, double want, double mag, double rel)
{
    return fabs(got - want) <= rel * mag + 1e-30;
}

static inline const struct kern_cpu_fns *isa_fns(int isa)
{
    return kern_cpu_fns_get((enum kern_isa)isa);
}

/* ---- shared by the dot, matvec and gemm tests ------------------------------------------- */

#define REL_TOL 1e-5 /* of sum |w_i x_i|; integer parts are exact, only float sums differ */

/* Whether byte off of a block of `type` is a fp16 scale field (kept sane by the extremes test). */
static inline int is_f16_field(uint32_t type, size_t off)
{
    switch (type) {
    case DTYPE_Q4_1:
    case DTYPE_Q4_K:
        return off < 4; /* d and m / dmin */
    case DTYPE_Q6_K:
        return off >= 208; /* d at the end */
    default:
        return off < 2; /* d */
    }
}

static const uint32_t all_types[] = {DTYPE_F32,  DTYPE_F16,  DTYPE_BF16, DTYPE_Q4_0, DTYPE_Q4_1,
                                     DTYPE_Q5_0, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};
#define N_ALL_TYPES (sizeof all_types / sizeof all_types[0])

/* n_rows random rows of n weights, row_bytes = dtype_row_bytes + pad apart (pad a multiple of 4,
 * filled with 0xEE). With a fill pattern (>= 0) every quant byte (not the fp16 scales) is set to
 * it. Caller frees. */
static inline uint8_t *random_rows(uint32_t type, int64_t n, int64_t n_rows, size_t pad, int fill,
                                   struct rng *r)
{
    size_t bytes = dtype_row_bytes(type, n), row_bytes = bytes + pad;
    const struct dtype_info *di = dtype_get(type);
    uint8_t *w = malloc(row_bytes * (size_t)n_rows);
    assert_non_null(w);
    memset(w, 0xEE, row_bytes * (size_t)n_rows);
    for (int64_t i = 0; i < n_rows; i++) {
        uint8_t *row = random_weights(type, n, r);
        if (fill >= 0 && di->block_elems > 1)
            for (size_t j = 0; j < bytes; j++)
                if (!is_f16_field(type, j % (size_t)di->block_bytes))
                    row[j] = (uint8_t)fill;
        memcpy(w + (size_t)i * row_bytes, row, bytes);
        free(row);
    }
    return w;
}

/* n_tok tokens of activations ldx apart, the padding set to NaN (must never be read as data). */
static inline float *gemm_acts(int64_t n, int64_t n_tok, size_t ldx, struct rng *r)
{
    float *x = malloc((size_t)n_tok * ldx * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < (size_t)n_tok * ldx; i++)
        x[i] = NAN;
    for (int64_t t = 0; t < n_tok; t++) {
        float *xt = x + (size_t)t * ldx;
        random_activations(xt, n - n % KERN_QK, r);
        for (int64_t i = n - n % KERN_QK; i < n; i++)
            xt[i] = rng_uniform(r, -2.0f, 2.0f);
    }
    return x;
}

#endif
