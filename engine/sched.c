/* Scheduling: the waiting queue and the running list, admission, preemption and the per-step
 * token budget. Each step packs every decoding sequence's next token first, then prefill chunks
 * (oldest running first, then newly admitted waiting requests) under the token budget; when the
 * KV pool runs out, the most recently admitted sequence is preempted (its blocks freed, to be
 * recomputed later from its tokens, usually from the prefix cache) and requeued at the front. */
#include "engine/engine_internal.h"

#include <assert.h>
#include <stdlib.h>
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
static int gated(const struct seq *s)
{
    return s->gate && !s->lead && !s->gate->open;
}

void engine_sched_enqueue(struct engine *e, struct seq *s)
{
    wait_push_back(e, s);
}

/* Take running[ri] out of the running list (order kept) and give its KV slot back. */
static void running_remove(struct engine *e, int ri)
{
    struct seq *s = e->running[ri];
    if (s->lead && s->gate)
        s->gate->lead_slot = -1; /* nothing to fork from any more */
    engine_draft_release(e, s);
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

/* Unlink every sequence of `user` from the singly linked list at *head (tail kept) onto *out. */
static size_t list_take(struct seq **head, struct seq **tail, const void *user, struct seq **out)
{
    size_t n = 0;
    struct seq *prev = NULL;
    for (struct seq *s = *head, *next; s; s = next) {
        next = s->next;
        if (s->user != user) {
            prev = s;
            continue;
        }
        *(prev ? &prev->next : head) = next;
        if (*tail == s)
            *tail = prev;
        s->next = *out;
        *out = s;
        n++;
    }
    return n;
}

size_t engine_sched_cancel(struct engine *e, const void *user)
{
    struct seq *gone = NULL;
    size_t n_wait = list_take(&e->wait_head, &e->wait_tail, user, &gone);
    e->n_waiting -= n_wait;
    size_t n_run = 0;
    for (int ri = e->n_running - 1; ri >= 0; ri--) {
        struct seq *s = e->running[ri];
        if (s->user != user)
            continue;
        running_remove(e, ri);
        s->next = gone;
        gone = s;
        n_run++;
    }
    e->stats.cancelled += n_wait + n_run;
    size_t n_done = list_take(&e->done_head, &e->done_tail, user, &gone);
    for (struct seq *s = gone; s; s = s->next)
        e->stats.cancelled_tokens += (uint64_t)s->n_gen;
    engine_seq_list_free(gone);
    return n_wait + n_run + n_done;
}

/* Whether a sequence of user runs, has run (admitted once: preempted ones wait again) or ended. */
static int user_started(const struct engine *e, const void *user)
{
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i]->user == user)
            return 1;
    for (const struct seq *s = e->done_head; s; s = s->next)
        if (s->user == user)
            return 1;
    for (const struct seq *s = e->wait_head; s; s = s->next)
        if (s->user == user && (s->admitted || s->n_gen))
            return 1;
    return 0;
}

size_t engine_sched_unstarted(const struct engine *e, const void **users, size_t max)
{
    size_t n = 0;
    /* (once per stop, over at most a few times --max-seqs sequences) */
    for (const struct seq *s = e->wait_head; s && n < max; s = s->next) {
        int seen = 0;
        for (size_t i = 0; i < n && !seen; i++)
            seen = users[i] == s->user;
        if (!seen && !user_started(e, s->user))
            users[n++] = s->user;
    }
    return n;
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

/* Tokens of s that fit in the pool now, up to want, leaving `keep` blocks free. */
static int32_t fit_tokens(const struct engine *e, const struct seq *s, int32_t want, int32_t keep)
{
    const int B = e->p.kv_block;
    /* in 64 bits: a pool may hold over 2^31 tokens */
    int64_t held = engine_kv_seq_blocks(e->kv, s->slot);
    int64_t cap = (held + engine_kv_available(e->kv) - keep) * B - s->n_computed;
    return want < cap ? want : (int32_t)cap;
}

/* Blocks an admission leaves free: what the running sequences' next block boundaries take in
 * a step on average (one per kv_block decode steps each), so that admitting a prompt rarely
 * makes a running sequence's next decode preempt the newest (whose recompute, when its blocks
 * have been evicted meanwhile, costs its whole prompt again). 0 when nothing runs. */
static int32_t admit_headroom(const struct engine *e)
{
    return (e->n_running + e->p.kv_block - 1) / e->p.kv_block;
}

/* First position of s whose logits the step samples: its last token. A speculative step, with
 * draft tokens appended to tok, would want the rows from the last accepted token on. */
static int32_t logits_from(const struct seq *s)
{
    return (int32_t)s->n_tok - 1;
}

/* Append tokens [from, from + n) of s to the batch, asking for logits at positions >=
 * logits_from(s). */
static void batch_add(struct engine *e, int *nb, int *rows, struct seq *s, int32_t from, int32_t n)
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

/* A later choice admitted for the first time while its first choice runs with the prompt
 * computed: slot forks all of the prompt but its last token (whose logits the choice needs)
 * from the first choice's KV. Returns the tokens it holds (0: not forked). */
static int32_t prompt_fork(struct engine *e, const struct seq *s, int slot)
{
    if (!s->gate || s->lead || s->gate->lead_slot < 0 || s->n_tok != s->n_prompt ||
        s->n_prompt < 2)
        return 0;
    const int32_t n = (int32_t)s->n_prompt - 1;
    return engine_kv_fork(e->kv, slot, s->gate->lead_slot, n) ? n : 0;
}

/* 1 when s, with `cached` prompt tokens found in the prefix cache, would compute its next whole
 * block although a running sequence with the same tokens up to that block's end is computing it
 * now (in this batch or a later one) and will register it: s then waits, and finds it in the
 * cache a step later, instead of computing it twice (identical prompts, or a long shared
 * system prompt, admitted together). Waiting ends as soon as that sequence has computed the
 * block, whether or not it was registered; and s keeps a free slot meanwhile (schedule), so
 * requests behind it cannot take every slot and leave it waiting for a whole generation. */
uint32_t engine_seq_rope_variant(const struct engine_model *m, const struct seq *s)
{
    return (uint32_t)engine_model_rope_variant(m, (int64_t)s->n_tok - s->n_gen + s->max_tokens - 1);
}

static int shared_block_pending(const struct engine *e, const struct seq *s, int32_t cached)
{
    const int32_t B = e->p.kv_block, end = cached + B;
    /* (attach stops before the last token; a preempted sequence keeps its place: it is not
     * passed over) */
    if (!e->p.prefix_cache || end > (int32_t)s->n_tok - 1 || s->preemptions)
        return 0;
    for (int i = 0; i < e->n_running; i++) {
        const struct seq *r = e->running[i];
        if (r == s || r->n_computed >= end || r->n_computed < cached || (int32_t)r->n_tok < end ||
            memcmp(r->tok + cached, s->tok + cached, sizeof(int32_t) * (size_t)B) ||
            memcmp(r->tok, s->tok, sizeof(int32_t) * (size_t)cached) ||
            engine_seq_rope_variant(e->m, r) != engine_seq_rope_variant(e->m, s))
            continue; /* (another variant's blocks are none s can use) */
        return 1;
    }
    return 0;
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
        int32_t n = fit_tokens(e, s, left < budget ? left : budget, 0);
        if (n <= 0)
            continue;
        engine_kv_reserve(e->kv, s->slot, s->n_computed + n, NULL);
        batch_add(e, &nb, &rows, s, s->n_computed, n);
        budget -= n;
    }
    /* 3. admit waiting requests, in order, passing over gated choices and requests waiting for
     * a shared block (each keeping a free slot) */
    struct seq *prev = NULL;
    int kept = 0;
    while (budget > 0 && e->n_free_slots > kept) {
        struct seq *s = prev ? prev->next : e->wait_head;
        if (!s)
            break;
        if (gated(s)) {
            prev = s;
            continue;
        }
        int slot = e->free_slots[e->n_free_slots - 1];
        /* (LongRoPE: the factors for the longest the sequence may grow to, its whole life) */
        engine_kv_set_variant(e->kv, slot, engine_seq_rope_variant(e->m, s));
        int32_t cached = prompt_fork(e, s, slot);
        if (!cached)
            cached = engine_kv_prefix_attach(e->kv, slot, s->tok, (int32_t)s->n_tok,
                                             (int32_t)s->n_tok - 1);
        if (shared_block_pending(e, s, cached)) {
            engine_kv_release(e->kv, slot);
            kept++;
            prev = s;
            continue;
        }
        s->slot = slot;
        s->n_computed = cached;
        int32_t left = (int32_t)s->n_tok - cached;
        int32_t n = fit_tokens(e, s, left < budget ? left : budget, admit_headroom(e));
        if (n <= 0) {
            engine_kv_release(e->kv, slot);
            s->slot = -1;
            s->n_computed = 0;
            break;
        }
        wait_remove(e, prev, s);
        e->n_free_slots--;
        if (s->n_cached == (size_t)-1) { /* its first admission (not a re-admission) */
            if (e->start_gate)
                e->gate_users[e->n_gate_users++] = s->user;
            s->n_cached = (size_t)cached;
            e->stats.cached_tokens +=
                (uint64_t)(cached < (int32_t)s->n_prompt ? cached : (int32_t)s->n_prompt);
        }
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
    e->n_gate_users = 0;
    for (;;) {
        nb = schedule(e, err);
        if (nb || !e->n_running)
            break;
        /* running sequences all blocked on KV blocks: make room by preempting */
        preempt(e, newest_running(e));
    }
    if (nb && e->n_gate_users &&
        e->start_gate(e->start_gate_ctx, e->gate_users, e->n_gate_users, err) != ST_OK)
        return -1;
    return nb;
}

/* ---- speculative decoding ---- */

static int slot_cmp(const void *a, const void *b)
{
    const struct spec_slot *x = a, *y = b;
    if (x->surv != y->surv)
        return x->surv > y->surv ? -1 : 1;
    return x->j - y->j; /* keeps a path's drafts in order at equal survival */
}

/* A sequence with a grammar keeps the part of its draft the grammar can read (an end-of-
 * generation token ends it too), with the grammar's state after each kept token in dstate;
 * returns how many tokens are kept. */
static int grammar_drafts(struct engine *e, struct seq *s)
{
    int32_t st = s->gstate;
    int n = 0;
    while (n < s->draft.n && st >= 0) {
        int32_t t = s->draft.tok[n];
        if (engine_tok_is_eog(e->tok, t))
            break;
        size_t pn = engine_tok_piece(e->tok, t, 0, e->piece, e->piece_cap);
        if ((st = engine_grammar_feed(s->grammar, st, e->piece, pn)) < 0)
            break;
        s->dstate[n++] = st;
    }
    return s->draft.n = n;
}

/* Candidate slots for s's drafted path (after cutting it to what its grammar can read, and to
 * what the request can still take: a step accepts its sampled token and then its drafts, and
 * none after an end-of-generation token or beyond max_tokens could ever be used). */
static int add_slots(struct engine *e, struct seq *s, int n_slots)
{
    if (s->grammar && !grammar_drafts(e, s))
        return n_slots;
    const int32_t left = s->max_tokens - s->n_gen - 1; /* tokens after this step's sampled one */
    if (s->draft.n > left)
        s->draft.n = left > 0 ? left : 0;
    for (int j = 0; !s->ignore_eos && j < s->draft.n; j++)
        if (engine_tok_is_eog(e->tok, s->draft.tok[j]))
            s->draft.n = j + 1;
    float surv = 1;
    for (int j = 0; j < s->draft.n; j++) {
        surv *= s->draft.c[j];
        e->slots[n_slots++] = (struct spec_slot){s, j, surv};
    }
    return n_slots;
}

int engine_seq_tok_room(struct seq *s, size_t n)
{
    if (s->n_tok + n + 1 <= s->cap_tok)
        return 1;
    size_t cap = (s->n_tok + n + 1) * 2;
    int32_t *t = realloc(s->tok, sizeof(int32_t) * cap);
    if (!t)
        return 0;
    s->tok = t;
    s->cap_tok = cap;
    return 1;
}

/* Admit s's next draft token: its KV position reserved, the token written after the known
 * ones, n_draft counted. 0 (nothing taken) when the pool or the token array has no room. */
static int admit_next(struct engine *e, struct seq *s)
{
    const int32_t n_pos = (int32_t)s->n_tok + s->n_draft + 1;
    if (engine_kv_blocks_needed(e->kv, s->slot, n_pos) > engine_kv_available(e->kv) ||
        !engine_seq_tok_room(s, (size_t)s->n_draft + 1))
        return 0;
    enum status st = engine_kv_reserve(e->kv, s->slot, n_pos, NULL);
    assert(!st);
    (void)st;
    s->tok[s->n_tok + (size_t)s->n_draft] = s->draft.tok[s->n_draft];
    s->n_draft++;
    return 1;
}

/* Insert each sequence's admitted drafts after its last entry (in place, from the back). */
static int expand(struct engine *e, int nb, int added)
{
    int w = nb + added;
    for (int k = nb - 1; k >= 0; k--) {
        struct seq *s = e->b_owner[k];
        if (e->b_want[k])
            for (int i = s->n_draft - 1; i >= 0; i--) {
                w--;
                e->b_tok[w] = s->tok[s->n_tok + (size_t)i];
                e->b_pos[w] = (int32_t)s->n_tok + i;
                e->b_seq[w] = s->slot;
                e->b_owner[w] = s;
                e->b_want[w] = 1;
            }
        w--;
        e->b_tok[w] = e->b_tok[k];
        e->b_pos[w] = e->b_pos[k];
        e->b_seq[w] = e->b_seq[k];
        e->b_owner[w] = e->b_owner[k];
        e->b_want[w] = e->b_want[k];
    }
    assert(w == 0);
    return nb + added;
}

int engine_sched_speculate(struct engine *e, int nb)
{
    struct engine_spec *sp = e->spec;
    if (!sp)
        return nb;
    int rows = 0;
    for (int k = 0; k < nb; k++)
        rows += e->b_want[k];
    int room_tok = e->p.max_batch_tokens - nb, room_rows = e->n_logit_rows - rows;
    if (room_tok <= 0 || room_rows <= 0 || !rows)
        return nb;
    const int all = e->p.spec_budget == ENGINE_SPEC_BUDGET_ALL;
    /* Expected tokens out of the step (one per sampled row) and its cost; drafting is skipped
     * outright when even the most trusted first draft token could not raise tokens/second */
    double gain = rows, t = engine_spec_cost(sp, nb);
    if (!all && t > 0 &&
        (gain + engine_spec_best_conf(sp)) * t <= gain * engine_spec_cost(sp, nb + 1)) {
        e->stats.spec_skipped++;
        return nb;
    }
    double t0 = engine_now();
    int n_slots = 0, n_cand = 0;
    for (int k = 0; k < nb; k++) {
        if (!e->b_want[k])
            continue;
        struct seq *s = e->b_owner[k];
        s->n_draft = 0;
        s->draft.n = 0;
        if (s->spec_wait > 0) {
            s->spec_wait--;
            continue;
        }
        int kmax = s->max_tokens - s->n_gen - 1; /* drafts past max_tokens are never kept */
        kmax = kmax < e->p.spec_max_k ? kmax : e->p.spec_max_k;
        if (kmax <= 0)
            continue;
        if (e->dkv) { /* the draft model drafts for all of them at once, below */
            /* only within the draft model's context (it writes positions up to n_tok + kmax
             * - 2): its buffers hold no more, and one sequence past it failed the whole draft
             * batch (no drafts for any sequence while it ran) */
            const int64_t room = (int64_t)engine_model_hparams(e->p.draft_model)->n_ctx_train -
                                 (int64_t)s->n_tok + 1;
            if (room < kmax)
                kmax = (int)(room > 0 ? room : 0);
            if (kmax <= 0)
                continue;
            s->d_kmax = kmax;
            e->d_cand[n_cand++] = s;
            continue;
        }
        if (!engine_spec_propose(sp, s->tok, s->n_tok, kmax, s->spec_rate, &s->draft))
            continue;
        n_slots = add_slots(e, s, n_slots);
    }
    if (n_cand && engine_draft_propose(e, e->d_cand, n_cand, NULL) == ST_OK)
        for (int i = 0; i < n_cand; i++)
            n_slots = add_slots(e, e->d_cand[i], n_slots);
    e->stats.spec_draft_s += engine_now() - t0;
    if (!n_slots)
        return nb;
    qsort(e->slots, (size_t)n_slots, sizeof(*e->slots), slot_cmp);
    /* admit by survival while the expected tokens per second rise (DSpark's greedy budget) */
    int added = 0;
    for (int i = 0; i < n_slots && room_tok > 0 && room_rows > 0; i++) {
        struct seq *s = e->slots[i].s;
        if (e->slots[i].j != s->n_draft || s->n_draft >= s->draft.n)
            continue; /* an earlier draft of its path was not admitted */
        double t1 = engine_spec_cost(sp, nb + added + 1);
        if (!all && t1 > 0 && (gain + e->slots[i].surv) * t <= gain * t1)
            break; /* the first drop: stop */
        if (!admit_next(e, s)) {
            s->draft.n = s->n_draft; /* no room for more of its path */
            continue;
        }
        gain += e->slots[i].surv;
        t = t1;
        added++;
        room_tok--;
        room_rows--;
    }
    /* exploration: when nothing paid, one path whose bins have little evidence is verified
     * anyway, as far as its tokens' bins are unexplored (at most ENGINE_SPEC_EXPLORE tries
     * per coarse bin over the engine's life) */
    struct seq *x = NULL;
    for (int i = 0; !added && !all && i < n_slots; i++) {
        struct seq *s = e->slots[i].s;
        if (e->slots[i].j == 0 && engine_spec_exploring(sp, &s->draft, 0) &&
            (!x || s->draft.u[0] > x->draft.u[0]))
            x = s;
    }
    while (x && x->n_draft < x->draft.n && room_tok > 0 && room_rows > 0 &&
           engine_spec_exploring(sp, &x->draft, x->n_draft) && admit_next(e, x)) {
        added++;
        room_tok--;
        room_rows--;
    }
    if (!added)
        return nb;
    e->stats.spec_steps++;
    return expand(e, nb, added);
}

void engine_sched_computed(struct engine *e, int nb)
{
    for (int k = 0; k < nb; k++) {
        struct seq *s = e->b_owner[k];
        if (s->n_computed < (int32_t)s->n_prompt)
            e->stats.prompt_tokens++;
        s->n_computed++;
        if (k + 1 == nb || e->b_owner[k + 1] != s) {
            /* draft tokens are not known tokens: their blocks wait for verification */
            int32_t known = s->n_computed < (int32_t)s->n_tok ? s->n_computed : (int32_t)s->n_tok;
            engine_kv_prefix_commit(e->kv, s->slot, s->tok, known);
            engine_kv_slide(e->kv, s->slot, known); /* verification keeps at least these */
            if (s->lead && s->gate && s->n_computed >= (int32_t)s->n_prompt) {
                s->gate->open = 1;
                s->gate->lead_slot = s->slot;
            }
        }
    }
}
