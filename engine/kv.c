/* Block pools, reference counts, LRU of cached free blocks, and the prefix-cache hash tables
 * (open addressing, linear probing, backward-shift deletion). In each pool a block is always
 * exactly one of: referenced by >= 1 sequence, free and cached (on the LRU), or free and
 * uncached. A model with sliding-window layers gets a second pool for them: a sequence's
 * tables run in parallel (one logical block, one block per pool), and engine_kv_slide gives
 * back the second pool's blocks that no future position can attend to. */
#include "engine/kv_internal.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define CHAIN_SEED 0x9E3779B97F4A7C15ull

size_t engine_kv_bytes_per_token(int n_layer, int n_kv_head, int head_dim, int dtype)
{
    /* K and V: per layer and KV head, one token's share of a tile */
    return (size_t)n_layer * 2 * (size_t)n_kv_head * KERN_KV_TILE_BYTES(dtype, 1, head_dim);
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Chain hash of a block of tokens after a parent with chain hash parent (0 = none). Never 0. */
static uint64_t chain_hash(uint64_t parent, const int32_t *tok, int n)
{
    uint64_t h = mix64(parent ^ CHAIN_SEED);
    for (int i = 0; i < n; i++)
        h = mix64(h ^ (uint32_t)tok[i]);
    return h ? h : 1;
}

/* The parent hash of a sequence's first block: 0, or one of its variant's own (variants never
 * share blocks). */
static uint64_t chain_root(const struct engine_kv_seq *s)
{
    return s->variant ? mix64(0x5A17ull + s->variant) | 1 : 0;
}

/* ---- a pool's bookkeeping ---- */

static int pool_init(struct kv_pool *p, int32_t n_blocks, int block_size, int n_layer)
{
    memset(p, 0, sizeof(*p));
    p->n_blocks = n_blocks;
    p->n_layer = n_layer;
    uint32_t tsize = 16;
    while (tsize < 2u * (uint32_t)n_blocks)
        tsize *= 2;
    p->table_mask = tsize - 1;
    size_t nb = (size_t)n_blocks;
    p->ref = calloc(nb, sizeof(*p->ref));
    p->hash = calloc(nb, sizeof(*p->hash));
    p->phash = calloc(nb, sizeof(*p->phash));
    p->btok = malloc(nb * (size_t)block_size * sizeof(*p->btok));
    p->lru_prev = malloc(nb * sizeof(*p->lru_prev));
    p->lru_next = malloc(nb * sizeof(*p->lru_next));
    p->free_ids = malloc(nb * sizeof(*p->free_ids));
    p->table = malloc((size_t)tsize * sizeof(*p->table));
    if (!p->ref || !p->hash || !p->phash || !p->btok || !p->lru_prev || !p->lru_next ||
        !p->free_ids || !p->table)
        return -1;
    for (int32_t i = 0; i < n_blocks; i++)
        p->free_ids[i] = n_blocks - 1 - i; /* pop order 0, 1, 2, ... */
    p->n_free = n_blocks;
    p->lru_head = p->lru_tail = -1;
    memset(p->table, 0xff, (size_t)tsize * sizeof(*p->table));
    return 0;
}

/* What one rank stores of pool p (kern_ops.kv_alloc and the ops on its blocks). */
static struct kern_kv_desc pool_desc(const struct engine_kv *kv, const struct kv_pool *p)
{
    return (struct kern_kv_desc){p->n_layer, kv->rank_kv_head, kv->head_dim, kv->block_size,
                                 kv->dtype};
}

static void pool_free(struct engine_kv *kv, struct kv_pool *p)
{
    if (p->layers) {
        struct kern_kv_desc d = pool_desc(kv, p);
        for (int r = 0; r < kv->n_rank; r++)
            kv->be[r]->ops->kv_free(kv->be[r], &d, p->n_blocks, p->layers + (size_t)r * p->n_layer);
        free(p->layers);
    }
    free(p->table);
    free(p->free_ids);
    free(p->lru_next);
    free(p->lru_prev);
    free(p->btok);
    free(p->phash);
    free(p->hash);
    free(p->ref);
}

enum status engine_kv_init(struct engine_kv **out, int n_layer, int n_kv_head, int head_dim,
                           int dtype, int block_size, int32_t n_blocks, int max_seqs,
                           int prefix_cache, struct err_detail *err)
{
    *out = NULL;
    if (n_layer < 1 || n_kv_head < 1 || head_dim < 1 || block_size < 1 || block_size > 4096 ||
        n_blocks < 1 || n_blocks > (1 << 28) || max_seqs < 1 ||
        (dtype != KERN_KV_F16 && dtype != KERN_KV_Q8))
        return err_set(err, ST_ERR_INVALID_ARG, "bad KV cache geometry");
    struct engine_kv *kv = calloc(1, sizeof(*kv));
    if (!kv)
        return err_set(err, ST_ERR_NOMEM, "no memory for the KV cache");
    kv->n_layer = n_layer;
    kv->n_kv_head = n_kv_head;
    kv->head_dim = head_dim;
    kv->dtype = dtype;
    kv->block_size = block_size;
    kv->max_seqs = max_seqs;
    kv->prefix_cache = prefix_cache;
    kv->n_pool = 1;
    kv->seqs = calloc((size_t)max_seqs, sizeof(*kv->seqs));
    kv->layer_pool = calloc((size_t)n_layer, sizeof(*kv->layer_pool));
    kv->layer_idx = malloc((size_t)n_layer * sizeof(*kv->layer_idx));
    if (pool_init(&kv->pool[0], n_blocks, block_size, n_layer) || !kv->seqs || !kv->layer_pool ||
        !kv->layer_idx) {
        engine_kv_free(kv);
        return err_set(err, ST_ERR_NOMEM, "no memory for a KV cache of %d blocks x %d tokens",
                       n_blocks, block_size);
    }
    for (int l = 0; l < n_layer; l++)
        kv->layer_idx[l] = l;
    *out = kv;
    return ST_OK;
}

enum status engine_kv_set_window(struct engine_kv *kv, const uint8_t *local, int window,
                                 int32_t n_local_blocks, struct err_detail *err)
{
    int n_local = 0;
    for (int l = 0; l < kv->n_layer; l++)
        n_local += local[l] != 0;
    if (kv->n_pool != 1 || kv->n_rank || window < 1 || n_local < 1 || n_local == kv->n_layer ||
        n_local_blocks < 1 || n_local_blocks > kv->pool[0].n_blocks)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "sliding-window KV pool: %d of %d layers local, window %d, %d blocks (of "
                       "%d), before any storage",
                       n_local, kv->n_layer, window, n_local_blocks, kv->pool[0].n_blocks);
    for (int i = 0; i < kv->max_seqs; i++)
        assert(kv->seqs[i].n_blocks == 0);
    if (pool_init(&kv->pool[1], n_local_blocks, kv->block_size, n_local)) {
        pool_free(kv, &kv->pool[1]);
        memset(&kv->pool[1], 0, sizeof(kv->pool[1]));
        return err_set(err, ST_ERR_NOMEM, "no memory for the sliding-window KV pool");
    }
    int idx[2] = {0, 0};
    for (int l = 0; l < kv->n_layer; l++) {
        kv->layer_pool[l] = local[l] != 0;
        kv->layer_idx[l] = idx[kv->layer_pool[l]]++;
    }
    kv->pool[0].n_layer = kv->n_layer - n_local;
    kv->window = window;
    kv->n_pool = 2;
    return ST_OK;
}

void engine_kv_free(struct engine_kv *kv)
{
    if (!kv)
        return;
    if (kv->seqs)
        for (int i = 0; i < kv->max_seqs; i++) {
            free(kv->seqs[i].blocks[0]);
            free(kv->seqs[i].blocks[1]);
            free(kv->seqs[i].chain);
        }
    free(kv->seqs);
    for (int p = 0; p < kv->n_pool; p++)
        pool_free(kv, &kv->pool[p]);
    free(kv->be);
    free(kv->layer_idx);
    free(kv->layer_pool);
    free(kv);
}

/* ---- hash table ---- */

static int block_matches(const struct kv_pool *p, int B, int32_t b, uint64_t h, uint64_t parent,
                         const int32_t *tok)
{
    return p->hash[b] == h && p->phash[b] == parent &&
           !memcmp(p->btok + (size_t)b * B, tok, sizeof(int32_t) * (size_t)B);
}

static int32_t table_find(const struct kv_pool *p, int B, uint64_t h, uint64_t parent,
                          const int32_t *tok)
{
    for (uint32_t i = (uint32_t)h & p->table_mask;; i = (i + 1) & p->table_mask) {
        int32_t b = p->table[i];
        if (b < 0)
            return -1;
        if (block_matches(p, B, b, h, parent, tok))
            return b;
    }
}

static void table_insert(struct kv_pool *p, int32_t b)
{
    uint32_t i = (uint32_t)p->hash[b] & p->table_mask;
    while (p->table[i] >= 0)
        i = (i + 1) & p->table_mask;
    p->table[i] = b;
}

static void table_remove(struct kv_pool *p, int32_t b)
{
    uint32_t i = (uint32_t)p->hash[b] & p->table_mask;
    while (p->table[i] != b) {
        assert(p->table[i] >= 0);
        i = (i + 1) & p->table_mask;
    }
    /* backward-shift deletion keeps every probe chain intact without tombstones */
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & p->table_mask;
        int32_t c = p->table[j];
        if (c < 0)
            break;
        uint32_t home = (uint32_t)p->hash[c] & p->table_mask;
        /* move c into the hole at i unless its home lies cyclically in (i, j] */
        if (((j - home) & p->table_mask) >= ((j - i) & p->table_mask)) {
            p->table[i] = c;
            i = j;
        }
    }
    p->table[i] = -1;
}

/* Register block b of p under (h, parent, tok) unless it or an identical block already is. */
static void block_register(struct kv_pool *p, int B, int32_t b, uint64_t h, uint64_t parent,
                           const int32_t *tok)
{
    if (p->hash[b] || table_find(p, B, h, parent, tok) >= 0)
        return;
    p->hash[b] = h;
    p->phash[b] = parent;
    memcpy(p->btok + (size_t)b * B, tok, sizeof(int32_t) * (size_t)B);
    table_insert(p, b);
}

/* Make b (held by one sequence, about to be overwritten) unfindable. */
static void block_unregister(struct kv_pool *p, int32_t b)
{
    assert(p->ref[b] == 1 && "truncating into a shared block");
    if (p->hash[b]) {
        table_remove(p, b);
        p->hash[b] = 0;
    }
}

/* ---- LRU of cached free blocks ---- */

static void lru_push(struct kv_pool *p, int32_t b)
{
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0)
        p->lru_next[p->lru_tail] = b;
    else
        p->lru_head = b;
    p->lru_tail = b;
    p->n_lru++;
}

static void lru_unlink(struct kv_pool *p, int32_t b)
{
    if (p->lru_prev[b] >= 0)
        p->lru_next[p->lru_prev[b]] = p->lru_next[b];
    else
        p->lru_head = p->lru_next[b];
    if (p->lru_next[b] >= 0)
        p->lru_prev[p->lru_next[b]] = p->lru_prev[b];
    else
        p->lru_tail = p->lru_prev[b];
    p->n_lru--;
}

/* ---- allocation ---- */

static int32_t block_take(struct engine_kv *kv, struct kv_pool *p)
{
    int32_t b;
    if (p->n_free) {
        b = p->free_ids[--p->n_free];
    } else {
        b = p->lru_head;
        assert(b >= 0);
        lru_unlink(p, b);
        table_remove(p, b);
        p->hash[b] = 0;
        kv->stats.evictions++;
    }
    p->ref[b] = 1;
    return b;
}

static void block_put(struct kv_pool *p, int32_t b)
{
    assert(p->ref[b] > 0);
    if (--p->ref[b])
        return;
    if (p->hash[b])
        lru_push(p, b);
    else
        p->free_ids[p->n_free++] = b;
}

/* A cached block gains a holder: off the LRU if it was free. */
static void block_hold(struct kv_pool *p, int32_t b)
{
    if (p->ref[b] == 0)
        lru_unlink(p, b);
    p->ref[b]++;
}

static enum status seq_grow(struct engine_kv_seq *s, int32_t need, struct err_detail *err)
{
    if (need <= s->cap)
        return ST_OK;
    int32_t cap = s->cap ? s->cap : 8;
    while (cap < need)
        cap *= 2;
    for (int p = 0; p < 2; p++) {
        int32_t *nb = realloc(s->blocks[p], sizeof(int32_t) * (size_t)cap);
        if (!nb)
            return err_set(err, ST_ERR_NOMEM, "no memory for a block table");
        s->blocks[p] = nb;
    }
    uint64_t *nc = realloc(s->chain, sizeof(uint64_t) * (size_t)cap);
    if (!nc)
        return err_set(err, ST_ERR_NOMEM, "no memory for a block table");
    s->chain = nc;
    s->cap = cap;
    return ST_OK;
}

/* First block of the window of position pos: blocks before it no query at pos or later reads
 * (kern_attn_first: pos attends to pos - window < p <= pos). */
static int32_t window_lo(const struct engine_kv *kv, int32_t pos)
{
    int32_t first = pos + 1 - kv->window;
    return first > 0 ? first / kv->block_size : 0;
}

int32_t engine_kv_blocks_needed(const struct engine_kv *kv, int seq, int32_t n_tokens)
{
    int32_t need = (n_tokens + kv->block_size - 1) / kv->block_size;
    int32_t have = kv->seqs[seq].n_blocks;
    return need > have ? need - have : 0;
}

static int32_t pool_available(const struct kv_pool *p)
{
    return p->n_free + p->n_lru;
}

int32_t engine_kv_available(const struct engine_kv *kv)
{
    int32_t a = pool_available(&kv->pool[0]);
    if (kv->n_pool > 1 && pool_available(&kv->pool[1]) < a)
        a = pool_available(&kv->pool[1]);
    return a;
}

enum status engine_kv_reserve(struct engine_kv *kv, int seq, int32_t n_tokens,
                              struct err_detail *err)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    int32_t more = engine_kv_blocks_needed(kv, seq, n_tokens);
    if (!more)
        return ST_OK;
    if (more > engine_kv_available(kv))
        return err_set(err, ST_ERR_RANGE, "KV cache full: need %d more blocks, %d available", more,
                       engine_kv_available(kv));
    enum status st = seq_grow(s, s->n_blocks + more, err);
    if (st)
        return st;
    while (more--) {
        s->blocks[0][s->n_blocks] = block_take(kv, &kv->pool[0]);
        s->blocks[1][s->n_blocks] = kv->n_pool > 1 ? block_take(kv, &kv->pool[1]) : -1;
        s->n_blocks++;
    }
    return ST_OK;
}

/* Drop the last logical block of s. */
static void seq_pop(struct engine_kv *kv, struct engine_kv_seq *s)
{
    s->n_blocks--;
    block_put(&kv->pool[0], s->blocks[0][s->n_blocks]);
    if (kv->n_pool > 1 && s->n_blocks >= s->lo)
        block_put(&kv->pool[1], s->blocks[1][s->n_blocks]);
}

void engine_kv_truncate(struct engine_kv *kv, int seq, int32_t n_tokens)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    int32_t keep = (n_tokens + kv->block_size - 1) / kv->block_size;
    while (s->n_blocks > keep)
        seq_pop(kv, s);
    if (s->lo > s->n_blocks)
        s->lo = s->n_blocks;
    int32_t full = n_tokens / kv->block_size;
    if (s->n_hashed > full) {
        /* a kept partial block will be overwritten: it must not stay findable */
        if (full < s->n_blocks) {
            block_unregister(&kv->pool[0], s->blocks[0][full]);
            if (kv->n_pool > 1 && full >= s->lo)
                block_unregister(&kv->pool[1], s->blocks[1][full]);
        }
        s->n_hashed = full;
    }
}

void engine_kv_release(struct engine_kv *kv, int seq)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    /* free in reverse so a chain's first blocks are evicted last */
    while (s->n_blocks)
        seq_pop(kv, s);
    s->lo = 0;
    s->n_hashed = 0;
    s->variant = 0;
}

void engine_kv_set_variant(struct engine_kv *kv, int seq, uint32_t variant)
{
    assert(kv->seqs[seq].n_blocks == 0);
    kv->seqs[seq].variant = variant;
}

uint32_t engine_kv_variant(const struct engine_kv *kv, int seq)
{
    return kv->seqs[seq].variant;
}

void engine_kv_slide(struct engine_kv *kv, int seq, int32_t n_done)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    if (kv->n_pool < 2)
        return;
    int32_t lo = window_lo(kv, n_done);
    if (lo > s->n_blocks)
        lo = s->n_blocks;
    for (; s->lo < lo; s->lo++) {
        block_put(&kv->pool[1], s->blocks[1][s->lo]);
        s->blocks[1][s->lo] = -1;
    }
}

/* ---- prefix cache ---- */

/* 1 when pool 1 has, cached, the blocks a sequence attached to blocks [0, k) needs: those of
 * the window of position k * block_size (chain hashes in s->chain). */
static int window_cached(const struct engine_kv *kv, const struct engine_kv_seq *s,
                         const int32_t *tokens, int32_t k)
{
    const int B = kv->block_size;
    for (int32_t i = window_lo(kv, k * B); i < k; i++)
        if (table_find(&kv->pool[1], B, s->chain[i], i ? s->chain[i - 1] : chain_root(s),
                       tokens + (size_t)i * B) < 0)
            return 0;
    return 1;
}

int32_t engine_kv_prefix_attach(struct engine_kv *kv, int seq, const int32_t *tokens,
                                int32_t n_tokens, int32_t max_tokens)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    assert(s->n_blocks == 0);
    if (!kv->prefix_cache)
        return 0;
    const int B = kv->block_size;
    int32_t n_full = (n_tokens < max_tokens ? n_tokens : max_tokens) / B;
    kv->stats.lookup_blocks += (uint64_t)n_full;
    if (n_full < 1 || seq_grow(s, n_full, NULL))
        return 0;
    /* the longest run of cached blocks in pool 0 ... */
    int32_t k = 0;
    for (uint64_t parent = chain_root(s); k < n_full; k++) {
        const int32_t *tok = tokens + (size_t)k * B;
        uint64_t h = chain_hash(parent, tok, B);
        int32_t b = table_find(&kv->pool[0], B, h, parent, tok);
        if (b < 0)
            break;
        s->blocks[0][k] = b;
        s->chain[k] = h;
        parent = h;
    }
    /* ... cut to where pool 1 also has the window's blocks */
    while (kv->n_pool > 1 && k > 0 && !window_cached(kv, s, tokens, k))
        k--;
    s->lo = kv->n_pool > 1 ? window_lo(kv, k * B) : 0;
    for (int32_t i = 0; i < k; i++) {
        block_hold(&kv->pool[0], s->blocks[0][i]);
        s->blocks[1][i] = -1;
        if (kv->n_pool > 1 && i >= s->lo) {
            s->blocks[1][i] =
                table_find(&kv->pool[1], B, s->chain[i], i ? s->chain[i - 1] : chain_root(s),
                           tokens + (size_t)i * B);
            block_hold(&kv->pool[1], s->blocks[1][i]);
        }
    }
    s->n_blocks = s->n_hashed = k;
    if (k == 0)
        s->lo = 0;
    kv->stats.hit_blocks += (uint64_t)k;
    return k * B;
}

/* Block src of pool q copied to block dst on every rank that stores it. */
static void block_copy(struct engine_kv *kv, int q, int32_t dst, int32_t src)
{
    struct kv_pool *p = &kv->pool[q];
    const struct kern_kv_desc d = pool_desc(kv, p);
    for (int r = 0; r < kv->n_rank; r++)
        kv->be[r]->ops->kv_copy(kv->be[r], &d, p->layers + (size_t)r * p->n_layer, dst, src);
}

int engine_kv_fork(struct engine_kv *kv, int dst, int src, int32_t n_tokens)
{
    struct engine_kv_seq *d = &kv->seqs[dst];
    const struct engine_kv_seq *s = &kv->seqs[src];
    const int B = kv->block_size;
    assert(d->n_blocks == 0 && dst != src && n_tokens > 0);
    const int32_t full = n_tokens / B, n_blk = (n_tokens + B - 1) / B;
    /* pool 1: the blocks of the window of position n_tokens, which dst computes next */
    const int32_t lo = kv->n_pool > 1 ? window_lo(kv, n_tokens) : 0;
    if (n_blk > s->n_blocks || lo < s->lo || (n_blk > full && engine_kv_available(kv) < 1) ||
        seq_grow(d, n_blk, NULL))
        return 0;
    for (int32_t i = 0; i < full; i++) {
        block_hold(&kv->pool[0], d->blocks[0][i] = s->blocks[0][i]);
        d->blocks[1][i] = -1;
        if (kv->n_pool > 1 && i >= lo)
            block_hold(&kv->pool[1], d->blocks[1][i] = s->blocks[1][i]);
    }
    if (n_blk > full) { /* the partly filled block: dst's own copy (full >= lo) */
        d->blocks[0][full] = block_take(kv, &kv->pool[0]);
        block_copy(kv, 0, d->blocks[0][full], s->blocks[0][full]);
        d->blocks[1][full] = -1;
        if (kv->n_pool > 1) {
            d->blocks[1][full] = block_take(kv, &kv->pool[1]);
            block_copy(kv, 1, d->blocks[1][full], s->blocks[1][full]);
        }
    }
    d->n_blocks = n_blk;
    d->lo = lo;
    d->variant = s->variant;
    d->n_hashed = full < s->n_hashed ? full : s->n_hashed;
    if (d->n_hashed)
        memcpy(d->chain, s->chain, sizeof(*d->chain) * (size_t)d->n_hashed);
    kv->stats.forked_blocks += (uint64_t)full;
    kv->stats.copied_blocks += (uint64_t)(n_blk - full);
    return 1;
}

void engine_kv_prefix_commit(struct engine_kv *kv, int seq, const int32_t *tokens,
                             int32_t n_computed)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    if (!kv->prefix_cache)
        return;
    const int B = kv->block_size;
    int32_t full = n_computed / B;
    if (full > s->n_blocks)
        full = s->n_blocks;
    for (int32_t i = s->n_hashed; i < full; i++) {
        const int32_t *tok = tokens + (size_t)i * B;
        uint64_t parent = i ? s->chain[i - 1] : chain_root(s);
        uint64_t h = chain_hash(parent, tok, B);
        s->chain[i] = h;
        block_register(&kv->pool[0], B, s->blocks[0][i], h, parent, tok);
        if (kv->n_pool > 1 && i >= s->lo)
            block_register(&kv->pool[1], B, s->blocks[1][i], h, parent, tok);
    }
    if (full > s->n_hashed)
        s->n_hashed = full;
}

void engine_kv_prefix_clear(struct engine_kv *kv)
{
    for (int q = 0; q < kv->n_pool; q++) {
        struct kv_pool *p = &kv->pool[q];
        while (p->lru_head >= 0) {
            int32_t b = p->lru_head;
            lru_unlink(p, b);
            p->free_ids[p->n_free++] = b;
        }
        for (int32_t b = 0; b < p->n_blocks; b++)
            p->hash[b] = 0;
        memset(p->table, 0xff, ((size_t)p->table_mask + 1) * sizeof(*p->table));
    }
}

/* engine_kv_check for pool q. */
static enum status pool_check(const struct engine_kv *kv, int q, int expect_empty,
                              struct err_detail *err)
{
    const struct kv_pool *p = &kv->pool[q];
    int32_t *refs = calloc((size_t)p->n_blocks, sizeof(int32_t));
    uint8_t *where = calloc((size_t)p->n_blocks, 1); /* 1 free, 2 lru */
    enum status st = ST_OK;
    if (!refs || !where) {
        free(refs);
        free(where);
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    for (int i = 0; i < kv->max_seqs && !st; i++) {
        const struct engine_kv_seq *s = &kv->seqs[i];
        for (int32_t j = 0; j < s->n_blocks && !st; j++) {
            int32_t b = s->blocks[q][j];
            if (q == 1 && j < s->lo) {
                if (b != -1)
                    st = err_set(err, ST_ERR_INTERNAL,
                                 "slot %d: released window block %d "
                                 "still in its table",
                                 i, j);
            } else if (b < 0 || b >= p->n_blocks) {
                st =
                    err_set(err, ST_ERR_INTERNAL, "slot %d: block %d of pool %d is %d", i, j, q, b);
            } else {
                refs[b]++;
            }
        }
    }
    for (int32_t i = 0; i < p->n_free && !st; i++) {
        int32_t b = p->free_ids[i];
        if (where[b] || p->hash[b])
            st = err_set(err, ST_ERR_INTERNAL, "free block %d listed twice or still hashed", b);
        where[b] = 1;
    }
    int32_t n_lru = 0;
    for (int32_t b = p->lru_head; b >= 0 && !st; b = p->lru_next[b], n_lru++) {
        if (where[b] || !p->hash[b])
            st = err_set(err, ST_ERR_INTERNAL, "LRU block %d listed twice or not hashed", b);
        where[b] = 2;
    }
    if (!st && n_lru != p->n_lru)
        st = err_set(err, ST_ERR_INTERNAL, "LRU holds %d blocks, counter says %d", n_lru, p->n_lru);
    for (int32_t b = 0; b < p->n_blocks && !st; b++) {
        if (refs[b] != p->ref[b])
            st = err_set(err, ST_ERR_INTERNAL, "block %d: refcount %d, tables hold %d", b,
                         p->ref[b], refs[b]);
        else if ((refs[b] > 0) == (where[b] != 0))
            st = err_set(err, ST_ERR_INTERNAL, "block %d is %s", b,
                         refs[b] ? "both held and free" : "neither held nor free (leaked)");
        else if (expect_empty && refs[b])
            st = err_set(err, ST_ERR_INTERNAL, "block %d still held by a sequence (leak)", b);
        else if (p->hash[b] && table_find(p, kv->block_size, p->hash[b], p->phash[b],
                                          p->btok + (size_t)b * kv->block_size) < 0)
            st = err_set(err, ST_ERR_INTERNAL, "hashed block %d is not findable", b);
    }
    free(refs);
    free(where);
    if (st && q)
        err_prefix(err, "sliding-window pool");
    return st;
}

enum status engine_kv_check(const struct engine_kv *kv, int expect_empty, struct err_detail *err)
{
    enum status st = ST_OK;
    for (int q = 0; q < kv->n_pool && !st; q++)
        st = pool_check(kv, q, expect_empty, err);
    for (int i = 0; i < kv->max_seqs && !st && kv->n_pool > 1; i++) {
        const struct engine_kv_seq *s = &kv->seqs[i];
        if (s->lo > s->n_blocks)
            st = err_set(err, ST_ERR_INTERNAL, "slot %d: window starts at block %d of %d", i, s->lo,
                         s->n_blocks);
    }
    return st;
}

const int32_t *engine_kv_table(const struct engine_kv *kv, int seq)
{
    return kv->seqs[seq].blocks[0];
}

const int32_t *engine_kv_table_pool(const struct engine_kv *kv, int seq, int pool)
{
    assert(pool >= 0 && pool < kv->n_pool);
    return kv->seqs[seq].blocks[pool];
}

enum status engine_kv_storage_alloc(struct engine_kv *kv, struct kern_backend *const *be,
                                    int n_rank, struct err_detail *err)
{
    assert(!kv->n_rank && !kv->be && n_rank >= 1 && kv->n_kv_head % n_rank == 0);
    kv->be = calloc((size_t)n_rank, sizeof(*kv->be));
    if (!kv->be)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    kv->rank_kv_head = kv->n_kv_head / n_rank;
    for (int q = 0; q < kv->n_pool; q++) {
        struct kv_pool *p = &kv->pool[q];
        p->layers = calloc((size_t)p->n_layer * (size_t)n_rank, sizeof(*p->layers));
        if (!p->layers)
            return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    for (int r = 0; r < n_rank; r++) {
        kv->be[r] = be[r];
        for (int q = 0; q < kv->n_pool; q++) {
            struct kv_pool *p = &kv->pool[q];
            struct kern_kv_desc d = pool_desc(kv, p);
            enum status st = be[r]->ops->kv_alloc(be[r], &d, p->n_blocks,
                                                  p->layers + (size_t)r * p->n_layer, err);
            if (st) {
                /* free what this rank got; engine_kv_free frees the ranks before it */
                for (int u = 0; u < q; u++) {
                    struct kv_pool *pu = &kv->pool[u];
                    struct kern_kv_desc du = pool_desc(kv, pu);
                    be[r]->ops->kv_free(be[r], &du, pu->n_blocks,
                                        pu->layers + (size_t)r * pu->n_layer);
                }
                return st;
            }
        }
        kv->n_rank = r + 1;
    }
    return ST_OK;
}

struct kern_kv_layer engine_kv_layer(const struct engine_kv *kv, int rank, int layer)
{
    assert(rank >= 0 && rank < kv->n_rank && layer >= 0 && layer < kv->n_layer);
    const struct kv_pool *p = &kv->pool[kv->layer_pool[layer]];
    return p->layers[(size_t)rank * p->n_layer + kv->layer_idx[layer]];
}

int engine_kv_layer_pool(const struct engine_kv *kv, int layer)
{
    assert(layer >= 0 && layer < kv->n_layer);
    return kv->layer_pool[layer];
}

int engine_kv_n_pools(const struct engine_kv *kv)
{
    return kv->n_pool;
}

int32_t engine_kv_n_blocks(const struct engine_kv *kv)
{
    return kv->pool[0].n_blocks;
}

int32_t engine_kv_pool_blocks(const struct engine_kv *kv, int pool)
{
    return pool < kv->n_pool ? kv->pool[pool].n_blocks : 0;
}

int32_t engine_kv_pool_used(const struct engine_kv *kv, int pool)
{
    return pool < kv->n_pool ? kv->pool[pool].n_blocks - pool_available(&kv->pool[pool]) : 0;
}

int32_t engine_kv_seq_held(const struct engine_kv *kv, int seq, int pool)
{
    const struct engine_kv_seq *s = &kv->seqs[seq];
    return pool == 0 ? s->n_blocks : pool < kv->n_pool ? s->n_blocks - s->lo : 0;
}

int engine_kv_block_size(const struct engine_kv *kv)
{
    return kv->block_size;
}

int engine_kv_max_seqs(const struct engine_kv *kv)
{
    return kv->max_seqs;
}

int32_t engine_kv_seq_blocks(const struct engine_kv *kv, int seq)
{
    assert(seq >= 0 && seq < kv->max_seqs);
    return kv->seqs[seq].n_blocks;
}

int engine_kv_n_rank(const struct engine_kv *kv)
{
    return kv->n_rank;
}

const struct engine_kv_stats *engine_kv_get_stats(const struct engine_kv *kv)
{
    return &kv->stats;
}

void engine_kv_stats_reset(struct engine_kv *kv)
{
    memset(&kv->stats, 0, sizeof(kv->stats));
}
