/* Deterministic random test data shared by the kernel and backend-op tests: a splitmix64
 * generator and weight rows of every GGUF type with random but valid contents. Include after
 * cmocka.h and kernels/cpu/cpu_kernels.h. */
#ifndef TESTS_TEST_RAND_H
#define TESTS_TEST_RAND_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"

/* splitmix64: the test's own deterministic generator. */
struct rng {
    uint64_t s; /* state */
};

static inline uint64_t rng_u64(struct rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi). */
static inline float rng_uniform(struct rng *r, float lo, float hi)
{
    return lo + (hi - lo) * (float)((double)(rng_u64(r) >> 11) * 0x1p-53);
}

static inline void put_f16(uint8_t *p, float v)
{
    uint16_t h = kern_f32_to_f16(v);
    memcpy(p, &h, sizeof h);
}

/* A row of n weights of `type` with random but valid contents: random fp16 scales in a sane
 * range, random quant bytes (every bit pattern of the quant fields is a valid encoding). Caller
 * frees. */
static inline uint8_t *random_weights(uint32_t type, int64_t n, struct rng *r)
{
    const struct dtype_info *di = dtype_get(type);
    assert_non_null(di);
    size_t bytes = dtype_row_bytes(type, n);
    assert_true(bytes > 0);
    uint8_t *w = malloc(bytes);
    assert_non_null(w);
    for (size_t i = 0; i < bytes; i++)
        w[i] = (uint8_t)rng_u64(r);

    int64_t nb = n / di->block_elems;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * di->block_bytes;
        float sign = rng_u64(r) & 1 ? 1.0f : -1.0f;
        switch (type) {
        case DTYPE_F32: {
            float v = rng_uniform(r, -1.0f, 1.0f);
            memcpy(blk, &v, sizeof v);
            break;
        }
        case DTYPE_F16:
            put_f16(blk, rng_uniform(r, -1.0f, 1.0f));
            break;
        case DTYPE_BF16: {
            uint16_t h = kern_f32_to_bf16(rng_uniform(r, -1.0f, 1.0f));
            memcpy(blk, &h, sizeof h);
            break;
        }
        case DTYPE_Q4_0:
        case DTYPE_Q5_0:
        case DTYPE_Q8_0:
            put_f16(blk, sign * rng_uniform(r, 0.001f, 0.1f));
            break;
        case DTYPE_Q4_1: { /* d > 0; m about -8d, as a real quantizer would produce */
            float d = rng_uniform(r, 0.001f, 0.1f);
            put_f16(blk, d);
            put_f16(blk + 2, -d * rng_uniform(r, 0.0f, 15.0f));
            break;
        }
        case DTYPE_Q4_K:
            put_f16(blk, rng_uniform(r, 0.0001f, 0.01f));
            put_f16(blk + 2, rng_uniform(r, 0.0001f, 0.01f));
            break;
        case DTYPE_Q6_K:
            put_f16(blk + 208, sign * rng_uniform(r, 0.0001f, 0.01f));
            break;
        default:
            fail_msg("no generator for type %u", (unsigned)type);
        }
    }
    return w;
}

#endif
