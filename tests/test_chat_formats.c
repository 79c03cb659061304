/* The chat formats beyond ChatML (engine/chat.c): the published templates of Gemma 3, Gemma 2,
 * Llama 3, Llama 2, Mistral v0.1/v0.2 and Phi-3/3.5,
 * recognised from tokenizer.chat_template, render every conversation of
 * tests/fixtures/chat_templates_ref.jsonl exactly as Jinja2 does (tools/ref_chat_templates.py:
 * with and without system messages, multi-turn, whitespace that trim removes, the generation
 * prompt, and the conversation the Gemma template refuses); the Gemma renderings tokenize to
 * llama.cpp's ids for the Jinja text with the real Gemma vocabulary (`make gemma`), which has no
 * template and is recognised by its <start_of_turn> token; Mistral v0.3's and Nemo's (tekken)
 * prompts tokenize to Mistral's own tokenizer's ids (mistral_common); --chat-template names a
 * format. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "engine/chat.h"
#include "tests/test_tokenizer_util.h"
#include "tests/test_util.h"

#define MAX_MSGS 8

static struct io_gguf *gguf_kv(struct gbuf *b, const char *key, const char *value)
{
    const char *const kv[] = {key, value, NULL};
    return gb_open(b, kv);
}

static size_t json_msgs(const cJSON *arr, struct engine_chat_msg *m)
{
    size_t n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr)
    {
        assert_true(n < MAX_MSGS);
        m[n].role = cJSON_GetObjectItem(e, "role")->valuestring;
        m[n].content = cJSON_GetObjectItem(e, "content")->valuestring;
        n++;
    }
    return n;
}

/* The chat format of a reference line's template ("source_file" or "source"), recognised from
 * a GGUF holding it (*g; the caller closes it). */
static struct engine_chat *line_chat(const cJSON *j, struct io_gguf **g)
{
    static struct gbuf b;
    struct err_detail err = {0};
    size_t len;
    const cJSON *src_file = cJSON_GetObjectItem(j, "source_file");
    char *src = src_file ? test_read_file(src_file->valuestring, &len) : NULL;
    *g = gguf_kv(&b, "tokenizer.chat_template",
                 src ? src : cJSON_GetObjectItem(j, "source")->valuestring);
    free(src);
    struct engine_chat *c;
    if (engine_chat_init(&c, *g, &err))
        fail_msg("%s", err.msg);
    return c;
}

static void test_templates_vs_jinja(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct io_gguf *gg;
    struct engine_tok *gtok;
    struct engine_chat *gchat;
    if (io_gguf_open(&gg, test_gemma_path(), &err))
        fail_msg("cannot open %s (run `make gemma` or set QUERN_GEMMA): %s", test_gemma_path(),
                 err.msg);
    assert_int_equal(engine_tok_load(&gtok, gg, &err), ST_OK);
    assert_int_equal(engine_chat_init(&gchat, gg, &err), ST_OK); /* no template: by vocabulary */
    /* Mistral v0.3's vocabulary (with its template) for Mistral's own token ids */
    struct io_gguf *mg;
    struct engine_tok *mtok;
    struct engine_chat *mchat;
    assert_int_equal(io_gguf_open(&mg, "tests/fixtures/mistral_v3_vocab.gguf", &err), ST_OK);
    assert_int_equal(engine_tok_load(&mtok, mg, &err), ST_OK);
    assert_int_equal(engine_chat_init(&mchat, mg, &err), ST_OK);
    size_t flen;
    char *file = test_read_file("tests/fixtures/chat_templates_ref.jsonl", &flen);
    assert_non_null(file);
    struct engine_tok *ttok = test_zstd_tok("tests/fixtures/tekken_vocab.gguf.zst");
    size_t lines = 0, id_lines = 0, errors = 0, mistral_lines = 0, tekken_lines = 0;
    char *save = NULL;
    for (char *line = strtok_r(file, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        struct io_gguf *g;
        struct engine_chat *c = line_chat(j, &g);
        const cJSON *today = cJSON_GetObjectItem(j, "today"); /* the date Jinja was given */
        if (today) {
            struct tm tm = {0};
            assert_non_null(strptime(today->valuestring, "%Y-%m-%d", &tm));
            engine_chat_set_date(c, (int64_t)timegm(&tm));
        }
        struct engine_chat_msg m[MAX_MSGS];
        const size_t n = json_msgs(cJSON_GetObjectItem(j, "messages"), m);
        const int gen = cJSON_IsTrue(cJSON_GetObjectItem(j, "add_generation_prompt"));
        const unsigned flags =
            (gen ? ENGINE_CHAT_GEN_PROMPT : 0) |
            (cJSON_IsFalse(cJSON_GetObjectItem(j, "enable_thinking")) ? ENGINE_CHAT_NO_THINKING
                                                                      : 0);
        const char *tname = cJSON_GetObjectItem(j, "template")->valuestring;
        char *s = NULL;
        size_t len;
        const cJSON *text = cJSON_GetObjectItem(j, "text");
        enum status st = engine_chat_render(c, m, n, flags, &s, &len, &err);
        if (!text) { /* the template raises: so must we, for the same reason */
            const char *why = cJSON_GetObjectItem(j, "error")->valuestring;
            if (st != ST_ERR_INVALID_ARG)
                fail_msg("line %zu (%s): Jinja2 raised \"%s\", we did not", lines + 1, tname, why);
            assert_non_null(strstr(err.msg, strstr(why, "alternate") ? "alternating"
                                            : strstr(why, "System role")
                                                ? "no system role"
                                                : "only user and assistant"));
            errors++;
        } else {
            if (st != ST_OK)
                fail_msg("line %zu (%s): %s", lines + 1, tname, err.msg);
            if (strcmp(s, text->valuestring))
                fail_msg("line %zu (%s, gen %d):\n  got  \"%s\"\n  want \"%s\"", lines + 1, tname,
                         gen, s, text->valuestring);
        }
        const cJSON *want = cJSON_GetObjectItem(j, "ids");
        const cJSON *mwant = cJSON_GetObjectItem(j, "mistral_ids");
        const cJSON *twant = cJSON_GetObjectItem(j, "tekken_ids");
        if (want || mwant || twant) {
            int32_t *ids;
            size_t n_ids;
            /* Gemma's with the model's own template; Mistral v0.3's with the vocabulary's;
             * Nemo's (tekken) with this line's template */
            struct engine_chat *uc = gchat;
            struct engine_tok *ut = gtok;
            if (mwant) {
                want = mwant;
                uc = mchat;
                ut = mtok;
                mistral_lines++;
            } else if (twant) {
                want = twant;
                uc = c;
                ut = ttok;
                tekken_lines++;
            } else {
                id_lines++;
            }
            assert_int_equal(engine_chat_tokenize(uc, ut, m, n, gen, 0, &ids, &n_ids, &err), ST_OK);
            assert_int_equal(n_ids, (size_t)cJSON_GetArraySize(want));
            for (size_t i = 0; i < n_ids; i++)
                assert_int_equal(ids[i], cJSON_GetArrayItem(want, (int)i)->valueint);
            free(ids);
        }
        free(s);
        engine_chat_free(c);
        io_gguf_close(g);
        cJSON_Delete(j);
        lines++;
    }
    free(file);
    print_message("chat_templates_ref: %zu renderings identical to Jinja2 (%zu refused alike), "
                  "%zu Gemma token lists identical to llama.cpp's, %zu Mistral v0.3 and %zu tekken "
                  "(Nemo, Mistral Small 3.2) token lists identical to Mistral's own tokenizer's\n",
                  lines, errors, id_lines, mistral_lines, tekken_lines);
    assert_true(lines >= 260 && id_lines >= 20 && errors >= 30 && mistral_lines >= 12 &&
                tekken_lines >= 32);
    engine_tok_free(ttok);
    engine_chat_free(mchat);
    engine_tok_free(mtok);
    io_gguf_close(mg);
    engine_chat_free(gchat);
    engine_tok_free(gtok);
    io_gguf_close(gg);
}

/* Llama 3.0/3.1/3.2's and ChatML/Qwen3's prompts over Llama 3's and Qwen2's vocabularies
 * (llama.cpp's vocabulary-only GGUFs) as Hugging Face's tokenizer tokenizes the Jinja text
 * with its special tokens (tests/fixtures/tokenizer_bpe_ref.jsonl, "template" lines). */
static void test_bpe_chat_ids(void **state)
{
    (void)state;
    struct engine_tok *llama3 = test_zstd_tok("tests/fixtures/vocab_llama_bpe.gguf.zst"),
                      *qwen2 = test_zstd_tok("tests/fixtures/vocab_qwen2.gguf.zst");
    struct err_detail err = {0};
    size_t flen, lines = 0, by[2] = {0, 0};
    char *file = test_read_file("tests/fixtures/tokenizer_bpe_ref.jsonl", &flen);
    assert_non_null(file);
    char *save = NULL;
    for (char *line = strtok_r(file, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        if (!cJSON_GetObjectItem(j, "template")) { /* a plain string: test_tokenizer_families */
            cJSON_Delete(j);
            continue;
        }
        struct io_gguf *g;
        struct engine_chat *c = line_chat(j, &g);
        struct engine_chat_msg m[MAX_MSGS];
        const size_t n = json_msgs(cJSON_GetObjectItem(j, "messages"), m);
        const int gen = cJSON_IsTrue(cJSON_GetObjectItem(j, "add_generation_prompt"));
        const int l3 = !strcmp(cJSON_GetObjectItem(j, "vocab")->valuestring, "llama-bpe");
        const unsigned flags =
            (gen ? ENGINE_CHAT_GEN_PROMPT : 0) |
            (cJSON_IsFalse(cJSON_GetObjectItem(j, "enable_thinking")) ? ENGINE_CHAT_NO_THINKING
                                                                      : 0);
        int32_t *ids;
        size_t n_ids;
        assert_int_equal(
            engine_chat_tokenize(c, l3 ? llama3 : qwen2, m, n, flags, 0, &ids, &n_ids, &err),
            ST_OK);
        const cJSON *want = cJSON_GetObjectItem(j, "ids");
        int same = n_ids == (size_t)cJSON_GetArraySize(want);
        for (size_t i = 0; same && i < n_ids; i++)
            same = ids[i] == cJSON_GetArrayItem(want, (int)i)->valueint;
        if (!same)
            fail_msg("tokenizer_bpe_ref chat line %zu (%s): \"%s\" tokenized otherwise", lines + 1,
                     cJSON_GetObjectItem(j, "template")->valuestring,
                     cJSON_GetObjectItem(j, "text")->valuestring);
        by[l3]++;
        free(ids);
        engine_chat_free(c);
        io_gguf_close(g);
        cJSON_Delete(j);
        lines++;
    }
    free(file);
    print_message("tokenizer_bpe_ref: %zu Llama 3.x prompts over Llama 3's vocabulary and %zu "
                  "ChatML/Qwen3 prompts over Qwen2's identical to Hugging Face's ids\n",
                  by[1], by[0]);
    assert_true(by[1] >= 60 && by[0] >= 60);
    engine_tok_free(llama3);
    engine_tok_free(qwen2);
}

static void test_named_and_refused(void **state)
{
    (void)state;
    static struct gbuf b;
    struct err_detail err = {0};
    struct engine_chat *c;
    struct engine_chat_msg m[] = {{"user", " Hi "}};
    char *s;
    size_t len;
    /* a ChatML template, but --chat-template llama3 */
    struct io_gguf *g =
        gguf_kv(&b, "tokenizer.chat_template",
                "{% for message in messages %}{{'<|im_start|>' + message['role'] "
                "+ '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}");
    assert_int_equal(engine_chat_init_named(&c, g, "llama3", &err), ST_OK);
    assert_int_equal(engine_chat_render(c, m, 1, 1, &s, &len, &err), ST_OK);
    assert_string_equal(s, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi"
                           "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    free(s);
    engine_chat_free(c);
    assert_int_equal(engine_chat_init_named(&c, g, "vicuna", &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg,
                           "chatml, deepseek-r1, gemma, llama2, llama3, llama31, "
                           "mistral, mistral-v3, mistral-v7, phi3, phi4, phi4-mini, qwen3"));
    io_gguf_close(g);
    /* a template that writes Llama 3.1's dated system turn without the rest of its lines */
    g = gguf_kv(&b, "tokenizer.chat_template",
                "{{- bos_token }}{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
                "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}");
    assert_int_equal(engine_chat_init(&c, g, &err), ST_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "--chat-template"));
    io_gguf_close(g);
    /* variants of the recognised families that render differently: refused, not misrendered */
    static const char *const variants[] = {
        /* a piece of Mistral v0.3's: the system message goes into the last user turn */
        "{%- if messages[0][\"role\"] == \"system\" %}{%- set system_message = "
        "messages[0][\"content\"] %}{%- endif %}{{- bos_token }}{{- \"[INST] \" + "
        "system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}",
        /* a Llama 2 template with a default system prompt (vigogne-2-chat) */
        "{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] "
        "%}{% elif true == true and not '<<SYS>>' in messages[0]['content'] %}{% set "
        "system_message = 'Vous etes Vigogne' %}{% else %}{% set system_message = false %}{% endif "
        "%}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' "
        "[/INST]' }}{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' }}{% endif %}",
        /* the first Phi-3 mini template: <|assistant|> after every user turn, no system */
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') "
        "%}{{'<|user|>"
        "' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}{% elif "
        "(message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}{% endif %}"
        "{% endfor %}",
        /* Phi-4's with a generation prompt of its own (it writes the assistant header after
         * every user turn) */
        "{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system"
        "<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') "
        "%}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif "
        "(message['role'] == 'assistant') %}{{message['content'] + '<|im_end|>'}}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant<|im_sep|>'}}"
        "{% endif %}",
    };
    for (size_t i = 0; i < sizeof(variants) / sizeof(variants[0]); i++) {
        g = gguf_kv(&b, "tokenizer.chat_template", variants[i]);
        assert_int_equal(engine_chat_init(&c, g, &err), ST_ERR_UNSUPPORTED);
        assert_non_null(strstr(err.msg, "--chat-template"));
        io_gguf_close(g);
    }
    /* --chat-template mistral: a system message is refused as the template raises */
    g = gguf_kv(&b, "tokenizer.chat_template", variants[0]);
    assert_int_equal(engine_chat_init_named(&c, g, "mistral", &err), ST_OK);
    struct engine_chat_msg sys_user[] = {{"user", "Hi"}, {"system", "be brief"}};
    assert_int_equal(engine_chat_render(c, sys_user, 2, 1, &s, &len, &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "only user and assistant"));
    engine_chat_free(c);
    io_gguf_close(g);
}

/* engine/chat_published.h (what the formats recognised by their statements are checked
 * against) holds the fixture's published templates as they are (tools/gen_chat_published.py). */
static void test_published_header(void **state)
{
    (void)state;
    static const struct {
        const char *name, *file;
    } pub[] = {
        {"llama31", "meta-llama-Llama-3.1-8B-Instruct.jinja"},
        {"llama31", "meta-llama-Llama-3.2-3B-Instruct.jinja"},
        {"mistral-v3", "mistralai-Mistral-7B-Instruct-v0.3.jinja"},
        {"mistral-v3", "mistralai-Mistral-Nemo-Instruct-2407.jinja"},
        {"qwen3", "Qwen-Qwen3-0.6B.jinja"},
        {"deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"},
        {"mistral-v7", "mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja"},
        {"phi4", "microsoft-phi-4.jinja"},
        {"phi4-mini", "microsoft-Phi-4-mini-instruct.jinja"},
    };
    size_t k = 0;
    static const char *const names[] = {"llama31",    "mistral-v3", "qwen3",    "deepseek-r1",
                                        "mistral-v7", "phi4",       "phi4-mini"};
    for (size_t f = 0; f < sizeof(names) / sizeof(names[0]); f++)
        for (size_t i = 0;; i++) {
            char *text = engine_chat_published(names[f], i);
            if (!text)
                break;
            assert_true(k < sizeof(pub) / sizeof(pub[0]));
            assert_string_equal(names[f], pub[k].name);
            char path[256];
            size_t len;
            snprintf(path, sizeof(path), "tests/fixtures/chat_templates/%s", pub[k].file);
            char *file = test_read_file(path, &len);
            assert_non_null(file);
            if (strcmp(text, file))
                fail_msg("engine/chat_published.h differs from %s: run tools/gen_chat_published.py",
                         path);
            free(file);
            free(text);
            k++;
        }
    assert_int_equal(k, sizeof(pub) / sizeof(pub[0]));
}

/* The published Llama 3.1 and Mistral v0.3 templates edited where they write what a
 * conversation renders to: refused, not rendered as the unedited ones; --chat-template llama31
 * and mistral-v3 render as those. */
static void test_edited_templates(void **state)
{
    (void)state;
    static struct gbuf b;
    struct err_detail err = {0};
    struct engine_chat *c;
    size_t len;
    static const char *const files[] = {
        "tests/fixtures/chat_templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
        "tests/fixtures/chat_templates/mistralai-Mistral-7B-Instruct-v0.3.jinja",
        "tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja",
        "tests/fixtures/chat_templates/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
        "tests/fixtures/chat_templates/mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja",
        "tests/fixtures/chat_templates/microsoft-Phi-4-mini-instruct.jinja"};
    /* (file, what is replaced, by what; 1 where the edited copy still renders the same) */
    static const struct {
        int file;
        const char *from, *to;
        int same;
    } edits[] = {
        {0, "\"26 Jul 2024\"", "\"01 Jan 2025\"", 0},
        {0, "December 2023", "March 2024", 0},
        {0, "messages[0]['content']|trim", "messages[0]['content']", 0},
        {0, "'<|end_header_id|>\\n\\n'+ message['content'] | trim",
         "'<|end_header_id|>\\n\\n'+ message['content']", 0},
        {1, "(message == user_messages[-1]) and system_message", "loop.first and system_message",
         0},
        {1, "\" \" + message[\"content\"]|trim + eos_token",
         "message[\"content\"]|trim + eos_token", 0},
        {1, "{{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}",
         "{{- \"[INST]\" + message[\"content\"] + \" [/INST]\" }}", 0},
        {2, "{%- if loop.last or (not loop.last and reasoning_content) %}", "{%- if loop.last %}",
         0},
        {2, "'<think>\\n\\n</think>\\n\\n'", "'<think>\\n</think>\\n'", 0},
        {2, ".split('<think>')[-1]", ".split('<think>')[0]", 0},
        /* DeepSeek R1's first revision: no <think> in the generation prompt */
        {3, "<think>\\n'}}", "'}}", 0},
        {3, "content.split('</think>')[-1]", "content", 0},
        /* Mistral Small 3.1's default system prompt, a date format of one's own */
        {4, "You are Mistral Small 3, a", "You are Mistral Small 3.1, a", 0},
        {4, "strftime_now(\"%Y-%m-%d\")", "strftime_now(\"%d %b %Y\")", 0},
        {4, "{{- message['content'] + eos_token }}", "{{- message['content']|trim + eos_token }}",
         0},
        /* Phi-3's newline after each role tag, a generation prompt of Phi-3's */
        {5, "'<|' + message['role'] + '|>' + message['content'] + '<|end|>'",
         "'<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n'", 0},
        {5, "{{ '<|assistant|>' }}", "{{ '<|assistant|>\n' }}", 0},
        /* statements or text added: a line of a fine-tune's own, a default system prompt, a
         * space written between two statements; a tag whose '-' is gone */
        {0, "{{- system_message }}", "{{- \"Reasoning: on\\n\" }}\n{{- system_message }}", 0},
        {0, "{{- bos_token }}\n", "{{- bos_token }}\nYou are a pirate.\n", 0},
        {1, "{{- bos_token }}", "{{- bos_token }}{{- \"[SYSTEM_PROMPT]x[/SYSTEM_PROMPT]\" }}", 0},
        {2, "{%- for message in messages[::-1] %}",
         "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>"
         "\\n' }}{%- endif %}\n{%- for message in messages[::-1] %}",
         0},
        {3, "{{ns.system_prompt}}", "{{ns.system_prompt}}{{'Always answer in French.'}}", 0},
        {3, "{{bos_token}}{{ns.system_prompt}}", "{{bos_token}} {{ns.system_prompt}}", 0},
        {0, "{{- \"<|eot_id|>\" }}", "{{ \"<|eot_id|>\" }}", 0},
        /* a statement of the template's own repeated elsewhere: the system message dropped */
        {0, "{%- set system_message = messages[0]['content']|trim %}",
         "{%- set system_message = messages[0]['content']|trim %}\n{%- set system_message = \"\" "
         "%}",
         0},
        /* white space that the '-'s and trim_blocks remove, a comment: the same */
        {0, "{%- if not date_string is defined %}", "\n\n  {%- if not date_string is defined %}",
         1},
        {1, "{{- bos_token }}", "{#- a note #}\n{{- bos_token }}", 1},
    };
    for (size_t i = 0; i < sizeof(edits) / sizeof(edits[0]); i++) {
        char *src = test_read_file(files[edits[i].file], &len);
        assert_non_null(src);
        /* unedited: recognised */
        struct io_gguf *g = gguf_kv(&b, "tokenizer.chat_template", src);
        assert_int_equal(engine_chat_init(&c, g, &err), ST_OK);
        engine_chat_free(c);
        io_gguf_close(g);
        char *at = strstr(src, edits[i].from);
        if (!at)
            fail_msg("edit %zu: \"%s\" is not in %s", i, edits[i].from, files[edits[i].file]);
        const size_t fl = strlen(edits[i].from), tl = strlen(edits[i].to);
        char *ed = malloc(len + tl + 1);
        assert_non_null(ed);
        memcpy(ed, src, (size_t)(at - src));
        memcpy(ed + (at - src), edits[i].to, tl);
        strcpy(ed + (at - src) + tl, at + fl);
        g = gguf_kv(&b, "tokenizer.chat_template", ed);
        const enum status st = engine_chat_init(&c, g, &err);
        if (edits[i].same) {
            if (st != ST_OK)
                fail_msg("edit %zu (%s -> %s) was refused: %s", i, edits[i].from, edits[i].to,
                         err.msg);
            engine_chat_free(c);
        } else {
            if (st != ST_ERR_UNSUPPORTED)
                fail_msg("edit %zu (%s -> %s) was not refused", i, edits[i].from, edits[i].to);
            assert_non_null(strstr(err.msg, "Llama 3.1/3.2/3.3, Mistral v0.1/v0.2/v0.3"));
            assert_non_null(strstr(err.msg, "Qwen3 and DeepSeek R1's distills"));
        }
        io_gguf_close(g);
        free(ed);
        free(src);
    }
    /* each published text with the white space before its '-' tags removed (the statements
     * side by side, as a template written on one line): the same */
    for (size_t f = 0; f < sizeof(files) / sizeof(files[0]); f++) {
        char *src = test_read_file(files[f], &len);
        assert_non_null(src);
        size_t o = 0, cut = 0;
        for (size_t i = 0; i < len; i++) {
            size_t j = i;
            while (j < len && strchr(" \n", src[j]))
                j++;
            if (j > i && (!strncmp(src + j, "{%-", 3) || !strncmp(src + j, "{{-", 3))) {
                cut += j - i;
                i = j - 1;
                continue;
            }
            src[o++] = src[i];
        }
        src[o] = 0;
        assert_true(cut > 100 || !memchr(src, '\n', o)); /* (Phi-4-mini's is one line) */
        struct io_gguf *g = gguf_kv(&b, "tokenizer.chat_template", src);
        if (engine_chat_init(&c, g, &err) != ST_OK)
            fail_msg("%s on one line was refused: %s", files[f], err.msg);
        engine_chat_free(c);
        io_gguf_close(g);
        free(src);
    }
    /* by name */
    struct io_gguf *g = gguf_kv(&b, "tokenizer.chat_template", "{{ messages }}");
    struct engine_chat_msg m[] = {
        {"system", " S "}, {"user", " Hi "}, {"assistant", " A "}, {"user", "Q"}};
    char *s;
    assert_int_equal(engine_chat_init_named(&c, g, "llama31", &err), ST_OK);
    assert_int_equal(engine_chat_render(c, m, 2, 1, &s, &len, &err), ST_OK);
    assert_string_equal(s, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nS"
                           "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n");
    free(s);
    engine_chat_free(c);
    assert_int_equal(engine_chat_init_named(&c, g, "mistral-v3", &err), ST_OK);
    assert_int_equal(engine_chat_render(c, m, 4, 1, &s, &len, &err), ST_OK);
    assert_string_equal(s, "<s>[INST]  Hi [/INST] A</s>[INST]  S \n\nQ[/INST]");
    free(s);
    engine_chat_free(c);
    /* mistral-v7: the default system prompt holds the date set (the first day here) */
    assert_int_equal(engine_chat_init_named(&c, g, "mistral-v7", &err), ST_OK);
    engine_chat_set_date(c, 86399);
    assert_int_equal(engine_chat_render(c, m + 1, 3, 1, &s, &len, &err), ST_OK);
    assert_non_null(strstr(s, "The current date is 1970-01-01.\n"));
    assert_non_null(strstr(s, "[/SYSTEM_PROMPT][INST] Hi [/INST] A </s>[INST]Q[/INST]"));
    free(s);
    assert_int_equal(engine_chat_render(c, m, 2, 1, &s, &len, &err), ST_OK);
    assert_string_equal(s, "<s>[SYSTEM_PROMPT] S [/SYSTEM_PROMPT][INST] Hi [/INST]");
    free(s);
    engine_chat_free(c);
    struct engine_chat_msg think[] = {{"user", "Q"}, {"assistant", "<think>r</think>\n\nA"}};
    assert_int_equal(engine_chat_init_named(&c, g, "qwen3", &err), ST_OK);
    assert_int_equal(engine_chat_render(c, think, 2, 0, &s, &len, &err), ST_OK);
    assert_string_equal(s, "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr\n"
                           "</think>\n\nA<|im_end|>\n");
    free(s);
    engine_chat_free(c);
    io_gguf_close(g);
    /* ChatML that writes or strips reasoning, but not as Qwen3's does (QwQ's, SmolLM3's) */
    g = gguf_kv(&b, "tokenizer.chat_template",
                "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
                "message.content.split('</think>')[-1] + '<|im_end|>\\n' }}{%- endfor %}");
    assert_int_equal(engine_chat_init(&c, g, &err), ST_ERR_UNSUPPORTED);
    io_gguf_close(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_templates_vs_jinja), cmocka_unit_test(test_named_and_refused),
        cmocka_unit_test(test_bpe_chat_ids),       cmocka_unit_test(test_edited_templates),
        cmocka_unit_test(test_published_header),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
