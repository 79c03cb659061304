/* OpenAI Batch output lines (see jobs/record.h) and their deterministic ids. */
#include "jobs/record.h"

#include <stdio.h>
#include <string.h>

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

char *job_record_success(const struct job_result *r)
{
    struct job_json b = {0};
    int chat = r->kind == JOB_KIND_CHAT;

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
    if (chat) {
        job_json_put_lit(&b, ",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\","
                             "\"content\":");
        job_json_put_str(&b, r->text, r->text_len);
        job_json_put_lit(&b, "},\"logprobs\":null,\"finish_reason\":");
    } else {
        job_json_put_lit(&b, ",\"choices\":[{\"text\":");
        job_json_put_str(&b, r->text, r->text_len);
        job_json_put_lit(&b, ",\"index\":0,\"logprobs\":null,\"finish_reason\":");
    }
    job_json_put_cstr(&b, r->finish_reason);
    job_json_put_fmt(&b,
                     "}],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,"
                     "\"total_tokens\":%lld}}},\"error\":null}",
                     (int)r->prompt_tokens, (int)r->completion_tokens,
                     (long long)r->prompt_tokens + (long long)r->completion_tokens);
    return job_json_take(&b);
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
    struct job_json b = {0};
    job_json_put_lit(&b, "{");
    put_id(&b, "id", "batch_req_", "batch_req", job_id, custom_id);
    job_json_put_lit(&b, ",\"custom_id\":");
    job_json_put_cstr(&b, custom_id);
    job_json_put_fmt(&b, ",\"response\":{\"status_code\":%d,", status_code);
    put_id(&b, "request_id", "req_", "req", job_id, custom_id);
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
