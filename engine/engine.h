/* The batch engine: requests go in with engine_add_request, engine_step runs one forward pass
 * over every running sequence's next token plus prefill chunks of waiting ones (continuous
 * batching over a paged, prefix-cached KV cache), and finished requests come out of
 * engine_poll. Single-threaded API; the kernels underneath use the backend's threads, and the
 * engine samples on its own pool of host_threads between forward passes. */
#ifndef ENGINE_ENGINE_H
#define ENGINE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "engine/grammar.h"
#include "engine/kv.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/spec.h"
#include "engine/tokenizer.h"

struct engine_params {
    int max_seqs;          /* sequences running at once (default 256) */
    int max_batch_tokens;  /* tokens per forward step (default 512) */
    int kv_block;          /* tokens per KV block (default 16) */
    size_t kv_mem;         /* bytes for the KV pool (default 1 GiB); 0 = engine_kv_mem_auto's */
    int prefix_cache;      /* reuse cached prompt blocks (default 1) */
    int kv_window_pool;    /* sliding-window layers in their own pool, blocks out of the window
                            * given back (default 1; engine_model_kv_plan) */
    int kv_dtype;          /* enum kern_kv_dtype: KERN_KV_F16 (default) or KERN_KV_Q8 */
    int host_threads;      /* threads sampling a step's rows; 0 (default) = online CPUs, at
                            * most 8. The tokens do not depend on it. */
    int spec;              /* speculative decoding's drafters: 0 (default) = off, else
                            * ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX (engine/spec.h). Lossless:
                            * a request's tokens are the same with it on or off */
    int spec_max_k;        /* draft tokens per sequence and step at most, 1..ENGINE_SPEC_MAX_K
                            * (default 8) */
    int spec_budget;       /* ENGINE_SPEC_BUDGET_AUTO (default): verify only the draft tokens
                            * that raise the expected tokens per second; _ALL: every one drafted */
    struct engine_model *draft_model; /* with ENGINE_SPEC_MODEL: the draft model (borrowed; the
                            * same vocabulary); its KV pool gets as many blocks as the model's */
    int spec_test_broken;  /* tests only: 1 = a rejected draft's replacement is drawn afresh
                            * from the whole distribution instead of the residual (wrong: the
                            * distribution test must catch it) */
    int spec_test_draws;   /* tests only: how a draft model drafts for sampled requests: 0 as
                            * learned (engine_spec_model_kind), 1 draws, 2 argmax, 3 draws with
                            * other random numbers than the verifier's (matching less often) */
};


void engine_params_default(struct engine_params *p);

/* The KV pool engine_init makes of kv_mem 0 (--kv-mem auto), given avail bytes of host memory
 * this process can take (mem_available, 0 unknown): on a backend in host memory a quarter of
 * avail (with a draft model, the main pool's share of it: the draft's pool has as many blocks),
 * at most what max_seqs sequences at the model's full context take, and at least 1 GiB
 * and one full-context sequence (or all of the first when less); 1 GiB where avail is unknown
 * (a device backend: engine_kv_mem_resolve). */
size_t engine_kv_mem_auto(const struct engine_model *m, const struct engine_params *p,
                          uint64_t avail);

/* The device memory --kv-mem auto leaves to the runtime (its context, the allocator's rounding,
 * libraries' workspaces) on a device of total bytes: 5 %, at least 256 MiB. */
size_t engine_device_reserve(size_t total);

/* The KV pool --kv-mem auto makes on n_rank device ranks whose memory is mi[r] (the forward
 * pass's buffers already taken): each rank's share of its device's free memory beyond
 * engine_device_reserve (ranks reporting one device share it), the least of the ranks' shares
 * times n_rank (the pool splits evenly by KV head), at most need; 0 when a device has no room. */
uint64_t engine_kv_mem_device(const struct kern_mem_info *mi, int n_rank, uint64_t need);

/* The KV pool's bytes engine_init makes of p: p->kv_mem when set, else --kv-mem auto's: on the
 * CPU engine_kv_mem_auto of the memory available now, on a device the buffers of the forward
 * pass (and the draft model's) reserved first and engine_kv_mem_device of what is left once
 * logit_rows rows of logits and sample_rows rows of the device sampler's scratch are set aside
 * (the most a batch of the caller's wants: engine_logit_rows each for engine_init), at most
 * max_seqs full-context sequences (a warning when less than one; an error when no room). */
enum status engine_kv_mem_resolve(struct engine_model *m, const struct engine_params *p,
                                  int logit_rows, int sample_rows, size_t *out,
                                  struct err_detail *err);

#define ENGINE_MAX_STOP 8
#define ENGINE_MAX_CHOICES 128

/* One request. The engine copies everything it needs; the caller may free after adding. */
struct engine_request {
    const int32_t *prompt;          /* prompt token ids */
    size_t n_prompt;                /* >= 1 */
    struct engine_sampling sampling; /* validated by engine_add_request */
    int32_t max_tokens;             /* tokens to generate at most, >= 1 */
    int ignore_eos;                 /* 1 = do not stop at end-of-generation tokens */
    const char *const *stop;        /* stop strings (not part of the output) */
    size_t n_stop;                  /* <= ENGINE_MAX_STOP */
    const char *request_id;         /* seeds the RNG with sampling.seed; NUL-terminated */
    void *user;                     /* returned with the output */
    int n_choices;                  /* independent completions of the prompt (OpenAI's n; 0
                                     * counts as 1), at most ENGINE_MAX_CHOICES: choice i draws
                                     * with engine_rng_choice(first_choice + i) and comes out as
                                     * its own engine_output. With the prefix cache on, choices
                                     * after the first wait until the first has computed the
                                     * prompt, then share its full KV blocks (each recomputes
                                     * only the prompt's last, partial block) */
    int first_choice;               /* index of the first choice (usually 0) */
    struct engine_grammar *grammar; /* NULL, or the grammar the output must follow (structured
                                     * outputs): each step masks the tokens that cannot continue
                                     * it, end-of-generation only where it may end; the engine
                                     * holds a reference while the request runs */
    int logprobs;                   /* 1 = report each generated token's log-probability
                                     * (after the grammar's mask, when there is one) */
    int top_logprobs;               /* with logprobs: alternatives per token, 0..
                                     * ENGINE_TOP_LOGPROBS_MAX (engine_logprobs) */
    /* Optional streaming: called from engine_step with each piece of the output text as it
     * becomes final (complete UTF-8, past any possible stop string), in order; the pieces
     * concatenate to the output's text. NULL = no streaming. */
    void (*on_text)(void *user, const char *text, size_t n);
};

enum engine_finish {
    ENGINE_FINISH_STOP = 0,   /* end-of-generation token or stop string */
    ENGINE_FINISH_LENGTH = 1, /* max_tokens reached */
    ENGINE_FINISH_GRAMMAR = 2, /* the request's grammar allowed no token (too ambiguous:
                                * ENGINE_GRAMMAR_MAX_STACKS; or no token spells what it needs);
                                * the output is not a complete sentence of it */
};

/* A finished request; valid until the next engine_poll/engine_free. */
struct engine_output {
    uint64_t id;                /* as returned by engine_add_request */
    void *user;                 /* caller's pointer */
    const int32_t *tokens;      /* generated token ids (excluding a final EOG token) */
    size_t n_tokens;            /* count */
    const char *text;           /* generated text, stop string removed (NUL-terminated) */
    size_t text_len;            /* bytes */
    enum engine_finish finish;  /* why it ended */
    int stop_string;            /* 1 when a stop string ended it (finish is then STOP) */
    size_t n_prompt;            /* prompt tokens */
    size_t n_cached;            /* prompt tokens served from the prefix cache (first admission) */
    double t_arrival;           /* engine_add_request time (monotonic s) */
    double t_first;             /* first generated token */
    double t_finish;            /* completion */
    int preemptions;            /* times evicted and recomputed */
    int choice;                 /* which choice of its request (first_choice + i) */
    /* With logprobs: per generated token (n_tokens entries), its log-probability under the
     * model's raw distribution (engine_logprobs), and top_logprobs alternatives each (ids by
     * descending probability and their log-probabilities, n_tokens x top_logprobs). NULL and 0
     * when the request did not ask. */
    const float *logprobs;
    int top_logprobs;
    const int32_t *top_ids;
    const float *top_lps;
};

struct engine_stats {
    uint64_t steps;             /* forward passes */
    uint64_t batch_tokens;      /* tokens over all steps */
    uint64_t batch_seqs;        /* running sequences summed over steps */
    uint64_t prompt_tokens;     /* prompt tokens computed (excluding cache hits) */
    uint64_t cached_tokens;     /* prompt tokens found in the prefix cache at first admission */
    uint64_t gen_tokens;        /* tokens sampled */
    uint64_t preemptions;       /* sequences preempted */
    uint64_t cancelled;         /* sequences dropped unfinished by engine_cancel */
    uint64_t cancelled_tokens;  /* tokens sampled for the sequences engine_cancel dropped */
    uint64_t nucleus_fast;      /* top_p/min_p draws decided from candidates (sampler.h) */
    uint64_t nucleus_full;      /* ... and by ranking the whole row (the fallback) */
    uint64_t sampled_backend;   /* rows drawn by a backend that samples (kern_ops.sample) */
    uint64_t sampled_host;      /* ... and rows it left to the host (grammars, its limits) */
    uint64_t sampled_epilogue;  /* rows whose whole-row pass ran in the output projection's
                                 * epilogue (kern_ops.matmul_hook, the CPU backend) */
    int32_t peak_blocks_used;   /* most KV blocks referenced at once */
    /* speculative decoding (engine_params.spec) */
    uint64_t spec_steps;        /* steps that verified draft tokens */
    uint64_t spec_skipped;      /* steps whose load left no room worth drafting for */
    uint64_t spec_drafted;      /* draft tokens verified */
    uint64_t spec_accepted;     /* of those, accepted */
    uint64_t spec_tried_at[ENGINE_SPEC_MAX_K]; /* per draft position: verified ... */
    uint64_t spec_acc_at[ENGINE_SPEC_MAX_K];   /* ... and accepted */
    double spec_draft_s;        /* seconds spent drafting */
    uint64_t spec_model_tokens; /* --spec model: tokens the draft model computed ... */
    uint64_t spec_model_cached; /* ... and known tokens it found in its prefix cache instead */
    uint64_t spec_model_drawn; /* sampled requests' draft-model paths drawn from its distribution */
    uint64_t spec_model_argmax; /* ... and those that took its argmax (engine_spec_model_kind) */
    double spec_ece;            /* survival ECE after warm-up (engine/spec.h), -1 = none yet */
};

/* What the engine holds at this moment (engine_get_load), for progress displays. Tokens
 * generated so far, by unfinished requests too, are engine_get_stats()->gen_tokens. */
struct engine_load {
    int running;                /* sequences running (holding a KV slot) */
    size_t waiting;             /* requests waiting: new ones and preempted ones */
    int32_t kv_used;            /* KV blocks referenced now (cached free blocks not counted) */
    int32_t kv_total;           /* blocks in the (main) pool */
};

struct engine;

/* Rows of logits the engine keeps for p (one per running sequence, and some for draft tokens
 * with speculation): with the vocabulary, what engine_logits_bytes costs. */
int engine_logit_rows(const struct engine_params *p);

/* The engine's largest host buffer: its logits rows x n_vocab floats (`quern plan` counts it;
 * --max-seqs 8192 on a 49k vocabulary is 1.6 GB). */
size_t engine_logits_bytes(const struct engine_params *p, int32_t n_vocab);

/* The engine borrows m and tok (they must outlive it). */
enum status engine_init(struct engine **out, struct engine_model *m, const struct engine_tok *tok,
                        const struct engine_params *p, struct err_detail *err);
/* The bytes of KV storage engine_init sized its pools for (p->kv_mem, or what 0 made). */
size_t engine_kv_pool_bytes(const struct engine *e);
/* Frees everything; in debug builds (!NDEBUG) aborts if the KV check finds a leak. */
void engine_free(struct engine *e);

/* Queue a request. ST_ERR_RANGE when prompt + max_tokens exceeds the model context or the
 * KV pool could never hold it; ST_ERR_INVALID_ARG for bad parameters. */
enum status engine_add_request(struct engine *e, const struct engine_request *r, uint64_t *id,
                               struct err_detail *err);
/* Drop every choice of the request added with `user` as its engine_request.user: waiting,
 * running (its KV slot given back; whole prompt blocks stay in the prefix cache) or finished
 * and not yet polled. Nothing of it is returned by engine_poll any more. Between steps only.
 * Returns the sequences dropped (0 when none has that user). */
size_t engine_cancel(struct engine *e, const void *user);
/* The users of the requests none of whose choices has started (every one waiting, never
 * admitted to a step, none finished): up to max of them into users, oldest first, each once;
 * returns how many. A choice already polled is not seen here: the caller knows those. With
 * engine_cancel, a stopping run gives such requests back instead of starting them. */
size_t engine_unstarted(const struct engine *e, const void **users, size_t max);
/* A gate on first admissions: once a step's batch is built, before it is computed, gate(ctx,
 * users, n, err) is called with the users of the sequences the step computes for the first time
 * (a request with several choices may be there more than once): a runner records there,
 * durably, that those requests have begun (a crash from then on may be their doing). An error
 * it returns is engine_step's, and nothing is computed; the engine must not be stepped again
 * (the run fails). NULL: no gate. Fails only for lack of memory. */
typedef enum status (*engine_start_gate_fn)(void *ctx, const void *const *users, int n,
                                            struct err_detail *err);
enum status engine_set_start_gate(struct engine *e, engine_start_gate_fn gate, void *ctx,
                                  struct err_detail *err);
/* Run one step (no-op when idle). */
enum status engine_step(struct engine *e, struct err_detail *err);
/* Requests waiting or running. */
size_t engine_pending(const struct engine *e);
/* Take up to max finished requests (oldest first); returns how many. */
size_t engine_poll(struct engine *e, struct engine_output *out, size_t max);
/* One short batch to fault in weights and buffers; leaves no state behind. */
enum status engine_warmup(struct engine *e, struct err_detail *err);

const struct engine_stats *engine_get_stats(const struct engine *e);
const struct engine_kv *engine_get_kv(const struct engine *e);
/* Fill *out with the engine's current load (constant time). */
void engine_get_load(const struct engine *e, struct engine_load *out);

#endif
