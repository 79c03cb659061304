/* The engine's public API and its step: a step takes the batch the scheduler built (sched.c),
 * runs the forward pass, samples the wanted rows on the engine's host pool and hands each
 * sequence its tokens (seq.c). All kernels are batch-invariant and every request has its own
 * RNG, so a request's tokens never depend on its batch mates or on the thread count. */
#include "engine/engine.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cpus.h"
#include "common/log.h"
#include "common/pool.h"
#include "engine/engine_internal.h"

void engine_params_default(struct engine_params *p)
{
    p->max_seqs = 256;
    p->max_batch_tokens = 512;
    p->kv_block = 16;
    p->kv_mem = (size_t)1 << 30;
    p->prefix_cache = 1;
    p->kv_window_pool = 1;
    p->kv_dtype = KERN_KV_F16;
    p->host_threads = 0;
    p->spec = 0;
    p->spec_max_k = 8;
    p->spec_budget = ENGINE_SPEC_BUDGET_AUTO;
    p->spec_test_broken = 0;
    p->spec_test_draws = 0;
}

size_t engine_kv_pool_bytes(const struct engine *e)
{
    return e->p.kv_mem;
}

/* What --kv-mem auto never goes beyond: max_seqs sequences at the model's full context (each
 * holds this many blocks, and one more while it grows); *one: one such sequence. Saturating (a
 * context length of nonsense). */
static uint64_t kv_need(const struct engine_model *m, const struct engine_params *p, uint64_t *one)
{
    const struct engine_hparams *hp = engine_model_hparams(m);
    const uint64_t blocks =
        ((uint64_t)hp->n_ctx_train + (uint64_t)p->kv_block - 1) / (uint64_t)p->kv_block + 1;
    const uint64_t bb = engine_model_kv_block_bytes(m, p->kv_block, p->kv_dtype);
    const uint64_t cap = (uint64_t)1 << 62;
    *one = bb && blocks > cap / bb ? cap : blocks * bb;
    return *one > cap / (uint64_t)p->max_seqs ? cap : *one * (uint64_t)p->max_seqs;
}

size_t engine_kv_mem_auto(const struct engine_model *m, const struct engine_params *p,
                          uint64_t avail)
{
    if (!avail || !engine_model_host_memory(m) || p->kv_block < 1 || p->max_seqs < 1)
        return (size_t)1 << 30;
    uint64_t one;
    const uint64_t need = kv_need(m, p, &one);
    /* never less than 1 GiB (the fixed default before) nor one full-context sequence: a request
     * the context holds always fits; all of need where that is less. But one sequence of a
     * long context (Phi-3.5 mini's 131,072 tokens: 48 GiB) gets at most half the memory: the
     * requests longer than the pool holds are refused one by one, not the whole run */
    uint64_t least = one > ((uint64_t)1 << 30) ? one : (uint64_t)1 << 30;
    if (one > avail / 2)
        least = avail / 2 > ((uint64_t)1 << 30) ? avail / 2 : (uint64_t)1 << 30;
    least = least < need ? least : need;
    uint64_t kv = avail / 4;
    const struct engine_model *dm = p->spec & ENGINE_SPEC_MODEL ? p->draft_model : NULL;
    if (dm) { /* the draft model's pool, as many blocks, takes its share of the quarter */
        const uint64_t bb = engine_model_kv_block_bytes(m, p->kv_block, p->kv_dtype);
        const uint64_t db = engine_model_kv_block_bytes(dm, p->kv_block, p->kv_dtype);
        kv = bb + db ? (uint64_t)((double)kv * (double)bb / (double)(bb + db)) : kv;
    }
    kv = kv < need ? kv : need;
    kv = kv > least ? kv : least;
    return kv > SIZE_MAX / 2 ? SIZE_MAX / 2 : (size_t)kv;
}

size_t engine_device_reserve(size_t total)
{
    const size_t least = (size_t)256 << 20;
    return total / 20 > least ? total / 20 : least;
}

uint64_t engine_kv_mem_device(const struct kern_mem_info *mi, int n_rank, uint64_t need)
{
    uint64_t per_rank = UINT64_MAX;
    for (int r = 0; r < n_rank; r++) {
        /* the ranks on rank r's device, and the least free memory any of them saw */
        int n = 0;
        size_t avail = mi[r].avail;
        for (int q = 0; q < n_rank; q++)
            if (mi[q].device == mi[r].device) {
                n++;
                avail = mi[q].avail < avail ? mi[q].avail : avail;
            }
        const size_t keep = engine_device_reserve(mi[r].total);
        const uint64_t room = avail > keep ? (uint64_t)(avail - keep) / (uint64_t)n : 0;
        per_rank = room < per_rank ? room : per_rank;
    }
    const uint64_t kv =
        n_rank > 0 && per_rank <= UINT64_MAX / (uint64_t)n_rank ? per_rank * (uint64_t)n_rank : 0;
    return kv < need ? kv : need;
}

/* --kv-mem auto on a device backend: the forward pass's buffers (and the draft model's) are
 * reserved first, at their largest (block tables as long as the context, or as the devices
 * could hold), then the pool takes what the devices have left beside engine_device_reserve's
 * share for the runtime and what comes later on rank 0's device: the logits buffer grown to
 * logit_rows rows and the device sampler's scratch of sample_rows. With a draft model on the
 * device its pool of as many blocks takes its part. */
static enum status kv_mem_device(struct engine_model *m, const struct engine_params *p,
                                 int logit_rows, int sample_rows, size_t *out,
                                 struct err_detail *err)
{
    struct kern_mem_info mi[ENGINE_MAX_RANKS];
    int n = engine_model_mem_info(m, mi, ENGINE_MAX_RANKS);
    if (!n) { /* the device cannot say */
        *out = (size_t)1 << 30;
        return ST_OK;
    }
    const uint64_t bb = engine_model_kv_block_bytes(m, p->kv_block, p->kv_dtype);
    uint64_t avail = 0;
    for (int r = 0; r < n; r++)
        avail += mi[r].avail;
    /* no block table longer than the context, nor than all the free memory could hold */
    const int64_t fit = bb ? (int64_t)(avail / bb) + 2 : INT32_MAX;
    struct engine_model *dm = p->spec & ENGINE_SPEC_MODEL ? p->draft_model : NULL;
    enum status st = ST_OK;
    for (int k = 0; k < 2 && !st; k++) {
        struct engine_model *x = k ? dm : m;
        if (!x || (k && engine_model_host_memory(x)))
            continue;
        int64_t ctx = (engine_model_hparams(x)->n_ctx_train + p->kv_block - 1) / p->kv_block + 1;
        ctx = ctx < fit ? ctx : fit;
        st = engine_model_reserve_sizes(x, p->max_batch_tokens, p->max_seqs, p->kv_block,
                                        (int)(ctx < INT32_MAX ? ctx : INT32_MAX), err);
    }
    if (st)
        return st;
    if (!(n = engine_model_mem_info(m, mi, ENGINE_MAX_RANKS))) {
        *out = (size_t)1 << 30;
        return ST_OK;
    }
    const uint64_t later = ((uint64_t)(logit_rows > 0 ? logit_rows : 0) +
                            (uint64_t)(sample_rows > 0 ? sample_rows : 0)) *
                           (uint64_t)engine_model_hparams(m)->n_vocab * sizeof(float);
    for (int r = 0; r < n; r++)
        if (mi[r].device == mi[0].device)
            mi[r].avail = mi[r].avail > later ? mi[r].avail - (size_t)later : 0;
    uint64_t one;
    const uint64_t need = kv_need(m, p, &one);
    uint64_t kv = engine_kv_mem_device(mi, n, UINT64_MAX);
    if (dm && !engine_model_host_memory(dm)) {
        const uint64_t db = engine_model_kv_block_bytes(dm, p->kv_block, p->kv_dtype);
        kv = bb + db ? (uint64_t)((double)kv * (double)bb / (double)(bb + db)) : kv;
    }
    kv = kv < need ? kv : need;
    if (kv < bb * 2) {
        int w = 0; /* the device with the least room */
        for (int r = 1; r < n; r++)
            w = mi[r].avail < mi[w].avail ? r : w;
        return err_set(err, ST_ERR_NOMEM,
                       "--kv-mem auto: device %d has %.0f MiB free after the weights and the "
                       "forward pass's buffers (and what its logits rows will take), and keeps "
                       "%.0f MiB for the runtime: no room for a KV cache (smaller "
                       "--max-batch-tokens or --max-seqs, more --tp ranks, or a device with "
                       "more memory)",
                       mi[w].device, (double)mi[w].avail / 1048576.0,
                       (double)engine_device_reserve(mi[w].total) / 1048576.0);
    }
    if (kv < one && kv < need && sample_rows > 0) /* (a run's; perplexity checks its windows) */
        LOG_WARN("--kv-mem auto: the device's free memory holds a KV pool of %.0f MiB, less "
                 "than one sequence at the model's full context (%.0f MiB): longer requests "
                 "fail as kv_cache_too_small",
                 (double)kv / 1048576.0, (double)one / 1048576.0);
    *out = kv > SIZE_MAX / 2 ? SIZE_MAX / 2 : (size_t)kv;
    return ST_OK;
}

enum status engine_kv_mem_resolve(struct engine_model *m, const struct engine_params *p,
                                  int logit_rows, int sample_rows, size_t *out,
                                  struct err_detail *err)
{
    if (p->kv_mem) {
        *out = p->kv_mem;
        return ST_OK;
    }
    if (engine_model_host_memory(m)) {
        *out = engine_kv_mem_auto(m, p, mem_available());
        return ST_OK;
    }
    return kv_mem_device(m, p, logit_rows, sample_rows, out, err);
}

/* The sliding-window layers' own KV pool (engine_kv_set_window), as planned. */
static enum status set_window(struct engine *e, const struct engine_kv_plan *plan,
                              struct err_detail *err)
{
    const int n_layer = engine_model_hparams(e->m)->n_layer;
    uint8_t *local = malloc((size_t)n_layer);
    if (!local)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    for (int l = 0; l < n_layer; l++)
        local[l] = (uint8_t)engine_model_layer_local(e->m, l);
    enum status st =
        engine_kv_set_window(e->kv, local, plan->window, (int32_t)plan->n_local, err);
    free(local);
    return st;
}

/* host_threads 0: the CPUs this process may use, at most 8 (sampling a step's rows gains
 * little beyond). */
static int host_threads(const struct engine_params *p)
{
    if (p->host_threads > 0)
        return p->host_threads;
    int n = cpus_usable();
    return n > 8 ? 8 : n;
}

int engine_logit_rows(const struct engine_params *p)
{
    int rows = p->max_seqs; /* one sampled row per running sequence */
    if (p->spec) {          /* and rows for draft tokens: a few per sequence when few run */
        int extra = p->max_seqs * p->spec_max_k < 128 ? p->max_seqs * p->spec_max_k : 128;
        rows =
            p->max_seqs + extra < p->max_batch_tokens ? p->max_seqs + extra : p->max_batch_tokens;
    }
    return rows;
}

size_t engine_logits_bytes(const struct engine_params *p, int32_t n_vocab)
{
    return sizeof(float) * (size_t)engine_logit_rows(p) * (size_t)n_vocab;
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
    if (p->spec & ~(ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX | ENGINE_SPEC_MODEL) ||
        p->spec_max_k < 1 ||
        p->spec_max_k > ENGINE_SPEC_MAX_K ||
        (p->spec_budget != ENGINE_SPEC_BUDGET_AUTO && p->spec_budget != ENGINE_SPEC_BUDGET_ALL))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "engine: speculation drafters 0x%x, max-k %d (1..%d) or budget %d invalid",
                       (unsigned)p->spec, p->spec_max_k, ENGINE_SPEC_MAX_K, p->spec_budget);
    if (p->kv_dtype != KERN_KV_F16 && p->kv_dtype != KERN_KV_Q8)
        return err_set(err, ST_ERR_INVALID_ARG, "engine: unknown KV dtype %d", p->kv_dtype);
    size_t kv_mem;
    enum status st =
        engine_kv_mem_resolve(m, p, engine_logit_rows(p), engine_logit_rows(p), &kv_mem, err);
    if (st)
        return st;
    const struct engine_kv_plan_in pin = {kv_mem,      p->kv_block,         p->kv_dtype,
                                          p->max_seqs, p->max_batch_tokens, p->kv_window_pool};
    struct engine_kv_plan plan;
    engine_model_kv_plan(m, &pin, &plan);
    if (plan.n_main < 1 || plan.n_main > (1 << 28))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "engine: kv-mem %zu bytes holds %lld blocks of %zu bytes (need 1..2^28)",
                       kv_mem, (long long)plan.n_main, plan.bytes_main + plan.bytes_local);
    struct engine *e = calloc(1, sizeof(*e));
    if (!e)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    e->m = m;
    e->tok = tok;
    e->p = *p;
    e->p.kv_mem = kv_mem;
    st =
        engine_kv_init(&e->kv, engine_model_hparams(m)->n_layer, engine_model_hparams(m)->n_kv_head,
                       engine_model_hparams(m)->head_dim, p->kv_dtype, p->kv_block,
                       (int32_t)plan.n_main, p->max_seqs, p->prefix_cache, err);
    if (st) {
        free(e);
        return st;
    }
    if (plan.n_local && (st = set_window(e, &plan, err))) {
        engine_free(e);
        return st;
    }
    if ((st = engine_model_kv_attach(m, e->kv, p->max_batch_tokens, err)) ||
        (st = pool_init(&e->pool, host_threads(p), err))) {
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
        if ((st = engine_sampler_init(&e->smp[i], engine_model_hparams(m)->n_vocab, err))) {
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
    e->n_logit_rows = engine_logit_rows(p);
    if (p->spec) {
        if ((st = engine_spec_new(&e->spec, p->spec, p->max_batch_tokens, err))) {
            engine_free(e);
            return st;
        }
        e->slots = malloc(sizeof(*e->slots) * (size_t)p->max_seqs * (size_t)p->spec_max_k);
        if (!e->slots) {
            engine_free(e);
            return err_set(err, ST_ERR_NOMEM, "no memory for the engine");
        }
        if ((p->spec & ENGINE_SPEC_MODEL) && (st = engine_draft_init(e, err))) {
            engine_free(e);
            return st;
        }
    }
    e->logits = malloc(sizeof(float) * (size_t)e->n_logit_rows * (size_t)engine_model_hparams(m)->n_vocab);
    e->s_seq = malloc(sizeof(*e->s_seq) * bt);
    e->s_logits = malloc(sizeof(*e->s_logits) * bt);
    e->s_id = malloc(sizeof(*e->s_id) * bt);
    e->s_lp = malloc(sizeof(*e->s_lp) * bt);
    e->s_off = malloc(sizeof(*e->s_off) * bt);
    e->s_alt = malloc(sizeof(*e->s_alt) * bt);
    e->s_stuck = calloc(bt, 1);
    e->s_top_id = malloc(sizeof(*e->s_top_id) * bt * ENGINE_TOP_LOGPROBS_MAX);
    e->s_top_lp = malloc(sizeof(*e->s_top_lp) * bt * ENGINE_TOP_LOGPROBS_MAX);
    e->s_mask = calloc(bt, sizeof(*e->s_mask));
    e->s_row = calloc(bt, sizeof(*e->s_row));
    e->s_out = calloc(bt, sizeof(*e->s_out));
    e->s_drawn = calloc(bt, 1);
    e->s_hook = calloc(bt, 1);
    e->h_nc =
        ((size_t)engine_model_hparams(m)->n_vocab + ENGINE_SAMPLE_CHUNK - 1) / ENGINE_SAMPLE_CHUNK;
    e->h_z = malloc(sizeof(*e->h_z) * (size_t)e->n_logit_rows * e->h_nc);
    e->h_m = malloc(sizeof(*e->h_m) * (size_t)e->n_logit_rows * e->h_nc);
    const char *hook_env = getenv("QUERN_SAMPLE_HOOK");
    e->hook_off = hook_env && !strcmp(hook_env, "0");
    e->lp_row = calloc((size_t)e->n_smp, sizeof(*e->lp_row));
    for (int i = 0; e->lp_row && i < e->n_smp; i++)
        if (!(e->lp_row[i] = malloc(sizeof(float) * (size_t)engine_model_hparams(m)->n_vocab))) {
            engine_free(e);
            return err_set(err, ST_ERR_NOMEM, "no memory for the engine");
        }
    e->piece_cap = ENGINE_TOK_STREAM_OUT_MAX(engine_tok_max_piece(tok)) + 8;
    e->piece = malloc(e->piece_cap);
    if (!e->running || !e->free_slots || !e->b_tok || !e->b_pos || !e->b_seq || !e->b_want ||
        !e->b_owner || !e->logits || !e->piece || !e->s_seq || !e->s_logits || !e->s_id ||
        !e->s_lp || !e->s_off || !e->s_alt || !e->s_stuck || !e->s_top_id || !e->s_top_lp ||
        !e->lp_row || !e->s_mask || !e->s_row || !e->s_out || !e->s_drawn || !e->s_hook ||
        !e->h_z || !e->h_m) {
        engine_free(e);
        return err_set(err, ST_ERR_NOMEM,
                       "no memory for the engine (its logits alone: %.0f MiB for --max-seqs %d; "
                       "lower --max-seqs)",
                       (double)engine_logits_bytes(p, engine_model_hparams(m)->n_vocab) / 1048576.0,
                       p->max_seqs);
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
        engine_draft_release(e, e->running[i]);
        engine_kv_release(e->kv, e->running[i]->slot);
        engine_seq_free(e->running[i]);
    }
    engine_seq_list_free(e->wait_head);
    engine_seq_list_free(e->done_head);
    engine_seq_list_free(e->polled);
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
    for (int i = 0; e->lp_row && i < e->n_smp; i++)
        free(e->lp_row[i]);
    free(e->lp_row);
    free(e->s_lp);
    free(e->s_off);
    free(e->s_alt);
    free(e->s_stuck);
    free(e->slots);
    engine_draft_free(e);
    engine_spec_free(e->spec);
    free(e->s_top_id);
    free(e->s_top_lp);
    free(e->s_mask);
    free(e->s_row);
    free(e->s_out);
    free(e->s_drawn);
    free(e->s_hook);
    free(e->h_z);
    free(e->h_m);
    free(e->pen_id);
    free(e->pen_count);
    free(e->pen_pair);
    free(e->masks);
    engine_vocab_free(e->vocab);
    pool_free(e->pool);
    free(e->s_seq);
    free(e->s_logits);
    free(e->s_id);
    free(e->running);
    free(e->free_slots);
    free(e->gate_users);
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
    out->kv_total = engine_kv_n_blocks(e->kv);
    out->kv_used = engine_kv_pool_used(e->kv, 0);
}

enum status engine_add_request(struct engine *e, const struct engine_request *r, uint64_t *id,
                               struct err_detail *err)
{
    const int n_ctx = engine_model_hparams(e->m)->n_ctx_train;
    enum status st;
    if (r->n_prompt < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "empty prompt");
    if (r->max_tokens < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "max_tokens must be >= 1");
    if (r->n_stop > ENGINE_MAX_STOP)
        return err_set(err, ST_ERR_INVALID_ARG, "at most %d stop strings", ENGINE_MAX_STOP);
    if ((st = engine_sampling_validate(&r->sampling, err)))
        return st;
    if (r->n_choices < 0 || r->n_choices > ENGINE_MAX_CHOICES || r->first_choice < 0 ||
        r->first_choice > INT32_MAX - ENGINE_MAX_CHOICES)
        return err_set(err, ST_ERR_INVALID_ARG, "n_choices %d not in 0..%d (or first_choice %d "
                       "negative)", r->n_choices, ENGINE_MAX_CHOICES, r->first_choice);
    if (r->logprobs && (r->top_logprobs < 0 || r->top_logprobs > ENGINE_TOP_LOGPROBS_MAX))
        return err_set(err, ST_ERR_INVALID_ARG, "top_logprobs %d not in 0..%d", r->top_logprobs,
                       ENGINE_TOP_LOGPROBS_MAX);
    for (size_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= engine_model_hparams(e->m)->n_vocab)
            return err_set(err, ST_ERR_RANGE, "prompt token %d is outside the vocabulary",
                           r->prompt[i]);
    uint64_t total = (uint64_t)r->n_prompt + (uint64_t)r->max_tokens;
    if (r->n_prompt >= (size_t)n_ctx) /* (whatever max_tokens is: no room for one token) */
        return err_set(err, ST_ERR_RANGE,
                       "prompt (%zu tokens) leaves no room for output in the model context (%d)",
                       r->n_prompt, n_ctx);
    if (total > (uint64_t)n_ctx)
        return err_set(err, ST_ERR_RANGE,
                       "prompt (%zu tokens) + max_tokens (%d) exceeds the model context (%d)",
                       r->n_prompt, r->max_tokens, n_ctx);
    uint64_t blocks = (total + (uint64_t)e->p.kv_block - 1) / (uint64_t)e->p.kv_block;
    if (blocks > (uint64_t)engine_kv_n_blocks(e->kv))
        return err_set(err, ST_ERR_CAPACITY,
                       "prompt + max_tokens needs %llu KV blocks; the pool has %d (raise --kv-mem)",
                       (unsigned long long)blocks, engine_kv_n_blocks(e->kv));
    if (r->grammar && !e->vocab &&
        (st = engine_vocab_new(&e->vocab, e->tok, engine_model_hparams(e->m)->n_vocab, err)))
        return st;
    /* every choice is made before any is queued, so a failure queues none */
    const int n = r->n_choices > 1 ? r->n_choices : 1;
    struct seq *first = NULL, **tail = &first;
    struct seq_gate *gate = NULL;
    if (n > 1 && e->p.prefix_cache) {
        if (!(gate = calloc(1, sizeof(*gate))))
            return err_set(err, ST_ERR_NOMEM, "no memory");
        gate->lead_slot = -1;
    }
    const double now = engine_now();
    for (int i = 0; i < n; i++) {
        struct seq *s;
        if ((st = engine_seq_new(&s, r, err))) {
            if (gate && !first) /* else the choices made hold it: freed with the last */
                free(gate);
            engine_seq_list_free(first);
            return st;
        }
        s->id = e->next_id;
        s->t_arrival = now;
        s->choice = r->first_choice + i;
        engine_rng_choice(&s->rng, (uint32_t)s->choice);
        s->lead = i == 0;
        if (gate) {
            s->gate = gate;
            gate->refs++;
        }
        *tail = s;
        tail = &s->next;
    }
    if (id)
        *id = e->next_id;
    e->next_id++;
    while (first) {
        struct seq *s = first;
        first = s->next;
        engine_sched_enqueue(e, s);
    }
    return ST_OK;
}

int engine_mask_row(const uint32_t *m, float *row, int32_t n_vocab)
{
    int any = 0;
    for (int32_t w = 0; w < (n_vocab + 31) / 32; w++) {
        any |= m[w] != 0;
        if (m[w] != 0xffffffffu)
            for (int32_t t = w * 32; t < w * 32 + 32 && t < n_vocab; t++)
                if (!(m[w] >> (t & 31) & 1))
                    row[t] = -INFINITY;
    }
    return any;
}

struct sample_job {
    struct engine *e; /* the engine */
    long n;           /* sampling jobs this step */
};

/* This step's sampling jobs, split evenly over the pool (engine_step); thread ith uses its own
 * sampler scratch, and each draw is keyed by its sequence and the position it fills
 * (engine_rng_at), so the tokens do not depend on the split. A speculative step samples several
 * rows of one sequence: row s_off = i draws the token at position n_tok + i with the history up
 * to it (the known tokens and drafts 1..i, which sit after them in tok) -- exactly the draw
 * decoding without drafts makes there if those drafts are accepted. */
static void sample_range(void *arg, int ith, int nth)
{
    const struct sample_job *sj = arg;
    struct engine *e = sj->e;
    const int32_t n_vocab = engine_model_hparams(e->m)->n_vocab;
    long lo, hi;
    pool_range(sj->n, ith, nth, &lo, &hi);
    for (long j = lo; j < hi; j++) {
        struct seq *s = e->s_seq[j];
        if (e->s_stuck[j]) { /* nothing to draw: engine_step ends it if it gets here */
            e->s_id[j] = -1;
            continue;
        }
        if (e->s_drawn[j]) /* the backend drew it (forward_sampled) */
            continue;
        const size_t at = s->n_tok + (size_t)e->s_off[j];
        if (e->s_hook[j]) { /* its whole-row pass ran in the epilogue (forward_hooked) */
            e->s_id[j] = engine_sample_chunked(e->smp[ith], &s->sp, engine_rng_at(&s->rng, at, 0),
                                               e->s_logits[j], e->h_z + (size_t)j * e->h_nc,
                                               e->h_m + (size_t)j * e->h_nc, NULL);
            continue;
        }
        float *row = e->s_logits[j];
        if (e->s_mask[j]) /* structured output: tokens that cannot continue the grammar are out */
            engine_mask_row(e->s_mask[j], row, n_vocab);
        if (s->lp_k >= 0) { /* sample a copy: the log-probabilities read the raw row */
            memcpy(e->lp_row[ith], row, sizeof(float) * (size_t)n_vocab);
            row = e->lp_row[ith];
        }
        if (e->p.spec_test_broken && e->s_off[j] < s->n_draft && s->lp_k < 0) {
            /* the deliberately wrong replacement for a rejected draft: a fresh draw from the
             * whole distribution (another key), which can be the rejected token again */
            memcpy(e->lp_row[ith], row, sizeof(float) * (size_t)n_vocab);
            struct engine_rng other = s->rng;
            other.key ^= 0x5bd1e995u;
            e->s_alt[j] = engine_sample(e->smp[ith], &s->sp, &other, (uint64_t)at, e->lp_row[ith],
                                        s->tok, at, NULL);
        }
        e->s_id[j] = engine_sample(e->smp[ith], &s->sp, &s->rng, (uint64_t)at, row, s->tok, at,
                                   NULL);
        if (s->lp_k >= 0)
            engine_logprobs(e->s_logits[j], n_vocab, e->s_id[j], s->lp_k, &e->s_lp[j],
                            e->s_top_id + j * ENGINE_TOP_LOGPROBS_MAX,
                            e->s_top_lp + j * ENGINE_TOP_LOGPROBS_MAX);
    }
}

/* Room in pen_id, pen_count and pen_pair for a row's (token, count) pairs after the first
 * n_pen entries: at most one per token of its penalty window (the last repeat_last_n of its
 * history of `at` tokens, or all of them). */
static enum status pen_room(struct engine *e, int n_pen, const struct engine_sampling *p, size_t at,
                            struct err_detail *err)
{
    const size_t window =
        p->repeat_last_n > 0 && (size_t)p->repeat_last_n < at ? (size_t)p->repeat_last_n : at;
    const size_t need = (size_t)n_pen + window;
    if (need <= e->pen_cap)
        return ST_OK;
    const size_t cap = 2 * need + 256;
    int32_t *id = realloc(e->pen_id, sizeof(*id) * cap);
    if (id)
        e->pen_id = id;
    int32_t *cnt = realloc(e->pen_count, sizeof(*cnt) * cap);
    if (cnt)
        e->pen_count = cnt;
    uint64_t *pair = realloc(e->pen_pair, sizeof(*pair) * cap);
    if (pair)
        e->pen_pair = pair;
    if (!id || !cnt || !pair)
        return err_set(err, ST_ERR_NOMEM, "no memory for the sampling penalties");
    e->pen_cap = cap;
    return ST_OK;
}

/* The forward pass with this step's n_s sampling rows drawn by the backend (engine_model_samples):
 * each row's parameters, penalties over its history, grammar mask (s_mask, made before the
 * pass) and uniform, exactly what sample_range would use; stuck grammar rows and the
 * broken-speculation test's rows stay on the host. Sets s_drawn, s_id and the
 * log-probabilities of the rows it drew. */
static enum status forward_sampled(struct engine *e, const struct engine_batch *b, int n_s,
                                   struct err_detail *err)
{
    _Static_assert(ENGINE_TOP_LOGPROBS_MAX == KERN_TOP_LOGPROBS_MAX, "top log-probability rows");
    const size_t words = ((size_t)engine_model_hparams(e->m)->n_vocab + 31) / 32;
    int n_pen = 0, n_masks = 0;
    enum status st;
    for (int j = 0; j < n_s; j++) {
        struct seq *s = e->s_seq[j];
        const size_t at = s->n_tok + (size_t)e->s_off[j];
        const struct engine_sampling *p = &s->sp;
        struct kern_sample_row *R = &e->s_row[j];
        if ((st = pen_room(e, n_pen, p, at, err)))
            return st;
        *R = (struct kern_sample_row){.temperature = p->temperature,
                                      .top_k = p->top_k,
                                      .top_p = p->top_p,
                                      .min_p = p->min_p,
                                      .repeat_penalty = p->repeat_penalty,
                                      .frequency_penalty = p->frequency_penalty,
                                      .presence_penalty = p->presence_penalty,
                                      .pen_first = n_pen,
                                      .u = engine_rng_at(&s->rng, at, 0),
                                      .lp_k = s->lp_k,
                                      .mask = -1,
                                      .host = e->s_stuck[j] || e->p.spec_test_broken};
        if (e->s_mask[j] && !R->host) { /* the grammar's mask goes up with the row */
            if (n_masks == e->masks_cap) {
                const int cap = 2 * n_masks + 8;
                uint32_t *mk = realloc(e->masks, sizeof(*mk) * (size_t)cap * words);
                if (!mk)
                    return err_set(err, ST_ERR_NOMEM, "no memory for the grammar masks");
                e->masks = mk;
                e->masks_cap = cap;
            }
            memcpy(e->masks + (size_t)n_masks * words, e->s_mask[j], sizeof(uint32_t) * words);
            R->mask = n_masks++;
        }
        R->pen_n = (int32_t)engine_sampler_counts(e->smp[0], p, s->tok, at, e->pen_id + n_pen,
                                                  e->pen_count + n_pen);
        n_pen += R->pen_n;
    }
    st = engine_model_forward_sample(e->m, e->kv, b, e->s_row, e->pen_id, e->pen_count, n_pen,
                                     e->masks, n_masks, e->s_out, e->logits, err);
    if (st)
        return st;
    for (int j = 0; j < n_s; j++) {
        const struct kern_sample_out *o = &e->s_out[j];
        e->s_drawn[j] = o->id >= 0;
        e->stats.sampled_backend += o->id >= 0;
        e->stats.sampled_host += o->id < 0;
        if (o->id < 0)
            continue;
        e->s_id[j] = o->id;
        if (e->s_row[j].lp_k < 0)
            continue;
        e->s_lp[j] = o->lp;
        memcpy(e->s_top_id + j * ENGINE_TOP_LOGPROBS_MAX, o->top_id,
               sizeof(o->top_id[0]) * (size_t)e->s_row[j].lp_k);
        memcpy(e->s_top_lp + j * ENGINE_TOP_LOGPROBS_MAX, o->top_lp,
               sizeof(o->top_lp[0]) * (size_t)e->s_row[j].lp_k);
    }
    return ST_OK;
}

/* packed (token, count) pairs in token order (qsort) */
static int pair_cmp(const void *a, const void *b)
{
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The output projection's epilogue (engine_model_forward_hook): columns [r0, r1) of every
 * row, at blk + j * ld, go to its logits; on the way a row that takes it is penalised (in the
 * block) and through engine_sampler_chunk. */
static void sample_hook(void *ctx, int ith, int64_t r0, int64_t r1, float *blk, size_t ld)
{
    (void)ith;
    struct engine *e = ctx;
    const size_t c = (size_t)r0 / ENGINE_SAMPLE_CHUNK, n = (size_t)(r1 - r0);
    for (int j = 0; j < e->n_hook_rows; j++) {
        float *src = blk + (size_t)j * ld, *dst = e->s_logits[j] + r0;
        if (!e->s_hook[j]) {
            memcpy(dst, src, sizeof(float) * n);
            continue;
        }
        const struct engine_sampling *p = &e->s_seq[j]->sp;
        const int32_t *pid = e->pen_id + e->s_row[j].pen_first;
        const int32_t *pc = e->pen_count + e->s_row[j].pen_first;
        int32_t lo = 0, hi = e->s_row[j].pen_n; /* the first penalised token >= r0 */
        while (lo < hi) {
            const int32_t mid = lo + (hi - lo) / 2;
            if (pid[mid] < r0)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (; lo < e->s_row[j].pen_n && pid[lo] < r1; lo++)
            src[pid[lo] - r0] = engine_sampler_penalise(p, src[pid[lo] - r0], pc[lo]);
        e->h_z[(size_t)j * e->h_nc + c] =
            engine_sampler_chunk(src, dst, n, p->temperature, &e->h_m[(size_t)j * e->h_nc + c]);
    }
}

/* The forward pass with this step's n_s sampling rows' whole-row pass in the output
 * projection's epilogue, for the rows whose draw takes it (temperature > 0, no top_k, no
 * grammar, no log-probabilities: engine_sample_chunked); sets s_hook, all 0 when the backend
 * did not run it. */
static enum status forward_hooked(struct engine *e, const struct engine_batch *b, int n_s,
                                  struct err_detail *err)
{
    const int32_t n_vocab = engine_model_hparams(e->m)->n_vocab;
    int n_pen = 0, any = 0;
    enum status st;
    for (int j = 0; j < n_s; j++) {
        struct seq *s = e->s_seq[j];
        const struct engine_sampling *p = &s->sp;
        e->s_hook[j] = !e->hook_off && p->temperature > 0.0f &&
                       !(p->top_k > 0 && p->top_k < n_vocab) && !e->s_mask[j] && !e->s_stuck[j] &&
                       s->lp_k < 0 && !e->p.spec_test_broken;
        if (!e->s_hook[j])
            continue;
        any = 1;
        const size_t at = s->n_tok + (size_t)e->s_off[j];
        if ((st = pen_room(e, n_pen, p, at, err)))
            return st;
        e->s_row[j].pen_first = n_pen;
        e->s_row[j].pen_n = (int32_t)engine_sampler_counts(e->smp[0], p, s->tok, at,
                                                           e->pen_id + n_pen, e->pen_count + n_pen);
        /* sorted by token: each (id, count) pair packed in one word, ids distinct */
        uint64_t *pair = e->pen_pair;
        const int32_t np = e->s_row[j].pen_n;
        for (int32_t k = 0; k < np; k++)
            pair[k] =
                (uint64_t)(uint32_t)e->pen_id[n_pen + k] << 32 | (uint32_t)e->pen_count[n_pen + k];
        qsort(pair, (size_t)np, sizeof(*pair), pair_cmp);
        for (int32_t k = 0; k < np; k++) {
            e->pen_id[n_pen + k] = (int32_t)(pair[k] >> 32);
            e->pen_count[n_pen + k] = (int32_t)(uint32_t)pair[k];
        }
        n_pen += e->s_row[j].pen_n;
    }
    e->n_hook_rows = n_s;
    int hooked = 0;
    st = any ? engine_model_forward_hook(e->m, e->kv, b, e->logits, sample_hook, e, &hooked, err)
             : engine_model_forward(e->m, e->kv, b, e->logits, err);
    if (!hooked)
        memset(e->s_hook, 0, (size_t)n_s);
    for (int j = 0; j < n_s; j++)
        e->stats.sampled_epilogue += e->s_hook[j];
    return st;
}

/* A finished sequence leaves the running list; the job's suffix index learns its output. */
static void finish(struct engine *e, struct seq *s)
{
    engine_spec_learn(e->spec, s->tok, s->n_prompt, s->tok + s->n_prompt, s->n_tok - s->n_prompt);
    engine_sched_retire(e, s);
}

/* s's verification outcome: its first n_acc of n_draft drafts matched the draws, and the first
 * n_used of those became output (fewer when a stop string ended the request). The confidence
 * model learns from the matches (what it predicts); the counters count what was used. Updates
 * the request's recent acceptance, and sends a request whose drafts keep failing to sit out a
 * while (doubling each time, up to 64 steps). */
static void spec_outcome(struct engine *e, struct seq *s, int n_acc, int n_used)
{
    const int nd = s->n_draft;
    engine_spec_observe(e->spec, &s->draft, nd, n_acc);
    e->stats.spec_drafted += (uint64_t)nd;
    e->stats.spec_accepted += (uint64_t)n_used;
    for (int i = 0; i < nd; i++) {
        e->stats.spec_tried_at[i]++;
        e->stats.spec_acc_at[i] += i < n_used;
    }
    float r = (float)n_acc / (float)nd;
    s->spec_rate = s->spec_rate < 0 ? r : 0.7f * s->spec_rate + 0.3f * r;
    if (s->spec_rate < 0.1f) {
        s->spec_wait = s->spec_backoff;
        s->spec_backoff = s->spec_backoff < 64 ? s->spec_backoff * 2 : 64;
        s->spec_rate = -1;
    } else if (s->spec_rate >= 0.3f) {
        s->spec_backoff = 4;
    }
}

enum status engine_step(struct engine *e, struct err_detail *err)
{
    const double t_step = engine_now();
    int nb = engine_sched_build(e, err);
    if (nb < 0)
        return err->status;
    if (!nb)
        return ST_OK;
    nb = engine_sched_speculate(e, nb);
    struct engine_batch b = {nb, e->b_tok, e->b_pos, e->b_seq, e->b_want};
    /* when every row sampled this step is plain greedy (no penalties), the model may hand back
     * the argmax tokens without writing the logits */
    int greedy = 1, fused = 0;
    for (int k = 0; k < nb && greedy; k++)
        greedy = !e->b_want[k] ||
                 (engine_sampling_is_argmax(&e->b_owner[k]->sp) && e->b_owner[k]->lp_k < 0 &&
                  !e->b_owner[k]->grammar);
    /* the rows to sample: every sequence whose last known token is computed this step, each
     * row's logits at its index in e->logits */
    int n_s = 0;
    for (int k = 0; k < nb; k++) {
        if (!e->b_want[k])
            continue;
        e->s_seq[n_s] = e->b_owner[k];
        e->s_off[n_s] = n_s && e->s_seq[n_s - 1] == e->b_owner[k] ? e->s_off[n_s - 1] + 1 : 0;
        e->s_logits[n_s] = e->logits + (size_t)n_s * (size_t)engine_model_hparams(e->m)->n_vocab;
        e->s_drawn[n_s] = 0; /* every per-row flag is this step's: the branches below set */
        e->s_hook[n_s] = 0;  /* only those they use (a greedy step leaves s_hook alone) */
        n_s++;
    }
    /* the grammar rows' masks: first every grammar may drop its old masks, then they are taken
     * (computed here, on this thread, when new) and stay valid through the sampling */
    for (int j = 0; j < n_s; j++)
        if (e->s_seq[j]->grammar)
            engine_grammar_trim(e->s_seq[j]->grammar);
    for (int j = 0; j < n_s; j++) {
        struct seq *s = e->s_seq[j];
        e->s_mask[j] = NULL;
        e->s_stuck[j] = 0;
        if (!s->grammar)
            continue;
        /* row i's state: after the known tokens, then drafts 0..i-1 (engine_sched_speculate
         * drafts only what the grammar can read) */
        const int32_t gs = e->s_off[j] ? s->dstate[e->s_off[j] - 1] : s->gstate;
        if (gs < 0) { /* the last token's bytes passed the grammar's stack limit */
            e->s_stuck[j] = 1;
            continue;
        }
        if (!(e->s_mask[j] = engine_grammar_mask(s->grammar, gs, e->vocab)))
            return err_set(err, ST_ERR_NOMEM, "out of memory for a grammar's token mask");
        int any = 0;
        for (int32_t w = 0; w < (engine_model_hparams(e->m)->n_vocab + 31) / 32 && !any; w++)
            any = e->s_mask[j][w] != 0;
        e->s_stuck[j] = !any;
    }
    enum status st =
        greedy ? engine_model_forward_greedy(e->m, e->kv, &b, e->logits, e->s_id, &fused, err)
        : engine_model_samples(e->m) ? forward_sampled(e, &b, n_s, err)
                                     : forward_hooked(e, &b, n_s, err);
    if (st)
        return st;
    e->stats.steps++;
    e->stats.batch_tokens += (uint64_t)nb;
    e->stats.batch_seqs += (uint64_t)e->n_running;
    int32_t used = engine_kv_pool_used(e->kv, 0);
    if (used > e->stats.peak_blocks_used)
        e->stats.peak_blocks_used = used;
    engine_sched_computed(e, nb);
    /* sample for every sequence whose last known token was computed: draws in parallel (each
     * row has its own logits, its sequence's key and position, each thread its own scratch),
     * then the tokens are accepted in batch order (rows a backend that samples drew are done) */
    if (!fused) { /* else s_id holds the greedy tokens already */
        struct sample_job sj = {e, n_s};
        pool_run(e->pool, sample_range, &sj);
        for (int i = 0; i < e->n_smp; i++) {
            uint64_t fast, full;
            engine_sampler_take_counts(e->smp[i], &fast, &full);
            e->stats.nucleus_fast += fast;
            e->stats.nucleus_full += full;
        }
    }
    /* room for every sequence's tokens first, so that accepting them cannot fail half-way */
    for (int j = 0; j < n_s; j += 1 + e->s_seq[j]->n_draft)
        if (engine_seq_room(e->s_seq[j], 1 + (size_t)e->s_seq[j]->n_draft, e->piece_cap))
            return err_set(err, ST_ERR_NOMEM,
                           "out of memory for the generated tokens of %d "
                           "sequences (lower --max-seqs)",
                           n_s);
    /* accept each sequence's tokens: row i's draw, for i = 0 and for every row whose previous
     * row drew the draft that follows it (a speculative step samples 1 + n_draft rows; the
     * rows after the first rejected draft are dropped and their KV rolled back) */
    for (int j = 0; j < n_s;) {
        struct seq *s = e->s_seq[j];
        const int nd = s->n_draft;
        const size_t base = s->n_tok;
        int acc = 0; /* a stuck row drew -1: no draft matches it */
        while (acc < nd && e->s_id[j + acc] == s->tok[base + (size_t)acc])
            acc++;
        if (s->d_proposed)
            engine_draft_settle(e, s, base, acc);
        if (nd && e->p.spec_test_broken && acc < nd && s->lp_k < 0)
            e->s_id[j + acc] = e->s_alt[j + acc];
        int took = 0; /* tokens this step gave the sequence: its draw, then accepted drafts */
        for (int i = 0; i <= acc && !s->ended; i++, took++) {
            if (e->s_stuck[j + i]) {
                engine_seq_end_grammar(s);
                break;
            }
            if (s->lp_k >= 0) /* rows that want logprobs never take the fused greedy path */
                engine_seq_note_logprob(s, e->s_lp[j + i],
                                        e->s_top_id + (j + i) * ENGINE_TOP_LOGPROBS_MAX,
                                        e->s_top_lp + (j + i) * ENGINE_TOP_LOGPROBS_MAX);
            engine_seq_accept(e, s, &e->s_id[j + i], 1);
        }
        /* the drafts it used (one that matched after the sequence ended, at a stop string, was
         * no gain: counted as rejected) */
        if (nd)
            spec_outcome(e, s, acc, took - 1 < acc ? (took > 0 ? took - 1 : 0) : acc);
        s->n_draft = 0;
        if (s->ended) {
            finish(e, s);
        } else if (nd) { /* keep the accepted drafts' KV, drop the rest's */
            s->n_computed = (int32_t)base + acc;
            engine_kv_truncate(e->kv, s->slot, s->n_computed);
            engine_kv_prefix_commit(e->kv, s->slot, s->tok, s->n_computed);
        }
        j += 1 + nd;
    }
    if (e->spec) {
        engine_spec_time(e->spec, nb, engine_now() - t_step, 0);
        e->stats.spec_ece = engine_spec_ece(e->spec, NULL);
    }
    return ST_OK;
}

size_t engine_cancel(struct engine *e, const void *user)
{
    return engine_sched_cancel(e, user);
}

enum status engine_set_start_gate(struct engine *e, engine_start_gate_fn gate, void *ctx,
                                  struct err_detail *err)
{
    if (gate && !e->gate_users &&
        !(e->gate_users = malloc(sizeof(*e->gate_users) * (size_t)e->p.max_seqs)))
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    e->start_gate = gate;
    e->start_gate_ctx = ctx;
    return ST_OK;
}

size_t engine_unstarted(const struct engine *e, const void **users, size_t max)
{
    return engine_sched_unstarted(e, users, max);
}

size_t engine_poll(struct engine *e, struct engine_output *out, size_t max)
{
    engine_seq_list_free(e->polled);
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
        o->choice = s->choice;
        o->logprobs = s->lp_k >= 0 ? s->lp : NULL;
        o->top_logprobs = s->lp_k > 0 ? s->lp_k : 0;
        o->top_ids = s->lp_k > 0 ? s->lp_id : NULL;
        o->top_lps = s->lp_k > 0 ? s->lp_top : NULL;
    }
    return n;
}

/* Speculation's step-cost model starts from one forward pass per batch size: sizes 1..8, then
 * a quarter octave apart up to 64 (the slot's own positions, logits wanted for every row, as a
 * step of drafts wants them); real steps measure the sizes they run and refine the rest. */
static enum status measure_steps(struct engine *e, struct err_detail *err)
{
    const int slot = e->free_slots[e->n_free_slots - 1];
    const int32_t n_vocab = engine_model_hparams(e->m)->n_vocab;
    enum status st = ST_OK;
    const int n_ctx = engine_model_hparams(e->m)->n_ctx_train;
    int max_b = e->p.max_batch_tokens < 64 ? e->p.max_batch_tokens : 64;
    if (max_b > n_ctx) /* positions past the context are none a sequence reaches */
        max_b = n_ctx;
    for (int b = 1; b <= max_b && !st; b = b < 8 ? b + 1 : b + (b + 3) / 4) {
        if (engine_kv_blocks_needed(e->kv, slot, b) > engine_kv_available(e->kv))
            break;
        if ((st = engine_kv_reserve(e->kv, slot, b, err)))
            break;
        for (int i = 0; i < b; i++) {
            e->b_tok[i] = (int32_t)((i * 7919) % n_vocab);
            e->b_pos[i] = i;
            e->b_seq[i] = slot;
            e->b_want[i] = i >= b - e->n_logit_rows;
        }
        struct engine_batch bt = {b, e->b_tok, e->b_pos, e->b_seq, e->b_want};
        double t0 = engine_now();
        st = engine_model_forward(e->m, e->kv, &bt, e->logits, err);
        engine_spec_time(e->spec, b, engine_now() - t0, 1);
        engine_kv_release(e->kv, slot);
    }
    return st;
}

enum status engine_warmup(struct engine *e, struct err_detail *err)
{
    /* 8 prompt tokens and 2 generated, or what a model's context holds of them */
    const int n_ctx = engine_model_hparams(e->m)->n_ctx_train;
    int n_prompt = n_ctx - 2;
    if (n_prompt > 8)
        n_prompt = 8;
    if (n_prompt < 1)
        n_prompt = 1;
    int32_t prompt[8];
    for (int i = 0; i < n_prompt; i++)
        prompt[i] = (int32_t)((i * 7919) % engine_model_hparams(e->m)->n_vocab);
    struct engine_request r = {0};
    r.prompt = prompt;
    r.n_prompt = (size_t)n_prompt;
    engine_sampling_default(&r.sampling);
    r.sampling.temperature = 0;
    r.max_tokens = n_ctx - n_prompt < 2 ? n_ctx - n_prompt : 2;
    r.ignore_eos = 1;
    r.request_id = "warmup";
    enum status st = engine_add_request(e, &r, NULL, err);
    while (!st && engine_pending(e))
        st = engine_step(e, err);
    struct engine_output o;
    while (engine_poll(e, &o, 1))
        ;
    engine_poll(e, &o, 0); /* frees the polled warm-up request */
    if (!st && e->spec)
        st = measure_steps(e, err);
    engine_kv_prefix_clear(e->kv);
    memset(&e->stats, 0, sizeof(e->stats));
    engine_kv_stats_reset(e->kv);
    return st;
}
