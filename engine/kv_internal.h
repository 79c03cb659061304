/* The KV block manager's private state (engine/kv.c; the model reads a sequence's blocks
 * through engine/kv.h, tests may read this). */
#ifndef ENGINE_KV_INTERNAL_H
#define ENGINE_KV_INTERNAL_H

#include "engine/kv.h"

struct engine_kv_seq {
    int32_t *blocks;  /* block ids in position order (owned) */
    int32_t n_blocks; /* blocks held */
    int32_t cap;      /* capacity of blocks[] */
    int32_t n_hashed; /* leading blocks already offered to the prefix cache */
    uint64_t *chain;  /* chain hash of each of the first n_hashed blocks (owned, cap) */
};

struct engine_kv {
    int n_layer;                 /* layers */
    int n_kv_head;               /* KV heads */
    int head_dim;                /* channels per head */
    int dtype;                   /* enum kern_kv_dtype */
    int block_size;              /* tokens per block */
    int32_t n_blocks;            /* blocks in the pool */
    int n_rank;                  /* ranks holding storage (0: none) */
    struct kern_backend **be;    /* per rank: the backend holding its storage (not owned) */
    int rank_kv_head;            /* KV heads each rank stores (n_kv_head / n_rank) */
    struct kern_kv_layer *layers; /* per rank and layer: its storage (rank * n_layer + layer) */
    int32_t *ref;                /* per block: sequences holding it */
    uint64_t *hash;              /* per block: chain hash when cached/registered, else 0 */
    int32_t *btok;               /* per block: its block_size token ids (for exact matching) */
    uint64_t *phash;             /* per block: chain hash of its parent (0 for a first block) */
    int32_t *lru_prev;           /* cached free blocks, doubly linked, oldest at lru_head */
    int32_t *lru_next;           /* ... */
    int32_t lru_head;            /* least recently freed cached block, -1 if none */
    int32_t lru_tail;            /* most recently freed cached block, -1 if none */
    int32_t n_lru;               /* blocks on the LRU list */
    int32_t *free_ids;           /* stack of free, uncached blocks */
    int32_t n_free;              /* entries in free_ids */
    int32_t *table;              /* open-addressing hash -> block id, -1 empty */
    uint32_t table_mask;         /* table size - 1 (power of two) */
    int prefix_cache;            /* 1 = register and reuse full blocks */
    int max_seqs;                /* sequence slots */
    struct engine_kv_seq *seqs;  /* max_seqs slots */
    struct engine_kv_stats stats; /* counters since init */
};

#endif
