/* The GGUF writer (io/gguf_write.h) and dummy models (engine/dummy.h): what is written reads back
 * through the reader with the same values, types and shapes, aligned; the real model's tokenizer
 * pairs copy verbatim (the tokenizer loads from the copy and encodes the same ids); a saved file
 * is the same bytes; dummy models have their preset's shapes, are a function of the seed, carry
 * zero-mean weights of the intended size, and run the same tokens at --tp 3 as at one rank. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/dtype.h"
#include "engine/dummy.h"
#include "engine/kv.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "io/gguf_write.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernels.h"
#include "tests/test_util.h"

static void test_round_trip(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct io_gguf *src, *g;
    assert_int_equal(io_gguf_open(&src, test_model_path(), &err), ST_OK);
    struct io_gguf_writer *w;
    assert_int_equal(io_gguf_writer_init(&w, &err), ST_OK);
    assert_int_equal(io_gguf_writer_u32(w, "a.u32", 4000000000u, &err), ST_OK);
    assert_int_equal(io_gguf_writer_f32(w, "a.f32", -1.5f, &err), ST_OK);
    assert_int_equal(io_gguf_writer_str(w, "a.str", "héllo", &err), ST_OK);
    int copied = 0;
    for (uint64_t i = 0; i < src->n_kv; i++) /* every pair of the real file, all types */
        if (io_gguf_writer_copy(w, &src->kv[i], &err) == ST_OK)
            copied++;
    assert_int_equal(copied, (int)src->n_kv);
    const int64_t ne_a[2] = {64, 3}, ne_b[1] = {7}, ne_c[2] = {256, 2};
    assert_int_equal(io_gguf_writer_tensor(w, "t.q4_1", DTYPE_Q4_1, 2, ne_a, &err), ST_OK);
    assert_int_equal(io_gguf_writer_tensor(w, "t.f32", DTYPE_F32, 1, ne_b, &err), ST_OK);
    assert_int_equal(io_gguf_writer_tensor(w, "t.q6_k", DTYPE_Q6_K, 2, ne_c, &err), ST_OK);
    const int64_t bad[2] = {33, 1}; /* not a whole Q4_0 block */
    assert_int_not_equal(io_gguf_writer_tensor(w, "t.bad", DTYPE_Q4_0, 2, bad, &err), ST_OK);
    assert_int_equal(io_gguf_writer_open(w, &g, &err), ST_OK);
    io_gguf_writer_free(w);

    uint32_t u;
    float f;
    struct io_gguf_str s;
    assert_int_equal(io_gguf_get_u32(g, "a.u32", &u, &err), ST_OK);
    assert_int_equal(u, 4000000000u);
    assert_int_equal(io_gguf_get_f32(g, "a.f32", &f, &err), ST_OK);
    assert_true(f == -1.5f);
    assert_int_equal(io_gguf_get_str(g, "a.str", &s, &err), ST_OK);
    assert_true(io_gguf_str_eq(s, "héllo"));
    assert_int_equal(g->n_kv, src->n_kv + 3);
    for (uint64_t i = 0; i < src->n_kv; i++) { /* each copied pair: same type, count, bytes */
        const struct io_gguf_kv *a = &src->kv[i], *b = &g->kv[i + 3];
        assert_int_equal(a->key.len, b->key.len);
        assert_memory_equal(a->key.ptr, b->key.ptr, a->key.len);
        assert_int_equal(a->type, b->type);
        assert_int_equal(a->arr_type, b->arr_type);
        assert_int_equal(a->arr_n, b->arr_n);
        if (a->type == IO_GGUF_ARRAY && a->arr_type == IO_GGUF_STRING) {
            for (uint64_t k = 0; k < a->arr_n; k++) {
                assert_int_equal(a->strs[k].len, b->strs[k].len);
                assert_memory_equal(a->strs[k].ptr, b->strs[k].ptr, a->strs[k].len);
            }
        } else if (a->type == IO_GGUF_ARRAY) {
            const size_t es = a->arr_type <= IO_GGUF_INT8 || a->arr_type == IO_GGUF_BOOL ? 1
                              : a->arr_type <= IO_GGUF_INT16                            ? 2
                              : a->arr_type <= IO_GGUF_FLOAT32                          ? 4
                                                                                        : 8;
            assert_memory_equal(a->val, b->val, es * (size_t)a->arr_n);
        } else if (a->type == IO_GGUF_STRING) {
            uint64_t len;
            memcpy(&len, a->val, 8);
            assert_memory_equal(a->val, b->val, 8 + (size_t)len);
        } else {
            assert_memory_equal(a->val, b->val, 1);
        }
    }
    assert_int_equal(g->n_tensors, 3);
    const struct io_gguf_tensor *t = io_gguf_find_tensor(g, "t.q6_k");
    assert_non_null(t);
    assert_int_equal(t->type, DTYPE_Q6_K);
    assert_int_equal(t->ne[0], 256);
    assert_int_equal(t->ne[1], 2);
    assert_int_equal(t->nbytes, 2 * 210);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        assert_int_equal(((uintptr_t)g->tensors[i].data - (uintptr_t)g->base) % 32, 0);
        const uint8_t *d = g->tensors[i].data; /* zero pages until written */
        for (uint64_t k = 0; k < g->tensors[i].nbytes; k++)
            assert_int_equal(d[k], 0);
    }
    /* the tokenizer loads from the copy and encodes as from the file */
    struct engine_tok *ta, *tb;
    assert_int_equal(engine_tok_load(&ta, src, &err), ST_OK);
    assert_int_equal(engine_tok_load(&tb, g, &err), ST_OK);
    int32_t *ia, *ib;
    size_t na = 0, nb = 0;
    const char *text = "Hello world, ünïcode and <|im_start|> 12345";
    assert_int_equal(engine_tok_encode(ta, text, strlen(text), 0, &ia, &na, &err), ST_OK);
    assert_int_equal(engine_tok_encode(tb, text, strlen(text), 0, &ib, &nb, &err), ST_OK);
    assert_true(na > 5);
    assert_int_equal(na, nb);
    assert_memory_equal(ia, ib, na * sizeof(int32_t));
    free(ia);
    free(ib);
    engine_tok_free(ta);
    engine_tok_free(tb);

    /* saved and reopened: the same bytes; an existing temp file is not overwritten */
    char path[] = "/tmp/quern-gguf-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(io_gguf_save(g, path, &err), ST_OK);
    struct io_gguf *h;
    assert_int_equal(io_gguf_open(&h, path, &err), ST_OK);
    assert_int_equal(h->size, g->size);
    assert_memory_equal(h->base, g->base, g->size);
    io_gguf_close(h);
    char tmp[64];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *ft = fopen(tmp, "w");
    assert_non_null(ft);
    fclose(ft);
    assert_int_not_equal(io_gguf_save(g, path, &err), ST_OK);
    unlink(tmp);
    unlink(path);
    io_gguf_close(g);
    io_gguf_close(src);
}

/* A writer given nothing (as test_cuda_model makes one for a tokenizer-free dummy), and one
 * given an empty string value: valid files that read back as such. */
static void test_empty(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct io_gguf_writer *w;
    struct io_gguf *g;
    assert_int_equal(io_gguf_writer_init(&w, &err), ST_OK);
    assert_int_equal(io_gguf_writer_open(w, &g, &err), ST_OK);
    assert_int_equal(g->n_kv, 0);
    assert_int_equal(g->n_tensors, 0);
    io_gguf_close(g);
    io_gguf_writer_free(w);
    assert_int_equal(io_gguf_writer_init(&w, &err), ST_OK);
    assert_int_equal(io_gguf_writer_str(w, "k", "", &err), ST_OK);
    assert_int_equal(io_gguf_writer_open(w, &g, &err), ST_OK);
    struct io_gguf_str s;
    assert_int_equal(io_gguf_get_str(g, "k", &s, &err), ST_OK);
    assert_int_equal(s.len, 0);
    io_gguf_close(g);
    io_gguf_writer_free(w);
}

static struct io_gguf *dummy(const char *preset, uint64_t seed, int layers, int fill)
{
    struct err_detail err = {0};
    struct io_gguf *tok, *g;
    assert_int_equal(io_gguf_open(&tok, test_model_path(), &err), ST_OK);
    assert_int_equal(engine_dummy_gguf(&g, preset, tok, seed, layers, fill, &err), ST_OK);
    io_gguf_close(tok);
    return g;
}

static void test_dummy_shapes_and_seed(void **state)
{
    (void)state;
    struct err_detail err = {0};
    struct io_gguf *tok, *g;
    assert_int_equal(io_gguf_open(&tok, test_model_path(), &err), ST_OK);
    assert_int_not_equal(engine_dummy_gguf(&g, "llama3-9b", tok, 1, 0, 0, &err), ST_OK);
    assert_non_null(strstr(err.msg, "llama3-70b"));
    io_gguf_close(tok);

    /* llama3-70b, unfilled: the real shapes, no memory touched */
    g = dummy("llama3-70b", 1, 0, 0);
    struct engine_model *m;
    assert_int_equal(engine_model_from_gguf(&m, g, NULL, &err), ST_OK);
    const struct engine_hparams *hp = engine_model_hparams(m);
    assert_int_equal(hp->n_embd, 8192);
    assert_int_equal(hp->n_layer, 80);
    assert_int_equal(hp->n_head, 64);
    assert_int_equal(hp->n_kv_head, 8);
    assert_int_equal(hp->n_ff, 28672);
    assert_int_equal(hp->n_vocab, 128256);
    const struct io_gguf_tensor *k = io_gguf_find_tensor(g, "blk.79.attn_k.weight");
    assert_non_null(k);
    assert_int_equal(k->ne[0], 8192);
    assert_int_equal(k->ne[1], 1024);
    assert_non_null(io_gguf_find_tensor(g, "output.weight"));
    engine_model_free(m); /* owns g */

    /* the weights are a function of the seed (and layers); SmolLM2's head is tied */
    struct io_gguf *a = dummy("smollm2-135m", 7, 2, 1), *b = dummy("smollm2-135m", 7, 2, 1);
    struct io_gguf *c = dummy("smollm2-135m", 8, 2, 1);
    assert_null(io_gguf_find_tensor(a, "output.weight"));
    assert_int_equal(a->size, b->size);
    assert_memory_equal(a->base, b->base, a->size);
    const struct io_gguf_tensor *ta = io_gguf_find_tensor(a, "blk.1.ffn_down.weight");
    const struct io_gguf_tensor *tc = io_gguf_find_tensor(c, "blk.1.ffn_down.weight");
    assert_memory_not_equal(ta->data, tc->data, 4096);

    /* zero mean, standard deviation about 1 / sqrt(ne0): no row bias shared by every row */
    float *row = malloc(sizeof(float) * (size_t)ta->ne[0]);
    double sum = 0, sq = 0;
    const size_t rb = dtype_row_bytes(ta->type, ta->ne[0]);
    for (int64_t r = 0; r < ta->ne[1]; r++) {
        kern_ref_dequant_row(ta->type, (const uint8_t *)ta->data + (size_t)r * rb, row, ta->ne[0]);
        for (int64_t i = 0; i < ta->ne[0]; i++) {
            sum += row[i];
            sq += (double)row[i] * row[i];
        }
    }
    const double n = (double)(ta->ne[0] * ta->ne[1]), mean = sum / n;
    const double sd = sqrt(sq / n - mean * mean), want = 1.0 / sqrt((double)ta->ne[0]);
    printf("  ffn_down weights: mean %.2e, sd %.4f (want about %.4f)\n", mean, sd, want);
    assert_true(fabs(mean) < 0.02 * want);
    assert_true(sd > 0.7 * want && sd < 1.3 * want);
    free(row);
    io_gguf_close(a);
    io_gguf_close(b);
    io_gguf_close(c);
}

/* Greedy tokens of a 4-layer dummy SmolLM2: the same at --tp 3 as on one rank, and not one
 * token repeated (random weights that still tell tokens apart). */
static void greedy(struct io_gguf *g, int tp, int32_t *out, int n)
{
    struct err_detail err = {0};
    struct kern_backend_opts ko = {"cpu", 3, NULL, KERN_ACT_F32, 0, tp, 0};
    struct kern_group *grp;
    assert_int_equal(kern_group_open(&grp, &ko, &err), ST_OK);
    struct engine_model *m;
    assert_int_equal(engine_model_from_gguf_group(&m, g, grp, &err), ST_OK);
    struct engine_kv *kv;
    assert_int_equal(engine_model_kv_init(m, &kv, 64, 1, 16, KERN_KV_F16, &err), ST_OK);
    assert_int_equal(engine_kv_reserve(kv, 0, n, &err), ST_OK);
    const int V = engine_model_hparams(m)->n_vocab;
    float *lg = malloc(sizeof(float) * (size_t)V);
    int32_t tok = 1, pos = 0, seq = 0;
    for (int i = 0; i < n; i++, pos++) {
        struct engine_batch b = {1, &tok, &pos, &seq, NULL};
        assert_int_equal(engine_model_forward(m, kv, &b, lg, &err), ST_OK);
        int best = 0;
        for (int v = 1; v < V; v++)
            best = lg[v] > lg[best] ? v : best;
        out[i] = tok = best;
    }
    free(lg);
    engine_kv_free(kv);
    engine_model_free(m);
    kern_group_free(grp);
}

static void test_dummy_runs_tensor_parallel(void **state)
{
    (void)state;
    int32_t a[12], b[12];
    greedy(dummy("smollm2-135m", 1, 4, 1), 1, a, 12);
    greedy(dummy("smollm2-135m", 1, 4, 1), 3, b, 12);
    assert_memory_equal(a, b, sizeof(a));
    int distinct = 0;
    for (int i = 0; i < 12; i++) {
        int seen = 0;
        for (int j = 0; j < i; j++)
            seen |= a[j] == a[i];
        distinct += !seen;
    }
    printf("  12 greedy tokens, %d distinct\n", distinct);
    assert_true(distinct >= 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_dummy_shapes_and_seed),
        cmocka_unit_test(test_dummy_runs_tensor_parallel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
