/* Tokenizer tests on the real default model: every line of tests/fixtures/tokenizer_ref.jsonl
 * (ids from reference tokenizers) must match exactly; encode/decode round trips; the streaming
 * decoder's UTF-8 holdback; special-token parsing only on request; invalid UTF-8 replaced as
 * documented (also a random-bytes loop for ASan); concurrent encodes; unsupported tokenizers. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "tests/test_tokenizer_util.h"
#include "tests/test_util.h"

#define TOKENIZER_REF "tests/fixtures/tokenizer_ref.jsonl"

/* Shared by all tests: the model and its tokenizer, loaded once. */
struct fixture {
    struct io_gguf *g;      /* the default model */
    struct engine_tok *tok; /* its tokenizer */
    char why[1100];         /* why loading failed, when tok is NULL */
};

static int group_setup(void **state)
{
    static struct fixture f;
    struct err_detail err = {0};
    *state = &f;
    if (io_gguf_open(&f.g, test_model_path(), &err) != ST_OK) {
        snprintf(f.why, sizeof(f.why),
                 "cannot open model %s (set QUERN_MODEL or run `make "
                 "model`): %s",
                 test_model_path(), err.msg);
        return 0;
    }
    if (engine_tok_load(&f.tok, f.g, &err) != ST_OK)
        snprintf(f.why, sizeof(f.why), "engine_tok_load: %s", err.msg);
    return 0;
}

static int group_teardown(void **state)
{
    struct fixture *f = *state;
    engine_tok_free(f->tok);
    io_gguf_close(f->g);
    return 0;
}

static const struct engine_tok *tok_of(void **state)
{
    struct fixture *f = *state;
    if (!f->tok)
        fail_msg("%s", f->why);
    return f->tok;
}

/* ---- helpers ---- */

/* ---- tests ---- */

static void test_metadata(void **state)
{
    const struct engine_tok *t = tok_of(state);
    assert_int_equal(engine_tok_n_vocab(t), 49152);
    assert_int_equal(engine_tok_bos(t), 1);
    assert_int_equal(engine_tok_eos(t), 2);
    assert_true(engine_tok_is_eog(t, 2));  /* <|im_end|> = eos */
    assert_true(engine_tok_is_eog(t, 0));  /* <|endoftext|> */
    assert_false(engine_tok_is_eog(t, 1)); /* <|im_start|> */
    assert_false(engine_tok_is_eog(t, 905));
    assert_false(engine_tok_is_eog(t, -1));
    assert_false(engine_tok_is_eog(t, 1 << 30));

    assert_int_equal(engine_tok_find(t, "<|im_start|>", 12), 1);
    assert_int_equal(engine_tok_find(t, "<|im_end|>", 10), 2);
    assert_int_equal(engine_tok_find(t, " world", 6), 905);
    assert_int_equal(engine_tok_find(t, "\n", 1), 198);
    assert_int_equal(engine_tok_find(t, "Ġworld", strlen("Ġworld")), -1); /* raw bytes only */
    assert_int_equal(engine_tok_find(t, "no such token at all", 20), -1);

    char buf[64];
    assert_int_equal(engine_tok_piece(t, 905, 0, buf, sizeof(buf)), 6);
    assert_memory_equal(buf, " world", 6);
    assert_int_equal(engine_tok_piece(t, 2, 0, buf, sizeof(buf)), 0);
    assert_int_equal(engine_tok_piece(t, 2, 1, buf, sizeof(buf)), 10);
    assert_memory_equal(buf, "<|im_end|>", 10);
    assert_int_equal(engine_tok_piece(t, 2, 1, buf, 3), 10); /* full length, truncated copy */
    assert_memory_equal(buf, "<|i", 3);
    assert_int_equal(engine_tok_piece(t, -5, 1, buf, sizeof(buf)), 0);
    assert_int_equal(engine_tok_piece(t, 49152, 1, buf, sizeof(buf)), 0);
    assert_true(engine_tok_max_piece(t) >= 10);
}

/* Expectations checked by hand against Hugging Face tokenizers on this vocabulary. */
static void test_hand_checked(void **state)
{
    const struct engine_tok *t = tok_of(state);
    static const int32_t hello[] = {19556, 905};
    assert_ids(t, "Hello world", 11, 0, hello, 2);
    const char *s = "I'm   fine,\tthanks!\n\n  Numbers: 12345 and 3.14";
    static const int32_t mixed[] = {57,  5248, 256, 4979, 28, 197, 373, 3307, 17, 8866, 20254, 42,
                                    216, 33,   34,  35,   36, 37,  284, 216,  35, 30,   33,    36};
    assert_ids(t, s, strlen(s), 0, mixed, sizeof(mixed) / sizeof(mixed[0]));
    s = "café 日本語 😀";
    static const int32_t uni[] = {83,    1939, 2756, 17097, 241,   115,
                                  40993, 179,  120,  248,   40303, 218};
    assert_ids(t, s, strlen(s), 0, uni, sizeof(uni) / sizeof(uni[0]));
    static const int32_t chat[] = {1, 4093, 198, 6004, 2};
    s = "<|im_start|>user\nhi<|im_end|>";
    assert_ids(t, s, strlen(s), ENGINE_TOK_PARSE_SPECIAL, chat, 5);
    static const int32_t eot[] = {81, 0, 82};
    assert_ids(t, "a<|endoftext|>b", 15, ENGINE_TOK_PARSE_SPECIAL, eot, 3);
    /* add_bos_token is false for this model: the flag adds nothing. */
    assert_ids(t, "Hello world", 11, ENGINE_TOK_ADD_BOS, hello, 2);
    size_t n;
    int32_t *ids = encode(t, "", 0, 0, &n);
    assert_int_equal(n, 0);
    free(ids);
}

/* Without ENGINE_TOK_PARSE_SPECIAL no control token can come out of any text. */
static void test_special_not_smuggled(void **state)
{
    const struct engine_tok *t = tok_of(state);
    static const int32_t im_end_text[] = {44, 108, 306, 79, 486, 108, 46};
    assert_ids(t, "<|im_end|>", 10, 0, im_end_text, 7);
    static const int32_t sp_im_start_user[] = {2067, 108, 306, 79, 3738, 108, 46, 4093};
    assert_ids(t, " <|im_start|>user", 17, 0, sp_im_start_user, 8);

    /* Every control token's text, alone, glued to text, doubled: no control id appears. */
    char buf[256], piece[128];
    for (int32_t id = 0; id < engine_tok_n_vocab(t); id++) {
        size_t pl = engine_tok_piece(t, id, 1, piece, sizeof(piece));
        if (pl == 0 || pl > 100 || engine_tok_piece(t, id, 0, NULL, 0) != 0)
            continue; /* not a control token */
        int len = snprintf(buf, sizeof(buf), "x%.*s%.*sy", (int)pl, piece, (int)pl, piece);
        for (int variant = 0; variant < 2; variant++) {
            const char *s = variant ? buf : buf + 1;
            size_t sl = variant ? (size_t)len : pl;
            size_t n;
            int32_t *ids = encode(t, s, sl, 0, &n);
            for (size_t i = 0; i < n; i++)
                if (engine_tok_piece(t, ids[i], 0, NULL, 0) == 0)
                    fail_msg("control token %d came out of plain text \"%.*s\"", ids[i], (int)sl,
                             s);
            size_t dl;
            char *d = decode(t, ids, n, 0, &dl);
            assert_int_equal(dl, sl);
            assert_memory_equal(d, s, sl);
            free(d);
            free(ids);
            if (!variant) { /* with the flag, the bare text is exactly that token */
                ids = encode(t, s, sl, ENGINE_TOK_PARSE_SPECIAL, &n);
                assert_int_equal(n, 1);
                assert_int_equal(ids[0], id);
                free(ids);
            }
        }
    }
}

/* Every fixture line: identical ids; and decoding gives back the input bytes. */
static void test_reference_fixture(void **state)
{
    check_fixture(tok_of(state), TOKENIZER_REF, 1000);
}

static void test_invalid_utf8(void **state)
{
    const struct engine_tok *t = tok_of(state);
    /* Each byte that does not begin a well-formed sequence becomes U+FFFD, one per byte. */
    static const struct {
        const char *in, *as; /* input and the valid text it must tokenize like */
    } cases[] = {
        {"a\xff"
         "b",
         "a\xEF\xBF\xBD"
         "b"},
        {"caf\xC3", "caf\xEF\xBF\xBD"},                           /* truncated at end */
        {"\xC3(", "\xEF\xBF\xBD("},                               /* bad continuation */
        {"\xC0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD"},                 /* overlong NUL */
        {"\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* surrogate */
        {"\xF4\x90\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* > U+10FFFF */
        {"\xE2\x82 x", "\xEF\xBF\xBD\xEF\xBF\xBD x"},                             /* cut 3-byte */
        {"\x80\x80hello", "\xEF\xBF\xBD\xEF\xBF\xBDhello"}, /* lone continuations */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t n_want;
        int32_t *want = encode(t, cases[i].as, strlen(cases[i].as), 0, &n_want);
        assert_ids(t, cases[i].in, strlen(cases[i].in), 0, want, n_want);
        free(want);
    }
}

/* Random bytes (mostly invalid UTF-8) never crash, and decode to the documented replacement. */
static void test_random_bytes(void **state)
{
    check_random_bytes(tok_of(state), 3000);
}

/* Long inputs: a long run of one character and a long mixed text round-trip. */
static void test_long_inputs(void **state)
{
    const struct engine_tok *t = tok_of(state);
    size_t n = 200000;
    char *s = malloc(n);
    assert_non_null(s);
    const char fills[] = {' ', 'a', '\n', '7', '!'};
    for (size_t f = 0; f < sizeof(fills); f++) {
        memset(s, fills[f], n);
        size_t n_ids, dl;
        int32_t *ids = encode(t, s, n, 0, &n_ids);
        char *d = decode(t, ids, n_ids, 0, &dl);
        assert_int_equal(dl, n);
        assert_memory_equal(d, s, n);
        free(d);
        free(ids);
    }
    static const char *words[] = {"The ", "quick ", "brown ", "fox", "'s ", "jumps\n",    "über ",
                                  "1234", "  ",     "日本",   "😀",   "\t",  "<|im_end|>", "don't "};
    uint32_t x = 12345;
    size_t o = 0;
    while (o + 16 < n) {
        x = x * 1103515245u + 12345u;
        const char *w = words[(x >> 16) % (sizeof(words) / sizeof(words[0]))];
        memcpy(s + o, w, strlen(w));
        o += strlen(w);
    }
    size_t n_ids, dl;
    int32_t *ids = encode(t, s, o, 0, &n_ids);
    char *d = decode(t, ids, n_ids, 0, &dl);
    assert_int_equal(dl, o);
    assert_memory_equal(d, s, o);
    free(d);
    free(ids);
    free(s);
}

/* The stream decoder holds back a split emoji and emits it whole; invalid bytes -> U+FFFD. */
static void test_stream(void **state)
{
    const struct engine_tok *t = tok_of(state);
    static const unsigned char emoji[] = {0xF0, 0x9F, 0x98, 0x80}; /* U+1F600 */
    int32_t byte_tok[4];
    for (int i = 0; i < 4; i++) {
        byte_tok[i] = engine_tok_find(t, (const char *)&emoji[i], 1);
        assert_true(byte_tok[i] >= 0);
    }
    struct engine_tok_stream st = {0};
    char out[64];
    int32_t hi = engine_tok_find(t, "hi", 2);
    assert_true(hi >= 0);
    assert_int_equal(engine_tok_stream_push(t, &st, hi, out, sizeof(out)), 2);
    assert_memory_equal(out, "hi", 2);
    for (int i = 0; i < 3; i++)
        assert_int_equal(engine_tok_stream_push(t, &st, byte_tok[i], out, sizeof(out)), 0);
    assert_int_equal(st.n_pend, 3);
    /* Too small a buffer: the needed size comes back and nothing changes. */
    assert_int_equal(engine_tok_stream_push(t, &st, byte_tok[3], out, 2), 4);
    assert_int_equal(st.n_pend, 3);
    assert_int_equal(engine_tok_stream_push(t, &st, byte_tok[3], out, sizeof(out)), 4);
    assert_memory_equal(out, emoji, 4);
    assert_int_equal(st.n_pend, 0);
    assert_int_equal(engine_tok_stream_flush(&st, out, sizeof(out)), 0);

    /* The same through the real tokenization of the emoji (split over two byte tokens). */
    size_t n_ids, o = 0;
    int32_t *ids = encode(t, "x😀y", strlen("x😀y"), 0, &n_ids);
    assert_true(n_ids >= 3);
    char acc[64];
    for (size_t i = 0; i < n_ids; i++) {
        size_t w = engine_tok_stream_push(t, &st, ids[i], acc + o, sizeof(acc) - o);
        /* Whatever came out so far is whole characters: never a cut emoji. */
        assert_true(w == 0 || acc[o] == 'x' || (unsigned char)acc[o] == 0xF0 || acc[o] == 'y');
        o += w;
    }
    free(ids);
    o += engine_tok_stream_flush(&st, acc + o, sizeof(acc) - o);
    assert_int_equal(o, strlen("x😀y"));
    assert_memory_equal(acc, "x😀y", o);

    /* A held prefix followed by a non-continuation: the held bytes (one maximal subpart)
     * become one U+FFFD, as Python's and Hugging Face's decoders write them */
    assert_int_equal(engine_tok_stream_push(t, &st, byte_tok[0], out, sizeof(out)), 0);
    assert_int_equal(engine_tok_stream_push(t, &st, byte_tok[1], out, sizeof(out)), 0);
    assert_int_equal(engine_tok_stream_push(t, &st, hi, out, sizeof(out)), 5);
    assert_memory_equal(out, "\xEF\xBF\xBDhi", 5);
    /* A byte that can never start a character is replaced at once. */
    int32_t cont = engine_tok_find(t, "\x80", 1);
    assert_true(cont >= 0);
    assert_int_equal(engine_tok_stream_push(t, &st, cont, out, sizeof(out)), 3);
    assert_memory_equal(out, "\xEF\xBF\xBD", 3);
    /* Leftovers at the end of the stream (a character cut by max_tokens): one U+FFFD. */
    int32_t e2 = engine_tok_find(t, "\xE2", 1), x82 = engine_tok_find(t, "\x82", 1);
    assert_true(e2 >= 0 && x82 >= 0);
    assert_int_equal(engine_tok_stream_push(t, &st, e2, out, sizeof(out)), 0);
    assert_int_equal(engine_tok_stream_push(t, &st, x82, out, sizeof(out)), 0);
    assert_int_equal(engine_tok_stream_flush(&st, out, 1), 3); /* too small: unchanged */
    assert_int_equal(st.n_pend, 2);
    assert_int_equal(engine_tok_stream_flush(&st, out, sizeof(out)), 3);
    assert_memory_equal(out, "\xEF\xBF\xBD", 3);
    assert_int_equal(st.n_pend, 0);
    /* Control tokens print nothing in the stream. */
    assert_int_equal(engine_tok_stream_push(t, &st, 2, out, sizeof(out)), 0);
}

/* Property: streaming random tokens (many of them partial UTF-8) gives exactly the batch
 * replacement of the concatenated bytes, and every push emits only whole characters. */
static void test_stream_random(void **state)
{
    const struct engine_tok *t = tok_of(state);
    uint32_t x = 777;
    char all[4096], got[16384], out[256];
    for (int iter = 0; iter < 500; iter++) {
        struct engine_tok_stream st = {0};
        size_t n_all = 0, n_got = 0;
        for (int k = 0; k < 40; k++) {
            x = x * 1664525u + 1013904223u;
            /* Half single bytes (ids of byte tokens), half arbitrary tokens. */
            int32_t id;
            if (x & 0x100) {
                char b = (char)(x >> 24);
                id = engine_tok_find(t, &b, 1);
                if (id < 0)
                    continue;
            } else {
                id = (int32_t)((x >> 9) % (uint32_t)engine_tok_n_vocab(t));
            }
            n_all += engine_tok_piece(t, id, 0, all + n_all, sizeof(all) - n_all);
            size_t w = engine_tok_stream_push(t, &st, id, out, sizeof(out));
            assert_true(w <= sizeof(out));
            size_t chk;
            char *v = utf8_replace_invalid((const unsigned char *)out, w, &chk);
            assert_int_equal(chk, w); /* whole, valid characters only */
            assert_memory_equal(v, out, w);
            free(v);
            memcpy(got + n_got, out, w);
            n_got += w;
        }
        n_got += engine_tok_stream_flush(&st, got + n_got, sizeof(got) - n_got);
        size_t n_want;
        char *want = utf8_lossy_ref((const unsigned char *)all, n_all, &n_want);
        assert_int_equal(n_got, n_want);
        assert_memory_equal(got, want, n_want);
        free(want);
    }
}

/* Concurrent encodes on one tokenizer give the single-threaded result. */
struct thread_job {
    const struct engine_tok *t; /* shared tokenizer */
    const char *text;           /* shared input */
    size_t len;                 /* its length */
    int32_t *ids;               /* this thread's result */
    size_t n_ids;               /* its length */
    enum status st;             /* encode status */
};

static void *thread_main(void *arg)
{
    struct thread_job *j = arg;
    for (int rep = 0; rep < 3; rep++) {
        free(j->ids);
        j->st = engine_tok_encode(j->t, j->text, j->len, ENGINE_TOK_PARSE_SPECIAL, &j->ids,
                                  &j->n_ids, NULL);
        if (j->st != ST_OK)
            break;
    }
    return NULL;
}

static void test_threads(void **state)
{
    const struct engine_tok *t = tok_of(state);
    size_t len = 0, cap = 64 * 1024;
    char *text = malloc(cap);
    assert_non_null(text);
    static const char *parts[] = {"Once upon a time, ", "<|im_start|>", "there were 42 ",
                                  "naïve tokenizers ",  "日本語 ",      "\n\n",
                                  "<|im_end|>",         "emoji 😀 "};
    for (size_t i = 0; len + 32 < cap; i++) {
        const char *p = parts[(i * 7) % 8];
        memcpy(text + len, p, strlen(p));
        len += strlen(p);
    }
    size_t n_ref;
    int32_t *ref = encode(t, text, len, ENGINE_TOK_PARSE_SPECIAL, &n_ref);
    struct thread_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (struct thread_job){t, text, len, NULL, 0, ST_OK};
        assert_int_equal(pthread_create(&th[i], NULL, thread_main, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(jobs[i].st, ST_OK);
        assert_int_equal(jobs[i].n_ids, n_ref);
        assert_memory_equal(jobs[i].ids, ref, n_ref * sizeof(*ref));
        free(jobs[i].ids);
    }
    free(ref);
    free(text);
}

/* ---- unsupported tokenizers, from small GGUF files built in memory ---- */

static void test_unsupported(void **state)
{
    (void)state;
    const char *bert[] = {"tokenizer.ggml.model", "bert", NULL};
    expect_load_error(bert, ST_ERR_UNSUPPORTED, "tokenizer model 'bert' is not supported");
    const char *dsk[] = {"tokenizer.ggml.model", "gpt2", "tokenizer.ggml.pre", "deepseek-llm",
                         NULL};
    expect_load_error(dsk, ST_ERR_UNSUPPORTED, "pre-tokenizer 'deepseek-llm'");
    const char *spm[] = {"tokenizer.ggml.model", "llama", NULL};
    expect_load_error(spm, ST_ERR_NOT_FOUND, "tokenizer.ggml.tokens");
    const char *none[] = {"general.architecture", "llama", NULL};
    expect_load_error(none, ST_ERR_NOT_FOUND, "tokenizer.ggml.model");
    const char *no_vocab[] = {"tokenizer.ggml.model", "gpt2", "tokenizer.ggml.pre", "smollm", NULL};
    expect_load_error(no_vocab, ST_ERR_NOT_FOUND, "tokenizer.ggml.tokens");
}

/* The plain GPT-2 pre-tokenizer keeps digit runs together; "smollm" splits them; user-defined
 * tokens are recognised without the special flag; BOS comes when add_bos_token says so. */
static void test_tiny_vocab(void **state)
{
    (void)state;
    static struct gbuf b;
    static const char *pres[] = {NULL, "default", "smollm"};
    for (int p = 0; p < 3; p++) {
        struct io_gguf *g = tiny_model(&b, pres[p]);
        struct engine_tok *t;
        struct err_detail err = {0};
        if (engine_tok_load(&t, g, &err) != ST_OK)
            fail_msg("tiny vocab (pre %s): %s", pres[p] ? pres[p] : "absent", err.msg);
        io_gguf_close(g); /* the tokenizer keeps its own copies */
        assert_int_equal(engine_tok_n_vocab(t), 260);
        assert_int_equal(engine_tok_bos(t), 258);
        assert_int_equal(engine_tok_eos(t), -1);
        assert_true(engine_tok_is_eog(t, 258)); /* "<|end|>" is a known end marker */
        int32_t one = engine_tok_find(t, "1", 1), four = engine_tok_find(t, "4", 1);
        int32_t five = engine_tok_find(t, "5", 1), sp = engine_tok_find(t, " ", 1);
        assert_int_equal(one, '1'); /* ids follow byte values here */
        if (p < 2) {
            const int32_t want[] = {257, four, five};
            assert_ids(t, "12345", 5, 0, want, 3);
        } else {
            const int32_t want[] = {one, one + 1, one + 2, four, five};
            assert_ids(t, "12345", 5, 0, want, 5);
        }
        const int32_t tool_whole[] = {258, sp, 259, 256};          /* "12" merged */
        const int32_t tool_split[] = {258, sp, 259, one, one + 1}; /* digits split */
        const int32_t *tool = p < 2 ? tool_whole : tool_split;
        size_t n_tool = p < 2 ? 4 : 5;
        assert_ids(t, " <tool>12", 9, 0, tool + 1, n_tool - 1);
        assert_ids(t, " <tool>12", 9, ENGINE_TOK_ADD_BOS, tool, n_tool);
        const int32_t special[] = {259, 258};
        assert_ids(t, "<tool><|end|>", 13, ENGINE_TOK_PARSE_SPECIAL, special, 2);
        char buf[16];
        assert_int_equal(engine_tok_piece(t, 259, 0, buf, sizeof(buf)), 6); /* user: shown */
        assert_int_equal(engine_tok_piece(t, 258, 0, buf, sizeof(buf)), 0); /* control: not */
        engine_tok_free(t);
    }
}

/* A byte token's text must be "<0x" two hex digits ">": a sign or a missing digit is refused
 * (sscanf's %2x took "<0x-1>" as byte ~0u, an index past the byte table; found by fuzzing). */
static void test_byte_token_text(void **state)
{
    (void)state;
    static struct gbuf b;
    static const char *const bad[] = {"<0x-1>", "<0x+1>",  "<0x 1>", "<0x1>",
                                      "<0x1G>", "<0x123>", "<0x12",  "<0X41>"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct err_detail err = {0};
        struct io_gguf *g = tiny_model_byte(&b, NULL, bad[i], &err);
        struct engine_tok *t = NULL;
        if (engine_tok_load(&t, g, &err) != ST_ERR_FORMAT)
            fail_msg("byte token '%s' accepted (or refused for another reason: %s)", bad[i],
                     err.msg);
        assert_non_null(strstr(err.msg, "not <0xXX>"));
        io_gguf_close(g);
    }
    struct err_detail err = {0};
    struct io_gguf *g = tiny_model_byte(&b, NULL, "<0x4a>", &err);
    struct engine_tok *t;
    if (engine_tok_load(&t, g, &err) != ST_OK)
        fail_msg("byte token <0x4a>: %s", err.msg);
    io_gguf_close(g);
    char buf[8];
    assert_int_equal(engine_tok_piece(t, 257, 0, buf, sizeof(buf)), 1);
    assert_int_equal((unsigned char)buf[0], 0x4a);
    engine_tok_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metadata),
        cmocka_unit_test(test_hand_checked),
        cmocka_unit_test(test_special_not_smuggled),
        cmocka_unit_test(test_reference_fixture),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_random_bytes),
        cmocka_unit_test(test_long_inputs),
        cmocka_unit_test(test_stream),
        cmocka_unit_test(test_stream_random),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_unsupported),
        cmocka_unit_test(test_tiny_vocab),
        cmocka_unit_test(test_byte_token_text),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
