/* The engine's private structures and the seams between its parts: engine.c (the public API and
 * the step), sched.c (queues, admission, preemption, batch building) and seq.c (a sequence's
 * tokens and text: accepting sampled tokens, stop strings, end-of-generation, streaming). Only
 * the engine's own files and its tests include it. */
#ifndef ENGINE_ENGINE_INTERNAL_H
#define ENGINE_ENGINE_INTERNAL_H

#include "engine/engine.h"

struct pool;

enum seq_state { SEQ_WAITING, SEQ_RUNNING, SEQ_DONE };

/* Shared by the choices of one request (engine_request.n_choices > 1 with the prefix cache on):
 * the choices after the first stay waiting until the first has computed the prompt, then fork
 * its KV (engine_kv_fork: its whole blocks shared, the last partly filled one copied) while it
 * runs, else find its whole blocks in the prefix cache. Freed with its last choice. */
struct seq_gate {
    int refs;      /* choices holding it */
    int open;      /* 1 once the first choice's prompt KV is written */
    int lead_slot; /* the first choice's KV slot while it runs with its prompt computed, else -1 */
};

struct seq {
    uint64_t id;                 /* request id */
    void *user;                  /* caller's pointer */
    enum seq_state state;        /* where it is */
    int slot;                    /* KV slot while running, else -1 */
    uint64_t admitted;           /* admission counter value (newest = largest) */
    int32_t *tok;                /* prompt then generated tokens (owned) */
    size_t n_tok;                /* tokens in tok */
    size_t cap_tok;              /* capacity of tok */
    size_t n_prompt;             /* prompt length */
    int32_t n_computed;          /* tokens whose KV is in the cache */
    struct engine_sampling sp;   /* sampling parameters */
    struct engine_rng rng;       /* per-request RNG */
    int32_t max_tokens;          /* generation limit */
    int ignore_eos;              /* keep going past EOG */
    int32_t n_gen;               /* tokens sampled */
    struct engine_stop *stop;    /* stop strings or NULL (owned) */
    struct engine_tok_stream ts; /* UTF-8 holdback */
    char *text;                  /* generated text (owned, NUL-terminated) */
    size_t n_text;               /* bytes in text */
    size_t cap_text;             /* capacity of text */
    size_t n_final;              /* bytes of text the stop matcher has released */
    size_t n_streamed;           /* bytes of text passed to on_text */
    void (*on_text)(void *user, const char *text, size_t n); /* streaming callback or NULL */
    int ended;                   /* 1 once an accepted token finished it (seq.c); the scheduler
                                  * then retires it (engine_sched_retire) */
    enum engine_finish finish;   /* why it ended */
    int stop_string;             /* a stop string ended it */
    size_t n_cached;             /* prompt tokens from the prefix cache at first admission */
    int preemptions;             /* times preempted */
    int choice;                  /* which choice of its request */
    int lead;                    /* 1 = the first choice: it opens the gate */
    struct seq_gate *gate;       /* shared with its sibling choices, or NULL */
    struct engine_grammar *grammar; /* output grammar (a reference) or NULL */
    int32_t gstate;              /* its state after the generated tokens */
    int lp_k;                    /* -1: no logprobs; else alternatives per token */
    float *lp;                   /* per generated token: its log-probability (cap_lp entries) */
    int32_t *lp_id;              /* lp_k alternatives per token: ids (cap_lp x lp_k) */
    float *lp_top;               /* and their log-probabilities */
    size_t cap_lp;               /* tokens lp holds room for */
    double t_arrival, t_first, t_finish; /* monotonic seconds */
    struct seq *next;            /* waiting / done list link */
    /* speculative decoding: the drafted path, of which n_draft tokens are in this step's batch
     * (written after the known tokens, at tok[n_tok..n_tok + n_draft), not counted in n_tok) */
    struct engine_draft draft;
    int n_draft;                 /* 0 outside a step */
    int32_t dstate[ENGINE_SPEC_MAX_K]; /* with a grammar: its state after drafts 0..i */
    float spec_rate;             /* recent share of drafted tokens accepted, < 0 = unknown */
    int spec_wait;               /* steps to sit out before drafting again (backoff) */
    int spec_backoff;            /* length of the next sit-out */
    int32_t d_computed;          /* draft model: positions of its KV that hold tok's tokens */
    int d_proposed;              /* draft model: tokens it drafted this step */
    int d_kmax;                  /* draft model: most tokens to draft this step */
    int d_ready;                 /* draft model: its room taken this step (spec_model.c) */
    int d_kind;                  /* draft model: this step's path kind (ENGINE_SPEC_KIND_*) */
    uint32_t d_paths;            /* draft model: paths it was given a kind for */
};

/* One draft token that could be verified this step: draft j of s, and the chance that it and
 * every draft before it are accepted (engine_sched_speculate). */
struct spec_slot {
    struct seq *s;
    int j;
    float surv;
};

struct engine {
    struct engine_model *m;      /* model (borrowed) */
    const struct engine_tok *tok; /* tokenizer (borrowed) */
    struct engine_params p;      /* parameters */
    struct engine_kv *kv;        /* paged KV cache */
    struct pool *pool;           /* host threads for sampling (owned) */
    struct engine_sampler **smp; /* sampling scratch, one per pool thread */
    int n_smp;                   /* pool threads */
    struct seq **s_seq;          /* this step's sampling jobs (one per logits row): sequence, */
    float **s_logits;            /* its logits row, */
    int32_t *s_id;               /* and the token drawn; for rows that want logprobs: */
    float *s_lp;                 /* the drawn token's log-probability, */
    int32_t *s_top_id;           /* ENGINE_TOP_LOGPROBS_MAX alternatives per row */
    float *s_top_lp;             /* and theirs */
    float **lp_row;              /* per pool thread: a copy of the row to sample from */
    const uint32_t **s_mask;     /* per row: the grammar's allowed tokens, or NULL */
    struct engine_vocab *vocab;  /* the vocabulary trie for masks (made with the first grammar) */
    struct seq **running;        /* running sequences, admission order, n_running used */
    int n_running;               /* count */
    int *free_slots;             /* stack of unused KV slots */
    int n_free_slots;            /* count */
    struct seq *wait_head, *wait_tail; /* waiting queue (preempted ones at the head) */
    struct seq *done_head, *done_tail; /* finished, not yet polled */
    struct seq *polled;          /* handed out by the last poll; freed at the next */
    size_t n_waiting;            /* waiting count */
    uint64_t next_id;            /* request ids */
    uint64_t admit_counter;      /* admission order */
    engine_start_gate_fn start_gate; /* engine_set_start_gate, or NULL */
    void *start_gate_ctx;
    const void **gate_users; /* this step's first admissions' users (max_seqs), for the gate */
    int n_gate_users;
    /* per-step batch scratch, max_batch_tokens entries */
    int32_t *b_tok, *b_pos, *b_seq; /* token, position, KV slot */
    uint8_t *b_want;             /* logits wanted */
    struct seq **b_owner;        /* per batch entry: its sequence */
    int n_logit_rows;            /* rows logits holds; a batch never wants more */
    float *logits;               /* n_logit_rows x n_vocab */
    char *piece;                 /* decode scratch */
    size_t piece_cap;            /* its size */
    struct engine_stats stats;   /* counters */
    struct engine_spec *spec;    /* speculative decoding, or NULL when off */
    int32_t *s_off;              /* per sampling row: its offset past its sequence's last known
                                  * token (0, or a draft's 1..n_draft) */
    int32_t *s_alt;              /* per row: engine_params.spec_test_broken's wrong redraw */
    uint8_t *s_stuck;            /* per row: its grammar allows no token (nothing drawn; a
                                  * sequence that reaches such a row ends, ENGINE_FINISH_GRAMMAR) */
    /* sampling on the backend (engine_model_samples): per row its parameters and what the
     * backend drew (s_drawn: 1 when it did), and the step's penalties */
    struct kern_sample_row *s_row;
    struct kern_sample_out *s_out;
    uint8_t *s_drawn;
    int32_t *pen_id, *pen_count; /* pen_cap entries */
    uint64_t *pen_pair;          /* pen_cap entries of sorting scratch (forward_hooked) */
    size_t pen_cap;
    /* the sampler's whole-row pass run in the output projection's epilogue (host-memory
     * backends, engine_model_forward_hook): per row whether it takes it (s_hook), its
     * penalties sorted by token (s_row[j].pen_first/pen_n in pen_id/pen_count), and each
     * chunk's sum and maximum (h_z, h_m: n_logit_rows x h_nc); hook_off: QUERN_SAMPLE_HOOK=0 */
    uint8_t *s_hook;
    double *h_z;
    float *h_m;
    size_t h_nc;
    int n_hook_rows; /* this step's rows (sampling rows) */
    int hook_off;
    uint32_t *masks; /* the step's grammar masks back to back (masks_cap masks) */
    int masks_cap;
    struct spec_slot *slots;     /* a step's candidate draft slots (sched.c) */
    /* the draft model's KV cache and batch (engine/spec_model.c) */
    struct engine_kv *dkv;
    float *d_logits;             /* max_seqs rows */
    int32_t *d_tok, *d_pos, *d_seq;
    uint8_t *d_want;
    struct seq **d_owner;
    struct seq **d_cand;         /* this step's drafting sequences (sched.c) */
    struct seq **d_todo, **d_lead; /* spec_model.c's catch-up lists (max_seqs each) */
    struct engine_sampler *d_smp;  /* the draft model's draws' scratch (its counts not the run's) */
};

/* Monotonic seconds (the clock of engine_output's timestamps). */
double engine_now(void);

/* ---- the draft model (spec_model.c) ---- */

/* Its KV cache (as many blocks as the model's, with its own prefix cache) and buffers; checks that
 * its vocabulary is the model's. */
enum status engine_draft_init(struct engine *e, struct err_detail *err);
/* Frees them (aborts if a slot was left holding blocks). */
void engine_draft_free(struct engine *e);
/* Draft up to cand[i]->d_kmax tokens into cand[i]->draft for each of the n sequences (each drawn
 * as the request's own sampler would draw it from the draft model's logits, with its random
 * number for that position), after catching the draft KV up on their known tokens; a sequence
 * without room in the draft KV gets none. d_proposed is set to what each drafted. */
enum status engine_draft_propose(struct engine *e, struct seq *const *cand, int n,
                                 struct err_detail *err);
/* After verification: base = the known tokens before it, acc = drafts accepted; the draft KV
 * keeps the positions whose tokens stood. */
void engine_draft_settle(struct engine *e, struct seq *s, size_t base, int acc);
/* s leaves its slot (finished or preempted): its draft KV blocks go back. */
void engine_draft_release(struct engine *e, struct seq *s);

/* ---- sequence state (seq.c) ---- */

/* A new sequence for a validated request r (engine_add_request checks it): copies the prompt,
 * the stop strings and the parameters, seeds its RNG. Caller frees with engine_seq_free. */
enum status engine_seq_new(struct seq **out, const struct engine_request *r,
                           struct err_detail *err);
/* NULL is a no-op. Drops s's reference to its gate. */
void engine_seq_free(struct seq *s);
/* The KV variant of s's sequence in model m's cache (engine_model_rope_variant of the most
 * positions its forwards hold: prompt + max_tokens - 1, the last token sampled is never fed). */
uint32_t engine_seq_rope_variant(const struct engine_model *m, const struct seq *s);
/* End s because its grammar allows no token (ENGINE_FINISH_GRAMMAR); its text so far is final
 * and streamed. */
void engine_seq_end_grammar(struct seq *s);
/* Room in s for k more accepted tokens of up to piece_cap text bytes each (tokens, text and,
 * when s wants log-probabilities, theirs): ST_ERR_NOMEM when memory ran out. A step makes it
 * for every sequence before it accepts any token, so that accepting cannot fail. */
enum status engine_seq_room(struct seq *s, size_t k, size_t piece_cap);
/* Record the log-probabilities of the token about to be accepted for s (lp_k >= 0): lp for
 * it, top_id / top_lp its lp_k alternatives. Call before engine_seq_accept of that token. */
void engine_seq_note_logprob(struct seq *s, float lp, const int32_t *top_id, const float *top_lp);
/* Frees a list linked through next. */
void engine_seq_list_free(struct seq *s);

/* Accept the sampled tokens ids[0..k) for s, in order, stopping at the first that finishes it
 * (an end-of-generation token, max_tokens, or a completed stop string); returns how many were
 * taken (1..k for k >= 1). Each taken token is counted in e->stats.gen_tokens, appended (an
 * end-of-generation token is not, unless ignore_eos) and its text streamed to on_text as it
 * becomes final. When s finishes, s->ended is set with finish, stop_string and t_finish, the
 * text is final (a stop string and what follows it dropped) and fully streamed; the caller
 * then retires it. s must be running and not ended. */
size_t engine_seq_accept(struct engine *e, struct seq *s, const int32_t *ids, size_t k);

/* ---- scheduling (sched.c) ---- */

/* Put a new request's sequence at the back of the waiting queue. */
void engine_sched_enqueue(struct engine *e, struct seq *s);
/* Build the step's batch in b_tok/b_pos/b_seq/b_want/b_owner: every decoding sequence's next
 * token (preempting the newest running sequences when the KV pool runs out), then prefill
 * chunks of running sequences, then newly admitted waiting ones, never more than
 * max_batch_tokens tokens nor n_logit_rows wanted rows. KV blocks for every entry are reserved.
 * Returns the token count, 0 only when nothing is waiting or running, -1 when the start gate
 * (engine_set_start_gate) failed (*err says why). */
int engine_sched_build(struct engine *e, struct err_detail *err);
/* Speculative decoding: draft for the sequences sampled in the nb-token batch just built, pick
 * the draft tokens worth verifying (engine/spec.h: survival against the step-cost model, or all
 * with ENGINE_SPEC_BUDGET_ALL), reserve their KV and insert them after their sequences' last
 * entries (logits wanted). Returns the new token count (nb when nothing was drafted). */
int engine_sched_speculate(struct engine *e, int nb);
/* A grammar's token mask m (bit t of word t / 32: token t allowed) applied to a row of n_vocab
 * logits: each token it does not allow set to -inf. Returns 0 when it allows none. */
int engine_mask_row(const uint32_t *m, float *row, int32_t n_vocab);
/* Room in s's token array for its known tokens plus n more (drafts written after them) and one
 * spare; 0 when it cannot grow. */
int engine_seq_tok_room(struct seq *s, size_t n);
/* After the forward pass of the nb-token batch: advance computed counts, register full blocks
 * of known tokens in the prefix cache (never draft tokens), count prompt tokens. */
void engine_sched_computed(struct engine *e, int nb);
/* Move an ended running sequence to the done list, releasing its KV slot. */
void engine_sched_retire(struct engine *e, struct seq *s);
/* engine_cancel's work on the queues: unlink and free every sequence of `user`. */
size_t engine_sched_cancel(struct engine *e, const void *user);
/* engine_unstarted's work (see engine.h). */
size_t engine_sched_unstarted(const struct engine *e, const void **users, size_t max);

#endif
