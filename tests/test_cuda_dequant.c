/* The CUDA kernels' dequantization (kernels/cuda/cuda_dequant.h), compiled here on the CPU from
 * the same text nvcc compiles, against the scalar reference bit for bit: every supported type,
 * random rows with random scales, every 32-element unit of a row; plus special scale values
 * (subnormal, negative zero, inf, NaN halves). So the weights a GPU reads are decoded right
 * before any GPU runs them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_dequant.h"
#include "tests/test_rand.h"

static const uint32_t types[] = {DTYPE_F32,  DTYPE_F16,  DTYPE_BF16, DTYPE_Q4_0, DTYPE_Q4_1,
                                 DTYPE_Q5_0, DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q6_K};

/* Row `row` (n elements) through kcu_dequant32 unit by unit vs kern_ref_dequant_row; returns
 * the number of differing elements (bitwise). */
static int compare_row(uint32_t type, const uint8_t *row, int64_t n)
{
    float *want = malloc(sizeof(float) * (size_t)n), got[32];
    assert_non_null(want);
    kern_ref_dequant_row(type, row, want, n);
    int bad = 0;
    for (int64_t j = 0; j < n / 32; j++) {
        kcu_dequant32(type, row, j, got);
        for (int i = 0; i < 32; i++)
            if (memcmp(&got[i], &want[j * 32 + i], sizeof(float))) {
                if (bad < 5)
                    fprintf(stderr, "  %s element %lld: %a, reference %a\n",
                            dtype_get(type)->name, (long long)(j * 32 + i), (double)got[i],
                            (double)want[j * 32 + i]);
                bad++;
            }
    }
    free(want);
    return bad;
}

static void test_random_rows(void **state)
{
    (void)state;
    struct rng r = {2026};
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        assert_true(kcu_type_ok(types[k]));
        for (int rep = 0; rep < 20; rep++) {
            const int64_t n = dtype_get(types[k])->block_elems == 256 ? 256 * (1 + rep % 3)
                                                                      : 32 * (1 + rep % 7);
            uint8_t *row = random_weights(types[k], n, &r);
            assert_int_equal(compare_row(types[k], row, n), 0);
            free(row);
        }
    }
    assert_false(kcu_type_ok(7)); /* Q5_1: not read */
}

/* Every half-float bit pattern as a scale (and as an F16 element) decodes as the reference. */
static void test_every_half(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++)
        if (memcmp(&(float){kcu_f16((uint16_t)h)}, &(float){kern_f16_to_f32((uint16_t)h)},
                   sizeof(float)))
            fail_msg("half 0x%04x: %a, reference %a", h, (double)kcu_f16((uint16_t)h),
                     (double)kern_f16_to_f32((uint16_t)h));
    struct rng r = {7};
    static const uint16_t special[] = {0x0000, 0x8000, 0x0001, 0x83ff, 0x7c00, 0xfc00, 0x7e01,
                                       0x3c00, 0x7bff};
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        const int bs = dtype_get(types[k])->block_bytes, be = dtype_get(types[k])->block_elems;
        if (be == 1)
            continue;
        for (size_t i = 0; i < sizeof(special) / sizeof(special[0]); i++) {
            uint8_t *row = random_weights(types[k], be, &r);
            /* the scale fields: d first, except Q6_K (d last); Q4_1/Q4_K also their min/dmin */
            const int at = types[k] == DTYPE_Q6_K ? bs - 2 : 0;
            memcpy(row + at, &special[i], 2);
            if (types[k] == DTYPE_Q4_1 || types[k] == DTYPE_Q4_K)
                memcpy(row + 2, &special[(i + 3) % 9], 2);
            assert_int_equal(compare_row(types[k], row, be), 0);
            free(row);
        }
    }
}

/* The 8-bit KV inverse scale matches the CPU's for edge maxima. */
static void test_kv_quant_inv(void **state)
{
    (void)state;
    static const float amax[] = {0.0f, 1e-45f, 1e-38f, 0.5f, 1.0f, 127.0f, 3e38f, 1.0f / 0.0f};
    for (size_t i = 0; i < sizeof(amax) / sizeof(amax[0]); i++)
        assert_memory_equal(&(float){kcu_kv_quant_inv(amax[i])},
                            &(float){kern_kv_quant_inv(amax[i])}, sizeof(float));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_rows),
        cmocka_unit_test(test_every_half),
        cmocka_unit_test(test_kv_quant_inv),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
