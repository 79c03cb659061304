/* The CUDA backend against the CPU backend on a whole model (where a GPU is; elsewhere it says
 * why it did not run, and with QUERN_REQUIRE_CUDA=1, scripts/gpu-check.sh, that is a failure).
 * The op-by-op check is tests/test_backend_ops.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "engine/dummy.h"
#include "engine/kv.h"
#include "engine/model.h"
#include "io/gguf.h"
#include "io/gguf_write.h"
#include "kernels/comm.h"
#include "kernels/kernels.h"
#include "tests/test_util.h"
#ifdef QUERN_CUDA
#include "kernels/cuda/comm_nccl.h"
#endif

/* The CUDA backend against the CPU backend on a whole model: a 6-layer dummy SmolLM2 (random
 * Q4_0 weights at the real width, made in memory: no file to carry; logits of RMS ~1), 40 prompt
 * tokens then 12 greedy steps: every logit within LOGIT_TOL of the CPU's (f32 sums in another
 * order: the CPU's own scalar and AVX-512 tables differ by up to 1.1e-3 here) and the same greedy
 * tokens unless the CPU's row is a near-tie. Needs a GPU like test_cuda_backend. */
#define LOGIT_TOL 5e-3

static enum kern_act g_act = KERN_ACT_F32; /* the matmul mode model_on opens */
static const char *g_file;                 /* a GGUF model_on opens instead of the dummy */
static const int32_t *g_prompt;            /* model_run's prompt instead of its formula's */

static struct engine_model *model_on_tp(const char *device, int tp, struct kern_group **grp)
{
    struct err_detail err = {0};
    struct io_gguf_writer *w;
    struct io_gguf *empty, *g;
    if (g_file) {
        assert_int_equal(io_gguf_open(&g, g_file, &err), ST_OK);
    } else {
        assert_int_equal(io_gguf_writer_init(&w, &err), ST_OK);
        assert_int_equal(io_gguf_writer_open(w, &empty, &err), ST_OK); /* no tokenizer needed */
        io_gguf_writer_free(w);
        assert_int_equal(engine_dummy_gguf(&g, "smollm2-135m", empty, 5, 6, 1, &err), ST_OK);
        io_gguf_close(empty);
    }
    struct kern_backend_opts o = {device, 4, NULL, g_act, 0, tp, 0};
    struct engine_model *m;
    if (kern_group_open(grp, &o, &err) || engine_model_from_gguf_group(&m, g, *grp, &err)) {
        printf("  (%s, tp %d: %s)\n", device, tp, err.msg);
        io_gguf_close(g);
        kern_group_free(*grp);
        *grp = NULL;
        return NULL;
    }
    return m;
}

static int g_tp = 1; /* the ranks model_on splits over */

static struct engine_model *model_on(const char *device, struct kern_group **grp)
{
    return model_on_tp(device, g_tp, grp);
}

/* Logits of n_prompt tokens at once (all rows), then greedy steps; rows into lg. With g_prompt,
 * its second half goes a token at a time. */
static void model_run(struct engine_model *m, int n_prompt, int n_gen, float *lg, int32_t *gen)
{
    struct err_detail err = {0};
    struct engine_kv *kv;
    const int V = engine_model_hparams(m)->n_vocab, T = n_prompt + n_gen;
    assert_int_equal(engine_model_kv_init(m, &kv, 128, 1, 16, KERN_KV_F16, &err), ST_OK);
    assert_int_equal(engine_kv_reserve(kv, 0, T, &err), ST_OK);
    int32_t tok[64], pos[64], seq[64];
    uint8_t want[64];
    for (int i = 0; i < n_prompt; i++) {
        tok[i] = g_prompt ? g_prompt[i] : (int32_t)((i * 7919 + 13) % V);
        pos[i] = i;
        seq[i] = 0;
        want[i] = 1;
    }
    /* g_prompt's: its first half at once, the rest a token at a time (decode steps) */
    const int first = g_prompt ? n_prompt / 2 : n_prompt;
    struct engine_batch b = {first, tok, pos, seq, want};
    assert_int_equal(engine_model_forward(m, kv, &b, lg, &err), ST_OK);
    for (int i = first; i < n_prompt; i++) {
        struct engine_batch one = {1, tok + i, pos + i, seq + i, want + i};
        assert_int_equal(engine_model_forward(m, kv, &one, lg + (size_t)i * V, &err), ST_OK);
    }
    for (int s = 0; s < n_gen; s++) {
        const float *row = lg + (size_t)(n_prompt - 1 + s) * V;
        int best = 0;
        for (int v = 1; v < V; v++)
            best = row[v] > row[best] ? v : best;
        gen[s] = best;
        int32_t p = n_prompt + s, z = 0;
        struct engine_batch one = {1, &gen[s], &p, &z, NULL};
        assert_int_equal(engine_model_forward(m, kv, &one, lg + (size_t)(n_prompt + s) * V, &err),
                         ST_OK);
    }
    engine_kv_free(kv);
}

/* The CUDA backend in matmul mode `act` against the CPU backend's exact mode: logits within tol. */
static void cuda_vs_cpu(const char *what, enum kern_act act, double tol)
{
    struct kern_group *gc, *gg;
    g_act = act;
    struct engine_model *mg = model_on("cuda", &gg);
    g_act = KERN_ACT_F32;
    if (!mg) {
        const char *req = getenv("QUERN_REQUIRE_CUDA");
        if (req && !strcmp(req, "1"))
            fail_msg("QUERN_REQUIRE_CUDA=1 but the dummy model did not load on CUDA");
        printf("  %s: not tested here (no CUDA device)\n", what);
        return;
    }
    struct engine_model *mc = model_on("cpu", &gc);
    assert_non_null(mc);
    const int NP = g_prompt ? 24 : 40, NG = g_prompt ? 0 : 12;
    const int V = engine_model_hparams(mc)->n_vocab;
    float *lc = malloc(sizeof(float) * (size_t)(NP + NG) * V);
    float *lgp = malloc(sizeof(float) * (size_t)(NP + NG) * V);
    int32_t gc_ids[12], gg_ids[12];
    model_run(mc, NP, NG, lc, gc_ids);
    model_run(mg, NP, NG, lgp, gg_ids);
    /* The two greedy runs feed their own tokens back: rows agree up to the first step where
     * they chose differently, which is allowed only on a near-tie of the CPU's row. */
    int same = 0;
    while (same < NG && gc_ids[same] == gg_ids[same])
        same++;
    const int rows = NP + same + (same < NG); /* the row that chose differently is compared too */
    double worst = 0;
    for (size_t i = 0; i < (size_t)rows * V; i++) {
        const double d = fabs((double)lc[i] - lgp[i]) / (g_file ? 1 + fabs((double)lc[i]) : 1);
        worst = d > worst ? d : worst;
    }
    printf("  %s: max |logit cuda - cpu|%s = %.3g over %d rows (tolerance %g); greedy "
           "tokens equal for %d of %d steps\n",
           what, g_file ? " / (1 + |cpu|)" : "", worst, rows, tol, same, NG);
    assert_true(worst <= tol);
    if (same < NG) {
        const float *row = lc + (size_t)(NP - 1 + same) * V;
        const double gap = (double)row[gc_ids[same]] - row[gg_ids[same]];
        printf("  %s: step %d chose %d, the CPU %d: a CPU logit gap of %.3g\n", what, same,
               gg_ids[same], gc_ids[same], gap);
        assert_true(gap <= 2 * tol);
    }
    free(lc);
    free(lgp);
    engine_model_free(mc);
    engine_model_free(mg);
    kern_group_free(gc);
    kern_group_free(gg);
}

static void test_cuda_model(void **state)
{
    (void)state;
    cuda_vs_cpu("cuda model", KERN_ACT_F32, LOGIT_TOL);
}

/* Mixtures of experts (tests/fixtures/arch: Qwen3-MoE's 3 of 8 experts, Mixtral's 2 of 4,
 * Qwen2-MoE's 2 of 6 and a shared expert; the
 * routing read back to the host each layer, moe_add on the device), and the same split over 2
 * ranks through host memory (each expert split as a dense FFN is): the CPU's logits at the 24
 * positions of tests/fixtures/arch_ref.json's prompt (12 at once, then 12 decode steps), where no
 * token's router logits come within 4e-3 of choosing another expert (tools/gen_arch_fixtures.py
 * checks it; on the formula prompt of 52 tokens they come within 2.4e-3, and the CPU's own scalar
 * and AVX-512 tables differ there by 6e-3). Compared relative to 1 + |logit|, as test_arch
 * compares. */
#define MOE_TOL 4e-3 /* as test_arch's against the float64 reference (its comment says why) */
static void test_cuda_moe(void **state)
{
    (void)state;
    static const char *const names[3] = {"qwen3moe", "mixtral", "qwen2moe"};
    size_t len;
    char *js = test_read_file("tests/fixtures/arch_ref.json", &len);
    cJSON *root = js ? cJSON_Parse(js) : NULL;
    free(js);
    assert_non_null(root);
    for (int f = 0; f < 3; f++) {
        const cJSON *models = cJSON_GetObjectItem(root, "models"), *md = NULL;
        for (int i = 0; i < cJSON_GetArraySize(models); i++)
            if (!strcmp(cJSON_GetObjectItem(cJSON_GetArrayItem(models, i), "name")->valuestring,
                        names[f]))
                md = cJSON_GetArrayItem(models, i);
        assert_non_null(md);
        const cJSON *toks = cJSON_GetObjectItem(md, "tokens");
        int32_t prompt[24];
        assert_int_equal(cJSON_GetArraySize(toks), 24);
        for (int t = 0; t < 24; t++)
            prompt[t] = (int32_t)cJSON_GetArrayItem(toks, t)->valueint;
        g_prompt = prompt;
        g_file = cJSON_GetObjectItem(md, "file")->valuestring;
        char what[64];
        snprintf(what, sizeof(what), "cuda %s", names[f]);
        cuda_vs_cpu(what, KERN_ACT_F32, MOE_TOL);
        setenv("QUERN_TP_COMM", "staged", 1);
        g_tp = 2;
        snprintf(what, sizeof(what), "cuda %s tp 2", names[f]);
        cuda_vs_cpu(what, KERN_ACT_F32, MOE_TOL);
        g_tp = 1;
        unsetenv("QUERN_TP_COMM");
    }
    g_file = NULL;
    g_prompt = NULL;
    cJSON_Delete(root);
}

/* The CUDA backend's bf16 mode with attention on tensor cores (the scaled queries and the
 * probabilities rounded to halves) against the same mode with attention in f32
 * (QUERN_CUDA_ATTN_MMA=0): the logits of the whole model within ATTN_MMA_TOL, the greedy tokens
 * the same unless the f32 run's row is a near-tie. (The bf16 mode itself is ~4 logits from the
 * exact mode on this random model, too far to show attention's share.) */
#define ATTN_MMA_TOL 0.1 /* measured on the emulator: 0.037 */
static void test_cuda_attn_mma(void **state)
{
    (void)state;
    const int NP = 24, NG = 6;
    float *lg[2] = {NULL, NULL};
    int32_t ids[2][12] = {{0}};
    int V = 0;
    g_act = KERN_ACT_BF16;
    for (int mma = 0; mma < 2; mma++) {
        setenv("QUERN_CUDA_ATTN_MMA", mma ? "1" : "0", 1);
        struct kern_group *grp;
        struct engine_model *m = model_on("cuda", &grp);
        if (!m) {
            unsetenv("QUERN_CUDA_ATTN_MMA");
            g_act = KERN_ACT_F32;
            printf("  cuda attention mma: not tested here (no CUDA device)\n");
            return;
        }
        V = engine_model_hparams(m)->n_vocab;
        assert_non_null(lg[mma] = malloc(sizeof(float) * (size_t)(NP + NG) * V));
        model_run(m, NP, NG, lg[mma], ids[mma]);
        engine_model_free(m);
        kern_group_free(grp);
    }
    unsetenv("QUERN_CUDA_ATTN_MMA");
    g_act = KERN_ACT_F32;
    int same = 0;
    while (same < NG && ids[0][same] == ids[1][same])
        same++;
    const int rows = NP + same + (same < NG);
    double worst = 0;
    for (size_t i = 0; i < (size_t)rows * V; i++) {
        const double d = fabs((double)lg[0][i] - lg[1][i]);
        worst = d > worst ? d : worst;
    }
    printf("  cuda attention mma: bf16 mode, max |logit tensor-core attention - f32 attention| = "
           "%.3g over %d rows (tolerance %g); greedy tokens equal for %d of %d steps\n",
           worst, rows, ATTN_MMA_TOL, same, NG);
    assert_true(worst > 0); /* the tensor cores ran */
    assert_true(worst <= ATTN_MMA_TOL);
    if (same < NG) {
        const float *row = lg[0] + (size_t)(NP - 1 + same) * V;
        assert_true((double)row[ids[0][same]] - row[ids[1][same]] <= 2 * ATTN_MMA_TOL);
    }
    free(lg[0]);
    free(lg[1]);
}

/* Three sequences of 5, 9 and 14 prompt tokens, then `steps` decode steps of one token each
 * (fixed ids) over 2-token KV blocks reserved as the positions need them, so the batch's block
 * tables widen every other step (from 7 to 13 blocks: padded with graphs, from 8 to 16): every
 * step's 3 logit rows into lg. With drop, that backend gives memory back half way (which drops
 * its graphs). */
static void graph_run(struct engine_model *m, int steps, float *lg, struct kern_backend *drop)
{
    struct err_detail err = {0};
    struct engine_kv *kv;
    const int V = engine_model_hparams(m)->n_vocab, len[3] = {5, 9, 14};
    assert_int_equal(engine_model_kv_init(m, &kv, 256, 3, 2, KERN_KV_F16, &err), ST_OK);
    int32_t tok[28], pos[28], seq[28];
    int n = 0;
    for (int s = 0; s < 3; s++) {
        assert_int_equal(engine_kv_reserve(kv, s, len[s], &err), ST_OK);
        for (int i = 0; i < len[s]; i++, n++) {
            tok[n] = (int32_t)((n * 7919 + 13) % V);
            pos[n] = i;
            seq[n] = s;
        }
    }
    float *scratch = malloc(sizeof(float) * 3 * (size_t)V);
    assert_non_null(scratch);
    struct engine_batch b = {n, tok, pos, seq, NULL}; /* logits: each sequence's last token */
    assert_int_equal(engine_model_forward(m, kv, &b, scratch, &err), ST_OK);
    for (int t = 0; t < steps; t++) {
        if (drop && t == steps / 2)
            drop->ops->buf_free(drop, drop->ops->buf_alloc(drop, 64));
        for (int s = 0; s < 3; s++) { /* blocks as the positions need them */
            assert_int_equal(engine_kv_reserve(kv, s, len[s] + t + 1, &err), ST_OK);
            tok[s] = (int32_t)((t * 31 + s * 7 + 1) % V);
            pos[s] = len[s] + t;
            seq[s] = s;
        }
        const uint8_t want[3] = {1, 1, 1};
        struct engine_batch d = {3, tok, pos, seq, want};
        assert_int_equal(engine_model_forward(m, kv, &d, lg + (size_t)t * 3 * V, &err), ST_OK);
    }
    free(scratch);
    engine_kv_free(kv);
}

/* CUDA graphs at the engine level (kern_ops.graph_begin): with graphs on, a step is padded to
 * buckets (28 prompt tokens to 32, 3 decode tokens and rows to 4, the tables' width to a
 * multiple of 8 blocks; padding tokens copy token 0 and are never stored) and its layers are
 * captured once its shape repeats, then replayed while it lasts. Every step's logits are
 * bitwise those of the same run without graphs (QUERN_CUDA_GRAPHS=0: no padding either),
 * across the tables' widening (a replay with a stale width reads the wrong blocks for rows 1
 * and 2). */
static void test_cuda_graphs(void **state)
{
    (void)state;
    enum { STEPS = 12 };
    float *lg[2] = {NULL, NULL};
    long cap = 0, rep = 0;
    for (int on = 1; on >= 0; on--) {
        setenv("QUERN_CUDA_GRAPHS", on ? "1" : "0", 1);
        struct kern_group *grp;
        struct engine_model *m = model_on("cuda", &grp);
        if (!m) {
            unsetenv("QUERN_CUDA_GRAPHS");
            printf("  cuda graphs: not tested here (no CUDA device)\n");
            return;
        }
        const int V = engine_model_hparams(m)->n_vocab;
        lg[on] = malloc(sizeof(float) * STEPS * 3 * (size_t)V);
        assert_non_null(lg[on]);
        graph_run(m, STEPS, lg[on], NULL);
        long c, r;
        engine_model_graph_counts(m, &c, &r);
        if (on) {
            cap = c;
            rep = r;
        } else
            assert_true(c == 0 && r == 0);
        if (!on)
            assert_memory_equal(lg[0], lg[1], sizeof(float) * STEPS * 3 * (size_t)V);
        engine_model_free(m);
        kern_group_free(grp);
    }
    unsetenv("QUERN_CUDA_GRAPHS");
    printf("  cuda graphs: %d steps of 3 sequences bitwise the run without graphs; %ld graphs "
           "captured, %ld steps replayed\n",
           STEPS, cap, rep);
    assert_true(cap >= 2 && rep >= 6);
    free(lg[0]);
    free(lg[1]);
}

/* Tensor parallelism on CUDA: 3 ranks joined by NCCL (one device each: the emulator has 3) give
 * bitwise the logits of 3 ranks on one device joined through host memory (both add the ranks'
 * partial sums in rank order), and both are within LOGIT_TOL of one rank (no graphs with
 * several ranks unless QUERN_TP_GRAPHS=1: test_cuda_tp_graphs). With fewer than 3 devices only
 * the host-staged ranks are checked. */
static void test_cuda_tp(void **state)
{
    (void)state;
    const int NP = 20, NG = 6;
    float *lg[3] = {NULL, NULL, NULL}; /* tp 1, staged, nccl */
    int32_t ids[3][12] = {{0}};
    static const char *const how[3] = {"auto", "staged", "nccl"};
    int V = 0, ran = 0;
    long graphs[3][2] = {{0}}; /* captures, replays */
    for (int k = 0; k < 3; k++) {
        setenv("QUERN_TP_COMM", how[k], 1);
        struct kern_group *grp;
        struct engine_model *m = model_on_tp("cuda", k ? 3 : 1, &grp);
        if (!m) {
            if (k == 0) {
                unsetenv("QUERN_TP_COMM");
                printf("  cuda tp: not tested here (no CUDA device)\n");
                return;
            }
            assert_int_equal(k, 2); /* NCCL's absence or too few devices: said below */
#ifdef QUERN_CUDA
            char why[256] = "";
            if (kern_nccl_usable(3, why, sizeof(why)))
                fail_msg("3 ranks could not be joined by NCCL, which is usable here");
#endif
            continue;
        }
        if (k)
            assert_string_equal(grp->comm[0]->ops->name, how[k]);
        V = engine_model_hparams(m)->n_vocab;
        assert_non_null(lg[k] = malloc(sizeof(float) * (size_t)(NP + NG) * V));
        model_run(m, NP, NG, lg[k], ids[k]);
        engine_model_graph_counts(m, &graphs[k][0], &graphs[k][1]);
        engine_model_free(m);
        kern_group_free(grp);
        ran = k + 1;
    }
    unsetenv("QUERN_TP_COMM");
    double worst = 0;
    for (size_t i = 0; i < (size_t)(NP + NG) * V; i++) {
        const double d = fabs((double)lg[0][i] - lg[1][i]);
        worst = d > worst ? d : worst;
    }
    printf("  cuda tp: 3 ranks through host memory vs 1 rank: max |logit difference| %.3g "
           "(tolerance %g); greedy tokens %s\n",
           worst, LOGIT_TOL, memcmp(ids[0], ids[1], sizeof(int32_t) * NG) ? "differ" : "equal");
    assert_true(worst <= LOGIT_TOL);
    assert_true(graphs[1][0] == 0 && graphs[1][1] == 0); /* staged: no graphs */
    if (ran == 3) {
        assert_memory_equal(lg[1], lg[2], sizeof(float) * (size_t)(NP + NG) * V);
        printf("  cuda tp: 3 ranks joined by NCCL on 3 devices: logits bitwise those through "
               "host memory\n");
        assert_true(graphs[2][0] == 0 && graphs[2][1] == 0); /* graphs: QUERN_TP_GRAPHS=1 */
    } else {
        const char *req = getenv("QUERN_REQUIRE_NCCL");
        if (req && !strcmp(req, "1"))
            fail_msg("QUERN_REQUIRE_NCCL=1 but 3 ranks could not be joined by NCCL");
        printf("  cuda tp: NCCL ranks not tested here (fewer than 3 devices, or no NCCL)\n");
    }
    for (int k = 0; k < 3; k++)
        free(lg[k]);
}

/* NCCL ranks' steps in CUDA graphs (QUERN_TP_GRAPHS=1): graph_run's padded, widening decode of 3
 * sequences at --tp 3, with rank 0 giving memory back half way (its graphs dropped), gives
 * bitwise the logits of host-staged ranks (no graphs). Every rank captures and replays before
 * and after the drop; the engine drops the other ranks' graphs too (sync_graphs), since NCCL
 * requires every rank to run a collective from a graph or not alike, which the emulator's NCCL
 * checks (without the sync the run stops there). */
static void test_cuda_tp_graphs(void **state)
{
    (void)state;
#ifndef QUERN_CUDA
    printf("  cuda tp graphs: not tested here (a build without CUDA)\n");
#else
    enum { STEPS = 12 };
    char why[256] = "";
    if (!kern_nccl_usable(3, why, sizeof(why))) {
        const char *req = getenv("QUERN_REQUIRE_NCCL");
        if (req && !strcmp(req, "1"))
            fail_msg("QUERN_REQUIRE_NCCL=1 but NCCL cannot join 3 ranks: %s", why);
        printf("  cuda tp graphs: not tested here (%s)\n", why);
        return;
    }
    float *lg[2] = {NULL, NULL};
    long cap = 0, rep = 0;
    setenv("QUERN_TP_GRAPHS", "1", 1);
    for (int nccl = 0; nccl < 2; nccl++) {
        setenv("QUERN_TP_COMM", nccl ? "nccl" : "staged", 1);
        struct kern_group *grp;
        struct engine_model *m = model_on_tp("cuda", 3, &grp);
        assert_non_null(m);
        const int V = engine_model_hparams(m)->n_vocab;
        assert_non_null(lg[nccl] = malloc(sizeof(float) * STEPS * 3 * (size_t)V));
        graph_run(m, STEPS, lg[nccl], nccl ? grp->be[0] : NULL);
        engine_model_graph_counts(m, &cap, &rep);
        if (!nccl)
            assert_true(cap == 0 && rep == 0); /* host staging: no graphs */
        else
            assert_memory_equal(lg[0], lg[1], sizeof(float) * STEPS * 3 * (size_t)V);
        engine_model_free(m);
        kern_group_free(grp);
    }
    unsetenv("QUERN_TP_COMM");
    unsetenv("QUERN_TP_GRAPHS");
    printf("  cuda tp graphs: %d padded steps of 3 sequences on 3 NCCL ranks bitwise the staged "
           "ranks'; %ld graphs captured, %ld rank steps replayed, rank 0's graphs dropped half "
           "way\n",
           STEPS, cap, rep);
    assert_true(cap >= 6 && rep >= 6); /* every rank, before and after the drop */
    free(lg[0]);
    free(lg[1]);
#endif
}

int main(void)
{
    /* the emulator's devices (a GPU build ignores this) */
    setenv("QUERN_CUDA_EMU_DEVICES", "3", 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_model),  cmocka_unit_test(test_cuda_attn_mma),
        cmocka_unit_test(test_cuda_graphs), cmocka_unit_test(test_cuda_tp_graphs),
        cmocka_unit_test(test_cuda_tp),     cmocka_unit_test(test_cuda_moe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
