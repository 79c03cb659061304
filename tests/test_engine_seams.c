/* Tests of the seams inside the engine (engine_internal.h) on the real model: a run of
 * several accepted tokens stops exactly at a stop string or end-of-generation token; the
 * scheduler keeps the token budget and preempts newest first; the number of sampling threads
 * changes no token; engine_cancel drops a request wherever it is. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/test_engine_util.h"

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

/* engine_cancel drops a request wherever it is: running (its KV slot back), waiting, a request
 * of three choices (its gated followers with it) and finished but not yet polled; a user the
 * engine does not know drops nothing. The dropped never come out of engine_poll, the KV check
 * finds no leaked block, `cancelled` counts the unfinished sequences, and the requests left
 * produce the tokens they produce without the others. Fails if a dropped sequence stays on a
 * list, keeps its slot or blocks (the draft model's too, with speculation on), or disturbs
 * the rest. */
/* Add the fixture's prompt i as a greedy request of max_tokens (no EOS) for user; request 2
 * asks for three choices. */
static void add_greedy(const struct fixture *f, struct engine *e, int i, int32_t max_tokens,
                       void *user)
{
    struct err_detail err = {0};
    struct engine_request r = {0};
    r.prompt = f->prompt[i];
    r.n_prompt = f->n_prompt[i];
    engine_sampling_default(&r.sampling);
    r.sampling.temperature = 0;
    r.max_tokens = max_tokens;
    r.ignore_eos = 1;
    r.user = user;
    r.n_choices = i == 2 ? 3 : 1;
    assert_int_equal(engine_add_request(e, &r, NULL, &err), ST_OK);
}

static void cancel_case(struct fixture *f, int spec)
{
    enum { N = 8 };
    static struct result got[N], ref[N];
    memset(got, 0, sizeof(got));
    struct engine_params p;
    params(&p, 4, 64, 64, 1);
    if (spec) { /* speculation: the draft model (the model itself) holds KV of its own */
        p.spec = ENGINE_SPEC_MODEL | ENGINE_SPEC_NGRAM;
        p.draft_model = f->m;
    }
    struct engine *e;
    struct err_detail err = {0};
    assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
    for (int i = 0; i < N; i++) /* request 0 finishes at its first token */
        add_greedy(f, e, i, i == 0 ? 1 : GEN, &got[i]);
    /* until request 0 has finished (not polled) while request 1 runs */
    while (!e->done_head)
        assert_int_equal(engine_step(e, &err), ST_OK);
    assert_ptr_equal(e->done_head->user, &got[0]);
    struct engine_load l0, l1;
    engine_get_load(e, &l0);
    int running1 = 0, waiting6 = 0;
    for (int i = 0; i < e->n_running; i++)
        running1 |= e->running[i]->user == &got[1];
    for (struct seq *s = e->wait_head; s; s = s->next)
        waiting6 |= s->user == &got[6];
    assert_true(running1 && waiting6);
    /* the requests nothing of which has started: each once, in arrival order, and only those */
    const void *un[3 * N];
    size_t n_un = engine_unstarted(e, un, 3 * N);
    int listed[N] = {0}, started[N] = {0};
    for (size_t k = 0; k < n_un; k++) {
        int i = (int)((const struct result *)un[k] - got);
        assert_true(i >= 0 && i < N && !listed[i]);
        assert_true(k == 0 || (const struct result *)un[k - 1] < (const struct result *)un[k]);
        listed[i] = 1;
    }
    for (struct seq *s = e->done_head; s; s = s->next)
        started[(const struct result *)s->user - got] = 1;
    for (int k = 0; k < e->n_running; k++)
        started[(const struct result *)e->running[k]->user - got] = 1;
    for (struct seq *s = e->wait_head; s; s = s->next)
        started[(const struct result *)s->user - got] |= s->admitted || s->n_gen;
    for (int i = 0; i < N; i++)
        assert_int_equal(listed[i], !started[i]);
    assert_true(!listed[0] && !listed[1] && listed[6] && listed[7]);
    assert_int_equal(engine_unstarted(e, un, 1), 1); /* at most max */
    assert_true(listed[(const struct result *)un[0] - got]);
    assert_int_equal(engine_cancel(e, &got[0]), 1); /* finished, not polled */
    assert_int_equal(engine_cancel(e, &got[1]), 1); /* running */
    assert_int_equal(engine_cancel(e, &got[2]), 3); /* three choices */
    assert_int_equal(engine_cancel(e, &got[6]), 1); /* waiting */
    assert_int_equal(engine_cancel(e, &got[6]), 0); /* gone */
    assert_int_equal(engine_cancel(e, ref), 0);     /* never added */
    engine_get_load(e, &l1);
    assert_true(l1.running < l0.running && l1.kv_used < l0.kv_used);
    assert_int_equal(engine_pending(e), N - 4);
    check_ok(engine_get_kv(e), 0);
    int n_out = 0;
    while (engine_pending(e)) {
        assert_int_equal(engine_step(e, &err), ST_OK);
        struct engine_output o[8];
        size_t k;
        while ((k = engine_poll(e, o, 8)) > 0)
            for (size_t j = 0; j < k; j++) {
                struct result *rr = o[j].user;
                assert_true(rr != &got[0] && rr != &got[1] && rr != &got[2] && rr != &got[6]);
                assert_int_equal(rr->n, 0);
                memcpy(rr->tok, o[j].tokens, sizeof(int32_t) * o[j].n_tokens);
                rr->n = o[j].n_tokens;
                n_out++;
            }
    }
    assert_int_equal(n_out, N - 4);
    assert_int_equal(engine_get_stats(e)->cancelled, 5);
    /* the tokens they had: the finished one's single token and whatever the rest had drawn */
    assert_true(engine_get_stats(e)->cancelled_tokens >= 1);
    uint64_t kept = 0;
    for (int i = 0; i < N; i++)
        kept += got[i].n;
    if (!spec) /* (speculation counts accepted drafts apart) */
        assert_int_equal(engine_get_stats(e)->gen_tokens,
                         kept + engine_get_stats(e)->cancelled_tokens);
    check_ok(engine_get_kv(e), 1);
    engine_free(e);
    /* the survivors alone, numbered as in the batch (without speculation: it is lossless,
     * test_engine_spec.c) */
    const int keep[] = {3, 4, 5, 7};
    for (int i = 0; i < (spec ? 0 : 4); i++) {
        run_engine(f, &p, &f->prompt[keep[i]], &f->n_prompt[keep[i]], 1, keep[i], 0, &ref[i], NULL);
        assert_same(&got[keep[i]], &ref[i], 1, "a request left after cancels");
    }
}

static void test_cancel(void **state)
{
    cancel_case(*state, 0);
    cancel_case(*state, 1);
}

/* The start gate (engine_set_start_gate): each step passes it the users of the sequences it
 * admits for the first time, before computing them (so a runner can record that they began);
 * a request never admitted is never passed; an error from the gate is the step's, and the
 * step computes nothing. */
struct gate_log {
    const void *seen[64]; /* users passed so far */
    int n_seen;
    int calls, fail_at; /* fail_at: the call (1-based) that fails, 0 none */
};

static enum status gate_record(void *ctx, const void *const *users, int n, struct err_detail *err)
{
    struct gate_log *g = ctx;
    if (++g->calls == g->fail_at)
        return err_set(err, ST_ERR_IO, "the gate's queue failed");
    for (int i = 0; i < n && g->n_seen < 64; i++)
        g->seen[g->n_seen++] = users[i];
    return ST_OK;
}

static int gate_passed(const struct gate_log *g, const void *user)
{
    for (int i = 0; i < g->n_seen; i++)
        if (g->seen[i] == user)
            return 1;
    return 0;
}

static void test_start_gate(void **state)
{
    struct fixture *f = *state;
    enum { N = 8 };
    static struct result got[N];
    struct engine_params p;
    params(&p, 4, 64, 64, 1);
    for (int fail = 0; fail < 2; fail++) {
        struct gate_log g = {.fail_at = fail ? 1 : 0};
        struct engine *e;
        struct err_detail err = {0};
        assert_int_equal(engine_init(&e, f->m, f->tok, &p, &err), ST_OK);
        assert_int_equal(engine_set_start_gate(e, gate_record, &g, &err), ST_OK);
        for (int i = 0; i < N; i++)
            add_greedy(f, e, i, 2 + i, &got[i]);
        if (fail) {
            assert_int_equal(engine_step(e, &err), ST_ERR_IO);
            assert_string_equal(err.msg, "the gate's queue failed");
            assert_int_equal(engine_get_stats(e)->prompt_tokens, 0);
            assert_int_equal(engine_get_stats(e)->gen_tokens, 0);
            engine_free(e);
            continue;
        }
        int steps = 0;
        while (engine_pending(e)) {
            int before = g.n_seen, calls = g.calls;
            assert_int_equal(engine_step(e, &err), ST_OK);
            steps++;
            /* every sequence admitted by now was passed, and only those admitted this step were
             * passed in it */
            for (int k = 0; k < e->n_running; k++)
                assert_true(gate_passed(&g, e->running[k]->user));
            for (int k = before; k < g.n_seen; k++) {
                int admitted = 0;
                for (int j = 0; j < e->n_running && !admitted; j++)
                    admitted = e->running[j]->user == g.seen[k];
                for (struct seq *q = e->done_head; q && !admitted; q = q->next)
                    admitted = q->user == g.seen[k];
                assert_true(admitted);
            }
            assert_true(g.calls <= calls + 1);
            struct engine_output o[8];
            while (engine_poll(e, o, 8) > 0)
                ;
        }
        /* each request passed; the one of three choices once per choice at most */
        for (int i = 0; i < N; i++)
            assert_true(gate_passed(&g, &got[i]));
        assert_true(g.n_seen >= N && g.n_seen <= N + 2);
        assert_true(g.calls >= 2 && g.calls < steps);
        engine_free(e);
    }
}

int main(void)
{
    const struct CMUnitTest engine_tests[] = {
        cmocka_unit_test(test_accept_run),   cmocka_unit_test(test_sched_budget_and_victims),
        cmocka_unit_test(test_host_threads), cmocka_unit_test(test_cancel),
        cmocka_unit_test(test_start_gate),
    };
    return cmocka_run_group_tests_name("engine", engine_tests, setup, teardown);
}
