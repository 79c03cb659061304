/* Loading a model's weights from GGUF: the architecture (ENGINE_ARCH_NAMES) and its
 * hyperparameters from the metadata, whole matrices as views of the mapping, the norm and bias
 * vectors each architecture has. No backend here: engine/model.c splits and prepares them. */
#include "engine/model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/log.h"

static enum status get_hparam(const struct io_gguf *g, const char *arch, const char *key, int *out,
                              int required, int dflt, struct err_detail *err)
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

static enum status get_f32(const struct io_gguf *g, const char *arch, const char *key, float *out,
                           struct err_detail *err)
{
    char name[128];
    snprintf(name, sizeof(name), "%s.%s", arch, key);
    enum status st = io_gguf_get_f32(g, name, out, err);
    if (!st && !(isfinite(*out) && *out > 0))
        return err_set(err, ST_ERR_FORMAT, "metadata %s = %g is not a positive number", name,
                       (double)*out);
    return st;
}

/* The architectures: GGUF name and what differs from llama. */
static const struct {
    const char *name;
    int arch;
} g_archs[] = {
    {"llama", ENGINE_ARCH_LLAMA},    {"qwen2", ENGINE_ARCH_QWEN2},    {"qwen3", ENGINE_ARCH_QWEN3},
    {"gemma2", ENGINE_ARCH_GEMMA2},  {"gemma3", ENGINE_ARCH_GEMMA3},  {"phi3", ENGINE_ARCH_PHI3},
    {"qwen3moe", ENGINE_ARCH_QWEN3}, {"qwen2moe", ENGINE_ARCH_QWEN2},
};
#define ENGINE_ARCH_NAMES "llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma2, gemma3, phi3"

/* 1 when g has the metadata key "<arch>.<key>". */
static int has_key(const struct io_gguf *g, const char *arch, const char *key)
{
    char name[128];
    snprintf(name, sizeof(name), "%s.%s", arch, key);
    return io_gguf_find_kv(g, name) != NULL;
}

/* RoPE scaling: none, or linear (positions / factor); anything else is refused by name. */
static enum status read_rope_scaling(const struct io_gguf *g, const char *arch,
                                     struct engine_hparams *hp, struct err_detail *err)
{
    char name[128];
    struct io_gguf_str sc;
    hp->rope_scale = 1.0f;
    snprintf(name, sizeof(name), "%s.rope.scaling.type", arch);
    if (io_gguf_get_str(g, name, &sc, NULL) != ST_OK || io_gguf_str_eq(sc, "none"))
        return ST_OK;
    if (!io_gguf_str_eq(sc, "linear"))
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "RoPE scaling '%.*s' is not supported (none, linear)",
                       (int)(sc.len > 20 ? 20 : sc.len), sc.ptr);
    float factor;
    enum status st = get_f32(g, arch, "rope.scaling.factor", &factor, err);
    if (st)
        return st;
    hp->rope_scale = 1.0f / factor;
    return ST_OK;
}

/* A mixture of experts (expert_count): how many each token runs, each expert's FFN rows
 * (expert_feed_forward_length where given: Qwen3-MoE, Qwen2-MoE; else feed_forward_length:
 * Mixtral), and Qwen2-MoE's shared expert (expert_shared_feed_forward_length, else
 * feed_forward_length, as llama.cpp reads it). Softmax routing, as llama.cpp runs these
 * architectures: the chosen weights renormalized (llama, qwen3moe) or not (qwen2moe); a file that
 * declares other routing (more shared experts, another gating function, expert groups, a scale
 * of the weights) is refused by its key. */
static enum status read_experts(const struct io_gguf *g, const char *arch,
                                struct engine_hparams *hp, struct err_detail *err)
{
    enum status st;
    hp->n_expert = hp->n_expert_used = hp->n_ff_shexp = 0;
    hp->expert_norm = 1;
    char name[128];
    uint32_t count;
    snprintf(name, sizeof(name), "%s.expert_count", arch);
    if (!io_gguf_find_kv(g, name)) /* (0, as llama.cpp takes it, is a dense model too) */
        return ST_OK;
    if ((st = io_gguf_get_u32(g, name, &count, err)) || !count)
        return st;
    if ((st = get_hparam(g, arch, "expert_count", &hp->n_expert, 1, 0, err)))
        return st;
    const int qwen2moe = !strcmp(arch, "qwen2moe");
    if (hp->arch != ENGINE_ARCH_LLAMA && strcmp(arch, "qwen3moe") && !qwen2moe)
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "%s: experts are not supported in this architecture (llama, qwen2moe, "
                       "qwen3moe)",
                       arch);
    /* what routes otherwise: the key, and the one value that means this routing (Qwen2-MoE's one
     * shared expert) */
    const struct {
        const char *key;
        uint32_t ok;
    } other[] = {{"expert_shared_count", (uint32_t)qwen2moe},
                 {"expert_gating_func", 1},
                 {"expert_group_count", 1}};
    for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++) {
        uint32_t v;
        snprintf(name, sizeof(name), "%s.%s", arch, other[i].key);
        if (io_gguf_find_kv(g, name) && (io_gguf_get_u32(g, name, &v, NULL) || v != other[i].ok))
            return err_set(err, ST_ERR_UNSUPPORTED,
                           "%s: this routing is not supported (softmax over the experts%s)", name,
                           qwen2moe ? ", one shared expert" : ", the chosen ones renormalized");
    }
    if (qwen2moe) {
        hp->expert_norm = 0;
        if ((st = get_hparam(g, arch, "expert_shared_feed_forward_length", &hp->n_ff_shexp, 0,
                             hp->n_ff, err)))
            return st;
    }
    /* each expert's width: expert_feed_forward_length, else (llama.cpp's default) Qwen's MoE
     * the FFN's width over the experts a token runs, Mixtral's the FFN's */
    if ((st = get_hparam(g, arch, "expert_used_count", &hp->n_expert_used, 1, 0, err)) ||
        (st = get_hparam(g, arch, "expert_feed_forward_length", &hp->n_ff, 0,
                         hp->arch == ENGINE_ARCH_LLAMA ? hp->n_ff : hp->n_ff / hp->n_expert_used,
                         err)))
        return st;
    if (hp->n_ff < 1)
        return err_set(err, ST_ERR_FORMAT, "%s: experts of %d rows", arch, hp->n_ff);
    if (hp->n_expert > ENGINE_MAX_EXPERTS || hp->n_expert_used > hp->n_expert)
        return err_set(err, ST_ERR_UNSUPPORTED, "%d experts, %d used: at most %d, used <= count",
                       hp->n_expert, hp->n_expert_used, ENGINE_MAX_EXPERTS);
    /* llama.cpp reads no scale of the weights for these architectures: a file declaring one
     * (other than 1) is another model */
    float scale;
    snprintf(name, sizeof(name), "%s.expert_weights_scale", arch);
    if (io_gguf_find_kv(g, name) &&
        (io_gguf_get_f32(g, name, &scale, NULL) || (scale != 0.0f && scale != 1.0f)))
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "%s: a scale of the experts' weights is not part of %s (llama.cpp reads "
                       "none)",
                       name, arch);
    return ST_OK;
}

static enum status read_hparams(const struct io_gguf *g, struct engine_hparams *hp,
                                struct err_detail *err)
{
    struct io_gguf_str arch_s;
    enum status st = io_gguf_get_str(g, "general.architecture", &arch_s, err);
    if (st)
        return st;
    const char *arch = NULL;
    for (size_t i = 0; i < sizeof(g_archs) / sizeof(g_archs[0]); i++)
        if (io_gguf_str_eq(arch_s, g_archs[i].name)) {
            arch = g_archs[i].name;
            hp->arch = g_archs[i].arch;
        }
    if (!arch)
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "architecture '%.*s' is not supported (" ENGINE_ARCH_NAMES ")",
                       (int)(arch_s.len > 40 ? 40 : arch_s.len), arch_s.ptr);
    if ((st = get_hparam(g, arch, "embedding_length", &hp->n_embd, 1, 0, err)) ||
        (st = get_hparam(g, arch, "block_count", &hp->n_layer, 1, 0, err)) ||
        (st = get_hparam(g, arch, "feed_forward_length", &hp->n_ff, 1, 0, err)) ||
        (st = get_hparam(g, arch, "attention.head_count", &hp->n_head, 1, 0, err)) ||
        (st = get_hparam(g, arch, "context_length", &hp->n_ctx_train, 1, 0, err)) ||
        (st = get_f32(g, arch, "attention.layer_norm_rms_epsilon", &hp->rms_eps, err)))
        return st;
    if ((st = get_hparam(g, arch, "attention.head_count_kv", &hp->n_kv_head, 0, hp->n_head, err)))
        return st;
    if ((st = read_experts(g, arch, hp, err)))
        return st;
    if (hp->n_head % hp->n_kv_head)
        return err_set(err, ST_ERR_FORMAT, "heads do not divide: n_head %d, n_kv_head %d",
                       hp->n_head, hp->n_kv_head);
    /* head_dim: attention.key_length where given (Qwen3, Gemma 3: not n_embd / n_head) */
    if (has_key(g, arch, "attention.key_length")) {
        int vl;
        if ((st = get_hparam(g, arch, "attention.key_length", &hp->head_dim, 1, 0, err)) ||
            (st = get_hparam(g, arch, "attention.value_length", &vl, 0, hp->head_dim, err)))
            return st;
        if (vl != hp->head_dim)
            return err_set(err, ST_ERR_UNSUPPORTED, "key length %d != value length %d",
                           hp->head_dim, vl);
    } else {
        if (hp->n_embd % hp->n_head)
            return err_set(err, ST_ERR_FORMAT, "heads do not divide: n_embd %d, n_head %d",
                           hp->n_embd, hp->n_head);
        hp->head_dim = hp->n_embd / hp->n_head;
    }
    if (hp->head_dim > KERN_MAX_HEAD_DIM || hp->head_dim % 2)
        return err_set(err, ST_ERR_UNSUPPORTED, "head_dim %d unsupported (even, <= %d)",
                       hp->head_dim, KERN_MAX_HEAD_DIM);
    if ((st = get_hparam(g, arch, "rope.dimension_count", &hp->rope_dim, 0, hp->head_dim, err)))
        return st;
    if (hp->rope_dim > hp->head_dim || hp->rope_dim % 2)
        return err_set(err, ST_ERR_FORMAT, "rope.dimension_count %d invalid for head_dim %d",
                       hp->rope_dim, hp->head_dim);
    hp->rope_theta = 10000.0f;
    if (has_key(g, arch, "rope.freq_base") &&
        (st = get_f32(g, arch, "rope.freq_base", &hp->rope_theta, err)))
        return st;
    if ((st = read_rope_scaling(g, arch, hp, err)))
        return st;
    /* soft-capping wherever the GGUF says so (Gemma 2 does) */
    hp->attn_softcap = hp->final_softcap = 0.0f;
    if ((has_key(g, arch, "attn_logit_softcapping") &&
         (st = get_f32(g, arch, "attn_logit_softcapping", &hp->attn_softcap, err))) ||
        (has_key(g, arch, "final_logit_softcapping") &&
         (st = get_f32(g, arch, "final_logit_softcapping", &hp->final_softcap, err))))
        return st;
    /* what the architectures do differently (as llama.cpp runs them) */
    const int gemma = hp->arch == ENGINE_ARCH_GEMMA2 || hp->arch == ENGINE_ARCH_GEMMA3;
    hp->rope_neox = hp->arch != ENGINE_ARCH_LLAMA;
    hp->glu = gemma ? KERN_GLU_GELU : KERN_GLU_SILU;
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    hp->emb_scale = 0.0f;
    hp->swa_window = 0;
    hp->swa_pattern = 1;
    hp->rope_theta_swa = hp->rope_theta;
    hp->rope_orig_ctx = 0;
    hp->rope_mscale = 1.0f;
    if (hp->arch == ENGINE_ARCH_PHI3) {
        /* LongRoPE (Phi-3/3.5's 128k models): per-pair factors for short and for long contexts
         * (engine_model_rope_variant picks per sequence) and an attention factor. The sliding
         * window Phi-3 mini's GGUF may declare is not applied, as llama.cpp does not (Hugging
         * Face does: past it, outputs differ from HF's) */
        if (io_gguf_find_tensor(g, "rope_factors_long.weight") ||
            io_gguf_find_tensor(g, "rope_factors_short.weight")) {
            if ((st = get_hparam(g, arch, "rope.scaling.original_context_length",
                                 &hp->rope_orig_ctx, 1, 0, err)))
                return st;
            if (hp->rope_orig_ctx < 2)
                return err_set(err, ST_ERR_FORMAT, "phi3: rope.scaling.original_context_length %d",
                               hp->rope_orig_ctx);
            const double f = (double)hp->n_ctx_train / hp->rope_orig_ctx;
            hp->rope_mscale = f > 1.0 ? (float)sqrt(1.0 + log(f) / log(hp->rope_orig_ctx)) : 1.0f;
            if (has_key(g, arch, "rope.scaling.attn_factor") &&
                (st = get_f32(g, arch, "rope.scaling.attn_factor", &hp->rope_mscale, err)))
                return st;
        }
        int window;
        if ((st = get_hparam(g, arch, "attention.sliding_window", &window, 0, 0, err)))
            return st;
        if (window && window < hp->n_ctx_train)
            LOG_WARN("phi3: attention.sliding_window %d is not applied (as llama.cpp); past %d "
                     "tokens outputs differ from Hugging Face's",
                     window, window);
    }
    if (gemma) {
        hp->emb_scale = sqrtf((float)hp->n_embd);
        /* Gemma 2 and 3 27B scale by 1/sqrt(n_embd / n_head), the others by 1/sqrt(head_dim)
         * (query_pre_attn_scalar; the GGUF does not carry it) */
        if (hp->n_layer == (hp->arch == ENGINE_ARCH_GEMMA2 ? 46 : 62))
            hp->attn_scale = 1.0f / sqrtf((float)(hp->n_embd / hp->n_head));
        /* Gemma 2: every other layer sliding (even ones), all with rope.freq_base */
        const int pattern = hp->arch == ENGINE_ARCH_GEMMA2 ? 2 : 6;
        if ((st = get_hparam(g, arch, "attention.sliding_window", &hp->swa_window, 1, 0, err)) ||
            (st = get_hparam(g, arch, "attention.sliding_window_pattern", &hp->swa_pattern, 0,
                             pattern, err)))
            return st;
        if (hp->arch == ENGINE_ARCH_GEMMA2)
            return ST_OK;
        hp->rope_theta_swa = 10000.0f; /* the local layers' base (rope_local_base_freq) */
        if (has_key(g, arch, "rope.freq_base_swa") &&
            (st = get_f32(g, arch, "rope.freq_base_swa", &hp->rope_theta_swa, err)))
            return st;
    }
    return ST_OK;
}

const struct kern_tensor *engine_model_untied_embedding(const struct engine_model *m)
{
    return m->tied_output ? NULL : &m->tok_embd;
}

int engine_model_weights(const struct engine_model *m, int layer, const struct kern_tensor **out)
{
    if (layer == m->hp.n_layer) {
        out[0] = &m->output;
        return 1;
    }
    const struct engine_layer *L = &m->layers[layer];
    if (L->experts) {
        const struct kern_tensor *w[] = {&L->wq, &L->wk,     &L->wv,
                                         &L->wo, &L->router, &L->shexp_gate};
        memcpy(out, w, sizeof(w));
        return L->shexp_gate.data ? 6 : 5;
    }
    const struct kern_tensor *w[] = {&L->wq,     &L->wk,   &L->wv,    &L->wo,
                                     &L->w_gate, &L->w_up, &L->w_down};
    memcpy(out, w, sizeof(w));
    return (int)(sizeof(w) / sizeof(w[0]));
}

const struct kern_tensor *engine_model_experts(const struct engine_model *m, int layer)
{
    return layer < m->hp.n_layer ? m->layers[layer].experts : NULL;
}

enum status engine_model_check_finite(const struct io_gguf *g, struct err_detail *err)
{
    for (uint64_t k = 0; k < g->n_tensors; k++) {
        const struct io_gguf_tensor *t = &g->tensors[k];
        const int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        const int64_t i = dtype_first_nonfinite(t->type, t->data, n);
        if (i >= 0)
            return err_set(err, ST_ERR_FORMAT,
                           "tensor '%s' holds a NaN or an infinity (row %lld, element %lld): the "
                           "model file is damaged (fetch it again, or check its checksum)",
                           t->name, (long long)(i / t->ne[0]), (long long)(i % t->ne[0]));
    }
    return ST_OK;
}

static enum status load_matrix(const struct io_gguf *g, const char *name, int64_t in, int64_t out,
                               struct kern_tensor *t, struct err_detail *err);

/* Rows [row0, row0 + n) of the [in, out] matrix name as a matrix of its own (a view: Phi-3's
 * Q, K and V in attn_qkv, gate and up in ffn_up). */
static enum status load_rows(const struct io_gguf *g, const char *name, int64_t in, int64_t out,
                             int64_t row0, int64_t n, struct kern_tensor *t, struct err_detail *err)
{
    enum status st = load_matrix(g, name, in, out, t, err);
    if (st)
        return st;
    t->ne1 = n;
    t->data = (const char *)t->data + (size_t)row0 * t->row_bytes;
    return ST_OK;
}

static enum status load_matrix(const struct io_gguf *g, const char *name, int64_t in, int64_t out,
                               struct kern_tensor *t, struct err_detail *err)
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

/* A layer's vectors beyond llama's, as its architecture has them: Q/K/V biases (qwen2), QK-norm
 * (qwen3, gemma3), post-norms (gemma3); any other's presence is refused (a llama file with
 * biases is not run without them). */
static enum status load_extras(const struct io_gguf *g, const struct engine_hparams *hp, int l,
                               struct engine_layer *L, struct err_detail *err)
{
    const int a = hp->arch;
    const int64_t qd = (int64_t)hp->n_head * hp->head_dim,
                  kvd = (int64_t)hp->n_kv_head * hp->head_dim;
    const struct {
        const char *name;
        int want;        /* the architecture has it */
        int64_t n;       /* floats */
        const float **v; /* where it goes */
    } ex[] = {
        {"attn_q.bias", a == ENGINE_ARCH_QWEN2, qd, &L->bq},
        {"attn_k.bias", a == ENGINE_ARCH_QWEN2, kvd, &L->bk},
        {"attn_v.bias", a == ENGINE_ARCH_QWEN2, kvd, &L->bv},
        {"attn_q_norm.weight", a == ENGINE_ARCH_QWEN3 || a == ENGINE_ARCH_GEMMA3, hp->head_dim,
         &L->q_norm},
        {"attn_k_norm.weight", a == ENGINE_ARCH_QWEN3 || a == ENGINE_ARCH_GEMMA3, hp->head_dim,
         &L->k_norm},
        {"post_attention_norm.weight", a == ENGINE_ARCH_GEMMA3 || a == ENGINE_ARCH_GEMMA2,
         hp->n_embd, &L->post_attn_norm},
        {"post_ffw_norm.weight", a == ENGINE_ARCH_GEMMA3 || a == ENGINE_ARCH_GEMMA2, hp->n_embd,
         &L->post_ffn_norm},
        {"attn_output.bias", 0, 0, NULL},
    };
    for (size_t i = 0; i < sizeof(ex) / sizeof(ex[0]); i++) {
        char name[96];
        snprintf(name, sizeof(name), "blk.%d.%s", l, ex[i].name);
        if (!ex[i].want) {
            if (io_gguf_find_tensor(g, name))
                return err_set(err, ST_ERR_UNSUPPORTED,
                               "tensor '%s' is not part of the architecture as supported", name);
            continue;
        }
        enum status st = load_vector(g, name, ex[i].n, ex[i].v, err);
        if (st)
            return st;
    }
    L->swa = hp->swa_window > 0 && l % hp->swa_pattern != hp->swa_pattern - 1;
    return ST_OK;
}

/* A mixture-of-experts layer's router and experts: expert e's matrix of the 3-D tensor name
 * ([in, out, n_expert]) as a view, to experts[3e + which]. */
static enum status load_experts(const struct io_gguf *g, const struct engine_hparams *hp, int l,
                                struct engine_layer *L, struct err_detail *err)
{
    const int64_t E = hp->n_embd, F = hp->n_ff;
    static const char *const names[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    char name[96];
    snprintf(name, sizeof(name), "blk.%d.ffn_gate_inp.weight", l);
    enum status st = load_matrix(g, name, E, hp->n_expert, &L->router, err);
    if (st)
        return st;
    if (!(L->experts = calloc(3 * (size_t)engine_hp_n_ffns(hp), sizeof(*L->experts))))
        return err_set(err, ST_ERR_NOMEM, "no memory");
    if (hp->n_ff_shexp) { /* the shared expert: its gate (a vector: one row), its FFN */
        static const char *const sh[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
        const int64_t S = hp->n_ff_shexp;
        struct kern_tensor *X = &L->experts[3 * hp->n_expert];
        snprintf(name, sizeof(name), "blk.%d.ffn_gate_inp_shexp.weight", l);
        const float *v;
        if ((st = load_vector(g, name, E, &v, err)))
            return st;
        L->shexp_gate = (struct kern_tensor){.type = DTYPE_F32,
                                             .ne0 = E,
                                             .ne1 = 1,
                                             .row_bytes = dtype_row_bytes(DTYPE_F32, E),
                                             .data = v};
        for (int w = 0; w < 3; w++) {
            snprintf(name, sizeof(name), "blk.%d.%s.weight", l, sh[w]);
            if ((st = load_matrix(g, name, w == 2 ? S : E, w == 2 ? E : S, &X[w], err)))
                return st;
        }
    }
    for (int w = 0; w < 3; w++) {
        const int64_t in = w == 2 ? F : E, out = w == 2 ? E : F;
        snprintf(name, sizeof(name), "blk.%d.%s.weight", l, names[w]);
        const struct io_gguf_tensor *gt = io_gguf_find_tensor(g, name);
        if (!gt)
            return err_set(err, ST_ERR_NOT_FOUND,
                           "tensor '%s' is missing (a GGUF with one tensor per expert, from "
                           "before llama.cpp merged them, must be converted again)",
                           name);
        if (gt->n_dims != 3 || gt->ne[0] != in || gt->ne[1] != out || gt->ne[2] != hp->n_expert)
            return err_set(err, ST_ERR_FORMAT,
                           "tensor '%s' has shape [%lld, %lld, %lld], want [%lld, %lld, %d]", name,
                           (long long)gt->ne[0], (long long)gt->ne[1], (long long)gt->ne[2],
                           (long long)in, (long long)out, hp->n_expert);
        if (gt->type != DTYPE_F32 && gt->type != DTYPE_F16 && gt->type != DTYPE_BF16 && in % 32)
            return err_set(err, ST_ERR_UNSUPPORTED,
                           "tensor '%s': row length %lld not a multiple of 32", name,
                           (long long)in);
        for (int e = 0; e < hp->n_expert; e++) {
            struct kern_tensor *t = &L->experts[3 * e + w];
            t->type = gt->type;
            t->ne0 = in;
            t->ne1 = out;
            t->row_bytes = dtype_row_bytes(gt->type, in);
            t->data = (const char *)gt->data + (size_t)e * (size_t)out * t->row_bytes;
        }
    }
    return ST_OK;
}

enum status engine_model_load_weights(struct engine_model **out, struct io_gguf *g,
                                      struct err_detail *err)
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
    const int64_t q_dim = (int64_t)hp->n_head * hp->head_dim,
                  kv_dim = (int64_t)hp->n_kv_head * hp->head_dim;
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
    if (io_gguf_find_tensor(g, "rope_freqs.weight") &&
        (st = load_vector(g, "rope_freqs.weight", hp->rope_dim / 2, &m->rope_freqs, err)))
        goto fail;
    if (hp->rope_orig_ctx &&
        ((st = load_vector(g, "rope_factors_long.weight", hp->rope_dim / 2, &m->rope_long, err)) ||
         (st = load_vector(g, "rope_factors_short.weight", hp->rope_dim / 2, &m->rope_short, err))))
        goto fail;
    for (int i = 0; hp->rope_orig_ctx && i < hp->rope_dim / 2; i++)
        if (!(isfinite(m->rope_long[i]) && m->rope_long[i] > 0 && isfinite(m->rope_short[i]) &&
              m->rope_short[i] > 0)) {
            st =
                err_set(err, ST_ERR_FORMAT, "phi3: LongRoPE factor %d is not a positive number", i);
            goto fail;
        }
    m->n_rope = hp->swa_window && hp->rope_theta_swa != hp->rope_theta ? 2 : 1;
    for (int l = 0; l < hp->n_layer; l++) {
        struct engine_layer *L = &m->layers[l];
        char n[9][64];
        static const char *const names[9] = {"attn_norm", "attn_q",      "attn_k",
                                             "attn_v",    "attn_output", "ffn_norm",
                                             "ffn_gate",  "ffn_up",      "ffn_down"};
        for (int i = 0; i < 9; i++)
            snprintf(n[i], sizeof(n[i]), "blk.%d.%s.weight", l, names[i]);
        if ((st = load_extras(g, hp, l, L, err)))
            goto fail;
        /* Phi-3: [Q; K; V] in one matrix and [gate; up] in another where the file has them so
         * (as converted from Hugging Face), else separate as llama's */
        char qkv[64];
        snprintf(qkv, sizeof(qkv), "blk.%d.attn_qkv.weight", l);
        const int fused_qkv = hp->arch == ENGINE_ARCH_PHI3 && io_gguf_find_tensor(g, qkv),
                  fused_up = hp->arch == ENGINE_ARCH_PHI3 && !io_gguf_find_tensor(g, n[6]);
        const int64_t E = hp->n_embd, all = q_dim + 2 * kv_dim, F = hp->n_ff;
        if (fused_qkv && ((st = load_rows(g, qkv, E, all, 0, q_dim, &L->wq, err)) ||
                          (st = load_rows(g, qkv, E, all, q_dim, kv_dim, &L->wk, err)) ||
                          (st = load_rows(g, qkv, E, all, q_dim + kv_dim, kv_dim, &L->wv, err))))
            goto fail;
        if (fused_up && ((st = load_rows(g, n[7], E, 2 * F, 0, F, &L->w_gate, err)) ||
                         (st = load_rows(g, n[7], E, 2 * F, F, F, &L->w_up, err))))
            goto fail;
        const int dense = !hp->n_expert;
        if ((st = load_vector(g, n[0], E, &L->attn_norm, err)) ||
            (!fused_qkv && ((st = load_matrix(g, n[1], E, q_dim, &L->wq, err)) ||
                            (st = load_matrix(g, n[2], E, kv_dim, &L->wk, err)) ||
                            (st = load_matrix(g, n[3], E, kv_dim, &L->wv, err)))) ||
            (st = load_matrix(g, n[4], q_dim, E, &L->wo, err)) ||
            (st = load_vector(g, n[5], E, &L->ffn_norm, err)) ||
            (dense && !fused_up &&
             ((st = load_matrix(g, n[6], E, F, &L->w_gate, err)) ||
              (st = load_matrix(g, n[7], E, F, &L->w_up, err)))) ||
            (dense && (st = load_matrix(g, n[8], F, E, &L->w_down, err))) ||
            (!dense && (st = load_experts(g, hp, l, L, err))))
            goto fail;
    }
    m->gguf = g;
    *out = m;
    return ST_OK;
fail:
    engine_model_free(m);
    return st;
}
