/* `quern report`: one self-contained HTML file about a job (all parts, all runs): what it
 * gathers from the queue (counts, runs, time series, per-item usage and latencies, errors)
 * and how it draws it (inline SVG and CSS; no script, no network). See batch/batch.h. */
#include "batch/batch.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/utf8.h"
#include "io/shard.h"

/* ---- a growing text buffer ---- */

struct sbuf {
    char *p;    /* text, NUL-terminated */
    size_t len; /* bytes used */
    size_t cap; /* bytes allocated */
    int oom;    /* an allocation failed: the text is incomplete */
};

static void sb_printf(struct sbuf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = (b->cap + (size_t)n + 1) * 2;
        char *t = realloc(b->p, cap);
        if (!t) {
            b->oom = 1;
            return;
        }
        b->p = t;
        b->cap = cap;
    }
}

/* Text with &, <, >, " escaped for HTML. */
/* s as HTML text or a double-quoted attribute value: markup characters as entities, and
 * well-formed UTF-8 whatever s holds (a path or message cut mid-character, a file name in
 * another encoding: U+FFFD), control characters but tab and newline as U+FFFD too. */
static void sb_esc(struct sbuf *b, const char *s)
{
    for (; s && *s; s++) {
        const unsigned char *u = (const unsigned char *)s;
        if (*u >= 0x80) {
            size_t n = utf8_decode(u, strlen(s), NULL, NULL);
            if (n) {
                sb_printf(b, "%.*s", (int)n, s);
                s += n - 1;
            } else {
                sb_printf(b, "\xef\xbf\xbd");
                s += utf8_bad_len(u, strlen(s)) - 1;
            }
            continue;
        }
        if ((*u < 0x20 && *u != '\t' && *u != '\n') || *u == 0x7f) {
            sb_printf(b, "\xef\xbf\xbd");
            continue;
        }
        switch (*s) {
        case '&':
            sb_printf(b, "&amp;");
            break;
        case '<':
            sb_printf(b, "&lt;");
            break;
        case '>':
            sb_printf(b, "&gt;");
            break;
        case '"':
            sb_printf(b, "&quot;");
            break;
        case '\'':
            sb_printf(b, "&#39;");
            break;
        default:
            sb_printf(b, "%c", *s);
        }
    }
}

/* ---- what the report is made of ---- */

struct darr {
    double *v;     /* values */
    size_t n, cap; /* used, allocated */
};

static int darr_push(struct darr *a, double v)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        double *t = realloc(a->v, cap * sizeof(*t));
        if (!t)
            return 0;
        a->v = t;
        a->cap = cap;
    }
    a->v[a->n++] = v;
    return 1;
}

#define REPORT_EXAMPLES 3  /* examples shown per error code */
#define REPORT_CODES    32 /* error codes listed */

struct rep_error {
    char code[64];                  /* error code */
    int64_t count;                  /* items failed with it */
    char *example[REPORT_EXAMPLES]; /* "custom_id: message" (owned) */
    int n_examples;                 /* used */
};

struct rep_run {
    int part;           /* its part (0 for a queue file) */
    int64_t id;         /* run id within its queue */
    int64_t started_ms; /* start */
    int64_t end_ms;     /* end, or its last heartbeat when it never ended */
    int ended;          /* 1 when it recorded its end */
    char reason[32];    /* exit reason, or "killed" for a run that never ended and is silent */
    char host[64];      /* host */
    char engine[192];   /* its engine in words ("cpu amx, matmul bf16, KV f16, quern ..."), or
                           "" when none was recorded */
};

struct rep_part {
    int in_use;                             /* held by a run: counts from its progress file */
    int64_t items, done, failed, cancelled; /* counts */
};

struct report {
    char job[129];                            /* job name */
    char model[512];                          /* model path */
    int n_parts;                              /* 1 for a queue file */
    struct rep_part *parts;                   /* n_parts */
    struct queue_sample *samples;             /* every readable part's samples */
    int *sample_part;                         /* the part of each */
    size_t n_samples, cap_samples;            /* used, allocated */
    struct rep_run *runs;                     /* every readable part's runs */
    size_t n_runs, cap_runs;                  /* used, allocated */
    struct darr ttft, tpot;                   /* finished items' latencies (ms) */
    struct darr ptok, ctok;                   /* finished items' prompt and completion tokens */
    int64_t prompt_tokens, completion_tokens; /* summed over finished items */
    struct rep_error errors[REPORT_CODES];    /* by code, most frequent first once sorted */
    int n_errors;                             /* used */
    int oom;                                  /* an allocation failed */
};

static void report_free(struct report *r)
{
    free(r->parts);
    free(r->samples);
    free(r->sample_part);
    free(r->runs);
    free(r->ttft.v);
    free(r->tpot.v);
    free(r->ptok.v);
    free(r->ctok.v);
    for (int i = 0; i < r->n_errors; i++)
        for (int k = 0; k < r->errors[i].n_examples; k++)
            free(r->errors[i].example[k]);
}

static void note_error(struct report *r, const struct queue_item_info *it)
{
    const char *code = it->error_code ? it->error_code : "unknown";
    int i = 0;
    while (i < r->n_errors && strcmp(r->errors[i].code, code))
        i++;
    if (i == r->n_errors) {
        if (r->n_errors == REPORT_CODES)
            return;
        snprintf(r->errors[r->n_errors++].code, sizeof(r->errors[0].code), "%s", code);
    }
    struct rep_error *e = &r->errors[i];
    e->count++;
    if (e->n_examples < REPORT_EXAMPLES) {
        size_t n = 64 + (it->custom_id ? strlen(it->custom_id) : 0) +
                   (it->error_msg ? strlen(it->error_msg) : 0);
        char *t = malloc(n);
        if (t) {
            snprintf(t, n, "%s: %s", it->custom_id ? it->custom_id : "(no custom_id)",
                     it->error_msg ? it->error_msg : "");
            e->example[e->n_examples++] = t;
        }
    }
}

static enum status on_item(void *user, const struct queue_item_info *it)
{
    struct report *r = user;
    if (it->state == QUEUE_ITEM_DONE) {
        r->prompt_tokens += it->prompt_tokens;
        r->completion_tokens += it->completion_tokens;
        int ok = darr_push(&r->ptok, (double)it->prompt_tokens) &&
                 darr_push(&r->ctok, (double)it->completion_tokens);
        if (it->ttft_ms > 0)
            ok = ok && darr_push(&r->ttft, it->ttft_ms);
        if (it->tpot_ms > 0)
            ok = ok && darr_push(&r->tpot, it->tpot_ms);
        r->oom |= !ok;
    } else if (it->state == QUEUE_ITEM_FAILED) {
        note_error(r, it);
    }
    return ST_OK;
}

/* A run's engine_json (queue_run_set_engine) in words into out; "" when there is none. */
static void engine_words(const char *engine_json, char *out, size_t cap)
{
    cJSON *e = engine_json ? cJSON_Parse(engine_json) : NULL;
    const cJSON *dev = cJSON_GetObjectItem(e, "device"), *mm = cJSON_GetObjectItem(e, "matmul"),
                *kv = cJSON_GetObjectItem(e, "kv_dtype"), *rev = cJSON_GetObjectItem(e, "quern");
    out[0] = 0;
    if (cJSON_IsString(dev) && cJSON_IsString(mm) && cJSON_IsString(kv) && cJSON_IsString(rev))
        snprintf(out, cap, "%s, matmul %s, KV %s, quern %s", dev->valuestring, mm->valuestring,
                 kv->valuestring, rev->valuestring);
    const cJSON *blk = cJSON_GetObjectItem(e, "kv_block"); /* (older runs lack it) */
    if (out[0] && cJSON_IsNumber(blk)) {
        size_t len = strlen(out);
        snprintf(out + len, cap - len, ", KV blocks of %d", blk->valueint);
    }
    cJSON_Delete(e);
}

/* Gather part k's (or the queue file's) job into r. */
static enum status gather(struct report *r, struct queue *q, int k, const char *job,
                          int64_t stale_ms, struct err_detail *err)
{
    struct queue_job j = {0};
    struct queue_counts c;
    enum status st = queue_job_find_ready(q, job, &j, err);
    if (!st)
        st = queue_job_counts(q, j.id, &c, err);
    if (st) {
        queue_job_free(&j);
        return st;
    }
    if (!r->model[0])
        snprintf(r->model, sizeof(r->model), "%s", j.model_path);
    if (!r->job[0])
        snprintf(r->job, sizeof(r->job), "%s", j.name);
    struct rep_part *p = &r->parts[k];
    p->items = c.total;
    p->done = c.items[QUEUE_ITEM_DONE];
    p->failed = c.items[QUEUE_ITEM_FAILED];
    p->cancelled = c.items[QUEUE_ITEM_CANCELLED];
    struct queue_sample *smp = NULL;
    size_t n = 0;
    if (!(st = queue_sample_list(q, j.id, &smp, &n, err)) && n) {
        if (r->n_samples + n > r->cap_samples) {
            size_t cap = (r->n_samples + n) * 2;
            struct queue_sample *t = realloc(r->samples, cap * sizeof(*t));
            int *tp = t ? realloc(r->sample_part, cap * sizeof(*tp)) : NULL;
            if (t)
                r->samples = t;
            if (tp)
                r->sample_part = tp;
            if (!t || !tp)
                st = err_set(err, ST_ERR_NOMEM, "out of memory");
            else
                r->cap_samples = cap;
        }
        for (size_t i = 0; !st && i < n; i++) {
            r->samples[r->n_samples] = smp[i];
            r->sample_part[r->n_samples++] = k;
        }
    }
    free(smp);
    struct queue_run_info *runs = NULL;
    size_t nr = 0;
    if (!st && !(st = queue_run_list_job(q, j.id, &runs, &nr, err))) {
        for (size_t i = 0; i < nr && !st; i++) {
            if (r->n_runs == r->cap_runs) {
                size_t cap = r->cap_runs ? r->cap_runs * 2 : 16;
                struct rep_run *t = realloc(r->runs, cap * sizeof(*t));
                if (!t) {
                    st = err_set(err, ST_ERR_NOMEM, "out of memory");
                    break;
                }
                r->runs = t;
                r->cap_runs = cap;
            }
            struct rep_run *x = &r->runs[r->n_runs++];
            memset(x, 0, sizeof(*x));
            x->part = k;
            x->id = runs[i].id;
            x->started_ms = runs[i].started_ms;
            x->ended = runs[i].ended_ms > 0;
            /* a run found dead was ended when another run noticed; it stopped working at its
             * last heartbeat */
            int dead = x->ended && runs[i].exit_reason && !strcmp(runs[i].exit_reason, "dead");
            x->end_ms = x->ended && !dead ? runs[i].ended_ms : runs[i].heartbeat_ms;
            snprintf(x->reason, sizeof(x->reason), "%s",
                     x->ended ? (runs[i].exit_reason ? runs[i].exit_reason : "?")
                              : (runs[i].age_ms > stale_ms ? "killed" : "running"));
            snprintf(x->host, sizeof(x->host), "%s", runs[i].host ? runs[i].host : "");
            engine_words(runs[i].engine_json, x->engine, sizeof(x->engine));
        }
        queue_run_info_free(runs, nr);
    }
    if (!st)
        st = queue_item_scan_finished(q, j.id, on_item, r, err);
    queue_job_free(&j);
    if (!st && r->oom)
        st = err_set(err, ST_ERR_NOMEM, "out of memory");
    return st;
}

/* ---- numbers ---- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted v[0..n) (0 when empty). */
static double pct(const double *v, size_t n, double p)
{
    if (!n)
        return 0;
    size_t k = (size_t)ceil(p / 100.0 * (double)n);
    return v[k ? k - 1 : 0];
}

/* A "nice" axis step for a range: 1, 2 or 5 times a power of ten, about range / 4. */
static double nice_step(double range)
{
    if (range <= 0)
        return 1;
    double raw = range / 4, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

/* ---- SVG ---- */

#define SVG_W 640 /* viewBox width */
#define SVG_H 220 /* viewBox height */
#define SVG_L 52  /* left margin (y labels) */
#define SVG_R 22  /* right margin (room for the last x label) */
#define SVG_T 14  /* top margin */
#define SVG_B 30  /* bottom margin (x labels) */

struct chart {
    double x0, x1, y0, y1; /* data ranges */
    int w;                 /* viewBox width: SVG_W, narrower for charts side by side (0: SVG_W) */
};

static double cx(const struct chart *c, double x)
{
    return SVG_L + (x - c->x0) / (c->x1 - c->x0) * ((c->w ? c->w : SVG_W) - SVG_L - SVG_R);
}

static double cy(const struct chart *c, double y)
{
    return SVG_H - SVG_B - (y - c->y0) / (c->y1 - c->y0) * (SVG_H - SVG_T - SVG_B);
}

/* Open an SVG chart with axes, grid and labels; ymax rounded up to a nice step. */
static void svg_open(struct sbuf *b, struct chart *c, const char *label, const char *xlabel)
{
    if (c->x1 <= c->x0)
        c->x1 = c->x0 + 1;
    if (!c->w)
        c->w = SVG_W;
    double ys = nice_step(c->y1 - c->y0);
    c->y1 = c->y0 + ceil((c->y1 - c->y0) / ys) * ys;
    if (c->y1 <= c->y0)
        c->y1 = c->y0 + 1;
    sb_printf(b,
              "<svg viewBox=\"0 0 %d %d\" role=\"img\" xmlns=\"http://www.w3.org/2000/svg\">"
              "<title>",
              c->w, SVG_H);
    sb_esc(b, label);
    sb_printf(b, "</title>");
    for (double y = c->y0; y <= c->y1 + ys / 2; y += ys)
        sb_printf(b,
                  "<line class=\"grid\" x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\"/>"
                  "<text class=\"tick\" x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g</text>",
                  SVG_L, c->w - SVG_R, cy(c, y), cy(c, y), SVG_L - 4, cy(c, y) + 4, y);
    double xs = nice_step(c->x1 - c->x0);
    for (double x = ceil(c->x0 / xs) * xs; x <= c->x1 + 1e-9; x += xs)
        sb_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g</text>",
                  cx(c, x), SVG_H - SVG_B + 14, x);
    sb_printf(b,
              "<line class=\"axis\" x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\"/>"
              "<text class=\"tick\" x=\"%d\" y=\"%d\" text-anchor=\"middle\">",
              SVG_L, c->w - SVG_R, SVG_H - SVG_B, SVG_H - SVG_B, (SVG_L + c->w) / 2, SVG_H - 2);
    sb_esc(b, xlabel);
    sb_printf(b, "</text>");
}

/* A polyline of points (x[i], y[i]) with class cls. */
static void svg_poly(struct sbuf *b, const struct chart *c, const double *x, const double *y,
                     size_t n, const char *cls)
{
    if (!n)
        return;
    sb_printf(b, "<polyline class=\"%s\" points=\"", cls);
    for (size_t i = 0; i < n; i++)
        sb_printf(b, "%s%.1f,%.1f", i ? " " : "", cx(c, x[i]), cy(c, y[i]));
    sb_printf(b, "\"/>");
}

/* ---- sections ---- */

/* The time axis: seconds, minutes or hours since the first run started, by the job's span. */
static double g_unit_ms = 60000.0;     /* ms per unit */
static const char *g_unit = "minutes"; /* its name */

static void time_unit(int64_t span_ms)
{
    g_unit_ms = span_ms < 600000 ? 1000.0 : span_ms < 36000000 ? 60000.0 : 3600000.0;
    g_unit = span_ms < 600000 ? "seconds" : span_ms < 36000000 ? "minutes" : "hours";
}

/* Time units since t0 of a unix-ms time. */
static double minutes(int64_t t, int64_t t0)
{
    return (double)(t - t0) / g_unit_ms;
}

/* Vertical marks for every run: its start, and how it ended unless it finished normally. */
static void svg_runs(struct sbuf *b, const struct chart *c, const struct report *r, int64_t t0)
{
    for (size_t i = 0; i < r->n_runs; i++) {
        const struct rep_run *x = &r->runs[i];
        double xs = cx(c, minutes(x->started_ms, t0)), xe = cx(c, minutes(x->end_ms, t0));
        sb_printf(b, "<line class=\"run-start\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\"/>", xs,
                  xs, SVG_T, SVG_H - SVG_B);
        int bad = !strcmp(x->reason, "killed") || !strcmp(x->reason, "dead") ||
                  !strcmp(x->reason, "error");
        int stop = !strcmp(x->reason, "signal") || !strcmp(x->reason, "max_runtime");
        if (bad || stop)
            sb_printf(b,
                      "<line class=\"%s\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\"/>"
                      "<text class=\"mark\" x=\"%.1f\" y=\"%d\">%s</text>",
                      bad ? "run-killed" : "run-stopped", xe, xe, SVG_T, SVG_H - SVG_B, xe + 2,
                      SVG_T + 8, x->reason);
    }
}

/* Output tokens per second over time: each run's token counter between consecutive samples,
 * spread over that interval, summed over runs in 60 bins of the job's span. */
static void sec_throughput(struct sbuf *b, const struct report *r, int64_t t0, int64_t t1)
{
    enum { NB = 60 };
    double tok[NB] = {0}, x[NB], y[NB];
    double span = (double)(t1 - t0) / 1000.0, w = span / NB;
    for (size_t i = 1; i < r->n_samples && w > 0; i++) {
        const struct queue_sample *a = &r->samples[i - 1], *s = &r->samples[i];
        if (a->run_id != s->run_id || r->sample_part[i - 1] != r->sample_part[i])
            continue;
        double d = (double)(s->v[QUEUE_SAMPLE_GEN_TOKENS] - a->v[QUEUE_SAMPLE_GEN_TOKENS]);
        double ta = (double)(a->t_ms - t0) / 1000.0, tb = (double)(s->t_ms - t0) / 1000.0;
        if (d <= 0 || tb <= ta)
            continue;
        for (int k = 0; k < NB; k++) { /* the part of [ta, tb) that falls in bin k */
            double lo = fmax(ta, k * w), hi = fmin(tb, (k + 1) * w);
            if (hi > lo)
                tok[k] += d * (hi - lo) / (tb - ta);
        }
    }
    struct chart c = {0, span * 1000.0 / g_unit_ms, 0, 1, 0};
    for (int k = 0; k < NB; k++) {
        x[k] = (k + 0.5) * w * 1000.0 / g_unit_ms;
        y[k] = tok[k] / w;
        c.y1 = fmax(c.y1, y[k]);
    }
    sb_printf(b, "<section id=\"throughput\"><h2>Throughput over time</h2>"
                 "<p class=\"note\">Output tokens per second, all runs together; grey lines are "
                 "run starts, red ones runs that died (killed or lost), orange ones runs that "
                 "stopped early (signal or --max-runtime).</p>");
    char xl[64];
    snprintf(xl, sizeof(xl), "%s since the first run started", g_unit);
    svg_open(b, &c, "Output tokens per second over time", xl);
    svg_runs(b, &c, r, t0);
    svg_poly(b, &c, x, y, NB, "line1");
    sb_printf(b, "</svg></section>");
}

/* Batch size (tokens per step, running sequences) and KV use over time, a line per run. */
static void sec_load(struct sbuf *b, const struct report *r, int64_t t0, int64_t t1)
{
    double *x = malloc(sizeof(double) * (r->n_samples + 1));
    double *ya = malloc(sizeof(double) * (r->n_samples + 1));
    double *yb = malloc(sizeof(double) * (r->n_samples + 1));
    if (!x || !ya || !yb) {
        free(x), free(ya), free(yb);
        return;
    }
    struct chart c = {0, (double)(t1 - t0) / g_unit_ms, 0, 1, 0}, k = {c.x0, c.x1, 0, 100, 0};
    char xl[64];
    snprintf(xl, sizeof(xl), "%s since the first run started", g_unit);
    for (size_t i = 0; i < r->n_samples; i++) {
        c.y1 = fmax(c.y1, (double)r->samples[i].v[QUEUE_SAMPLE_RUNNING]);
        if (i && r->samples[i - 1].run_id == r->samples[i].run_id) {
            double ds = (double)(r->samples[i].v[QUEUE_SAMPLE_STEPS] -
                                 r->samples[i - 1].v[QUEUE_SAMPLE_STEPS]);
            double dt = (double)(r->samples[i].v[QUEUE_SAMPLE_BATCH_TOKENS] -
                                 r->samples[i - 1].v[QUEUE_SAMPLE_BATCH_TOKENS]);
            if (ds > 0)
                c.y1 = fmax(c.y1, dt / ds);
        }
    }
    for (int pass = 0; pass < 2; pass++) {
        struct chart *ch = pass ? &k : &c;
        if (!pass) {
            sb_printf(b, "<section id=\"load\"><h2>Batch size and KV cache use</h2>"
                         "<p class=\"note\"><span class=\"key line1\"></span> tokens per forward "
                         "step &nbsp; <span class=\"key line2\"></span> running sequences</p>");
            svg_open(b, ch, "Tokens per step and running sequences over time", xl);
        } else {
            sb_printf(b, "<p class=\"note\">KV cache blocks in use, percent of the pool</p>");
            svg_open(b, ch, "KV cache use over time", xl);
        }
        svg_runs(b, ch, r, t0);
        size_t i = 0;
        while (i < r->n_samples) { /* one polyline per run (and part) */
            size_t j = i, n = 0, m = 0;
            for (; j < r->n_samples && r->samples[j].run_id == r->samples[i].run_id &&
                   r->sample_part[j] == r->sample_part[i];
                 j++) {
                const struct queue_sample *s = &r->samples[j];
                double t = minutes(s->t_ms, t0);
                if (pass) {
                    x[n] = t;
                    ya[n++] = s->v[QUEUE_SAMPLE_KV_TOTAL]
                                  ? 100.0 * (double)s->v[QUEUE_SAMPLE_KV_USED] /
                                        (double)s->v[QUEUE_SAMPLE_KV_TOTAL]
                                  : 0;
                    continue;
                }
                yb[n] = (double)s->v[QUEUE_SAMPLE_RUNNING];
                x[n++] = t;
                if (j > i) {
                    const struct queue_sample *a = &r->samples[j - 1];
                    double ds = (double)(s->v[QUEUE_SAMPLE_STEPS] - a->v[QUEUE_SAMPLE_STEPS]);
                    ya[m++] = ds > 0 ? (double)(s->v[QUEUE_SAMPLE_BATCH_TOKENS] -
                                                a->v[QUEUE_SAMPLE_BATCH_TOKENS]) /
                                           ds
                                     : 0;
                }
            }
            if (pass) {
                svg_poly(b, ch, x, ya, n, "line1");
            } else {
                svg_poly(b, ch, x + 1, ya, m, "line1");
                svg_poly(b, ch, x, yb, n, "line2");
            }
            i = j;
        }
        sb_printf(b, "</svg>");
    }
    sb_printf(b, "</section>");
    free(x), free(ya), free(yb);
}

/* A histogram of v[0..n) (sorted here) in 30 bins up to its P99 (the rest in the last bin),
 * with P50, P90 and P99 marked and listed. */
static void svg_hist(struct sbuf *b, const char *id, const char *title, const char *unit,
                     struct darr *a)
{
    qsort(a->v, a->n, sizeof(double), cmp_double);
    double p50 = pct(a->v, a->n, 50), p90 = pct(a->v, a->n, 90), p99 = pct(a->v, a->n, 99);
    sb_printf(b, "<div class=\"hist\" id=\"%s\"><h3>", id);
    sb_esc(b, title);
    if (!a->n) /* (it showed "0 values; P50 0 ms") */
        sb_printf(b, "</h3><p class=\"note\">no values</p>");
    else
        sb_printf(b,
                  "</h3><p class=\"note\">%zu values; P50 <b data-k=\"%s_p50\">%.4g</b> %s, P90 "
                  "<b data-k=\"%s_p90\">%.4g</b> %s, P99 <b data-k=\"%s_p99\">%.4g</b> %s</p>",
                  a->n, id, p50, unit, id, p90, unit, id, p99, unit);
    enum { NB = 30 };
    double cnt[NB] = {0};
    double lo = a->n ? a->v[0] : 0, hi = a->n ? fmax(p99, lo + 1e-9) : 1;
    double w = (hi - lo) / NB;
    for (size_t i = 0; i < a->n; i++) {
        int k = w > 0 ? (int)((a->v[i] - lo) / w) : 0;
        cnt[k < 0 ? 0 : k >= NB ? NB - 1 : k]++;
    }
    struct chart c = {lo, hi, 0, 1, 400};
    for (int k = 0; k < NB; k++)
        c.y1 = fmax(c.y1, cnt[k]);
    char xl[64];
    snprintf(xl, sizeof(xl), "%s (last bar: P99 and above)", unit);
    svg_open(b, &c, title, xl);
    for (int k = 0; k < NB; k++)
        if (cnt[k] > 0)
            sb_printf(b,
                      "<rect class=\"bar\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>",
                      cx(&c, lo + k * w) + 0.5, cy(&c, cnt[k]),
                      fmax(0.5, cx(&c, lo + (k + 1) * w) - cx(&c, lo + k * w) - 1),
                      cy(&c, 0) - cy(&c, cnt[k]));
    const double pv[3] = {p50, p90, p99};
    const char *pn[3] = {"P50", "P90", "P99"};
    for (int i = 0; a->n && i < 3; i++)
        sb_printf(b,
                  "<line class=\"pct\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\"/>"
                  "<text class=\"mark\" x=\"%.1f\" y=\"%d\" text-anchor=\"%s\">%s</text>",
                  cx(&c, pv[i]), cx(&c, pv[i]), SVG_T, SVG_H - SVG_B,
                  cx(&c, pv[i]) + (cx(&c, pv[i]) > c.w - 40 ? -3 : 3), SVG_T + 10 + 13 * i,
                  cx(&c, pv[i]) > c.w - 40 ? "end" : "start", pn[i]);
    sb_printf(b, "</svg></div>");
}

static void sec_errors(struct sbuf *b, struct report *r)
{
    sb_printf(b, "<section id=\"errors\"><h2>Errors</h2>");
    if (!r->n_errors) {
        sb_printf(b, "<p>No failed items.</p></section>");
        return;
    }
    for (int i = 0; i < r->n_errors; i++) /* most frequent first */
        for (int j = i + 1; j < r->n_errors; j++)
            if (r->errors[j].count > r->errors[i].count) {
                struct rep_error t = r->errors[i];
                r->errors[i] = r->errors[j];
                r->errors[j] = t;
            }
    sb_printf(b, "<table><tr><th>code</th><th>items</th><th>examples</th></tr>");
    for (int i = 0; i < r->n_errors; i++) {
        sb_printf(b, "<tr><td><code>");
        sb_esc(b, r->errors[i].code);
        sb_printf(b, "</code></td><td data-k=\"error_%s\">%lld</td><td>", r->errors[i].code,
                  (long long)r->errors[i].count);
        for (int k = 0; k < r->errors[i].n_examples; k++) {
            sb_printf(b, "<div class=\"ex\">");
            sb_esc(b, r->errors[i].example[k]);
            sb_printf(b, "</div>");
        }
        sb_printf(b, "</td></tr>");
    }
    sb_printf(b, "</table></section>");
}

static void sec_parts(struct sbuf *b, const struct report *r)
{
    sb_printf(b, "<section id=\"parts\"><h2>Progress by part</h2><table><tr><th>part</th>"
                 "<th>finished</th><th>failed</th><th>cancelled</th><th>items</th><th></th></tr>");
    for (int k = 0; k < r->n_parts; k++) {
        const struct rep_part *p = &r->parts[k];
        double f = p->items ? 100.0 * (double)(p->done + p->failed) / (double)p->items : 0;
        sb_printf(b,
                  "<tr><td>%d%s</td><td>%lld</td><td>%lld</td><td>%lld</td><td>%lld</td>"
                  "<td class=\"barcell\"><div class=\"pbar\"><div style=\"width:%.1f%%\"></div>"
                  "</div></td></tr>",
                  k, p->in_use ? " (in use)" : "", (long long)(p->done + p->failed),
                  (long long)p->failed, (long long)p->cancelled, (long long)p->items, f);
    }
    sb_printf(b, "</table></section>");
}

static void sec_runs(struct sbuf *b, const struct report *r, int64_t t0)
{
    sb_printf(b,
              "<section id=\"runs\"><h2>Runs</h2><table><tr>%s<th>run</th><th>host</th>"
              "<th>start (%s)</th><th>length (%s)</th><th>how it ended</th><th>engine</th></tr>",
              r->n_parts > 1 ? "<th>part</th>" : "", g_unit, g_unit);
    for (size_t i = 0; i < r->n_runs; i++) {
        const struct rep_run *x = &r->runs[i];
        sb_printf(b, "<tr>");
        if (r->n_parts > 1)
            sb_printf(b, "<td>%d</td>", x->part);
        sb_printf(b, "<td>%lld</td><td>", (long long)x->id);
        sb_esc(b, x->host);
        sb_printf(b, "</td><td>%.1f</td><td>%.1f</td><td class=\"%s\">%s</td><td>",
                  minutes(x->started_ms, t0), minutes(x->end_ms, x->started_ms),
                  !strcmp(x->reason, "killed") || !strcmp(x->reason, "dead") ? "bad" : "",
                  x->reason);
        sb_esc(b, x->engine[0] ? x->engine : "unknown");
        sb_printf(b, "</td></tr>");
    }
    sb_printf(b, "</table></section>");
}

static const char CSS[] =
    "body{font:15px/1.45 system-ui,sans-serif;margin:0 auto;max-width:60rem;padding:1rem;"
    "color:#1b1b1b;background:#fff}h1{font-size:1.5rem;margin:.2rem 0}h2{font-size:1.2rem;"
    "margin:1.6rem 0 .4rem;border-bottom:1px solid #ddd}h3{font-size:1rem;margin:.8rem 0 .2rem}"
    "svg{width:100%;height:auto;display:block}table{border-collapse:collapse;width:100%}"
    "th,td{text-align:left;padding:.2rem .5rem;border-bottom:1px solid #eee;vertical-align:top}"
    "td{overflow-wrap:anywhere}.note{color:#555;font-size:.9rem;margin:.2rem 0}"
    ".grid{stroke:#eee}.axis{stroke:#888}.tick,.mark{font-size:13px;fill:#555}"
    ".line1{fill:none;stroke:#1f6fb5;stroke-width:1.8}.line2{fill:none;stroke:#d9822b;"
    "stroke-width:1.4}.bar{fill:#1f6fb5}.pct{stroke:#b3261e;stroke-dasharray:3 2}"
    ".run-start{stroke:#999;stroke-dasharray:2 3}.run-killed{stroke:#b3261e;stroke-width:1.5}"
    ".run-stopped{stroke:#d9822b;stroke-width:1.5}.key{display:inline-block;width:1.2em;"
    "height:.25em;vertical-align:middle}.key.line1{background:#1f6fb5}.key.line2{"
    "background:#d9822b}.kv{display:grid;grid-template-columns:repeat(auto-fit,minmax(11rem,1fr));"
    "gap:.4rem}@media (max-width:30rem){.kv{grid-template-columns:1fr 1fr}}.kv "
    "div{background:#f5f7fa;padding:.4rem .6rem;border-radius:4px}.kv b{display:"
    "block;font-size:1.15rem}.hists{display:grid;grid-template-columns:repeat(auto-fit,"
    "minmax(18rem,1fr));gap:1rem}.pbar{background:#eee;height:.7rem;min-width:5rem}.pbar div{"
    "background:#1f6fb5;height:100%}.ex{font-size:.85rem;color:#444}.bad{color:#b3261e}"
    "@media print{body{max-width:none;font-size:11pt}section{break-inside:avoid}"
    ".kv div{border:1px solid #ccc}}";

/* One summary figure: label and value, with data-k for tests. */
static void kv(struct sbuf *b, const char *key, const char *label, const char *fmt, ...)
{
    char v[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v, sizeof(v), fmt, ap);
    va_end(ap);
    sb_printf(b, "<div>%s<b data-k=\"%s\">%s</b></div>", label, key, v);
}

static void render(struct sbuf *b, struct report *r, const struct batch_report_opts *o)
{
    int64_t t0 = 0, t1 = 0;
    double run_h = 0;
    for (size_t i = 0; i < r->n_runs; i++) {
        const struct rep_run *x = &r->runs[i];
        t0 = !t0 || x->started_ms < t0 ? x->started_ms : t0;
        t1 = x->end_ms > t1 ? x->end_ms : t1;
        run_h += (double)(x->end_ms - x->started_ms) / 3.6e6;
    }
    for (size_t i = 0; i < r->n_samples; i++)
        t1 = r->samples[i].t_ms > t1 ? r->samples[i].t_ms : t1;
    int64_t items = 0, done = 0, failed = 0, cancelled = 0;
    for (int k = 0; k < r->n_parts; k++) {
        items += r->parts[k].items;
        done += r->parts[k].done;
        failed += r->parts[k].failed;
        cancelled += r->parts[k].cancelled;
    }
    double wall = t1 > t0 ? (double)(t1 - t0) / 1000.0 : 0;
    time_unit(t1 - t0);
    sb_printf(b, "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
                 "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
                 "<title>quern report: ");
    sb_esc(b, r->job);
    sb_printf(b, "</title><style>%s</style></head><body><header><h1>Job ", CSS);
    sb_esc(b, r->job);
    sb_printf(b, "</h1><p class=\"note\">");
    sb_esc(b, r->model);
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    char when[64];
    strftime(when, sizeof(when), "%Y-%m-%d %H:%M UTC", &tm);
    sb_printf(b, " &middot; %d part%s &middot; %zu run%s &middot; report made %s</p></header>",
              r->n_parts, r->n_parts == 1 ? "" : "s", r->n_runs, r->n_runs == 1 ? "" : "s", when);
    sb_printf(b, "<section id=\"summary\"><h2>Summary</h2><div class=\"kv\">");
    kv(b, "items", "items", "%lld", (long long)items);
    kv(b, "done", "done", "%lld", (long long)done);
    kv(b, "failed", "failed", "%lld", (long long)failed);
    kv(b, "cancelled", "cancelled", "%lld", (long long)cancelled);
    kv(b, "unfinished", "unfinished", "%lld", (long long)(items - done - failed - cancelled));
    kv(b, "prompt_tokens", "prompt tokens", "%lld", (long long)r->prompt_tokens);
    kv(b, "completion_tokens", "output tokens", "%lld", (long long)r->completion_tokens);
    kv(b, "wall_s", "wall time (s)", "%.1f", wall); /* (%.0f showed 0 beside a rate) */
    kv(b, "output_tok_s", "output tok/s (wall)", "%.1f",
       wall > 0 ? (double)r->completion_tokens / wall : 0);
    kv(b, "run_hours", "run hours (all runs)", "%.3f", run_h);
    sb_printf(b, "</div></section>");
    sec_throughput(b, r, t0, t1 > t0 ? t1 : t0 + 1);
    sec_load(b, r, t0, t1 > t0 ? t1 : t0 + 1);
    sb_printf(b, "<section id=\"latency\"><h2>Latency</h2><div class=\"hists\">");
    svg_hist(b, "ttft", "Time to first token", "ms", &r->ttft);
    svg_hist(b, "tpot", "Time per output token (after the first)", "ms", &r->tpot);
    sb_printf(b, "</div></section><section id=\"lengths\"><h2>Prompt and output lengths</h2>"
                 "<div class=\"hists\">");
    svg_hist(b, "prompt_len", "Prompt tokens", "tokens", &r->ptok);
    svg_hist(b, "output_len", "Output tokens", "tokens", &r->ctok);
    sb_printf(b, "</div></section>");
    sec_errors(b, r);
    sec_parts(b, r);
    sec_runs(b, r, t0);
    sb_printf(b, "<section id=\"cost\"><h2>Cost</h2>");
    if (o->cost_per_hour > 0) {
        double cost = run_h * o->cost_per_hour;
        sb_printf(b,
                  "<div class=\"kv\"><div>cost per run-hour<b data-k=\"cost_per_hour\">%.4g</b>"
                  "</div><div>cost of all runs<b data-k=\"cost\">%.4g</b></div><div>per million "
                  "output tokens<b data-k=\"cost_per_mtok\">%.4g</b></div></div>",
                  o->cost_per_hour, cost,
                  r->completion_tokens ? cost / ((double)r->completion_tokens / 1e6) : 0);
        sb_printf(b, "<p class=\"note\">Every run's time (start to end, or to its last heartbeat "
                     "when it was killed) at --cost-per-hour, one device or node per run.</p>");
    } else {
        sb_printf(b, "<p>Give <code>--cost-per-hour</code> (per device or node, as each run "
                     "uses one) for the cost per million output tokens.</p>");
    }
    sb_printf(b, "</section></body></html>\n");
}

/* ---- the report ---- */

static const struct report *g_sort; /* for cmp_sample (qsort has no user pointer) */

/* Samples by part, run, time: each run's samples one after another. */
static int cmp_sample(const void *a, const void *b)
{
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    const struct queue_sample *x = &g_sort->samples[i], *y = &g_sort->samples[j];
    int pi = g_sort->sample_part[i], pj = g_sort->sample_part[j];
    if (pi != pj)
        return pi < pj ? -1 : 1;
    if (x->run_id != y->run_id)
        return x->run_id < y->run_id ? -1 : 1;
    return x->t_ms < y->t_ms ? -1 : x->t_ms > y->t_ms;
}

static enum status sort_samples(struct report *r, struct err_detail *err)
{
    size_t n = r->n_samples;
    size_t *ix = malloc(sizeof(*ix) * (n + 1));
    struct queue_sample *s = malloc(sizeof(*s) * (n + 1));
    int *sp = malloc(sizeof(*sp) * (n + 1));
    if (!ix || !s || !sp) {
        free(ix), free(s), free(sp);
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++)
        ix[i] = i;
    g_sort = r;
    qsort(ix, n, sizeof(*ix), cmp_sample);
    for (size_t i = 0; i < n; i++) {
        s[i] = r->samples[ix[i]];
        sp[i] = r->sample_part[ix[i]];
    }
    free(r->samples);
    free(r->sample_part);
    free(ix);
    r->samples = s;
    r->sample_part = sp;
    return ST_OK;
}

enum status batch_report_write(const char *db, const char *job, const struct batch_report_opts *o,
                               const char *out_path, struct err_detail *err)
{
    struct batch_parts parts;
    int dir = batch_parts_find(db, &parts, err);
    if (dir < 0)
        return err->status;
    if (!dir && !job)
        return err_set(err, ST_ERR_INVALID_ARG, "--job is required for a queue file");
    if (dir && job && strcmp(job, parts.job))
        return err_set(err, ST_ERR_NOT_FOUND, "%s holds job '%s', not '%s'", db, parts.job, job);
    struct report r;
    memset(&r, 0, sizeof(r));
    r.n_parts = dir ? parts.n : 1;
    r.parts = calloc((size_t)r.n_parts, sizeof(*r.parts));
    enum status st = r.parts ? ST_OK : err_set(err, ST_ERR_NOMEM, "out of memory");
    int64_t stale_ms = (int64_t)(BATCH_PROGRESS_STALE_S * 1000);
    for (int k = 0; !st && k < r.n_parts; k++) {
        struct queue *q = NULL;
        struct queue_options qo = {.must_exist = true, .read_only_ok = true};
        st = dir ? batch_parts_open(&parts, k, 500, BATCH_PART_READ, &q, err)
                 : queue_open_opts(&q, db, &qo, err);
        if (st == ST_ERR_BUSY && dir) { /* in use: its counts from its run's progress file */
            char path[4200];
            batch_parts_path(&parts, k, ".progress.json", path, sizeof(path));
            cJSON *pj = batch_json_file(path);
            const cJSON *t = cJSON_GetObjectItem(pj, "total"), *d = cJSON_GetObjectItem(pj, "done"),
                        *f = cJSON_GetObjectItem(pj, "failed"),
                        *c = cJSON_GetObjectItem(pj, "cancelled");
            r.parts[k].in_use = 1;
            r.parts[k].items = cJSON_IsNumber(t) ? (int64_t)t->valuedouble : 0;
            r.parts[k].done = cJSON_IsNumber(d) ? (int64_t)d->valuedouble : 0;
            r.parts[k].failed = cJSON_IsNumber(f) ? (int64_t)f->valuedouble : 0;
            r.parts[k].cancelled = cJSON_IsNumber(c) ? (int64_t)c->valuedouble : 0;
            cJSON_Delete(pj);
            st = ST_OK;
            continue;
        }
        if (!st) { /* as status does: this host's runs whose process is gone are ended */
            struct proc_identity self;
            struct err_detail e2 = {0};
            proc_identity_self(&self);
            if (!queue_read_only(q) && queue_reap_dead(q, &self, NULL, &e2))
                LOG_WARN("ending the runs found dead: %s", e2.msg);
            st = gather(&r, q, k, dir ? parts.job : job, stale_ms, err);
        }
        queue_close(q);
    }
    if (!r.job[0] && dir)
        snprintf(r.job, sizeof(r.job), "%s", parts.job);
    struct sbuf b = {0};
    if (!st)
        st = sort_samples(&r, err);
    if (!st) {
        render(&b, &r, o);
        if (b.oom)
            st = err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    if (!st) {
        char dirname[4096] = ".";
        const char *slash = strrchr(out_path, '/');
        if (slash)
            snprintf(dirname, sizeof(dirname), "%.*s",
                     slash == out_path ? 1 : (int)(slash - out_path), out_path);
        st = io_file_replace(dirname, slash ? slash + 1 : out_path, b.p, b.len, NULL, err);
    }
    free(b.p);
    report_free(&r);
    return st;
}
