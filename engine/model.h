/* A decoder-only transformer loaded from GGUF (engine/model_load.c lists the architectures), with
 * a batched forward pass: one call computes a flat list of tokens from several sequences (each
 * with its own position and KV block table) and returns logits only where asked. */
#ifndef ENGINE_MODEL_H
#define ENGINE_MODEL_H

#include <stdint.h>

#include "common/err.h"
#include "engine/kv.h"
#include "io/gguf.h"
#include "kernels/kernels.h"

/* The architectures engine_model_load reads (GGUF general.architecture). */
enum engine_arch {
    ENGINE_ARCH_LLAMA = 0,  /* "llama": Llama 2/3, SmolLM2, Mistral-style */
    ENGINE_ARCH_QWEN2 = 1,  /* "qwen2": Q/K/V biases, NEOX RoPE ("qwen2moe": with experts) */
    ENGINE_ARCH_QWEN3 = 2,  /* "qwen3": QK-norm, NEOX RoPE ("qwen3moe": the same with experts) */
    ENGINE_ARCH_GEMMA3 = 3, /* "gemma3": scaled embedding, QK-norm, pre- and post-norms, GeGLU,
                             * sliding-window layers with their own RoPE base */
    ENGINE_ARCH_GEMMA2 = 4, /* "gemma2": as gemma3 without QK-norm, every other layer sliding
                             * (one RoPE base), attention and output logits soft-capped */
    ENGINE_ARCH_PHI3 = 5,   /* "phi3": Q, K, V in one matrix, gate and up in one; NEOX RoPE */
};

struct engine_hparams {
    int n_vocab;      /* vocabulary size (rows of the output head) */
    int n_ctx_train;  /* context length the model was trained for */
    int n_embd;       /* hidden size */
    int n_layer;      /* transformer blocks */
    int n_head;       /* query heads */
    int n_kv_head;    /* key/value heads */
    int head_dim;     /* n_embd / n_head */
    int n_ff;         /* FFN hidden size (of each expert in a mixture of experts) */
    int rope_dim;     /* channels rotated by RoPE per head */
    float rope_theta; /* RoPE base frequency */
    float rms_eps;    /* RMSNorm epsilon */
    int arch;         /* enum engine_arch */
    int rope_neox;    /* 1: RoPE rotates pairs (i, i + rope_dim / 2), else (2i, 2i + 1) */
    float rope_scale; /* positions times this in the (global layers') RoPE angles: linear
                       * scaling 1 / factor, else 1 */
    int glu;          /* enum kern_glu: the FFN's gated activation */
    float attn_scale; /* attention scores times this (1/sqrt(head_dim) unless the model says) */
    float emb_scale;  /* token embeddings times this (Gemma: sqrt(n_embd)), 0: not scaled */
    int swa_window;   /* sliding-window layers attend to this many last positions; 0: none */
    int swa_pattern;  /* with swa_window: layer l is global when l % swa_pattern ==
                       * swa_pattern - 1, else sliding */
    float rope_theta_swa; /* the sliding layers' RoPE base */
    float attn_softcap;   /* attention scores s -> cap * tanh(s / cap); 0: none */
    int rope_orig_ctx;    /* LongRoPE (Phi-3's 128k models): the context the short factors are
                           * for (rope.scaling.original_context_length); 0: no LongRoPE */
    float rope_mscale;    /* LongRoPE: cos and sin times this (rope.scaling.attn_factor, else
                           * sqrt(1 + ln(n_ctx_train / orig) / ln(orig)), as Hugging Face) */
    float final_softcap;  /* output logits likewise (the argmax is unchanged); 0: none */
    int n_expert;         /* mixture of experts (Mixtral, Qwen3-MoE): experts per layer, each an
                           * FFN of n_ff rows; 0: one dense FFN */
    int n_expert_used;    /* ... experts each token runs: the router's top ones, weighted by
                           * their softmax over all experts, */
    int expert_norm;      /* ... renormalized over the chosen ones (1: Mixtral, Qwen3-MoE) or
                           * not (0: Qwen2-MoE) */
    int n_ff_shexp;       /* ... a shared expert's FFN rows (Qwen2-MoE): every token runs it
                           * too, weighted by the sigmoid of its gate's dot product; 0: none */
};

/* A mixture of experts' FFNs per layer: its experts, and the shared one where it has one
 * (engine_model_experts lists 3 matrices of each, the shared one's last); 0 when dense. */
static inline int engine_hp_n_ffns(const struct engine_hparams *hp)
{
    return hp->n_expert + (hp->n_ff_shexp > 0);
}

/* The widest FFN a layer runs: its FFN (an expert's), or a shared expert's where wider. */
static inline int engine_hp_ffn_width(const struct engine_hparams *hp)
{
    return hp->n_ff_shexp > hp->n_ff ? hp->n_ff_shexp : hp->n_ff;
}

struct engine_model; /* opaque: engine/model_internal.h */

/* One forward step over a flat batch. Tokens of one sequence must appear in position order;
 * a sequence's positions 0..pos-1 must already be in the KV cache or earlier in the batch. */
struct engine_batch {
    int n_tok;               /* tokens */
    const int32_t *token;    /* token ids */
    const int32_t *pos;      /* position of each token in its sequence */
    const int32_t *seq;      /* KV sequence slot of each token */
    const uint8_t *logits;   /* 1 where logits are wanted; NULL = last token only */
};

/* The KV variant (engine_kv_set_variant) of a sequence whose forwards hold at most max_len
 * positions: with LongRoPE, 1 (the long factors) when max_len passes the original context, else
 * 0 (as Hugging Face and vLLM rotate any forward that stays within it); 0 for every other
 * model. */
int engine_model_rope_variant(const struct engine_model *m, int64_t max_len);

/* Load the model at path onto backend be (borrowed; must outlive the model). Every
 * hyperparameter comes from metadata; a missing tensor or unsupported feature is an error
 * that names it. Caller frees with engine_model_free. */
enum status engine_model_load(struct engine_model **out, const char *path, struct kern_backend *be,
                              struct err_detail *err);
/* The model split over the ranks of g (borrowed; must outlive the model): query and KV heads
 * and the FFN rows must divide by g->size (else ST_ERR_UNSUPPORTED naming the counts); the
 * split matrices' column slices must fall on quantization blocks. */
enum status engine_model_load_group(struct engine_model **out, const char *path,
                                    const struct kern_group *g, struct err_detail *err);
/* Same with an already-open GGUF; the model takes ownership of g on success. */
enum status engine_model_from_gguf(struct engine_model **out, struct io_gguf *g,
                                   struct kern_backend *be, struct err_detail *err);
/* engine_model_load_group with an already-open GGUF (a dummy model, engine/dummy.h); the model
 * takes ownership of g on success. */
enum status engine_model_from_gguf_group(struct engine_model **out, struct io_gguf *g,
                                         const struct kern_group *grp, struct err_detail *err);
void engine_model_free(struct engine_model *m);

/* Size the forward pass's buffers once, for batches of up to max_tok tokens over kv's
 * sequence slots (no allocation happens in engine_model_forward). Calling it again with
 * larger sizes reallocates; with sizes it already covers it does nothing. */
enum status engine_model_reserve(struct engine_model *m, const struct engine_kv *kv, int max_tok,
                                 struct err_detail *err);
/* The same for max_seqs sequence slots whose block tables (blocks of `block` tokens) hold up to
 * max_blocks ids, before a KV pool exists (--kv-mem auto on a device: the buffers first, then
 * the pool from what is left). */
enum status engine_model_reserve_sizes(struct engine_model *m, int max_tok, int max_seqs, int block,
                                       int max_blocks, struct err_detail *err);

/* Forward passes whose layers' ops were captured into a graph, and replayed from one
 * (kern_ops.graph_begin: CUDA graphs; both 0 elsewhere). */
void engine_model_graph_counts(const struct engine_model *m, long *captures, long *replays);

/* The bytes engine_model_reserve allocates on rank `rank`'s backend for batches of max_tok
 * tokens over max_seqs sequence slots whose block tables hold up to max_blocks ids, the model
 * split over n_rank ranks (device: a backend that is not host memory, where rank 0 also holds
 * the logits rows). For `quern plan`: m needs no backend. */
size_t engine_model_stage_bytes(const struct engine_model *m, int n_rank, int rank, int max_tok,
                                int max_seqs, int max_blocks, int device);

/* Run the batch; writes one n_vocab row of logits per requested token, in batch order, to
 * logits (caller-owned host memory). KV blocks for every position must be reserved beforehand
 * and the batch must fit engine_model_reserve's sizes (else ST_ERR_RANGE). */
enum status engine_model_forward(struct engine_model *m, struct engine_kv *kv,
                                 const struct engine_batch *b, float *logits,
                                 struct err_detail *err);

/* engine_model_forward for rows that only need their greedy token: where the backend can
 * (kern_ops.matmul_argmax), ids[j] = the argmax of wanted row j's logits (NaN never wins, ties
 * to the lowest id, 0 if every logit is NaN or -inf) without writing the logits, and *fused = 1;
 * otherwise the logits are written as by engine_model_forward and *fused = 0. */
enum status engine_model_forward_greedy(struct engine_model *m, struct engine_kv *kv,
                                        const struct engine_batch *b, float *logits,
                                        int32_t *ids, int *fused, struct err_detail *err);

/* engine_model_forward with an epilogue instead of the logits: where the model's backend can
 * (kern_ops.matmul_hook, a host-memory backend; not with soft-capped logits), hook(ctx, ith,
 * r0, r1, blk, ld) runs on the backend's threads for each KERN_HOOK_ROWS-column range with
 * wanted row j's logits of columns r0 .. r1 - 1 at blk + j * ld (the hook stores what it
 * wants of them: the logits are not written), and *hooked = 1; otherwise *hooked = 0, the
 * hook never runs and the logits are written as by engine_model_forward. */
enum status engine_model_forward_hook(struct engine_model *m, struct engine_kv *kv,
                                      const struct engine_batch *b, float *logits,
                                      void (*hook)(void *ctx, int ith, int64_t r0, int64_t r1,
                                                   float *blk, size_t ld),
                                      void *ctx, int *hooked, struct err_detail *err);

/* 1 when the model's backend draws tokens itself (kern_ops.sample, a device backend): then
 * engine_model_forward_sample may be used. (Not with soft-capped output logits, which are
 * capped on the host.) */
int engine_model_samples(const struct engine_model *m);

/* engine_model_forward whose wanted rows the backend draws as rows[j] says (struct
 * kern_sample_row; pen_id/pen_count: their penalties, n_pen entries; masks: n_masks grammar
 * masks of (n_vocab + 31) / 32 words): out[j] for wanted row j.
 * Only a row the backend left to the caller (out[j].id < 0: marked host, or beyond its limits)
 * has its logits written, to row j of logits. */
enum status engine_model_forward_sample(struct engine_model *m, struct engine_kv *kv,
                                        const struct engine_batch *b,
                                        const struct kern_sample_row *rows, const int32_t *pen_id,
                                        const int32_t *pen_count, int n_pen, const uint32_t *masks,
                                        int n_masks, struct kern_sample_out *out, float *logits,
                                        struct err_detail *err);

#define ENGINE_MAX_LAYER_WEIGHTS 8 /* matrices engine_model_weights returns at most */

/* The weight matrices matmuls read in layer `layer` (0 <= layer < n_layer: q, k, v, o, gate,
 * up, down; q, k, v, o, router with experts), or with layer == n_layer the output head: points
 * out[i] at them and returns their count (<= ENGINE_MAX_LAYER_WEIGHTS). The one list of a layer's
 * matrices (load, prepare/release, bench FLOPs, plan memory). */
int engine_model_weights(const struct engine_model *m, int layer, const struct kern_tensor **out);
/* A mixture-of-experts layer's experts (3 engine_hp_n_ffns matrices: expert e's gate, up and
 * down at 3e, 3e + 1, 3e + 2, the shared expert's last; each token runs n_expert_used of the
 * others), beside engine_model_weights' list (whose FFN is then the router, and the shared
 * expert's gate); NULL for a dense layer. */
const struct kern_tensor *engine_model_experts(const struct engine_model *m, int layer);

/* The token embedding, or NULL when it is the output head (tied): a device backend prepares it
 * like a matrix (get_rows reads that copy). */
const struct kern_tensor *engine_model_untied_embedding(const struct engine_model *m);

/* The model's hyperparameters and its GGUF file (for the tokenizer and chat template); valid
 * while the model lives. */
const struct engine_hparams *engine_model_hparams(const struct engine_model *m);
const struct io_gguf *engine_model_gguf(const struct engine_model *m);

/* 1 when models a and b have the same vocabulary: as many tokens, each the same text (what a
 * draft model must share with the model it drafts for: a count alone let a model of another
 * family, or an edited vocabulary, draft tokens that mean something else); else 0 with why
 * (cap bytes) saying where they differ. */
int engine_model_same_vocab(const struct engine_model *a, const struct engine_model *b, char *why,
                            size_t cap);

/* Bytes one KV block of block_size tokens takes on the model's backends (every rank's KV heads,
 * all layers, K and V; kern_ops.kv_block_bytes), or in the CPU layout without a backend. */
size_t engine_model_kv_block_bytes(const struct engine_model *m, int block_size, int dtype);

/* 1 when the model's backend holds its memory in host memory (the CPU backend), or it has none
 * (loaded to plan); 0 on a device (CUDA). */
int engine_model_host_memory(const struct engine_model *m);

#define ENGINE_MAX_RANKS 64 /* tensor-parallel ranks at most */
#define ENGINE_MAX_EXPERTS 512 /* experts per layer at most */

/* Each rank's device memory now (kern_ops.mem_info), in rank order into out (room for max):
 * returns the ranks reported, or 0 when any rank's backend cannot say (the CPU backend). */
int engine_model_mem_info(const struct engine_model *m, struct kern_mem_info *out, int max);

/* 1 when layer is a sliding-window layer (attends to the last hparams.swa_window positions). */
int engine_model_layer_local(const struct engine_model *m, int layer);

/* How a KV memory budget becomes blocks (engine_model_kv_plan). */
struct engine_kv_plan_in {
    size_t kv_mem;        /* bytes for all KV storage */
    int block_size;       /* tokens per block */
    int dtype;            /* enum kern_kv_dtype */
    int max_seqs;         /* sequences running at once */
    int max_batch_tokens; /* tokens per step */
    int window_pool;      /* 1: sliding-window layers get their own pool (engine_kv_set_window) */
};
struct engine_kv_plan {
    int64_t n_main;     /* blocks of the main pool (every layer, or the global ones) */
    int64_t n_local;    /* blocks of the sliding-window pool; 0: none */
    int window;         /* that pool's window (hparams.swa_window) */
    size_t bytes_main;  /* bytes of a main block, all ranks */
    size_t bytes_local; /* bytes of a window block, all ranks */
};
/* Split in->kv_mem between the pools: the largest main pool beside a window pool that holds a
 * window (plus a partial block) for every sequence the main pool holds when sequences are two
 * windows long (at most max_seqs), one step's new tokens and a few cached windows; never more
 * blocks than the main pool. Shorter sequences are then held back by the window pool (at most
 * ~12% fewer at once than with one pool, Gemma 3), longer ones run more at once (two windows:
 * ~1.5x). A model without sliding-window layers, or window_pool 0, gets one pool. */
void engine_model_kv_plan(const struct engine_model *m, const struct engine_kv_plan_in *in,
                          struct engine_kv_plan *out);

/* Storage for kv's blocks on the model's ranks (each its KV heads) and the forward buffers
 * for batches of up to max_tok tokens over its slots (engine_model_reserve). */
enum status engine_model_kv_attach(struct engine_model *m, struct engine_kv *kv, int max_tok,
                                   struct err_detail *err);

/* A KV cache sized for this model: n_tokens tokens of capacity over max_seqs sequences, stored
 * as dtype (enum kern_kv_dtype), attached (engine_model_kv_attach) for batches of up to
 * n_tokens tokens. */
enum status engine_model_kv_init(struct engine_model *m, struct engine_kv **out,
                                 int32_t n_tokens, int max_seqs, int block_size, int dtype,
                                 struct err_detail *err);

#endif
