/* The backend interface: the engine calls compute kernels only through struct kern_backend,
 * so a CPU or CUDA backend can sit behind the same forward pass. All activations are f32,
 * row-major, one row per token.
 *
 * Memory. Every pointer an op takes (activations, norm weights, RoPE tables, token ids,
 * positions, block tables, KV pools, packed weights) is backend memory: an address the backend
 * gave out (buf_alloc, kv_alloc, prepare), which on a device is a device address the host must
 * not dereference. The caller moves data with upload/download/copy and never reads backend
 * memory directly unless the backend says it is host memory (struct kern_backend.host_memory,
 * the CPU backend), in which case it may skip those copies. A weight's `data` is the host
 * mapping of the file; ops read a weight only through what prepare made of it.
 *
 * Order and blocking. Ops run in call order on one stream. On a device they may return before
 * the work is done; download (and sync) wait for all earlier work, so the host sees its
 * results. upload copies from host memory before it returns (the source may be reused at
 * once). The CPU backend finishes every op before returning. */
#ifndef KERNELS_KERNELS_H
#define KERNELS_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/err.h"

/* A weight matrix of ne1 rows of ne0 elements (GGUF ne order), stored in `type` blocks. */
struct kern_tensor {
    uint32_t type;    /* enum dtype */
    int64_t ne0;      /* elements per row (input features) */
    int64_t ne1;      /* rows (output features) */
    size_t row_bytes; /* bytes per row */
    const void *data; /* ne1 * row_bytes bytes (not owned) */
    void *packed;     /* the backend's copy repacked at load (kern_ops.prepare), or NULL */
    size_t packed_panel; /* bytes per panel of packed rows (backend-defined) */
    void *widened;    /* NULL, or prepare's lossless re-encoding of the rows in a type its
                       * kernels are faster on (then type, row_bytes and data describe it;
                       * release frees it) */
};

/* One layer's KV storage: a pool of fixed-size blocks, allocated by the backend (kv_alloc),
 * which alone reads and writes it. The CPU backend's layout, for the record: block b holds,
 * for each KV head g, a tile of block_size (B) tokens x head_dim (D) channels, tile number
 * (b * n_kv_head + g), each
 * KERN_KV_TILE_BYTES(dtype, B, D) bytes. In IEEE half floats (KERN_KV_F16):
 *   key     channel c of token i: k[tile * D * B + c * B + i]   (channel-major)
 *   value   channel c of token i: v[tile * B * D + i * D + c]   (token-major)
 * Keys are channel-major so that one vector load gives a channel of consecutive tokens (scores
 * of 16 keys come out of D vector FMAs, no horizontal sums); values are token-major for the
 * weighted sum. One tile is contiguous, so a query head group streams it once.
 * In 8 bits (KERN_KV_Q8, opt-in): the same positions hold int8 quants q, and the tile's last
 * 4 B bytes the B float scales s (token i's at byte D * B + 4 i); a token's D keys (values) of
 * one head are s q with s = max|x| / 127 and q = round(x / s) (kern_kv_quant_q8): half the
 * bytes of f16 for every attention read, at a rounding error of up to s / 2 per element.
 * In bfloat16 for the tile unit (KERN_KV_BF16T): never asked for; the CPU backend's kv_alloc
 * picks it for KERN_KV_F16 in the bf16 matmul mode on AMX (block_size a multiple of 16,
 * head_dim of 32), and only that backend reads it. The same bytes as f16, laid out as AMX-BF16
 * tile products take them (word w of a tile; values rounded to bfloat16, nearest even):
 *   key     channel c of token i: w = ((c / 2) * B + i) * 2 + c % 2   (channel pairs per token)
 *   value   channel c of token i: w = ((i / 2) * D + c) * 2 + i % 2   (token pairs per channel)
 */
enum kern_kv_dtype { KERN_KV_F16 = 0, KERN_KV_Q8 = 1, KERN_KV_BF16T = 2 };

#define KERN_KV_TILE_BYTES(dtype, B, D)                                                            \
    ((dtype) == KERN_KV_Q8 ? (size_t)(B) * ((size_t)(D) + 4) : (size_t)(B) * (size_t)(D) * 2)

struct kern_kv_layer {
    void *k;   /* keys of every block (backend memory) */
    void *v;   /* values of every block (backend memory) */
    int dtype; /* enum kern_kv_dtype */
};

/* What a KV pool holds (kv_alloc). */
struct kern_kv_desc {
    int n_layer;    /* layers */
    int n_kv_head;  /* key/value heads */
    int head_dim;   /* channels per head */
    int block_size; /* tokens per block */
    int dtype;      /* enum kern_kv_dtype */
};

/* Block tables, flat so they can be copied to a device: sequence row r's blocks are
 * ids[r * stride .. r * stride + stride), in position order (position p is in block
 * ids[r * stride + p / block_size]); token t belongs to row row[t]. All backend memory. */
struct kern_block_table {
    const int32_t *ids; /* n_rows x stride block ids */
    const int32_t *row; /* per token: its sequence's row */
    int stride;         /* ids per row */
};

/* Token t's block ids. */
static inline const int32_t *kern_block_row(const struct kern_block_table *bt, int t)
{
    return bt->ids + (size_t)bt->row[t] * (size_t)bt->stride;
}

/* Arguments of one attention call over a batch of tokens from several sequences. Token t
 * attends to positions 0..pos[t] of its own sequence, found through its block table row. */
struct kern_attn {
    int n_tok;                          /* tokens in the batch */
    const float *q;                     /* n_tok x (n_head * head_dim) */
    float *out;                         /* n_tok x (n_head * head_dim) */
    const int32_t *pos;                 /* position of each token in its sequence */
    struct kern_block_table bt;         /* block tables */
    struct kern_kv_layer kv;            /* this layer's pool */
    int block_size;                     /* tokens per block */
    int n_head;                         /* query heads */
    int n_kv_head;                      /* key/value heads (GQA: n_head % n_kv_head == 0) */
    int head_dim;                       /* channels per head */
    float scale;                        /* usually 1/sqrt(head_dim) */
    int window;                         /* 0: positions 0..pos[t]; else only the last `window`
                                         * of them, pos[t] - window < p <= pos[t] (sliding-
                                         * window attention) */
    float softcap;                      /* 0: none; else each scaled score s becomes
                                         * softcap * tanh(s / softcap) (Gemma 2) */
    /* Optional (store NULL: none): tokens t with store[t] set have their key and value rows
     * (k_new, v_new: n_tok x n_kv_head * head_dim, as kv_store takes them) written into the
     * pool by the attention itself, each KV head's right before that head's attention reads
     * it, instead of by kv_store (which the caller told to skip them): the write's cache misses
     * are then the ones the read takes anyway. Only for a token no other token of the batch
     * attends to (the last of its sequence in the batch). */
    const uint8_t *store;
    const float *k_new, *v_new;
    int n_seqs; /* a hint (0: none): the sequences the tokens belong to (a decode step: n_tok) */
};

/* Score s soft-capped as struct kern_attn's softcap says (every kernel uses this, so they
 * agree with the scalar reference). */
static inline float kern_attn_softcap(float s, float cap)
{
    return cap * tanhf(s / cap);
}

/* The first position token t of a attends to (sliding window: the last a->window ones). */
static inline int32_t kern_attn_first(const struct kern_attn *a, int t)
{
    return a->window > 0 && a->pos[t] + 1 > a->window ? a->pos[t] + 1 - a->window : 0;
}

#define KERN_MAX_HEAD_DIM 512 /* largest head_dim the attention kernels accept */

struct kern_backend;

/* A measured peak rate (kern_ops.peaks). */
struct kern_peak {
    const char *name; /* "int8", "amx_int8", "amx_bf16", ... (static storage) */
    double ops;       /* operations per second; 0 = not available here */
};

/* The gated activation of a feed-forward block: act(gate) * up. */
enum kern_glu {
    KERN_GLU_SILU = 0, /* SwiGLU: silu(g) = g / (1 + e^-g) (Llama, Qwen) */
    KERN_GLU_GELU = 1, /* GeGLU with the tanh GELU: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
                        * (Gemma) */
};

/* A matmul's input: rows x (n_tok x n) and the element-wise steps the backend fuses into the
 * pass that prepares them for the GEMM, each bitwise as the separate op (add, rmsnorm,
 * swiglu) would compute it. In order: x += add (x updated: the residual stream); then the
 * matmul's input is rmsnorm(x) * norm, written to xn, or act(x) * up (act: glu), written to
 * x; with neither it is x itself. */
struct kern_mm_in {
    float *x;          /* n_tok x n (read only when add and up are NULL) */
    const float *add;  /* NULL or n_tok x n */
    const float *norm; /* NULL or the n rmsnorm weights (xn must be set) */
    float eps;         /* rmsnorm epsilon */
    const float *up;   /* NULL or n_tok x n (swiglu: x is the gate); not with norm */
    int glu;           /* with up: enum kern_glu, the gate's activation */
    float *xn;         /* n_tok x n for rmsnorm's output, else unused */
};

/* Most alternatives a sampled row's log-probabilities report (OpenAI's top_logprobs limit). */
#define KERN_TOP_LOGPROBS_MAX 20

/* One row's draw for kern_ops.sample, with engine_sample's parameters (engine/sampler.h). */
struct kern_sample_row {
    float temperature;       /* 0: greedy */
    int32_t top_k;           /* 0: off */
    float top_p;             /* 1: off */
    float min_p;             /* 0: off */
    float repeat_penalty;    /* penalties of the tokens pen_id[pen_first .. pen_first + pen_n) */
    float frequency_penalty; /* ... with their counts pen_count[...] */
    float presence_penalty;
    int32_t pen_first, pen_n;
    double u;     /* the draw's uniform in [0, 1) (engine_rng_at(rng, pos, 0)) */
    int32_t lp_k; /* -1: no log-probabilities; else 0..KERN_TOP_LOGPROBS_MAX alternatives */
    int32_t mask; /* -1: none; else the index of its allowed-token mask (a grammar's): every
                   * token whose bit is clear is -inf before anything else, the
                   * log-probabilities included */
    int32_t host; /* 1: not drawn by the backend (the caller draws it from the row's logits) */
};

/* What kern_ops.sample drew for one row. */
struct kern_sample_out {
    int32_t id; /* the token, or -1: left to the caller */
    float lp;   /* with lp_k >= 0: the token's log-probability (engine_logprobs) */
    int32_t top_id[KERN_TOP_LOGPROBS_MAX]; /* ... and the lp_k most likely, with theirs */
    float top_lp[KERN_TOP_LOGPROBS_MAX];
};

/* kv_store's skip / kern_attn.store value of a padding token (kern_ops.graphs_on): neither
 * writes its key and value. */
#define KERN_STORE_PAD 2

/* kern_ops.graph_begin's answers. */
enum { KERN_GRAPH_NONE = 0, KERN_GRAPH_CAPTURE = 1, KERN_GRAPH_REPLAYED = 2 };

/* Rows per call of kern_ops.matmul_hook's epilogue. */
#define KERN_HOOK_ROWS 256

/* A device's memory (kern_ops.mem_info). */
struct kern_mem_info {
    size_t avail; /* bytes free now */
    size_t total; /* bytes the device has */
    int device;   /* its ordinal: backends reporting the same one share this memory */
};

struct kern_ops {
    const char *name; /* "cpu", "cuda" */
    /* For each of the n_w weights (same ne0, e.g. Q, K and V): y[i][t][r] = dot(row r of w[i],
     * x[t]) for t < n_tok, r < w[i]->ne1, where x is in's input rows (n_tok x ne0) after its
     * element-wise steps. Activations are prepared (e.g. quantized) once for all n_w, in the
     * same pass as those steps. Batch-invariant: a row's result does not depend on n_tok. */
    void (*matmul)(struct kern_backend *b, const struct kern_tensor *const *w, float *const *y,
                   int n_w, const struct kern_mm_in *in, int n_tok);
    /* Optional (NULL, or 0 returned = not done, nothing touched): for an output projection whose
     * rows are only wanted for their greedy token, ids[t] = the row of w with the largest
     * value of x[t] times it (NaN never wins, ties to the lowest row, 0 when every value is NaN
     * or -inf), without writing the n_tok x ne1 logits. The values compared are bitwise those
     * matmul would write. Returns 1 when done. */
    int (*matmul_argmax)(struct kern_backend *b, const struct kern_tensor *w,
                         const struct kern_mm_in *in, int n_tok, int32_t *ids);
    /* Optional, host-memory backends only (NULL, or 0 returned = not done, nothing touched): one
     * weight's matmul handed to an epilogue instead of stored: hook(ctx, ith, r0, r1, blk, ld)
     * is called once for each range of KERN_HOOK_ROWS rows [r0, r1) (r0 a multiple of
     * KERN_HOOK_ROWS, r1 = min(r0 + KERN_HOOK_ROWS, ne1)) with token t's values of rows r0 ..
     * r1 - 1 at blk + t * ld, bitwise what matmul writes, in backend scratch that is still in
     * cache and that the hook may overwrite (the sampler's whole-row pass, engine/sampler.h,
     * copies them to the logits on the way). Calls run concurrently on the backend's threads
     * (ith < the number of threads); one thread's ranges come in increasing order. Returns 1
     * when done. */
    int (*matmul_hook)(
        struct kern_backend *b, const struct kern_tensor *w, const struct kern_mm_in *in, int n_tok,
        void (*hook)(void *ctx, int ith, int64_t r0, int64_t r1, float *blk, size_t ld), void *ctx);
    /* Optional (NULL: the caller downloads the logits and draws on the host): draw one token
     * from each row i < n of logits (n x n_vocab, backend memory, left unchanged) as rows[i]
     * says (host memory), bitwise the token engine_sample (engine/sampler.h) draws from the same
     * row with those parameters and uniform: the penalties first (each listed token's logit l
     * becomes, when repeat_penalty != 1, l > 0 ? l / rp : l * rp, then l - (count * fp + pp)),
     * then greedy, or top_k, temperature, top_p, min_p and the inverse-CDF draw, every sum in
     * engine_sample's order. With lp_k >= 0 also engine_logprobs of the unpenalised row. pen_id
     * and pen_count (n_pen entries) and masks (n_masks masks of (n_vocab + 31) / 32 words, bit t
     * of word t / 32 set when token t is allowed) are host memory; out (n entries) is written
     * on return. A
     * row the backend cannot rank within its limits (a top_k or a nucleus of too many tokens)
     * gets id -1, like rows marked host: the caller draws those itself. Returns the rows
     * drawn. */
    int (*sample)(struct kern_backend *b, const float *logits, int n, int32_t n_vocab,
                  const struct kern_sample_row *rows, const int32_t *pen_id,
                  const int32_t *pen_count, int n_pen, const uint32_t *masks, int n_masks,
                  struct kern_sample_out *out);
    /* The feed-forward block: y = down(act(gate(x)) * up(x)), act the enum kern_glu glu and x
     * in's input rows (as for matmul); gate_buf and up_buf (n_tok x gate->ne1) are scratch the
     * backend may use. The same results as the two matmuls with the gated activation between
     * them (which is what it runs unless it has a fused kernel for the mode). */
    void (*ffn)(struct kern_backend *b, const struct kern_tensor *gate,
                const struct kern_tensor *up, const struct kern_tensor *down,
                const struct kern_mm_in *in, int glu, float *y, float *gate_buf, float *up_buf,
                int n_tok);
    /* Make the backend's copy of a weight matrix, once, at load: whatever its ops read (a
     * layout repacked for its kernels, device memory), setting w->packed; a host-memory backend
     * may also read w->data in place and leave packed NULL. The results are bitwise those of
     * the unpacked matrix. NULL: ops read w->data (host-memory backends only). release frees
     * what prepare made. */
    enum status (*prepare)(struct kern_backend *b, struct kern_tensor *w, struct err_detail *err);
    void (*release)(struct kern_backend *b, struct kern_tensor *w);
    /* out[i] = dequantized row ids[i] of w (embedding lookup); ids and out backend memory. */
    void (*get_rows)(struct kern_backend *b, const struct kern_tensor *w, const int32_t *ids,
                     int n, float *out);
    /* Rotate pair i < rot_dim / 2 of the first rot_dim channels of every head by the angle
     * whose cosine and sine are cs[t * rot_dim + 2i], cs[t * rot_dim + 2i + 1] (angle
     * pos * theta^(-2i/rot_dim), tabulated once per forward pass by the caller). Pair i is
     * (x[2i], x[2i+1]) with neox 0 (llama.cpp's "NORM": Llama) and (x[i], x[i + rot_dim/2])
     * with neox 1 ("NEOX": Qwen, Gemma). x is n_tok x n_head x head_dim. */
    void (*rope)(struct kern_backend *b, float *x, const float *cs, int n_tok, int n_head,
                 int head_dim, int rot_dim, int neox);
    /* y[i] += x[i] */
    void (*add)(struct kern_backend *b, float *y, const float *x, long n);
    /* Every row r < n_rows of y (width floats) += bias (width floats): a projection's bias. */
    void (*add_rows)(struct kern_backend *b, float *y, const float *bias, long n_rows, int width);
    /* Every row of x (n_rows of width floats) in place: rmsnorm(row) * w (w: width floats),
     * bitwise as kern_mm_in's norm step: a per-head QK-norm, a block's post-norm. */
    void (*norm_rows)(struct kern_backend *b, float *x, const float *w, long n_rows, int width,
                      float eps);
    /* x[i] *= s */
    void (*scale)(struct kern_backend *b, float *x, float s, long n);
    /* Write token rows k, v (n_tok x n_kv_head * head_dim floats) into their slots of the pool,
     * rounded to half (nearest even) or 8-bit as the pool stores them; tokens with skip[t] set
     * are left out (skip may be NULL: struct kern_attn's store does them). */
    void (*kv_store)(struct kern_backend *b, struct kern_kv_layer kv,
                     const struct kern_block_table *bt, const int32_t *pos, int block_size,
                     int n_kv_head, int head_dim, const float *k, const float *v, int n_tok,
                     const uint8_t *skip);
    /* Softmax attention of every (token, head) of the batch over its own sequence's KV. Each
     * query head group (the n_head / n_kv_head heads sharing a KV head) reads its KV tile once.
     * Batch-invariant: a token's output does not depend on the rest of the batch. */
    void (*attention)(struct kern_backend *b, const struct kern_attn *a);
    /* Rows: dst row i = src row idx[i] (width floats each), for i < n; dst and src distinct. */
    void (*gather)(struct kern_backend *b, float *dst, const float *src, const int32_t *idx,
                   int n, long width);
    /* Memory (see the top of this file). buf_alloc returns 64-byte aligned backend memory, or
     * NULL when there is none left; buf_free(NULL) does nothing. */
    /* A mixture of experts' weighted sum: for i = 0 .. n - 1 in that order, with t = rows[i]
     * (or ~rows[i] when it is negative), row t of y (width floats) = w[i] * row i of x when
     * rows[i] < 0 (the token's first), else row t += w[i] * row i of x, each product rounded to
     * float and then added (no fused multiply-add). rows and w backend memory. */
    void (*moe_add)(struct kern_backend *b, float *y, const float *x, const int32_t *rows,
                    const float *w, int n, long width);
    void *(*buf_alloc)(struct kern_backend *b, size_t bytes);
    void (*buf_free)(struct kern_backend *b, void *p);
    void (*upload)(struct kern_backend *b, void *dst, const void *src, size_t bytes);
    void (*download)(struct kern_backend *b, void *dst, const void *src, size_t bytes);
    void (*copy)(struct kern_backend *b, void *dst, const void *src, size_t bytes);
    void (*sync)(struct kern_backend *b); /* wait until every queued op is done */
    /* KV storage: bytes one block of d takes in this backend's layout (all layers, K and V),
     * and a pool of n_blocks such blocks (layers[l] for l < d->n_layer; zeroed), freed with
     * kv_free. */
    size_t (*kv_block_bytes)(struct kern_backend *b, const struct kern_kv_desc *d);
    enum status (*kv_alloc)(struct kern_backend *b, const struct kern_kv_desc *d, int32_t n_blocks,
                            struct kern_kv_layer *layers, struct err_detail *err);
    void (*kv_free)(struct kern_backend *b, const struct kern_kv_desc *d, int32_t n_blocks,
                    struct kern_kv_layer *layers);
    /* Block src's keys and values copied to block dst (src != dst) in every layer of the pool
     * (layers[l] for l < d->n_layer), in call order with the other ops: a sequence that forks
     * another's partly filled block (n > 1 choices) gets its own copy to write on. */
    void (*kv_copy)(struct kern_backend *b, const struct kern_kv_desc *d,
                    const struct kern_kv_layer *layers, int32_t dst, int32_t src);
    /* Optional (NULL: nothing to size): allocate the backend's own scratch once for ops over up
     * to max_tok tokens of rows of up to max_width floats, whose attention spans at most
     * max_pos positions of a sequence, so that no op allocates later. Called after kv_alloc. */
    enum status (*reserve)(struct kern_backend *b, int max_tok, int64_t max_width, int32_t max_pos,
                           struct err_detail *err);
    /* Optional (NULL: none): the device's measured peak multiply-add rates (2 ops per MAC),
     * each loop run for about `seconds` on all the backend's threads at once: fills up to max
     * entries of out and returns how many. A rate the machine lacks is reported as 0. */
    int (*peaks)(struct kern_backend *b, double seconds, struct kern_peak *out, int max);
    /* Optional (NULL: 0): bytes of backend memory prepare would hold for w (its packed copy)
     * in the current matmul mode, without making it (quern plan). */
    size_t (*weight_bytes)(struct kern_backend *b, const struct kern_tensor *w);
    /* Optional (NULL: unknown): 1 and the backend's device memory as its runtime sees it, once
     * every queued op is done (device-wide: this process's allocations and runtime context,
     * and any other process's on the same device, are not free): what --kv-mem auto sizes the
     * KV pool from, and what `quern plan --device ...` is set against. */
    int (*mem_info)(struct kern_backend *b, struct kern_mem_info *out);
    /* Optional (NULL: none), both or neither: graphs of a run of ops (CUDA graphs), for a run
     * whose ops and arguments (buffers, counts, scalars) are the same whenever `key` is, and
     * which reads what changes (inputs uploaded before it) from device memory at run time.
     * graph_begin(b, key) returns KERN_GRAPH_REPLAYED when it launched the graph made for key
     * (the caller skips the ops), KERN_GRAPH_CAPTURE when the ops the caller now calls, up to
     * graph_end, are to be recorded into one (they do not run yet), or KERN_GRAPH_NONE (run them
     * as usual; the backend decides which keys are worth a graph). graph_end returns 1 when the
     * recorded graph was made and launched, 0 when the capture failed at its end (the backend
     * says why and stops making graphs; the caller runs the ops again). No op called between
     * them may allocate, synchronise or move data to or from the host (an op that fails inside
     * a capture aborts, as any failing op does). Freeing backend memory drops every graph. */
    int (*graph_begin)(struct kern_backend *b, uint64_t key);
    int (*graph_end)(struct kern_backend *b);
    /* Optional (NULL: 0): 1 when graph_begin may make graphs now. The engine then pads a
     * step's tokens, block-table rows and width to buckets (engine/model.c) so that shapes
     * repeat; padding tokens carry KERN_STORE_PAD in kv_store's skip and attention's store,
     * and neither writes them. */
    int (*graphs_on)(struct kern_backend *b);
    /* Optional with graph_begin: how many times this backend has dropped its graphs (and what
     * graph_begin remembers of keys) so far, and a drop on demand. Ranks whose graphs go
     * through collectives must make the same graph decisions: when one rank has dropped its
     * graphs (it gave memory back), the engine drops every rank's. */
    uint64_t (*graph_epoch)(struct kern_backend *b);
    void (*graphs_reset)(struct kern_backend *b);
    void (*free)(struct kern_backend *b); /* frees b itself (kern_backend_free) */
    const char *(*describe)(const struct kern_backend *b);
};

struct kern_backend {
    const struct kern_ops *ops; /* dispatch table */
    void *impl;                 /* backend-private state */
    int host_memory;            /* 1: backend memory is host memory the caller may use directly */
};

/* How matmuls treat activations on the CPU. */
enum kern_act {
    KERN_ACT_F32 = 0, /* exact: weight rows dequantized to f32, f32 dot products (default) */
    KERN_ACT_Q8 = 1,  /* fast: activations quantized to 8-bit blocks, integer dot products
                       * (as llama.cpp does; costs accuracy, see README "Accuracy") */
    KERN_ACT_Q16 = 2, /* activations quantized to 16-bit blocks, exact integer dot products
                       * for Q4_0/Q4_1/Q8_0 weights (other types: as exact) */
    KERN_ACT_BF16 = 3, /* activations and dequantized weights rounded to bfloat16, f32 sums on
                        * AMX-BF16 tiles, Q4_0/Q4_1/Q8_0 weights (other types: as exact); needs
                        * the AMX table */
};

/* What kern_backend_open builds. Fields a backend does not use are ignored. */
struct kern_backend_opts {
    const char *device; /* NULL/"auto"/"cpu" (the only backend compiled in so far) */
    int n_threads;      /* host threads including the caller, >= 1 */
    const char *isa;    /* CPU: NULL/"auto" = best the CPU supports; "scalar", "avx2", ... */
    enum kern_act act;  /* activation precision of matmuls */
    int as_device;      /* CPU, for tests: report host_memory 0, so callers take the device
                         * path (every byte through upload/download) */
    int tp;             /* tensor-parallel ranks kern_group_open makes (0 or 1: one) */
    int ordinal;        /* CUDA: the device (kern_group_open sets it for each rank) */
};

/* The device a --device value names: "cpu" or "cuda" for those, and for NULL/"auto" the one
 * kern_backend_open would pick (logging once why it is the CPU where a CUDA build finds no
 * usable GPU); any other value is returned as it is (kern_backend_open refuses it). */
const char *kern_device_resolve(const char *device);

/* The matmul mode a device runs when --matmul is not given: on CUDA exact; on the CPU bf16 where
 * the kernel table --isa picks has AMX-BF16 tiles (there the fastest mode, and its perplexity
 * within 0.01 % of exact's: docs/BENCHMARKS.md, 2026-12-04), else q8 (the fastest mode within
 * 0.5 % of exact's). */
enum kern_act kern_default_act(const char *device, const char *isa);

/* The --matmul name of a mode ("exact", "q8", "q16", "bf16") and the --kv-dtype name of a KV
 * type ("f16", "q8"; a pool's KERN_KV_BF16T: "bf16"); static storage. */
const char *kern_act_name(enum kern_act act);
const char *kern_kv_dtype_name(enum kern_kv_dtype dtype);

/* Open a backend. An unknown device or an instruction set the machine lacks is an error that
 * says so. Caller frees with kern_backend_free. */
enum status kern_backend_open(struct kern_backend **out, const struct kern_backend_opts *o,
                              struct err_detail *err);
void kern_backend_free(struct kern_backend *b);
/* What the backend runs on, for logs and reports ("cpu avx512-vnni"); static storage. */
const char *kern_backend_describe(const struct kern_backend *b);
/* One line per compute device this build can use and what it supports (quern info). */
void kern_backends_print(FILE *f);

struct kern_comm;

/* The ranks of one tensor-parallel model: a backend per rank and a communicator joining them
 * (kernels/comm.h). The ranks are threads of this process, each backend with an even share of
 * o->n_threads (at least one). Host-memory backends reduce through shared memory
 * (kernels/cpu/comm_cpu.h). CUDA ranks, as QUERN_TP_COMM says (auto, the default: NCCL where it
 * can be had): rank r on device r joined by NCCL (kernels/cuda/comm_nccl.h) when the library
 * loads and there are as many devices as ranks; else (QUERN_TP_COMM=staged, or auto without
 * NCCL or devices) every rank on device 0 through host staging (kernels/comm_staged.h), which is
 * how the sharded paths run on one GPU. QUERN_TP_COMM=nccl makes the lack of NCCL an error. The
 * choice is logged once per group. */
struct kern_group {
    int size;                 /* ranks, >= 1 */
    struct kern_backend **be; /* per rank (owned) */
    struct kern_comm **comm;  /* per rank; NULL entries when size is 1 */
    void *impl;               /* the communicator's shared state (owned), or NULL */
    void (*impl_free)(void *impl); /* frees impl */
};

/* Open o->tp backends (at least one) as o says and their communicator. Caller frees with
 * kern_group_free. */
enum status kern_group_open(struct kern_group **out, const struct kern_backend_opts *o,
                            struct err_detail *err);
void kern_group_free(struct kern_group *g);

#endif
