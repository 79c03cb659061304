/* SentencePiece-style encoding (tokenizer.ggml.model "llama": Gemma, Llama 2, Mistral) as
 * llama.cpp runs it: the text with every space written U+2581 is split into UTF-8 characters;
 * the adjacent pair whose concatenation is a token of the highest score merges first (the
 * leftmost on ties), and merging goes on while any pair forms a token; each final piece is its
 * token, or, when it is none (a character outside the vocabulary), one <0xXX> token per byte
 * (the unknown token where even that is missing). */
#include "engine/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/utf8.h"

/* A candidate merge of two adjacent symbols. */
struct spm_pair {
    float score;   /* the merged token's score: higher first */
    int32_t left;  /* left symbol; lower first on equal scores */
    int32_t right; /* right symbol */
    uint32_t size; /* bytes of the two together when queued (stale if either changed) */
};

struct spm {
    const struct engine_tok *t;
    const unsigned char *s; /* escaped text */
    int32_t *off, *len;     /* per symbol: bytes of s; len 0 once merged away */
    int32_t *prev, *next;   /* live neighbours, -1 at the ends */
    struct spm_pair *heap;
    size_t n_heap, cap_heap;
    struct err_detail *err;
};

static int pair_before(const struct spm_pair *a, const struct spm_pair *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static enum status pair_push(struct spm *p, struct spm_pair c)
{
    if (p->n_heap == p->cap_heap) {
        size_t cap = p->cap_heap ? 2 * p->cap_heap : 64;
        struct spm_pair *h = realloc(p->heap, cap * sizeof(*h));
        if (!h)
            return err_set(p->err, ST_ERR_NOMEM, "growing the SentencePiece queue");
        p->heap = h;
        p->cap_heap = cap;
    }
    size_t i = p->n_heap++;
    while (i > 0 && pair_before(&c, &p->heap[(i - 1) / 2])) {
        p->heap[i] = p->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    p->heap[i] = c;
    return ST_OK;
}

static struct spm_pair pair_pop(struct spm *p)
{
    struct spm_pair top = p->heap[0], last = p->heap[--p->n_heap];
    size_t i = 0, n = p->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && pair_before(&p->heap[c + 1], &p->heap[c]))
            c++;
        if (!pair_before(&p->heap[c], &last))
            break;
        p->heap[i] = p->heap[c];
        i = c;
    }
    if (n)
        p->heap[i] = last;
    return top;
}

/* Queue symbols l and r (adjacent) when together they are a token. */
static enum status pair_try(struct spm *p, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return ST_OK;
    const uint32_t size = (uint32_t)(p->len[l] + p->len[r]);
    const int32_t id = engine_tok_raw_find(p->t, (const char *)p->s + p->off[l], size);
    if (id < 0)
        return ST_OK;
    return pair_push(p, (struct spm_pair){p->t->score[id], l, r, size});
}

enum status engine_tok_spm_encode(const struct engine_tok *t, const unsigned char *s, size_t n,
                                  int space_prefix, int32_t **v, size_t *nv, size_t *cap,
                                  struct err_detail *err)
{
    if (n > INT32_MAX / 4)
        return err_set(err, ST_ERR_RANGE, "a text stretch of %zu bytes is too long", n);
    /* escape: spaces (and a leading one when asked) as U+2581, 3 bytes each */
    unsigned char *e = malloc(3 * n + 3);
    const size_t ns = n + 1;
    struct spm p = {.t = t, .err = err};
    p.off = malloc(sizeof(int32_t) * ns);
    p.len = malloc(sizeof(int32_t) * ns);
    p.prev = malloc(sizeof(int32_t) * ns);
    p.next = malloc(sizeof(int32_t) * ns);
    enum status st = ST_OK;
    if (!e || !p.off || !p.len || !p.prev || !p.next) {
        st = err_set(err, ST_ERR_NOMEM, "allocating SentencePiece symbols");
        goto out;
    }
    size_t m = 0;
    if (space_prefix) {
        memcpy(e, "\xE2\x96\x81", 3);
        m = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(e + m, "\xE2\x96\x81", 3);
            m += 3;
        } else {
            e[m++] = s[i];
        }
    }
    p.s = e;
    /* one symbol per UTF-8 character (the input is valid UTF-8) */
    int32_t n_sym = 0;
    for (size_t i = 0; i < m;) {
        size_t l = utf8_decode(e + i, m - i, NULL, NULL);
        l = l ? l : 1;
        p.off[n_sym] = (int32_t)i;
        p.len[n_sym] = (int32_t)l;
        p.prev[n_sym] = n_sym - 1;
        p.next[n_sym] = n_sym + 1;
        n_sym++;
        i += l;
    }
    if (!n_sym)
        goto out;
    p.next[n_sym - 1] = -1;
    for (int32_t i = 1; i < n_sym && st == ST_OK; i++)
        st = pair_try(&p, i - 1, i);
    while (st == ST_OK && p.n_heap) {
        const struct spm_pair c = pair_pop(&p);
        if (!p.len[c.left] || !p.len[c.right] ||
            (uint32_t)(p.len[c.left] + p.len[c.right]) != c.size)
            continue; /* one side merged since */
        p.len[c.left] += p.len[c.right];
        p.len[c.right] = 0;
        p.next[c.left] = p.next[c.right];
        if (p.next[c.right] >= 0)
            p.prev[p.next[c.right]] = c.left;
        if ((st = pair_try(&p, p.prev[c.left], c.left)) == ST_OK)
            st = pair_try(&p, c.left, p.next[c.left]);
    }
    for (int32_t i = 0; i >= 0 && st == ST_OK; i = p.next[i]) {
        const int32_t id = engine_tok_raw_find(t, (const char *)e + p.off[i], (size_t)p.len[i]);
        if (id >= 0) {
            st = engine_tok_push(v, nv, cap, id, err);
            continue;
        }
        for (int32_t b = 0; b < p.len[i] && st == ST_OK; b++) {
            int32_t bid = t->byte_id[e[p.off[i] + b]];
            bid = bid >= 0 ? bid : t->unk;
            if (bid >= 0)
                st = engine_tok_push(v, nv, cap, bid, err);
        }
    }
out:
    free(e);
    free(p.off);
    free(p.len);
    free(p.prev);
    free(p.next);
    free(p.heap);
    return st;
}
