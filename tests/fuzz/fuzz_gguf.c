/* libFuzzer harness for the GGUF reader (io/gguf.c), the parser of model files: any bytes must
 * be read or refused with a status and a message. What it reads is checked against the bytes
 * by an independent walk (tables, bounds, sizes, data offsets), the typed getters the model
 * and tokenizer loaders use must agree with it, and the same bytes read from a file (as
 * io_gguf_open maps them), cut to the file's own length or extended must give the same answer. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/dtype.h"
#include "common/err.h"
#include "io/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond))                                                                               \
            check_failed(__LINE__, #cond);                                                         \
    } while (0)

#define MAX_PROBES 48 /* keys and tensors looked up by name per input (lookups are linear) */

static volatile uint64_t sink; /* bytes handed out are summed here so every one is read */

static void check_failed(int line, const char *what)
{
    fprintf(stderr, "fuzz_gguf.c:%d: property does not hold: %s\n", line, what);
    abort();
}

static uint32_t rd32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static void touch(const void *p, uint64_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0;
    for (uint64_t i = 0; i < n; i++)
        h = h * 31 + b[i];
    sink += h;
}

/* Size of a scalar value type per the GGUF spec, 0 for string, array and unknown types. */
static size_t spec_size(uint32_t t)
{
    static const uint8_t sz[IO_GGUF_VTYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < IO_GGUF_VTYPE_COUNT ? sz[t] : 0;
}

/* The bytes [pos, pos + n) lie in a buffer of `size` bytes. */
static int in_buf(size_t size, size_t pos, uint64_t n)
{
    return pos <= size && n <= size - pos;
}

/* Walk one value of type t at *pos the way the GGUF spec lays it out; 0 when the bytes do not
 * hold one (a value the reader accepted must walk). */
static int walk_value(const uint8_t *b, size_t size, size_t *pos, uint32_t t, int depth)
{
    if (t == IO_GGUF_STRING) {
        if (!in_buf(size, *pos, 8) || !in_buf(size, *pos + 8, rd64(b + *pos)))
            return 0;
        *pos += 8 + (size_t)rd64(b + *pos);
        return 1;
    }
    if (t == IO_GGUF_ARRAY) {
        if (depth > 16 || !in_buf(size, *pos, 12))
            return 0;
        uint32_t et = rd32(b + *pos);
        uint64_t n = rd64(b + *pos + 4);
        *pos += 12;
        if (spec_size(et)) {
            if (n > (size - *pos) / spec_size(et))
                return 0;
            for (uint64_t i = 0; et == IO_GGUF_BOOL && i < n; i++)
                if (b[*pos + i] > 1)
                    return 0;
            *pos += (size_t)n * spec_size(et);
            return 1;
        }
        for (uint64_t i = 0; i < n; i++)
            if (!walk_value(b, size, pos, et, depth + 1))
                return 0;
        return 1;
    }
    size_t sz = spec_size(t);
    if (!sz || !in_buf(size, *pos, sz) || (t == IO_GGUF_BOOL && b[*pos] > 1))
        return 0;
    *pos += sz;
    return 1;
}

static int key_cmp(const void *a, const void *b)
{
    const struct io_gguf_kv *x = *(const struct io_gguf_kv *const *)a;
    const struct io_gguf_kv *y = *(const struct io_gguf_kv *const *)b;
    size_t n = x->key.len < y->key.len ? (size_t)x->key.len : (size_t)y->key.len;
    int r = memcmp(x->key.ptr, y->key.ptr, n);
    return r ? r : (x->key.len > y->key.len) - (x->key.len < y->key.len);
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp((*(const struct io_gguf_tensor *const *)a)->name,
                  (*(const struct io_gguf_tensor *const *)b)->name);
}

/* Keys are unique and so are tensor names. */
static void check_unique(const struct io_gguf *g)
{
    size_t n = (size_t)(g->n_kv > g->n_tensors ? g->n_kv : g->n_tensors);
    const void **v = malloc((n + 1) * sizeof(*v));
    CHECK(v != NULL);
    for (size_t i = 0; i < g->n_kv; i++)
        v[i] = &g->kv[i];
    qsort(v, (size_t)g->n_kv, sizeof(*v), key_cmp);
    for (size_t i = 1; i < g->n_kv; i++)
        CHECK(key_cmp(&v[i - 1], &v[i]) != 0);
    for (size_t i = 0; i < g->n_tensors; i++)
        v[i] = &g->tensors[i];
    qsort(v, (size_t)g->n_tensors, sizeof(*v), name_cmp);
    for (size_t i = 1; i < g->n_tensors; i++)
        CHECK(name_cmp(&v[i - 1], &v[i]) != 0);
    free(v);
}

/* The reader's tables are what the bytes say: every key, value, string and tensor info sits
 * where the spec puts it, in order, inside the buffer; sizes follow from types and shapes; the
 * data section starts at the aligned end of the tensor infos and every tensor's data lies in
 * it. Returns the length of the shortest prefix that holds the file (header and all data). */
static size_t check_tables(const struct io_gguf *g, const uint8_t *b, size_t size)
{
    CHECK(g->base == b && g->size == size && !g->mapped);
    CHECK(size >= 24 && !memcmp(b, "GGUF", 4));
    CHECK((g->version == 2 || g->version == 3) && rd32(b + 4) == g->version);
    CHECK(rd64(b + 8) == g->n_tensors && rd64(b + 16) == g->n_kv);
    CHECK(g->kv != NULL && g->tensors != NULL);

    size_t pos = 24;
    uint32_t alignment = 32;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct io_gguf_kv *kv = &g->kv[i];
        CHECK(in_buf(size, pos, 8));
        uint64_t klen = rd64(b + pos);
        CHECK(klen > 0 && in_buf(size, pos + 8, klen) && in_buf(size, pos + 8 + klen, 4));
        CHECK(kv->key.ptr == (const char *)b + pos + 8 && kv->key.len == klen);
        pos += 8 + (size_t)klen;
        CHECK(rd32(b + pos) == (uint32_t)kv->type && (uint32_t)kv->type < IO_GGUF_VTYPE_COUNT);
        pos += 4;
        size_t end = pos;
        CHECK(walk_value(b, size, &end, kv->type, 0));
        if (kv->type == IO_GGUF_ARRAY) {
            CHECK(rd32(b + pos) == (uint32_t)kv->arr_type && rd64(b + pos + 4) == kv->arr_n);
            CHECK(kv->val == b + pos + 12);
        } else {
            CHECK(kv->val == b + pos);
        }
        if (kv->type == IO_GGUF_ARRAY && kv->arr_type == IO_GGUF_STRING) {
            CHECK(kv->arr_n == 0 || kv->strs != NULL);
            size_t at = pos + 12;
            for (uint64_t j = 0; j < kv->arr_n; j++) {
                const struct io_gguf_str *s = &kv->strs[j];
                CHECK(s->ptr == (const char *)b + at + 8 && s->len == rd64(b + at));
                CHECK(in_buf(size, at + 8, s->len));
                touch(s->ptr, s->len);
                at += 8 + (size_t)s->len;
            }
            CHECK(at == end);
        } else {
            CHECK(kv->strs == NULL);
        }
        if (io_gguf_str_eq(kv->key, "general.alignment")) {
            CHECK(kv->type == IO_GGUF_UINT32);
            alignment = rd32(kv->val);
        }
        touch(kv->key.ptr, kv->key.len);
        pos = end;
    }
    CHECK(g->alignment == alignment && alignment && !(alignment & (alignment - 1)));

    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct io_gguf_tensor *t = &g->tensors[i];
        CHECK(in_buf(size, pos, 8));
        uint64_t nlen = rd64(b + pos);
        CHECK(nlen >= 1 && nlen < sizeof(t->name) && in_buf(size, pos + 8, nlen));
        CHECK(strnlen(t->name, sizeof(t->name)) == nlen && !memcmp(t->name, b + pos + 8, nlen));
        pos += 8 + (size_t)nlen;
        CHECK(in_buf(size, pos, 4) && rd32(b + pos) == t->n_dims);
        CHECK(t->n_dims >= 1 && t->n_dims <= IO_GGUF_MAX_DIMS);
        pos += 4;
        uint64_t nel = 1;
        for (uint32_t d = 0; d < IO_GGUF_MAX_DIMS; d++) {
            if (d < t->n_dims) {
                CHECK(in_buf(size, pos, 8) && rd64(b + pos) == (uint64_t)t->ne[d]);
                pos += 8;
            }
            CHECK(t->ne[d] >= 1 && (d < t->n_dims || t->ne[d] == 1));
            CHECK(!__builtin_mul_overflow(nel, (uint64_t)t->ne[d], &nel) &&
                  nel <= (uint64_t)INT64_MAX);
        }
        CHECK(in_buf(size, pos, 12) && rd32(b + pos) == t->type && rd64(b + pos + 4) == t->offset);
        pos += 12;
        const struct dtype_info *di = dtype_get(t->type);
        CHECK(di != NULL && t->ne[0] % di->block_elems == 0);
        /* the size the loaders compute, row by row */
        uint64_t row = dtype_row_bytes(t->type, t->ne[0]), rows = nel / (uint64_t)t->ne[0];
        uint64_t nbytes;
        CHECK(row > 0 && !__builtin_mul_overflow(row, rows, &nbytes) && nbytes == t->nbytes);
        CHECK(t->offset % alignment == 0);
    }
    if (!g->n_tensors)
        return pos; /* nothing follows the metadata */

    size_t data_start = pos + (alignment - pos % alignment) % alignment, need = data_start;
    CHECK(data_start <= size);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct io_gguf_tensor *t = &g->tensors[i];
        CHECK(in_buf(size, data_start, t->offset) &&
              in_buf(size, data_start + t->offset, t->nbytes));
        CHECK((const uint8_t *)t->data == b + data_start + t->offset);
        touch(t->data, t->nbytes);
        if (data_start + t->offset + t->nbytes > need)
            need = data_start + (size_t)(t->offset + t->nbytes);
    }
    return need;
}

/* Every typed getter on key agrees with the key's entry (or its absence): right type gives the
 * value the bytes hold, another type ST_ERR_FORMAT, a missing key ST_ERR_NOT_FOUND; a failure
 * names the key. */
static void probe(const struct io_gguf *g, const char *key)
{
    const struct io_gguf_kv *kv = io_gguf_find_kv(g, key);
    if (kv)
        CHECK(io_gguf_str_eq(kv->key, key));
    struct err_detail err;
    enum status st;
#define EXPECT(cond_ok, call)                                                                      \
    do {                                                                                           \
        memset(&err, 0, sizeof(err));                                                              \
        st = (call);                                                                               \
        if (!kv)                                                                                   \
            CHECK(st == ST_ERR_NOT_FOUND);                                                         \
        else                                                                                       \
            CHECK(st == ((cond_ok) ? ST_OK : ST_ERR_FORMAT));                                      \
        if (st != ST_OK)                                                                           \
            CHECK(err.status == st && strstr(err.msg, key) != NULL);                               \
    } while (0)

    int64_t iv = 0;
    int is_int = 0;
    if (kv) {
        const uint8_t *p = kv->val;
        switch (kv->type) {
        case IO_GGUF_UINT8:
            iv = p[0], is_int = 1;
            break;
        case IO_GGUF_INT8:
            iv = (int8_t)p[0], is_int = 1;
            break;
        case IO_GGUF_UINT16:
            iv = (uint16_t)(p[0] | p[1] << 8), is_int = 1;
            break;
        case IO_GGUF_INT16:
            iv = (int16_t)(uint16_t)(p[0] | p[1] << 8), is_int = 1;
            break;
        case IO_GGUF_UINT32:
            iv = rd32(p), is_int = 1;
            break;
        case IO_GGUF_INT32:
            iv = (int32_t)rd32(p), is_int = 1;
            break;
        case IO_GGUF_INT64:
            iv = (int64_t)rd64(p), is_int = 1;
            break;
        case IO_GGUF_UINT64:
            is_int = rd64(p) <= (uint64_t)INT64_MAX;
            iv = (int64_t)(rd64(p) & INT64_MAX);
            break;
        default:
            break;
        }
    }
    uint32_t u = 0;
    EXPECT(is_int && iv >= 0 && iv <= (int64_t)UINT32_MAX, io_gguf_get_u32(g, key, &u, &err));
    if (st == ST_OK)
        CHECK(u == (uint64_t)iv);

    float f = 0;
    EXPECT(kv->type == IO_GGUF_FLOAT32 || kv->type == IO_GGUF_FLOAT64,
           io_gguf_get_f32(g, key, &f, &err));
    if (st == ST_OK && kv->type == IO_GGUF_FLOAT32)
        CHECK(!memcmp(&f, kv->val, 4));

    int bv = -1;
    EXPECT(kv->type == IO_GGUF_BOOL, io_gguf_get_bool(g, key, &bv, &err));
    if (st == ST_OK)
        CHECK(bv == kv->val[0] && (bv == 0 || bv == 1));

    struct io_gguf_str s = {0};
    EXPECT(kv->type == IO_GGUF_STRING, io_gguf_get_str(g, key, &s, &err));
    if (st == ST_OK) {
        CHECK(s.ptr == (const char *)kv->val + 8 && s.len == rd64(kv->val));
        CHECK((const uint8_t *)s.ptr >= g->base &&
              in_buf(g->size, (size_t)((const uint8_t *)s.ptr - g->base), s.len));
        touch(s.ptr, s.len);
    }

    for (uint32_t et = 0; et <= IO_GGUF_VTYPE_COUNT; et++) {
        const void *arr = NULL;
        uint64_t n = 0;
        EXPECT(kv->type == IO_GGUF_ARRAY && (uint32_t)kv->arr_type == et && spec_size(et),
               io_gguf_get_arr(g, key, (enum io_gguf_vtype)et, &arr, &n, &err));
        if (st == ST_OK) {
            CHECK(arr == kv->val && n == kv->arr_n);
            size_t at = (size_t)((const uint8_t *)arr - g->base);
            CHECK(n <= (g->size - at) / spec_size(et));
            touch(arr, n * spec_size(et));
        }
    }

    const struct io_gguf_str *strs = NULL;
    uint64_t n = 0;
    EXPECT(kv->type == IO_GGUF_ARRAY && kv->arr_type == IO_GGUF_STRING,
           io_gguf_get_str_arr(g, key, &strs, &n, &err));
    if (st == ST_OK)
        CHECK(strs == kv->strs && n == kv->arr_n); /* each string was checked in the walk */
#undef EXPECT
}

/* What engine/model.c and engine/tokenizer.c read, the way they read it. */
static void loader_reads(const struct io_gguf *g)
{
    static const char *const keys[] = {
        "general.architecture",        "general.alignment",
        "tokenizer.ggml.model",        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",       "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",       "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id", "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",     "quern.fuzz.absent",
    };
    static const char *const hparams[] = {
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "context_length",
        "attention.layer_norm_rms_epsilon",
        "rope.dimension_count",
        "rope.freq_base",
        "rope.scaling.type",
    };
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
        probe(g, keys[i]);

    /* architecture keys, named after the file's own architecture as a loader would */
    char arch[48] = "llama", name[128];
    struct io_gguf_str s;
    if (io_gguf_get_str(g, "general.architecture", &s, NULL) == ST_OK && s.len > 0 &&
        s.len < sizeof(arch) && !memchr(s.ptr, 0, (size_t)s.len)) {
        memcpy(arch, s.ptr, (size_t)s.len);
        arch[s.len] = 0;
    }
    for (size_t i = 0; i < sizeof(hparams) / sizeof(hparams[0]); i++) {
        snprintf(name, sizeof(name), "%s.%s", arch, hparams[i]);
        probe(g, name);
    }

    /* the vocabulary: token texts, their types (one per token), merges split at a space */
    const struct io_gguf_str *toks, *merges;
    const void *types;
    uint64_t n_toks, n_types, n_merges;
    if (io_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n_toks, NULL) == ST_OK) {
        uint64_t total = 0;
        for (uint64_t i = 0; i < n_toks; i++)
            total += toks[i].len;
        CHECK(total <= g->size);
        if (io_gguf_get_arr(g, "tokenizer.ggml.token_type", IO_GGUF_INT32, &types, &n_types,
                            NULL) == ST_OK &&
            n_types == n_toks)
            for (uint64_t i = 0; i < n_types; i++) {
                int32_t ty;
                memcpy(&ty, (const uint8_t *)types + 4 * i, 4);
                sink += (uint32_t)ty;
            }
    }
    if (io_gguf_get_str_arr(g, "tokenizer.ggml.merges", &merges, &n_merges, NULL) == ST_OK)
        for (uint64_t i = 0; i < n_merges; i++) {
            size_t len = (size_t)merges[i].len;
            const char *sp = len > 1 ? memchr(merges[i].ptr + 1, ' ', len - 1) : NULL;
            sink += sp ? (uint64_t)(sp - merges[i].ptr) : 0;
        }

    /* the tensors the model loader looks up by name */
    static const char *const tensors[] = {"token_embd.weight", "output_norm.weight",
                                          "output.weight", "blk.0.attn_q.weight",
                                          "blk.0.attn_norm.weight"};
    for (size_t i = 0; i < sizeof(tensors) / sizeof(tensors[0]); i++) {
        const struct io_gguf_tensor *t = io_gguf_find_tensor(g, tensors[i]);
        if (t)
            CHECK(!strcmp(t->name, tensors[i]) && t >= g->tensors && t < g->tensors + g->n_tensors);
    }
}

/* Every key and tensor (up to MAX_PROBES of each, spread over the table) is found by name. */
static void lookups(const struct io_gguf *g)
{
    uint64_t step = g->n_kv / MAX_PROBES + 1;
    for (uint64_t i = 0; i < g->n_kv; i += step) {
        const struct io_gguf_kv *kv = &g->kv[i];
        char key[256];
        if (kv->key.len >= sizeof(key) || memchr(kv->key.ptr, 0, (size_t)kv->key.len))
            continue; /* not reachable through a C-string key */
        memcpy(key, kv->key.ptr, (size_t)kv->key.len);
        key[kv->key.len] = 0;
        CHECK(io_gguf_find_kv(g, key) == kv);
        probe(g, key);
    }
    step = g->n_tensors / MAX_PROBES + 1;
    for (uint64_t i = 0; i < g->n_tensors; i += step)
        CHECK(io_gguf_find_tensor(g, g->tensors[i].name) == &g->tensors[i]);
    for (uint32_t t = 0; t <= IO_GGUF_VTYPE_COUNT + 1; t++)
        CHECK(io_gguf_vtype_name((enum io_gguf_vtype)t) != NULL);
}

/* Read the first `keep` bytes of data, followed by `len - keep` filler bytes, from an
 * exact-size heap copy (so ASan sees a read one byte past the end). */
static enum status reparse(const uint8_t *data, size_t keep, size_t len, struct io_gguf **g,
                           uint8_t **copy)
{
    *copy = malloc(len ? len : 1);
    CHECK(*copy != NULL);
    memcpy(*copy, data, keep);
    memset(*copy + keep, 0xA5, len - keep);
    struct err_detail err = {0};
    enum status st = io_gguf_open_mem(g, *copy, len, &err);
    if (st != ST_OK)
        CHECK(*g == NULL && err.status == st && err.msg[0]);
    return st;
}

/* b read from the same bytes as a, at another address: the same tables. */
static void check_same(const struct io_gguf *a, const struct io_gguf *b)
{
    CHECK(a->version == b->version && a->n_kv == b->n_kv && a->n_tensors == b->n_tensors &&
          a->alignment == b->alignment);
    for (uint64_t i = 0; i < a->n_kv; i++) {
        const struct io_gguf_kv *x = &a->kv[i], *y = &b->kv[i];
        CHECK(x->key.ptr - (const char *)a->base == y->key.ptr - (const char *)b->base);
        CHECK(x->key.len == y->key.len && x->type == y->type &&
              x->val - a->base == y->val - b->base);
        if (x->type == IO_GGUF_ARRAY)
            CHECK(x->arr_type == y->arr_type && x->arr_n == y->arr_n);
    }
    for (uint64_t i = 0; i < a->n_tensors; i++) {
        const struct io_gguf_tensor *x = &a->tensors[i], *y = &b->tensors[i];
        CHECK(!strcmp(x->name, y->name) && x->n_dims == y->n_dims && x->type == y->type);
        CHECK(!memcmp(x->ne, y->ne, sizeof(x->ne)) && x->offset == y->offset &&
              x->nbytes == y->nbytes);
        CHECK((const uint8_t *)x->data - a->base == (const uint8_t *)y->data - b->base);
    }
}

/* The bytes as a file, through io_gguf_open (open, mmap, then the in-memory reader): the same
 * status as from memory (with the path in front of the message), or the same tables. */
static void check_file(const uint8_t *data, size_t size, enum status st_mem,
                       const struct io_gguf *g_mem, const struct err_detail *err_mem)
{
    int fd = memfd_create("fuzz_gguf", MFD_CLOEXEC);
    CHECK(fd >= 0);
    for (size_t done = 0; done < size;) {
        ssize_t w = write(fd, data + done, size - done);
        CHECK(w > 0);
        done += (size_t)w;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    struct io_gguf *g;
    struct err_detail err = {0};
    enum status st = io_gguf_open(&g, path, &err);
    close(fd); /* the mapping outlives it */
    if (st != ST_OK) {
        CHECK(g == NULL && err.status == st && !strncmp(err.msg, path, strlen(path)));
        if (size == 0) /* refused before mapping: nothing to map */
            CHECK(st == ST_ERR_FORMAT);
        else
            CHECK(st == st_mem && !strncmp(err.msg + strlen(path) + 2, err_mem->msg, 256));
        return;
    }
    CHECK(st_mem == ST_OK && g->mapped && g->size == size);
    check_same(g_mem, g);
    io_gguf_close(g);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct io_gguf poison;
    struct io_gguf *g = &poison; /* must come back NULL on failure */
    struct err_detail err = {0};
    enum status st = io_gguf_open_mem(&g, data, size, &err);
    if (st != ST_OK) {
        /* refused: no reader, a status for bad input (or no memory) and the reason */
        CHECK(g == NULL);
        CHECK(st == ST_ERR_FORMAT || st == ST_ERR_UNSUPPORTED || st == ST_ERR_NOMEM);
        CHECK(err.status == st && err.msg[0] != 0 &&
              strnlen(err.msg, sizeof(err.msg)) < sizeof(err.msg));
        if (size % 16 == 0) /* a sample: the file costs as much as the parse */
            check_file(data, size, st, NULL, &err);
        return 0;
    }
    CHECK(g != NULL);
    size_t need = check_tables(g, data, size);
    CHECK(need <= size);
    check_unique(g);
    lookups(g);
    loader_reads(g);
    check_file(data, size, st, g, &err);

    /* the file alone reads the same; one byte short of it is refused; bytes after it change
     * nothing (a reader must not depend on what follows the data) */
    struct io_gguf *h;
    uint8_t *copy;
    if (reparse(data, need, need, &h, &copy) == ST_OK) {
        check_same(g, h);
        io_gguf_close(h);
    } else {
        CHECK(!"the file cut to its own length is refused");
    }
    free(copy);
    if (need > 0) {
        CHECK(reparse(data, need - 1, need - 1, &h, &copy) != ST_OK);
        free(copy);
    }
    if (reparse(data, size, size + 1 + size % 64, &h, &copy) == ST_OK) {
        check_same(g, h);
        io_gguf_close(h);
    } else {
        CHECK(!"the file with bytes appended is refused");
    }
    free(copy);
    io_gguf_close(g);
    return 0;
}
