/* Unit tests for jobs/ request parsing: a table of good and bad input lines (exact error
 * codes, messages that name the field), size limits, the custom_id in errors, canonical JSON
 * round trips and a 10k-mutation fuzz loop. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/test_jobs_util.h"

static struct job_request *parse_ok(const char *line, size_t len)
{
    struct job_defaults d = defaults();
    struct job_request *r = NULL;
    struct job_error e;
    enum status st = job_request_parse(line, len, &d, &r, &e);
    if (st != ST_OK)
        print_error("unexpected failure: %s: %s\nline: %.200s\n", job_err_code_str(e.code),
                    e.message, line);
    assert_int_equal(st, ST_OK);
    assert_int_equal(e.code, JOB_ERR_NONE);
    assert_non_null(r);
    return r;
}

/* ---- the line table --------------------------------------------------------------------- */

static void check_batch_chat(const struct job_request *r)
{
    assert_string_equal(r->custom_id, "req-1");
    assert_int_equal(r->kind, JOB_KIND_CHAT);
    assert_int_equal(r->n_messages, 2);
    assert_string_equal(r->messages[0].role, "system");
    assert_string_equal(r->messages[0].content, "Be brief.");
    assert_string_equal(r->messages[1].role, "user");
    assert_string_equal(r->messages[1].content, "Hi\n\"there\"");
    assert_null(r->prompt);
    assert_string_equal(r->model, "gpt-4o-mini");
    assert_int_equal(r->max_tokens, 100);
    assert_true(r->sampling.temperature == 0.7f);
    assert_true(r->sampling.top_p == 0.9f);
    assert_true(r->sampling.frequency_penalty == 0.5f);
    assert_true(r->sampling.presence_penalty == -0.5f);
    assert_true(r->sampling.seed == 123);
    assert_int_equal(r->sampling.top_k, 0); /* default kept */
    assert_true(r->sampling.repeat_penalty == 1.0f);
    assert_int_equal(r->n_stop, 2);
    assert_string_equal(r->stop[0], "\n\n");
    assert_string_equal(r->stop[1], "END");
}

static void check_batch_completion(const struct job_request *r)
{
    assert_string_equal(r->custom_id, "c1");
    assert_int_equal(r->kind, JOB_KIND_COMPLETION);
    assert_string_equal(r->prompt, "Once upon");
    assert_null(r->messages);
    assert_int_equal(r->n_messages, 0);
    assert_int_equal(r->max_tokens, 5);
    assert_int_equal(r->n_stop, 1);
    assert_string_equal(r->stop[0], "\n");
    assert_int_equal(r->sampling.top_k, 40);
    assert_true(r->sampling.min_p == 0.05f);
    assert_true(r->sampling.repeat_penalty == 1.1f);
    assert_int_equal(r->sampling.repeat_last_n, 64);
}

static void check_defaults_used(const struct job_request *r)
{
    struct job_defaults d = defaults();
    assert_string_equal(r->custom_id, "line-7");
    assert_int_equal(r->kind, JOB_KIND_COMPLETION);
    assert_string_equal(r->prompt, "Tell me a story");
    assert_null(r->model);
    assert_int_equal(r->max_tokens, d.max_tokens);
    assert_true(r->sampling.temperature == d.sampling.temperature);
    assert_true(r->sampling.seed == 42);
    assert_int_equal(r->n_stop, 0);
    assert_null(r->stop);
}

static void check_developer(const struct job_request *r)
{
    assert_string_equal(r->custom_id, "dev");
    assert_string_equal(r->messages[0].role, "system");
    assert_string_equal(r->messages[1].role, "user");
    assert_string_equal(r->messages[2].role, "assistant");
    assert_string_equal(r->messages[2].content, "");
}

static void check_parts(const struct job_request *r)
{
    assert_int_equal(r->n_messages, 1);
    assert_string_equal(r->messages[0].content, "Hello, world");
}

/* top_p 0 (OpenAI accepts it): the smallest nucleus, kept as top_k 1 */
static void check_top_p_0(const struct job_request *r)
{
    assert_true(r->sampling.top_p == 1.0f);
    assert_int_equal(r->sampling.top_k, 1);
}

static void check_mct(const struct job_request *r)
{
    assert_int_equal(r->max_tokens, 12);
}

static void check_n3_logprobs(const struct job_request *r)
{
    assert_int_equal(r->n, 3);
    assert_int_equal(r->logprobs, 1);
    assert_int_equal(r->top_logprobs, 4);
}

static void check_logprobs_int(const struct job_request *r)
{
    assert_int_equal(r->n, 1);
    assert_int_equal(r->logprobs, 1);
    assert_int_equal(r->top_logprobs, 0);
}

static void check_no_logprobs(const struct job_request *r)
{
    assert_int_equal(r->n, 1);
    assert_int_equal(r->logprobs, 0);
    assert_int_equal(r->top_logprobs, 0);
}

static void check_json_object(const struct job_request *r)
{
    assert_int_equal(r->format, JOB_FORMAT_JSON_OBJECT);
    assert_null(r->schema);
}

static void check_grammar(const struct job_request *r)
{
    assert_int_equal(r->format, JOB_FORMAT_GRAMMAR);
    assert_string_equal(r->schema, "root ::= [a-z]+ \".\"");
}

static void check_json_schema(const struct job_request *r)
{
    assert_int_equal(r->format, JOB_FORMAT_JSON_SCHEMA);
    assert_string_equal(r->schema, "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":"
                                   "\"integer\"}},\"required\":[\"a\"]}");
}

/* the stored schema keeps its numbers exact (cJSON's printer made 9007199254740991 into
 * 9.00719925474099e+15, and the run compiled other bounds than submit checked) */
static void check_schema_numbers(const struct job_request *r)
{
    assert_string_equal(r->schema, "{\"type\":\"integer\",\"minimum\":9007199254740991,"
                                   "\"maximum\":9007199254740991,\"description\":"
                                   "[0.30000000000000004,-0,1e999]}");
}

static void check_unicode(const struct job_request *r)
{
    assert_string_equal(r->prompt, "caf\xc3\xa9 \xf0\x9f\x98\x80 \xe6\x97\xa5 \\u0000 /");
}

static void check_nulls(const struct job_request *r)
{
    assert_string_equal(r->custom_id, "line-7");
    assert_true(r->sampling.temperature == 1.0f);
    assert_int_equal(r->n_stop, 0);
    assert_true(r->sampling.seed == 42);
}

static void check_seed_max(const struct job_request *r)
{
    assert_true(r->sampling.seed == UINT64_MAX);
}

static void check_seed_minus_one(const struct job_request *r)
{
    assert_true(r->sampling.seed == UINT64_MAX);
    assert_int_equal(r->sampling.top_k, 0);
}

static void check_seed_exp(const struct job_request *r)
{
    assert_true(r->sampling.seed == 1000);
    assert_int_equal(r->max_tokens, 5);
    assert_true(r->sampling.temperature == 0.0f);
}

static void check_prompt_array(const struct job_request *r)
{
    assert_string_equal(r->prompt, "only one");
}

static void check_greedy_short(const struct job_request *r)
{
    assert_string_equal(r->custom_id, "g");
    assert_true(r->sampling.temperature == 0.0f);
    assert_int_equal(r->kind, JOB_KIND_CHAT);
}

struct line_case {
    const char *name;                          /* what the line exercises */
    const char *line;                          /* the input */
    size_t len;                                /* bytes of line; 0 = strlen */
    enum job_err_code code;                    /* JOB_ERR_NONE for a good line */
    const char *in_msg;                        /* bad lines: must appear in the message */
    void (*check)(const struct job_request *); /* good lines: field checks, or NULL */
};

/* clang-format off */
#define GOOD(n, l, f)            {n, l, 0, JOB_ERR_NONE, NULL, f}

#define BAD(n, l, c, m)          {n, l, 0, c, m, NULL}

#define BADN(n, l, len, c, m)    {n, l, len, c, m, NULL}

#define CHAT(params)  "{\"custom_id\":\"x\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]" params "}"

/* clang-format on */

static void check_no_thinking(const struct job_request *r)
{
    assert_int_equal(r->kind, JOB_KIND_CHAT);
    assert_int_equal(r->no_thinking, 1);
}

static void check_thinking(const struct job_request *r)
{
    assert_int_equal(r->no_thinking, 0);
}

static const struct line_case cases[] = {
    /* good lines */
    GOOD("chat_template_kwargs enable_thinking false",
         CHAT(",\"chat_template_kwargs\":{\"enable_thinking\":false}"), check_no_thinking),
    GOOD("chat_template_kwargs enable_thinking true",
         CHAT(",\"chat_template_kwargs\":{\"enable_thinking\":true}"), check_thinking),
    GOOD("chat_template_kwargs enable_thinking null, in a batch body",
         "{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{"
         "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"chat_template_kwargs\":{"
         "\"enable_thinking\":null}}}",
         check_thinking),
    GOOD("chat_template_kwargs empty on a prompt", "{\"prompt\":\"x\",\"chat_template_kwargs\":{}}",
         NULL),
    GOOD(
        "batch chat, every common field",
        "{\"custom_id\":\"req-1\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\","
        "\"body\":{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"system\",\"content\":"
        "\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\\n\\\"there\\\"\"}],\"max_tokens\":100,"
        "\"temperature\":0.7,\"top_p\":0.9,\"seed\":123,\"stop\":[\"\\n\\n\",\"END\"],"
        "\"frequency_penalty\":0.5,\"presence_penalty\":-0.5,\"n\":1,\"stream\":false,"
        "\"user\":\"u1\",\"logprobs\":false,\"top_logprobs\":0,\"tools\":[],"
        "\"response_format\":{\"type\":\"text\"},\"metadata\":{\"a\":[1,2.5e3,{\"b\":null}]}}}",
        check_batch_chat),
    GOOD(
        "batch completion with extensions",
        "{\"custom_id\":\"c1\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"model\":"
        "\"m\",\"prompt\":\"Once upon\",\"max_tokens\":5,\"stop\":\"\\n\",\"top_k\":40,\"min_p\":"
        "0.05,\"repetition_penalty\":1.1,\"repeat_last_n\":64,\"logprobs\":null,\"echo\":false,"
        "\"suffix\":null,\"best_of\":1}}",
        check_batch_completion),
    GOOD("short prompt, no custom_id: defaults", "{\"prompt\":\"Tell me a story\"}",
         check_defaults_used),
    GOOD("developer role maps to system; empty content",
         "{\"custom_id\":\"dev\",\"messages\":[{\"role\":\"developer\",\"content\":\"rules\"},"
         "{\"role\":\"user\",\"content\":\"q\",\"name\":null},{\"role\":\"assistant\","
         "\"content\":\"\",\"tool_calls\":[],\"refusal\":null}]}",
         check_developer),
    GOOD("text content parts are concatenated",
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hello, \"},"
         "{\"type\":\"text\",\"text\":\"world\"}]}]}",
         check_parts),
    GOOD("max_completion_tokens", CHAT(",\"max_completion_tokens\":12"), check_mct),
    GOOD("grammar", "{\"prompt\":\"x\",\"grammar\":\"root ::= [a-z]+ \\\".\\\"\"}", check_grammar),
    GOOD("response_format json_object", CHAT(",\"response_format\":{\"type\":\"json_object\"}"),
         check_json_object),
    GOOD("response_format json_schema, strict, spaces in the schema",
         BATCH(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"r\","
               "\"strict\":true,\"schema\":{\"type\": \"object\", \"properties\": {\"a\": "
               "{\"type\": \"integer\"}}, \"required\": [\"a\"]}}}"),
         check_json_schema),
    GOOD("response_format json_schema: numbers stored exactly",
         CHAT(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":"
              "{\"type\":\"integer\",\"minimum\":9007199254740991,\"maximum\":9007199254740991,"
              "\"description\":[0.30000000000000004,-0.0,1e400]}}}"),
         check_schema_numbers),
    GOOD("n 3, logprobs true, top_logprobs 4",
         BATCH(",\"n\":3,\"logprobs\":true,\"top_logprobs\":4"), check_n3_logprobs),
    GOOD("completions' integer logprobs 0: the chosen tokens only",
         "{\"prompt\":\"x\",\"logprobs\":0}", check_logprobs_int),
    GOOD("logprobs false, top_logprobs 0, n 1",
         CHAT(",\"logprobs\":false,\"top_logprobs\":0,\"n\":1"), check_no_logprobs),
    GOOD("integer logprobs with an agreeing top_logprobs",
         "{\"prompt\":\"x\",\"logprobs\":4,\"top_logprobs\":4,\"n\":3}", check_n3_logprobs),
    GOOD("max_tokens and max_completion_tokens agreeing",
         CHAT(",\"max_tokens\":12,\"max_completion_tokens\":12"), check_mct),
    GOOD("escapes: non-ASCII, surrogate pair, escaped backslash-u0000, solidus",
         "{\"prompt\":\"caf\\u00e9 \\ud83d\\ude00 \xe6\x97\xa5 \\\\u0000 \\/\"}", check_unicode),
    GOOD("BOM, surrounding whitespace and CR", "\xef\xbb\xbf  {\"prompt\":\"x\"} \t\r", NULL),
    GOOD("nulls count as absent",
         "{\"custom_id\":null,\"prompt\":\"x\",\"temperature\":null,\"stop\":null,\"seed\":null,"
         "\"model\":null}",
         check_nulls),
    GOOD("seed 2^64-1 exactly", "{\"prompt\":\"x\",\"seed\":18446744073709551615}", check_seed_max),
    GOOD("seed -1 wraps; top_k -1 means off", "{\"prompt\":\"x\",\"seed\":-1,\"top_k\":-1}",
         check_seed_minus_one),
    GOOD("integers written as 1e3 and 5.0; temperature 0",
         "{\"prompt\":\"x\",\"seed\":1e3,\"max_tokens\":5.0,\"temperature\":0}", check_seed_exp),
    GOOD("one-element prompt array", "{\"prompt\":[\"only one\"]}", check_prompt_array),
    GOOD("OpenAI's fields that change nothing are ignored (metadata even duplicated)",
         "{\"prompt\":\"x\",\"metadata\":1,\"metadata\":[true,false],\"stream_options\":{},"
         "\"user\":\"u\",\"store\":false,\"service_tier\":\"auto\",\"tool_choice\":\"none\","
         "\"function_call\":\"auto\",\"parallel_tool_calls\":true,\"modalities\":[\"text\"],"
         "\"prediction\":{},\"audio\":null,\"safety_identifier\":\"s\",\"prompt_cache_key\":\"k\","
         "\"priority\":1}",
         NULL),
    BAD("an unknown field (a typo) is refused", "{\"prompt\":\"x\",\"max_token\":3}",
        JOB_ERR_UNKNOWN_FIELD, "unknown field max_token"),
    BAD("an unknown field in a body is refused", BATCH(",\"temprature\":0"), JOB_ERR_UNKNOWN_FIELD,
        "unknown field body.temprature"),
    BAD("a parameter beside the body is refused",
        "{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\","
        "\"max_tokens\":3,\"body\":{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}}",
        JOB_ERR_UNKNOWN_FIELD, "unknown field max_tokens"),
    BAD("a prompt in a chat body is refused",
        "{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\","
        "\"body\":{\"prompt\":\"p\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}}",
        JOB_ERR_UNKNOWN_FIELD, "unknown field body.prompt"),
    /* an audit of 2026-12-06: keys inside messages and response_format were ignored (a
     * message's "temperature" sampled at 1; a misspelt "shema" accepted) */
    BAD("a message's name is refused (no place in a chat template)",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"q\",\"name\":\"bob\"}]}",
        JOB_ERR_UNSUPPORTED, "messages[0].name is not supported"),
    BAD("an unknown key in a message is refused",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"q\",\"temperature\":0}]}",
        JOB_ERR_UNKNOWN_FIELD, "unknown field messages[0].temperature"),
    BAD("an unknown key in a content part is refused",
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"q\","
        "\"txt\":\"r\"}]}]}",
        JOB_ERR_UNKNOWN_FIELD, "unknown field messages[0].content[0].txt"),
    BAD("an unknown key in response_format is refused",
        CHAT(",\"response_format\":{\"type\":\"json_object\",\"shema\":{}}"), JOB_ERR_UNKNOWN_FIELD,
        "unknown field response_format.shema"),
    BAD("an unknown key in json_schema is refused",
        CHAT(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\","
             "\"schema\":{},\"strct\":true}}"),
        JOB_ERR_UNKNOWN_FIELD, "unknown field response_format.json_schema.strct"),
    BAD("audio output", BATCH(",\"audio\":{\"voice\":\"alloy\"}"), JOB_ERR_UNSUPPORTED,
        "body.audio: audio output"),
    BAD("web search", "{\"prompt\":\"x\",\"web_search_options\":{}}", JOB_ERR_UNSUPPORTED,
        "web search"),
    BAD("reasoning effort", BATCH(",\"reasoning_effort\":\"low\""), JOB_ERR_UNSUPPORTED,
        "reasoning"),
    BAD("a required tool call", BATCH(",\"tool_choice\":\"required\""), JOB_ERR_UNSUPPORTED,
        "body.tool_choice: tool and function calls"),
    BAD("audio modality", BATCH(",\"modalities\":[\"text\",\"audio\"]"), JOB_ERR_UNSUPPORTED,
        "body.modalities: only"),
    GOOD("short chat, greedy",
         "{\"custom_id\":\"g\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
         "\"temperature\":0.0}",
         check_greedy_short),
    GOOD("stop: four strings, max length ok", CHAT(",\"stop\":[\"a\",\"b\",\"c\",\"\\u00e9\"]"),
         NULL),
    GOOD("penalty edges",
         CHAT(",\"frequency_penalty\":-2,\"presence_penalty\":2,\"top_p\":1,"
              "\"min_p\":1,\"temperature\":2,\"max_tokens\":4096"),
         NULL),

    /* JSON syntax */
    BAD("empty line", "", JOB_ERR_INVALID_JSON, "empty"),
    BAD("blank line", " \t ", JOB_ERR_INVALID_JSON, "empty"),
    BAD("truncated object", "{\"prompt\":\"hi\"", JOB_ERR_INVALID_JSON, "end of line"),
    BAD("trailing garbage", "{\"prompt\":\"hi\"} x", JOB_ERR_INVALID_JSON, "byte 16"),
    BAD("two objects", "{\"prompt\":\"a\"}{\"prompt\":\"b\"}", JOB_ERR_INVALID_JSON, "byte 14"),
    BAD("single quotes", "{'prompt':'hi'}", JOB_ERR_INVALID_JSON, "byte 1"),
    BAD("NaN literal", "{\"prompt\":\"x\",\"temperature\":NaN}", JOB_ERR_INVALID_JSON,
        "temperature"),
    BAD("leading zero", "{\"prompt\":\"x\",\"max_tokens\":012}", JOB_ERR_INVALID_JSON,
        "max_tokens"),
    BAD("number 1.", "{\"prompt\":\"x\",\"top_p\":1.}", JOB_ERR_INVALID_JSON, "top_p"),
    BAD("plus sign", "{\"prompt\":\"x\",\"seed\":+1}", JOB_ERR_INVALID_JSON, "seed"),
    BAD("trailing comma", "{\"prompt\":\"x\",}", JOB_ERR_INVALID_JSON, "string key"),
    BAD("bad escape", "{\"prompt\":\"\\x41\"}", JOB_ERR_INVALID_JSON, "prompt"),
    BAD("raw control character", "{\"prompt\":\"a\x01\"}", JOB_ERR_INVALID_JSON, "prompt"),
    BADN("raw NUL byte in a string", "{\"prompt\":\"a\0b\"}", 16, JOB_ERR_INVALID_JSON, "0x00"),
    BAD("duplicate key read by quern", "{\"prompt\":\"x\",\"temperature\":1,\"temperature\":0}",
        JOB_ERR_INVALID_JSON, "temperature"),
    BAD("duplicate key in body", BATCH(",\"seed\":1,\"seed\":2"), JOB_ERR_INVALID_JSON,
        "body.seed"),
    BAD("duplicate role",
        "{\"messages\":[{\"role\":\"user\",\"role\":\"system\",\"content\":\"\"}]}",
        JOB_ERR_INVALID_JSON, "messages[0].role"),
    BAD("not an object", "[1,2]", JOB_ERR_INVALID_TYPE, "JSON object"),
    BAD("a bare string", "\"hello\"", JOB_ERR_INVALID_TYPE, "JSON object"),

    /* UTF-8 */
    BAD("invalid byte in a string", "{\"prompt\":\"a\xff\"}", JOB_ERR_INVALID_UTF8, "prompt"),
    BAD("overlong '/' (C0 AF)", "{\"prompt\":\"\xc0\xaf\"}", JOB_ERR_INVALID_UTF8, "overlong"),
    BAD("overlong 3-byte (E0 80 AF)", "{\"prompt\":\"\xe0\x80\xaf\"}", JOB_ERR_INVALID_UTF8,
        "overlong"),
    BAD("overlong 4-byte (F0 80 80 AF)", "{\"prompt\":\"\xf0\x80\x80\xaf\"}", JOB_ERR_INVALID_UTF8,
        "overlong"),
    BAD("encoded surrogate (ED A0 80)",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"\xed\xa0\x80\"}]}", JOB_ERR_INVALID_UTF8,
        "messages[0].content"),
    BAD("above U+10FFFF", "{\"prompt\":\"\xf4\x90\x80\x80\"}", JOB_ERR_INVALID_UTF8, "U+10FFFF"),
    BAD("missing continuation", "{\"prompt\":\"\xe2\x82\"}", JOB_ERR_INVALID_UTF8, "prompt"),
    BAD("invalid byte in a key", "{\"pr\xffompt\":\"x\"}", JOB_ERR_INVALID_UTF8, "byte 4"),
    BAD("invalid byte outside strings", "{\"prompt\":\"x\"}\xff", JOB_ERR_INVALID_UTF8, "byte 14"),
    BAD("unpaired high surrogate escape", "{\"prompt\":\"\\ud800x\"}", JOB_ERR_INVALID_UTF8,
        "prompt"),
    BAD("unpaired low surrogate escape", "{\"prompt\":\"\\udc00\"}", JOB_ERR_INVALID_UTF8,
        "prompt"),
    BAD("\\u0000 in content", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}",
        JOB_ERR_INVALID_VALUE, "messages[0].content"),
    BAD("\\u0000 in a key", "{\"prompt\":\"x\",\"temperature\\u0000\":1}", JOB_ERR_INVALID_VALUE,
        "\\u0000"),

    /* shape */
    BAD("neither messages nor prompt", "{\"custom_id\":\"a\"}", JOB_ERR_MISSING_FIELD, "messages"),
    BAD("both messages and prompt",
        "{\"prompt\":\"x\",\"messages\":[{\"role\":\"user\",\"content\":\"y\"}]}",
        JOB_ERR_INVALID_VALUE, "prompt"),
    BAD("batch without custom_id",
        "{\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"x\"}}",
        JOB_ERR_MISSING_FIELD, "custom_id"),
    BAD("batch without body",
        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\"}",
        JOB_ERR_MISSING_FIELD, "body"),
    BAD("batch body not an object",
        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":[]}",
        JOB_ERR_INVALID_TYPE, "body"),
    BAD("batch without method", "{\"custom_id\":\"a\",\"url\":\"/v1/completions\",\"body\":{}}",
        JOB_ERR_MISSING_FIELD, "method"),
    BAD("batch method GET",
        "{\"custom_id\":\"a\",\"method\":\"GET\",\"url\":\"/v1/completions\",\"body\":{}}",
        JOB_ERR_INVALID_VALUE, "method"),
    BAD("batch url embeddings",
        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/embeddings\",\"body\":{}}",
        JOB_ERR_UNSUPPORTED, "url"),
    BAD("batch url not a string", "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":7,\"body\":{}}",
        JOB_ERR_INVALID_TYPE, "url"),
    BAD("batch chat without messages",
        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":"
        "{\"prompt\":\"x\"}}",
        JOB_ERR_MISSING_FIELD, "body.messages"),
    BAD("batch completion without prompt",
        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{}}",
        JOB_ERR_MISSING_FIELD, "body.prompt"),
    BAD("custom_id a number", "{\"custom_id\":5,\"prompt\":\"x\"}", JOB_ERR_INVALID_TYPE,
        "custom_id"),
    BAD("custom_id empty", "{\"custom_id\":\"\",\"prompt\":\"x\"}", JOB_ERR_INVALID_VALUE,
        "custom_id"),

    /* messages */
    BAD("messages empty", "{\"messages\":[]}", JOB_ERR_INVALID_VALUE, "messages"),
    BAD("messages a string", "{\"messages\":\"hi\"}", JOB_ERR_INVALID_TYPE, "messages"),
    BAD("messages null", "{\"messages\":null}", JOB_ERR_INVALID_TYPE, "messages"),
    BAD("message not an object", "{\"messages\":[1]}", JOB_ERR_INVALID_TYPE, "messages[0]"),
    BAD("bad role", "{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}",
        JOB_ERR_INVALID_VALUE, "messages[0].role"),
    BAD("role missing", "{\"messages\":[{\"content\":\"x\"}]}", JOB_ERR_MISSING_FIELD,
        "messages[0].role"),
    BAD("role a number", "{\"messages\":[{\"role\":1,\"content\":\"x\"}]}", JOB_ERR_INVALID_TYPE,
        "messages[0].role"),
    BAD("role tool", "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", JOB_ERR_UNSUPPORTED,
        "messages[0].role"),
    BAD("content missing",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\"}]}",
        JOB_ERR_MISSING_FIELD, "messages[1].content"),
    BAD("content a number", "{\"messages\":[{\"role\":\"user\",\"content\":5}]}",
        JOB_ERR_INVALID_TYPE, "messages[0].content"),
    BAD("content null", "{\"messages\":[{\"role\":\"user\",\"content\":null}]}",
        JOB_ERR_INVALID_TYPE, "messages[0].content"),
    BAD("content parts empty", "{\"messages\":[{\"role\":\"user\",\"content\":[]}]}",
        JOB_ERR_INVALID_VALUE, "messages[0].content"),
    BAD("image part",
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"look\"},"
        "{\"type\":\"image_url\",\"image_url\":{\"url\":\"http://x/y.png\"}}]}]}",
        JOB_ERR_UNSUPPORTED, "messages[0].content[1].type"),
    BAD("part without text",
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}",
        JOB_ERR_MISSING_FIELD, "messages[0].content[0].text"),
    BAD("part text a number",
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":1}]}]}",
        JOB_ERR_INVALID_TYPE, "messages[0].content[0].text"),
    BAD("part type unknown",
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"bogus\",\"text\":\"a\"}]}]}",
        JOB_ERR_INVALID_VALUE, "messages[0].content[0].type"),
    BAD("part type missing", "{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"a\"}]}]}",
        JOB_ERR_MISSING_FIELD, "messages[0].content[0].type"),
    BAD("part a string", "{\"messages\":[{\"role\":\"user\",\"content\":[\"a\"]}]}",
        JOB_ERR_INVALID_TYPE, "messages[0].content[0]"),
    BAD("assistant tool_calls",
        "{\"messages\":[{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"1\"}]}]"
        "}",
        JOB_ERR_UNSUPPORTED, "messages[0].tool_calls"),

    /* prompt */
    BAD("prompt empty", "{\"prompt\":\"\"}", JOB_ERR_INVALID_VALUE, "prompt"),
    BAD("prompt a number", "{\"prompt\":5}", JOB_ERR_INVALID_TYPE, "prompt"),
    BAD("prompt empty array", "{\"prompt\":[]}", JOB_ERR_INVALID_VALUE, "prompt"),
    BAD("several prompts", "{\"prompt\":[\"a\",\"b\"]}", JOB_ERR_UNSUPPORTED, "prompt"),
    BAD("token-id prompt", "{\"prompt\":[1,2,3]}", JOB_ERR_UNSUPPORTED, "prompt"),
    BAD("token-id prompts", "{\"prompt\":[[1,2],[3]]}", JOB_ERR_UNSUPPORTED, "prompt"),

    /* parameters: types */
    BAD("temperature a string", BATCH(",\"temperature\":\"hot\""), JOB_ERR_INVALID_TYPE,
        "body.temperature must be a number, got \"hot\""),
    BAD("top_p a bool", CHAT(",\"top_p\":true"), JOB_ERR_INVALID_TYPE, "top_p"),
    BAD("response_format type twice",
        CHAT(",\"response_format\":{\"type\":\"json_object\",\"type\":\"text\"}"),
        JOB_ERR_INVALID_JSON, "duplicate key response_format.type"),
    BAD("json_schema schema twice",
        CHAT(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{},"
             "\"schema\":{\"type\":\"object\"}}}"),
        JOB_ERR_INVALID_JSON, "duplicate key response_format.json_schema.schema"),
    BAD("top_k fractional", CHAT(",\"top_k\":1.5"), JOB_ERR_INVALID_TYPE, "top_k"),
    BAD("min_p a string", CHAT(",\"min_p\":\"x\""), JOB_ERR_INVALID_TYPE, "min_p"),
    BAD("repetition_penalty an array", CHAT(",\"repetition_penalty\":[1]"), JOB_ERR_INVALID_TYPE,
        "repetition_penalty"),
    BAD("frequency_penalty an object", CHAT(",\"frequency_penalty\":{}"), JOB_ERR_INVALID_TYPE,
        "frequency_penalty"),
    BAD("presence_penalty a bool", BATCH(",\"presence_penalty\":true"), JOB_ERR_INVALID_TYPE,
        "body.presence_penalty"),
    BAD("max_tokens a string", CHAT(",\"max_tokens\":\"10\""), JOB_ERR_INVALID_TYPE, "max_tokens"),
    BAD("max_completion_tokens fractional", BATCH(",\"max_completion_tokens\":2.5"),
        JOB_ERR_INVALID_TYPE, "body.max_completion_tokens"),
    BAD("seed fractional", CHAT(",\"seed\":1.5"), JOB_ERR_INVALID_TYPE, "seed"),
    BAD("seed a string", BATCH(",\"seed\":\"1\""), JOB_ERR_INVALID_TYPE, "body.seed"),
    BAD("stop a number", CHAT(",\"stop\":5"), JOB_ERR_INVALID_TYPE, "stop"),
    BAD("stop element a number", CHAT(",\"stop\":[\"a\",1]"), JOB_ERR_INVALID_TYPE, "stop[1]"),
    BAD("stop an object", CHAT(",\"stop\":{}"), JOB_ERR_INVALID_TYPE, "stop"),
    BAD("model a number", BATCH(",\"model\":5"), JOB_ERR_INVALID_TYPE, "body.model"),
    BAD("n a string", CHAT(",\"n\":\"2\""), JOB_ERR_INVALID_TYPE, "n must be"),
    BAD("stream a string", CHAT(",\"stream\":\"yes\""), JOB_ERR_INVALID_TYPE, "stream"),
    BAD("logprobs a string", CHAT(",\"logprobs\":\"yes\""), JOB_ERR_INVALID_TYPE, "logprobs"),
    BAD("repeat_last_n fractional", CHAT(",\"repeat_last_n\":0.5"), JOB_ERR_INVALID_TYPE,
        "repeat_last_n"),

    /* parameters: ranges */
    BAD("temperature 3", BATCH(",\"temperature\":3"), JOB_ERR_INVALID_VALUE,
        "body.temperature must be a number in [0, 2], got 3"),
    BAD("temperature negative", CHAT(",\"temperature\":-0.1"), JOB_ERR_INVALID_VALUE,
        "temperature"),
    GOOD("top_p 0", CHAT(",\"top_p\":0,\"top_k\":40"), check_top_p_0),
    BAD("top_p below 0", CHAT(",\"top_p\":-0.1"), JOB_ERR_INVALID_VALUE,
        "top_p must be a number in [0, 1]"),
    BAD("top_p 1.5", CHAT(",\"top_p\":1.5"), JOB_ERR_INVALID_VALUE, "top_p"),
    GOOD("top_p tiny (float 0)", CHAT(",\"top_p\":1e-60"), check_top_p_0),
    BAD("top_k -2", CHAT(",\"top_k\":-2"), JOB_ERR_INVALID_VALUE, "top_k"),
    BAD("top_k too big", CHAT(",\"top_k\":3e9"), JOB_ERR_INVALID_VALUE, "top_k"),
    BAD("min_p 2", CHAT(",\"min_p\":2"), JOB_ERR_INVALID_VALUE, "min_p"),
    BAD("repetition_penalty 0", CHAT(",\"repetition_penalty\":0"), JOB_ERR_INVALID_VALUE,
        "repetition_penalty"),
    BAD("repetition_penalty overflows float", CHAT(",\"repetition_penalty\":1e300"),
        JOB_ERR_INVALID_VALUE, "repetition_penalty"),
    BAD("frequency_penalty 3", CHAT(",\"frequency_penalty\":3"), JOB_ERR_INVALID_VALUE,
        "frequency_penalty"),
    BAD("presence_penalty -2.5", CHAT(",\"presence_penalty\":-2.5"), JOB_ERR_INVALID_VALUE,
        "presence_penalty"),
    BAD("max_tokens 0", BATCH(",\"max_tokens\":0"), JOB_ERR_INVALID_VALUE, "body.max_tokens"),
    BAD("max_tokens over the cap", CHAT(",\"max_tokens\":4097"), JOB_ERR_INVALID_VALUE,
        "max_tokens must be an integer in [1, 4096]"),
    BAD("max_tokens disagreeing", CHAT(",\"max_tokens\":5,\"max_completion_tokens\":6"),
        JOB_ERR_INVALID_VALUE, "max_completion_tokens"),
    BAD("repeat_last_n -2", CHAT(",\"repeat_last_n\":-2"), JOB_ERR_INVALID_VALUE, "repeat_last_n"),
    BAD("seed 1e30", CHAT(",\"seed\":1e30"), JOB_ERR_INVALID_VALUE, "seed"),
    BAD("seed 2^64", CHAT(",\"seed\":18446744073709551616"), JOB_ERR_INVALID_VALUE, "seed"),
    BAD("seed below -2^63", CHAT(",\"seed\":-9223372036854775809"), JOB_ERR_INVALID_VALUE, "seed"),
    BAD("five stops", CHAT(",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]"), JOB_ERR_INVALID_VALUE,
        "stop"),
    BAD("empty stop", BATCH(",\"stop\":\"\""), JOB_ERR_INVALID_VALUE, "body.stop"),
    BAD("empty stop in array", CHAT(",\"stop\":[\"a\",\"\"]"), JOB_ERR_INVALID_VALUE, "stop[1]"),
    BAD("n 0", CHAT(",\"n\":0"), JOB_ERR_INVALID_VALUE, "n must be"),
    BAD("n 129", BATCH(",\"n\":129"), JOB_ERR_INVALID_VALUE,
        "body.n must be an integer in [1, 128]"),
    BAD("top_logprobs without logprobs", CHAT(",\"top_logprobs\":3"), JOB_ERR_INVALID_VALUE,
        "top_logprobs needs logprobs set to true"),
    BAD("top_logprobs 21", CHAT(",\"logprobs\":true,\"top_logprobs\":21"), JOB_ERR_INVALID_VALUE,
        "top_logprobs must be an integer in [0, 20]"),
    BAD("logprobs 21 (completions)", "{\"prompt\":\"x\",\"logprobs\":21}", JOB_ERR_INVALID_VALUE,
        "logprobs must be an integer in [0, 20]"),
    BAD("logprobs and top_logprobs disagree",
        "{\"prompt\":\"x\",\"logprobs\":2,\"top_logprobs\":3}", JOB_ERR_INVALID_VALUE, "disagrees"),
    BAD("logprobs fractional", "{\"prompt\":\"x\",\"logprobs\":1.5}", JOB_ERR_INVALID_TYPE,
        "logprobs must be a boolean or an integer"),

    /* unsupported */
    BAD("best_of 3", CHAT(",\"best_of\":3"), JOB_ERR_UNSUPPORTED, "best_of"),
    BAD("stream true", BATCH(",\"stream\":true"), JOB_ERR_UNSUPPORTED, "body.stream"),
    BAD("echo true", "{\"prompt\":\"x\",\"echo\":true}", JOB_ERR_UNSUPPORTED, "echo"),
    BAD("suffix", "{\"prompt\":\"x\",\"suffix\":\"end\"}", JOB_ERR_UNSUPPORTED, "suffix"),
    BAD("tools", BATCH(",\"tools\":[{\"type\":\"function\"}]"), JOB_ERR_UNSUPPORTED, "body.tools"),
    BAD("logit_bias", CHAT(",\"logit_bias\":{\"50256\":-100}"), JOB_ERR_UNSUPPORTED, "logit_bias"),
    BAD("chat_template_kwargs other key", CHAT(",\"chat_template_kwargs\":{\"tools\":[]}"),
        JOB_ERR_UNSUPPORTED, "chat_template_kwargs.tools is not supported (only enable_thinking)"),
    BAD("chat_template_kwargs enable_thinking a string",
        CHAT(",\"chat_template_kwargs\":{\"enable_thinking\":\"no\"}"), JOB_ERR_INVALID_TYPE,
        "chat_template_kwargs.enable_thinking must be true or false"),
    BAD("chat_template_kwargs an array", CHAT(",\"chat_template_kwargs\":[]"), JOB_ERR_INVALID_TYPE,
        "chat_template_kwargs must be an object"),
    BAD("chat_template_kwargs on a prompt",
        "{\"prompt\":\"x\",\"chat_template_kwargs\":{\"enable_thinking\":false}}",
        JOB_ERR_INVALID_VALUE, "chat_template_kwargs is for chat requests"),
    BAD("response_format json_schema with pattern",
        BATCH(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\","
              "\"schema\":{\"type\":\"string\",\"pattern\":\"a\"}}}"),
        JOB_ERR_UNSUPPORTED,
        "body.response_format.json_schema.schema: keyword 'pattern' is not supported"),
    BAD("grammar with an undefined rule",
        "{\"prompt\":\"x\",\"grammar\":\"root ::= a b\\na ::= \\\"a\\\"\"}", JOB_ERR_INVALID_VALUE,
        "grammar: line 1: rule 'b' is used but not defined"),
    BAD("grammar and json_object",
        CHAT(",\"grammar\":\"root ::= \\\"a\\\"\",\"response_format\":"
             "{\"type\":\"json_object\"}"),
        JOB_ERR_INVALID_VALUE, "grammar and a JSON response_format cannot be used together"),
    BAD("grammar not a string", CHAT(",\"grammar\":5"), JOB_ERR_INVALID_TYPE,
        "grammar must be a string"),
    BAD("response_format xml", CHAT(",\"response_format\":{\"type\":\"xml\"}"),
        JOB_ERR_INVALID_VALUE, "response_format.type must be"),
    BAD("response_format json_schema without schema",
        CHAT(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\"}}"),
        JOB_ERR_MISSING_FIELD, "response_format.json_schema.schema is missing"),
    BAD("response_format json_schema, schema not an object",
        CHAT(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":[]}}"),
        JOB_ERR_INVALID_TYPE, "response_format.json_schema.schema must be an object"),
};

static void check_case(const struct line_case *c)
{
    struct job_defaults d = defaults();
    struct job_request *r = (struct job_request *)1;
    struct job_error e;
    size_t len = c->len ? c->len : strlen(c->line);
    enum status st = job_request_parse(c->line, len, &d, &r, &e);

    if (c->code == JOB_ERR_NONE) {
        if (st != ST_OK)
            print_error("case '%s': unexpected %s: %s\n", c->name, job_err_code_str(e.code),
                        e.message);
        assert_int_equal(st, ST_OK);
        assert_non_null(r);
        if (c->check)
            c->check(r);
        job_request_free(r);
        return;
    }
    if (st == ST_OK || e.code != c->code || !strstr(e.message, c->in_msg))
        print_error("case '%s': want %s containing '%s', got %s: %s\n", c->name,
                    job_err_code_str(c->code), c->in_msg, job_err_code_str(e.code), e.message);
    assert_int_not_equal(st, ST_OK);
    assert_null(r);
    assert_int_equal(e.code, c->code);
    assert_non_null(strstr(e.message, c->in_msg));
    /* the status groups the codes */
    if (c->code == JOB_ERR_INVALID_JSON || c->code == JOB_ERR_INVALID_UTF8)
        assert_int_equal(st, ST_ERR_FORMAT);
    else if (c->code == JOB_ERR_UNSUPPORTED)
        assert_int_equal(st, ST_ERR_UNSUPPORTED);
    else
        assert_int_equal(st, ST_ERR_INVALID_ARG);
    /* a named field is also in e.field, and the message names it */
    if (e.field[0])
        assert_non_null(strstr(e.message, e.field));
    /* a JSON object bad in what it holds (a bad request, not another format) unless the JSON
     * itself is bad or the line is another JSON value; a duplicate key is bad JSON in a whole
     * object */
    const int object = !(c->code == JOB_ERR_INVALID_JSON || c->code == JOB_ERR_INVALID_UTF8 ||
                         (c->code == JOB_ERR_INVALID_TYPE && !e.field[0])) ||
                       strstr(e.message, "duplicate key");
    if (e.is_object != object)
        print_error("case '%s': is_object %d\n", c->name, e.is_object);
    assert_int_equal(e.is_object, object);
}

static void test_line_table(void **state)
{
    (void)state;
    size_t n = sizeof(cases) / sizeof(cases[0]), good = 0;
    for (size_t i = 0; i < n; i++) {
        check_case(&cases[i]);
        good += cases[i].code == JOB_ERR_NONE;
    }
    assert_true(n >= 40);
    assert_true(good >= 15);
}

/* Lines built at run time: sizes and lengths. */
static void test_sizes(void **state)
{
    (void)state;
    struct job_defaults d = defaults();
    struct job_request *r;
    struct job_error e;

    /* 1 MB prompt: accepted (the input reader caps lines) */
    size_t big = 1u << 20;
    char *line = malloc(big + 64);
    assert_non_null(line);
    int k = sprintf(line, "{\"prompt\":\"");
    memset(line + k, 'a', big);
    strcpy(line + k + big, "\"}");
    r = parse_ok(line, strlen(line));
    assert_int_equal(strlen(r->prompt), big);
    job_request_free(r);
    free(line);

    /* custom_id: 512 bytes fine, 513 not */
    char id[700];
    for (int n = 512; n <= 513; n++) {
        memset(id, 'i', (size_t)n);
        id[n] = 0;
        char buf[800];
        snprintf(buf, sizeof(buf), "{\"custom_id\":\"%s\",\"prompt\":\"x\"}", id);
        enum status st = job_request_parse(buf, strlen(buf), &d, &r, &e);
        if (n == 512) {
            assert_int_equal(st, ST_OK);
            assert_string_equal(r->custom_id, id);
            job_request_free(r);
        } else {
            assert_int_equal(st, ST_ERR_INVALID_ARG);
            assert_int_equal(e.code, JOB_ERR_INVALID_VALUE);
            assert_non_null(strstr(e.message, "custom_id"));
            assert_string_equal(e.custom_id, ""); /* not its own, and never the default id */
        }
    }

    /* stop strings: ENGINE_STOP_MAX_LEN bytes fine, one more not */
    for (int n = ENGINE_STOP_MAX_LEN; n <= ENGINE_STOP_MAX_LEN + 1; n++) {
        char buf[ENGINE_STOP_MAX_LEN + 100];
        int m = sprintf(buf, "{\"prompt\":\"x\",\"stop\":\"");
        memset(buf + m, 's', (size_t)n);
        strcpy(buf + m + n, "\"}");
        enum status st = job_request_parse(buf, strlen(buf), &d, &r, &e);
        assert_int_equal(st, n == ENGINE_STOP_MAX_LEN ? ST_OK : ST_ERR_INVALID_ARG);
        if (st == ST_OK)
            job_request_free(r);
        else
            assert_non_null(strstr(e.message, "stop"));
    }

    /* nesting: 60 levels in an ignored field fine, 70 not */
    for (int depth = 60; depth <= 70; depth += 10) {
        char buf[400];
        int m = sprintf(buf, "{\"prompt\":\"x\",\"metadata\":");
        for (int i = 0; i < depth - 1; i++)
            buf[m++] = '[';
        for (int i = 0; i < depth - 1; i++)
            buf[m++] = ']';
        strcpy(buf + m, "}");
        enum status st = job_request_parse(buf, strlen(buf), &d, &r, &e);
        if (depth == 60) {
            assert_int_equal(st, ST_OK);
            job_request_free(r);
        } else {
            assert_int_equal(e.code, JOB_ERR_INVALID_JSON);
            assert_non_null(strstr(e.message, "nesting"));
            assert_non_null(strstr(e.message, "meta"));
        }
    }

    /* a custom_id is required when there is no default */
    d.default_id = NULL;
    assert_int_equal(job_request_parse("{\"prompt\":\"x\"}", 14, &d, &r, &e), ST_ERR_INVALID_ARG);
    assert_int_equal(e.code, JOB_ERR_MISSING_FIELD);
    assert_string_equal(e.field, "custom_id");
    assert_string_equal(e.custom_id, "");

    /* max_tokens without a cap: anything up to INT32_MAX */
    d = defaults();
    d.max_tokens_cap = 0;
    const char *l = "{\"prompt\":\"x\",\"max_tokens\":2147483647}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_OK);
    assert_int_equal(r->max_tokens, INT32_MAX);
    job_request_free(r);
    l = "{\"prompt\":\"x\",\"max_tokens\":2147483648}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_INVALID_ARG);

    /* a line without max_tokens: the default, marked as such, and its JSON leaves it out (so a
     * run knows it may lower it to what the context leaves); a line with it keeps it */
    l = "{\"prompt\":\"x\"}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_OK);
    assert_int_equal(r->max_tokens, d.max_tokens);
    assert_true(r->max_tokens_default);
    char *js = job_request_to_json(r);
    assert_null(strstr(js, "max_tokens"));
    free(js);
    job_request_free(r);
    l = "{\"prompt\":\"x\",\"max_completion_tokens\":7}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_OK);
    assert_false(r->max_tokens_default);
    js = job_request_to_json(r);
    assert_non_null(strstr(js, "\"max_tokens\":7"));
    free(js);
    job_request_free(r);

    /* the line is not read past len: a valid prefix of a longer buffer */
    l = "{\"prompt\":\"x\"}GARBAGE";
    assert_int_equal(job_request_parse(l, 14, &d, &r, &e), ST_OK);
    job_request_free(r);

    /* jerr may be NULL */
    assert_int_equal(job_request_parse("{", 1, &d, &r, NULL), ST_ERR_FORMAT);
    assert_null(r);
}

/* The error keeps the line's custom_id so the error record can carry it. */
static void test_error_custom_id(void **state)
{
    (void)state;
    struct job_defaults d = defaults();
    struct job_request *r;
    struct job_error e;
    const char *l = BATCH(",\"temperature\":9");
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_INVALID_ARG);
    assert_string_equal(e.custom_id, "b");
    assert_string_equal(e.field, "body.temperature");
    /* a line that is not valid JSON further on keeps the custom_id the scan read whole */
    l = "{\"custom_id\":\"zz\"";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_FORMAT);
    assert_string_equal(e.custom_id, "zz");
    l = "{\"custom_id\":\"a\\u00e9\\ud83d\\ude00\",\"prompt\":\"\\ud800\"}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_FORMAT);
    assert_int_equal(e.code, JOB_ERR_INVALID_UTF8);
    assert_string_equal(e.custom_id, "a\xc3\xa9\xf0\x9f\x98\x80"); /* escapes undone */
    l = "{\"metadata\":{\"custom_id\":\"inner\"},\"prompt\":\"x\",}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_FORMAT);
    assert_string_equal(e.custom_id, ""); /* only the top level's */
    l = "{\"custom_id\":\"\",\"prompt\":1,}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_FORMAT);
    assert_string_equal(e.custom_id, ""); /* not a valid custom_id */
    /* a line without one never gets the default id ("line-7"): that name may be another
     * line's own custom_id, which a bad line must not take */
    l = "{\"prompt\":\"x\",\"max_tokens\":0}";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_INVALID_ARG);
    assert_string_equal(e.custom_id, "");
    l = "garbage";
    assert_int_equal(job_request_parse(l, strlen(l), &d, &r, &e), ST_ERR_FORMAT);
    assert_string_equal(e.custom_id, "");
    assert_string_equal(job_err_code_str(JOB_ERR_INVALID_UTF8), "invalid_utf8");
    assert_string_equal(job_err_code_str(JOB_ERR_MISSING_FIELD), "missing_field");
}

/* ---- canonical JSON ----------------------------------------------------------------------- */

/* to_json(r) parses back (under other defaults) to an equal request and the same text; all but
 * a default max_tokens, which the JSON leaves to the job's defaults (a run reads it back under
 * the same, and may lower it to what the context leaves). */
static void check_round_trip(const struct job_request *r)
{
    char *j1 = job_request_to_json(r);
    assert_non_null(j1);
    struct job_defaults other = defaults();
    other.sampling.temperature = 0.3f;
    other.sampling.seed = 999;
    other.sampling.top_k = 7;
    other.max_tokens = r->max_tokens_default ? r->max_tokens : 17;
    other.default_id = NULL;
    struct job_request *r2 = NULL;
    struct job_error e;
    enum status st = job_request_parse(j1, strlen(j1), &other, &r2, &e);
    if (st != ST_OK)
        print_error("canonical line rejected: %s\n%.300s\n", e.message, j1);
    assert_int_equal(st, ST_OK);
    assert_true(job_request_equal(r, r2));
    char *j2 = job_request_to_json(r2);
    assert_string_equal(j1, j2);
    /* and cJSON agrees it is JSON */
    cJSON *root = cJSON_Parse(j1);
    assert_non_null(root);
    cJSON_Delete(root);
    free(j1);
    free(j2);
    job_request_free(r2);
}

static void test_round_trip(void **state)
{
    (void)state;
    struct job_defaults d = defaults();
    size_t n = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (cases[i].code != JOB_ERR_NONE)
            continue;
        struct job_request *r;
        struct job_error e;
        size_t len = cases[i].len ? cases[i].len : strlen(cases[i].line);
        assert_int_equal(job_request_parse(cases[i].line, len, &d, &r, &e), ST_OK);
        check_round_trip(r);
        job_request_free(r);
        n++;
    }
    assert_true(n >= 15);

    /* short float text, and the exact seed */
    const char *l = "{\"custom_id\":\"f\",\"prompt\":\"x\",\"temperature\":0.7,\"top_p\":0.95,"
                    "\"repetition_penalty\":1.1,\"seed\":18446744073709551615}";
    struct job_request *r = parse_ok(l, strlen(l));
    char *j = job_request_to_json(r);
    assert_non_null(strstr(j, "\"temperature\":0.7,"));
    assert_non_null(strstr(j, "\"top_p\":0.95,"));
    assert_non_null(strstr(j, "\"repetition_penalty\":1.1,"));
    assert_non_null(strstr(j, "\"seed\":18446744073709551615"));
    assert_null(strstr(j, "max_tokens")); /* (the job's default: left to it) */
    free(j);
    job_request_free(r);

    /* equal is not trivially true */
    struct job_request *a = parse_ok("{\"prompt\":\"x\"}", 14);
    struct job_request *b = parse_ok("{\"prompt\":\"y\"}", 14);
    struct job_request *c = parse_ok("{\"prompt\":\"x\",\"top_k\":3}", 24);
    assert_true(job_request_equal(a, a));
    assert_false(job_request_equal(a, b));
    assert_false(job_request_equal(a, c));
    job_request_free(a);
    job_request_free(b);
    job_request_free(c);
}

/* ---- fuzz --------------------------------------------------------------------------------- */

static uint64_t fz_state = 0x9e3779b97f4a7c15ull;

static uint64_t fz_next(void)
{
    fz_state ^= fz_state << 13;
    fz_state ^= fz_state >> 7;
    fz_state ^= fz_state << 17;
    return fz_state;
}

static size_t fz_below(size_t n)
{
    return n ? (size_t)(fz_next() % n) : 0;
}

/* Random mutations of good lines: never crash, never leak (ASan), and whatever parses
 * round-trips through the canonical form. */
static void test_fuzz(void **state)
{
    (void)state;
    static const char *const tokens[] = {"\\u0000",
                                         "\xff",
                                         "\xc0\xaf",
                                         "{",
                                         "}",
                                         "[",
                                         "]",
                                         "\"",
                                         ",",
                                         ":",
                                         "\\",
                                         "null",
                                         "1e999",
                                         "-0",
                                         "\"temperature\":",
                                         "\\ud800",
                                         "\xed\xa0\x80",
                                         " ",
                                         "\"messages\":[]",
                                         "0.5",
                                         "\"stop\":[\"a\"]"};
    struct job_defaults d = defaults();
    size_t n_good = 0, n_cases = sizeof(cases) / sizeof(cases[0]);
    const struct line_case *good[64];
    for (size_t i = 0; i < n_cases && n_good < 64; i++)
        if (cases[i].code == JOB_ERR_NONE)
            good[n_good++] = &cases[i];

    size_t accepted = 0;
    for (int iter = 0; iter < 10000; iter++) {
        const struct line_case *c = good[fz_below(n_good)];
        size_t len = c->len ? c->len : strlen(c->line);
        size_t cap = len * 2 + 256;
        char *buf = malloc(cap);
        assert_non_null(buf);
        memcpy(buf, c->line, len);
        int n_mut = 1 + (int)fz_below(4);
        for (int m = 0; m < n_mut; m++) {
            size_t pos = fz_below(len + 1);
            switch (fz_below(5)) {
            case 0: /* flip a byte */
                if (len)
                    buf[fz_below(len)] ^= (char)(1u << fz_below(8));
                break;
            case 1: /* random byte */
                if (len)
                    buf[fz_below(len)] = (char)fz_below(256);
                break;
            case 2: /* delete a span */
                if (len) {
                    size_t p = fz_below(len), k = 1 + fz_below(8);
                    if (p + k > len)
                        k = len - p;
                    memmove(buf + p, buf + p + k, len - p - k);
                    len -= k;
                }
                break;
            case 3: { /* insert a token */
                const char *t = tokens[fz_below(sizeof(tokens) / sizeof(tokens[0]))];
                size_t k = strlen(t);
                if (len + k <= cap) {
                    memmove(buf + pos + k, buf + pos, len - pos);
                    memcpy(buf + pos, t, k);
                    len += k;
                }
                break;
            }
            default: /* truncate */
                len = pos;
                break;
            }
        }
        /* exact-size copy so ASan sees any read past len */
        char *exact = malloc(len ? len : 1);
        assert_non_null(exact);
        memcpy(exact, buf, len);
        free(buf);
        struct job_request *r = NULL;
        struct job_error e;
        enum status st = job_request_parse(exact, len, &d, &r, &e);
        if (st == ST_OK) {
            accepted++;
            check_round_trip(r);
            struct job_choice ch = {.text = exact, .text_len = len, .finish_reason = "stop",
                                    .completion_tokens = 2};
            struct job_result res = {.custom_id = r->custom_id, .kind = r->kind,
                                     .model = r->model, .choices = &ch, .n_choices = 1,
                                     .prompt_tokens = 1, .created = 3, .job_id = 4};
            char *rec = job_record_success(&res);
            assert_non_null(rec);
            assert_strict_json(rec);
            free(rec);
            job_request_free(r);
        } else {
            assert_null(r);
            assert_int_not_equal(e.code, JOB_ERR_NONE);
            assert_int_not_equal(e.code, JOB_ERR_INTERNAL);
            assert_true(e.message[0] != 0);
            char *rec = job_record_parse_error(1, &e);
            assert_non_null(rec);
            assert_strict_json(rec);
            free(rec);
        }
        free(exact);
    }
    /* the mutations are neither all fatal nor all harmless */
    assert_true(accepted > 100);
    assert_true(accepted < 9000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_line_table),
        cmocka_unit_test(test_sizes),
        cmocka_unit_test(test_error_custom_id),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_fuzz),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
