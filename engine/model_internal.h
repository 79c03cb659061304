/* The model's private state (engine/model.c; tests may read it): the whole weights as views
 * of the file, and each tensor-parallel rank's slices, norms and forward buffers. */
#ifndef ENGINE_MODEL_INTERNAL_H
#define ENGINE_MODEL_INTERNAL_H

#include "engine/model.h"
#include "kernels/comm.h"

struct pool;

struct engine_layer {
    const float *attn_norm;    /* n_embd */
    struct kern_tensor wq;     /* n_embd -> n_head*head_dim */
    struct kern_tensor wk;     /* n_embd -> n_kv_head*head_dim */
    struct kern_tensor wv;     /* n_embd -> n_kv_head*head_dim */
    struct kern_tensor wo;     /* n_head*head_dim -> n_embd */
    const float *ffn_norm;     /* n_embd */
    struct kern_tensor w_gate; /* n_embd -> n_ff */
    struct kern_tensor w_up;   /* n_embd -> n_ff */
    struct kern_tensor w_down; /* n_ff -> n_embd */
    struct kern_tensor router; /* mixture of experts: n_embd -> n_expert (ffn_gate_inp); the
                                * layer's FFN is then its experts, not w_gate/up/down */
    struct kern_tensor *experts;   /* ... 3 engine_hp_n_ffns matrices: expert e's gate, up and
                                    * down at 3e, 3e + 1, 3e + 2 (views of the file's 3-D tensors),
                                    * then the shared expert's */
    struct kern_tensor shexp_gate; /* ... the shared expert's gate: 1 row of n_embd; or none */
    const float *bq, *bk, *bv; /* NULL, or the projections' biases (qwen2) */
    const float *q_norm;       /* NULL, or head_dim: RMS norm of each query head (QK-norm) */
    const float *k_norm;       /* NULL, or head_dim: the same for each key head */
    const float *post_attn_norm; /* NULL, or n_embd: norm of the attention output (gemma3) */
    const float *post_ffn_norm;  /* NULL, or n_embd: norm of the FFN output (gemma3) */
    int swa;                   /* 1: a sliding-window layer (hparams swa_window, theta_swa) */
};

/* A rank's buffers for one forward pass, backend memory, sized once (engine_model_reserve). */
struct engine_rank_bufs {
    float *act;     /* activations: residual, norm, q, attention, k, v, gate, up */
    int32_t *tok;   /* token ids */
    int32_t *pos;   /* positions */
    int32_t *row;   /* per token: its block table row */
    uint8_t *last;  /* per token: 1 when it is its sequence's highest position */
    float *rope;    /* per token: cos, sin of each rotated pair (then the sliding layers' table,
                     * when they have their own base) */
    int32_t *tables; /* block tables, one row per sequence in the batch */
    int32_t *idx;   /* rows that want logits */
    float *logits;  /* logits (rank 0, only when the backend's memory is not host memory) */
    int logits_rows; /* ... rows it holds: one a sequence slot, grown when a batch wants more */
    int32_t *ids;   /* greedy ids (same) */
    int32_t *perm;  /* more than one rank: gathered rank-major rows -> token-major (per step) */
    /* mixture of experts: a layer's routing, n_tok x n_expert_used slots in expert order (made
     * on the host from the router logits each rank downloads, then uploaded) */
    int32_t *slot_tok; /* each slot's token, then its moe_add row (~token at the token's first
                        * slot), then with several ranks each expert run's all-gather order */
    float *slot_w;     /* each slot's weight */
    float *h_router;   /* host: the router logits, n_tok x n_expert */
    int32_t *h_slot;   /* host: slot_tok */
    float *h_w;        /* host: slot_w */
    int32_t *h_count;  /* host: slots per expert */
};

/* One tensor-parallel rank: its backend and its share of every layer, every matrix split by
 * output rows (q, k, v by heads; gate and up by FFN rows; o and down by hidden rows), so each
 * output element is one whole dot product, computed as with one rank: the ranks' slices are
 * all-gathered before the next matrix that reads them, and a split model gives bitwise the
 * logits of a whole one. Norms, the embedding and the output head are whole. With one rank,
 * the whole model. */
struct engine_rank {
    struct kern_backend *be;      /* its backend (not owned) */
    struct kern_comm *comm;       /* joins the ranks; NULL with one */
    uint64_t graph_epoch;         /* its backend's graph_epoch after the last step's check */
    int n_head;                   /* query heads here */
    int n_kv_head;                /* KV heads here */
    int n_ff;                     /* FFN rows here */
    int n_embd;                   /* rows of o and down here */
    struct engine_layer *layers;  /* its slices, prepared on be (norms: backend copies) */
    const float *output_norm;     /* backend copy */
    float *norms;                 /* backend memory holding every norm and bias vector */
    struct engine_rank_bufs buf;  /* forward buffers */
};

/* Host-side staging of one forward pass, sized once with the ranks' buffers. */
struct engine_model_stage {
    int graphs;         /* this step goes through graph_begin on every rank (graphs_usable) */
    int max_tok;        /* tokens per batch at most */
    int max_seqs;       /* sequence slots of the KV cache it was sized for */
    int max_blocks;     /* blocks per sequence at most (block table stride) */
    int32_t *row;       /* per token: its block table row */
    uint8_t *last;      /* per token: highest position of its sequence */
    float *rope;        /* per token: cos, sin of each rotated pair (x n_rope tables) */
    int32_t *tables;    /* block tables */
    int32_t *idx;       /* rows that want logits */
    int32_t *seq_row;   /* per sequence slot: its row in this batch, -1 if none */
    int32_t *seq_top;   /* per row: the token at its highest position */
    int32_t *perm;      /* n_tok x n_rank: token t's slice from rank r is gathered row r n + t */
    int32_t *tok, *pos; /* padded batches: the token ids and positions, padding included */
    int n_out;          /* this batch: rows that want logits */
    int n_pad;          /* this batch: tokens the layers run (n_tok, or its bucket: padded) */
    int stride;         /* this batch: block table stride (a bucket when padded) */
    int n_rows;         /* this batch: block table rows (sequences; a bucket when padded) */
};

struct engine_model {
    struct io_gguf *gguf;         /* owns the mapping the weights point into */
    struct engine_hparams hp;     /* hyperparameters from metadata */
    struct kern_tensor tok_embd;  /* n_vocab rows of n_embd */
    const float *output_norm;     /* n_embd (host, in the file) */
    struct kern_tensor output;    /* output head (tok_embd when tied); prepared on rank 0 */
    int tied_output;              /* 1 when the output head is tok_embd */
    const float *rope_freqs;      /* NULL, or rope_dim / 2 factors dividing each pair's frequency
                                   * (Llama 3's rope_freqs.weight) */
    const float *rope_long;       /* LongRoPE: rope_dim / 2 such factors for sequences that may
                                   * pass rope_orig_ctx positions (KV variant 1), and */
    const float *rope_short;      /* those for the others (variant 0); NULL without */
    int n_rope;                   /* RoPE tables per step: 1, or 2 when sliding layers have
                                   * their own base */
    struct engine_layer *layers;  /* n_layer layers, whole (host views of the file) */
    struct kern_backend *be;      /* rank 0's backend, or NULL (no compute) */
    int n_rank;                   /* tensor-parallel ranks (0 without a backend) */
    struct engine_rank *rank;     /* n_rank ranks */
    struct pool *rank_pool;       /* one thread per rank (more than one rank) */
    struct engine_model_stage stage; /* host staging (engine_model_reserve) */
    long graph_captures;             /* forward passes whose layers became a graph (atomic) */
    long graph_replays;              /* ... and that replayed one (atomic) */
};

/* A tensor of g holding a NaN or an infinity is refused (a damaged file: every token after it
 * would be garbage or nothing, with no word; perplexity printed the vocabulary size). It reads
 * every weight byte, so it runs only for a model that will compute (on backends), not for one
 * loaded to be described (quern plan: a 70B plan read 40 GB). */
enum status engine_model_check_finite(const struct io_gguf *g, struct err_detail *err);
/* The weights from the file (engine/model_load.c): hyperparameters, whole matrices (views of the
 * mapping) and norm/bias vectors; no backend yet. On success the model owns g. */
enum status engine_model_load_weights(struct engine_model **out, struct io_gguf *g,
                                      struct err_detail *err);

#endif
