/* Status names and the err_detail helpers. */
#include "common/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *status_str(enum status st)
{
    switch (st) {
    case ST_OK: return "ok";
    case ST_ERR_IO: return "I/O error";
    case ST_ERR_NOMEM: return "out of memory";
    case ST_ERR_FORMAT: return "format error";
    case ST_ERR_UNSUPPORTED: return "unsupported";
    case ST_ERR_INVALID_ARG: return "invalid argument";
    case ST_ERR_RANGE: return "out of range";
    case ST_ERR_NOT_FOUND: return "not found";
    case ST_ERR_INTERNAL: return "internal error";
    case ST_ERR_EXISTS: return "already exists";
    case ST_ERR_BUSY: return "busy";
    case ST_ERR_CONFLICT: return "conflict";
    case ST_ERR_CAPACITY:
        return "over capacity";
    }
    return "unknown status";
}

enum status err_set(struct err_detail *e, enum status st, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        e->status = st;
        vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
        va_end(ap);
    }
    return st;
}

void err_prefix(struct err_detail *e, const char *fmt, ...)
{
    if (!e)
        return;
    char head[256];
    char old[sizeof(e->msg)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof(head), fmt, ap);
    va_end(ap);
    memcpy(old, e->msg, sizeof(old));
    size_t h = strlen(head), o = strnlen(old, sizeof(old) - 1), cap = sizeof(e->msg) - 1;
    if (h > cap - 2)
        h = cap - 2;
    if (o > cap - 2 - h)
        o = cap - 2 - h;
    memcpy(e->msg, head, h);
    memcpy(e->msg + h, ": ", 2);
    memcpy(e->msg + h + 2, old, o);
    e->msg[h + 2 + o] = 0;
}
