/* Drafting with a draft model (engine_params.spec ENGINE_SPEC_MODEL): a second, usually
 * smaller, model with the same vocabulary keeps its own KV cache per sequence slot, with its
 * own prefix cache (the known tokens' full blocks are registered as they are computed, so
 * prompts that share a prefix, and a preempted sequence coming back, compute it once; draft
 * tokens not yet verified are never registered), and drafts each token as the request's sampler
 * would draw it from the draft model's logits (draw, below) -- a deterministic function of the
 * request's random numbers, so the engine's verification stays exactly lossless. Each step it first
 * catches up on the tokens a sequence gained since its last drafts (the prompt, for a new
 * sequence), then runs one forward pass per draft position over every drafting sequence. After
 * verification its KV keeps only the positions whose tokens were accepted (engine_draft_settle). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

enum status engine_draft_init(struct engine *e, struct err_detail *err)
{
    struct engine_model *dm = e->p.draft_model;
    if (!dm)
        return err_set(err, ST_ERR_INVALID_ARG, "engine: --spec model needs a draft model");
    const struct engine_hparams *h = engine_model_hparams(dm);
    char why[128];
    if (!engine_model_same_vocab(e->m, dm, why, sizeof(why)))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "engine: the draft model's vocabulary is not the model's (%s): they must "
                       "be the same",
                       why);
    enum status st =
        engine_kv_init(&e->dkv, h->n_layer, h->n_kv_head, h->head_dim, e->p.kv_dtype, e->p.kv_block,
                       engine_kv_n_blocks(e->kv), e->p.max_seqs, e->p.prefix_cache, err);
    if (st || (st = engine_model_kv_attach(dm, e->dkv, e->p.max_batch_tokens, err)))
        return st;
    const size_t bt = (size_t)e->p.max_batch_tokens;
    e->d_logits = malloc(sizeof(float) * (size_t)e->p.max_seqs * (size_t)h->n_vocab);
    e->d_tok = malloc(sizeof(int32_t) * bt);
    e->d_pos = malloc(sizeof(int32_t) * bt);
    e->d_seq = malloc(sizeof(int32_t) * bt);
    e->d_want = malloc(bt);
    e->d_owner = malloc(sizeof(*e->d_owner) * bt);
    e->d_cand = malloc(sizeof(*e->d_cand) * (size_t)e->p.max_seqs);
    e->d_todo = malloc(sizeof(*e->d_todo) * (size_t)e->p.max_seqs);
    e->d_lead = malloc(sizeof(*e->d_lead) * (size_t)e->p.max_seqs);
    if ((st = engine_sampler_init(&e->d_smp, h->n_vocab, err)))
        return st;
    if (!e->d_logits || !e->d_tok || !e->d_pos || !e->d_seq || !e->d_want || !e->d_owner ||
        !e->d_cand || !e->d_todo || !e->d_lead)
        return err_set(err, ST_ERR_NOMEM, "no memory for the draft model");
    return ST_OK;
}

void engine_draft_free(struct engine *e)
{
    if (e->dkv) {
        struct err_detail err = {0};
        if (engine_kv_check(e->dkv, 1, &err))
            abort(); /* a slot left behind: engine_draft_release was missed */
    }
    engine_kv_free(e->dkv);
    free(e->d_logits);
    free(e->d_tok);
    free(e->d_pos);
    free(e->d_seq);
    free(e->d_want);
    free(e->d_owner);
    free(e->d_cand);
    free(e->d_todo);
    free(e->d_lead);
    engine_sampler_free(e->d_smp);
}

void engine_draft_release(struct engine *e, struct seq *s)
{
    if (!e->dkv || s->slot < 0)
        return;
    engine_kv_release(e->dkv, s->slot);
    s->d_computed = 0;
}

void engine_draft_settle(struct engine *e, struct seq *s, size_t base, int acc)
{
    const int32_t keep = (int32_t)base + acc; /* positions whose tokens stood */
    if (s->d_computed > keep) {
        s->d_computed = keep;
        engine_kv_truncate(e->dkv, s->slot, keep);
    }
    s->d_proposed = 0;
}

/* Append token t of s at position pos to the draft batch (logits wanted or not). */
static void add(struct engine *e, int *nb, struct seq *s, int32_t t, int32_t pos, int want)
{
    int k = (*nb)++;
    e->d_tok[k] = t;
    e->d_pos[k] = pos;
    e->d_seq[k] = s->slot;
    e->d_want[k] = (uint8_t)want;
    e->d_owner[k] = s;
}

/* Draw draft token j of s (at position n_tok + j) from the draft model's logits l (scratch) as
 * the request's own sampler would draw it there (its penalties over its history with drafts
 * 0..j-1 after its known tokens, written at tok[n_tok..]; its grammar's mask in the state those
 * drafts lead to), by the path's kind (ENGINE_SPEC_KIND_*): at temperature 0 for GREEDY and
 * ARGMAX paths, with the request's parameters and its random number for that position for DRAW
 * paths (the inverse CDF at the u the verifier uses). Correctness never rests on it: the
 * verifier keeps a draft only where it equals its own draw. Returns the token, its probability
 * in *prob, or -1 when s can draft no further (no room, or its grammar allows nothing). */
static int32_t draw(struct engine *e, struct seq *s, int j, float *l, float *prob)
{
    const int32_t V = engine_model_hparams(e->m)->n_vocab;
    const size_t at = s->n_tok + (size_t)j;
    if (!engine_seq_tok_room(s, (size_t)j))
        return -1;
    memcpy(s->tok + s->n_tok, s->draft.tok, sizeof(int32_t) * (size_t)j);
    const int32_t gs = !s->grammar ? 0 : j ? s->dstate[j - 1] : s->gstate;
    if (s->grammar) {
        const uint32_t *m = gs >= 0 ? engine_grammar_mask(s->grammar, gs, e->vocab) : NULL;
        if (!m || !engine_mask_row(m, l, V))
            return -1;
    }
    struct engine_sampling sp = s->sp;
    if (s->d_kind != ENGINE_SPEC_KIND_DRAW)
        sp.temperature = 0;
    struct engine_rng r = s->rng;
    if (e->p.spec_test_draws == 3)
        r.key ^= 0x9e3779b97f4a7c15ull;
    float lp = 0;
    const int32_t t = engine_sample(e->d_smp, &sp, &r, at, l, s->tok, at, &lp);
    *prob = expf(lp);
    if (s->grammar) { /* its state after the draft, for the next draw */
        size_t pn = engine_tok_piece(e->tok, t, 0, e->piece, e->piece_cap);
        s->dstate[j] =
            engine_tok_is_eog(e->tok, t) ? -1 : engine_grammar_feed(s->grammar, gs, e->piece, pn);
    }
    return t;
}

/* Run the draft batch; each wanted row's draw (draw above) becomes its sequence's next draft
 * token, with the draft model's probability of it as evidence. A sequence whose draft ends its
 * output (an end-of-generation token it does not ignore) or that can draft no further is given
 * no more draft positions this step (d_kmax cut to what it has). */
static enum status run(struct engine *e, int nb, struct err_detail *err)
{
    struct engine_batch b = {nb, e->d_tok, e->d_pos, e->d_seq, e->d_want};
    enum status st = engine_model_forward(e->p.draft_model, e->dkv, &b, e->d_logits, err);
    if (st)
        return st;
    e->stats.spec_model_tokens += (uint64_t)nb;
    const int32_t V = engine_model_hparams(e->m)->n_vocab;
    int row = 0;
    for (int k = 0; k < nb; k++) {
        struct seq *s = e->d_owner[k];
        s->d_computed = e->d_pos[k] + 1;
        if (!e->d_want[k])
            continue;
        float *l = e->d_logits + (size_t)row++ * (size_t)V, prob = 0;
        const int j = s->draft.n;
        const int32_t t = draw(e, s, j, l, &prob);
        if (t < 0) {
            s->d_kmax = j > 0 ? j : 1; /* (nonzero: its known tokens' blocks still register) */
            continue;
        }
        if (!j) { /* a path of its kind drafted */
            e->stats.spec_model_drawn += s->d_kind == ENGINE_SPEC_KIND_DRAW;
            e->stats.spec_model_argmax += s->d_kind == ENGINE_SPEC_KIND_ARGMAX;
        }
        s->draft.tok[j] = t;
        engine_spec_rate_model(e->spec, &s->draft, j, prob, s->d_kind, s->spec_rate);
        s->draft.n = j + 1;
        if ((engine_tok_is_eog(e->tok, t) && !s->ignore_eos) || (s->grammar && s->dstate[j] < 0))
            s->d_kmax = j + 1;
    }
    return ST_OK;
}

/* 1 when s, whose draft KV is empty, starts with the same block of tokens as one of the n
 * sequences whose prompts are being caught up from nothing (it waits for their blocks). */
static int follows(const struct engine_model *dm, struct seq *const *lead, int n,
                   const struct seq *s, int kb)
{
    if (s->n_tok <= (size_t)kb)
        return 0; /* no whole block it could find cached */
    for (int i = 0; i < n; i++)
        if (lead[i]->n_tok > (size_t)kb &&
            !memcmp(lead[i]->tok, s->tok, sizeof(int32_t) * (size_t)kb) &&
            engine_seq_rope_variant(dm, lead[i]) == engine_seq_rope_variant(dm, s))
            return 1;
    return 0;
}

/* Take s's room in the draft KV for this step: the cached blocks of its prompt when its KV is
 * empty, then the positions it will write. 0 when there is none (s drafts nothing). */
static int take_room(struct engine *e, struct seq *s, int fresh)
{
    s->d_ready = 1;
    if (fresh) {
        engine_kv_set_variant(e->dkv, s->slot, engine_seq_rope_variant(e->p.draft_model, s));
        s->d_computed = engine_kv_prefix_attach(e->dkv, s->slot, s->tok, (int32_t)s->n_tok,
                                                (int32_t)s->n_tok - 1);
        e->stats.spec_model_cached += (uint64_t)s->d_computed;
    }
    const int32_t need = (int32_t)s->n_tok + s->d_kmax - 1;
    if (engine_kv_blocks_needed(e->dkv, s->slot, need) > engine_kv_available(e->dkv) ||
        engine_kv_reserve(e->dkv, s->slot, need, NULL))
        s->d_kmax = 0;
    return s->d_kmax > 0;
}

enum status engine_draft_propose(struct engine *e, struct seq *const *cand, int n,
                                 struct err_detail *err)
{
    const int B = e->p.max_batch_tokens, kb = engine_kv_block_size(e->dkv);
    struct seq **todo = e->d_todo, **lead = e->d_lead;
    for (int i = 0; i < n; i++) {
        struct seq *s = cand[i];
        s->draft.n = 0;
        s->draft.src = ENGINE_SPEC_SRC_MODEL;
        s->d_proposed = 0;
        s->d_ready = 0;
        /* the path's kind, by the sequence and its path number (not by the order in which
         * sequences come: a fixed order would give a sequence the same kind on every path) */
        const int forced = e->p.spec_test_draws;
        s->d_kind = s->sp.temperature == 0.0f ? ENGINE_SPEC_KIND_GREEDY
                    : forced == 2             ? ENGINE_SPEC_KIND_ARGMAX
                    : forced                  ? ENGINE_SPEC_KIND_DRAW
                             : engine_spec_model_kind(e->spec, s->id, s->d_paths++);
        todo[i] = s;
    }
    /* catch up: the tokens each gained since its last drafts, in passes of at most B tokens;
     * the pass that reaches a sequence's last token drafts its first token. A sequence whose
     * KV is empty (new, or preempted) first takes what the prefix cache holds of its prompt;
     * one whose first block another such sequence is computing in this step waits for a later
     * pass, so that a shared prefix is computed once (as the scheduler's shared_block_pending
     * does for the model itself). Each pass's known blocks are registered after it runs. */
    enum status st = ST_OK;
    int n_todo = n, n_lead = 0, k_most = 0;
    while (n_todo && !st) {
        int nb = 0, kept = 0;
        for (int i = 0; i < n_todo; i++) {
            struct seq *s = todo[i];
            if (nb >= B) {
                todo[kept++] = s;
                continue;
            }
            if (!s->d_ready) {
                const int fresh = s->d_computed == 0 && !engine_kv_seq_blocks(e->dkv, s->slot);
                if (fresh && follows(e->p.draft_model, lead, n_lead, s, kb)) {
                    todo[kept++] = s; /* after its lead's blocks are registered */
                    continue;
                }
                if (!take_room(e, s, fresh))
                    continue; /* no drafts this step */
                k_most = s->d_kmax > k_most ? s->d_kmax : k_most;
                if (fresh)
                    lead[n_lead++] = s;
            }
            const int32_t left = (int32_t)s->n_tok - s->d_computed;
            const int32_t t = left < B - nb ? left : B - nb;
            for (int32_t j = 0; j < t; j++)
                add(e, &nb, s, s->tok[s->d_computed + j], s->d_computed + j, j + 1 == left);
            if (t < left)
                todo[kept++] = s; /* continues in the next pass (run advances d_computed) */
        }
        n_todo = kept;
        if (nb)
            st = run(e, nb, err);
        for (int i = 0; i < n && !st; i++) /* the known tokens' blocks now written */
            if (cand[i]->d_kmax && cand[i]->d_ready)
                engine_kv_prefix_commit(e->dkv, cand[i]->slot, cand[i]->tok, cand[i]->d_computed);
        for (int i = 0; i < n_lead;) /* leads done with their prompts free their followers */
            if (lead[i]->d_computed >= (int32_t)lead[i]->n_tok)
                lead[i] = lead[--n_lead];
            else
                i++;
    }
    /* one pass per further draft position */
    for (int j = 1; j < k_most && !st; j++) {
        int nb = 0;
        for (int i = 0; i < n; i++) {
            struct seq *s = cand[i];
            if (s->d_kmax && s->draft.n == j && j < s->d_kmax)
                add(e, &nb, s, s->draft.tok[j - 1], (int32_t)s->n_tok + j - 1, 1);
        }
        if (!nb)
            break;
        st = run(e, nb, err);
    }
    for (int i = 0; i < n; i++)
        cand[i]->d_proposed = cand[i]->draft.n;
    return st;
}
