/* Scheduling: the waiting queue and the running list, admission, preemption and the per-step
 * token budget. Each step packs every decoding sequence's next token first, then prefill chunks
 * (oldest running first, then newly admitted waiting requests) under the token budget; when the
 * KV pool runs out, the most recently admitted sequence is preempted (its blocks freed, to be
 * recomputed later from its tokens, usually from the prefix cache) and requeued at the front. */
#include "engine/engine_internal.h"

#include <assert.h>
#include <string.h>

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

/* Take s out of the waiting queue; prev is the entry before it (NULL for the head). */
static void wait_remove(struct engine *e, struct seq *prev, struct seq *s)
{
    *(prev ? &prev->next : &e->wait_head) = s->next;
    if (e->wait_tail == s)
        e->wait_tail = prev;
    s->next = NULL;
    e->n_waiting--;
}

/* 1 when s must keep waiting: a later choice whose first choice has not computed the prompt
 * yet (it would find nothing in the prefix cache). */
static int gated(const struct seq *s) { return s->gate && !s->lead && !s->gate->open; }

void engine_sched_enqueue(struct engine *e, struct seq *s) { wait_push_back(e, s); }

/* Take running[ri] out of the running list (order kept) and give its KV slot back. */
static void running_remove(struct engine *e, int ri)
{
    struct seq *s = e->running[ri];
    engine_kv_release(e->kv, s->slot);
    e->free_slots[e->n_free_slots++] = s->slot;
    s->slot = -1;
    memmove(&e->running[ri], &e->running[ri + 1],
            sizeof(*e->running) * (size_t)(e->n_running - ri - 1));
    e->n_running--;
}

void engine_sched_retire(struct engine *e, struct seq *s)
{
    assert(s->ended && s->state == SEQ_RUNNING);
    int ri = 0;
    while (e->running[ri] != s)
        ri++;
    running_remove(e, ri);
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
    running_remove(e, ri);
    s->n_computed = 0;
    s->preemptions++;
    e->stats.preemptions++;
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
    int32_t held = engine_kv_seq_blocks(e->kv, s->slot);
    int32_t cap = (held + engine_kv_available(e->kv)) * B - s->n_computed;
    return want < cap ? want : cap;
}

/* First position of s whose logits the step samples: its last token. A speculative step, with
 * draft tokens appended to tok, would want the rows from the last accepted token on. */
static int32_t logits_from(const struct seq *s) { return (int32_t)s->n_tok - 1; }

/* Append tokens [from, from + n) of s to the batch, asking for logits at positions >=
 * logits_from(s). */
static void batch_add(struct engine *e, int *nb, int *rows, struct seq *s, int32_t from,
                      int32_t n)
{
    const int32_t want_from = logits_from(s);
    for (int32_t i = 0; i < n; i++) {
        int k = (*nb)++;
        assert(k < e->p.max_batch_tokens);
        e->b_tok[k] = s->tok[from + i];
        e->b_pos[k] = from + i;
        e->b_seq[k] = s->slot;
        e->b_owner[k] = s;
        e->b_want[k] = from + i >= want_from;
        *rows += e->b_want[k];
    }
    assert(*rows <= e->n_logit_rows);
}

/* Build one step's batch; returns its token count (0 only when nothing can run). */
static int schedule(struct engine *e, struct err_detail *err)
{
    int budget = e->p.max_batch_tokens, nb = 0, rows = 0;
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
            batch_add(e, &nb, &rows, s, s->n_computed, 1);
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
        batch_add(e, &nb, &rows, s, s->n_computed, n);
        budget -= n;
    }
    /* 3. admit waiting requests, in order, passing over gated choices */
    struct seq *prev = NULL;
    while (budget > 0 && e->n_free_slots) {
        struct seq *s = prev ? prev->next : e->wait_head;
        if (!s)
            break;
        if (gated(s)) {
            prev = s;
            continue;
        }
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
        wait_remove(e, prev, s);
        e->n_free_slots--;
        if (s->n_cached == (size_t)-1)
            s->n_cached = (size_t)cached;
        s->state = SEQ_RUNNING;
        s->admitted = ++e->admit_counter;
        e->running[e->n_running++] = s;
        engine_kv_reserve(e->kv, slot, cached + n, NULL);
        batch_add(e, &nb, &rows, s, cached, n);
        budget -= n;
    }
    return nb;
}

int engine_sched_build(struct engine *e, struct err_detail *err)
{
    int nb;
    for (;;) {
        nb = schedule(e, err);
        if (nb || !e->n_running)
            break;
        /* running sequences all blocked on KV blocks: make room by preempting */
        preempt(e, newest_running(e));
    }
    return nb;
}

void engine_sched_computed(struct engine *e, int nb)
{
    for (int k = 0; k < nb; k++) {
        struct seq *s = e->b_owner[k];
        if (s->n_computed < (int32_t)s->n_prompt)
            e->stats.prompt_tokens++;
        s->n_computed++;
        if (k + 1 == nb || e->b_owner[k + 1] != s) {
            engine_kv_prefix_commit(e->kv, s->slot, s->tok, s->n_computed);
            if (s->lead && s->gate && s->n_computed >= (int32_t)s->n_prompt)
                s->gate->open = 1;
        }
    }
}
