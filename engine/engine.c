/* Continuous batching. Each step packs every decoding sequence's next token first, then
 * prefill chunks (oldest running first, then newly admitted waiting requests) under the
 * token budget; when the KV pool runs out, the most recently admitted sequence is preempted
 * (its blocks freed, to be recomputed later from its tokens, usually from the prefix cache).
 * All kernels are batch-invariant, so a request's tokens never depend on its batch mates. */
#include "engine/engine.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/pool.h"

enum seq_state { SEQ_WAITING, SEQ_RUNNING, SEQ_DONE };

struct seq {
    uint64_t id;                 /* request id */
    void *user;                  /* caller's pointer */
    enum seq_state state;        /* where it is */
    int slot;                    /* KV slot while running, else -1 */
    uint64_t admitted;           /* admission counter value (newest = largest) */
    int32_t *tok;                /* prompt then generated tokens (owned) */
    size_t n_tok;                /* tokens in tok */
    size_t cap_tok;              /* capacity of tok */
    size_t n_prompt;             /* prompt length */
    int32_t n_computed;          /* tokens whose KV is in the cache */
    struct engine_sampling sp;   /* sampling parameters */
    struct engine_rng rng;       /* per-request RNG */
    int32_t max_tokens;          /* generation limit */
    int ignore_eos;              /* keep going past EOG */
    int32_t n_gen;               /* tokens sampled */
    struct engine_stop *stop;    /* stop strings or NULL (owned) */
    struct engine_tok_stream ts; /* UTF-8 holdback */
    char *text;                  /* generated text (owned, NUL-terminated) */
    size_t n_text;               /* bytes in text */
    size_t cap_text;             /* capacity of text */
    size_t n_final;              /* bytes of text the stop matcher has released */
    size_t n_streamed;           /* bytes of text passed to on_text */
    void (*on_text)(void *user, const char *text, size_t n); /* streaming callback or NULL */
    enum engine_finish finish;   /* why it ended */
    int stop_string;             /* a stop string ended it */
    size_t n_cached;             /* prompt tokens from the prefix cache at first admission */
    int preemptions;             /* times preempted */
    double t_arrival, t_first, t_finish; /* monotonic seconds */
    struct seq *next;            /* waiting / done list link */
};

struct engine {
    struct engine_model *m;      /* model (borrowed) */
    const struct engine_tok *tok; /* tokenizer (borrowed) */
    struct engine_params p;      /* parameters */
    struct engine_kv *kv;        /* paged KV cache */
    struct pool *pool;           /* host threads for sampling (owned) */
    struct engine_sampler **smp; /* sampling scratch, one per pool thread */
    int n_smp;                   /* pool threads */
    struct seq **s_seq;          /* this step's sampling jobs: sequence, */
    float **s_logits;            /* its logits row, */
    int32_t *s_id;               /* and the token drawn */
    struct seq **running;        /* running sequences, admission order, n_running used */
    int n_running;               /* count */
    int *free_slots;             /* stack of unused KV slots */
    int n_free_slots;            /* count */
    struct seq *wait_head, *wait_tail; /* waiting queue (preempted ones at the head) */
    struct seq *done_head, *done_tail; /* finished, not yet polled */
    struct seq *polled;          /* handed out by the last poll; freed at the next */
    size_t n_waiting;            /* waiting count */
    uint64_t next_id;            /* request ids */
    uint64_t admit_counter;      /* admission order */
    /* per-step batch scratch, max_batch_tokens entries */
    int32_t *b_tok, *b_pos, *b_seq; /* token, position, KV slot */
    uint8_t *b_want;             /* logits wanted */
    float *logits;               /* max_seqs x n_vocab */
    struct seq **b_owner;        /* per batch entry: its sequence */
    char *piece;                 /* decode scratch */
    size_t piece_cap;            /* its size */
    struct engine_stats stats;   /* counters */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void engine_params_default(struct engine_params *p)
{
    p->max_seqs = 256;
    p->max_batch_tokens = 512;
    p->kv_block = 16;
    p->kv_mem = (size_t)1 << 30;
    p->prefix_cache = 1;
    p->kv_dtype = KERN_KV_F16;
    p->host_threads = 0;
}

/* host_threads 0: the online CPUs, at most 8 (sampling a step's rows gains little beyond). */
static int host_threads(const struct engine_params *p)
{
    if (p->host_threads > 0)
        return p->host_threads;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 8 ? 8 : (int)n;
}

static void seq_free(struct seq *s)
{
    if (!s)
        return;
    engine_stop_free(s->stop);
    free(s->tok);
    free(s->text);
    free(s);
}

static void list_free(struct seq *s)
{
    while (s) {
        struct seq *n = s->next;
        seq_free(s);
        s = n;
    }
}

enum status engine_init(struct engine **out, struct engine_model *m, const struct engine_tok *tok,
                        const struct engine_params *p, struct err_detail *err)
{
    *out = NULL;
    if (p->max_seqs < 1 || p->max_batch_tokens < 1 || p->kv_block < 1 || p->kv_block > 4096)
        return err_set(err, ST_ERR_INVALID_ARG, "engine: max-seqs, max-batch-tokens and "
                                                "kv-block must be positive (kv-block <= 4096)");
    if (p->max_batch_tokens < p->max_seqs)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "engine: max-batch-tokens (%d) must be >= max-seqs (%d) so every running "
                       "sequence decodes each step",
                       p->max_batch_tokens, p->max_seqs);
    if (p->host_threads < 0 || p->host_threads > 1024)
        return err_set(err, ST_ERR_INVALID_ARG, "engine: host-threads %d not in 0..1024",
                       p->host_threads);
    if (p->kv_dtype != KERN_KV_F16 && p->kv_dtype != KERN_KV_Q8)
        return err_set(err, ST_ERR_INVALID_ARG, "engine: unknown KV dtype %d", p->kv_dtype);
    size_t per_block = engine_kv_bytes_per_token(m->hp.n_layer, m->hp.n_kv_head, m->hp.head_dim,
                                                 p->kv_dtype) *
                       (size_t)p->kv_block;
    size_t n_blocks = p->kv_mem / per_block;
    if (n_blocks < 1 || n_blocks > (1u << 28))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "engine: kv-mem %zu bytes holds %zu blocks of %zu bytes (need 1..2^28)",
                       p->kv_mem, n_blocks, per_block);
    struct engine *e = calloc(1, sizeof(*e));
    if (!e)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    e->m = m;
    e->tok = tok;
    e->p = *p;
    enum status st = engine_kv_init(&e->kv, m->hp.n_layer, m->hp.n_kv_head, m->hp.head_dim,
                                    p->kv_dtype, p->kv_block, (int32_t)n_blocks, p->max_seqs,
                                    p->prefix_cache, err);
    if (st) {
        free(e);
        return st;
    }
    if ((st = pool_init(&e->pool, host_threads(p), err))) {
        engine_free(e);
        return st;
    }
    /* sampling jobs come one per forward pass, milliseconds apart: idle workers sleep at once
     * instead of spinning on the CPUs the backend's kernel threads are using */
    pool_set_spin(e->pool, 0);
    e->n_smp = pool_size(e->pool);
    e->smp = calloc((size_t)e->n_smp, sizeof(*e->smp));
    if (!e->smp) {
        engine_free(e);
        return err_set(err, ST_ERR_NOMEM, "no memory for the engine");
    }
    for (int i = 0; i < e->n_smp; i++)
        if ((st = engine_sampler_init(&e->smp[i], m->hp.n_vocab, err))) {
            engine_free(e);
            return st;
        }
    size_t bt = (size_t)p->max_batch_tokens;
    e->running = calloc((size_t)p->max_seqs, sizeof(*e->running));
    e->free_slots = malloc(sizeof(int) * (size_t)p->max_seqs);
    e->b_tok = malloc(sizeof(int32_t) * bt);
    e->b_pos = malloc(sizeof(int32_t) * bt);
    e->b_seq = malloc(sizeof(int32_t) * bt);
    e->b_want = malloc(bt);
    e->b_owner = malloc(sizeof(*e->b_owner) * bt);
    e->logits = malloc(sizeof(float) * (size_t)p->max_seqs * (size_t)m->hp.n_vocab);
    e->s_seq = malloc(sizeof(*e->s_seq) * bt);
    e->s_logits = malloc(sizeof(*e->s_logits) * bt);
    e->s_id = malloc(sizeof(*e->s_id) * bt);
    e->piece_cap = ENGINE_TOK_STREAM_OUT_MAX(engine_tok_max_piece(tok)) + 8;
    e->piece = malloc(e->piece_cap);
    if (!e->running || !e->free_slots || !e->b_tok || !e->b_pos || !e->b_seq || !e->b_want ||
        !e->b_owner || !e->logits || !e->piece || !e->s_seq || !e->s_logits || !e->s_id) {
        engine_free(e);
        return err_set(err, ST_ERR_NOMEM, "no memory for the engine");
    }
    for (int i = 0; i < p->max_seqs; i++)
        e->free_slots[i] = p->max_seqs - 1 - i;
    e->n_free_slots = p->max_seqs;
    e->next_id = 1;
    *out = e;
    return ST_OK;
}

void engine_free(struct engine *e)
{
    if (!e)
        return;
    for (int i = 0; i < e->n_running; i++) {
        engine_kv_release(e->kv, e->running[i]->slot);
        seq_free(e->running[i]);
    }
    list_free(e->wait_head);
    list_free(e->done_head);
    list_free(e->polled);
    if (e->kv) {
        struct err_detail err = {0};
        if (engine_kv_check(e->kv, 1, &err)) {
            LOG_ERROR("KV cache check at shutdown: %s", err.msg);
#ifndef NDEBUG
            abort();
#endif
        }
    }
    engine_kv_free(e->kv);
    if (e->smp)
        for (int i = 0; i < e->n_smp; i++)
            engine_sampler_free(e->smp[i]);
    free(e->smp);
    pool_free(e->pool);
    free(e->s_seq);
    free(e->s_logits);
    free(e->s_id);
    free(e->running);
    free(e->free_slots);
    free(e->b_tok);
    free(e->b_pos);
    free(e->b_seq);
    free(e->b_want);
    free(e->b_owner);
    free(e->logits);
    free(e->piece);
    free(e);
}

size_t engine_pending(const struct engine *e) { return e->n_waiting + (size_t)e->n_running; }

const struct engine_stats *engine_get_stats(const struct engine *e) { return &e->stats; }

const struct engine_kv *engine_get_kv(const struct engine *e) { return e->kv; }

void engine_get_load(const struct engine *e, struct engine_load *out)
{
    memset(out, 0, sizeof(*out));
    out->running = e->n_running;
    out->waiting = e->n_waiting;
    out->kv_total = e->kv->n_blocks;
    out->kv_used = e->kv->n_blocks - engine_kv_available(e->kv);
}

/* ---- queues ---- */

static void wait_push_back(struct engine *e, struct seq *s)
{
    s->state = SEQ_WAITING;
    s->next = NULL;
    if (e->wait_tail)
        e->wait_tail->next = s;
    else
        e->wait_head = s;
    e->wait_tail = s;
    e->n_waiting++;
}

static void wait_push_front(struct engine *e, struct seq *s)
{
    s->state = SEQ_WAITING;
    s->next = e->wait_head;
    e->wait_head = s;
    if (!e->wait_tail)
        e->wait_tail = s;
    e->n_waiting++;
}

static struct seq *wait_pop(struct engine *e)
{
    struct seq *s = e->wait_head;
    if (s) {
        e->wait_head = s->next;
        if (!e->wait_head)
            e->wait_tail = NULL;
        s->next = NULL;
        e->n_waiting--;
    }
    return s;
}

/* ---- requests ---- */

static enum status tok_push(struct seq *s, int32_t id)
{
    if (s->n_tok == s->cap_tok) {
        size_t cap = s->cap_tok * 2;
        int32_t *nt = realloc(s->tok, sizeof(int32_t) * cap);
        if (!nt)
            return ST_ERR_NOMEM;
        s->tok = nt;
        s->cap_tok = cap;
    }
    s->tok[s->n_tok++] = id;
    return ST_OK;
}

static enum status text_append(struct seq *s, const char *p, size_t n)
{
    if (s->n_text + n + 1 > s->cap_text) {
        size_t cap = (s->n_text + n + 1) * 2;
        char *nt = realloc(s->text, cap);
        if (!nt)
            return ST_ERR_NOMEM;
        s->text = nt;
        s->cap_text = cap;
    }
    memcpy(s->text + s->n_text, p, n);
    s->n_text += n;
    s->text[s->n_text] = 0;
    return ST_OK;
}

enum status engine_add_request(struct engine *e, const struct engine_request *r, uint64_t *id,
                               struct err_detail *err)
{
    const int n_ctx = e->m->hp.n_ctx_train;
    enum status st;
    if (r->n_prompt < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "empty prompt");
    if (r->max_tokens < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "max_tokens must be >= 1");
    if (r->n_stop > ENGINE_MAX_STOP)
        return err_set(err, ST_ERR_INVALID_ARG, "at most %d stop strings", ENGINE_MAX_STOP);
    if ((st = engine_sampling_validate(&r->sampling, err)))
        return st;
    for (size_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->m->hp.n_vocab)
            return err_set(err, ST_ERR_RANGE, "prompt token %d is outside the vocabulary",
                           r->prompt[i]);
    uint64_t total = (uint64_t)r->n_prompt + (uint64_t)r->max_tokens;
    if (total > (uint64_t)n_ctx)
        return err_set(err, ST_ERR_RANGE,
                       "prompt (%zu tokens) + max_tokens (%d) exceeds the model context (%d)",
                       r->n_prompt, r->max_tokens, n_ctx);
    uint64_t blocks = (total + (uint64_t)e->p.kv_block - 1) / (uint64_t)e->p.kv_block;
    if (blocks > (uint64_t)e->kv->n_blocks)
        return err_set(err, ST_ERR_RANGE,
                       "prompt + max_tokens needs %llu KV blocks; the pool has %d (raise --kv-mem)",
                       (unsigned long long)blocks, e->kv->n_blocks);
    struct seq *s = calloc(1, sizeof(*s));
    if (!s)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    s->cap_tok = r->n_prompt + (size_t)(r->max_tokens < 64 ? r->max_tokens : 64) + 1;
    s->tok = malloc(sizeof(int32_t) * s->cap_tok);
    s->cap_text = 256;
    s->text = malloc(s->cap_text);
    if (!s->tok || !s->text) {
        seq_free(s);
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    s->text[0] = 0;
    if (r->n_stop && (st = engine_stop_init(&s->stop, r->stop, r->n_stop, err))) {
        seq_free(s);
        return st;
    }
    memcpy(s->tok, r->prompt, sizeof(int32_t) * r->n_prompt);
    s->n_tok = s->n_prompt = r->n_prompt;
    s->sp = r->sampling;
    const char *rid = r->request_id ? r->request_id : "";
    engine_rng_seed(&s->rng, r->sampling.seed, rid, strlen(rid));
    s->max_tokens = r->max_tokens;
    s->ignore_eos = r->ignore_eos;
    s->user = r->user;
    s->on_text = r->on_text;
    s->slot = -1;
    s->id = e->next_id++;
    s->t_arrival = now_s();
    s->n_cached = (size_t)-1; /* set at first admission */
    wait_push_back(e, s);
    if (id)
        *id = s->id;
    return ST_OK;
}

/* ---- scheduling ---- */

static void finish_seq(struct engine *e, int ri, enum engine_finish why)
{
    struct seq *s = e->running[ri];
    s->finish = why;
    s->t_finish = now_s();
    engine_kv_release(e->kv, s->slot);
    e->free_slots[e->n_free_slots++] = s->slot;
    s->slot = -1;
    memmove(&e->running[ri], &e->running[ri + 1], sizeof(*e->running) * (size_t)(e->n_running - ri - 1));
    e->n_running--;
    s->state = SEQ_DONE;
    s->next = NULL;
    if (e->done_tail)
        e->done_tail->next = s;
    else
        e->done_head = s;
    e->done_tail = s;
}

/* Evict running[ri]: its blocks go back (cached), it waits at the front to be recomputed. */
static void preempt(struct engine *e, int ri)
{
    struct seq *s = e->running[ri];
    engine_kv_release(e->kv, s->slot);
    e->free_slots[e->n_free_slots++] = s->slot;
    s->slot = -1;
    s->n_computed = 0;
    s->preemptions++;
    e->stats.preemptions++;
    memmove(&e->running[ri], &e->running[ri + 1], sizeof(*e->running) * (size_t)(e->n_running - ri - 1));
    e->n_running--;
    wait_push_front(e, s);
}

/* Index in running[] of the most recently admitted sequence. */
static int newest_running(const struct engine *e)
{
    int best = 0;
    for (int i = 1; i < e->n_running; i++)
        if (e->running[i]->admitted > e->running[best]->admitted)
            best = i;
    return best;
}

/* Tokens of s that fit in the pool now, up to want. */
static int32_t fit_tokens(const struct engine *e, const struct seq *s, int32_t want)
{
    const int B = e->p.kv_block;
    int32_t held = e->kv->seqs[s->slot].n_blocks;
    int32_t cap = (held + engine_kv_available(e->kv)) * B - s->n_computed;
    return want < cap ? want : cap;
}

/* Append tokens [from, from + n) of s to the batch. */
static void batch_add(struct engine *e, int *nb, struct seq *s, int32_t from, int32_t n)
{
    for (int32_t i = 0; i < n; i++) {
        int k = (*nb)++;
        e->b_tok[k] = s->tok[from + i];
        e->b_pos[k] = from + i;
        e->b_seq[k] = s->slot;
        e->b_owner[k] = s;
        e->b_want[k] = (size_t)(from + i) == s->n_tok - 1;
    }
}

/* Build one step's batch; returns its token count (0 only when nothing can run). */
static int schedule(struct engine *e, struct err_detail *err)
{
    int budget = e->p.max_batch_tokens, nb = 0;
    /* 1. decodes, oldest first; preempt the newest when blocks run out. The loop relies on the
     * victim never standing before i in the running list (already in this batch): true while
     * the list is in admission order and the newest is the victim; a different policy must
     * take the victim's tokens back out of the batch. */
    for (int i = 0; i < e->n_running && budget > 0;) {
        struct seq *s = e->running[i];
        if ((size_t)s->n_computed + 1 != s->n_tok) {
            i++;
            continue;
        }
        while (engine_kv_blocks_needed(e->kv, s->slot, (int32_t)s->n_tok) >
               engine_kv_available(e->kv)) {
            int v = newest_running(e);
            preempt(e, v);
            if (v == i)
                break;
        }
        if (i < e->n_running && e->running[i] == s) {
            enum status st = engine_kv_reserve(e->kv, s->slot, (int32_t)s->n_tok, err);
            assert(!st);
            (void)st;
            batch_add(e, &nb, s, s->n_computed, 1);
            budget--;
            i++;
        }
    }
    /* 2. continue prefills of running sequences */
    for (int i = 0; i < e->n_running && budget > 0; i++) {
        struct seq *s = e->running[i];
        int32_t left = (int32_t)s->n_tok - s->n_computed;
        if (left <= 1 && (size_t)s->n_computed + 1 == s->n_tok)
            continue; /* decoding (handled above) */
        int32_t n = fit_tokens(e, s, left < budget ? left : budget);
        if (n <= 0)
            continue;
        engine_kv_reserve(e->kv, s->slot, s->n_computed + n, NULL);
        batch_add(e, &nb, s, s->n_computed, n);
        budget -= n;
    }
    /* 3. admit waiting requests */
    while (budget > 0 && e->wait_head && e->n_free_slots) {
        struct seq *s = e->wait_head;
        int slot = e->free_slots[e->n_free_slots - 1];
        int32_t cached = engine_kv_prefix_attach(e->kv, slot, s->tok, (int32_t)s->n_tok,
                                                 (int32_t)s->n_tok - 1);
        s->slot = slot;
        s->n_computed = cached;
        int32_t left = (int32_t)s->n_tok - cached;
        int32_t n = fit_tokens(e, s, left < budget ? left : budget);
        if (n <= 0) {
            engine_kv_release(e->kv, slot);
            s->slot = -1;
            s->n_computed = 0;
            break;
        }
        wait_pop(e);
        e->n_free_slots--;
        if (s->n_cached == (size_t)-1)
            s->n_cached = (size_t)cached;
        s->state = SEQ_RUNNING;
        s->admitted = ++e->admit_counter;
        e->running[e->n_running++] = s;
        engine_kv_reserve(e->kv, slot, cached + n, NULL);
        batch_add(e, &nb, s, cached, n);
        budget -= n;
    }
    return nb;
}

/* Pass the text that became final since the last call to the request's on_text. */
static void stream_text(struct seq *s, size_t final)
{
    if (s->on_text && final > s->n_streamed)
        s->on_text(s->user, s->text + s->n_streamed, final - s->n_streamed);
    s->n_streamed = final;
}

/* A token was sampled for running[ri]; returns 1 if the sequence finished. An end-of-generation
 * token ends the text (bytes of an incomplete UTF-8 character held back are flushed as the
 * tokenizer's stream flush renders them); so does max_tokens; a completed stop string ends it
 * before the stop string. */
static int accept_token(struct engine *e, int ri, int32_t id)
{
    struct seq *s = e->running[ri];
    s->n_gen++;
    e->stats.gen_tokens++;
    if (s->n_gen == 1)
        s->t_first = now_s();
    const int eog = !s->ignore_eos && engine_tok_is_eog(e->tok, id);
    size_t n = 0;
    if (!eog) {
        if (tok_push(s, id))
            abort(); /* a few bytes per token: out of memory here is fatal */
        n = engine_tok_stream_push(e->tok, &s->ts, id, e->piece, e->piece_cap);
    }
    const int end = eog || s->n_gen >= s->max_tokens;
    if (end)
        n += engine_tok_stream_flush(&s->ts, e->piece + n, e->piece_cap - n);
    if (text_append(s, e->piece, n))
        abort();
    int stopped = 0;
    if (s->stop) {
        size_t ok = 0;
        stopped = engine_stop_push(s->stop, e->piece, n, &ok);
        s->n_final += ok;
    } else {
        s->n_final = s->n_text;
    }
    if (stopped) {
        s->n_text = s->n_final;
        s->text[s->n_text] = 0;
        s->stop_string = 1;
    }
    stream_text(s, stopped || end ? s->n_text : s->n_final);
    if (stopped || eog) {
        finish_seq(e, ri, ENGINE_FINISH_STOP);
        return 1;
    }
    if (end) {
        finish_seq(e, ri, ENGINE_FINISH_LENGTH);
        return 1;
    }
    return 0;
}

struct sample_job {
    struct engine *e; /* the engine */
    long n;           /* sampling jobs this step */
};

/* This step's sampling jobs, split evenly over the pool (engine_step); thread ith uses its own
 * sampler scratch, each job its own sequence's RNG, so the tokens do not depend on the split. */
static void sample_range(void *arg, int ith, int nth)
{
    const struct sample_job *sj = arg;
    struct engine *e = sj->e;
    long lo, hi;
    pool_range(sj->n, ith, nth, &lo, &hi);
    for (long j = lo; j < hi; j++) {
        struct seq *s = e->s_seq[j];
        e->s_id[j] = engine_sample(e->smp[ith], &s->sp, &s->rng, e->s_logits[j], s->tok,
                                   s->n_tok, NULL);
    }
}

enum status engine_step(struct engine *e, struct err_detail *err)
{
    int nb;
    for (;;) {
        nb = schedule(e, err);
        if (nb || !e->n_running)
            break;
        /* running sequences all blocked on KV blocks: make room by preempting */
        preempt(e, newest_running(e));
    }
    if (!nb)
        return ST_OK;
    struct engine_batch b = {nb, e->b_tok, e->b_pos, e->b_seq, e->b_want};
    /* when every row sampled this step is plain greedy (no penalties), the model may hand back
     * the argmax tokens without writing the logits */
    int greedy = 1, fused = 0;
    for (int k = 0; k < nb && greedy; k++)
        greedy = !e->b_want[k] || engine_sampling_is_argmax(&e->b_owner[k]->sp);
    enum status st = greedy ? engine_model_forward_greedy(e->m, e->kv, &b, e->logits, e->s_id,
                                                          &fused, err)
                            : engine_model_forward(e->m, e->kv, &b, e->logits, err);
    if (st)
        return st;
    e->stats.steps++;
    e->stats.batch_tokens += (uint64_t)nb;
    e->stats.batch_seqs += (uint64_t)e->n_running;
    int32_t used = e->kv->n_blocks - engine_kv_available(e->kv);
    if (used > e->stats.peak_blocks_used)
        e->stats.peak_blocks_used = used;
    /* advance computed counts and register full blocks */
    for (int k = 0; k < nb; k++) {
        struct seq *s = e->b_owner[k];
        if (s->n_computed < (int32_t)s->n_prompt)
            e->stats.prompt_tokens++;
        s->n_computed++;
        if (k + 1 == nb || e->b_owner[k + 1] != s)
            engine_kv_prefix_commit(e->kv, s->slot, s->tok, s->n_computed);
    }
    /* sample for every sequence whose last known token was computed: draws in parallel (each
     * sequence has its own RNG and logits row, each thread its own scratch), then the tokens
     * are accepted in batch order */
    int n_s = 0;
    for (int k = 0; k < nb; k++) {
        if (!e->b_want[k])
            continue;
        e->s_seq[n_s] = e->b_owner[k];
        e->s_logits[n_s] = e->logits + (size_t)n_s * (size_t)e->m->hp.n_vocab;
        n_s++;
    }
    if (!fused) { /* else s_id holds the greedy tokens already */
        struct sample_job sj = {e, n_s};
        pool_run(e->pool, sample_range, &sj);
    }
    for (int j = 0; j < n_s; j++) {
        int ri = 0;
        while (e->running[ri] != e->s_seq[j])
            ri++;
        accept_token(e, ri, e->s_id[j]);
    }
    return ST_OK;
}

size_t engine_poll(struct engine *e, struct engine_output *out, size_t max)
{
    list_free(e->polled);
    e->polled = NULL;
    struct seq **tail = &e->polled;
    size_t n = 0;
    while (n < max && e->done_head) {
        struct seq *s = e->done_head;
        e->done_head = s->next;
        if (!e->done_head)
            e->done_tail = NULL;
        s->next = NULL;
        *tail = s;
        tail = &s->next;
        struct engine_output *o = &out[n++];
        o->id = s->id;
        o->user = s->user;
        o->tokens = s->tok + s->n_prompt;
        o->n_tokens = s->n_tok - s->n_prompt;
        o->text = s->text;
        o->text_len = s->n_text;
        o->finish = s->finish;
        o->stop_string = s->stop_string;
        o->n_prompt = s->n_prompt;
        o->n_cached = s->n_cached == (size_t)-1 ? 0 : s->n_cached;
        o->t_arrival = s->t_arrival;
        o->t_first = s->t_first;
        o->t_finish = s->t_finish;
        o->preemptions = s->preemptions;
    }
    return n;
}

enum status engine_warmup(struct engine *e, struct err_detail *err)
{
    int32_t prompt[8];
    for (int i = 0; i < 8; i++)
        prompt[i] = (int32_t)((i * 7919) % e->m->hp.n_vocab);
    struct engine_request r = {0};
    r.prompt = prompt;
    r.n_prompt = 8;
    engine_sampling_default(&r.sampling);
    r.sampling.temperature = 0;
    r.max_tokens = 2;
    r.ignore_eos = 1;
    r.request_id = "warmup";
    enum status st = engine_add_request(e, &r, NULL, err);
    while (!st && engine_pending(e))
        st = engine_step(e, err);
    struct engine_output o;
    while (engine_poll(e, &o, 1))
        ;
    engine_poll(e, &o, 0); /* frees the polled warm-up request */
    engine_kv_prefix_clear(e->kv);
    memset(&e->stats, 0, sizeof(e->stats));
    memset(&e->kv->stats, 0, sizeof(e->kv->stats));
    return st;
}
