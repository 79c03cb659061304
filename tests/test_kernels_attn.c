/* Unit tests for kernels/cpu attention and row operations: attention over the paged KV cache
 * (f16 and 8-bit) against a naive float64 version, the 8-bit KV quantizer, the backend's deferred
 * KV store; RMS norm, SwiGLU and RoPE of every table against float64 formulas. */
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
#include "kernels/kernels.h"
#include "tests/test_kernels_util.h"
#include "tests/test_rand.h"

/* ---- attention over the paged KV cache (f16 and 8-bit) -------------------------------------- */

/* Element idx of a tile of pool (K or V) whose token is i, as stored (8-bit: quant times the
 * token's scale). */
static double kv_at(const struct kern_attn *a, const void *pool, size_t tile, size_t idx, int i)
{
    const int D = a->head_dim, B = a->block_size;
    const uint8_t *t = (const uint8_t *)pool + tile * KERN_KV_TILE_BYTES(a->kv.dtype, B, D);
    if (a->kv.dtype == KERN_KV_F16)
        return kern_f16_to_f32(((const uint16_t *)t)[idx]);
    float sc;
    memcpy(&sc, t + (size_t)D * B + 4 * (size_t)i, sizeof sc);
    return (double)((const int8_t *)t)[idx] * sc;
}

/* Key / value channel c of token i of a tile: keys channel-major, values token-major. */
static double kv_key(const struct kern_attn *a, size_t tile, int c, int i)
{
    return kv_at(a, a->kv.k, tile, (size_t)c * a->block_size + i, i);
}

static double kv_value(const struct kern_attn *a, size_t tile, int c, int i)
{
    return kv_at(a, a->kv.v, tile, (size_t)i * a->head_dim + c, i);
}

/* Straightforward float64 attention over the layout of struct kern_kv_layer: all scores, max,
 * exp, normalize, weighted sum. Independent of the kernels' run/online-softmax structure. */
static void naive_attention(const struct kern_attn *a, int t, double *out)
{
    const int D = a->head_dim, B = a->block_size, G = a->n_head / a->n_kv_head;
    const int n = a->pos[t] + 1;
    double *sc = malloc(sizeof(double) * (size_t)n);
    for (int h = 0; h < a->n_head; h++) {
        const int g = h / G;
        const float *q = a->q + ((size_t)t * a->n_head + h) * D;
        double mx = -INFINITY, sum = 0;
        for (int p = 0; p < n; p++) {
            size_t tile = (size_t)kern_block_row(&a->bt, t)[p / B] * a->n_kv_head + g;
            double d = 0;
            for (int c = 0; c < D; c++)
                d += (double)q[c] * kv_key(a, tile, c, p % B);
            sc[p] = d * a->scale;
            mx = sc[p] > mx ? sc[p] : mx;
        }
        for (int p = 0; p < n; p++)
            sum += (sc[p] = exp(sc[p] - mx));
        for (int c = 0; c < D; c++) {
            double acc = 0;
            for (int p = 0; p < n; p++) {
                size_t tile = (size_t)kern_block_row(&a->bt, t)[p / B] * a->n_kv_head + g;
                acc += sc[p] * kv_value(a, tile, c, p % B);
            }
            out[h * D + c] = acc / sum;
        }
    }
    free(sc);
}

/* Every table's kv_quant_q8 gives the reference's bytes and scale for x[0..n). */
static void check_kv_quant_tables(const float *x, int n, const int8_t *want, float want_sc)
{
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        if (!f)
            continue;
        int8_t q[64];
        float sc = -1.0f;
        memset(q, 0x55, sizeof q);
        f->kv_quant_q8(x, n, q, &sc);
        if (memcmp(q, want, (size_t)n) != 0 || memcmp(&sc, &want_sc, sizeof sc) != 0)
            fail_msg("%s kv_quant_q8 (n %d) differs from the reference", f->name, n);
        for (int i = n; i < 64; i++)
            assert_int_equal(q[i], 0x55); /* nothing written past n */
    }
}

/* kern_kv_quant_q8: the largest magnitude maps to +-127, every value within half a step of
 * its quant times the scale, zeros stay zero. */
static void check_kv_quant(void)
{
    struct rng r = {0x0A8};
    float x[64], sc;
    int8_t q[64];
    for (int it = 0; it < 200; it++) {
        int n = 1 + (int)(rng_u64(&r) % 64);
        float amp = it % 2 ? 1e-3f : 40.0f, amax = 0;
        for (int i = 0; i < n; i++) {
            x[i] = rng_uniform(&r, -amp, amp);
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        }
        kern_kv_quant_q8(x, n, q, &sc);
        assert_true(sc == amax / 127.0f);
        check_kv_quant_tables(x, n, q, sc);
        int top = 0;
        for (int i = 0; i < n; i++) {
            if (!(fabs((double)x[i] - (double)q[i] * sc) <= 0.5001 * sc))
                fail_msg("kv quant: %g stored as %d x %g", (double)x[i], q[i], (double)sc);
            top |= q[i] == 127 || q[i] == -127;
        }
        assert_true(top);
    }
    memset(x, 0, sizeof x);
    kern_kv_quant_q8(x, 64, q, &sc);
    assert_true(sc == 0.0f);
    for (int i = 0; i < 64; i++)
        assert_int_equal(q[i], 0);
    check_kv_quant_tables(x, 64, q, sc);
    /* x * id within half an ulp of a half-integer: the product rounded before the add (as the
     * reference does) and a fused multiply-add give different quants; every table must round
     * twice */
    const float tie[4] = {0x1.6ad5acp+0f, 0x1.bb76eep+0f, 0x1.56ad5cp+1f, 0x1.7efdfcp+1f};
    memset(x, 0, sizeof x);
    x[0] = 40.0f; /* id = 127 / 40 */
    memcpy(x + 1, tie, sizeof tie);
    kern_kv_quant_q8(x, 5, q, &sc);
    assert_int_equal(q[1], 4); /* 4.4999... rounded to 4.5, then to even */
    check_kv_quant_tables(x, 5, q, sc);
    /* a row so small that 127 / max|x| overflows: zeros with the tiny scale, every table */
    memset(x, 0, sizeof x);
    x[3] = 1e-38f;
    x[40] = -5e-39f;
    kern_kv_quant_q8(x, 64, q, &sc);
    assert_true(sc == 1e-38f / 127.0f);
    for (int i = 0; i < 64; i++)
        assert_int_equal(q[i], 0);
    check_kv_quant_tables(x, 64, q, sc);
    /* a NaN is skipped by the maximum and stored as 0, in every table */
    for (int i = 0; i < 64; i++)
        x[i] = (float)(i - 20) * 0.25f;
    x[7] = NAN;
    kern_kv_quant_q8(x, 64, q, &sc);
    assert_true(sc == 43.0f * 0.25f / 127.0f);
    assert_int_equal(q[7], 0);
    assert_int_equal(q[63], 127);
    for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
        const struct kern_cpu_fns *f = isa_fns(isa);
        int8_t q2[64];
        float sc2;
        if (!f)
            continue;
        f->kv_quant_q8(x, 64, q2, &sc2);
        assert_true(sc2 == sc);
        for (int i = 0; i < 64; i++)
            assert_int_equal(q2[i], q[i]);
    }
}

/* Random keys/values into a pool of n_tiles tiles: f16, or each token's row of one head
 * quantized by kern_kv_quant_q8 (the one quantizer the KV store uses). */
static void fill_kv_pool(struct kern_kv_layer *kv, int dtype, size_t n_tiles, int B, int D,
                         struct rng *r)
{
    const size_t tb = KERN_KV_TILE_BYTES(dtype, B, D);
    uint8_t *k = malloc(n_tiles * tb), *v = malloc(n_tiles * tb);
    float row[KERN_MAX_HEAD_DIM];
    int8_t q[KERN_MAX_HEAD_DIM];
    assert_true(k && v);
    for (size_t t = 0; t < n_tiles; t++)
        for (int i = 0; i < B; i++)
            for (int kvi = 0; kvi < 2; kvi++) {
                uint8_t *tile = (kvi ? v : k) + t * tb;
                for (int c = 0; c < D; c++)
                    row[c] = kvi ? rng_uniform(r, -1.0f, 1.0f) : rng_uniform(r, -2.0f, 2.0f);
                if (dtype == KERN_KV_F16) {
                    for (int c = 0; c < D; c++)
                        ((uint16_t *)tile)[kvi ? (size_t)i * D + c : (size_t)c * B + i] =
                            kern_f32_to_f16(row[c]);
                } else {
                    float sc;
                    kern_kv_quant_q8(row, D, q, &sc);
                    for (int c = 0; c < D; c++)
                        ((int8_t *)tile)[kvi ? (size_t)i * D + c : (size_t)c * B + i] = q[c];
                    memcpy(tile + (size_t)D * B + 4 * (size_t)i, &sc, sizeof sc);
                }
            }
    *kv = (struct kern_kv_layer){k, v, dtype};
}

/* Every table's attn_group against naive_attention, for several head shapes, block sizes
 * (multiples of 16 and not), sequence lengths (1 to past several blocks; partial runs), blocks
 * scattered in the pool, and both KV storage types. Scores are large enough that the softmax
 * is peaked, so the running-max rescale is exercised. */
static void test_attention_vs_naive(void **state)
{
    (void)state;
    static const struct {
        int n_head, n_kv_head, head_dim, block_size;
    } shapes[] = {{9, 3, 64, 16}, {8, 8, 64, 16}, {8, 1, 128, 32}, {6, 3, 64, 8},
                  {4, 2, 32, 16}, {3, 3, 10, 5},  {12, 4, 64, 48}};
    struct rng r = {0x51ED};
    check_kv_quant();
    for (int dtype = KERN_KV_F16; dtype <= KERN_KV_Q8; dtype++)
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int H = shapes[si].n_head, KV = shapes[si].n_kv_head, D = shapes[si].head_dim;
        const int B = shapes[si].block_size, n_blocks = 64, n_tok = 6;
        static const int lens[6] = {1, 2, 17, 33, 100, 257};
        struct kern_kv_layer kv;
        fill_kv_pool(&kv, dtype, (size_t)n_blocks * KV, B, D, &r);
        float *q = malloc(sizeof(float) * (size_t)n_tok * H * D);
        float *out = malloc(sizeof(float) * (size_t)n_tok * H * D);
        double *want = malloc(sizeof(double) * (size_t)H * D);
        for (int i = 0; i < n_tok * H * D; i++)
            q[i] = rng_uniform(&r, -1.5f, 1.5f);
        int32_t pos[6], tables[6][64];
        int32_t rows[6];
        for (int t = 0; t < n_tok; t++) {
            pos[t] = lens[t] - 1 < n_blocks * B - 1 ? lens[t] - 1 : n_blocks * B - 1;
            for (int b = 0; b < n_blocks; b++) /* a random permutation of the pool */
                tables[t][b] = b;
            for (int b = n_blocks - 1; b > 0; b--) {
                int j = (int)(rng_u64(&r) % (uint64_t)(b + 1));
                int32_t x = tables[t][b];
                tables[t][b] = tables[t][j];
                tables[t][j] = x;
            }
            rows[t] = t;
        }
        struct kern_attn a = {.n_tok = n_tok, .q = q, .out = out, .pos = pos,
                              .bt = {&tables[0][0], rows, 64},
                              .kv = kv, .block_size = B, .n_head = H, .n_kv_head = KV,
                              .head_dim = D, .scale = 1.0f / sqrtf((float)D) * 4.0f};
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            memset(out, 0xff, sizeof(float) * (size_t)n_tok * H * D); /* NaN: must be written */
            for (int t = 0; t < n_tok; t++) /* each call told the next one, as the backend does */
                for (int g = 0; g < KV; g++)
                    f->attn_group(&a, t, g, g + 1 < KV ? t : (t + 1 < n_tok ? t + 1 : -1),
                                  g + 1 < KV ? g + 1 : 0, t == 0 && g == 0);
            double worst = 0;
            for (int t = 0; t < n_tok; t++) {
                naive_attention(&a, t, want);
                for (int i = 0; i < H * D; i++) {
                    double d = fabs((double)out[(size_t)t * H * D + i] - want[i]);
                    if (!(d <= 2e-5))
                        fail_msg("%s %s shape %zu token %d (len %d) elem %d: %g vs %g", f->name,
                                 dtype ? "q8" : "f16", si, t, pos[t] + 1, i,
                                 (double)out[(size_t)t * H * D + i], want[i]);
                    worst = d > worst ? d : worst;
                }
            }
            print_message("attention %-12s %s H %2d KV %d D %3d B %2d: max |diff| %.2e\n",
                          f->name, dtype ? "q8 " : "f16", H, KV, D, B, worst);
        }
        free(kv.k);
        free(kv.v);
        free(q);
        free(out);
        free(want);
    }
}

/* ---- bf16 mode: attention on AMX tiles over a KERN_KV_BF16T pool ---------------------------- */

/* Word w of a KERN_KV_BF16T tile as a float. */
static double bf16t_at(const void *pool, size_t tile, int B, int D, size_t w)
{
    return kern_bf16_to_f32(((const uint16_t *)pool)[tile * (size_t)B * D + w]);
}

/* Float64 attention of row (token t, head h) from the bf16 values the tile kernel reads: q
 * rounded to bfloat16, keys and values as stored. */
static void naive_tiles(const struct kern_attn *a, int t, int h, double *out)
{
    const int D = a->head_dim, B = a->block_size, G = a->n_head / a->n_kv_head, g = h / G;
    const int32_t first = kern_attn_first(a, t), n = a->pos[t] + 1;
    const float *q = a->q + ((size_t)t * a->n_head + h) * D;
    double *sc = malloc(sizeof(double) * (size_t)n), mx = -INFINITY, sum = 0;
    for (int32_t p = first; p < n; p++) {
        const size_t tile = (size_t)kern_block_row(&a->bt, t)[p / B] * a->n_kv_head + g;
        const int i = p % B;
        double d = 0;
        for (int c = 0; c < D; c++)
            d += (double)kern_bf16_to_f32(kern_f32_to_bf16(q[c])) *
                 bf16t_at(a->kv.k, tile, B, D, ((size_t)(c / 2) * B + i) * 2 + c % 2);
        d *= a->scale;
        if (a->softcap > 0)
            d = a->softcap * tanh(d / a->softcap);
        sc[p] = d;
        mx = d > mx ? d : mx;
    }
    for (int c = 0; c < D; c++)
        out[c] = 0;
    for (int32_t p = first; p < n; p++) {
        const size_t tile = (size_t)kern_block_row(&a->bt, t)[p / B] * a->n_kv_head + g;
        const int i = p % B;
        const double w = exp(sc[p] - mx);
        sum += w;
        for (int c = 0; c < D; c++)
            out[c] += w * bf16t_at(a->kv.v, tile, B, D, ((size_t)(i / 2) * D + c) * 2 + i % 2);
    }
    for (int c = 0; c < D; c++)
        out[c] /= sum;
    free(sc);
}

/* The AMX table's attn_tiles: against float64 on the same bf16 values, for several head
 * shapes, block sizes, a sliding window and a softcap, over a pool whose unwritten slots hold
 * large stale values (a tile reads whole runs of 16 positions: those past a sequence's end
 * must not leak in; kv_store_tiles never stores NaN or infinities there);
 * and row by row bitwise the same whether a token is computed alone, with all the others in
 * one call, or in calls of random sizes (batch invariance). */
static void test_attention_tiles(void **state)
{
    (void)state;
    const struct kern_cpu_fns *f = isa_fns(KERN_ISA_AMX);
    if (!f || !f->attn_tiles) {
        print_message("attention tiles: this CPU has no AMX-BF16; not run\n");
        return;
    }
    static const struct {
        int n_head, n_kv_head, head_dim, block_size, window;
        float softcap;
    } shapes[] = {{9, 3, 64, 16, 0, 0},  {8, 1, 128, 32, 0, 0}, {4, 1, 256, 16, 40, 0},
                  {8, 8, 64, 64, 0, 30}, {6, 3, 32, 16, 0, 0},  {16, 2, 64, 48, 100, 0}};
    struct rng r = {0x711E5};
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int H = shapes[si].n_head, KV = shapes[si].n_kv_head, D = shapes[si].head_dim;
        const int B = shapes[si].block_size, G = H / KV, n_blocks = 24, len = 300, n_tok = 70;
        const size_t tw = (size_t)B * D, pool = (size_t)n_blocks * KV * tw;
        uint16_t *kp = malloc(2 * pool), *vp = malloc(2 * pool);
        for (size_t i = 0; i < pool; i++) /* stale values (finite: see below) where no token was */
            kp[i] = vp[i] = (uint16_t)(0x4000 + rng_u64(&r) % 0x3000); /* 2 .. 2^97 */
        int32_t table[24];
        for (int b = 0; b < n_blocks; b++)
            table[b] = b;
        for (int b = n_blocks - 1; b > 0; b--) {
            int j = (int)(rng_u64(&r) % (uint64_t)(b + 1));
            int32_t x = table[b];
            table[b] = table[j];
            table[j] = x;
        }
        float kr[256], vr[256];
        for (int p = 0; p < len; p++)
            for (int g = 0; g < KV; g++) {
                for (int c = 0; c < D; c++) {
                    kr[c] = rng_uniform(&r, -1.0f, 1.0f);
                    vr[c] = rng_uniform(&r, -1.0f, 1.0f);
                }
                const size_t tile = (size_t)table[p / B] * KV + g;
                f->kv_store_tiles(kr, vr, kp + tile * tw, vp + tile * tw, B, D, p % B);
            }
        /* the stored words are kern_f32_to_bf16 of what was given (spot check, last token) */
        {
            const int p = len - 1, g = KV - 1;
            const size_t tile = (size_t)table[p / B] * KV + g;
            for (int c = 0; c < D; c++) {
                assert_int_equal(kp[tile * tw + ((size_t)(c / 2) * B + p % B) * 2 + c % 2],
                                 kern_f32_to_bf16(kr[c]));
                assert_int_equal(vp[tile * tw + ((size_t)(p % B / 2) * D + c) * 2 + p % B % 2],
                                 kern_f32_to_bf16(vr[c]));
            }
        }
        { /* NaN and infinities are stored as 0, so no stale slot ever holds one */
            uint16_t kt[16 * 256], vt[16 * 256];
            kr[0] = NAN;
            kr[1] = INFINITY;
            vr[0] = -INFINITY;
            vr[D - 1] = 3.4e38f; /* finite, but rounds to bfloat16's infinity */
            f->kv_store_tiles(kr, vr, kt, vt, 16, D, 5);
            assert_int_equal(kt[(0 * 16 + 5) * 2 + 0], 0);
            assert_int_equal(kt[(0 * 16 + 5) * 2 + 1], 0);
            assert_int_equal(vt[((size_t)(5 / 2) * D + 0) * 2 + 1], 0);
            assert_int_equal(vt[((size_t)(5 / 2) * D + D - 1) * 2 + 1], 0);
            assert_int_equal(kt[(1 * 16 + 5) * 2 + 0], kern_f32_to_bf16(kr[2]));
        }
        float *q = malloc(sizeof(float) * (size_t)n_tok * H * D);
        float *out[3];
        for (int k = 0; k < 3; k++)
            out[k] = malloc(sizeof(float) * (size_t)n_tok * H * D);
        double want[256];
        int32_t pos[70], rows[70], toks[70];
        for (int t = 0; t < n_tok; t++) {
            pos[t] = len - n_tok + t; /* a chunk ending at the sequence's last position */
            rows[t] = 0;
            toks[t] = t;
        }
        pos[0] = 3; /* and two tokens far back: a block none of whose keys some rows read */
        pos[1] = 40;
        for (int i = 0; i < n_tok * H * D; i++)
            q[i] = rng_uniform(&r, -1.5f, 1.5f);
        struct kern_attn a = {.n_tok = n_tok,
                              .q = q,
                              .out = out[0],
                              .pos = pos,
                              .bt = {table, rows, 24},
                              .kv = {kp, vp, KERN_KV_BF16T},
                              .block_size = B,
                              .n_head = H,
                              .n_kv_head = KV,
                              .head_dim = D,
                              .scale = 1.0f / sqrtf((float)D) * 4.0f,
                              .window = shapes[si].window,
                              .softcap = shapes[si].softcap};
        void *ws = aligned_alloc(64, (KERN_ATTN_TILES_BYTES(D, len / 32 + 1) + 63) / 64 * 64);
        for (int k = 0; k < 3; k++) {
            a.out = out[k];
            memset(out[k], 0xff, sizeof(float) * (size_t)n_tok * H * D);
            for (int g = 0; g < KV; g++) {
                if (k == 0) /* all tokens in one call */
                    f->attn_tiles(&a, toks, n_tok, g, ws, NULL);
                else if (k == 1) /* one token a call, last first */
                    for (int t = n_tok - 1; t >= 0; t--)
                        f->attn_tiles(&a, toks + t, 1, g, ws, NULL);
                else /* calls of random sizes */
                    for (int t = 0; t < n_tok;) {
                        int m = 1 + (int)(rng_u64(&r) % 23);
                        m = m < n_tok - t ? m : n_tok - t;
                        f->attn_tiles(&a, toks + t, m, g, ws, NULL);
                        t += m;
                    }
            }
        }
        double worst = 0;
        for (int t = 0; t < n_tok; t++)
            for (int h = 0; h < H; h++) {
                const size_t o = ((size_t)t * H + h) * D;
                if (memcmp(out[0] + o, out[1] + o, sizeof(float) * D) ||
                    memcmp(out[0] + o, out[2] + o, sizeof(float) * D))
                    fail_msg("shape %zu token %d head %d: not the same bits alone and in a batch",
                             si, t, h);
                naive_tiles(&a, t, h, want);
                for (int c = 0; c < D; c++) {
                    const double d = fabs((double)out[0][o + c] - want[c]);
                    if (!(d <= 5e-3))
                        fail_msg("shape %zu token %d (pos %d) head %d ch %d: %g vs %g", si, t,
                                 pos[t], h, c, (double)out[0][o + c], want[c]);
                    worst = d > worst ? d : worst;
                }
            }
        print_message("attention tiles H %2d KV %d D %3d B %2d window %3d softcap %2.0f: max "
                      "|diff| %.2e\n",
                      H, KV, D, B, shapes[si].window, (double)shapes[si].softcap, worst);
        (void)G;
        free(ws);
        free(q);
        for (int k = 0; k < 3; k++)
            free(out[k]);
        free(kp);
        free(vp);
    }
}

/* The CPU backend's KV store deferred into the attention pass (kern_attn.store, kv_store's skip)
 * writes the same pool bytes and gives bitwise the same outputs as storing every token first:
 * a batch of 3 sequences (a 21-token prefill chunk starting mid-block, one decode token, a
 * 5-token chunk), each sequence's highest position deferred, both storage types, 2 threads. */
static void test_backend_deferred_kv_store(void **state)
{
    (void)state;
    enum { H = 9, KV = 3, D = 64, B = 16, NB = 24, N = 27 };
    struct rng r = {0xDEF};
    struct kern_backend *be;
    struct err_detail err = {0};
    struct kern_backend_opts ko = {.n_threads = 2};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    static const int seq_of[3] = {21, 1, 5}, start[3] = {37, 60, 3};
    int32_t pos[N], tables[3][8];
    int32_t rows[N];
    uint8_t last[N];
    for (int s = 0, t = 0; s < 3; s++) {
        for (int b = 0; b < 8; b++)
            tables[s][b] = s * 8 + (b * 5) % 8; /* the sequence's own 8 blocks, shuffled */
        for (int i = 0; i < seq_of[s]; i++, t++) {
            pos[t] = start[s] + i;
            rows[t] = s;
            last[t] = i == seq_of[s] - 1;
        }
    }
    float *q = malloc(sizeof(float) * N * H * D), *kk = malloc(sizeof(float) * N * KV * D);
    float *vv = malloc(sizeof(float) * N * KV * D);
    float *out0 = malloc(sizeof(float) * N * H * D), *out1 = malloc(sizeof(float) * N * H * D);
    assert_true(q && kk && vv && out0 && out1);
    for (int i = 0; i < N * H * D; i++)
        q[i] = rng_uniform(&r, -1.5f, 1.5f);
    for (int i = 0; i < N * KV * D; i++) {
        kk[i] = rng_uniform(&r, -2.0f, 2.0f);
        vv[i] = rng_uniform(&r, -1.0f, 1.0f);
    }
    for (int dtype = KERN_KV_F16; dtype <= KERN_KV_Q8; dtype++) {
        const size_t bytes = (size_t)NB * KV * KERN_KV_TILE_BYTES(dtype, B, D);
        struct kern_kv_layer kv[2];
        fill_kv_pool(&kv[0], dtype, (size_t)NB * KV, B, D, &r); /* earlier positions' KV */
        fill_kv_pool(&kv[1], dtype, (size_t)NB * KV, B, D, &r);
        memcpy(kv[1].k, kv[0].k, bytes);
        memcpy(kv[1].v, kv[0].v, bytes);
        for (int run = 0; run < 2; run++) {
            const uint8_t *defer = run ? last : NULL;
            float *out = run ? out1 : out0;
            memset(out, 0xff, sizeof(float) * N * H * D);
            const struct kern_block_table bt = {&tables[0][0], rows, 8};
            be->ops->kv_store(be, kv[run], &bt, pos, B, KV, D, kk, vv, N, defer);
            struct kern_attn a = {.n_tok = N, .q = q, .out = out, .pos = pos, .bt = bt,
                                  .kv = kv[run], .block_size = B, .n_head = H, .n_kv_head = KV,
                                  .head_dim = D, .scale = 1.0f / sqrtf((float)D),
                                  .store = defer, .k_new = kk, .v_new = vv};
            be->ops->attention(be, &a);
        }
        if (memcmp(kv[0].k, kv[1].k, bytes) || memcmp(kv[0].v, kv[1].v, bytes))
            fail_msg("%s pool differs with deferred stores", dtype ? "q8" : "f16");
        if (memcmp(out0, out1, sizeof(float) * N * H * D))
            fail_msg("%s attention differs with deferred stores", dtype ? "q8" : "f16");
        for (int i = 0; i < N * H * D; i++)
            assert_true(isfinite(out0[i]));
        for (int k = 0; k < 2; k++) {
            free(kv[k].k);
            free(kv[k].v);
        }
    }
    free(q);
    free(kk);
    free(vv);
    free(out0);
    free(out1);
    kern_backend_free(be);
}

/* ---- row operations ------------------------------------------------------------------------ */

/* rmsnorm, swiglu and geglu of every table against float64 formulas, over lengths that exercise the
 * vector bodies and tails, and inputs from tiny to large (SiLU saturates both ways). */
static void test_row_ops_vs_double(void **state)
{
    (void)state;
    struct rng r = {0xE1E1};
    static const int lens[] = {1, 7, 8, 15, 16, 17, 64, 576, 1000, 1536};
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
        const int n = lens[li];
        float *x = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * n);
        float *y = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
        float *up = malloc(sizeof(float) * n);
        for (int i = 0; i < n; i++) {
            x[i] = rng_uniform(&r, -3.0f, 3.0f);
            w[i] = rng_uniform(&r, -2.0f, 2.0f);
            up[i] = rng_uniform(&r, -2.0f, 2.0f);
        }
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            double ss = 0;
            for (int i = 0; i < n; i++)
                ss += (double)x[i] * x[i];
            double sc = 1.0 / sqrt(ss / n + 1e-5);
            f->rmsnorm(x, w, y, n, 1e-5f);
            for (int i = 0; i < n; i++) {
                double want = x[i] * sc * w[i];
                if (!(fabs(y[i] - want) <= 1e-6 * (fabs(want) + 1e-3)))
                    fail_msg("%s rmsnorm n %d [%d]: %g vs %g", f->name, n, i, (double)y[i], want);
            }
            for (int i = 0; i < n; i++) /* spread over [-100, 100]: exp under- and overflow */
                g[i] = (i % 3 == 0) ? rng_uniform(&r, -100.0f, 100.0f) : x[i];
            memcpy(y, g, sizeof(float) * n);
            f->swiglu(y, up, n);
            for (int i = 0; i < n; i++) {
                double want = g[i] / (1.0 + exp(-(double)g[i])) * up[i];
                if (!(fabs(y[i] - want) <= 1e-6 * fabs(want) + 1e-30))
                    fail_msg("%s swiglu n %d [%d] g %g: %g vs %g", f->name, n, i, (double)g[i],
                             (double)y[i], want);
            }
            memcpy(y, g, sizeof(float) * n);
            f->geglu(y, up, n);
            for (int i = 0; i < n; i++) {
                const double gd = g[i];
                /* 0.5 g (1 + tanh z) in its exact form g / (1 + e^-2z) (1 + tanh z cancels) */
                const double z = 0.7978845608028654 * (gd + 0.044715 * gd * gd * gd);
                double want = gd / (1.0 + exp(-2.0 * z)) * up[i];
                /* the exponent 2z is computed in float: its rounding grows with |2z| */
                if (!(fabs(y[i] - want) <= 1e-6 * (2.0 + 2.0 * fabs(z)) * fabs(want) + 1e-30))
                    fail_msg("%s geglu n %d [%d] g %g: %g vs %g", f->name, n, i, gd,
                             (double)y[i], want);
            }
        }
        free(x);
        free(w);
        free(y);
        free(g);
        free(up);
    }
}

/* RoPE: every table bitwise equal to the formula x[2i] cos - x[2i+1] sin, x[2i] sin +
 * x[2i+1] cos computed here in float with each product rounded (the documented rounding), for
 * rotary widths that use the vector body, its tail and both, over several heads. */
static void test_rope_tables(void **state)
{
    (void)state;
    struct rng r = {0x2077};
    static const int dims[][2] = {{64, 64}, {64, 32}, {128, 128}, {10, 10}, {48, 40}, {64, 18}};
    for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
        const int hd = dims[di][0], rot = dims[di][1], H = 3;
        float x[3 * 128], want[3 * 128], got[3 * 128], cs[128];
        for (int i = 0; i < H * hd; i++)
            x[i] = rng_uniform(&r, -3.0f, 3.0f);
        for (int i = 0; i < rot; i += 2) {
            double ang = rng_uniform(&r, -100.0f, 100.0f);
            cs[i] = (float)cos(ang);
            cs[i + 1] = (float)sin(ang);
        }
        memcpy(want, x, sizeof(float) * (size_t)(H * hd));
        for (int h = 0; h < H; h++)
            for (int i = 0; i < rot; i += 2) {
                volatile float ac = x[h * hd + i] * cs[i], bs = x[h * hd + i + 1] * cs[i + 1];
                volatile float as = x[h * hd + i] * cs[i + 1], bc = x[h * hd + i + 1] * cs[i];
                want[h * hd + i] = ac - bs;
                want[h * hd + i + 1] = as + bc;
            }
        for (int isa = 0; isa < KERN_ISA_COUNT; isa++) {
            const struct kern_cpu_fns *f = isa_fns(isa);
            if (!f)
                continue;
            assert_non_null(f->rope);
            memcpy(got, x, sizeof(float) * (size_t)(H * hd));
            f->rope(got, cs, H, hd, rot);
            for (int i = 0; i < H * hd; i++)
                if (f32_bits(got[i]) != f32_bits(want[i]))
                    fail_msg("%s rope head_dim %d rot %d elem %d: %.9g vs %.9g", f->name, hd, rot,
                             i, (double)got[i], (double)want[i]);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_vs_naive),
        cmocka_unit_test(test_attention_tiles),
        cmocka_unit_test(test_backend_deferred_kv_store),
        cmocka_unit_test(test_row_ops_vs_double),
        cmocka_unit_test(test_rope_tables),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
