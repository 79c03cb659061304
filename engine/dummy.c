/* Dummy models: the preset table, the GGUF layout they get (the same tensor names and metadata a
 * converted file of the preset's architecture has, so the loader treats them like any file), and
 * the random fill. Each
 * tensor's bytes come from its own splitmix64 stream keyed by (seed, tensor index): a dummy
 * model's weights are a function of the preset, the layer count and the seed. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/dtype.h"
#include "engine/dummy.h"
#include "io/gguf.h"
#include "io/gguf_write.h"

struct preset {
    const char *name;   /* --dummy NAME */
    int n_embd;         /* hidden size */
    int n_layer;        /* blocks */
    int n_head;         /* query heads */
    int n_kv_head;      /* KV heads */
    int n_ff;           /* FFN hidden size */
    int n_vocab;        /* vocabulary (rows of the embedding and output head) */
    int n_ctx;          /* training context */
    float rope_theta;   /* RoPE base */
    float rms_eps;      /* RMSNorm epsilon */
    int tied;           /* 1: the output head is the embedding */
    const char *arch;   /* GGUF general.architecture */
    int head_dim;       /* 0: n_embd / n_head; else attention.key_length */
    int swa;            /* gemma2/3: attention.sliding_window */
    int orig_ctx;       /* phi3 LongRoPE: rope.scaling.original_context_length; 0: none */
    int n_expert;       /* a mixture of experts: experts per layer; 0: dense */
    int n_expert_used;  /* ... experts a token runs */
    int n_ff_exp;       /* ... each expert's width when it is not n_ff (Qwen3-MoE) */
    int n_ff_shexp;     /* ... a shared expert's width (Qwen2-MoE); 0: none */
};

/* Dimensions and architectures as the models' published configs give them, each with its
 * family's extra tensors (Llama 3's rope_freqs, Qwen's q/k/v biases, QK-norms, Gemma's
 * post-norms): the matrices, heads and vocabulary, which set the cost, are the real ones. */
static const struct preset presets[] = {
    {"smollm2-135m", 576, 30, 9, 3, 1536, 49152, 8192, 100000.0f, 1e-5f, 1, "llama", 0, 0, 0, 0, 0,
     0, 0},
    {"llama3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0f, 1e-5f, 0, "llama", 0, 0, 0, 0, 0,
     0, 0},
    {"llama3-70b", 8192, 80, 64, 8, 28672, 128256, 8192, 500000.0f, 1e-5f, 0, "llama", 0, 0, 0, 0,
     0, 0, 0},
    {"qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0f, 1e-6f, 0, "qwen2", 0, 0, 0, 0,
     0, 0, 0},
    {"qwen3-8b", 4096, 36, 32, 8, 12288, 151936, 40960, 1000000.0f, 1e-6f, 0, "qwen3", 128, 0, 0, 0,
     0, 0, 0},
    {"gemma3-27b", 5376, 62, 32, 16, 21504, 262208, 131072, 1000000.0f, 1e-6f, 1, "gemma3", 128,
     1024, 0, 0, 0, 0, 0},
    {"gemma2-9b", 3584, 42, 16, 8, 14336, 256000, 8192, 10000.0f, 1e-6f, 1, "gemma2", 256, 4096, 0,
     0, 0, 0, 0},
    {"phi3-mini", 3072, 32, 32, 32, 8192, 32064, 4096, 10000.0f, 1e-5f, 0, "phi3", 0, 0, 0, 0, 0, 0,
     0},
    {"phi3.5-mini", 3072, 32, 32, 32, 8192, 32064, 131072, 10000.0f, 1e-5f, 0, "phi3", 0, 0, 4096,
     0, 0, 0, 0},
    {"qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, 40960, 1000000.0f, 1e-6f, 0, "qwen3moe", 128,
     0, 0, 128, 8, 768, 0},
    {"mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, 32768, 1000000.0f, 1e-5f, 0, "llama", 0, 0, 0,
     8, 2, 0, 0},
    {"qwen1.5-moe-a2.7b", 2048, 24, 16, 16, 5632, 151936, 8192, 1000000.0f, 1e-6f, 0, "qwen2moe", 0,
     0, 0, 60, 4, 1408, 5632},
};
#define N_PRESETS (sizeof(presets) / sizeof(presets[0]))

/* The table's names joined by "|" (built once: the table is the only list of presets). */
static char preset_names[256];

static void join_names(void)
{
    size_t k = 0;
    for (size_t i = 0; i < N_PRESETS; i++)
        k += (size_t)snprintf(preset_names + k, sizeof(preset_names) - k, "%s%s", i ? "|" : "",
                              presets[i].name);
}

const char *engine_dummy_names(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, join_names);
    return preset_names;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* IEEE half of a positive normal float in half's range (round to nearest even). */
static uint16_t half_of(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t r = x + 0xFFFu + ((x >> 13) & 1);
    return (uint16_t)((r - (112u << 23)) >> 13);
}

/* rows Q4_0 rows of ne0 weights: random nibbles, and per block a scale d of random sign and
 * size around 1 / (4.6 sqrt(ne0)) (uniform nibbles minus 8 have a standard deviation of 4.6), so a row's dot
 * product with unit-variance inputs has about unit variance and activations stay in range. */
static void fill_q4_0(uint8_t *p, int64_t ne0, int64_t rows, uint64_t key)
{
    const float base = 1.0f / (4.61f * sqrtf((float)ne0));
    const int64_t nb = rows * (ne0 / 32);
    for (int64_t b = 0; b < nb; b++, p += 18) {
        uint64_t s = key ^ (uint64_t)b * 0xD1B54A32D192ED03ull;
        const uint64_t r0 = splitmix(&s), r1 = splitmix(&s), r2 = splitmix(&s);
        /* a random sign: Q4_0's values -8..7 have mean -1/2, which would give every row the
         * same bias and every token nearly the same logits */
        const uint16_t d = (uint16_t)(half_of(base * (0.5f + (float)(r0 >> 40) * 0x1p-24f)) |
                                      (r0 & 1) << 15);
        memcpy(p, &d, 2);
        memcpy(p + 2, &r1, 8);
        memcpy(p + 10, &r2, 8);
    }
}

/* n norm weights (or RoPE frequency factors) around 1; biases (offset -1) around 0. */
static void fill_norm(float *p, int64_t n, uint64_t key, float offset)
{
    uint64_t s = key;
    for (int64_t i = 0; i < n; i++)
        p[i] = offset + 0.75f + (float)(splitmix(&s) >> 40) * 0x1p-24f * 0.5f;
}

/* n floats uniform in [-a, a]. */
static void fill_signed(float *p, int64_t n, uint64_t key, float a)
{
    uint64_t s = key;
    for (int64_t i = 0; i < n; i++)
        p[i] = a * ((float)(splitmix(&s) >> 40) * 0x1p-23f - 1.0f);
}

static enum status add_matrix(struct io_gguf_writer *w, const char *name, int64_t ne0,
                              int64_t ne1, struct err_detail *err)
{
    const int64_t ne[2] = {ne0, ne1};
    return io_gguf_writer_tensor(w, name, DTYPE_Q4_0, 2, ne, err);
}

/* Layer l's router and 3-D expert tensors ([in, out, n_expert]), as llama.cpp's converter
 * names them. */
static enum status add_experts(struct io_gguf_writer *w, const struct preset *p, int l,
                               struct err_detail *err)
{
    const int64_t E = p->n_embd, F = p->n_ff_exp ? p->n_ff_exp : p->n_ff, X = p->n_expert;
    const int64_t router[2] = {E, X}, up[3] = {E, F, X}, down[3] = {F, E, X};
    static const char *const names[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    char name[96];
    snprintf(name, sizeof(name), "blk.%d.ffn_gate_inp.weight", l);
    enum status st = io_gguf_writer_tensor(w, name, DTYPE_F32, 2, router, err);
    for (int i = 0; i < 3 && !st; i++) {
        snprintf(name, sizeof(name), "blk.%d.%s.weight", l, names[i]);
        st = io_gguf_writer_tensor(w, name, DTYPE_Q4_0, 3, i == 2 ? down : up, err);
    }
    if (!p->n_ff_shexp || st)
        return st;
    /* the shared expert: its gate (a vector, F32), its FFN */
    static const char *const sh[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
    const int64_t S = p->n_ff_shexp, sh_up[2] = {E, S}, sh_down[2] = {S, E};
    snprintf(name, sizeof(name), "blk.%d.ffn_gate_inp_shexp.weight", l);
    st = io_gguf_writer_tensor(w, name, DTYPE_F32, 1, &E, err);
    for (int i = 0; i < 3 && !st; i++) {
        snprintf(name, sizeof(name), "blk.%d.%s.weight", l, sh[i]);
        st = io_gguf_writer_tensor(w, name, DTYPE_Q4_0, 2, i == 2 ? sh_down : sh_up, err);
    }
    return st;
}

static enum status layout(struct io_gguf_writer *w, const struct preset *p, int n_layer,
                          const struct io_gguf *tok, struct err_detail *err)
{
    enum status st = ST_OK;
    for (uint64_t i = 0; i < tok->n_kv && !st; i++)
        if (tok->kv[i].key.len > 10 && !memcmp(tok->kv[i].key.ptr, "tokenizer.", 10))
            st = io_gguf_writer_copy(w, &tok->kv[i], err);
    const int head_dim = p->head_dim ? p->head_dim : p->n_embd / p->n_head;
    char name[96];
    snprintf(name, sizeof(name), "dummy %s, random Q4_0 weights", p->name);
    const struct {
        const char *key;
        uint32_t v;
    } u32[] = {
        {"embedding_length", (uint32_t)p->n_embd},
        {"block_count", (uint32_t)n_layer},
        {"feed_forward_length", (uint32_t)p->n_ff},
        {"attention.head_count", (uint32_t)p->n_head},
        {"attention.head_count_kv", (uint32_t)p->n_kv_head},
        {"context_length", (uint32_t)p->n_ctx},
        {"rope.dimension_count", (uint32_t)head_dim},
        {"attention.key_length", p->head_dim ? (uint32_t)head_dim : 0},
        {"attention.value_length", p->head_dim ? (uint32_t)head_dim : 0},
        {"attention.sliding_window", (uint32_t)p->swa},
        {"rope.scaling.original_context_length", (uint32_t)p->orig_ctx},
        {"expert_count", (uint32_t)p->n_expert},
        {"expert_used_count", (uint32_t)p->n_expert_used},
        {"expert_feed_forward_length", (uint32_t)p->n_ff_exp},
        {"expert_shared_feed_forward_length", (uint32_t)p->n_ff_shexp},
    };
    if (st || (st = io_gguf_writer_str(w, "general.architecture", p->arch, err)) ||
        (st = io_gguf_writer_str(w, "general.name", name, err)))
        return st;
    for (size_t i = 0; i < sizeof(u32) / sizeof(u32[0]) && !st; i++) {
        snprintf(name, sizeof(name), "%s.%s", p->arch, u32[i].key);
        if (u32[i].v)
            st = io_gguf_writer_u32(w, name, u32[i].v, err);
    }
    snprintf(name, sizeof(name), "%s.rope.freq_base", p->arch);
    if (st || (st = io_gguf_writer_f32(w, name, p->rope_theta, err)))
        return st;
    snprintf(name, sizeof(name), "%s.attention.layer_norm_rms_epsilon", p->arch);
    if ((st = io_gguf_writer_f32(w, name, p->rms_eps, err)))
        return st;
    if (!strcmp(p->arch, "gemma2") && /* its soft-capping */
        ((st = io_gguf_writer_f32(w, "gemma2.attn_logit_softcapping", 50.0f, err)) ||
         (st = io_gguf_writer_f32(w, "gemma2.final_logit_softcapping", 30.0f, err))))
        return st;
    const int64_t E = p->n_embd, Q = (int64_t)p->n_head * head_dim,
                  KV = (int64_t)p->n_kv_head * head_dim, F = p->n_ff, HD = head_dim,
                  HALF = head_dim / 2;
    const int llama3 = !strcmp(p->arch, "llama") && p->rope_theta == 500000.0f;
    if ((st = add_matrix(w, "token_embd.weight", E, p->n_vocab, err)) ||
        (st = io_gguf_writer_tensor(w, "output_norm.weight", DTYPE_F32, 1, &E, err)) ||
        (!p->tied && (st = add_matrix(w, "output.weight", E, p->n_vocab, err))) ||
        (llama3 &&
         (st = io_gguf_writer_tensor(w, "rope_freqs.weight", DTYPE_F32, 1, &HALF, err))) ||
        (p->orig_ctx && /* LongRoPE's factor sets (filled as norms are: all positive) */
         ((st = io_gguf_writer_tensor(w, "rope_factors_long.weight", DTYPE_F32, 1, &HALF, err)) ||
          (st = io_gguf_writer_tensor(w, "rope_factors_short.weight", DTYPE_F32, 1, &HALF, err)))))
        return st;
    /* the family's per-layer vectors: name, length, the architectures (" name " in a list) */
    const struct {
        const char *name;
        const int64_t *n;
        const char *archs;
    } extra[] = {
        {"attn_q.bias", &Q, " qwen2 qwen2moe "},
        {"attn_k.bias", &KV, " qwen2 qwen2moe "},
        {"attn_v.bias", &KV, " qwen2 qwen2moe "},
        {"attn_q_norm.weight", &HD, " qwen3 qwen3moe gemma3 "},
        {"attn_k_norm.weight", &HD, " qwen3 qwen3moe gemma3 "},
        {"post_attention_norm.weight", &E, " gemma3 gemma2 "},
        {"post_ffw_norm.weight", &E, " gemma3 gemma2 "},
    };
    char arch_word[40];
    snprintf(arch_word, sizeof(arch_word), " %s ", p->arch);
    const int phi3 = !strcmp(p->arch, "phi3"); /* [Q; K; V] and [gate; up], each one matrix */
    for (int l = 0; l < n_layer && !st; l++) {
        static const char *const names[9] = {"attn_norm", "attn_q",   "attn_k",
                                             "attn_v",    "attn_output", "ffn_norm",
                                             "ffn_gate",  "ffn_up",   "ffn_down"};
        static const char *const phi3_names[6] = {"attn_norm", "attn_qkv", "attn_output",
                                                  "ffn_norm",  "ffn_up",   "ffn_down"};
        const int64_t in[9] = {E, E, E, E, Q, E, E, E, F}, out[9] = {1, Q, KV, KV, E, 1, F, F, E};
        const int64_t phi3_in[6] = {E, E, Q, E, E, F},
                      phi3_out[6] = {1, Q + 2 * KV, E, 1, 2 * F, E};
        for (int i = 0; phi3 && i < 6 && !st; i++) {
            snprintf(name, sizeof(name), "blk.%d.%s.weight", l, phi3_names[i]);
            st = phi3_out[i] == 1 ? io_gguf_writer_tensor(w, name, DTYPE_F32, 1, &phi3_in[i], err)
                                  : add_matrix(w, name, phi3_in[i], phi3_out[i], err);
        }
        for (int i = 0; !phi3 && i < (p->n_expert ? 6 : 9) && !st; i++) {
            snprintf(name, sizeof(name), "blk.%d.%s.weight", l, names[i]);
            st = out[i] == 1 ? io_gguf_writer_tensor(w, name, DTYPE_F32, 1, &in[i], err)
                             : add_matrix(w, name, in[i], out[i], err);
        }
        if (p->n_expert && !st) /* the router (F32, as llama.cpp keeps it) and the experts */
            st = add_experts(w, p, l, err);
        for (size_t i = 0; i < sizeof(extra) / sizeof(extra[0]) && !st; i++) {
            if (!strstr(extra[i].archs, arch_word))
                continue;
            snprintf(name, sizeof(name), "blk.%d.%s", l, extra[i].name);
            st = io_gguf_writer_tensor(w, name, DTYPE_F32, 1, extra[i].n, err);
        }
    }
    return st;
}

enum status engine_dummy_gguf(struct io_gguf **out, const char *preset, const struct io_gguf *tok,
                              uint64_t seed, int n_layer, int fill, struct err_detail *err)
{
    *out = NULL;
    const struct preset *p = NULL;
    for (size_t i = 0; i < N_PRESETS; i++)
        if (!strcmp(presets[i].name, preset))
            p = &presets[i];
    if (!p)
        return err_set(err, ST_ERR_INVALID_ARG, "unknown dummy preset '%s' (%s)", preset,
                       engine_dummy_names());
    struct io_gguf_writer *w;
    enum status st = io_gguf_writer_init(&w, err);
    if (st)
        return st;
    st = layout(w, p, n_layer > 0 ? n_layer : p->n_layer, tok, err);
    if (!st)
        st = io_gguf_writer_open(w, out, err);
    io_gguf_writer_free(w);
    if (st)
        return st;
    /* (the vectors even without fill: small, and what the loader checks, LongRoPE's factors) */
    for (uint64_t i = 0; i < (*out)->n_tensors; i++) {
        const struct io_gguf_tensor *t = &(*out)->tensors[i];
        uint64_t key = seed * 0x9E3779B97F4A7C15ull + i + 1;
        key = splitmix(&key);
        void *data = (void *)t->data; /* the writer's mapping is writable */
        if (t->type == DTYPE_Q4_0) {
            if (fill)
                fill_q4_0(data, t->ne[0], t->ne[1] * t->ne[2], key);
        } else if (t->ne[1] > 1 || strstr(t->name, "_shexp")) { /* a router (or a shared
                                                                 * expert's gate): logits of
                                                                 * about unit variance */
            if (fill)
                fill_signed(data, t->ne[0] * t->ne[1], key, 1.7f / sqrtf((float)t->ne[0]));
        } else {
            fill_norm(data, t->ne[0], key, strstr(t->name, ".bias") ? -1.0f : 0.0f);
        }
    }
    return ST_OK;
}
