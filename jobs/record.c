/* OpenAI Batch output lines (see jobs/record.h), deterministic ids and the compact JSON text
 * builder shared with jobs/request.c. */
#include "jobs/record.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/utf8.h"

/* ---- JSON text building ------------------------------------------------------------------ */

static int jbuf_reserve(struct job_jbuf *b, size_t extra)
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

void job_jbuf_put_raw(struct job_jbuf *b, const char *s, size_t n)
{
    if (!jbuf_reserve(b, n))
        return;
    if (n)
        memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void job_jbuf_put_lit(struct job_jbuf *b, const char *s)
{
    job_jbuf_put_raw(b, s, strlen(s));
}

void job_jbuf_put_fmt(struct job_jbuf *b, const char *fmt, ...)
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
    job_jbuf_put_raw(b, tmp, (size_t)n);
}

void job_jbuf_put_str(struct job_jbuf *b, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;

    /* Worst case 6 output bytes per input byte (\u00XX); reserve once. */
    if (n > (SIZE_MAX - 2) / 6) {
        b->failed = 1;
        return;
    }
    if (!jbuf_reserve(b, n * 6 + 2))
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
            size_t k = utf8_decode(p + i, n - i, NULL, NULL);
            if (k) {
                memcpy(o, p + i, k);
                o += k;
                i += k;
            } else { /* U+FFFD: 3 bytes for 1 input byte, within the reservation */
                *o++ = (char)0xEF, *o++ = (char)0xBF, *o++ = (char)0xBD;
                i++;
            }
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->data);
    b->data[b->len] = 0;
}

void job_jbuf_put_cstr(struct job_jbuf *b, const char *s)
{
    if (s)
        job_jbuf_put_str(b, s, strlen(s));
    else
        job_jbuf_put_lit(b, "null");
}

void job_jbuf_put_float(struct job_jbuf *b, float f)
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
            job_jbuf_put_lit(b, tmp);
            return;
        }
    }
    snprintf(tmp, sizeof(tmp), "%.17g", (double)f); /* the double is exact */
    job_jbuf_put_lit(b, tmp);
}

char *job_jbuf_take(struct job_jbuf *b)
{
    char *d = NULL;
    if (!b->failed && jbuf_reserve(b, 0))
        d = b->data;
    else
        free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    b->failed = 0;
    return d;
}

void job_jbuf_free(struct job_jbuf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    b->failed = 0;
}

/* ---- Ids --------------------------------------------------------------------------------- */

/* splitmix64's finalizer: a bijective avalanche mix. */
static uint64_t mix_a(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* MurmurHash3's fmix64 constants: a second, independent bijective mix. */
static uint64_t mix_b(uint64_t z)
{
    z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdull;
    z = (z ^ (z >> 33)) * 0xc4ceb9fe1a85ec53ull;
    return z ^ (z >> 33);
}

/* Two 64-bit lanes, each chaining a bijective mix over 8-byte little-endian words. */
struct idhash {
    uint64_t a, b, word; /* lanes and the word being filled */
    size_t n;            /* bytes fed so far */
};

static void idhash_feed(struct idhash *h, const void *data, size_t len)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < len; i++) {
        h->word |= (uint64_t)p[i] << (8 * (h->n & 7));
        h->n++;
        if ((h->n & 7) == 0) {
            h->a = mix_a(h->a ^ h->word);
            h->b = mix_b(h->b ^ h->word) + h->word * 0x9e3779b97f4a7c15ull;
            h->word = 0;
        }
    }
}

void job_record_hash_hex(const char *tag, int64_t job_id, const char *custom_id, char out[33])
{
    struct idhash h = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0, 0};
    unsigned char jid[8];
    uint64_t u = (uint64_t)job_id;
    for (int i = 0; i < 8; i++)
        jid[i] = (unsigned char)(u >> (8 * i));
    idhash_feed(&h, tag, strlen(tag) + 1); /* the NUL separates tag from job id */
    idhash_feed(&h, jid, 8);
    if (custom_id)
        idhash_feed(&h, custom_id, strlen(custom_id));
    uint64_t n = h.n;
    h.a = mix_a(h.a ^ h.word ^ (n << 56));
    h.b = mix_b(h.b ^ h.word ^ n) ^ h.a;
    h.a = mix_a(h.a + h.b);
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)h.a, (unsigned long long)h.b);
}

/* Append `"key":"<prefix><hash>"`. */
static void put_id(struct job_jbuf *b, const char *key, const char *prefix, const char *tag,
                   int64_t job_id, const char *custom_id)
{
    char hex[33];
    job_record_hash_hex(tag, job_id, custom_id, hex);
    job_jbuf_put_fmt(b, "\"%s\":\"%s%s\"", key, prefix, hex);
}

/* ---- Records ----------------------------------------------------------------------------- */

char *job_record_success(const struct job_result *r)
{
    struct job_jbuf b = {0};
    int chat = r->kind == JOB_KIND_CHAT;

    job_jbuf_put_lit(&b, "{");
    put_id(&b, "id", "batch_req_", "batch_req", r->job_id, r->custom_id);
    job_jbuf_put_lit(&b, ",\"custom_id\":");
    job_jbuf_put_cstr(&b, r->custom_id);
    job_jbuf_put_lit(&b, ",\"response\":{\"status_code\":200,");
    put_id(&b, "request_id", "req_", "req", r->job_id, r->custom_id);
    job_jbuf_put_lit(&b, ",\"body\":{");
    put_id(&b, "id", chat ? "chatcmpl-" : "cmpl-", "cmpl", r->job_id, r->custom_id);
    job_jbuf_put_lit(&b,
                     chat ? ",\"object\":\"chat.completion\"" : ",\"object\":\"text_completion\"");
    job_jbuf_put_fmt(&b, ",\"created\":%lld,\"model\":", (long long)r->created);
    job_jbuf_put_cstr(&b, r->model ? r->model : "");
    if (chat) {
        job_jbuf_put_lit(&b, ",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\","
                             "\"content\":");
        job_jbuf_put_str(&b, r->text, r->text_len);
        job_jbuf_put_lit(&b, "},\"logprobs\":null,\"finish_reason\":");
    } else {
        job_jbuf_put_lit(&b, ",\"choices\":[{\"text\":");
        job_jbuf_put_str(&b, r->text, r->text_len);
        job_jbuf_put_lit(&b, ",\"index\":0,\"logprobs\":null,\"finish_reason\":");
    }
    job_jbuf_put_cstr(&b, r->finish_reason);
    job_jbuf_put_fmt(&b,
                     "}],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,"
                     "\"total_tokens\":%lld}}},\"error\":null}",
                     (int)r->prompt_tokens, (int)r->completion_tokens,
                     (long long)r->prompt_tokens + (long long)r->completion_tokens);
    return job_jbuf_take(&b);
}

char *job_record_rejected(int64_t job_id, const char *custom_id, const char *source,
                          int64_t line_no, const char *code, const char *message)
{
    char idbuf[64], msg[1024];
    if (!custom_id) {
        snprintf(idbuf, sizeof(idbuf), "line-%lld", (long long)line_no);
        custom_id = idbuf;
    }
    snprintf(msg, sizeof(msg), "%s:%lld: %s", source ? source : "?", (long long)line_no,
             message ? message : "rejected at submit");
    return job_record_invalid(job_id, custom_id, 400, code ? code : "invalid_request", msg, NULL);
}

char *job_record_invalid(int64_t job_id, const char *custom_id, int status_code, const char *code,
                         const char *message, const char *param)
{
    struct job_jbuf b = {0};
    job_jbuf_put_lit(&b, "{");
    put_id(&b, "id", "batch_req_", "batch_req", job_id, custom_id);
    job_jbuf_put_lit(&b, ",\"custom_id\":");
    job_jbuf_put_cstr(&b, custom_id);
    job_jbuf_put_fmt(&b, ",\"response\":{\"status_code\":%d,", status_code);
    put_id(&b, "request_id", "req_", "req", job_id, custom_id);
    job_jbuf_put_lit(&b, ",\"body\":{\"error\":{\"message\":");
    job_jbuf_put_cstr(&b, message ? message : "");
    job_jbuf_put_lit(&b, status_code >= 400 && status_code < 500
                             ? ",\"type\":\"invalid_request_error\",\"param\":"
                             : ",\"type\":\"server_error\",\"param\":");
    job_jbuf_put_cstr(&b, param);
    job_jbuf_put_lit(&b, ",\"code\":");
    job_jbuf_put_cstr(&b, code);
    job_jbuf_put_lit(&b, "}}},\"error\":null}");
    return job_jbuf_take(&b);
}

char *job_record_parse_error(int64_t job_id, const struct job_error *e)
{
    return job_record_invalid(job_id, e->custom_id[0] ? e->custom_id : NULL, 400,
                              job_err_code_str(e->code), e->message, e->field[0] ? e->field : NULL);
}

char *job_record_error(int64_t job_id, const char *custom_id, const char *code, const char *message)
{
    struct job_jbuf b = {0};
    job_jbuf_put_lit(&b, "{");
    put_id(&b, "id", "batch_req_", "batch_req", job_id, custom_id);
    job_jbuf_put_lit(&b, ",\"custom_id\":");
    job_jbuf_put_cstr(&b, custom_id);
    job_jbuf_put_lit(&b, ",\"response\":null,\"error\":{\"code\":");
    job_jbuf_put_cstr(&b, code);
    job_jbuf_put_lit(&b, ",\"message\":");
    job_jbuf_put_cstr(&b, message);
    job_jbuf_put_lit(&b, "}}");
    return job_jbuf_take(&b);
}
