/* Status codes and caller-owned error details shared by every module.
 * Fallible functions return enum status and, on failure, describe the problem in a
 * struct err_detail that the caller owns (never a global). */
#ifndef COMMON_ERR_H
#define COMMON_ERR_H

#include <stddef.h>

enum status {
    ST_OK = 0,
    ST_ERR_IO,          /* open/read/write/mmap failed */
    ST_ERR_NOMEM,       /* allocation failed */
    ST_ERR_FORMAT,      /* malformed, truncated or hostile input */
    ST_ERR_UNSUPPORTED, /* well-formed but not supported (type, architecture, template) */
    ST_ERR_INVALID_ARG, /* bad argument from a user (flag value, request field) */
    ST_ERR_RANGE,       /* value out of range (context too long, id out of vocab) */
    ST_ERR_NOT_FOUND,   /* a required key, tensor or item is missing */
    ST_ERR_INTERNAL,    /* a library we call failed in an unexpected way */
    ST_ERR_EXISTS,      /* a unique thing already exists (duplicate custom_id, job name) */
    ST_ERR_BUSY,        /* a shared resource stayed locked past its timeout; retry later */
    ST_ERR_CONFLICT,    /* lost a race: the item/shard is no longer ours (lease re-claimed) */
    ST_ERR_CAPACITY,    /* fits the model, not what this process was given (--kv-mem) */
};

struct err_detail {
    enum status status; /* last status recorded here */
    char msg[512];      /* human-readable description, NUL-terminated */
};

/* Name of a status ("ST_ERR_FORMAT" -> "format error"); never NULL. */
const char *status_str(enum status st);

/* Record st and a printf-style message in e (e may be NULL); returns st so callers can
 * write `return err_set(e, ST_ERR_FORMAT, "...")`. */
enum status err_set(struct err_detail *e, enum status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefix the message already in e with more context ("loading x: <old msg>"). */
void err_prefix(struct err_detail *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
