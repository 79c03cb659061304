/* engine/grammar: the JSON pieces accept exactly the JSON texts of their kind (checked on
 * hand-picked valid and invalid texts, including UTF-8 edge cases); token masks equal feeding
 * every token's bytes one by one (the default model's 49,152 tokens, several states and two
 * grammars); bad grammars (left recursion, a rule without alternatives) are refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "jobs/schema.h"
#include "tests/test_util.h"

static struct engine_grammar *json_object_grammar(void)
{
    struct engine_gb *b;
    struct engine_grammar *g;
    struct err_detail err = {0};
    assert_int_equal(engine_gb_new(&b, &err), ST_OK);
    int32_t root = engine_gb_rule(b);
    engine_gb_alt(b, root);
    engine_gb_ref(b, engine_gb_json_object(b));
    if (engine_gb_finish(b, &g, &err))
        fail_msg("finish: %s", err.msg);
    return g;
}

static int accepts(struct engine_grammar *g, const char *text)
{
    int32_t s = engine_grammar_feed(g, engine_grammar_start(g), text, strlen(text));
    return engine_grammar_accepting(g, s);
}

static void test_json_object_texts(void **state)
{
    (void)state;
    struct engine_grammar *g = json_object_grammar();
    static const char *const good[] = {
        "{}", "{ }", "{\"a\":1}", "{\"a\" : -0.5e+10, \"b\":[true,false,null]}",
        "{\n  \"k\": {\"x\": [1, [2, {}], \"s\"]},\n  \"e\": \"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\"\n}",
        "{\"u\":\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xed\x9f\xbf \xf4\x8f\xbf\xbf\"}",
        "{\"n\":0,\"m\":-12,\"f\":3.25,\"E\":1E5}", "{\"del\":\"\x7f\"}",
    };
    static const char *const bad[] = {
        "", "[]", "\"s\"", "{", "{\"a\"}", "{\"a\":}", "{\"a\":1,}", "{,}", "{\"a\":01}",
        "{\"a\":1.}", "{\"a\":.5}", "{\"a\":-}", "{\"a\":tru}", "{\"a\":\"\\x\"}",
        "{\"a\":\"\\u12\"}", "{\"a\":\"\x01\"}", "{\"a\":\"\xc0\xaf\"}", "{\"a\":\"\xed\xa0\x80\"}",
        "{\"a\":\"\xf4\x90\x80\x80\"}", "{\"a\":\"\xff\"}", "{'a':1}", "{\"a\":1}}", "{} ",
        "{\"a\":[1 2]}", "{\"a\":NaN}",
        "{\n                      \"a\":1}", /* a newline then 22 spaces: more than ws allows */
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++)
        if (!accepts(g, good[i]))
            fail_msg("refused valid %s", good[i]);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        if (accepts(g, bad[i]))
            fail_msg("accepted invalid %s", bad[i]);
    /* after the closing brace nothing may follow */
    int32_t s = engine_grammar_feed(g, engine_grammar_start(g), "{}", 2);
    assert_true(engine_grammar_final(g, s));
    assert_int_equal(engine_grammar_step(g, s, ' '), ENGINE_GRAMMAR_DEAD);
    engine_grammar_unref(g);
}

static void test_bad_grammars(void **state)
{
    (void)state;
    struct engine_gb *b;
    struct engine_grammar *g;
    struct err_detail err = {0};
    /* a ::= b "x"; b ::= "" | a */
    assert_int_equal(engine_gb_new(&b, &err), ST_OK);
    int32_t a = engine_gb_rule(b), c = engine_gb_rule(b);
    engine_gb_alt(b, a);
    engine_gb_ref(b, c);
    engine_gb_lit(b, "x", 1);
    engine_gb_alt(b, c);
    engine_gb_alt(b, c);
    engine_gb_ref(b, a);
    assert_int_equal(engine_gb_finish(b, &g, &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "left-recursive"));
    assert_null(g);
    /* a rule nobody defined */
    assert_int_equal(engine_gb_new(&b, &err), ST_OK);
    a = engine_gb_rule(b);
    c = engine_gb_rule(b);
    engine_gb_alt(b, a);
    engine_gb_ref(b, c);
    assert_int_equal(engine_gb_finish(b, &g, &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "no alternative"));
}

/* Compare g's masks after each prefix with feeding every token's bytes; returns how many
 * tokens the masks allowed in all. */
static long check_masks(struct engine_grammar *g, struct engine_vocab *v,
                        const struct engine_tok *tok, int32_t n_logits,
                        const char *const *prefixes, size_t n_prefixes, const char *what)
{
    const int32_t n_tok = engine_tok_n_vocab(tok);
    char piece[256];
    long total = 0;
    for (size_t p = 0; p < n_prefixes; p++) {
        int32_t s = engine_grammar_feed(g, engine_grammar_start(g), prefixes[p],
                                        strlen(prefixes[p]));
        assert_true(s >= 0);
        const uint32_t *m = engine_grammar_mask(g, s, v);
        assert_non_null(m);
        int32_t allowed = 0;
        for (int32_t t = 0; t < n_logits; t++) {
            int want;
            if (t >= n_tok)
                want = 0;
            else if (engine_tok_is_eog(tok, t))
                want = engine_grammar_accepting(g, s);
            else {
                size_t n = engine_tok_piece(tok, t, 0, piece, sizeof(piece));
                want = n > 0 && n <= sizeof(piece) && engine_grammar_feed(g, s, piece, n) >= 0;
            }
            int got = (int)(m[t >> 5] >> (t & 31) & 1);
            if (got != want)
                fail_msg("%s, prefix %s: token %d mask %d, feeding says %d", what, prefixes[p],
                         t, got, want);
            allowed += got;
        }
        print_message("%s %-22s %6d tokens allowed\n", what, prefixes[p], allowed);
        assert_true(allowed > 0);
        assert_ptr_equal(engine_grammar_mask(g, s, v), m); /* cached */
        total += allowed;
    }
    return total;
}

/* The default model's tokenizer and its vocabulary for masks of n_vocab + pad logits. */
static struct engine_vocab *load_vocab(struct io_gguf **gf, struct engine_tok **tok, int32_t pad)
{
    struct err_detail err = {0};
    struct engine_vocab *v = NULL;
    if (io_gguf_open(gf, test_model_path(), &err) || engine_tok_load(tok, *gf, &err) ||
        engine_vocab_new(&v, *tok, engine_tok_n_vocab(*tok) + pad, &err))
        fail_msg("tokenizer: %s", err.msg);
    return v;
}

/* Masks against the obvious computation (feed each token's bytes), on JSON objects at several
 * depths and on a GBNF grammar. */
static void test_masks_match_feeding(void **state)
{
    (void)state;
    struct io_gguf *gf = NULL;
    struct engine_tok *tok = NULL;
    struct err_detail err = {0};
    struct engine_vocab *v = load_vocab(&gf, &tok, 40); /* padded rows */
    const int32_t n_logits = engine_tok_n_vocab(tok) + 40;
    static const char *const json_prefixes[] = {
        "", "{", "{\"ke", "{\"k\":", "{\"k\": 1", "{\"k\":[", "{\"k\":\"caf\xc3", "{\"k\":true}",
        "{\"k\":1.5e", "{\"a\":{\"b\":[{\"c\":\"x", "{\"a\":{\"b\":[{\"c\":\"x\"}", "{\"a\":[[[1,"};
    static const char *const gbnf_prefixes[] = {"", "x", "xy:", "x: ab", "x: ab c"};
    struct engine_grammar *g = json_object_grammar();
    long a = check_masks(g, v, tok, n_logits, json_prefixes,
                         sizeof(json_prefixes) / sizeof(json_prefixes[0]), "json");
    uint64_t computed, cached;
    engine_grammar_counts(g, &computed, &cached);
    assert_true(computed >= 1 && cached >= 1);
    engine_grammar_unref(g);
    assert_int_equal(job_gbnf_grammar("root ::= word \":\" tail\nword ::= [a-z]+\n"
                                      "tail ::= (\" \" [a-z]+)* .\n",
                                      &g, &err),
                     ST_OK);
    long b = check_masks(g, v, tok, n_logits, gbnf_prefixes,
                         sizeof(gbnf_prefixes) / sizeof(gbnf_prefixes[0]), "gbnf");
    engine_grammar_unref(g);
    assert_true(a > 0 && b > 0);
    engine_vocab_free(v);
    engine_tok_free(tok);
    io_gguf_close(gf);
}

/* A mask's work is bounded (ENGINE_GRAMMAR_MASK_WORK), and whether a mask passes the bound
 * depends on its state alone: "([a-z ]?{100}){40}" keeps ~4,000 parses alive through every
 * letter, and its first mask (0.45 s without the bound) allows nothing, also when another walk
 * computed and cached steps first; a JSON state's mask is untouched. */
static void test_mask_work_bound(void **state)
{
    (void)state;
    struct io_gguf *gf = NULL;
    struct engine_tok *tok = NULL;
    struct err_detail err = {0};
    struct engine_vocab *v = load_vocab(&gf, &tok, 0);
    const int32_t n_logits = engine_tok_n_vocab(tok);
    for (int warm = 0; warm < 2; warm++) {
        struct engine_grammar *g = NULL;
        assert_int_equal(job_gbnf_grammar("root ::= ([a-z ]?{100}){40}", &g, &err), ST_OK);
        int32_t s = engine_grammar_start(g);
        if (warm) /* steps of the start state computed (and cached) by feeding first */
            assert_true(engine_grammar_feed(g, s, "the cat", 7) >= 0);
        const uint32_t *m = engine_grammar_mask(g, s, v);
        assert_non_null(m);
        int any = 0;
        for (int32_t w = 0; w < (n_logits + 31) / 32; w++)
            any |= m[w] != 0;
        print_message("([a-z ]?{100}){40}%s: mask cut %llu, %llu frame expansions\n",
                      warm ? " after a feed" : "", (unsigned long long)engine_grammar_masks_cut(g),
                      (unsigned long long)engine_grammar_expansions(g));
        assert_false(any);
        assert_int_equal(engine_grammar_masks_cut(g), 1);
        assert_true(engine_grammar_expansions(g) <= 2 * (uint64_t)ENGINE_GRAMMAR_MASK_WORK);
        engine_grammar_unref(g);
    }
    engine_vocab_free(v);
    engine_tok_free(tok);
    io_gguf_close(gf);
    /* ordinary masks are never cut, on the default model's 49k vocabulary nor on Gemma 3's
     * 262k (counting every step taken rather than every distinct one cut these on Gemma) */
    for (int gemma = 0; gemma < 2; gemma++) {
        struct err_detail e2 = {0};
        if (io_gguf_open(&gf, gemma ? test_gemma_path() : test_model_path(), &e2) ||
            engine_tok_load(&tok, gf, &e2) ||
            engine_vocab_new(&v, tok, engine_tok_n_vocab(tok), &e2))
            fail_msg("tokenizer: %s", e2.msg);
        const int32_t nv = engine_tok_n_vocab(tok);
        static const char *const gbnf[] = {
            "root ::= [^\\n]* \"!\" | [^\\n]* \"?\" | [^\\n]* \".\" | [^\\n]* \";\"",
            "root ::= (\"{\\\"name\\\": \\\"\" [a-z ]* \"\\\", \\\"\" [abc] \"\\\": 1}\")+",
        };
        for (int k = 0; k < 3; k++) {
            struct engine_grammar *g = NULL;
            if (k == 2)
                g = json_object_grammar();
            else
                assert_int_equal(job_gbnf_grammar(gbnf[k], &g, &e2), ST_OK);
            const char *pre = k == 2 ? "{\"k\": \"ab" : k == 1 ? "{\"name\": \"x" : "Hi";
            int32_t s = engine_grammar_feed(g, engine_grammar_start(g), pre, strlen(pre));
            const uint32_t *m = engine_grammar_mask(g, s, v);
            assert_non_null(m);
            int32_t allowed = 0;
            for (int32_t t = 0; t < nv; t++)
                allowed += m[t >> 5] >> (t & 31) & 1;
            if (engine_grammar_masks_cut(g) || allowed < nv / 20)
                fail_msg("%s, grammar %d: %d of %d tokens allowed, %llu cut",
                         gemma ? "gemma" : "smollm2", k, allowed, nv,
                         (unsigned long long)engine_grammar_masks_cut(g));
            engine_grammar_unref(g);
        }
        engine_vocab_free(v);
        engine_tok_free(tok);
        io_gguf_close(gf);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_object_texts),
        cmocka_unit_test(test_bad_grammars),
        cmocka_unit_test(test_masks_match_feeding),
        cmocka_unit_test(test_mask_work_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
