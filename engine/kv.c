/* Block pool, reference counts, LRU of cached free blocks, and the prefix-cache hash table
 * (open addressing, linear probing, backward-shift deletion). A block is always exactly one
 * of: referenced by >= 1 sequence, free and cached (on the LRU), or free and uncached. */
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
    kv->n_blocks = n_blocks;
    kv->max_seqs = max_seqs;
    kv->prefix_cache = prefix_cache;
    uint32_t tsize = 16;
    while (tsize < 2u * (uint32_t)n_blocks)
        tsize *= 2;
    kv->table_mask = tsize - 1;
    size_t nb = (size_t)n_blocks;
    kv->ref = calloc(nb, sizeof(*kv->ref));
    kv->hash = calloc(nb, sizeof(*kv->hash));
    kv->phash = calloc(nb, sizeof(*kv->phash));
    kv->btok = malloc(nb * (size_t)block_size * sizeof(*kv->btok));
    kv->lru_prev = malloc(nb * sizeof(*kv->lru_prev));
    kv->lru_next = malloc(nb * sizeof(*kv->lru_next));
    kv->free_ids = malloc(nb * sizeof(*kv->free_ids));
    kv->table = malloc((size_t)tsize * sizeof(*kv->table));
    kv->seqs = calloc((size_t)max_seqs, sizeof(*kv->seqs));
    if (!kv->ref || !kv->hash || !kv->phash || !kv->btok || !kv->lru_prev ||
        !kv->lru_next || !kv->free_ids || !kv->table || !kv->seqs) {
        engine_kv_free(kv);
        return err_set(err, ST_ERR_NOMEM, "no memory for a KV cache of %d blocks x %d tokens",
                       n_blocks, block_size);
    }
    for (int32_t i = 0; i < n_blocks; i++)
        kv->free_ids[i] = n_blocks - 1 - i; /* pop order 0, 1, 2, ... */
    kv->n_free = n_blocks;
    kv->lru_head = kv->lru_tail = -1;
    memset(kv->table, 0xff, (size_t)tsize * sizeof(*kv->table));
    *out = kv;
    return ST_OK;
}

void engine_kv_free(struct engine_kv *kv)
{
    if (!kv)
        return;
    if (kv->seqs)
        for (int i = 0; i < kv->max_seqs; i++) {
            free(kv->seqs[i].blocks);
            free(kv->seqs[i].chain);
        }
    free(kv->seqs);
    free(kv->table);
    free(kv->free_ids);
    free(kv->lru_next);
    free(kv->lru_prev);
    free(kv->btok);
    free(kv->phash);
    free(kv->hash);
    free(kv->ref);
    if (kv->layers) {
        struct kern_kv_desc d = {kv->n_layer, kv->rank_kv_head, kv->head_dim, kv->block_size,
                                 kv->dtype};
        for (int r = 0; r < kv->n_rank; r++)
            kv->be[r]->ops->kv_free(kv->be[r], &d, kv->n_blocks,
                                    kv->layers + (size_t)r * kv->n_layer);
        free(kv->layers);
        free(kv->be);
    }
    free(kv);
}

/* ---- hash table ---- */

static int block_matches(const struct engine_kv *kv, int32_t b, uint64_t h, uint64_t parent,
                         const int32_t *tok)
{
    return kv->hash[b] == h && kv->phash[b] == parent &&
           !memcmp(kv->btok + (size_t)b * kv->block_size, tok,
                   sizeof(int32_t) * (size_t)kv->block_size);
}

static int32_t table_find(const struct engine_kv *kv, uint64_t h, uint64_t parent,
                          const int32_t *tok)
{
    for (uint32_t i = (uint32_t)h & kv->table_mask;; i = (i + 1) & kv->table_mask) {
        int32_t b = kv->table[i];
        if (b < 0)
            return -1;
        if (block_matches(kv, b, h, parent, tok))
            return b;
    }
}

static void table_insert(struct engine_kv *kv, int32_t b)
{
    uint32_t i = (uint32_t)kv->hash[b] & kv->table_mask;
    while (kv->table[i] >= 0)
        i = (i + 1) & kv->table_mask;
    kv->table[i] = b;
}

static void table_remove(struct engine_kv *kv, int32_t b)
{
    uint32_t i = (uint32_t)kv->hash[b] & kv->table_mask;
    while (kv->table[i] != b) {
        assert(kv->table[i] >= 0);
        i = (i + 1) & kv->table_mask;
    }
    /* backward-shift deletion keeps every probe chain intact without tombstones */
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & kv->table_mask;
        int32_t c = kv->table[j];
        if (c < 0)
            break;
        uint32_t home = (uint32_t)kv->hash[c] & kv->table_mask;
        /* move c into the hole at i unless its home lies cyclically in (i, j] */
        if (((j - home) & kv->table_mask) >= ((j - i) & kv->table_mask)) {
            kv->table[i] = c;
            i = j;
        }
    }
    kv->table[i] = -1;
}

/* ---- LRU of cached free blocks ---- */

static void lru_push(struct engine_kv *kv, int32_t b)
{
    kv->lru_prev[b] = kv->lru_tail;
    kv->lru_next[b] = -1;
    if (kv->lru_tail >= 0)
        kv->lru_next[kv->lru_tail] = b;
    else
        kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_lru++;
}

static void lru_unlink(struct engine_kv *kv, int32_t b)
{
    if (kv->lru_prev[b] >= 0)
        kv->lru_next[kv->lru_prev[b]] = kv->lru_next[b];
    else
        kv->lru_head = kv->lru_next[b];
    if (kv->lru_next[b] >= 0)
        kv->lru_prev[kv->lru_next[b]] = kv->lru_prev[b];
    else
        kv->lru_tail = kv->lru_prev[b];
    kv->n_lru--;
}

/* ---- allocation ---- */

static int32_t block_take(struct engine_kv *kv)
{
    int32_t b;
    if (kv->n_free) {
        b = kv->free_ids[--kv->n_free];
    } else {
        b = kv->lru_head;
        assert(b >= 0);
        lru_unlink(kv, b);
        table_remove(kv, b);
        kv->hash[b] = 0;
        kv->stats.evictions++;
    }
    kv->ref[b] = 1;
    return b;
}

static void block_put(struct engine_kv *kv, int32_t b)
{
    assert(kv->ref[b] > 0);
    if (--kv->ref[b])
        return;
    if (kv->hash[b])
        lru_push(kv, b);
    else
        kv->free_ids[kv->n_free++] = b;
}

static enum status seq_grow(struct engine_kv_seq *s, int32_t need, struct err_detail *err)
{
    if (need <= s->cap)
        return ST_OK;
    int32_t cap = s->cap ? s->cap : 8;
    while (cap < need)
        cap *= 2;
    int32_t *nb = realloc(s->blocks, sizeof(int32_t) * (size_t)cap);
    if (nb)
        s->blocks = nb;
    uint64_t *nc = realloc(s->chain, sizeof(uint64_t) * (size_t)cap);
    if (nc)
        s->chain = nc;
    if (!nb || !nc)
        return err_set(err, ST_ERR_NOMEM, "no memory for a block table");
    s->cap = cap;
    return ST_OK;
}

int32_t engine_kv_blocks_needed(const struct engine_kv *kv, int seq, int32_t n_tokens)
{
    int32_t need = (n_tokens + kv->block_size - 1) / kv->block_size;
    int32_t have = kv->seqs[seq].n_blocks;
    return need > have ? need - have : 0;
}

int32_t engine_kv_available(const struct engine_kv *kv) { return kv->n_free + kv->n_lru; }

enum status engine_kv_reserve(struct engine_kv *kv, int seq, int32_t n_tokens,
                              struct err_detail *err)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    int32_t more = engine_kv_blocks_needed(kv, seq, n_tokens);
    if (!more)
        return ST_OK;
    if (more > engine_kv_available(kv))
        return err_set(err, ST_ERR_RANGE, "KV cache full: need %d more blocks, %d available",
                       more, engine_kv_available(kv));
    enum status st = seq_grow(s, s->n_blocks + more, err);
    if (st)
        return st;
    while (more--)
        s->blocks[s->n_blocks++] = block_take(kv);
    return ST_OK;
}

void engine_kv_truncate(struct engine_kv *kv, int seq, int32_t n_tokens)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    int32_t keep = (n_tokens + kv->block_size - 1) / kv->block_size;
    while (s->n_blocks > keep)
        block_put(kv, s->blocks[--s->n_blocks]);
    int32_t full = n_tokens / kv->block_size;
    if (s->n_hashed > full) {
        /* a kept partial block will be overwritten: it must not stay findable */
        if (full < s->n_blocks) {
            int32_t b = s->blocks[full];
            assert(kv->ref[b] == 1 && "truncating into a shared block");
            if (kv->hash[b]) {
                table_remove(kv, b);
                kv->hash[b] = 0;
            }
        }
        s->n_hashed = full;
    }
}

void engine_kv_release(struct engine_kv *kv, int seq)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    /* free in reverse so a chain's first blocks are evicted last */
    while (s->n_blocks)
        block_put(kv, s->blocks[--s->n_blocks]);
    s->n_hashed = 0;
}

/* ---- prefix cache ---- */

int32_t engine_kv_prefix_attach(struct engine_kv *kv, int seq, const int32_t *tokens,
                                int32_t n_tokens, int32_t max_tokens)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    assert(s->n_blocks == 0);
    if (!kv->prefix_cache)
        return 0;
    const int B = kv->block_size;
    int32_t n_full = (n_tokens < max_tokens ? n_tokens : max_tokens) / B;
    uint64_t parent = 0;
    kv->stats.lookup_blocks += (uint64_t)n_full;
    for (int32_t i = 0; i < n_full; i++) {
        const int32_t *tok = tokens + (size_t)i * B;
        uint64_t h = chain_hash(parent, tok, B);
        int32_t b = table_find(kv, h, parent, tok);
        if (b < 0 || seq_grow(s, i + 1, NULL))
            break;
        if (kv->ref[b] == 0)
            lru_unlink(kv, b);
        kv->ref[b]++;
        s->blocks[i] = b;
        s->chain[i] = h;
        s->n_blocks = s->n_hashed = i + 1;
        kv->stats.hit_blocks++;
        parent = h;
    }
    return s->n_blocks * B;
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
        uint64_t parent = i ? s->chain[i - 1] : 0;
        uint64_t h = chain_hash(parent, tok, B);
        int32_t b = s->blocks[i];
        s->chain[i] = h;
        if (kv->hash[b] || table_find(kv, h, parent, tok) >= 0)
            continue; /* already registered, or an identical block is */
        kv->hash[b] = h;
        kv->phash[b] = parent;
        memcpy(kv->btok + (size_t)b * B, tok, sizeof(int32_t) * (size_t)B);
        table_insert(kv, b);
    }
    if (full > s->n_hashed)
        s->n_hashed = full;
}

void engine_kv_prefix_clear(struct engine_kv *kv)
{
    while (kv->lru_head >= 0) {
        int32_t b = kv->lru_head;
        lru_unlink(kv, b);
        kv->free_ids[kv->n_free++] = b;
    }
    for (int32_t b = 0; b < kv->n_blocks; b++)
        kv->hash[b] = 0;
    memset(kv->table, 0xff, ((size_t)kv->table_mask + 1) * sizeof(*kv->table));
}

enum status engine_kv_check(const struct engine_kv *kv, int expect_empty, struct err_detail *err)
{
    int32_t *refs = calloc((size_t)kv->n_blocks, sizeof(int32_t));
    uint8_t *where = calloc((size_t)kv->n_blocks, 1); /* 1 free, 2 lru */
    enum status st = ST_OK;
    if (!refs || !where) {
        free(refs);
        free(where);
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    for (int i = 0; i < kv->max_seqs; i++)
        for (int32_t j = 0; j < kv->seqs[i].n_blocks; j++)
            refs[kv->seqs[i].blocks[j]]++;
    for (int32_t i = 0; i < kv->n_free && !st; i++) {
        int32_t b = kv->free_ids[i];
        if (where[b] || kv->hash[b])
            st = err_set(err, ST_ERR_INTERNAL, "free block %d listed twice or still hashed", b);
        where[b] = 1;
    }
    int32_t n_lru = 0;
    for (int32_t b = kv->lru_head; b >= 0 && !st; b = kv->lru_next[b], n_lru++) {
        if (where[b] || !kv->hash[b])
            st = err_set(err, ST_ERR_INTERNAL, "LRU block %d listed twice or not hashed", b);
        where[b] = 2;
    }
    if (!st && n_lru != kv->n_lru)
        st = err_set(err, ST_ERR_INTERNAL, "LRU holds %d blocks, counter says %d", n_lru,
                     kv->n_lru);
    for (int32_t b = 0; b < kv->n_blocks && !st; b++) {
        if (refs[b] != kv->ref[b])
            st = err_set(err, ST_ERR_INTERNAL, "block %d: refcount %d, tables hold %d", b,
                         kv->ref[b], refs[b]);
        else if ((refs[b] > 0) == (where[b] != 0))
            st = err_set(err, ST_ERR_INTERNAL, "block %d is %s", b,
                         refs[b] ? "both held and free" : "neither held nor free (leaked)");
        else if (expect_empty && refs[b])
            st = err_set(err, ST_ERR_INTERNAL, "block %d still held by a sequence (leak)", b);
        else if (kv->hash[b] && table_find(kv, kv->hash[b], kv->phash[b],
                                           kv->btok + (size_t)b * kv->block_size) < 0)
            st = err_set(err, ST_ERR_INTERNAL, "hashed block %d is not findable", b);
    }
    free(refs);
    free(where);
    return st;
}

int32_t engine_kv_free_blocks(const struct engine_kv *kv) { return kv->n_free + kv->n_lru; }

const int32_t *engine_kv_table(const struct engine_kv *kv, int seq) { return kv->seqs[seq].blocks; }

enum status engine_kv_storage_alloc(struct engine_kv *kv, struct kern_backend *const *be,
                                    int n_rank, struct err_detail *err)
{
    assert(!kv->layers && n_rank >= 1 && kv->n_kv_head % n_rank == 0);
    struct kern_kv_desc d = {kv->n_layer, kv->n_kv_head / n_rank, kv->head_dim, kv->block_size,
                             kv->dtype};
    kv->layers = calloc((size_t)kv->n_layer * (size_t)n_rank, sizeof(*kv->layers));
    kv->be = calloc((size_t)n_rank, sizeof(*kv->be));
    if (!kv->layers || !kv->be) {
        free(kv->layers);
        free(kv->be);
        kv->layers = NULL;
        kv->be = NULL;
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    kv->rank_kv_head = d.n_kv_head;
    for (int r = 0; r < n_rank; r++) {
        enum status st = be[r]->ops->kv_alloc(be[r], &d, kv->n_blocks,
                                              kv->layers + (size_t)r * kv->n_layer, err);
        if (st)
            return st; /* engine_kv_free frees the ranks done so far */
        kv->be[r] = be[r];
        kv->n_rank = r + 1;
    }
    return ST_OK;
}

struct kern_kv_layer engine_kv_layer(const struct engine_kv *kv, int rank, int layer)
{
    assert(rank >= 0 && rank < kv->n_rank && layer >= 0 && layer < kv->n_layer);
    return kv->layers[(size_t)rank * kv->n_layer + layer];
}

int32_t engine_kv_n_blocks(const struct engine_kv *kv)
{
    return kv->n_blocks;
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
