/* The KV block manager's private state (engine/kv.c; the model reads a sequence's blocks
 * through engine/kv.h, tests may read this). */
#ifndef ENGINE_KV_INTERNAL_H
#define ENGINE_KV_INTERNAL_H

#include "engine/kv.h"

/* One pool of blocks: its allocator, its prefix cache and its layers' storage. Pool 0 holds
 * the global (full-attention) layers and every position of a sequence; pool 1, when the model
 * has sliding-window layers, holds those layers and only the blocks still inside the window. */
struct kv_pool {
    int32_t n_blocks;             /* blocks in the pool */
    int n_layer;                  /* model layers stored in this pool */
    struct kern_kv_layer *layers; /* per rank and pool layer: storage (rank * n_layer + i) */
    int32_t *ref;                 /* per block: sequences holding it */
    uint64_t *hash;               /* per block: chain hash when cached/registered, else 0 */
    int32_t *btok;                /* per block: its block_size token ids (for exact matching) */
    uint64_t *phash;              /* per block: chain hash of its parent (0 for a first block) */
    int32_t *lru_prev;            /* cached free blocks, doubly linked, oldest at lru_head */
    int32_t *lru_next;            /* ... */
    int32_t lru_head;             /* least recently freed cached block, -1 if none */
    int32_t lru_tail;             /* most recently freed cached block, -1 if none */
    int32_t n_lru;                /* blocks on the LRU list */
    int32_t *free_ids;            /* stack of free, uncached blocks */
    int32_t n_free;               /* entries in free_ids */
    int32_t *table;               /* open-addressing hash -> block id, -1 empty */
    uint32_t table_mask;          /* table size - 1 (power of two) */
};

struct engine_kv_seq {
    int32_t *blocks[2]; /* per pool: block ids in position order (owned); pool 1's entries
                         * below lo are -1 (released: out of every future window) */
    int32_t n_blocks;   /* logical blocks held (the tables' length) */
    int32_t lo;         /* pool 1: first entry still held */
    int32_t cap;        /* capacity of the tables and chain */
    int32_t n_hashed;   /* leading blocks already offered to the prefix cache */
    uint64_t *chain;    /* chain hash of each of the first n_hashed blocks (owned, cap) */
    uint32_t variant;   /* engine_kv_set_variant; the chain's root (0 for variant 0) */
};

struct engine_kv {
    int n_layer;                  /* layers */
    int n_kv_head;                /* KV heads */
    int head_dim;                 /* channels per head */
    int dtype;                    /* enum kern_kv_dtype */
    int block_size;               /* tokens per block */
    int n_pool;                   /* 1, or 2 with a sliding-window pool */
    struct kv_pool pool[2];       /* see struct kv_pool */
    int window;                   /* pool 1's layers attend to this many last positions */
    uint8_t *layer_pool;          /* per layer: its pool */
    int32_t *layer_idx;           /* per layer: its index among its pool's layers */
    int n_rank;                   /* ranks holding storage (0: none) */
    struct kern_backend **be;     /* per rank: the backend holding its storage (not owned) */
    int rank_kv_head;             /* KV heads each rank stores (n_kv_head / n_rank) */
    int prefix_cache;             /* 1 = register and reuse full blocks */
    int max_seqs;                 /* sequence slots */
    struct engine_kv_seq *seqs;   /* max_seqs slots */
    struct engine_kv_stats stats; /* counters since init */
};

#endif
