/* The architectures beyond SmolLM2's llama (engine/model.c): small random-weight GGUFs of
 * llama with Llama 3's RoPE frequency factors, qwen2 (Q/K/V biases), qwen3 (QK-norm, head_dim
 * not hidden / heads) and gemma3 (scaled embedding, QK-norm, post-norms, GeGLU, 5-token sliding
 * windows in five layers of six with their own RoPE base), written by tools/gen_arch_fixtures.py
 * with the `gguf` package, against tools/ref_forward.py's float64 logits
 * (tests/fixtures/arch_ref.json) at every position: the prompt in one batch, one token at a time
 * over 4-token KV blocks (windows that start inside a block), and over two tensor-parallel ranks
 * (bitwise one rank's). An architecture quern does not run is a clear error. */
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

#include "engine/model_internal.h"
#include "tests/test_util.h"

static cJSON *g_root; /* parsed arch_ref.json */

static int setup(void **state)
{
    size_t len;
    char *js = test_read_file("tests/fixtures/arch_ref.json", &len);
    if (!js || !(g_root = cJSON_Parse(js))) {
        fprintf(stderr, "missing or unreadable tests/fixtures/arch_ref.json\n");
        free(js);
        return -1;
    }
    free(js);
    *state = g_root;
    return 0;
}

static int teardown(void **state)
{
    cJSON_Delete(*state);
    return 0;
}

/* Tokens [0, n) of one sequence in chunks of `chunk` over blocks of block_size, logits for
 * every position. */
static void run_seq(struct engine_model *m, const int32_t *ids, int n, int chunk, int block_size,
                    float *logits)
{
    struct err_detail err = {0};
    struct engine_kv *kv;
    assert_int_equal(engine_model_kv_init(m, &kv, n + 16, 1, block_size, KERN_KV_F16, &err), ST_OK);
    assert_int_equal(engine_kv_reserve(kv, 0, n, &err), ST_OK);
    int32_t pos[64], seq[64] = {0};
    uint8_t want[64];
    assert_true(n <= 64);
    for (int i = 0; i < n; i++) {
        pos[i] = i;
        want[i] = 1;
    }
    for (int i = 0; i < n; i += chunk) {
        int c = n - i < chunk ? n - i : chunk;
        struct engine_batch b = {c, ids + i, pos + i, seq + i, want + i};
        assert_int_equal(engine_model_forward(m, kv, &b, logits + (size_t)i * m->hp.n_vocab, &err),
                         ST_OK);
    }
    engine_kv_free(kv);
}

/* Largest |ours - reference| / (1 + |reference|) over all logits; top-1 must agree wherever the
 * reference's margin is clear. */
static double compare(const char *name, const char *how, const float *got, const cJSON *ref, int n,
                      int V)
{
    double worst = 0;
    for (int t = 0; t < n; t++) {
        const cJSON *row = cJSON_GetArrayItem(ref, t);
        assert_int_equal(cJSON_GetArraySize(row), V);
        int best_r = 0, best_g = 0;
        double r1 = -INFINITY, r2 = -INFINITY;
        for (int v = 0; v < V; v++) {
            const double r = cJSON_GetArrayItem(row, v)->valuedouble;
            const double d = fabs(got[(size_t)t * V + v] - r) / (1 + fabs(r));
            worst = d > worst ? d : worst;
            if (r > r1) {
                r2 = r1;
                r1 = r;
                best_r = v;
            } else if (r > r2) {
                r2 = r;
            }
            if (got[(size_t)t * V + v] > got[(size_t)t * V + best_g])
                best_g = v;
        }
        if (r1 - r2 > 0.01)
            assert_int_equal(best_g, best_r);
    }
    printf("  %-7s %-32s max |ours - ref| / (1 + |ref|) = %.2e\n", name, how, worst);
    return worst;
}

static void test_arch_logits(void **state)
{
    const cJSON *models = cJSON_GetObjectItem(*state, "models");
    assert_int_equal(cJSON_GetArraySize(models), 4);
    struct err_detail err = {0};
    struct kern_backend *be;
    struct kern_backend_opts ko = {NULL, 2, NULL, KERN_ACT_F32, 0, 1};
    assert_int_equal(kern_backend_open(&be, &ko, &err), ST_OK);
    for (int i = 0; i < cJSON_GetArraySize(models); i++) {
        const cJSON *md = cJSON_GetArrayItem(models, i);
        const char *name = cJSON_GetObjectItem(md, "name")->valuestring;
        const char *file = cJSON_GetObjectItem(md, "file")->valuestring;
        const cJSON *toks = cJSON_GetObjectItem(md, "tokens");
        const cJSON *ref = cJSON_GetObjectItem(md, "logits");
        struct engine_model *m;
        if (engine_model_load(&m, file, be, &err))
            fail_msg("%s: %s", file, err.msg);
        const int n = cJSON_GetArraySize(toks), V = m->hp.n_vocab;
        int32_t ids[64];
        for (int t = 0; t < n; t++)
            ids[t] = (int32_t)cJSON_GetArrayItem(toks, t)->valueint;
        float *whole = malloc(sizeof(float) * (size_t)n * V);
        float *steps = malloc(sizeof(float) * (size_t)n * V);
        run_seq(m, ids, n, n, 16, whole);
        run_seq(m, ids, n, 1, 4, steps);
        /* f32 compute against float64, the same f16 KV rounding */
        assert_true(compare(name, "one batch", whole, ref, n, V) < 2e-3);
        assert_true(compare(name, "a token at a time, 4-token blocks", steps, ref, n, V) < 2e-3);
        /* the architecture's features are there: a gemma3 layer slides, qwen2's biases ... */
        if (!strcmp(name, "gemma3")) {
            assert_int_equal(m->hp.swa_window, 5);
            assert_true(m->layers[0].swa && !m->layers[5].swa && m->layers[0].post_ffn_norm);
            assert_int_equal(m->hp.head_dim, 32);
        }
        if (!strcmp(name, "qwen2"))
            assert_non_null(m->layers[0].bq);
        if (!strcmp(name, "qwen3"))
            assert_true(m->layers[0].q_norm && m->hp.head_dim == 32);
        if (!strcmp(name, "llama3"))
            assert_non_null(m->rope_freqs);

        /* two ranks: bitwise one rank's logits */
        struct kern_group *g;
        struct kern_backend_opts to = {NULL, 2, NULL, KERN_ACT_F32, 0, 2};
        struct engine_model *tm;
        assert_int_equal(kern_group_open(&g, &to, &err), ST_OK);
        if (engine_model_load_group(&tm, file, g, &err))
            fail_msg("%s --tp 2: %s", file, err.msg);
        float *tp = malloc(sizeof(float) * (size_t)n * V);
        run_seq(tm, ids, n, 7, 4, tp);
        run_seq(m, ids, n, 7, 4, steps);
        assert_memory_equal(tp, steps, sizeof(float) * (size_t)n * V);
        printf("  %-7s tp 2: bitwise one rank's at all %d positions\n", name, n);
        engine_model_free(tm);
        kern_group_free(g);
        free(tp);
        free(whole);
        free(steps);
        engine_model_free(m);
    }
    kern_backend_free(be);
}

static void test_unsupported_arch(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct engine_model *m = NULL;
    assert_int_equal(engine_model_load(&m, "tests/fixtures/arch/phi3.gguf", NULL, &err),
                     ST_ERR_UNSUPPORTED);
    assert_null(m);
    printf("  %s\n", err.msg);
    assert_non_null(strstr(err.msg, "architecture 'phi3' is not supported"));
    assert_non_null(strstr(err.msg, "llama, qwen2, qwen3, gemma3"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arch_logits),
        cmocka_unit_test(test_unsupported_arch),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
