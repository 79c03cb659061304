/* Engine tests: the KV block manager on its own (reference counts, LRU eviction order, prefix
 * matching, leak check) and continuous batching on the real model: 64 prompts decoded
 * together give exactly the tokens each gives alone (greedy, and sampling with a seed per
 * request); prefix-cache hits (bitwise logits), chunked prefill and preemption with recompute
 * change nothing; the newest sequence is the one preempted and it is requeued first; request
 * timestamps are ordered and the warm-up is not counted; tokens and the load are counted live,
 * before requests finish; requests that cannot fit are rejected with an error. The seams
 * inside the engine: a run of several accepted tokens stops exactly at a stop string or
 * end-of-generation token; the scheduler keeps the token budget and preempts newest first;
 * the number of sampling threads changes no token. */
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
static int n_prompts(void) { return getenv("QUERN_SANITIZE") ? 16 : N_PROMPTS; }

/* ---- block manager ---- */

static void check_ok(const struct engine_kv *kv, int empty)
{
    struct err_detail err = {0};
    if (engine_kv_check(kv, empty, &err))
        fail_msg("KV check: %s", err.msg);
}

static void test_kv_refcount_and_lru(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    /* 4 blocks of 4 tokens, 3 slots */
    assert_int_equal(engine_kv_init(&kv, 1, 1, 2, KERN_KV_F16, 4, 4, 3, 1, &err), ST_OK);
    int32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    assert_int_equal(engine_kv_reserve(kv, 0, 9, &err), ST_OK); /* 3 blocks */
    assert_int_equal(engine_kv_available(kv), 1);
    engine_kv_prefix_commit(kv, 0, a, 9); /* registers blocks 0 and 1 (full) */
    check_ok(kv, 0);
    /* slot 1 shares the two full blocks, never the partial third */
    assert_int_equal(engine_kv_prefix_attach(kv, 1, a, 12, 11), 8);
    assert_int_equal(kv->ref[engine_kv_table(kv, 1)[0]], 2);
    assert_int_equal(engine_kv_table(kv, 1)[1], engine_kv_table(kv, 0)[1]);
    check_ok(kv, 0);
    /* a different prefix shares nothing */
    int32_t b[8] = {1, 2, 3, 5, 5, 6, 7, 8};
    assert_int_equal(engine_kv_prefix_attach(kv, 2, b, 8, 8), 0);
    /* over-reserving fails and takes nothing */
    assert_int_equal(engine_kv_reserve(kv, 2, 8, &err), ST_ERR_RANGE);
    assert_int_equal(engine_kv_available(kv), 1);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 1);
    check_ok(kv, 1);
    /* the two registered blocks are cached-free; the unregistered one is plain free */
    assert_int_equal(kv->n_lru, 2);
    assert_int_equal(kv->n_free, 2);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, a, 12, 12), 8); /* cache hit after free */
    engine_kv_release(kv, 0);
    /* reserving all 4 blocks evicts both cached ones */
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK);
    assert_int_equal(kv->stats.evictions, 2);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, a, 12, 12), 0);
    check_ok(kv, 0);
    /* truncate returns blocks */
    engine_kv_truncate(kv, 2, 5);
    assert_int_equal(engine_kv_available(kv), 2);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    engine_kv_free(kv);
}

/* Cached free blocks are evicted least recently used first: of two released prompts the older
 * goes first; reattaching a prompt makes it the newest again; and a released chain loses its
 * last block before its first (the first blocks are the ones other prompts can share). Fails if
 * eviction takes the newest cached block, or if a hit does not refresh a block's age. */
static void test_kv_lru_order(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    /* 5 blocks of 4 tokens, 3 slots */
    assert_int_equal(engine_kv_init(&kv, 1, 1, 2, KERN_KV_F16, 4, 5, 3, 1, &err), ST_OK);
    const int32_t x[4] = {1, 2, 3, 4}, y[4] = {5, 6, 7, 8}, c[8] = {9, 10, 11, 12, 13, 14, 15, 16};
    /* cache one block of x, then one of y: LRU x (oldest), y */
    const int32_t *one[2] = {x, y};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(engine_kv_reserve(kv, 0, 4, &err), ST_OK);
        engine_kv_prefix_commit(kv, 0, one[i], 4);
        engine_kv_release(kv, 0);
    }
    assert_int_equal(kv->n_lru, 2);
    assert_int_equal(kv->n_free, 3);
    /* slot 2 takes the 3 plain free blocks and one cached: x must go, y stay */
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK);
    assert_int_equal(kv->stats.evictions, 1);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 4);
    assert_int_equal(engine_kv_prefix_attach(kv, 1, x, 4, 4), 0);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    /* cache x again after y, then hit y: y was used last, so x is now the older one */
    assert_int_equal(engine_kv_reserve(kv, 0, 4, &err), ST_OK);
    engine_kv_prefix_commit(kv, 0, x, 4);
    engine_kv_release(kv, 0);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 4);
    engine_kv_release(kv, 0);
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK); /* 3 free + 1 cached */
    assert_int_equal(kv->stats.evictions, 2);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 4);
    assert_int_equal(engine_kv_prefix_attach(kv, 1, x, 4, 4), 0);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 2);
    /* a two-block chain c released after y: evicting one block takes y (older), the next takes
     * c's second block, and c's first block is still a hit */
    assert_int_equal(engine_kv_reserve(kv, 0, 8, &err), ST_OK);
    engine_kv_prefix_commit(kv, 0, c, 8);
    engine_kv_release(kv, 0);
    assert_int_equal(kv->n_lru, 3);
    assert_int_equal(kv->n_free, 2);
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK); /* 2 free + 2 cached */
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 0);
    assert_int_equal(engine_kv_prefix_attach(kv, 1, c, 8, 8), 4);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 1);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    engine_kv_free(kv);
}

static void test_kv_check_detects_leak(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    assert_int_equal(engine_kv_init(&kv, 1, 1, 2, KERN_KV_F16, 4, 4, 2, 1, &err), ST_OK);
    assert_int_equal(engine_kv_reserve(kv, 0, 4, &err), ST_OK);
    assert_int_equal(engine_kv_check(kv, 1, &err), ST_ERR_INTERNAL); /* still held */
    assert_non_null(strstr(err.msg, "leak"));
    kv->ref[engine_kv_table(kv, 0)[0]] = 2; /* corrupt a count */
    assert_int_equal(engine_kv_check(kv, 0, &err), ST_ERR_INTERNAL);
    kv->ref[engine_kv_table(kv, 0)[0]] = 1;
    engine_kv_release(kv, 0);
    check_ok(kv, 1);
    engine_kv_free(kv);
}

/* Random operations keep the invariants (hash table deletions included). */
static void test_kv_random_ops(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    assert_int_equal(engine_kv_init(&kv, 1, 1, 1, KERN_KV_F16, 2, 32, 6, 1, &err), ST_OK);
    uint64_t r = 12345;
    int32_t toks[6][64];
    int32_t len[6] = {0};
    for (int it = 0; it < 20000; it++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        int s = (int)((r >> 33) % 6), op = (int)((r >> 40) % 4);
        if (op == 0 && len[s] == 0) { /* start: prompt from a small alphabet -> shared prefixes */
            int n = 1 + (int)((r >> 20) % 40);
            for (int i = 0; i < n; i++)
                toks[s][i] = (int32_t)((r >> (i % 30)) % 2);
            int32_t got = engine_kv_prefix_attach(kv, s, toks[s], n, n - 1);
            if (engine_kv_reserve(kv, s, n, NULL) == ST_OK) {
                len[s] = n;
                engine_kv_prefix_commit(kv, s, toks[s], n);
            } else {
                engine_kv_release(kv, s);
            }
            (void)got;
        } else if (op == 1 && len[s] > 0 && len[s] < 64) { /* decode one token */
            if (engine_kv_reserve(kv, s, len[s] + 1, NULL) == ST_OK) {
                toks[s][len[s]] = (int32_t)(r % 3);
                len[s]++;
                engine_kv_prefix_commit(kv, s, toks[s], len[s]);
            }
        } else if (op == 2 && len[s] > 0) {
            engine_kv_release(kv, s);
            len[s] = 0;
        } else if (op == 3 && len[s] > 2) { /* roll back the last token */
            int32_t keep = len[s] - 1;
            if (kv->ref[engine_kv_table(kv, s)[(keep) / 2]] == 1 || keep % 2 == 0) {
                engine_kv_truncate(kv, s, keep);
                len[s] = keep;
            }
        }
        if (it % 97 == 0)
            check_ok(kv, 0);
    }
    for (int s = 0; s < 6; s++)
        engine_kv_release(kv, s);
    check_ok(kv, 1);
    assert_true(kv->stats.hit_blocks > 100);
    engine_kv_free(kv);
}

/* ---- engine on the real model ---- */

struct fixture {
    struct kern_backend *be;   /* CPU backend */
    struct engine_model *m;    /* model */
    struct engine_tok *tok;    /* tokenizer */
    int32_t *prompt[N_PROMPTS]; /* tokenized prompts */
    size_t n_prompt[N_PROMPTS]; /* lengths */
};

static int setup(void **state)
{
    static struct fixture f;
    struct err_detail err = {0};
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_F32, 0, 1};
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

static int teardown(void **state)
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
static void assert_times_ordered(const struct engine_output *o)
{
    if (!(o->t_arrival > 0 && o->t_arrival <= o->t_first && o->t_first <= o->t_finish))
        fail_msg("request %llu: times out of order: arrival %.9f, first %.9f, finish %.9f",
                 (unsigned long long)o->id, o->t_arrival, o->t_first, o->t_finish);
}

/* Run requests [0, n) (prompt i from prompts[i]) through an engine with parameters p;
 * request i is numbered first + i: that is its request id ("req-<number>") and, added to 42,
 * its seed, so sampled requests (temperature 1) each draw from their own RNG stream, and a
 * request run alone can be given the number it has in a batch. */
static void run_engine(struct fixture *f, const struct engine_params *p, int32_t *const *prompts,
                       const size_t *n_prompts, int n, int first, int sampled, struct result *res,
                       struct engine_stats *stats)
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

static void params(struct engine_params *p, int max_seqs, int max_batch, size_t kv_mb, int cache)
{
    engine_params_default(p);
    p->max_seqs = max_seqs;
    p->max_batch_tokens = max_batch;
    p->kv_mem = kv_mb << 20;
    p->prefix_cache = cache;
}

static void assert_same(const struct result *a, const struct result *b, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        if (a[i].n != b[i].n || memcmp(a[i].tok, b[i].tok, sizeof(int32_t) * a[i].n))
            fail_msg("%s: request %d differs (%zu vs %zu tokens, first %d vs %d)", what, i,
                     a[i].n, b[i].n, a[i].tok[0], b[i].tok[0]);
    }
}

static void batch_invariance(struct fixture *f, int sampled, int kv_dtype)
{
    static struct result alone[N_PROMPTS], together[N_PROMPTS];
    const int np = n_prompts();
    struct engine_params p;
    params(&p, 1, 64, 64, 0);
    p.kv_dtype = kv_dtype;
    for (int i = 0; i < np; i++)
        run_engine(f, &p, &f->prompt[i], &f->n_prompt[i], 1, i, sampled, &alone[i], NULL);
    /* together: request i has the id and seed its solo run had (run_engine numbers it i).
     * They differ between requests, so every sequence has its own RNG stream: sequences that
     * drew from each other's RNG state would sample other tokens than alone. */
    struct engine_stats st;
    params(&p, 64, 512, 256, 0);
    p.kv_dtype = kv_dtype;
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    for (int i = 0; i < np; i++) {
        struct engine_request r = {0};
        char id[32];
        snprintf(id, sizeof(id), "req-%d", i);
        r.prompt = f->prompt[i];
        r.n_prompt = f->n_prompt[i];
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = sampled ? 1.0f : 0.0f;
        r.sampling.seed = 42 + (uint64_t)i;
        r.max_tokens = GEN;
        r.ignore_eos = 1;
        r.request_id = id;
        r.user = &together[i];
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    size_t max_batch_seqs = 0;
    while (engine_pending(e)) {
        if (engine_step(e, &err))
            fail_msg("step: %s", err.msg);
        struct engine_output o[N_PROMPTS];
        size_t k = engine_poll(e, o, N_PROMPTS);
        for (size_t j = 0; j < k; j++) {
            struct result *rr = o[j].user;
            memcpy(rr->tok, o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
            rr->n = o[j].n_tokens;
            assert_times_ordered(&o[j]);
        }
        if (engine_pending(e) > max_batch_seqs)
            max_batch_seqs = engine_pending(e);
    }
    st = *engine_get_stats(e);
    engine_free(e);
    assert_true(max_batch_seqs == (size_t)np);
    assert_true(st.batch_seqs / st.steps > (uint64_t)np / 2); /* really batched */
    assert_same(alone, together, np, sampled ? "sampled" : "greedy");
    print_message("%d prompts: batched tokens equal solo tokens\n", np);
    for (int i = 0; i < np; i++)
        assert_int_equal(together[i].n, GEN);
}

static void test_batch_invariance_greedy(void **state)
{
    batch_invariance(*state, 0, KERN_KV_F16);
}
static void test_batch_invariance_sampled(void **state)
{
    batch_invariance(*state, 1, KERN_KV_F16);
}
/* The 8-bit KV cache quantizes each token's keys and values on their own: still invariant. */
static void test_batch_invariance_kv_q8(void **state)
{
    batch_invariance(*state, 0, KERN_KV_Q8);
}

/* The same for greedy decoding in bf16 mode (its own tile GEMM), where the CPU has AMX-BF16. */
static void test_batch_invariance_bf16(void **state)
{
    if (kern_cpu_detect() != KERN_ISA_AMX) {
        print_message("bf16: no AMX-BF16 on this CPU, not run\n");
        return;
    }
    struct fixture f = *(struct fixture *)*state;
    struct err_detail err = {0};
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_BF16, 0, 1};
    assert_int_equal(kern_backend_open(&f.be, &ko, &err), ST_OK);
    assert_int_equal(engine_model_load(&f.m, test_model_path(), f.be, &err), ST_OK);
    batch_invariance(&f, 0, KERN_KV_F16);
    engine_model_free(f.m);
    kern_backend_free(f.be);
}

/* Chunked prefill (4 tokens per step), preemption under a tiny KV pool (sampled and greedy),
 * and prefix-cache hits all give the tokens of a roomy cold run. */
static void test_chunking_preemption_prefix(void **state)
{
    struct fixture *f = *state;
    enum { N = 16 };
    static struct result base[N], chunked[N], tight[N], cached[N];
    /* prompts sharing a 3-block prefix (48 tokens) plus their own question */
    int32_t *pr[N];
    size_t np[N];
    int32_t shared[48];
    for (int i = 0; i < 48; i++)
        shared[i] = f->prompt[i % N_PROMPTS][i % f->n_prompt[i % N_PROMPTS]];
    for (int i = 0; i < N; i++) {
        np[i] = 48 + f->n_prompt[i];
        pr[i] = malloc(sizeof(int32_t) * np[i]);
        memcpy(pr[i], shared, sizeof(shared));
        memcpy(pr[i] + 48, f->prompt[i], sizeof(int32_t) * f->n_prompt[i]);
    }
    struct engine_params p;
    struct engine_stats st;
    params(&p, 16, 512, 256, 0);
    run_engine(f, &p, pr, np, N, 0, 0, base, &st);
    params(&p, 4, 4, 256, 0); /* 4 tokens per step: every prompt is split into chunks */
    run_engine(f, &p, pr, np, N, 0, 0, chunked, &st);
    assert_same(base, chunked, N, "chunked prefill");
    /* pool of 24 blocks (384 tokens) for 16 sequences of ~70 tokens: must preempt */
    size_t blk = engine_model_kv_block_bytes(f->m, 16, KERN_KV_F16);
    engine_params_default(&p);
    p.max_seqs = 16;
    p.max_batch_tokens = 64;
    p.kv_mem = 24 * blk;
    p.prefix_cache = 0;
    run_engine(f, &p, pr, np, N, 0, 0, tight, &st); /* greedy: the fused argmax path */
    assert_true(st.preemptions > 0);
    assert_same(base, tight, N, "preemption (greedy)");
    run_engine(f, &p, pr, np, N, 0, 1, tight, &st);
    assert_true(st.preemptions > 0);
    static struct result base_s[N];
    params(&p, 16, 512, 256, 0);
    run_engine(f, &p, pr, np, N, 0, 1, base_s, NULL);
    assert_same(base_s, tight, N, "preemption (sampled)");
    print_message("preemptions under a 24-block pool: %llu\n", (unsigned long long)st.preemptions);
    /* prefix cache: later requests reuse the shared 48 tokens */
    params(&p, 4, 64, 256, 1);
    run_engine(f, &p, pr, np, N, 0, 0, cached, &st);
    assert_same(base, cached, N, "prefix cache");
    int hits = 0;
    for (int i = 0; i < N; i++)
        hits += cached[i].n_cached == 48;
    assert_true(hits >= N - 4); /* all but the first wave */
    assert_true(st.prompt_tokens < (uint64_t)(N * 48));
    for (int i = 0; i < N; i++)
        free(pr[i]);
}

/* Preemption policy. Three requests a, b, c are admitted in that order (max_seqs 3) and d
 * waits for a slot; the pool holds a and b to the end but not c as well. When the pool runs
 * out, the most recently admitted sequence (c) must be preempted, never a or b, and requeued at
 * the front: d, behind it in the queue, must not get the slot c left, so d's first token comes
 * only after a and b have finished. Every request still gives the greedy tokens of a roomy run,
 * with and without the prefix cache serving the recompute. Fails if the oldest sequence is
 * preempted, if the preempted one goes to the back of the queue (d, a 2-token prompt that fits
 * anywhere, would then start at once), or if recomputing changes a greedy token. */
static void test_preemption_policy(void **state)
{
    struct fixture *f = *state;
    enum { N = 4, BLK = 4 };
    int32_t *pr[N] = {f->prompt[0], f->prompt[1], f->prompt[2], f->prompt[3]};
    size_t np[N] = {f->n_prompt[0], f->n_prompt[1], f->n_prompt[2], 2};
    int32_t need[N]; /* blocks each request holds at the end */
    for (int i = 0; i < N; i++)
        need[i] = (int32_t)((np[i] + GEN + BLK - 1) / BLK);
    int32_t pool = need[0] + need[1];
    if (need[2] + need[3] > pool)
        pool = need[2] + need[3];
    assert_true(pool < need[0] + need[1] + need[2]); /* a, b and c cannot all finish at once */
    size_t blk = engine_model_kv_block_bytes(f->m, BLK, KERN_KV_F16);
    static struct result base[N], tight[N];
    struct engine_params p;
    params(&p, N, 512, 64, 0);
    p.kv_block = BLK;
    run_engine(f, &p, pr, np, N, 0, 0, base, NULL);
    for (int cache = 0; cache < 2; cache++) {
        struct engine_stats st;
        params(&p, 3, 64, 0, cache);
        p.kv_block = BLK;
        p.kv_mem = (size_t)pool * blk;
        run_engine(f, &p, pr, np, N, 0, 0, tight, &st);
        print_message("prefix cache %d, pool of %d blocks: preemptions %d %d %d %d\n", cache, pool,
                      tight[0].preempted, tight[1].preempted, tight[2].preempted,
                      tight[3].preempted);
        assert_same(base, tight, N, "preemption (greedy)");
        assert_int_equal(tight[0].preempted, 0);
        assert_int_equal(tight[1].preempted, 0);
        assert_true(tight[2].preempted > 0);
        assert_int_equal(st.preemptions, (uint64_t)(tight[0].preempted + tight[1].preempted +
                                                    tight[2].preempted + tight[3].preempted));
        if (tight[3].t_first < tight[0].t_finish || tight[3].t_first < tight[1].t_finish)
            fail_msg("d started before a and b finished: it overtook the preempted c");
    }
}

/* Compute tokens [from, n) of toks in KV slot seq (positions from..n-1, blocks reserved here)
 * and write the logits of the last one to logits. */
static void forward_tail(struct fixture *f, struct engine_kv *kv, int seq, const int32_t *toks,
                         int32_t from, int32_t n, float *logits)
{
    struct err_detail err = {0};
    int32_t pos[64], sq[64];
    assert_true(n - from <= 64);
    for (int32_t i = from; i < n; i++) {
        pos[i - from] = i;
        sq[i - from] = seq;
    }
    assert_int_equal(engine_kv_reserve(kv, seq, n, &err), ST_OK);
    /* a bare block manager (engine_kv_init) gets storage the first time */
    assert_int_equal(engine_model_kv_attach(f->m, kv, 64, &err), ST_OK);
    struct engine_batch b = {n - from, toks + from, pos, sq, NULL};
    assert_int_equal(engine_model_forward(f->m, kv, &b, logits, &err), ST_OK);
}

/* A prompt whose first two blocks come from the prefix cache gives bitwise the logits of a cold
 * run, for both KV storage types. The cache also holds a decoy: the prompt's second block of
 * tokens, cached after a different first block (so with other keys and values). Fails if a hit
 * attaches the wrong block (e.g. one matched by its own tokens without its parent), or if
 * computing on top of cached blocks differs from computing the whole prompt in one batch. */
static void test_prefix_hit_logits(void **state)
{
    struct fixture *f = *state;
    enum { B = 16, N = 3 * B - 8 }; /* 2 full blocks + 8 tokens */
    const size_t V = (size_t)f->m->hp.n_vocab;
    /* blocks of distinct text: x, y, w and tails t, u, v from the fixture prompts */
    int32_t all[6 * B];
    int n_all = 0;
    for (int i = 0; n_all < 6 * B; i++)
        for (size_t j = 0; j < f->n_prompt[i] && n_all < 6 * B; j++)
            all[n_all++] = f->prompt[i][j];
    const int32_t *x = all, *y = all + B, *w = all + 2 * B, *t = all + 3 * B, *u = all + 4 * B,
                  *v = all + 5 * B;
    int32_t prompt[N], decoy[N], other[N]; /* x y t; w y u; x y v */
    const int32_t *parts[3][3] = {{x, y, t}, {w, y, u}, {x, y, v}};
    int32_t *dst[3] = {prompt, decoy, other};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 3; i++)
            memcpy(dst[k] + i * B, parts[k][i], sizeof(int32_t) * (i < 2 ? B : N - 2 * B));
    float *cold = malloc(sizeof(float) * V), *hit = malloc(sizeof(float) * V);
    assert_non_null(cold);
    assert_non_null(hit);
    static const int dtypes[2] = {KERN_KV_F16, KERN_KV_Q8};
    for (int d = 0; d < 2; d++) {
        struct err_detail err = {0};
        struct engine_kv *kv;
        assert_int_equal(engine_model_kv_init(f->m, &kv, 4 * B, 1, B, dtypes[d], &err), ST_OK);
        forward_tail(f, kv, 0, prompt, 0, N, cold);
        engine_kv_release(kv, 0);
        engine_kv_free(kv);
        /* the decoy first (so its y block comes first in a probe), then x y v */
        assert_int_equal(engine_kv_init(&kv, f->m->hp.n_layer, f->m->hp.n_kv_head,
                                        f->m->hp.head_dim, dtypes[d], B, 16, 2, 1, &err),
                         ST_OK);
        const int32_t *fill[2] = {decoy, other};
        for (int k = 0; k < 2; k++) {
            forward_tail(f, kv, 0, fill[k], 0, N, hit);
            engine_kv_prefix_commit(kv, 0, fill[k], N);
            engine_kv_release(kv, 0);
        }
        int32_t cached = engine_kv_prefix_attach(kv, 1, prompt, N, N - 1);
        forward_tail(f, kv, 1, prompt, cached, N, hit);
        if (memcmp(cold, hit, sizeof(float) * V))
            fail_msg("kv dtype %d: logits after a %d-token prefix hit differ from a cold run",
                     dtypes[d], cached);
        assert_int_equal(cached, 2 * B);
        engine_kv_release(kv, 1);
        /* the decoy's blocks were really cached next to x and y (the tails are partial) */
        assert_int_equal(kv->n_lru, 4);
        assert_int_equal(engine_kv_prefix_attach(kv, 0, decoy, N, N), 2 * B);
        engine_kv_release(kv, 0);
        check_ok(kv, 1);
        engine_kv_free(kv);
    }
    free(cold);
    free(hit);
}

static void test_rejects(void **state)
{
    struct fixture *f = *state;
    struct engine *e;
    struct err_detail err = {0};
    struct engine_params p;
    params(&p, 4, 64, 64, 1);
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    struct engine_request r = {0};
    int32_t tok[4] = {1, 2, 3, 4};
    r.prompt = tok;
    r.n_prompt = 4;
    engine_sampling_default(&r.sampling);
    r.max_tokens = f->m->hp.n_ctx_train; /* 4 + n_ctx > n_ctx */
    assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_ERR_RANGE);
    assert_non_null(strstr(err.msg, "context"));
    r.max_tokens = 4000; /* fits the context, not the 64 MB pool (~1400 tokens) */
    assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_ERR_RANGE);
    assert_non_null(strstr(err.msg, "kv-mem"));
    tok[1] = f->m->hp.n_vocab;
    r.max_tokens = 4;
    assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_ERR_RANGE);
    tok[1] = 2;
    r.sampling.top_p = 0;
    assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(engine_pending(e), 0);
    engine_free(e);
}

/* on_text streaming: the pieces, in order, are exactly the output text, for requests ending at
 * max_tokens, at an end-of-generation token and at a stop string (which must not leak), run
 * together in one engine. */
struct stream_buf {
    char text[4096]; /* concatenated pieces */
    size_t n;        /* bytes */
    int calls;       /* callbacks */
};

static void stream_cb(void *user, const char *text, size_t n)
{
    struct stream_buf *b = user;
    assert_true(n > 0 && b->n + n < sizeof(b->text));
    memcpy(b->text + b->n, text, n);
    b->n += n;
    b->calls++;
}

static void test_streaming(void **state)
{
    struct fixture *f = *state;
    struct engine *e;
    struct err_detail err = {0};
    struct engine_params p;
    params(&p, 4, 64, 64, 1);
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    static const struct {
        const char *prompt;
        const char *stop;
        int ignore_eos;
    } cases[] = {
        {"Once upon a time", NULL, 1},
        {"<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
         NULL, 0},
        {"1, 2, 3, 4, 5, 6,", " 9", 0},
        {"The quick brown fox", "zqzqzq", 1},
    };
    enum { N = 4 };
    static struct stream_buf bufs[N];
    memset(bufs, 0, sizeof(bufs));
    for (int i = 0; i < N; i++) {
        int32_t *ids;
        size_t n;
        assert_int_equal(engine_tok_encode(f->tok, cases[i].prompt, strlen(cases[i].prompt),
                                           ENGINE_TOK_PARSE_SPECIAL, &ids, &n, &err),
                         ST_OK);
        struct engine_request r = {0};
        r.prompt = ids;
        r.n_prompt = n;
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = 0;
        r.max_tokens = 32;
        r.ignore_eos = cases[i].ignore_eos;
        const char *stops[1] = {cases[i].stop};
        r.stop = stops;
        r.n_stop = cases[i].stop ? 1 : 0;
        r.request_id = "stream";
        r.user = &bufs[i];
        r.on_text = stream_cb;
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
        free(ids);
    }
    int done = 0;
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        struct engine_output o;
        while (engine_poll(e, &o, 1)) {
            struct stream_buf *b = o.user;
            int i = (int)(b - bufs);
            assert_int_equal(b->n, o.text_len);
            assert_memory_equal(b->text, o.text, o.text_len);
            print_message("stream %d: %d pieces, finish %d%s: \"%.*s\"\n", i, b->calls,
                          (int)o.finish, o.stop_string ? " (stop string)" : "", (int)o.text_len,
                          o.text);
            switch (i) {
            case 0:
            case 3:
                assert_int_equal(o.finish, ENGINE_FINISH_LENGTH);
                assert_true(b->calls > 8); /* streamed as it went, not at the end */
                break;
            case 1:
                assert_int_equal(o.finish, ENGINE_FINISH_STOP);
                assert_false(o.stop_string);
                assert_non_null(strstr(o.text, "Paris"));
                break;
            case 2:
                assert_int_equal(o.finish, ENGINE_FINISH_STOP);
                assert_true(o.stop_string);
                assert_null(strstr(o.text, " 9"));
                assert_non_null(strstr(o.text, " 8,"));
                break;
            }
            done++;
        }
    }
    assert_int_equal(done, N);
    engine_free(e);
}

/* ---- the engine's seams (engine_internal.h) ---- */

/* A sequence for request r, in the state the scheduler gives it before tokens are accepted. */
static struct seq *seq_running(const struct engine_request *r)
{
    struct seq *s;
    struct err_detail err = {0};
    assert_int_equal(engine_seq_new(&s, r, &err), ST_OK);
    s->state = SEQ_RUNNING;
    return s;
}

/* Feed ids[0..n) to a fresh sequence of r in runs of `run` tokens (the last may be shorter)
 * until it ends or the ids run out; returns the sequence (caller frees) and the tokens taken. */
static struct seq *accept_in_runs(struct engine *e, const struct engine_request *r,
                                  const int32_t *ids, size_t n, size_t run, size_t *taken)
{
    struct seq *s = seq_running(r);
    *taken = 0;
    while (*taken < n && !s->ended) {
        size_t k = n - *taken < run ? n - *taken : run;
        size_t got = engine_seq_accept(e, s, ids + *taken, k);
        assert_true(got >= 1 && got <= k);
        if (got < k)
            assert_true(s->ended); /* a run stops short only where the sequence ended */
        *taken += got;
    }
    return s;
}

/* Accepting a run of several tokens (what a speculative step would do) stops at the token
 * that finishes the sequence and takes exactly the tokens before it, with the text and the
 * streamed pieces of accepting them one by one: a stop string spanning tokens midway (the text
 * ends before it; UTF-8 characters split over byte tokens come out whole), an end-of-generation
 * token midway (not appended, the rest dropped), and max_tokens. Fails if accept takes tokens
 * past the end, counts them, leaks the stop string into the text or the stream, or if the
 * result depends on how the tokens were split into runs. */
static void test_accept_run(void **state)
{
    struct fixture *f = *state;
    struct engine *e;
    struct err_detail err = {0};
    struct engine_params p;
    params(&p, 2, 64, 64, 0);
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    const char *text = "\xe6\x97\xa5\xe6\x9c\xac 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11"; /* 日本 */
    const char *before_stop = "\xe6\x97\xa5\xe6\x9c\xac 1, 2, 3, 4, 5, 6, 7, 8";
    int32_t *ids;
    size_t n;
    assert_int_equal(engine_tok_encode(f->tok, text, strlen(text), 0, &ids, &n, &err), ST_OK);
    /* the token that completes ", 9" is the last one taken */
    char acc[512];
    size_t na = 0, want = 0;
    for (size_t i = 0; i < n && !want; i++) {
        na += engine_tok_piece(f->tok, ids[i], 0, acc + na, sizeof(acc) - 1 - na);
        acc[na] = 0;
        if (strstr(acc, ", 9"))
            want = i + 1;
    }
    assert_true(want > 2 && want < n);
    static struct stream_buf buf;
    struct engine_request r = {0};
    r.prompt = ids;
    r.n_prompt = 1;
    engine_sampling_default(&r.sampling);
    r.max_tokens = 64;
    const char *stops[1] = {", 9"};
    r.stop = stops;
    r.n_stop = 1;
    r.user = &buf;
    r.on_text = stream_cb;
    const size_t runs[] = {n, 1, 3, want};
    for (size_t t = 0; t < sizeof(runs) / sizeof(runs[0]); t++) {
        memset(&buf, 0, sizeof(buf));
        uint64_t gen0 = engine_get_stats(e)->gen_tokens;
        size_t taken;
        struct seq *s = accept_in_runs(e, &r, ids, n, runs[t], &taken);
        assert_int_equal(taken, want);
        assert_true(s->ended && s->stop_string);
        assert_int_equal(s->finish, ENGINE_FINISH_STOP);
        assert_int_equal(s->n_gen, want);
        assert_int_equal(engine_get_stats(e)->gen_tokens - gen0, want);
        assert_int_equal(s->n_tok, 1 + want);
        assert_memory_equal(s->tok + 1, ids, sizeof(int32_t) * want);
        assert_string_equal(s->text, before_stop);
        assert_int_equal(s->n_text, strlen(before_stop));
        assert_int_equal(buf.n, s->n_text);
        assert_memory_equal(buf.text, s->text, s->n_text);
        assert_true(s->t_first > 0 && s->t_first <= s->t_finish);
        engine_seq_free(s);
    }
    /* an end-of-generation token third in a run of five (ASCII tokens around it) */
    int32_t eog = engine_tok_eos(f->tok);
    assert_true(engine_tok_is_eog(f->tok, eog));
    const int32_t run[5] = {ids[n - 4], ids[n - 3], eog, ids[n - 2], ids[n - 1]};
    char two[64];
    size_t n2 = engine_tok_piece(f->tok, run[0], 0, two, sizeof(two));
    n2 += engine_tok_piece(f->tok, run[1], 0, two + n2, sizeof(two) - n2);
    r.n_stop = 0;
    memset(&buf, 0, sizeof(buf));
    struct seq *s = seq_running(&r);
    assert_int_equal(engine_seq_accept(e, s, run, 5), 3);
    assert_true(s->ended && !s->stop_string);
    assert_int_equal(s->finish, ENGINE_FINISH_STOP);
    assert_int_equal(s->n_gen, 3);
    assert_int_equal(s->n_tok, 1 + 2); /* the EOG token is not part of the output */
    assert_int_equal(s->n_text, n2);
    assert_memory_equal(s->text, two, n2);
    assert_int_equal(buf.n, n2);
    assert_memory_equal(buf.text, two, n2);
    engine_seq_free(s);
    /* ignore_eos: the EOG token is an ordinary token; max_tokens 4 ends the run at the 4th */
    r.ignore_eos = 1;
    r.max_tokens = 4;
    s = seq_running(&r);
    assert_int_equal(engine_seq_accept(e, s, run, 5), 4);
    assert_true(s->ended);
    assert_int_equal(s->finish, ENGINE_FINISH_LENGTH);
    assert_int_equal(s->n_tok, 1 + 4);
    assert_memory_equal(s->tok + 1, run, sizeof(int32_t) * 4);
    engine_seq_free(s);
    free(ids);
    engine_free(e);
}

/* The scheduler under a KV pool far too small for its sequences, watched step by step: no
 * step's batch exceeds max_batch_tokens (and the budget is reached, so it binds); every
 * preemption takes the most recently admitted of the sequences running before the step, never
 * an older one while a newer still runs; preempted sequences wait ahead of every request never
 * admitted; and the tokens are those of a roomy run. Fails if the budget is overrun, the
 * victim is chosen by any other order, or a preempted sequence is requeued at the back. */
static void test_sched_budget_and_victims(void **state)
{
    struct fixture *f = *state;
    enum { N = 8, BLK = 4, T = 8 };
    static struct result base[N], tight[N];
    struct engine_params p;
    params(&p, N, 512, 64, 0);
    p.kv_block = BLK;
    run_engine(f, &p, f->prompt, f->n_prompt, N, 0, 0, base, NULL);
    int32_t most = 0; /* blocks of the largest request */
    for (int i = 0; i < N; i++) {
        int32_t b = (int32_t)((f->n_prompt[i] + GEN + BLK - 1) / BLK);
        most = b > most ? b : most;
    }
    size_t blk = engine_model_kv_block_bytes(f->m, BLK, KERN_KV_F16);
    params(&p, 6, T, 0, 0);
    p.kv_block = BLK;
    p.kv_mem = (size_t)(2 * most) * blk; /* about two requests at a time */
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    for (int i = 0; i < N; i++) {
        struct engine_request r = {0};
        char id[32];
        snprintf(id, sizeof(id), "req-%d", i);
        r.prompt = f->prompt[i];
        r.n_prompt = f->n_prompt[i];
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = 0;
        r.sampling.seed = 42 + (uint64_t)i;
        r.max_tokens = GEN;
        r.ignore_eos = 1;
        r.request_id = id;
        r.user = &tight[i];
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    uint64_t max_batch = 0, victims = 0;
    int done = 0;
    while (engine_pending(e)) {
        struct seq *run[6];
        uint64_t admitted[6];
        int pre[6];
        const int n_run = e->n_running;
        for (int i = 0; i < n_run; i++) {
            run[i] = e->running[i];
            admitted[i] = run[i]->admitted;
            pre[i] = run[i]->preemptions;
        }
        struct engine_stats st0 = *engine_get_stats(e);
        assert_int_equal(engine_step(e, &err), ST_OK);
        const struct engine_stats *st = engine_get_stats(e);
        uint64_t nb = st->batch_tokens - st0.batch_tokens;
        assert_true(nb >= 1 && nb <= T);
        max_batch = nb > max_batch ? nb : max_batch;
        uint64_t newest_kept = 0, oldest_victim = UINT64_MAX, n_pre = 0;
        for (int i = 0; i < n_run; i++) {
            if (run[i]->preemptions > pre[i]) {
                n_pre += (uint64_t)(run[i]->preemptions - pre[i]);
                oldest_victim = admitted[i] < oldest_victim ? admitted[i] : oldest_victim;
            } else if (admitted[i] > newest_kept) {
                newest_kept = admitted[i];
            }
        }
        assert_int_equal(n_pre, st->preemptions - st0.preemptions);
        if (n_pre && oldest_victim < newest_kept)
            fail_msg("preempted a sequence admitted %llu while one admitted %llu kept running",
                     (unsigned long long)oldest_victim, (unsigned long long)newest_kept);
        victims += n_pre;
        int fresh = 0; /* a never-admitted request was seen in the queue */
        for (const struct seq *s = e->wait_head; s; s = s->next) {
            if (s->n_cached == (size_t)-1)
                fresh = 1;
            else if (fresh)
                fail_msg("a preempted sequence waits behind a request never admitted");
        }
        struct engine_output o[N];
        size_t k = engine_poll(e, o, N);
        for (size_t j = 0; j < k; j++, done++) {
            struct result *rr = o[j].user;
            memcpy(rr->tok, o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
            rr->n = o[j].n_tokens;
        }
    }
    assert_int_equal(done, N);
    print_message("pool of %d blocks: %llu preemptions, largest batch %llu tokens\n", 2 * most,
                  (unsigned long long)victims, (unsigned long long)max_batch);
    assert_true(victims > 0);
    assert_int_equal(max_batch, T);
    check_ok(engine_get_kv(e), 1);
    engine_free(e);
    assert_same(base, tight, N, "scheduled under a small pool");
}

/* Sampled tokens do not depend on how many host threads sample them (each request has its own
 * RNG, each thread its own scratch): 1, 3 and the default give the same tokens; a negative
 * count is refused. Fails if a thread's sampler state or split leaked into the draws. */
static void test_host_threads(void **state)
{
    struct fixture *f = *state;
    enum { N = 16 };
    static struct result a[N], b[N];
    struct engine_params p;
    params(&p, N, 512, 64, 0);
    p.host_threads = 1;
    run_engine(f, &p, f->prompt, f->n_prompt, N, 0, 1, a, NULL);
    const int counts[] = {3, 0};
    for (int t = 0; t < 2; t++) {
        p.host_threads = counts[t];
        run_engine(f, &p, f->prompt, f->n_prompt, N, 0, 1, b, NULL);
        assert_same(a, b, N, "host threads");
    }
    struct engine *e;
    struct err_detail err = {0};
    p.host_threads = -1;
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_ERR_INVALID_ARG);
}

/* Request timestamps and warm-up. */
static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

struct times_seen {
    double added0, added1; /* just before and just after engine_add_request */
    double first_text;     /* first on_text call */
    double last_text;      /* latest on_text call */
    int calls;             /* on_text calls */
};

static void times_cb(void *user, const char *text, size_t n)
{
    struct times_seen *t = user;
    (void)text;
    (void)n;
    t->last_text = mono_now();
    if (!t->calls++)
        t->first_text = t->last_text;
}

/* Run prompts 0..n-1 greedily (GEN tokens) on an engine with parameters p, after
 * engine_warmup when warm; checks every output's timestamps against what the caller saw (both
 * use the monotonic clock, engine.h): added <= t_arrival <= t_first <= the first streamed
 * text, the last streamed text <= t_finish <= the poll that returned it. Fails if t_arrival is
 * taken at admission rather than arrival, if t_first is moved by later tokens, or if t_finish is
 * not the completion time. The run's stats (engine and KV) go to st and kst. */
static void run_timed(struct fixture *f, const struct engine_params *p, int n, int warm,
                      struct engine_stats *st, struct engine_kv_stats *kst)
{
    struct engine *e;
    struct err_detail err = {0};
    static struct times_seen seen[8];
    assert_true(n <= 8);
    memset(seen, 0, sizeof(seen));
    assert_int_equal(engine_init(&e, f->m, f->tok, p, &err), ST_OK);
    const struct engine_kv *kv = engine_get_kv(e);
    if (warm) {
        /* the warm-up leaves nothing behind: no request, no stats, no cached block */
        assert_int_equal(engine_warmup(e, &err), ST_OK);
        struct engine_output o;
        assert_int_equal(engine_poll(e, &o, 1), 0);
        assert_int_equal(engine_pending(e), 0);
        const struct engine_stats *s0 = engine_get_stats(e);
        assert_true(s0->steps == 0 && s0->batch_tokens == 0 && s0->batch_seqs == 0 &&
                    s0->prompt_tokens == 0 && s0->gen_tokens == 0 && s0->preemptions == 0 &&
                    s0->peak_blocks_used == 0);
        assert_true(kv->stats.lookup_blocks == 0 && kv->stats.hit_blocks == 0 &&
                    kv->stats.evictions == 0);
        assert_int_equal(kv->n_lru, 0);
        assert_int_equal(engine_kv_free_blocks(kv), kv->n_blocks);
        check_ok(kv, 1);
    }
    for (int i = 0; i < n; i++) {
        struct engine_request r = {0};
        r.prompt = f->prompt[i];
        r.n_prompt = f->n_prompt[i];
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = 0;
        r.max_tokens = GEN;
        r.ignore_eos = 1;
        r.request_id = "timed";
        r.user = &seen[i];
        r.on_text = times_cb;
        seen[i].added0 = mono_now();
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
        seen[i].added1 = mono_now();
    }
    int done = 0;
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        struct engine_output o[8];
        size_t k = engine_poll(e, o, 8);
        double polled = mono_now();
        for (size_t j = 0; j < k; j++, done++) {
            const struct times_seen *t = o[j].user;
            assert_int_equal(o[j].n_tokens, GEN);
            assert_true(t->calls > 1);
            assert_times_ordered(&o[j]);
            if (!(t->added0 <= o[j].t_arrival && o[j].t_arrival <= t->added1 &&
                  o[j].t_first <= t->first_text && t->last_text <= o[j].t_finish &&
                  o[j].t_finish <= polled))
                fail_msg("request %d: added %.9f..%.9f, text %.9f..%.9f, polled %.9f; "
                         "arrival %.9f, first %.9f, finish %.9f",
                         (int)(t - seen), t->added0, t->added1, t->first_text, t->last_text, polled,
                         o[j].t_arrival, o[j].t_first, o[j].t_finish);
        }
    }
    assert_int_equal(done, n);
    *st = *engine_get_stats(e);
    *kst = kv->stats;
    engine_free(e);
}

/* Timestamps are those of arrival, first token and completion (run_timed), and the warm-up is
 * not counted: after engine_warmup the same requests give exactly the engine and KV stats of an
 * engine that never warmed up. Two slots for four requests, so two wait; 4-token blocks, so the
 * warm-up's 8-token prompt has full blocks to look up and cache. Fails if the warm-up's steps,
 * tokens, peak blocks or prefix-cache lookups stay in the stats, or its blocks stay cached. */
static void test_request_times_and_warmup(void **state)
{
    struct fixture *f = *state;
    struct engine_params p;
    struct engine_stats st[2];
    struct engine_kv_stats kst[2];
    params(&p, 2, 64, 64, 1);
    p.kv_block = 4;
    for (int warm = 0; warm < 2; warm++)
        run_timed(f, &p, 4, warm, &st[warm], &kst[warm]);
    assert_true(st[0].steps > 0 && st[0].gen_tokens == 4 * GEN && kst[0].lookup_blocks > 0);
    assert_int_equal(st[1].steps, st[0].steps);
    assert_int_equal(st[1].batch_tokens, st[0].batch_tokens);
    assert_int_equal(st[1].batch_seqs, st[0].batch_seqs);
    assert_int_equal(st[1].prompt_tokens, st[0].prompt_tokens);
    assert_int_equal(st[1].gen_tokens, st[0].gen_tokens);
    assert_int_equal(st[1].preemptions, st[0].preemptions);
    assert_int_equal(st[1].peak_blocks_used, st[0].peak_blocks_used);
    assert_int_equal(kst[1].lookup_blocks, kst[0].lookup_blocks);
    assert_int_equal(kst[1].hit_blocks, kst[0].hit_blocks);
    assert_int_equal(kst[1].evictions, kst[0].evictions);
}

/* engine_get_load and the live token count, as a progress display reads them mid-run: before
 * any request finishes, gen_tokens already counts the tokens sampled, the requests are running
 * and hold KV blocks; once drained nothing runs and no block is referenced. Fails if tokens were
 * counted only at completion, or the load were not kept current. */
static void test_live_load(void **state)
{
    struct fixture *f = *state;
    struct engine *e;
    struct err_detail err = {0};
    struct engine_params p;
    params(&p, 4, 64, 64, 1);
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    struct engine_load ld;
    engine_get_load(e, &ld);
    assert_int_equal(ld.running, 0);
    assert_int_equal(ld.waiting, 0);
    assert_int_equal(ld.kv_used, 0);
    assert_int_equal(ld.kv_total, engine_get_kv(e)->n_blocks);
    assert_true(ld.kv_total > 0);
    for (int i = 0; i < 4; i++) {
        struct engine_request r = {0};
        r.prompt = f->prompt[i];
        r.n_prompt = f->n_prompt[i];
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = 0;
        r.max_tokens = GEN;
        r.ignore_eos = 1;
        r.request_id = "load";
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    engine_get_load(e, &ld);
    assert_int_equal(ld.running, 0);
    assert_int_equal(ld.waiting, 4);
    struct engine_output o[4];
    int steps = 0;
    while (engine_get_stats(e)->gen_tokens < 2 * 4) { /* two tokens each, none finished */
        assert_int_equal(engine_step(e, &err), ST_OK);
        assert_int_equal(engine_poll(e, o, 4), 0);
        assert_true(++steps < 64);
    }
    engine_get_load(e, &ld);
    assert_int_equal(ld.running, 4);
    assert_int_equal(ld.waiting, 0);
    assert_true(ld.kv_used >= 4 && ld.kv_used <= ld.kv_total);
    assert_true(engine_get_stats(e)->prompt_tokens > 0);
    size_t done = 0;
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        done += engine_poll(e, o, 4);
    }
    done += engine_poll(e, o, 4);
    assert_int_equal(done, 4);
    assert_int_equal(engine_get_stats(e)->gen_tokens, 4 * GEN);
    engine_get_load(e, &ld);
    assert_int_equal(ld.running, 0);
    assert_int_equal(ld.waiting, 0);
    assert_int_equal(ld.kv_used, 0);
    engine_free(e);
}

int main(void)
{
    const struct CMUnitTest kv_tests[] = {
        cmocka_unit_test(test_kv_refcount_and_lru),
        cmocka_unit_test(test_kv_lru_order),
        cmocka_unit_test(test_kv_check_detects_leak),
        cmocka_unit_test(test_kv_random_ops),
    };
    const struct CMUnitTest engine_tests[] = {
        cmocka_unit_test(test_rejects),
        cmocka_unit_test(test_streaming),
        cmocka_unit_test(test_accept_run),
        cmocka_unit_test(test_sched_budget_and_victims),
        cmocka_unit_test(test_host_threads),
        cmocka_unit_test(test_request_times_and_warmup),
        cmocka_unit_test(test_live_load),
        cmocka_unit_test(test_chunking_preemption_prefix),
        cmocka_unit_test(test_prefix_hit_logits),
        cmocka_unit_test(test_preemption_policy),
        cmocka_unit_test(test_batch_invariance_greedy),
        cmocka_unit_test(test_batch_invariance_sampled),
        cmocka_unit_test(test_batch_invariance_kv_q8),
        cmocka_unit_test(test_batch_invariance_bf16),
    };
    int rc = cmocka_run_group_tests_name("kv", kv_tests, NULL, NULL);
    return rc | cmocka_run_group_tests_name("engine", engine_tests, setup, teardown);
}
