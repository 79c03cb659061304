/* A small terminal helper for live displays (no curses): is the stream a terminal, how wide it
 * is, whether colour and escape sequences may be used (NO_COLOR, TERM=dumb), and one status line
 * redrawn in place that log messages step around and that ends as a clean line. */
#ifndef RUNNER_TERM_H
#define RUNNER_TERM_H

#include <stddef.h>
#include <stdio.h>

struct runner_term {
    FILE *f;          /* the stream drawn on (borrowed) */
    int tty;          /* f is a terminal: draw live, in place */
    int ansi;         /* escape sequences allowed (a terminal and TERM is set, not "dumb") */
    int color;        /* colours allowed (ansi, and NO_COLOR unset or empty) */
    int shown;        /* a live line is on the screen now */
    size_t shown_len; /* its visible width, for padding over it without escape sequences */
};

/* Look at f and the environment. A terminal's live line is cleared before every LOG_* message
 * (common/log.h) while t is alive: call runner_term_close before t goes away. */
void runner_term_init(struct runner_term *t, FILE *f);
/* Stop clearing for log messages; a live line still shown is left as it is. */
void runner_term_close(struct runner_term *t);

/* Columns of the terminal: TIOCGWINSZ, else $COLUMNS, else 80; at least 20. */
int runner_term_width(const struct runner_term *t);

/* Replace the live line with line (no newline; it should fit runner_term_width - 1 columns, and
 * may hold colour sequences only when t->color). Only for a terminal. */
void runner_term_redraw(struct runner_term *t, const char *line);
/* Remove the live line, leaving the cursor at the start of an empty line. */
void runner_term_clear(struct runner_term *t);
/* The last word: line replaces the live line (on a terminal) and ends with a newline. */
void runner_term_finish(struct runner_term *t, const char *line);

/* Columns line takes on the screen: bytes outside escape sequences, UTF-8 continuation bytes
 * not counted. */
size_t runner_term_visible(const char *line);

/* "[#####-----]" of width columns (brackets included, >= 3) filled to frac (0..1), the filled
 * part green when color. Into buf (always terminated). */
void runner_term_bar(char *buf, size_t cap, double frac, int width, int color);

#define RUNNER_TERM_GREEN "\033[32m"
#define RUNNER_TERM_RED   "\033[31m"
#define RUNNER_TERM_RESET "\033[0m"

#endif
