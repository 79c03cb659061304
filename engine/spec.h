/* Speculative decoding's parts that know nothing of sequences or batches (the engine's
 * scheduler uses them, engine/sched.c): the drafters, the confidence model that turns a
 * drafter's evidence into a calibrated acceptance probability, and the step-cost model the
 * load-aware budget reads.
 *
 * Drafters are deterministic: each proposes one path of up to k tokens, each token with its
 * evidence. "ngram" (prompt lookup) matches the sequence's last tokens against its own earlier
 * tokens (prompt and output); "suffix" matches them against an index of the finished outputs
 * of the same engine's job (each with the last prompt tokens before it), learned online as
 * requests finish and bounded in memory (a ring of ENGINE_SPEC_INDEX_TOKENS tokens with hash
 * chains). Where several earlier occurrences match, the path follows the most frequent
 * continuation (among the longest matches), as SuffixDecoding's frequency-weighted tree does.
 *
 * Confidence: each draft token falls in a bin by drafter, depth, vote share, support, match
 * length and the request's recent acceptance; a bin's estimate is its observed conditional
 * acceptance rate (accepted given every earlier draft token of the path was), shrunk toward
 * its coarse bin (drafter, depth, share) and a 0.5 prior while it has few observations. The
 * survival of draft j is the product of the first j estimates; how honest those products are
 * is tracked as the expected calibration error (ECE) of survival over 10 bins. */
#ifndef ENGINE_SPEC_H
#define ENGINE_SPEC_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#define ENGINE_SPEC_MAX_K 16             /* draft tokens per sequence and step at most */
#define ENGINE_SPEC_INDEX_TOKENS (1 << 20) /* tokens the job's suffix index keeps (ring) */

#define ENGINE_SPEC_NGRAM 0x1  /* draft from the request's own tokens (prompt lookup) */
#define ENGINE_SPEC_SUFFIX 0x2 /* draft from the job's finished outputs */
#define ENGINE_SPEC_MODEL  0x4 /* draft with a draft model (engine_params.draft_model) */
enum { ENGINE_SPEC_BUDGET_AUTO = 0, ENGINE_SPEC_BUDGET_ALL = 1 };

enum engine_spec_src { ENGINE_SPEC_SRC_SELF = 0, ENGINE_SPEC_SRC_JOB = 1, ENGINE_SPEC_SRC_MODEL = 2 };

/* One drafted path. */
struct engine_draft {
    int n;                              /* tokens proposed */
    int src;                            /* enum engine_spec_src */
    int32_t tok[ENGINE_SPEC_MAX_K];     /* the tokens */
    float c[ENGINE_SPEC_MAX_K];         /* confidence: P(token i accepted | 0..i-1 were) */
    float u[ENGINE_SPEC_MAX_K];         /* c plus an exploration bonus (what the budget uses) */
    uint16_t bin[ENGINE_SPEC_MAX_K];    /* calibration bin of each token */
};

struct engine_spec;

/* A speculation state for drafters `drafters` (ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX bits of
 * engine_params.spec) and batches of up to max_batch_tokens tokens. */
enum status engine_spec_new(struct engine_spec **out, int drafters, int max_batch_tokens,
                            struct err_detail *err);
void engine_spec_free(struct engine_spec *sp);

/* Draft up to k (<= ENGINE_SPEC_MAX_K) tokens to follow tok[0..n) with every drafter on and
 * keep the path with the larger expected accepted length; recent: the request's recent
 * acceptance rate in [0, 1], or < 0 when unknown. Returns d->n (0: nothing to propose). */
int engine_spec_propose(struct engine_spec *sp, const int32_t *tok, size_t n, int k,
                        float recent, struct engine_draft *d);

/* How a draft model drafts a path: a greedy request gets its argmax (ENGINE_SPEC_KIND_GREEDY);
 * a sampled request either a draw from the draft model's distribution with the verifier's random
 * number for that position (ENGINE_SPEC_KIND_DRAW), which the verifier's own draw matches
 * whenever the two distributions agree around that number -- always, when the draft model is the
 * model -- or its argmax (ENGINE_SPEC_KIND_ARGMAX), which the verifier's draw matches with the
 * model's probability of it: better where the two models differ more (engine_spec_model_kind
 * chooses). */
enum { ENGINE_SPEC_KIND_GREEDY = 0, ENGINE_SPEC_KIND_DRAW = 1, ENGINE_SPEC_KIND_ARGMAX = 2 };

/* Estimates for token j of a draft model's path (d->src ENGINE_SPEC_SRC_MODEL): its bin by
 * depth, the draft model's probability of the token (prob, as a vote share), the path's kind
 * (ENGINE_SPEC_KIND_*: each is accepted at its own rate for the same probability) and the
 * request's recent acceptance. */
void engine_spec_rate_model(const struct engine_spec *sp, struct engine_draft *d, int j, float prob,
                            int kind, float recent);

/* The kind of path number `path` of sequence `seq` (a sampled request's): the kind whose first
 * tokens were accepted more often lately (each kind's rate over its last ~128 verified first
 * tokens, older ones fading). Until both kinds have ENGINE_SPEC_EXPLORE verified first tokens,
 * either at even odds, and after that the other one on 1 path in 16, so that the choice follows
 * the job: a coin from (seq, path), so that every sequence tries both and the choice depends on
 * nothing else (not on which sequences draft together). */
int engine_spec_model_kind(const struct engine_spec *sp, uint64_t seq, uint32_t path);

/* A verification of d's first n_tried tokens accepted the first n_acc: updates the bins and
 * the survival calibration statistics. */
void engine_spec_observe(struct engine_spec *sp, const struct engine_draft *d, int n_tried,
                         int n_acc);

/* Add a finished request to the job index: the last prompt tokens before its output (at most
 * 8 of prompt[0..n_prompt)) and its output. No-op without the suffix drafter. */
void engine_spec_learn(struct engine_spec *sp, const int32_t *prompt, size_t n_prompt,
                       const int32_t *out, size_t n_out);

/* Step cost model: a step of b tokens took seconds (warm 1: a warm-up pass; 0: a real step),
 * kept per batch size as an exponential average. engine_spec_cost(b) is the estimate for b
 * tokens (1 <= b <= max_batch_tokens): what real steps of b tokens took, else the warm-up's
 * curve (interpolated between its sizes) scaled to the nearest size real steps measured;
 * non-decreasing in b; 0 until anything is measured. */
void engine_spec_time(struct engine_spec *sp, int b, double seconds, int warm);
double engine_spec_cost(struct engine_spec *sp, int b);

/* Largest first-token confidence, with its exploration bonus, any draft could get now (the
 * budget's quick "is drafting worth anything at this load" test). */
float engine_spec_best_conf(const struct engine_spec *sp);

/* 1 while draft token j's coarse bin (drafter, depth, vote share) has been verified fewer than
 * ENGINE_SPEC_EXPLORE times: the budget verifies such tokens even when their estimate does not
 * pay, so that every kind of draft gets evidence. */
#define ENGINE_SPEC_EXPLORE 32
int engine_spec_exploring(const struct engine_spec *sp, const struct engine_draft *d, int j);
/* Survival ECE over observations after the first ENGINE_SPEC_ECE_WARMUP verified draft tokens
 * (negative when there are none yet), and the count it covers. */
#define ENGINE_SPEC_ECE_WARMUP 2000
double engine_spec_ece(const struct engine_spec *sp, uint64_t *n);

#endif
