/* Speculative decoding (engine_params.spec, engine/spec.h) on the real model: the tokens are
 * identical with drafting on and off, greedy and sampled (penalties included), whichever drafter
 * and budget; a first-token distribution with forced drafts matches the model's softmax by a
 * chi-square test, and the same test catches a deliberately wrong replacement of rejected drafts;
 * the KV pool and prefix cache stay consistent through many steps of random acceptance and
 * rollback. Unit checks of the drafters, the confidence bins and the step-cost model. */
#include "tests/test_engine_util.h"

#include <math.h>
#include <stdlib.h>

#include "engine/spec.h"
#include "io/gguf.h"
#include "jobs/schema.h"

#define SP_GEN 32
#define SP_MAX_REQ (N_PROMPTS + 8)

struct sp_out {
    int32_t tok[128];
    size_t n;
};

struct sp_set {
    int32_t *prompt[SP_MAX_REQ];
    size_t n_prompt[SP_MAX_REQ];
    int n;    /* prompts used */
    int made; /* prompts make_set encoded (from n_fixture on) */
};

/* The fixture's prompts plus repetitive ones (lists, code) where drafts get accepted. */
static void make_set(struct fixture *f, struct sp_set *s, int n_fixture)
{
    static const char *const rep[] = {
        "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
        "def get_a(self):\n    return self.a\n\ndef get_b(self):\n    return self.b\n\ndef get_c(self):",
        "<item><name>apple</name></item>\n<item><name>pear</name></item>\n<item><name>",
        "Monday, Tuesday, Wednesday, Thursday, Friday, Monday, Tuesday,",
        "The cat sat on the mat. The cat sat on the mat. The cat",
        "{\"id\": 1, \"ok\": true}\n{\"id\": 2, \"ok\": true}\n{\"id\": 3,",
        "a b c d e f g a b c d e f g a b c",
        "SELECT name FROM users;\nSELECT name FROM orders;\nSELECT name FROM",
    };
    struct err_detail err = {0};
    s->n = 0;
    for (int i = 0; i < n_fixture; i++) {
        s->prompt[s->n] = f->prompt[i];
        s->n_prompt[s->n++] = f->n_prompt[i];
    }
    for (size_t i = 0; i < sizeof(rep) / sizeof(rep[0]); i++) {
        assert_int_equal(engine_tok_encode(f->tok, rep[i], strlen(rep[i]), 0, &s->prompt[s->n],
                                           &s->n_prompt[s->n], &err),
                         ST_OK);
        s->n++;
    }
    s->made = s->n;
}

static void free_set(struct sp_set *s, int n_fixture)
{
    for (int i = n_fixture; i < s->made; i++)
        free(s->prompt[i]);
}

struct sp_cfg {
    float temperature, top_p, repeat_penalty;
    int max_tokens;
    struct engine_grammar *grammar; /* or NULL */
};

/* Tests only: run_set holds every sequence's drafting back until all of the set's requests
 * are decoding, so that they start drafting in the same step. */
static int sp_hold_drafts;

/* Run the set through an engine with p; out[i] gets request i's tokens. KV checked each step. */
static void run_set(struct fixture *f, const struct engine_params *p, const struct sp_set *s,
                    const struct sp_cfg *c, struct sp_out *out, struct engine_stats *stats)
{
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, p, &err), ST_OK);
    for (int i = 0; i < s->n; i++) {
        struct engine_request r = {0};
        char id[32];
        snprintf(id, sizeof(id), "sp-%d", i);
        r.prompt = s->prompt[i];
        r.n_prompt = s->n_prompt[i];
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = c->temperature;
        r.sampling.top_p = c->top_p;
        r.sampling.repeat_penalty = c->repeat_penalty;
        r.sampling.seed = 5;
        r.max_tokens = c->max_tokens;
        r.ignore_eos = !c->grammar; /* a grammar's output ends where the grammar lets it */
        r.grammar = c->grammar;
        r.request_id = id;
        r.user = &out[i];
        out[i].n = 0;
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    int held = sp_hold_drafts;
    for (struct seq *q = e->wait_head; held && q; q = q->next)
        q->spec_wait = 1 << 20;
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        check_ok(e->kv, 0);
        int decoding = 0;
        for (int i = 0; held && i < e->n_running; i++)
            decoding += e->running[i]->n_gen > 0;
        if (held && decoding == s->n) { /* every one decoding: all draft from the next step */
            for (int i = 0; i < e->n_running; i++)
                e->running[i]->spec_wait = 0;
            held = 0;
        }
        struct engine_output o[16];
        size_t k;
        while ((k = engine_poll(e, o, 16)) > 0)
            for (size_t i = 0; i < k; i++) {
                struct sp_out *so = o[i].user;
                assert_true(o[i].n_tokens <= 128);
                memcpy(so->tok, o[i].tokens, sizeof(int32_t) * o[i].n_tokens);
                so->n = o[i].n_tokens;
            }
    }
    if (stats)
        *stats = *engine_get_stats(e);
    engine_free(e);
}

static void assert_outs_same(const struct sp_out *a, const struct sp_out *b, int n,
                             const char *what)
{
    for (int i = 0; i < n; i++)
        if (a[i].n != b[i].n || memcmp(a[i].tok, b[i].tok, sizeof(int32_t) * a[i].n))
            fail_msg("%s: request %d differs (%zu vs %zu tokens)", what, i, a[i].n, b[i].n);
}

/* Drafting on (each drafter, each budget) gives the tokens drafting off gives. */
static void same_tokens(void **state, const struct sp_cfg *c, const char *what)
{
    struct fixture *f = *state;
    struct sp_set s;
    const int nf = getenv("QUERN_SANITIZE") ? 0 : 8;
    make_set(f, &s, nf);
    if (getenv("QUERN_SANITIZE")) /* each draft row costs the output head: keep it small */
        s.n = 4;
    static struct sp_out off[SP_MAX_REQ], on[SP_MAX_REQ];
    struct engine_params p;
    params(&p, 32, 256, 64, 1);
    run_set(f, &p, &s, c, off, NULL);
    static const struct {
        int spec, budget, k;
    } modes[] = {{ENGINE_SPEC_NGRAM, ENGINE_SPEC_BUDGET_ALL, 8},
                 {ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX, ENGINE_SPEC_BUDGET_AUTO, 3}};
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        p.spec = modes[m].spec;
        p.spec_budget = modes[m].budget;
        p.spec_max_k = modes[m].k;
        struct engine_stats st;
        run_set(f, &p, &s, c, on, &st);
        assert_outs_same(off, on, s.n, what);
        if (modes[m].budget == ENGINE_SPEC_BUDGET_ALL) { /* drafts happened, some held */
            assert_true(st.spec_drafted > 0);
            assert_true(st.spec_accepted > 0);
            assert_true(st.spec_accepted < st.spec_drafted);
        }
        print_message("%s, drafters %d budget %d k %d: %llu drafted, %llu accepted, %llu steps "
                      "(identical tokens)\n",
                      what, modes[m].spec, modes[m].budget, modes[m].k,
                      (unsigned long long)st.spec_drafted, (unsigned long long)st.spec_accepted,
                      (unsigned long long)st.steps);
    }
    free_set(&s, nf);
}

/* Tokens per request in the identity tests (fewer under sanitizers). */
static int sp_gen(void) { return getenv("QUERN_SANITIZE") ? 12 : SP_GEN; }

static void test_spec_greedy_same(void **state)
{
    struct sp_cfg c = {0.0f, 1.0f, 1.0f, sp_gen(), NULL};
    same_tokens(state, &c, "greedy");
}

static void test_spec_sampled_same(void **state)
{
    struct sp_cfg c = {0.8f, 0.95f, 1.1f, sp_gen(), NULL}; /* nucleus, history-dependent penalty */
    same_tokens(state, &c, "sampled");
}

/* Structured outputs: drafts are cut where the grammar cannot read them, each draft row gets
 * the mask of the grammar's state after the drafts before it; the tokens stay identical. */
static const char sp_schema[] =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":12},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",\"blue\"]},\"maxItems\":6}"
    "},"
    "\"required\":[\"name\",\"tags\"],\"additionalProperties\":false}";

static void test_spec_grammar_same(void **state)
{
    struct engine_grammar *g;
    struct err_detail err = {0};
    assert_int_equal(job_schema_grammar_text(JOB_FORMAT_JSON_SCHEMA, sp_schema, &g, &err), ST_OK);
    struct sp_cfg c = {0.0f, 1.0f, 1.0f, sp_gen() + 16, g};
    same_tokens(state, &c, "grammar, greedy");
    c.temperature = 0.8f;
    same_tokens(state, &c, "grammar, sampled");
    engine_grammar_unref(g);
}

/* The job's suffix index: identical requests one after another; from the second on, the first's
 * output is drafted from the index and accepted (greedy: every draft token). */
static void test_spec_suffix_learns(void **state)
{
    struct fixture *f = *state;
    struct sp_set s;
    s.n = 0;
    for (int i = 0; i < 4; i++) {
        s.prompt[s.n] = f->prompt[3];
        s.n_prompt[s.n++] = f->n_prompt[3];
    }
    struct engine_params p;
    params(&p, 1, 64, 64, 1); /* one at a time: each finishes before the next starts */
    p.spec = ENGINE_SPEC_SUFFIX;
    p.spec_budget = ENGINE_SPEC_BUDGET_ALL;
    struct sp_cfg c = {0.0f, 1.0f, 1.0f, SP_GEN, NULL};
    struct sp_out out[4];
    struct engine_stats st;
    run_set(f, &p, &s, &c, out, &st);
    for (int i = 1; i < 4; i++)
        assert_outs_same(&out[0], &out[i], 1, "repeat");
    print_message("suffix index: %llu of %llu draft tokens accepted, %llu steps\n",
                  (unsigned long long)st.spec_accepted, (unsigned long long)st.spec_drafted,
                  (unsigned long long)st.steps);
    /* requests 2..4 draft their whole output from request 1's, 8 tokens a step (the step's own
     * token after them): at least 3 x (SP_GEN - SP_GEN / 8 - 1) accepted, none rejected */
    assert_true(st.spec_accepted >= 3 * (SP_GEN - SP_GEN / 8 - 1));
    assert_true(st.spec_accepted == st.spec_drafted);
}

/* A draft model (here the model itself, on its own KV cache) drafts each token as the request's
 * sampler would draw it, with its random number for that position: with batch-invariant kernels
 * its logits are the verifier's, so every draft is accepted -- greedy, sampled (temperature,
 * top-p), penalised and under a grammar alike -- and the tokens are those of no speculation; the
 * draft KV is rolled back and released (engine_free checks). Drawn with other random numbers
 * than the verifier's, or taken as the argmax, sampled drafts are rejected now and then; paths
 * of the kinds chosen as learned mix both; the tokens never change. */
static void test_spec_draft_model(void **state)
{
    struct fixture *f = *state;
    struct sp_set s;
    make_set(f, &s, getenv("QUERN_SANITIZE") ? 0 : 4);
    if (getenv("QUERN_SANITIZE"))
        s.n = 3;
    static struct sp_out off[SP_MAX_REQ], on[SP_MAX_REQ];
    struct engine_params p;
    params(&p, 8, 256, 64, 1);
    p.kv_block = 4; /* rollbacks cross blocks */
    struct engine_stats st;
    struct engine_grammar *g;
    struct err_detail err = {0};
    assert_int_equal(job_schema_grammar_text(JOB_FORMAT_JSON_SCHEMA, sp_schema, &g, &err), ST_OK);
    const struct {
        const char *what;
        struct sp_cfg c;
        int draws; /* engine_params.spec_test_draws */
    } cases[] = {{"greedy", {0.0f, 1.0f, 1.0f, 0, NULL}, 1},
                 {"sampled, drawn", {0.8f, 1.0f, 1.0f, 0, NULL}, 1},
                 {"top-p, penalised, drawn", {1.0f, 0.9f, 1.3f, 0, NULL}, 1},
                 {"sampled, json_schema, drawn", {0.8f, 1.0f, 1.0f, 0, g}, 1},
                 {"greedy, penalised, json_schema", {0.0f, 1.0f, 1.3f, 0, g}, 0},
                 {"sampled, drawn apart", {0.8f, 1.0f, 1.0f, 0, NULL}, 3},
                 {"sampled, argmax", {0.8f, 1.0f, 1.0f, 0, NULL}, 2},
                 {"sampled, as learned", {0.8f, 1.0f, 1.0f, 0, NULL}, 0}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct sp_cfg c = cases[i].c;
        c.max_tokens = sp_gen() + (c.grammar ? 16 : 0);
        p.spec = 0;
        run_set(f, &p, &s, &c, off, NULL);
        p.spec = ENGINE_SPEC_MODEL;
        p.draft_model = f->m;
        p.spec_budget = ENGINE_SPEC_BUDGET_ALL;
        p.spec_max_k = 4;
        p.spec_test_draws = cases[i].draws;
        run_set(f, &p, &s, &c, on, &st);
        assert_outs_same(off, on, s.n, cases[i].what);
        print_message("draft model (itself), %s: %llu drafted, %llu accepted, %llu steps; paths "
                      "%llu drawn, %llu argmax\n",
                      cases[i].what, (unsigned long long)st.spec_drafted,
                      (unsigned long long)st.spec_accepted, (unsigned long long)st.steps,
                      (unsigned long long)st.spec_model_drawn,
                      (unsigned long long)st.spec_model_argmax);
        assert_true(st.spec_drafted > 0);
        if (c.temperature == 0) { /* the argmax, as the verifier's: penalties, mask and all */
            assert_true(st.spec_accepted == st.spec_drafted);
            assert_true(!st.spec_model_drawn && !st.spec_model_argmax);
            continue;
        }
        switch (cases[i].draws) {
        case 1:
            assert_true(st.spec_accepted == st.spec_drafted);
            assert_true(!st.spec_model_argmax && st.spec_model_drawn > 0);
            break;
        case 3:
            assert_true(st.spec_accepted < st.spec_drafted);
            break;
        case 2:
            assert_true(st.spec_accepted < st.spec_drafted && !st.spec_model_drawn);
            break;
        default:
            assert_true(st.spec_model_drawn > 0 && st.spec_model_argmax > 0);
        }
    }
    engine_grammar_unref(g);
    free_set(&s, getenv("QUERN_SANITIZE") ? 0 : 4);
}

/* A draft model with a shorter context than the target's (a second copy of the model, its
 * context cut to 32 tokens): a sequence past it drafts nothing, the others still draft (one
 * sequence past it used to fail the whole draft batch: no drafts at all while it ran), and the
 * tokens are those of no speculation. */
static void test_spec_draft_short_context(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct engine_model *dm = NULL;
    assert_int_equal(engine_model_load(&dm, test_model_path(), f->be, &err), ST_OK);
    ((struct engine_hparams *)engine_model_hparams(dm))->n_ctx_train = 32;
    struct sp_set s;
    make_set(f, &s, 0);
    /* the list prompt (~20 tokens) three times: past the draft's context from the start */
    static const char *const longp = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5,"
                                     " 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,";
    free(s.prompt[0]);
    assert_int_equal(
        engine_tok_encode(f->tok, longp, strlen(longp), 0, &s.prompt[0], &s.n_prompt[0], &err),
        ST_OK);
    assert_true(s.n_prompt[0] > 40);
    s.n = 4;
    static struct sp_out off[SP_MAX_REQ], on[SP_MAX_REQ];
    struct engine_params p;
    params(&p, 8, 256, 64, 1);
    p.kv_block = 4;
    struct sp_cfg c = {0.0f, 1.0f, 1.0f, 12, NULL};
    run_set(f, &p, &s, &c, off, NULL);
    p.spec = ENGINE_SPEC_MODEL;
    p.draft_model = dm;
    p.spec_budget = ENGINE_SPEC_BUDGET_ALL;
    p.spec_max_k = 4;
    struct engine_stats st;
    run_set(f, &p, &s, &c, on, &st);
    assert_outs_same(off, on, s.n, "draft model with a short context");
    print_message("draft model, 32-token context: %llu drafted, %llu accepted\n",
                  (unsigned long long)st.spec_drafted, (unsigned long long)st.spec_accepted);
    assert_true(st.spec_drafted > 0);
    free_set(&s, 0);
    engine_model_free(dm);
}

/* p drafts with the fixture's model itself, every draft verified, up to 3 a step. */
static void self_draft(struct fixture *f, struct engine_params *p)
{
    p->spec = ENGINE_SPEC_MODEL;
    p->draft_model = f->m;
    p->spec_budget = ENGINE_SPEC_BUDGET_ALL;
    p->spec_max_k = 3;
    p->spec_test_draws = 1; /* every path drawn: drafts that do not follow the schedule (the
                             * learned kinds alternate by path, and the schedule differs with
                             * and without a prefix cache) */
}

/* Four prompts that share a long prefix (their question differs): the tokens they share. */
static size_t shared_prefix_set(struct fixture *f, struct sp_set *s)
{
    static const char *const prefix =
        "You are a careful assistant. Answer in one short sentence and never use lists. "
        "Keep to the facts you are sure of, and say so when you are not. Question: ";
    static const char *const q[] = {"What is the capital of France?", "Why is the sky blue?",
                                    "How many legs has a spider?", "What is 7 times 8?"};
    struct err_detail err = {0};
    memset(s, 0, sizeof(*s));
    for (int i = 0; i < 4; i++) {
        char text[512];
        snprintf(text, sizeof(text), "%s%s", prefix, q[i]);
        assert_int_equal(
            engine_tok_encode(f->tok, text, strlen(text), 0, &s->prompt[i], &s->n_prompt[i], &err),
            ST_OK);
    }
    s->n = s->made = 4;
    size_t common = 0;
    for (int same = 1; same && common < s->n_prompt[0]; common += same)
        for (int i = 1; i < 4; i++)
            if (common >= s->n_prompt[i] || s->prompt[i][common] != s->prompt[0][common])
                same = 0;
    assert_true(common >= 32);
    return common;
}

/* The draft model's own prefix cache: requests that share a long prefix, two slots, so the later
 * ones find the prefix's blocks in the draft model's cache (before, the draft model computed
 * every request's whole prompt again: 6 prompts of ~8,150 tokens sharing a prefix took 5x
 * as long as without speculation); the tokens are those of no speculation, and the draft model
 * computes exactly what it found there fewer tokens than without the cache. */
static void test_spec_draft_prefix_cache(void **state)
{
    struct fixture *f = *state;
    struct sp_set s;
    const size_t common = shared_prefix_set(f, &s);
    static struct sp_out off[SP_MAX_REQ], on[SP_MAX_REQ];
    struct engine_params p;
    params(&p, 2, 256, 64, 1); /* two at a time: the last two start after the first two */
    p.kv_block = 4;
    struct sp_cfg c = {0.8f, 0.95f, 1.0f, getenv("QUERN_SANITIZE") ? 6 : 16, NULL};
    run_set(f, &p, &s, &c, off, NULL);
    self_draft(f, &p);
    struct engine_stats with, without;
    run_set(f, &p, &s, &c, on, &with);
    assert_outs_same(off, on, s.n, "draft model with its prefix cache");
    p.prefix_cache = 0;
    run_set(f, &p, &s, &c, on, &without);
    assert_outs_same(off, on, s.n, "draft model without a prefix cache");
    print_message("draft model prefix cache: %llu tokens computed, %llu found cached; without "
                  "the cache %llu computed\n",
                  (unsigned long long)with.spec_model_tokens,
                  (unsigned long long)with.spec_model_cached,
                  (unsigned long long)without.spec_model_tokens);
    assert_int_equal(without.spec_model_cached, 0);
    /* the last two requests each found the shared prefix's whole blocks */
    assert_true(with.spec_model_cached >= 2 * (common / 4 * 4));
    /* the same drafts either way (budget "all"), so what it found it did not compute */
    assert_int_equal(with.spec_model_tokens + with.spec_model_cached, without.spec_model_tokens);
    assert_true(with.spec_drafted > 0 && without.spec_drafted > 0);
    free_set(&s, 0);
}

/* The same four prompts all starting to draft in the same step (as when a busy run's budget
 * skipped drafting and the load then falls): the first computes the shared prefix in the draft
 * model, the other three wait for its blocks within the step and find them cached. */
static void test_spec_draft_prefix_same_step(void **state)
{
    struct fixture *f = *state;
    struct sp_set s;
    const size_t common = shared_prefix_set(f, &s);
    static struct sp_out off[SP_MAX_REQ], on[SP_MAX_REQ];
    struct engine_params p;
    params(&p, 4, 256, 64, 1);
    p.kv_block = 4;
    struct sp_cfg c = {0.0f, 1.0f, 1.0f, getenv("QUERN_SANITIZE") ? 6 : 12, NULL};
    run_set(f, &p, &s, &c, off, NULL);
    self_draft(f, &p);
    struct engine_stats st;
    sp_hold_drafts = 1;
    run_set(f, &p, &s, &c, on, &st);
    sp_hold_drafts = 0;
    assert_outs_same(off, on, s.n, "draft model, four sequences starting in one step");
    print_message("draft model, four starting in one step: %llu tokens computed, %llu found "
                  "cached (%zu prompt tokens shared)\n",
                  (unsigned long long)st.spec_model_tokens,
                  (unsigned long long)st.spec_model_cached, common);
    assert_true(st.spec_model_cached >= 3 * (common / 4 * 4));
    assert_true(st.spec_drafted > 0);
    free_set(&s, 0);
}

/* A draft model is refused unless its vocabulary is the model's token for token (it was
 * compared by count only: an edited or another family's vocabulary of the same size drafted
 * tokens that mean something else): a second copy of the model with one token's text cut. */
static void test_spec_draft_vocab(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct engine_model *dm = NULL;
    assert_int_equal(engine_model_load(&dm, test_model_path(), f->be, &err), ST_OK);
    char why[128];
    assert_true(engine_model_same_vocab(f->m, dm, why, sizeof(why)));
    const struct io_gguf_kv *kv = io_gguf_find_kv(engine_model_gguf(dm), "tokenizer.ggml.tokens");
    assert_non_null(kv);
    assert_true(kv->arr_n > 1000 && kv->strs[1000].len > 1);
    ((struct io_gguf_str *)kv->strs)[1000].len--; /* (the copy's reader-owned list) */
    assert_false(engine_model_same_vocab(f->m, dm, why, sizeof(why)));
    assert_string_equal(why, "token 1000 differs");
    struct engine_params p;
    params(&p, 2, 64, 64, 1);
    p.spec = ENGINE_SPEC_MODEL;
    p.draft_model = dm;
    struct engine *e = NULL;
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "the draft model's vocabulary is not the model's (token 1000"));
    engine_model_free(dm);
}

/* One greedy request of a repeating prompt alone, ngram drafts verified every step: its output
 * tokens (into out, at most 64) and the engine's counters. */
static int one_request(struct fixture *f, int max_tokens, const char *stop, int32_t *out,
                       struct engine_stats *st)
{
    static const char *const text = "a b c d e f g h a b c d e f g h a b c d e f g h a b";
    struct err_detail err = {0};
    int32_t *prompt = NULL;
    size_t np = 0;
    assert_int_equal(engine_tok_encode(f->tok, text, strlen(text), 0, &prompt, &np, &err), ST_OK);
    struct engine_params p;
    params(&p, 1, 64, 64, 1);
    p.spec = ENGINE_SPEC_NGRAM;
    p.spec_budget = ENGINE_SPEC_BUDGET_ALL;
    p.spec_max_k = 16;
    struct engine *e;
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    struct engine_request r = {0};
    r.prompt = prompt;
    r.n_prompt = np;
    engine_sampling_default(&r.sampling);
    r.sampling.temperature = 0;
    r.max_tokens = max_tokens;
    r.stop = &stop;
    r.n_stop = stop ? 1 : 0;
    r.request_id = "cut";
    assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    int n = 0;
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        struct engine_output o[2];
        size_t k;
        while ((k = engine_poll(e, o, 2)) > 0)
            for (size_t i = 0; i < k; i++) {
                assert_true(o[i].n_tokens <= 64);
                memcpy(out, o[i].tokens, sizeof(int32_t) * o[i].n_tokens);
                n = (int)o[i].n_tokens;
            }
    }
    *st = *engine_get_stats(e);
    engine_free(e);
    free(prompt);
    return n;
}

/* Drafts that matched after a stop string ended a request do not count as accepted (before, a
 * request of 10 tokens that a stop string ended showed 16 drafted and 16 accepted), and none
 * goes past a request's max_tokens (a guard the scheduler's k already kept). */
static void test_spec_counts_used(void **state)
{
    struct fixture *f = *state;
    int32_t out[64];
    struct engine_stats st;
    int n = one_request(f, 40, "f g h a b c d", out, &st);
    print_message("stop string: %d tokens, %llu drafted, %llu accepted\n", n,
                  (unsigned long long)st.spec_drafted, (unsigned long long)st.spec_accepted);
    assert_true(n > 0 && n < 40);
    assert_true(st.spec_drafted > 0);
    assert_true(st.spec_accepted <= (uint64_t)n); /* (the stop string's tokens are cut out) */
    assert_true(st.spec_accepted < st.spec_drafted);
    n = one_request(f, 2, NULL, out, &st);
    print_message("max_tokens 2: %d tokens, %llu drafted, %llu accepted\n", n,
                  (unsigned long long)st.spec_drafted, (unsigned long long)st.spec_accepted);
    assert_int_equal(n, 2);
    assert_true(st.spec_drafted <= 1); /* one token after the prefill's, at most */
    n = one_request(f, 9, NULL, out, &st);
    assert_int_equal(n, 9);
    assert_true(st.spec_accepted <= 8 && st.spec_drafted <= 8 + 16);
}

/* Chi-square statistic of counts against n x probs over the tokens expected at least 5 times
 * (the rest lumped into one cell); *df gets the degrees of freedom. */
static double chi_square(const int *counts, const double *probs, int V, int n, int *df)
{
    double chi = 0, rest_e = 0, rest_o = 0;
    int cells = 0;
    for (int t = 0; t < V; t++) {
        double ex = probs[t] * n;
        if (ex >= 5) {
            chi += (counts[t] - ex) * (counts[t] - ex) / ex;
            cells++;
        } else {
            rest_e += ex;
            rest_o += counts[t];
        }
    }
    if (rest_e >= 5) {
        chi += (rest_o - rest_e) * (rest_o - rest_e) / rest_e;
        cells++;
    }
    *df = cells - 1;
    return chi;
}

/* Upper 0.1 % point of chi-square with df degrees of freedom (Wilson-Hilferty). */
static double chi_crit(int df)
{
    const double z = 3.090;
    double a = 2.0 / (9.0 * df);
    return df * pow(1 - a + z * sqrt(a), 3);
}

/* First tokens of n requests (distinct ids) of a repetitive prompt whose ngram draft is forced
 * (budget all), temperature 1: their counts against the model's softmax. */
static double first_token_chi(struct fixture *f, int broken, int n, int *df,
                              struct engine_stats *st)
{
    const int V = engine_model_hparams(f->m)->n_vocab;
    struct err_detail err = {0};
    const char *text = "red green blue red green blue red green";
    int32_t *prompt;
    size_t np;
    assert_int_equal(engine_tok_encode(f->tok, text, strlen(text), 0, &prompt, &np, &err), ST_OK);
    /* the model's distribution of the first token: its logits after the prompt */
    struct engine_kv *kv;
    assert_int_equal(engine_model_kv_init(f->m, &kv, (int32_t)np + 4, 1, 16, KERN_KV_F16, &err),
                     ST_OK);
    assert_int_equal(engine_kv_reserve(kv, 0, (int32_t)np, &err), ST_OK);
    int32_t *pos = malloc(sizeof(int32_t) * np), *seq = calloc(np, sizeof(int32_t));
    for (size_t i = 0; i < np; i++)
        pos[i] = (int32_t)i;
    float *logits = malloc(sizeof(float) * (size_t)V);
    struct engine_batch b = {(int)np, prompt, pos, seq, NULL};
    assert_int_equal(engine_model_forward(f->m, kv, &b, logits, &err), ST_OK);
    engine_kv_release(kv, 0);
    engine_kv_free(kv);
    double *probs = malloc(sizeof(double) * (size_t)V), mx = -INFINITY, sum = 0;
    for (int t = 0; t < V; t++)
        mx = logits[t] > mx ? logits[t] : mx;
    for (int t = 0; t < V; t++)
        sum += probs[t] = exp(logits[t] - mx);
    for (int t = 0; t < V; t++)
        probs[t] /= sum;

    struct engine_params p;
    params(&p, 64, 256, 64, 1);
    p.kv_block = 4; /* the prompt's blocks come from the prefix cache */
    p.spec = ENGINE_SPEC_NGRAM;
    p.spec_budget = ENGINE_SPEC_BUDGET_ALL;
    p.spec_max_k = 2;
    p.spec_test_broken = broken;
    struct engine *e;
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    int *counts = calloc((size_t)V, sizeof(int));
    for (int i = 0; i < n; i++) {
        struct engine_request r = {0};
        char id[32];
        snprintf(id, sizeof(id), "chi-%d", i);
        r.prompt = prompt;
        r.n_prompt = np;
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = 1.0f;
        r.sampling.top_k = 0;
        r.sampling.top_p = 1.0f;
        r.max_tokens = 3;
        r.ignore_eos = 1;
        r.request_id = id;
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        struct engine_output o[64];
        size_t k;
        while ((k = engine_poll(e, o, 64)) > 0)
            for (size_t i = 0; i < k; i++)
                counts[o[i].tokens[0]]++;
    }
    *st = *engine_get_stats(e);
    engine_free(e);
    double chi = chi_square(counts, probs, V, n, df);
    free(counts);
    free(probs);
    free(logits);
    free(pos);
    free(seq);
    free(prompt);
    return chi;
}

static void test_spec_distribution(void **state)
{
    struct fixture *f = *state;
    const int san = getenv("QUERN_SANITIZE") != NULL, n = san ? 48 : 600;
    int df;
    struct engine_stats st;
    double chi = first_token_chi(f, 0, n, &df, &st);
    print_message("first tokens with drafts, %d samples: chi-square %.1f, df %d, 0.1%% critical "
                  "%.1f; %llu drafted, %llu accepted\n",
                  n, chi, df, chi_crit(df), (unsigned long long)st.spec_drafted,
                  (unsigned long long)st.spec_accepted);
    /* most requests drafted their first token (not those whose whole prompt filled a step), and
     * both outcomes happened */
    assert_true(st.spec_tried_at[0] >= (uint64_t)n / 2);
    assert_true(st.spec_acc_at[0] > 0 && st.spec_acc_at[0] < st.spec_tried_at[0]);
    assert_true(df >= 1);
    assert_true(chi < chi_crit(df));
    if (san) /* the test's power (below) is checked in the normal build of the same suite */
        return;
    /* the wrong replacement (a fresh draw that can repeat the rejected draft) must fail */
    double bad = first_token_chi(f, 1, n, &df, &st);
    print_message("deliberately wrong replacement: chi-square %.1f, df %d (must exceed %.1f)\n",
                  bad, df, chi_crit(df));
    assert_true(bad > chi_crit(df));
}

/* Many steps of speculative decoding with random acceptance (sampled, forced drafts of up to 8
 * tokens, KV blocks of 4 so rollbacks cross blocks, a pool small enough to preempt): the KV
 * check after every step, the leak check at the end (engine_free in debug builds). Steps from
 * QUERN_SPEC_STEPS (default 150; 16 under sanitizers). */
static void test_spec_rollback_invariants(void **state)
{
    struct fixture *f = *state;
    const char *env = getenv("QUERN_SPEC_STEPS");
    long want = env ? atol(env) : getenv("QUERN_SANITIZE") ? 16 : 150;
    struct sp_set s;
    make_set(f, &s, 8);
    struct engine_params p;
    params(&p, 16, 128, 4, 1); /* 45 blocks of 4: every request fits, 16 of them do not */
    p.kv_block = 4;
    p.spec = ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX;
    p.spec_budget = ENGINE_SPEC_BUDGET_ALL;
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    long steps = 0;
    int next = 0;
    while (steps < want) {
        while (engine_pending(e) < 16) { /* keep it full: a new request as one finishes */
            struct engine_request r = {0};
            char id[32];
            snprintf(id, sizeof(id), "rb-%d", next);
            r.prompt = s.prompt[next % s.n];
            r.n_prompt = s.n_prompt[next % s.n];
            engine_sampling_default(&r.sampling);
            r.sampling.temperature = 0.7f;
            r.max_tokens = 24 + next % 40;
            r.ignore_eos = next % 3 != 0;
            r.request_id = id;
            next++;
            assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
        }
        assert_int_equal(engine_step(e, &err), ST_OK);
        check_ok(e->kv, 0);
        steps++;
        struct engine_output o[16];
        while (engine_poll(e, o, 16) > 0)
            ;
    }
    const struct engine_stats *st = engine_get_stats(e);
    print_message("%ld steps, %llu with drafts, %llu drafted, %llu accepted, %llu preemptions, "
                  "%d requests\n",
                  steps, (unsigned long long)st->spec_steps, (unsigned long long)st->spec_drafted,
                  (unsigned long long)st->spec_accepted, (unsigned long long)st->preemptions,
                  next);
    assert_true(st->spec_steps >= (uint64_t)want / 4);
    assert_true(st->spec_accepted > 0 && st->spec_accepted < st->spec_drafted);
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        struct engine_output o[16];
        while (engine_poll(e, o, 16) > 0)
            ;
    }
    check_ok(e->kv, 1);
    engine_free(e);
    free_set(&s, 8);
}

/* ---- units: drafters, bins, cost model ---- */

static void test_spec_units(void **state)
{
    (void)state;
    struct engine_spec *sp;
    struct err_detail err = {0};
    assert_int_equal(engine_spec_new(&sp, ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX, 64, &err), ST_OK);
    struct engine_draft d;
    /* ngram: the continuation of the most recent earlier occurrence of the last two tokens */
    const int32_t a[] = {1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 5, 9, 1, 2};
    assert_int_equal(engine_spec_propose(sp, a, 15, 4, -1, &d), 4);
    assert_int_equal(d.src, ENGINE_SPEC_SRC_SELF);
    assert_int_equal(d.tok[0], 3);
    assert_int_equal(d.tok[3], 9); /* most recent: ...4 5 9 1 2 */
    for (int i = 0; i < 4; i++)
        assert_true(d.c[i] > 0 && d.c[i] < 1);
    /* nothing repeats: no draft */
    const int32_t b[] = {1, 2, 3, 4, 5, 6};
    assert_int_equal(engine_spec_propose(sp, b, 6, 4, -1, &d), 0);
    /* the job index: learned outputs are drafted, the majority continuation wins */
    const int32_t p1[] = {50, 51, 52}, o1[] = {60, 61, 62, 63}, o2[] = {60, 61, 70, 71};
    engine_spec_learn(sp, p1, 3, o1, 4);
    engine_spec_learn(sp, p1, 3, o1, 4);
    engine_spec_learn(sp, p1, 3, o2, 4);
    const int32_t q[] = {7, 8, 51, 52};
    assert_int_equal(engine_spec_propose(sp, q, 4, 8, -1, &d), 4);
    assert_int_equal(d.src, ENGINE_SPEC_SRC_JOB);
    const int32_t want[] = {60, 61, 62, 63};
    assert_memory_equal(d.tok, want, sizeof(want));
    /* bins learn: depth-0 acceptance 70 % of the time -> the estimate approaches 0.7, and the
     * survival ECE stays small */
    uint64_t state_ = 12345;
    for (int i = 0; i < 20000; i++) {
        assert_int_equal(engine_spec_propose(sp, q, 4, 1, -1, &d), 1);
        state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
        engine_spec_observe(sp, &d, 1, (state_ >> 33) % 10 < 7);
    }
    assert_int_equal(engine_spec_propose(sp, q, 4, 1, -1, &d), 1);
    assert_true(fabsf(d.c[0] - 0.7f) < 0.03f);
    uint64_t n_ece;
    double ece = engine_spec_ece(sp, &n_ece);
    assert_true(n_ece == 20000 - ENGINE_SPEC_ECE_WARMUP);
    assert_true(ece >= 0 && ece < 0.03);
    /* the ring wraps: twice its size of outputs, and the index still answers from recent ones */
    int32_t *big = malloc(sizeof(int32_t) * 4096);
    for (int i = 0; i < 4096; i++)
        big[i] = 1000 + i % 97;
    for (int r = 0; r < 2 * ENGINE_SPEC_INDEX_TOKENS / 4096; r++)
        engine_spec_learn(sp, p1, 3, big, 4096);
    const int32_t q2[] = {1000 + 5, 1000 + 6};
    assert_true(engine_spec_propose(sp, q2, 2, 4, -1, &d) == 4);
    assert_int_equal(d.tok[0], 1000 + 7);
    free(big);
    /* cost model: interpolated between measured sizes, non-decreasing, extrapolated past them */
    assert_true(engine_spec_cost(sp, 10) == 0);
    engine_spec_time(sp, 8, 1.0, 1);
    engine_spec_time(sp, 16, 2.0, 1);
    engine_spec_time(sp, 32, 1.5, 1); /* noise below a smaller size's time is lifted */
    assert_true(fabs(engine_spec_cost(sp, 1) - 1.0) < 1e-9);
    assert_true(fabs(engine_spec_cost(sp, 12) - 1.5) < 1e-9);
    assert_true(fabs(engine_spec_cost(sp, 24) - 2.0) < 1e-9);
    for (int bb = 2; bb <= 64; bb++)
        assert_true(engine_spec_cost(sp, bb) >= engine_spec_cost(sp, bb - 1));
    /* a real step at 16 took 4 s: 16 costs that, and the warm-up's curve is scaled to it */
    engine_spec_time(sp, 16, 4.0, 0);
    assert_true(fabs(engine_spec_cost(sp, 16) - 4.0) < 1e-9);
    assert_true(fabs(engine_spec_cost(sp, 12) - 3.0) < 1e-9);
    assert_true(fabs(engine_spec_cost(sp, 8) - 2.0) < 1e-9);
    for (int bb = 2; bb <= 64; bb++)
        assert_true(engine_spec_cost(sp, bb) >= engine_spec_cost(sp, bb - 1));
    engine_spec_free(sp);
}

/* A draft model's path kind for sampled requests follows what is accepted: both kinds at even
 * odds until each has ENGINE_SPEC_EXPLORE verified first tokens, then the one accepted more
 * often lately on about 15 paths of 16 -- draws when they match 90 % and the argmax 40 %, the
 * argmax when the rates swap mid-job; every sequence gets both kinds; the kinds fall in fine
 * bins of their own. */
static void test_spec_model_kind(void **state)
{
    (void)state;
    struct engine_spec *sp;
    struct err_detail err = {0};
    assert_int_equal(engine_spec_new(&sp, 0, 64, &err), ST_OK);
    uint64_t lcg = 7;
    for (int phase = 0; phase < 2; phase++) {
        const int good = phase ? ENGINE_SPEC_KIND_ARGMAX : ENGINE_SPEC_KIND_DRAW;
        int n[3] = {0, 0, 0}, per_seq[16][3] = {{0}};
        for (int i = 0; i < 6000; i++) {
            /* 16 sequences drafting together, each step in the same order */
            const int k = engine_spec_model_kind(sp, (uint64_t)(100 + i % 16), (uint32_t)(i / 16));
            assert_true(k == ENGINE_SPEC_KIND_DRAW || k == ENGINE_SPEC_KIND_ARGMAX);
            if (i >= 4000) {
                n[k]++;
                per_seq[i % 16][k]++;
            }
            struct engine_draft d = {.n = 1, .src = ENGINE_SPEC_SRC_MODEL, .tok = {5}};
            engine_spec_rate_model(sp, &d, 0, 0.6f, k, -1);
            lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
            const int hit = (int)((lcg >> 33) % 10) < (k == good ? 9 : 4);
            engine_spec_observe(sp, &d, 1, hit);
        }
        /* the last third of each phase: the better kind on about 15 paths of 16 (1/16 of 2,000
         * is 125, with a standard deviation of 11), and each sequence tried the other too */
        const int other = ENGINE_SPEC_KIND_DRAW + ENGINE_SPEC_KIND_ARGMAX - good;
        print_message("phase %d: %d paths of the better kind, %d of the other\n", phase, n[good],
                      n[other]);
        assert_true(n[other] >= 80 && n[other] <= 170);
        assert_int_equal(n[good] + n[other], 2000);
        for (int q = 0; q < 16; q++)
            assert_true(per_seq[q][other] > 0 && per_seq[q][good] > per_seq[q][other]);
        struct engine_draft a = {.src = ENGINE_SPEC_SRC_MODEL}, b = a;
        engine_spec_rate_model(sp, &a, 0, 0.6f, ENGINE_SPEC_KIND_DRAW, -1);
        engine_spec_rate_model(sp, &b, 0, 0.6f, ENGINE_SPEC_KIND_ARGMAX, -1);
        assert_true(a.bin[0] != b.bin[0]);
        assert_true(phase ? b.c[0] > a.c[0] : a.c[0] > b.c[0]);
    }
    engine_spec_free(sp);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_units),
        cmocka_unit_test(test_spec_suffix_learns),
        cmocka_unit_test(test_spec_greedy_same),
        cmocka_unit_test(test_spec_sampled_same),
        cmocka_unit_test(test_spec_grammar_same),
        cmocka_unit_test(test_spec_draft_model),
        cmocka_unit_test(test_spec_model_kind),
        cmocka_unit_test(test_spec_draft_prefix_cache),
        cmocka_unit_test(test_spec_draft_prefix_same_step),
        cmocka_unit_test(test_spec_draft_vocab),
        cmocka_unit_test(test_spec_draft_short_context),
        cmocka_unit_test(test_spec_counts_used),
        cmocka_unit_test(test_spec_distribution),
        cmocka_unit_test(test_spec_rollback_invariants),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
