/* The forward pass over a flat multi-sequence batch, read top to bottom like llama2.c:
 * embed (x sqrt(n_embd) for gemma3) -> per layer (RMSNorm, QKV (+ biases), QK-norm, RoPE, paged
 * attention (a sliding window on gemma3's local layers), output proj (+ post-norm), residual,
 * RMSNorm, SwiGLU/GeGLU FFN (+ post-norm), residual) -> final norm -> output head for the rows
 * that want logits; the tensor-parallel ranks; loading is in engine/model_load.c. */
#include "engine/model_internal.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pool.h"

/* ---- ranks ---- */

/* Rows [r0, r0 + n) of w, as a view of the same bytes. */
static struct kern_tensor rows_of(const struct kern_tensor *w, int64_t r0, int64_t n)
{
    struct kern_tensor t = *w;
    t.ne1 = n;
    t.data = (const uint8_t *)w->data + (size_t)r0 * w->row_bytes;
    t.packed = NULL;
    t.packed_panel = 0;
    return t;
}

/* A vector a rank holds on its backend: n floats from src, its backend address to *dst. */
struct vec_slot {
    const float **dst;
    const float *src;
    size_t n;
};

#define RANK_VECS 9 /* vectors of one layer at most */

/* Rank r's vectors of layer l (l = -1: the output norm): every norm whole, the biases its
 * rows' slice. Returns their count. */
static int rank_vecs(const struct engine_model *m, struct engine_rank *R, int r, int l,
                     struct vec_slot *v)
{
    const struct engine_hparams *hp = &m->hp;
    int n = 0;
    if (l < 0) {
        v[n++] = (struct vec_slot){&R->output_norm, m->output_norm, (size_t)hp->n_embd};
        return n;
    }
    const struct engine_layer *L = &m->layers[l];
    struct engine_layer *S = &R->layers[l];
    const size_t E = (size_t)hp->n_embd, hd = (size_t)hp->head_dim;
    const size_t qd = (size_t)R->n_head * hd, kvd = (size_t)R->n_kv_head * hd;
    const struct vec_slot all[RANK_VECS] = {
        {&S->attn_norm, L->attn_norm, E},
        {&S->ffn_norm, L->ffn_norm, E},
        {&S->post_attn_norm, L->post_attn_norm, E},
        {&S->post_ffn_norm, L->post_ffn_norm, E},
        {&S->q_norm, L->q_norm, hd},
        {&S->k_norm, L->k_norm, hd},
        {&S->bq, L->bq ? L->bq + (size_t)r * qd : NULL, qd},
        {&S->bk, L->bk ? L->bk + (size_t)r * kvd : NULL, kvd},
        {&S->bv, L->bv ? L->bv + (size_t)r * kvd : NULL, kvd},
    };
    for (int i = 0; i < RANK_VECS; i++)
        if (all[i].src)
            v[n++] = all[i];
    return n;
}

/* Rank r of n's router (whole) and experts (each split as a dense FFN: gate and up by rows, down
 * by hidden rows), prepared on be. */
static enum status rank_experts(struct engine_layer *S, const struct engine_layer *L, int n_ffns,
                                int r, int n, struct kern_backend *be, struct err_detail *err)
{
    S->experts = NULL;
    if (!L->experts)
        return ST_OK;
    if (!(S->experts = calloc(3 * (size_t)n_ffns, sizeof(*S->experts))))
        return err_set(err, ST_ERR_NOMEM, "no memory");
    for (int e = 0; e < n_ffns; e++) {
        const struct kern_tensor *g = &L->experts[3 * e], *d = &L->experts[3 * e + 2];
        const int64_t F = g->ne1 / n, E = d->ne1 / n;
        S->experts[3 * e] = rows_of(g, r * F, F);
        S->experts[3 * e + 1] = rows_of(&L->experts[3 * e + 1], r * F, F);
        S->experts[3 * e + 2] = rows_of(d, r * E, E);
    }
    for (int i = 0; be->ops->prepare && i < 3 * n_ffns + 2; i++) {
        struct kern_tensor *w = i < 3 * n_ffns    ? &S->experts[i]
                                : i == 3 * n_ffns ? &S->router
                                                  : &S->shexp_gate;
        enum status st = w->data ? be->ops->prepare(be, w, err) : ST_OK;
        if (st)
            return st;
    }
    return ST_OK;
}

/* Rank r of n: its slices of every layer, prepared on its backend, and its norm vectors. */
static enum status rank_init(struct engine_model *m, int r, int n, struct kern_backend *be,
                             struct kern_comm *comm, struct err_detail *err)
{
    const struct engine_hparams *hp = &m->hp;
    struct engine_rank *R = &m->rank[r];
    R->be = be;
    R->comm = comm;
    R->n_head = hp->n_head / n;
    R->n_kv_head = hp->n_kv_head / n;
    R->n_ff = hp->n_ff / n;
    R->n_embd = hp->n_embd / n;
    const int hd = hp->head_dim, qd = R->n_head * hd, kvd = R->n_kv_head * hd;
    R->layers = calloc((size_t)hp->n_layer, sizeof(*R->layers));
    if (!R->layers)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    for (int l = 0; l < hp->n_layer; l++) {
        const struct engine_layer *L = &m->layers[l];
        struct engine_layer *S = &R->layers[l];
        *S = *L;
        S->experts = NULL; /* (rank_experts makes the rank's own; until then not L's to free) */
        if (n > 1) {
            S->wq = rows_of(&L->wq, (int64_t)r * qd, qd);
            S->wk = rows_of(&L->wk, (int64_t)r * kvd, kvd);
            S->wv = rows_of(&L->wv, (int64_t)r * kvd, kvd);
            S->w_gate = rows_of(&L->w_gate, (int64_t)r * R->n_ff, R->n_ff);
            S->w_up = rows_of(&L->w_up, (int64_t)r * R->n_ff, R->n_ff);
            S->wo = rows_of(&L->wo, (int64_t)r * R->n_embd, R->n_embd);
            S->w_down = rows_of(&L->w_down, (int64_t)r * R->n_embd, R->n_embd);
        }
        struct kern_tensor *mats[] = {&S->wq, &S->wk, &S->wv, &S->wo, &S->w_gate, &S->w_up,
                                      &S->w_down};
        for (size_t i = 0; be->ops->prepare && i < sizeof(mats) / sizeof(mats[0]); i++) {
            if (!mats[i]->data) /* (a mixture of experts has no dense FFN) */
                continue;
            enum status st = be->ops->prepare(be, mats[i], err);
            if (st)
                return st;
        }
        enum status st = rank_experts(S, L, engine_hp_n_ffns(hp), r, n, be, err);
        if (st)
            return st;
    }
    /* the norm and bias vectors (norms whole, biases this rank's slice) into one backend
     * buffer: counted, then copied */
    for (int pass = 0; pass < 2; pass++) {
        size_t off = 0;
        for (int l = -1; l < hp->n_layer; l++) {
            struct vec_slot v[RANK_VECS];
            const int nv = rank_vecs(m, R, r, l, v);
            for (int i = 0; i < nv; i++) {
                if (pass == 1) {
                    be->ops->upload(be, R->norms + off, v[i].src, sizeof(float) * v[i].n);
                    *v[i].dst = R->norms + off;
                }
                off += (v[i].n + 15) / 16 * 16; /* 64-byte aligned */
            }
        }
        if (pass == 0 && !(R->norms = be->ops->buf_alloc(be, sizeof(float) * off)))
            return err_set(err, ST_ERR_NOMEM, "no backend memory for the norm weights");
    }
    return ST_OK;
}

static void rank_bufs_free(struct engine_rank *R)
{
    struct engine_rank_bufs *f = &R->buf;
    void *d[] = {f->act,    f->tok, f->pos,    f->row, f->last, f->rope,
                 f->tables, f->idx, f->logits, f->ids, f->perm};
    for (size_t i = 0; i < sizeof(d) / sizeof(d[0]); i++)
        R->be->ops->buf_free(R->be, d[i]);
    R->be->ops->buf_free(R->be, f->slot_tok);
    R->be->ops->buf_free(R->be, f->slot_w);
    free(f->h_slot);
    free(f->h_w);
    free(f->h_count);
    free(f->h_router);
    memset(f, 0, sizeof(*f));
}

static void stage_free(struct engine_model *m)
{
    struct engine_model_stage *s = &m->stage;
    for (int r = 0; r < m->n_rank; r++)
        if (m->rank[r].be)
            rank_bufs_free(&m->rank[r]);
    free(s->row);
    free(s->last);
    free(s->tok);
    free(s->pos);
    free(s->rope);
    free(s->tables);
    free(s->idx);
    free(s->seq_row);
    free(s->seq_top);
    free(s->perm);
    memset(s, 0, sizeof(*s));
}

static void rank_free(struct engine_rank *R, int n_layer, int n_ffns)
{
    if (!R->be)
        return;
    for (int l = 0; R->layers && l < n_layer; l++) {
        struct engine_layer *S = &R->layers[l];
        struct kern_tensor *mats[] = {&S->wq,   &S->wk,     &S->wv,     &S->wo,        &S->w_gate,
                                      &S->w_up, &S->w_down, &S->router, &S->shexp_gate};
        for (size_t i = 0; R->be->ops->release && i < sizeof(mats) / sizeof(mats[0]); i++)
            R->be->ops->release(R->be, mats[i]);
        for (int i = 0; S->experts && R->be->ops->release && i < 3 * n_ffns; i++)
            R->be->ops->release(R->be, &S->experts[i]);
        free(S->experts);
    }
    R->be->ops->buf_free(R->be, R->norms);
    free(R->layers);
}

/* Split m over the n ranks be[i] / comm[i]. */
static enum status ranks_init(struct engine_model *m, struct kern_backend *const *be,
                              struct kern_comm *const *comm, int n, struct err_detail *err)
{
    const struct engine_hparams *hp = &m->hp;
    if (n > ENGINE_MAX_RANKS)
        return err_set(err, ST_ERR_INVALID_ARG, "--tp %d: at most %d ranks", n, ENGINE_MAX_RANKS);
    if (hp->n_head % n || hp->n_kv_head % n || hp->n_ff % n || hp->n_embd % n ||
        hp->n_ff_shexp % n) {
        char shexp[48] = "";
        if (hp->n_ff_shexp)
            snprintf(shexp, sizeof(shexp), " (%d of its shared expert)", hp->n_ff_shexp);
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "--tp %d: the model's %d query heads, %d KV heads, %d FFN rows%s and %d "
                       "hidden rows must each divide by it (KV heads are not replicated)",
                       n, hp->n_head, hp->n_kv_head, hp->n_ff, shexp, hp->n_embd);
    }
    m->rank = calloc((size_t)n, sizeof(*m->rank));
    if (!m->rank)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    m->n_rank = n;
    m->be = be[0];
    enum status st;
    for (int r = 0; r < n; r++)
        if ((st = rank_init(m, r, n, be[r], comm ? comm[r] : NULL, err)))
            return st;
    if (be[0]->ops->prepare && (st = be[0]->ops->prepare(be[0], &m->output, err)))
        return st;
    /* The token embedding, which get_rows reads: a host-memory backend reads the mapping; a
     * device gets its copy too, the output's when the two are one matrix (tied). */
    if (be[0]->ops->prepare && !be[0]->host_memory) {
        if (m->tied_output)
            m->tok_embd = m->output; /* what prepare made of it, as the output reads it */
        else if ((st = be[0]->ops->prepare(be[0], &m->tok_embd, err)))
            return st;
    }
    if (n > 1 && (st = pool_init(&m->rank_pool, n, err)))
        return st;
    return ST_OK;
}

static enum status from_gguf(struct engine_model **out, struct io_gguf *g,
                             struct kern_backend *const *be, struct kern_comm *const *comm, int n,
                             struct err_detail *err)
{
    enum status st = engine_model_load_weights(out, g, err);
    if (st)
        return st;
    /* (after the cheap checks of the file, so that a wrong architecture or a missing tensor is
     * told before every weight byte is read) */
    if (n &&
        ((st = engine_model_check_finite(g, err)) || (st = ranks_init(*out, be, comm, n, err)))) {
        (*out)->gguf = NULL; /* on failure the caller closes g */
        engine_model_free(*out);
        *out = NULL;
    }
    return st;
}

enum status engine_model_from_gguf(struct engine_model **out, struct io_gguf *g,
                                   struct kern_backend *be, struct err_detail *err)
{
    return from_gguf(out, g, &be, NULL, be ? 1 : 0, err);
}

static enum status load_path(struct engine_model **out, const char *path,
                             struct kern_backend *const *be, struct kern_comm *const *comm, int n,
                             struct err_detail *err)
{
    struct io_gguf *g;
    enum status st = io_gguf_open(&g, path, err);
    if (st)
        return st;
    st = from_gguf(out, g, be, comm, n, err);
    if (st) {
        err_prefix(err, "%s", path);
        io_gguf_close(g);
    }
    return st;
}

enum status engine_model_load(struct engine_model **out, const char *path, struct kern_backend *be,
                              struct err_detail *err)
{
    return load_path(out, path, &be, NULL, be ? 1 : 0, err);
}

enum status engine_model_load_group(struct engine_model **out, const char *path,
                                    const struct kern_group *g, struct err_detail *err)
{
    return load_path(out, path, g->be, g->size > 1 ? g->comm : NULL, g->size, err);
}

enum status engine_model_from_gguf_group(struct engine_model **out, struct io_gguf *g,
                                         const struct kern_group *grp, struct err_detail *err)
{
    return from_gguf(out, g, grp->be, grp->size > 1 ? grp->comm : NULL, grp->size, err);
}

void engine_model_free(struct engine_model *m)
{
    if (!m)
        return;
    stage_free(m);
    for (int r = 0; m->rank && r < m->n_rank; r++)
        rank_free(&m->rank[r], m->hp.n_layer, engine_hp_n_ffns(&m->hp));
    if (m->be && m->be->ops->release) {
        m->be->ops->release(m->be, &m->output);
        if (!m->tied_output)
            m->be->ops->release(m->be, &m->tok_embd);
    }
    pool_free(m->rank_pool);
    free(m->rank);
    io_gguf_close(m->gguf);
    for (int l = 0; m->layers && l < m->hp.n_layer; l++)
        free(m->layers[l].experts);
    free(m->layers);
    free(m);
}

/* Bytes of one block of n_layer layers over all ranks. */
static size_t kv_bytes(const struct engine_model *m, int n_layer, int block_size, int dtype)
{
    const struct engine_hparams *hp = &m->hp;
    if (!m->n_rank)
        return engine_kv_bytes_per_token(n_layer, hp->n_kv_head, hp->head_dim, dtype) *
               (size_t)block_size;
    size_t bytes = 0;
    for (int r = 0; r < m->n_rank; r++) {
        const struct engine_rank *R = &m->rank[r];
        struct kern_kv_desc d = {n_layer, R->n_kv_head, hp->head_dim, block_size, dtype};
        bytes += R->be->ops->kv_block_bytes(R->be, &d);
    }
    return bytes;
}

size_t engine_model_kv_block_bytes(const struct engine_model *m, int block_size, int dtype)
{
    return kv_bytes(m, m->hp.n_layer, block_size, dtype);
}

int engine_model_host_memory(const struct engine_model *m)
{
    return !m->be || m->be->host_memory;
}

int engine_model_mem_info(const struct engine_model *m, struct kern_mem_info *out, int max)
{
    int n = 0;
    for (int r = 0; r < m->n_rank && n < max; r++) {
        struct kern_backend *be = m->rank[r].be;
        if (!be || !be->ops->mem_info || !be->ops->mem_info(be, &out[n]))
            return 0;
        n++;
    }
    return n;
}

int engine_model_layer_local(const struct engine_model *m, int layer)
{
    return m->layers[layer].swa;
}

/* The window pool beside a main pool of n_main blocks: a window's blocks (win, and a partial
 * one, and one for the step's chunk) for every sequence the main pool holds when sequences are
 * two windows long (at most max_seqs), the step's new tokens, and room to keep 4 windows
 * cached for prefix reuse; never more than n_main. */
static int64_t window_blocks(int64_t n_main, int64_t win, int B,
                             const struct engine_kv_plan_in *in)
{
    int64_t seqs = n_main / (2 * win + 1);
    seqs = seqs < in->max_seqs ? seqs : in->max_seqs;
    const int64_t n = seqs * (win + 2) + (in->max_batch_tokens + B - 1) / B + 4 * (win + 1);
    return n < n_main ? n : n_main;
}

void engine_model_kv_plan(const struct engine_model *m, const struct engine_kv_plan_in *in,
                          struct engine_kv_plan *out)
{
    const struct engine_hparams *hp = &m->hp;
    const int B = in->block_size;
    int n_local = 0;
    for (int l = 0; l < hp->n_layer; l++)
        n_local += engine_model_layer_local(m, l);
    memset(out, 0, sizeof(*out));
    out->bytes_main = kv_bytes(m, hp->n_layer - (in->window_pool ? n_local : 0), B, in->dtype);
    if (!in->window_pool || !n_local) {
        out->n_main = (int64_t)(in->kv_mem / out->bytes_main);
        return;
    }
    out->bytes_local = kv_bytes(m, n_local, B, in->dtype);
    /* the largest main pool whose window pool fits beside it (window_blocks grows with it) */
    const int64_t win = (hp->swa_window - 1 + B - 1) / B;
    int64_t lo = 0, hi = (int64_t)(in->kv_mem / out->bytes_main) + 1;
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        const int64_t nl = window_blocks(mid, win, B, in);
        if ((double)mid * out->bytes_main + (double)nl * out->bytes_local <= (double)in->kv_mem)
            lo = mid;
        else
            hi = mid;
    }
    out->n_main = lo;
    out->n_local = window_blocks(lo, win, B, in);
    out->window = hp->swa_window;
}

enum status engine_model_kv_attach(struct engine_model *m, struct engine_kv *kv, int max_tok,
                                   struct err_detail *err)
{
    struct kern_backend *be[ENGINE_MAX_RANKS];
    assert(m->n_rank >= 1 && m->n_rank <= ENGINE_MAX_RANKS);
    for (int r = 0; r < m->n_rank; r++)
        be[r] = m->rank[r].be;
    enum status st = engine_kv_n_rank(kv) ? ST_OK : engine_kv_storage_alloc(kv, be, m->n_rank, err);
    return st ? st : engine_model_reserve(m, kv, max_tok, err);
}

enum status engine_model_kv_init(struct engine_model *m, struct engine_kv **out,
                                 int32_t n_tokens, int max_seqs, int block_size, int dtype,
                                 struct err_detail *err)
{
    int32_t blocks = (n_tokens + block_size - 1) / block_size;
    enum status st = engine_kv_init(out, m->hp.n_layer, m->hp.n_kv_head, m->hp.head_dim, dtype,
                                    block_size, blocks, max_seqs, 0, err);
    if (st || !m->be)
        return st;
    if ((st = engine_model_kv_attach(m, *out, n_tokens, err))) {
        engine_kv_free(*out);
        *out = NULL;
    }
    return st;
}

/* ---- forward ---- */

/* A mixture of experts' slots per token: its chosen experts, and the shared one. */
static int moe_k(const struct engine_hparams *hp)
{
    return hp->n_expert_used + (hp->n_ff_shexp > 0);
}

/* Floats of a rank's activation scratch per token: residual, norm, its q, attention output, k,
 * v, gate and up; with more than one rank also the whole attention output, gate and up, its
 * slice of o's and down's output, and the all-gather's landing area (rank_init's shares). */
static size_t scratch_per_tok(const struct engine_hparams *hp, int n_rank)
{
    size_t q_dim = (size_t)(hp->n_head / n_rank) * hp->head_dim;
    size_t kv_dim = (size_t)(hp->n_kv_head / n_rank) * hp->head_dim;
    size_t s = 2 * (size_t)hp->n_embd + 2 * q_dim + 2 * kv_dim +
               2 * (size_t)(engine_hp_ffn_width(hp) / n_rank);
    if (n_rank > 1) {
        size_t qf = (size_t)hp->n_head * hp->head_dim, F = (size_t)engine_hp_ffn_width(hp);
        size_t widest = qf > F ? qf : F;
        widest = widest > (size_t)hp->n_embd ? widest : (size_t)hp->n_embd;
        s += qf + 2 * F + (size_t)(hp->n_embd / n_rank) + widest;
    }
    if (hp->n_expert) /* the experts' input and output rows, their sum, the router logits */
        s += 3 * (size_t)hp->n_embd + (size_t)engine_hp_n_ffns(hp);
    return s;
}

/* A mixture of experts' int32 slot arrays for T tokens (engine_rank_bufs.slot_tok: the slots'
 * tokens, their moe_add rows, and with several ranks each expert run's all-gather order). */
static size_t moe_slot_ints(const struct engine_hparams *hp, size_t T, int n_rank)
{
    return T * (size_t)moe_k(hp) * (2 + (n_rank > 1 ? (size_t)n_rank : 0));
}

/* The element counts of engine_model_reserve's buffers. */
struct stage_sizes {
    size_t T;      /* tokens */
    size_t rows;   /* sequence rows of a batch */
    size_t tables; /* block-table ids: per row, the main pool's then the window pool's */
    size_t rope;   /* RoPE table floats */
    size_t act;    /* activation floats of a rank */
};

static struct stage_sizes stage_sizes(const struct engine_model *m, int n_rank, int max_tok,
                                      int max_seqs, int max_blocks)
{
    const struct engine_hparams *hp = &m->hp;
    struct stage_sizes z;
    z.T = (size_t)max_tok;
    z.rows = z.T < (size_t)max_seqs ? z.T : (size_t)max_seqs;
    z.tables = 2 * z.rows * (size_t)max_blocks;
    z.rope = z.T * (size_t)hp->rope_dim * m->n_rope;
    z.act = scratch_per_tok(hp, n_rank) * z.T;
    return z;
}

void engine_model_graph_counts(const struct engine_model *m, long *captures, long *replays)
{
    *captures = __atomic_load_n(&m->graph_captures, __ATOMIC_RELAXED);
    *replays = __atomic_load_n(&m->graph_replays, __ATOMIC_RELAXED);
}

size_t engine_model_stage_bytes(const struct engine_model *m, int n_rank, int rank, int max_tok,
                                int max_seqs, int max_blocks, int device)
{
    const struct stage_sizes z = stage_sizes(m, n_rank, max_tok, max_seqs, max_blocks);
    size_t b = sizeof(float) * z.act + sizeof(int32_t) * 4 * z.T + z.T + sizeof(float) * z.rope +
               sizeof(int32_t) * z.tables; /* act, tok pos row idx, last, rope, tables */
    if (n_rank > 1)
        b += sizeof(int32_t) * z.T * (size_t)n_rank; /* perm */
    b += sizeof(int32_t) * moe_slot_ints(&m->hp, z.T, n_rank) +
         sizeof(float) * z.T * (size_t)moe_k(&m->hp); /* the experts' slots */
    if (rank == 0 && device)                         /* logits (one row a sequence slot) and ids */
        b += sizeof(float) * z.rows * (size_t)m->hp.n_vocab + sizeof(int32_t) * z.T;
    return b;
}

enum status engine_model_reserve(struct engine_model *m, const struct engine_kv *kv, int max_tok,
                                 struct err_detail *err)
{
    const int block = engine_kv_block_size(kv);
    /* a sequence never holds more blocks than the pool, nor more than the model's context */
    int32_t ctx_blocks = (m->hp.n_ctx_train + block - 1) / block + 1;
    int max_blocks = engine_kv_n_blocks(kv) < ctx_blocks ? engine_kv_n_blocks(kv) : ctx_blocks;
    return engine_model_reserve_sizes(m, max_tok, engine_kv_max_seqs(kv), block, max_blocks, err);
}

enum status engine_model_reserve_sizes(struct engine_model *m, int max_tok, int max_seqs, int block,
                                       int max_blocks, struct err_detail *err)
{
    struct engine_model_stage *s = &m->stage;
    const struct engine_hparams *hp = &m->hp;
    if (max_tok < 1 || max_seqs < 1 || block < 1 || max_blocks < 1)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "engine_model_reserve: %d tokens, %d sequences, %d blocks of %d", max_tok,
                       max_seqs, max_blocks, block);
    if (s->max_tok >= max_tok && s->max_seqs >= max_seqs && s->max_blocks >= max_blocks)
        return ST_OK;
    stage_free(m);
    const struct stage_sizes z = stage_sizes(m, m->n_rank, max_tok, max_seqs, max_blocks);
    const size_t T = z.T, Rw = z.rows, tables = z.tables, rope = z.rope;
    int ok = 1;
    for (int r = 0; r < m->n_rank; r++) {
        struct engine_rank *R = &m->rank[r];
        struct engine_rank_bufs *f = &R->buf;
        struct kern_backend *be = R->be;
        const int64_t widest =
            engine_hp_ffn_width(hp) > hp->n_embd ? engine_hp_ffn_width(hp) : hp->n_embd;
        const int64_t qd = (int64_t)hp->n_head * hp->head_dim;
        enum status rs = be->ops->reserve ? be->ops->reserve(be, max_tok, widest > qd ? widest : qd,
                                                             max_blocks * block, err)
                                          : ST_OK;
        if (rs) {
            stage_free(m);
            return rs;
        }
        f->act = be->ops->buf_alloc(be, sizeof(float) * z.act);
        if (m->n_rank > 1) {
            f->perm = be->ops->buf_alloc(be, sizeof(int32_t) * T * (size_t)m->n_rank);
            ok = ok && f->perm;
        }
        f->tok = be->ops->buf_alloc(be, sizeof(int32_t) * T);
        f->pos = be->ops->buf_alloc(be, sizeof(int32_t) * T);
        f->row = be->ops->buf_alloc(be, sizeof(int32_t) * T);
        f->last = be->ops->buf_alloc(be, T);
        f->rope = be->ops->buf_alloc(be, sizeof(float) * rope);
        f->tables = be->ops->buf_alloc(be, sizeof(int32_t) * tables);
        f->idx = be->ops->buf_alloc(be, sizeof(int32_t) * T);
        ok = ok && f->act && f->tok && f->pos && f->row && f->last && f->rope && f->tables &&
             f->idx;
        if (hp->n_expert) {
            const size_t ints = moe_slot_ints(hp, T, m->n_rank), slots = T * moe_k(hp);
            f->slot_tok = be->ops->buf_alloc(be, sizeof(int32_t) * ints);
            f->slot_w = be->ops->buf_alloc(be, sizeof(float) * slots);
            f->h_slot = malloc(sizeof(int32_t) * ints);
            f->h_w = malloc(sizeof(float) * slots);
            f->h_count = malloc(sizeof(int32_t) * (size_t)engine_hp_n_ffns(hp));
            f->h_router = malloc(sizeof(float) * T * (size_t)engine_hp_n_ffns(hp));
            ok = ok && f->slot_tok && f->slot_w && f->h_slot && f->h_w && f->h_count && f->h_router;
        }
        if (r == 0 && !be->host_memory) {
            f->logits = be->ops->buf_alloc(be, sizeof(float) * Rw * (size_t)hp->n_vocab);
            f->logits_rows = (int)Rw;
            f->ids = be->ops->buf_alloc(be, sizeof(int32_t) * T);
            ok = ok && f->logits && f->ids;
        }
    }
    s->row = calloc(T, sizeof(*s->row));
    s->last = calloc(T, 1);
    s->tok = calloc(T, sizeof(*s->tok));
    s->pos = calloc(T, sizeof(*s->pos));
    s->rope = calloc(rope, sizeof(*s->rope));
    s->tables = calloc(tables, sizeof(*s->tables));
    s->idx = calloc(T, sizeof(*s->idx));
    s->seq_row = malloc(sizeof(*s->seq_row) * (size_t)max_seqs);
    s->seq_top = malloc(sizeof(*s->seq_top) * Rw);
    s->perm = malloc(sizeof(*s->perm) * T * (size_t)m->n_rank);
    if (!ok || !s->row || !s->last || !s->tok || !s->pos || !s->rope || !s->tables || !s->idx ||
        !s->seq_row || !s->seq_top || !s->perm) {
        stage_free(m);
        return err_set(err, ST_ERR_NOMEM, "no memory for the buffers of %d-token batches",
                       max_tok);
    }
    for (int i = 0; i < max_seqs; i++)
        s->seq_row[i] = -1;
    s->max_tok = max_tok;
    s->max_seqs = max_seqs;
    s->max_blocks = max_blocks;
    return ST_OK;
}

static enum status check_batch(const struct engine_model *m, const struct engine_kv *kv,
                               const struct engine_batch *b, struct err_detail *err)
{
    if (b->n_tok < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "empty batch");
    if (b->n_tok > m->stage.max_tok || engine_kv_max_seqs(kv) > m->stage.max_seqs ||
        engine_kv_n_rank(kv) != m->n_rank)
        return err_set(err, ST_ERR_RANGE,
                       "a batch of %d tokens over %d sequence slots exceeds the buffers reserved "
                       "(%d tokens, %d slots), or the KV cache is not attached to this model",
                       b->n_tok, engine_kv_max_seqs(kv), m->stage.max_tok, m->stage.max_seqs);
    for (int t = 0; t < b->n_tok; t++) {
        if (b->token[t] < 0 || b->token[t] >= m->hp.n_vocab)
            return err_set(err, ST_ERR_RANGE, "token id %d outside the vocabulary (%d)",
                           b->token[t], m->hp.n_vocab);
        if (b->seq[t] < 0 || b->seq[t] >= engine_kv_max_seqs(kv))
            return err_set(err, ST_ERR_RANGE, "sequence slot %d outside 0..%d", b->seq[t],
                           engine_kv_max_seqs(kv) - 1);
        int64_t cap = (int64_t)engine_kv_seq_blocks(kv, b->seq[t]) * engine_kv_block_size(kv);
        if (b->pos[t] < 0 || b->pos[t] >= cap)
            return err_set(err, ST_ERR_RANGE,
                           "position %d of sequence %d has no KV block reserved (capacity %lld)",
                           b->pos[t], b->seq[t], (long long)cap);
        if (engine_kv_seq_blocks(kv, b->seq[t]) > m->stage.max_blocks)
            return err_set(err, ST_ERR_RANGE, "sequence %d holds %d KV blocks, more than %d",
                           b->seq[t], engine_kv_seq_blocks(kv, b->seq[t]), m->stage.max_blocks);
    }
    return ST_OK;
}

/* The host side of a step: each sequence of the batch gets a block table row (in order of
 * first appearance), each token its row and whether it is its sequence's highest position
 * (no other token attends to it: its KV is written by the attention pass, right before it is
 * read, struct kern_attn's store; the others by kv_store, before any attention); the RoPE
 * angles and the rows that want logits. */
/* A padded batch's size: n rounded up (powers of two to 8, then multiples of 8 to 64, of 32
 * to 256, of 64 above), at most cap. Batches of more than PAD_MAX tokens (prefill chunks, which
 * seldom repeat a shape) are not padded. */
#define PAD_MAX 256
static int pad_bucket(int n, int cap)
{
    int q = n <= 8 ? 1 : n <= 64 ? 8 : n <= 256 ? 32 : 64, b;
    if (n <= 8)
        for (b = 1; b < n; b *= 2)
            ;
    else
        b = (n + q - 1) / q * q;
    return b < cap ? b : cap;
}

/* Whether steps may go through graphs: every rank's backend makes them (kern_ops.graphs_on), and
 * with several ranks every collective can be captured with the rest (kern_comm.in_graphs: NCCL's
 * with QUERN_TP_GRAPHS=1, not host staging). Decided once a step (stage_batch: engine_model_stage
 * .graphs), so that every rank asks graph_begin or none does. */
static int graphs_usable(const struct engine_model *m)
{
    if (m->hp.n_expert) /* the routing is read back to the host in every layer */
        return 0;
    for (int r = 0; r < m->n_rank; r++) {
        const struct engine_rank *R = &m->rank[r];
        const struct kern_ops *k = R->be->ops;
        if (!k->graphs_on || !k->graph_begin || !k->graphs_on(R->be) ||
            (m->n_rank > 1 && !(R->comm && R->comm->in_graphs && k->graph_epoch)))
            return 0;
    }
    return 1;
}

/* With graphs usable (graphs_usable: stage.graphs), a step's tokens, block-table rows and width are
 * padded to buckets (pad_bucket; the width to a multiple of 8 blocks) so that a decode batch's
 * shape repeats while sequences come and go and grow: the padding tokens (copies of token 0,
 * whose blocks are valid in every pool: a sliding-window pool's tables hold -1 for blocks out
 * of the window; KERN_STORE_PAD: never stored) compute rows nobody reads, and every op is
 * row-wise and batch-invariant, so the real rows are bitwise those of the unpadded step. */

int engine_model_rope_variant(const struct engine_model *m, int64_t max_len)
{
    return m->rope_long && max_len > m->hp.rope_orig_ctx;
}

static void stage_batch(struct engine_model *m, const struct engine_kv *kv,
                        const struct engine_batch *b)
{
    struct engine_model_stage *s = &m->stage;
    const struct engine_hparams *hp = &m->hp;
    const int n = b->n_tok;
    int n_rows = 0, stride = 1;
    s->graphs = graphs_usable(m);
    for (int t = 0; t < n; t++) {
        int32_t *r = &s->seq_row[b->seq[t]];
        if (*r < 0) {
            s->seq_top[n_rows] = t;
            *r = n_rows++;
            int nb = engine_kv_seq_blocks(kv, b->seq[t]);
            stride = nb > stride ? nb : stride;
        }
        s->row[t] = *r;
        if (b->pos[t] > b->pos[s->seq_top[*r]])
            s->seq_top[*r] = t;
    }
    int np = n;
    const int32_t *pos = b->pos;
    if (s->graphs) {
        const int rows_cap = s->max_tok < s->max_seqs ? s->max_tok : s->max_seqs;
        np = n <= PAD_MAX ? pad_bucket(n, s->max_tok) : n;
        n_rows = pad_bucket(n_rows, rows_cap);
        stride = (stride + 7) / 8 * 8 < s->max_blocks ? (stride + 7) / 8 * 8 : s->max_blocks;
        memcpy(s->tok, b->token, sizeof(int32_t) * (size_t)n);
        memcpy(s->pos, b->pos, sizeof(int32_t) * (size_t)n);
        for (int t = n; t < np; t++) { /* token 0 again: its blocks are valid in every pool */
            s->tok[t] = b->token[0];
            s->pos[t] = b->pos[0];
            s->row[t] = s->row[0];
            s->last[t] = KERN_STORE_PAD;
        }
        pos = s->pos;
    }
    for (int t = 0; t < n; t++) {
        const int r = s->row[t];
        s->last[t] = s->seq_top[r] == t;
        if (s->seq_top[r] == t) /* once per row: its block ids in each pool */
            for (int p = 0; p < engine_kv_n_pools(kv); p++)
                memcpy(s->tables + ((size_t)p * n_rows + r) * (size_t)stride,
                       engine_kv_table_pool(kv, b->seq[t], p),
                       sizeof(int32_t) * (size_t)engine_kv_seq_blocks(kv, b->seq[t]));
    }
    for (int t = 0; t < n; t++)
        s->seq_row[b->seq[t]] = -1;
    /* RoPE angles pos * scale * theta^(-i/rope_dim) / factor for pair i/2 (factor: Llama 3's
     * rope_freqs; LongRoPE's long or short factors by the token's KV variant, cos and sin then
     * times rope_mscale; else 1), one table for the global layers and one for the sliding ones
     * when their base differs (unscaled, no factors) */
    for (int k = 0; k < m->n_rope; k++) {
        const double theta = k ? hp->rope_theta_swa : hp->rope_theta;
        const double scale = k ? 1.0 : hp->rope_scale;
        const int longrope = !k && m->rope_long;
        const double ms = longrope ? (double)hp->rope_mscale : 1.0;
        float *tab = s->rope + (size_t)k * (size_t)np * (size_t)hp->rope_dim;
        for (int i = 0; i < hp->rope_dim; i += 2) {
            double freq = pow(theta, -(double)i / hp->rope_dim);
            if (!k && m->rope_freqs)
                freq /= m->rope_freqs[i / 2];
            for (int t = 0; t < np; t++) {
                double f = freq;
                if (longrope) /* (padding rows: token 0's) */
                    f /= (engine_kv_variant(kv, b->seq[t < n ? t : 0]) ? m->rope_long
                                                                       : m->rope_short)[i / 2];
                double ang = (double)pos[t] * scale * f;
                tab[(size_t)t * hp->rope_dim + i] = (float)(ms * cos(ang));
                tab[(size_t)t * hp->rope_dim + i + 1] = (float)(ms * sin(ang));
            }
        }
    }
    s->n_out = 0;
    for (int t = 0; t < n; t++)
        if (b->logits ? b->logits[t] != 0 : t == n - 1)
            s->idx[s->n_out++] = t;
    for (int t = 0; m->n_rank > 1 && t < np; t++) /* the all-gathers' reordering (of np rows:
                                                       the layers run the padding too) */
        for (int r = 0; r < m->n_rank; r++)
            s->perm[t * m->n_rank + r] = r * np + t;
    s->stride = stride;
    s->n_rows = n_rows;
    s->n_pad = np;
}

/* One forward pass, shared by the rank threads. */
struct fwd_job {
    struct engine_model *m;      /* model */
    struct engine_kv *kv;        /* KV cache */
    const struct engine_batch *b; /* batch */
    float *logits;               /* host: wanted rows' logits */
    int32_t *ids;                /* host: their greedy ids (NULL: logits) */
    int *fused;                  /* set to 1 when ids were written */
    const struct kern_sample_row *srows; /* draws by the backend (NULL: none), per wanted row */
    const int32_t *pen_id, *pen_count;   /* ... their penalties */
    int n_pen;
    const uint32_t *masks; /* ... their grammars' masks */
    int n_masks;
    struct kern_sample_out *sout; /* ... and what it drew */
    /* the logits' epilogue, or NULL */
    void (*hook)(void *ctx, int ith, int64_t r0, int64_t r1, float *blk, size_t ld);
    void *hook_ctx;
    int *hooked; /* set to 1 when the hook ran */
};

static void matmul1(struct kern_backend *be, const struct kern_tensor *w,
                    const struct kern_mm_in *in, float *y, int n_tok)
{
    float *const ys[1] = {y};
    be->ops->matmul(be, &w, ys, 1, in, n_tok);
}

/* The ranks' slices src (n rows of w floats each, one slice per rank) gathered into dst: n rows
 * of n_rank * w floats, rank r's slice at columns r w .. (through the landing area land), perm
 * the order: n_rank entries per row, rank r's r n + the row. */
static void gather_perm(struct engine_rank *R, int n_rank, const float *src, float *dst,
                        float *land, int n, int w, const int32_t *perm)
{
    kern_comm_all_gather(R->comm, src, land, sizeof(float) * (size_t)n * (size_t)w);
    R->be->ops->gather(R->be, dst, land, perm, n * n_rank, w);
}

/* ... in the step's order (engine_model_stage.perm: n is the step's token count). */
static void gather_slices(struct engine_rank *R, int n_rank, const float *src, float *dst,
                          float *land, int n, int w)
{
    gather_perm(R, n_rank, src, dst, land, n, w, R->buf.perm);
}

/* A block's output y (n rows of E) normed in place when the layer has a post-norm (gemma3). */
static void post_norm(struct kern_backend *be, const float *w, float *y, int n, int E, float eps)
{
    if (w)
        be->ops->norm_rows(be, y, w, n, E, eps);
}

/* A rank's activation scratch (engine_rank_bufs.act) carved for n tokens. */
struct fwd_bufs {
    float *x;       /* residual stream, n x E */
    float *xn;      /* normed input / a block's output, n x E */
    float *q;       /* its queries, n x q_dim */
    float *att;     /* its heads' attention output, n x q_dim */
    float *kk, *vv; /* its keys and values, n x kv_dim */
    float *gate;    /* its FFN gate rows, n x n_ff */
    float *up;      /* its FFN up rows, n x n_ff */
    /* more than one rank: the whole attention output, gate and up, this rank's rows of o's and
     * down's output, and where the all-gathers land */
    float *att_all;  /* n x n_head * hd */
    float *gate_all; /* n x n_ff (whole) */
    float *up_all;   /* n x n_ff (whole) */
    float *y;        /* n x R->n_embd */
    float *land;     /* n x widest */
    /* a mixture of experts (at the scratch's end): the rows a group of slots runs through their
     * experts, the experts' outputs, the weighted sum of each token's, its router logits */
    float *moe_in, *moe_out; /* n x E */
    float *moe_sum;          /* n x E */
    float *router;           /* n x n_expert */
};

static struct fwd_bufs fwd_bufs_of(const struct engine_hparams *hp, const struct engine_rank *R,
                                   int n_rank, int n)
{
    const int E = hp->n_embd, hd = hp->head_dim;
    const int q_dim = R->n_head * hd, kv_dim = R->n_kv_head * hd;
    struct fwd_bufs B;
    B.x = R->buf.act;
    B.xn = B.x + (size_t)n * E;
    B.q = B.xn + (size_t)n * E;
    B.att = B.q + (size_t)n * q_dim;
    B.kk = B.att + (size_t)n * q_dim;
    B.vv = B.kk + (size_t)n * kv_dim;
    B.gate = B.vv + (size_t)n * kv_dim;
    B.up = B.gate + (size_t)n * (engine_hp_ffn_width(hp) / n_rank);
    B.att_all = B.up + (size_t)n * (engine_hp_ffn_width(hp) / n_rank);
    B.gate_all = B.att_all + (size_t)n * hp->n_head * hd;
    B.up_all = B.gate_all + (size_t)n * engine_hp_ffn_width(hp);
    B.y = B.up_all + (size_t)n * engine_hp_ffn_width(hp);
    B.land = B.y + (size_t)n * R->n_embd;
    const size_t moe = 3 * (size_t)E + (size_t)engine_hp_n_ffns(hp);
    B.moe_in = B.x + (size_t)n * (scratch_per_tok(hp, n_rank) - moe);
    B.moe_out = B.moe_in + (size_t)n * E;
    B.moe_sum = B.moe_out + (size_t)n * E;
    B.router = B.moe_sum + (size_t)n * E;
    return B;
}

/* The routing of a mixture of experts (struct engine_hparams hp) for n tokens, on the host: logits
 * holds each token's n_expert router logits, then with a shared expert each token's gate logit.
 * Each token runs the n_expert_used experts of the largest logits (NaN never chosen unless
 * nothing else is left, ties to the lower expert), weighted by their softmax over all experts,
 * renormalized over the chosen where hp->expert_norm (Mixtral's, Qwen3-MoE's; Qwen2-MoE's not),
 * and the shared expert (number n_expert) weighted by the sigmoid of its gate logit. The slots
 * (token, expert) in expert order, by token within an expert: slot_tok = the tokens, slot_tok +
 * n moe_k = their moe_add rows (~token where it is the token's first slot, its lowest expert),
 * w = the weights, count = slots per expert. */
static void moe_route(const struct engine_hparams *hp, const float *logits, int n,
                      int32_t *slot_tok, float *w, int32_t *count)
{
    const int X = hp->n_expert, k = hp->n_expert_used, shared = hp->n_ff_shexp > 0;
    int32_t *row = slot_tok + (size_t)n * moe_k(hp);
    memset(count, 0, sizeof(*count) * (size_t)(X + shared));
    /* pass 0 counts each expert's slots, pass 1 writes them at their expert's offset */
    for (int pass = 0; pass < 2; pass++) {
        int32_t off[ENGINE_MAX_EXPERTS + 1];
        for (int e = 0, o = 0; pass && e < X + shared; e++) {
            off[e] = o;
            o += count[e];
        }
        for (int t = 0; t < n; t++) {
            const float *l = logits + (size_t)t * X;
            int sel[ENGINE_MAX_EXPERTS + 1] = {0}; /* (k >= 1: sel[0] always chosen) */
            uint8_t used[ENGINE_MAX_EXPERTS] = {0};
            double wt[ENGINE_MAX_EXPERTS + 1], sum = 0;
            for (int i = 0; i < k; i++) {
                int best = -1;
                for (int e = 0; e < X; e++)
                    if (!used[e] &&
                        (best < 0 || l[e] > l[best] || (l[best] != l[best] && l[e] == l[e])))
                        best = e;
                used[best] = 1;
                sel[i] = best;
            }
            for (int e = 0; e < X; e++) { /* (renormalized: over the chosen alone) */
                const double d = (double)l[e] - (double)l[sel[0]];
                if (used[e] || !hp->expert_norm)
                    sum += d == d ? exp(d) : 0.0;
            }
            for (int i = 0; i < k; i++) {
                const double d = (double)l[sel[i]] - (double)l[sel[0]];
                wt[i] = sum > 0 && d == d ? exp(d) / sum : 0.0;
            }
            if (shared) {
                sel[k] = X;
                wt[k] = 1.0 / (1.0 + exp(-(double)logits[(size_t)n * X + t]));
            }
            int lowest = sel[0];
            for (int i = 1; i < k; i++)
                lowest = sel[i] < lowest ? sel[i] : lowest;
            for (int i = 0; i < k + shared; i++) {
                if (!pass) {
                    count[sel[i]]++;
                    continue;
                }
                const int32_t at = off[sel[i]]++;
                slot_tok[at] = t;
                row[at] = sel[i] == lowest ? ~t : t;
                w[at] = (float)wt[i];
            }
        }
    }
}

/* One expert's run of slots within a group (moe_ffn): expert e, slots [c0 + off, c0 + off + m) of
 * the group starting at slot c0. */
struct moe_run {
    int e, c0, off, m;
};

/* The runs of the slots (count[e] slots of expert e, in expert order) in groups of at most n:
 * at most n_expert + groups of them. Returns their number. */
static int moe_runs(const int32_t *count, int n_expert, int n_slot, int n, struct moe_run *run)
{
    int nr = 0, e = 0, e0 = 0; /* expert e's slots start at e0 */
    for (int c0 = 0; c0 < n_slot; c0 += n) {
        const int c1 = c0 + n < n_slot ? c0 + n : n_slot;
        for (;;) {
            while (e < n_expert && e0 + count[e] <= c0)
                e0 += count[e++];
            if (e == n_expert || e0 >= c1)
                break;
            const int s0 = e0 > c0 ? e0 : c0, s1 = e0 + count[e] < c1 ? e0 + count[e] : c1;
            if (s1 > s0) /* (an expert no token chose has no run) */
                run[nr++] = (struct moe_run){e, c0, s0 - c0, s1 - s0};
            if (e0 + count[e] > c1)
                break;
            e0 += count[e++];
        }
    }
    return nr;
}

/* The FFN of a mixture-of-experts layer on rank r: x += xn and xn = norm(x) in the router's
 * matmul; the routing on the host (moe_route); then the slots in groups of at most n: their
 * tokens' normed rows gathered, each expert's run of them through the expert (with several
 * ranks as the dense FFN splits: this rank's gate and up rows, gathered, its down rows,
 * gathered), and moe_add summing the group's outputs into their tokens' rows in slot order (so
 * each token's in expert order); those sums to xn. A token's output is its own experts' alone,
 * whatever else the batch holds. */
static void moe_ffn(const struct engine_model *m, struct engine_rank *R, const struct fwd_bufs *B,
                    const struct engine_layer *L, int n)
{
    const struct engine_hparams *hp = &m->hp;
    struct engine_rank_bufs *f = &R->buf;
    struct kern_backend *be = R->be;
    const int N = m->n_rank, E = hp->n_embd, n_slot = n * moe_k(hp), nf = engine_hp_n_ffns(hp);
    const struct kern_mm_in in = {
        .x = B->x, .add = B->xn, .norm = L->ffn_norm, .eps = hp->rms_eps, .xn = B->xn};
    /* the router's logits, and a shared expert's gate logit after them */
    const struct kern_tensor *rw[2] = {&L->router, &L->shexp_gate};
    float *const ry[2] = {B->router, B->router + (size_t)n * hp->n_expert};
    be->ops->matmul(be, rw, ry, 1 + (nf > hp->n_expert), &in, n);
    be->ops->download(be, f->h_router, B->router, sizeof(float) * (size_t)n * nf);
    moe_route(hp, f->h_router, n, f->h_slot, f->h_w, f->h_count);
    struct moe_run run[2 * ENGINE_MAX_EXPERTS + 2];
    const int nr = moe_runs(f->h_count, nf, n_slot, n, run);
    /* with several ranks each run's all-gather order (as stage_batch's perm for its rows) */
    size_t p = 2 * (size_t)n_slot;
    for (int i = 0; N > 1 && i < nr; p += (size_t)run[i++].m * N)
        for (int t = 0; t < run[i].m; t++)
            for (int q = 0; q < N; q++)
                f->h_slot[p + (size_t)t * N + q] = q * run[i].m + t;
    be->ops->upload(be, f->slot_tok, f->h_slot,
                    sizeof(int32_t) * (size_t)n_slot * (size_t)(2 + (N > 1 ? N : 0)));
    be->ops->upload(be, f->slot_w, f->h_w, sizeof(float) * (size_t)n_slot);
    const int32_t *perm = f->slot_tok + 2 * (size_t)n_slot;
    for (int i = 0; i < nr; i++) {
        const struct moe_run *u = &run[i];
        const int c1 = u->c0 + n < n_slot ? u->c0 + n : n_slot;
        if (!i || u->c0 != run[i - 1].c0) /* a new group: its tokens' normed rows */
            be->ops->gather(be, B->moe_in, B->xn, f->slot_tok + u->c0, c1 - u->c0, E);
        const struct kern_tensor *X = &L->experts[3 * u->e];
        const struct kern_mm_in x_in = {.x = B->moe_in + (size_t)u->off * E};
        float *out = B->moe_out + (size_t)u->off * E;
        if (N == 1)
            be->ops->ffn(be, &X[0], &X[1], &X[2], &x_in, hp->glu, out, B->gate, B->up, u->m);
        else {
            const struct kern_tensor *gu_w[2] = {&X[0], &X[1]};
            float *const gu_y[2] = {B->gate, B->up};
            be->ops->matmul(be, gu_w, gu_y, 2, &x_in, u->m);
            const int F = (int)X[0].ne1; /* this rank's rows of the expert (the shared one's
                                          * width may differ) */
            gather_perm(R, N, B->gate, B->gate_all, B->land, u->m, F, perm);
            gather_perm(R, N, B->up, B->up_all, B->land, u->m, F, perm);
            const struct kern_mm_in down_in = {.x = B->gate_all, .up = B->up_all, .glu = hp->glu};
            matmul1(be, &X[2], &down_in, B->y, u->m);
            gather_perm(R, N, B->y, out, B->land, u->m, R->n_embd, perm);
            perm += (size_t)u->m * N;
        }
        if (i == nr - 1 || run[i + 1].c0 != u->c0) /* the group's outputs into their sums */
            be->ops->moe_add(be, B->moe_sum, B->moe_out, f->slot_tok + n_slot + u->c0,
                             f->slot_w + u->c0, c1 - u->c0, E);
    }
    be->ops->copy(be, B->xn, B->moe_sum, sizeof(float) * (size_t)n * E);
}

/* The embedding and every layer of rank r's share: the ops between the step's uploads and the
 * output head, whose sequence and arguments depend only on the model, the cache, the token
 * count and the block tables' shape (what graph_key hashes). */
static void forward_layers(struct fwd_job *j, int r, const struct fwd_bufs *B,
                           const struct kern_block_table *bts)
{
    struct engine_model *m = j->m;
    const struct engine_hparams *hp = &m->hp;
    struct engine_rank *R = &m->rank[r];
    struct engine_rank_bufs *f = &R->buf;
    struct kern_backend *be = R->be;
    const struct kern_ops *k = be->ops;
    const int N = m->n_rank, n = m->stage.n_pad, E = hp->n_embd, hd = hp->head_dim;
    const int q_dim = R->n_head * hd, kv_dim = R->n_kv_head * hd;
    float *x = B->x, *xn = B->xn, *q = B->q, *att = B->att, *kk = B->kk, *vv = B->vv;
    float *gate = B->gate, *up = B->up, *att_all = B->att_all, *gate_all = B->gate_all;
    float *up_all = B->up_all, *y = B->y, *land = B->land;
    k->get_rows(be, &m->tok_embd, f->tok, n, x);
    if (hp->emb_scale > 0)
        k->scale(be, x, hp->emb_scale, (long)n * E);
    /* Each matmul's input pass also does the element-wise steps before it (struct kern_mm_in):
     * the residual add of the block before, the norm or the SwiGLU. */
    for (int l = 0; l < hp->n_layer; l++) {
        const struct engine_layer *L = &R->layers[l];
        struct kern_kv_layer kvl = engine_kv_layer(j->kv, r, l);
        const struct kern_block_table bt = bts[engine_kv_layer_pool(j->kv, l)];

        /* attention block: x += the previous FFN's output (in xn), xn = norm(x) */
        const struct kern_mm_in attn_in = {.x = x, .add = l ? xn : NULL, .norm = L->attn_norm,
                                           .eps = hp->rms_eps, .xn = xn};
        const struct kern_tensor *qkv_w[3] = {&L->wq, &L->wk, &L->wv};
        float *const qkv_y[3] = {q, kk, vv};
        k->matmul(be, qkv_w, qkv_y, 3, &attn_in, n);
        if (L->bq) {
            k->add_rows(be, q, L->bq, n, q_dim);
            k->add_rows(be, kk, L->bk, n, kv_dim);
            k->add_rows(be, vv, L->bv, n, kv_dim);
        }
        if (L->q_norm) {
            k->norm_rows(be, q, L->q_norm, (long)n * R->n_head, hd, hp->rms_eps);
            k->norm_rows(be, kk, L->k_norm, (long)n * R->n_kv_head, hd, hp->rms_eps);
        }
        const float *cs = f->rope + (L->swa && m->n_rope > 1 ? (size_t)n * hp->rope_dim : 0);
        k->rope(be, q, cs, n, R->n_head, hd, hp->rope_dim, hp->rope_neox);
        k->rope(be, kk, cs, n, R->n_kv_head, hd, hp->rope_dim, hp->rope_neox);
        k->kv_store(be, kvl, &bt, f->pos, engine_kv_block_size(j->kv), R->n_kv_head, hd, kk, vv, n,
                    f->last);
        struct kern_attn a = {
            .n_tok = n,
            .q = q,
            .out = att,
            .pos = f->pos,
            .bt = bt,
            .kv = kvl,
            .block_size = engine_kv_block_size(j->kv),
            .n_head = R->n_head,
            .n_kv_head = R->n_kv_head,
            .head_dim = hd,
            .scale = hp->attn_scale,
            .window = L->swa ? hp->swa_window : 0,
            .softcap = hp->attn_softcap,
            .store = f->last,
            .k_new = kk,
            .v_new = vv,
            .n_seqs = j->m->stage.n_rows,
        };
        k->attention(be, &a);
        if (L->experts) {
            if (N == 1) {
                const struct kern_mm_in o_in = {.x = att};
                matmul1(be, &L->wo, &o_in, xn, n);
            } else {
                gather_slices(R, N, att, att_all, land, n, q_dim);
                const struct kern_mm_in o_in = {.x = att_all};
                matmul1(be, &L->wo, &o_in, y, n);
                gather_slices(R, N, y, xn, land, n, R->n_embd);
            }
            post_norm(be, L->post_attn_norm, xn, n, E, hp->rms_eps);
            moe_ffn(m, R, B, L, n);
            post_norm(be, L->post_ffn_norm, xn, n, E, hp->rms_eps);
            continue;
        }
        if (N == 1) {
            const struct kern_mm_in o_in = {.x = att};
            matmul1(be, &L->wo, &o_in, xn, n);
            post_norm(be, L->post_attn_norm, xn, n, E, hp->rms_eps);
            /* feed-forward block: x += the attention output, xn = norm(x); down(act(gate) *
             * up) */
            const struct kern_mm_in ffn_in = {.x = x, .add = xn, .norm = L->ffn_norm,
                                              .eps = hp->rms_eps, .xn = xn};
            k->ffn(be, &L->w_gate, &L->w_up, &L->w_down, &ffn_in, hp->glu, xn, gate, up, n);
            post_norm(be, L->post_ffn_norm, xn, n, E, hp->rms_eps);
            continue;
        }
        /* the heads' outputs from every rank, then this rank's rows of o (the whole output in
         * xn after the second gather) */
        gather_slices(R, N, att, att_all, land, n, q_dim);
        const struct kern_mm_in o_in = {.x = att_all};
        matmul1(be, &L->wo, &o_in, y, n);
        gather_slices(R, N, y, xn, land, n, R->n_embd);
        post_norm(be, L->post_attn_norm, xn, n, E, hp->rms_eps);
        /* feed-forward block: this rank's gate and up rows of norm(x += xn), both gathered;
         * its rows of down(act(gate) * up), gathered */
        const struct kern_mm_in ffn_in = {.x = x, .add = xn, .norm = L->ffn_norm,
                                          .eps = hp->rms_eps, .xn = xn};
        const struct kern_tensor *gu_w[2] = {&L->w_gate, &L->w_up};
        float *const gu_y[2] = {gate, up};
        k->matmul(be, gu_w, gu_y, 2, &ffn_in, n);
        gather_slices(R, N, gate, gate_all, land, n, R->n_ff);
        gather_slices(R, N, up, up_all, land, n, R->n_ff);
        const struct kern_mm_in down_in = {.x = gate_all, .up = up_all, .glu = hp->glu};
        matmul1(be, &L->w_down, &down_in, y, n);
        gather_slices(R, N, y, xn, land, n, R->n_embd);
        post_norm(be, L->post_ffn_norm, xn, n, E, hp->rms_eps);
    }
}

/* What fixes forward_layers' ops and arguments for a step: the token count, the block tables'
 * rows and width, and the device memory they read and write: the rank's buffers (carved by the
 * token count), every layer's KV pools and the weights (hashed as addresses, so a buffer,
 * cache or model made anew elsewhere is a new key; one made anew at the same address is the
 * same memory with the same role). */
static uint64_t graph_key(const struct fwd_job *j, int r)
{
    const struct engine_model *m = j->m;
    const struct engine_model_stage *s = &m->stage;
    const struct engine_rank *R = &m->rank[r];
    uint64_t h = 0x9E3779B97F4A7C15ull;
#define KEY_MIX(v)                                                                                 \
    do {                                                                                           \
        h ^= (uint64_t)(v) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);                          \
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;                                               \
        h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;                                               \
        h ^= h >> 31;                                                                              \
    } while (0)
    KEY_MIX(s->n_pad);
    KEY_MIX(s->n_rows);
    KEY_MIX(s->stride);
    KEY_MIX((uintptr_t)R->buf.act);
    KEY_MIX((uintptr_t)R->buf.tables);
    KEY_MIX((uintptr_t)m->tok_embd.packed);
    for (int l = 0; l < m->hp.n_layer; l++) {
        const struct kern_kv_layer kv = engine_kv_layer(j->kv, r, l);
        KEY_MIX((uintptr_t)kv.k);
        KEY_MIX((uintptr_t)kv.v);
        KEY_MIX((uintptr_t)R->layers[l].wq.packed);
    }
#undef KEY_MIX
    return h;
}

/* Rank r's share of the pass: its query/KV heads of attention and its rows of every matrix;
 * with more than one rank the slices each next matrix reads are all-gathered first (every rank
 * then holds the whole residual stream, bitwise as one rank computes it). Rank 0 then runs the
 * output head. On a backend with graphs (CUDA; several ranks: joined by NCCL) the layers' ops
 * go through kern_ops.graph_begin, which replays a graph of them when one was made for the same
 * shape. */
static void forward_rank(struct fwd_job *j, int r)
{
    struct engine_model *m = j->m;
    const struct engine_hparams *hp = &m->hp;
    struct engine_rank *R = &m->rank[r];
    struct engine_rank_bufs *f = &R->buf;
    const struct engine_model_stage *s = &m->stage;
    struct kern_backend *be = R->be;
    const struct kern_ops *k = be->ops;
    const struct engine_batch *b = j->b;
    const int N = m->n_rank, n = b->n_tok, E = hp->n_embd, np = s->n_pad;
    const struct fwd_bufs B = fwd_bufs_of(hp, R, N, np); /* the layers run np tokens */
    float *x = B.x, *xn = B.xn;
    k->upload(be, f->tok, np > n ? s->tok : b->token, sizeof(int32_t) * (size_t)np);
    k->upload(be, f->pos, np > n ? s->pos : b->pos, sizeof(int32_t) * (size_t)np);
    k->upload(be, f->row, s->row, sizeof(int32_t) * (size_t)np);
    k->upload(be, f->last, s->last, (size_t)np);
    k->upload(be, f->rope, s->rope, sizeof(float) * (size_t)np * (size_t)hp->rope_dim * m->n_rope);
    if (N > 1)
        k->upload(be, f->perm, s->perm, sizeof(int32_t) * (size_t)np * (size_t)N);
    const int n_pools = engine_kv_n_pools(j->kv);
    const size_t table_ids = (size_t)s->n_rows * (size_t)s->stride;
    k->upload(be, f->tables, s->tables, sizeof(int32_t) * table_ids * (size_t)n_pools);
    const struct kern_block_table bts[2] = {{f->tables, f->row, s->stride},
                                            {f->tables + table_ids, f->row, s->stride}};

    /* every rank asks or none does (stage.graphs), with the same graph state (sync_graphs): so
     * every rank captures, replays or runs its collectives alike, as NCCL requires */
    const int g = m->stage.graphs ? k->graph_begin(be, graph_key(j, r)) : KERN_GRAPH_NONE;
    if (g == KERN_GRAPH_REPLAYED)
        __atomic_fetch_add(&m->graph_replays, 1, __ATOMIC_RELAXED);
    else {
        forward_layers(j, r, &B, bts);
        if (g == KERN_GRAPH_CAPTURE) {
            if (k->graph_end(be))
                __atomic_fetch_add(&m->graph_captures, 1, __ATOMIC_RELAXED);
            else /* the capture failed (the backend said why): the ops run now */
                forward_layers(j, r, &B, bts);
        }
    }
    if (r != 0 || !s->n_out)
        return;
    k->add(be, x, xn, (long)n * E); /* the last FFN's output */

    /* the rows that want logits (into xn), then final norm (into x) and output head */
    const int n_out = s->n_out;
    k->upload(be, f->idx, s->idx, sizeof(int32_t) * (size_t)n_out);
    k->gather(be, xn, x, f->idx, n_out, E);
    const struct kern_mm_in out_in = {.x = xn, .norm = R->output_norm, .eps = hp->rms_eps,
                                      .xn = x};
    const size_t V = (size_t)hp->n_vocab;
    if (j->ids && k->matmul_argmax &&
        k->matmul_argmax(be, &m->output, &out_in, n_out, be->host_memory ? j->ids : f->ids)) {
        if (!be->host_memory)
            k->download(be, j->ids, f->ids, sizeof(int32_t) * (size_t)n_out);
        *j->fused = 1;
    } else if (j->hook && be->host_memory && k->matmul_hook && !(hp->final_softcap > 0) &&
               k->matmul_hook(be, &m->output, &out_in, n_out, j->hook, j->hook_ctx)) {
        *j->hooked = 1;
    } else {
        matmul1(be, &m->output, &out_in, be->host_memory ? j->logits : f->logits, n_out);
        if (j->srows) { /* engine_model_samples: drawn on the device; its leftovers come back */
            k->sample(be, f->logits, n_out, hp->n_vocab, j->srows, j->pen_id, j->pen_count,
                      j->n_pen, j->masks, j->n_masks, j->sout);
            for (int i = 0; i < n_out; i++)
                if (j->sout[i].id < 0)
                    k->download(be, j->logits + V * (size_t)i, f->logits + V * (size_t)i,
                                sizeof(float) * V);
            return;
        }
        if (!be->host_memory)
            k->download(be, j->logits, f->logits, sizeof(float) * V * (size_t)n_out);
        if (hp->final_softcap > 0) /* on the host: the rows are here now (Gemma 2) */
            for (size_t i = 0; i < V * (size_t)n_out; i++)
                j->logits[i] = hp->final_softcap * tanhf(j->logits[i] / hp->final_softcap);
    }
}

static void rank_worker(void *arg, int ith, int nth)
{
    (void)nth;
    forward_rank(arg, ith);
}

/* The forward pass of job j (its model, cache, batch and outputs set; forward_rank says what
 * each output asks of the output head). */
/* A device backend's logits buffer holds one row a sequence slot (a step's usual need); a batch
 * that wants more rows (several tokens of a sequence: speculative drafts, scoring) grows it. */
static enum status logits_rows(struct engine_model *m, int n, struct err_detail *err)
{
    struct engine_rank *R = &m->rank[0];
    struct kern_backend *be = R->be;
    if (be->host_memory || n <= R->buf.logits_rows)
        return ST_OK;
    /* at least doubled (each growth frees memory, which drops the backend's graphs) */
    const int dbl =
        2 * R->buf.logits_rows < m->stage.max_tok ? 2 * R->buf.logits_rows : m->stage.max_tok;
    n = n > dbl ? n : dbl;
    be->ops->buf_free(be, R->buf.logits);
    R->buf.logits = be->ops->buf_alloc(be, sizeof(float) * (size_t)n * (size_t)m->hp.n_vocab);
    R->buf.logits_rows = R->buf.logits ? n : 0;
    return R->buf.logits ? ST_OK
                         : err_set(err, ST_ERR_NOMEM, "no device memory for %d rows of logits", n);
}

/* Ranks that take graphs together keep the same graph state: when any rank dropped its graphs
 * since the last step (it gave memory back: rank 0's logits or sampling scratch grew), every
 * rank drops them, so the ranks ask for the same keys with the same memory of them and decide
 * alike (a rank whose graphs are off turns graphs_usable off for all). */
static void sync_graphs(struct engine_model *m)
{
    if (!m->stage.graphs)
        return;
    int moved = 0;
    for (int r = 0; r < m->n_rank; r++) {
        const struct engine_rank *R = &m->rank[r];
        moved |= R->be->ops->graph_epoch(R->be) != R->graph_epoch;
    }
    for (int r = 0; r < m->n_rank; r++) {
        struct engine_rank *R = &m->rank[r];
        if (moved)
            R->be->ops->graphs_reset(R->be);
        R->graph_epoch = R->be->ops->graph_epoch(R->be);
    }
}

static enum status forward(struct fwd_job *j, struct err_detail *err)
{
    enum status st = check_batch(j->m, j->kv, j->b, err);
    if (st)
        return st;
    stage_batch(j->m, j->kv, j->b);
    if ((st = logits_rows(j->m, j->m->stage.n_out, err)))
        return st;
    if (j->m->n_rank > 1) {
        sync_graphs(j->m);
        pool_run(j->m->rank_pool, rank_worker, j);
    } else
        forward_rank(j, 0);
    return ST_OK;
}

enum status engine_model_forward(struct engine_model *m, struct engine_kv *kv,
                                 const struct engine_batch *b, float *logits,
                                 struct err_detail *err)
{
    struct fwd_job j = {.m = m, .kv = kv, .b = b, .logits = logits};
    return forward(&j, err);
}

enum status engine_model_forward_greedy(struct engine_model *m, struct engine_kv *kv,
                                        const struct engine_batch *b, float *logits,
                                        int32_t *ids, int *fused, struct err_detail *err)
{
    *fused = 0;
    struct fwd_job j = {.m = m, .kv = kv, .b = b, .logits = logits, .ids = ids, .fused = fused};
    return forward(&j, err);
}

enum status engine_model_forward_hook(struct engine_model *m, struct engine_kv *kv,
                                      const struct engine_batch *b, float *logits,
                                      void (*hook)(void *ctx, int ith, int64_t r0, int64_t r1,
                                                   float *blk, size_t ld),
                                      void *ctx, int *hooked, struct err_detail *err)
{
    *hooked = 0;
    struct fwd_job j = {.m = m,
                        .kv = kv,
                        .b = b,
                        .logits = logits,
                        .hook = hook,
                        .hook_ctx = ctx,
                        .hooked = hooked};
    return forward(&j, err);
}

int engine_model_samples(const struct engine_model *m)
{
    const struct kern_backend *be = m->rank[0].be;
    return be->ops->sample && !be->host_memory && !(m->hp.final_softcap > 0);
}

enum status engine_model_forward_sample(struct engine_model *m, struct engine_kv *kv,
                                        const struct engine_batch *b,
                                        const struct kern_sample_row *rows, const int32_t *pen_id,
                                        const int32_t *pen_count, int n_pen, const uint32_t *masks,
                                        int n_masks, struct kern_sample_out *out, float *logits,
                                        struct err_detail *err)
{
    if (!engine_model_samples(m))
        return err_set(err, ST_ERR_UNSUPPORTED, "this model's backend does not sample");
    struct fwd_job j = {.m = m,
                        .kv = kv,
                        .b = b,
                        .logits = logits,
                        .srows = rows,
                        .pen_id = pen_id,
                        .pen_count = pen_count,
                        .n_pen = n_pen,
                        .masks = masks,
                        .n_masks = n_masks,
                        .sout = out};
    return forward(&j, err);
}

const struct engine_hparams *engine_model_hparams(const struct engine_model *m)
{
    return &m->hp;
}

const struct io_gguf *engine_model_gguf(const struct engine_model *m)
{
    return m->gguf;
}

int engine_model_same_vocab(const struct engine_model *a, const struct engine_model *b, char *why,
                            size_t cap)
{
    const struct io_gguf_str *ta = NULL, *tb = NULL;
    uint64_t na = 0, nb = 0;
    if (a == b) /* a model drafting for itself (a file without token lists too) */
        return 1;
    if (a->hp.n_vocab != b->hp.n_vocab) {
        snprintf(why, cap, "%d tokens against %d", b->hp.n_vocab, a->hp.n_vocab);
        return 0;
    }
    if (io_gguf_get_str_arr(a->gguf, "tokenizer.ggml.tokens", &ta, &na, NULL) ||
        io_gguf_get_str_arr(b->gguf, "tokenizer.ggml.tokens", &tb, &nb, NULL) || na != nb) {
        snprintf(why, cap, "their token lists cannot be compared");
        return 0;
    }
    for (uint64_t i = 0; i < na; i++)
        if (ta[i].len != tb[i].len || memcmp(ta[i].ptr, tb[i].ptr, ta[i].len)) {
            snprintf(why, cap, "token %llu differs", (unsigned long long)i);
            return 0;
        }
    return 1;
}
