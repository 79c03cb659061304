/* Progress numbers, their JSON and their three printed forms (runner/progress.h). */
#include "runner/progress.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "runner/term.h"

int64_t runner_progress_left(const struct runner_progress *p)
{
    int64_t left = p->total - p->done - p->failed - p->cancelled;
    return left > 0 ? left : 0;
}

void runner_progress_eta(struct runner_progress *p)
{
    int64_t left = runner_progress_left(p);
    if (!left) {
        p->eta_s = 0;
        return;
    }
    if (p->mean_out <= 0 || p->gen_tok_s <= 0) {
        p->eta_s = -1;
        return;
    }
    double tokens = (double)left * p->mean_out - p->inflight_tokens;
    p->eta_s = tokens > 0 ? tokens / p->gen_tok_s : 0;
}

void runner_progress_add_json(cJSON *o, const struct runner_progress *p)
{
    cJSON_AddNumberToObject(o, "job_id", (double)p->job_id);
    cJSON_AddStringToObject(o, "job", p->job);
    cJSON_AddNumberToObject(o, "total", (double)p->total);
    cJSON_AddNumberToObject(o, "done", (double)p->done);
    cJSON_AddNumberToObject(o, "failed", (double)p->failed);
    cJSON_AddNumberToObject(o, "cancelled", (double)p->cancelled);
    cJSON_AddNumberToObject(o, "gen_tokens", (double)p->gen_tokens);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)p->prompt_tokens);
    cJSON_AddNumberToObject(o, "gen_tok_s", p->gen_tok_s);
    cJSON_AddNumberToObject(o, "prompt_tok_s", p->prompt_tok_s);
    cJSON_AddNumberToObject(o, "mean_out", p->mean_out);
    cJSON_AddNumberToObject(o, "inflight_tokens", p->inflight_tokens);
    cJSON_AddNumberToObject(o, "running", (double)p->running);
    cJSON_AddNumberToObject(o, "waiting", (double)p->waiting);
    cJSON_AddNumberToObject(o, "kv_used", (double)p->kv_used);
    cJSON_AddNumberToObject(o, "kv_total", (double)p->kv_total);
    cJSON_AddNumberToObject(o, "elapsed_s", p->elapsed_s);
    if (p->eta_s >= 0)
        cJSON_AddNumberToObject(o, "eta_s", p->eta_s);
    else
        cJSON_AddNullToObject(o, "eta_s");
}

char *runner_progress_to_json(const struct runner_progress *p)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    runner_progress_add_json(o, p);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static double num(const cJSON *o, const char *key, double dflt)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) ? v->valuedouble : dflt;
}

int runner_progress_from_json(const char *json, struct runner_progress *p)
{
    memset(p, 0, sizeof(*p));
    p->eta_s = -1;
    cJSON *o = json ? cJSON_Parse(json) : NULL;
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return 0;
    }
    const cJSON *name = cJSON_GetObjectItem(o, "job");
    if (cJSON_IsString(name) && name->valuestring)
        snprintf(p->job, sizeof(p->job), "%s", name->valuestring);
    p->job_id = (int64_t)num(o, "job_id", 0);
    p->total = (int64_t)num(o, "total", 0);
    p->done = (int64_t)num(o, "done", 0);
    p->failed = (int64_t)num(o, "failed", 0);
    p->cancelled = (int64_t)num(o, "cancelled", 0);
    p->gen_tokens = (int64_t)num(o, "gen_tokens", 0);
    p->prompt_tokens = (int64_t)num(o, "prompt_tokens", 0);
    p->gen_tok_s = num(o, "gen_tok_s", 0);
    p->prompt_tok_s = num(o, "prompt_tok_s", 0);
    p->mean_out = num(o, "mean_out", 0);
    p->inflight_tokens = num(o, "inflight_tokens", 0);
    p->running = (int64_t)num(o, "running", 0);
    p->waiting = (int64_t)num(o, "waiting", 0);
    p->kv_used = (int64_t)num(o, "kv_used", 0);
    p->kv_total = (int64_t)num(o, "kv_total", 0);
    p->elapsed_s = num(o, "elapsed_s", 0);
    p->eta_s = num(o, "eta_s", -1);
    p->runs = 1;
    cJSON_Delete(o);
    return 1;
}

/* 769.5, 3.4k, 12.3M */
static void fmt_rate(char *b, size_t cap, double x)
{
    if (x < 1000)
        snprintf(b, cap, "%.1f", x);
    else if (x < 1e6)
        snprintf(b, cap, "%.1fk", x / 1e3);
    else
        snprintf(b, cap, "%.1fM", x / 1e6);
}

/* m:ss or h:mm:ss; "--" when unknown (< 0) */
static void fmt_dur(char *b, size_t cap, double s)
{
    if (s < 0 || !isfinite(s)) {
        snprintf(b, cap, "--");
        return;
    }
    long t = (long)(s + 0.5), h = t / 3600, m = t / 60 % 60, sec = t % 60;
    if (h)
        snprintf(b, cap, "%ld:%02ld:%02ld", h, m, sec);
    else
        snprintf(b, cap, "%ld:%02ld", m, sec);
}

static double pct(int64_t a, int64_t b)
{
    return b > 0 ? 100.0 * (double)a / (double)b : 0;
}

enum {
    SEG_NAME,
    SEG_BAR,
    SEG_COUNT,
    SEG_FAILED,
    SEG_GEN,
    SEG_PROMPT,
    SEG_SEQS,
    SEG_KV,
    SEG_ELAPSED,
    SEG_ETA,
    SEG_N
};

void runner_progress_line(const struct runner_progress *p, int width, int color, char *buf,
                          size_t cap)
{
    /* dropped first when the line does not fit: higher number */
    static const int drop[SEG_N] = {
        [SEG_NAME] = 9,   [SEG_PROMPT] = 8, [SEG_KV] = 7,  [SEG_SEQS] = 6, [SEG_ELAPSED] = 5,
        [SEG_FAILED] = 4, [SEG_BAR] = 3,    [SEG_ETA] = 2, [SEG_GEN] = 1,  [SEG_COUNT] = 0};
    enum { BAR_MIN = 12, BAR_MAX = 40 };
    char seg[SEG_N][96], r[32], d[32];
    int64_t fin = p->done + p->failed + p->cancelled;
    snprintf(seg[SEG_NAME], sizeof(seg[0]), "%.40s", p->job[0] ? p->job : "all jobs");
    seg[SEG_BAR][0] = 0;
    snprintf(seg[SEG_COUNT], sizeof(seg[0]), "%lld/%lld %.0f%%", (long long)fin,
             (long long)p->total, pct(fin, p->total));
    snprintf(seg[SEG_FAILED], sizeof(seg[0]), "%s%lld failed%s",
             color && p->failed ? RUNNER_TERM_RED : "", (long long)p->failed,
             color && p->failed ? RUNNER_TERM_RESET : "");
    fmt_rate(r, sizeof(r), p->gen_tok_s);
    snprintf(seg[SEG_GEN], sizeof(seg[0]), "gen %s tok/s", r);
    fmt_rate(r, sizeof(r), p->prompt_tok_s);
    snprintf(seg[SEG_PROMPT], sizeof(seg[0]), "prompt %s tok/s", r);
    snprintf(seg[SEG_SEQS], sizeof(seg[0]), "seqs %lld", (long long)p->running);
    snprintf(seg[SEG_KV], sizeof(seg[0]), "KV %.0f%%", pct(p->kv_used, p->kv_total));
    fmt_dur(d, sizeof(d), p->elapsed_s);
    snprintf(seg[SEG_ELAPSED], sizeof(seg[0]), "%s", d);
    fmt_dur(d, sizeof(d), p->eta_s);
    snprintf(seg[SEG_ETA], sizeof(seg[0]), "ETA %s", d);
    int keep[SEG_N], len[SEG_N], total = 0, n = 0;
    for (int i = 0; i < SEG_N; i++) {
        keep[i] = 1;
        len[i] = i == SEG_BAR ? BAR_MIN : (int)runner_term_visible(seg[i]);
        total += len[i];
        n++;
    }
    int sep = 2, room = width - 1;
    while (total + sep * (n - 1) > room && n > 1) {
        int worst = -1;
        for (int i = 0; i < SEG_N; i++)
            if (keep[i] && (worst < 0 || drop[i] > drop[worst]))
                worst = i;
        keep[worst] = 0;
        total -= len[worst];
        n--;
    }
    if (keep[SEG_BAR]) {
        int extra = room - (total + sep * (n - 1)), bw = BAR_MIN + (extra > 0 ? extra : 0);
        double frac = p->total > 0 ? (double)fin / (double)p->total : 0;
        runner_term_bar(seg[SEG_BAR], sizeof(seg[0]), frac, bw > BAR_MAX ? BAR_MAX : bw, color);
    }
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; i < SEG_N && k < cap; i++) {
        if (!keep[i])
            continue;
        int w = snprintf(buf + k, cap - k, "%s%s", k ? (i == SEG_BAR ? " " : "  ") : "", seg[i]);
        if (w < 0)
            break;
        k += (size_t)w;
    }
    if (k >= cap && cap)
        buf[cap - 1] = 0;
}

void runner_progress_log(const struct runner_progress *p, char *buf, size_t cap)
{
    char name[sizeof(p->job)], eta[32];
    snprintf(name, sizeof(name), "%s", p->job[0] ? p->job : "all");
    for (char *c = name; *c; c++)
        if ((unsigned char)*c <= ' ' || *c == '=' || *c == '"' || *c == '\'' || *c == 0x7f)
            *c = '_';
    if (p->eta_s >= 0)
        snprintf(eta, sizeof(eta), "%.0f", p->eta_s);
    else
        snprintf(eta, sizeof(eta), "--");
    int64_t fin = p->done + p->failed + p->cancelled;
    snprintf(buf, cap,
             "progress: job=%s done=%lld failed=%lld cancelled=%lld total=%lld pct=%.1f "
             "gen_tok_s=%.1f prompt_tok_s=%.1f gen_tokens=%lld prompt_tokens=%lld running=%lld "
             "waiting=%lld kv_pct=%.1f runs=%lld elapsed_s=%.1f eta_s=%s",
             name, (long long)p->done, (long long)p->failed, (long long)p->cancelled,
             (long long)p->total, pct(fin, p->total), p->gen_tok_s, p->prompt_tok_s,
             (long long)p->gen_tokens, (long long)p->prompt_tokens, (long long)p->running,
             (long long)p->waiting, pct(p->kv_used, p->kv_total), (long long)p->runs, p->elapsed_s,
             eta);
}

void runner_progress_summary(const struct runner_progress *p, char *buf, size_t cap)
{
    char d[32];
    fmt_dur(d, sizeof(d), p->elapsed_s);
    double el = p->elapsed_s > 0 ? p->elapsed_s : 0;
    snprintf(buf, cap,
             "job %s: %lld/%lld finished (%lld failed, %lld cancelled) in %s; %lld tokens "
             "sampled (%.1f tok/s), %lld prompt tokens computed (%.1f tok/s)",
             p->job[0] ? p->job : "(all jobs)", (long long)(p->done + p->failed + p->cancelled),
             (long long)p->total, (long long)p->failed, (long long)p->cancelled, d,
             (long long)p->gen_tokens, el > 0 ? (double)p->gen_tokens / el : 0,
             (long long)p->prompt_tokens, el > 0 ? (double)p->prompt_tokens / el : 0);
}

void runner_rate_reset(struct runner_rate *r)
{
    memset(r, 0, sizeof(*r));
}

void runner_rate_add(struct runner_rate *r, double t, double v)
{
    /* a sample less than a second after the one before the newest replaces the newest, so the
     * window stays ~10 s however often this is called */
    if (r->n >= 2) {
        int prev = (r->head + RUNNER_RATE_SAMPLES - 1) % RUNNER_RATE_SAMPLES;
        if (t - r->t[prev] < 1.0) {
            r->t[r->head] = t;
            r->v[r->head] = v;
            return;
        }
    }
    r->head = r->n ? (r->head + 1) % RUNNER_RATE_SAMPLES : 0;
    r->t[r->head] = t;
    r->v[r->head] = v;
    if (r->n < RUNNER_RATE_SAMPLES)
        r->n++;
}

double runner_rate_get(const struct runner_rate *r)
{
    if (r->n < 2)
        return 0;
    int old = (r->head + RUNNER_RATE_SAMPLES - (r->n - 1)) % RUNNER_RATE_SAMPLES;
    double dt = r->t[r->head] - r->t[old];
    return dt > 0 ? (r->v[r->head] - r->v[old]) / dt : 0;
}
