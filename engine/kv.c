/* Block pool and per-sequence block tables for the KV cache. */
#include "engine/kv.h"

#include <stdlib.h>

size_t engine_kv_bytes_per_token(int n_layer, int kv_dim)
{
    return (size_t)n_layer * 2 * (size_t)kv_dim * sizeof(float);
}

enum status engine_kv_init(struct engine_kv **out, int n_layer, int kv_dim, int block_size,
                           int32_t n_blocks, int max_seqs, struct err_detail *err)
{
    *out = NULL;
    if (n_layer < 1 || kv_dim < 1 || block_size < 1 || n_blocks < 1 || max_seqs < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "bad KV cache geometry");
    struct engine_kv *kv = calloc(1, sizeof(*kv));
    if (!kv)
        return err_set(err, ST_ERR_NOMEM, "no memory for the KV cache");
    kv->n_layer = n_layer;
    kv->kv_dim = kv_dim;
    kv->block_size = block_size;
    kv->n_blocks = n_blocks;
    kv->max_seqs = max_seqs;
    size_t per_layer = (size_t)n_blocks * (size_t)block_size * (size_t)kv_dim;
    kv->k = calloc(per_layer * (size_t)n_layer, sizeof(float));
    kv->v = calloc(per_layer * (size_t)n_layer, sizeof(float));
    kv->free_ids = malloc(sizeof(int32_t) * (size_t)n_blocks);
    kv->seqs = calloc((size_t)max_seqs, sizeof(*kv->seqs));
    if (!kv->k || !kv->v || !kv->free_ids || !kv->seqs) {
        engine_kv_free(kv);
        return err_set(err, ST_ERR_NOMEM, "no memory for a KV cache of %d blocks x %d tokens",
                       n_blocks, block_size);
    }
    for (int32_t i = 0; i < n_blocks; i++)
        kv->free_ids[i] = n_blocks - 1 - i; /* pop order 0, 1, 2, ... */
    kv->n_free = n_blocks;
    *out = kv;
    return ST_OK;
}

void engine_kv_free(struct engine_kv *kv)
{
    if (!kv)
        return;
    if (kv->seqs)
        for (int i = 0; i < kv->max_seqs; i++)
            free(kv->seqs[i].blocks);
    free(kv->seqs);
    free(kv->free_ids);
    free(kv->k);
    free(kv->v);
    free(kv);
}

enum status engine_kv_reserve(struct engine_kv *kv, int seq, int32_t n_tokens,
                              struct err_detail *err)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    int32_t need = (n_tokens + kv->block_size - 1) / kv->block_size;
    if (need <= s->n_blocks)
        return ST_OK;
    if (need - s->n_blocks > kv->n_free)
        return err_set(err, ST_ERR_RANGE, "KV cache full: need %d more blocks, %d free",
                       need - s->n_blocks, kv->n_free);
    if (need > s->cap) {
        int32_t cap = s->cap ? s->cap : 8;
        while (cap < need)
            cap *= 2;
        int32_t *nb = realloc(s->blocks, sizeof(int32_t) * (size_t)cap);
        if (!nb)
            return err_set(err, ST_ERR_NOMEM, "no memory for a block table");
        s->blocks = nb;
        s->cap = cap;
    }
    while (s->n_blocks < need)
        s->blocks[s->n_blocks++] = kv->free_ids[--kv->n_free];
    return ST_OK;
}

void engine_kv_truncate(struct engine_kv *kv, int seq, int32_t n_tokens)
{
    struct engine_kv_seq *s = &kv->seqs[seq];
    int32_t keep = (n_tokens + kv->block_size - 1) / kv->block_size;
    while (s->n_blocks > keep)
        kv->free_ids[kv->n_free++] = s->blocks[--s->n_blocks];
}

int32_t engine_kv_free_blocks(const struct engine_kv *kv) { return kv->n_free; }

const int32_t *engine_kv_table(const struct engine_kv *kv, int seq) { return kv->seqs[seq].blocks; }

struct kern_kv_layer engine_kv_layer(const struct engine_kv *kv, int layer)
{
    size_t per_layer = (size_t)kv->n_blocks * (size_t)kv->block_size * (size_t)kv->kv_dim;
    struct kern_kv_layer l = {kv->k + per_layer * (size_t)layer, kv->v + per_layer * (size_t)layer};
    return l;
}
