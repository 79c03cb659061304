/* Unit tests for engine/sampler: RNG streams (Philox known answers), greedy and truncated
 * sampling against a full-sort reference, penalties, validation and batch independence. The
 * draw distribution and the two truncation paths are in test_sampler_dist.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/philox.h"
#include "engine/sampler.h"
#include "engine/sampler_internal.h"
#include "tests/test_sampler_util.h"

/* ---- helpers ---------------------------------------------------------------------------- */

/* Kept set of the spec computed the slow, obvious way: full sorts, no histograms. Applies
 * top_k, temperature, top_p, min_p to the (already penalised) logits in `in`; writes the
 * kept ids, best first, to out and returns how many. */
static size_t ref_kept(const float *in, size_t n, const struct engine_sampling *p, int32_t *out)
{
    struct ref_item *it = malloc(n * sizeof(*it));
    float *clean = malloc(n * sizeof(float));
    assert_non_null(it);
    assert_non_null(clean);
    for (size_t i = 0; i < n; i++) {
        clean[i] = isnan(in[i]) ? -INFINITY : in[i]; /* NaN ranks as -inf */
        it[i] = (struct ref_item){clean[i], (int32_t)i};
    }
    in = clean;
    size_t m = n;
    if (p->top_k > 0 && (size_t)p->top_k < n) {
        qsort(it, n, sizeof(*it), ref_cmp);
        m = (size_t)p->top_k;
    }
    float mx = -INFINITY;
    for (size_t j = 0; j < m; j++)
        mx = fmaxf(mx, in[it[j].id] / p->temperature);
    double total = 0.0;
    for (size_t j = 0; j < m; j++) {
        float l = in[it[j].id] / p->temperature;
        it[j].v = l == mx ? 1.0f : engine_sample_exp(l - mx);
        total += it[j].v;
    }
    qsort(it, m, sizeof(*it), ref_cmp);
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        for (size_t j = 0; j < m; j++) {
            cum += it[j].v;
            if (cum >= (double)p->top_p * total) {
                m = j + 1;
                break;
            }
        }
    }
    size_t k = 0;
    for (size_t j = 0; j < m; j++)
        if (it[j].v >= p->min_p * it[0].v)
            out[k++] = it[j].id;
    free(it);
    free(clean);
    return k;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* ---- RNG -------------------------------------------------------------------------------- */

static void test_rng_same_seed_same_stream(void **state)
{
    struct engine_rng a, b;
    engine_rng_seed(&a, 42, "req-1", 5);
    engine_rng_seed(&b, 42, "req-1", 5);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(engine_rng_next(&a), engine_rng_next(&b));
    /* a copied state continues the same stream */
    struct engine_rng c = a;
    for (int i = 0; i < 100; i++)
        assert_int_equal(engine_rng_next(&a), engine_rng_next(&c));
}

static void test_rng_different_ids_and_seeds(void **state)
{
    struct engine_rng a, b, c, d;
    engine_rng_seed(&a, 42, "req-1", 5);
    engine_rng_seed(&b, 42, "req-2", 5);
    engine_rng_seed(&c, 43, "req-1", 5);
    engine_rng_seed(&d, 42, NULL, 0);
    int same_ab = 0, same_ac = 0, same_ad = 0;
    for (int i = 0; i < 1000; i++) {
        uint64_t x = engine_rng_next(&a);
        same_ab += x == engine_rng_next(&b);
        same_ac += x == engine_rng_next(&c);
        same_ad += x == engine_rng_next(&d);
    }
    assert_int_equal(same_ab, 0);
    assert_int_equal(same_ac, 0);
    assert_int_equal(same_ad, 0);
}

static void test_rng_uniform_range_and_mean(void **state)
{
    struct engine_rng r;
    engine_rng_seed(&r, 7, "u", 1);
    double sum = 0.0;
    int low = 0;
    const int n = 100000;
    for (int i = 0; i < n; i++) {
        double u = engine_rng_uniform(&r);
        assert_true(u >= 0.0 && u < 1.0);
        sum += u;
        low += u < 0.25;
    }
    assert_true(fabs(sum / n - 0.5) < 0.005);
    assert_true(fabs((double)low / n - 0.25) < 0.005);
}

/* ---- greedy / top_k ------------------------------------------------------------------- */

static void test_greedy_argmax_ties_lowest(void **state)
{
    struct engine_sampler *s = new_sampler(8);
    struct engine_sampling p = sampling(0.0f, 0, 1.0f, 0.0f);
    struct engine_rng r, r0;
    engine_rng_seed(&r, 1, "g", 1);
    r0 = r;
    float l1[8] = {0.5f, 3.0f, -1.0f, 3.0f, 2.0f, 3.0f, 0.0f, 1.0f};
    float lp = 1.0f;
    assert_int_equal(engine_sample(s, &p, &r, next_pos(), l1, NULL, 0, &lp), 1);
    /* greedy logprob is log softmax of the logits: three tied maxima */
    double z = 0.0;
    for (int i = 0; i < 8; i++)
        z += exp(l1[i] - 3.0);
    assert_float_equal(lp, -log(z), 1e-6);
    assert_memory_equal(&r, &r0, sizeof(r)); /* greedy consumes no randomness */

    float l2[8] = {NAN, -INFINITY, 2.0f, 2.0f, NAN, 1.0f, 2.0f, -5.0f};
    assert_int_equal(engine_sample(s, &p, &r, next_pos(), l2, NULL, 0, NULL), 2);
    assert_true(isinf(l2[0]) && l2[0] < 0); /* NaN became -inf */
    float l3[8] = {-1.0f, -1.0f, -1.0f, -1.0f, -1.0f, -1.0f, -1.0f, -1.0f};
    assert_int_equal(engine_sample(s, &p, &r, next_pos(), l3, NULL, 0, NULL), 0);
    float l4[8] = {-1.0f, -1.0f, -1.0f, -1.0f, -1.0f, -1.0f, -1.0f, 0.0f};
    assert_int_equal(engine_sample(s, &p, &r, next_pos(), l4, NULL, 0, NULL), 7);
    assert_int_equal(engine_sampler_n_kept(s), 1);
    engine_sampler_free(s);
}

static void test_top_k1_equals_greedy(void **state)
{
    const size_t n = 4096;
    struct engine_sampler *s = new_sampler((int32_t)n);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    struct engine_rng gen, r;
    engine_rng_seed(&gen, 9, "logits", 6);
    engine_rng_seed(&r, 9, "draws", 5);
    struct engine_sampling greedy = sampling(0.0f, 0, 1.0f, 0.0f);
    for (int trial = 0; trial < 1000; trial++) {
        random_logits(&gen, a, n, trial % 2 ? 10.0f : 0.5f);
        if (trial % 3 == 0) { /* plant ties at the top */
            a[100] = 50.0f;
            a[7] = 50.0f;
            a[3000] = 50.0f;
        }
        memcpy(b, a, n * sizeof(float));
        struct engine_sampling topk1 = sampling(0.1f + (float)(trial % 19) / 10.0f, 1, 1.0f, 0.0f);
        float lp = 1.0f;
        int32_t g = engine_sample(s, &greedy, &r, next_pos(), a, NULL, 0, NULL);
        int32_t k = engine_sample(s, &topk1, &r, next_pos(), b, NULL, 0, &lp);
        assert_int_equal(g, k);
        assert_float_equal(lp, 0.0f, 0.0f); /* one candidate left: probability 1 */
        if (trial % 3 == 0)
            assert_int_equal(g, 7);
    }
    free(a);
    free(b);
    engine_sampler_free(s);
}

/* Kept sets of the sampler match the full-sort reference over many random rows, for
 * top_k / top_p / min_p mixes on the real vocabulary size (covers the histogram prefix,
 * the radix sort, the insertion sort and the heap). */
static void test_truncation_matches_reference(void **state)
{
    struct engine_sampler *s = new_sampler(VOCAB);
    float *l = malloc(VOCAB * sizeof(float)), *work = malloc(VOCAB * sizeof(float));
    int32_t *ref = malloc(VOCAB * sizeof(int32_t)), *got = malloc(VOCAB * sizeof(int32_t));
    struct engine_rng gen, r;
    engine_rng_seed(&gen, 5, "rows", 4);
    engine_rng_seed(&r, 5, "draws", 5);
    const float spreads[] = {0.05f, 1.0f, 4.0f, 12.0f, 40.0f};
    const struct {
        int32_t top_k;
        float top_p, min_p, temp;
    } cfg[] = {
        {0, 0.9f, 0.0f, 1.0f},     {0, 0.5f, 0.0f, 0.7f},     {0, 0.99f, 0.0f, 1.5f},
        {0, 0.1f, 0.0f, 1.0f},     {40, 1.0f, 0.0f, 1.0f},    {40, 0.9f, 0.0f, 1.0f},
        {1000, 0.95f, 0.0f, 1.0f}, {40000, 1.0f, 0.0f, 1.0f}, {0, 1.0f, 0.05f, 1.0f},
        {0, 0.9f, 0.1f, 0.8f},     {50, 0.8f, 0.2f, 1.2f},    {0, 1.0f, 0.0f, 1.0f},
    };
    for (size_t c = 0; c < sizeof(cfg) / sizeof(cfg[0]); c++) {
        for (size_t sp = 0; sp < sizeof(spreads) / sizeof(spreads[0]); sp++) {
            random_logits(&gen, l, VOCAB, spreads[sp]);
            if (sp == 2) /* coarse values: many exact ties */
                for (size_t i = 0; i < VOCAB; i++)
                    l[i] = roundf(l[i]);
            struct engine_sampling p =
                sampling(cfg[c].temp, cfg[c].top_k, cfg[c].top_p, cfg[c].min_p);
            size_t nref = ref_kept(l, VOCAB, &p, ref);
            memcpy(work, l, VOCAB * sizeof(float));
            int32_t tok = engine_sample(s, &p, &r, next_pos(), work, NULL, 0, NULL);
            size_t n = engine_sampler_n_kept(s);
            assert_int_equal(n, nref);
            double psum = 0.0;
            int seen = 0;
            for (size_t i = 0; i < n; i++) {
                double pr;
                got[i] = engine_sampler_kept(s, i, &pr);
                psum += pr;
                seen |= got[i] == tok;
            }
            assert_true(seen);
            assert_float_equal(psum, 1.0, 1e-9);
            int truncated = cfg[c].top_k > 0 || cfg[c].top_p < 1.0f || cfg[c].min_p > 0.0f;
            if (truncated) { /* ranked order: must equal the reference order exactly */
                assert_memory_equal(got, ref, n * sizeof(int32_t));
            } else { /* id order: compare as sets */
                qsort(ref, nref, sizeof(int32_t), cmp_i32);
                assert_memory_equal(got, ref, n * sizeof(int32_t));
            }
        }
    }
    free(l);
    free(work);
    free(ref);
    free(got);
    engine_sampler_free(s);
}

/* The sampler's own e^x: accurate, exact at 0, zero below -80. */
static void test_exp_accuracy(void **state)
{
    double worst = 0.0;
    for (int i = 0; i <= 400000; i++) {
        float x = -80.0f * (float)i / 400000.0f;
        double want = exp((double)x), got = engine_sample_exp(x);
        double rel = fabs(got - want) / want;
        worst = rel > worst ? rel : worst;
    }
    assert_true(worst < 4e-7);
    assert_true(engine_sample_exp(0.0f) == 1.0f);
    assert_true(engine_sample_exp(-80.001f) == 0.0f);
    assert_true(engine_sample_exp(-INFINITY) == 0.0f);
    assert_true(engine_sample_exp(NAN) == 0.0f);
}

/* The vector weight passes (engine_sampler_chunk, engine_sampler_weights), bit for bit
 * against the scalar definition computed here: scaled = src / t (src itself at t = 1) with
 * NaN as -inf, weight = 1 at the maximum else engine_sample_exp(scaled - max), lane k
 * of 16 summing the tokens k, k + 16, ... in float, the tail apart, the lanes added pairwise
 * in double. Chunks of random values with ties, -0, +-inf, NaN and values either side of
 * -80 below the maximum; lengths with and without a tail. */
static void test_weights_bitwise(void **state)
{
    (void)state;
    struct engine_rng r;
    engine_rng_seed(&r, 21, "weights", 7);
    static const size_t lens[] = {256, 255, 17, 16, 5};
    static const float temps[] = {1.0f, 0.8f, 0.7f, 1.3f};
    float src[256], want_l[256], got_l[256], w[256];
    int checked = 0;
    for (int kind = 0; kind < 8; kind++)
        for (int li = 0; li < 5; li++) {
            const size_t n = lens[li];
            const float t = temps[(kind + li) % 4];
            for (size_t i = 0; i < n; i++)
                src[i] = (float)(engine_rng_uniform(&r) * 60.0 - 50.0);
            if (kind == 1) /* ties, zeros of both signs, -inf */
                for (size_t i = 0; i < n; i += 3)
                    src[i] = i % 2 ? -0.0f : (i % 9 ? 0.0f : -INFINITY);
            if (kind == 2 && n > 4) { /* NaN and -inf, the maximum last */
                src[1] = NAN;
                src[3] = -INFINITY;
                src[n - 1] = 30.0f;
            }
            if (kind == 3) /* around -80 below the maximum (after scaling) */
                for (size_t i = 0; i < n; i++)
                    src[i] = i == 0 ? 0.0f : -t * (80.0f + (float)((int)(i % 5) - 2) * 1e-5f);
            if (kind == 4) /* every value -inf: each is the maximum */
                for (size_t i = 0; i < n; i++)
                    src[i] = -INFINITY;
            if (kind == 5 && n > 2) /* +inf: only it weighs */
                src[2] = INFINITY;
            if (kind == 6) /* large spread */
                for (size_t i = 0; i < n; i++)
                    src[i] *= 40.0f;
            float m = -INFINITY;
            for (size_t i = 0; i < n; i++) {
                float v = t == 1.0f ? src[i] : src[i] / t;
                want_l[i] = isnan(v) ? -INFINITY : v;
                m = want_l[i] > m ? want_l[i] : m;
            }
            float lane[16] = {0}, tail = 0.0f, wt[256];
            const size_t nv = n / 16 * 16;
            for (size_t i = 0; i < n; i++) {
                wt[i] = want_l[i] == m ? 1.0f : engine_sample_exp(want_l[i] - m);
                if (i < nv)
                    lane[i % 16] += wt[i];
                else
                    tail += wt[i];
            }
            double z = tail;
            for (int k = 0; k < 16; k += 4)
                z += ((double)lane[k] + lane[k + 1]) + ((double)lane[k + 2] + lane[k + 3]);
            float got_m;
            const double got_z = engine_sampler_chunk(src, got_l, n, t, &got_m);
            assert_memory_equal(got_l, want_l, n * sizeof(float));
            assert_memory_equal(&got_m, &m, sizeof(float));
            assert_memory_equal(&got_z, &z, sizeof(double));
            engine_sampler_weights(want_l, n, m, w);
            assert_memory_equal(w, wt, n * sizeof(float));
            want_l[0] = NAN; /* weighs nothing (in a lane or in the tail) */
            engine_sampler_weights(want_l, n, m, w);
            assert_true(w[0] == 0.0f);
            checked++;
        }
    /* a dense sweep of [-80.5, 0] against engine_sample_exp (maximum 0) */
    enum { SWEEP = 1 << 18 };
    float *x = malloc(SWEEP * sizeof(float)), *wx = malloc(SWEEP * sizeof(float));
    assert_non_null(x);
    assert_non_null(wx);
    for (size_t i = 0; i < SWEEP; i++)
        x[i] = -80.5f * (float)i / (float)(SWEEP - 1);
    engine_sampler_weights(x, SWEEP, 0.0f, wx);
    for (size_t i = 0; i < SWEEP; i++)
        if (memcmp(&wx[i], &(float){engine_sample_exp(x[i])}, sizeof(float)))
            fail_msg("weight of %a is %a, scalar %a", (double)x[i], (double)wx[i],
                     (double)engine_sample_exp(x[i]));
    free(x);
    free(wx);
    assert_int_equal(checked, 40);
}

/* engine_sampler_top_values against a full sort (descending value, NaN as -inf, a later equal
 * value after an earlier one): rows of 1 to 49,152 values, coarse values so that many tie at
 * the k-th (blocks that hold only ties of the bar must be skipped, one above it must not),
 * NaN and -inf inside blocks, k from 0 to 20. */
static void test_top_values(void **state)
{
    (void)state;
    struct engine_rng r;
    engine_rng_seed(&r, 23, "top", 3);
    static const size_t lens[] = {1, 15, 16, 17, 48, 1000, 49152};
    const size_t cap = 49152;
    float *l = malloc(cap * sizeof(float));
    struct ref_item *it = malloc(cap * sizeof(*it));
    assert_non_null(l);
    assert_non_null(it);
    for (int li = 0; li < 7; li++)
        for (int k = 0; k <= 20; k += (k < 4 ? 1 : 4)) {
            const size_t n = lens[li];
            const int coarse = k % 2;
            for (size_t i = 0; i < n; i++) {
                const double u = engine_rng_uniform(&r);
                l[i] = coarse ? (float)(int)(u * 6.0) : (float)(u * 100.0 - 50.0);
                if (n > 20 && i % 37 == 5)
                    l[i] = i % 2 ? NAN : -INFINITY;
            }
            for (size_t i = 0; i < n; i++)
                it[i] = (struct ref_item){isnan(l[i]) ? -INFINITY : l[i], (int32_t)i};
            qsort(it, n, sizeof(*it), ref_cmp); /* descending, ties to the lower id */
            int32_t id[20];
            float v[20];
            const int m = engine_sampler_top_values(l, n, k, id, v);
            assert_int_equal(m, (size_t)k < n ? k : (int)n);
            for (int j = 0; j < m; j++) {
                assert_int_equal(id[j], it[j].id);
                assert_memory_equal(&v[j], &it[j].v, sizeof(float));
            }
        }
    free(l);
    free(it);
}

/* Rows with +inf, -inf and NaN entries draw only from what deserves mass. */
static void test_edge_rows(void **state)
{
    struct engine_sampler *s = new_sampler(4);
    struct engine_rng r;
    engine_rng_seed(&r, 21, "edge", 4);
    struct engine_sampling p = sampling(1.0f, 0, 1.0f, 0.0f);
    const float rows[3][4] = {
        {0.0f, INFINITY, 1.0f, INFINITY},
        {NAN, 0.0f, NAN, 0.0f},
        {-INFINITY, -INFINITY, -INFINITY, -INFINITY},
    };
    for (int row = 0; row < 3; row++) {
        int counts[4] = {0};
        for (int i = 0; i < 4000; i++) {
            float l[4];
            memcpy(l, rows[row], sizeof(l));
            int32_t t = engine_sample(s, &p, &r, next_pos(), l, NULL, 0, NULL);
            assert_true(t >= 0 && t < 4);
            counts[t]++;
        }
        if (row < 2) { /* tokens 1 and 3 only, evenly */
            assert_int_equal(counts[0] + counts[2], 0);
            assert_true(counts[1] > 1800 && counts[3] > 1800);
        } else { /* all masked: every token alike */
            for (int t = 0; t < 4; t++)
                assert_true(counts[t] > 850);
        }
    }
    engine_sampler_free(s);
}

/* The sampler's kept list equals the reference's for this row and top_k. */
static void check_top_k(struct engine_sampler *s, const float *l, size_t n, int32_t k,
                        struct engine_rng *r)
{
    float *work = malloc(n * sizeof(float));
    int32_t *ref = malloc(n * sizeof(int32_t));
    struct engine_sampling p = sampling(1.0f, k, 1.0f, 0.0f);
    size_t nref = ref_kept(l, n, &p, ref);
    memcpy(work, l, n * sizeof(float));
    engine_sample(s, &p, r, next_pos(), work, NULL, 0, NULL);
    assert_int_equal(engine_sampler_n_kept(s), nref);
    for (size_t i = 0; i < nref; i++)
        assert_int_equal(engine_sampler_kept(s, i, NULL), ref[i]);
    free(work);
    free(ref);
}

/* top_k's rising-bar buffer against the reference on orders that stress it: ascending
 * (every token enters, many refills), descending, constant (all ties: lowest ids win),
 * -inf / NaN, signed zeros (equal, so ties by id); then random rows of a few distinct
 * values, where later tokens often land just above the bar, and of continuous values. */
static void test_top_k_orders(void **state)
{
    const size_t n = 1000;
    struct engine_sampler *s = new_sampler((int32_t)n);
    float *l = malloc(n * sizeof(float));
    struct engine_rng r;
    engine_rng_seed(&r, 31, "k", 1);
    const int32_t ks[] = {1, 2, 5, 63, 64, 65, 200, 499, 500, 501, 999};
    for (int order = 0; order < 6; order++) {
        for (size_t i = 0; i < n; i++) {
            switch (order) {
            case 0:
                l[i] = (float)i * 0.01f;
                break;
            case 1:
                l[i] = -(float)i * 0.01f;
                break;
            case 2:
                l[i] = 0.5f;
                break;
            case 3:
                l[i] = (float)(i % 7); /* ties in blocks */
                break;
            case 4:
                l[i] = i % 3 == 0 ? -INFINITY : i % 5 == 0 ? NAN : (float)(i % 11);
                break;
            default:
                l[i] = i % 4 == 1 ? 0.0f : i % 4 == 2 ? -0.0f : -1.0f - (float)(i % 9);
                break;
            }
        }
        for (size_t c = 0; c < sizeof(ks) / sizeof(ks[0]); c++)
            check_top_k(s, l, n, ks[c], &r);
    }
    for (int trial = 0; trial < 400; trial++) {
        int discrete = trial % 2 == 0;
        for (size_t i = 0; i < n; i++)
            l[i] = discrete ? (float)(engine_rng_next(&r) % 13)
                            : (float)engine_rng_uniform(&r) * 10.0f;
        int32_t k = 1 + (int32_t)(engine_rng_next(&r) % (trial % 4 < 2 ? 80 : n - 1));
        check_top_k(s, l, n, k, &r);
    }
    free(l);
    engine_sampler_free(s);
}

/* ---- top_p / min_p on crafted distributions ------------------------------------------ */

/* Probabilities 0.05, 0.30, 0.15, 0.50 (ids 0..3) plus four tiny ones. */
static void crafted(float *l)
{
    const double pr[8] = {0.05, 0.30, 0.15, 0.4999, 1e-4 / 4, 1e-4 / 4, 1e-4 / 4, 1e-4 / 4};
    for (int i = 0; i < 8; i++)
        l[i] = (float)log(pr[i]);
}

static size_t kept_ids(struct engine_sampler *s, int32_t *ids)
{
    size_t n = engine_sampler_n_kept(s);
    for (size_t i = 0; i < n; i++)
        ids[i] = engine_sampler_kept(s, i, NULL);
    return n;
}

static void test_top_p_smallest_prefix(void **state)
{
    struct engine_sampler *s = new_sampler(8);
    struct engine_rng r;
    engine_rng_seed(&r, 11, "tp", 2);
    const struct {
        float top_p;
        size_t n;
    } cases[] = {{0.01f, 1}, {0.49f, 1}, {0.51f, 2},    {0.79f, 2}, {0.81f, 3},
                 {0.94f, 3}, {0.96f, 4}, {0.99991f, 5}, {1.0f, 8}};
    const int32_t order[5] = {3, 1, 2, 0, 4};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        float l[8];
        int32_t ids[8];
        crafted(l);
        struct engine_sampling p = sampling(1.0f, 0, cases[c].top_p, 0.0f);
        int32_t t = engine_sample(s, &p, &r, next_pos(), l, NULL, 0, NULL);
        size_t n = kept_ids(s, ids);
        assert_int_equal(n, cases[c].n);
        if (cases[c].top_p < 1.0f) {
            assert_memory_equal(ids, order, n * sizeof(int32_t));
            int ok = 0;
            for (size_t i = 0; i < n; i++)
                ok |= ids[i] == t;
            assert_true(ok);
        }
    }
    /* renormalised: with top_p 0.81 the kept probabilities are 0.4999, 0.3, 0.15 / 0.9499 */
    float l[8];
    crafted(l);
    struct engine_sampling p = sampling(1.0f, 0, 0.81f, 0.0f);
    engine_sample(s, &p, &r, next_pos(), l, NULL, 0, NULL);
    double pr;
    assert_int_equal(engine_sampler_kept(s, 1, &pr), 1);
    assert_float_equal(pr, 0.30 / 0.9499, 1e-6);
    engine_sampler_free(s);
}

static void test_min_p_cutoff(void **state)
{
    struct engine_sampler *s = new_sampler(8);
    struct engine_rng r;
    engine_rng_seed(&r, 12, "mp", 2);
    /* relative to p_max = 0.4999: 0.30 -> 0.60, 0.15 -> 0.30, 0.05 -> 0.10, tiny -> 5e-5 */
    const struct {
        float min_p;
        size_t n;
    } cases[] = {{0.0f, 8},  {1e-5f, 8}, {1e-3f, 4}, {0.09f, 4}, {0.11f, 3},
                 {0.29f, 3}, {0.31f, 2}, {0.59f, 2}, {0.61f, 1}, {1.0f, 1}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        float l[8];
        int32_t ids[8];
        crafted(l);
        struct engine_sampling p = sampling(1.0f, 0, 1.0f, cases[c].min_p);
        engine_sample(s, &p, &r, next_pos(), l, NULL, 0, NULL);
        size_t n = kept_ids(s, ids);
        assert_int_equal(n, cases[c].n);
        /* without ranking truncation the kept set is in id order: check membership */
        for (size_t i = 0; i < n; i++) {
            double rel = exp(l[ids[i]] - l[3]);
            assert_true(rel >= cases[c].min_p * (1 - 1e-6));
        }
    }
    /* draws never leave the kept set */
    struct engine_sampling p = sampling(1.0f, 0, 1.0f, 0.31f);
    for (int i = 0; i < 2000; i++) {
        float l[8];
        crafted(l);
        int32_t t = engine_sample(s, &p, &r, next_pos(), l, NULL, 0, NULL);
        assert_true(t == 3 || t == 1);
    }
    engine_sampler_free(s);
}

/* ---- penalties ------------------------------------------------------------------------ */

static void test_penalties_exact(void **state)
{
    struct engine_sampler *s = new_sampler(8);
    struct engine_rng r;
    engine_rng_seed(&r, 13, "pen", 3);
    const float base[8] = {2.0f, -2.0f, 1.0f, 4.0f, 0.0f, 3.0f, -1.0f, 0.5f};
    /* history: 0 x3, 1 x1, 2 x2, 99 (out of vocab, ignored), -1 (ignored) */
    const int32_t hist[] = {5, 0, 2, 0, 99, 1, -1, 2, 0};
    float l[8];

    /* repeat penalty 2 only, whole history: positive /2, negative *2, zero stays */
    struct engine_sampling p = sampling(0.0f, 0, 1.0f, 0.0f);
    p.repeat_penalty = 2.0f;
    memcpy(l, base, sizeof(l));
    engine_sample(s, &p, &r, next_pos(), l, hist, 9, NULL);
    const float e1[8] = {1.0f, -4.0f, 0.5f, 4.0f, 0.0f, 1.5f, -1.0f, 0.5f};
    assert_memory_equal(l, e1, sizeof(l));

    /* frequency 0.5 and presence 0.25 (OpenAI), no repeat penalty */
    p = sampling(0.0f, 0, 1.0f, 0.0f);
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    memcpy(l, base, sizeof(l));
    engine_sample(s, &p, &r, next_pos(), l, hist, 9, NULL);
    const float e2[8] = {2.0f - 1.5f - 0.25f,
                         -2.0f - 0.5f - 0.25f,
                         1.0f - 1.0f - 0.25f,
                         4.0f,
                         0.0f,
                         3.0f - 0.5f - 0.25f,
                         -1.0f,
                         0.5f};
    assert_memory_equal(l, e2, sizeof(l));

    /* all three with a window of the last 4 tokens: {1, -1, 2, 0} -> ids 0, 1, 2 once */
    p.repeat_penalty = 2.0f;
    p.repeat_last_n = 4;
    memcpy(l, base, sizeof(l));
    engine_sample(s, &p, &r, next_pos(), l, hist, 9, NULL);
    const float e3[8] = {1.0f - 0.75f, -4.0f - 0.75f, 0.5f - 0.75f, 4.0f, 0.0f, 3.0f, -1.0f, 0.5f};
    assert_memory_equal(l, e3, sizeof(l));

    /* repeat_last_n 0 turns every penalty off; and the scratch counts were cleared */
    p.repeat_last_n = 0;
    memcpy(l, base, sizeof(l));
    engine_sample(s, &p, &r, next_pos(), l, hist, 9, NULL);
    assert_memory_equal(l, base, sizeof(l));
    p.repeat_last_n = -1;
    const int32_t one[1] = {3};
    memcpy(l, base, sizeof(l));
    engine_sample(s, &p, &r, next_pos(), l, one, 1, NULL);
    const float e4[8] = {2.0f, -2.0f, 1.0f, 2.0f - 0.75f, 0.0f, 3.0f, -1.0f, 0.5f};
    assert_memory_equal(l, e4, sizeof(l));

    /* a penalty can change the greedy choice: token 3 (4.0 -> 2.0 - 0.75) loses to 5 */
    memcpy(l, base, sizeof(l));
    assert_int_equal(engine_sample(s, &p, &r, next_pos(), l, one, 1, NULL), 5);

    /* the prompt (hist[0..4): 5, 0, 2, 0) is repeated but not counted: frequency and presence
     * count the generated 99, 1, -1, 2, 0 (0, 1 and 2 once each); without a repetition
     * penalty a token only the prompt holds is untouched (5), with one it is repeated only */
    p = sampling(0.0f, 0, 1.0f, 0.0f);
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    p.counted_from = 4;
    memcpy(l, base, sizeof(l));
    engine_sample(s, &p, &r, next_pos(), l, hist, 9, NULL);
    const float e5[8] = {2.0f - 0.75f, -2.0f - 0.75f, 1.0f - 0.75f, 4.0f, 0.0f, 3.0f, -1.0f, 0.5f};
    assert_memory_equal(l, e5, sizeof(l));
    int32_t ids[9], cnt[9];
    assert_int_equal(engine_sampler_counts(s, &p, hist, 9, ids, cnt), 3); /* 1, 2, 0 */
    p.repeat_penalty = 2.0f;
    memcpy(l, base, sizeof(l));
    engine_sample(s, &p, &r, next_pos(), l, hist, 9, NULL);
    const float e6[8] = {1.0f - 0.75f, -4.0f - 0.75f, 0.5f - 0.75f, 4.0f, 0.0f, 1.5f, -1.0f, 0.5f};
    assert_memory_equal(l, e6, sizeof(l));
    assert_int_equal(engine_sampler_counts(s, &p, hist, 9, ids, cnt), 4);
    assert_int_equal(ids[0], 5);
    assert_int_equal(cnt[0], 0);
    engine_sampler_free(s);
}

/* ---- independence of batch composition ------------------------------------------------ */

/* Two requests generated on one shared sampler, interleaved with a third, give the same
 * tokens as each alone on a fresh sampler. */
static void run_request(struct engine_sampler *s, const struct engine_sampling *p,
                        const float *base, int32_t *hist, size_t *n_hist, struct engine_rng *r)
{
    float *l = malloc(VOCAB * sizeof(float));
    memcpy(l, base, VOCAB * sizeof(float));
    /* make logits depend on the history so the sequence feeds back */
    l[hist[*n_hist - 1] * 7 % VOCAB] += 3.0f;
    int32_t t = engine_sample(s, p, r, *n_hist, l, hist, *n_hist, NULL);
    hist[(*n_hist)++] = t;
    free(l);
}

static void test_batch_independence(void **state)
{
    float *base = malloc(VOCAB * sizeof(float));
    struct engine_rng gen;
    engine_rng_seed(&gen, 77, "base", 4);
    random_logits(&gen, base, VOCAB, 8.0f);
    struct engine_sampling pa = sampling(0.9f, 0, 0.9f, 0.0f);
    pa.repeat_penalty = 1.3f;
    pa.frequency_penalty = 0.4f;
    struct engine_sampling pb = sampling(1.2f, 50, 1.0f, 0.05f);
    pb.presence_penalty = 0.6f;
    pb.repeat_last_n = 16;
    struct engine_sampling pc = sampling(0.0f, 0, 1.0f, 0.0f);
    pc.repeat_penalty = 1.5f;
    enum { STEPS = 60 };
    int32_t ha[STEPS + 1] = {1}, hb[STEPS + 1] = {2}, hc[STEPS + 1] = {3};
    int32_t ha2[STEPS + 1] = {1}, hb2[STEPS + 1] = {2};
    size_t na = 1, nb = 1, nc = 1, na2 = 1, nb2 = 1;
    struct engine_rng ra, rb, rc, ra2, rb2;
    engine_rng_seed(&ra, 1, "a", 1);
    engine_rng_seed(&rb, 1, "b", 1);
    engine_rng_seed(&rc, 1, "c", 1);
    ra2 = ra;
    rb2 = rb;

    struct engine_sampler *shared = new_sampler(VOCAB);
    for (int i = 0; i < STEPS; i++) {
        run_request(shared, &pa, base, ha, &na, &ra);
        if (i % 3 != 1)
            run_request(shared, &pc, base, hc, &nc, &rc);
        run_request(shared, &pb, base, hb, &nb, &rb);
    }
    engine_sampler_free(shared);
    struct engine_sampler *alone = new_sampler(VOCAB);
    for (int i = 0; i < STEPS; i++)
        run_request(alone, &pa, base, ha2, &na2, &ra2);
    engine_sampler_free(alone);
    alone = new_sampler(VOCAB);
    for (int i = 0; i < STEPS; i++)
        run_request(alone, &pb, base, hb2, &nb2, &rb2);
    engine_sampler_free(alone);
    assert_memory_equal(ha, ha2, sizeof(ha));
    assert_memory_equal(hb, hb2, sizeof(hb));
    /* and the two requests did not simply produce the same thing */
    assert_memory_not_equal(ha, hb, sizeof(ha));
    free(base);
}


/* ---- counter-based RNG (Philox) ------------------------------------------------------- */

/* Philox4x32-10 against Random123's known-answer vectors (its tests/kat_vectors). */
static void test_philox_known_answers(void **state)
{
    static const uint32_t ctr[3][4] = {{0, 0, 0, 0},
                                       {~0u, ~0u, ~0u, ~0u},
                                       {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}};
    static const uint32_t key[3][2] = {{0, 0}, {~0u, ~0u}, {0xa4093822, 0x299f31d0}};
    static const uint32_t want[3][4] = {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
                                        {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
                                        {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}};
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        philox4x32_10(ctr[i], key[i], out);
        assert_memory_equal(out, want[i], sizeof(out));
    }
    /* a draw is a pure function of (key, position, draw) */
    struct engine_rng a, b;
    engine_rng_seed(&a, 5, "x", 1);
    b = a;
    for (int i = 0; i < 100; i++)
        engine_rng_next(&b); /* the plain stream does not move the draws */
    assert_true(engine_rng_at(&a, 17, 0) == engine_rng_at(&b, 17, 0));
    assert_true(engine_rng_at(&a, 17, 0) != engine_rng_at(&a, 18, 0));
    assert_true(engine_rng_at(&a, 17, 0) != engine_rng_at(&a, 17, 1));
}

/* ---- validation ----------------------------------------------------------------------- */

static void test_validate(void **state)
{
    struct err_detail err = {0};
    struct engine_sampling p;
    engine_sampling_default(&p);
    assert_int_equal(engine_sampling_validate(&p, &err), ST_OK);
    assert_float_equal(p.temperature, 1.0f, 0.0f);
    assert_float_equal(p.top_p, 1.0f, 0.0f);
    assert_float_equal(p.repeat_penalty, 1.0f, 0.0f);
    assert_int_equal(p.top_k, 0);

    struct engine_sampling ok[5];
    for (int i = 0; i < 5; i++)
        engine_sampling_default(&ok[i]);
    ok[0].temperature = 0.0f;
    ok[1].temperature = 2.0f;
    ok[2].top_p = 1e-6f;
    ok[3].min_p = 1.0f;
    ok[4].frequency_penalty = -2.0f;
    ok[4].presence_penalty = 2.0f;
    ok[4].repeat_last_n = 0;
    ok[4].top_k = 49152;
    for (int i = 0; i < 5; i++)
        assert_int_equal(engine_sampling_validate(&ok[i], &err), ST_OK);

    struct engine_sampling bad[16];
    for (int i = 0; i < 16; i++)
        engine_sampling_default(&bad[i]);
    bad[0].temperature = -0.1f;
    bad[1].temperature = 2.5f;
    bad[2].temperature = NAN;
    bad[3].top_k = -1;
    bad[4].top_p = 0.0f;
    bad[5].top_p = 1.01f;
    bad[6].top_p = NAN;
    bad[7].min_p = -0.01f;
    bad[8].min_p = 1.5f;
    bad[9].repeat_penalty = 0.0f;
    bad[10].repeat_penalty = INFINITY;
    bad[11].repeat_last_n = -2;
    bad[12].frequency_penalty = 2.5f;
    bad[13].presence_penalty = -3.0f;
    bad[14].frequency_penalty = NAN;
    bad[15].temperature = INFINITY;
    for (int i = 0; i < 16; i++) {
        err.msg[0] = 0;
        assert_int_equal(engine_sampling_validate(&bad[i], &err), ST_ERR_INVALID_ARG);
        assert_int_equal(err.status, ST_ERR_INVALID_ARG);
        assert_true(strlen(err.msg) > 0);
    }

    struct engine_sampler *s = NULL;
    assert_int_equal(engine_sampler_init(&s, 0, &err), ST_ERR_INVALID_ARG);
    assert_null(s);
    engine_sampler_free(NULL);
}

/* engine_logprobs against the obvious double computation: log-softmax with exp() in double,
 * the alternatives by a full sort (ties to the lower id). Rows: random of several spreads,
 * 49,152 and 262,144 tokens, ties in the top, -inf and NaN entries; k from 0 to 20. The
 * normaliser may differ by the relative error of engine_sample_exp (4e-7), so 1e-5 absolute. */
static void test_logprobs_reference(void **state)
{
    (void)state;
    struct engine_rng r;
    engine_rng_seed(&r, 11, "lp", 2);
    static const size_t sizes[] = {49152, 262144, 7};
    static const float spreads[] = {1.0f, 8.0f, 30.0f};
    for (int si = 0; si < 3; si++)
        for (int sp = 0; sp < 3; sp++) {
            const size_t n = sizes[si];
            float *l = malloc(n * sizeof(float));
            struct ref_item *it = malloc(n * sizeof(*it));
            assert_non_null(l);
            assert_non_null(it);
            random_logits(&r, l, n, spreads[sp]);
            l[n / 2] = l[1] = 40.0f; /* a tie at the top: the lower id first */
            l[2] = -INFINITY;
            if (n > 100)
                l[99] = NAN;
            double mx = -INFINITY, sum = 0;
            for (size_t i = 0; i < n; i++)
                if (!isnan(l[i]))
                    mx = fmax(mx, l[i]);
            for (size_t i = 0; i < n; i++)
                sum += isnan(l[i]) ? 0.0 : exp((double)l[i] - mx);
            const double norm = mx + log(sum);
            for (size_t i = 0; i < n; i++)
                it[i] = (struct ref_item){isnan(l[i]) ? -INFINITY : l[i], (int32_t)i};
            qsort(it, n, sizeof(*it), ref_cmp);
            for (int k = 0; k <= ENGINE_TOP_LOGPROBS_MAX; k += 5) {
                const int32_t chosen = (int32_t)((size_t)(k * 7919) % n);
                float lp, top_lp[ENGINE_TOP_LOGPROBS_MAX];
                int32_t top_id[ENGINE_TOP_LOGPROBS_MAX];
                engine_logprobs(l, (int32_t)n, chosen, k, &lp, top_id, top_lp);
                const double want = isnan(l[chosen]) ? -INFINITY : (double)l[chosen] - norm;
                if (isinf(want))
                    assert_true(isinf(lp) && lp < 0);
                else if (fabs((double)lp - want) > 1e-5)
                    fail_msg("n %zu spread %g: logprob %.8f, reference %.8f", n, spreads[sp],
                             (double)lp, want);
                const int kk = (size_t)k < n ? k : (int)n;
                for (int j = 0; j < kk; j++) {
                    assert_int_equal(top_id[j], it[j].id);
                    if (isinf(it[j].v)) /* -inf and NaN entries (the 7-token rows) */
                        assert_true(isinf(top_lp[j]) && top_lp[j] < 0);
                    else
                        assert_true(fabs((double)top_lp[j] - ((double)it[j].v - norm)) <= 1e-5);
                }
            }
            free(it);
            free(l);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng_same_seed_same_stream),
        cmocka_unit_test(test_rng_different_ids_and_seeds),
        cmocka_unit_test(test_rng_uniform_range_and_mean),
        cmocka_unit_test(test_greedy_argmax_ties_lowest),
        cmocka_unit_test(test_top_k1_equals_greedy),
        cmocka_unit_test(test_truncation_matches_reference),
        cmocka_unit_test(test_exp_accuracy),
        cmocka_unit_test(test_weights_bitwise),
        cmocka_unit_test(test_top_values),
        cmocka_unit_test(test_edge_rows),
        cmocka_unit_test(test_top_k_orders),
        cmocka_unit_test(test_top_p_smallest_prefix),
        cmocka_unit_test(test_min_p_cutoff),
        cmocka_unit_test(test_penalties_exact),
        cmocka_unit_test(test_batch_independence),
        cmocka_unit_test(test_validate),
        cmocka_unit_test(test_philox_known_answers),
        cmocka_unit_test(test_logprobs_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
