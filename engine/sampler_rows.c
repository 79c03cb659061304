/* The sampler's ranking and whole-row passes (engine/sampler_internal.h): candidate sorting, the
 * top-k selection, the chunked scaling pass and the draw over the whole row, top-p/min-p
 * truncation, greedy. engine_sample (engine/sampler.c) calls them; the scans run 16 lanes at a
 * time with the same bits on every instruction set. */
#include "engine/sampler_internal.h"

#include <math.h>
#include <string.h>

/* ---- Ranking --------------------------------------------------------------------------- */

/* Sort key that orders floats by descending value: flip every bit of a positive float
 * except the sign, and only the sign of a negative one (branch-free: the sign bit spread
 * into a mask). -0 is folded into +0 so that equal values get equal keys (ties then fall
 * to the lower id through stable sorting). v must not be NaN. */
static uint32_t rank_key(float v)
{
    v += 0.0f;
    uint32_t u;
    memcpy(&u, &v, sizeof(u));
    uint32_t neg = 0u - (u >> 31); /* all ones when v < 0 */
    return u ^ (~neg & 0x7fffffffu);
}

/* Candidate a ranks above b: larger w, ties to the lower id. */
static int cand_above(struct cand a, struct cand b)
{
    return a.w > b.w || (a.w == b.w && a.id < b.id);
}

/* Sort c[0..n) by rank; cheap when already nearly sorted. */
void engine_sampler_insertion_sort(struct cand *c, size_t n)
{
    for (size_t i = 1; i < n; i++) {
        struct cand x = c[i];
        size_t j = i;
        for (; j > 0 && cand_above(x, c[j - 1]); j--)
            c[j] = c[j - 1];
        c[j] = x;
    }
}

/* Sort c[0..n) by rank with a stable LSD radix sort on rank_key(w), 8 bits a pass; the
 * input must be in ascending id order so that equal weights stay in id order. Passes in
 * which every key has the same byte are skipped. Uses tmp[0..n). */
static void radix_sort(struct cand *c, struct cand *tmp, size_t n)
{
    struct cand *src = c, *dst = tmp;
    for (int shift = 0; shift < 32; shift += 8) {
        size_t hist[256] = {0};
        for (size_t i = 0; i < n; i++)
            hist[(rank_key(src[i].w) >> shift) & 0xff]++;
        size_t pos = 0;
        int single = 0;
        for (int b = 0; b < 256; b++) {
            size_t cnt = hist[b];
            single |= cnt == n;
            hist[b] = pos;
            pos += cnt;
        }
        if (single)
            continue;
        for (size_t i = 0; i < n; i++)
            dst[hist[(rank_key(src[i].w) >> shift) & 0xff]++] = src[i];
        struct cand *t = src;
        src = dst;
        dst = t;
    }
    if (src != c)
        memcpy(c, src, n * sizeof(*c));
}

/* Sort c[0..n) (in ascending id order) by rank. */
static void sort_cands(struct cand *c, struct cand *tmp, size_t n)
{
    if (n <= 48)
        engine_sampler_insertion_sort(c, n);
    else
        radix_sort(c, tmp, n);
}

/* ---- Whole-row passes, 16 lanes at a time ---------------------------------------------
 * GCC/clang vector extensions: each lane computes exactly what the scalar code computes (no
 * contraction into fused multiply-adds under -std=c11), so results do not depend on the
 * instruction set; target_clones picks AVX-512 or AVX2 code at load time where the CPU has
 * it (the plain build targets baseline x86-64). */
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
#define VLANES 16

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__clang__)
/* (clang rejects the AVX2 clone's 64-byte vector temporaries; it builds the baseline code) */
#define ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ROW_CLONES
#endif

static inline __attribute__((always_inline)) vf16 vload(const float *p)
{
    vf16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

#define VSTORE(p, v)                                                                        \
    do {                                                                                    \
        const vf16 v_ = (v);                                                                \
        memcpy((p), &v_, sizeof(v_));                                                       \
    } while (0)

/* m ? a : b lane by lane (m: all ones or zero per lane, as comparisons give). */
#define vsel(m, a, b) ((vf16)(((vi16)(a) & (m)) | ((vi16)(b) & ~(m))))

static inline __attribute__((always_inline)) vf16 vsplat(float x)
{
    return (vf16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* Whether any lane of the comparison mask *m is set. */
static inline __attribute__((always_inline)) int vany(const vi16 *m)
{
    uint64_t part[VLANES / 2], any = 0;
    memcpy(part, m, sizeof(part));
    for (int k = 0; k < VLANES / 2; k++)
        any |= part[k];
    return any != 0;
}

/* Put the k (< n_vocab) highest-ranked logits, best first, at the front of cand (NaN ranks
 * as -inf). One pass with a rising bar, 64 tokens at a time once it is set (a block with no
 * value above the bar's is skipped whole): a token that beats the current k-th best is
 * appended to a buffer of max(2k, k + 64); when the buffer fills it is sorted and cut back
 * to k, and the new k-th best becomes the bar. A later token equal to the bar loses the
 * tie (higher id), so only strictly better keys enter. Equal keys stay in id order in the
 * buffer, as sort_cands requires. */
#define SELECT_BLOCK 64 /* tokens select_top_k checks against the bar at once */

ROW_CLONES void engine_sampler_select_top_k(struct engine_sampler *s, const float *logits,
                                            size_t k)
{
    const size_t n = (size_t)s->n_vocab;
    size_t cap = k < 64 ? k + 64 : 2 * k;
    if (cap > n)
        cap = n;
    uint32_t bar = UINT32_MAX; /* above every non-NaN key */
    vf16 bar_v = vsplat(INFINITY); /* once the bar is set: its value */
    size_t m = 0;
    for (size_t i0 = 0; i0 < n; i0 += SELECT_BLOCK) {
        const size_t i1 = n - i0 < SELECT_BLOCK ? n : i0 + SELECT_BLOCK;
        /* a whole block at or below the bar's value cannot enter (a NaN lane is looked at) */
        if (i1 - i0 == SELECT_BLOCK && bar != UINT32_MAX) {
            vi16 in = ~(vload(logits + i0) <= bar_v);
            for (int b = 1; b < SELECT_BLOCK / VLANES; b++)
                in |= ~(vload(logits + i0 + (size_t)b * VLANES) <= bar_v);
            if (!vany(&in))
                continue;
        }
        for (size_t i = i0; i < i1; i++) {
            float v = isnan(logits[i]) ? -INFINITY : logits[i];
            if (rank_key(v) >= bar)
                continue;
            s->cand[m++] = (struct cand){v, (int32_t)i};
            if (m == cap) {
                sort_cands(s->cand, s->tmp, m);
                m = k;
                bar = rank_key(s->cand[k - 1].w);
                bar_v = vsplat(s->cand[k - 1].w);
            }
        }
    }
    sort_cands(s->cand, s->tmp, m);
}

float engine_sample_exp(float x)
{
    return engine_sampler_exp_nonpos(x);
}

/* engine_sampler_exp_nonpos of every lane, bitwise. */
static inline __attribute__((always_inline)) vf16 vexp_nonpos(vf16 x)
{
    const vf16 lo = vsplat(-80.0f), magic = vsplat(12582912.0f);
    const vi16 ok = x >= lo; /* false below -80 and for NaN */
    const vf16 xc = vsel(ok, x, lo);
    const vf16 nf = (xc * vsplat(1.44269504f) + magic) - magic;
    const vf16 r = (xc - nf * vsplat(0.693145751953125f)) - nf * vsplat(1.42860677e-6f);
    vf16 p = vsplat(1.0f / 720.0f);
    p = p * r + vsplat(1.0f / 120.0f);
    p = p * r + vsplat(1.0f / 24.0f);
    p = p * r + vsplat(1.0f / 6.0f);
    p = p * r + vsplat(0.5f);
    p = p * r + vsplat(1.0f);
    p = p * r + vsplat(1.0f);
    const vi16 bits = (__builtin_convertvector(nf, vi16) + 127) << 23;
    return (vf16)((vi16)(p * (vf16)bits) & ok);
}

/* engine_sampler_cand_weight of every lane (mv: the maximum in every lane). */
static inline __attribute__((always_inline)) vf16 vweight(vf16 v, vf16 mv)
{
    return vsel(v == mv, vsplat(1.0f), vexp_nonpos(v - mv));
}

ROW_CLONES void engine_sampler_weights(const float *l, size_t n, float mx, float *w)
{
    const vf16 mv = vsplat(mx);
    size_t i = 0;
    for (; i + VLANES <= n; i += VLANES)
        VSTORE(w + i, vweight(vload(l + i), mv));
    for (; i < n; i++)
        w[i] = engine_sampler_cand_weight(l[i], mx);
}

/* The sum of l[0 .. n)'s weights relative to m: lane k adds the tokens k, k + 16, ... in
 * float, the scalar tail apart, the lanes added pairwise in double after the tail. */
static inline __attribute__((always_inline)) double chunk_sum(const float *l, size_t n, float m)
{
    const vf16 mv = vsplat(m);
    vf16 acc = vsplat(0.0f);
    float tail = 0.0f;
    size_t i = 0;
    for (; i + VLANES <= n; i += VLANES)
        acc += vweight(vload(l + i), mv);
    for (; i < n; i++)
        tail += engine_sampler_cand_weight(l[i], m);
    double z = tail;
    for (int k = 0; k < VLANES; k += 4)
        z += ((double)acc[k] + acc[k + 1]) + ((double)acc[k + 2] + acc[k + 3]);
    return z;
}

/* The whole-row pass for one chunk src[0 .. n) (n <= SAMPLE_CHUNK): every logit scaled into l
 * (NaN -> -inf, divided by t unless t == 1; l may be src), then, while they are in L1, the
 * chunk's maximum *max and chunk_sum. */
ROW_CLONES double engine_sampler_chunk(const float *src, float *l, size_t n, float t, float *max)
{
    const vf16 ninf = vsplat(-INFINITY), tv = vsplat(t);
    vf16 hi = ninf;
    size_t i = 0;
    for (; i + VLANES <= n; i += VLANES) {
        vf16 v = vload(src + i);
        if (t != 1.0f)
            v = v / tv;
        v = vsel(v != v, ninf, v);
        VSTORE(l + i, v);
        hi = vsel(v > hi, v, hi);
    }
    float m = -INFINITY;
    for (int k = 0; k < VLANES; k++)
        m = hi[k] > m ? hi[k] : m;
    for (; i < n; i++) {
        float v = src[i];
        v = isnan(v) ? -INFINITY : t == 1.0f ? v : v / t;
        l[i] = v;
        m = v > m ? v : m;
    }
    *max = m;
    return chunk_sum(l, n, m);
}

ROW_CLONES float engine_sampler_row_max(const float *l, size_t n)
{
    vf16 hi = vsplat(-INFINITY);
    size_t i = 0;
    for (; i + VLANES <= n; i += VLANES) {
        const vf16 v = vload(l + i);
        hi = vsel(v > hi, v, hi);
    }
    float m = -INFINITY;
    for (int k = 0; k < VLANES; k++)
        m = hi[k] > m ? hi[k] : m;
    for (; i < n; i++)
        m = l[i] > m ? l[i] : m;
    return m;
}

ROW_CLONES double engine_sampler_weight_sum(const float *l, size_t n, float mx)
{
    double sum = 0.0;
    for (size_t i0 = 0; i0 < n; i0 += SAMPLE_CHUNK)
        sum += chunk_sum(l + i0, n - i0 < SAMPLE_CHUNK ? n - i0 : SAMPLE_CHUNK, mx);
    return sum;
}

ROW_CLONES int engine_sampler_top_values(const float *l, size_t n, int k, int32_t *top_id,
                                         float *top_v)
{
    int m = 0;
    vf16 bar = vsplat(INFINITY); /* once full: the k-th value (nothing passes before) */
    for (size_t i0 = 0; i0 < n && k > 0; i0 += VLANES) {
        const size_t i1 = n - i0 < VLANES ? n : i0 + VLANES;
        if (m == k && i1 - i0 == VLANES) {
            const vi16 gt = vload(l + i0) > bar;
            if (!vany(&gt))
                continue;
        }
        for (size_t i = i0; i < i1; i++) {
            float v = l[i];
            if (!(v == v))
                v = -INFINITY;
            if (m == k && !(v > top_v[m - 1]))
                continue;
            int j = m < k ? m++ : m - 1;
            while (j > 0 && v > top_v[j - 1]) {
                top_v[j] = top_v[j - 1];
                top_id[j] = top_id[j - 1];
                j--;
            }
            top_v[j] = v;
            top_id[j] = (int32_t)i;
        }
        if (m == k)
            bar = vsplat(top_v[k - 1]);
    }
    return m;
}

float engine_sampler_combine(struct engine_sampler *s, const double *zc, const float *mc,
                             double *total)
{
    const size_t nc = ((size_t)s->n_vocab + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    float mx = -INFINITY;
    for (size_t c = 0; c < nc; c++) {
        mx = mc[c] > mx ? mc[c] : mx;
        s->tmp_f[c] = mc[c]; /* kept for collect (mc may be s->tmp_f) */
    }
    engine_sampler_weights(s->tmp_f, nc, mx, s->wtmp);
    double sum = 0.0;
    for (size_t c = 0; c < nc; c++) {
        s->zc[c] = zc[c] * s->wtmp[c];
        sum += s->zc[c];
    }
    *total = sum;
    return mx;
}

/* The whole-row pass: engine_sampler_chunk over every SAMPLE_CHUNK tokens, then
 * engine_sampler_combine. */
float engine_sampler_scale_chunks(struct engine_sampler *s, float *l, float t, double *total)
{
    const size_t n = (size_t)s->n_vocab;
    float *mc = s->tmp_f; /* chunk maxima */
    size_t nc = 0;
    for (size_t i0 = 0; i0 < n; i0 += SAMPLE_CHUNK, nc++)
        s->zc[nc] = engine_sampler_chunk(l + i0, l + i0,
                                         n - i0 < SAMPLE_CHUNK ? n - i0 : SAMPLE_CHUNK, t, &mc[nc]);
    return engine_sampler_combine(s, s->zc, mc, total);
}

/* Inverse CDF over the whole row in id order (l: engine_sampler_scale_chunks' scaled logits,
 * maximum mx, weights summing to total): the chunk in which the running sum of s->zc passes
 * u * total, then the token within it where the running sum of its weights does; a target just
 * past the chunk's weights by rounding takes its last token of positive weight. */
int32_t engine_sampler_draw_row(const struct engine_sampler *s, const float *l, float mx,
                                double total, double u)
{
    const size_t n = (size_t)s->n_vocab, nc = (n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    const double target = u * total;
    double cum = 0.0;
    size_t c = 0, last_c = 0;
    for (; c < nc; c++) {
        if (s->zc[c] > 0.0)
            last_c = c;
        if (target < cum + s->zc[c])
            break;
        cum += s->zc[c];
    }
    if (c == nc) /* only by rounding */
        c = last_c;
    const size_t i0 = c * SAMPLE_CHUNK, i1 = n - i0 < SAMPLE_CHUNK ? n : i0 + SAMPLE_CHUNK;
    float wc[SAMPLE_CHUNK];
    engine_sampler_weights(l + i0, i1 - i0, mx, wc);
    size_t last = i0;
    for (size_t i = i0; i < i1; i++) {
        const float w = wc[i - i0];
        if (w > 0.0f)
            last = i;
        cum += w;
        if (target < cum && w > 0.0f)
            return (int32_t)i;
    }
    return (int32_t)last;
}

/* Rank cand[0..m) (in id order): returns the length of a ranked prefix of it that holds the
 * kept set. With top_p (total = the row total): the mass histogram gives the first rank bucket
 * at which it and every bucket above hold top_p * total; those tokens form a prefix of the
 * ranking (each outweighs every other token), usually a short one, and only they are sorted.
 * If summing them in ranked order falls short of the target (rounding, or mass outside cand),
 * all m are sorted. Without top_p, the tokens of weight >= min_p form the prefix. */
static size_t rank_cands(struct engine_sampler *s, size_t m, double total, float top_p,
                         float min_p)
{
    if (top_p >= 1.0f) {
        size_t k = 0;
        for (size_t i = 0; i < m; i++)
            if (s->cand[i].w >= min_p)
                s->cand[k++] = s->cand[i];
        sort_cands(s->cand, s->tmp, k);
        return k;
    }
    memset(s->mass, 0, sizeof(s->mass));
    size_t i = 0;
    for (; i + 4 <= m; i += 4)
        for (int k = 0; k < 4; k++)
            s->mass[k][RANK_BUCKET(rank_key(s->cand[i + k].w))] += s->cand[i + k].w;
    for (; i < m; i++)
        s->mass[0][RANK_BUCKET(rank_key(s->cand[i].w))] += s->cand[i].w;
    double target = (double)top_p * total, acc = 0.0;
    uint32_t last = RANK_BUCKETS - 1;
    for (uint32_t b = 0; b < RANK_BUCKETS; b++) {
        acc += (s->mass[0][b] + s->mass[1][b]) + (s->mass[2][b] + s->mass[3][b]);
        if (acc >= target) {
            last = b;
            break;
        }
    }
    size_t k = 0;
    for (i = 0; i < m; i++)
        if (RANK_BUCKET(rank_key(s->cand[i].w)) <= last)
            s->tmp[k++] = s->cand[i];
    if (k < m) {
        double cum = 0.0;
        for (size_t j = 0; j < k; j++)
            cum += s->tmp[j].w;
        if (cum >= target) { /* the prefix holds the nucleus: rank just it */
            memcpy(s->cand, s->tmp, k * sizeof(*s->cand));
            sort_cands(s->cand, s->tmp, k);
            return k;
        }
    }
    sort_cands(s->cand, s->tmp, m);
    return m;
}

/* The tokens of weight >= bound (engine_sampler_cand_weight(l[i], mx), all of them: each with a
 * scaled logit of at least mx + ln(bound) less a margin that covers the exp's error), in id
 * order into cand; returns how many, or stops at max + 1. */
ROW_CLONES static size_t collect(struct engine_sampler *s, const float *l, float mx, float bound,
                                 size_t max)
{
    const size_t n = (size_t)s->n_vocab;
    const float theta = (float)((double)mx + log((double)bound) - 1e-3);
    const vf16 tv = vsplat(theta), mv = vsplat(mx), bv = vsplat(bound);
    size_t m = 0, i = 0;
    for (; i + VLANES <= n && m <= max; i += VLANES) {
        if (i % SAMPLE_CHUNK == 0 && s->tmp_f[i / SAMPLE_CHUNK] < theta) {
            i += SAMPLE_CHUNK - VLANES; /* no token of this chunk passes: not read */
            continue;
        }
        const vf16 v = vload(l + i);
        const vi16 pass = v >= tv;
        if (!vany(&pass))
            continue;
        const vf16 w = vweight(v, mv);
        const vi16 keep = pass & (w >= bv);
        for (int k = 0; k < VLANES; k++)
            if (keep[k])
                s->cand[m++] = (struct cand){w[k], (int32_t)(i + (size_t)k)};
    }
    for (; i < n && m <= max; i++) {
        if (!(l[i] >= theta))
            continue;
        const float w = engine_sampler_cand_weight(l[i], mx);
        if (w >= bound)
            s->cand[m++] = (struct cand){w, (int32_t)i};
    }
    return m;
}

/* Weight a first, tighter bound keeps for top_p: tokens within ln(1000) of the maximum. Their
 * sum usually holds the nucleus already, and far fewer tokens pass it. */
#define TOP_P_TIGHT 1e-3f

/* top_p and/or min_p without top_k on the scaled row l (engine_sampler_scale_chunks: maximum
 * mx, weights summing to total): cand[0..m) ranked, a prefix of the full ranking that holds the
 * kept set; returns m. The tokens of weight >= a bound form a prefix of the ranking; the bound
 * is min_p, or for top_p first TOP_P_TIGHT (enough when those tokens hold top_p of the total),
 * then (1 - top_p) * total / n_vocab, below which all tokens together weigh less than
 * (1 - top_p) of the total. When more than s->max_cands tokens pass, or their sum falls short
 * of the nucleus by rounding, the whole row is ranked instead (the same prefix, so the same
 * token). */
ROW_CLONES size_t engine_sampler_truncate_row(struct engine_sampler *s,
                                              const struct engine_sampling *p, const float *l,
                                              float mx, double total)
{
    const size_t n = (size_t)s->n_vocab;
    const double target = (double)p->top_p * total;
    float bound = p->min_p;
    if (p->top_p < 1.0f) {
        float loose = (float)((1.0 - (double)p->top_p) * total / (double)n);
        bound = loose > bound ? loose : bound;
    }
    for (int tier = p->top_p < 1.0f && TOP_P_TIGHT > bound ? 0 : 1; tier < 2; tier++) {
        const float b = tier ? bound : TOP_P_TIGHT;
        size_t m = collect(s, l, mx, b, s->max_cands);
        if (m > s->max_cands)
            break;
        if (!tier) { /* enough mass above the tight bound? (exactly checked after ranking) */
            double sum = 0.0;
            for (size_t j = 0; j < m; j++)
                sum += s->cand[j].w;
            if (sum < target * (1.0 - 1e-6))
                continue;
        }
        size_t k = rank_cands(s, m, total, p->top_p, p->min_p);
        double cum = 0.0;
        for (size_t j = 0; j < k && p->top_p < 1.0f; j++)
            cum += s->cand[j].w;
        if (p->top_p >= 1.0f || cum >= target || p->min_p >= b) {
            s->n_fast++;
            return k;
        }
    }
    s->n_slow++;
    const vf16 mv = vsplat(mx);
    size_t i = 0;
    for (; i + VLANES <= n; i += VLANES) {
        const vf16 w = vweight(vload(l + i), mv);
        for (int k = 0; k < VLANES; k++)
            s->cand[i + (size_t)k] = (struct cand){w[k], (int32_t)(i + (size_t)k)};
    }
    for (; i < n; i++)
        s->cand[i] = (struct cand){engine_sampler_cand_weight(l[i], mx), (int32_t)i};
    return rank_cands(s, n, total, p->top_p, p->min_p);
}

/* Greedy: argmax of the penalised logits, ties to the lowest id; NaN becomes -inf. */
ROW_CLONES int32_t engine_sampler_greedy(struct engine_sampler *s, float *logits, float *logprob)
{
    const size_t n = (size_t)s->n_vocab;
    /* the maximum, then its first index; NaNs never win (16 lanes; max is exact) */
    vf16 hi = vsplat(-INFINITY);
    vi16 nan = {0};
    size_t i = 0;
    for (; i + VLANES <= n; i += VLANES) {
        const vf16 v = vload(logits + i);
        hi = vsel(v > hi, v, hi);
        nan |= v != v;
    }
    float mx = -INFINITY;
    int has_nan = 0;
    for (int k = 0; k < VLANES; k++) {
        mx = hi[k] > mx ? hi[k] : mx;
        has_nan |= nan[k] != 0;
    }
    for (; i < n; i++) {
        mx = logits[i] > mx ? logits[i] : mx;
        has_nan |= logits[i] != logits[i];
    }
    if (has_nan)
        for (i = 0; i < n; i++)
            if (isnan(logits[i]))
                logits[i] = -INFINITY;
    size_t best = 0;
    for (const vf16 mv = vsplat(mx); best + VLANES <= n; best += VLANES) { /* its block */
        const vi16 eq = vload(logits + best) == mv;
        if (vany(&eq))
            break;
    }
    while (best < n - 1 && !(logits[best] == mx))
        best++;
    if (logprob) {
        double sum = 0.0;
        const vf16 mv = vsplat(mx);
        for (i = 0; i + VLANES <= n; i += VLANES) {
            const vf16 w = vweight(vload(logits + i), mv);
            for (int k = 0; k < VLANES; k++)
                sum += w[k];
        }
        for (; i < n; i++)
            sum += engine_sampler_cand_weight(logits[i], mx);
        *logprob = (float)-log(sum);
    }
    s->cand[0] = (struct cand){1.0f, (int32_t)best};
    s->n_kept = 1;
    s->kept_total = 1.0;
    return (int32_t)best;
}

