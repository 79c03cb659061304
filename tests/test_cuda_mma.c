/* The tensor-core kernel's operand plumbing, checked on the CPU. mma.sync.m16n8k16 (bf16 inputs,
 * f32 accumulators) is emulated from the PTX ISA's fragment tables, written out independently
 * in kernels/cuda/emu/mma_ref.h (docs/CUDA_NOTES.md §2.1). The kernel's helpers
 * (kernels/cuda/cuda_mma.h: which tile elements a lane loads, where its results go) then drive
 * the emulated instruction over a block tile exactly as k_matmul_bf16 does, and the result must
 * equal a plain product of the same bf16 values. Wrong fragment indices (a swapped half, a
 * transposed B) give different numbers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_mma.h"
#include "kernels/cuda/emu/mma_ref.h"

#define BM 64
#define BN 64
#define BK 32
#define LD (BK + 8)

/* One k0 step of k_matmul_bf16's block, as its warps run it: 4 warps x 16 tokens, 8 n8 tiles
 * each, two k16 halves. acc[warp][lane][j][i] as in the kernel. */
static void block_step(const uint16_t *as, const uint16_t *bs, float acc[4][32][8][4])
{
    for (int warp = 0; warp < 4; warp++)
        for (int ks = 0; ks < BK; ks += 16)
            for (int j = 0; j < 8; j++) {
                uint32_t a[32][4], b[32][2];
                float c[32][4];
                for (int lane = 0; lane < 32; lane++) {
                    kcu_frag_a(as, LD, warp * 16, ks, lane, a[lane]);
                    kcu_frag_b(bs, LD, j * 8, ks, lane, b[lane]);
                    memcpy(c[lane], acc[warp][lane][j], sizeof(c[lane]));
                }
                kcu_mma_ref((const uint32_t(*)[4])a, (const uint32_t(*)[2])b, c);
                for (int lane = 0; lane < 32; lane++)
                    memcpy(acc[warp][lane][j], c[lane], sizeof(c[lane]));
            }
}

static uint64_t s_rng = 99;

static float rnd(void)
{
    s_rng = s_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(s_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* A 64-token x 64-row x 96-k product through the block's steps, against a double-precision
 * product of the same bf16 values (f32 accumulation: relative 1e-5 of the magnitudes). */
static void test_block_tile(void **state)
{
    (void)state;
    enum { K = 96 };
    static uint16_t x[BM][K], w[BN][K];
    for (int m = 0; m < BM; m++)
        for (int k = 0; k < K; k++)
            x[m][k] = kern_f32_to_bf16(rnd());
    for (int n = 0; n < BN; n++)
        for (int k = 0; k < K; k++)
            w[n][k] = kern_f32_to_bf16(rnd());
    static float acc[4][32][8][4];
    memset(acc, 0, sizeof(acc));
    static uint16_t as[BM * LD], bs[BN * LD];
    for (int k0 = 0; k0 < K; k0 += BK) {
        memset(as, 0xFF, sizeof(as)); /* the pitch's padding must never be read: NaN if it is */
        memset(bs, 0xFF, sizeof(bs));
        for (int m = 0; m < BM; m++)
            memcpy(as + m * LD, &x[m][k0], BK * sizeof(uint16_t));
        for (int n = 0; n < BN; n++)
            memcpy(bs + n * LD, &w[n][k0], BK * sizeof(uint16_t));
        block_step(as, bs, acc);
    }
    int seen[BM][BN] = {{0}}, bad = 0;
    for (int warp = 0; warp < 4; warp++)
        for (int lane = 0; lane < 32; lane++)
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 4; i++) {
                    int r, c;
                    kcu_frag_c(lane, i, &r, &c);
                    const int m = warp * 16 + r, n = j * 8 + c;
                    assert_true(m < BM && n < BN);
                    seen[m][n]++;
                    double want = 0, mag = 0;
                    for (int k = 0; k < K; k++) {
                        const double p =
                            (double)kern_bf16_to_f32(x[m][k]) * kern_bf16_to_f32(w[n][k]);
                        want += p;
                        mag += fabs(p);
                    }
                    const float got = acc[warp][lane][j][i];
                    if (!(fabs(got - want) <= 1e-5 * mag + 1e-7)) {
                        if (bad++ < 5)
                            fprintf(stderr, "  y[%d][%d] = %g, want %g\n", m, n, (double)got, want);
                    }
                }
    assert_int_equal(bad, 0);
    for (int m = 0; m < BM; m++) /* every output written exactly once */
        for (int n = 0; n < BN; n++)
            assert_int_equal(seen[m][n], 1);
}

/* The helpers read only a lane's own elements: each A element is loaded by exactly one lane
 * and register half of a warp, each B element likewise (a 16 x 16 and a 16 x 8 tile). */
static void test_fragments_cover_tiles(void **state)
{
    (void)state;
    uint16_t a[16 * 16], b[8 * 16];
    for (int i = 0; i < 16 * 16; i++)
        a[i] = (uint16_t)i;
    for (int i = 0; i < 8 * 16; i++)
        b[i] = (uint16_t)(1000 + i);
    int na[16 * 16] = {0}, nb[8 * 16] = {0};
    for (int lane = 0; lane < 32; lane++) {
        uint32_t fa[4], fb[2];
        kcu_frag_a(a, 16, 0, 0, lane, fa);
        kcu_frag_b(b, 16, 0, 0, lane, fb);
        for (int p = 0; p < 4; p++) {
            na[fa[p] & 0xFFFF]++;
            na[fa[p] >> 16]++;
        }
        for (int p = 0; p < 2; p++) {
            nb[(fb[p] & 0xFFFF) - 1000]++;
            nb[(fb[p] >> 16) - 1000]++;
        }
    }
    for (int i = 0; i < 16 * 16; i++)
        assert_int_equal(na[i], 1);
    for (int i = 0; i < 8 * 16; i++)
        assert_int_equal(nb[i], 1);
}

/* kcu_frag_a_rows (A's rows read straight from global memory) is kcu_frag_a of the same
 * rows, with zeros for rows past the batch and k past the row's end. */
static void test_fragment_rows(void **state)
{
    (void)state;
    enum { N = 96, ROWS = 11 }; /* 11 tokens: rows 11..15 of the 16 are past the batch */
    uint16_t x[ROWS * N], tile[16 * 112];
    for (int i = 0; i < ROWS * N; i++)
        x[i] = (uint16_t)(1 + i);
    for (int r = 0; r < 16; r++) /* the tile kcu_frag_a reads: 112 k, the last 16 past N */
        for (int k = 0; k < 112; k++)
            tile[r * 112 + k] = r < ROWS && k < N ? x[r * N + k] : 0;
    for (int ks = 0; ks < 112; ks += 16)
        for (int lane = 0; lane < 32; lane++) {
            const int g = lane / 4;
            uint32_t want[4], got[4];
            kcu_frag_a(tile, 112, 0, ks, lane, want);
            kcu_frag_a_rows(g < ROWS ? x + g * N : NULL, g + 8 < ROWS ? x + (g + 8) * N : NULL, N,
                            ks, lane, got);
            for (int p = 0; p < 4; p++)
                assert_int_equal(got[p], want[p]);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fragments_cover_tiles),
        cmocka_unit_test(test_fragment_rows),
        cmocka_unit_test(test_block_tile),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
