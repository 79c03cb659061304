/* Input line -> validated request (see jobs/request.h), and the canonical JSON form of a
 * request. Two passes: a strict RFC 8259 scan of the raw bytes (jobs/request_scan.c), then cJSON
 * builds the tree and the fields are read, type-checked and range-checked one by one
 * (jobs/request_fields.c, jobs/request_params.c). */
#include "jobs/request_internal.h"

#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jobs/json.h"

const char *job_err_code_str(enum job_err_code c)
{
    switch (c) {
    case JOB_ERR_NONE:
        return "";
    case JOB_ERR_INVALID_JSON:
        return "invalid_json";
    case JOB_ERR_INVALID_UTF8:
        return "invalid_utf8";
    case JOB_ERR_MISSING_FIELD:
        return "missing_field";
    case JOB_ERR_INVALID_TYPE:
        return "invalid_type";
    case JOB_ERR_INVALID_VALUE:
        return "invalid_value";
    case JOB_ERR_UNSUPPORTED:
        return "unsupported";
    case JOB_ERR_UNKNOWN_FIELD:
        return "unknown_field";
    case JOB_ERR_INTERNAL:
        return "internal_error";
    }
    return "internal_error";
}

int job_request_fail(struct job_error *e, enum job_err_code code, const char *field,
                     const char *fmt, ...)
{
    va_list ap;
    e->code = code;
    snprintf(e->field, sizeof(e->field), "%s", field ? field : "");
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return 0;
}

void job_request_pathf(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, JOB_PATH_CAP, fmt, ap);
    va_end(ap);
}

static enum status status_of(enum job_err_code code)
{
    switch (code) {
    case JOB_ERR_INVALID_JSON:
    case JOB_ERR_INVALID_UTF8:
        return ST_ERR_FORMAT;
    case JOB_ERR_UNSUPPORTED:
        return ST_ERR_UNSUPPORTED;
    case JOB_ERR_INTERNAL:
        return ST_ERR_NOMEM;
    default:
        return ST_ERR_INVALID_ARG;
    }
}

/* A line that failed before its custom_id was read: the first top-level "custom_id" string the
 * scan passed (a valid JSON string, so cJSON reads it alone), if it is a valid custom_id. */
static void salvage_custom_id(const struct job_scan *s, struct job_error *e)
{
    cJSON *v = cJSON_ParseWithLength(s->id_raw - 1, s->id_len + 2);
    if (cJSON_IsString(v) && v->valuestring[0] && strlen(v->valuestring) <= JOB_CUSTOM_ID_MAX)
        snprintf(e->custom_id, sizeof(e->custom_id), "%s", v->valuestring);
    cJSON_Delete(v);
}

int job_line_blank(const char *line, size_t len)
{
    size_t i = len >= 3 && !memcmp(line, "\xEF\xBB\xBF", 3) ? 3 : 0;
    for (; i < len; i++)
        if (!strchr(" \t\r\n\v\f", line[i]) || !line[i])
            return 0;
    return 1;
}

enum status job_request_parse(const char *line, size_t len, const struct job_defaults *defaults,
                              struct job_request **out, struct job_error *jerr)
{
    struct job_error local;
    struct job_error *e = jerr ? jerr : &local;
    struct job_scan *s = NULL;
    struct job_request *r = NULL;
    cJSON *root = NULL;
    const char *json = NULL; /* the value's first byte */
    int whole = 0;           /* 1 once it scanned as strict JSON */

    *out = NULL;
    memset(e, 0, sizeof(*e));

    /* Pass 1 (the scan state is ~2.5 KB: heap, not stack). */
    if (!(s = calloc(1, sizeof(*s)))) {
        job_request_fail(e, JOB_ERR_INTERNAL, NULL, "out of memory");
        goto done;
    }
    s->base = (const unsigned char *)line;
    s->p = s->base;
    s->end = s->base + len;
    s->e = e;
    if (len >= 3 && memcmp(line, "\xEF\xBB\xBF", 3) == 0)
        s->p += 3; /* byte order mark */
    job_scan_ws(s);
    if (s->p == s->end) {
        job_request_fail(e, JOB_ERR_INVALID_JSON, NULL, "the line is empty");
        goto done;
    }
    json = (const char *)s->p;
    if (!job_scan_value(s))
        goto done;
    job_scan_ws(s);
    if (s->p != s->end) {
        job_scan_unexpected(s, "the end of the line after the JSON value");
        goto done;
    }

    whole = 1;
    /* Pass 2: the input is now known to be strict JSON that cJSON accepts. */
    const char *parse_end = NULL;
    root = cJSON_ParseWithLengthOpts(json, (size_t)(s->end - (const unsigned char *)json),
                                     &parse_end, 0);
    if (!root) {
        job_request_fail(e, JOB_ERR_INTERNAL, NULL, "cJSON failed on valid JSON (out of memory?)");
        goto done;
    }
    if (!(r = calloc(1, sizeof(*r)))) {
        job_request_fail(e, JOB_ERR_INTERNAL, NULL, "out of memory");
        goto done;
    }
    r->sampling = defaults->sampling;
    struct job_parse_ctx c = {e, defaults, s, 0, ""};
    if (!job_request_read(&c, root, r))
        goto done;
    *out = r;
    r = NULL;
    e->code = JOB_ERR_NONE;
done:
    /* a JSON object, bad only in what it holds (scanned whole, or its scan stopped at a value
     * that is valid JSON but not taken, as a \u0000) */
    e->is_object = json && *json == '{' &&
                   (whole || (e->code != JOB_ERR_INVALID_JSON && e->code != JOB_ERR_INVALID_UTF8));
    if (!*out && !e->custom_id[0] && s && s->id_raw)
        salvage_custom_id(s, e);
    job_request_free(r);
    cJSON_Delete(root);
    free(s);
    return *out ? ST_OK : status_of(e->code);
}

void job_request_free(struct job_request *r)
{
    if (!r)
        return;
    free(r->custom_id);
    for (size_t i = 0; i < r->n_messages; i++)
        free((char *)r->messages[i].content);
    free(r->messages);
    free(r->prompt);
    for (size_t i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->model);
    free(r->schema);
    free(r);
}

/* ---- Canonical form ---------------------------------------------------------------------- */

char *job_request_to_json(const struct job_request *r)
{
    struct job_json b = {0};
    const struct engine_sampling *sp = &r->sampling;

    job_json_put_lit(&b, "{\"custom_id\":");
    job_json_put_cstr(&b, r->custom_id);
    if (r->kind == JOB_KIND_CHAT) {
        job_json_put_lit(&b, ",\"messages\":[");
        for (size_t i = 0; i < r->n_messages; i++) {
            job_json_put_lit(&b, i ? ",{\"role\":" : "{\"role\":");
            job_json_put_cstr(&b, r->messages[i].role);
            job_json_put_lit(&b, ",\"content\":");
            job_json_put_cstr(&b, r->messages[i].content);
            job_json_put_lit(&b, "}");
        }
        job_json_put_lit(&b, "]");
    } else {
        job_json_put_lit(&b, ",\"prompt\":");
        job_json_put_cstr(&b, r->prompt);
    }
    if (r->model) {
        job_json_put_lit(&b, ",\"model\":");
        job_json_put_cstr(&b, r->model);
    }
    if (!r->max_tokens_default) /* (else the job's default applies when it is read back) */
        job_json_put_fmt(&b, ",\"max_tokens\":%d", (int)r->max_tokens);
    job_json_put_lit(&b, ",\"temperature\":");
    job_json_put_float(&b, sp->temperature);
    job_json_put_lit(&b, ",\"top_p\":");
    job_json_put_float(&b, sp->top_p);
    job_json_put_fmt(&b, ",\"top_k\":%d,\"min_p\":", (int)sp->top_k);
    job_json_put_float(&b, sp->min_p);
    job_json_put_lit(&b, ",\"repetition_penalty\":");
    job_json_put_float(&b, sp->repeat_penalty);
    job_json_put_fmt(&b, ",\"repeat_last_n\":%d,\"frequency_penalty\":", (int)sp->repeat_last_n);
    job_json_put_float(&b, sp->frequency_penalty);
    job_json_put_lit(&b, ",\"presence_penalty\":");
    job_json_put_float(&b, sp->presence_penalty);
    job_json_put_fmt(&b, ",\"seed\":%llu", (unsigned long long)sp->seed);
    if (r->n > 1) /* written only when not the default, so older payloads read the same */
        job_json_put_fmt(&b, ",\"n\":%d", (int)r->n);
    if (r->logprobs)
        job_json_put_fmt(&b, ",\"logprobs\":true,\"top_logprobs\":%d", (int)r->top_logprobs);
    if (r->format == JOB_FORMAT_JSON_OBJECT)
        job_json_put_lit(&b, ",\"response_format\":{\"type\":\"json_object\"}");
    if (r->format == JOB_FORMAT_JSON_SCHEMA) {
        job_json_put_lit(&b, ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
                             "{\"name\":\"schema\",\"schema\":");
        job_json_put_lit(&b, r->schema);
        job_json_put_lit(&b, "}}");
    }
    if (r->format == JOB_FORMAT_GRAMMAR) {
        job_json_put_lit(&b, ",\"grammar\":");
        job_json_put_cstr(&b, r->schema);
    }
    if (r->no_thinking) /* written only when set, so older payloads read the same */
        job_json_put_lit(&b, ",\"chat_template_kwargs\":{\"enable_thinking\":false}");
    if (r->n_stop) {
        job_json_put_lit(&b, ",\"stop\":[");
        for (size_t i = 0; i < r->n_stop; i++) {
            if (i)
                job_json_put_lit(&b, ",");
            job_json_put_cstr(&b, r->stop[i]);
        }
        job_json_put_lit(&b, "]");
    }
    job_json_put_lit(&b, "}");
    return job_json_take(&b);
}

static int str_eq(const char *a, const char *b)
{
    return a == b || (a && b && strcmp(a, b) == 0);
}

int job_request_equal(const struct job_request *a, const struct job_request *b)
{
    const struct engine_sampling *x = &a->sampling, *y = &b->sampling;
    if (!str_eq(a->custom_id, b->custom_id) || a->kind != b->kind ||
        a->n_messages != b->n_messages || !str_eq(a->prompt, b->prompt) ||
        a->max_tokens != b->max_tokens || a->max_tokens_default != b->max_tokens_default ||
        a->n_stop != b->n_stop || !str_eq(a->model, b->model) || a->n != b->n ||
        a->logprobs != b->logprobs || a->top_logprobs != b->top_logprobs ||
        a->format != b->format || !str_eq(a->schema, b->schema) || a->no_thinking != b->no_thinking)
        return 0;
    for (size_t i = 0; i < a->n_messages; i++)
        if (!str_eq(a->messages[i].role, b->messages[i].role) ||
            !str_eq(a->messages[i].content, b->messages[i].content))
            return 0;
    for (size_t i = 0; i < a->n_stop; i++)
        if (!str_eq(a->stop[i], b->stop[i]))
            return 0;
    return x->temperature == y->temperature && x->top_k == y->top_k && x->top_p == y->top_p &&
           x->min_p == y->min_p && x->repeat_penalty == y->repeat_penalty &&
           x->repeat_last_n == y->repeat_last_n && x->frequency_penalty == y->frequency_penalty &&
           x->presence_penalty == y->presence_penalty && x->seed == y->seed;
}
