/* KV cache as a pool of fixed-size blocks with per-sequence block tables (the paged layout
 * the attention kernels read). This is the minimal allocator; reference counts and prefix
 * sharing come with the throughput engine. */
#ifndef ENGINE_KV_H
#define ENGINE_KV_H

#include <stdint.h>

#include "common/err.h"
#include "kernels/kernels.h"

struct engine_kv_seq {
    int32_t *blocks;  /* block ids in position order */
    int32_t n_blocks; /* blocks held */
    int32_t cap;      /* capacity of blocks[] */
};

struct engine_kv {
    int n_layer;                 /* layers */
    int kv_dim;                  /* n_kv_head * head_dim */
    int block_size;              /* tokens per block */
    int32_t n_blocks;            /* blocks in the pool */
    float *k;                    /* n_layer x n_blocks x block_size x kv_dim */
    float *v;                    /* same shape */
    int32_t *free_ids;           /* stack of free block ids */
    int32_t n_free;              /* entries in free_ids */
    int max_seqs;                /* sequence slots */
    struct engine_kv_seq *seqs;  /* max_seqs slots */
};

/* A pool of n_blocks blocks for max_seqs sequences. Caller frees with engine_kv_free. */
enum status engine_kv_init(struct engine_kv **out, int n_layer, int kv_dim, int block_size,
                           int32_t n_blocks, int max_seqs, struct err_detail *err);
void engine_kv_free(struct engine_kv *kv);

/* Bytes one token occupies across all layers (K and V). */
size_t engine_kv_bytes_per_token(int n_layer, int kv_dim);

/* Make positions [0, n_tokens) of seq addressable, taking blocks from the pool.
 * ST_ERR_RANGE when the pool is exhausted (nothing is taken then). */
enum status engine_kv_reserve(struct engine_kv *kv, int seq, int32_t n_tokens,
                              struct err_detail *err);
/* Keep positions [0, n_tokens) of seq and return the rest of its blocks to the pool. */
void engine_kv_truncate(struct engine_kv *kv, int seq, int32_t n_tokens);
/* Blocks not held by any sequence. */
int32_t engine_kv_free_blocks(const struct engine_kv *kv);
const int32_t *engine_kv_table(const struct engine_kv *kv, int seq);
struct kern_kv_layer engine_kv_layer(const struct engine_kv *kv, int layer);

#endif
