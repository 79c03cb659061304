/* Helpers of the tokenizer tests (tests/test_tokenizer.c, tests/test_tokenizer_families.c):
 * encode/decode wrappers that fail the test on error, hex fixtures, the independent invalid-UTF-8
 * rule, and the reference-fixture check. */
#ifndef TESTS_TEST_TOKENIZER_UTIL_H
#define TESTS_TEST_TOKENIZER_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <zstd.h>

#include "engine/tokenizer_internal.h"
#include "io/gguf.h"
#include "tests/test_util.h"

static inline int32_t *encode(const struct engine_tok *t, const char *s, size_t n, unsigned flags,
                              size_t *n_ids)
{
    int32_t *ids;
    struct err_detail err = {0};
    enum status st = engine_tok_encode(t, s, n, flags, &ids, n_ids, &err);
    if (st != ST_OK)
        fail_msg("encode failed: %s", err.msg);
    assert_non_null(ids);
    return ids;
}

/* Concatenated pieces of ids; *len bytes in a malloc'd buffer. */
static inline char *decode(const struct engine_tok *t, const int32_t *ids, size_t n, int special,
                           size_t *len)
{
    size_t cap = 64, o = 0;
    char *s = malloc(cap);
    assert_non_null(s);
    for (size_t i = 0; i < n; i++) {
        size_t need = engine_tok_piece(t, ids[i], special, NULL, 0);
        while (o + need > cap) {
            cap *= 2;
            s = realloc(s, cap);
            assert_non_null(s);
        }
        assert_int_equal(engine_tok_piece(t, ids[i], special, s + o, need), need);
        o += need;
    }
    *len = o;
    return s;
}

static inline void format_ids(char *buf, size_t cap, const int32_t *ids, size_t n)
{
    size_t o = 0;
    buf[0] = 0;
    for (size_t i = 0; i < n && o + 16 < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%d", i ? "," : "", ids[i]);
}

static inline void assert_ids(const struct engine_tok *t, const char *s, size_t n, unsigned flags,
                              const int32_t *want, size_t n_want)
{
    size_t n_got;
    int32_t *got = encode(t, s, n, flags, &n_got);
    if (n_got != n_want || memcmp(got, want, n_want * sizeof(*want)) != 0) {
        char g[2048], w[2048];
        format_ids(g, sizeof(g), got, n_got);
        format_ids(w, sizeof(w), want, n_want);
        free(got);
        fail_msg("tokens of \"%.*s\" (flags %u):\n  got  [%s]\n  want [%s]", (int)n, s, flags, g,
                 w);
    }
    free(got);
}

static inline int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Decode a hex string into a malloc'd buffer; NULL if malformed. */
static inline char *unhex(const char *h, size_t *len)
{
    size_t n = strlen(h);
    if (n % 2)
        return NULL;
    char *s = malloc(n / 2 + 1);
    assert_non_null(s);
    for (size_t i = 0; i < n / 2; i++) {
        int a = hexval(h[2 * i]), b = hexval(h[2 * i + 1]);
        if (a < 0 || b < 0) {
            free(s);
            return NULL;
        }
        s[i] = (char)(a * 16 + b);
    }
    *len = n / 2;
    return s;
}

/* Independent reference for the documented invalid-UTF-8 rule: decode code points and
 * replace each byte that does not start a well-formed one by EF BF BD. Returns a malloc'd
 * buffer of *out_len bytes. */
static inline char *utf8_replace_invalid(const unsigned char *s, size_t n, size_t *out_len)
{
    char *d = malloc(3 * n + 1);
    assert_non_null(d);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
        int ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                ok = 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (ok && (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)))
            ok = 0;
        if (ok) {
            memcpy(d + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(d + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    *out_len = o;
    return d;
}

/* Independent reference for decoded output: well-formed characters kept, and each maximal
 * subpart of an ill-formed sequence (the longest run that Table 3-7 lets a character start
 * with) replaced by one EF BF BD, as Python's errors="replace" does. Returns a malloc'd buffer
 * of *out_len bytes. */
static inline char *utf8_lossy_ref(const unsigned char *s, size_t n, size_t *out_len)
{
    char *d = malloc(3 * n + 1);
    assert_non_null(d);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        const unsigned c = s[i];
        size_t len = 0;
        unsigned lo = 0x80, hi = 0xBF; /* the second byte's range */
        if (c < 0x80)
            len = 1;
        else if (c >= 0xC2 && c <= 0xDF)
            len = 2;
        else if (c >= 0xE0 && c <= 0xEF)
            len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        else if (c >= 0xF0 && c <= 0xF4)
            len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        size_t j = 1; /* bytes that fit a character starting at i */
        while (len && j < len && i + j < n && s[i + j] >= (j == 1 ? lo : 0x80) &&
               s[i + j] <= (j == 1 ? hi : 0xBF))
            j++;
        if (len && j == len) {
            memcpy(d + o, s + i, len);
            o += len;
        } else {
            memcpy(d + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
        i += j;
    }
    *out_len = o;
    return d;
}

/* Bytes the vocabulary has no token for are dropped by encode; remove them from s in place. */
static inline size_t drop_tokenless_bytes(const struct engine_tok *t, char *s, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++)
        if (engine_tok_find(t, s + i, 1) >= 0)
            s[o++] = s[i];
    return o;
}

/* s with each U+2581 made a space, in place; returns the new length. */
static inline size_t spaces_for_u2581(char *s, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + 2 < n && !memcmp(s + i, "\xE2\x96\x81", 3)) {
            s[o++] = ' ';
            i += 2;
        } else {
            s[o++] = s[i];
        }
    }
    return o;
}

/* Every line of the reference fixture at path (hex text, ids, optional "special") encodes to
 * its ids exactly, and each valid UTF-8 line decodes back; at least min_lines lines. */
static inline void check_fixture(const struct engine_tok *t, const char *path, size_t min_lines)
{
    size_t flen;
    char *file = test_read_file(path, &flen);
    if (!file)
        fail_msg("missing fixture %s (made by the reference-fixture generator)", path);
    size_t lines = 0, special_lines = 0, roundtrips = 0, total_ids = 0;
    char *save = NULL;
    for (char *line = strtok_r(file, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (!*line)
            continue;
        cJSON *j = cJSON_Parse(line);
        if (!j)
            fail_msg("%s line %zu: not JSON", path, lines + 1);
        const cJSON *hex = cJSON_GetObjectItemCaseSensitive(j, "hex");
        const cJSON *jids = cJSON_GetObjectItemCaseSensitive(j, "ids");
        int special = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "special"));
        if (!cJSON_IsString(hex) || !cJSON_IsArray(jids))
            fail_msg("%s line %zu: needs \"hex\" and \"ids\"", path, lines + 1);
        size_t len;
        char *text = unhex(hex->valuestring, &len);
        if (!text)
            fail_msg("%s line %zu: bad hex", path, lines + 1);
        size_t n_want = (size_t)cJSON_GetArraySize(jids);
        int32_t *want = malloc((n_want + 1) * sizeof(*want));
        assert_non_null(want);
        size_t k = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, jids) want[k++] = (int32_t)v->valuedouble;

        unsigned flags = special ? ENGINE_TOK_PARSE_SPECIAL : 0;
        size_t n_got;
        int32_t *got = encode(t, text, len, flags, &n_got);
        if (n_got != n_want || memcmp(got, want, n_want * sizeof(*want)) != 0) {
            size_t at = 0;
            while (at < n_got && at < n_want && got[at] == want[at])
                at++;
            /* Show the ids around the first difference; whole lists can be long. */
            size_t from = at > 8 ? at - 8 : 0;
            char g[1024], w[1024];
            format_ids(g, sizeof(g), got + from, n_got - from < 32 ? n_got - from : 32);
            format_ids(w, sizeof(w), want + from, n_want - from < 32 ? n_want - from : 32);
            fail_msg("%s line %zu (special=%d): first difference at id index %zu (%zu vs %zu "
                     "ids)\n  text \"%.*s\"\n  hex  %.300s\n  got  [%zu..] %s\n  want [%zu..] %s",
                     path, lines + 1, special, at, n_got, n_want, (int)(len > 300 ? 300 : len),
                     text, hex->valuestring, from, g, from, w);
        }
        /* Round trip: the pieces give back the (valid UTF-8) input, minus bytes that have no
         * token at all in this vocabulary. */
        size_t clen;
        char *clean = utf8_replace_invalid((const unsigned char *)text, len, &clen);
        if (clen == len && memcmp(clean, text, len) == 0) {
            clen = drop_tokenless_bytes(t, clean, clen);
            if (t->spm) /* SentencePiece: U+2581 is how the vocabulary writes a space */
                clen = spaces_for_u2581(clean, clen);
            size_t dl;
            char *d = decode(t, got, n_got, special, &dl);
            if (dl != clen || memcmp(d, clean, dl) != 0)
                fail_msg("%s line %zu: decode(encode(x)) != x for \"%.*s\"", path, lines + 1,
                         (int)len, text);
            free(d);
            roundtrips++;
        }
        free(clean);
        total_ids += n_got;
        special_lines += special != 0;
        lines++;
        free(got);
        free(want);
        free(text);
        cJSON_Delete(j);
    }
    free(file);
    print_message("%s: %zu lines (%zu with special tokens), %zu ids, %zu round "
                  "trips\n",
                  path, lines, special_lines, total_ids, roundtrips);
    if (lines < min_lines)
        fail_msg("%s has only %zu lines; want at least %zu", path, lines, min_lines);
}

struct gbuf {
    unsigned char data[16384]; /* the file being built */
    size_t n;                  /* bytes used */
};

static inline void gb_put(struct gbuf *b, const void *p, size_t n)
{
    assert_true(b->n + n <= sizeof(b->data));
    memcpy(b->data + b->n, p, n);
    b->n += n;
}

static inline void gb_u32(struct gbuf *b, uint32_t v)
{
    gb_put(b, &v, 4);
}

static inline void gb_u64(struct gbuf *b, uint64_t v)
{
    gb_put(b, &v, 8);
}

static inline void gb_str(struct gbuf *b, const char *s)
{
    gb_u64(b, strlen(s));
    gb_put(b, s, strlen(s));
}

/* A GGUF v3 file with no tensors and the given string metadata (NULL-terminated pairs). */
static inline void gb_build(struct gbuf *b, const char *const *kv)
{
    size_t n_kv = 0;
    while (kv[2 * n_kv])
        n_kv++;
    b->n = 0;
    gb_put(b, "GGUF", 4);
    gb_u32(b, 3);
    gb_u64(b, 0);
    gb_u64(b, n_kv);
    for (size_t i = 0; i < n_kv; i++) {
        gb_str(b, kv[2 * i]);
        gb_u32(b, 8); /* string */
        gb_str(b, kv[2 * i + 1]);
    }
    while (b->n % 32)
        b->data[b->n++] = 0;
}

/* gb_build's file opened as a GGUF (the test fails if the reader refuses it). */
static inline struct io_gguf *gb_open(struct gbuf *b, const char *const *kv)
{
    gb_build(b, kv);
    struct io_gguf *g;
    struct err_detail err = {0};
    if (io_gguf_open_mem(&g, b->data, b->n, &err) != ST_OK)
        fail_msg("in-memory GGUF rejected: %s", err.msg);
    return g;
}

static inline void expect_load_error(const char *const *kv, enum status want, const char *needle)
{
    static struct gbuf b;
    struct io_gguf *g = gb_open(&b, kv);
    struct err_detail err = {0};
    struct engine_tok *t = (struct engine_tok *)&b; /* must be reset to NULL on failure */
    enum status st = engine_tok_load(&t, g, &err);
    assert_int_equal(st, want);
    assert_null(t);
    if (!strstr(err.msg, needle))
        fail_msg("error \"%s\" does not mention \"%s\"", err.msg, needle);
    io_gguf_close(g);
}

/* iters random byte strings (biased towards UTF-8-looking bytes, so sequences are sometimes
 * valid) encode without error, and decode to the input with invalid bytes replaced, tokenless
 * bytes dropped (and U+2581 a space in SentencePiece vocabularies). */
static inline void check_random_bytes(const struct engine_tok *t, int iters)
{
    uint64_t x = 0x9E3779B97F4A7C15ull;
    unsigned char buf[300];
    for (int iter = 0; iter < iters; iter++) {
        size_t n = (size_t)(iter % 300);
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            /* Bias towards UTF-8-looking bytes so sequences are sometimes valid. */
            unsigned r = (unsigned)(x >> 24);
            buf[i] = (r & 3) == 0   ? (unsigned char)(0x80 | (r >> 8 & 0x3F))
                     : (r & 3) == 1 ? (unsigned char)(0xC2 + (r >> 8) % 0x33)
                                    : (unsigned char)(r >> 8);
        }
        unsigned flags = iter & 1 ? ENGINE_TOK_PARSE_SPECIAL : 0;
        size_t n_ids;
        int32_t *ids = encode(t, (const char *)buf, n, flags, &n_ids);
        size_t clen, dl;
        char *clean = utf8_replace_invalid(buf, n, &clen);
        clen = drop_tokenless_bytes(t, clean, clen);
        if (t->spm)
            clen = spaces_for_u2581(clean, clen);
        char *d = decode(t, ids, n_ids, 1, &dl);
        if (dl != clen || memcmp(d, clean, dl) != 0)
            fail_msg("random bytes iteration %d: decode differs from the replaced input", iter);
        free(d);
        free(clean);
        free(ids);
    }
}

/* A tiny vocabulary built in memory: the 256 byte tokens (GPT-2 byte-level text), "12", "123",
 * a control "<|end|>" and a user-defined "<tool>"; merges "1 2" and "12 3". With byte_tok, token
 * 257 is instead a byte token (type 6) with that text in a SentencePiece vocabulary (model
 * "llama", all scores 0), and "12 3" is not a merge. */
static inline struct io_gguf *tiny_model_byte(struct gbuf *b, const char *pre, const char *byte_tok,
                                              struct err_detail *err)
{
    static char bytes[256][3];
    const char *toks[256 + 4];
    int32_t types[256 + 4];
    for (int c = 0, n = 0; c < 256; c++) {
        int printable = (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
        unsigned cp = printable ? (unsigned)c : 256u + (unsigned)n++;
        if (cp < 0x80) {
            bytes[c][0] = (char)cp;
            bytes[c][1] = 0;
        } else {
            bytes[c][0] = (char)(0xC0 | (cp >> 6));
            bytes[c][1] = (char)(0x80 | (cp & 0x3F));
            bytes[c][2] = 0;
        }
        toks[c] = bytes[c];
        types[c] = 1;
    }
    toks[256] = "12", types[256] = 1;
    toks[257] = "123", types[257] = 1;
    toks[258] = "<|end|>", types[258] = 3;
    toks[259] = "<tool>", types[259] = 4;
    if (byte_tok)
        toks[257] = byte_tok, types[257] = 6;
    static const char *merges[] = {"1 2", "12 3"};
    const int n_merges = byte_tok ? 1 : 2;
    size_t n_kv = 6 + (pre != NULL) + (byte_tok != NULL);
    b->n = 0;
    gb_put(b, "GGUF", 4);
    gb_u32(b, 3);
    gb_u64(b, 0);
    gb_u64(b, n_kv);
    gb_str(b, "tokenizer.ggml.model");
    gb_u32(b, 8);
    gb_str(b, byte_tok ? "llama" : "gpt2"); /* byte tokens are SentencePiece's */
    if (byte_tok) {
        static const float zero[260];
        gb_str(b, "tokenizer.ggml.scores");
        gb_u32(b, 9);
        gb_u32(b, 6);
        gb_u64(b, 260);
        gb_put(b, zero, sizeof(zero));
    }
    if (pre) {
        gb_str(b, "tokenizer.ggml.pre");
        gb_u32(b, 8);
        gb_str(b, pre);
    }
    gb_str(b, "tokenizer.ggml.tokens");
    gb_u32(b, 9);
    gb_u32(b, 8);
    gb_u64(b, 260);
    for (int i = 0; i < 260; i++)
        gb_str(b, toks[i]);
    gb_str(b, "tokenizer.ggml.token_type");
    gb_u32(b, 9);
    gb_u32(b, 5);
    gb_u64(b, 260);
    gb_put(b, types, sizeof(types));
    gb_str(b, "tokenizer.ggml.merges");
    gb_u32(b, 9);
    gb_u32(b, 8);
    gb_u64(b, (uint64_t)n_merges);
    for (int i = 0; i < n_merges; i++)
        gb_str(b, merges[i]);
    gb_str(b, "tokenizer.ggml.bos_token_id");
    gb_u32(b, 4);
    gb_u32(b, 258);
    gb_str(b, "tokenizer.ggml.add_bos_token");
    gb_u32(b, 7);
    gb_put(b, "\1", 1);
    while (b->n % 32)
        b->data[b->n++] = 0;
    struct io_gguf *g;
    if (io_gguf_open_mem(&g, b->data, b->n, err) != ST_OK)
        fail_msg("in-memory GGUF rejected: %s", err->msg);
    return g;
}

static inline struct io_gguf *tiny_model(struct gbuf *b, const char *pre)
{
    struct err_detail err = {0};
    return tiny_model_byte(b, pre, NULL, &err);
}

/* The tokenizer of a zstd-compressed vocabulary GGUF (tests/fixtures/NAME.gguf.zst, written by
 * tools/ref_tokenizer_families.py: Mistral's tekken, llama.cpp's Llama 3 and Qwen2 files). */
static inline struct engine_tok *test_zstd_tok(const char *path)
{
    size_t zl;
    char *z = test_read_file(path, &zl);
    if (!z)
        fail_msg("missing %s", path);
    const unsigned long long n = ZSTD_getFrameContentSize(z, zl);
    assert_true(n != ZSTD_CONTENTSIZE_ERROR && n != ZSTD_CONTENTSIZE_UNKNOWN);
    char *buf = malloc((size_t)n);
    assert_non_null(buf);
    assert_int_equal(ZSTD_decompress(buf, (size_t)n, z, zl), n);
    free(z);
    struct io_gguf *g;
    struct engine_tok *t;
    struct err_detail err = {0};
    assert_int_equal(io_gguf_open_mem(&g, buf, (size_t)n, &err), ST_OK);
    if (engine_tok_load(&t, g, &err))
        fail_msg("%s: %s", path, err.msg);
    io_gguf_close(g); /* the tokenizer keeps what it needs */
    free(buf);
    return t;
}

#endif
