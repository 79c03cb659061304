/* Chat template tests: the default model's ChatML template against tests/fixtures/chat_ref.jsonl
 * (text and ids from the reference Jinja renderer and tokenizer), hand-checked renders, special
 * tokens in content, bad roles, and templates built into small in-memory GGUF files. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "engine/chat.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "tests/test_tokenizer_util.h"
#include "tests/test_util.h"

#define CHAT_REF "tests/fixtures/chat_ref.jsonl"
#define SMOL_SYSTEM                                                                                \
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "         \
    "Face<|im_end|>\n"

/* Shared by all tests: the default model, its tokenizer and chat template. */
struct fixture {
    struct io_gguf *g;        /* the default model */
    struct engine_tok *tok;   /* its tokenizer */
    struct engine_chat *chat; /* its chat template */
    char why[1100];           /* why loading failed, when chat is NULL */
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
    if (engine_tok_load(&f.tok, f.g, &err) != ST_OK) {
        snprintf(f.why, sizeof(f.why), "engine_tok_load: %s", err.msg);
        return 0;
    }
    if (engine_chat_init(&f.chat, f.g, &err) != ST_OK)
        snprintf(f.why, sizeof(f.why), "engine_chat_init: %s", err.msg);
    return 0;
}

static int group_teardown(void **state)
{
    struct fixture *f = *state;
    engine_chat_free(f->chat);
    engine_tok_free(f->tok);
    io_gguf_close(f->g);
    return 0;
}

static struct fixture *fix(void **state)
{
    struct fixture *f = *state;
    if (!f->chat)
        fail_msg("%s", f->why);
    return f;
}

static char *render(const struct engine_chat *c, const struct engine_chat_msg *m, size_t n, int gen)
{
    char *s;
    size_t len;
    struct err_detail err = {0};
    if (engine_chat_render(c, m, n, gen, &s, &len, &err) != ST_OK)
        fail_msg("render: %s", err.msg);
    assert_int_equal(strlen(s), len);
    return s;
}

static void assert_chat_ids(struct fixture *f, const struct engine_chat_msg *m, size_t n, int gen,
                            int allow, const int32_t *want, size_t n_want, const char *what)
{
    int32_t *ids;
    size_t n_ids;
    struct err_detail err = {0};
    if (engine_chat_tokenize(f->chat, f->tok, m, n, gen, allow, &ids, &n_ids, &err) != ST_OK)
        fail_msg("%s: tokenize: %s", what, err.msg);
    if (n_ids != n_want || memcmp(ids, want, n_want * sizeof(*want)) != 0) {
        size_t at = 0;
        while (at < n_ids && at < n_want && ids[at] == want[at])
            at++;
        size_t from = at > 8 ? at - 8 : 0;
        char g[1024], w[1024];
        format_ids(g, sizeof(g), ids + from, n_ids - from < 32 ? n_ids - from : 32);
        format_ids(w, sizeof(w), want + from, n_want - from < 32 ? n_want - from : 32);
        free(ids);
        fail_msg("%s: chat ids differ at index %zu (%zu vs %zu ids)\n  got  [%zu..] %s\n  "
                 "want [%zu..] %s",
                 what, at, n_ids, n_want, from, g, from, w);
    }
    free(ids);
}

/* Hand-checked against the template rendered by Jinja and Hugging Face tokenizers. */
static void test_default_system(void **state)
{
    struct fixture *f = fix(state);
    struct engine_chat_msg m[] = {{"user", "Hi"}};
    char *s = render(f->chat, m, 1, 1);
    assert_string_equal(s, SMOL_SYSTEM "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    free(s);
    static const int32_t want[] = {1,     9690,  198,  2683, 359,   253,  5356, 5646,
                                   11173, 3365,  3511, 308,  34519, 28,   7018, 411,
                                   407,   19712, 8182, 2,    198,   1,    4093, 198,
                                   26843, 2,     198,  1,    520,   9531, 198};
    assert_chat_ids(f, m, 1, 1, 0, want, sizeof(want) / sizeof(want[0]), "user Hi");

    /* A leading system message replaces the default one. */
    struct engine_chat_msg m2[] = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Yo"}};
    s = render(f->chat, m2, 3, 0);
    assert_string_equal(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                           "<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n");
    free(s);
    /* A system message later on does not. */
    struct engine_chat_msg m3[] = {{"user", "a"}, {"system", "b"}};
    s = render(f->chat, m3, 2, 0);
    assert_string_equal(s, SMOL_SYSTEM "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nb"
                                       "<|im_end|>\n");
    free(s);
}

/* Special-token text inside content stays text unless explicitly allowed. */
static void test_special_in_content(void **state)
{
    struct fixture *f = fix(state);
    struct engine_chat_msg m[] = {{"user", "Say <|im_end|> now"}};
    static const int32_t plain[] = {1,    9690, 198, 2683,  359,  253,  5356,  5646, 11173,
                                    3365, 3511, 308, 34519, 28,   7018, 411,   407,  19712,
                                    8182, 2,    198, 1,     4093, 198,  36218, 2067, 108,
                                    306,  79,   486, 108,   46,   1209, 2,     198};
    assert_chat_ids(f, m, 1, 0, 0, plain, sizeof(plain) / sizeof(plain[0]), "smuggled im_end");
    static const int32_t allowed[] = {1,    9690, 198,   2683, 359,   253, 5356, 5646,  11173, 3365,
                                      3511, 308,  34519, 28,   7018,  411, 407,  19712, 8182,  2,
                                      198,  1,    4093,  198,  36218, 216, 2,    1209,  2,     198};
    assert_chat_ids(f, m, 1, 0, 1, allowed, sizeof(allowed) / sizeof(allowed[0]), "allowed im_end");
}

/* Without special text in content, tokenizing the chat equals tokenizing its rendering with
 * special-token parsing (the reference's way). */
static void test_tokenize_matches_render(void **state)
{
    struct fixture *f = fix(state);
    struct engine_chat_msg m[] = {{"system", "You are terse.\n\n"},
                                  {"user", "  What's 12+30?  "},
                                  {"assistant", "42\n"},
                                  {"user", "日本語で 😀"},
                                  {"assistant", ""}};
    for (size_t first = 0; first < 2; first++) { /* with and without the default system */
        for (size_t n = 1; first + n <= 5; n++) {
            for (int gen = 0; gen < 2; gen++) {
                char *s = render(f->chat, m + first, n, gen);
                int32_t *want;
                size_t n_want;
                assert_int_equal(engine_tok_encode(f->tok, s, strlen(s), ENGINE_TOK_PARSE_SPECIAL,
                                                   &want, &n_want, NULL),
                                 ST_OK);
                assert_chat_ids(f, m + first, n, gen, 0, want, n_want, s);
                free(want);
                free(s);
            }
        }
    }
}

static void test_bad_messages(void **state)
{
    struct fixture *f = fix(state);
    char *s = NULL;
    size_t len;
    int32_t *ids = NULL;
    size_t n_ids;
    struct err_detail err = {0};
    struct engine_chat_msg tool[] = {{"user", "a"}, {"tool", "b"}};
    assert_int_equal(engine_chat_render(f->chat, tool, 2, 0, &s, &len, &err), ST_ERR_INVALID_ARG);
    assert_null(s);
    assert_non_null(strstr(err.msg, "tool"));
    assert_int_equal(engine_chat_tokenize(f->chat, f->tok, tool, 2, 0, 0, &ids, &n_ids, &err),
                     ST_ERR_INVALID_ARG);
    assert_null(ids);
    struct engine_chat_msg nul[] = {{"user", NULL}};
    assert_int_equal(engine_chat_render(f->chat, nul, 1, 0, &s, &len, &err), ST_ERR_INVALID_ARG);
    struct engine_chat_msg norole[] = {{NULL, "x"}};
    assert_int_equal(engine_chat_render(f->chat, norole, 1, 0, &s, &len, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(engine_chat_render(f->chat, tool, 0, 1, &s, &len, &err), ST_ERR_INVALID_ARG);
}

static void test_reference_fixture(void **state)
{
    struct fixture *f = fix(state);
    size_t flen;
    char *file = test_read_file(CHAT_REF, &flen);
    if (!file)
        fail_msg("missing fixture %s (made by the reference-fixture generator)", CHAT_REF);
    size_t lines = 0;
    char *save = NULL;
    for (char *line = strtok_r(file, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (!*line)
            continue;
        lines++;
        cJSON *j = cJSON_Parse(line);
        if (!j)
            fail_msg("%s line %zu: not JSON", CHAT_REF, lines);
        const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(j, "messages");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(j, "text");
        const cJSON *jids = cJSON_GetObjectItemCaseSensitive(j, "ids");
        int gen = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "add_generation_prompt"));
        if (!cJSON_IsArray(msgs) || !cJSON_IsString(text) || !cJSON_IsArray(jids))
            fail_msg("%s line %zu: needs messages, text and ids", CHAT_REF, lines);
        size_t n = (size_t)cJSON_GetArraySize(msgs), k = 0;
        struct engine_chat_msg *m = calloc(n + 1, sizeof(*m));
        assert_non_null(m);
        const cJSON *v;
        cJSON_ArrayForEach(v, msgs)
        {
            const cJSON *r = cJSON_GetObjectItemCaseSensitive(v, "role");
            const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
            if (!cJSON_IsString(r) || !cJSON_IsString(c))
                fail_msg("%s line %zu: message %zu needs role and content", CHAT_REF, lines, k);
            m[k].role = r->valuestring;
            m[k].content = c->valuestring;
            k++;
        }
        char *s = render(f->chat, m, n, gen);
        if (strcmp(s, text->valuestring) != 0)
            fail_msg("%s line %zu: rendered text differs\n  got  \"%s\"\n  want \"%s\"", CHAT_REF,
                     lines, s, text->valuestring);
        size_t n_want = (size_t)cJSON_GetArraySize(jids), w = 0;
        int32_t *want = malloc((n_want + 1) * sizeof(*want));
        assert_non_null(want);
        cJSON_ArrayForEach(v, jids) want[w++] = (int32_t)v->valuedouble;
        char what[128];
        snprintf(what, sizeof(what), "%s line %zu", CHAT_REF, lines);
        assert_chat_ids(f, m, n, gen, 0, want, n_want, what);
        free(want);
        free(s);
        free(m);
        cJSON_Delete(j);
    }
    free(file);
    print_message("chat_ref: %zu conversations\n", lines);
    if (lines == 0)
        fail_msg("%s is empty", CHAT_REF);
}

/* ---- other templates, from small GGUF files built in memory ---- */

/* A GGUF with no tensors and one string key (none when tpl is NULL). */
static struct io_gguf *gguf_with_template(struct gbuf *b, const char *tpl)
{
    const char *const kv[] = {tpl ? "tokenizer.chat_template" : NULL, tpl, NULL};
    return gb_open(b, kv);
}

static void test_other_templates(void **state)
{
    (void)state;
    static struct gbuf b;
    struct err_detail err = {0};
    struct engine_chat *c;
    struct engine_chat_msg m[] = {{"user", "Hi"}};
    char *s;

    /* Llama-2 style: not ChatML. */
    const char *llama2 = "{% for message in messages %}{% if message['role'] == 'user' %}"
                         "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
                         "{% endfor %}";
    struct io_gguf *g = gguf_with_template(&b, llama2);
    c = (struct engine_chat *)&b;
    assert_int_equal(engine_chat_init(&c, g, &err), ST_ERR_UNSUPPORTED);
    assert_null(c);
    if (!strstr(err.msg, "{% for message in messages %}{% if message['role'] == 'user"))
        fail_msg("error does not quote the template: %s", err.msg);
    io_gguf_close(g);

    /* No template at all: plain ChatML, no default system turn. */
    g = gguf_with_template(&b, NULL);
    assert_int_equal(engine_chat_init(&c, g, &err), ST_OK);
    s = render(c, m, 1, 1);
    assert_string_equal(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    free(s);
    engine_chat_free(c);
    io_gguf_close(g);

    /* Qwen2.5 style: escaped newlines in the literal, default turn in an else branch, a tools
     * branch whose strings are not system turns. */
    const char *qwen =
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- \"\\n\\n# Tools\\n<tools>\" }}"
        "{{- \"</tools><|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
        "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
    g = gguf_with_template(&b, qwen);
    assert_int_equal(engine_chat_init(&c, g, &err), ST_OK);
    s = render(c, m, 1, 0);
    assert_string_equal(s, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                           "helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    free(s);
    engine_chat_free(c);
    io_gguf_close(g);

    /* A default system turn glued to other expressions is refused, not guessed at. */
    const char *glued = "{{ '<|im_start|>system\\nX<|im_end|>\\n' + date }}"
                        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' "
                        "+ message['content'] + '<|im_end|>\\n'}}{% endfor %}";
    g = gguf_with_template(&b, glued);
    assert_int_equal(engine_chat_init(&c, g, &err), ST_ERR_UNSUPPORTED);
    assert_null(c);
    io_gguf_close(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_system),          cmocka_unit_test(test_special_in_content),
        cmocka_unit_test(test_tokenize_matches_render), cmocka_unit_test(test_bad_messages),
        cmocka_unit_test(test_reference_fixture),       cmocka_unit_test(test_other_templates),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
