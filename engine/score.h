/* Scoring text with the model: the negative log-likelihood of tokens given the tokens before them
 * in their window, many windows at once through the batched multi-sequence forward pass (what
 * `quern perplexity` measures). The forward pass is batch-invariant, so a window's numbers do not
 * depend on which windows share its batches. */
#ifndef ENGINE_SCORE_H
#define ENGINE_SCORE_H

#include <stdint.h>

#include "common/err.h"
#include "engine/model.h"

/* One window: tokens tok[0..n) run as one sequence from position 0; targets tok[from..n) are
 * scored, each by the logits of the position before it (1 <= from <= n). */
struct engine_score_window {
    const int32_t *tok; /* n tokens (borrowed) */
    int n;              /* window length, <= the KV pool's per-sequence capacity */
    int from;           /* first scored target */
    int bos_first;      /* 1: position 0 holds bos instead of tok[0] (a window that starts in
                         * the middle of a text, for a model that adds BOS; from >= 1) */
    int32_t bos;
};

/* How windows go through the model. */
struct engine_score_opts {
    int max_seqs;         /* windows in flight at once (>= 1) */
    int max_batch_tokens; /* tokens per forward step (>= max_seqs) */
    int kv_block;         /* tokens per KV block */
    int kv_dtype;         /* enum kern_kv_dtype */
    /* Optional: called after each forward step with windows finished and tokens run so far. */
    void (*progress)(void *ctx, int windows_done, long tokens_run);
    void *progress_ctx; /* its argument */
    int *kv_stored;     /* Optional out: the KV dtype the backend stores (kern_kv_layer.dtype:
                         * f16 is bf16 in the CPU's bf16 mode) */
};

/* Scores n_win windows: nll[k] (caller-owned, sum of (n - from) over the windows, in window
 * order) = -log p(target k), computed in double from the f32 logits. */
enum status engine_score(struct engine_model *m, const struct engine_score_window *win,
                         int n_win, const struct engine_score_opts *o, double *nll,
                         struct err_detail *err);

#endif
