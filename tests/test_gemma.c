/* The real Gemma 3 270M (Q4_K_M: Q8_0, Q5_0, Q4_K and Q6_K matrices; fetched by `make gemma`)
 * against tools/ref_gemma.py's float64 reference (tests/fixtures/forward_gemma3.json): the
 * top-16 and 64 probe logits at every position of five prompts, one of them 600 tokens long so
 * that the sliding-window layers (512 positions) drop keys, and each prompt's 16 greedy tokens;
 * the sliding-window layers' KV in their own pool of 37 blocks (engine_kv_set_window), given
 * back as the window moves, so the 616-token sequence runs in fewer window blocks than it has
 * positions' worth (39). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "engine/kv.h"
#include "engine/model_internal.h"
#include "tests/test_util.h"

/* f32 compute over f16 KV against float64 over the same f16 KV (see the printed numbers; as in
 * test_model.c, which keys round the other way depends on the ISA: max 0.0258 on an AVX2-only
 * EPYC, 2026-12-02, mean 8.7e-4). */
#define GEMMA_TOL      0.03f
#define GEMMA_MEAN_TOL 0.002f
#define CHUNK          64

/* Window pool blocks: a 64-token chunk's positions and the 511 before them, in 16-token blocks
 * starting anywhere in one. */
#define WINDOW_BLOCKS ((511 + CHUNK + 15) / 16 + 1)

/* A one-sequence KV cache for n tokens with the sliding-window layers in their own pool of
 * WINDOW_BLOCKS blocks, attached to m. */
static struct engine_kv *window_kv(struct engine_model *m, int n)
{
    struct err_detail err = {0};
    struct engine_kv *kv;
    uint8_t local[64];
    assert_true(m->hp.n_layer <= 64);
    for (int l = 0; l < m->hp.n_layer; l++)
        local[l] = (uint8_t)engine_model_layer_local(m, l);
    const int32_t blocks = (n + 15) / 16 + 1;
    assert_int_equal(engine_kv_init(&kv, m->hp.n_layer, m->hp.n_kv_head, m->hp.head_dim,
                                    KERN_KV_F16, 16, blocks, 1, 0, &err),
                     ST_OK);
    const int32_t nl = WINDOW_BLOCKS < blocks ? WINDOW_BLOCKS : blocks;
    assert_int_equal(engine_kv_set_window(kv, local, m->hp.swa_window, nl, &err), ST_OK);
    assert_int_equal(engine_model_kv_attach(m, kv, CHUNK, &err), ST_OK);
    return kv;
}

/* Positions [0, n_done) are computed: the window pool gives back what no later one reads. */
static void slide(struct engine_kv *kv, int32_t n_done)
{
    engine_kv_slide(kv, 0, n_done);
    assert_true(engine_kv_seq_held(kv, 0, 1) <= 512 / 16 + 2 + CHUNK / 16);
}

static void test_gemma_vs_reference(void **state)
{
    (void)state;
    size_t len;
    char *js = test_read_file("tests/fixtures/forward_gemma3.json", &len);
    assert_non_null(js);
    cJSON *root = cJSON_Parse(js);
    free(js);
    assert_non_null(root);
    struct err_detail err = {0};
    struct kern_backend *be;
    struct engine_model *m;
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_F32, 0, 1, 0};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    if (engine_model_load(&m, test_gemma_path(), be, &err))
        fail_msg("%s (run `make gemma` or set QUERN_GEMMA)", err.msg);
    assert_int_equal(m->hp.arch, ENGINE_ARCH_GEMMA3);
    assert_int_equal(m->hp.swa_window, 512);
    assert_int_equal(m->hp.head_dim, 256);
    const int V = m->hp.n_vocab;
    const cJSON *probe = cJSON_GetObjectItem(root, "probe_ids");
    const cJSON *prompts = cJSON_GetObjectItem(root, "prompts");
    float *lg = malloc(sizeof(float) * (size_t)CHUNK * V);
    assert_non_null(lg);
    double worst = 0, sum = 0;
    long compared = 0;
    int greedy_ok = 0, n_prompts = 0, top1 = 0;
    /* under sanitizers the four short prompts (the 600-token one is minutes there) */
    const int max_len = getenv("QUERN_SANITIZE") ? 64 : 1 << 20;
    const cJSON *p;
    cJSON_ArrayForEach(p, prompts)
    {
        const cJSON *toks = cJSON_GetObjectItem(p, "tokens");
        const int n = cJSON_GetArraySize(toks);
        if (n > max_len)
            continue;
        const char *name = cJSON_GetObjectItem(p, "name")->valuestring;
        const cJSON *positions = cJSON_GetObjectItem(p, "positions");
        const cJSON *greedy = cJSON_GetObjectItem(p, "greedy");
        const int ng = cJSON_GetArraySize(greedy);
        struct engine_kv *kv = window_kv(m, n + ng);
        int32_t ids[CHUNK], pos[CHUNK], seq[CHUNK] = {0};
        uint8_t want[CHUNK];
        memset(want, 1, sizeof(want));
        for (int c0 = 0; c0 < n; c0 += CHUNK) {
            const int c = n - c0 < CHUNK ? n - c0 : CHUNK;
            for (int i = 0; i < c; i++) {
                ids[i] = (int32_t)cJSON_GetArrayItem(toks, c0 + i)->valueint;
                pos[i] = c0 + i;
            }
            struct engine_batch b = {c, ids, pos, seq, want};
            assert_int_equal(engine_kv_reserve(kv, 0, c0 + c, &err), ST_OK);
            assert_int_equal(engine_model_forward(m, kv, &b, lg, &err), ST_OK);
            slide(kv, c0 + c);
            for (int i = 0; i < c; i++) {
                const cJSON *pi = cJSON_GetArrayItem(positions, c0 + i);
                const float *row = lg + (size_t)i * V;
                const cJSON *top = cJSON_GetObjectItem(pi, "top");
                const int ref1 = cJSON_GetArrayItem(cJSON_GetArrayItem(top, 0), 0)->valueint;
                if (cJSON_GetObjectItem(pi, "margin")->valuedouble > 0.05) {
                    if (test_argmax(row, V) != ref1)
                        fail_msg("%s position %d: top-1 %d, reference %d", name, c0 + i,
                                 test_argmax(row, V), ref1);
                    top1++;
                }
                const cJSON *e;
                cJSON_ArrayForEach(e, top)
                {
                    const double d = fabs(row[cJSON_GetArrayItem(e, 0)->valueint] -
                                          cJSON_GetArrayItem(e, 1)->valuedouble);
                    worst = d > worst ? d : worst;
                    sum += d;
                    compared++;
                }
                const cJSON *pr = cJSON_GetObjectItem(pi, "probe");
                for (int k = 0; k < cJSON_GetArraySize(pr); k++) {
                    const double d = fabs(row[cJSON_GetArrayItem(probe, k)->valueint] -
                                          cJSON_GetArrayItem(pr, k)->valuedouble);
                    worst = d > worst ? d : worst;
                    sum += d;
                    compared++;
                }
            }
        }
        /* greedy: the last prompt row, then one token at a time */
        int ok = 1;
        int32_t next = (int32_t)test_argmax(lg + (size_t)((n - 1) % CHUNK) * V, V);
        for (int g = 0; g < ng && ok; g++) {
            ok = next == cJSON_GetArrayItem(greedy, g)->valueint;
            int32_t ps = n + g, sq = 0;
            struct engine_batch b1 = {1, &next, &ps, &sq, NULL};
            assert_int_equal(engine_kv_reserve(kv, 0, ps + 1, &err), ST_OK);
            assert_int_equal(engine_model_forward(m, kv, &b1, lg, &err), ST_OK);
            slide(kv, ps + 1);
            next = (int32_t)test_argmax(lg, V);
        }
        if (!ok) { /* only where the reference's choice was clear */
            const cJSON *mg = cJSON_GetObjectItem(p, "greedy_margins");
            double min_m = 1e9;
            for (int g = 0; g < ng; g++)
                min_m = fmin(min_m, cJSON_GetArrayItem(mg, g)->valuedouble);
            if (min_m > 0.05)
                fail_msg("%s: greedy continuation differs (smallest margin %g)", name, min_m);
        }
        greedy_ok += ok;
        n_prompts++;
        if (n + ng > WINDOW_BLOCKS * 16) /* it ran in fewer window blocks than it has */
            assert_true(engine_kv_seq_held(kv, 0, 1) < engine_kv_seq_blocks(kv, 0));
        assert_int_equal(engine_kv_check(kv, 0, &err), ST_OK);
        engine_kv_free(kv);
    }
    print_message("gemma3 270m: %d prompts, max |ours - reference| = %.5f (tolerance %g), mean "
                  "%.6f (tolerance %g) over %ld logits; top-1 equal at %d clear positions; "
                  "greedy 16 tokens identical for %d of %d prompts\n",
                  n_prompts, worst, (double)GEMMA_TOL, sum / (double)compared,
                  (double)GEMMA_MEAN_TOL, compared, top1, greedy_ok, n_prompts);
    assert_true(worst <= GEMMA_TOL);
    assert_true(sum / (double)compared <= GEMMA_MEAN_TOL);
    assert_true(n_prompts >= 4 && greedy_ok >= n_prompts - 1);
    free(lg);
    engine_model_free(m);
    kern_backend_free(be);
    cJSON_Delete(root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemma_vs_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
