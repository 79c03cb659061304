/* The terminal helper (runner/term.h): one live line drawn with a carriage return and either
 * "clear to end of line" (ESC [ K) or, on a dumb terminal, spaces over what was there. */
#include "runner/term.h"

#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "common/log.h"

static struct runner_term *g_live; /* the terminal whose line log messages clear, or NULL */

static void before_log(void)
{
    if (g_live)
        runner_term_clear(g_live);
}

void runner_term_init(struct runner_term *t, FILE *f)
{
    memset(t, 0, sizeof(*t));
    t->f = f;
    t->tty = isatty(fileno(f));
    const char *term = getenv("TERM"), *nc = getenv("NO_COLOR");
    t->ansi = t->tty && term && *term && strcmp(term, "dumb") != 0;
    t->color = t->ansi && !(nc && *nc);
    if (t->tty) {
        g_live = t;
        log_set_before_write(before_log);
    }
}

void runner_term_close(struct runner_term *t)
{
    if (g_live == t) {
        g_live = NULL;
        log_set_before_write(NULL);
    }
}

int runner_term_width(const struct runner_term *t)
{
    int w = 0;
    struct winsize ws;
    if (t->tty && ioctl(fileno(t->f), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
        w = ws.ws_col;
    const char *c = getenv("COLUMNS");
    if (!w && c)
        w = atoi(c);
    if (w <= 0)
        w = 80;
    return w < 20 ? 20 : w;
}

size_t runner_term_visible(const char *line)
{
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)line; *p; p++) {
        if (*p == 0x1b) { /* ESC [ parameters final-byte */
            if (p[1] == '[') {
                p += 2;
                while (*p && !(*p >= 0x40 && *p <= 0x7e))
                    p++;
                if (!*p)
                    break;
            }
            continue;
        }
        if ((*p & 0xc0) != 0x80)
            n++;
    }
    return n;
}

/* Spaces over the rest of the old line (dumb terminals) or ESC [ K. */
static void erase_rest(struct runner_term *t, size_t drawn)
{
    if (t->ansi) {
        fputs("\033[K", t->f);
        return;
    }
    for (size_t i = drawn; i < t->shown_len; i++)
        fputc(' ', t->f);
}

void runner_term_redraw(struct runner_term *t, const char *line)
{
    if (!t->tty)
        return;
    size_t n = runner_term_visible(line);
    fputc('\r', t->f);
    fputs(line, t->f);
    erase_rest(t, n);
    fflush(t->f);
    t->shown = 1;
    t->shown_len = n;
}

void runner_term_clear(struct runner_term *t)
{
    if (!t->tty || !t->shown)
        return;
    fputc('\r', t->f);
    erase_rest(t, 0);
    fputc('\r', t->f);
    fflush(t->f);
    t->shown = 0;
    t->shown_len = 0;
}

void runner_term_finish(struct runner_term *t, const char *line)
{
    if (t->tty) {
        runner_term_redraw(t, line);
        fputc('\n', t->f);
        t->shown = 0;
        t->shown_len = 0;
    } else {
        fprintf(t->f, "%s\n", line);
    }
    fflush(t->f);
}

void runner_term_bar(char *buf, size_t cap, double frac, int width, int color)
{
    if (!cap)
        return;
    if (width < 3)
        width = 3;
    if (frac < 0 || frac != frac)
        frac = 0;
    if (frac > 1)
        frac = 1;
    int inner = width - 2, fill = (int)(frac * inner + 1e-9);
    size_t k = 0;
#define PUT(ch)                                                                                    \
    do {                                                                                           \
        if (k + 1 < cap)                                                                           \
            buf[k++] = (ch);                                                                       \
    } while (0)
#define PUTS(s)                                                                                    \
    do {                                                                                           \
        for (const char *q_ = (s); *q_; q_++)                                                      \
            PUT(*q_);                                                                              \
    } while (0)
    PUT('[');
    if (color && fill)
        PUTS(RUNNER_TERM_GREEN);
    for (int i = 0; i < fill; i++)
        PUT('#');
    if (color && fill)
        PUTS(RUNNER_TERM_RESET);
    for (int i = fill; i < inner; i++)
        PUT('-');
    PUT(']');
#undef PUTS
#undef PUT
    buf[k] = 0;
}
