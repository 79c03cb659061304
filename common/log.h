/* Logging to stderr through LOG_* macros. Results never go to stderr; logs never to stdout. */
#ifndef COMMON_LOG_H
#define COMMON_LOG_H

#include <stddef.h>

enum log_level { LOG_LEVEL_ERROR = 0, LOG_LEVEL_WARN, LOG_LEVEL_INFO, LOG_LEVEL_DEBUG };

/* Messages above this level are dropped; default LOG_LEVEL_INFO, QUERN_LOG=debug|info|warn|error
 * in the environment overrides it at the first log call. */
void log_set_level(enum log_level lvl);
enum log_level log_get_level(void);
void log_write(enum log_level lvl, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* fn (or NULL) is called before each message is written: a live progress line on the terminal
 * clears itself there so that messages never land in the middle of it. */
void log_set_before_write(void (*fn)(void));

/* s made safe to print on a terminal, into buf (cap bytes, always terminated; returns buf):
 * control characters (C0 but tab, DEL, and C1 as UTF-8) become \xNN / \u00NN, so that text from
 * users' files (file names, ids, JSON keys, model paths) can neither move the cursor, set the
 * title or clipboard, nor forge a log line. Every LOG_* message goes through it. */
char *log_printable(const char *s, char *buf, size_t cap);

#define LOG_ERROR(...) log_write(LOG_LEVEL_ERROR, __FILE__, __LINE__, __VA_ARGS__)
#define LOG_WARN(...) log_write(LOG_LEVEL_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define LOG_INFO(...) log_write(LOG_LEVEL_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define LOG_DEBUG(...) log_write(LOG_LEVEL_DEBUG, __FILE__, __LINE__, __VA_ARGS__)

#endif
