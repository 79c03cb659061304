/* Byte-level BPE tokenizer: loads the vocabulary, merges and special tokens from GGUF metadata
 * and turns text into ids (special split -> PCRE2 pre-tokenizer -> rank-ordered merges) and ids
 * back into bytes. Nothing is cached between calls, so a loaded tokenizer is shareable. */
#include "engine/tokenizer.h"

#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/log.h"
#include "common/utf8.h"

/* How a token behaves, derived from tokenizer.ggml.token_type. */
enum tok_kind {
    TOK_KIND_NORMAL = 0, /* text is byte-level encoded; produced by BPE */
    TOK_KIND_CONTROL,    /* control or unknown: literal text, parsed only on request */
    TOK_KIND_USER,       /* user-defined: literal text, always parsed and printed */
    TOK_KIND_UNUSED,     /* unused slot: never parsed, prints nothing */
};

/* One merge rule in the open-addressing pair table. */
struct tok_merge {
    uint64_t key;   /* (left id << 32) | right id; TOK_EMPTY_KEY when the slot is free */
    int32_t rank;   /* priority: lower merges first (index in tokenizer.ggml.merges) */
    int32_t merged; /* id of the concatenated token */
};

#define TOK_EMPTY_KEY UINT64_MAX

struct engine_tok {
    int32_t n_vocab;          /* number of tokens */
    char *text;               /* all token texts back to back (decoded for normal tokens) */
    uint32_t *text_off;       /* n_vocab + 1 offsets into text */
    uint8_t *kind;            /* n_vocab enum tok_kind values */
    int32_t *text_map;        /* open-addressing table of ids keyed by (text, is_normal) */
    uint32_t text_map_mask;   /* table size - 1 (power of two) */
    struct tok_merge *merges; /* open-addressing pair table */
    uint32_t merge_mask;      /* table size - 1 (power of two) */
    int32_t byte_id[256];     /* the single-byte token for each byte value, or -1 */
    int32_t *special;         /* control + user-defined ids, longest text first */
    size_t n_special;         /* entries in special */
    int32_t eog[16];          /* end-of-generation ids */
    size_t n_eog;             /* entries in eog */
    int32_t bos;              /* beginning of sequence, -1 if none */
    int32_t eos;              /* end of sequence, -1 if none */
    int add_bos;              /* tokenizer.ggml.add_bos_token */
    size_t max_piece;         /* longest token text in bytes */
    pcre2_code *re_digit;     /* \p{N}: splits digits one by one; NULL when not used */
    pcre2_code *re_words;     /* the GPT-2 word regex */
};

/* ---- the GPT-2 byte <-> unicode mapping ---- */

/* GPT-2 maps bytes that are printable Latin-1 to themselves and the rest, in byte order, to
 * U+0100 onwards, so every byte becomes a visible character. */
static int byte_is_printable(int b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* Byte for the code point of a byte-level encoded character, or -1 if cp encodes no byte. */
static int byte_from_cp(uint32_t cp)
{
    if (cp < 256)
        return byte_is_printable((int)cp) ? (int)cp : -1;
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        if (byte_is_printable(b))
            continue;
        if (cp == 256 + n)
            return b;
        n++;
    }
    return -1;
}

/* Byte-level decode src into dst (room for srclen bytes; decoding never grows the text).
 * Characters that encode no byte are copied through as UTF-8. Returns the decoded length. */
static size_t byte_level_decode(const unsigned char *src, size_t srclen, unsigned char *dst,
                                const int16_t *cp_to_byte)
{
    size_t o = 0;
    for (size_t i = 0; i < srclen;) {
        uint32_t cp;
        size_t l = utf8_decode(src + i, srclen - i, &cp, NULL);
        if (l == 0) {
            dst[o++] = src[i++];
            continue;
        }
        int b = cp < 512 ? cp_to_byte[cp] : -1;
        if (b >= 0) {
            dst[o++] = (unsigned char)b;
        } else {
            memcpy(dst + o, src + i, l);
            o += l;
        }
        i += l;
    }
    return o;
}

/* ---- hash tables ---- */

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33; /* murmur3 finaliser */
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint32_t table_size_for(uint64_t n)
{
    uint32_t cap = 16;
    while (cap < 2 * n)
        cap <<= 1;
    return cap;
}

static size_t tok_text_len(const struct engine_tok *t, int32_t id)
{
    return t->text_off[id + 1] - t->text_off[id];
}

static const char *tok_text(const struct engine_tok *t, int32_t id)
{
    return t->text + t->text_off[id];
}

/* Id of the token with this text in the normal (byte-decoded) or the literal class; -1. */
static int32_t text_map_find(const struct engine_tok *t, const char *s, size_t n, int normal)
{
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->text_map_mask;
    for (;; i = (i + 1) & t->text_map_mask) {
        int32_t id = t->text_map[i];
        if (id < 0)
            return -1;
        if ((t->kind[id] == TOK_KIND_NORMAL) == (normal != 0) && tok_text_len(t, id) == n &&
            memcmp(tok_text(t, id), s, n) == 0)
            return id;
    }
}

/* Insert id unless a token with the same text and class is already there (first id wins). */
static void text_map_insert(struct engine_tok *t, int32_t id)
{
    int normal = t->kind[id] == TOK_KIND_NORMAL;
    if (text_map_find(t, tok_text(t, id), tok_text_len(t, id), normal) >= 0)
        return;
    uint32_t i = (uint32_t)hash_bytes(tok_text(t, id), tok_text_len(t, id)) & t->text_map_mask;
    while (t->text_map[i] >= 0)
        i = (i + 1) & t->text_map_mask;
    t->text_map[i] = id;
}

static const struct tok_merge *merge_find(const struct engine_tok *t, int32_t l, int32_t r)
{
    uint64_t key = ((uint64_t)(uint32_t)l << 32) | (uint32_t)r;
    uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
    for (;; i = (i + 1) & t->merge_mask) {
        const struct tok_merge *m = &t->merges[i];
        if (m->key == key)
            return m;
        if (m->key == TOK_EMPTY_KEY)
            return NULL;
    }
}

/* Insert a rule; an existing rule for the same pair keeps its (lower) rank. */
static void merge_insert(struct engine_tok *t, int32_t l, int32_t r, int32_t rank, int32_t merged)
{
    uint64_t key = ((uint64_t)(uint32_t)l << 32) | (uint32_t)r;
    uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
    for (;; i = (i + 1) & t->merge_mask) {
        struct tok_merge *m = &t->merges[i];
        if (m->key == key)
            return;
        if (m->key == TOK_EMPTY_KEY) {
            m->key = key;
            m->rank = rank;
            m->merged = merged;
            return;
        }
    }
}

/* ---- loading ---- */

/* The White_Space property, as llama.cpp and Oniguruma use for \s (PCRE2's UCP \s omits
 * U+0085). */
#define WS                                                                                         \
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"             \
    "\\x{202F}\\x{205F}\\x{3000}"

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static const char re_words_src[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS
                                   "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])|[" WS "]+";
static const char re_digit_src[] = "\\p{N}";

static enum status compile_re(pcre2_code **out, const char *src, struct err_detail *err)
{
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof(msg));
        return err_set(err, ST_ERR_INTERNAL, "compiling pre-tokenizer regex at %zu: %s", (size_t)eo,
                       (const char *)msg);
    }
    /* JIT is an optimisation only: the interpreter runs the same pattern when it fails. */
    if (pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) != 0)
        LOG_DEBUG("tokenizer: PCRE2 JIT unavailable, using the interpreter");
    *out = re;
    return ST_OK;
}

/* Read an optional token id key into *out (left as is when absent). */
static enum status load_opt_id(const struct io_gguf *g, const char *key, int32_t n_vocab,
                               int32_t *out, struct err_detail *err)
{
    uint32_t v;
    enum status st = io_gguf_get_u32(g, key, &v, err);
    if (st == ST_ERR_NOT_FOUND)
        return ST_OK;
    if (st != ST_OK)
        return st;
    if (v >= (uint32_t)n_vocab)
        return err_set(err, ST_ERR_FORMAT, "%s = %u is outside the vocabulary (%d tokens)", key, v,
                       n_vocab);
    *out = (int32_t)v;
    return ST_OK;
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const struct engine_tok *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    size_t lx = tok_text_len(t, x), ly = tok_text_len(t, y);
    if (lx != ly)
        return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

static void add_eog(struct engine_tok *t, int32_t id)
{
    if (id < 0 || t->n_eog == sizeof(t->eog) / sizeof(t->eog[0]))
        return;
    for (size_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return;
    t->eog[t->n_eog++] = id;
}

static enum status load_vocab(struct engine_tok *t, const struct io_gguf *g,
                              const int16_t *cp_to_byte, struct err_detail *err)
{
    const struct io_gguf_str *toks;
    uint64_t n;
    enum status st = io_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n, err);
    if (st != ST_OK)
        return st;
    if (n == 0 || n > INT32_MAX / 2)
        return err_set(err, ST_ERR_FORMAT, "tokenizer.ggml.tokens has %llu entries",
                       (unsigned long long)n);
    t->n_vocab = (int32_t)n;

    const void *types = NULL;
    uint64_t n_types = 0;
    st = io_gguf_get_arr(g, "tokenizer.ggml.token_type", IO_GGUF_INT32, &types, &n_types, err);
    if (st == ST_ERR_NOT_FOUND)
        types = NULL;
    else if (st != ST_OK)
        return st;
    else if (n_types != n)
        return err_set(err, ST_ERR_FORMAT,
                       "tokenizer.ggml.token_type has %llu entries, "
                       "tokens has %llu",
                       (unsigned long long)n_types, (unsigned long long)n);

    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++)
        total += toks[i].len;
    if (total > UINT32_MAX - 1)
        return err_set(err, ST_ERR_FORMAT, "token texts too large (%llu bytes)",
                       (unsigned long long)total);

    t->text = malloc(total + 1);
    t->text_off = malloc((n + 1) * sizeof(*t->text_off));
    t->kind = malloc(n);
    if (!t->text || !t->text_off || !t->kind)
        return err_set(err, ST_ERR_NOMEM, "allocating the vocabulary");

    uint32_t off = 0;
    for (uint64_t i = 0; i < n; i++) {
        int32_t ty = 1;
        if (types)
            memcpy(&ty, (const unsigned char *)types + 4 * i, 4);
        enum tok_kind k = TOK_KIND_NORMAL;
        if (ty == 2 || ty == 3)
            k = TOK_KIND_CONTROL;
        else if (ty == 4)
            k = TOK_KIND_USER;
        else if (ty == 5)
            k = TOK_KIND_UNUSED;
        t->kind[i] = (uint8_t)k;
        t->text_off[i] = off;
        const unsigned char *src = (const unsigned char *)toks[i].ptr;
        size_t len = (size_t)toks[i].len;
        if (k == TOK_KIND_NORMAL) {
            len = byte_level_decode(src, len, (unsigned char *)t->text + off, cp_to_byte);
        } else if (len) {
            memcpy(t->text + off, src, len);
        }
        off += (uint32_t)len;
        if (len > t->max_piece)
            t->max_piece = len;
    }
    t->text_off[n] = off;

    t->text_map_mask = table_size_for(n) - 1;
    t->text_map = malloc(((size_t)t->text_map_mask + 1) * sizeof(*t->text_map));
    t->special = malloc(n * sizeof(*t->special));
    if (!t->text_map || !t->special)
        return err_set(err, ST_ERR_NOMEM, "allocating the vocabulary index");
    memset(t->text_map, 0xff, ((size_t)t->text_map_mask + 1) * sizeof(*t->text_map));
    for (int32_t i = 0; i < t->n_vocab; i++) {
        text_map_insert(t, i);
        if ((t->kind[i] == TOK_KIND_CONTROL || t->kind[i] == TOK_KIND_USER) && tok_text_len(t, i))
            t->special[t->n_special++] = i;
    }
    qsort_r(t->special, t->n_special, sizeof(*t->special), cmp_special, t);

    /* Vocabularies may lack tokens for bytes that never occur in UTF-8 text (SmolLM2 has no
     * 0xC0, 0xF5..0xFF, and a few control characters): those bytes get -1 and are dropped. */
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_id[b] = text_map_find(t, &c, 1, 1);
    }
    return ST_OK;
}

static enum status load_merges(struct engine_tok *t, const struct io_gguf *g,
                               const int16_t *cp_to_byte, struct err_detail *err)
{
    const struct io_gguf_str *m;
    uint64_t n;
    enum status st = io_gguf_get_str_arr(g, "tokenizer.ggml.merges", &m, &n, err);
    if (st != ST_OK)
        return st;
    if (n > INT32_MAX / 2)
        return err_set(err, ST_ERR_FORMAT, "tokenizer.ggml.merges has %llu entries",
                       (unsigned long long)n);
    t->merge_mask = table_size_for(n) - 1;
    t->merges = malloc(((size_t)t->merge_mask + 1) * sizeof(*t->merges));
    size_t buf_cap = 256;
    unsigned char *buf = malloc(buf_cap);
    if (!t->merges || !buf) {
        free(buf);
        return err_set(err, ST_ERR_NOMEM, "allocating the merge table");
    }
    for (size_t i = 0; i <= t->merge_mask; i++)
        t->merges[i].key = TOK_EMPTY_KEY;

    uint64_t skipped = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s = m[i].ptr;
        size_t len = (size_t)m[i].len;
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) {
            skipped++;
            continue;
        }
        if (len > buf_cap) {
            free(buf);
            buf_cap = len;
            buf = malloc(buf_cap);
            if (!buf)
                return err_set(err, ST_ERR_NOMEM, "allocating the merge table");
        }
        /* Decode both halves next to each other: buf = left bytes ++ right bytes. */
        size_t ll = byte_level_decode((const unsigned char *)s, (size_t)(sp - s), buf, cp_to_byte);
        size_t rl = byte_level_decode((const unsigned char *)sp + 1, len - (size_t)(sp - s) - 1,
                                      buf + ll, cp_to_byte);
        int32_t l = text_map_find(t, (const char *)buf, ll, 1);
        int32_t r = text_map_find(t, (const char *)buf + ll, rl, 1);
        int32_t mg = text_map_find(t, (const char *)buf, ll + rl, 1);
        if (l < 0 || r < 0 || mg < 0) {
            skipped++;
            continue;
        }
        merge_insert(t, l, r, (int32_t)i, mg);
    }
    free(buf);
    if (skipped)
        LOG_WARN("tokenizer: ignored %llu of %llu merges that name tokens not in the vocabulary",
                 (unsigned long long)skipped, (unsigned long long)n);
    return ST_OK;
}

/* Control tokens whose text marks the end of a turn in common chat formats. */
static const char *const eog_texts[] = {
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>",      "<|eom_id|>",
    "<|end|>",    "<end_of_turn>", "<|end_of_text|>",
};

static enum status tok_load(struct engine_tok *t, const struct io_gguf *g, struct err_detail *err)
{
    struct io_gguf_str s;
    enum status st = io_gguf_get_str(g, "tokenizer.ggml.model", &s, err);
    if (st == ST_ERR_NOT_FOUND)
        return err_set(err, ST_ERR_NOT_FOUND, "the model has no tokenizer (tokenizer.ggml.model)");
    if (st != ST_OK)
        return st;
    if (!io_gguf_str_eq(s, "gpt2"))
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "tokenizer model '%.*s' is not supported (only 'gpt2' byte-level BPE)",
                       (int)(s.len > 64 ? 64 : s.len), s.ptr);

    int digits = 0;
    st = io_gguf_get_str(g, "tokenizer.ggml.pre", &s, err);
    if (st == ST_OK) {
        if (io_gguf_str_eq(s, "smollm"))
            digits = 1;
        else if (!io_gguf_str_eq(s, "default") && !io_gguf_str_eq(s, "gpt2") &&
                 !io_gguf_str_eq(s, "gpt-2"))
            return err_set(err, ST_ERR_UNSUPPORTED,
                           "pre-tokenizer '%.*s' is not supported (supported: smollm, gpt2, "
                           "default)",
                           (int)(s.len > 64 ? 64 : s.len), s.ptr);
    } else if (st != ST_ERR_NOT_FOUND) {
        return st;
    }

    int16_t cp_to_byte[512];
    for (int i = 0; i < 512; i++)
        cp_to_byte[i] = (int16_t)byte_from_cp((uint32_t)i);

    if ((st = load_vocab(t, g, cp_to_byte, err)) != ST_OK)
        return st;
    if ((st = load_merges(t, g, cp_to_byte, err)) != ST_OK)
        return st;

    t->bos = t->eos = -1;
    int32_t eot = -1, eom = -1;
    if ((st = load_opt_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos, err)) ||
        (st = load_opt_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos, err)) ||
        (st = load_opt_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, &eot, err)) ||
        (st = load_opt_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab, &eom, err)))
        return st;
    st = io_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos, err);
    if (st == ST_ERR_NOT_FOUND)
        t->add_bos = 0;
    else if (st != ST_OK)
        return st;

    add_eog(t, t->eos);
    add_eog(t, eot);
    add_eog(t, eom);
    for (size_t i = 0; i < sizeof(eog_texts) / sizeof(eog_texts[0]); i++) {
        int32_t id = text_map_find(t, eog_texts[i], strlen(eog_texts[i]), 0);
        if (id >= 0 && t->kind[id] == TOK_KIND_CONTROL)
            add_eog(t, id);
    }

    if (digits && (st = compile_re(&t->re_digit, re_digit_src, err)) != ST_OK)
        return st;
    return compile_re(&t->re_words, re_words_src, err);
}

enum status engine_tok_load(struct engine_tok **out, const struct io_gguf *g,
                            struct err_detail *err)
{
    *out = NULL;
    struct engine_tok *t = calloc(1, sizeof(*t));
    if (!t)
        return err_set(err, ST_ERR_NOMEM, "allocating the tokenizer");
    enum status st = tok_load(t, g, err);
    if (st != ST_OK) {
        err_prefix(err, "loading tokenizer");
        engine_tok_free(t);
        return st;
    }
    *out = t;
    return ST_OK;
}

void engine_tok_free(struct engine_tok *t)
{
    if (!t)
        return;
    pcre2_code_free(t->re_digit);
    pcre2_code_free(t->re_words);
    free(t->text);
    free(t->text_off);
    free(t->kind);
    free(t->text_map);
    free(t->merges);
    free(t->special);
    free(t);
}

/* ---- encoding ---- */

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
};

static enum status enc_push(struct enc *e, int32_t id)
{
    if (e->n_out == e->cap_out) {
        size_t cap = e->cap_out ? 2 * e->cap_out : 64;
        int32_t *p = realloc(e->out, cap * sizeof(*p));
        if (!p)
            return err_set(e->err, ST_ERR_NOMEM, "growing the token buffer");
        e->out = p;
        e->cap_out = cap;
    }
    e->out[e->n_out++] = id;
    return ST_OK;
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
    const struct tok_merge *m = merge_find(e->t, e->sym[l], e->sym[r]);
    if (!m)
        return ST_OK;
    struct bpe_cand c = {m->rank, l, e->sym[l], e->sym[r]};
    return heap_push(e, c);
}

/* Apply merges to one pre-tokenized word, lowest rank first (leftmost on ties), and append the
 * resulting ids. A byte the vocabulary has no token for is dropped before merging, so its
 * neighbours may merge (as Hugging Face tokenizers does with no unk token; llama.cpp instead
 * lets such a byte block merges across it). */
static enum status bpe_word(struct enc *e, const unsigned char *w, size_t n)
{
    const struct engine_tok *t = e->t;
    if (n == 0)
        return ST_OK;
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
        e->sym[c.left] = merge_find(t, c.lid, c.rid)->merged;
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

static enum status words_split(struct enc *e, const unsigned char *s, size_t n)
{
    return re_split(e, e->t->re_words, s, n, bpe_word);
}

/* Pre-tokenize and BPE one stretch of plain (already valid UTF-8) text. */
static enum status encode_text(struct enc *e, const unsigned char *s, size_t n)
{
    if (e->t->re_digit)
        return re_split(e, e->t->re_digit, s, n, words_split);
    return words_split(e, s, n);
}

/* A stretch of the input: plain text, or a recognised special token. */
struct frag {
    size_t off; /* start in the input */
    size_t len; /* length in bytes */
    int32_t id; /* special token id, or -1 for text */
};

/* Split the text fragments at occurrences of each applicable special token, longest first.
 * On success *frags (caller frees) holds *n_frags fragments in input order. */
static enum status split_special(struct enc *e, const unsigned char *s, size_t n, unsigned flags,
                                 struct frag **frags, size_t *n_frags)
{
    const struct engine_tok *t = e->t;
    size_t cap = 16, nf = 1;
    struct frag *f = malloc(cap * sizeof(*f));
    if (!f)
        return err_set(e->err, ST_ERR_NOMEM, "allocating fragments");
    f[0] = (struct frag){0, n, -1};
    for (size_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        if (t->kind[id] == TOK_KIND_CONTROL && !(flags & ENGINE_TOK_PARSE_SPECIAL))
            continue;
        const char *tt = tok_text(t, id);
        size_t tl = tok_text_len(t, id);
        for (size_t i = 0; i < nf; i++) {
            if (f[i].id >= 0 || f[i].len < tl)
                continue;
            const unsigned char *p = memmem(s + f[i].off, f[i].len, tt, tl);
            if (!p)
                continue;
            /* Replace fragment i by [before][token][after]; "after" is scanned next. */
            if (nf + 2 > cap) {
                cap *= 2;
                struct frag *g = realloc(f, cap * sizeof(*f));
                if (!g) {
                    free(f);
                    return err_set(e->err, ST_ERR_NOMEM, "allocating fragments");
                }
                f = g;
            }
            size_t at = (size_t)(p - s), end = f[i].off + f[i].len;
            struct frag before = {f[i].off, at - f[i].off, -1};
            struct frag tok = {at, tl, id};
            struct frag after = {at + tl, end - at - tl, -1};
            size_t ins = (before.len ? 1 : 0) + 1 + (after.len ? 1 : 0);
            memmove(f + i + ins, f + i + 1, (nf - i - 1) * sizeof(*f));
            size_t j = i;
            if (before.len)
                f[j++] = before;
            f[j++] = tok;
            if (after.len)
                f[j] = after;
            nf += ins - 1;
            i = j - 1; /* the loop's i++ lands on "after" */
        }
    }
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

    e.md = pcre2_match_data_create(2, NULL);
    if (!e.md) {
        st = err_set(err, ST_ERR_NOMEM, "allocating regex match data");
        goto out;
    }
    if ((flags & ENGINE_TOK_ADD_BOS) && t->add_bos && t->bos >= 0 &&
        (st = enc_push(&e, t->bos)) != ST_OK)
        goto out;
    if (len && (st = split_special(&e, s, len, flags, &frags, &n_frags)) != ST_OK)
        goto out;
    for (size_t i = 0; i < n_frags && st == ST_OK; i++) {
        if (frags[i].id >= 0)
            st = enc_push(&e, frags[i].id);
        else
            st = encode_text(&e, s + frags[i].off, frags[i].len);
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

/* ---- queries and decoding ---- */

int32_t engine_tok_n_vocab(const struct engine_tok *t)
{
    return t->n_vocab;
}

int32_t engine_tok_bos(const struct engine_tok *t)
{
    return t->bos;
}

int32_t engine_tok_eos(const struct engine_tok *t)
{
    return t->eos;
}

int engine_tok_is_eog(const struct engine_tok *t, int32_t id)
{
    for (size_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return 1;
    return 0;
}

int32_t engine_tok_find(const struct engine_tok *t, const char *text, size_t len)
{
    int32_t id = text_map_find(t, text, len, 1);
    return id >= 0 ? id : text_map_find(t, text, len, 0);
}

/* Bytes of token id as decoding emits them; *len 0 for hidden or out-of-range tokens. */
static const char *piece_of(const struct engine_tok *t, int32_t id, int include_special,
                            size_t *len)
{
    *len = 0;
    if (id < 0 || id >= t->n_vocab)
        return "";
    enum tok_kind k = t->kind[id];
    if (k == TOK_KIND_UNUSED || (k == TOK_KIND_CONTROL && !include_special))
        return "";
    *len = tok_text_len(t, id);
    return tok_text(t, id);
}

size_t engine_tok_piece(const struct engine_tok *t, int32_t id, int include_special, char *buf,
                        size_t cap)
{
    size_t n;
    const char *p = piece_of(t, id, include_special, &n);
    if (n && cap)
        memcpy(buf, p, n < cap ? n : cap);
    return n;
}

size_t engine_tok_max_piece(const struct engine_tok *t)
{
    return t->max_piece;
}

/* Run the UTF-8 holdback over a[0..na) ++ b[0..nb). Writes output to out when non-NULL and
 * the held tail to pend/n_pend; returns the output length. */
static size_t stream_run(const unsigned char *a, size_t na, const unsigned char *b, size_t nb,
                         char *out, unsigned char *pend, int *n_pend)
{
    size_t total = na + nb, o = 0;
    *n_pend = 0;
    for (size_t i = 0; i < total;) {
        unsigned char q[4];
        size_t avail = total - i < 4 ? total - i : 4;
        for (size_t j = 0; j < avail; j++)
            q[j] = i + j < na ? a[i + j] : b[i + j - na];
        size_t l = utf8_decode(q, avail, NULL, NULL);
        if (l) {
            if (out)
                memcpy(out + o, q, l);
            o += l;
            i += l;
            continue;
        }
        /* Invalid here, but perhaps only because the sequence is cut off: hold it back. */
        if (utf8_is_prefix(q, avail)) {
            memcpy(pend, q, avail);
            *n_pend = (int)avail;
            break;
        }
        if (out)
            memcpy(out + o, "\xEF\xBF\xBD", 3);
        o += 3;
        i++;
    }
    return o;
}

size_t engine_tok_stream_push(const struct engine_tok *t, struct engine_tok_stream *s, int32_t id,
                              char *out, size_t cap)
{
    size_t n;
    const char *p = piece_of(t, id, 0, &n);
    unsigned char pend[8];
    int n_pend;
    size_t need =
        stream_run(s->pend, (size_t)s->n_pend, (const unsigned char *)p, n, NULL, pend, &n_pend);
    if (need > cap)
        return need;
    stream_run(s->pend, (size_t)s->n_pend, (const unsigned char *)p, n, out, pend, &n_pend);
    memcpy(s->pend, pend, sizeof(pend));
    s->n_pend = n_pend;
    return need;
}

size_t engine_tok_stream_flush(struct engine_tok_stream *s, char *out, size_t cap)
{
    size_t need = 3 * (size_t)s->n_pend;
    if (need > cap)
        return need;
    for (int i = 0; i < s->n_pend; i++)
        memcpy(out + 3 * i, "\xEF\xBF\xBD", 3);
    s->n_pend = 0;
    return need;
}
