/* Tokenizers of the other model families: Gemma 3's SentencePiece vocabulary (the real model,
 * fetched by `make gemma`) against llama.cpp's ids for >1,000 strings
 * (tests/fixtures/tokenizer_gemma3.jsonl, tools/ref_tokenizer_families.py), its byte fallback,
 * spaces and end-of-turn token, random bytes; and the llama-bpe (Llama 3), qwen2 and gpt-4o
 * (o200k: Phi-4-mini) pre-tokenizers against Python's `regex` module over the same strings
 * (tests/fixtures/pretok_ref.jsonl);
 * Mistral's tekken vocabulary (Nemo's, as a byte-level BPE GGUF,
 * tests/fixtures/tekken_vocab.gguf.zst) against mistral_common's Tekkenizer ids for the same
 * strings (tests/fixtures/tokenizer_tekken.jsonl); Llama 3's and Qwen2's vocabularies (llama.cpp's
 * vocabulary-only GGUFs) against Hugging Face's tokenizer (tests/fixtures/tokenizer_bpe_ref.jsonl).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "engine/tokenizer_internal.h"
#include "io/gguf.h"
#include "tests/test_tokenizer_util.h"
#include "tests/test_util.h"

static void test_gemma_reference(void **state)
{
    (void)state;
    struct io_gguf *g;
    struct engine_tok *t;
    struct err_detail err = {0};
    if (io_gguf_open(&g, test_gemma_path(), &err))
        fail_msg("cannot open %s (run `make gemma` or set QUERN_GEMMA): %s", test_gemma_path(),
                 err.msg);
    if (engine_tok_load(&t, g, &err))
        fail_msg("%s", err.msg);
    io_gguf_close(g); /* the tokenizer keeps what it needs */
    assert_int_equal(engine_tok_n_vocab(t), 262144);
    assert_int_equal(engine_tok_bos(t), 2);
    assert_int_equal(engine_tok_eos(t), 1);
    const int32_t eot = engine_tok_find(t, "<end_of_turn>", 13);
    assert_int_equal(eot, 106);
    assert_true(engine_tok_is_eog(t, eot) && engine_tok_is_eog(t, 1));
    /* "</s>" is one of Gemma's user-defined HTML tags (212): text, as Hugging Face's tokenizer
     * has it, not an end of generation (llama.cpp makes it one: a generated strikethrough
     * ended the output) */
    const int32_t strike = engine_tok_find(t, "</s>", 4);
    assert_int_equal(strike, 212);
    assert_false(engine_tok_is_eog(t, strike));
    {
        size_t ns;
        int32_t *sid = encode(t, "a</s>", 5, 0, &ns);
        assert_true(ns == 2 && sid[1] == 212);
        size_t sl;
        char *sd = decode(t, sid, ns, 0, &sl);
        assert_int_equal(sl, 5);
        assert_memory_equal(sd, "a</s>", 5);
        free(sd);
        free(sid);
    }
    /* BOS is prepended (add_bos_token); no space is (add_space_prefix false) */
    size_t n;
    int32_t *ids = encode(t, "Hi", 2, ENGINE_TOK_ADD_BOS, &n);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 2);
    free(ids);
    /* a character outside the vocabulary: its UTF-8 bytes as <0xXX> tokens, which decode back */
    const char *rare = "\xF0\x9F\xAB\xA8"; /* U+1FAE8 */
    ids = encode(t, rare, 4, 0, &n);
    char piece[8];
    for (size_t i = 0; i < n; i++)
        assert_int_equal(engine_tok_piece(t, ids[i], 0, piece, sizeof(piece)), 1);
    size_t dl;
    char *d = decode(t, ids, n, 0, &dl);
    assert_int_equal(dl, 4);
    assert_memory_equal(d, rare, 4);
    free(d);
    free(ids);
    /* U+2581 in a token is a space when decoded */
    ids = encode(t, "a b", 3, 0, &n);
    d = decode(t, ids, n, 0, &dl);
    assert_int_equal(dl, 3);
    assert_memory_equal(d, "a b", 3);
    free(d);
    free(ids);
    /* a line of many user-defined tokens (whitespace runs, tags: always split out) encodes
     * as its repeated unit does, once per repetition (split_special cut it in one pass per
     * token; shifting its fragment array per occurrence was quadratic: 2.2 MB took 46 s) */
    const char unit[] = "x\n\n\ny  <b>z</b>\t\t";
    size_t nu, nl;
    int32_t *one = encode(t, unit, sizeof(unit) - 1, 0, &nu);
    assert_true(nu >= 5);
    enum { REPS = 20000 };
    char *line = malloc(REPS * (sizeof(unit) - 1));
    assert_non_null(line);
    for (int r = 0; r < REPS; r++)
        memcpy(line + (size_t)r * (sizeof(unit) - 1), unit, sizeof(unit) - 1);
    ids = encode(t, line, REPS * (sizeof(unit) - 1), 0, &nl);
    assert_int_equal(nl, REPS * nu);
    for (size_t i = 0; i < nl; i++)
        assert_int_equal(ids[i], one[i % nu]);
    free(ids);
    free(line);
    free(one);
    check_fixture(t, "tests/fixtures/tokenizer_gemma3.jsonl", 1000);
    check_random_bytes(t, getenv("QUERN_SANITIZE") ? 500 : 3000);
    engine_tok_free(t);
}

static void on_piece(void *ctx, const char *s, size_t n)
{
    cJSON *a = ctx;
    char *h = malloc(2 * n + 1);
    assert_non_null(h);
    for (size_t i = 0; i < n; i++)
        snprintf(h + 2 * i, 3, "%02x", (unsigned char)s[i]);
    h[2 * n] = 0;
    cJSON_AddItemToArray(a, cJSON_CreateString(h));
    free(h);
}

static void test_pretokenizers(void **state)
{
    (void)state;
    static const char *const names[] = {"llama-bpe", "qwen2", "gpt-4o"};
    struct engine_tok *tok[3];
    struct err_detail err = {0};
    for (int k = 0; k < 3; k++) {
        static struct gbuf b;
        struct io_gguf *g = tiny_model(&b, names[k]);
        assert_int_equal(engine_tok_load(&tok[k], g, &err), ST_OK);
        io_gguf_close(g);
    }
    size_t flen;
    char *file = test_read_file("tests/fixtures/pretok_ref.jsonl", &flen);
    if (!file)
        fail_msg("missing tests/fixtures/pretok_ref.jsonl");
    size_t lines = 0, pieces = 0;
    char *save = NULL;
    for (char *line = strtok_r(file, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        size_t len;
        char *text = unhex(cJSON_GetObjectItem(j, "hex")->valuestring, &len);
        for (int k = 0; k < 3; k++) {
            const cJSON *want = cJSON_GetObjectItem(j, names[k]);
            cJSON *got = cJSON_CreateArray();
            assert_int_equal(engine_tok_pretokenize(tok[k], text, len, on_piece, got, &err), ST_OK);
            char *g = cJSON_PrintUnformatted(got), *w = cJSON_PrintUnformatted(want);
            if (strcmp(g, w))
                fail_msg("pretok_ref line %zu, %s: text \"%.*s\"\n  got  %.400s\n  want %.400s",
                         lines + 1, names[k], (int)(len > 200 ? 200 : len), text, g, w);
            pieces += (size_t)cJSON_GetArraySize(want);
            free(g);
            free(w);
            cJSON_Delete(got);
        }
        free(text);
        cJSON_Delete(j);
        lines++;
    }
    free(file);
    print_message("pretok_ref: %zu strings, %zu pieces, llama-bpe, qwen2 and gpt-4o as Python "
                  "regex\n",
                  lines, pieces);
    assert_true(lines >= 1000);
    /* what differs: digits in threes (llama-bpe, gpt-4o) or one by one (qwen2); gpt-4o's "="
     * goes with its word */
    const char *digits = "x=12345";
    for (int k = 0; k < 3; k++) {
        cJSON *got = cJSON_CreateArray();
        assert_int_equal(engine_tok_pretokenize(tok[k], digits, 7, on_piece, got, &err), ST_OK);
        assert_int_equal(cJSON_GetArraySize(got), k == 1 ? 1 + 1 + 5 : 1 + 1 + 2);
        cJSON_Delete(got);
        engine_tok_free(tok[k]);
    }
    /* DeepSeek R1's Qwen distills name Qwen2's pre-tokenizer otherwise; cl100k's (Phi-4) is
     * named dbrx and splits as Llama 3's */
    static const struct {
        const char *name;
        int pieces;
    } alias[] = {{"deepseek-r1-qwen", 1 + 1 + 5}, {"dbrx", 1 + 1 + 2}};
    for (size_t k = 0; k < sizeof(alias) / sizeof(alias[0]); k++) {
        static struct gbuf b;
        struct io_gguf *g = tiny_model(&b, alias[k].name);
        struct engine_tok *at;
        assert_int_equal(engine_tok_load(&at, g, &err), ST_OK);
        io_gguf_close(g);
        cJSON *got = cJSON_CreateArray();
        assert_int_equal(engine_tok_pretokenize(at, digits, 7, on_piece, got, &err), ST_OK);
        assert_int_equal(cJSON_GetArraySize(got), alias[k].pieces);
        cJSON_Delete(got);
        engine_tok_free(at);
    }
}

static void test_tekken_reference(void **state)
{
    (void)state;
    struct engine_tok *t = test_zstd_tok("tests/fixtures/tekken_vocab.gguf.zst");
    assert_int_equal(engine_tok_n_vocab(t), 131072);
    assert_int_equal(engine_tok_bos(t), 1);
    assert_int_equal(engine_tok_eos(t), 2);
    /* the control tokens in text only when asked; words split at capitals */
    size_t ni;
    int32_t *ids = encode(t, "[INST]HelloWorld[/INST]", 23, ENGINE_TOK_PARSE_SPECIAL, &ni);
    assert_true(ni >= 4 && ids[0] == 3 && ids[ni - 1] == 4);
    free(ids);
    ids = encode(t, "[INST]", 6, 0, &ni);
    assert_true(ni > 1);
    free(ids);
    check_fixture(t, "tests/fixtures/tokenizer_tekken.jsonl", 1500);
    check_random_bytes(t, getenv("QUERN_SANITIZE") ? 500 : 3000);
    engine_tok_free(t);
}

/* Llama 3's and Qwen2's vocabularies (llama.cpp's vocabulary-only GGUFs) against Hugging
 * Face's tokenizer over them (tests/fixtures/tokenizer_bpe_ref.jsonl: the reference checked
 * there against the ids HF's own tokenizer.json gave for llama.cpp's test strings). */
static void test_bpe_vocab_reference(void **state)
{
    (void)state;
    static const char *const names[] = {"llama-bpe", "qwen2"};
    struct engine_tok *t[2] = {test_zstd_tok("tests/fixtures/vocab_llama_bpe.gguf.zst"),
                               test_zstd_tok("tests/fixtures/vocab_qwen2.gguf.zst")};
    assert_int_equal(engine_tok_n_vocab(t[0]), 128256);
    assert_int_equal(engine_tok_n_vocab(t[1]), 151936);
    size_t flen;
    char *file = test_read_file("tests/fixtures/tokenizer_bpe_ref.jsonl", &flen);
    if (!file)
        fail_msg("missing tests/fixtures/tokenizer_bpe_ref.jsonl");
    size_t lines = 0, ids_total = 0;
    char *save = NULL;
    for (char *line = strtok_r(file, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        const cJSON *hex = cJSON_GetObjectItem(j, "hex");
        if (!hex) { /* a chat rendering: tests/test_chat_formats.c */
            cJSON_Delete(j);
            continue;
        }
        size_t len = 0;
        char *text = unhex(hex->valuestring, &len);
        assert_non_null(text);
        for (int k = 0; k < 2; k++) {
            const cJSON *want = cJSON_GetObjectItem(j, names[k]);
            size_t n;
            int32_t *ids = encode(t[k], text, len, 0, &n);
            int same = (size_t)cJSON_GetArraySize(want) == n;
            for (size_t i = 0; same && i < n; i++)
                same = ids[i] == cJSON_GetArrayItem(want, (int)i)->valueint;
            if (!same) {
                char *w = cJSON_PrintUnformatted(want);
                char g[1024];
                format_ids(g, sizeof(g), ids, n < 32 ? n : 32);
                fail_msg("tokenizer_bpe_ref line %zu, %s: text \"%.*s\"\n  got  %s\n  want %.400s",
                         lines + 1, names[k], (int)(len > 200 ? 200 : len), text, g, w);
            }
            ids_total += n;
            free(ids);
        }
        free(text);
        cJSON_Delete(j);
        lines++;
    }
    free(file);
    print_message("tokenizer_bpe_ref: %zu strings, %zu ids, Llama 3 and Qwen2 vocabularies as "
                  "Hugging Face's tokenizer\n",
                  lines, ids_total);
    assert_true(lines >= 1500);
    engine_tok_free(t[0]);
    engine_tok_free(t[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemma_reference),
        cmocka_unit_test(test_pretokenizers),
        cmocka_unit_test(test_tekken_reference),
        cmocka_unit_test(test_bpe_vocab_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
