/* jobs/schema: JSON schemas compiled to grammars accept the instances the schema allows (in
 * the shapes the grammar writes: properties in schema order) and refuse the ones it does not;
 * schemas that use what the grammar cannot guarantee are refused with the place and the
 * keyword. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jobs/schema.h"

struct case_ {
    const char *schema;
    const char *good[10]; /* accepted, NULL-terminated */
    const char *bad[10]; /* refused, NULL-terminated */
};

static const struct case_ cases[] = {
    {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}"
     "},"
     "\"required\":[\"a\"],\"additionalProperties\":false}",
     {"{\"a\":1}", "{\"a\": -7, \"b\": \"x\"}", "{ \"a\":0 ,\"b\":\"\" }", NULL},
     {"{}", "{\"b\":\"x\"}", "{\"a\":1.5}", "{\"a\":1,\"c\":2}", "{\"b\":\"x\",\"a\":1}",
      "{\"a\":\"1\"}", NULL}},
    {"{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"boolean\"},\"y\":{\"type\":\"null\"}}"
     "}",
     {"{}", "{\"x\":true}", "{\"y\":null}", "{\"x\":false,\"y\":null}", NULL},
     {"{\"x\":1}", "{\"y\":0}", "{,}", "{\"x\":true,}", NULL}},
    {"{\"type\":\"integer\",\"minimum\":-15,\"maximum\":230}",
     {"-15", "-9", "0", "7", "99", "100", "199", "230", NULL},
     {"-16", "-0", "231", "300", "1000", "007", "1.0", "-", NULL}},
    {"{\"type\":\"integer\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":10}",
     {"1", "9", NULL},
     {"0", "10", "-1", NULL}},
    {"{\"type\":\"integer\",\"minimum\":1000}",
     {"1000", "123456789", NULL},
     {"999", "-1000", NULL}},
    {"{\"type\":\"number\",\"minimum\":0}", {"0", "1.5", "2e-3", "10", NULL}, {"-1", "-0.5", NULL}},
    {"{\"type\":\"string\",\"enum\":[\"red\",\"green\",\"caf\\u00e9\"]}",
     {"\"red\"", "\"green\"", "\"caf\xc3\xa9\"", NULL},
     {"\"blue\"", "\"re\"", "red", NULL}},
    {"{\"enum\":[1,\"a\",null,[1,2],{\"k\":true}]}",
     {"1", "\"a\"", "null", "[1,2]", "{\"k\":true}", NULL},
     {"2", "[1, 2]", NULL}},
    {"{\"const\":\"fixed\"}", {"\"fixed\"", NULL}, {"\"other\"", NULL}},
    {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}",
     {"\"ab\"", "\"abc\"", "\"\\n\\u00e9\"", "\"\xc3\xa9\xc3\xa9\"", NULL},
     {"\"a\"", "\"abcd\"", "\"\"", NULL}},
    {"{\"type\":\"string\",\"minLength\":1}", {"\"a\"", "\"abcdefgh\"", NULL}, {"\"\"", NULL}},
    {"{\"type\":\"string\",\"format\":\"date\"}",
     {"\"2024-01-31\"", "\"1999-04-30\"", "\"2023-02-28\"", "\"0001-12-01\"", NULL},
     {"\"2024-04-31\"", "\"2023-02-29\"", "\"2024-13-01\"", "\"2024-00-10\"", "\"2024-1-01\"",
      "\"2024-01-00\"", "\"0000-01-01\"", NULL}},
    {"{\"type\":\"string\",\"format\":\"date-time\"}",
     {"\"2024-01-31T23:59:59Z\"", "\"2024-01-31T00:00:00.123+05:30\"", NULL},
     {"\"2024-01-31 23:59:59Z\"", "\"2024-01-31T24:00:00Z\"", "\"2024-01-31T10:00:00\"", NULL}},
    {"{\"type\":\"string\",\"format\":\"uuid\"}",
     {"\"123e4567-e89b-12d3-a456-426614174000\"", NULL},
     {"\"123e4567e89b12d3a456426614174000\"", "\"123e4567-e89b-12d3-a456-42661417400g\"", NULL}},
    {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":3}",
     {"[1]", "[1,2]", "[ 1 , 2 , 3 ]", NULL},
     {"[]", "[1,2,3,4]", "[\"a\"]", "[1,]", NULL}},
    {"{\"type\":\"array\",\"minItems\":2}",
     {"[1,\"a\"]", "[{},[],null,true]", NULL},
     {"[]", "[1]", NULL}},
    {"{\"type\":\"array\",\"maxItems\":0}", {"[]", NULL}, {"[1]", NULL}},
    {"{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"null\"}]}",
     {"5", "null", NULL},
     {"\"5\"", "true", NULL}},
    {"{\"type\":[\"string\",\"boolean\"]}", {"\"s\"", "false", NULL}, {"1", "null", NULL}},
    {"{\"type\":\"integer\",\"nullable\":true}", {"3", "null", NULL}, {"\"3\"", NULL}},
    /* a $ref's NAME escaped as a JSON pointer in a URI fragment: ~1 '/', ~0 '~', %25 '%' (an
     * audit: refused) */
    {"{\"type\":\"array\",\"items\":{\"anyOf\":[{\"$ref\":\"#/$defs/a~1b\"},"
     "{\"$ref\":\"#/$defs/c~0d\"},{\"$ref\":\"#/$defs/e%25f\"}]},"
     "\"$defs\":{\"a/b\":{\"type\":\"integer\"},\"c~d\":{\"type\":\"boolean\"},"
     "\"e%f\":{\"type\":\"null\"}}}",
     {"[1,true,null]", "[]", "[-3]", NULL},
     {"[\"x\"]", "[1.5]", "[{}]", NULL}},
    {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
     "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},"
     "\"required\":[\"v\",\"next\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",
     {"{\"v\":1,\"next\":null}", "{\"v\":1,\"next\":{\"v\":2,\"next\":{\"v\":3,\"next\":null}}}",
      NULL},
     {"{\"v\":1}", "{\"v\":1,\"next\":{\"v\":2}}", NULL}},
    {"{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}",
     {"{}", "{\"a\":1,\"b\":2}", NULL},
     {"{\"a\":\"x\"}", NULL}},
    {"{\"type\":\"object\",\"additionalProperties\":false}", {"{}", NULL}, {"{\"a\":1}", NULL}},
    {"{\"title\":\"anything\",\"description\":\"untyped\"}",
     {"1", "\"s\"", "{\"a\":[null]}", NULL},
     {"", "nul", NULL}},
    /* the schema audit of 2026-12-05 (each accepted a text its schema forbids, or refused a
     * valid one): whitespace before '}' when every property is optional */
    {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}",
     {"{}", "{ }", "{\"a\":1 }", "{\n  \"a\": 1\n}", NULL},
     {"{\"a\":1,}", "{ \"a\":1 , }", NULL}},
    /* February 29 in leap years only; RFC 3339's lower-case t and z */
    {"{\"type\":\"string\",\"format\":\"date\"}",
     {"\"2024-02-29\"", "\"2000-02-29\"", "\"0004-02-29\"", "\"1996-02-29\"", NULL},
     {"\"2023-02-29\"", "\"1900-02-29\"", "\"2100-02-29\"", "\"0000-02-29\"", "\"2024-02-30\"",
      NULL}},
    {"{\"type\":\"string\",\"format\":\"date-time\"}",
     {"\"2024-01-01t00:00:00z\"", NULL},
     {"\"2024-01-01x00:00:00z\"", NULL}},
    /* a surrogate pair escape is one character; a lone surrogate none */
    {"{\"type\":\"string\",\"maxLength\":1}",
     {"\"\\ud83d\\ude00\"", "\"\\uD83D\\uDE00\"", "\"\\ud7ff\"", "\"\\ue000\"", NULL},
     {"\"\\ud800\"", "\"\\udc00\"", "\"\\ud83d\\u0041\"", "\"\\ud83dx\"", NULL}},
    {"{\"type\":\"string\",\"minLength\":2}",
     {"\"\\ud83d\\ude00a\"", NULL},
     {"\"\\ud83d\\ude00\"", NULL}},
    /* enum and const numbers as exactly as the schema gives them (cJSON printed 15 digits) */
    {"{\"enum\":[0.30000000000000004]}", {"0.30000000000000004", NULL}, {"0.3", NULL}},
    {"{\"type\":\"integer\",\"const\":1000000000000000}",
     {"1000000000000000", NULL},
     {"1e+15", NULL}},
    /* untyped: the type its keywords constrain */
    {"{\"minLength\":3}", {"\"abc\"", NULL}, {"\"a\"", "5", "null", NULL}},
    {"{\"minItems\":2}", {"[1,2]", NULL}, {"[]", "\"ab\"", NULL}},
    {"{\"additionalProperties\":false}", {"{}", NULL}, {"{\"x\":1}", NULL}},
};

static void test_instances(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct case_ *c = &cases[i];
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        if (job_schema_grammar_text(JOB_FORMAT_JSON_SCHEMA, c->schema, &g, &err))
            fail_msg("schema %zu refused: %s", i, err.msg);
        for (int k = 0; c->good[k]; k++) {
            int32_t s = engine_grammar_feed(g, engine_grammar_start(g), c->good[k],
                                            strlen(c->good[k]));
            if (!engine_grammar_accepting(g, s))
                fail_msg("schema %zu: refused %s", i, c->good[k]);
        }
        for (int k = 0; c->bad[k]; k++) {
            int32_t s = engine_grammar_feed(g, engine_grammar_start(g), c->bad[k],
                                            strlen(c->bad[k]));
            if (engine_grammar_accepting(g, s))
                fail_msg("schema %zu: accepted %s", i, c->bad[k]);
        }
        engine_grammar_unref(g);
    }
}

static void test_refusals(void **state)
{
    (void)state;
    static const struct {
        const char *schema, *want;
        enum status st;
    } r[] = {
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"pattern\":\"^a\"}}}",
         "properties.a: keyword 'pattern' is not supported", ST_ERR_UNSUPPORTED},
        {"{\"oneOf\":[{\"type\":\"string\"}]}", "keyword 'oneOf' is not supported",
         ST_ERR_UNSUPPORTED},
        {"{\"type\":\"array\",\"items\":{\"type\":\"string\",\"format\":\"email\"}}",
         "items: format 'email' is not supported", ST_ERR_UNSUPPORTED},
        {"{\"type\":\"number\",\"maximum\":5}", "'maximum' on a number is not supported",
         ST_ERR_UNSUPPORTED},
        {"{\"$ref\":\"#/$defs/missing\"}", "$ref '#/$defs/missing' names no definition",
         ST_ERR_INVALID_ARG},
        {"{\"$ref\":\"http://x/y.json\"}", "only #", ST_ERR_UNSUPPORTED},
        {"{\"type\":\"object\",\"properties\":{},\"required\":[\"a\"]}",
         "required property 'a' is not in 'properties'", ST_ERR_UNSUPPORTED},
        {"{\"type\":\"strin\"}", "unknown type 'strin'", ST_ERR_INVALID_ARG},
        {"{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "no integer lies within",
         ST_ERR_INVALID_ARG},
        {"{\"type\":\"array\",\"maxItems\":5000}", "'maxItems' over 1024", ST_ERR_UNSUPPORTED},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"object\",\"properties\":{\"k\":"
         "{\"uniqueItems\":true}}}]}",
         "anyOf[1].properties.k: keyword 'uniqueItems' is not supported", ST_ERR_UNSUPPORTED},
        {"[1]", "a schema must be an object", ST_ERR_INVALID_ARG},
        /* the schema audit of 2026-12-05: each compiled before and accepted texts it forbids */
        {"{\"anyOf\":[{\"type\":\"string\"}],\"maxLength\":2}", "'maxLength' next to anyOf",
         ST_ERR_UNSUPPORTED},
        {"{\"enum\":[\"a\",\"bb\"],\"maxLength\":1}", "'maxLength' next to enum",
         ST_ERR_UNSUPPORTED},
        {"{\"const\":{\"a\":1},\"properties\":{\"b\":{}},\"required\":[\"b\"]}",
         "'properties' next to const", ST_ERR_UNSUPPORTED},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":9007199254740992}", "at or beyond +-2^53",
         ST_ERR_UNSUPPORTED},
        {"{\"type\":\"integer\",\"minimum\":9007199254740993}", "at or beyond +-2^53",
         ST_ERR_UNSUPPORTED},
        {"{\"enum\":[9007199254740993]}", "integer beyond +-2^53", ST_ERR_UNSUPPORTED},
        {"{\"const\":[1e400]}", "not finite", ST_ERR_UNSUPPORTED},
        {"{\"type\":\"string\",\"type\":\"integer\"}", "key 'type' appears twice",
         ST_ERR_INVALID_ARG},
        {"{\"properties\":{\"a\":{},\"b\":{\"x\":1,\"x\":2}}}", "key 'x' appears twice",
         ST_ERR_INVALID_ARG},
        {"{\"maximum\":5}", "'maximum' without 'type'", ST_ERR_UNSUPPORTED},
        {"{\"minLength\":1,\"minItems\":1}", "keywords of two types", ST_ERR_UNSUPPORTED},
        {"{\"$ref\":\"#/$defs/a%2x\",\"$defs\":{\"a%b\":{}}}", "only #", ST_ERR_UNSUPPORTED},
        {"{\"$ref\":\"#/$defs/a~2\",\"$defs\":{\"a~2\":{}}}", "only #", ST_ERR_UNSUPPORTED},
        {"{\"$ref\":\"#/$defs/a/b\",\"$defs\":{\"a\":{\"b\":{}}}}", "only #", ST_ERR_UNSUPPORTED},
        {"{\"$ref\":\"#/$defs/a%2Fb\",\"$defs\":{\"a/b\":{}}}", "only #", ST_ERR_UNSUPPORTED},
        /* an audit of 2026-12-06: a sub-schema's $id would scope its $refs (quern's resolve
         * against the root: outputs violated the schema), nullable next to enum let null
         * through, and a format on an integer went unchecked */
        {"{\"type\":\"object\",\"properties\":{\"c\":{\"$id\":\"https://x/c\",\"$defs\":{\"x\":"
         "{\"type\":\"integer\"}},\"properties\":{\"v\":{\"$ref\":\"#/$defs/x\"}}}}}",
         "properties.c: '$id' below the root", ST_ERR_UNSUPPORTED},
        {"{\"type\":\"string\",\"enum\":[\"x\"],\"nullable\":true}", "'nullable' next to enum",
         ST_ERR_UNSUPPORTED},
        {"{\"const\":1,\"nullable\":true}", "'nullable' next to const", ST_ERR_UNSUPPORTED},
        {"{\"type\":\"strin\",\"enum\":[\"a\"]}", "unknown type 'strin'", ST_ERR_INVALID_ARG},
        {"{\"type\":\"integer\",\"format\":\"int32\"}", "'format' on a type other than string",
         ST_ERR_UNSUPPORTED},
        {"{\"type\":[\"number\",\"null\"],\"format\":\"float\"}", "'format' on a type",
         ST_ERR_UNSUPPORTED},
    };
    for (size_t i = 0; i < sizeof(r) / sizeof(r[0]); i++) {
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        enum status st = job_schema_grammar_text(JOB_FORMAT_JSON_SCHEMA, r[i].schema, &g, &err);
        assert_null(g);
        if (st != r[i].st || !strstr(err.msg, r[i].want))
            fail_msg("schema %s: status %d, message '%s' (want %d, '%s')", r[i].schema, st,
                     err.msg, r[i].st, r[i].want);
    }
}

/* quern's GBNF-style grammars: sentences accepted and refused, every operator; errors with
 * their line. */
static void test_gbnf(void **state)
{
    (void)state;
    static const struct {
        const char *grammar;
        const char *good[6], *bad[6];
    } c[] = {
        {"root ::= \"yes\" | \"no\"", {"yes", "no", NULL}, {"", "ye", "yesno", "No", NULL}},
        {"# comment\nroot ::= digit+ (\".\" digit{2})?  # trailing\ndigit ::= [0-9]\n",
         {"7", "123", "4.50", NULL}, {"", ".5", "1.5", "1.505", "a", NULL}},
        {"root ::= item (\",\" item)*\nitem ::= [a-c]{1,2} | \"x\"?\n",
         {"a", "ab,c", ",", "x,,cc", NULL}, {"abc", "d", "a;b", NULL}},
        {"root ::= [^\"\\n]* \"\\n\"", {"\n", "caf\xc3\xa9 ok\n", NULL}, {"a\"\n", "a", NULL}},
        {"root ::= \"\\x41\\u00e9\\t\" .", {"A\xc3\xa9\tz", "A\xc3\xa9\t\xe2\x82\xac", NULL},
         {"A\xc3\xa9\t", "A\xc3\xa9\tzz", NULL}},
        {"root ::= a\n  | b\na ::= \"a\"\nb ::= [\xc3\xa9\xc3\xb6]", {"a", "\xc3\xa9", "\xc3\xb6", NULL},
         {"b", "\xc3\xa8", NULL}},
        {"root ::= \"(\" root \")\" | \"\"", {"", "()", "((()))", NULL}, {"(", "())", NULL}},
        /* only the empty output: a state with no stack at all (fuzz_grammar found NULL passed
         * to qsort and memcpy there) */
        {"root ::= \"\"", {"", NULL}, {"a", NULL}},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        if (job_gbnf_grammar(c[i].grammar, &g, &err))
            fail_msg("grammar %zu refused: %s", i, err.msg);
        for (int k = 0; c[i].good[k]; k++)
            if (!engine_grammar_accepting(g, engine_grammar_feed(g, engine_grammar_start(g),
                                                                 c[i].good[k],
                                                                 strlen(c[i].good[k]))))
                fail_msg("grammar %zu refused %s", i, c[i].good[k]);
        for (int k = 0; c[i].bad[k]; k++)
            if (engine_grammar_accepting(g, engine_grammar_feed(g, engine_grammar_start(g),
                                                                c[i].bad[k],
                                                                strlen(c[i].bad[k]))))
                fail_msg("grammar %zu accepted %s", i, c[i].bad[k]);
        engine_grammar_unref(g);
    }
    /* two chains of 120 nested optionals: the closure work stays linear (the fuzzer found a
     * line whose start state took 42 s when each path re-expanded what follows the chain) */
    {
        char text[512];
        int n = snprintf(text, sizeof(text), "root ::= \"a\" .");
        for (int k = 0; k < 120; k++)
            text[n++] = '?';
        n += snprintf(text + n, sizeof(text) - (size_t)n, " .");
        for (int k = 0; k < 120; k++)
            text[n++] = '?';
        text[n] = 0;
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        assert_int_equal(job_gbnf_grammar(text, &g, &err), ST_OK);
        int32_t s = engine_grammar_feed(g, engine_grammar_start(g), "axy", 3);
        assert_true(engine_grammar_accepting(g, s));
        print_message("nested optionals: %llu frame expansions\n",
                      (unsigned long long)engine_grammar_expansions(g));
        assert_true(engine_grammar_expansions(g) < 5000);
        engine_grammar_unref(g);
    }
    /* an ambiguous grammar ((.+)+ nested 17 deep): the parses alive grow until a byte passes
     * ENGINE_GRAMMAR_MAX_STACKS and the state is dead, never an unbounded closure (the grammar
     * fuzzer's 74 s input) */
    {
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        assert_int_equal(job_gbnf_grammar("root ::= .+++++++++++++++++", &g, &err), ST_OK);
        int32_t s = engine_grammar_start(g);
        int steps = 0;
        while (s >= 0 && steps < 64)
            s = engine_grammar_step(g, s, (unsigned char)('a' + steps++ % 26));
        print_message("(.+)+ x17: dead after %d bytes, %llu frame expansions\n", steps,
                      (unsigned long long)engine_grammar_expansions(g));
        assert_true(s < 0 && steps > 1);
        assert_true(engine_grammar_expansions(g) < (uint64_t)steps * 2 * ENGINE_GRAMMAR_MAX_STACKS);
        engine_grammar_unref(g);
    }
    /* nested repetitions of a nullable item: each of the outer 221 places holds the inner 221,
     * each nesting 90 optionals, so the start's closure reaches ~4.4M distinct frames that end
     * at few bytes (the request fuzzer's 390-byte line took 2.2 s and 353 MB at submit, 18 s
     * under ASan). The closure stops at ENGINE_GRAMMAR_MAX_EXPAND and the grammar is refused. */
    {
        char text[512];
        int n = snprintf(text, sizeof(text), "root ::= \"0\"");
        for (int k = 0; k < 90; k++)
            text[n++] = '?';
        n += snprintf(text + n, sizeof(text) - (size_t)n, "{221}??????{221}");
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        assert_int_equal(job_gbnf_grammar(text, &g, &err), ST_ERR_INVALID_ARG);
        assert_null(g);
        print_message("nested repetitions: %s\n", err.msg);
        assert_non_null(strstr(err.msg, "too ambiguous"));
        /* the same shape, smaller, still compiles (the bound is not hit by a modest grammar) */
        n = snprintf(text, sizeof(text), "root ::= \"0\"???{20}??{20}");
        assert_int_equal(job_gbnf_grammar(text, &g, &err), ST_OK);
        assert_true(engine_grammar_accepting(
            g, engine_grammar_feed(g, engine_grammar_start(g), "000000", 6)));
        engine_grammar_unref(g);
    }
    /* size: 20,000 alternatives "a"{255} (5.1M alternatives counted out) took 4.8 s and 2.1 GB
     * before the builder's caps; a JSON schema's 300,000-value enum likewise */
    {
        const size_t n = 20000;
        char *text = malloc(4u << 20); /* (either text fits) */
        assert_non_null(text);
        size_t k = (size_t)sprintf(text, "root ::= \"a\"{255}");
        for (size_t i = 1; i < n; i++)
            k += (size_t)sprintf(text + k, " | \"a\"{255}");
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        assert_int_equal(job_gbnf_grammar(text, &g, &err), ST_ERR_INVALID_ARG);
        assert_null(g);
        print_message("20,000 x \"a\"{255}: %s\n", err.msg);
        assert_non_null(strstr(err.msg, "too large"));
        k = (size_t)sprintf(text, "{\"enum\": [0");
        for (int i = 1; i < 300000; i++)
            k += (size_t)sprintf(text + k, ",%d", i);
        sprintf(text + k, "]}");
        assert_int_equal(job_schema_grammar_text(JOB_FORMAT_JSON_SCHEMA, text, &g, &err),
                         ST_ERR_INVALID_ARG);
        assert_null(g);
        print_message("300,000-value enum: %s\n", err.msg);
        assert_non_null(strstr(err.msg, "too large"));
        free(text);
    }
    static const struct {
        const char *grammar, *want;
    } e[] = {
        {"root ::= foo", "line 1: rule 'foo' is used but not defined"},
        {"root ::= \"a\"\nroot ::= \"b\"", "line 2: rule defined twice"},
        {"root ::= x \"a\"\nx ::= \"\" | root", "is left-recursive"},
        {"root ::= (\"a\"", "line 1: expected ')'"},
        {"r ::= \"a\"", "no rule named 'root'"},
        {"root ::= \"a\n\"", "line 1: unterminated literal or class"},
        {"root ::= [z-a]", "class ranges must be ASCII, low to high"},
        {"root ::= \"a\"{3,2}", "bad {m,n}"},
        {"root ::= \"\\q\"", "unknown escape"},
        {"\n\nroot = \"a\"", "line 3: expected '::='"},
    };
    for (size_t i = 0; i < sizeof(e) / sizeof(e[0]); i++) {
        struct engine_grammar *g = NULL;
        struct err_detail err = {0};
        if (!job_gbnf_grammar(e[i].grammar, &g, &err) || !strstr(err.msg, e[i].want))
            fail_msg("grammar %s: message '%s', want '%s'", e[i].grammar, err.msg, e[i].want);
        assert_null(g);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_instances),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_gbnf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
