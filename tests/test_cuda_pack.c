/* The GPU's packed layout (kernels/cuda/cuda_pack.h), checked on the CPU from the same text
 * nvcc compiles: GGUF rows repacked as prepare repacks them and unpacked again as the kernels
 * decode them equal the CPU reference's dequantization bit for bit, for Q4_0, Q4_1, Q4_K, Q5_0,
 * Q6_K and Q8_0, random rows and special scale values, shapes with partial tiles and groups; the
 * padding is zero; a lane's words are in mma's B fragment order (kernels/cuda/cuda_mma.h); the
 * sizes are what the layout's comment says. */
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
#include "kernels/cuda/cuda_mma.h"
#include "kernels/cuda/cuda_pack.h"
#include "kernels/cuda/emu/mma_ref.h"
#include "tests/test_rand.h"

static const uint32_t types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q4_K,
                                 DTYPE_Q8_0, DTYPE_Q5_0, DTYPE_Q6_K};

/* ne1 random rows of ne0 (with `special` halves written into the scale fields of some blocks),
 * packed, unpacked unit by unit: the number of elements that differ from the reference. */
static int round_trip(uint32_t type, int64_t ne0, int64_t ne1, struct rng *r, int special)
{
    const struct dtype_info *di = dtype_get(type);
    const size_t row_bytes = (size_t)(ne0 / di->block_elems) * di->block_bytes;
    uint8_t *src = malloc(row_bytes * (size_t)ne1);
    assert_non_null(src);
    for (int64_t i = 0; i < ne1; i++) {
        uint8_t *row = random_weights(type, ne0, r);
        memcpy(src + (size_t)i * row_bytes, row, row_bytes);
        free(row);
    }
    static const uint16_t halves[] = {0x0000, 0x8000, 0x0001, 0x83ff, 0x7c00,
                                      0xfc00, 0x7e01, 0x3c00, 0x7bff};
    if (special) /* d first (Q6_K: last); Q4_1's m and Q4_K's dmin next */
        for (size_t b = 0; b < row_bytes * (size_t)ne1 / di->block_bytes; b++) {
            const size_t at = type == DTYPE_Q6_K ? (size_t)di->block_bytes - 2 : 0;
            memcpy(src + b * di->block_bytes + at, &halves[b % 9], 2);
            if (type == DTYPE_Q4_1 || type == DTYPE_Q4_K)
                memcpy(src + b * di->block_bytes + 2, &halves[(b + 4) % 9], 2);
        }
    const size_t bytes = kcu_p4_bytes(type, ne0, ne1);
    uint8_t *p = malloc(bytes);
    assert_non_null(p);
    memset(p, 0xA5, bytes); /* pack must write every byte */
    kcu_p4_pack(type, src, row_bytes, ne0, ne1, p);
    float *want = malloc(sizeof(float) * (size_t)ne0), got[32];
    assert_non_null(want);
    int bad = 0;
    for (int64_t i = 0; i < ne1; i++) {
        kern_ref_dequant_row(type, src + (size_t)i * row_bytes, want, ne0);
        for (int64_t u = 0; u < ne0 / 32; u++) {
            kcu_p4_unit(type, p, kcu_p4_qbytes(type, ne0, ne1), kcu_p4_sbase(type, ne0, ne1), ne0,
                        i, u, got);
            for (int e = 0; e < 32; e++)
                if (memcmp(&got[e], &want[u * 32 + e], sizeof(float)) && bad++ < 5)
                    fprintf(stderr, "  %s %lldx%lld row %lld element %lld: %a, reference %a\n",
                            di->name, (long long)ne0, (long long)ne1, (long long)i,
                            (long long)(u * 32 + e), (double)got[e], (double)want[u * 32 + e]);
        }
    }
    /* padding: units past the row's end and rows past the last are zero in both planes */
    const int64_t groups = kcu_p4_groups(ne0);
    for (int64_t i = 0; i < kcu_p4_tiles(ne1) * 8; i++)
        for (int64_t u = 0; u < groups * 4; u++) {
            if (i < ne1 && u < ne0 / 32)
                continue;
            for (int t = 0; t < 4; t++)
                for (int k = 0; k < 4 * kcu_p4_words(type); k++)
                    if (p[kcu_p4_qoff(type, groups, i, u, t) + (size_t)k] != 0)
                        bad++;
            for (int t = 0; t < 4; t++) /* the unit's high bits (whole bytes: hb bytes a unit) */
                for (int k = 0; k < kcu_p4_hbits(type); k++)
                    if (p[kcu_p4_qbytes(type, ne0, ne1) + kcu_p4_hoff(type, groups, i, u / 4, t) +
                          (size_t)(u % 4) * (size_t)kcu_p4_hbits(type) + (size_t)k] != 0)
                        bad++;
            if (i >= ne1)
                for (int k = 0; k < kcu_p4_rec(type); k++)
                    if (p[kcu_p4_sbase(type, ne0, ne1) + kcu_p4_soff(type, groups, i, u / 4) +
                          (size_t)k] != 0)
                        bad++;
        }
    free(want);
    free(p);
    free(src);
    return bad;
}

static void test_round_trip(void **state)
{
    (void)state;
    struct rng r = {2027};
    static const int64_t rows[] = {1, 7, 8, 13, 40};
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        assert_true(kcu_p4_type(types[k]));
        const int qk = dtype_get(types[k])->block_elems == 256;
        static const int64_t cols32[] = {32, 96, 128, 160, 576}, cols256[] = {256, 512, 768};
        const int64_t *cols = qk ? cols256 : cols32;
        const size_t nc = qk ? 3 : 5;
        for (size_t c = 0; c < nc; c++)
            for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
                for (int special = 0; special < 2; special++)
                    assert_int_equal(round_trip(types[k], cols[c], rows[i], &r, special), 0);
    }
    assert_false(kcu_p4_type(DTYPE_F16));
    assert_false(kcu_p4_type(DTYPE_F32));
}

/* Lane l = 4g + t's word of a unit, nibbles 4h..4h+3, are the k a B fragment of mma.sync m16n8k16
 * for k 16h..16h+15 takes from row g (kcu_frag_b on a dense tile whose entries are their k). */
static void test_fragment_order(void **state)
{
    (void)state;
    uint16_t tile[8 * 32];
    for (int n = 0; n < 8; n++)
        for (int k = 0; k < 32; k++)
            tile[n * 32 + k] = (uint16_t)(n << 8 | k);
    for (int lane = 0; lane < 32; lane++)
        for (int h = 0; h < 2; h++) {
            uint32_t f[2];
            kcu_frag_b(tile, 32, 0, 16 * h, lane, f);
            for (int i = 0; i < 4; i++) {
                const uint16_t want = (uint16_t)(f[i / 2] >> (16 * (i % 2)));
                const int k = kcu_p4_k(lane % 4, 4 * h + i);
                assert_int_equal(want, (lane / 4) << 8 | k);
            }
        }
    /* and the 8 nibbles of the 4 lanes of a row cover the unit's 32 k once each */
    int seen[32] = {0};
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < 8; i++)
            seen[kcu_p4_k(t, i)]++;
    for (int k = 0; k < 32; k++)
        assert_int_equal(seen[k], 1);
}

/* The q8 mode's byte order (kcu_q8_pos) against the int8 mma's fragment table (PTX ISA, "Matrix
 * Fragments for mma.m16n8k32"; mma_ref.h): the B register p of lane t holds k 4t + 16p + e in
 * byte e, so the quantized input at that byte must be the element the lane's weight value
 * i = 4p + e stands for, kcu_p4_k(t, i), and every element has one byte. */
static void test_q8_order(void **state)
{
    (void)state;
    int seen[32] = {0};
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < 8; i++) {
            const int k = kcu_p4_k(t, i);
            assert_int_equal(kcu_q8_pos(k), 4 * t + 16 * (i / 4) + i % 4);
            seen[kcu_q8_pos(k)]++;
        }
    for (int p = 0; p < 32; p++)
        assert_int_equal(seen[p], 1);
    /* and through the emulated instruction (mma_ref.h, the PTX table): A from 16 weight rows'
     * values as k_p4_q8 takes them (registers 0, 1: values 0..3 of rows g, g + 8; 2, 3: values
     * 4..7), B from 8 token rows stored in kcu_q8_pos order (one word each), gives the plain
     * integer products */
    int8_t W[16][32], X[8][32], xs[8][32];
    struct rng r = {5};
    for (int m = 0; m < 16; m++)
        for (int k = 0; k < 32; k++)
            W[m][k] = (int8_t)((int)(rng_u64(&r) % 255) - 127);
    for (int n = 0; n < 8; n++)
        for (int k = 0; k < 32; k++) {
            X[n][k] = (int8_t)((int)(rng_u64(&r) % 255) - 127);
            xs[n][kcu_q8_pos(k)] = X[n][k];
        }
    uint32_t a[32][4], b[32][2];
    int32_t c[32][4];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane / 4, t = lane % 4;
        for (int p = 0; p < 4; p++) {
            a[lane][p] = 0;
            for (int e = 0; e < 4; e++)
                a[lane][p] |= (uint32_t)(uint8_t)W[g + 8 * (p % 2)][kcu_p4_k(t, 4 * (p / 2) + e)]
                              << (8 * e);
        }
        for (int p = 0; p < 2; p++)
            memcpy(&b[lane][p], &xs[g][16 * p + 4 * t], 4); /* little-endian, as the GPU */
        memset(c[lane], 0, sizeof(c[lane]));
    }
    kcu_mma_ref_s8((const uint32_t(*)[4])a, (const uint32_t(*)[2])b, c);
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            const int m = lane / 4 + 8 * (i / 2), n = 2 * (lane % 4) + i % 2;
            int32_t want = 0;
            for (int k = 0; k < 32; k++)
                want += W[m][k] * X[n][k];
            assert_int_equal(c[lane][i], want);
        }
    /* the integer values the int8 mma multiplies: a weight is a * this (less b) */
    assert_int_equal(kcu_p4_int(KCU_Q4_0, 0), -8);
    assert_int_equal(kcu_p4_int(KCU_Q5_0, 31), 15);
    assert_int_equal(kcu_p4_int(KCU_Q6_K, 0), -32);
    assert_int_equal(kcu_p4_int(KCU_Q4_1, 15), 15);
    assert_int_equal(kcu_p4_int(KCU_Q8_0, -128), -128);
}

/* Bits per weight at a large shape: Q4_0 4.5, Q4_1 5 and Q8_0 8.5 as GGUF, Q4_K 4.75; a (tile,
 * group) is the 512 bytes (Q8_0: 1024) a warp loads. */
static void test_sizes(void **state)
{
    (void)state;
    const int64_t ne0 = 4096, ne1 = 4096;
    const double w = (double)ne0 * (double)ne1;
    assert_true(8.0 * (double)kcu_p4_bytes(DTYPE_Q4_0, ne0, ne1) / w == 4.5);
    assert_true(8.0 * (double)kcu_p4_bytes(DTYPE_Q4_1, ne0, ne1) / w == 5.0);
    assert_true(8.0 * (double)kcu_p4_bytes(DTYPE_Q4_K, ne0, ne1) / w == 4.75);
    assert_true(8.0 * (double)kcu_p4_bytes(DTYPE_Q8_0, ne0, ne1) / w == 8.5);
    assert_true(8.0 * (double)kcu_p4_bytes(DTYPE_Q5_0, ne0, ne1) / w == 5.5);
    assert_true(8.0 * (double)kcu_p4_bytes(DTYPE_Q6_K, ne0, ne1) / w == 6.75);
    assert_int_equal(kcu_p4_qbytes(DTYPE_Q4_0, ne0, ne1), (size_t)(w / 2));
    assert_int_equal(kcu_p4_qbytes(DTYPE_Q8_0, ne0, ne1), (size_t)w);
    assert_int_equal(KCU_P4_TILE, 512);
    /* lane l of (tile, group) at l * 16 W bytes, the W words of units 0..3 in turn */
    const size_t g4 = (size_t)kcu_p4_groups(ne0);
    assert_int_equal(kcu_p4_qoff(DTYPE_Q4_0, (int64_t)g4, 8 * 3 + 5, 4 * 7 + 2, 1),
                     ((3 * g4 + 7) * 32 + 5 * 4 + 1) * 16 + 2 * 4);
    assert_int_equal(kcu_p4_qoff(DTYPE_Q8_0, (int64_t)g4, 8 * 3 + 5, 4 * 7 + 2, 1),
                     ((3 * g4 + 7) * 32 + 5 * 4 + 1) * 32 + 2 * 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_fragment_order),
        cmocka_unit_test(test_q8_order),
        cmocka_unit_test(test_sizes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
