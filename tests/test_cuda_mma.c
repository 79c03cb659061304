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
                kcu_mma_ref((const uint32_t(*)[4])a, (const uint32_t(*)[2])b, c, 0);
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

/* ldmatrix.x4 (as mma_ref.h emulates it from the PTX ISA) pointed where kcu_ldsm_a says returns
 * kcu_frag_a's registers, for tiles at every row and k offset a kernel uses; .trans returns the
 * transposed matrices. */
static void test_ldmatrix_a(void **state)
{
    (void)state;
    enum { LDA = 136 }; /* k_p4_mma's pitch */
    static uint16_t a[64 * LDA];
    for (int i = 0; i < 64 * LDA; i++)
        a[i] = (uint16_t)(i * 7 + 3);
    for (int r0 = 0; r0 < 64; r0 += 16)
        for (int ks = 0; ks < 128; ks += 16) {
            const uint16_t *addr[32];
            uint32_t got[32][4];
            for (int lane = 0; lane < 32; lane++)
                addr[lane] = kcu_ldsm_a(a, LDA, r0, ks, lane);
            kcu_ldmatrix_ref(addr, 4, 0, got);
            for (int lane = 0; lane < 32; lane++) {
                uint32_t want[4];
                kcu_frag_a(a, LDA, r0, ks, lane, want);
                for (int p = 0; p < 4; p++)
                    assert_int_equal(got[lane][p], want[p]);
            }
        }
    /* B stored k-major (attention's keys, channel-major, and values, position-major) read by
     * ldmatrix.x4.trans where kcu_ldsm_bt says: kcu_frag_b's registers of the same B stored
     * n-major, for two n8 tiles at each k16 */
    enum { KB = 48, NB = 32, LDK = 40, LDN = 56 };
    static uint16_t bk[KB * LDK], bn[NB * LDN];
    for (int k = 0; k < KB; k++)
        for (int n = 0; n < NB; n++)
            bk[k * LDK + n] = bn[n * LDN + k] = (uint16_t)(k * 131 + n * 7 + 1);
    for (int ks = 0; ks < KB; ks += 16)
        for (int n0 = 0; n0 < NB; n0 += 16) {
            const uint16_t *addr[32];
            uint32_t got[32][4];
            for (int lane = 0; lane < 32; lane++)
                addr[lane] = kcu_ldsm_bt(bk, LDK, n0, ks, lane);
            kcu_ldmatrix_ref(addr, 4, 1, got);
            for (int lane = 0; lane < 32; lane++) {
                uint32_t w0[2], w1[2];
                kcu_frag_b(bn, LDN, n0, ks, lane, w0);
                kcu_frag_b(bn, LDN, n0 + 8, ks, lane, w1);
                assert_int_equal(got[lane][0], w0[0]);
                assert_int_equal(got[lane][1], w0[1]);
                assert_int_equal(got[lane][2], w1[0]);
                assert_int_equal(got[lane][3], w1[1]);
            }
        }
    /* .trans: an 8 x 8 matrix m(i, j) = 8 i + j read transposed gives lane l the pair
     * (m(2 (l % 4), l / 4), m(2 (l % 4) + 1, l / 4)) */
    uint16_t m[8][8];
    const uint16_t *rows[32];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++)
            m[i][j] = (uint16_t)(8 * i + j);
    for (int lane = 0; lane < 32; lane++)
        rows[lane] = m[lane % 8];
    uint32_t t[32][4];
    kcu_ldmatrix_ref(rows, 1, 1, t);
    for (int lane = 0; lane < 32; lane++) {
        const uint32_t lo = (uint32_t)(8 * (2 * (lane % 4)) + lane / 4);
        assert_int_equal(t[lane][0], lo | (lo + 8) << 16);
    }
}

/* The emulator's f16 inputs (mma.sync .f16.f16, attention's): every half decoded as the CPU's
 * reference decodes it, and an f16 product of a row of halves with a column equal to the plain
 * sum (the values chosen so that every partial sum is exact in f32). */
static void test_f16_inputs(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        const float want = kern_f16_to_f32((uint16_t)h), lo = kcu_ref_f16(h, 0),
                    hi = kcu_ref_f16(h << 16, 1);
        if (isnan(want)) {
            assert_true(isnan(lo) && isnan(hi));
            continue;
        }
        if (memcmp(&want, &lo, sizeof(want)) || memcmp(&want, &hi, sizeof(want)))
            fail_msg("half 0x%04x: %g and %g, want %g", h, (double)lo, (double)hi, (double)want);
    }
    uint32_t a[32][4], b[32][2];
    float c[32][4];
    memset(c, 0, sizeof(c));
    /* A all 1.5 (0x3E00), B column n all n + 1 (halves): D(m, n) = 16 * 1.5 * (n + 1) */
    for (int lane = 0; lane < 32; lane++) {
        for (int p = 0; p < 4; p++)
            a[lane][p] = 0x3E003E00u;
        const uint32_t v = kern_f32_to_f16((float)(lane / 4 + 1));
        b[lane][0] = b[lane][1] = v | v << 16;
    }
    kcu_mma_ref((const uint32_t(*)[4])a, (const uint32_t(*)[2])b, c, 1);
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            int row, col;
            kcu_frag_c(lane, i, &row, &col);
            assert_true(c[lane][i] == 24.0f * (float)(col + 1));
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fragments_cover_tiles),
        cmocka_unit_test(test_fragment_rows),
        cmocka_unit_test(test_block_tile),
        cmocka_unit_test(test_f16_inputs),
        cmocka_unit_test(test_ldmatrix_a),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
