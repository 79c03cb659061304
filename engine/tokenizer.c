/* Tokenizer loading: the vocabulary, merges (byte-level BPE) or scores (SentencePiece) and
 * special tokens from GGUF metadata into the immutable struct engine_tok, with its GPT-2 byte
 * <-> unicode mapping, pre-tokenizer regexes and hash tables. Encoding is in
 * engine/tokenizer_encode.c and engine/tokenizer_spm.c, decoding in engine/tokenizer_decode.c. */
#include "engine/tokenizer_internal.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/utf8.h"

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

size_t engine_tok_text_len(const struct engine_tok *t, int32_t id)
{
    return t->text_off[id + 1] - t->text_off[id];
}

const char *engine_tok_text(const struct engine_tok *t, int32_t id)
{
    return t->text + t->text_off[id];
}

/* Id of the token with this text in the normal (byte-decoded) or the literal class; -1. */
int32_t engine_tok_text_map_find(const struct engine_tok *t, const char *s, size_t n, int normal)
{
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->text_map_mask;
    for (;; i = (i + 1) & t->text_map_mask) {
        int32_t id = t->text_map[i];
        if (id < 0)
            return -1;
        if ((t->kind[id] == TOK_KIND_NORMAL) == (normal != 0) && engine_tok_text_len(t, id) == n &&
            memcmp(engine_tok_text(t, id), s, n) == 0)
            return id;
    }
}

int32_t engine_tok_raw_find(const struct engine_tok *t, const char *s, size_t n)
{
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->raw_map_mask;
    for (;; i = (i + 1) & t->raw_map_mask) {
        int32_t id = t->raw_map[i];
        if (id < 0)
            return -1;
        if (t->raw_off[id + 1] - t->raw_off[id] == n && memcmp(t->raw + t->raw_off[id], s, n) == 0)
            return id;
    }
}

/* SentencePiece: id into the raw-text table unless its text is there already (first wins). */
static void raw_map_insert(struct engine_tok *t, int32_t id)
{
    const char *s = t->raw + t->raw_off[id];
    const size_t n = t->raw_off[id + 1] - t->raw_off[id];
    if (engine_tok_raw_find(t, s, n) >= 0)
        return;
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->raw_map_mask;
    while (t->raw_map[i] >= 0)
        i = (i + 1) & t->raw_map_mask;
    t->raw_map[i] = id;
}

/* Insert id unless a token with the same text and class is already there (first id wins);
 * byte-fallback tokens stay out (their byte is also some normal token's text). */
static void text_map_insert(struct engine_tok *t, int32_t id)
{
    if (t->kind[id] == TOK_KIND_BYTE)
        return;
    int normal = t->kind[id] == TOK_KIND_NORMAL;
    if (engine_tok_text_map_find(t, engine_tok_text(t, id), engine_tok_text_len(t, id), normal) >=
        0)
        return;
    uint32_t i =
        (uint32_t)hash_bytes(engine_tok_text(t, id), engine_tok_text_len(t, id)) & t->text_map_mask;
    while (t->text_map[i] >= 0)
        i = (i + 1) & t->text_map_mask;
    t->text_map[i] = id;
}

const struct tok_merge *engine_tok_merge_find(const struct engine_tok *t, int32_t l, int32_t r)
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

/* Llama 3 ("llama-bpe") and Qwen2 ("qwen2"): case-insensitive contractions, letters with one
 * leading non-letter, digits in runs of up to three (qwen2: one by one), punctuation with
 * trailing newlines, newline runs, spaces:
 * (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
#define RE_LLAMA3(DIGITS)                                                                          \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"     \
    "\\p{N}" DIGITS "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS      \
    "])|[" WS "]+"
static const char re_llama3_src[] = RE_LLAMA3("{1,3}");
static const char re_qwen2_src[] = RE_LLAMA3("");

/* Mistral's tekken (Nemo, Ministral, Mistral Small 3): a word is an optional non-letter, then
 * capitals (and marks) before lower case or lower case after capitals, so "HelloWorld" splits
 * into two; digits one by one; punctuation with trailing newlines or slashes:
 * [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
 * [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
 *  ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
#define TK_UP "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"
#define TK_LO "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"
#define RE_CASED(CONTRACTION, DIGITS)                                                              \
    "[^\\r\\n\\p{L}\\p{N}]?" TK_UP "*" TK_LO "+" CONTRACTION "|[^\\r\\n\\p{L}\\p{N}]?" TK_UP       \
    "+" TK_LO "*" CONTRACTION "|\\p{N}" DIGITS "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n/]*|[" WS          \
    "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+"
static const char re_tekken_src[] = RE_CASED("", "");
/* o200k's (GPT-4o; Phi-4-mini's GGUFs name it "gpt-4o"): tekken's words, each with an optional
 * contraction after it (any case), and digits in runs of up to three (tiktoken's o200k_base):
 * ...UP*LO+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|...UP+LO*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}|... */
static const char re_gpt4o_src[] = RE_CASED("(?i:'s|'t|'re|'ve|'m|'ll|'d)?", "{1,3}");

/* The byte-level BPE pre-tokenizers by tokenizer.ggml.pre name: an optional digit split, then
 * the word regex. */
static const struct {
    const char *name;
    int digits;        /* 1: every digit its own piece first (smollm) */
    const char *words; /* the word regex */
    int whole_words;   /* engine_tok.whole_words */
} g_pre[] = {
    {"default", 0, re_words_src, 0},
    {"gpt2", 0, re_words_src, 0},
    {"gpt-2", 0, re_words_src, 0},
    {"smollm", 1, re_words_src, 0},
    {"llama-bpe", 0, re_llama3_src, 1},
    {"llama3", 0, re_llama3_src, 1},
    {"llama-v3", 0, re_llama3_src, 1},
    {"qwen2", 0, re_qwen2_src, 0},
    /* DeepSeek R1's Qwen distills name Qwen2's otherwise; cl100k's (Phi-4, DBRX) is Llama 3's
     * regex without the whole-word lookup (as llama.cpp maps them) */
    {"deepseek-r1-qwen", 0, re_qwen2_src, 0},
    {"dbrx", 0, re_llama3_src, 0},
    {"tekken", 0, re_tekken_src, 1},
    /* (no whole-word lookup, as llama.cpp runs it) */
    {"gpt-4o", 0, re_gpt4o_src, 0},
};

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
    size_t lx = engine_tok_text_len(t, x), ly = engine_tok_text_len(t, y);
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

/* Texts that mark the end of a turn in common chat formats: a token with one of them is a
 * control token that ends generation, whatever its type says (as llama.cpp), except a
 * user-defined "</s>" (Gemma's HTML tag: see the vocabulary load). */
static const char *const eog_texts[] = {
    "<|im_end|>",    "<|endoftext|>",   "<|eot_id|>", "<|eom_id|>", "<|end|>",
    "<end_of_turn>", "<|end_of_text|>", "</s>",       "<EOT>",      "<end_of_utterance>",
};

static int is_eog_text(const char *s, size_t n)
{
    for (size_t i = 0; i < sizeof(eog_texts) / sizeof(eog_texts[0]); i++)
        if (strlen(eog_texts[i]) == n && !memcmp(eog_texts[i], s, n))
            return 1;
    return 0;
}

/* SentencePiece: the scores, the GGUF texts and their table (the merges look tokens up by the
 * text with U+2581 for spaces, as the vocabulary writes them). */
static enum status load_spm(struct engine_tok *t, const struct io_gguf *g,
                            const struct io_gguf_str *toks, struct err_detail *err)
{
    const void *sc;
    uint64_t n_sc;
    enum status st = io_gguf_get_arr(g, "tokenizer.ggml.scores", IO_GGUF_FLOAT32, &sc, &n_sc, err);
    if (st)
        return st;
    if (n_sc != (uint64_t)t->n_vocab)
        return err_set(err, ST_ERR_FORMAT, "tokenizer.ggml.scores has %llu entries, tokens %d",
                       (unsigned long long)n_sc, t->n_vocab);
    const size_t n = (size_t)t->n_vocab;
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += toks[i].len;
    t->score = malloc(sizeof(float) * n);
    t->raw = malloc(total + 1);
    t->raw_off = malloc(sizeof(uint32_t) * (n + 1));
    t->raw_map_mask = table_size_for(n) - 1;
    t->raw_map = malloc(sizeof(int32_t) * ((size_t)t->raw_map_mask + 1));
    if (!t->score || !t->raw || !t->raw_off || !t->raw_map)
        return err_set(err, ST_ERR_NOMEM, "allocating the SentencePiece vocabulary");
    memcpy(t->score, sc, sizeof(float) * n);
    memset(t->raw_map, 0xff, sizeof(int32_t) * ((size_t)t->raw_map_mask + 1));
    uint32_t off = 0;
    for (size_t i = 0; i < n; i++) {
        t->raw_off[i] = off;
        memcpy(t->raw + off, toks[i].ptr, toks[i].len);
        off += (uint32_t)toks[i].len;
    }
    t->raw_off[n] = off;
    for (int32_t i = 0; i < t->n_vocab; i++)
        raw_map_insert(t, i);
    return ST_OK;
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
    for (int b = 0; b < 256; b++)
        t->byte_id[b] = -1;

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
        else if (ty == 6 && t->spm)
            k = TOK_KIND_BYTE;
        t->kind[i] = (uint8_t)k;
        t->text_off[i] = off;
        const unsigned char *src = (const unsigned char *)toks[i].ptr;
        size_t len = (size_t)toks[i].len;
        unsigned char *dst = (unsigned char *)t->text + off;
        unsigned bv;
        char tail;
        if (k == TOK_KIND_BYTE) { /* "<0xXX>": that byte */
            char hex[8] = {0};
            memcpy(hex, src, len < 7 ? len : 7);
            /* two hex digits exactly: %2x alone takes a sign ("<0x-1>" would be byte ~0u) */
            if (len != 6 || !isxdigit((unsigned char)hex[3]) || !isxdigit((unsigned char)hex[4]) ||
                sscanf(hex, "<0x%2x%c", &bv, &tail) != 2 || tail != '>' || bv > 255)
                return err_set(err, ST_ERR_FORMAT, "byte token %llu has text '%.*s', not <0xXX>",
                               (unsigned long long)i, (int)(len > 16 ? 16 : len),
                               (const char *)src);
            dst[0] = (unsigned char)bv;
            len = 1;
            if (t->byte_id[bv] < 0)
                t->byte_id[bv] = (int32_t)i;
        } else if (k == TOK_KIND_NORMAL && t->spm) { /* U+2581 is a space */
            size_t o = 0;
            for (size_t j = 0; j < len; j++) {
                if (j + 2 < len && !memcmp(src + j, "\xE2\x96\x81", 3)) {
                    dst[o++] = ' ';
                    j += 2;
                } else {
                    dst[o++] = src[j];
                }
            }
            len = o;
        } else if (k == TOK_KIND_NORMAL) {
            len = byte_level_decode(src, len, dst, cp_to_byte);
        } else if (len) {
            memcpy(dst, src, len);
        }
        /* a vocabulary that types an end-of-turn marker as text has it as control all the same
         * (as llama.cpp does), except "</s>" declared user-defined: in Gemma's that is HTML's
         * strikethrough end among the other tags, text to Hugging Face's tokenizer and
         * vLLM (it ended Gemma's output wherever it wrote one) */
        if (is_eog_text(t->text + off, len) &&
            (k == TOK_KIND_NORMAL ||
             (k == TOK_KIND_USER && !(len == 4 && !memcmp(t->text + off, "</s>", 4)))))
            t->kind[i] = TOK_KIND_CONTROL;
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
        if ((t->kind[i] == TOK_KIND_CONTROL || t->kind[i] == TOK_KIND_USER) &&
            engine_tok_text_len(t, i))
            t->special[t->n_special++] = i;
    }
    qsort_r(t->special, t->n_special, sizeof(*t->special), cmp_special, t);

    if (t->spm)
        return load_spm(t, g, toks, err);
    /* Vocabularies may lack tokens for bytes that never occur in UTF-8 text (SmolLM2 has no
     * 0xC0, 0xF5..0xFF, and a few control characters): those bytes get -1 and are dropped. */
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_id[b] = engine_tok_text_map_find(t, &c, 1, 1);
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
        int32_t l = engine_tok_text_map_find(t, (const char *)buf, ll, 1);
        int32_t r = engine_tok_text_map_find(t, (const char *)buf + ll, rl, 1);
        int32_t mg = engine_tok_text_map_find(t, (const char *)buf, ll + rl, 1);
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

static enum status tok_load(struct engine_tok *t, const struct io_gguf *g, struct err_detail *err)
{
    struct io_gguf_str s;
    enum status st = io_gguf_get_str(g, "tokenizer.ggml.model", &s, err);
    if (st == ST_ERR_NOT_FOUND)
        return err_set(err, ST_ERR_NOT_FOUND, "the model has no tokenizer (tokenizer.ggml.model)");
    if (st != ST_OK)
        return st;
    if (io_gguf_str_eq(s, "llama"))
        t->spm = 1;
    else if (!io_gguf_str_eq(s, "gpt2"))
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "tokenizer model '%.*s' is not supported ('gpt2' byte-level BPE, 'llama' "
                       "SentencePiece)",
                       (int)(s.len > 64 ? 64 : s.len), s.ptr);

    int pre = 0; /* g_pre[0]: default */
    st = io_gguf_get_str(g, "tokenizer.ggml.pre", &s, err);
    if (st == ST_OK && !t->spm) {
        for (pre = 0; pre < (int)(sizeof(g_pre) / sizeof(g_pre[0])); pre++)
            if (io_gguf_str_eq(s, g_pre[pre].name))
                break;
        if (pre == (int)(sizeof(g_pre) / sizeof(g_pre[0])))
            return err_set(err, ST_ERR_UNSUPPORTED,
                           "pre-tokenizer '%.*s' is not supported (supported: default, gpt2, "
                           "smollm, llama-bpe, qwen2, deepseek-r1-qwen, dbrx, tekken, gpt-4o)",
                           (int)(s.len > 64 ? 64 : s.len), s.ptr);
    } else if (st != ST_OK && st != ST_ERR_NOT_FOUND) {
        return st;
    }

    int16_t cp_to_byte[512];
    for (int i = 0; i < 512; i++)
        cp_to_byte[i] = (int16_t)byte_from_cp((uint32_t)i);

    if ((st = load_vocab(t, g, cp_to_byte, err)) != ST_OK)
        return st;
    if (!t->spm && (st = load_merges(t, g, cp_to_byte, err)) != ST_OK)
        return st;

    t->bos = t->eos = t->unk = -1;
    t->spm_space_prefix = 1;
    if (t->spm) {
        st = io_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &t->spm_space_prefix, err);
        if (st != ST_OK && st != ST_ERR_NOT_FOUND)
            return st;
        if ((st = load_opt_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk, err)))
            return st;
    }
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
        int32_t id = engine_tok_text_map_find(t, eog_texts[i], strlen(eog_texts[i]), 0);
        if (id >= 0 && t->kind[id] == TOK_KIND_CONTROL)
            add_eog(t, id);
    }

    if (t->spm)
        return ST_OK;
    if (g_pre[pre].digits && (st = compile_re(&t->re_digit, re_digit_src, err)) != ST_OK)
        return st;
    t->whole_words = g_pre[pre].whole_words;
    return compile_re(&t->re_words, g_pre[pre].words, err);
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
    free(t->score);
    free(t->raw);
    free(t->raw_off);
    free(t->raw_map);
    free(t);
}
