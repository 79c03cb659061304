/* Input line -> validated request (see jobs/request.h). Two passes: a strict RFC 8259 scan of
 * the raw bytes (syntax, UTF-8, NUL escapes, with the JSON path of any problem), then cJSON
 * builds the tree and the fields are read, type-checked and range-checked one by one. */
#include "jobs/request.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/utf8.h"
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
    case JOB_ERR_INTERNAL:
        return "internal_error";
    }
    return "internal_error";
}

/* Record an error (field may be NULL); returns 0 so callers can `return fail(...)`. */
static int fail(struct job_error *e, enum job_err_code code, const char *field, const char *fmt,
                ...) __attribute__((format(printf, 4, 5)));

static int fail(struct job_error *e, enum job_err_code code, const char *field, const char *fmt,
                ...)
{
    va_list ap;
    e->code = code;
    snprintf(e->field, sizeof(e->field), "%s", field ? field : "");
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return 0;
}

#define PATH_CAP 160 /* bytes for a field path; longer paths are cut (only messages use them) */

/* Format a field path into out[PATH_CAP], cutting it if too long. */
static void pathf(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void pathf(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, PATH_CAP, fmt, ap);
    va_end(ap);
}

/* ---- Pass 1: strict syntax scan ---------------------------------------------------------- */

#define SCAN_MAX_DEPTH  64 /* deepest nesting of objects and arrays accepted */
#define SCAN_MAX_NUMBER 63 /* longest number token (cJSON reads at most 63 characters) */

/* One open container. */
struct scan_frame {
    int is_array;    /* 1 for [...], 0 for {...} */
    const char *key; /* object: raw text of the current member's key (no quotes), or NULL */
    size_t key_len;  /* bytes in key */
    size_t index;    /* array: index of the current element */
};

struct scan {
    const unsigned char *base; /* first byte of the line (offsets are reported from here) */
    const unsigned char *p;    /* read position */
    const unsigned char *end;  /* one past the last byte */
    int depth;                 /* open containers; st[1..depth] describe them */
    struct scan_frame st[SCAN_MAX_DEPTH + 1]; /* st[0] unused */
    struct job_error *e;                      /* where problems are reported */
    const char *seed_raw[2]; /* raw number text of top-level "seed" / "body"."seed" */
    size_t seed_len[2];      /* their lengths */
};

/* Write the path of the current position ("body.messages[0].content") into out. */
static void scan_path(const struct scan *s, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = 0;
    for (int d = 1; d <= s->depth && n + 1 < cap; d++) {
        const struct scan_frame *f = &s->st[d];
        int w;
        if (f->is_array)
            w = snprintf(out + n, cap - n, "[%zu]", f->index);
        else if (f->key) {
            size_t kl = f->key_len;
            if (kl > 40) { /* cut long keys, not inside a character */
                kl = 40;
                while (kl > 0 && ((unsigned char)f->key[kl] & 0xC0) == 0x80)
                    kl--;
            }
            w = snprintf(out + n, cap - n, "%s%.*s", n ? "." : "", (int)kl, f->key);
        } else
            w = 0;
        if (w < 0)
            break;
        n += (size_t)w;
        if (n >= cap)
            n = cap - 1;
    }
    out[n] = 0;
}

/* Report a scan error at byte offset `at`: message "<what> at byte N[ in <path>]". */
static int scan_fail(struct scan *s, enum job_err_code code, const unsigned char *at,
                     const char *what)
{
    char path[PATH_CAP];
    scan_path(s, path, sizeof(path));
    return fail(s->e, code, path, "%s at byte %zu%s%s", what, (size_t)(at - s->base),
                path[0] ? " in " : "", path);
}

static void scan_ws(struct scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

/* Complain about the byte at s->p, which cannot start or continue what is expected. */
static int scan_unexpected(struct scan *s, const char *expected)
{
    char what[160];
    if (s->p >= s->end) {
        snprintf(what, sizeof(what), "unexpected end of line (expected %s)", expected);
        return scan_fail(s, JOB_ERR_INVALID_JSON, s->p, what);
    }
    unsigned char c = *s->p;
    if (c >= 0x80) {
        enum utf8_err why;
        if (!utf8_decode(s->p, (size_t)(s->end - s->p), NULL, &why)) {
            snprintf(what, sizeof(what), "invalid UTF-8 (%s)", utf8_err_str(why));
            return scan_fail(s, JOB_ERR_INVALID_UTF8, s->p, what);
        }
    }
    if (c > 0x20 && c < 0x7f)
        snprintf(what, sizeof(what), "unexpected character '%c' (expected %s)", c, expected);
    else
        snprintf(what, sizeof(what), "unexpected byte 0x%02X (expected %s)", c, expected);
    return scan_fail(s, JOB_ERR_INVALID_JSON, s->p, what);
}

static int hex4(const unsigned char *p, uint32_t *v)
{
    uint32_t x = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char c = p[i];
        x <<= 4;
        if (c >= '0' && c <= '9')
            x |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            x |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            x |= (uint32_t)(c - 'A' + 10);
        else
            return 0;
    }
    *v = x;
    return 1;
}

/* String starting at the '"' under s->p; on success s->p is past the closing quote and
 * *raw / *raw_len (may be NULL) hold the text between the quotes. */
static int scan_string(struct scan *s, const char **raw, size_t *raw_len)
{
    const unsigned char *start = ++s->p;
    char what[128];
    while (s->p < s->end) {
        unsigned char c = *s->p;
        if (c == '"') {
            if (raw) {
                *raw = (const char *)start;
                *raw_len = (size_t)(s->p - start);
            }
            s->p++;
            return 1;
        }
        if (c == '\\') {
            const unsigned char *esc = s->p;
            if (s->end - s->p < 2)
                break;
            c = s->p[1];
            if (c == 'u') {
                uint32_t v, lo;
                if (s->end - s->p < 6 || !hex4(s->p + 2, &v))
                    return scan_fail(s, JOB_ERR_INVALID_JSON, esc,
                                     "invalid \\u escape (needs 4 hex digits)");
                s->p += 6;
                if (v == 0)
                    return scan_fail(s, JOB_ERR_INVALID_VALUE, esc,
                                     "unsupported \\u0000 (NUL) escape");
                if (v >= 0xDC00 && v <= 0xDFFF)
                    return scan_fail(s, JOB_ERR_INVALID_UTF8, esc, "unpaired low surrogate escape");
                if (v >= 0xD800 && v <= 0xDBFF) {
                    if (s->end - s->p < 6 || s->p[0] != '\\' || s->p[1] != 'u' ||
                        !hex4(s->p + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                        return scan_fail(s, JOB_ERR_INVALID_UTF8, esc,
                                         "unpaired high surrogate escape");
                    s->p += 6;
                }
                continue;
            }
            if (!strchr("\"\\/bfnrt", c) || c == 0)
                return scan_fail(s, JOB_ERR_INVALID_JSON, esc, "invalid escape sequence");
            s->p += 2;
            continue;
        }
        if (c < 0x20) {
            snprintf(what, sizeof(what), "unescaped control character 0x%02X in a string", c);
            return scan_fail(s, JOB_ERR_INVALID_JSON, s->p, what);
        }
        if (c < 0x80) {
            s->p++;
            continue;
        }
        enum utf8_err why;
        size_t k = utf8_decode(s->p, (size_t)(s->end - s->p), NULL, &why);
        if (!k) {
            snprintf(what, sizeof(what), "invalid UTF-8 (%s)", utf8_err_str(why));
            return scan_fail(s, JOB_ERR_INVALID_UTF8, s->p, what);
        }
        s->p += k;
    }
    return scan_fail(s, JOB_ERR_INVALID_JSON, s->end, "unterminated string");
}

static int is_digit(unsigned char c)
{
    return c >= '0' && c <= '9';
}

static int scan_number(struct scan *s)
{
    const unsigned char *start = s->p;
    if (s->p < s->end && *s->p == '-')
        s->p++;
    if (s->p >= s->end || !is_digit(*s->p))
        return scan_fail(s, JOB_ERR_INVALID_JSON, start, "invalid number");
    if (*s->p == '0')
        s->p++;
    else
        while (s->p < s->end && is_digit(*s->p))
            s->p++;
    if (s->p < s->end && *s->p == '.') {
        s->p++;
        if (s->p >= s->end || !is_digit(*s->p))
            return scan_fail(s, JOB_ERR_INVALID_JSON, start, "invalid number");
        while (s->p < s->end && is_digit(*s->p))
            s->p++;
    }
    if (s->p < s->end && (*s->p == 'e' || *s->p == 'E')) {
        s->p++;
        if (s->p < s->end && (*s->p == '+' || *s->p == '-'))
            s->p++;
        if (s->p >= s->end || !is_digit(*s->p))
            return scan_fail(s, JOB_ERR_INVALID_JSON, start, "invalid number");
        while (s->p < s->end && is_digit(*s->p))
            s->p++;
    }
    if (s->p < s->end && (is_digit(*s->p) || *s->p == '.' || *s->p == 'e' || *s->p == 'E' ||
                          *s->p == '-' || *s->p == '+'))
        return scan_fail(s, JOB_ERR_INVALID_JSON, start,
                         "invalid number (leading zero or misplaced sign/exponent)");
    if (s->p - start > SCAN_MAX_NUMBER)
        return scan_fail(s, JOB_ERR_INVALID_JSON, start, "number longer than 63 characters");
    return 1;
}

static int key_is(const struct scan_frame *f, const char *k)
{
    size_t n = strlen(k);
    return !f->is_array && f->key && f->key_len == n && memcmp(f->key, k, n) == 0;
}

static int scan_value(struct scan *s);

static int scan_container(struct scan *s, int is_array)
{
    if (s->depth >= SCAN_MAX_DEPTH)
        return scan_fail(s, JOB_ERR_INVALID_JSON, s->p, "nesting deeper than 64 levels");
    struct scan_frame *f = &s->st[++s->depth];
    f->is_array = is_array;
    f->key = NULL;
    f->key_len = 0;
    f->index = 0;
    s->p++;
    scan_ws(s);
    if (s->p < s->end && *s->p == (is_array ? ']' : '}')) {
        s->p++;
        s->depth--;
        return 1;
    }
    for (;;) {
        if (!is_array) {
            f->key = NULL;
            scan_ws(s);
            if (s->p >= s->end || *s->p != '"')
                return scan_unexpected(s, "a string key");
            const char *k;
            size_t kl;
            if (!scan_string(s, &k, &kl))
                return 0;
            f->key = k;
            f->key_len = kl;
            scan_ws(s);
            if (s->p >= s->end || *s->p != ':')
                return scan_unexpected(s, "':'");
            s->p++;
        }
        if (!scan_value(s))
            return 0;
        scan_ws(s);
        if (s->p < s->end && *s->p == ',') {
            s->p++;
            f->index++;
            continue;
        }
        if (s->p < s->end && *s->p == (is_array ? ']' : '}')) {
            s->p++;
            s->depth--;
            return 1;
        }
        return scan_unexpected(s, is_array ? "',' or ']'" : "',' or '}'");
    }
}

static int scan_literal(struct scan *s, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0)
        return scan_unexpected(s, "a JSON value");
    s->p += n;
    return 1;
}

static int scan_value(struct scan *s)
{
    scan_ws(s);
    if (s->p >= s->end)
        return scan_unexpected(s, "a JSON value");
    switch (*s->p) {
    case '{':
        return scan_container(s, 0);
    case '[':
        return scan_container(s, 1);
    case '"':
        return scan_string(s, NULL, NULL);
    case 't':
        return scan_literal(s, "true");
    case 'f':
        return scan_literal(s, "false");
    case 'n':
        return scan_literal(s, "null");
    default:
        break;
    }
    if (*s->p != '-' && !is_digit(*s->p))
        return scan_unexpected(s, "a JSON value");
    const unsigned char *start = s->p;
    if (!scan_number(s))
        return 0;
    /* Remember seed's exact text: cJSON keeps only a double (53 bits). */
    int slot = -1;
    if (s->depth == 1 && key_is(&s->st[1], "seed"))
        slot = 0;
    else if (s->depth == 2 && key_is(&s->st[1], "body") && key_is(&s->st[2], "seed"))
        slot = 1;
    if (slot >= 0) {
        s->seed_raw[slot] = (const char *)start;
        s->seed_len[slot] = (size_t)(s->p - start);
    }
    return 1;
}

/* ---- Pass 2: fields ---------------------------------------------------------------------- */

/* State of one parse. */
struct ctx {
    struct job_error *e;          /* error out */
    const struct job_defaults *d; /* job defaults */
    const struct scan *s;         /* for the raw seed text */
    int batch;                    /* 1 for the OpenAI Batch shape (parameters under body) */
    const char *pfx;              /* "body." or "" */
};

/* Short text for a JSON value in messages: "\"hot\"", "3.5", "true", "an array". */
static void describe(const cJSON *v, char *out, size_t cap)
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
static int fail_type(struct ctx *c, const char *path, const char *what, const cJSON *v)
{
    char got[80];
    describe(v, got, sizeof(got));
    return fail(c->e, JOB_ERR_INVALID_TYPE, path, "%s must be %s, got %s", path, what, got);
}

/* Find member `name` of obj (case-sensitive). Sets *out to it or NULL; fails on a duplicate.
 * path is the object's path prefix ("", "body.", "body.messages[0].") for messages. */
static int get(struct ctx *c, const cJSON *obj, const char *prefix, const char *name,
               const cJSON **out)
{
    const cJSON *found = NULL;
    *out = NULL;
    for (const cJSON *it = obj->child; it; it = it->next) {
        if (it->string && strcmp(it->string, name) == 0) {
            if (found) {
                char path[PATH_CAP];
                pathf(path, "%s%s", prefix, name);
                return fail(c->e, JOB_ERR_INVALID_JSON, path, "duplicate key %s", path);
            }
            found = it;
        }
    }
    *out = found;
    return 1;
}

/* Like get, but a JSON null counts as absent. */
static int get_opt(struct ctx *c, const cJSON *obj, const char *prefix, const char *name,
                   const cJSON **out)
{
    if (!get(c, obj, prefix, name, out))
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
static int param_int(struct ctx *c, const cJSON *obj, const char *name, double lo, double hi,
                     int64_t *out, int *present)
{
    const cJSON *v;
    char path[PATH_CAP];
    pathf(path, "%s%s", c->pfx, name);
    *present = 0;
    if (!get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (!is_integral(v))
        return fail_type(c, path, "an integer", v);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi)) {
        char got[80];
        describe(v, got, sizeof(got));
        return fail(c->e, JOB_ERR_INVALID_VALUE, path,
                    "%s must be an integer in [%.0f, %.0f], got %s", path, lo, hi, got);
    }
    *out = (int64_t)v->valuedouble;
    *present = 1;
    return 1;
}

/* Optional float parameter; range [lo, hi] ((lo, hi] when lo_open; hi = INFINITY means any
 * finite value above lo). Checked after conversion to float, as the engine will see it. */
static int param_float(struct ctx *c, const cJSON *obj, const char *name, float lo, float hi,
                       int lo_open, float *out)
{
    const cJSON *v;
    char path[PATH_CAP];
    pathf(path, "%s%s", c->pfx, name);
    if (!get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (!cJSON_IsNumber(v))
        return fail_type(c, path, "a number", v);
    float f = (float)v->valuedouble;
    int ok = isfinite(f) && (lo_open ? f > lo : f >= lo) && f <= hi;
    if (!ok) {
        char got[80], range[64];
        describe(v, got, sizeof(got));
        if (isinf(hi))
            snprintf(range, sizeof(range), "a finite number %s %g",
                     lo_open ? ">" : ">=", (double)lo);
        else
            snprintf(range, sizeof(range), "a number in %c%g, %g]", lo_open ? '(' : '[', (double)lo,
                     (double)hi);
        return fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must be %s, got %s", path, range, got);
    }
    *out = f;
    return 1;
}

/* Optional boolean that must not be true (stream, echo). */
static int param_false(struct ctx *c, const cJSON *obj, const char *name, const char *why)
{
    const cJSON *v;
    char path[PATH_CAP];
    pathf(path, "%s%s", c->pfx, name);
    if (!get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (!cJSON_IsBool(v))
        return fail_type(c, path, "a boolean", v);
    if (cJSON_IsTrue(v))
        return fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s=true is not supported: %s", path, why);
    return 1;
}

/* Optional array/object that must be empty (tools, functions, logit_bias). */
static int param_empty(struct ctx *c, const cJSON *obj, const char *name, int want_array)
{
    const cJSON *v;
    char path[PATH_CAP];
    pathf(path, "%s%s", c->pfx, name);
    if (!get_opt(c, obj, c->pfx, name, &v))
        return 0;
    if (!v)
        return 1;
    if (want_array ? !cJSON_IsArray(v) : !cJSON_IsObject(v))
        return fail_type(c, path, want_array ? "an array" : "an object", v);
    if (v->child)
        return fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s is not supported", path);
    return 1;
}

/* Parameters that quern cannot honour: fail clearly rather than answer differently. */
static int check_unsupported(struct ctx *c, const cJSON *obj)
{
    int64_t v;
    int present;
    const cJSON *it;
    char path[PATH_CAP];

    if (!param_int(c, obj, "n", 1, 1e9, &v, &present))
        return 0;
    pathf(path, "%sn", c->pfx);
    if (present && v > 1)
        return fail(c->e, JOB_ERR_UNSUPPORTED, path,
                    "%s=%lld is not supported: only one choice per request (n=1); "
                    "submit separate lines with different custom_ids instead",
                    path, (long long)v);
    if (!param_int(c, obj, "best_of", 1, 1e9, &v, &present))
        return 0;
    pathf(path, "%sbest_of", c->pfx);
    if (present && v > 1)
        return fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s=%lld is not supported (only 1)", path,
                    (long long)v);
    if (!param_false(c, obj, "stream", "batch results are written to files, not streamed"))
        return 0;
    if (!param_false(c, obj, "echo", "the prompt is not echoed"))
        return 0;

    /* logprobs: boolean (chat) or integer (completions); top_logprobs: integer. */
    pathf(path, "%slogprobs", c->pfx);
    if (!get_opt(c, obj, c->pfx, "logprobs", &it))
        return 0;
    if (it && !cJSON_IsBool(it) && !is_integral(it))
        return fail_type(c, path, "a boolean or an integer", it);
    if (it && (cJSON_IsTrue(it) || (cJSON_IsNumber(it) && it->valuedouble > 0)))
        return fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s is not supported yet", path);
    if (!param_int(c, obj, "top_logprobs", 0, 20, &v, &present))
        return 0;
    pathf(path, "%stop_logprobs", c->pfx);
    if (present && v > 0)
        return fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s > 0 is not supported yet", path);

    pathf(path, "%ssuffix", c->pfx);
    if (!get_opt(c, obj, c->pfx, "suffix", &it))
        return 0;
    if (it && !cJSON_IsString(it))
        return fail_type(c, path, "a string", it);
    if (it && it->valuestring[0])
        return fail(c->e, JOB_ERR_UNSUPPORTED, path, "%s (insertion) is not supported", path);

    if (!param_empty(c, obj, "tools", 1) || !param_empty(c, obj, "functions", 1) ||
        !param_empty(c, obj, "logit_bias", 0))
        return 0;

    pathf(path, "%sresponse_format", c->pfx);
    if (!get_opt(c, obj, c->pfx, "response_format", &it))
        return 0;
    if (it) {
        if (!cJSON_IsObject(it))
            return fail_type(c, path, "an object", it);
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(it, "type");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") != 0)
            return fail(c->e, JOB_ERR_UNSUPPORTED, path,
                        "%s is not supported (only {\"type\":\"text\"})", path);
    }
    return 1;
}

/* Exact integer text "-?[0-9]+" -> seed; other number forms through the double. */
static int read_seed(struct ctx *c, const cJSON *v, const char *path, uint64_t *out)
{
    const char *raw = c->s->seed_raw[c->batch];
    size_t n = c->s->seed_len[c->batch];
    char buf[SCAN_MAX_NUMBER + 1], got[80];
    static const char range[] = "[-9223372036854775808, 18446744073709551615]";

    if (!is_integral(v))
        return fail_type(c, path, "an integer", v);
    describe(v, got, sizeof(got));
    if (raw && n < sizeof(buf) && !memchr(raw, '.', n) && !memchr(raw, 'e', n) &&
        !memchr(raw, 'E', n)) {
        memcpy(buf, raw, n);
        buf[n] = 0;
        errno = 0;
        if (buf[0] == '-') {
            long long x = strtoll(buf, NULL, 10);
            if (errno == ERANGE)
                return fail(c->e, JOB_ERR_INVALID_VALUE, path,
                            "%s must be an integer in %s, got %s", path, range, buf);
            *out = (uint64_t)(int64_t)x;
        } else {
            unsigned long long x = strtoull(buf, NULL, 10);
            if (errno == ERANGE)
                return fail(c->e, JOB_ERR_INVALID_VALUE, path,
                            "%s must be an integer in %s, got %s", path, range, buf);
            *out = (uint64_t)x;
        }
        return 1;
    }
    double d = v->valuedouble;
    if (!(d >= -9223372036854775808.0 && d < 18446744073709551616.0))
        return fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must be an integer in %s, got %s", path,
                    range, got);
    *out = d < 0 ? (uint64_t)(int64_t)d : (uint64_t)d;
    return 1;
}

/* Sampling parameters, max_tokens, stop and model from obj (top level or body). */
static int read_params(struct ctx *c, const cJSON *obj, struct job_request *r)
{
    struct engine_sampling *sp = &r->sampling;
    const cJSON *v;
    char path[PATH_CAP];
    int64_t iv;
    int present;

    if (!check_unsupported(c, obj))
        return 0;

    /* model: recorded only. */
    pathf(path, "%smodel", c->pfx);
    if (!get_opt(c, obj, c->pfx, "model", &v))
        return 0;
    if (v) {
        if (!cJSON_IsString(v))
            return fail_type(c, path, "a string", v);
        if (strlen(v->valuestring) > JOB_MODEL_MAX)
            return fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s is longer than %d bytes", path,
                        JOB_MODEL_MAX);
        if (!(r->model = strdup(v->valuestring)))
            return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    }

    /* max_tokens / max_completion_tokens (the newer name); both given must agree. */
    int32_t cap = c->d->max_tokens_cap > 0 ? c->d->max_tokens_cap : INT32_MAX;
    int64_t mt = 0, mct = 0;
    int has_mt, has_mct;
    pathf(path, "%smax_completion_tokens", c->pfx);
    if (!param_int(c, obj, "max_tokens", 1, cap, &mt, &has_mt) ||
        !param_int(c, obj, "max_completion_tokens", 1, cap, &mct, &has_mct))
        return 0;
    if (has_mt && has_mct && mt != mct)
        return fail(c->e, JOB_ERR_INVALID_VALUE, path,
                    "%smax_tokens (%lld) and %smax_completion_tokens (%lld) disagree", c->pfx,
                    (long long)mt, c->pfx, (long long)mct);
    r->max_tokens = has_mct ? (int32_t)mct : has_mt ? (int32_t)mt : c->d->max_tokens;
    if (r->max_tokens < 1 || r->max_tokens > cap)
        return fail(c->e, JOB_ERR_INVALID_VALUE, "max_tokens",
                    "the job's default max_tokens %d is not in [1, %d]", (int)r->max_tokens,
                    (int)cap);

    if (!param_float(c, obj, "temperature", 0.0f, 2.0f, 0, &sp->temperature) ||
        !param_float(c, obj, "top_p", 0.0f, 1.0f, 1, &sp->top_p) ||
        !param_float(c, obj, "min_p", 0.0f, 1.0f, 0, &sp->min_p) ||
        !param_float(c, obj, "repetition_penalty", 0.0f, INFINITY, 1, &sp->repeat_penalty) ||
        !param_float(c, obj, "frequency_penalty", -2.0f, 2.0f, 0, &sp->frequency_penalty) ||
        !param_float(c, obj, "presence_penalty", -2.0f, 2.0f, 0, &sp->presence_penalty))
        return 0;
    if (!param_int(c, obj, "top_k", -1, INT32_MAX, &iv, &present))
        return 0;
    if (present)
        sp->top_k = iv < 0 ? 0 : (int32_t)iv; /* -1 (vLLM) and 0 both mean off */
    if (!param_int(c, obj, "repeat_last_n", -1, INT32_MAX, &iv, &present))
        return 0;
    if (present)
        sp->repeat_last_n = (int32_t)iv;

    pathf(path, "%sseed", c->pfx);
    if (!get_opt(c, obj, c->pfx, "seed", &v))
        return 0;
    if (v && !read_seed(c, v, path, &sp->seed))
        return 0;

    /* stop: a string or an array of up to JOB_STOP_MAX strings. */
    pathf(path, "%sstop", c->pfx);
    if (!get_opt(c, obj, c->pfx, "stop", &v))
        return 0;
    if (v) {
        size_t n = 0;
        if (cJSON_IsString(v)) {
            n = 1;
        } else if (cJSON_IsArray(v)) {
            for (const cJSON *it = v->child; it; it = it->next)
                n++;
            if (n > JOB_STOP_MAX)
                return fail(c->e, JOB_ERR_INVALID_VALUE, path,
                            "%s has %zu strings; at most %d are allowed", path, n, JOB_STOP_MAX);
        } else {
            return fail_type(c, path, "a string or an array of strings", v);
        }
        if (n && !(r->stop = calloc(n, sizeof(*r->stop))))
            return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
        const cJSON *it = cJSON_IsString(v) ? v : v->child;
        for (size_t i = 0; i < n; i++, it = it->next) {
            char ipath[PATH_CAP];
            if (cJSON_IsString(v))
                pathf(ipath, "%s", path);
            else
                pathf(ipath, "%s[%zu]", path, i);
            if (!cJSON_IsString(it))
                return fail_type(c, ipath, "a string", it);
            size_t len = strlen(it->valuestring);
            if (len == 0)
                return fail(c->e, JOB_ERR_INVALID_VALUE, ipath, "%s must not be empty", ipath);
            if (len > ENGINE_STOP_MAX_LEN)
                return fail(c->e, JOB_ERR_INVALID_VALUE, ipath, "%s is longer than %d bytes", ipath,
                            ENGINE_STOP_MAX_LEN);
            if (!(r->stop[i] = strdup(it->valuestring)))
                return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
            r->n_stop = i + 1;
        }
    }

    /* Backstop: our ranges match engine_sampling_validate's, so this cannot fail unless
     * the job defaults themselves are bad. */
    struct err_detail ed = {0};
    if (engine_sampling_validate(sp, &ed) != ST_OK)
        return fail(c->e, JOB_ERR_INVALID_VALUE, NULL, "sampling parameters: %s", ed.msg);
    return 1;
}

/* One message's content: a string or an array of {"type":"text","text":...} parts. */
static int read_content(struct ctx *c, const cJSON *v, const char *path, char **out)
{
    if (cJSON_IsString(v)) {
        if (!(*out = strdup(v->valuestring)))
            return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
        return 1;
    }
    if (!cJSON_IsArray(v))
        return fail_type(c, path, "a string or an array of text parts", v);
    if (!v->child)
        return fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must not be an empty array", path);
    size_t total = 0, i = 0;
    for (const cJSON *it = v->child; it; it = it->next, i++) {
        char ppath[PATH_CAP], fpath[PATH_CAP];
        const cJSON *t, *tx;
        pathf(ppath, "%s[%zu]", path, i);
        if (!cJSON_IsObject(it))
            return fail_type(c, ppath, "an object ({\"type\":\"text\",\"text\":...})", it);
        char pfx[PATH_CAP];
        pathf(pfx, "%s.", ppath);
        if (!get(c, it, pfx, "type", &t))
            return 0;
        pathf(fpath, "%s.type", ppath);
        if (!t)
            return fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        if (!cJSON_IsString(t))
            return fail_type(c, fpath, "a string", t);
        const char *ty = t->valuestring;
        if (strcmp(ty, "text") != 0) {
            static const char *const media[] = {"image_url",   "input_image", "image",
                                                "input_audio", "audio",       "file",
                                                "input_file",  "video_url",   "refusal"};
            for (size_t k = 0; k < sizeof(media) / sizeof(media[0]); k++)
                if (strcmp(ty, media[k]) == 0)
                    return fail(c->e, JOB_ERR_UNSUPPORTED, fpath,
                                "%s is \"%s\": only text parts are supported", fpath, ty);
            char got[80];
            describe(t, got, sizeof(got));
            return fail(c->e, JOB_ERR_INVALID_VALUE, fpath, "%s must be \"text\", got %s", fpath,
                        got);
        }
        if (!get(c, it, pfx, "text", &tx))
            return 0;
        pathf(fpath, "%s.text", ppath);
        if (!tx)
            return fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        if (!cJSON_IsString(tx))
            return fail_type(c, fpath, "a string", tx);
        total += strlen(tx->valuestring);
    }
    char *buf = malloc(total + 1);
    if (!buf)
        return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    size_t n = 0;
    for (const cJSON *it = v->child; it; it = it->next) {
        const char *tx = cJSON_GetObjectItemCaseSensitive(it, "text")->valuestring;
        size_t l = strlen(tx);
        memcpy(buf + n, tx, l);
        n += l;
    }
    buf[n] = 0;
    *out = buf;
    return 1;
}

static int read_messages(struct ctx *c, const cJSON *v, struct job_request *r)
{
    char path[PATH_CAP];
    pathf(path, "%smessages", c->pfx);
    if (!cJSON_IsArray(v))
        return fail_type(c, path, "an array of messages", v);
    size_t n = 0;
    for (const cJSON *it = v->child; it; it = it->next)
        n++;
    if (n == 0)
        return fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must not be empty", path);
    if (!(r->messages = calloc(n, sizeof(*r->messages))))
        return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    size_t i = 0;
    for (const cJSON *m = v->child; m; m = m->next, i++) {
        char mpath[PATH_CAP], pfx[PATH_CAP], fpath[PATH_CAP], got[80];
        const cJSON *role, *content, *tc;
        pathf(mpath, "%s[%zu]", path, i);
        pathf(pfx, "%s.", mpath);
        if (!cJSON_IsObject(m))
            return fail_type(c, mpath, "an object with role and content", m);
        if (!get(c, m, pfx, "role", &role) || !get(c, m, pfx, "content", &content) ||
            !get(c, m, pfx, "tool_calls", &tc))
            return 0;
        pathf(fpath, "%srole", pfx);
        if (!role)
            return fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        if (!cJSON_IsString(role))
            return fail_type(c, fpath, "a string", role);
        const char *rs = role->valuestring, *canon = NULL;
        if (strcmp(rs, "system") == 0 || strcmp(rs, "developer") == 0)
            canon = "system";
        else if (strcmp(rs, "user") == 0)
            canon = "user";
        else if (strcmp(rs, "assistant") == 0)
            canon = "assistant";
        else if (strcmp(rs, "tool") == 0 || strcmp(rs, "function") == 0)
            return fail(c->e, JOB_ERR_UNSUPPORTED, fpath,
                        "%s \"%s\" is not supported (no tool calling)", fpath, rs);
        if (!canon) {
            describe(role, got, sizeof(got));
            return fail(c->e, JOB_ERR_INVALID_VALUE, fpath,
                        "%s must be one of system, user, assistant, developer, got %s", fpath, got);
        }
        r->messages[i].role = canon;
        if (tc && !cJSON_IsNull(tc) && !(cJSON_IsArray(tc) && !tc->child)) {
            pathf(fpath, "%stool_calls", pfx);
            return fail(c->e, JOB_ERR_UNSUPPORTED, fpath, "%s is not supported", fpath);
        }
        pathf(fpath, "%scontent", pfx);
        if (!content)
            return fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        char *text = NULL;
        if (!read_content(c, content, fpath, &text))
            return 0;
        r->messages[i].content = text;
        r->n_messages = i + 1;
    }
    return 1;
}

static int read_prompt(struct ctx *c, const cJSON *v, struct job_request *r)
{
    char path[PATH_CAP];
    pathf(path, "%sprompt", c->pfx);
    if (cJSON_IsArray(v)) {
        size_t n = 0;
        for (const cJSON *it = v->child; it; it = it->next)
            n++;
        if (n == 0)
            return fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must not be an empty array", path);
        if (!cJSON_IsString(v->child)) {
            if (cJSON_IsNumber(v->child) || cJSON_IsArray(v->child))
                return fail(c->e, JOB_ERR_UNSUPPORTED, path,
                            "%s as token ids is not supported; send text", path);
            return fail_type(c, path, "a string", v->child);
        }
        if (n > 1)
            return fail(c->e, JOB_ERR_UNSUPPORTED, path,
                        "%s with %zu prompts is not supported; put one prompt per line", path, n);
        v = v->child; /* a one-element array is the same as its string */
    }
    if (!cJSON_IsString(v))
        return fail_type(c, path, "a string", v);
    if (!v->valuestring[0])
        return fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must not be empty", path);
    if (!(r->prompt = strdup(v->valuestring)))
        return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    return 1;
}

/* custom_id (always top level). Sets r->custom_id, or fails. */
static int read_custom_id(struct ctx *c, const cJSON *root, struct job_request *r)
{
    const cJSON *v;
    if (!get_opt(c, root, "", "custom_id", &v))
        return 0;
    if (!v) {
        if (c->batch || !c->d->default_id)
            return fail(c->e, JOB_ERR_MISSING_FIELD, "custom_id", "custom_id is missing");
        v = NULL;
    } else {
        if (!cJSON_IsString(v))
            return fail_type(c, "custom_id", "a string", v);
        size_t n = strlen(v->valuestring);
        if (n == 0)
            return fail(c->e, JOB_ERR_INVALID_VALUE, "custom_id", "custom_id must not be empty");
        if (n > JOB_CUSTOM_ID_MAX)
            return fail(c->e, JOB_ERR_INVALID_VALUE, "custom_id",
                        "custom_id is %zu bytes long; at most %d are allowed", n,
                        JOB_CUSTOM_ID_MAX);
        snprintf(c->e->custom_id, sizeof(c->e->custom_id), "%s", v->valuestring);
    }
    const char *id = v ? v->valuestring : c->d->default_id;
    size_t n = strlen(id);
    if (n == 0 || n > JOB_CUSTOM_ID_MAX)
        return fail(c->e, JOB_ERR_INVALID_VALUE, "custom_id",
                    "the default custom_id must be 1..%d bytes", JOB_CUSTOM_ID_MAX);
    if (!(r->custom_id = strdup(id)))
        return fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    return 1;
}

/* Shape detection and the whole field walk over a parsed root. */
static int read_request(struct ctx *c, const cJSON *root, struct job_request *r)
{
    const cJSON *body, *method, *url, *msgs, *prompt;

    if (!cJSON_IsObject(root)) {
        char got[80];
        describe(root, got, sizeof(got));
        return fail(c->e, JOB_ERR_INVALID_TYPE, NULL, "the line must be a JSON object, got %s",
                    got);
    }
    if (!get(c, root, "", "body", &body) || !get(c, root, "", "method", &method) ||
        !get(c, root, "", "url", &url))
        return 0;
    c->batch = body || method || url;
    c->pfx = c->batch ? "body." : "";
    if (!read_custom_id(c, root, r))
        return 0;

    const cJSON *params = root;
    if (c->batch) {
        if (!method)
            return fail(c->e, JOB_ERR_MISSING_FIELD, "method",
                        "method is missing (must be \"POST\")");
        if (!cJSON_IsString(method))
            return fail_type(c, "method", "a string", method);
        if (strcmp(method->valuestring, "POST") != 0) {
            char got[80];
            describe(method, got, sizeof(got));
            return fail(c->e, JOB_ERR_INVALID_VALUE, "method", "method must be \"POST\", got %s",
                        got);
        }
        if (!url)
            return fail(c->e, JOB_ERR_MISSING_FIELD, "url", "url is missing");
        if (!cJSON_IsString(url))
            return fail_type(c, "url", "a string", url);
        if (strcmp(url->valuestring, "/v1/chat/completions") == 0) {
            r->kind = JOB_KIND_CHAT;
        } else if (strcmp(url->valuestring, "/v1/completions") == 0) {
            r->kind = JOB_KIND_COMPLETION;
        } else {
            char got[80];
            describe(url, got, sizeof(got));
            return fail(c->e, JOB_ERR_UNSUPPORTED, "url",
                        "url %s is not supported (use /v1/chat/completions or /v1/completions)",
                        got);
        }
        if (!body)
            return fail(c->e, JOB_ERR_MISSING_FIELD, "body", "body is missing");
        if (!cJSON_IsObject(body))
            return fail_type(c, "body", "an object", body);
        params = body;
        if (!get(c, body, "body.", "messages", &msgs) || !get(c, body, "body.", "prompt", &prompt))
            return 0;
        if (r->kind == JOB_KIND_CHAT && !msgs)
            return fail(c->e, JOB_ERR_MISSING_FIELD, "body.messages",
                        "body.messages is missing (required by /v1/chat/completions)");
        if (r->kind == JOB_KIND_COMPLETION && !prompt)
            return fail(c->e, JOB_ERR_MISSING_FIELD, "body.prompt",
                        "body.prompt is missing (required by /v1/completions)");
    } else {
        if (!get(c, root, "", "messages", &msgs) || !get(c, root, "", "prompt", &prompt))
            return 0;
        if (msgs && prompt)
            return fail(c->e, JOB_ERR_INVALID_VALUE, "prompt",
                        "the line has both messages and prompt; give one");
        if (!msgs && !prompt)
            return fail(c->e, JOB_ERR_MISSING_FIELD, "messages",
                        "messages (chat) or prompt (completion) is missing, and there is no "
                        "OpenAI Batch body");
        r->kind = msgs ? JOB_KIND_CHAT : JOB_KIND_COMPLETION;
    }
    if (r->kind == JOB_KIND_CHAT ? !read_messages(c, msgs, r) : !read_prompt(c, prompt, r))
        return 0;
    return read_params(c, params, r);
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

enum status job_request_parse(const char *line, size_t len, const struct job_defaults *defaults,
                              struct job_request **out, struct job_error *jerr)
{
    struct job_error local;
    struct job_error *e = jerr ? jerr : &local;
    struct scan *s = NULL;
    struct job_request *r = NULL;
    cJSON *root = NULL;

    *out = NULL;
    memset(e, 0, sizeof(*e));
    if (defaults->default_id)
        snprintf(e->custom_id, sizeof(e->custom_id), "%s", defaults->default_id);

    /* Pass 1 (the scan state is ~2.5 KB: heap, not stack). */
    if (!(s = calloc(1, sizeof(*s)))) {
        fail(e, JOB_ERR_INTERNAL, NULL, "out of memory");
        goto done;
    }
    s->base = (const unsigned char *)line;
    s->p = s->base;
    s->end = s->base + len;
    s->e = e;
    if (len >= 3 && memcmp(line, "\xEF\xBB\xBF", 3) == 0)
        s->p += 3; /* byte order mark */
    scan_ws(s);
    if (s->p == s->end) {
        fail(e, JOB_ERR_INVALID_JSON, NULL, "the line is empty");
        goto done;
    }
    const char *json = (const char *)s->p;
    if (!scan_value(s))
        goto done;
    scan_ws(s);
    if (s->p != s->end) {
        scan_unexpected(s, "the end of the line after the JSON value");
        goto done;
    }

    /* Pass 2: the input is now known to be strict JSON that cJSON accepts. */
    const char *parse_end = NULL;
    root = cJSON_ParseWithLengthOpts(json, (size_t)(s->end - (const unsigned char *)json),
                                     &parse_end, 0);
    if (!root) {
        fail(e, JOB_ERR_INTERNAL, NULL, "cJSON failed on valid JSON (out of memory?)");
        goto done;
    }
    if (!(r = calloc(1, sizeof(*r)))) {
        fail(e, JOB_ERR_INTERNAL, NULL, "out of memory");
        goto done;
    }
    r->sampling = defaults->sampling;
    struct ctx c = {e, defaults, s, 0, ""};
    if (!read_request(&c, root, r))
        goto done;
    *out = r;
    r = NULL;
    e->code = JOB_ERR_NONE;
done:
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
    job_json_put_fmt(&b, ",\"max_tokens\":%d,\"temperature\":", (int)r->max_tokens);
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
        a->max_tokens != b->max_tokens || a->n_stop != b->n_stop || !str_eq(a->model, b->model))
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
