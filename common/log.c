/* stderr logger with a process-wide level (set once at start-up by the CLI). */
#include "common/log.h"

#include "common/utf8.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int log_level = -1;              /* -1: not yet read from QUERN_LOG */
static void (*log_before_write)(void); /* see log_set_before_write */

static void log_init_level(void)
{
    const char *s = getenv("QUERN_LOG");
    log_level = LOG_LEVEL_INFO;
    if (!s || !*s)
        return;
    if (!strcmp(s, "debug"))
        log_level = LOG_LEVEL_DEBUG;
    else if (!strcmp(s, "warn"))
        log_level = LOG_LEVEL_WARN;
    else if (!strcmp(s, "error"))
        log_level = LOG_LEVEL_ERROR;
    else if (strcmp(s, "info")) {
        char shown[64];
        fprintf(stderr, "quern warn: QUERN_LOG=%s is none of debug, info, warn, error: info\n",
                log_printable(s, shown, sizeof(shown)));
    }
}

void log_set_level(enum log_level lvl) { log_level = (int)lvl; }

void log_set_before_write(void (*fn)(void)) { log_before_write = fn; }

enum log_level log_get_level(void)
{
    if (log_level < 0)
        log_init_level();
    return (enum log_level)log_level;
}

char *log_printable(const char *s, char *buf, size_t cap)
{
    size_t o = 0, left = strlen(s);
    for (const unsigned char *p = (const unsigned char *)s; *p && o + 7 < cap; p++, left--) {
        size_t n = *p >= 0x80 ? utf8_decode(p, left, NULL, NULL) : 1;
        if ((*p < 0x20 && *p != '\t') || *p == 0x7f || !n) /* (a byte of no character too) */
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", *p);
        else if (*p == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f)
            o += (size_t)snprintf(buf + o, cap - o, "\\u%04x", *++p), left--;
        else if (o + n + 1 < cap) {
            memcpy(buf + o, p, n);
            o += n;
            p += n - 1;
            left -= n - 1;
        } else
            break;
    }
    if (cap)
        buf[o < cap ? o : cap - 1] = 0;
    return buf;
}

void log_write(enum log_level lvl, const char *file, int line, const char *fmt, ...)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    if ((int)lvl > (int)log_get_level())
        return;
    char raw[1024], buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof(raw), fmt, ap);
    va_end(ap);
    log_printable(raw, buf, sizeof(buf));
    if (log_before_write)
        log_before_write();
    if (lvl == LOG_LEVEL_DEBUG)
        fprintf(stderr, "quern %s %s:%d: %s\n", names[lvl], file, line, buf);
    else
        fprintf(stderr, "quern %s: %s\n", names[lvl], buf);
}
