/* Per-request token sampling (penalties, top-k, temperature, top-p, min-p, seeded draw) and
 * stop-string matching. A request's result depends only on its own logits, history, params
 * and RNG, never on what else shares the batch. */
#ifndef ENGINE_SAMPLER_H
#define ENGINE_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

/* ---- Parameters ------------------------------------------------------------------------ */

/* Per-request sampling parameters (OpenAI names; llama.cpp semantics for repeat_penalty). */
struct engine_sampling {
    float temperature;     /* 0 = greedy (argmax, ties to lowest id); else logits /= T */
    int32_t top_k;         /* keep the k most likely tokens; 0 = off */
    float top_p;           /* keep the smallest most-likely prefix with mass >= top_p; 1 = off */
    float min_p;           /* drop tokens with p < min_p * p_max; 0 = off */
    float repeat_penalty;  /* tokens in the window: logit > 0 ? logit / rp : logit * rp; 1 = off */
    int32_t repeat_last_n; /* penalty window in tokens: -1 = whole history, 0 = no penalties */
    float frequency_penalty; /* logit -= count * fp, count = generated occurrences in the window */
    float presence_penalty;  /* logit -= pp when that count > 0 */
    uint64_t seed;           /* job/request seed, mixed with the request id by engine_rng_seed */
    /* Not a request parameter: the history index of the first generated token (the engine
     * sets the prompt's length). Frequency and presence count only tokens from there on, as
     * OpenAI's do (tokens sampled so far); the repetition penalty covers the prompt too
     * (llama.cpp's and Hugging Face's). 0: all of history counts. */
    uint32_t counted_from;
};

/* Temperature 1, top_p 1, repeat_penalty 1, every other penalty and filter off, seed 0,
 * counted_from 0; repeat_last_n -1 so that a request setting only frequency/presence
 * penalties gets the OpenAI behaviour (counts over everything generated). */
void engine_sampling_default(struct engine_sampling *p);

/* 1 when sampling with p is the plain argmax of the logits (greedy, no penalties): the engine
 * may then take the token without the logits (engine_model_forward_greedy). */
int engine_sampling_is_argmax(const struct engine_sampling *p);

/* Check user-supplied values: temperature in [0, 2], top_k >= 0, top_p in (0, 1],
 * min_p in [0, 1], repeat_penalty finite and > 0, repeat_last_n >= -1, frequency and
 * presence penalties in [-2, 2]. Returns ST_ERR_INVALID_ARG naming the first bad field. */
enum status engine_sampling_validate(const struct engine_sampling *p, struct err_detail *err);

/* ---- Random numbers -------------------------------------------------------------------- */

/* A request's random numbers, counter-based (Philox4x32-10, common/philox.h): a key from the
 * seed and the request id, and every draw named by what it is for. The sampler's draw for the
 * token at position pos is engine_rng_at(rng, pos, 0), so a request's tokens do not depend on
 * what shares its batches, on the thread count, on preemption or on the backend. (Seeded
 * outputs changed once, when this replaced a sequential xoshiro256** stream.) Plain value. */
struct engine_rng {
    uint64_t key; /* from engine_rng_seed */
    uint64_t ctr; /* next counter of the plain stream (engine_rng_next) */
};

/* Seed a per-request key from the job seed and the request id bytes (e.g. custom_id;
 * request_id may be NULL when id_len is 0). Same (seed, id) gives the same key; different
 * ids give unrelated ones. The plain stream starts at counter 0. */
void engine_rng_seed(struct engine_rng *r, uint64_t seed, const char *request_id, size_t id_len);

/* Choice `choice` of a request with several (OpenAI's n): choice 0 keeps the key, choice c > 0
 * replaces it with an unrelated key derived from (key, c), so each choice draws on its own and a
 * request's choice c is reproduced by a one-choice request given the same c. */
void engine_rng_choice(struct engine_rng *r, uint32_t choice);

/* The uniform double in [0, 1) (53 random bits) of draw number `draw` for the token at
 * position pos. A pure function of (key, pos, draw). */
double engine_rng_at(const struct engine_rng *r, uint64_t pos, uint32_t draw);

/* Next 64 random bits of the plain stream (synthetic data, tests): counter ctr, then ctr++.
 * Independent of every engine_rng_at draw. */
uint64_t engine_rng_next(struct engine_rng *r);

/* Uniform double in [0, 1) with 53 random bits (consumes one engine_rng_next). */
double engine_rng_uniform(struct engine_rng *r);

/* ---- Sampler --------------------------------------------------------------------------- */

/* Scratch for sampling over a vocabulary of n_vocab tokens (28 bytes a token + 64 KiB).
 * Owned by one worker thread; holds no per-request state between calls, so one sampler
 * serves every request the worker runs, in any order. */
struct engine_sampler;

/* Allocate a sampler for n_vocab > 0 tokens; caller frees with engine_sampler_free. */
enum status engine_sampler_init(struct engine_sampler **out, int32_t n_vocab,
                                struct err_detail *err);

/* Free a sampler; NULL is a no-op. */
void engine_sampler_free(struct engine_sampler *s);

/* Draw one token id in [0, n_vocab) for one request.
 * logits: n_vocab values, caller-owned, used as scratch (unspecified on return).
 * history: the request's previous tokens (prompt + generated) for the penalties; ids
 *   outside [0, n_vocab) are ignored. May be NULL when n_history is 0.
 * p: validated parameters (engine_sampling_validate); rng, pos: the request's key and the
 *   position of the token drawn (its index in prompt + generated); the draw uses the one
 *   uniform engine_rng_at(rng, pos, 0), none when greedy.
 * Order: penalties -> (temperature 0: argmax) -> top_k -> temperature + softmax -> top_p
 *   -> min_p -> renormalise -> draw by inverse CDF in rank order (id order when nothing
 *   truncates). Ties in ranking go to the lowest id. Probabilities are softmax weights
 *   exp(l - max) (engine_sample_exp) over their total: per 256-token chunk the float sum in
 *   16 lanes of exp(l - chunk max), times exp(chunk max - max), the chunk sums added in order
 *   in double (over the top_k candidates, in rank order, when top_k truncates).
 * top_p and min_p without top_k are first decided from the tokens above a weight that bounds
 *   the kept set (min_p, or a weight below which all tokens together cannot reach the
 *   nucleus); when there are more than ENGINE_SAMPLE_CANDS of them (see
 *   engine_sampler_set_max_cands), the whole row is ranked instead (engine_sampler_take_counts).
 *   Both give the same token: the kept set and the sums over it are the same numbers in the
 *   same order.
 * logprob (NULL = skip): natural log of the chosen token's probability under the final,
 *   renormalised distribution; for greedy, under softmax of the penalised logits.
 * The result depends only on (logits, history, p, rng key, pos). */
int32_t engine_sample(struct engine_sampler *s, const struct engine_sampling *p,
                      const struct engine_rng *rng, uint64_t pos, float *logits,
                      const int32_t *history, size_t n_history, float *logprob);

/* The penalties engine_sample applies for p after history: the distinct tokens among the last
 * repeat_last_n of history (ids outside [0, n_vocab) ignored) that a penalty touches (with a
 * repetition penalty all of them; else those generated, from p->counted_from on), in first-seen
 * order, into ids with their generated counts (0 for a token only the prompt holds); returns
 * how many (0 when p penalises nothing). ids and counts must hold the window's length (at most
 * n_history). A backend that samples (kern_ops.sample) gets these. */
size_t engine_sampler_counts(struct engine_sampler *s, const struct engine_sampling *p,
                             const int32_t *history, size_t n_history, int32_t *ids,
                             int32_t *counts);

/* engine_sample with the draw's uniform u in [0, 1) given instead of (rng, pos), as a backend
 * that samples gets it (struct kern_sample_row.u): engine_sample(..., rng, pos, ...) is
 * engine_sample_u(..., engine_rng_at(rng, pos, 0), ...). Tests use it to draw at chosen
 * uniforms, e.g. next to the boundary between two tokens. */
int32_t engine_sample_u(struct engine_sampler *s, const struct engine_sampling *p, double u,
                        float *logits, const int32_t *history, size_t n_history, float *logprob);

/* engine_sample's whole-row pass cut in chunks, so that a backend can run it while the rows
 * are in cache (kern_ops.matmul_hook): chunk c holds tokens [c * ENGINE_SAMPLE_CHUNK,
 * min((c + 1) * ENGINE_SAMPLE_CHUNK, n_vocab)). For a row whose draw takes it (temperature > 0
 * and no top_k below n_vocab), engine_sample is bitwise: penalise each chunk's logits of the
 * tokens engine_sampler_counts gives (l = engine_sampler_penalise(p, l, count)), run
 * engine_sampler_chunk on it (z[c], m[c]), then engine_sample_chunked with the uniform
 * engine_rng_at(rng, pos, 0). */
#define ENGINE_SAMPLE_CHUNK 256

/* One penalised logit: l after the repetition penalty and count * frequency + presence (the
 * presence only when count > 0). */
float engine_sampler_penalise(const struct engine_sampling *p, float l, int32_t count);

/* One chunk src[0 .. n) of a row at temperature t, scaled into l (NaN -> -inf, / t; l may be
 * src); returns the sum of the chunk's weights relative to its maximum, which goes to *max. */
double engine_sampler_chunk(const float *src, float *l, size_t n, float t, float *max);

/* engine_sample's draw from a row whose chunks went through the above (z, m: one entry per
 * chunk), at uniform u. */
int32_t engine_sample_chunked(struct engine_sampler *s, const struct engine_sampling *p, double u,
                              float *logits, const double *z, const float *m, float *logprob);

/* Most candidates the truncated fast path ranks (see engine_sample). */
#define ENGINE_SAMPLE_CANDS 8192

/* Most candidates s's truncated fast path ranks (default ENGINE_SAMPLE_CANDS; 0 = always
 * rank the whole row, as tests do to compare the two). */
void engine_sampler_set_max_cands(struct engine_sampler *s, size_t max);

/* Rows s has drawn with top_p or min_p (and no top_k) since the last call (or since it was
 * made): decided from the candidates (*fast) and by ranking the whole row (*fallback). The
 * counts restart from zero. */
void engine_sampler_take_counts(struct engine_sampler *s, uint64_t *fast, uint64_t *fallback);

/* e^x for x <= 0 exactly as the sampler computes softmax weights: plain float arithmetic,
 * so the same bits on every IEEE machine and libm (relative error under 4e-7); returns 0
 * for x < -80 (such tokens never matter next to the maximum, whose weight is 1), -inf and
 * NaN. */
float engine_sample_exp(float x);

/* The candidates that survived truncation in the last engine_sample call on s: how many. */
size_t engine_sampler_n_kept(const struct engine_sampler *s);

/* The i-th surviving candidate (i < engine_sampler_n_kept) of the last call: returns its id
 * and stores its final probability in *prob (may be NULL). Order is by descending
 * probability (ties to lowest id) when top_k, top_p or min_p truncated, otherwise by id. After a
 * greedy call there is one candidate, the argmax, with probability 1. When nothing
 * truncated, the probabilities are read from that call's logits row: valid only until the
 * caller changes it. */
int32_t engine_sampler_kept(const struct engine_sampler *s, size_t i, double *prob);

/* ---- Log-probabilities ------------------------------------------------------------------- */

/* Most alternatives engine_logprobs reports per position (OpenAI's top_logprobs limit). */
#define ENGINE_TOP_LOGPROBS_MAX 20

/* Log-probabilities under the model's own distribution: the log-softmax of the raw logits row
 * (before penalties, temperature and any truncation, as OpenAI's logprobs are; NaN counts as
 * -inf). Stores the chosen token's in *chosen_lp and the k (0..ENGINE_TOP_LOGPROBS_MAX, at most
 * n_vocab) most likely ids in top_id[0..k) with theirs in top_lp, by descending logit, ties to
 * the lower id. The normaliser is max + log of the sum of the weights 1 for the maximum,
 * engine_sample_exp(l - max) for the others (relative error of each under 4e-7), summed as
 * the sampler's chunk pass sums them (16 float lanes per 256 tokens, chunks in double). Reads
 * logits only; a pure function. */
void engine_logprobs(const float *logits, int32_t n_vocab, int32_t chosen, int k,
                     float *chosen_lp, int32_t *top_id, float *top_lp);

/* ---- Stop strings ---------------------------------------------------------------------- */

/* Longest stop string accepted, in bytes. */
#define ENGINE_STOP_MAX_LEN 1024

/* Matcher of a request's generated text against its stop strings (OpenAI `stop`). The
 * caller owns the generated text; the matcher keeps a private copy of the short pending
 * tail (under ENGINE_STOP_MAX_LEN bytes) it needs to see stops that span several pushes. */
struct engine_stop;

/* Build a matcher for n stop strings (NUL-terminated, non-empty, at most
 * ENGINE_STOP_MAX_LEN bytes each); they are copied, so the caller may free them after the
 * call. n == 0 gives a matcher that never matches. Caller frees with engine_stop_free. */
enum status engine_stop_init(struct engine_stop **out, const char *const *stops, size_t n,
                             struct err_detail *err);

/* Free a matcher; NULL is a no-op. */
void engine_stop_free(struct engine_stop *s);

/* Feed len newly generated bytes. The "pending" text is every byte pushed but not yet
 * released; *emit_len is set to how many bytes from the start of the pending text are now
 * final and may be emitted (they can no longer be part of a stop string); the rest stays
 * pending. Returns 1 when a stop string completed: *emit_len then counts the bytes before
 * the stop string, and the stop string and everything after it must be dropped. The match
 * is the occurrence that ends first in the whole text (the longest one if several end
 * there), so results do not depend on how the text was split into pushes. After a match,
 * further pushes return 1 with *emit_len 0. Emitted boundaries are byte positions and may
 * split a UTF-8 character; callers that stream must hold partial characters themselves. */
int engine_stop_push(struct engine_stop *s, const char *text, size_t len, size_t *emit_len);

/* Bytes pushed but not yet released (the text to emit at end of generation when no stop
 * string matched, e.g. on max_tokens). */
size_t engine_stop_pending(const struct engine_stop *s);

/* Index (into the init array) of the stop string that matched, or -1 before a match. */
int engine_stop_matched(const struct engine_stop *s);

#endif
