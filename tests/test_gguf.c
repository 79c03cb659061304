/* GGUF reader tests: every tensor of the real default model against a table made by the
 * independent `gguf` Python package; typed metadata of a small fixture; a fuzz loop that
 * mutates and truncates that fixture thousands of times (run under ASan in CI); and the files
 * the libFuzzer harness (tests/fuzz/fuzz_gguf.c) found mishandled. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "common/dtype.h"
#include "io/gguf.h"
#include "tests/test_util.h"

static void test_model_tensors(void **state)
{
    (void)state;
    struct io_gguf *g;
    struct err_detail err = {0};
    enum status st = io_gguf_open(&g, test_model_path(), &err);
    if (st)
        fail_msg("cannot open model %s: %s", test_model_path(), err.msg);
    FILE *f = fopen("tests/fixtures/model_tensors.tsv", "r");
    assert_non_null(f);
    char line[512];
    uint64_t rows = 0;
    while (fgets(line, sizeof(line), f)) {
        if (line[0] == '#')
            continue;
        char name[128], dims[64], fnv[32];
        unsigned type;
        unsigned long long nbytes;
        assert_int_equal(sscanf(line, "%127s %u %63s %llu %31s", name, &type, dims, &nbytes, fnv),
                         5);
        const struct io_gguf_tensor *t = io_gguf_find_tensor(g, name);
        if (!t)
            fail_msg("tensor %s missing", name);
        assert_int_equal(t->type, type);
        assert_int_equal(t->nbytes, nbytes);
        int64_t ne[4] = {1, 1, 1, 1};
        int nd = 0;
        for (char *tok = strtok(dims, ","); tok && nd < 4; tok = strtok(NULL, ","))
            ne[nd++] = strtoll(tok, NULL, 10);
        assert_int_equal(t->n_dims, nd);
        for (int d = 0; d < 4; d++)
            assert_int_equal(t->ne[d], ne[d]);
        char got[32];
        snprintf(got, sizeof(got), "%016llx",
                 (unsigned long long)test_fnv1a64(t->data, (size_t)t->nbytes));
        if (strcmp(got, fnv))
            fail_msg("tensor %s data hash %s, want %s (wrong offset?)", name, got, fnv);
        rows++;
    }
    fclose(f);
    assert_int_equal(rows, g->n_tensors);
    assert_int_equal(rows, 272);

    uint32_t u;
    float fl;
    struct io_gguf_str s;
    assert_int_equal(io_gguf_get_u32(g, "llama.block_count", &u, &err), ST_OK);
    assert_int_equal(u, 30);
    assert_int_equal(io_gguf_get_f32(g, "llama.rope.freq_base", &fl, &err), ST_OK);
    assert_true(fl == 100000.0f);
    assert_int_equal(io_gguf_get_str(g, "tokenizer.ggml.pre", &s, &err), ST_OK);
    assert_true(io_gguf_str_eq(s, "smollm"));
    const struct io_gguf_str *toks;
    uint64_t n;
    assert_int_equal(io_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n, &err), ST_OK);
    assert_int_equal(n, 49152);
    assert_true(io_gguf_str_eq(toks[2], "<|im_end|>"));
    /* wrong-type and missing keys are errors, not crashes */
    assert_int_equal(io_gguf_get_u32(g, "tokenizer.ggml.pre", &u, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "tokenizer.ggml.pre"));
    assert_int_equal(io_gguf_get_u32(g, "no.such.key", &u, &err), ST_ERR_NOT_FOUND);
    io_gguf_close(g);
}

static char *load_small(size_t *len)
{
    char *buf = test_read_file("tests/fixtures/small.gguf", len);
    assert_non_null(buf);
    return buf;
}

static void test_small_metadata(void **state)
{
    (void)state;
    size_t len, jlen;
    char *buf = load_small(&len);
    char *js = test_read_file("tests/fixtures/small_gguf.json", &jlen);
    assert_non_null(js);
    cJSON *j = cJSON_Parse(js);
    assert_non_null(j);
    struct io_gguf *g;
    struct err_detail err = {0};
    assert_int_equal(io_gguf_open_mem(&g, buf, len, &err), ST_OK);
    assert_int_equal(g->n_kv, cJSON_GetObjectItem(j, "n_kv")->valueint);
    const cJSON *ts = cJSON_GetObjectItem(j, "tensors");
    assert_int_equal(g->n_tensors, cJSON_GetArraySize(ts));
    const cJSON *jt;
    cJSON_ArrayForEach(jt, ts)
    {
        const struct io_gguf_tensor *t =
            io_gguf_find_tensor(g, cJSON_GetObjectItem(jt, "name")->valuestring);
        assert_non_null(t);
        assert_int_equal(t->type, cJSON_GetObjectItem(jt, "type")->valueint);
        assert_int_equal(t->nbytes, (uint64_t)cJSON_GetObjectItem(jt, "nbytes")->valuedouble);
        char got[32];
        snprintf(got, sizeof(got), "%016llx",
                 (unsigned long long)test_fnv1a64(t->data, (size_t)t->nbytes));
        assert_string_equal(got, cJSON_GetObjectItem(jt, "fnv")->valuestring);
    }
    uint32_t u;
    float f;
    int b;
    struct io_gguf_str s;
    assert_int_equal(io_gguf_get_u32(g, "test.u8", &u, &err), ST_OK);
    assert_int_equal(u, 200);
    assert_int_equal(io_gguf_get_u32(g, "test.u32", &u, &err), ST_OK);
    assert_int_equal(u, 4000000000u);
    assert_int_equal(io_gguf_get_u32(g, "test.i8", &u, &err), ST_ERR_FORMAT); /* negative */
    assert_int_equal(io_gguf_get_f32(g, "test.f32", &f, &err), ST_OK);
    assert_true(f == 1.5f);
    assert_int_equal(io_gguf_get_f32(g, "test.f64", &f, &err), ST_OK);
    assert_true(f == -2.25f);
    assert_int_equal(io_gguf_get_bool(g, "test.bool", &b, &err), ST_OK);
    assert_int_equal(b, 1);
    assert_int_equal(io_gguf_get_str(g, "test.str", &s, &err), ST_OK);
    assert_true(io_gguf_str_eq(s, "h\xc3\xa9llo w\xc3\xb6rld"));
    const struct io_gguf_str *strs;
    uint64_t n;
    assert_int_equal(io_gguf_get_str_arr(g, "test.arr_str", &strs, &n, &err), ST_OK);
    assert_int_equal(n, 4);
    assert_true(io_gguf_str_eq(strs[1], "bc") && io_gguf_str_eq(strs[2], "") &&
                io_gguf_str_eq(strs[3], "d\xc3\xa9" "f"));
    const void *data;
    assert_int_equal(io_gguf_get_arr(g, "test.arr_i32", IO_GGUF_INT32, &data, &n, &err), ST_OK);
    int32_t v[3];
    memcpy(v, data, sizeof(v));
    assert_int_equal(n, 3);
    assert_true(v[0] == 1 && v[1] == -2 && v[2] == 3);
    const struct io_gguf_kv *kv = io_gguf_find_kv(g, "test.arr_nested");
    assert_non_null(kv);
    assert_int_equal(kv->type, IO_GGUF_ARRAY);
    assert_int_equal(kv->arr_type, IO_GGUF_ARRAY);
    assert_int_equal(kv->arr_n, 2);
    io_gguf_close(g);
    cJSON_Delete(j);
    free(js);
    free(buf);
}

/* Touch every byte the reader hands out, so ASan flags any out-of-bounds pointer. */
static uint64_t touch_all(const struct io_gguf *g)
{
    uint64_t h = 0;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct io_gguf_kv *kv = &g->kv[i];
        h += test_fnv1a64(kv->key.ptr, (size_t)kv->key.len);
        if (kv->strs)
            for (uint64_t j = 0; j < kv->arr_n; j++)
                h += test_fnv1a64(kv->strs[j].ptr, (size_t)kv->strs[j].len);
        struct io_gguf_str s;
        char key[128];
        snprintf(key, sizeof(key), "%.*s", (int)(kv->key.len < 100 ? kv->key.len : 100),
                 kv->key.ptr);
        if (io_gguf_get_str(g, key, &s, NULL) == ST_OK)
            h += test_fnv1a64(s.ptr, (size_t)s.len);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++)
        h += test_fnv1a64(g->tensors[i].data, (size_t)g->tensors[i].nbytes);
    return h;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void try_parse(const char *src, size_t len, int *ok, int *bad)
{
    /* exact-size heap copy: ASan catches a read one byte past the end */
    char *copy = malloc(len ? len : 1);
    assert_non_null(copy);
    memcpy(copy, src, len);
    struct io_gguf *g = NULL;
    struct err_detail err = {0};
    enum status st = io_gguf_open_mem(&g, copy, len, &err);
    if (st == ST_OK) {
        assert_non_null(g);
        touch_all(g);
        io_gguf_close(g);
        (*ok)++;
    } else {
        assert_null(g);
        assert_true(err.msg[0] != 0); /* every failure says why */
        (*bad)++;
    }
    free(copy);
}

static void test_fuzz(void **state)
{
    (void)state;
    size_t len;
    char *buf = load_small(&len);
    int ok = 0, bad = 0;
    /* every truncation length: only cutting trailing padding after the last tensor's data
     * may still parse */
    struct io_gguf *g;
    assert_int_equal(io_gguf_open_mem(&g, buf, len, NULL), ST_OK);
    size_t data_end = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        size_t e = (size_t)((const char *)g->tensors[i].data - buf) + g->tensors[i].nbytes;
        data_end = e > data_end ? e : data_end;
    }
    io_gguf_close(g);
    for (size_t n = 0; n < len; n++)
        try_parse(buf, n, &ok, &bad);
    assert_int_equal(ok, (int)(len - data_end));
    /* random mutations: byte flips, interesting values, 64-bit length fields */
    char *m = malloc(len);
    assert_non_null(m);
    static const uint64_t interesting[] = {0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
                                           0x100000000ull, 0x7FFFFFFFFFFFFFFFull,
                                           0xFFFFFFFFFFFFFFFFull, 0x8000000000000000ull};
    for (int iter = 0; iter < 20000; iter++) {
        memcpy(m, buf, len);
        int edits = 1 + (int)(rnd() % 4);
        for (int e = 0; e < edits; e++) {
            size_t at = (size_t)(rnd() % len);
            switch (rnd() % 4) {
            case 0: m[at] ^= (char)(1u << (rnd() % 8)); break;
            case 1: m[at] = (char)rnd(); break;
            case 2:
            case 3: {
                uint64_t v = interesting[rnd() % (sizeof(interesting) / sizeof(interesting[0]))];
                size_t w = (rnd() % 2) ? 8 : 4;
                if (at + w <= len)
                    memcpy(m + at, &v, w);
                break;
            }
            }
        }
        size_t n = (rnd() % 8) ? len : (size_t)(rnd() % len);
        try_parse(m, n, &ok, &bad);
    }
    free(m);
    free(buf);
    print_message("fuzz: %d parsed, %d rejected\n", ok, bad);
    assert_true(bad > 1000);
    assert_true(ok > 100); /* mutations of tensor data must still parse */
}

static void test_errors(void **state)
{
    (void)state;
    struct io_gguf *g;
    struct err_detail err = {0};
    assert_int_equal(io_gguf_open(&g, "/nonexistent/model.gguf", &err), ST_ERR_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/model.gguf"));
    assert_int_equal(io_gguf_open_mem(&g, "GGUF\x01\0\0\0", 8, &err), ST_ERR_UNSUPPORTED);
    assert_int_equal(io_gguf_open_mem(&g, "GGML\x03\0\0\0", 8, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "magic"));
    size_t len;
    char *buf = load_small(&len);
    /* tensor count of 2^40 is refused before any allocation */
    uint64_t huge = 1ull << 40;
    memcpy(buf + 8, &huge, 8);
    assert_int_equal(io_gguf_open_mem(&g, buf, len, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "tensor count"));
    free(buf);
}

/* A file whose only string array is empty: no string pool is allocated, and the reader used
 * to point the array's strings at NULL + 0 (undefined behaviour, which clang's UBSan stops at;
 * found by tests/fuzz/fuzz_gguf.c). It reads, and the array has no strings. */
static void test_empty_string_array(void **state)
{
    (void)state;
    static const unsigned char file[] = {
        'G', 'G', 'U', 'F', 3, 0, 0, 0,      /* magic, version */
        0,   0,   0,   0,   0, 0, 0, 0,      /* no tensors */
        1,   0,   0,   0,   0, 0, 0, 0,      /* one pair */
        1,   0,   0,   0,   0, 0, 0, 0, 'k', /* key "k" */
        9,   0,   0,   0,   8, 0, 0, 0,      /* array of strings */
        0,   0,   0,   0,   0, 0, 0, 0,      /* of none */
    };
    struct io_gguf *g;
    struct err_detail err = {0};
    if (io_gguf_open_mem(&g, file, sizeof(file), &err) != ST_OK)
        fail_msg("empty string array refused: %s", err.msg);
    static const struct io_gguf_str junk;
    const struct io_gguf_str *strs = &junk;
    uint64_t n = 1;
    assert_int_equal(io_gguf_get_str_arr(g, "k", &strs, &n, &err), ST_OK);
    assert_int_equal(n, 0);
    assert_null(strs);
    io_gguf_close(g);
}

/* dtype_first_nonfinite: every type, a NaN or infinity in each float field a block has (the
 * scales; for plain types any value) found at its block's first element, finite ones passing
 * (huge finite halves and int8 quants included). */
static void test_nonfinite(void **state)
{
    (void)state;
    static const struct {
        uint32_t type;
        int field[2]; /* byte offsets of a block's f16 fields (-1: none), F32/F16/BF16: -2 */
    } ty[] = {
        {DTYPE_F32, {-2, -1}}, {DTYPE_F16, {-2, -1}}, {DTYPE_BF16, {-2, -1}},
        {DTYPE_Q4_0, {0, -1}}, {DTYPE_Q4_1, {0, 2}},  {DTYPE_Q5_0, {0, -1}},
        {DTYPE_Q8_0, {0, -1}}, {DTYPE_Q4_K, {0, 2}},  {DTYPE_Q6_K, {208, -1}},
    };
    unsigned char buf[4 * 256 * 4];
    for (size_t k = 0; k < sizeof(ty) / sizeof(ty[0]); k++) {
        const struct dtype_info *di = dtype_get(ty[k].type);
        assert_non_null(di);
        const int64_t n = 4 * (int64_t)di->block_elems; /* four blocks (or values) */
        const size_t bytes = (size_t)(n / di->block_elems) * (size_t)di->block_bytes;
        memset(buf, 0xfb, bytes); /* finite in every field: f16 -65504, bf16 -2.6e36, f32 */
        assert_int_equal(dtype_first_nonfinite(ty[k].type, buf, n), -1);
        for (int f = 0; f < 2; f++) {
            const int off = ty[k].field[f];
            if (off == -1)
                continue;
            const int size = off == -2 ? di->block_bytes : 2;
            const int at = off == -2 ? 0 : off;
            for (int bad = 0; bad < 2; bad++) { /* an infinity, then a NaN, in block 2 */
                unsigned char *p = buf + 2 * (size_t)di->block_bytes + (size_t)at;
                memset(buf, 0xfb, bytes);
                if (size == 4)
                    memcpy(p, bad ? "\x01\x00\x80\x7f" : "\x00\x00\x80\xff", 4);
                else if (ty[k].type == DTYPE_BF16)
                    memcpy(p, bad ? "\xc1\x7f" : "\x80\x7f", 2);
                else
                    memcpy(p, bad ? "\x01\x7e" : "\x00\xfc", 2);
                assert_int_equal(dtype_first_nonfinite(ty[k].type, buf, n),
                                 2 * (int64_t)di->block_elems);
            }
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_tensors), cmocka_unit_test(test_small_metadata),
        cmocka_unit_test(test_errors),        cmocka_unit_test(test_empty_string_array),
        cmocka_unit_test(test_fuzz),          cmocka_unit_test(test_nonfinite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
