/* Fixture and helpers shared by the engine tests on the real model (test_engine.c,
 * test_engine_seams.c): the model loaded once per group, engine parameters in one call,
 * and a batch of prompts run through the engine with the results kept. */
#ifndef TESTS_TEST_ENGINE_UTIL_H
#define TESTS_TEST_ENGINE_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "engine/engine.h"
#include "engine/kv_internal.h"
#include "engine/model_internal.h"
#include "engine/engine_internal.h"
#include "engine/kv.h"
#include "engine/model.h"
#include "kernels/cpu/cpu_kernels.h"
#include "engine/tokenizer.h"
#include "kernels/kernels.h"
#include "tests/test_util.h"

#define N_PROMPTS 64 /* prompts decoded together in the batch-invariance tests */

#define GEN 8

/* Under sanitizers (QUERN_SANITIZE set by `make asan test`) the batch-invariance tests use
 * the first 16 prompts: ASan makes each of the 64 solo runs ~10x slower, and the full
 * 64-prompt check already runs in the normal suite of the same CI job. */
static inline int n_prompts(void) { return getenv("QUERN_SANITIZE") ? 16 : N_PROMPTS; }

/* ---- block manager ---- */

static inline void check_ok(const struct engine_kv *kv, int empty)
{
    struct err_detail err = {0};
    if (engine_kv_check(kv, empty, &err))
        fail_msg("KV check: %s", err.msg);
}

/* ---- engine on the real model ---- */

struct fixture {
    struct kern_backend *be;   /* CPU backend */
    struct engine_model *m;    /* model */
    struct engine_tok *tok;    /* tokenizer */
    int32_t *prompt[N_PROMPTS]; /* tokenized prompts */
    size_t n_prompt[N_PROMPTS]; /* lengths */
};

static inline int setup(void **state)
{
    static struct fixture f;
    struct err_detail err = {0};
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_F32, 0, 1, 0};
    if (kern_backend_open(&f.be, &ko, &err) ||
        engine_model_load(&f.m, test_model_path(), f.be, &err) ||
        engine_tok_load(&f.tok, f.m->gguf, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    static const char *const topics[] = {"the sea", "a robot", "Paris", "prime numbers",
                                         "a red fox", "coffee", "the moon", "C pointers"};
    for (int i = 0; i < N_PROMPTS; i++) {
        char text[256];
        snprintf(text, sizeof(text), "%s %d. Tell me about %s in %d words:",
                 i % 2 ? "Question" : "Task", i, topics[i % 8], 5 + i);
        if (engine_tok_encode(f.tok, text, strlen(text), 0, &f.prompt[i], &f.n_prompt[i], &err))
            return -1;
    }
    *state = &f;
    return 0;
}

static inline int teardown(void **state)
{
    struct fixture *f = *state;
    for (int i = 0; i < N_PROMPTS; i++)
        free(f->prompt[i]);
    engine_tok_free(f->tok);
    engine_model_free(f->m);
    kern_backend_free(f->be);
    return 0;
}

struct result {
    int32_t tok[64];  /* generated tokens */
    size_t n;         /* count */
    size_t n_cached;  /* prompt tokens from the prefix cache */
    int finish;       /* enum engine_finish */
    int preempted;    /* times preempted */
    double t_arrival; /* the output's timestamps: arrival, */
    double t_first;   /* first token, */
    double t_finish;  /* completion */
};

/* A request's timestamps must be in order: it arrives, then its first token is sampled, then
 * it finishes (fails if, say, t_first were never set or reset when the request is preempted). */
static inline void assert_times_ordered(const struct engine_output *o)
{
    if (!(o->t_arrival > 0 && o->t_arrival <= o->t_first && o->t_first <= o->t_finish))
        fail_msg("request %llu: times out of order: arrival %.9f, first %.9f, finish %.9f",
                 (unsigned long long)o->id, o->t_arrival, o->t_first, o->t_finish);
}

/* Run requests [0, n) (prompt i from prompts[i]) through an engine with parameters p;
 * request i is numbered first + i: that is its request id ("req-<number>") and, added to 42,
 * its seed, so sampled requests (sampled 1: temperature 1; 2: temperature 0.8, top_p 0.95) each
 * draw with their own RNG key, and a request run alone can be given the number it has in a
 * batch. */
static inline void run_engine(struct fixture *f, const struct engine_params *p,
                              int32_t *const *prompts, const size_t *n_prompts, int n, int first,
                              int sampled, struct result *res, struct engine_stats *stats)
{
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, p, &err), ST_OK);
    for (int i = 0; i < n; i++) {
        struct engine_request r = {0};
        char id[32];
        snprintf(id, sizeof(id), "req-%d", first + i);
        r.prompt = prompts[i];
        r.n_prompt = n_prompts[i];
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = sampled ? 1.0f : 0.0f;
        if (sampled == 2) { /* nucleus sampling, the common dataset setting */
            r.sampling.temperature = 0.8f;
            r.sampling.top_p = 0.95f;
        }
        r.sampling.seed = 42 + (uint64_t)(first + i);
        r.max_tokens = GEN;
        r.ignore_eos = 1;
        r.request_id = id;
        r.user = &res[i];
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    int done = 0;
    while (engine_pending(e)) {
        if (engine_step(e, &err))
            fail_msg("step: %s", err.msg);
        struct engine_output o[8];
        size_t k;
        while ((k = engine_poll(e, o, 8)) > 0)
            for (size_t j = 0; j < k; j++) {
                struct result *rr = o[j].user;
                assert_true(o[j].n_tokens <= 64);
                memcpy(rr->tok, o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
                rr->n = o[j].n_tokens;
                rr->n_cached = o[j].n_cached;
                rr->finish = (int)o[j].finish;
                rr->preempted = o[j].preemptions;
                rr->t_arrival = o[j].t_arrival;
                rr->t_first = o[j].t_first;
                rr->t_finish = o[j].t_finish;
                assert_times_ordered(&o[j]);
                done++;
            }
    }
    assert_int_equal(done, n);
    if (stats)
        *stats = *engine_get_stats(e);
    check_ok(engine_get_kv(e), 1);
    engine_free(e);
}

static inline void params(struct engine_params *p, int max_seqs, int max_batch, size_t kv_mb,
                          int cache)
{
    engine_params_default(p);
    p->max_seqs = max_seqs;
    p->max_batch_tokens = max_batch;
    p->kv_mem = kv_mb << 20;
    p->prefix_cache = cache;
}

static inline void assert_same(const struct result *a, const struct result *b, int n,
                               const char *what)
{
    for (int i = 0; i < n; i++) {
        if (a[i].n != b[i].n || memcmp(a[i].tok, b[i].tok, sizeof(int32_t) * a[i].n))
            fail_msg("%s: request %d differs (%zu vs %zu tokens, first %d vs %d)", what, i,
                     a[i].n, b[i].n, a[i].tok[0], b[i].tok[0]);
    }
}

/* on_text streaming: the pieces, in order, are exactly the output text, for requests ending at
 * max_tokens, at an end-of-generation token and at a stop string (which must not leak), run
 * together in one engine. */
struct stream_buf {
    char text[4096]; /* concatenated pieces */
    size_t n;        /* bytes */
    int calls;       /* callbacks */
};

static inline void stream_cb(void *user, const char *text, size_t n)
{
    struct stream_buf *b = user;
    assert_true(n > 0 && b->n + n < sizeof(b->text));
    memcpy(b->text + b->n, text, n);
    b->n += n;
    b->calls++;
}

#endif
