/* Unit tests for jobs/ output records, read back with cJSON: success records (ids), text
 * encoding (U+FFFD replacement, control-character escapes) and error records. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "jobs/params.h"
#include "tests/test_jobs_util.h"
#include "tests/test_util.h"

/* ---- records ------------------------------------------------------------------------------ */

static const cJSON *at(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!v)
        print_error("missing key %s\n", k);
    assert_non_null(v);
    return v;
}

static void assert_hex_id(const char *s, const char *prefix)
{
    size_t p = strlen(prefix);
    assert_int_equal(strncmp(s, prefix, p), 0);
    assert_int_equal(strlen(s), p + 32);
    for (size_t i = p; i < p + 32; i++)
        assert_non_null(strchr("0123456789abcdef", s[i]));
}

static void test_record_success(void **state)
{
    (void)state;
    static const char text[] = "Paris.\nThe \"capital\" \\ \xc3\xa9";
    struct job_choice ch0 = {.text = text, .text_len = sizeof(text) - 1, .finish_reason = "stop",
                             .completion_tokens = 4};
    struct job_result res = {.custom_id = "q-1",
                             .kind = JOB_KIND_CHAT,
                             .model = "smollm2",
                             .choices = &ch0,
                             .n_choices = 1,
                             .prompt_tokens = 31,
                             .cached_tokens = 16,
                             .created = 1700000000,
                             .job_id = 9};
    char *line = job_record_success(&res);
    assert_non_null(line);
    assert_null(strchr(line, '\n'));
    assert_strict_json(line);
    cJSON *root = cJSON_Parse(line);
    assert_non_null(root);
    assert_hex_id(at(root, "id")->valuestring, "batch_req_");
    assert_string_equal(at(root, "custom_id")->valuestring, "q-1");
    assert_true(cJSON_IsNull(at(root, "error")));
    const cJSON *resp = at(root, "response");
    assert_int_equal(at(resp, "status_code")->valueint, 200);
    assert_hex_id(at(resp, "request_id")->valuestring, "req_");
    const cJSON *body = at(resp, "body");
    assert_hex_id(at(body, "id")->valuestring, "chatcmpl-");
    assert_string_equal(at(body, "object")->valuestring, "chat.completion");
    assert_true(at(body, "created")->valuedouble == 1700000000.0);
    assert_string_equal(at(body, "model")->valuestring, "smollm2");
    const cJSON *choices = at(body, "choices");
    assert_int_equal(cJSON_GetArraySize(choices), 1);
    const cJSON *ch = cJSON_GetArrayItem(choices, 0);
    assert_int_equal(at(ch, "index")->valueint, 0);
    assert_string_equal(at(at(ch, "message"), "role")->valuestring, "assistant");
    assert_string_equal(at(at(ch, "message"), "content")->valuestring, text);
    assert_true(cJSON_IsNull(at(ch, "logprobs")));
    assert_string_equal(at(ch, "finish_reason")->valuestring, "stop");
    const cJSON *usage = at(body, "usage");
    assert_int_equal(at(usage, "prompt_tokens")->valueint, 31);
    assert_int_equal(at(usage, "completion_tokens")->valueint, 4);
    assert_int_equal(at(usage, "total_tokens")->valueint, 35);
    /* OpenAI's fields that code reads without .get (an audit): present, with quern's values */
    assert_int_equal(at(at(usage, "prompt_tokens_details"), "cached_tokens")->valueint, 16);
    assert_int_equal(at(at(usage, "completion_tokens_details"), "reasoning_tokens")->valueint, 0);
    assert_true(cJSON_IsNull(at(body, "system_fingerprint")));
    assert_true(cJSON_IsNull(at(at(ch, "message"), "refusal")));

    /* ids: deterministic, distinct per field, per custom_id and per job */
    char *again = job_record_success(&res);
    assert_string_equal(line, again);
    const char *id = at(root, "id")->valuestring + 10;
    assert_string_not_equal(id, at(resp, "request_id")->valuestring + 4);
    assert_string_not_equal(id, at(body, "id")->valuestring + 9);
    char h1[33], h2[33], h3[33];
    job_record_hash_hex("batch_req", 9, "q-1", h1);
    assert_string_equal(h1, id);
    job_record_hash_hex("batch_req", 9, "q-2", h2);
    job_record_hash_hex("batch_req", 10, "q-1", h3);
    assert_string_not_equal(h1, h2);
    assert_string_not_equal(h1, h3);
    free(again);
    cJSON_Delete(root);
    free(line);

    /* text completion, finish length */
    res.kind = JOB_KIND_COMPLETION;
    ch0.finish_reason = "length";
    res.model = NULL;
    line = job_record_success(&res);
    assert_strict_json(line);
    root = cJSON_Parse(line);
    assert_non_null(root);
    body = at(at(root, "response"), "body");
    assert_hex_id(at(body, "id")->valuestring, "cmpl-");
    assert_string_equal(at(body, "object")->valuestring, "text_completion");
    assert_string_equal(at(body, "model")->valuestring, "");
    ch = cJSON_GetArrayItem(at(body, "choices"), 0);
    assert_string_equal(at(ch, "text")->valuestring, text);
    assert_int_equal(at(ch, "index")->valueint, 0);
    assert_true(cJSON_IsNull(at(ch, "logprobs")));
    assert_string_equal(at(ch, "finish_reason")->valuestring, "length");
    cJSON_Delete(root);
    free(line);
}

static void test_record_text_encoding(void **state)
{
    (void)state;
    /* invalid UTF-8: lone 0xFF, overlong C0 AF, encoded surrogate, truncated tail */
    static const char bad[] = "a\xff"
                              "b\xc0\xaf"
                              "c\xed\xa0\x80"
                              "d\xe2\x82";
    struct job_choice ch0 = {.text = bad, .text_len = sizeof(bad) - 1, .finish_reason = "stop",
                             .completion_tokens = 1};
    struct job_result res = {.custom_id = "u", .kind = JOB_KIND_CHAT, .model = "m",
                             .choices = &ch0, .n_choices = 1, .prompt_tokens = 1, .job_id = 1};
    char *line = job_record_success(&res);
    assert_strict_json(line);
    cJSON *root = cJSON_Parse(line);
    const cJSON *ch = cJSON_GetArrayItem(at(at(at(root, "response"), "body"), "choices"), 0);
    assert_string_equal(at(at(ch, "message"), "content")->valuestring,
                        "a\xef\xbf\xbd"
                        "b\xef\xbf\xbd\xef\xbf\xbd"
                        "c\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"
                        "d\xef\xbf\xbd"); /* (Python's errors="replace" gives the same) */
    cJSON_Delete(root);
    free(line);

    /* control characters, NUL, DEL, quotes: escaped, and decoded back to the same bytes */
    static const char ctl[] = "x\0y\x01\x1f\t\n\r\b\f\x7f\"\\/z";
    ch0.text = ctl;
    ch0.text_len = sizeof(ctl) - 1;
    line = job_record_success(&res);
    assert_strict_json(line);
    assert_non_null(strstr(line, "\"x\\u0000y\\u0001\\u001f\\t\\n\\r\\b\\f\x7f\\\"\\\\/z\""));
    root = cJSON_Parse(line);
    ch = cJSON_GetArrayItem(at(at(at(root, "response"), "body"), "choices"), 0);
    assert_string_equal(at(at(ch, "message"), "content")->valuestring,
                        "x"); /* cJSON stops at NUL */
    cJSON_Delete(root);
    free(line);

    /* without the NUL, the whole text comes back byte for byte */
    ch0.text = ctl + 2;
    ch0.text_len = sizeof(ctl) - 3;
    line = job_record_success(&res);
    root = cJSON_Parse(line);
    ch = cJSON_GetArrayItem(at(at(at(root, "response"), "body"), "choices"), 0);
    assert_string_equal(at(at(ch, "message"), "content")->valuestring, ctl + 2);
    cJSON_Delete(root);
    free(line);

    /* empty text, NULL pointer */
    ch0.text = NULL;
    ch0.text_len = 0;
    line = job_record_success(&res);
    assert_non_null(strstr(line, "\"content\":\"\""));
    free(line);

    /* U+2028 and U+2029 escaped (line breaks to some JSONL readers), read back the same */
    static const char seps[] = "a\xe2\x80\xa8"
                               "b\xe2\x80\xa9"
                               "c";
    ch0.text = seps;
    ch0.text_len = sizeof(seps) - 1;
    line = job_record_success(&res);
    assert_strict_json(line);
    assert_non_null(strstr(line, "\"a\\u2028b\\u2029c\""));
    assert_null(strstr(line, "\xe2\x80\xa8"));
    root = cJSON_Parse(line);
    ch = cJSON_GetArrayItem(at(at(at(root, "response"), "body"), "choices"), 0);
    assert_string_equal(at(at(ch, "message"), "content")->valuestring, seps);
    cJSON_Delete(root);
    free(line);

    /* every valid code point class passes through verbatim */
    static const char good[] = "\x7f\xc2\x80\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf\xf0\x90\x80\x80"
                               "\xf4\x8f\xbf\xbf";
    struct job_json b = {0};
    job_json_put_str(&b, good, sizeof(good) - 1);
    char *s = job_json_take(&b);
    assert_int_equal(strlen(s), sizeof(good) + 1);
    assert_memory_equal(s + 1, good, sizeof(good) - 1);
    free(s);

    /* job_json_add_text (paths and messages into cJSON documents): the same replacement, so the
     * printed document is UTF-8; valid text (the classes above) unchanged */
    cJSON *o = cJSON_CreateObject();
    assert_non_null(job_json_add_text(o, "a", "x\xffy\xe2\x82z\xed\xa0\x80/\xc3\xa9"));
    assert_non_null(job_json_add_text(o, "b", good));
    assert_string_equal(at(o, "a")->valuestring, "x\xef\xbf\xbdy\xef\xbf\xbdz"
                                                 "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd/\xc3\xa9");
    assert_string_equal(at(o, "b")->valuestring, good);
    cJSON_Delete(o);
}

static void test_record_errors(void **state)
{
    (void)state;
    char *line = job_record_error(3, "e-1", "batch_cancelled", "the job was \"cancelled\"");
    assert_strict_json(line);
    cJSON *root = cJSON_Parse(line);
    assert_non_null(root);
    assert_hex_id(at(root, "id")->valuestring, "batch_req_");
    assert_string_equal(at(root, "custom_id")->valuestring, "e-1");
    assert_true(cJSON_IsNull(at(root, "response")));
    const cJSON *err = at(root, "error");
    assert_string_equal(at(err, "code")->valuestring, "batch_cancelled");
    assert_string_equal(at(err, "message")->valuestring, "the job was \"cancelled\"");
    cJSON_Delete(root);
    free(line);

    line = job_record_error(3, NULL, "c", "m");
    root = cJSON_Parse(line);
    assert_true(cJSON_IsNull(at(root, "custom_id")));
    cJSON_Delete(root);
    free(line);

    /* a parse failure as a 400 record, straight from job_error */
    struct job_defaults d = defaults();
    struct job_request *r;
    struct job_error e;
    const char *l = BATCH(",\"temperature\":\"hot\"");
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_INVALID_ARG);
    line = job_record_parse_error(5, &e);
    assert_strict_json(line);
    root = cJSON_Parse(line);
    assert_non_null(root);
    assert_string_equal(at(root, "custom_id")->valuestring, "b");
    assert_true(cJSON_IsNull(at(root, "error")));
    const cJSON *resp = at(root, "response");
    assert_int_equal(at(resp, "status_code")->valueint, 400);
    assert_hex_id(at(resp, "request_id")->valuestring, "req_");
    err = at(at(resp, "body"), "error");
    assert_string_equal(at(err, "message")->valuestring, e.message);
    assert_string_equal(at(err, "type")->valuestring, "invalid_request_error");
    assert_string_equal(at(err, "param")->valuestring, "body.temperature");
    assert_string_equal(at(err, "code")->valuestring, "invalid_type");
    cJSON_Delete(root);
    free(line);

    /* same id as a success record for the same (job, custom_id) */
    char h[33];
    job_record_hash_hex("batch_req", 5, "b", h);
    line = job_record_parse_error(5, &e);
    assert_non_null(strstr(line, h));
    free(line);

    /* a line rejected at submit without its own custom_id: null, and ids of its own that
     * differ from another item's (the same file given twice: the same source and line) and
     * from those of any line whose custom_id is "line-N" */
    char *r2 = job_record_rejected(5, 2, NULL, "in.jsonl", 2, "invalid_json", "bad", NULL);
    char *r3 = job_record_rejected(5, 3, NULL, "in.jsonl", 2, "invalid_json", "bad", NULL);
    char *named = job_record_rejected(5, 2, "line-2", "in.jsonl", 2, "invalid_json", "bad", "x");
    cJSON *a = cJSON_Parse(r2), *b = cJSON_Parse(r3), *n = cJSON_Parse(named);
    assert_true(cJSON_IsNull(at(a, "custom_id")));
    assert_string_equal(at(n, "custom_id")->valuestring, "line-2");
    assert_string_equal(at(at(at(at(a, "response"), "body"), "error"), "message")->valuestring,
                        "in.jsonl:2: bad");
    const char *ida = at(a, "id")->valuestring, *idb = at(b, "id")->valuestring,
               *idn = at(n, "id")->valuestring;
    assert_hex_id(ida, "batch_req_");
    assert_string_not_equal(ida, idb);
    assert_string_not_equal(ida, idn);
    assert_string_not_equal(at(at(a, "response"), "request_id")->valuestring,
                            at(at(b, "response"), "request_id")->valuestring);
    cJSON_Delete(a);
    cJSON_Delete(b);
    cJSON_Delete(n);
    free(r2);
    free(r3);
    free(named);

    /* 500: server_error, param null */
    line = job_record_invalid(1, "x", 500, "internal_error", "boom", NULL);
    root = cJSON_Parse(line);
    err = at(at(at(root, "response"), "body"), "error");
    assert_string_equal(at(err, "type")->valuestring, "server_error");
    assert_true(cJSON_IsNull(at(err, "param")));
    cJSON_Delete(root);
    free(line);
}

/* Two choices, one with logprobs, against the default model's tokenizer: both OpenAI shapes,
 * token strings and exact bytes (a character split over two tokens), the chosen token added to
 * a completion's alternatives when missing, -inf as -9999.0, usage summing the choices. */
static void test_record_choices_logprobs(void **state)
{
    (void)state;
    struct io_gguf *g = NULL;
    struct engine_tok *tok = NULL;
    struct err_detail err = {0};
    if (io_gguf_open(&g, test_model_path(), &err) != ST_OK ||
        engine_tok_load(&tok, g, &err) != ST_OK)
        fail_msg("tokenizer of %s: %s", test_model_path(), err.msg);
    const int32_t paris = engine_tok_find(tok, " Paris", 6), dot = engine_tok_find(tok, ".", 1),
                  c3 = engine_tok_find(tok, "\xc3", 1), a9 = engine_tok_find(tok, "\xa9", 1);
    assert_true(paris >= 0 && dot >= 0 && c3 >= 0 && a9 >= 0);
    const int32_t ids[4] = {paris, dot, c3, a9};
    const float lps[4] = {-0.25f, -0.5f, -INFINITY, -1e6f};
    const int32_t top_ids[8] = {paris, dot, dot, paris, a9, c3, c3, a9};
    const float top_lps[8] = {-0.25f, -2.0f, -0.5f, -1.0f, -0.1f, -INFINITY, -0.2f, -1e6f};
    static const char text[] = " Paris.\xc3\xa9";
    struct job_choice ch[2] = {
        {.text = text, .text_len = sizeof(text) - 1, .finish_reason = "length",
         .completion_tokens = 4, .tokens = ids, .logprobs = lps, .top_logprobs = 2,
         .top_ids = top_ids, .top_lps = top_lps},
        {.text = "x", .text_len = 1, .finish_reason = "stop", .completion_tokens = 3},
    };
    struct job_result res = {.custom_id = "lp", .kind = JOB_KIND_COMPLETION, .model = "m",
                             .choices = ch, .n_choices = 2, .prompt_tokens = 5, .job_id = 1,
                             .tok = tok};
    char *line = job_record_success(&res);
    assert_strict_json(line);
    cJSON *root = cJSON_Parse(line);
    const cJSON *body = at(at(root, "response"), "body");
    assert_int_equal(at(at(body, "usage"), "completion_tokens")->valueint, 7);
    assert_int_equal(at(at(body, "usage"), "total_tokens")->valueint, 12);
    const cJSON *choices = at(body, "choices");
    assert_int_equal(cJSON_GetArraySize(choices), 2);
    assert_int_equal(at(cJSON_GetArrayItem(choices, 1), "index")->valueint, 1);
    assert_true(cJSON_IsNull(at(cJSON_GetArrayItem(choices, 1), "logprobs")));
    const cJSON *lp = at(cJSON_GetArrayItem(choices, 0), "logprobs");
    const cJSON *toks = at(lp, "tokens"), *tl = at(lp, "token_logprobs");
    assert_string_equal(cJSON_GetArrayItem(toks, 0)->valuestring, " Paris");
    /* a token that is not whole UTF-8 characters: its bytes, as OpenAI writes them */
    assert_string_equal(cJSON_GetArrayItem(toks, 2)->valuestring, "bytes:\\xc3");
    assert_true(cJSON_GetArrayItem(tl, 0)->valuedouble == -0.25);
    assert_true(cJSON_GetArrayItem(tl, 2)->valuedouble == -9999.0);
    assert_true(cJSON_GetArrayItem(tl, 3)->valuedouble == -9999.0);
    const cJSON *top = at(lp, "top_logprobs");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetArrayItem(top, 0)), 2); /* chosen among them */
    assert_int_equal(cJSON_GetArraySize(cJSON_GetArrayItem(top, 1)), 2);
    assert_true(at(cJSON_GetArrayItem(top, 1), ".")->valuedouble == -0.5);
    /* token 2 (0xC3) and its alternatives 0xA9 and 0xC3: two keys (as U+FFFD they were one,
     * and JSON readers kept the last) */
    const cJSON *t2 = cJSON_GetArrayItem(top, 2);
    assert_int_equal(cJSON_GetArraySize(t2), 2);
    assert_true(at(t2, "bytes:\\xa9")->valuedouble == -0.1); /* shortest form of -0.1f */
    assert_true(at(t2, "bytes:\\xc3")->valuedouble == -9999.0);
    const cJSON *off = at(lp, "text_offset");
    const int want_off[4] = {0, 6, 7, 8};
    for (int i = 0; i < 4; i++)
        assert_int_equal(cJSON_GetArrayItem(off, i)->valueint, want_off[i]);
    cJSON_Delete(root);
    free(line);

    res.kind = JOB_KIND_CHAT;
    line = job_record_success(&res);
    assert_strict_json(line);
    root = cJSON_Parse(line);
    body = at(at(root, "response"), "body");
    lp = at(cJSON_GetArrayItem(at(body, "choices"), 0), "logprobs");
    assert_true(cJSON_IsNull(at(lp, "refusal")));
    const cJSON *content = at(lp, "content");
    assert_int_equal(cJSON_GetArraySize(content), 4);
    t2 = cJSON_GetArrayItem(content, 2);
    const cJSON *t3 = cJSON_GetArrayItem(content, 3);
    assert_string_equal(at(t2, "token")->valuestring, "\xef\xbf\xbd");
    assert_int_equal(cJSON_GetArraySize(at(t2, "bytes")), 1);
    assert_int_equal(cJSON_GetArrayItem(at(t2, "bytes"), 0)->valueint, 0xc3);
    assert_int_equal(cJSON_GetArrayItem(at(t3, "bytes"), 0)->valueint, 0xa9);
    const cJSON *alt = at(cJSON_GetArrayItem(content, 1), "top_logprobs");
    assert_int_equal(cJSON_GetArraySize(alt), 2); /* exactly the alternatives in chat */
    assert_string_equal(at(cJSON_GetArrayItem(alt, 0), "token")->valuestring, ".");
    assert_true(at(cJSON_GetArrayItem(alt, 1), "logprob")->valuedouble == -1.0);
    cJSON_Delete(root);
    free(line);
    engine_tok_free(tok);
    io_gguf_close(g);
}

/* Job parameters in JSON: floats as the shortest decimal of the float (0.7, not
 * 0.699999988079071), read back as the very same floats; the seed exactly. */
static void test_params_round_trip(void **state)
{
    (void)state;
    struct job_defaults d = {0}, back = {0};
    engine_sampling_default(&d.sampling);
    d.max_tokens = 64;
    d.sampling.temperature = 0.7f;
    d.sampling.top_p = 0.9f;
    d.sampling.min_p = 0.05f;
    d.sampling.repeat_penalty = 1.1f;
    d.sampling.frequency_penalty = -0.3f;
    d.sampling.presence_penalty = 1.0f / 3.0f;
    d.sampling.seed = UINT64_MAX;
    char *js = job_params_to_json(&d);
    assert_non_null(js);
    assert_non_null(strstr(js, "\"temperature\":0.7,"));
    assert_non_null(strstr(js, "\"top_p\":0.9,"));
    assert_non_null(strstr(js, "\"repetition_penalty\":1.1,"));
    assert_non_null(strstr(js, "\"presence_penalty\":0.33333334,"));
    engine_sampling_default(&back.sampling);
    assert_int_equal(job_params_from_json(js, &back, NULL), ST_OK);
    assert_true(back.sampling.temperature == d.sampling.temperature);
    assert_true(back.sampling.top_p == d.sampling.top_p);
    assert_true(back.sampling.min_p == d.sampling.min_p);
    assert_true(back.sampling.repeat_penalty == d.sampling.repeat_penalty);
    assert_true(back.sampling.frequency_penalty == d.sampling.frequency_penalty);
    assert_true(back.sampling.presence_penalty == d.sampling.presence_penalty);
    assert_true(back.sampling.seed == UINT64_MAX);
    free(js);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_params_round_trip),    cmocka_unit_test(test_record_success),
        cmocka_unit_test(test_record_text_encoding), cmocka_unit_test(test_record_choices_logprobs),
        cmocka_unit_test(test_record_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
