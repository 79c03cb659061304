/* The architectures beyond SmolLM2's llama (engine/model.c): small random-weight GGUFs of
 * llama with Llama 3's RoPE frequency factors, qwen2 (Q/K/V biases), qwen3 (QK-norm, head_dim
 * not hidden / heads) and gemma3 (scaled embedding, QK-norm, post-norms, GeGLU, 5-token sliding
 * windows in five layers of six with their own RoPE base), gemma2, phi3 (fused Q/K/V and
 * gate/up) and phi3 with LongRoPE (each factor set; through the engine, the set chosen by
 * prompt + max_tokens and kept apart in the prefix cache), written by tools/gen_arch_fixtures.py
 * with the `gguf` package, against tools/ref_forward.py's float64 logits
 * (tests/fixtures/arch_ref.json) at every position: the prompt in one batch, one token at a time
 * over 4-token KV blocks (windows that start inside a block), and over two tensor-parallel ranks
 * (bitwise one rank's); with the sliding-window layers in their own small KV pool, bitwise the
 * one pool's, alone and through the engine (prefix cache, chunked prefill, preemption,
 * speculative rollback). An architecture quern does not run is a clear error. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "common/dtype.h"
#include "engine/engine.h"
#include "engine/kv_internal.h"
#include "engine/model_internal.h"
#include "engine/score.h"
#include "engine/spec.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "io/gguf_write.h"
#include "tests/test_util.h"

static cJSON *g_root; /* parsed arch_ref.json */

static int setup(void **state)
{
    size_t len;
    char *js = test_read_file("tests/fixtures/arch_ref.json", &len);
    if (!js || !(g_root = cJSON_Parse(js))) {
        fprintf(stderr, "missing or unreadable tests/fixtures/arch_ref.json\n");
        free(js);
        return -1;
    }
    free(js);
    *state = g_root;
    return 0;
}

static int teardown(void **state)
{
    cJSON_Delete(*state);
    return 0;
}

static uint32_t g_variant; /* run_seq's KV variant (LongRoPE: 1 = the long factors) */

/* Tokens [0, n) of one sequence in chunks of `chunk` over blocks of block_size, logits for
 * every position. n_local > 0: the sliding-window layers in their own pool of that many
 * blocks, each chunk's blocks reserved before it and the window slid after it. */
static void run_seq(struct engine_model *m, const int32_t *ids, int n, int chunk, int block_size,
                    int32_t n_local, float *logits)
{
    struct err_detail err = {0};
    struct engine_kv *kv;
    assert_true(n <= 64);
    if (!n_local) {
        assert_int_equal(engine_model_kv_init(m, &kv, n + 16, 1, block_size, KERN_KV_F16, &err),
                         ST_OK);
    } else {
        uint8_t local[64];
        for (int l = 0; l < m->hp.n_layer; l++)
            local[l] = (uint8_t)engine_model_layer_local(m, l);
        assert_int_equal(engine_kv_init(&kv, m->hp.n_layer, m->hp.n_kv_head, m->hp.head_dim,
                                        KERN_KV_F16, block_size, (n + 16) / block_size + 1, 1, 0,
                                        &err),
                         ST_OK);
        assert_int_equal(engine_kv_set_window(kv, local, m->hp.swa_window, n_local, &err), ST_OK);
        assert_int_equal(engine_model_kv_attach(m, kv, n, &err), ST_OK);
    }
    int32_t pos[64], seq[64] = {0};
    uint8_t want[64];
    engine_kv_set_variant(kv, 0, g_variant);
    for (int i = 0; i < n; i++) {
        pos[i] = i;
        want[i] = 1;
    }
    for (int i = 0; i < n; i += chunk) {
        int c = n - i < chunk ? n - i : chunk;
        assert_int_equal(engine_kv_reserve(kv, 0, i + c, &err), ST_OK);
        struct engine_batch b = {c, ids + i, pos + i, seq + i, want + i};
        assert_int_equal(engine_model_forward(m, kv, &b, logits + (size_t)i * m->hp.n_vocab, &err),
                         ST_OK);
        engine_kv_slide(kv, 0, i + c);
        assert_true(engine_kv_seq_held(kv, 0, 1) <= n_local);
    }
    assert_int_equal(engine_kv_check(kv, 0, &err), ST_OK);
    engine_kv_free(kv);
}

/* Largest |ours - reference| / (1 + |reference|) over all logits; top-1 must agree wherever the
 * reference's margin is clear. */
static double compare(const char *name, const char *how, const float *got, const cJSON *ref, int n,
                      int V)
{
    double worst = 0;
    for (int t = 0; t < n; t++) {
        const cJSON *row = cJSON_GetArrayItem(ref, t);
        assert_int_equal(cJSON_GetArraySize(row), V);
        int best_r = 0, best_g = 0;
        double r1 = -INFINITY, r2 = -INFINITY;
        for (int v = 0; v < V; v++) {
            const double r = cJSON_GetArrayItem(row, v)->valuedouble;
            const double d = fabs(got[(size_t)t * V + v] - r) / (1 + fabs(r));
            worst = d > worst ? d : worst;
            if (r > r1) {
                r2 = r1;
                r1 = r;
                best_r = v;
            } else if (r > r2) {
                r2 = r;
            }
            if (got[(size_t)t * V + v] > got[(size_t)t * V + best_g])
                best_g = v;
        }
        if (r1 - r2 > 0.01)
            assert_int_equal(best_g, best_r);
    }
    printf("  %-7s %-32s max |ours - ref| / (1 + |ref|) = %.2e\n", name, how, worst);
    return worst;
}

static void test_arch_logits(void **state)
{
    const cJSON *models = cJSON_GetObjectItem(*state, "models");
    assert_int_equal(cJSON_GetArraySize(models), 11);
    struct err_detail err = {0};
    struct kern_backend *be;
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_F32, 0, 1, 0};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    for (int i = 0; i < cJSON_GetArraySize(models); i++) {
        const cJSON *md = cJSON_GetArrayItem(models, i);
        const char *name = cJSON_GetObjectItem(md, "name")->valuestring;
        const char *file = cJSON_GetObjectItem(md, "file")->valuestring;
        const cJSON *toks = cJSON_GetObjectItem(md, "tokens");
        const cJSON *ref = cJSON_GetObjectItem(md, "logits");
        struct engine_model *m;
        if (engine_model_load(&m, file, be, &err))
            fail_msg("%s: %s", file, err.msg);
        const int n = cJSON_GetArraySize(toks), V = m->hp.n_vocab;
        int32_t ids[64];
        for (int t = 0; t < n; t++)
            ids[t] = (int32_t)cJSON_GetArrayItem(toks, t)->valueint;
        float *whole = malloc(sizeof(float) * (size_t)n * V);
        float *steps = malloc(sizeof(float) * (size_t)n * V);
        run_seq(m, ids, n, n, 16, 0, whole);
        run_seq(m, ids, n, 1, 4, 0, steps);
        /* f32 compute against float64, the same f16 KV rounding (LongRoPE's within 3e-3, as
         * below; a mixture of experts within 4e-3: its routing weights pass on more of the KV's
         * rounding where a value lies an ulp from where f16 rounds it otherwise: 0.7-2.4e-3
         * measured over the scalar, AVX2 and AVX-512 tables and the CUDA backend; wrong weights
         * move them by over 0.1) */
        const double tol = m->hp.n_expert ? 4e-3 : m->rope_long ? 3e-3 : 2e-3;
        assert_true(compare(name, "one batch", whole, ref, n, V) < tol);
        assert_true(compare(name, "a token at a time, 4-token blocks", steps, ref, n, V) < tol);
        /* the architecture's features are there: a gemma3 layer slides, qwen2's biases ... */
        if (!strcmp(name, "gemma2")) { /* every other layer sliding, soft-capped, no QK-norm */
            assert_true(m->layers[0].swa && !m->layers[1].swa && m->layers[2].swa);
            assert_true(!m->layers[0].q_norm && m->layers[1].post_attn_norm);
            assert_true(m->hp.attn_softcap == 4.0f && m->hp.final_softcap == 30.0f);
            assert_true(m->n_rope == 1);
        }
        if (m->hp.swa_window) {
            /* the sliding layers in their own pool, blocks out of the window given back and
             * reused: a pool of 3 (chunks of 1) or 4 (chunks of 7) 4-token blocks serves the
             * 6-block sequence, bitwise as the one pool does */
            float *win = malloc(sizeof(float) * (size_t)n * V);
            run_seq(m, ids, n, 1, 4, 3, win);
            assert_memory_equal(win, steps, sizeof(float) * (size_t)n * V);
            run_seq(m, ids, n, 7, 4, 0, steps);
            run_seq(m, ids, n, 7, 4, 4, win);
            assert_memory_equal(win, steps, sizeof(float) * (size_t)n * V);
            printf("  %-7s sliding-window pool of 3-4 blocks: bitwise one pool's\n", name);
            free(win);
        }
        if (!strcmp(name, "gemma3")) {
            assert_int_equal(m->hp.swa_window, 5);
            assert_true(m->layers[0].swa && !m->layers[5].swa && m->layers[0].post_ffn_norm);
            assert_int_equal(m->hp.head_dim, 32);
        }
        if (!strcmp(name, "qwen2"))
            assert_non_null(m->layers[0].bq);
        if (!strcmp(name, "qwen3"))
            assert_true(m->layers[0].q_norm && m->hp.head_dim == 32);
        if (!strcmp(name, "llama3"))
            assert_non_null(m->rope_freqs);
        if (!strcmp(name, "qwen3moe")) /* 3 of 8 experts 32 wide, an F16 router, QK-norm */
            assert_true(m->hp.n_expert == 8 && m->hp.n_expert_used == 3 && m->hp.n_ff == 32 &&
                        m->layers[0].router.type == DTYPE_F16 && m->layers[0].q_norm &&
                        m->layers[0].experts[3 * 7 + 2].ne1 == m->hp.n_embd);
        if (!strcmp(name, "mixtral")) /* llama with 2 of 4 experts 64 wide, an F32 router */
            assert_true(m->hp.arch == ENGINE_ARCH_LLAMA && m->hp.n_expert == 4 &&
                        m->hp.n_expert_used == 2 && m->hp.n_ff == 64 &&
                        m->layers[0].router.type == DTYPE_F32 && !m->layers[0].w_gate.data);
        if (!strcmp(name, "qwen2moe")) /* 2 of 6 experts, not renormalized; a shared one */
            assert_true(m->hp.arch == ENGINE_ARCH_QWEN2 && m->hp.n_expert == 6 &&
                        !m->hp.expert_norm && m->hp.n_ff == 32 && m->hp.n_ff_shexp == 64 &&
                        m->layers[0].bq && m->layers[0].shexp_gate.ne1 == 1 &&
                        m->layers[0].experts[3 * 6].ne1 == 64);
        if (!strcmp(name, "phi3_partial")) /* Phi-4-mini's: RoPE on 12 of 16, tied output */
            assert_true(m->hp.rope_dim == 12 && m->hp.head_dim == 16 && m->tied_output &&
                        m->rope_long);
        if (cJSON_GetObjectItem(md, "logits_long")) { /* phi3_longrope, phi3_partial */
            /* the long factors (a sequence that may pass the original 16 positions): their own
             * reference logits, one batch and a token at a time, and --tp 2 bitwise below;
             * within 3e-3, 11x inside what rounding the KV to f16 alone moves them (2.5e-2; the
             * two factor sets' logits differ by 2.2, a missing attention factor by 2.9) */
            assert_true(m->hp.rope_orig_ctx == 16 && m->hp.rope_mscale == 1.19f);
            assert_int_equal(engine_model_rope_variant(m, 16), 0);
            assert_int_equal(engine_model_rope_variant(m, 17), 1);
            const cJSON *lref = cJSON_GetObjectItem(md, "logits_long");
            float *lw = malloc(sizeof(float) * (size_t)n * V);
            g_variant = 1;
            run_seq(m, ids, n, n, 16, 0, lw);
            assert_true(compare(name, "long factors, one batch", lw, lref, n, V) < 3e-3);
            run_seq(m, ids, n, 1, 4, 0, lw);
            assert_true(compare(name, "long factors, a token at a time", lw, lref, n, V) < 3e-3);
            free(lw);
        }
        if (!strcmp(name, "phi3")) { /* Q, K, V and gate, up: row views of two matrices */
            assert_ptr_equal((const char *)m->layers[0].wk.data,
                             (const char *)m->layers[0].wq.data +
                                 m->layers[0].wq.ne1 * m->layers[0].wq.row_bytes);
            assert_true(m->layers[0].w_up.ne1 == m->hp.n_ff && m->hp.head_dim == 48 &&
                        !m->hp.swa_window && m->hp.rope_neox);
        }

        /* two ranks: bitwise one rank's logits */
        struct kern_group *g;
        struct kern_backend_opts to = {NULL, 2, NULL, KERN_ACT_F32, 0, 2, 0};
        struct engine_model *tm;
        assert_int_equal(kern_group_open(&g, &to, &err), ST_OK);
        if (engine_model_load_group(&tm, file, g, &err))
            fail_msg("%s --tp 2: %s", file, err.msg);
        float *tp = malloc(sizeof(float) * (size_t)n * V);
        run_seq(tm, ids, n, 7, 4, 0, tp);
        run_seq(m, ids, n, 7, 4, 0, steps);
        assert_memory_equal(tp, steps, sizeof(float) * (size_t)n * V);
        printf("  %-7s tp 2: bitwise one rank's at all %d positions%s\n", name, n,
               g_variant ? " (long factors)" : "");
        g_variant = 0;
        engine_model_free(tm);
        kern_group_free(g);
        free(tp);
        free(whole);
        free(steps);
        engine_model_free(m);
    }
    kern_backend_free(be);
}

#define WIN_REQS 10
#define WIN_GEN  14

/* Greedy tokens of WIN_REQS requests (a shared 13-token prefix, then 3-9 tokens of their own)
 * through an engine on the gemma3 fixture with parameters p (results in out), each request with
 * n_choices choices (all must agree, being greedy); the KV cache's state is checked after every
 * step. */
static void run_window_engine(struct engine_model *m, const struct engine_tok *tok,
                              const struct engine_params *p, int n_choices, int32_t out[][WIN_GEN],
                              struct engine_kv_stats *kst, int32_t *peak_local, int *preempted)
{
    int seen[WIN_REQS] = {0};
    struct err_detail err = {0};
    struct engine *e;
    assert_int_equal(engine_init(&e, m, tok, p, &err), ST_OK);
    for (int i = 0; i < WIN_REQS; i++) {
        int32_t prompt[24];
        const int n = 16 + i % 7;
        for (int t = 0; t < n; t++)
            prompt[t] = t < 13 ? (int32_t)(7 + 5 * t) % 128 : (int32_t)(11 * i + 3 * t) % 128;
        struct engine_request r = {0};
        r.prompt = prompt;
        r.n_prompt = (size_t)n;
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = 0;
        r.max_tokens = WIN_GEN;
        r.ignore_eos = 1;
        r.user = out[i];
        r.n_choices = n_choices;
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    *peak_local = 0;
    int done = 0;
    while (engine_pending(e)) {
        if (engine_step(e, &err))
            fail_msg("step: %s", err.msg);
        const struct engine_kv *kv = engine_get_kv(e);
        if (engine_kv_check(kv, 0, &err))
            fail_msg("KV check: %s", err.msg);
        const int32_t used = engine_kv_pool_used(kv, 1);
        *peak_local = used > *peak_local ? used : *peak_local;
        struct engine_output o[4];
        size_t k;
        while ((k = engine_poll(e, o, 4)) > 0)
            for (size_t j = 0; j < k; j++) {
                assert_int_equal(o[j].n_tokens, WIN_GEN);
                const int i = (int)(((int32_t(*)[WIN_GEN])o[j].user) - out);
                if (seen[i]++)
                    assert_memory_equal(out[i], o[j].tokens, sizeof(int32_t) * WIN_GEN);
                else
                    memcpy(out[i], o[j].tokens, sizeof(int32_t) * WIN_GEN);
                done++;
            }
    }
    assert_int_equal(done, WIN_REQS * n_choices);
    *kst = *engine_kv_get_stats(engine_get_kv(e));
    *preempted = (int)engine_get_stats(e)->preemptions;
    engine_free(e); /* checks that every block came back */
}

/* The engine with the sliding-window pool gives every request the tokens it gets with one pool
 * -- with the prefix cache attaching shared prompts (only as far as the window pool still has
 * their windows), prefill in chunks, sequences preempted for blocks, and speculative decoding
 * rolling drafts back, and choices forking their first choice's KV -- while the window pool
 * holds a fraction of the main pool's blocks. (The
 * fixture has no tokenizer; SmolLM2's turns the fixture's ids < 128 into text.) */
static void test_arch_engine_window(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct kern_backend *be;
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_F32, 0, 1, 0};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    struct engine_model *m;
    struct engine_tok *tok;
    struct io_gguf *sg;
    assert_int_equal(engine_model_load(&m, "tests/fixtures/arch/gemma3.gguf", be, &err), ST_OK);
    assert_int_equal(io_gguf_open(&sg, test_model_path(), &err), ST_OK);
    assert_int_equal(engine_tok_load(&tok, sg, &err), ST_OK);
    struct engine_params p;
    engine_params_default(&p);
    p.max_seqs = 4;
    p.max_batch_tokens = 12; /* prompts prefill in chunks */
    p.kv_block = 2;
    p.kv_mem = 36 * engine_model_kv_block_bytes(m, 2, KERN_KV_F16);
    static int32_t ref[WIN_REQS][WIN_GEN], got[WIN_REQS][WIN_GEN];
    struct engine_kv_stats ks;
    int32_t peak;
    int preempted;
    p.kv_window_pool = 0;
    run_window_engine(m, tok, &p, 1, ref, &ks, &peak, &preempted);
    assert_int_equal(peak, 0);
    assert_true(preempted > 0);
    for (int spec = 0; spec < 2; spec++) {
        p.kv_window_pool = 1;
        p.spec = spec ? ENGINE_SPEC_NGRAM : 0;
        run_window_engine(m, tok, &p, 1, got, &ks, &peak, &preempted);
        for (int i = 0; i < WIN_REQS; i++)
            assert_memory_equal(got[i], ref[i], sizeof(ref[i]));
        /* the plan gives the window pool what 4 sequences of 5-token windows (2 blocks, and 2
         * partial ones) and a 12-token step can ask, and 4 cached windows (4 x 4 + 6 + 4 x 3 =
         * 34 blocks): 5/6 of the layers in 34 blocks and 1/6 in the rest (46); with one pool,
         * 36 blocks in all */
        struct engine_kv_plan_in pin = {p.kv_mem, 2, KERN_KV_F16, 4, 12, 1};
        struct engine_kv_plan plan;
        engine_model_kv_plan(m, &pin, &plan);
        assert_int_equal(plan.n_local, 34);
        assert_int_equal(plan.n_main, 46);
        assert_true(peak > 0 && peak <= plan.n_local);
        /* (speculation's budget follows measured step times: its schedule, and whether it
         * preempts, varies from run to run) */
        assert_true(spec || preempted > 0);
        print_message("gemma3 engine, window pool%s: %d requests as with one pool; prefix hits "
                      "%llu of %llu blocks; window pool %lld blocks (peak %d held), main %lld; %d "
                      "preemptions\n",
                      spec ? " + speculation" : "", WIN_REQS, (unsigned long long)ks.hit_blocks,
                      (unsigned long long)ks.lookup_blocks, (long long)plan.n_local, peak,
                      (long long)plan.n_main, preempted);
        assert_true(ks.hit_blocks > 0);
    }
    /* three choices a request: the later ones fork the first's KV in both pools (or, where
     * the first has slid its window past what they need, take the prefix cache); 4-token
     * blocks, so that most prompts end inside a block the fork copies */
    p.spec = 0;
    p.kv_block = 4;
    p.kv_mem = 36 * engine_model_kv_block_bytes(m, 4, KERN_KV_F16);
    run_window_engine(m, tok, &p, 3, got, &ks, &peak, &preempted);
    for (int i = 0; i < WIN_REQS; i++)
        assert_memory_equal(got[i], ref[i], sizeof(ref[i]));
    print_message("gemma3 engine, window pool, 3 choices: %llu blocks forked, %llu copied, "
                  "prefix hits %llu\n",
                  (unsigned long long)ks.forked_blocks, (unsigned long long)ks.copied_blocks,
                  (unsigned long long)ks.hit_blocks);
    assert_true(ks.forked_blocks > 0 && ks.copied_blocks > 0);
    engine_tok_free(tok);
    io_gguf_close(sg);
    engine_model_free(m);
    kern_backend_free(be);
}

/* Greedy tokens (up to 12) of n requests with one prompt and the given max_tokens, through one
 * engine with room for `seqs` sequences at a time (1: each finds the earlier ones' blocks in the
 * prefix cache), each request with `choices` choices (which must agree), drafting with the
 * model itself when spec; the cache's hits in *hits, the engine's counters in *es. */
static void run_longrope(struct engine_model *m, const struct engine_tok *tok,
                         const int32_t *prompt, int n_prompt, const int *max_tokens, int n,
                         int seqs, int choices, int spec, int32_t out[][12], uint64_t *hits,
                         struct engine_stats *es)
{
    struct err_detail err = {0};
    struct engine_params p;
    engine_params_default(&p);
    p.max_seqs = seqs;
    p.kv_block = 2;
    p.kv_mem = 40 * engine_model_kv_block_bytes(m, 2, KERN_KV_F16);
    if (spec) {
        p.spec = ENGINE_SPEC_MODEL;
        p.draft_model = m;
        p.spec_budget = ENGINE_SPEC_BUDGET_ALL;
        p.spec_max_k = 3;
    }
    int seen[4] = {0};
    struct engine *e;
    if (engine_init(&e, m, tok, &p, &err))
        fail_msg("engine_init: %s", err.msg);
    for (int i = 0; i < n; i++) {
        struct engine_request r = {0};
        r.prompt = prompt;
        r.n_prompt = (size_t)n_prompt;
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = 0;
        r.max_tokens = max_tokens[i];
        r.ignore_eos = 1;
        r.user = out[i];
        r.n_choices = choices;
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    while (engine_pending(e)) {
        if (engine_step(e, &err))
            fail_msg("step: %s", err.msg);
        struct engine_output o[2];
        size_t k;
        while ((k = engine_poll(e, o, 2)) > 0)
            for (size_t j = 0; j < k; j++) {
                const int i = (int)((int32_t(*)[12])o[j].user - out);
                assert_true(i >= 0 && i < n && i < 4 && o[j].n_tokens == (size_t)max_tokens[i]);
                if (seen[i]++)
                    assert_memory_equal(out[i], o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
                else
                    memcpy(out[i], o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
            }
    }
    for (int i = 0; i < n; i++)
        assert_int_equal(seen[i], choices);
    *hits = engine_kv_get_stats(engine_get_kv(e))->hit_blocks;
    *es = *engine_get_stats(e);
    engine_free(e);
}

/* LongRoPE through the engine: a sequence whose forwards may pass the original context
 * (prompt + max_tokens - 1 > 16) gets the long factors, its whole life; one that may not, the
 * short ones (the first token of each is the fixture's reference argmax for that set); the
 * prefix cache shares blocks only between sequences of one set; choices forked from a first
 * one and a draft model (the model itself, in a KV cache of its own) keep the set; scoring a
 * window longer than the original context uses the long factors. */
static void test_arch_engine_longrope(void **state)
{
    const cJSON *models = cJSON_GetObjectItem(*state, "models");
    const cJSON *md = cJSON_GetArrayItem(models, 6);
    assert_string_equal(cJSON_GetObjectItem(md, "name")->valuestring, "phi3_longrope");
    struct err_detail err = {0};
    struct kern_backend *be;
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_F32, 0, 1, 0};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    struct engine_model *m;
    struct engine_tok *tok;
    struct io_gguf *sg;
    assert_int_equal(engine_model_load(&m, cJSON_GetObjectItem(md, "file")->valuestring, be, &err),
                     ST_OK);
    assert_int_equal(io_gguf_open(&sg, test_model_path(), &err), ST_OK);
    assert_int_equal(engine_tok_load(&tok, sg, &err), ST_OK);
    enum { NP = 8 };
    int32_t prompt[NP];
    for (int t = 0; t < NP; t++)
        prompt[t] = cJSON_GetArrayItem(cJSON_GetObjectItem(md, "tokens"), t)->valueint;
    int first[2]; /* the references' argmax after the prompt: short, long */
    for (int k = 0; k < 2; k++) {
        const cJSON *row =
            cJSON_GetArrayItem(cJSON_GetObjectItem(md, k ? "logits_long" : "logits"), NP - 1);
        first[k] = 0;
        for (int v = 1; v < cJSON_GetArraySize(row); v++)
            if (cJSON_GetArrayItem(row, v)->valuedouble >
                cJSON_GetArrayItem(row, first[k])->valuedouble)
                first[k] = v;
    }
    assert_int_not_equal(first[0], first[1]);
    static int32_t alone[2][1][12], both[3][12];
    uint64_t hits;
    struct engine_stats es;
    const int mt[3] = {9, 12, 9}; /* 8 + 9 - 1 = 16 positions: short; 8 + 12 - 1: long */
    for (int k = 0; k < 2; k++) {
        run_longrope(m, tok, prompt, NP, &mt[k], 1, 1, 1, 0, alone[k], &hits, &es);
        assert_int_equal(alone[k][0][0], first[k]);
    }
    /* short, long, short again in one engine: the long one finds no block of the first (its
     * 4 prompt blocks are all computed again), the third all of them but the last's */
    run_longrope(m, tok, prompt, NP, mt, 3, 1, 1, 0, both, &hits, &es);
    assert_memory_equal(both[0], alone[0][0], sizeof(int32_t) * 9);
    assert_memory_equal(both[1], alone[1][0], sizeof(int32_t) * 12);
    assert_memory_equal(both[2], alone[0][0], sizeof(int32_t) * 9);
    const uint64_t hits_seq = hits;
    /* the three at once, two choices each (the second forks the first's KV), drafting with
     * the model itself: the same tokens, every greedy draft accepted (a draft KV rotated with
     * the other set would propose other tokens) */
    run_longrope(m, tok, prompt, NP, mt, 3, 4, 2, 1, both, &hits, &es);
    assert_memory_equal(both[0], alone[0][0], sizeof(int32_t) * 9);
    assert_memory_equal(both[1], alone[1][0], sizeof(int32_t) * 12);
    assert_memory_equal(both[2], alone[0][0], sizeof(int32_t) * 9);
    assert_true(es.spec_drafted > 0 && es.spec_accepted == es.spec_drafted);
    /* scoring a 24-token window (past the original 16): the long factors' logits */
    {
        enum { NW = 24 };
        int32_t wt[NW];
        for (int t = 0; t < NW; t++)
            wt[t] = cJSON_GetArrayItem(cJSON_GetObjectItem(md, "tokens"), t)->valueint;
        struct engine_score_window w = {wt, NW, 1, 0, 0};
        struct engine_score_opts so = {1, 32, 4, KERN_KV_F16, NULL, NULL, NULL};
        double nll[NW];
        assert_int_equal(engine_score(m, &w, 1, &so, nll, &err), ST_OK);
        double worst[2] = {0, 0};
        for (int k = 0; k < 2; k++)
            for (int p = 1; p < NW; p++) { /* target p is predicted at position p - 1 */
                const cJSON *row = cJSON_GetArrayItem(
                    cJSON_GetObjectItem(md, k ? "logits_long" : "logits"), p - 1);
                double mx = -INFINITY, sum = 0;
                for (int v = 0; v < cJSON_GetArraySize(row); v++)
                    mx = fmax(mx, cJSON_GetArrayItem(row, v)->valuedouble);
                for (int v = 0; v < cJSON_GetArraySize(row); v++)
                    sum += exp(cJSON_GetArrayItem(row, v)->valuedouble - mx);
                const double ref = mx + log(sum) - cJSON_GetArrayItem(row, wt[p])->valuedouble;
                worst[k] = fmax(worst[k], fabs(nll[p - 1] - ref));
            }
        print_message("phi3_longrope scoring 24 tokens: max |nll - ref| %.2e with the long "
                      "factors' reference, %.2e with the short's\n",
                      worst[1], worst[0]);
        assert_true(worst[1] < 0.02 && worst[0] > 0.2);
    }
    hits = hits_seq;
    print_message("phi3_longrope engine: short and long factors by prompt + max_tokens, first "
                  "tokens %d / %d as the references; prefix hits %llu\n",
                  first[0], first[1], (unsigned long long)hits);
    assert_int_equal(hits, 3);
    engine_tok_free(tok);
    io_gguf_close(sg);
    engine_model_free(m);
    kern_backend_free(be);
}

/* A mixture of experts is batch-invariant: a sequence's logits in a batch with two others (24 +
 * 17 + 9 tokens: their slots in groups of at most 50, each expert's run split differently) are
 * bitwise its logits alone, in the exact, q8 and q16 matmul modes (bf16 needs AMX), at --tp 1
 * and 2. */
static void test_arch_moe_batch(void **state)
{
    const cJSON *models = cJSON_GetObjectItem(*state, "models");
    static const enum kern_act acts[3] = {KERN_ACT_F32, KERN_ACT_Q8, KERN_ACT_Q16};
    for (int i = 0; i < cJSON_GetArraySize(models); i++) {
        const cJSON *md = cJSON_GetArrayItem(models, i);
        const char *name = cJSON_GetObjectItem(md, "name")->valuestring;
        if (strcmp(name, "qwen3moe") && strcmp(name, "mixtral") && strcmp(name, "qwen2moe"))
            continue;
        const char *file = cJSON_GetObjectItem(md, "file")->valuestring;
        const cJSON *toks = cJSON_GetObjectItem(md, "tokens");
        const int n = cJSON_GetArraySize(toks);
        int32_t ids[64];
        for (int t = 0; t < n; t++)
            ids[t] = (int32_t)cJSON_GetArrayItem(toks, t)->valueint;
        for (int a = 0; a < 3; a++)
            for (int tp = 1; tp <= 2; tp++) {
                struct err_detail err = {0};
                struct kern_group *g;
                struct kern_backend_opts o = {NULL, 2, NULL, acts[a], 0, tp, 0};
                struct engine_model *m;
                assert_int_equal(kern_group_open(&g, &o, &err), ST_OK);
                if (engine_model_load_group(&m, file, g, &err))
                    fail_msg("%s: %s", file, err.msg);
                const int V = m->hp.n_vocab, lens[3] = {n, 17, 9}, total = n + 17 + 9;
                float *alone = malloc(sizeof(float) * (size_t)n * V);
                float *mixed = malloc(sizeof(float) * (size_t)total * V);
                run_seq(m, ids, n, n, 16, 0, alone);
                /* three sequences, their tokens interleaved in one batch */
                struct engine_kv *kv;
                assert_int_equal(engine_model_kv_init(m, &kv, 3 * 64, 3, 16, KERN_KV_F16, &err),
                                 ST_OK);
                int32_t bt[64 * 3], bp[64 * 3], bs[64 * 3], at[3] = {0, 0, 0};
                int k = 0;
                while (k < total)
                    for (int q = 0; q < 3; q++)
                        if (at[q] < lens[q]) {
                            bt[k] = q ? (int32_t)((7 * at[q] + 31 * q) % V) : ids[at[q]];
                            bp[k] = at[q]++;
                            bs[k++] = q;
                        }
                for (int q = 0; q < 3; q++)
                    assert_int_equal(engine_kv_reserve(kv, q, lens[q], &err), ST_OK);
                uint8_t want[64 * 3];
                memset(want, 1, sizeof(want));
                struct engine_batch b = {total, bt, bp, bs, want};
                assert_int_equal(engine_model_forward(m, kv, &b, mixed, &err), ST_OK);
                for (int t = 0, r = 0; t < total; t++)
                    if (bs[t] == 0)
                        assert_memory_equal(mixed + (size_t)t * V, alone + (size_t)r++ * V,
                                            sizeof(float) * (size_t)V);
                engine_kv_free(kv);
                free(alone);
                free(mixed);
                engine_model_free(m);
                kern_group_free(g);
            }
        printf("  %-7s in a batch of three sequences: bitwise alone (exact, q8, q16; tp 1, 2)\n",
               name);
    }
}

/* The qwen3moe fixture with one metadata key set (a u32, or with f32 set an f32), loaded without
 * a backend: its status, the message in msg. */
static enum status moe_with_key(const char *key, uint32_t v, int f32, float fv, char *msg,
                                size_t cap)
{
    struct err_detail err = {0};
    struct io_gguf *src, *g;
    struct io_gguf_writer *w;
    assert_int_equal(io_gguf_open(&src, "tests/fixtures/arch/qwen3moe.gguf", &err), ST_OK);
    assert_int_equal(io_gguf_writer_init(&w, &err), ST_OK);
    for (uint64_t i = 0; i < src->n_kv; i++) /* (the key itself replaced) */
        if (!io_gguf_str_eq(src->kv[i].key, key))
            assert_int_equal(io_gguf_writer_copy(w, &src->kv[i], &err), ST_OK);
    assert_int_equal(
        f32 ? io_gguf_writer_f32(w, key, fv, &err) : io_gguf_writer_u32(w, key, v, &err), ST_OK);
    for (uint64_t i = 0; i < src->n_tensors; i++) {
        const struct io_gguf_tensor *t = &src->tensors[i];
        assert_int_equal(io_gguf_writer_tensor(w, t->name, t->type, (int)t->n_dims, t->ne, &err),
                         ST_OK);
    }
    assert_int_equal(io_gguf_writer_open(w, &g, &err), ST_OK);
    io_gguf_writer_free(w);
    for (uint64_t i = 0; i < src->n_tensors; i++)
        memcpy((void *)g->tensors[i].data, src->tensors[i].data, src->tensors[i].nbytes);
    io_gguf_close(src);
    struct engine_model *m = NULL;
    const enum status st = engine_model_from_gguf(&m, g, NULL, &err);
    memcpy(msg, st ? err.msg : "", st ? cap : 1);
    if (st)
        io_gguf_close(g);
    engine_model_free(m); /* (it owns g) */
    return st;
}

/* Routing these architectures do not have is refused by its key (llama.cpp runs Mixtral and
 * Qwen3-MoE with softmax gating and the chosen weights renormalized, whatever else a file
 * says), and the keys' values that mean exactly that routing are accepted. */
static void test_moe_routing_keys(void **state)
{
    (void)state;
    char msg[sizeof(((struct err_detail *)0)->msg)];
    static const struct {
        const char *key;
        uint32_t v;
        int f32;
        float fv;
        enum status want;
    } cases[] = {
        {"qwen3moe.expert_shared_count", 1, 0, 0, ST_ERR_UNSUPPORTED},
        {"qwen3moe.expert_shared_count", 0, 0, 0, ST_OK},
        {"qwen3moe.expert_gating_func", 2, 0, 0, ST_ERR_UNSUPPORTED}, /* sigmoid */
        {"qwen3moe.expert_gating_func", 1, 0, 0, ST_OK},              /* softmax */
        {"qwen3moe.expert_group_count", 4, 0, 0, ST_ERR_UNSUPPORTED},
        {"qwen3moe.expert_weights_scale", 0, 1, 2.5f, ST_ERR_UNSUPPORTED},
        {"qwen3moe.expert_weights_scale", 0, 1, 1.0f, ST_OK},
        {"qwen3moe.expert_used_count", 9, 0, 0, ST_ERR_UNSUPPORTED}, /* more than 8 experts */
        /* 0 experts: a dense model (as llama.cpp takes it), which this file's tensors are not */
        {"qwen3moe.expert_count", 0, 0, 0, ST_ERR_NOT_FOUND},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const enum status st =
            moe_with_key(cases[i].key, cases[i].v, cases[i].f32, cases[i].fv, msg, sizeof(msg));
        if (st != cases[i].want)
            fail_msg("%s: status %d, want %d (%s)", cases[i].key, st, cases[i].want, msg);
        if (st) {
            printf("  %s\n", msg);
            assert_true(strstr(msg, cases[i].key) || strstr(msg, "used") ||
                        strstr(msg, "blk.0.ffn_gate.weight' is missing"));
        }
    }
}

static struct kern_ops g_cpu_ops; /* the CPU backend's, which fail_prepare wraps */
static int g_prepares, g_fail_at; /* prepare calls so far; the one that fails */

static enum status fail_prepare(struct kern_backend *b, struct kern_tensor *w,
                                struct err_detail *err)
{
    if (++g_prepares == g_fail_at)
        return err_set(err, ST_ERR_NOMEM, "no memory (prepare call %d, failed on purpose)",
                       g_prepares);
    return g_cpu_ops.prepare(b, w, err);
}

/* A weight that fails to prepare (a device out of memory) fails the load with its status and
 * frees what was made, whichever it is: a layer's attention matrices, before the rank has its own
 * list of experts (their list was freed twice), an expert, the router. Under the sanitizers a
 * double free or a leak fails this. */
static void test_moe_prepare_fails(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct kern_backend *real;
    struct kern_backend_opts ko = {NULL, 1, NULL, KERN_ACT_Q8, 0, 1, 0};
    assert_int_equal(kern_backend_open(&real, &ko, &err), ST_OK);
    g_cpu_ops = *real->ops;
    if (!g_cpu_ops.prepare) {
        printf("  (this backend prepares nothing)\n");
        kern_backend_free(real);
        return;
    }
    struct kern_ops ops = g_cpu_ops;
    ops.prepare = fail_prepare;
    struct kern_backend be = *real;
    be.ops = &ops;
    /* per layer: q, k, v, o (calls 1-4), the experts' matrices, the router, (qwen2moe) the
     * shared expert's gate; last the output head */
    static const struct {
        const char *name;
        int at[9], calls;
    } cases[] = {
        {"qwen3moe", {1, 4, 7, 28, 29, 30, 33, 59, 140}, 6 * 29 + 1},
        {"qwen2moe", {1, 4, 5, 25, 26, 27, 28, 54, 163}, 6 * 27 + 1},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        char path[96];
        snprintf(path, sizeof(path), "tests/fixtures/arch/%s.gguf", cases[c].name);
        for (size_t i = 0; i < 9; i++) {
            struct engine_model *m = NULL;
            g_prepares = 0;
            g_fail_at = cases[c].at[i];
            assert_int_equal(engine_model_load(&m, path, &be, &err), ST_ERR_NOMEM);
            assert_null(m);
            assert_non_null(strstr(err.msg, "failed on purpose"));
        }
        g_fail_at = 0; /* and whole: every call made */
        struct engine_model *m = NULL;
        g_prepares = 0;
        assert_int_equal(engine_model_load(&m, path, &be, &err), ST_OK);
        printf("  %s: %d prepare calls; a failure at any of 9 of them fails the load cleanly\n",
               cases[c].name, g_prepares);
        assert_int_equal(g_prepares, cases[c].calls);
        engine_model_free(m);
    }
    kern_backend_free(real);
}

static void test_unsupported_arch(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct engine_model *m = NULL;
    assert_int_equal(engine_model_load(&m, "tests/fixtures/arch/phi2.gguf", NULL, &err),
                     ST_ERR_UNSUPPORTED);
    assert_null(m);
    printf("  %s\n", err.msg);
    assert_non_null(strstr(err.msg, "architecture 'phi2' is not supported"));
    assert_non_null(
        strstr(err.msg, "llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma2, gemma3, phi3"));
}

/* A model file holding a NaN or an infinity is refused at load onto a backend, naming the tensor
 * (before, its text was garbage or empty and its perplexity the vocabulary size, with no word):
 * an F32 norm, a Q4_0 and a Q8_0 block's scale of the llama fixture, each patched in a copy.
 * Loaded without a backend, to be described (quern plan), it is not read through (a 70B plan
 * read every weight byte). */
static void test_damaged_weights(void **state)
{
    (void)state;
    size_t len = 0;
    char *buf = test_read_file("tests/fixtures/arch/llama3.gguf", &len);
    assert_non_null(buf);
    struct err_detail err = {0};
    struct io_gguf *g = NULL;
    assert_int_equal(io_gguf_open_mem(&g, buf, len, &err), ST_OK);
    static const struct {
        const char *tensor;
        size_t at;          /* byte within its data */
        unsigned char b[4]; /* written there */
        const char *where;  /* the message's row and element */
    } cases[] = {
        {"output_norm.weight", 12, {0x00, 0x00, 0xc0, 0x7f}, "row 0, element 3"}, /* f32 NaN */
        {"blk.1.attn_q.weight", 18 * 5, {0x00, 0x7c}, "row 2, element 32"},       /* Q4_0 block 5's
                                                                                      d: +inf */
        {"blk.0.ffn_down.weight", 0, {0x01, 0xfc}, "row 0, element 0"},           /* d: NaN */
    };
    char path[] = "/tmp/quern-damaged-XXXXXX";
    struct kern_backend *be;
    struct kern_backend_opts ko = {NULL, 1, NULL, KERN_ACT_F32, 0, 1, 0};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const struct io_gguf_tensor *t = io_gguf_find_tensor(g, cases[c].tensor);
        assert_non_null(t);
        char *copy = malloc(len);
        assert_non_null(copy);
        memcpy(copy, buf, len);
        const size_t off = (size_t)((const char *)t->data - buf) + cases[c].at;
        memcpy(copy + off, cases[c].b, t->type == DTYPE_F32 ? 4 : 2);
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        assert_int_equal(write(fd, copy, len), (ssize_t)len);
        close(fd);
        free(copy);
        struct engine_model *m = NULL;
        assert_int_equal(engine_model_load(&m, path, NULL, &err), ST_OK); /* described only */
        engine_model_free(m);
        m = NULL;
        assert_int_equal(engine_model_load(&m, path, be, &err), ST_ERR_FORMAT);
        assert_null(m);
        printf("  %s\n", err.msg);
        assert_non_null(strstr(err.msg, cases[c].tensor));
        assert_non_null(strstr(err.msg, "holds a NaN or an infinity"));
        assert_non_null(strstr(err.msg, cases[c].where));
        unlink(path);
        memcpy(path + strlen(path) - 6, "XXXXXX", 6);
    }
    kern_backend_free(be);
    io_gguf_close(g);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arch_logits),          cmocka_unit_test(test_arch_engine_window),
        cmocka_unit_test(test_arch_engine_longrope), cmocka_unit_test(test_unsupported_arch),
        cmocka_unit_test(test_damaged_weights),      cmocka_unit_test(test_arch_moe_batch),
        cmocka_unit_test(test_moe_routing_keys),     cmocka_unit_test(test_moe_prepare_fails),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
