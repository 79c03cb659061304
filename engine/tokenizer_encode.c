/* Byte-level BPE tokenizer, encoding: text -> ids through the special-token split, the PCRE2
 * pre-tokenizer (smollm digits, GPT-2 words) and rank-ordered merges on a min-heap; invalid
 * UTF-8 becomes U+FFFD first. Nothing is cached between calls. */
#include "engine/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/utf8.h"

/* A candidate merge of a symbol with its right neighbour, in the min-heap. It is still valid
 * when popped if both symbols still have the ids they had when it was queued. */
struct bpe_cand {
    int32_t rank; /* merge rank; lower first */
    int32_t left; /* position of the left symbol */
    int32_t lid;  /* left symbol's id when queued */
    int32_t rid;  /* right neighbour's id when queued */
};

/* Per-call scratch state; one per engine_tok_encode call. */
struct enc {
    const struct engine_tok *t; /* the tokenizer */
    pcre2_match_data *md;       /* match data for both regexes */
    int32_t *out;               /* ids produced so far */
    size_t n_out, cap_out;      /* count and capacity of out */
    int32_t *sym;               /* per-byte symbol ids of the current word (-1: merged away) */
    int32_t *next;              /* next live symbol position, -1 at the end */
    int32_t *prev;              /* previous live symbol position, -1 at the start */
    size_t cap_sym;             /* capacity of sym/next/prev */
    struct bpe_cand *heap;      /* candidate merges */
    size_t n_heap, cap_heap;    /* count and capacity of heap */
    struct err_detail *err;     /* where failures are described */
    /* what a pre-tokenized word goes to: NULL = BPE; else (engine_tok_pretokenize) this */
    void (*piece)(void *ctx, const char *s, size_t n);
    void *piece_ctx;
};

enum status engine_tok_push(int32_t **v, size_t *n, size_t *cap, int32_t id,
                            struct err_detail *err)
{
    if (*n == *cap) {
        size_t c = *cap ? 2 * *cap : 64;
        int32_t *p = realloc(*v, c * sizeof(*p));
        if (!p)
            return err_set(err, ST_ERR_NOMEM, "growing the token buffer");
        *v = p;
        *cap = c;
    }
    (*v)[(*n)++] = id;
    return ST_OK;
}

static enum status enc_push(struct enc *e, int32_t id)
{
    return engine_tok_push(&e->out, &e->n_out, &e->cap_out, id, e->err);
}

static int cand_less(const struct bpe_cand *a, const struct bpe_cand *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static enum status heap_push(struct enc *e, struct bpe_cand c)
{
    if (e->n_heap == e->cap_heap) {
        size_t cap = e->cap_heap ? 2 * e->cap_heap : 256;
        struct bpe_cand *h = realloc(e->heap, cap * sizeof(*h));
        if (!h)
            return err_set(e->err, ST_ERR_NOMEM, "growing the BPE queue");
        e->heap = h;
        e->cap_heap = cap;
    }
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &e->heap[p]))
            break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = c;
    return ST_OK;
}

static struct bpe_cand heap_pop(struct enc *e)
{
    struct bpe_cand top = e->heap[0];
    struct bpe_cand last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && cand_less(&e->heap[c + 1], &e->heap[c]))
            c++;
        if (!cand_less(&e->heap[c], &last))
            break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n)
        e->heap[i] = last;
    return top;
}

/* Queue the merge of the symbol at l with its right neighbour r if the vocabulary has one. */
static enum status bpe_try(struct enc *e, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return ST_OK;
    const struct tok_merge *m = engine_tok_merge_find(e->t, e->sym[l], e->sym[r]);
    if (!m)
        return ST_OK;
    struct bpe_cand c = {m->rank, l, e->sym[l], e->sym[r]};
    return heap_push(e, c);
}

/* Apply merges to one pre-tokenized word, lowest rank first (leftmost on ties), and append the
 * resulting ids; with whole_words, a word that is a (normal) token is that token. A byte the
 * vocabulary has no token for is dropped before merging, so its neighbours may merge (as
 * Hugging Face tokenizers does with no unk token; llama.cpp instead lets such a byte block
 * merges across it). */
static enum status bpe_word(struct enc *e, const unsigned char *w, size_t n)
{
    const struct engine_tok *t = e->t;
    if (n == 0)
        return ST_OK;
    if (t->whole_words && n > 1) {
        const int32_t id = engine_tok_text_map_find(t, (const char *)w, n, 1);
        if (id >= 0)
            return enc_push(e, id);
    }
    if (n == 1)
        return t->byte_id[w[0]] >= 0 ? enc_push(e, t->byte_id[w[0]]) : ST_OK;
    if (n > INT32_MAX / 4)
        return err_set(e->err, ST_ERR_RANGE, "a single word of %zu bytes is too long", n);
    if (n > e->cap_sym) {
        free(e->sym);
        free(e->next);
        free(e->prev);
        e->sym = malloc(n * sizeof(*e->sym));
        e->next = malloc(n * sizeof(*e->next));
        e->prev = malloc(n * sizeof(*e->prev));
        e->cap_sym = n;
        if (!e->sym || !e->next || !e->prev) {
            e->cap_sym = 0;
            return err_set(e->err, ST_ERR_NOMEM, "allocating BPE scratch");
        }
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (t->byte_id[w[i]] < 0)
            continue;
        e->sym[m++] = t->byte_id[w[i]];
    }
    if (m == 0)
        return ST_OK;
    for (size_t i = 0; i < m; i++) {
        e->prev[i] = (int32_t)i - 1;
        e->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
    }
    e->n_heap = 0;
    enum status st = ST_OK;
    for (size_t i = 0; i + 1 < m && st == ST_OK; i++)
        st = bpe_try(e, (int32_t)i, (int32_t)i + 1);
    while (e->n_heap && st == ST_OK) {
        struct bpe_cand c = heap_pop(e);
        int32_t r = e->next[c.left];
        if (e->sym[c.left] != c.lid || r < 0 || e->sym[r] != c.rid)
            continue; /* stale: one side was merged since this was queued */
        e->sym[c.left] = engine_tok_merge_find(t, c.lid, c.rid)->merged;
        e->sym[r] = -1;
        int32_t nx = e->next[r];
        e->next[c.left] = nx;
        if (nx >= 0)
            e->prev[nx] = c.left;
        st = bpe_try(e, e->prev[c.left], c.left);
        if (st == ST_OK)
            st = bpe_try(e, c.left, nx);
    }
    for (int32_t i = 0; i >= 0 && st == ST_OK; i = e->next[i])
        st = enc_push(e, e->sym[i]);
    return st;
}

/* Next match of re in s[0..n) at or after start; 1 with [*ms, *me) set, 0 if none. */
static enum status re_next(struct enc *e, const pcre2_code *re, const unsigned char *s, size_t n,
                           size_t start, size_t *ms, size_t *me, int *found)
{
    int rc = pcre2_match(re, s, n, start, PCRE2_NO_UTF_CHECK, e->md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(re, s, n, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) {
        *found = 0;
        return ST_OK;
    }
    if (rc < 0) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        return err_set(e->err, ST_ERR_INTERNAL, "pre-tokenizer regex failed: %s",
                       (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
    *ms = ov[0];
    *me = ov[1];
    *found = 1;
    return ST_OK;
}

/* Split s[0..n) into matches of re and the gaps between them (both become pieces), calling
 * fn on each piece in order. */
static enum status re_split(struct enc *e, const pcre2_code *re, const unsigned char *s, size_t n,
                            enum status (*fn)(struct enc *, const unsigned char *, size_t))
{
    size_t pos = 0, gap = 0;
    enum status st;
    while (pos < n) {
        size_t ms = 0, me = 0;
        int found = 0;
        if ((st = re_next(e, re, s, n, pos, &ms, &me, &found)) != ST_OK)
            return st;
        if (!found)
            break;
        if (me == ms) { /* empty match: step over one character, it stays in the gap */
            size_t l = ms < n ? utf8_decode(s + ms, n - ms, NULL, NULL) : 0;
            pos = ms + (l ? l : 1);
            continue;
        }
        if (ms > gap && (st = fn(e, s + gap, ms - gap)) != ST_OK)
            return st;
        if ((st = fn(e, s + ms, me - ms)) != ST_OK)
            return st;
        gap = pos = me;
    }
    return gap < n ? fn(e, s + gap, n - gap) : ST_OK;
}

static enum status piece_word(struct enc *e, const unsigned char *w, size_t n)
{
    e->piece(e->piece_ctx, (const char *)w, n);
    return ST_OK;
}

static enum status words_split(struct enc *e, const unsigned char *s, size_t n)
{
    return re_split(e, e->t->re_words, s, n, e->piece ? piece_word : bpe_word);
}

static enum status encode_text(struct enc *e, const unsigned char *s, size_t n)
{
    if (e->t->re_digit)
        return re_split(e, e->t->re_digit, s, n, words_split);
    return words_split(e, s, n);
}

enum status engine_tok_pretokenize(const struct engine_tok *t, const char *s, size_t n,
                                   void (*piece)(void *ctx, const char *s, size_t n), void *ctx,
                                   struct err_detail *err)
{
    if (t->spm)
        return err_set(err, ST_ERR_INVALID_ARG, "a SentencePiece tokenizer has no pre-tokenizer");
    struct enc e = {.t = t, .err = err, .piece = piece, .piece_ctx = ctx};
    if (!(e.md = pcre2_match_data_create(2, NULL)))
        return err_set(err, ST_ERR_NOMEM, "allocating regex match data");
    enum status st = encode_text(&e, (const unsigned char *)s, n);
    pcre2_match_data_free(e.md);
    return st;
}

/* Pre-tokenize and BPE one stretch of plain (already valid UTF-8) text. */
/* A stretch of the input: plain text, or a recognised special token. */
struct frag {
    size_t off; /* start in the input */
    size_t len; /* length in bytes */
    int32_t id; /* special token id, or -1 for text */
};

/* *a with room for at least need fragments (*cap grown by doubling); 0 when out of memory (*a
 * unchanged). */
static int grow_frags(struct frag **a, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 1;
    size_t c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    struct frag *b = realloc(*a, c * sizeof(**a));
    if (!b)
        return 0;
    *a = b;
    *cap = c;
    return 1;
}

/* Split the text fragments at occurrences of each applicable special token, longest first.
 * On success *frags (caller frees) holds *n_frags fragments in input order. */
static enum status split_special(struct enc *e, const unsigned char *s, size_t n, unsigned flags,
                                 struct frag **frags, size_t *n_frags)
{
    const struct engine_tok *t = e->t;
    size_t cap = 16, nf = 1, gcap = 0;
    struct frag *f = malloc(cap * sizeof(*f)), *g = NULL;
    if (!f)
        return err_set(e->err, ST_ERR_NOMEM, "allocating fragments");
    f[0] = (struct frag){0, n, -1};
    for (size_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        if (t->kind[id] == TOK_KIND_CONTROL && !(flags & ENGINE_TOK_PARSE_SPECIAL))
            continue;
        const char *tt = engine_tok_text(t, id);
        size_t tl = engine_tok_text_len(t, id);
        /* the first text fragment holding the token; none: nothing to split */
        size_t i = 0;
        const unsigned char *p = NULL;
        for (; i < nf && !p; i++)
            if (f[i].id < 0 && f[i].len >= tl)
                p = memmem(s + f[i].off, f[i].len, tt, tl);
        if (!p)
            continue;
        i--;
        /* the fragments again into g, each text fragment from i on cut at every occurrence
         * (leftmost first, the rest after it): [before][token]...[after]. One pass per token,
         * not a shift of the array per occurrence (quadratic in lines with many of them). */
        size_t ng = 0;
        if (!grow_frags(&g, &gcap, i + 16)) {
            free(f);
            return err_set(e->err, ST_ERR_NOMEM, "allocating fragments");
        }
        memcpy(g, f, i * sizeof(*f));
        ng = i;
        for (; i < nf; i++) {
            size_t off = f[i].off, end = off + f[i].len;
            if (f[i].id < 0)
                while (end - off >= tl && (p = memmem(s + off, end - off, tt, tl)) != NULL) {
                    size_t at = (size_t)(p - s);
                    if (!grow_frags(&g, &gcap, ng + 2 + (nf - i))) {
                        free(f);
                        free(g);
                        return err_set(e->err, ST_ERR_NOMEM, "allocating fragments");
                    }
                    if (at > off)
                        g[ng++] = (struct frag){off, at - off, -1};
                    g[ng++] = (struct frag){at, tl, id};
                    off = at + tl;
                }
            if (!grow_frags(&g, &gcap, ng + 1 + (nf - i))) {
                free(f);
                free(g);
                return err_set(e->err, ST_ERR_NOMEM, "allocating fragments");
            }
            if (off < end)
                g[ng++] = (struct frag){off, end - off, f[i].id};
        }
        struct frag *tmp = f;
        f = g;
        g = tmp;
        size_t tc = cap;
        cap = gcap;
        gcap = tc;
        nf = ng;
    }
    free(g);
    *frags = f;
    *n_frags = nf;
    return ST_OK;
}

/* Offset of the first byte of s[0..n) that does not start well-formed UTF-8, or n. */
static size_t utf8_first_invalid(const unsigned char *s, size_t n)
{
    size_t i = 0, l;
    while (i < n && (l = utf8_decode(s + i, n - i, NULL, NULL)) != 0)
        i += l;
    return i;
}

/* Copy of s with every byte that does not start well-formed UTF-8 replaced by U+FFFD (the first
 * such byte is at bad); *out_len gets the new length. NULL when out of memory. */
static unsigned char *utf8_replace_invalid(const unsigned char *s, size_t n, size_t bad,
                                           size_t *out_len)
{
    unsigned char *d = n <= SIZE_MAX / 3 ? malloc(3 * n) : NULL;
    if (!d)
        return NULL;
    memcpy(d, s, bad);
    size_t o = bad;
    for (size_t i = bad; i < n;) {
        size_t l = utf8_decode(s + i, n - i, NULL, NULL);
        if (l) {
            memcpy(d + o, s + i, l);
            o += l;
            i += l;
        } else {
            memcpy(d + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    *out_len = o;
    return d;
}

enum status engine_tok_encode(const struct engine_tok *t, const char *text, size_t len,
                              unsigned flags, int32_t **ids, size_t *n_ids, struct err_detail *err)
{
    *ids = NULL;
    *n_ids = 0;
    struct enc e = {.t = t, .err = err};
    enum status st = ST_OK;
    struct frag *frags = NULL;
    size_t n_frags = 0;
    const unsigned char *s = (const unsigned char *)text;
    unsigned char *clean = NULL;
    size_t bad = len ? utf8_first_invalid(s, len) : 0;
    if (bad < len) { /* documented in tokenizer.h: invalid bytes become U+FFFD */
        if (!(clean = utf8_replace_invalid(s, len, bad, &len)))
            return err_set(err, ST_ERR_NOMEM, "copying %zu bytes of input", len);
        s = clean;
    }

    e.md = t->spm ? NULL : pcre2_match_data_create(2, NULL);
    if (!t->spm && !e.md) {
        st = err_set(err, ST_ERR_NOMEM, "allocating regex match data");
        goto out;
    }
    if ((flags & ENGINE_TOK_ADD_BOS) && t->add_bos && t->bos >= 0 &&
        (st = enc_push(&e, t->bos)) != ST_OK)
        goto out;
    if (len && (st = split_special(&e, s, len, flags, &frags, &n_frags)) != ST_OK)
        goto out;
    /* SentencePiece: a space before text at the start or after a special token, when the
     * vocabulary asks (add_space_prefix) */
    for (size_t i = 0, prev_special = 1; i < n_frags && st == ST_OK; i++) {
        if (frags[i].id >= 0)
            st = enc_push(&e, frags[i].id);
        else if (t->spm)
            st = engine_tok_spm_encode(t, s + frags[i].off, frags[i].len,
                                       t->spm_space_prefix && prev_special, &e.out, &e.n_out,
                                       &e.cap_out, err);
        else
            st = encode_text(&e, s + frags[i].off, frags[i].len);
        prev_special = frags[i].id >= 0;
    }
    if (st == ST_OK && !e.out && !(e.out = malloc(sizeof(*e.out))))
        st = err_set(err, ST_ERR_NOMEM, "allocating the token buffer"); /* empty input */

out:
    free(frags);
    free(clean);
    free(e.sym);
    free(e.next);
    free(e.prev);
    free(e.heap);
    pcre2_match_data_free(e.md);
    if (st != ST_OK) {
        free(e.out);
        return st;
    }
    *ids = e.out;
    *n_ids = e.n_out;
    return ST_OK;
}
