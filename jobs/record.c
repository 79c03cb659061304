/* OpenAI Batch output lines (see jobs/record.h) and their deterministic ids. */
#include "jobs/record.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/utf8.h"
#include "engine/tokenizer.h"
#include "jobs/json.h"

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
static void put_id(struct job_json *b, const char *key, const char *prefix, const char *tag,
                   int64_t job_id, const char *custom_id)
{
    char hex[33];
    job_record_hash_hex(tag, job_id, custom_id, hex);
    job_json_put_fmt(b, "\"%s\":\"%s%s\"", key, prefix, hex);
}

/* ---- Records ----------------------------------------------------------------------------- */

/* A log-probability as OpenAI writes it: -9999.0 stands for anything below (and -inf). */
static void put_lp(struct job_json *b, float lp)
{
    if (!(lp >= -9999.0f))
        job_json_put_lit(b, "-9999.0");
    else
        job_json_put_float(b, lp);
}

/* Token id's bytes (control tokens as their text) into *buf, growing it; returns the count. */
static size_t piece(const struct engine_tok *tok, int32_t id, char **buf, size_t *cap)
{
    size_t n = engine_tok_piece(tok, id, 1, *buf, *cap);
    if (n > *cap) {
        char *nb = realloc(*buf, n);
        if (!nb)
            return 0; /* the record is then written with an empty token string */
        *buf = nb;
        *cap = n;
        n = engine_tok_piece(tok, id, 1, *buf, *cap);
    }
    return n;
}

/* "token":S,"logprob":F,"bytes":[...] of one chat logprobs entry. */
static void put_chat_token(struct job_json *b, const char *p, size_t n, float lp)
{
    job_json_put_lit(b, "\"token\":");
    job_json_put_str(b, p, n);
    job_json_put_lit(b, ",\"logprob\":");
    put_lp(b, lp);
    job_json_put_lit(b, ",\"bytes\":[");
    for (size_t i = 0; i < n; i++)
        job_json_put_fmt(b, i ? ",%u" : "%u", (unsigned)(unsigned char)p[i]);
    job_json_put_lit(b, "]");
}

static void put_chat_logprobs(struct job_json *b, const struct job_choice *c,
                              const struct engine_tok *tok, char **buf, size_t *cap)
{
    job_json_put_lit(b, "{\"content\":[");
    for (int32_t t = 0; t < c->completion_tokens; t++) {
        job_json_put_lit(b, t ? ",{" : "{");
        size_t n = piece(tok, c->tokens[t], buf, cap);
        put_chat_token(b, *buf, n, c->logprobs[t]);
        job_json_put_lit(b, ",\"top_logprobs\":[");
        for (int k = 0; k < c->top_logprobs; k++) {
            size_t i = (size_t)t * (size_t)c->top_logprobs + (size_t)k;
            job_json_put_lit(b, k ? ",{" : "{");
            n = piece(tok, c->top_ids[i], buf, cap);
            put_chat_token(b, *buf, n, c->top_lps[i]);
            job_json_put_lit(b, "}");
        }
        job_json_put_lit(b, "]}");
    }
    job_json_put_lit(b, "],\"refusal\":null}");
}

/* A completions logprobs token: its text, or when its bytes are not whole UTF-8 characters
 * (a byte-level token cut inside one) "bytes:\\xNN..." as OpenAI writes them: replaced by
 * U+FFFD, such tokens would all be the same key of top_logprobs, and JSON readers keep one. */
static void put_completion_token(struct job_json *b, const char *p, size_t n)
{
    size_t i = 0, k;
    while (i < n && (k = utf8_decode((const unsigned char *)p + i, n - i, NULL, NULL)))
        i += k;
    if (i == n) {
        job_json_put_str(b, p, n);
        return;
    }
    static const char hex[] = "0123456789abcdef";
    char *t = malloc(6 + 4 * n);
    if (!t) {
        b->failed = 1; /* the record is then reported as out of memory */
        return;
    }
    memcpy(t, "bytes:", 6);
    size_t m = 6;
    for (i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)p[i];
        t[m++] = '\\', t[m++] = 'x', t[m++] = hex[c >> 4], t[m++] = hex[c & 15];
    }
    job_json_put_str(b, t, m);
    free(t);
}

static void put_completion_logprobs(struct job_json *b, const struct job_choice *c,
                                    const struct engine_tok *tok, char **buf, size_t *cap)
{
    job_json_put_lit(b, "{\"tokens\":[");
    for (int32_t t = 0; t < c->completion_tokens; t++) {
        size_t n = piece(tok, c->tokens[t], buf, cap);
        if (t)
            job_json_put_lit(b, ",");
        put_completion_token(b, *buf, n);
    }
    job_json_put_lit(b, "],\"token_logprobs\":[");
    for (int32_t t = 0; t < c->completion_tokens; t++) {
        if (t)
            job_json_put_lit(b, ",");
        put_lp(b, c->logprobs[t]);
    }
    job_json_put_lit(b, "],\"top_logprobs\":[");
    for (int32_t t = 0; t < c->completion_tokens; t++) {
        job_json_put_lit(b, t ? ",{" : "{");
        int chosen_listed = 0;
        for (int k = 0; k < c->top_logprobs; k++) {
            size_t i = (size_t)t * (size_t)c->top_logprobs + (size_t)k;
            size_t n = piece(tok, c->top_ids[i], buf, cap);
            job_json_put_lit(b, k ? "," : "");
            put_completion_token(b, *buf, n);
            job_json_put_lit(b, ":");
            put_lp(b, c->top_lps[i]);
            chosen_listed |= c->top_ids[i] == c->tokens[t];
        }
        if (!chosen_listed) {
            size_t n = piece(tok, c->tokens[t], buf, cap);
            job_json_put_lit(b, c->top_logprobs ? "," : "");
            put_completion_token(b, *buf, n);
            job_json_put_lit(b, ":");
            put_lp(b, c->logprobs[t]);
        }
        job_json_put_lit(b, "}");
    }
    job_json_put_lit(b, "],\"text_offset\":[");
    long long off = 0;
    for (int32_t t = 0; t < c->completion_tokens; t++) {
        size_t n = piece(tok, c->tokens[t], buf, cap);
        job_json_put_fmt(b, t ? ",%lld" : "%lld", off);
        for (size_t i = 0; i < n; i++)
            off += ((unsigned char)(*buf)[i] & 0xC0) != 0x80;
    }
    job_json_put_lit(b, "]}");
}

char *job_record_success(const struct job_result *r)
{
    struct job_json b = {0};
    int chat = r->kind == JOB_KIND_CHAT;
    char *buf = NULL;
    size_t cap = 0;

    job_json_put_lit(&b, "{");
    put_id(&b, "id", "batch_req_", "batch_req", r->job_id, r->custom_id);
    job_json_put_lit(&b, ",\"custom_id\":");
    job_json_put_cstr(&b, r->custom_id);
    job_json_put_lit(&b, ",\"response\":{\"status_code\":200,");
    put_id(&b, "request_id", "req_", "req", r->job_id, r->custom_id);
    job_json_put_lit(&b, ",\"body\":{");
    put_id(&b, "id", chat ? "chatcmpl-" : "cmpl-", "cmpl", r->job_id, r->custom_id);
    job_json_put_lit(&b,
                     chat ? ",\"object\":\"chat.completion\"" : ",\"object\":\"text_completion\"");
    job_json_put_fmt(&b, ",\"created\":%lld,\"model\":", (long long)r->created);
    job_json_put_cstr(&b, r->model ? r->model : "");
    job_json_put_lit(&b, ",\"choices\":[");
    long long completion = 0;
    for (size_t i = 0; i < r->n_choices; i++) {
        const struct job_choice *c = &r->choices[i];
        completion += c->completion_tokens;
        if (chat) {
            job_json_put_fmt(&b, "%s{\"index\":%zu,\"message\":{\"role\":\"assistant\","
                                 "\"content\":", i ? "," : "", i);
            job_json_put_str(&b, c->text, c->text_len);
            job_json_put_lit(&b, ",\"refusal\":null},\"logprobs\":");
        } else {
            job_json_put_lit(&b, i ? ",{\"text\":" : "{\"text\":");
            job_json_put_str(&b, c->text, c->text_len);
            job_json_put_fmt(&b, ",\"index\":%zu,\"logprobs\":", i);
        }
        if (!c->logprobs || !r->tok)
            job_json_put_lit(&b, "null");
        else if (chat)
            put_chat_logprobs(&b, c, r->tok, &buf, &cap);
        else
            put_completion_logprobs(&b, c, r->tok, &buf, &cap);
        job_json_put_lit(&b, ",\"finish_reason\":");
        job_json_put_cstr(&b, c->finish_reason);
        job_json_put_lit(&b, "}");
    }
    free(buf);
    job_json_put_fmt(&b,
                     "],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%lld,"
                     "\"total_tokens\":%lld,",
                     (int)r->prompt_tokens, completion, (long long)r->prompt_tokens + completion);
    job_json_put_fmt(&b, "\"prompt_tokens_details\":{\"cached_tokens\":%d},",
                     (int)r->cached_tokens);
    job_json_put_lit(&b, "\"completion_tokens_details\":{\"reasoning_tokens\":0}},"
                         "\"system_fingerprint\":");
    job_json_put_cstr(&b, r->fingerprint);
    job_json_put_lit(&b, "}},\"error\":null}");
    return job_json_take(&b);
}

/* job_record_invalid with the record's ids made from idkey (custom_id unless it is NULL). */
static char *invalid_keyed(int64_t job_id, const char *custom_id, const char *idkey,
                           int status_code, const char *code, const char *message,
                           const char *param)
{
    struct job_json b = {0};
    job_json_put_lit(&b, "{");
    put_id(&b, "id", "batch_req_", "batch_req", job_id, idkey);
    job_json_put_lit(&b, ",\"custom_id\":");
    job_json_put_cstr(&b, custom_id);
    job_json_put_fmt(&b, ",\"response\":{\"status_code\":%d,", status_code);
    put_id(&b, "request_id", "req_", "req", job_id, idkey);
    job_json_put_lit(&b, ",\"body\":{\"error\":{\"message\":");
    job_json_put_cstr(&b, message ? message : "");
    job_json_put_lit(&b, status_code >= 400 && status_code < 500
                             ? ",\"type\":\"invalid_request_error\",\"param\":"
                             : ",\"type\":\"server_error\",\"param\":");
    job_json_put_cstr(&b, param);
    job_json_put_lit(&b, ",\"code\":");
    job_json_put_cstr(&b, code);
    job_json_put_lit(&b, "}}},\"error\":null}");
    return job_json_take(&b);
}

char *job_record_rejected(int64_t job_id, int64_t item_id, const char *custom_id,
                          const char *source, int64_t line_no, const char *code,
                          const char *message, const char *param)
{
    char key[1100], msg[1024];
    /* a line without its own custom_id gets null, and ids made from its item and where it was
     * (a leading control byte, so that only a custom_id of that very form could share them) */
    snprintf(key, sizeof(key), "\001%lld:%s:%lld", (long long)item_id, source ? source : "?",
             (long long)line_no);
    snprintf(msg, sizeof(msg), "%s:%lld: %s", source ? source : "?", (long long)line_no,
             message ? message : "rejected at submit");
    return invalid_keyed(job_id, custom_id, custom_id ? custom_id : key, 400,
                         code ? code : "invalid_request", msg, param);
}

char *job_record_invalid(int64_t job_id, const char *custom_id, int status_code, const char *code,
                         const char *message, const char *param)
{
    return invalid_keyed(job_id, custom_id, custom_id, status_code, code, message, param);
}

char *job_record_parse_error(int64_t job_id, const struct job_error *e)
{
    return job_record_invalid(job_id, e->custom_id[0] ? e->custom_id : NULL, 400,
                              job_err_code_str(e->code), e->message, e->field[0] ? e->field : NULL);
}

char *job_record_error(int64_t job_id, const char *custom_id, const char *code, const char *message)
{
    struct job_json b = {0};
    job_json_put_lit(&b, "{");
    put_id(&b, "id", "batch_req_", "batch_req", job_id, custom_id);
    job_json_put_lit(&b, ",\"custom_id\":");
    job_json_put_cstr(&b, custom_id);
    job_json_put_lit(&b, ",\"response\":null,\"error\":{\"code\":");
    job_json_put_cstr(&b, code);
    job_json_put_lit(&b, ",\"message\":");
    job_json_put_cstr(&b, message);
    job_json_put_lit(&b, "}}");
    return job_json_take(&b);
}
