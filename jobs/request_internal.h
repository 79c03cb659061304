/* Private parts of request parsing shared by jobs/request.c (entry points, canonical form),
 * jobs/request_scan.c (pass 1: the strict scan) and jobs/request_fields.c and
 * jobs/request_params.c (pass 2: the field walk over the cJSON tree). */
#ifndef JOBS_REQUEST_INTERNAL_H
#define JOBS_REQUEST_INTERNAL_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "jobs/request.h"

#define JOB_PATH_CAP 160 /* bytes for a field path; longer paths are cut (only messages use them)  \
                          */

#define JOB_SCAN_MAX_DEPTH  64 /* deepest nesting of objects and arrays accepted */
#define JOB_SCAN_MAX_NUMBER 63 /* longest number token (cJSON reads at most 63 characters) */

/* One open container. */
struct job_scan_frame {
    int is_array;    /* 1 for [...], 0 for {...} */
    const char *key; /* object: raw text of the current member's key (no quotes), or NULL */
    size_t key_len;  /* bytes in key */
    size_t index;    /* array: index of the current element */
};

/* The state of one pass-1 scan (~2.5 KB: callers put it on the heap). */
struct job_scan {
    const unsigned char *base; /* first byte of the line (offsets are reported from here) */
    const unsigned char *p;    /* read position */
    const unsigned char *end;  /* one past the last byte */
    int depth;                 /* open containers; st[1..depth] describe them */
    struct job_scan_frame st[JOB_SCAN_MAX_DEPTH + 1]; /* st[0] unused */
    struct job_error *e;                              /* where problems are reported */
    const char *seed_raw[2]; /* raw number text of top-level "seed" / "body"."seed" */
    size_t seed_len[2];      /* their lengths */
    const char *id_raw;      /* text between the quotes of the first top-level "custom_id"
                                string (escapes undone by the caller), or NULL */
    size_t id_len;           /* its length */
};

/* State of one parse. */
struct job_parse_ctx {
    struct job_error *e;          /* error out */
    const struct job_defaults *d; /* job defaults */
    const struct job_scan *s;     /* for the raw seed text */
    int batch;                    /* 1 for the OpenAI Batch shape (parameters under body) */
    const char *pfx;              /* "body." or "" */
};

/* Record an error (field may be NULL); returns 0 so callers can `return job_request_fail(...)`. */
int job_request_fail(struct job_error *e, enum job_err_code code, const char *field,
                     const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Format a field path into out[JOB_PATH_CAP], cutting it if too long. */
void job_request_pathf(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- pass 1 (jobs/request_scan.c) ---- */

/* Skip JSON whitespace at s->p. */
void job_scan_ws(struct job_scan *s);

/* Scan one JSON value at s->p (after whitespace); 1 on success with s->p past it, 0 with the
 * error in s->e. */
int job_scan_value(struct job_scan *s);

/* Complain about the byte at s->p, which cannot start or continue what is expected; returns 0. */
int job_scan_unexpected(struct job_scan *s, const char *expected);

/* ---- pass 2 (jobs/request_params.c; the field walk is in jobs/request_fields.c) ---- */

/* Short text for a JSON value in messages: "\"hot\"", "3.5", "true", "an array". */
void job_request_describe(const cJSON *v, char *out, size_t cap);

/* Type error: "<path> must be <what>, got <value>"; returns 0. */
int job_request_fail_type(struct job_parse_ctx *c, const char *path, const char *what,
                          const cJSON *v);

/* Find member `name` of obj (case-sensitive). Sets *out to it or NULL; fails on a duplicate.
 * prefix is the object's path prefix ("", "body.", "body.messages[0].") for messages. */
int job_request_get(struct job_parse_ctx *c, const cJSON *obj, const char *prefix, const char *name,
                    const cJSON **out);

/* Like job_request_get, but a JSON null counts as absent. */
int job_request_get_opt(struct job_parse_ctx *c, const cJSON *obj, const char *prefix,
                        const char *name, const cJSON **out);

/* Sampling parameters, max_tokens, stop and model from obj (top level or body) into r. */
int job_request_read_params(struct job_parse_ctx *c, const cJSON *obj, struct job_request *r);

/* Every member of obj (whose fields' paths begin with prefix: "" or "body.") is named in extra
 * (NULL-terminated: the object's other fields, e.g. "messages") or, when params is set, a
 * request parameter quern knows (OpenAI's or its own); an unknown one (a typo such as
 * "max_token", which would otherwise change the output silently) fails with
 * JOB_ERR_UNKNOWN_FIELD, OpenAI's that quern cannot honour with JOB_ERR_UNSUPPORTED. */
int job_request_check_fields(struct job_parse_ctx *c, const cJSON *obj, const char *prefix,
                             const char *const *extra, int params);

/* Every member of a nested object (a message, a content part, response_format...: paths begin
 * with prefix) is named in known (NULL-terminated), or in unhonoured with a null value (OpenAI's
 * fields quern cannot honour: a value is JOB_ERR_UNSUPPORTED); anything else fails with
 * JOB_ERR_UNKNOWN_FIELD (a key quern ignored would change the output silently). */
int job_request_known_fields(struct job_parse_ctx *c, const cJSON *obj, const char *prefix,
                             const char *const *known, const char *const *unhonoured);

/* Pass 2's field walk: shape detection and every field of a parsed root into r; 1 on success,
 * 0 with the error in c->e (jobs/request_fields.c). */
int job_request_read(struct job_parse_ctx *c, const cJSON *root, struct job_request *r);

#endif
