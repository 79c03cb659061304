/* Pass 2 of request parsing, the typed field access shared by the field walk (describe, get, type
 * errors), and the sampling parameters, max_tokens, stop and model with the unsupported features
 * that are refused. */
#include "jobs/json.h"
#include "jobs/request_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Short text for a JSON value in messages: "\"hot\"", "3.5", "true", "an array". */
void job_request_describe(const cJSON *v, char *out, size_t cap)
{
    if (cJSON_IsString(v)) {
        const char *str = v->valuestring;
        size_t n = strlen(str), keep = n > 40 ? 40 : n;
        while (keep < n && keep > 0 && ((unsigned char)str[keep] & 0xC0) == 0x80)
            keep--; /* do not cut a character */
        char tmp[48];
        for (size_t i = 0; i < keep; i++)
            tmp[i] = (unsigned char)str[i] < 0x20 ? '?' : str[i];
        tmp[keep] = 0;
        snprintf(out, cap, "\"%s\"%s", tmp, keep < n ? "..." : "");
    } else if (cJSON_IsNumber(v)) {
        snprintf(out, cap, "%.17g", v->valuedouble);
        /* prefer the short form when it is exact */
        char tmp[40];
        snprintf(tmp, sizeof(tmp), "%g", v->valuedouble);
        if (strtod(tmp, NULL) == v->valuedouble)
            snprintf(out, cap, "%s", tmp);
    } else if (cJSON_IsBool(v)) {
        snprintf(out, cap, "%s", cJSON_IsTrue(v) ? "true" : "false");
    } else if (cJSON_IsNull(v)) {
        snprintf(out, cap, "null");
    } else if (cJSON_IsArray(v)) {
        snprintf(out, cap, "an array");
    } else {
        snprintf(out, cap, "an object");
    }
}

/* Type error: "<path> must be <what>, got <value>". */
int job_request_fail_type(struct job_parse_ctx *c, const char *path, const char *what,
                          const cJSON *v)
{
    char got[80];
    job_request_describe(v, got, sizeof(got));
    return job_request_fail(c->e, JOB_ERR_INVALID_TYPE, path, "%s must be %s, got %s", path, what,
                            got);
}

/* Find member `name` of obj (case-sensitive). Sets *out to it or NULL; fails on a duplicate.
 * path is the object's path prefix ("", "body.", "body.messages[0].") for messages. */
int job_request_get(struct job_parse_ctx *c, const cJSON *obj, const char *prefix, const char *name,
                    const cJSON **out)
{
    const cJSON *found = NULL;
    *out = NULL;
    for (const cJSON *it = obj->child; it; it = it->next) {
        if (it->string && strcmp(it->string, name) == 0) {
            if (found) {
                char path[JOB_PATH_CAP];
                job_request_pathf(path, "%s%s", prefix, name);
                return job_request_fail(c->e, JOB_ERR_INVALID_JSON, path, "duplicate key %s", path);
            }
            found = it;
        }
    }
    *out = found;
    return 1;
}

/* Like get, but a JSON null counts as absent. */
int job_request_get_opt(struct job_parse_ctx *c, const cJSON *obj, const char *prefix,
                        const char *name, const cJSON **out)
{
    if (!job_request_get(c, obj, prefix, name, out))
        return 0;
    if (*out && cJSON_IsNull(*out))
        *out = NULL;
    return 1;
}

static int is_integral(const cJSON *v)
{
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble);
}

/* Optional integer parameter in [lo, hi]; *out untouched when absent. */
static int param_int(struct job_parse_ctx *c, const cJSON *obj, const char *name, double lo,
                     double hi, int64_t *out, int *present)
{
    const cJSON *v;
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%s%s", c->pfx, name);
    *present = 0;
    if (!job_request_get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (!is_integral(v))
        return job_request_fail_type(c, path, "an integer", v);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi)) {
        char got[80];
        job_request_describe(v, got, sizeof(got));
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                "%s must be an integer in [%.0f, %.0f], got %s", path, lo, hi, got);
    }
    *out = (int64_t)v->valuedouble;
    *present = 1;
    return 1;
}

/* Optional float parameter; range [lo, hi] ((lo, hi] when lo_open; hi = INFINITY means any
 * finite value above lo). Checked after conversion to float, as the engine will see it. */
static int param_float(struct job_parse_ctx *c, const cJSON *obj, const char *name, float lo,
                       float hi, int lo_open, float *out)
{
    const cJSON *v;
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%s%s", c->pfx, name);
    if (!job_request_get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (!cJSON_IsNumber(v))
        return job_request_fail_type(c, path, "a number", v);
    float f = (float)v->valuedouble;
    int ok = isfinite(f) && (lo_open ? f > lo : f >= lo) && f <= hi;
    if (!ok) {
        char got[80], range[64];
        job_request_describe(v, got, sizeof(got));
        if (isinf(hi))
            snprintf(range, sizeof(range), "a finite number %s %g",
                     lo_open ? ">" : ">=", (double)lo);
        else
            snprintf(range, sizeof(range), "a number in %c%g, %g]", lo_open ? '(' : '[', (double)lo,
                     (double)hi);
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must be %s, got %s", path,
                                range, got);
    }
    *out = f;
    return 1;
}

/* Optional boolean that must not be true (stream, echo). */
static int param_false(struct job_parse_ctx *c, const cJSON *obj, const char *name, const char *why)
{
    const cJSON *v;
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%s%s", c->pfx, name);
    if (!job_request_get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (!cJSON_IsBool(v))
        return job_request_fail_type(c, path, "a boolean", v);
    if (cJSON_IsTrue(v))
        return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s=true is not supported: %s",
                                path, why);
    return 1;
}

/* Optional array/object that must be empty (tools, functions, logit_bias). */
static int param_empty(struct job_parse_ctx *c, const cJSON *obj, const char *name, int want_array)
{
    const cJSON *v;
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%s%s", c->pfx, name);
    if (!job_request_get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (want_array ? !cJSON_IsArray(v) : !cJSON_IsObject(v))
        return job_request_fail_type(c, path, want_array ? "an array" : "an object", v);
    if (v->child)
        return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s is not supported", path);
    return 1;
}

/* Parameters that quern cannot honour: fail clearly rather than answer differently. */
static int check_unsupported(struct job_parse_ctx *c, const cJSON *obj)
{
    int64_t v;
    int present;
    const cJSON *it;
    char path[JOB_PATH_CAP];

    if (!param_int(c, obj, "best_of", 1, 1e9, &v, &present))
        return 0;
    job_request_pathf(path, "%sbest_of", c->pfx);
    if (present && v > 1)
        return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path,
                                "%s=%lld is not supported (only 1)", path, (long long)v);
    if (!param_false(c, obj, "stream", "batch results are written to files, not streamed"))
        return 0;
    if (!param_false(c, obj, "echo", "the prompt is not echoed"))
        return 0;

    job_request_pathf(path, "%ssuffix", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "suffix", &it))
        return 0;
    if (it && !cJSON_IsString(it))
        return job_request_fail_type(c, path, "a string", it);
    if (it && it->valuestring[0])
        return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s (insertion) is not supported",
                                path);

    if (!param_empty(c, obj, "tools", 1) || !param_empty(c, obj, "functions", 1) ||
        !param_empty(c, obj, "logit_bias", 0))
        return 0;

    return 1;
}

/* Request parameters quern reads (check_unsupported refuses some of their values): what
 * job_request_read_params reads must be here, or its lines are refused as unknown. */
static const char *const known_params[] = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty", "seed", "stop",
    "n", "logprobs", "top_logprobs", "response_format", "grammar", "best_of", "stream", "echo",
    "suffix", "tools", "functions", "logit_bias", "chat_template_kwargs",
    /* OpenAI's that change nothing here: bookkeeping, service hints, options of refused ones */
    "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
    "prediction", "tool_choice", "function_call", "modalities", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention",
    /* vLLM's scheduling priority (no effect on the output) */
    "priority", NULL};

/* OpenAI's that would change the output in ways quern cannot: refused with why. */
static const char *const refused_params[][2] = {
    {"audio", "audio output is not supported"},
    {"web_search_options", "web search is not supported"},
    {"reasoning_effort", "the model has no reasoning setting"},
    {"verbosity", "the model has no verbosity setting"},
    /* vLLM's extensions that would change the output */
    {"guided_json", "vLLM's guided decoding is not supported (use response_format json_schema)"},
    {"guided_regex", "vLLM's guided decoding is not supported (use quern's grammar)"},
    {"guided_choice", "vLLM's guided decoding is not supported (use quern's grammar)"},
    {"guided_grammar", "vLLM's guided decoding is not supported (use quern's grammar)"},
    {"ignore_eos", "not supported: generation stops at the end-of-sequence token"},
    {"min_tokens", "not supported: generation stops at the end-of-sequence token"},
    {"stop_token_ids", "not supported (use stop strings)"},
    {"include_stop_str_in_output", "not supported: a stop string is never in the output"},
    {"continue_final_message", "not supported: a chat always gets a new assistant turn"},
    {"add_generation_prompt", "not supported: a chat always gets a new assistant turn"},
    {"chat_template", "not supported: the model's own chat template is used"},
};

/* Why parameter k is refused, or NULL. */
static const char *refusal(const char *k)
{
    for (size_t i = 0; i < sizeof(refused_params) / sizeof(refused_params[0]); i++)
        if (!strcmp(k, refused_params[i][0]))
            return refused_params[i][1];
    return NULL;
}

static int in_list(const char *const *list, const char *k)
{
    for (; *list; list++)
        if (!strcmp(*list, k))
            return 1;
    return 0;
}

int job_request_known_fields(struct job_parse_ctx *c, const cJSON *obj, const char *prefix,
                             const char *const *known, const char *const *unhonoured)
{
    char path[JOB_PATH_CAP];
    for (const cJSON *it = obj->child; it; it = it->next) {
        if (in_list(known, it->string))
            continue;
        job_request_pathf(path, "%s%s", prefix, it->string);
        if (unhonoured && in_list(unhonoured, it->string)) {
            if (cJSON_IsNull(it))
                continue;
            return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s is not supported", path);
        }
        return job_request_fail(c->e, JOB_ERR_UNKNOWN_FIELD, path, "unknown field %s", path);
    }
    return 1;
}

/* tool_choice / function_call: "none" or "auto" choose nothing when no tools can be given;
 * anything else asks for a tool call. */
static int check_choice(struct job_parse_ctx *c, const cJSON *v, const char *path)
{
    if (cJSON_IsNull(v) ||
        (cJSON_IsString(v) && (!strcmp(v->valuestring, "none") || !strcmp(v->valuestring, "auto"))))
        return 1;
    return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path,
                            "%s: tool and function calls are not supported (only \"none\")", path);
}

int job_request_check_fields(struct job_parse_ctx *c, const cJSON *obj, const char *prefix,
                             const char *const *extra, int params)
{
    char path[JOB_PATH_CAP];
    for (const cJSON *it = obj->child; it; it = it->next) {
        const char *k = it->string;
        if (in_list(extra, k))
            continue;
        job_request_pathf(path, "%s%s", prefix, k);
        if (!params) /* (the line of a Batch request: its parameters go in its body) */
            return job_request_fail(c->e, JOB_ERR_UNKNOWN_FIELD, path,
                                    "unknown field %s beside the body (parameters go in body)",
                                    path);
        const char *why = refusal(k);
        if (why && !cJSON_IsNull(it))
            return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s: %s", path, why);
        if (why) /* (null: not asked for) */
            continue;
        if (!in_list(known_params, k))
            return job_request_fail(c->e, JOB_ERR_UNKNOWN_FIELD, path,
                                    "unknown field %s (a typo? your own data can go in "
                                    "metadata)",
                                    path);
        if ((!strcmp(k, "tool_choice") || !strcmp(k, "function_call")) &&
            !check_choice(c, it, path))
            return 0;
        if (!strcmp(k, "modalities") && !cJSON_IsNull(it)) {
            const cJSON *m = it->child;
            if (!cJSON_IsArray(it) || !m || m->next || !cJSON_IsString(m) ||
                strcmp(m->valuestring, "text"))
                return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path,
                                        "%s: only [\"text\"] is supported", path);
        }
    }
    return 1;
}

/* The outcome of compiling a request's schema or grammar (g, st, ed) as the line's verdict:
 * 1 when it compiled (g released: the run compiles its own), else the job error at path. */
static int compiled(struct job_parse_ctx *c, const char *path, struct engine_grammar *g,
                    enum status st, const struct err_detail *ed)
{
    engine_grammar_unref(g);
    if (st == ST_ERR_NOMEM)
        return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    if (st)
        return job_request_fail(c->e, st == ST_ERR_UNSUPPORTED ? JOB_ERR_UNSUPPORTED
                                                               : JOB_ERR_INVALID_VALUE,
                                path, "%s: %s", path, ed->msg);
    return 1;
}

/* grammar (quern's extension): GBNF-style text that compiles; not with a JSON response_format. */
static int read_grammar(struct job_parse_ctx *c, const cJSON *obj, struct job_request *r)
{
    const cJSON *it;
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%sgrammar", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "grammar", &it))
        return 0;
    if (!it)
        return 1;
    if (!cJSON_IsString(it))
        return job_request_fail_type(c, path, "a string", it);
    if (r->format != JOB_FORMAT_TEXT)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                "%s and a JSON response_format cannot be used together", path);
    struct engine_grammar *g = NULL;
    struct err_detail ed = {0};
    enum status st = job_gbnf_grammar(it->valuestring, &g, &ed);
    if (!compiled(c, path, g, st, &ed))
        return 0;
    if (!(r->schema = strdup(it->valuestring)))
        return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    r->format = JOB_FORMAT_GRAMMAR;
    return 1;
}

/* response_format: text, json_object, or json_schema with a schema that compiles. */
static int read_response_format(struct job_parse_ctx *c, const cJSON *obj, struct job_request *r)
{
    const cJSON *it;
    char path[JOB_PATH_CAP], sub[JOB_PATH_CAP];
    job_request_pathf(path, "%sresponse_format", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "response_format", &it))
        return 0;
    if (!it)
        return 1;
    if (!cJSON_IsObject(it))
        return job_request_fail_type(c, path, "an object", it);
    /* (job_request_get: a key given twice is an error, as everywhere in a request) */
    char pfx[JOB_PATH_CAP];
    const cJSON *t;
    job_request_pathf(pfx, "%s.", path);
    static const char *const rf_known[] = {"type", "json_schema", NULL};
    if (!job_request_known_fields(c, it, pfx, rf_known, NULL))
        return 0;
    if (!job_request_get(c, it, pfx, "type", &t))
        return 0;
    job_request_pathf(sub, "%s.type", path);
    if (!t)
        return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, sub, "%s is missing", sub);
    if (!cJSON_IsString(t))
        return job_request_fail_type(c, sub, "a string", t);
    if (!strcmp(t->valuestring, "text"))
        return 1;
    if (!strcmp(t->valuestring, "json_object")) {
        r->format = JOB_FORMAT_JSON_OBJECT;
        return 1;
    }
    if (strcmp(t->valuestring, "json_schema") != 0)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, sub,
                                "%s must be \"text\", \"json_object\" or \"json_schema\"", sub);
    const cJSON *js;
    if (!job_request_get(c, it, pfx, "json_schema", &js))
        return 0;
    job_request_pathf(sub, "%s.json_schema", path);
    if (!js)
        return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, sub, "%s is missing", sub);
    if (!cJSON_IsObject(js))
        return job_request_fail_type(c, sub, "an object", js);
    const cJSON *strict, *schema;
    job_request_pathf(pfx, "%s.json_schema.", path);
    static const char *const js_known[] = {"name", "description", "schema", "strict", NULL};
    if (!job_request_known_fields(c, js, pfx, js_known, NULL))
        return 0;
    if (!job_request_get(c, js, pfx, "strict", &strict) ||
        !job_request_get(c, js, pfx, "schema", &schema))
        return 0;
    if (strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict)) {
        job_request_pathf(sub, "%s.json_schema.strict", path);
        return job_request_fail_type(c, sub, "a boolean", strict);
    }
    job_request_pathf(sub, "%s.json_schema.schema", path);
    if (!schema)
        return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, sub, "%s is missing", sub);
    if (!cJSON_IsObject(schema))
        return job_request_fail_type(c, sub, "an object", schema);
    struct engine_grammar *g = NULL;
    struct err_detail ed = {0};
    enum status st = job_schema_grammar(JOB_FORMAT_JSON_SCHEMA, schema, &g, &ed);
    if (!compiled(c, sub, g, st, &ed))
        return 0;
    struct job_json text = {0}; /* numbers exact (cJSON's printer rounds some) */
    job_json_put_value(&text, schema);
    if (!(r->schema = job_json_take(&text)))
        return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    r->format = JOB_FORMAT_JSON_SCHEMA;
    return 1;
}

/* Exact integer text "-?[0-9]+" -> seed; other number forms through the double. */
static int read_seed(struct job_parse_ctx *c, const cJSON *v, const char *path, uint64_t *out)
{
    const char *raw = c->s->seed_raw[c->batch];
    size_t n = c->s->seed_len[c->batch];
    char buf[JOB_SCAN_MAX_NUMBER + 1], got[80];
    static const char range[] = "[-9223372036854775808, 18446744073709551615]";

    if (!is_integral(v))
        return job_request_fail_type(c, path, "an integer", v);
    job_request_describe(v, got, sizeof(got));
    if (raw && n < sizeof(buf) && !memchr(raw, '.', n) && !memchr(raw, 'e', n) &&
        !memchr(raw, 'E', n)) {
        memcpy(buf, raw, n);
        buf[n] = 0;
        errno = 0;
        if (buf[0] == '-') {
            long long x = strtoll(buf, NULL, 10);
            if (errno == ERANGE)
                return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                        "%s must be an integer in %s, got %s", path, range, buf);
            *out = (uint64_t)(int64_t)x;
        } else {
            unsigned long long x = strtoull(buf, NULL, 10);
            if (errno == ERANGE)
                return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                        "%s must be an integer in %s, got %s", path, range, buf);
            *out = (uint64_t)x;
        }
        return 1;
    }
    double d = v->valuedouble;
    if (!(d >= -9223372036854775808.0 && d < 18446744073709551616.0))
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                "%s must be an integer in %s, got %s", path, range, got);
    *out = d < 0 ? (uint64_t)(int64_t)d : (uint64_t)d;
    return 1;
}

/* n, logprobs and top_logprobs (see jobs/request.h for the two forms of logprobs). */
static int read_choices_logprobs(struct job_parse_ctx *c, const cJSON *obj, struct job_request *r)
{
    int64_t v;
    int present, has_top;
    const cJSON *it;
    char path[JOB_PATH_CAP], tpath[JOB_PATH_CAP];

    r->n = 1;
    if (!param_int(c, obj, "n", 1, JOB_N_MAX, &v, &present))
        return 0;
    if (present)
        r->n = (int32_t)v;
    int64_t top = 0;
    if (!param_int(c, obj, "top_logprobs", 0, JOB_TOP_LOGPROBS_MAX, &top, &has_top))
        return 0;
    job_request_pathf(path, "%slogprobs", c->pfx);
    job_request_pathf(tpath, "%stop_logprobs", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "logprobs", &it))
        return 0;
    if (it && cJSON_IsBool(it)) {
        r->logprobs = cJSON_IsTrue(it);
    } else if (it && !is_integral(it)) {
        return job_request_fail_type(c, path, "a boolean or an integer", it);
    } else if (it) {
        int64_t k;
        if (!param_int(c, obj, "logprobs", 0, JOB_TOP_LOGPROBS_MAX, &k, &present))
            return 0; /* not an integer, or out of range: the error names it */
        if (has_top && top != k)
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, tpath,
                                    "%s (%lld) disagrees with %s (%lld); give one of them", tpath,
                                    (long long)top, path, (long long)k);
        r->logprobs = 1;
        top = k;
    }
    if (!r->logprobs && top > 0)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, tpath,
                                "%s needs %s set to true", tpath, path);
    r->top_logprobs = (int32_t)top;
    return 1;
}

/* Sampling parameters, max_tokens, stop and model from obj (top level or body). */
/* chat_template_kwargs (vLLM's): only enable_thinking (a boolean, or null), only for chat
 * requests; a template that does not read it (all but Qwen3's) ignores it, as Jinja does. */
static int read_template_kwargs(struct job_parse_ctx *c, const cJSON *obj, struct job_request *r)
{
    const cJSON *v;
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%schat_template_kwargs", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "chat_template_kwargs", &v))
        return 0;
    if (!v)
        return 1;
    if (!cJSON_IsObject(v))
        return job_request_fail_type(c, path, "an object", v);
    if (r->kind != JOB_KIND_CHAT && v->child)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                "%s is for chat requests (messages), not prompts", path);
    for (const cJSON *it = v->child; it; it = it->next) {
        char kpath[JOB_PATH_CAP];
        job_request_pathf(kpath, "%s.%s", path, it->string);
        if (strcmp(it->string, "enable_thinking"))
            return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, kpath,
                                    "%s is not supported (only enable_thinking)", kpath);
        if (!cJSON_IsBool(it) && !cJSON_IsNull(it))
            return job_request_fail_type(c, kpath, "true or false", it);
        r->no_thinking = cJSON_IsFalse(it);
    }
    return 1;
}

int job_request_read_params(struct job_parse_ctx *c, const cJSON *obj, struct job_request *r)
{
    struct engine_sampling *sp = &r->sampling;
    const cJSON *v;
    char path[JOB_PATH_CAP];
    int64_t iv;
    int present;

    if (!check_unsupported(c, obj) || !read_choices_logprobs(c, obj, r) ||
        !read_response_format(c, obj, r) || !read_grammar(c, obj, r) ||
        !read_template_kwargs(c, obj, r))
        return 0;

    /* model: recorded only. */
    job_request_pathf(path, "%smodel", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "model", &v))
        return 0;
    if (v) {
        if (!cJSON_IsString(v))
            return job_request_fail_type(c, path, "a string", v);
        if (strlen(v->valuestring) > JOB_MODEL_MAX)
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s is longer than %d bytes",
                                    path, JOB_MODEL_MAX);
        if (!(r->model = strdup(v->valuestring)))
            return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    }

    /* max_tokens / max_completion_tokens (the newer name); both given must agree. */
    int32_t cap = c->d->max_tokens_cap > 0 ? c->d->max_tokens_cap : INT32_MAX;
    int64_t mt = 0, mct = 0;
    int has_mt, has_mct;
    job_request_pathf(path, "%smax_completion_tokens", c->pfx);
    if (!param_int(c, obj, "max_tokens", 1, cap, &mt, &has_mt) ||
        !param_int(c, obj, "max_completion_tokens", 1, cap, &mct, &has_mct))
        return 0;
    if (has_mt && has_mct && mt != mct)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                "%smax_tokens (%lld) and %smax_completion_tokens (%lld) disagree",
                                c->pfx, (long long)mt, c->pfx, (long long)mct);
    r->max_tokens = has_mct ? (int32_t)mct : has_mt ? (int32_t)mt : c->d->max_tokens;
    r->max_tokens_default = !has_mct && !has_mt;
    if (r->max_tokens < 1 || r->max_tokens > cap)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, "max_tokens",
                                "the job's default max_tokens %d is not in [1, %d]",
                                (int)r->max_tokens, (int)cap);

    if (!param_float(c, obj, "temperature", 0.0f, 2.0f, 0, &sp->temperature) ||
        !param_float(c, obj, "top_p", 0.0f, 1.0f, 0, &sp->top_p) ||
        !param_float(c, obj, "min_p", 0.0f, 1.0f, 0, &sp->min_p) ||
        !param_float(c, obj, "repetition_penalty", 0.0f, INFINITY, 1, &sp->repeat_penalty) ||
        !param_float(c, obj, "frequency_penalty", -2.0f, 2.0f, 0, &sp->frequency_penalty) ||
        !param_float(c, obj, "presence_penalty", -2.0f, 2.0f, 0, &sp->presence_penalty))
        return 0;
    if (!param_int(c, obj, "top_k", -1, INT32_MAX, &iv, &present))
        return 0;
    if (present)
        sp->top_k = iv < 0 ? 0 : (int32_t)iv; /* -1 (vLLM) and 0 both mean off */
    if (sp->top_p == 0.0f) { /* OpenAI takes 0: the smallest nucleus, the most likely token
                              * alone (ties to the lowest id, as ranking does everywhere) */
        sp->top_p = 1.0f;
        sp->top_k = 1;
    }
    if (!param_int(c, obj, "repeat_last_n", -1, INT32_MAX, &iv, &present))
        return 0;
    if (present)
        sp->repeat_last_n = (int32_t)iv;

    job_request_pathf(path, "%sseed", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "seed", &v))
        return 0;
    if (v && !read_seed(c, v, path, &sp->seed))
        return 0;

    /* stop: a string or an array of up to JOB_STOP_MAX strings. */
    job_request_pathf(path, "%sstop", c->pfx);
    if (!job_request_get_opt(c, obj, c->pfx, "stop", &v))
        return 0;
    if (v) {
        size_t n = 0;
        if (cJSON_IsString(v)) {
            n = 1;
        } else if (cJSON_IsArray(v)) {
            for (const cJSON *it = v->child; it; it = it->next)
                n++;
            if (n > JOB_STOP_MAX)
                return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                        "%s has %zu strings; at most %d are allowed", path, n,
                                        JOB_STOP_MAX);
        } else {
            return job_request_fail_type(c, path, "a string or an array of strings", v);
        }
        if (n && !(r->stop = calloc(n, sizeof(*r->stop))))
            return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
        const cJSON *it = cJSON_IsString(v) ? v : v->child;
        for (size_t i = 0; i < n; i++, it = it->next) {
            char ipath[JOB_PATH_CAP];
            if (cJSON_IsString(v))
                job_request_pathf(ipath, "%s", path);
            else
                job_request_pathf(ipath, "%s[%zu]", path, i);
            if (!cJSON_IsString(it))
                return job_request_fail_type(c, ipath, "a string", it);
            size_t len = strlen(it->valuestring);
            if (len == 0)
                return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, ipath, "%s must not be empty",
                                        ipath);
            if (len > ENGINE_STOP_MAX_LEN)
                return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, ipath,
                                        "%s is longer than %d bytes", ipath, ENGINE_STOP_MAX_LEN);
            if (!(r->stop[i] = strdup(it->valuestring)))
                return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
            r->n_stop = i + 1;
        }
    }

    /* Backstop: our ranges match engine_sampling_validate's, so this cannot fail unless
     * the job defaults themselves are bad. */
    struct err_detail ed = {0};
    if (engine_sampling_validate(sp, &ed) != ST_OK)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, NULL, "sampling parameters: %s",
                                ed.msg);
    return 1;
}
