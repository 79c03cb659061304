/* libFuzzer harness for the tokenizer loaders and encoders (engine/tokenizer*.c), which read a
 * model file's untrusted tokenizer.* metadata. Each input builds a GGUF in memory: its first
 * bytes choose the tokenizer model (gpt2 byte-level BPE or llama SentencePiece), the
 * pre-tokenizer, add_bos / add_space_prefix and whether metadata arrays are malformed (a wrong
 * element type, a short scores or types array, out-of-range ids); the rest, up to a blank line,
 * is the vocabulary, one token per line (first byte: its type 0..7, the rest its text; BPE merges
 * are made from neighbouring tokens); what follows is text to encode. Loading must succeed or
 * fail with a message; an encoding's ids must be in the vocabulary and decode without fault.
 * When the text holds a \x01 byte, what comes before it is also the GGUF's
 * tokenizer.chat_template (engine/chat.c recognises it, or --chat-template names a format), and
 * the text's lines become chat messages (role by first byte) rendered and tokenized with it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/chat.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_TOKENS 512

struct buf {
    uint8_t *p;
    size_t n, cap;
};

static void put(struct buf *b, const void *s, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 256;
        b->p = realloc(b->p, b->cap);
        if (!b->p)
            abort();
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void u32(struct buf *b, uint32_t v)
{
    put(b, &v, 4);
}
static void u64(struct buf *b, uint64_t v)
{
    put(b, &v, 8);
}

static void str(struct buf *b, const void *s, size_t n)
{
    u64(b, n);
    put(b, s, n);
}

static void key(struct buf *b, const char *k, uint32_t type)
{
    str(b, k, strlen(k));
    u32(b, type);
}

struct tok {
    const uint8_t *s;
    size_t n;
    int type;
};

#define MAX_MSGS 6

/* The text's lines as chat messages (first byte: role, also an unknown one), rendered and
 * tokenized through the template g names, or the format `pick` names (12 and up: none, so
 * recognised from g). Errors must come with a message; ids must be in the vocabulary. */
static void fuzz_chat(const struct io_gguf *g, const struct engine_tok *t, const uint8_t *text,
                      size_t n, int pick)
{
    static const char *const names[] = {"chatml",     "deepseek-r1", "gemma",   "llama2",
                                        "llama3",     "llama31",     "mistral", "mistral-v3",
                                        "mistral-v7", "phi3",        "phi4",    "qwen3"};
    static const char *const roles[] = {"user", "assistant", "system", "tool"};
    struct err_detail err = {0};
    struct engine_chat *c;
    enum status st = pick < 12 ? engine_chat_init_named(&c, g, names[pick], &err)
                               : engine_chat_init(&c, g, &err);
    if (st) {
        if (!err.msg[0])
            abort();
        return;
    }
    struct engine_chat_msg m[MAX_MSGS];
    char *own[MAX_MSGS];
    size_t k = 0;
    for (size_t i = 0; i < n && k < MAX_MSGS;) {
        size_t e = i;
        while (e < n && text[e] != '\n')
            e++;
        own[k] = strndup((const char *)text + i + (e > i), e > i ? e - i - 1 : 0);
        if (!own[k])
            abort();
        m[k].role = roles[e > i ? text[i] % 4 : 0];
        m[k].content = own[k];
        k++;
        i = e + 1;
    }
    for (int gen = 0; gen < 2 && k; gen++) {
        char *s;
        size_t len;
        if (engine_chat_render(c, m, k, gen, &s, &len, &err) == ST_OK) {
            if (strlen(s) > len)
                abort();
            free(s);
        } else if (!err.msg[0]) {
            abort();
        }
        int32_t *ids;
        size_t n_ids;
        if (engine_chat_tokenize(c, t, m, k, gen, gen, &ids, &n_ids, &err) == ST_OK) {
            for (size_t i = 0; i < n_ids; i++)
                if (ids[i] < 0 || ids[i] >= engine_tok_n_vocab(t))
                    abort();
            free(ids);
        } else if (!err.msg[0]) {
            abort();
        }
    }
    for (size_t i = 0; i < k; i++)
        free(own[i]);
    engine_chat_free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3)
        return 0;
    static const char *const pres[] = {"default", "smollm", "llama-bpe", "qwen2",
                                       "gpt2",    "tekken", "gpt-4o",    "nope"};
    const int spm = data[0] & 1, bad = data[0] >> 1 & 7,
              pre = data[1] % (int)(sizeof(pres) / sizeof(pres[0]));
    const int add_bos = data[2] & 1, prefix = data[2] >> 1 & 1, by_template = data[2] >> 2 & 1;
    data += 3;
    size = size - 3;
    /* vocabulary lines up to a blank line, then the text */
    struct tok toks[MAX_TOKENS];
    size_t n_tok = 0, i = 0;
    while (i < size && n_tok < MAX_TOKENS) {
        size_t e = i;
        while (e < size && data[e] != '\n')
            e++;
        if (e == i) { /* blank line: the text follows */
            i++;
            break;
        }
        toks[n_tok++] = (struct tok){data + i + 1, e - i - 1, data[i] & 7};
        i = e + 1;
    }
    const uint8_t *text = data + (i < size ? i : size);
    size_t text_n = size - (size_t)(text - data);
    const uint8_t *sep = memchr(text, 1, text_n);
    const uint8_t *tpl = NULL;
    size_t tpl_n = 0;
    if (sep) { /* chat template, then the text */
        tpl = text;
        tpl_n = (size_t)(sep - text);
        text_n -= tpl_n + 1;
        text = sep + 1;
    }

    struct buf b = {0};
    const int n_kv = 7 + (spm ? 2 : 1) + (tpl != NULL);
    put(&b, "GGUF", 4);
    u32(&b, 3);
    u64(&b, 0);
    u64(&b, (uint64_t)n_kv);
    key(&b, "tokenizer.ggml.model", 8);
    const char *model = spm ? "llama" : "gpt2";
    str(&b, model, strlen(model));
    key(&b, "tokenizer.ggml.pre", 8);
    str(&b, pres[pre], strlen(pres[pre]));
    key(&b, "tokenizer.ggml.tokens", 9);
    u32(&b, 8);
    u64(&b, n_tok);
    for (size_t k = 0; k < n_tok; k++)
        str(&b, toks[k].s, toks[k].n);
    key(&b, "tokenizer.ggml.token_type", 9);
    u32(&b, bad == 1 ? 6 : 5); /* 5: int32; bad 1: float32 */
    u64(&b, bad == 2 && n_tok ? n_tok - 1 : n_tok);
    for (size_t k = 0; k < n_tok - (bad == 2 && n_tok); k++)
        u32(&b, (uint32_t)toks[k].type);
    key(&b, "tokenizer.ggml.bos_token_id", 4);
    u32(&b, bad == 3 ? (uint32_t)n_tok : 0);
    key(&b, "tokenizer.ggml.eos_token_id", 4);
    u32(&b, n_tok > 1 ? 1 : 0);
    key(&b, "tokenizer.ggml.add_bos_token", 7);
    put(&b, &(uint8_t){(uint8_t)add_bos}, 1);
    if (tpl) {
        key(&b, "tokenizer.chat_template", 8);
        str(&b, tpl, tpl_n);
    }
    if (spm) {
        key(&b, "tokenizer.ggml.scores", 9);
        u32(&b, 6); /* float32 */
        u64(&b, bad == 4 && n_tok ? n_tok - 1 : n_tok);
        for (size_t k = 0; k < n_tok - (bad == 4 && n_tok); k++) {
            float sc = toks[k].n ? -(float)(toks[k].s[0] ^ (uint8_t)k) : 0.0f;
            put(&b, &sc, 4);
        }
        key(&b, "tokenizer.ggml.add_space_prefix", 7);
        put(&b, &(uint8_t){(uint8_t)prefix}, 1);
    } else { /* merges "a b" of neighbouring tokens' texts (the loader skips unknown ones) */
        key(&b, "tokenizer.ggml.merges", 9);
        u32(&b, 8);
        const size_t nm = n_tok > 1 ? n_tok - 1 : 0;
        u64(&b, nm);
        for (size_t k = 0; k < nm; k++) {
            u64(&b, toks[k].n + 1 + toks[k + 1].n);
            put(&b, toks[k].s, toks[k].n);
            put(&b, " ", 1);
            put(&b, toks[k + 1].s, toks[k + 1].n);
        }
    }
    while (b.n % 32)
        put(&b, "", 1);

    struct io_gguf *g;
    struct engine_tok *t;
    struct err_detail err = {0};
    if (io_gguf_open_mem(&g, b.p, b.n, &err) == ST_OK) {
        if (engine_tok_load(&t, g, &err) == ST_OK) {
            const int32_t nv = engine_tok_n_vocab(t);
            for (unsigned flags = 0; flags < 4; flags++) {
                int32_t *ids;
                size_t n;
                if (engine_tok_encode(t, (const char *)text, text_n, flags, &ids, &n, &err))
                    continue; /* an error with a message */
                struct engine_tok_stream st = {0};
                const size_t cap = ENGINE_TOK_STREAM_OUT_MAX(engine_tok_max_piece(t));
                char *out = malloc(cap);
                if (!out)
                    abort();
                for (size_t k = 0; k < n; k++) {
                    if (ids[k] < 0 || ids[k] >= nv)
                        abort();
                    char piece[256];
                    engine_tok_piece(t, ids[k], 1, piece, sizeof(piece));
                    if (engine_tok_stream_push(t, &st, ids[k], out, cap) > cap)
                        abort(); /* STREAM_OUT_MAX of the longest piece always fits */
                    (void)engine_tok_is_eog(t, ids[k]);
                }
                engine_tok_stream_flush(&st, out, cap);
                free(out);
                free(ids);
            }
            if (tpl)
                fuzz_chat(g, t, text, text_n, bad + 8 * by_template);
            engine_tok_free(t);
        }
        io_gguf_close(g);
    }
    free(b.p);
    return 0;
}
