/* Several choices per request (engine_request.n_choices) and per-token log-probabilities on the
 * real model: each choice draws on its own and equals a one-choice request given its index;
 * greedy choices agree; the prompt is computed once and its full KV blocks are shared (the
 * engine's and the block manager's counters); logprobs describe the tokens drawn and never change
 * them. */
#include "tests/test_engine_util.h"

#include <math.h>

#define MAX_CH 4
#define CH_GEN 12

struct choice_out {
    int32_t tok[CH_GEN]; /* generated tokens */
    size_t n;            /* count */
    size_t n_cached;     /* prompt tokens from the prefix cache */
    int got;             /* 1 once it came out */
    float lp[CH_GEN];    /* logprobs, when asked */
    int32_t top_id[CH_GEN * 5];
    float top_lp[CH_GEN * 5];
    int top_k;
};

struct ch_req {
    const int32_t *prompt;
    size_t n_prompt;
    int n_choices, first_choice;
    float temperature;
    int logprobs, top_logprobs;
    const char *id;
    struct choice_out out[MAX_CH]; /* indexed by choice - first_choice */
};

/* How an engine may share a prompt's KV between choices. */
enum share {
    SHARE_NONE,   /* no prefix cache: every choice computes its prompt */
    SHARE_FORK,   /* prefix cache, 16 sequences at once: later choices fork the first's KV */
    SHARE_SERIAL, /* prefix cache, one sequence at a time: the first choice is gone when the
                   * next starts, which finds its whole blocks in the prefix cache */
};

/* Run reqs[0..n) through one engine (kv_block 16); every output lands in its request's out[]
 * by choice. */
static void run_choices(struct fixture *f, struct ch_req *reqs, int n, enum share share,
                        struct engine_stats *stats, struct engine_kv_stats *kv_stats)
{
    struct engine_params p;
    params(&p, share == SHARE_SERIAL ? 1 : 16, 256, 64, share != SHARE_NONE);
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    for (int i = 0; i < n; i++) {
        struct ch_req *q = &reqs[i];
        memset(q->out, 0, sizeof(q->out));
        struct engine_request r = {0};
        r.prompt = q->prompt;
        r.n_prompt = q->n_prompt;
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = q->temperature;
        r.sampling.seed = 7;
        r.max_tokens = CH_GEN;
        r.ignore_eos = 1;
        r.request_id = q->id;
        r.user = q;
        r.n_choices = q->n_choices;
        r.first_choice = q->first_choice;
        r.logprobs = q->logprobs;
        r.top_logprobs = q->top_logprobs;
        assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
    }
    while (engine_pending(e)) {
        if (engine_step(e, &err))
            fail_msg("step: %s", err.msg);
        struct engine_output o[8];
        size_t k;
        while ((k = engine_poll(e, o, 8)) > 0)
            for (size_t j = 0; j < k; j++) {
                struct ch_req *q = o[j].user;
                int c = o[j].choice - q->first_choice;
                assert_true(c >= 0 && c < MAX_CH && !q->out[c].got);
                struct choice_out *co = &q->out[c];
                assert_true(o[j].n_tokens == CH_GEN);
                memcpy(co->tok, o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
                co->n = o[j].n_tokens;
                co->n_cached = o[j].n_cached;
                co->got = 1;
                assert_int_equal(o[j].logprobs != NULL, q->logprobs);
                if (o[j].logprobs) {
                    assert_int_equal(o[j].top_logprobs, q->top_logprobs);
                    memcpy(co->lp, o[j].logprobs, sizeof(float) * o[j].n_tokens);
                    size_t nt = o[j].n_tokens * (size_t)o[j].top_logprobs;
                    if (nt) {
                        memcpy(co->top_id, o[j].top_ids, sizeof(int32_t) * nt);
                        memcpy(co->top_lp, o[j].top_lps, sizeof(float) * nt);
                    }
                    co->top_k = o[j].top_logprobs;
                }
            }
    }
    for (int i = 0; i < n; i++)
        for (int c = 0; c < (reqs[i].n_choices > 1 ? reqs[i].n_choices : 1); c++)
            assert_true(reqs[i].out[c].got);
    if (stats)
        *stats = *engine_get_stats(e);
    if (kv_stats)
        *kv_stats = *engine_kv_get_stats(engine_get_kv(e));
    check_ok(engine_get_kv(e), 1);
    engine_free(e);
}

static int same_tokens(const struct choice_out *a, const struct choice_out *b)
{
    return a->n == b->n && !memcmp(a->tok, b->tok, sizeof(int32_t) * a->n);
}

/* Choice c of an n-choice request = a one-choice request with first_choice c (same seed, same
 * id), run in another engine with other batch mates; sampled choices differ; greedy ones agree. */
static void test_choices_match_single(void **state)
{
    struct fixture *f = *state;
    enum { NREQ = 4, NCH = 3 };
    static struct ch_req multi[NREQ], single[NREQ * NCH];
    char ids[NREQ][16];
    for (int i = 0; i < NREQ; i++) {
        snprintf(ids[i], sizeof(ids[i]), "q%d", i);
        multi[i] = (struct ch_req){.prompt = f->prompt[i], .n_prompt = f->n_prompt[i],
                                   .n_choices = NCH, .temperature = 1.0f, .id = ids[i]};
        for (int c = 0; c < NCH; c++) /* in another order: choice-major */
            single[c * NREQ + i] = (struct ch_req){.prompt = f->prompt[i],
                                                   .n_prompt = f->n_prompt[i], .n_choices = 1,
                                                   .first_choice = c, .temperature = 1.0f,
                                                   .id = ids[i]};
    }
    run_choices(f, multi, NREQ, SHARE_FORK, NULL, NULL);
    run_choices(f, single, NREQ * NCH, SHARE_FORK, NULL, NULL);
    for (int i = 0; i < NREQ; i++) {
        for (int c = 0; c < NCH; c++)
            if (!same_tokens(&multi[i].out[c], &single[c * NREQ + i].out[0]))
                fail_msg("request %d choice %d differs from its one-choice request", i, c);
        if (same_tokens(&multi[i].out[0], &multi[i].out[1]) &&
            same_tokens(&multi[i].out[1], &multi[i].out[2]))
            fail_msg("request %d: three sampled choices are identical", i);
    }
    /* greedy: every choice is the argmax continuation */
    for (int i = 0; i < NREQ; i++)
        multi[i].temperature = 0;
    run_choices(f, multi, NREQ, SHARE_FORK, NULL, NULL);
    for (int i = 0; i < NREQ; i++)
        for (int c = 1; c < NCH; c++)
            assert_true(same_tokens(&multi[i].out[0], &multi[i].out[c]));
}

/* A 40-token prompt with 4 choices and 16-token blocks: the first choice computes the prompt;
 * the other three fork its KV while it runs (its two whole blocks shared, the third, holding
 * positions 32..38, copied) and compute only the last prompt token; with 12 generated tokens
 * (52 in all, 4 blocks a choice) at most 4 + 3 x 2 blocks are ever in use (16 without
 * sharing). One sequence at a time, the first choice is gone before the next starts: they find
 * its whole blocks in the prefix cache and compute the last 8 tokens. Without the prefix cache
 * every choice computes the whole prompt. The outputs are the same every way. */
static void test_choices_share_prompt(void **state)
{
    struct fixture *f = *state;
    int32_t prompt[40];
    size_t n = 0;
    for (int i = 0; n < 40; i++)
        for (size_t j = 0; j < f->n_prompt[i] && n < 40; j++)
            prompt[n++] = f->prompt[i][j];
    struct ch_req a = {.prompt = prompt, .n_prompt = 40, .n_choices = 4, .temperature = 0.8f,
                       .id = "share"};
    struct ch_req b = a, c = a;
    struct engine_stats st;
    struct engine_kv_stats ks;
    run_choices(f, &a, 1, SHARE_FORK, &st, &ks);
    assert_int_equal(st.prompt_tokens, 40 + 3 * 1);
    assert_int_equal(ks.forked_blocks, 3 * 2);
    assert_int_equal(ks.copied_blocks, 3 * 1);
    assert_int_equal(ks.hit_blocks, 0);
    if (st.peak_blocks_used > 4 + 3 * 2) /* 52 tokens: 4 blocks each, 2 of them shared */
        fail_msg("peak %d blocks in use; sharing the prompt's two full blocks needs 10",
                 st.peak_blocks_used);
    assert_int_equal(a.out[0].n_cached, 0);
    for (int k = 1; k < 4; k++)
        assert_int_equal(a.out[k].n_cached, 39);
    run_choices(f, &c, 1, SHARE_SERIAL, &st, &ks);
    assert_int_equal(st.prompt_tokens, 40 + 3 * 8);
    assert_int_equal(ks.hit_blocks, 3 * 2);
    assert_int_equal(ks.forked_blocks, 0);
    for (int k = 1; k < 4; k++)
        assert_int_equal(c.out[k].n_cached, 32);
    run_choices(f, &b, 1, SHARE_NONE, &st, NULL);
    assert_int_equal(st.prompt_tokens, 4 * 40);
    for (int k = 0; k < 4; k++) {
        assert_true(same_tokens(&a.out[k], &b.out[k]));
        assert_true(same_tokens(&a.out[k], &c.out[k]));
    }
}

/* Logprobs: greedy tokens are their own top alternative, alternatives descend and hold at most
 * all the probability; asking for logprobs changes no token (greedy: the full-logits path
 * instead of the fused argmax; sampled: the draw reads a copy of the row). */
static void test_logprobs_tokens(void **state)
{
    struct fixture *f = *state;
    enum { NREQ = 4 };
    static struct ch_req with[NREQ], without[NREQ];
    for (int i = 0; i < NREQ; i++) {
        with[i] = (struct ch_req){.prompt = f->prompt[i], .n_prompt = f->n_prompt[i],
                                  .n_choices = 2, .temperature = i % 2 ? 0.9f : 0.0f,
                                  .logprobs = 1, .top_logprobs = i < 2 ? 5 : 0, .id = "lp"};
        without[i] = with[i];
        without[i].logprobs = 0;
        without[i].top_logprobs = 0;
    }
    run_choices(f, with, NREQ, SHARE_FORK, NULL, NULL);
    run_choices(f, without, NREQ, SHARE_FORK, NULL, NULL);
    for (int i = 0; i < NREQ; i++)
        for (int c = 0; c < 2; c++) {
            const struct choice_out *o = &with[i].out[c];
            assert_true(same_tokens(o, &without[i].out[c]));
            for (size_t t = 0; t < o->n; t++) {
                assert_true(o->lp[t] <= 0 && isfinite(o->lp[t]));
                double mass = 0;
                for (int k = 0; k < o->top_k; k++) {
                    const float lk = o->top_lp[t * 5 + (size_t)k];
                    assert_true(lk <= 0);
                    if (k)
                        assert_true(lk <= o->top_lp[t * 5 + (size_t)k - 1]);
                    if (o->top_id[t * 5 + (size_t)k] == o->tok[t])
                        assert_true(lk == o->lp[t]);
                    mass += exp((double)lk);
                }
                assert_true(mass <= 1.0 + 1e-5);
                if (with[i].temperature == 0 && o->top_k)
                    assert_int_equal(o->top_id[t * 5], o->tok[t]);
            }
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choices_match_single),
        cmocka_unit_test(test_choices_share_prompt),
        cmocka_unit_test(test_logprobs_tokens),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
