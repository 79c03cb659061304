/* Per-request sampling and stop-string matching (see engine/sampler.h): parameters, the RNG,
 * the sampler's scratch, penalties and the sampling chain (its ranking and whole-row passes are
 * in engine/sampler_rows.c), stop strings. Everything here is a pure function of one request's
 * inputs: scratch is cleared after each call, sums run in a fixed order, and ranking ties always
 * go to the lowest token id. */
#include "engine/sampler_internal.h"

#include "common/philox.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- Parameters ------------------------------------------------------------------------ */

void engine_sampling_default(struct engine_sampling *p)
{
    memset(p, 0, sizeof(*p));
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = -1;
}

enum status engine_sampling_validate(const struct engine_sampling *p, struct err_detail *err)
{
    /* Written as !(in range) so that NaN fails every check. */
    if (!(p->temperature >= 0.0f && p->temperature <= 2.0f))
        return err_set(err, ST_ERR_INVALID_ARG, "temperature %g not in [0, 2]",
                       (double)p->temperature);
    if (p->top_k < 0)
        return err_set(err, ST_ERR_INVALID_ARG, "top_k %d is negative", (int)p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return err_set(err, ST_ERR_INVALID_ARG, "top_p %g not in (0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return err_set(err, ST_ERR_INVALID_ARG, "min_p %g not in [0, 1]", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f && isfinite(p->repeat_penalty)))
        return err_set(err, ST_ERR_INVALID_ARG, "repeat_penalty %g must be finite and > 0",
                       (double)p->repeat_penalty);
    if (p->repeat_last_n < -1)
        return err_set(err, ST_ERR_INVALID_ARG, "repeat_last_n %d is below -1",
                       (int)p->repeat_last_n);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return err_set(err, ST_ERR_INVALID_ARG, "frequency_penalty %g not in [-2, 2]",
                       (double)p->frequency_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return err_set(err, ST_ERR_INVALID_ARG, "presence_penalty %g not in [-2, 2]",
                       (double)p->presence_penalty);
    return ST_OK;
}

/* ---- Random numbers: a Philox key per request ------------------------------------------ */

/* Counter word 1 of each kind of draw, so that no two uses share a counter. */
#define RNG_STREAM_SAMPLE 0x53414d50u /* engine_rng_at */
#define RNG_STREAM_PLAIN  0x504c4149u /* engine_rng_next */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void engine_rng_seed(struct engine_rng *r, uint64_t seed, const char *request_id, size_t id_len)
{
    /* FNV-1a over the id bytes, folded into a scrambled seed, scrambled again */
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < id_len; i++) {
        h ^= (unsigned char)request_id[i];
        h *= 0x100000001b3ull;
    }
    uint64_t x = seed;
    x = splitmix64(&x) ^ h;
    r->key = splitmix64(&x);
    r->ctr = 0;
}

void engine_rng_choice(struct engine_rng *r, uint32_t choice)
{
    if (!choice)
        return;
    uint64_t x = r->key ^ ((uint64_t)choice * 0x9e3779b97f4a7c15ull);
    x = splitmix64(&x) ^ 0x6a09e667f3bcc909ull; /* a constant of its own: not a seed's mix */
    r->key = splitmix64(&x);
}

double engine_rng_at(const struct engine_rng *r, uint64_t pos, uint32_t draw)
{
    return philox_uniform(r->key, pos, (uint64_t)draw << 32 | RNG_STREAM_SAMPLE);
}

uint64_t engine_rng_next(struct engine_rng *r)
{
    return philox_bits(r->key, r->ctr++, RNG_STREAM_PLAIN);
}

double engine_rng_uniform(struct engine_rng *r)
{
    return (double)(engine_rng_next(r) >> 11) * 0x1.0p-53;
}

/* ---- Sampler --------------------------------------------------------------------------- */

enum status engine_sampler_init(struct engine_sampler **out, int32_t n_vocab,
                                struct err_detail *err)
{
    *out = NULL;
    if (n_vocab <= 0)
        return err_set(err, ST_ERR_INVALID_ARG, "sampler: n_vocab %d must be positive",
                       (int)n_vocab);
    struct engine_sampler *s = calloc(1, sizeof(*s));
    if (!s)
        return err_set(err, ST_ERR_NOMEM, "sampler: out of memory");
    size_t n = (size_t)n_vocab;
    s->n_vocab = n_vocab;
    s->max_cands = ENGINE_SAMPLE_CANDS;
    s->cand = malloc(n * sizeof(*s->cand));
    s->tmp = malloc(n * sizeof(*s->tmp));
    s->count = calloc(n, sizeof(*s->count));
    s->touched = malloc(n * sizeof(*s->touched));
    s->counts = malloc(n * sizeof(*s->counts));
    s->zc = malloc((n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK * sizeof(*s->zc));
    s->tmp_f = malloc((n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK * sizeof(*s->tmp_f));
    s->wtmp = malloc((n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK * sizeof(*s->wtmp));
    if (!s->cand || !s->tmp || !s->count || !s->touched || !s->counts || !s->zc || !s->tmp_f ||
        !s->wtmp) {
        engine_sampler_free(s);
        return err_set(err, ST_ERR_NOMEM, "sampler: out of memory for %d tokens", (int)n_vocab);
    }
    *out = s;
    return ST_OK;
}

void engine_sampler_free(struct engine_sampler *s)
{
    if (!s)
        return;
    free(s->cand);
    free(s->tmp);
    free(s->count);
    free(s->touched);
    free(s->counts);
    free(s->zc);
    free(s->tmp_f);
    free(s->wtmp);
    free(s);
}

size_t engine_sampler_n_kept(const struct engine_sampler *s)
{
    return s->n_kept;
}

int32_t engine_sampler_kept(const struct engine_sampler *s, size_t i, double *prob)
{
    assert(i < s->n_kept);
    if (s->row) { /* every token kept, in id order */
        if (prob)
            *prob = engine_sampler_cand_weight(s->row[i], s->row_max) / s->kept_total;
        return (int32_t)i;
    }
    if (prob)
        *prob = s->cand[i].w / s->kept_total;
    return s->cand[i].id;
}

void engine_sampler_set_max_cands(struct engine_sampler *s, size_t max)
{
    s->max_cands = max;
}

void engine_sampler_take_counts(struct engine_sampler *s, uint64_t *fast, uint64_t *fallback)
{
    *fast = s->n_fast;
    *fallback = s->n_slow;
    s->n_fast = s->n_slow = 0;
}

/* Whether p's penalties can change a logit at all. */
static int penalizes(const struct engine_sampling *p)
{
    return p->repeat_last_n != 0 && (p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f ||
                                     p->presence_penalty != 0.0f);
}

int engine_sampling_is_argmax(const struct engine_sampling *p)
{
    return p->temperature == 0.0f && !penalizes(p);
}

size_t engine_sampler_counts(struct engine_sampler *s, const struct engine_sampling *p,
                             const int32_t *history, size_t n_history, int32_t *ids,
                             int32_t *counts)
{
    if (!penalizes(p) || n_history == 0)
        return 0;
    size_t start = 0;
    if (p->repeat_last_n > 0 && (size_t)p->repeat_last_n < n_history)
        start = n_history - (size_t)p->repeat_last_n;
    /* s->count[t]: 0 unseen, else 1 + its generated occurrences */
    const int rep = p->repeat_penalty != 1.0f;
    size_t n = 0;
    for (size_t i = start; i < n_history; i++) {
        int32_t t = history[i];
        const int gen = i >= (size_t)p->counted_from;
        if (t < 0 || t >= s->n_vocab || !(gen || rep))
            continue;
        if (s->count[t] == 0) {
            ids[n++] = t;
            s->count[t] = 1;
        }
        s->count[t] += gen;
    }
    for (size_t j = 0; j < n; j++) {
        counts[j] = s->count[ids[j]] - 1;
        s->count[ids[j]] = 0;
    }
    return n;
}

/* Repetition, frequency and presence penalties over the last repeat_last_n history tokens,
 * applied in place (engine_sampler_counts: O(window), not O(n_vocab)). */
static void apply_penalties(struct engine_sampler *s, const struct engine_sampling *p,
                            float *logits, const int32_t *history, size_t n_history)
{
    const size_t n = engine_sampler_counts(s, p, history, n_history, s->touched, s->counts);
    for (size_t j = 0; j < n; j++)
        logits[s->touched[j]] = engine_sampler_penalise(p, logits[s->touched[j]], s->counts[j]);
}

float engine_sampler_penalise(const struct engine_sampling *p, float l, int32_t count)
{
    if (p->repeat_penalty != 1.0f)
        l = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
    return l - ((float)count * p->frequency_penalty + (count > 0 ? p->presence_penalty : 0.0f));
}

int32_t engine_sample(struct engine_sampler *s, const struct engine_sampling *p,
                      const struct engine_rng *rng, uint64_t pos, float *logits,
                      const int32_t *history, size_t n_history, float *logprob)
{
    const double u = p->temperature == 0.0f ? 0.0 : engine_rng_at(rng, pos, 0);
    return engine_sample_u(s, p, u, logits, history, n_history, logprob);
}

static int32_t sample_scaled(struct engine_sampler *s, const struct engine_sampling *p,
                             double u_draw, float *logits, float mx, double total, float *logprob);
static int32_t draw_cands(struct engine_sampler *s, const struct engine_sampling *p, double u_draw,
                          size_t m, double total, float *logprob);

int32_t engine_sample_u(struct engine_sampler *s, const struct engine_sampling *p, double u_draw,
                        float *logits, const int32_t *history, size_t n_history, float *logprob)
{
    assert(p->temperature >= 0.0f && p->top_k >= 0 && p->top_p > 0.0f && p->top_p <= 1.0f);
    assert(p->min_p >= 0.0f && p->min_p <= 1.0f && p->repeat_penalty > 0.0f);
    const size_t n = (size_t)s->n_vocab;
    const float t = p->temperature;

    s->row = NULL;
    apply_penalties(s, p, logits, history, n_history);
    if (t == 0.0f)
        return engine_sampler_greedy(s, logits, logprob);

    double total = 0.0;
    if (!(p->top_k > 0 && (size_t)p->top_k < n)) { /* the whole-row pass, then its draw */
        const float mx = engine_sampler_scale_chunks(s, logits, t, &total);
        return sample_scaled(s, p, u_draw, logits, mx, total, logprob);
    }
    /* top_k: the k best by penalised logit (temperature touches only them), ranked with their
     * weights in cand[0 .. k) */
    const size_t m = (size_t)p->top_k;
    engine_sampler_select_top_k(s, logits, m);
    for (size_t j = 0; j < m; j++)
        logits[s->cand[j].id] = t == 1.0f ? s->cand[j].w : s->cand[j].w / t;
    const float mx = logits[s->cand[0].id]; /* dividing by t > 0 keeps the best on top */
    for (size_t j = 0; j < m; j++) {
        s->cand[j].w = engine_sampler_cand_weight(logits[s->cand[j].id], mx);
        total += s->cand[j].w;
    }
    /* weights can tie where logits did not: re-rank by id */
    engine_sampler_insertion_sort(s->cand, m);
    return draw_cands(s, p, u_draw, m, total, logprob);
}

int32_t engine_sample_chunked(struct engine_sampler *s, const struct engine_sampling *p, double u,
                              float *logits, const double *zc, const float *mc, float *logprob)
{
    assert(p->temperature > 0.0f && !(p->top_k > 0 && p->top_k < s->n_vocab));
    assert(p->top_p > 0.0f && p->top_p <= 1.0f && p->min_p >= 0.0f && p->min_p <= 1.0f);
    s->row = NULL;
    double total;
    const float mx = engine_sampler_combine(s, zc, mc, &total);
    return sample_scaled(s, p, u, logits, mx, total, logprob);
}

/* engine_sample after the whole-row pass (scaled row logits, maximum mx, weights summing to
 * total; s->zc the chunk weights): the whole row, or the candidates truncation keeps. */
static int32_t sample_scaled(struct engine_sampler *s, const struct engine_sampling *p,
                             double u_draw, float *logits, float mx, double total, float *logprob)
{
    const size_t n = (size_t)s->n_vocab;
    if (p->top_p >= 1.0f && p->min_p <= 0.0f) { /* nothing truncates: the whole row */
        int32_t id = engine_sampler_draw_row(s, logits, mx, total, u_draw);
        if (logprob)
            *logprob =
                (float)(log((double)engine_sampler_cand_weight(logits[id], mx)) - log(total));
        s->row = logits;
        s->row_max = mx;
        s->n_kept = n;
        s->kept_total = total;
        return id;
    }
    return draw_cands(s, p, u_draw, engine_sampler_truncate_row(s, p, logits, mx, total), total,
                      logprob);
}

/* engine_sample's end: cand[0 .. m) ranked with their weights (the row's summing to total),
 * truncated by top_p and min_p, renormalised and drawn from at u_draw. */
static int32_t draw_cands(struct engine_sampler *s, const struct engine_sampling *p, double u_draw,
                          size_t m, double total, float *logprob)
{
    const size_t n = (size_t)s->n_vocab;
    const size_t m_weighed = m;

    /* top_p: the smallest ranked prefix whose mass reaches top_p of the total. */
    if (p->top_p < 1.0f) {
        double target = (double)p->top_p * total, cum = 0.0;
        for (size_t j = 0; j < m; j++) {
            cum += s->cand[j].w;
            if (cum >= target) {
                m = j + 1;
                break;
            }
        }
    }

    /* min_p: p_i >= min_p * p_max is w_i >= min_p, as the most likely weight is exactly 1. */
    if (p->min_p > 0.0f) {
        size_t kept = 0;
        while (kept < m && s->cand[kept].w >= p->min_p)
            kept++;
        m = kept;
    }

    /* Renormalise and draw with one uniform. */
    double kept_total = total;
    if (m != m_weighed || !(p->top_k > 0 && (size_t)p->top_k < n)) {
        kept_total = 0.0;
        for (size_t j = 0; j < m; j++)
            kept_total += s->cand[j].w;
    }
    double u = u_draw * kept_total, cum = 0.0;
    size_t pick = 0, last_pos = 0;
    int found = 0;
    for (size_t j = 0; j < m; j++) {
        cum += s->cand[j].w;
        if (s->cand[j].w > 0.0f)
            last_pos = j;
        if (u < cum) {
            pick = j;
            found = 1;
            break;
        }
    }
    if (!found)
        pick = last_pos; /* u at the very top, past the sum by rounding: last weighted token */

    int32_t id = s->cand[pick].id;
    if (logprob)
        *logprob = (float)(log((double)s->cand[pick].w) - log(kept_total));
    s->n_kept = m;
    s->kept_total = kept_total;
    return id;
}

/* ---- Stop strings ---------------------------------------------------------------------- */

struct engine_stop {
    size_t n;       /* number of stop strings */
    char *blob;     /* all stop strings back to back, owned */
    size_t *off;    /* n offsets of each string in blob, owned */
    size_t *len;    /* n lengths in bytes (> 0), owned */
    size_t max_len; /* longest stop string */
    char *win;      /* 2 * max_len bytes: the last bytes of the text, owned */
    size_t win_len; /* valid bytes in win (at least min(text so far, max_len)) */
    size_t pending; /* bytes pushed, not yet released (under max_len between pushes) */
    int matched;    /* index of the stop string that matched, -1 before */
};

enum status engine_stop_init(struct engine_stop **out, const char *const *stops, size_t n,
                             struct err_detail *err)
{
    *out = NULL;
    size_t total = 0, max_len = 1;
    for (size_t i = 0; i < n; i++) {
        if (!stops[i] || !stops[i][0])
            return err_set(err, ST_ERR_INVALID_ARG, "stop string %zu is empty", i);
        size_t l = 0;
        while (l <= ENGINE_STOP_MAX_LEN && stops[i][l])
            l++;
        if (l > ENGINE_STOP_MAX_LEN)
            return err_set(err, ST_ERR_INVALID_ARG, "stop string %zu is longer than %d bytes", i,
                           ENGINE_STOP_MAX_LEN);
        total += l;
        if (l > max_len)
            max_len = l;
    }
    struct engine_stop *s = calloc(1, sizeof(*s));
    if (!s)
        return err_set(err, ST_ERR_NOMEM, "stop: out of memory");
    s->n = n;
    s->max_len = max_len;
    s->matched = -1;
    s->blob = malloc(total + 1);
    s->off = malloc((n + 1) * sizeof(*s->off));
    s->len = malloc((n + 1) * sizeof(*s->len));
    s->win = malloc(2 * max_len);
    if (!s->blob || !s->off || !s->len || !s->win) {
        engine_stop_free(s);
        return err_set(err, ST_ERR_NOMEM, "stop: out of memory");
    }
    size_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        s->len[i] = strlen(stops[i]);
        s->off[i] = pos;
        memcpy(s->blob + pos, stops[i], s->len[i]);
        pos += s->len[i];
    }
    *out = s;
    return ST_OK;
}

void engine_stop_free(struct engine_stop *s)
{
    if (!s)
        return;
    free(s->blob);
    free(s->off);
    free(s->len);
    free(s->win);
    free(s);
}

size_t engine_stop_pending(const struct engine_stop *s)
{
    return s->matched >= 0 ? 0 : s->pending;
}

int engine_stop_matched(const struct engine_stop *s)
{
    return s->matched;
}

/* Length of the longest pending suffix that is a proper prefix of some stop string: the
 * bytes that must be held back because a later push could complete a stop with them. */
static size_t stop_holdback(const struct engine_stop *s)
{
    size_t h = s->pending < s->max_len - 1 ? s->pending : s->max_len - 1;
    for (; h > 0; h--) {
        const char *tail = s->win + s->win_len - h;
        for (size_t k = 0; k < s->n; k++)
            if (s->len[k] > h && memcmp(tail, s->blob + s->off[k], h) == 0)
                return h;
    }
    return 0;
}

int engine_stop_push(struct engine_stop *s, const char *text, size_t len, size_t *emit_len)
{
    *emit_len = 0;
    if (s->matched >= 0)
        return 1;
    for (size_t i = 0; i < len; i++) {
        if (s->win_len == 2 * s->max_len) {
            /* keep the last max_len bytes: enough for any stop ending at the next byte */
            memmove(s->win, s->win + s->max_len, s->max_len);
            s->win_len = s->max_len;
        }
        s->win[s->win_len++] = text[i];
        s->pending++;
        /* Does a stop string end at this byte? Prefer the longest. Matches never start
         * before the pending text: those bytes were released only because no stop string
         * could begin there. */
        size_t best = 0;
        int which = -1;
        for (size_t k = 0; k < s->n; k++) {
            size_t l = s->len[k];
            if (l > best && l <= s->pending &&
                memcmp(s->win + s->win_len - l, s->blob + s->off[k], l) == 0) {
                best = l;
                which = (int)k;
            }
        }
        if (which >= 0) {
            *emit_len = s->pending - best;
            s->pending = 0;
            s->matched = which;
            return 1;
        }
    }
    size_t hold = stop_holdback(s);
    *emit_len = s->pending - hold;
    s->pending = hold;
    return 0;
}

void engine_logprobs(const float *logits, int32_t n_vocab, int32_t chosen, int k,
                     float *chosen_lp, int32_t *top_id, float *top_lp)
{
    const float mx = engine_sampler_row_max(logits, (size_t)n_vocab);
    const double norm = (double)mx + log(engine_sampler_weight_sum(logits, (size_t)n_vocab, mx));
    const float lc = logits[chosen];
    *chosen_lp = lc == lc ? (float)((double)lc - norm) : -INFINITY;
    if (k > n_vocab)
        k = n_vocab;
    const int n = engine_sampler_top_values(logits, (size_t)n_vocab, k, top_id, top_lp);
    for (int j = 0; j < n; j++)
        top_lp[j] = (float)((double)top_lp[j] - norm);
}
