/* stderr logger with a process-wide level (set once at start-up by the CLI). */
#include "common/log.h"

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
    if (!s)
        return;
    if (!strcmp(s, "debug"))
        log_level = LOG_LEVEL_DEBUG;
    else if (!strcmp(s, "warn"))
        log_level = LOG_LEVEL_WARN;
    else if (!strcmp(s, "error"))
        log_level = LOG_LEVEL_ERROR;
}

void log_set_level(enum log_level lvl) { log_level = (int)lvl; }

void log_set_before_write(void (*fn)(void)) { log_before_write = fn; }

enum log_level log_get_level(void)
{
    if (log_level < 0)
        log_init_level();
    return (enum log_level)log_level;
}

void log_write(enum log_level lvl, const char *file, int line, const char *fmt, ...)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    if ((int)lvl > (int)log_get_level())
        return;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (log_before_write)
        log_before_write();
    if (lvl == LOG_LEVEL_DEBUG)
        fprintf(stderr, "quern %s %s:%d: %s\n", names[lvl], file, line, buf);
    else
        fprintf(stderr, "quern %s: %s\n", names[lvl], buf);
}
