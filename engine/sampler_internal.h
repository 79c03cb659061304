/* Private parts of the sampler shared by engine/sampler.c (parameters, RNG, penalties, the
 * sampling chain, stop strings) and engine/sampler_rows.c (ranking and the whole-row passes):
 * struct engine_sampler, its candidates, the weight function and the passes engine_sample calls. */
#ifndef ENGINE_SAMPLER_INTERNAL_H
#define ENGINE_SAMPLER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "engine/sampler.h"

/* Histogram buckets are the top 11 bits of a rank key (rank_key in engine/sampler_rows.c: sign,
 * exponent, two mantissa bits): values within a factor of 2^(1/4) share a bucket, and a lower
 * bucket means a larger value. */
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
#define SAMPLE_CHUNK ENGINE_SAMPLE_CHUNK

/* The sampler's scratch (opaque in engine/sampler.h). */
struct engine_sampler {
    int32_t n_vocab;   /* vocabulary size */
    struct cand *cand; /* n_vocab: candidates of the current call; after it, the kept ones */
    double *zc;        /* weight per SAMPLE_CHUNK tokens (engine_sampler_scale_chunks) */
    float *tmp_f;      /* per chunk: the last whole-row pass's chunk maxima (set by
                        * engine_sampler_combine; truncation skips the chunks they rule out) */
    float *wtmp;       /* one per chunk: weights scratch (engine_sampler_combine) */
    const float *row;  /* the last call's scaled logits when it kept every token (else NULL) */
    float row_max;     /* ... and their maximum */
    size_t max_cands;  /* most candidates of the truncated fast path */
    uint64_t n_fast;   /* truncated rows decided from the candidates */
    uint64_t n_slow;   /* ... and by ranking the whole row */
    struct cand *tmp;  /* n_vocab: second buffer for the top-p radix sort */
    int32_t *count;    /* n_vocab: penalty counts; all zero between calls */
    int32_t *touched;  /* n_vocab: ids whose count is non-zero during a call */
    int32_t *counts;   /* n_vocab: their counts (engine_sampler_counts) */
    size_t n_kept;     /* candidates kept by the last call (prefix of cand) */
    double kept_total; /* sum of their weights */
    double mass[4][RANK_BUCKETS]; /* top-p scratch: weight per rank bucket, in four lanes */
};

/* e^x for x <= 0 (engine_sample_exp), inlined into the weight loops; 0 below -80, for -inf
 * and for NaN. */
static inline float engine_sampler_exp_nonpos(float x)
{
    /* 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2; e^r by its Taylor series to
     * degree 6 (measured error under 3e-7 relative over [-80, 0]). ln 2 is split in two so
     * that n * ln2_hi is exact. Adding and subtracting 1.5 * 2^23 rounds to an integer.
     * Plain float operations only, so every IEEE machine gets the same bits as long as
     * multiply-adds are not fused (-std=c11 implies -ffp-contract=off). */
    const float log2e = 1.44269504f, ln2_hi = 0.693145751953125f, ln2_lo = 1.42860677e-6f;
    const float round_magic = 12582912.0f;
    if (!(x >= -80.0f))
        return 0.0f;
    float n = (x * log2e + round_magic) - round_magic;
    float r = (x - n * ln2_hi) - n * ln2_lo;
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
    return p * scale;
}

/* Weight of logit l when the largest candidate logit is mx: exactly 1 for the maximum
 * itself (so rows with +inf, or with every logit -inf, stay well defined). */
static inline float engine_sampler_cand_weight(float l, float mx)
{
    return l == mx ? 1.0f : engine_sampler_exp_nonpos(l - mx);
}

/* ---- Ranking and whole-row passes (engine/sampler_rows.c) ----------------------------- */

/* Sort c[0..n) by rank (larger w first, ties to the lower id); cheap when already nearly
 * sorted. */
void engine_sampler_insertion_sort(struct cand *c, size_t n);

/* The k (< n_vocab) highest-ranked logits, best first, at the front of s->cand (NaN ranks as
 * -inf). */
void engine_sampler_select_top_k(struct engine_sampler *s, const float *logits, size_t k);

/* engine_sampler_cand_weight(l[i], mx) for i in [0, n) into w, 16 at a time (a NaN weighs
 * 0). */
void engine_sampler_weights(const float *l, size_t n, float mx, float *w);

/* The largest value of l[0 .. n) (NaN never wins; -inf when there is none). */
float engine_sampler_row_max(const float *l, size_t n);

/* The sum of engine_sampler_cand_weight(l[i], mx) over l[0 .. n), in engine_sampler_chunk's
 * order within each SAMPLE_CHUNK tokens, the chunks added in double. */
double engine_sampler_weight_sum(const float *l, size_t n, float mx);

/* The k largest values of l[0 .. n) (NaN as -inf), largest first, a later equal value after
 * an earlier one, into top_v and their indices into top_id; returns how many (min(k, n), 0
 * for k <= 0). */
int engine_sampler_top_values(const float *l, size_t n, int k, int32_t *top_id, float *top_v);

/* Scales the row l in place by 1/t (NaN -> -inf) and fills s->zc with the weight per
 * SAMPLE_CHUNK tokens; returns the row maximum and sets *total to the sum of the weights. */
float engine_sampler_scale_chunks(struct engine_sampler *s, float *l, float t, double *total);

/* The second half of engine_sampler_scale_chunks, from each chunk's engine_sampler_chunk (z in
 * zc, maximum in mc; zc may be s->zc): returns the row maximum M; s->zc[c] becomes zc[c] times
 * e^(mc[c] - M) (the weight the chunk holds: every weight is engine_sampler_exp_nonpos(s - M),
 * 1 for the maximum), and *total their sum, added in chunk order in double. A fixed order, so
 * a fixed total. */
float engine_sampler_combine(struct engine_sampler *s, const double *zc, const float *mc,
                             double *total);

/* Inverse CDF over the whole scaled row l (maximum mx, weights summing to total) at u in
 * [0, 1): the token drawn. */
int32_t engine_sampler_draw_row(const struct engine_sampler *s, const float *l, float mx,
                                double total, double u);

/* top_p and/or min_p without top_k on the scaled row l: s->cand[0..m) ranked, a prefix of the
 * full ranking that holds the kept set; returns m. */
size_t engine_sampler_truncate_row(struct engine_sampler *s, const struct engine_sampling *p,
                                   const float *l, float mx, double total);

/* Greedy: argmax of the penalised logits, ties to the lowest id; NaN becomes -inf. Sets the
 * kept set to that one token. */
int32_t engine_sampler_greedy(struct engine_sampler *s, float *logits, float *logprob);

#endif
