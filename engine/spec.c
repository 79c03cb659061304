/* Speculative decoding's drafters, confidence bins and step-cost model (engine/spec.h). */
#include "engine/spec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>


#define WINDOW 4096   /* tokens of its own the ngram drafter looks back over */
#define MAX_CANDS 32  /* earlier occurrences a draft is voted from */
#define MAX_CHAIN 64  /* hash-chain entries the suffix drafter visits */
#define MAX_MATCH 16  /* match length counted at most */
#define PROMPT_TAIL 8 /* prompt tokens learned before each output */
#define HASH_BITS 18

/* bins: drafter x depth x vote share x support x match length x recent acceptance */
#define N_DEPTH 8
#define N_SHARE 4
#define N_SUPPORT 3
#define N_MATCH 3
#define N_RECENT 4
#define N_SRC 3 /* enum engine_spec_src */
#define N_FINE (N_SRC * N_DEPTH * N_SHARE * N_SUPPORT * N_MATCH * N_RECENT)
#define N_COARSE (N_SRC * N_DEPTH * N_SHARE)
#define SHRINK 8.0 /* observations a fine bin needs to weigh as much as its coarse bin */
#define N_ECE 10
#define KIND_DECAY (1.0 - 1.0 / 128)

struct cand {
    int match;                    /* tokens matched before the continuation */
    int n;                        /* continuation tokens */
    int32_t t[ENGINE_SPEC_MAX_K]; /* the continuation */
};

struct engine_spec {
    int drafters;                 /* ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX */
    /* job index: ring of tokens (-1 separates outputs) with hash chains over token pairs */
    int32_t *ring;
    uint64_t *prev;               /* per ring slot: 1 + previous position with its pair hash */
    uint64_t *head;               /* per hash: 1 + latest position */
    uint64_t n_ring;              /* tokens ever written */
    /* confidence bins: conditional acceptances and tries */
    double acc[N_FINE], tried[N_FINE], cacc[N_COARSE], ctried[N_COARSE];
    /* survival calibration: predicted and observed sums per bin of predicted survival */
    double ece_pred[N_ECE], ece_obs[N_ECE];
    uint64_t ece_n[N_ECE], n_obs;
    /* a draft model's paths for sampled requests, by kind (DRAW, ARGMAX): first tokens verified,
     * the same and those accepted counted with a decay of KIND_DECAY per observation of the kind
     * (its last few hundred weigh) */
    uint64_t kind_n[3];
    double kind_tried[3], kind_acc[3];
    /* step cost per batch size */
    int max_b;
    double *t_avg;                /* max_b + 1 entries: real steps' average, 0 = none */
    double *w_avg;                /* the warm-up's measurements */
    double *w_tab;                /* w_avg interpolated */
    double *t_tab;                /* the estimate (rebuild) */
    int *near;                    /* per size: the nearest size real steps measured */
    int dirty;                    /* t_tab out of date */
    struct cand cands[MAX_CANDS];
};

enum status engine_spec_new(struct engine_spec **out, int drafters, int max_batch_tokens,
                            struct err_detail *err)
{
    *out = NULL;
    struct engine_spec *sp = calloc(1, sizeof(*sp));
    if (!sp)
        return err_set(err, ST_ERR_NOMEM, "no memory for speculative decoding");
    sp->drafters = drafters;
    sp->max_b = max_batch_tokens;
    sp->t_avg = calloc((size_t)max_batch_tokens + 1, sizeof(double));
    sp->t_tab = calloc((size_t)max_batch_tokens + 1, sizeof(double));
    sp->w_avg = calloc((size_t)max_batch_tokens + 1, sizeof(double));
    sp->w_tab = calloc((size_t)max_batch_tokens + 1, sizeof(double));
    sp->near = calloc((size_t)max_batch_tokens + 1, sizeof(int));
    int ok = sp->t_avg && sp->t_tab && sp->w_avg && sp->w_tab && sp->near;
    if (ok && (drafters & ENGINE_SPEC_SUFFIX)) {
        sp->ring = malloc(sizeof(int32_t) * ENGINE_SPEC_INDEX_TOKENS);
        sp->prev = malloc(sizeof(uint64_t) * ENGINE_SPEC_INDEX_TOKENS);
        sp->head = calloc((size_t)1 << HASH_BITS, sizeof(uint64_t));
        ok = sp->ring && sp->prev && sp->head;
    }
    if (!ok) {
        engine_spec_free(sp);
        return err_set(err, ST_ERR_NOMEM, "no memory for speculative decoding");
    }
    *out = sp;
    return ST_OK;
}

void engine_spec_free(struct engine_spec *sp)
{
    if (!sp)
        return;
    free(sp->ring);
    free(sp->prev);
    free(sp->head);
    free(sp->t_avg);
    free(sp->t_tab);
    free(sp->w_avg);
    free(sp->w_tab);
    free(sp->near);
    free(sp);
}

/* ---- the job index ---- */

static uint32_t pair_hash(int32_t a, int32_t b)
{
    uint64_t h = (uint64_t)(uint32_t)a * 0x9E3779B97F4A7C15ull ^
                 (uint64_t)(uint32_t)b * 0xC2B2AE3D27D4EB4Full;
    return (uint32_t)(h >> (64 - HASH_BITS));
}

/* Ring position p still holds its token. */
static int ring_valid(const struct engine_spec *sp, uint64_t p)
{
    return p < sp->n_ring && sp->n_ring - p <= ENGINE_SPEC_INDEX_TOKENS;
}

static int32_t ring_at(const struct engine_spec *sp, uint64_t p)
{
    return sp->ring[p % ENGINE_SPEC_INDEX_TOKENS];
}

static void ring_push(struct engine_spec *sp, int32_t t)
{
    uint64_t p = sp->n_ring++;
    size_t slot = p % ENGINE_SPEC_INDEX_TOKENS;
    sp->ring[slot] = t;
    sp->prev[slot] = 0;
    if (t < 0 || p == 0 || !ring_valid(sp, p - 1) || ring_at(sp, p - 1) < 0)
        return;
    uint32_t h = pair_hash(ring_at(sp, p - 1), t);
    sp->prev[slot] = sp->head[h];
    sp->head[h] = p + 1;
}

void engine_spec_learn(struct engine_spec *sp, const int32_t *prompt, size_t n_prompt,
                       const int32_t *out, size_t n_out)
{
    if (!sp || !(sp->drafters & ENGINE_SPEC_SUFFIX) || !n_out)
        return;
    size_t from = n_prompt > PROMPT_TAIL ? n_prompt - PROMPT_TAIL : 0;
    for (size_t i = from; i < n_prompt; i++)
        ring_push(sp, prompt[i]);
    for (size_t i = 0; i < n_out; i++)
        ring_push(sp, out[i]);
    ring_push(sp, -1);
}

/* ---- candidates ---- */

/* Earlier occurrences of tok's last two tokens in tok itself, most recent first. */
static int cands_self(struct engine_spec *sp, const int32_t *tok, size_t n, int k)
{
    int nc = 0;
    if (n < 3)
        return 0;
    size_t lo = n - 1 > WINDOW ? n - 1 - WINDOW : 1;
    for (size_t p = n - 2; p >= lo && nc < MAX_CANDS; p--) {
        if (tok[p] != tok[n - 1] || tok[p - 1] != tok[n - 2])
            continue;
        struct cand *c = &sp->cands[nc++];
        c->match = 2;
        while (c->match < MAX_MATCH && (size_t)c->match <= p &&
               tok[p - (size_t)c->match] == tok[n - 1 - (size_t)c->match])
            c->match++;
        c->n = 0;
        for (size_t q = p + 1; q < n && c->n < k; q++)
            c->t[c->n++] = tok[q];
    }
    return nc;
}

/* Occurrences of tok's last two tokens in the job index, most recent first. */
static int cands_job(struct engine_spec *sp, const int32_t *tok, size_t n, int k)
{
    int nc = 0;
    if (n < 2 || !sp->n_ring)
        return 0;
    uint64_t p1 = sp->head[pair_hash(tok[n - 2], tok[n - 1])];
    for (int steps = 0; p1 && steps < MAX_CHAIN && nc < MAX_CANDS; steps++) {
        uint64_t p = p1 - 1;
        if (!ring_valid(sp, p) || p == 0 || !ring_valid(sp, p - 1))
            break; /* the chain only gets older */
        p1 = sp->prev[p % ENGINE_SPEC_INDEX_TOKENS];
        if (ring_at(sp, p) != tok[n - 1] || ring_at(sp, p - 1) != tok[n - 2])
            continue; /* hash collision */
        struct cand *c = &sp->cands[nc];
        c->match = 2;
        while (c->match < MAX_MATCH && (size_t)c->match < n && p >= (uint64_t)c->match &&
               ring_valid(sp, p - (uint64_t)c->match) &&
               ring_at(sp, p - (uint64_t)c->match) == tok[n - 1 - (size_t)c->match])
            c->match++;
        c->n = 0;
        for (uint64_t q = p + 1; ring_valid(sp, q) && ring_at(sp, q) >= 0 && c->n < k; q++)
            c->t[c->n++] = ring_at(sp, q);
        nc += c->n > 0;
    }
    return nc;
}

static int bucket_share(double s) { return s >= 1.0 ? 3 : s >= 0.75 ? 2 : s >= 0.5 ? 1 : 0; }
static int bucket_support(int n) { return n <= 1 ? 0 : n <= 3 ? 1 : 2; }
static int bucket_match(int m) { return m <= 2 ? 0 : m <= 5 ? 1 : 2; }
static int bucket_recent(float r) { return r < 0 ? 0 : r < 0.3f ? 1 : r < 0.7f ? 2 : 3; }

static double coarse_rate(const struct engine_spec *sp, int c)
{
    return (sp->cacc[c] + 1.0) / (sp->ctried[c] + 2.0);
}

static double fine_rate(const struct engine_spec *sp, int f)
{
    int c = f / (N_SUPPORT * N_MATCH * N_RECENT);
    return (sp->acc[f] + SHRINK * coarse_rate(sp, c)) / (sp->tried[f] + SHRINK);
}

/* fine_rate plus an exploration bonus that fades as the bin's coarse bin gathers evidence
 * (1 / sqrt(1 + its tries), capped at 0.99): a drafter nobody has tried yet looks promising
 * enough to be verified a few times, so a budget that trusts only proven drafts can still
 * learn that a job's drafts are good. */
static double optimistic_rate(const struct engine_spec *sp, int f)
{
    int c = f / (N_SUPPORT * N_MATCH * N_RECENT);
    double r = fine_rate(sp, f) + 1.0 / sqrt(1.0 + sp->ctried[c]);
    return r < 0.99 ? r : 0.99;
}

static int bin_of(int src, int depth, double share, int support, int match, float recent)
{
    return ((((src * N_DEPTH + (depth < N_DEPTH ? depth : N_DEPTH - 1)) * N_SHARE +
              bucket_share(share)) * N_SUPPORT + bucket_support(support)) * N_MATCH +
            bucket_match(match)) * N_RECENT + bucket_recent(recent);
}

/* Token j of d falls in bin f: its estimates. */
static void rate(const struct engine_spec *sp, struct engine_draft *d, int j, int f)
{
    d->bin[j] = (uint16_t)f;
    d->c[j] = (float)fine_rate(sp, f);
    d->u[j] = (float)optimistic_rate(sp, f);
}

void engine_spec_rate_model(const struct engine_spec *sp, struct engine_draft *d, int j, float prob,
                            int kind, float recent)
{
    /* (the support dimension, unused by a draft model otherwise, tells the kinds apart: 1, 2
     * and 4 fall in its buckets 0, 1 and 2) */
    rate(sp, d, j, bin_of(ENGINE_SPEC_SRC_MODEL, j, prob, 1 << kind, 0, recent));
}

/* The kind of a draft model's path (ENGINE_SPEC_KIND_*) from its first token's bin. */
static int kind_of(int f)
{
    return f / (N_MATCH * N_RECENT) % N_SUPPORT;
}

int engine_spec_model_kind(const struct engine_spec *sp, uint64_t seq, uint32_t path)
{
    /* a coin per (sequence, path): splitmix64's finaliser */
    uint64_t h = seq * 0x9E3779B97F4A7C15ull + path + 1;
    h = (h ^ h >> 30) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ h >> 27) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    enum { D = ENGINE_SPEC_KIND_DRAW, A = ENGINE_SPEC_KIND_ARGMAX };
    if (sp->kind_n[D] < ENGINE_SPEC_EXPLORE || sp->kind_n[A] < ENGINE_SPEC_EXPLORE)
        return h & 1 ? A : D;
    const double *t = sp->kind_tried, *a = sp->kind_acc;
    const int best = (a[D] + 1) / (t[D] + 2) >= (a[A] + 1) / (t[A] + 2) ? D : A;
    return (h >> 1) % 16 == 0 ? D + A - best : best;
}

/* Vote one path out of nc candidates into d; returns its expected accepted length. */
static double vote(struct engine_spec *sp, int nc, int src, float recent,
                   struct engine_draft *d)
{
    d->n = 0;
    d->src = src;
    if (!nc)
        return 0;
    int best = 0;
    for (int i = 0; i < nc; i++)
        if (sp->cands[i].match > best)
            best = sp->cands[i].match;
    const int thr = best < 8 ? best : 8;
    uint8_t alive[MAX_CANDS];
    for (int i = 0; i < nc; i++)
        alive[i] = sp->cands[i].match >= thr;
    double surv = 1, expect = 0;
    for (int depth = 0; depth < ENGINE_SPEC_MAX_K; depth++) {
        int total = 0, top = -1, top_n = 0;
        for (int i = 0; i < nc; i++) {
            if (!alive[i] || sp->cands[i].n <= depth)
                continue;
            total++;
            int32_t t = sp->cands[i].t[depth];
            int same = 0, seen_before = 0;
            for (int j = 0; j < nc; j++)
                if (alive[j] && sp->cands[j].n > depth && sp->cands[j].t[depth] == t) {
                    same++;
                    seen_before |= j < i;
                }
            if (!seen_before && same > top_n) {
                top_n = same;
                top = sp->cands[i].t[depth];
            }
        }
        if (!total)
            break;
        d->tok[depth] = top;
        rate(sp, d, depth, bin_of(src, depth, (double)top_n / total, total, thr, recent));
        d->n = depth + 1;
        surv *= d->c[depth];
        expect += surv;
        for (int i = 0; i < nc; i++)
            alive[i] = alive[i] && sp->cands[i].n > depth && sp->cands[i].t[depth] == top;
    }
    return expect;
}

int engine_spec_propose(struct engine_spec *sp, const int32_t *tok, size_t n, int k,
                        float recent, struct engine_draft *d)
{
    d->n = 0;
    if (k > ENGINE_SPEC_MAX_K)
        k = ENGINE_SPEC_MAX_K;
    if (k < 1)
        return 0;
    double best = 0;
    if (sp->drafters & ENGINE_SPEC_NGRAM)
        best = vote(sp, cands_self(sp, tok, n, k), ENGINE_SPEC_SRC_SELF, recent, d);
    if (sp->drafters & ENGINE_SPEC_SUFFIX) {
        struct engine_draft j;
        double e = vote(sp, cands_job(sp, tok, n, k), ENGINE_SPEC_SRC_JOB, recent, &j);
        if (e > best)
            *d = j;
    }
    return d->n;
}

void engine_spec_observe(struct engine_spec *sp, const struct engine_draft *d, int n_tried,
                         int n_acc)
{
    if (d->src == ENGINE_SPEC_SRC_MODEL && n_tried > 0) {
        const int k = kind_of(d->bin[0]);
        sp->kind_n[k]++;
        sp->kind_tried[k] = sp->kind_tried[k] * KIND_DECAY + 1;
        sp->kind_acc[k] = sp->kind_acc[k] * KIND_DECAY + (n_acc > 0);
    }
    double surv = 1;
    for (int i = 0; i < n_tried; i++) {
        if (i <= n_acc) { /* tried given the earlier ones were accepted */
            int f = d->bin[i], c = f / (N_SUPPORT * N_MATCH * N_RECENT);
            double a = i < n_acc;
            sp->acc[f] += a;
            sp->tried[f] += 1;
            sp->cacc[c] += a;
            sp->ctried[c] += 1;
        }
        surv *= d->c[i];
        if (++sp->n_obs > ENGINE_SPEC_ECE_WARMUP) {
            int b = (int)(surv * N_ECE);
            b = b < 0 ? 0 : b >= N_ECE ? N_ECE - 1 : b;
            sp->ece_pred[b] += surv;
            sp->ece_obs[b] += i < n_acc;
            sp->ece_n[b]++;
        }
    }
}

double engine_spec_ece(const struct engine_spec *sp, uint64_t *n)
{
    uint64_t total = 0;
    double ece = 0;
    for (int b = 0; b < N_ECE; b++)
        total += sp->ece_n[b];
    if (n)
        *n = total;
    if (!total)
        return -1;
    for (int b = 0; b < N_ECE; b++)
        if (sp->ece_n[b])
            ece += fabs(sp->ece_pred[b] - sp->ece_obs[b]) / (double)total;
    return ece;
}

int engine_spec_exploring(const struct engine_spec *sp, const struct engine_draft *d, int j)
{
    return sp->ctried[d->bin[j] / (N_SUPPORT * N_MATCH * N_RECENT)] < ENGINE_SPEC_EXPLORE;
}

float engine_spec_best_conf(const struct engine_spec *sp)
{
    double best = 0;
    const int per_depth = N_SHARE * N_SUPPORT * N_MATCH * N_RECENT;
    for (int src = 0; src < N_SRC; src++)
        for (int i = 0; i < per_depth; i++) {
            double r = optimistic_rate(sp, src * N_DEPTH * per_depth + i);
            if (r > best)
                best = r;
        }
    return (float)best;
}

/* ---- step cost ---- */

void engine_spec_time(struct engine_spec *sp, int b, double seconds, int warm)
{
    if (b < 1 || b > sp->max_b || !(seconds > 0))
        return;
    double *avg = warm ? sp->w_avg : sp->t_avg;
    avg[b] = avg[b] > 0 ? 0.8 * avg[b] + 0.2 * seconds : seconds;
    sp->dirty = 1;
}

/* out[b] for b in 1..max_b from the sizes avg measured (avg[b] > 0): measured values where
 * there are some, linear between them, the first one's below them, extended past the last one
 * along the last two's slope; 0 everywhere when nothing was measured. */
static void interpolate(const double *avg, int max_b, double *out)
{
    int first = 0, last = 0, before_last = 0;
    for (int b = 1; b <= max_b; b++)
        if (avg[b] > 0) {
            if (!first)
                first = b;
            before_last = last;
            last = b;
        }
    int lo = first, hi = 0; /* measured sizes around b: lo <= b < hi */
    for (int b = 1; b <= max_b; b++) {
        if (avg[b] > 0)
            lo = b;
        if (!first) {
            out[b] = 0;
        } else if (b <= first) {
            out[b] = avg[first];
        } else if (b >= last) {
            double slope = before_last ? (avg[last] - avg[before_last]) /
                                             (double)(last - before_last)
                                       : avg[last] / (double)last;
            out[b] = avg[last] + (slope > 0 ? slope : 0) * (double)(b - last);
        } else {
            if (hi <= b)
                for (hi = b + 1; avg[hi] <= 0; hi++)
                    ;
            out[b] = avg[b] > 0 ? avg[b]
                                : avg[lo] + (avg[hi] - avg[lo]) * (double)(b - lo) /
                                                (double)(hi - lo);
        }
    }
}

/* The estimate: a size real steps ran at costs what they measured; another size costs the
 * warm-up's curve there scaled to the nearest size real steps measured (the warm-up's single
 * prompt chunk is cheaper than a step of many sequences' decodes: its shape is kept, not its
 * level); non-decreasing in b. */
static void rebuild(struct engine_spec *sp)
{
    interpolate(sp->w_avg, sp->max_b, sp->w_tab);
    interpolate(sp->t_avg, sp->max_b, sp->t_tab);
    int prev = 0;
    for (int b = 1; b <= sp->max_b; b++) {
        if (sp->t_avg[b] > 0)
            prev = b;
        sp->near[b] = prev; /* the nearest real size at or below b, for now */
    }
    int next = 0;
    for (int b = sp->max_b; b >= 1; b--) {
        if (sp->t_avg[b] > 0)
            next = b;
        if (next && (!sp->near[b] || next - b < b - sp->near[b]))
            sp->near[b] = next;
    }
    for (int b = 1; b <= sp->max_b; b++) {
        int r = sp->near[b];
        double t = sp->t_tab[b];
        if (r && r != b && sp->w_tab[b] > 0 && sp->w_tab[r] > 0)
            t = sp->w_tab[b] * sp->t_avg[r] / sp->w_tab[r];
        else if (!r)
            t = sp->w_tab[b];
        sp->t_tab[b] = b > 1 && sp->t_tab[b - 1] > t ? sp->t_tab[b - 1] : t;
    }
    sp->dirty = 0;
}

double engine_spec_cost(struct engine_spec *sp, int b)
{
    if (sp->dirty)
        rebuild(sp);
    if (b < 1)
        return 0;
    return sp->t_tab[b > sp->max_b ? sp->max_b : b];
}
