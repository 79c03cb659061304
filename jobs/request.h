/* Input requests: turns one JSONL input line into a validated generation request (chat or
 * completion, sampling parameters, stops) or a per-line error with a stable machine code,
 * and writes the canonical JSON form of a request that the queue stores.
 *
 * Accepted line shapes (one JSON object per line):
 *   OpenAI Batch  {"custom_id","method":"POST","url":"/v1/chat/completions"|"/v1/completions",
 *                 "body":{...}}; parameters live in body; custom_id is required.
 *   short chat    {"custom_id"?, "messages":[...], <parameters>}
 *   short prompt  {"custom_id"?, "prompt":"...", <parameters>}
 * Parameters: model (recorded, not used to pick a model), max_tokens or max_completion_tokens,
 * temperature, top_p, seed, stop (string or array of <= 4 strings), n (1..128 choices),
 * logprobs + top_logprobs, response_format ({"type": "text" | "json_object" | "json_schema",
 * "json_schema": {"name", "schema", "strict"}}), grammar (quern's GBNF-style text, see
 * job_gbnf_grammar; not with a JSON response_format), frequency_penalty, presence_penalty, and the extensions top_k
 * (-1 = off), min_p, repetition_penalty, repeat_last_n. A parameter given as null counts as
 * absent.
 * logprobs: true / false with top_logprobs 0..20 (chat's form; top_logprobs > 0 needs logprobs
 * true), or an integer k in 0..20 (completions' form: the chosen tokens' log-probabilities and
 * k alternatives; a top_logprobs given too must equal k). Either form on either endpoint; the
 * output shape follows the endpoint.
 *
 * Decisions (also in the error messages):
 *   - Unknown fields are ignored (user, metadata, stream_options, ...). Fields that would
 *     change what must be produced and that quern cannot honour fail with "unsupported":
 *     best_of > 1, stream true, echo true, suffix, non-empty tools/functions/logit_bias, a
 *     response_format json_schema whose schema uses what jobs/schema.h cannot guarantee (the
 *     message names the keyword and its place in the schema), image/audio/file content parts, roles tool/function, prompt arrays of
 *     several prompts or of token ids, URLs other than the two above.
 *   - Role "developer" is accepted as "system". Text content parts are concatenated with no
 *     separator. A message's content may be "" but a completion prompt may not.
 *   - "\u0000" anywhere in the line is rejected (invalid_value): engine strings are
 *     NUL-terminated. Raw control characters inside strings, lone surrogate escapes, leading
 *     zeros and other non-RFC 8259 syntax are rejected too (cJSON alone would accept them).
 *   - Duplicate keys are rejected (invalid_json) when the key is one quern reads, in any
 *     object quern reads; duplicates among ignored fields are ignored.
 *   - A leading UTF-8 byte order mark is skipped; trailing JSON whitespace (\r too) is fine.
 *     A blank line is an invalid_json error: callers skip blank lines themselves.
 *   - Integers may be written 5 or 5.0; seed takes any integer in [-2^63, 2^64) exactly
 *     (negative seeds wrap to uint64).
 *   - The line length is not limited here: the input reader's max_line is the cap.
 */
#ifndef JOBS_REQUEST_H
#define JOBS_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "engine/chat.h"
#include "engine/sampler.h"
#include "jobs/schema.h"

#define JOB_CUSTOM_ID_MAX 512 /* longest custom_id, in bytes */
#define JOB_MODEL_MAX     256 /* longest model name, in bytes */
#define JOB_STOP_MAX      4   /* most stop strings per request (OpenAI's limit) */
#define JOB_N_MAX         128 /* most choices per request (OpenAI's limit) */
#define JOB_TOP_LOGPROBS_MAX 20 /* most alternatives per token (OpenAI's chat limit) */

enum job_kind {
    JOB_KIND_CHAT = 0,   /* messages through the chat template (/v1/chat/completions) */
    JOB_KIND_COMPLETION, /* raw prompt text (/v1/completions) */
};

/* Stable machine codes of per-line errors (job_err_code_str gives the text stored in the
 * queue and written to error records). */
enum job_err_code {
    JOB_ERR_NONE = 0,      /* "" */
    JOB_ERR_INVALID_JSON,  /* "invalid_json": syntax, trailing data, duplicate key, nesting */
    JOB_ERR_INVALID_UTF8,  /* "invalid_utf8": bad bytes or an unpaired surrogate escape */
    JOB_ERR_MISSING_FIELD, /* "missing_field": a required field is absent */
    JOB_ERR_INVALID_TYPE,  /* "invalid_type": a field has the wrong JSON type */
    JOB_ERR_INVALID_VALUE, /* "invalid_value": right type, value out of range or not allowed */
    JOB_ERR_UNSUPPORTED,   /* "unsupported": valid OpenAI input quern cannot honour */
    JOB_ERR_UNKNOWN_FIELD, /* "unknown_field": a field neither OpenAI's nor quern's (a typo) */
    JOB_ERR_INTERNAL,      /* "internal_error": out of memory; not the line's fault */
};

/* Machine code text for c ("invalid_value"); never NULL. */
const char *job_err_code_str(enum job_err_code c);

/* A per-line error, owned by the caller (no heap memory inside). */
struct job_error {
    enum job_err_code code; /* what kind of problem */
    char field[128];        /* offending field path ("body.messages[0].role"), "" when none */
    char message[512];      /* human message naming the field, NUL-terminated */
    char custom_id[JOB_CUSTOM_ID_MAX + 1]; /* the line's own custom_id when one could be
                                              read (even from a line that is not valid JSON
                                              further on), else "": never the default id, which
                                              a bad line must not take from another line */
    int is_object; /* 1 when the line is a JSON object whose fault, if any, is in what
                      it holds (a bad request, not a line of another format) */
};

/* Job-level settings a line is parsed against. Pointers are caller-owned, only read. */
struct job_defaults {
    struct engine_sampling sampling; /* values for parameters a request leaves out */
    int32_t max_tokens;              /* max_tokens when the request gives none (>= 1) */
    int32_t max_tokens_cap;          /* larger request max_tokens are invalid; 0 = no cap */
    const char *default_id;          /* custom_id for a line without one ("line-17");
                                        NULL makes custom_id required */
};

/* A validated request. Everything is owned by the request and freed by job_request_free. */
struct job_request {
    char *custom_id;                  /* non-empty, <= JOB_CUSTOM_ID_MAX bytes, valid UTF-8 */
    enum job_kind kind;               /* chat or completion */
    struct engine_chat_msg *messages; /* chat: n_messages >= 1; role points to a static string
                                         ("system", "user" or "assistant"), content is owned;
                                         NULL for completions */
    size_t n_messages;                /* entries in messages */
    char *prompt;                     /* completion: non-empty prompt text; NULL for chat */
    struct engine_sampling sampling;  /* defaults overridden by the line; validated */
    int32_t max_tokens;               /* >= 1 and <= the cap */
    int max_tokens_default;           /* 1: the line gave none, max_tokens is the job's default,
                                         which a run lowers to what the context leaves (the
                                         line's JSON then has no max_tokens) */
    char **stop;                      /* n_stop owned non-empty strings (<= ENGINE_STOP_MAX_LEN
                                         bytes); NULL when n_stop is 0 */
    size_t n_stop;                    /* 0..JOB_STOP_MAX */
    char *model;                      /* the line's model field, or NULL */
    int32_t n;                        /* choices (OpenAI n), 1..JOB_N_MAX */
    int logprobs;                     /* 1 = log-probabilities of the output tokens */
    int32_t top_logprobs;             /* with logprobs: alternatives per token, 0..20 */
    enum job_format format;           /* response_format: text, json_object or json_schema */
    char *schema;                     /* json_schema: the schema's compact JSON; grammar: the
                                         grammar's text (owned; it compiled, jobs/schema.h,
                                         when the line was parsed); else NULL */
    int no_thinking;                  /* chat: chat_template_kwargs.enable_thinking was false
                                         (ENGINE_CHAT_NO_THINKING) */
};

/* 1 when a line is empty or only ASCII white space, after a UTF-8 byte order mark (a BOM alone on
 * a line: an editor's empty file, a BOM before a blank first line): a line the job's readers
 * skip (submit counts it blank; bench --input passes over it). */
int job_line_blank(const char *line, size_t len);

/* Parse and validate line[0..len) (not NUL-terminated; any bytes). On ST_OK *out is a new
 * request the caller frees with job_request_free. On a bad line *out is NULL, the return is
 * ST_ERR_FORMAT (invalid_json, invalid_utf8), ST_ERR_UNSUPPORTED (unsupported) or
 * ST_ERR_INVALID_ARG (the rest), and jerr says what and where; ST_ERR_NOMEM means out of
 * memory (code internal_error), which is not the line's fault. jerr may be NULL. */
enum status job_request_parse(const char *line, size_t len, const struct job_defaults *defaults,
                              struct job_request **out, struct job_error *jerr);

/* Free a request; NULL is a no-op. */
void job_request_free(struct job_request *r);

struct engine_chat;
/* r's prompt as token ids (*ids malloc'd, *n of them): a chat request's messages through chat
 * (NULL: the model has none, ST_ERR_UNSUPPORTED), a completion's text with the model's BOS.
 * With n_ctx > 0, a prompt longer than a context of n_ctx tokens could hold even at the longest
 * token text is refused untokenized (ST_ERR_RANGE; a 16 MiB line took seconds and ~0.5 GB to
 * find too long). The engine checks the tokens' count against the context itself. */
enum status job_request_tokens(const struct job_request *r, const struct engine_tok *tok,
                               const struct engine_chat *chat, int32_t n_ctx, int32_t **ids,
                               size_t *n, struct err_detail *err);

/* Canonical compact JSON of r (short form, every parameter written out, keys in a fixed
 * order), such that job_request_parse gives back an equal request whatever the defaults
 * (as long as max_tokens is within their cap). Returns a malloc'd string the caller frees, or
 * NULL when out of memory. */
char *job_request_to_json(const struct job_request *r);

/* 1 when a and b describe the same request (every field, floats compared exactly). */
int job_request_equal(const struct job_request *a, const struct job_request *b);

#endif
