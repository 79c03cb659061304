/* Per-request sampling and stop-string matching (see engine/sampler.h). Everything here is
 * a pure function of one request's inputs: scratch is cleared after each call, sums run in
 * a fixed order, and ranking ties always go to the lowest token id. */
#include "engine/sampler.h"

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

/* Histogram buckets are the top 11 key bits (sign, exponent, two mantissa bits): values
 * within a factor of 2^(1/4) share a bucket, and a lower bucket means a larger value. */
#define RANK_BUCKET_BITS 11
#define RANK_BUCKETS     (1u << RANK_BUCKET_BITS)
#define RANK_BUCKET(key) ((key) >> (32 - RANK_BUCKET_BITS))

/* One candidate token. During top-k selection w holds the (NaN-free) logit; afterwards the
 * unnormalised weight exp(logit - max), which is exactly 1 for the most likely token. */
struct cand {
    float w;    /* logit during selection, then weight in [0, 1] */
    int32_t id; /* token id */
};

/* Tokens per chunk of the row total (see engine_sample). */
#define SAMPLE_CHUNK 256

struct engine_sampler {
    int32_t n_vocab;   /* vocabulary size */
    struct cand *cand; /* n_vocab: candidates of the current call; after it, the kept ones */
    double *zc;        /* weight per SAMPLE_CHUNK tokens (scale_chunks) */
    float *tmp_f;      /* per-chunk scratch of scale_chunks */
    const float *row;  /* the last call's scaled logits when it kept every token (else NULL) */
    float row_max;     /* ... and their maximum */
    size_t max_cands;  /* most candidates of the truncated fast path */
    uint64_t n_fast;   /* truncated rows decided from the candidates */
    uint64_t n_slow;   /* ... and by ranking the whole row */
    struct cand *tmp;  /* n_vocab: second buffer for the top-p radix sort */
    int32_t *count;    /* n_vocab: penalty counts; all zero between calls */
    int32_t *touched;  /* n_vocab: ids whose count is non-zero during a call */
    size_t n_kept;     /* candidates kept by the last call (prefix of cand) */
    double kept_total; /* sum of their weights */
    double mass[4][RANK_BUCKETS]; /* top-p scratch: weight per rank bucket, in four lanes */
};

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
    s->zc = malloc((n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK * sizeof(*s->zc));
    s->tmp_f = malloc((n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK * sizeof(*s->tmp_f));
    if (!s->cand || !s->tmp || !s->count || !s->touched || !s->zc || !s->tmp_f) {
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
    free(s->zc);
    free(s->tmp_f);
    free(s);
}

static float cand_weight(float l, float mx);

size_t engine_sampler_n_kept(const struct engine_sampler *s)
{
    return s->n_kept;
}

int32_t engine_sampler_kept(const struct engine_sampler *s, size_t i, double *prob)
{
    assert(i < s->n_kept);
    if (s->row) { /* every token kept, in id order */
        if (prob)
            *prob = cand_weight(s->row[i], s->row_max) / s->kept_total;
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

/* Repetition, frequency and presence penalties over the last repeat_last_n history tokens,
 * applied in place. Counts live in s->count and are reset through s->touched, so a call
 * costs O(window), not O(n_vocab), and leaves the scratch clean. */
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

static void apply_penalties(struct engine_sampler *s, const struct engine_sampling *p,
                            float *logits, const int32_t *history, size_t n_history)
{
    if (!penalizes(p) || n_history == 0)
        return;
    size_t start = 0;
    if (p->repeat_last_n > 0 && (size_t)p->repeat_last_n < n_history)
        start = n_history - (size_t)p->repeat_last_n;

    size_t n_touched = 0;
    for (size_t i = start; i < n_history; i++) {
        int32_t t = history[i];
        if (t < 0 || t >= s->n_vocab)
            continue;
        if (s->count[t]++ == 0)
            s->touched[n_touched++] = t;
    }
    for (size_t j = 0; j < n_touched; j++) {
        int32_t t = s->touched[j];
        float l = logits[t];
        if (p->repeat_penalty != 1.0f)
            l = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
        l -= (float)s->count[t] * p->frequency_penalty + p->presence_penalty;
        logits[t] = l;
        s->count[t] = 0;
    }
}

/* Candidate a ranks above b: larger w, ties to the lower id. */
static int cand_above(struct cand a, struct cand b)
{
    return a.w > b.w || (a.w == b.w && a.id < b.id);
}

/* Sort c[0..n) by rank; cheap when already nearly sorted. */
static void insertion_sort(struct cand *c, size_t n)
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
        insertion_sort(c, n);
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

ROW_CLONES static void select_top_k(struct engine_sampler *s, const float *logits, size_t k)
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

/* e^x for x <= 0 (engine_sample_exp), inlined into the weight loops. */
static inline float exp_nonpos(float x)
{
    /* 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2; e^r by its Taylor series to
     * degree 6 (measured error under 3e-7 relative over [-80, 0]). ln 2 is split in two so
     * that n * ln2_hi is exact. Adding and subtracting 1.5 * 2^23 rounds to an integer.
     * Plain float operations only, so every IEEE machine gets the same bits as long as
     * multiply-adds are not fused (-std=c11 implies -ffp-contract=off). */
    const float log2e = 1.44269504f, ln2_hi = 0.693145751953125f, ln2_lo = 1.42860677e-6f;
    const float round_magic = 12582912.0f;
    float xc = x < -80.0f ? -80.0f : x;
    float n = (xc * log2e + round_magic) - round_magic;
    float r = (xc - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return x < -80.0f ? 0.0f : p * scale;
}

float engine_sample_exp(float x)
{
    return exp_nonpos(x);
}

/* Weight of logit l when the largest candidate logit is mx: exactly 1 for the maximum
 * itself (so rows with +inf, or with every logit -inf, stay well defined). */
static float cand_weight(float l, float mx)
{
    return l == mx ? 1.0f : exp_nonpos(l - mx);
}

/* exp_nonpos of every lane, bitwise. */
static inline __attribute__((always_inline)) vf16 vexp_nonpos(vf16 x)
{
    const vf16 lo = vsplat(-80.0f), magic = vsplat(12582912.0f);
    const vi16 under = x < lo;
    const vf16 xc = vsel(under, lo, x);
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
    return vsel(under, vsplat(0.0f), p * (vf16)bits);
}


/* The whole-row pass: every logit scaled in place (NaN -> -inf, divided by t unless t == 1),
 * and per SAMPLE_CHUNK tokens, while they are in L1, the chunk's maximum m_c and the float sum
 * of exp(s - m_c) in 16 lanes. Returns the row maximum M; s->zc[c] becomes the chunk's sum times
 * e^(m_c - M) (the weight it holds: every weight is exp_nonpos(s - M), 1 for the maximum), and
 * *total their sum, added in chunk order in double. A fixed order, so a fixed total. */
ROW_CLONES static float scale_chunks(struct engine_sampler *s, float *l, float t, double *total)
{
    const size_t n = (size_t)s->n_vocab;
    const vf16 ninf = vsplat(-INFINITY), tv = vsplat(t), one = vsplat(1.0f);
    float *mc = s->tmp_f; /* chunk maxima */
    float mx = -INFINITY;
    size_t nc = 0;
    for (size_t i0 = 0; i0 < n; i0 += SAMPLE_CHUNK, nc++) {
        const size_t i1 = n - i0 < SAMPLE_CHUNK ? n : i0 + SAMPLE_CHUNK;
        vf16 hi = ninf;
        size_t i = i0;
        for (; i + VLANES <= i1; i += VLANES) {
            vf16 v = vload(l + i);
            if (t != 1.0f)
                v = v / tv;
            v = vsel(v != v, ninf, v);
            VSTORE(l + i, v);
            hi = vsel(v > hi, v, hi);
        }
        float m = -INFINITY;
        for (int k = 0; k < VLANES; k++)
            m = hi[k] > m ? hi[k] : m;
        for (; i < i1; i++) {
            float v = l[i];
            v = isnan(v) ? -INFINITY : t == 1.0f ? v : v / t;
            l[i] = v;
            m = v > m ? v : m;
        }
        const vf16 mv = vsplat(m);
        vf16 acc = vsplat(0.0f);
        float tail = 0.0f;
        for (i = i0; i + VLANES <= i1; i += VLANES) {
            const vf16 v = vload(l + i);
            acc += vsel(v == mv, one, vexp_nonpos(v - mv));
        }
        for (; i < i1; i++)
            tail += cand_weight(l[i], m);
        double z = tail;
        for (int k = 0; k < VLANES; k += 4)
            z += ((double)acc[k] + acc[k + 1]) + ((double)acc[k + 2] + acc[k + 3]);
        s->zc[nc] = z;
        mc[nc] = m;
        mx = m > mx ? m : mx;
    }
    double sum = 0.0;
    for (size_t c = 0; c < nc; c++) {
        s->zc[c] *= cand_weight(mc[c], mx);
        sum += s->zc[c];
    }
    *total = sum;
    return mx;
}

/* Inverse CDF over the whole row in id order (l: scale_chunks' scaled logits, maximum mx,
 * weights summing to total): the chunk in which the running sum of s->zc passes u * total,
 * then the token within it where the running sum of its weights does; a target just past the
 * chunk's weights by rounding takes its last token of positive weight. */
static int32_t draw_row(const struct engine_sampler *s, const float *l, float mx, double total,
                        double u)
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
    size_t last = i0;
    for (size_t i = i0; i < i1; i++) {
        const float w = cand_weight(l[i], mx);
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

/* The tokens of weight >= bound (cand_weight(l[i], mx), all of them: each with a scaled logit
 * of at least mx + ln(bound) less a margin that covers the exp's error), in id order into
 * cand; returns how many, or stops at max + 1. */
ROW_CLONES static size_t collect(struct engine_sampler *s, const float *l, float mx, float bound,
                                 size_t max)
{
    const size_t n = (size_t)s->n_vocab;
    const float theta = (float)((double)mx + log((double)bound) - 1e-3);
    const vf16 tv = vsplat(theta), mv = vsplat(mx), bv = vsplat(bound), one = vsplat(1.0f);
    size_t m = 0, i = 0;
    for (; i + VLANES <= n && m <= max; i += VLANES) {
        const vf16 v = vload(l + i);
        const vi16 pass = v >= tv;
        if (!vany(&pass))
            continue;
        const vf16 w = vsel(v == mv, one, vexp_nonpos(v - mv)); /* = cand_weight */
        const vi16 keep = pass & (w >= bv);
        for (int k = 0; k < VLANES; k++)
            if (keep[k])
                s->cand[m++] = (struct cand){w[k], (int32_t)(i + (size_t)k)};
    }
    for (; i < n && m <= max; i++) {
        if (!(l[i] >= theta))
            continue;
        const float w = cand_weight(l[i], mx);
        if (w >= bound)
            s->cand[m++] = (struct cand){w, (int32_t)i};
    }
    return m;
}

/* Weight a first, tighter bound keeps for top_p: tokens within ln(1000) of the maximum. Their
 * sum usually holds the nucleus already, and far fewer tokens pass it. */
#define TOP_P_TIGHT 1e-3f

/* top_p and/or min_p without top_k on the scaled row l (scale_chunks: maximum mx, weights
 * summing to total): cand[0..m) ranked, a prefix of the full ranking that holds the kept set;
 * returns m. The tokens of weight >= a bound form a prefix of the ranking; the bound is min_p,
 * or for top_p first TOP_P_TIGHT (enough when those tokens hold top_p of the total), then
 * (1 - top_p) * total / n_vocab, below which all tokens together weigh less than (1 - top_p)
 * of the total. When more than s->max_cands tokens pass, or their sum falls short of the
 * nucleus by rounding, the whole row is ranked instead (the same prefix, so the same token). */
ROW_CLONES static size_t truncate_row(struct engine_sampler *s, const struct engine_sampling *p,
                                      const float *l, float mx, double total)
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
    for (size_t i = 0; i < n; i++)
        s->cand[i] = (struct cand){cand_weight(l[i], mx), (int32_t)i};
    return rank_cands(s, n, total, p->top_p, p->min_p);
}

/* Greedy: argmax of the penalised logits, ties to the lowest id; NaN becomes -inf. */
ROW_CLONES static int32_t sample_greedy(struct engine_sampler *s, float *logits,
                                       float *logprob)
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
        for (i = 0; i < n; i++)
            sum += cand_weight(logits[i], mx);
        *logprob = (float)-log(sum);
    }
    s->cand[0] = (struct cand){1.0f, (int32_t)best};
    s->n_kept = 1;
    s->kept_total = 1.0;
    return (int32_t)best;
}

int32_t engine_sample(struct engine_sampler *s, const struct engine_sampling *p,
                      const struct engine_rng *rng, uint64_t pos, float *logits,
                      const int32_t *history, size_t n_history, float *logprob)
{
    assert(p->temperature >= 0.0f && p->top_k >= 0 && p->top_p > 0.0f && p->top_p <= 1.0f);
    assert(p->min_p >= 0.0f && p->min_p <= 1.0f && p->repeat_penalty > 0.0f);
    const size_t n = (size_t)s->n_vocab;
    const float t = p->temperature;

    s->row = NULL;
    apply_penalties(s, p, logits, history, n_history);
    if (t == 0.0f)
        return sample_greedy(s, logits, logprob);

    /* Candidates with their weights, cand[0..m), ranked: after top_k the k best by penalised
     * logit (temperature touches only them); else a ranked prefix holding the kept set. */
    size_t m;
    float mx;
    double total = 0.0;
    if (p->top_k > 0 && (size_t)p->top_k < n) {
        m = (size_t)p->top_k;
        select_top_k(s, logits, m);
        for (size_t j = 0; j < m; j++)
            logits[s->cand[j].id] = t == 1.0f ? s->cand[j].w : s->cand[j].w / t;
        mx = logits[s->cand[0].id]; /* dividing by t > 0 keeps the best on top */
        for (size_t j = 0; j < m; j++) {
            s->cand[j].w = cand_weight(logits[s->cand[j].id], mx);
            total += s->cand[j].w;
        }
        insertion_sort(s->cand, m); /* weights can tie where logits did not: re-rank by id */
    } else {
        mx = scale_chunks(s, logits, t, &total);
        if (p->top_p >= 1.0f && p->min_p <= 0.0f) { /* nothing truncates: the whole row */
            int32_t id = draw_row(s, logits, mx, total, engine_rng_at(rng, pos, 0));
            if (logprob)
                *logprob = (float)(log((double)cand_weight(logits[id], mx)) - log(total));
            s->row = logits;
            s->row_max = mx;
            s->n_kept = n;
            s->kept_total = total;
            return id;
        }
        m = truncate_row(s, p, logits, mx, total);
    }
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
    double u = engine_rng_at(rng, pos, 0) * kept_total, cum = 0.0;
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
