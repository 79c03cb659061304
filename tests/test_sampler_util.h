/* Helpers shared by the sampler tests (test_sampler.c, test_sampler_dist.c): a sampler in one
 * call, sampling parameters, random logit rows, fresh draw positions and the (value desc, id asc)
 * reference order. */
#ifndef TESTS_TEST_SAMPLER_UTIL_H
#define TESTS_TEST_SAMPLER_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "engine/sampler.h"

#define VOCAB 49152 /* the default model's vocabulary size */

/* ---- helpers ---------------------------------------------------------------------------- */

/* A fresh position for each draw: with a counter-based RNG, the same (key, position) would
 * repeat the same uniform. */
static inline uint64_t next_pos(void)
{
    static uint64_t pos;
    return pos++;
}

static inline struct engine_sampler *new_sampler(int32_t n)
{
    struct engine_sampler *s = NULL;
    struct err_detail err = {0};
    assert_int_equal(engine_sampler_init(&s, n, &err), ST_OK);
    assert_non_null(s);
    return s;
}

/* Logits with scale `spread` (small = flat distribution) from the test's own rng. */
static inline void random_logits(struct engine_rng *r, float *l, size_t n, float spread)
{
    for (size_t i = 0; i < n; i++) {
        /* sum of uniforms: roughly normal, with a long-ish head when spread is large */
        double u = engine_rng_uniform(r) + engine_rng_uniform(r) + engine_rng_uniform(r) - 1.5;
        l[i] = (float)(u * spread);
    }
}

static inline struct engine_sampling sampling(float temperature, int32_t top_k, float top_p,
                                              float min_p)
{
    struct engine_sampling p;
    engine_sampling_default(&p);
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    return p;
}

/* Reference: rank by (value desc, id asc). */
struct ref_item {
    float v;    /* the value ranked: a logit or a weight */
    int32_t id; /* token id */
};

static inline int ref_cmp(const void *a, const void *b)
{
    const struct ref_item *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

#endif
