/* Drafting with a draft model (engine_params.spec ENGINE_SPEC_MODEL): a second, usually
 * smaller, model with the same vocabulary keeps its own KV cache per sequence slot (no prefix
 * cache) and drafts greedily — a deterministic drafter, so the engine's verification stays
 * exactly lossless. Each step it first catches up on the tokens a sequence gained since its last
 * drafts (the prompt, for a new sequence), then runs one forward pass per draft position over
 * every drafting sequence. After verification its KV keeps only the positions whose tokens were
 * accepted (engine_draft_settle). */
#include <math.h>
#include <stdlib.h>

#include "engine/engine_internal.h"

enum status engine_draft_init(struct engine *e, struct err_detail *err)
{
    struct engine_model *dm = e->p.draft_model;
    if (!dm)
        return err_set(err, ST_ERR_INVALID_ARG, "engine: --spec model needs a draft model");
    const struct engine_hparams *h = engine_model_hparams(dm);
    const int V = engine_model_hparams(e->m)->n_vocab;
    if (h->n_vocab != V)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "engine: the draft model's vocabulary has %d tokens, the model's %d: they "
                       "must be the same", h->n_vocab, V);
    enum status st = engine_kv_init(&e->dkv, h->n_layer, h->n_kv_head, h->head_dim,
                                    e->p.kv_dtype, e->p.kv_block, engine_kv_n_blocks(e->kv),
                                    e->p.max_seqs, 0, err);
    if (st || (st = engine_model_kv_attach(dm, e->dkv, e->p.max_batch_tokens, err)))
        return st;
    const size_t bt = (size_t)e->p.max_batch_tokens;
    e->d_logits = malloc(sizeof(float) * (size_t)e->p.max_seqs * (size_t)V);
    e->d_tok = malloc(sizeof(int32_t) * bt);
    e->d_pos = malloc(sizeof(int32_t) * bt);
    e->d_seq = malloc(sizeof(int32_t) * bt);
    e->d_want = malloc(bt);
    e->d_owner = malloc(sizeof(*e->d_owner) * bt);
    e->d_cand = malloc(sizeof(*e->d_cand) * (size_t)e->p.max_seqs);
    if (!e->d_logits || !e->d_tok || !e->d_pos || !e->d_seq || !e->d_want || !e->d_owner ||
        !e->d_cand)
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

/* Run the draft batch; each wanted row's argmax becomes its sequence's next draft token (with
 * the draft model's probability of it as evidence). */
static enum status run(struct engine *e, int nb, struct err_detail *err)
{
    struct engine_batch b = {nb, e->d_tok, e->d_pos, e->d_seq, e->d_want};
    enum status st = engine_model_forward(e->p.draft_model, e->dkv, &b, e->d_logits, err);
    if (st)
        return st;
    const int32_t V = engine_model_hparams(e->m)->n_vocab;
    int row = 0;
    for (int k = 0; k < nb; k++) {
        struct seq *s = e->d_owner[k];
        s->d_computed = e->d_pos[k] + 1;
        if (!e->d_want[k])
            continue;
        const float *l = e->d_logits + (size_t)row++ * (size_t)V;
        int32_t best = 0;
        for (int32_t t = 1; t < V; t++)
            if (l[t] > l[best])
                best = t;
        double sum = 0;
        for (int32_t t = 0; t < V; t++)
            sum += exp((double)l[t] - (double)l[best]);
        const int j = s->draft.n;
        s->draft.tok[j] = best;
        engine_spec_rate_model(e->spec, &s->draft, j, (float)(1.0 / sum), s->spec_rate);
        s->draft.n = j + 1;
    }
    return ST_OK;
}

enum status engine_draft_propose(struct engine *e, struct seq *const *cand, int n,
                                 struct err_detail *err)
{
    const int B = e->p.max_batch_tokens;
    int k_most = 0;
    for (int i = 0; i < n; i++) { /* room in the draft KV for the positions it will write */
        struct seq *s = cand[i];
        s->draft.n = 0;
        s->draft.src = ENGINE_SPEC_SRC_MODEL;
        s->d_proposed = 0;
        const int32_t need = (int32_t)s->n_tok + s->d_kmax - 1;
        if (engine_kv_blocks_needed(e->dkv, s->slot, need) > engine_kv_available(e->dkv) ||
            engine_kv_reserve(e->dkv, s->slot, need, NULL))
            s->d_kmax = 0; /* no drafts this step */
        k_most = s->d_kmax > k_most ? s->d_kmax : k_most;
    }
    /* catch up: the tokens each gained since its last drafts, in passes of at most B tokens;
     * the pass that reaches a sequence's last token drafts its first token */
    enum status st = ST_OK;
    for (int next = 0; next < n && !st;) {
        int nb = 0;
        while (next < n && nb < B) {
            struct seq *s = cand[next];
            if (!s->d_kmax) {
                next++;
                continue;
            }
            int32_t left = (int32_t)s->n_tok - s->d_computed;
            int32_t t = left < B - nb ? left : B - nb;
            for (int32_t i = 0; i < t; i++)
                add(e, &nb, s, s->tok[s->d_computed + i], s->d_computed + i, i + 1 == left);
            if (t < left)
                break; /* continues in the next pass (run advances d_computed) */
            next++;
        }
        if (nb)
            st = run(e, nb, err);
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
