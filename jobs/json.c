/* Compact JSON text building (see jobs/json.h). */
#include "jobs/json.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/utf8.h"

static int json_reserve(struct job_json *b, size_t extra)
{
    if (b->failed)
        return 0;
    if (b->len + extra + 1 <= b->cap)
        return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) {
        if (cap > SIZE_MAX / 2) {
            b->failed = 1;
            return 0;
        }
        cap *= 2;
    }
    char *d = realloc(b->data, cap);
    if (!d) {
        b->failed = 1;
        return 0;
    }
    b->data = d;
    b->cap = cap;
    return 1;
}

void job_json_put_raw(struct job_json *b, const char *s, size_t n)
{
    if (!json_reserve(b, n))
        return;
    if (n)
        memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void job_json_put_lit(struct job_json *b, const char *s)
{
    job_json_put_raw(b, s, strlen(s));
}

void job_json_put_fmt(struct job_json *b, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(tmp)) {
        b->failed = 1; /* only used for numbers: cannot happen */
        return;
    }
    job_json_put_raw(b, tmp, (size_t)n);
}

void job_json_put_str(struct job_json *b, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;

    /* Worst case 6 output bytes per input byte (\u00XX); reserve once. */
    if (n > (SIZE_MAX - 2) / 6) {
        b->failed = 1;
        return;
    }
    if (!json_reserve(b, n * 6 + 2))
        return;
    char *o = b->data + b->len;
    *o++ = '"';
    while (i < n) {
        unsigned char c = p[i];
        if (c >= 0x20 && c < 0x80) {
            if (c == '"' || c == '\\')
                *o++ = '\\';
            *o++ = (char)c;
            i++;
        } else if (c < 0x20) {
            *o++ = '\\';
            switch (c) {
            case '\n':
                *o++ = 'n';
                break;
            case '\t':
                *o++ = 't';
                break;
            case '\r':
                *o++ = 'r';
                break;
            case '\b':
                *o++ = 'b';
                break;
            case '\f':
                *o++ = 'f';
                break;
            default:
                *o++ = 'u', *o++ = '0', *o++ = '0';
                *o++ = hex[c >> 4], *o++ = hex[c & 15];
            }
            i++;
        } else {
            uint32_t cp = 0;
            size_t k = utf8_decode(p + i, n - i, &cp, NULL);
            if (cp == 0x2028 || cp == 0x2029) { /* valid JSON raw, but line breaks to some
                                                 * readers of JSONL (str.splitlines, old JS) */
                memcpy(o, cp == 0x2028 ? "\\u2028" : "\\u2029", 6);
                o += 6;
                i += k;
            } else if (k) {
                memcpy(o, p + i, k);
                o += k;
                i += k;
            } else { /* one U+FFFD for the maximal subpart (at most 3 bytes for 1 input byte,
                      * within the reservation) */
                *o++ = (char)0xEF, *o++ = (char)0xBF, *o++ = (char)0xBD;
                i += utf8_bad_len(p + i, n - i);
            }
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->data);
    b->data[b->len] = 0;
}

void job_json_put_cstr(struct job_json *b, const char *s)
{
    if (s)
        job_json_put_str(b, s, strlen(s));
    else
        job_json_put_lit(b, "null");
}

void job_json_put_float(struct job_json *b, float f)
{
    char tmp[64];
    if (!isfinite(f)) {
        b->failed = 1; /* programmer error: requests hold validated finite values */
        return;
    }
    /* Readers (cJSON) parse a double and round it to float, so test exactly that. */
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*g", prec, (double)f);
        if ((float)strtod(tmp, NULL) == f) {
            job_json_put_lit(b, tmp);
            return;
        }
    }
    snprintf(tmp, sizeof(tmp), "%.17g", (double)f); /* the double is exact */
    job_json_put_lit(b, tmp);
}

void job_json_put_double(struct job_json *b, double d)
{
    char tmp[64];
    if (isnan(d)) {
        job_json_put_lit(b, "null");
        return;
    }
    if (isinf(d)) {
        job_json_put_lit(b, d > 0 ? "1e999" : "-1e999");
        return;
    }
    if (d == floor(d) && fabs(d) < 9007199254740992.0) {
        job_json_put_fmt(b, "%.0f", d); /* (-0 stays "-0") */
        return;
    }
    for (int prec = 15; prec < 17; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*g", prec, d);
        if (strtod(tmp, NULL) == d) {
            job_json_put_lit(b, tmp);
            return;
        }
    }
    snprintf(tmp, sizeof(tmp), "%.17g", d);
    job_json_put_lit(b, tmp);
}

void job_json_put_value(struct job_json *b, const cJSON *v)
{
    const cJSON *it;
    if (cJSON_IsNumber(v)) {
        job_json_put_double(b, v->valuedouble);
    } else if (cJSON_IsString(v)) {
        job_json_put_cstr(b, v->valuestring);
    } else if (cJSON_IsArray(v) || cJSON_IsObject(v)) {
        const int obj = cJSON_IsObject(v);
        job_json_put_raw(b, obj ? "{" : "[", 1);
        cJSON_ArrayForEach(it, v)
        {
            if (it != v->child)
                job_json_put_raw(b, ",", 1);
            if (obj) {
                job_json_put_cstr(b, it->string);
                job_json_put_raw(b, ":", 1);
            }
            job_json_put_value(b, it);
        }
        job_json_put_raw(b, obj ? "}" : "]", 1);
    } else {
        job_json_put_lit(b, cJSON_IsTrue(v) ? "true" : cJSON_IsFalse(v) ? "false" : "null");
    }
}

char *job_json_take(struct job_json *b)
{
    char *d = NULL;
    if (!b->failed && json_reserve(b, 0))
        d = b->data;
    else
        free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    b->failed = 0;
    return d;
}

void job_json_free(struct job_json *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    b->failed = 0;
}

cJSON *job_json_add_text(cJSON *o, const char *key, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    const size_t n = strlen(s);
    size_t i = 0, bad = 0;
    while (i < n) { /* count the replacements first: most text needs none */
        size_t k = utf8_decode(p + i, n - i, NULL, NULL);
        if (!k) {
            k = utf8_bad_len(p + i, n - i);
            bad++;
        }
        i += k;
    }
    if (!bad)
        return cJSON_AddStringToObject(o, key, s);
    char *t = malloc(n + 2 * bad + 1), *w = t; /* each U+FFFD: 3 bytes for at least 1 */
    if (!t)
        return NULL;
    for (i = 0; i < n;) {
        size_t k = utf8_decode(p + i, n - i, NULL, NULL);
        if (k) {
            memcpy(w, s + i, k);
            w += k;
        } else {
            k = utf8_bad_len(p + i, n - i);
            memcpy(w, "\xef\xbf\xbd", 3);
            w += 3;
        }
        i += k;
    }
    *w = 0;
    cJSON *item = cJSON_AddStringToObject(o, key, t);
    free(t);
    return item;
}
