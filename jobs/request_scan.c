/* Pass 1 of request parsing: a strict RFC 8259 scan of the raw line (syntax, UTF-8, NUL escapes,
 * nesting and number limits) that reports the JSON path of any problem and keeps seed's exact
 * text. */
#include "jobs/request_internal.h"

#include <stdio.h>
#include <string.h>

#include "common/utf8.h"

/* Write the path of the current position ("body.messages[0].content") into out. */
static void scan_path(const struct job_scan *s, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = 0;
    for (int d = 1; d <= s->depth && n + 1 < cap; d++) {
        const struct job_scan_frame *f = &s->st[d];
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
static int scan_fail(struct job_scan *s, enum job_err_code code, const unsigned char *at,
                     const char *what)
{
    char path[JOB_PATH_CAP];
    scan_path(s, path, sizeof(path));
    return job_request_fail(s->e, code, path, "%s at byte %zu%s%s", what, (size_t)(at - s->base),
                            path[0] ? " in " : "", path);
}

void job_scan_ws(struct job_scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

/* Complain about the byte at s->p, which cannot start or continue what is expected. */
int job_scan_unexpected(struct job_scan *s, const char *expected)
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
static int scan_string(struct job_scan *s, const char **raw, size_t *raw_len)
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

static int scan_number(struct job_scan *s)
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
    if (s->p - start > JOB_SCAN_MAX_NUMBER)
        return scan_fail(s, JOB_ERR_INVALID_JSON, start, "number longer than 63 characters");
    return 1;
}

static int key_is(const struct job_scan_frame *f, const char *k)
{
    size_t n = strlen(k);
    return !f->is_array && f->key && f->key_len == n && memcmp(f->key, k, n) == 0;
}

static int scan_container(struct job_scan *s, int is_array)
{
    if (s->depth >= JOB_SCAN_MAX_DEPTH)
        return scan_fail(s, JOB_ERR_INVALID_JSON, s->p, "nesting deeper than 64 levels");
    struct job_scan_frame *f = &s->st[++s->depth];
    f->is_array = is_array;
    f->key = NULL;
    f->key_len = 0;
    f->index = 0;
    s->p++;
    job_scan_ws(s);
    if (s->p < s->end && *s->p == (is_array ? ']' : '}')) {
        s->p++;
        s->depth--;
        return 1;
    }
    for (;;) {
        if (!is_array) {
            f->key = NULL;
            job_scan_ws(s);
            if (s->p >= s->end || *s->p != '"')
                return job_scan_unexpected(s, "a string key");
            const char *k;
            size_t kl;
            if (!scan_string(s, &k, &kl))
                return 0;
            f->key = k;
            f->key_len = kl;
            job_scan_ws(s);
            if (s->p >= s->end || *s->p != ':')
                return job_scan_unexpected(s, "':'");
            s->p++;
        }
        if (!job_scan_value(s))
            return 0;
        job_scan_ws(s);
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
        return job_scan_unexpected(s, is_array ? "',' or ']'" : "',' or '}'");
    }
}

static int scan_literal(struct job_scan *s, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0)
        return job_scan_unexpected(s, "a JSON value");
    s->p += n;
    return 1;
}

int job_scan_value(struct job_scan *s)
{
    job_scan_ws(s);
    if (s->p >= s->end)
        return job_scan_unexpected(s, "a JSON value");
    switch (*s->p) {
    case '{':
        return scan_container(s, 0);
    case '[':
        return scan_container(s, 1);
    case '"':
        if (s->depth == 1 && key_is(&s->st[1], "custom_id") && !s->id_raw)
            return scan_string(s, &s->id_raw, &s->id_len);
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
        return job_scan_unexpected(s, "a JSON value");
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
