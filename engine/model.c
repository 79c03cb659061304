/* Llama forward pass over a flat multi-sequence batch, read top to bottom like llama2.c:
 * embed -> per layer (RMSNorm, QKV, RoPE, paged attention, output proj, residual, RMSNorm,
 * SwiGLU FFN, residual) -> final norm -> output head for the rows that want logits. */
#include "engine/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"

/* ---- loading ---- */

static enum status get_hparam(const struct io_gguf *g, const char *arch, const char *key,
                              int *out, int required, int dflt, struct err_detail *err)
{
    char name[128];
    uint32_t v;
    snprintf(name, sizeof(name), "%s.%s", arch, key);
    enum status st = io_gguf_get_u32(g, name, &v, err);
    if (st == ST_ERR_NOT_FOUND && !required) {
        *out = dflt;
        return ST_OK;
    }
    if (st)
        return st;
    if (v == 0 || v > (1u << 24))
        return err_set(err, ST_ERR_FORMAT, "metadata %s = %u is out of range", name, v);
    *out = (int)v;
    return ST_OK;
}

static enum status get_f32(const struct io_gguf *g, const char *arch, const char *key,
                           float *out, struct err_detail *err)
{
    char name[128];
    snprintf(name, sizeof(name), "%s.%s", arch, key);
    enum status st = io_gguf_get_f32(g, name, out, err);
    if (!st && !(isfinite(*out) && *out > 0))
        return err_set(err, ST_ERR_FORMAT, "metadata %s = %g is not a positive number", name,
                       (double)*out);
    return st;
}

static enum status read_hparams(const struct io_gguf *g, struct engine_hparams *hp,
                                struct err_detail *err)
{
    struct io_gguf_str arch_s;
    enum status st = io_gguf_get_str(g, "general.architecture", &arch_s, err);
    if (st)
        return st;
    if (!io_gguf_str_eq(arch_s, "llama"))
        return err_set(err, ST_ERR_UNSUPPORTED, "architecture '%.*s' is not supported (llama only)",
                       (int)(arch_s.len > 40 ? 40 : arch_s.len), arch_s.ptr);
    const char *arch = "llama";
    if ((st = get_hparam(g, arch, "embedding_length", &hp->n_embd, 1, 0, err)) ||
        (st = get_hparam(g, arch, "block_count", &hp->n_layer, 1, 0, err)) ||
        (st = get_hparam(g, arch, "feed_forward_length", &hp->n_ff, 1, 0, err)) ||
        (st = get_hparam(g, arch, "attention.head_count", &hp->n_head, 1, 0, err)) ||
        (st = get_hparam(g, arch, "context_length", &hp->n_ctx_train, 1, 0, err)) ||
        (st = get_f32(g, arch, "attention.layer_norm_rms_epsilon", &hp->rms_eps, err)))
        return st;
    if ((st = get_hparam(g, arch, "attention.head_count_kv", &hp->n_kv_head, 0, hp->n_head, err)))
        return st;
    if (hp->n_embd % hp->n_head || hp->n_head % hp->n_kv_head)
        return err_set(err, ST_ERR_FORMAT, "heads do not divide: n_embd %d, n_head %d, n_kv_head %d",
                       hp->n_embd, hp->n_head, hp->n_kv_head);
    hp->head_dim = hp->n_embd / hp->n_head;
    if (hp->head_dim > KERN_MAX_HEAD_DIM || hp->head_dim % 2)
        return err_set(err, ST_ERR_UNSUPPORTED, "head_dim %d unsupported (even, <= %d)",
                       hp->head_dim, KERN_MAX_HEAD_DIM);
    if ((st = get_hparam(g, arch, "rope.dimension_count", &hp->rope_dim, 0, hp->head_dim, err)))
        return st;
    if (hp->rope_dim > hp->head_dim || hp->rope_dim % 2)
        return err_set(err, ST_ERR_FORMAT, "rope.dimension_count %d invalid for head_dim %d",
                       hp->rope_dim, hp->head_dim);
    hp->rope_theta = 10000.0f;
    char name[128];
    snprintf(name, sizeof(name), "%s.rope.freq_base", arch);
    if (io_gguf_find_kv(g, name) && (st = get_f32(g, arch, "rope.freq_base", &hp->rope_theta, err)))
        return st;
    struct io_gguf_str sc;
    snprintf(name, sizeof(name), "%s.rope.scaling.type", arch);
    if (io_gguf_get_str(g, name, &sc, NULL) == ST_OK && !io_gguf_str_eq(sc, "none"))
        return err_set(err, ST_ERR_UNSUPPORTED, "RoPE scaling '%.*s' is not supported yet",
                       (int)(sc.len > 20 ? 20 : sc.len), sc.ptr);
    return ST_OK;
}

int engine_model_weights(const struct engine_model *m, int layer, const struct kern_tensor **out)
{
    if (layer == m->hp.n_layer) {
        out[0] = &m->output;
        return 1;
    }
    const struct engine_layer *L = &m->layers[layer];
    const struct kern_tensor *w[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up,
                                     &L->w_down};
    memcpy(out, w, sizeof(w));
    return (int)(sizeof(w) / sizeof(w[0]));
}

static enum status load_matrix(const struct io_gguf *g, const char *name, int64_t in,
                               int64_t out, struct kern_tensor *t, struct err_detail *err)
{
    const struct io_gguf_tensor *gt = io_gguf_find_tensor(g, name);
    if (!gt)
        return err_set(err, ST_ERR_NOT_FOUND, "tensor '%s' is missing", name);
    if (gt->n_dims != 2 || gt->ne[0] != in || gt->ne[1] != out)
        return err_set(err, ST_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld], want [%lld, %lld]",
                       name, (long long)gt->ne[0], (long long)gt->ne[1], (long long)in,
                       (long long)out);
    if (gt->type != DTYPE_F32 && gt->type != DTYPE_F16 && gt->type != DTYPE_BF16 && in % 32)
        return err_set(err, ST_ERR_UNSUPPORTED, "tensor '%s': row length %lld not a multiple of 32",
                       name, (long long)in);
    t->type = gt->type;
    t->ne0 = in;
    t->ne1 = out;
    t->row_bytes = dtype_row_bytes(gt->type, in);
    t->data = gt->data;
    return ST_OK;
}

static enum status load_vector(const struct io_gguf *g, const char *name, int64_t n,
                               const float **v, struct err_detail *err)
{
    const struct io_gguf_tensor *gt = io_gguf_find_tensor(g, name);
    if (!gt)
        return err_set(err, ST_ERR_NOT_FOUND, "tensor '%s' is missing", name);
    if (gt->type != DTYPE_F32 || gt->ne[0] != n || gt->ne[1] * gt->ne[2] * gt->ne[3] != 1)
        return err_set(err, ST_ERR_UNSUPPORTED, "tensor '%s': want F32 vector of %lld", name,
                       (long long)n);
    if ((uintptr_t)gt->data % sizeof(float))
        return err_set(err, ST_ERR_FORMAT, "tensor '%s' is not 4-byte aligned", name);
    *v = gt->data;
    return ST_OK;
}

/* The norm vectors into one backend buffer; the model's pointers then point there. */
static enum status upload_norms(struct engine_model *m, struct err_detail *err)
{
    const int E = m->hp.n_embd, nv = 2 * m->hp.n_layer + 1;
    m->norms = m->be->ops->buf_alloc(m->be, sizeof(float) * (size_t)E * (size_t)nv);
    if (!m->norms)
        return err_set(err, ST_ERR_NOMEM, "no backend memory for the norm weights");
    for (int i = 0; i < nv; i++) {
        const float **p = i == 0       ? &m->output_norm
                          : (i - 1) % 2 ? &m->layers[(i - 1) / 2].ffn_norm
                                        : &m->layers[(i - 1) / 2].attn_norm;
        float *dst = m->norms + (size_t)i * (size_t)E;
        m->be->ops->upload(m->be, dst, *p, sizeof(float) * (size_t)E);
        *p = dst;
    }
    return ST_OK;
}

static void bufs_free(struct engine_model *m)
{
    struct engine_model_bufs *f = &m->buf;
    if (m->be) {
        void *d[] = {f->d_act, f->d_tok,    f->d_pos, f->d_row,    f->d_last,
                     f->d_rope, f->d_tables, f->d_idx, f->d_logits, f->d_ids};
        for (size_t i = 0; i < sizeof(d) / sizeof(d[0]); i++)
            m->be->ops->buf_free(m->be, d[i]);
    }
    free(f->h_row);
    free(f->h_last);
    free(f->h_rope);
    free(f->h_tables);
    free(f->h_idx);
    free(f->h_seq_row);
    free(f->h_seq_top);
    memset(f, 0, sizeof(*f));
}

enum status engine_model_from_gguf(struct engine_model **out, struct io_gguf *g,
                                   struct kern_backend *be, struct err_detail *err)
{
    *out = NULL;
    struct engine_model *m = calloc(1, sizeof(*m));
    if (!m)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    struct engine_hparams *hp = &m->hp;
    enum status st = read_hparams(g, hp, err);
    if (st)
        goto fail;
    const struct io_gguf_tensor *emb = io_gguf_find_tensor(g, "token_embd.weight");
    if (!emb) {
        st = err_set(err, ST_ERR_NOT_FOUND, "tensor 'token_embd.weight' is missing");
        goto fail;
    }
    hp->n_vocab = (int)emb->ne[1];
    int q_dim = hp->n_head * hp->head_dim, kv_dim = hp->n_kv_head * hp->head_dim;
    if ((st = load_matrix(g, "token_embd.weight", hp->n_embd, hp->n_vocab, &m->tok_embd, err)) ||
        (st = load_vector(g, "output_norm.weight", hp->n_embd, &m->output_norm, err)))
        goto fail;
    if (io_gguf_find_tensor(g, "output.weight")) {
        if ((st = load_matrix(g, "output.weight", hp->n_embd, hp->n_vocab, &m->output, err)))
            goto fail;
    } else {
        m->output = m->tok_embd;
        m->tied_output = 1;
    }
    m->layers = calloc((size_t)hp->n_layer, sizeof(*m->layers));
    if (!m->layers) {
        st = err_set(err, ST_ERR_NOMEM, "no memory");
        goto fail;
    }
    for (int l = 0; l < hp->n_layer; l++) {
        struct engine_layer *L = &m->layers[l];
        char n[9][64];
        static const char *const names[9] = {"attn_norm", "attn_q", "attn_k",
                                             "attn_v",    "attn_output", "ffn_norm",
                                             "ffn_gate",  "ffn_up", "ffn_down"};
        for (int i = 0; i < 9; i++)
            snprintf(n[i], sizeof(n[i]), "blk.%d.%s.weight", l, names[i]);
        char bias[64];
        snprintf(bias, sizeof(bias), "blk.%d.attn_q.bias", l);
        if (io_gguf_find_tensor(g, bias)) {
            st = err_set(err, ST_ERR_UNSUPPORTED, "attention biases (%s) are not supported", bias);
            goto fail;
        }
        if ((st = load_vector(g, n[0], hp->n_embd, &L->attn_norm, err)) ||
            (st = load_matrix(g, n[1], hp->n_embd, q_dim, &L->wq, err)) ||
            (st = load_matrix(g, n[2], hp->n_embd, kv_dim, &L->wk, err)) ||
            (st = load_matrix(g, n[3], hp->n_embd, kv_dim, &L->wv, err)) ||
            (st = load_matrix(g, n[4], q_dim, hp->n_embd, &L->wo, err)) ||
            (st = load_vector(g, n[5], hp->n_embd, &L->ffn_norm, err)) ||
            (st = load_matrix(g, n[6], hp->n_embd, hp->n_ff, &L->w_gate, err)) ||
            (st = load_matrix(g, n[7], hp->n_embd, hp->n_ff, &L->w_up, err)) ||
            (st = load_matrix(g, n[8], hp->n_ff, hp->n_embd, &L->w_down, err)))
            goto fail;
    }
    m->be = be;
    for (int l = 0; be && be->ops->prepare && l <= hp->n_layer; l++) {
        const struct kern_tensor *mats[ENGINE_MAX_LAYER_WEIGHTS];
        for (int i = 0, nw = engine_model_weights(m, l, mats); i < nw; i++)
            if ((st = be->ops->prepare(be, (struct kern_tensor *)mats[i], err)))
                goto fail;
    }
    if (be && (st = upload_norms(m, err)))
        goto fail;
    m->gguf = g; /* only now: on failure the caller closes g */
    *out = m;
    return ST_OK;
fail:
    engine_model_free(m);
    return st;
}

enum status engine_model_load(struct engine_model **out, const char *path, struct kern_backend *be,
                              struct err_detail *err)
{
    struct io_gguf *g;
    enum status st = io_gguf_open(&g, path, err);
    if (st)
        return st;
    st = engine_model_from_gguf(out, g, be, err);
    if (st) {
        err_prefix(err, "%s", path);
        io_gguf_close(g);
    }
    return st;
}

void engine_model_free(struct engine_model *m)
{
    if (!m)
        return;
    for (int l = 0; m->be && m->be->ops->release && m->layers && l <= m->hp.n_layer; l++) {
        const struct kern_tensor *mats[ENGINE_MAX_LAYER_WEIGHTS];
        for (int i = 0, nw = engine_model_weights(m, l, mats); i < nw; i++)
            m->be->ops->release(m->be, (struct kern_tensor *)mats[i]);
    }
    bufs_free(m);
    if (m->be)
        m->be->ops->buf_free(m->be, m->norms);
    io_gguf_close(m->gguf);
    free(m->layers);
    free(m);
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
    if ((st = engine_kv_storage_alloc(*out, m->be, err)) ||
        (st = engine_model_reserve(m, *out, n_tokens, err))) {
        engine_kv_free(*out);
        *out = NULL;
    }
    return st;
}

/* ---- forward ---- */

static void matmul1(struct engine_model *m, const struct kern_tensor *w,
                    const struct kern_mm_in *in, float *y, int n_tok)
{
    float *const ys[1] = {y};
    m->be->ops->matmul(m->be, &w, ys, 1, in, n_tok);
}

/* Floats of activation scratch per token. */
static size_t scratch_per_tok(const struct engine_hparams *hp)
{
    size_t q_dim = (size_t)hp->n_head * hp->head_dim, kv_dim = (size_t)hp->n_kv_head * hp->head_dim;
    return 2 * (size_t)hp->n_embd + 2 * q_dim + 2 * kv_dim + 2 * (size_t)hp->n_ff;
}

enum status engine_model_reserve(struct engine_model *m, const struct engine_kv *kv, int max_tok,
                                 struct err_detail *err)
{
    struct engine_model_bufs *f = &m->buf;
    const struct engine_hparams *hp = &m->hp;
    /* a sequence never holds more blocks than the pool, nor more than the model's context */
    int32_t ctx_blocks = (hp->n_ctx_train + kv->block_size - 1) / kv->block_size + 1;
    int max_blocks = kv->n_blocks < ctx_blocks ? kv->n_blocks : ctx_blocks;
    if (max_tok < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "engine_model_reserve: %d tokens", max_tok);
    if (f->max_tok >= max_tok && f->max_seqs >= kv->max_seqs && f->max_blocks >= max_blocks)
        return ST_OK;
    bufs_free(m);
    struct kern_backend *be = m->be;
    const size_t T = (size_t)max_tok, R = T < (size_t)kv->max_seqs ? T : (size_t)kv->max_seqs;
    const size_t tables = R * (size_t)max_blocks, rope = T * (size_t)hp->rope_dim;
    f->d_act = be->ops->buf_alloc(be, sizeof(float) * scratch_per_tok(hp) * T);
    f->d_tok = be->ops->buf_alloc(be, sizeof(int32_t) * T);
    f->d_pos = be->ops->buf_alloc(be, sizeof(int32_t) * T);
    f->d_row = be->ops->buf_alloc(be, sizeof(int32_t) * T);
    f->d_last = be->ops->buf_alloc(be, T);
    f->d_rope = be->ops->buf_alloc(be, sizeof(float) * rope);
    f->d_tables = be->ops->buf_alloc(be, sizeof(int32_t) * tables);
    f->d_idx = be->ops->buf_alloc(be, sizeof(int32_t) * T);
    int ok = f->d_act && f->d_tok && f->d_pos && f->d_row && f->d_last && f->d_rope &&
             f->d_tables && f->d_idx;
    if (!be->host_memory) {
        f->d_logits = be->ops->buf_alloc(be, sizeof(float) * T * (size_t)hp->n_vocab);
        f->d_ids = be->ops->buf_alloc(be, sizeof(int32_t) * T);
        ok = ok && f->d_logits && f->d_ids;
    }
    f->h_row = calloc(T, sizeof(*f->h_row));
    f->h_last = calloc(T, 1);
    f->h_rope = calloc(rope, sizeof(*f->h_rope));
    f->h_tables = calloc(tables, sizeof(*f->h_tables));
    f->h_idx = calloc(T, sizeof(*f->h_idx));
    f->h_seq_row = malloc(sizeof(*f->h_seq_row) * (size_t)kv->max_seqs);
    f->h_seq_top = malloc(sizeof(*f->h_seq_top) * R);
    if (!ok || !f->h_row || !f->h_last || !f->h_rope || !f->h_tables || !f->h_idx ||
        !f->h_seq_row || !f->h_seq_top) {
        bufs_free(m);
        return err_set(err, ST_ERR_NOMEM, "no memory for the buffers of %d-token batches",
                       max_tok);
    }
    for (int i = 0; i < kv->max_seqs; i++)
        f->h_seq_row[i] = -1;
    f->max_tok = max_tok;
    f->max_seqs = kv->max_seqs;
    f->max_blocks = max_blocks;
    return ST_OK;
}

static enum status check_batch(const struct engine_model *m, const struct engine_kv *kv,
                               const struct engine_batch *b, struct err_detail *err)
{
    if (b->n_tok < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "empty batch");
    if (b->n_tok > m->buf.max_tok || kv->max_seqs > m->buf.max_seqs)
        return err_set(err, ST_ERR_RANGE,
                       "a batch of %d tokens over %d sequence slots exceeds the buffers reserved "
                       "(%d tokens, %d slots)",
                       b->n_tok, kv->max_seqs, m->buf.max_tok, m->buf.max_seqs);
    for (int t = 0; t < b->n_tok; t++) {
        if (b->token[t] < 0 || b->token[t] >= m->hp.n_vocab)
            return err_set(err, ST_ERR_RANGE, "token id %d outside the vocabulary (%d)",
                           b->token[t], m->hp.n_vocab);
        if (b->seq[t] < 0 || b->seq[t] >= kv->max_seqs)
            return err_set(err, ST_ERR_RANGE, "sequence slot %d outside 0..%d", b->seq[t],
                           kv->max_seqs - 1);
        int64_t cap = (int64_t)kv->seqs[b->seq[t]].n_blocks * kv->block_size;
        if (b->pos[t] < 0 || b->pos[t] >= cap)
            return err_set(err, ST_ERR_RANGE,
                           "position %d of sequence %d has no KV block reserved (capacity %lld)",
                           b->pos[t], b->seq[t], (long long)cap);
        if (kv->seqs[b->seq[t]].n_blocks > m->buf.max_blocks)
            return err_set(err, ST_ERR_RANGE, "sequence %d holds %d KV blocks, more than %d",
                           b->seq[t], kv->seqs[b->seq[t]].n_blocks, m->buf.max_blocks);
    }
    return ST_OK;
}

/* The host side of a step: each sequence of the batch gets a block table row (in order of
 * first appearance), each token its row and whether it is its sequence's highest position
 * (no other token attends to it: its KV is written by the attention pass, right before it is
 * read, struct kern_attn's store; the others by kv_store, before any attention); the RoPE
 * angles and the rows that want logits. Everything is uploaded; returns the table stride and
 * sets *n_out. */
static int stage_batch(struct engine_model *m, const struct engine_kv *kv,
                       const struct engine_batch *b, int *n_out)
{
    struct engine_model_bufs *f = &m->buf;
    const struct engine_hparams *hp = &m->hp;
    struct kern_backend *be = m->be;
    const int n = b->n_tok;
    int n_rows = 0, stride = 1;
    for (int t = 0; t < n; t++) {
        int32_t *r = &f->h_seq_row[b->seq[t]];
        if (*r < 0) {
            f->h_seq_top[n_rows] = t;
            *r = n_rows++;
            int nb = kv->seqs[b->seq[t]].n_blocks;
            stride = nb > stride ? nb : stride;
        }
        f->h_row[t] = *r;
        if (b->pos[t] > b->pos[f->h_seq_top[*r]])
            f->h_seq_top[*r] = t;
    }
    for (int t = 0; t < n; t++) {
        const int r = f->h_row[t];
        f->h_last[t] = f->h_seq_top[r] == t;
        if (f->h_seq_top[r] == t) { /* once per row: its block ids */
            const struct engine_kv_seq *sq = &kv->seqs[b->seq[t]];
            memcpy(f->h_tables + (size_t)r * (size_t)stride, sq->blocks,
                   sizeof(int32_t) * (size_t)sq->n_blocks);
        }
    }
    for (int t = 0; t < n; t++)
        f->h_seq_row[b->seq[t]] = -1;
    /* RoPE angles pos * theta^(-i/rope_dim) for pair i/2, the same for every layer */
    for (int i = 0; i < hp->rope_dim; i += 2) {
        double freq = pow((double)hp->rope_theta, -(double)i / hp->rope_dim);
        for (int t = 0; t < n; t++) {
            double ang = b->pos[t] * freq;
            f->h_rope[(size_t)t * hp->rope_dim + i] = (float)cos(ang);
            f->h_rope[(size_t)t * hp->rope_dim + i + 1] = (float)sin(ang);
        }
    }
    *n_out = 0;
    for (int t = 0; t < n; t++)
        if (b->logits ? b->logits[t] != 0 : t == n - 1)
            f->h_idx[(*n_out)++] = t;
    const struct kern_ops *k = be->ops;
    k->upload(be, f->d_tok, b->token, sizeof(int32_t) * (size_t)n);
    k->upload(be, f->d_pos, b->pos, sizeof(int32_t) * (size_t)n);
    k->upload(be, f->d_row, f->h_row, sizeof(int32_t) * (size_t)n);
    k->upload(be, f->d_last, f->h_last, (size_t)n);
    k->upload(be, f->d_rope, f->h_rope, sizeof(float) * (size_t)n * (size_t)hp->rope_dim);
    k->upload(be, f->d_tables, f->h_tables, sizeof(int32_t) * (size_t)n_rows * (size_t)stride);
    k->upload(be, f->d_idx, f->h_idx, sizeof(int32_t) * (size_t)*n_out);
    return stride;
}

/* The forward pass; with ids, the greedy tokens of the wanted rows instead of their logits
 * where the backend can (*fused = 1). logits and ids are host memory. */
static enum status forward(struct engine_model *m, struct engine_kv *kv,
                           const struct engine_batch *b, float *logits, int32_t *ids, int *fused,
                           struct err_detail *err)
{
    const struct engine_hparams *hp = &m->hp;
    const struct kern_ops *k = m->be->ops;
    struct kern_backend *be = m->be;
    struct engine_model_bufs *f = &m->buf;
    enum status st = check_batch(m, kv, b, err);
    if (st)
        return st;
    const int n = b->n_tok, E = hp->n_embd, hd = hp->head_dim;
    const int q_dim = hp->n_head * hd, kv_dim = hp->n_kv_head * hd;
    float *x = f->d_act;                 /* residual stream, n x E */
    float *xn = x + (size_t)n * E;       /* normed input, n x E */
    float *q = xn + (size_t)n * E;       /* queries, n x q_dim */
    float *att = q + (size_t)n * q_dim;  /* attention output, n x q_dim */
    float *kk = att + (size_t)n * q_dim; /* keys, n x kv_dim */
    float *vv = kk + (size_t)n * kv_dim; /* values, n x kv_dim */
    float *gate = vv + (size_t)n * kv_dim; /* FFN gate, n x n_ff */
    float *up = gate + (size_t)n * hp->n_ff; /* FFN up, n x n_ff */
    int n_out;
    const struct kern_block_table bt = {f->d_tables, f->d_row, stage_batch(m, kv, b, &n_out)};
    const uint8_t *last = f->d_last;

    k->get_rows(be, &m->tok_embd, f->d_tok, n, x);
    /* Each matmul's input pass also does the element-wise steps before it (struct kern_mm_in):
     * the residual add of the block before, the norm or the SwiGLU. */
    for (int l = 0; l < hp->n_layer; l++) {
        const struct engine_layer *L = &m->layers[l];
        struct kern_kv_layer kvl = engine_kv_layer(kv, l);

        /* attention block: x += the previous FFN's output (in xn), xn = norm(x) */
        const struct kern_mm_in attn_in = {.x = x, .add = l ? xn : NULL, .norm = L->attn_norm,
                                           .eps = hp->rms_eps, .xn = xn};
        const struct kern_tensor *qkv_w[3] = {&L->wq, &L->wk, &L->wv};
        float *const qkv_y[3] = {q, kk, vv};
        k->matmul(be, qkv_w, qkv_y, 3, &attn_in, n);
        k->rope(be, q, f->d_rope, n, hp->n_head, hd, hp->rope_dim);
        k->rope(be, kk, f->d_rope, n, hp->n_kv_head, hd, hp->rope_dim);
        k->kv_store(be, kvl, &bt, f->d_pos, kv->block_size, hp->n_kv_head, hd, kk, vv, n, last);
        struct kern_attn a = {
            .n_tok = n, .q = q, .out = att, .pos = f->d_pos, .bt = bt,
            .kv = kvl, .block_size = kv->block_size, .n_head = hp->n_head,
            .n_kv_head = hp->n_kv_head, .head_dim = hd, .scale = 1.0f / sqrtf((float)hd),
            .store = last, .k_new = kk, .v_new = vv,
        };
        k->attention(be, &a);
        const struct kern_mm_in o_in = {.x = att};
        matmul1(m, &L->wo, &o_in, xn, n);

        /* feed-forward block: x += the attention output, xn = norm(x); down(silu(gate) * up) */
        const struct kern_mm_in ffn_in = {.x = x, .add = xn, .norm = L->ffn_norm,
                                          .eps = hp->rms_eps, .xn = xn};
        k->ffn(be, &L->w_gate, &L->w_up, &L->w_down, &ffn_in, xn, gate, up, n);
    }
    k->add(be, x, xn, (long)n * E); /* the last FFN's output */
    if (!n_out)
        return ST_OK;

    /* the rows that want logits (into xn), then final norm (into x) and output head */
    k->gather(be, xn, x, f->d_idx, n_out, E);
    const struct kern_mm_in out_in = {.x = xn, .norm = m->output_norm, .eps = hp->rms_eps,
                                      .xn = x};
    const size_t V = (size_t)hp->n_vocab;
    if (ids && k->matmul_argmax &&
        k->matmul_argmax(be, &m->output, &out_in, n_out, be->host_memory ? ids : f->d_ids)) {
        if (!be->host_memory)
            k->download(be, ids, f->d_ids, sizeof(int32_t) * (size_t)n_out);
        *fused = 1;
    } else {
        matmul1(m, &m->output, &out_in, be->host_memory ? logits : f->d_logits, n_out);
        if (!be->host_memory)
            k->download(be, logits, f->d_logits, sizeof(float) * V * (size_t)n_out);
    }
    return ST_OK;
}

enum status engine_model_forward(struct engine_model *m, struct engine_kv *kv,
                                 const struct engine_batch *b, float *logits,
                                 struct err_detail *err)
{
    return forward(m, kv, b, logits, NULL, NULL, err);
}

enum status engine_model_forward_greedy(struct engine_model *m, struct engine_kv *kv,
                                        const struct engine_batch *b, float *logits,
                                        int32_t *ids, int *fused, struct err_detail *err)
{
    *fused = 0;
    return forward(m, kv, b, logits, ids, fused, err);
}
