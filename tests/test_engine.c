/* Engine tests on the real model: 64 prompts decoded together give exactly the tokens each
 * gives alone (greedy, and sampling with a seed per request); prefix-cache hits (bitwise
 * logits), chunked prefill and preemption with recompute change nothing; the newest sequence
 * is the one preempted and it is requeued first; request timestamps are ordered and the
 * warm-up is not counted; tokens and the load are counted live, before requests finish;
 * requests that cannot fit are rejected with an error; streamed text is the final text. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/cpus.h"
#include "tests/test_engine_util.h"

static void batch_invariance(struct fixture *f, int sampled, int kv_dtype)
{
    static struct result alone[N_PROMPTS], together[N_PROMPTS];
    const int np = n_prompts();
    struct engine_params p;
    params(&p, 1, 64, 64, 0);
    p.kv_dtype = kv_dtype;
    p.host_threads = 1; /* alone: one sampling thread; together: two */
    for (int i = 0; i < np; i++)
        run_engine(f, &p, &f->prompt[i], &f->n_prompt[i], 1, i, sampled, &alone[i], NULL);
    /* together: request i has the id and seed its solo run had (run_engine numbers it i).
     * They differ between requests, so every sequence has its own RNG key: sequences that
     * drew with each other's key or position would sample other tokens than alone. */
    struct engine_stats st;
    params(&p, 64, 512, 256, 0);
    p.kv_dtype = kv_dtype;
    p.host_threads = 2;
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
        if (sampled == 2) {
            r.sampling.temperature = 0.8f;
            r.sampling.top_p = 0.95f;
        }
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
    if (sampled == 2) { /* every batched draw went through the nucleus paths, and was counted */
        print_message("nucleus: %llu draws from candidates, %llu by whole-row ranking\n",
                      (unsigned long long)st.nucleus_fast, (unsigned long long)st.nucleus_full);
        assert_int_equal(st.nucleus_fast + st.nucleus_full, st.gen_tokens);
    }
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

/* Temperature 0.8 with top_p 0.95: the nucleus decided from candidates or the whole row, the
 * draw keyed by position, alone and in a batch of 64. */
static void test_batch_invariance_nucleus(void **state)
{
    batch_invariance(*state, 2, KERN_KV_F16);
}

/* The sampler's whole-row pass in the output projection's epilogue (kern_ops.matmul_hook):
 * requests of every kind of sampling (temperature alone, top_p, min_p, penalties, top_k,
 * greedy) in one batch draw exactly the tokens they draw with the pass on the host
 * (QUERN_SAMPLE_HOOK=0), and the rows that can take the epilogue are counted as taking it; the
 * greedy requests outlive the sampled ones, so the last steps are greedy only. */
static void test_sample_epilogue(void **state)
{
    struct fixture *f = *state;
    enum { NR = 24, G = 12 };
    static struct result res[2][NR];
    struct engine_stats st[2];
    uint64_t want_epilogue = 0;
    for (int off = 0; off < 2; off++) {
        if (off)
            setenv("QUERN_SAMPLE_HOOK", "0", 1);
        struct engine_params p;
        params(&p, NR, 512, 256, 0);
        p.host_threads = 2;
        struct engine *e;
        struct err_detail err = {0};
        assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
        for (int i = 0; i < NR; i++) {
            struct engine_request r = {0};
            char id[32];
            snprintf(id, sizeof(id), "ep-%d", i);
            r.prompt = f->prompt[i % n_prompts()];
            r.n_prompt = f->n_prompt[i % n_prompts()];
            engine_sampling_default(&r.sampling);
            struct engine_sampling *sp = &r.sampling;
            sp->temperature = 0.6f + 0.1f * (float)(i % 6);
            switch (i % 6) {
            case 1:
                sp->top_p = 0.9f;
                break;
            case 2:
                sp->min_p = 0.05f;
                break;
            case 3: /* penalties over the whole output: tokens in many chunks */
                sp->top_p = 0.95f;
                sp->repeat_penalty = 1.3f;
                sp->frequency_penalty = 0.4f;
                sp->presence_penalty = 0.6f;
                sp->repeat_last_n = -1;
                break;
            case 4:
                sp->top_k = 40;
                break; /* no epilogue: top_k ranks the raw row */
            case 5:
                sp->temperature = 0.0f;
                break; /* greedy in a sampled batch */
            default:
                break;
            }
            /* the sampled requests end first: the greedy ones' last steps are greedy only (and
             * must not take a row flag from the steps before) */
            const int n_tok = i % 6 == 5 ? G : G / 2;
            if (!off && i % 6 < 4)
                want_epilogue += (uint64_t)n_tok;
            sp->seed = 7 + (uint64_t)i;
            r.max_tokens = n_tok;
            r.ignore_eos = 1;
            r.request_id = id;
            r.user = &res[off][i];
            assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
        }
        while (engine_pending(e)) {
            if (engine_step(e, &err))
                fail_msg("step: %s", err.msg);
            struct engine_output o[NR];
            size_t k = engine_poll(e, o, NR);
            for (size_t j = 0; j < k; j++) {
                struct result *rr = o[j].user;
                memcpy(rr->tok, o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
                rr->n = o[j].n_tokens;
            }
        }
        st[off] = *engine_get_stats(e);
        engine_free(e);
        unsetenv("QUERN_SAMPLE_HOOK");
    }
    print_message("epilogue: %llu of %llu rows\n", (unsigned long long)st[0].sampled_epilogue,
                  (unsigned long long)st[0].gen_tokens);
    assert_int_equal(st[0].sampled_epilogue, want_epilogue);
    assert_int_equal(st[1].sampled_epilogue, 0);
    assert_same(res[1], res[0], NR, "epilogue");
    for (int i = 0; i < NR; i++)
        assert_int_equal(res[0][i].n, i % 6 == 5 ? G : G / 2);
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
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_BF16, 0, 1, 0};
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
    enum { N_MAX = 16 };
    /* 8 requests under sanitizers (ASan makes each run ~10x slower; 8 sequences of ~5 blocks
     * still overflow the 24-block pool, and the normal build runs all 16) */
    const int N = getenv("QUERN_SANITIZE") ? 8 : N_MAX;
    static struct result base[N_MAX], chunked[N_MAX], tight[N_MAX], cached[N_MAX];
    /* prompts sharing a 3-block prefix (48 tokens) plus their own question */
    int32_t *pr[N_MAX];
    size_t np[N_MAX];
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
    if (!getenv("QUERN_SANITIZE")) { /* sampled: the normal build (under sanitizers it adds
                                      * two runs and no memory path the greedy ones lack) */
        run_engine(f, &p, pr, np, N, 0, 1, tight, &st);
        assert_true(st.preemptions > 0);
        static struct result base_s[N_MAX];
        params(&p, 16, 512, 256, 0);
        run_engine(f, &p, pr, np, N, 0, 1, base_s, NULL);
        assert_same(base_s, tight, N, "preemption (sampled)");
    }
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
    /* admitted together (one step holds every prompt): the shared blocks are computed once,
     * the others wait a step for them (each computed them again before: a throughput audit
     * measured 1.33x the prompt work on identical lines) */
    params(&p, 16, 512, 256, 1);
    run_engine(f, &p, pr, np, N, 0, 0, cached, &st);
    assert_same(base, cached, N, "prefix cache, admitted together");
    uint64_t total = 0;
    for (int i = 0; i < N; i++) {
        total += np[i];
        if (i)
            assert_int_equal(cached[i].n_cached, 48);
    }
    assert_int_equal(st.prompt_tokens, total - (uint64_t)(N - 1) * 48);
    for (int i = 0; i < N; i++)
        free(pr[i]);
}

/* Identical prompts admitted together: the later copies wait for the first's blocks, each
 * keeping a free slot, so the distinct requests behind them cannot take every slot (a review:
 * passed over without one, a copy waited for a whole generation to finish). max_seqs 4: A1 and
 * B start, A2 and A3 start a step later from the cache, C only when a slot frees. */
static void test_shared_block_wait(void **state)
{
    struct fixture *f = *state;
    enum { N = 7 };
    static struct result res[N], alone[N];
    int32_t *pr[N];
    size_t np[N];
    for (int i = 0; i < N; i++) {
        int src = i < 3 ? 0 : i - 2; /* three copies of A, then B, C, D, E */
        np[i] = 48 + f->n_prompt[src];
        pr[i] = malloc(sizeof(int32_t) * np[i]);
        for (int k = 0; k < 48; k++)
            pr[i][k] = f->prompt[(src + k) % N_PROMPTS][k % f->n_prompt[(src + k) % N_PROMPTS]];
        memcpy(pr[i] + 48, f->prompt[src], sizeof(int32_t) * f->n_prompt[src]);
    }
    struct engine_params p;
    struct engine_stats st;
    params(&p, 4, 512, 256, 1);
    run_engine(f, &p, pr, np, N, 0, 0, res, &st);
    params(&p, 16, 512, 256, 0);
    run_engine(f, &p, pr, np, N, 0, 0, alone, NULL);
    assert_same(alone, res, N, "shared blocks waited for");
    for (int i = 1; i < 3; i++) { /* the copies: from the cache, before C */
        assert_int_equal(res[i].n_cached, (np[0] - 1) / 16 * 16);
        if (!(res[i].t_first < res[4].t_first))
            fail_msg("copy %d started after C (%.6f >= %.6f)", i, res[i].t_first, res[4].t_first);
    }
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
        assert_int_equal(kv->pool[0].n_lru, 4);
        assert_int_equal(engine_kv_prefix_attach(kv, 0, decoy, N, N), 2 * B);
        engine_kv_release(kv, 0);
        check_ok(kv, 1);
        engine_kv_free(kv);
    }
    free(cold);
    free(hit);
}

/* --kv-mem auto (kv_mem 0): a quarter of the memory available (with a draft model, the main
 * pool's share of it), at most max_seqs sequences at the full context, at least 1 GiB and one
 * such sequence where half the memory holds it (all of the first where less); 1 GiB where the
 * memory is unknown; engine_init makes it. (A sequence past half the memory: dummy.sh plans
 * Phi-3.5 mini's 131,072 tokens.) */
static void test_kv_mem_auto(void **state)
{
    struct fixture *f = *state;
    struct engine_params p;
    engine_params_default(&p);
    const uint64_t blk = engine_model_kv_block_bytes(f->m, p.kv_block, p.kv_dtype);
    const uint64_t per_seq = (uint64_t)(f->m->hp.n_ctx_train / p.kv_block + 1) * blk;
    const uint64_t gib = (uint64_t)1 << 30;
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 0), gib);
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 4 * gib), gib);
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 10 * gib + 3), 10 * gib / 4);
    assert_int_equal(engine_kv_mem_auto(f->m, &p, (uint64_t)1 << 50), 256 * per_seq);
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 100 << 20), gib); /* (not less than before) */
    p.max_seqs = 1;
    assert_int_equal(engine_kv_mem_auto(f->m, &p, (uint64_t)1 << 50), per_seq);
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 1 << 20), per_seq); /* all it can use */
    p.max_seqs = 1 << 16;
    assert_int_equal(engine_kv_mem_auto(f->m, &p, UINT64_MAX), (uint64_t)(1 << 16) * per_seq);
    p.max_seqs = 1;
    p.kv_dtype = KERN_KV_Q8;
    assert_int_equal(engine_kv_mem_auto(f->m, &p, (uint64_t)1 << 50),
                     (f->m->hp.n_ctx_train / p.kv_block + 1) *
                         engine_model_kv_block_bytes(f->m, p.kv_block, KERN_KV_Q8));

    /* a draft model (here the model itself: as many bytes a block) halves the main pool's
     * share of the quarter (its own pool has as many blocks); the floors hold (the audit of
     * stop 48: the draft's pool came on top, half the memory in all) */
    p.kv_dtype = KERN_KV_F16;
    p.max_seqs = 256;
    p.spec = ENGINE_SPEC_MODEL;
    p.draft_model = f->m;
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 40 * gib), 5 * gib);
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 4 * gib), gib);
    p.spec = 0;
    p.draft_model = NULL;
    assert_int_equal(engine_kv_mem_auto(f->m, &p, 40 * gib), 10 * gib);

    p.max_seqs = 2;
    p.max_batch_tokens = 64;
    p.kv_mem = 0;
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    assert_true(mem_available() > 0);
    assert_int_equal(engine_kv_pool_bytes(e), 2 * per_seq); /* (below 1 GiB: all of it) */
    assert_int_equal(engine_kv_n_blocks(engine_get_kv(e)), engine_kv_pool_bytes(e) / blk);
    engine_free(e);
}

/* --kv-mem auto on devices (engine_kv_mem_device): each device's free memory beyond its reserve
 * (5 %, at least 256 MiB), shared by the ranks on it, the least share times the ranks, at most
 * need. */
static void test_kv_mem_device(void **state)
{
    (void)state;
    const size_t mib = (size_t)1 << 20, gib = (size_t)1 << 30;
    assert_int_equal(engine_device_reserve(gib), 256 * mib);
    assert_int_equal(engine_device_reserve(80 * gib), 4 * gib);
    /* one rank: free less the reserve; need caps it; no room is 0 */
    struct kern_mem_info one = {10 * gib, 80 * gib, 0};
    assert_int_equal(engine_kv_mem_device(&one, 1, UINT64_MAX), 6 * gib);
    assert_int_equal(engine_kv_mem_device(&one, 1, gib), gib);
    one.avail = 3 * gib;
    assert_int_equal(engine_kv_mem_device(&one, 1, UINT64_MAX), 0);
    /* three ranks on one device (host-staged): the room split three ways, then the pool is
     * three shares; the least free memory any of them saw counts */
    struct kern_mem_info same[3] = {
        {7 * gib, 16 * gib, 0}, {8 * gib, 16 * gib, 0}, {8 * gib, 16 * gib, 0}};
    const uint64_t share = (7 * gib - (16 * gib) / 20) / 3;
    assert_int_equal(engine_kv_mem_device(same, 3, UINT64_MAX), 3 * share);
    /* ranks on their own devices: the device with the least room decides every rank's share */
    struct kern_mem_info own[2] = {{20 * gib, 80 * gib, 0}, {12 * gib, 80 * gib, 1}};
    assert_int_equal(engine_kv_mem_device(own, 2, UINT64_MAX), 2 * (8 * gib));
    /* two devices with two ranks each: device 1's two ranks share its room */
    struct kern_mem_info mix[4] = {{20 * gib, 80 * gib, 0},
                                   {20 * gib, 80 * gib, 1},
                                   {20 * gib, 80 * gib, 0},
                                   {20 * gib, 80 * gib, 1}};
    assert_int_equal(engine_kv_mem_device(mix, 4, UINT64_MAX), 4 * (8 * gib));
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
    r.max_tokens = 4000; /* fits the context, not the 64 MB pool (~1400 tokens): the pool's */
    assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_ERR_CAPACITY);
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
        assert_int_equal(kv->pool[0].n_lru, 0);
        assert_int_equal(engine_kv_available(kv), kv->pool[0].n_blocks);
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

/* The warm-up fits a model whose context is shorter than its 8 + 2 tokens (it failed there:
 * no run or bench could start), with and without speculation (whose step timing went to 64
 * positions); and leaves nothing behind. */
static void test_warmup_short_context(void **state)
{
    struct fixture *f = *state;
    struct engine_hparams *hp = (struct engine_hparams *)engine_model_hparams(f->m);
    const int keep = hp->n_ctx_train;
    static const int ctx[] = {2, 3, 9, 10};
    for (size_t c = 0; c < sizeof(ctx) / sizeof(ctx[0]); c++)
        for (int spec = 0; spec < 2; spec++) {
            hp->n_ctx_train = ctx[c];
            struct engine_params p;
            params(&p, 2, 64, 64, 1);
            p.kv_block = 4;
            p.spec = spec ? ENGINE_SPEC_NGRAM : 0;
            struct engine *e;
            struct err_detail err = {0};
            assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
            if (engine_warmup(e, &err) != ST_OK) {
                hp->n_ctx_train = keep; /* (the tests after this one use the model too) */
                fail_msg("context %d, spec %d: %s", ctx[c], spec, err.msg);
            }
            assert_int_equal(engine_pending(e), 0);
            assert_int_equal(engine_kv_pool_used(engine_get_kv(e), 0), 0);
            engine_free(e);
        }
    hp->n_ctx_train = keep;
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
    assert_int_equal(ld.kv_total, engine_get_kv(e)->pool[0].n_blocks);
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
    const struct CMUnitTest engine_tests[] = {
        cmocka_unit_test(test_rejects),
        cmocka_unit_test(test_kv_mem_auto),
        cmocka_unit_test(test_kv_mem_device),
        cmocka_unit_test(test_streaming),
        cmocka_unit_test(test_request_times_and_warmup),
        cmocka_unit_test(test_warmup_short_context),
        cmocka_unit_test(test_live_load),
        cmocka_unit_test(test_chunking_preemption_prefix),
        cmocka_unit_test(test_prefix_hit_logits),
        cmocka_unit_test(test_shared_block_wait),
        cmocka_unit_test(test_preemption_policy),
        cmocka_unit_test(test_batch_invariance_greedy),
        cmocka_unit_test(test_batch_invariance_sampled),
        cmocka_unit_test(test_batch_invariance_nucleus),
        cmocka_unit_test(test_sample_epilogue),
        cmocka_unit_test(test_batch_invariance_kv_q8),
        cmocka_unit_test(test_batch_invariance_bf16),
    };
    return cmocka_run_group_tests_name("engine", engine_tests, setup, teardown);
}
