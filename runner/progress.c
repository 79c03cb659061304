/* The three printed forms of a job's progress numbers (runner/progress.h). */
#include "runner/progress.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "runner/term.h"

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

void runner_progress_line(const struct batch_progress *p, int width, int color, char *buf,
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

void runner_progress_log(const struct batch_progress *p, char *buf, size_t cap)
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

void runner_progress_summary(const struct batch_progress *p, char *buf, size_t cap)
{
    char d[32];
    fmt_dur(d, sizeof(d), p->elapsed_s);
    double el = p->elapsed_s > 0 ? p->elapsed_s : 0;
    char cancelled[48] = "";
    if (p->cancelled)
        snprintf(cancelled, sizeof(cancelled), ", %lld cancelled,", (long long)p->cancelled);
    snprintf(buf, cap,
             "job %s: %lld/%lld finished (%lld failed)%s in %s; %lld tokens sampled (%.1f tok/s), "
             "%lld prompt tokens %s (%.1f tok/s)",
             p->job[0] ? p->job : "(all jobs)", (long long)(p->done + p->failed),
             (long long)p->total, (long long)p->failed, cancelled, d, (long long)p->gen_tokens,
             el > 0 ? (double)p->gen_tokens / el : 0, (long long)p->prompt_tokens,
             p->prompt_all ? "in finished requests" : "computed",
             el > 0 ? (double)p->prompt_tokens / el : 0);
}
