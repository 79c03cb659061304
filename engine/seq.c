/* A sequence's own state: its tokens (prompt, then generated), and what accepting a sampled
 * token does to it: the token is detokenised into its text (UTF-8 held back until complete),
 * checked against end-of-generation, max_tokens and the stop strings, and the text that became
 * final is streamed to the request's on_text. Nothing here knows about queues or the KV cache. */
#include "engine/engine_internal.h"

#include "common/fault.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double engine_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void engine_seq_free(struct seq *s)
{
    if (!s)
        return;
    engine_stop_free(s->stop);
    if (s->gate && --s->gate->refs == 0)
        free(s->gate);
    engine_grammar_unref(s->grammar);
    free(s->lp);
    free(s->lp_id);
    free(s->lp_top);
    free(s->tok);
    free(s->text);
    free(s);
}

void engine_seq_list_free(struct seq *s)
{
    while (s) {
        struct seq *n = s->next;
        engine_seq_free(s);
        s = n;
    }
}

enum status engine_seq_new(struct seq **out, const struct engine_request *r,
                           struct err_detail *err)
{
    *out = NULL;
    struct seq *s = fault_hit("engine.seq_new") ? NULL : calloc(1, sizeof(*s));
    if (!s)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    s->cap_tok = r->n_prompt + (size_t)(r->max_tokens < 64 ? r->max_tokens : 64) + 1;
    s->tok = malloc(sizeof(int32_t) * s->cap_tok);
    s->cap_text = 256;
    s->text = malloc(s->cap_text);
    if (!s->tok || !s->text) {
        engine_seq_free(s);
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    s->text[0] = 0;
    enum status st;
    if (r->n_stop && (st = engine_stop_init(&s->stop, r->stop, r->n_stop, err))) {
        engine_seq_free(s);
        return st;
    }
    memcpy(s->tok, r->prompt, sizeof(int32_t) * r->n_prompt);
    s->n_tok = s->n_prompt = r->n_prompt;
    s->sp = r->sampling;
    s->sp.counted_from = (uint32_t)r->n_prompt; /* frequency and presence: generated tokens */
    const char *rid = r->request_id ? r->request_id : "";
    engine_rng_seed(&s->rng, r->sampling.seed, rid, strlen(rid));
    s->max_tokens = r->max_tokens;
    s->ignore_eos = r->ignore_eos;
    s->user = r->user;
    s->on_text = r->on_text;
    s->slot = -1;
    s->n_cached = (size_t)-1; /* set at first admission */
    s->lp_k = r->logprobs ? r->top_logprobs : -1;
    s->spec_rate = -1;
    s->spec_backoff = 4;
    if (r->grammar) {
        s->grammar = r->grammar;
        engine_grammar_ref(s->grammar);
        s->gstate = engine_grammar_start(s->grammar);
    }
    *out = s;
    return ST_OK;
}

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

enum status engine_seq_room(struct seq *s, size_t k, size_t piece_cap)
{
    if (fault_hit("engine.seq_room"))
        return ST_ERR_NOMEM;
    if (s->n_tok + k > s->cap_tok) {
        size_t cap = (s->n_tok + k) * 2;
        int32_t *nt = realloc(s->tok, sizeof(int32_t) * cap);
        if (!nt)
            return ST_ERR_NOMEM;
        s->tok = nt;
        s->cap_tok = cap;
    }
    const size_t text = s->n_text + k * piece_cap + 1;
    if (text > s->cap_text) {
        char *nt = realloc(s->text, text * 2);
        if (!nt)
            return ST_ERR_NOMEM;
        s->text = nt;
        s->cap_text = text * 2;
    }
    const size_t i = s->n_tok - s->n_prompt + k, lk = s->lp_k > 0 ? (size_t)s->lp_k : 0;
    if (s->lp_k >= 0 && i > s->cap_lp) {
        size_t cap = s->cap_lp ? s->cap_lp * 2 : 64;
        cap = cap < i ? i : cap;
        float *a = realloc(s->lp, sizeof(float) * cap);
        if (a)
            s->lp = a;
        int32_t *b = lk ? realloc(s->lp_id, sizeof(int32_t) * cap * lk) : NULL;
        if (b)
            s->lp_id = b;
        float *c = lk ? realloc(s->lp_top, sizeof(float) * cap * lk) : NULL;
        if (c)
            s->lp_top = c;
        if (!a || (lk && (!b || !c)))
            return ST_ERR_NOMEM; /* (cap_lp unchanged: the arrays that grew are only larger) */
        s->cap_lp = cap;
    }
    return ST_OK;
}

void engine_seq_note_logprob(struct seq *s, float lp, const int32_t *top_id, const float *top_lp)
{
    size_t i = s->n_tok - s->n_prompt, k = (size_t)s->lp_k;
    if (i >= s->cap_lp)
        abort(); /* engine_seq_room made room before the step accepted anything */
    s->lp[i] = lp;
    if (k) {
        memcpy(s->lp_id + i * k, top_id, sizeof(int32_t) * k);
        memcpy(s->lp_top + i * k, top_lp, sizeof(float) * k);
    }
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

/* Pass the text that became final since the last call to the request's on_text. */
static void stream_text(struct seq *s, size_t final)
{
    if (s->on_text && final > s->n_streamed)
        s->on_text(s->user, s->text + s->n_streamed, final - s->n_streamed);
    s->n_streamed = final;
}

static void end_seq(struct seq *s, enum engine_finish why)
{
    s->ended = 1;
    s->finish = why;
    s->t_finish = engine_now();
}

/* One token: an end-of-generation token ends the text (bytes of an incomplete UTF-8 character
 * held back are flushed as the tokenizer's stream flush renders them); so does max_tokens; a
 * completed stop string ends it before the stop string. */
static void accept_one(struct engine *e, struct seq *s, int32_t id)
{
    s->n_gen++;
    e->stats.gen_tokens++;
    if (s->n_gen == 1)
        s->t_first = engine_now();
    const int eog = !s->ignore_eos && engine_tok_is_eog(e->tok, id);
    size_t n = 0;
    if (!eog) {
        if (tok_push(s, id))
            abort();      /* cannot be: engine_seq_room made room */
        if (s->grammar) { /* the mask let only tokens through that continue the grammar */
            size_t pn = engine_tok_piece(e->tok, id, 0, e->piece, e->piece_cap);
            s->gstate = engine_grammar_feed(s->grammar, s->gstate, e->piece, pn);
        }
        n = engine_tok_stream_push(e->tok, &s->ts, id, e->piece, e->piece_cap);
    }
    const int end = eog || s->n_gen >= s->max_tokens;
    if (end)
        n += engine_tok_stream_flush(&s->ts, e->piece + n, e->piece_cap - n);
    if (text_append(s, e->piece, n))
        abort(); /* cannot be: engine_seq_room made room */
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
    if (stopped || eog)
        end_seq(s, ENGINE_FINISH_STOP);
    else if (end)
        end_seq(s, ENGINE_FINISH_LENGTH);
}

void engine_seq_end_grammar(struct seq *s)
{
    s->n_final = s->n_text; /* what a stop matcher held back is output too */
    stream_text(s, s->n_text);
    end_seq(s, ENGINE_FINISH_GRAMMAR);
}

size_t engine_seq_accept(struct engine *e, struct seq *s, const int32_t *ids, size_t k)
{
    assert(s->state == SEQ_RUNNING && !s->ended);
    size_t i = 0;
    while (i < k && !s->ended)
        accept_one(e, s, ids[i++]);
    return i;
}
