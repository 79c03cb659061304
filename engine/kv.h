/* Paged KV cache: a pool of fixed-size blocks, per-sequence block tables, reference counts
 * and an automatic prefix cache. A full block is identified by its token ids and its parent
 * block (a hash chain); sequences whose prompts share a prefix share those blocks, and blocks
 * freed by finished sequences stay cached until evicted least-recently-used.
 * A model with sliding-window layers (Gemma 3) keeps those layers in a second, smaller pool
 * (engine_kv_set_window): a sequence holds one block of each pool per logical block, and the
 * second pool's blocks that fall out of the window are given back as the sequence advances
 * (engine_kv_slide), cached like any other; a prefix is reused only when the second pool still
 * has the blocks of its window.
 * Storage is f16, or 8-bit with per-token scales on request (struct kern_kv_layer; README
 * "Accuracy"). */
#ifndef ENGINE_KV_H
#define ENGINE_KV_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "kernels/kernels.h"

struct engine_kv_stats {
    uint64_t lookup_blocks; /* full prompt blocks looked up in the prefix cache */
    uint64_t hit_blocks;    /* of those, found cached */
    uint64_t evictions;     /* cached blocks reused for new data */
    uint64_t forked_blocks; /* whole blocks shared by engine_kv_fork */
    uint64_t copied_blocks; /* partly filled blocks engine_kv_fork copied */
};

struct engine_kv; /* opaque: engine/kv_internal.h */

/* A block manager for n_blocks blocks and max_seqs sequence slots, without storage (the
 * bookkeeping alone, as the scheduler and the tests use it). Caller frees with engine_kv_free,
 * which also frees the storage. */
enum status engine_kv_init(struct engine_kv **out, int n_layer, int n_kv_head, int head_dim,
                           int dtype, int block_size, int32_t n_blocks, int max_seqs,
                           int prefix_cache, struct err_detail *err);
void engine_kv_free(struct engine_kv *kv);
/* Give the layers with local[layer] set (sliding-window layers attending to the last window
 * positions) their own pool of n_local_blocks blocks (<= the main pool's). Before storage is
 * allocated and before any sequence holds blocks. */
enum status engine_kv_set_window(struct engine_kv *kv, const uint8_t *local, int window,
                                 int32_t n_local_blocks, struct err_detail *err);
/* Storage for every block on n_rank backends, each holding n_kv_head / n_rank heads
 * (kern_ops.kv_alloc; the backends must outlive kv). */
enum status engine_kv_storage_alloc(struct engine_kv *kv, struct kern_backend *const *be,
                                    int n_rank, struct err_detail *err);

/* Bytes one token occupies across all layers (K and V) in the CPU backend's layout
 * (KERN_KV_TILE_BYTES); a backend reports its own through kern_ops.kv_block_bytes. */
size_t engine_kv_bytes_per_token(int n_layer, int n_kv_head, int head_dim, int dtype);

/* Make positions [0, n_tokens) of slot seq addressable, taking free blocks (evicting cached
 * ones LRU if needed). ST_ERR_RANGE when not enough blocks (nothing is taken then). */
enum status engine_kv_reserve(struct engine_kv *kv, int seq, int32_t n_tokens,
                              struct err_detail *err);
/* Blocks a reserve of n_tokens for seq would take (0 if it already holds them). */
int32_t engine_kv_blocks_needed(const struct engine_kv *kv, int seq, int32_t n_tokens);
/* Logical blocks available to reserve: free plus evictable cached (with two pools, the
 * smaller of the two counts: a reserve takes one block of each). */
int32_t engine_kv_available(const struct engine_kv *kv);

/* Keep positions [0, n_tokens) of seq and drop its later blocks. A kept partial block must
 * not be shared (speculative decoding rolls back only freshly written tokens). */
void engine_kv_truncate(struct engine_kv *kv, int seq, int32_t n_tokens);
/* Drop every block of seq (they stay cached if registered). */
void engine_kv_release(struct engine_kv *kv, int seq);
/* Positions [0, n_done) of seq are final (never truncated away): give back the sliding-window
 * pool's blocks that no position >= n_done attends to. No-op without that pool. */
void engine_kv_slide(struct engine_kv *kv, int seq, int32_t n_done);

/* For an empty slot: what its KV depends on besides its tokens, 0 by default (Phi-3's LongRoPE:
 * 1 = the long factors, engine_model_rope_variant); blocks are shared only between sequences
 * of one variant. Released slots go back to 0; a fork takes its source's. */
void engine_kv_set_variant(struct engine_kv *kv, int seq, uint32_t variant);
uint32_t engine_kv_variant(const struct engine_kv *kv, int seq);

/* Prefix cache. For an empty slot: attach the cached blocks that hold the longest prefix of
 * tokens made of whole blocks, at most max_tokens tokens; returns the tokens covered. */
int32_t engine_kv_prefix_attach(struct engine_kv *kv, int seq, const int32_t *tokens,
                                int32_t n_tokens, int32_t max_tokens);
/* Fork: empty slot dst takes positions [0, n_tokens) of slot src, whose KV is written there:
 * src's whole blocks shared (reference counted, like prefix-cache hits, cached or not) and
 * the block holding the positions past the last whole one copied into a block of dst's own
 * (kern_ops.kv_copy on every rank, queued before the next step's writes), since both will write
 * on after it (n > 1 choices of one prompt). Returns 1, or 0 with dst left empty when src
 * does not hold those blocks (pool 1: the window of position n_tokens) or none is free for
 * the copy. */
int engine_kv_fork(struct engine_kv *kv, int dst, int src, int32_t n_tokens);
/* Register seq's full blocks among positions [0, n_computed) whose KV is now written. */
void engine_kv_prefix_commit(struct engine_kv *kv, int seq, const int32_t *tokens,
                             int32_t n_computed);
/* Forget every cached block (they become plain free blocks). */
void engine_kv_prefix_clear(struct engine_kv *kv);

/* Consistency check: every block is exactly one of referenced / cached-free / free, and
 * reference counts equal the block-table references. With expect_empty, no block may be
 * referenced (used at shutdown to catch leaks). Returns ST_ERR_INTERNAL describing the
 * first violation. */
enum status engine_kv_check(const struct engine_kv *kv, int expect_empty, struct err_detail *err);

int32_t engine_kv_n_blocks(const struct engine_kv *kv);          /* blocks in the main pool */
int engine_kv_n_pools(const struct engine_kv *kv);               /* 1, or 2 with a window pool */
int engine_kv_layer_pool(const struct engine_kv *kv, int layer); /* the pool of a layer */
int32_t engine_kv_pool_blocks(const struct engine_kv *kv, int pool); /* its size, 0: none */
int32_t engine_kv_pool_used(const struct engine_kv *kv, int pool);   /* its blocks held */
/* Blocks of pool that seq holds (pool 1: only those inside the window). */
int32_t engine_kv_seq_held(const struct engine_kv *kv, int seq, int pool);
int engine_kv_block_size(const struct engine_kv *kv);              /* tokens per block */
int engine_kv_max_seqs(const struct engine_kv *kv);                /* sequence slots */
int32_t engine_kv_seq_blocks(const struct engine_kv *kv, int seq); /* its logical blocks */
int engine_kv_n_rank(const struct engine_kv *kv); /* ranks holding storage (0: none yet) */
const struct engine_kv_stats *engine_kv_get_stats(const struct engine_kv *kv);
void engine_kv_stats_reset(struct engine_kv *kv);                    /* counters back to 0 */
const int32_t *engine_kv_table(const struct engine_kv *kv, int seq); /* main pool's */
/* seq's block ids in pool (engine_kv_seq_blocks entries; pool 1's released ones are -1). */
const int32_t *engine_kv_table_pool(const struct engine_kv *kv, int seq, int pool);
/* Rank rank's storage of layer. */
struct kern_kv_layer engine_kv_layer(const struct engine_kv *kv, int rank, int layer);

#endif
