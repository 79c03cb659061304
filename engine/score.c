/* Window scoring (engine/score.h). Windows go through in groups of up to max_seqs sequences, each
 * group's tokens position by position in steps of up to max_batch_tokens tokens (every window of
 * the group advances by the same chunk), asking logits only for positions whose next token is
 * scored. Each such row becomes -log softmax(row)[target], summed in double. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv.h"
#include "engine/model.h"
#include "engine/score.h"
#include "kernels/kernels.h"

/* -log softmax(row)[target] in double: log sum exp(row - max) + max - row[target]. */
static double row_nll(const float *row, int n, int32_t target)
{
    float mx = row[0];
    for (int i = 1; i < n; i++)
        mx = row[i] > mx ? row[i] : mx;
    double s = 0;
    for (int i = 0; i < n; i++)
        s += exp((double)row[i] - (double)mx);
    return log(s) + (double)mx - (double)row[target];
}

enum status engine_score(struct engine_model *m, const struct engine_score_window *win,
                         int n_win, const struct engine_score_opts *o, double *nll,
                         struct err_detail *err)
{
    const int V = engine_model_hparams(m)->n_vocab;
    int max_len = 1;
    for (int w = 0; w < n_win; w++) {
        if (win[w].n < 1 || win[w].from < 1 || win[w].from > win[w].n)
            return err_set(err, ST_ERR_INVALID_ARG, "window %d: %d tokens, scored from %d", w,
                           win[w].n, win[w].from);
        max_len = win[w].n > max_len ? win[w].n : max_len;
    }
    const int S = o->max_seqs < n_win ? o->max_seqs : (n_win > 0 ? n_win : 1);
    const int T = o->max_batch_tokens > S ? o->max_batch_tokens : S;
    const struct engine_hparams *hp = engine_model_hparams(m);
    const int32_t blocks = (int32_t)S * ((max_len + o->kv_block - 1) / o->kv_block);
    struct engine_kv *kv = NULL;
    enum status st = engine_kv_init(&kv, hp->n_layer, hp->n_kv_head, hp->head_dim, o->kv_dtype,
                                    o->kv_block, blocks, S, 0, err);
    if (st)
        return st;
    if ((st = engine_model_kv_attach(m, kv, T, err))) { /* storage, and batches of T tokens */
        engine_kv_free(kv);
        return st;
    }
    if (o->kv_stored)
        *o->kv_stored = engine_kv_layer(kv, 0, 0).dtype;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T), *pos = malloc(sizeof(int32_t) * (size_t)T);
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)T), *target = malloc(sizeof(int32_t) * (size_t)T);
    uint8_t *want = malloc((size_t)T);
    size_t *slot = malloc(sizeof(size_t) * (size_t)T);
    size_t *base = malloc(sizeof(size_t) * (size_t)(n_win + 1));
    float *logits = malloc(sizeof(float) * (size_t)T * (size_t)V);
    if (!tok || !pos || !seq || !target || !want || !slot || !base || !logits) {
        st = err_set(err, ST_ERR_NOMEM, "no memory for scoring batches of %d tokens", T);
        goto out;
    }
    base[0] = 0; /* where each window's scores start in nll */
    for (int w = 0; w < n_win; w++)
        base[w + 1] = base[w] + (size_t)(win[w].n - win[w].from);
    long run = 0;
    for (int g0 = 0; g0 < n_win && !st; g0 += S) {
        const int ng = n_win - g0 < S ? n_win - g0 : S;
        int len = 0;
        for (int s = 0; s < ng && !st; s++) {
            /* (LongRoPE: a window longer than the original context, the long factors) */
            engine_kv_set_variant(kv, s, (uint32_t)engine_model_rope_variant(m, win[g0 + s].n));
            st = engine_kv_reserve(kv, s, win[g0 + s].n, err);
            len = win[g0 + s].n > len ? win[g0 + s].n : len;
        }
        const int chunk = T / ng; /* positions per window per step */
        for (int p0 = 0; p0 < len && !st; p0 += chunk) {
            int n = 0, n_out = 0;
            for (int s = 0; s < ng; s++) {
                const struct engine_score_window *w = &win[g0 + s];
                for (int p = p0; p < p0 + chunk && p < w->n; p++, n++) {
                    tok[n] = p == 0 && w->bos_first ? w->bos : w->tok[p];
                    pos[n] = p;
                    seq[n] = s;
                    /* position p's logits score target p + 1 */
                    want[n] = p + 1 >= w->from && p + 1 < w->n;
                    if (want[n]) {
                        target[n_out] = w->tok[p + 1];
                        slot[n_out++] = base[g0 + s] + (size_t)(p + 1 - w->from);
                    }
                }
            }
            const struct engine_batch b = {n, tok, pos, seq, want};
            if (n_out && (st = engine_model_forward(m, kv, &b, logits, err)))
                break;
            if (!n_out) { /* nothing scored in this step: run it for the KV all the same */
                want[0] = 1;
                if ((st = engine_model_forward(m, kv, &b, logits, err)))
                    break;
            }
            for (int i = 0; i < n_out; i++)
                nll[slot[i]] = row_nll(logits + (size_t)i * V, V, target[i]);
            run += n;
            if (o->progress)
                o->progress(o->progress_ctx, g0 + (p0 + chunk >= len ? ng : 0), run);
        }
        for (int s = 0; s < ng; s++)
            engine_kv_release(kv, s);
    }
out:
    free(tok);
    free(pos);
    free(seq);
    free(target);
    free(want);
    free(slot);
    free(base);
    free(logits);
    engine_kv_free(kv);
    return st;
}
