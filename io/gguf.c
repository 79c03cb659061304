/* GGUF reader: validates the whole header, metadata and tensor table of a mapped file up
 * front (bounds, overflow, types, alignment), so later accessors are plain lookups. */
#include "io/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/dtype.h"

#define GGUF_MAX_NEST 8 /* deepest array-of-array nesting accepted */

struct cursor {
    const uint8_t *base;     /* start of the buffer */
    size_t size;             /* its length */
    size_t pos;              /* next byte to read */
    struct err_detail *err;  /* where failures are described */
};

static enum status cur_need(struct cursor *c, uint64_t n, const char *what)
{
    if (n > c->size - c->pos)
        return err_set(c->err, ST_ERR_FORMAT,
                       "truncated file: %s needs %llu bytes at offset %zu, file has %zu",
                       what, (unsigned long long)n, c->pos, c->size);
    return ST_OK;
}

static enum status cur_u32(struct cursor *c, uint32_t *v, const char *what)
{
    enum status st = cur_need(c, 4, what);
    if (st)
        return st;
    memcpy(v, c->base + c->pos, 4);
    c->pos += 4;
    return ST_OK;
}

static enum status cur_u64(struct cursor *c, uint64_t *v, const char *what)
{
    enum status st = cur_need(c, 8, what);
    if (st)
        return st;
    memcpy(v, c->base + c->pos, 8);
    c->pos += 8;
    return ST_OK;
}

static enum status cur_str(struct cursor *c, struct io_gguf_str *s, const char *what)
{
    uint64_t len;
    enum status st = cur_u64(c, &len, what);
    if (st)
        return st;
    if ((st = cur_need(c, len, what)))
        return st;
    s->ptr = (const char *)c->base + c->pos;
    s->len = len;
    c->pos += (size_t)len;
    return ST_OK;
}

static const char *vtype_names[IO_GGUF_VTYPE_COUNT] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool", "string", "array", "uint64", "int64", "float64",
};

const char *io_gguf_vtype_name(enum io_gguf_vtype t)
{
    return (unsigned)t < IO_GGUF_VTYPE_COUNT ? vtype_names[t] : "invalid";
}

/* Size of a fixed-size scalar type, 0 for string/array. */
static size_t vtype_size(enum io_gguf_vtype t)
{
    switch (t) {
    case IO_GGUF_UINT8: case IO_GGUF_INT8: case IO_GGUF_BOOL: return 1;
    case IO_GGUF_UINT16: case IO_GGUF_INT16: return 2;
    case IO_GGUF_UINT32: case IO_GGUF_INT32: case IO_GGUF_FLOAT32: return 4;
    case IO_GGUF_UINT64: case IO_GGUF_INT64: case IO_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* Skip (and validate) one value of type t at nesting depth `depth`. */
static enum status skip_value(struct cursor *c, uint32_t t, int depth, const char *key)
{
    enum status st;
    if (t >= IO_GGUF_VTYPE_COUNT)
        return err_set(c->err, ST_ERR_FORMAT, "key '%s': invalid value type %u at offset %zu",
                       key, t, c->pos);
    if (t == IO_GGUF_STRING) {
        struct io_gguf_str s;
        return cur_str(c, &s, "string value");
    }
    if (t != IO_GGUF_ARRAY) {
        size_t sz = vtype_size((enum io_gguf_vtype)t);
        if ((st = cur_need(c, sz, "scalar value")))
            return st;
        if (t == IO_GGUF_BOOL && c->base[c->pos] > 1)
            return err_set(c->err, ST_ERR_FORMAT, "key '%s': bool value %u is not 0 or 1", key,
                           c->base[c->pos]);
        c->pos += sz;
        return ST_OK;
    }
    if (depth >= GGUF_MAX_NEST)
        return err_set(c->err, ST_ERR_FORMAT, "key '%s': arrays nested deeper than %d", key,
                       GGUF_MAX_NEST);
    uint32_t et;
    uint64_t n;
    if ((st = cur_u32(c, &et, "array type")) || (st = cur_u64(c, &n, "array length")))
        return st;
    if (et >= IO_GGUF_VTYPE_COUNT)
        return err_set(c->err, ST_ERR_FORMAT, "key '%s': invalid array element type %u", key, et);
    size_t sz = vtype_size((enum io_gguf_vtype)et);
    if (sz) {
        if (n > (c->size - c->pos) / sz)
            return err_set(c->err, ST_ERR_FORMAT,
                           "key '%s': array of %llu %s elements exceeds the file", key,
                           (unsigned long long)n, io_gguf_vtype_name(et));
        if (et == IO_GGUF_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (c->base[c->pos + i] > 1)
                    return err_set(c->err, ST_ERR_FORMAT, "key '%s': bool element %llu is %u",
                                   key, (unsigned long long)i, c->base[c->pos + i]);
        c->pos += (size_t)(n * sz);
        return ST_OK;
    }
    /* strings are >= 8 bytes, arrays >= 12: a count beyond that cannot fit */
    if (n > (c->size - c->pos) / 8)
        return err_set(c->err, ST_ERR_FORMAT, "key '%s': array of %llu elements exceeds the file",
                       key, (unsigned long long)n);
    for (uint64_t i = 0; i < n; i++)
        if ((st = skip_value(c, et, depth + 1, key)))
            return st;
    return ST_OK;
}

static int is_pow2(uint64_t x) { return x && !(x & (x - 1)); }

/* Parse kv pairs: first pass validates and counts strings of string arrays. */
static enum status parse_kv(struct io_gguf *g, struct cursor *c)
{
    enum status st;
    uint64_t n_strs = 0;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        struct io_gguf_kv *kv = &g->kv[i];
        uint32_t t;
        char key[96];
        if ((st = cur_str(c, &kv->key, "metadata key")))
            return st;
        if (kv->key.len == 0)
            return err_set(c->err, ST_ERR_FORMAT, "metadata pair %llu has an empty key",
                           (unsigned long long)i);
        snprintf(key, sizeof(key), "%.*s", (int)(kv->key.len > 80 ? 80 : kv->key.len),
                 kv->key.ptr);
        if ((st = cur_u32(c, &t, "metadata value type")))
            return st;
        if (t >= IO_GGUF_VTYPE_COUNT)
            return err_set(c->err, ST_ERR_FORMAT, "key '%s': invalid value type %u", key, t);
        kv->type = (enum io_gguf_vtype)t;
        if (t == IO_GGUF_ARRAY) {
            uint32_t et;
            size_t at = c->pos;
            if ((st = cur_u32(c, &et, "array type")) || (st = cur_u64(c, &kv->arr_n, "array length")))
                return st;
            kv->arr_type = (enum io_gguf_vtype)et;
            kv->val = c->base + c->pos;
            c->pos = at;
            if ((st = skip_value(c, t, 0, key)))
                return st;
            if (et == IO_GGUF_STRING)
                n_strs += kv->arr_n;
        } else {
            kv->val = c->base + c->pos;
            if ((st = skip_value(c, t, 0, key)))
                return st;
        }
    }
    if (n_strs) {
        g->str_pool = calloc((size_t)n_strs, sizeof(*g->str_pool));
        if (!g->str_pool)
            return err_set(c->err, ST_ERR_NOMEM, "no memory for %llu metadata strings",
                           (unsigned long long)n_strs);
    }
    /* second pass: record every string of string arrays (already validated); an empty one
     * keeps strs NULL (with no strings at all there is no pool to point into) */
    uint64_t used = 0;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        struct io_gguf_kv *kv = &g->kv[i];
        if (kv->type != IO_GGUF_ARRAY || kv->arr_type != IO_GGUF_STRING || !kv->arr_n)
            continue;
        struct cursor s = {g->base, g->size, (size_t)(kv->val - g->base), c->err};
        kv->strs = g->str_pool + used;
        for (uint64_t j = 0; j < kv->arr_n; j++)
            if ((st = cur_str(&s, &g->str_pool[used++], "string element")))
                return st; /* cannot happen: validated above */
    }
    return ST_OK;
}

static enum status parse_tensors(struct io_gguf *g, struct cursor *c)
{
    enum status st;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct io_gguf_tensor *t = &g->tensors[i];
        struct io_gguf_str name;
        if ((st = cur_str(c, &name, "tensor name")))
            return st;
        if (name.len == 0 || name.len >= sizeof(t->name))
            return err_set(c->err, ST_ERR_FORMAT, "tensor %llu: name length %llu not in 1..%zu",
                           (unsigned long long)i, (unsigned long long)name.len,
                           sizeof(t->name) - 1);
        memcpy(t->name, name.ptr, (size_t)name.len);
        t->name[name.len] = 0;
        if (strlen(t->name) != name.len)
            return err_set(c->err, ST_ERR_FORMAT, "tensor %llu: name contains a NUL byte",
                           (unsigned long long)i);
        if ((st = cur_u32(c, &t->n_dims, "tensor n_dims")))
            return st;
        if (t->n_dims < 1 || t->n_dims > IO_GGUF_MAX_DIMS)
            return err_set(c->err, ST_ERR_FORMAT, "tensor '%s': %u dimensions (1..%d allowed)",
                           t->name, t->n_dims, IO_GGUF_MAX_DIMS);
        uint64_t nel = 1;
        for (int d = 0; d < IO_GGUF_MAX_DIMS; d++) {
            uint64_t v = 1;
            if ((uint32_t)d < t->n_dims && (st = cur_u64(c, &v, "tensor dimension")))
                return st;
            if (v == 0 || v > (uint64_t)INT64_MAX || (nel && v > (uint64_t)INT64_MAX / nel))
                return err_set(c->err, ST_ERR_FORMAT,
                               "tensor '%s': dimension %d = %llu is zero or overflows", t->name,
                               d, (unsigned long long)v);
            t->ne[d] = (int64_t)v;
            nel *= v;
        }
        if ((st = cur_u32(c, &t->type, "tensor type")) || (st = cur_u64(c, &t->offset, "tensor offset")))
            return st;
        const struct dtype_info *di = dtype_get(t->type);
        if (!di)
            return err_set(c->err, ST_ERR_UNSUPPORTED, "tensor '%s': unsupported tensor type %u",
                           t->name, t->type);
        if (t->ne[0] % di->block_elems)
            return err_set(c->err, ST_ERR_FORMAT,
                           "tensor '%s': row length %lld is not a multiple of the %s block (%d)",
                           t->name, (long long)t->ne[0], di->name, di->block_elems);
        uint64_t blocks = nel / (uint64_t)di->block_elems;
        if (blocks > UINT64_MAX / (uint64_t)di->block_bytes)
            return err_set(c->err, ST_ERR_FORMAT, "tensor '%s': byte size overflows", t->name);
        t->nbytes = blocks * (uint64_t)di->block_bytes;
        if (t->offset % g->alignment)
            return err_set(c->err, ST_ERR_FORMAT, "tensor '%s': offset %llu not aligned to %u",
                           t->name, (unsigned long long)t->offset, g->alignment);
    }
    return ST_OK;
}

static int cmp_kv_key(const void *a, const void *b)
{
    const struct io_gguf_kv *x = *(const struct io_gguf_kv *const *)a;
    const struct io_gguf_kv *y = *(const struct io_gguf_kv *const *)b;
    size_t n = x->key.len < y->key.len ? (size_t)x->key.len : (size_t)y->key.len;
    int r = memcmp(x->key.ptr, y->key.ptr, n);
    return r ? r : (x->key.len > y->key.len) - (x->key.len < y->key.len);
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const struct io_gguf_tensor *const *)a)->name,
                  (*(const struct io_gguf_tensor *const *)b)->name);
}

/* Reject duplicate keys and tensor names (O(n log n), so hostile counts stay cheap). */
static enum status check_duplicates(struct io_gguf *g, struct err_detail *err)
{
    uint64_t n = g->n_kv > g->n_tensors ? g->n_kv : g->n_tensors;
    const void **v = malloc((size_t)(n + 1) * sizeof(*v));
    enum status st = ST_OK;
    if (!v)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    for (uint64_t i = 0; i < g->n_kv; i++)
        v[i] = &g->kv[i];
    qsort(v, (size_t)g->n_kv, sizeof(*v), cmp_kv_key);
    for (uint64_t i = 1; i < g->n_kv && !st; i++)
        if (!cmp_kv_key(&v[i - 1], &v[i])) {
            const struct io_gguf_kv *kv = v[i];
            st = err_set(err, ST_ERR_FORMAT, "duplicate metadata key '%.*s'",
                         (int)(kv->key.len > 80 ? 80 : kv->key.len), kv->key.ptr);
        }
    for (uint64_t i = 0; i < g->n_tensors && !st; i++)
        v[i] = &g->tensors[i];
    if (!st)
        qsort(v, (size_t)g->n_tensors, sizeof(*v), cmp_tensor_name);
    for (uint64_t i = 1; i < g->n_tensors && !st; i++)
        if (!cmp_tensor_name(&v[i - 1], &v[i]))
            st = err_set(err, ST_ERR_FORMAT, "duplicate tensor name '%s'",
                         ((const struct io_gguf_tensor *)v[i])->name);
    free(v);
    return st;
}

static enum status gguf_parse(struct io_gguf *g, struct err_detail *err)
{
    struct cursor c = {g->base, g->size, 0, err};
    enum status st;
    uint32_t magic;
    if ((st = cur_u32(&c, &magic, "magic")))
        return st;
    if (memcmp(&magic, "GGUF", 4))
        return err_set(err, ST_ERR_FORMAT, "not a GGUF file (bad magic)");
    if ((st = cur_u32(&c, &g->version, "version")))
        return st;
    if (g->version != 2 && g->version != 3)
        return err_set(err, ST_ERR_UNSUPPORTED, "GGUF version %u (only 2 and 3 are supported)",
                       g->version);
    if ((st = cur_u64(&c, &g->n_tensors, "tensor count")) ||
        (st = cur_u64(&c, &g->n_kv, "metadata count")))
        return st;
    /* every kv takes >= 12 bytes and every tensor info >= 28: reject impossible counts
     * before allocating anything */
    if (g->n_kv > (g->size - c.pos) / 12)
        return err_set(err, ST_ERR_FORMAT, "metadata count %llu cannot fit in the file",
                       (unsigned long long)g->n_kv);
    if (g->n_tensors > (g->size - c.pos) / 28)
        return err_set(err, ST_ERR_FORMAT, "tensor count %llu cannot fit in the file",
                       (unsigned long long)g->n_tensors);
    g->kv = calloc((size_t)g->n_kv + 1, sizeof(*g->kv));
    g->tensors = calloc((size_t)g->n_tensors + 1, sizeof(*g->tensors));
    if (!g->kv || !g->tensors)
        return err_set(err, ST_ERR_NOMEM, "no memory for the GGUF tables");
    if ((st = parse_kv(g, &c)))
        return st;

    g->alignment = 32;
    const struct io_gguf_kv *al = io_gguf_find_kv(g, "general.alignment");
    if (al) {
        uint32_t a;
        if (al->type != IO_GGUF_UINT32)
            return err_set(err, ST_ERR_FORMAT, "general.alignment has type %s, want uint32",
                           io_gguf_vtype_name(al->type));
        memcpy(&a, al->val, 4);
        if (!is_pow2(a) || a > (1u << 20))
            return err_set(err, ST_ERR_FORMAT, "general.alignment %u is not a power of two <= 1M",
                           a);
        g->alignment = a;
    }
    if ((st = parse_tensors(g, &c)) || (st = check_duplicates(g, err)))
        return st;

    size_t data_start = c.pos + (g->alignment - c.pos % g->alignment) % g->alignment;
    if (g->n_tensors && data_start > g->size)
        return err_set(err, ST_ERR_FORMAT, "truncated file: data section starts past the end");
    size_t data_size = g->n_tensors ? g->size - data_start : 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct io_gguf_tensor *t = &g->tensors[i];
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return err_set(err, ST_ERR_FORMAT,
                           "truncated file: tensor '%s' (%llu bytes at data offset %llu) "
                           "extends past the end (data section %zu bytes)",
                           t->name, (unsigned long long)t->nbytes,
                           (unsigned long long)t->offset, data_size);
        t->data = g->base + data_start + t->offset;
    }
    return ST_OK;
}

enum status io_gguf_open_mem(struct io_gguf **out, const void *buf, size_t len,
                             struct err_detail *err)
{
    *out = NULL;
    struct io_gguf *g = calloc(1, sizeof(*g));
    if (!g)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    g->base = buf;
    g->size = len;
    enum status st = gguf_parse(g, err);
    if (st) {
        io_gguf_close(g);
        return st;
    }
    *out = g;
    return ST_OK;
}

enum status io_gguf_open(struct io_gguf **out, const char *path, struct err_detail *err)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return err_set(err, ST_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return err_set(err, ST_ERR_IO, "%s is not a regular file", path);
    }
    if (sb.st_size == 0) {
        close(fd);
        return err_set(err, ST_ERR_FORMAT, "%s is empty", path);
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return err_set(err, ST_ERR_IO, "cannot map %s: %s", path, strerror(errno));
    struct io_gguf *g;
    enum status st = io_gguf_open_mem(&g, map, (size_t)sb.st_size, err);
    if (st) {
        munmap(map, (size_t)sb.st_size);
        err_prefix(err, "%s", path);
        return st;
    }
    g->mapped = 1;
    *out = g;
    return ST_OK;
}

void io_gguf_close(struct io_gguf *g)
{
    if (!g)
        return;
    if (g->mapped)
        munmap((void *)g->base, g->size);
    free(g->kv);
    free(g->tensors);
    free(g->str_pool);
    free(g);
}

int io_gguf_str_eq(struct io_gguf_str s, const char *c)
{
    size_t n = strlen(c);
    return s.len == n && !memcmp(s.ptr, c, n);
}

const struct io_gguf_kv *io_gguf_find_kv(const struct io_gguf *g, const char *key)
{
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (io_gguf_str_eq(g->kv[i].key, key))
            return &g->kv[i];
    return NULL;
}

const struct io_gguf_tensor *io_gguf_find_tensor(const struct io_gguf *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (!strcmp(g->tensors[i].name, name))
            return &g->tensors[i];
    return NULL;
}

static enum status find_typed(const struct io_gguf *g, const char *key,
                              const struct io_gguf_kv **kv, struct err_detail *err)
{
    *kv = io_gguf_find_kv(g, key);
    if (!*kv)
        return err_set(err, ST_ERR_NOT_FOUND, "metadata key '%s' is missing", key);
    return ST_OK;
}

static enum status wrong_type(const struct io_gguf_kv *kv, const char *key, const char *want,
                              struct err_detail *err)
{
    return err_set(err, ST_ERR_FORMAT, "metadata key '%s' has type %s, want %s", key,
                   io_gguf_vtype_name(kv->type), want);
}

/* Read any integer type as int64 (uint64 above INT64_MAX fails). */
static int kv_int(const struct io_gguf_kv *kv, int64_t *v)
{
    const uint8_t *p = kv->val;
    switch (kv->type) {
    case IO_GGUF_UINT8: *v = p[0]; return 1;
    case IO_GGUF_INT8: *v = (int8_t)p[0]; return 1;
    case IO_GGUF_UINT16: { uint16_t x; memcpy(&x, p, 2); *v = x; return 1; }
    case IO_GGUF_INT16: { int16_t x; memcpy(&x, p, 2); *v = x; return 1; }
    case IO_GGUF_UINT32: { uint32_t x; memcpy(&x, p, 4); *v = x; return 1; }
    case IO_GGUF_INT32: { int32_t x; memcpy(&x, p, 4); *v = x; return 1; }
    case IO_GGUF_INT64: { int64_t x; memcpy(&x, p, 8); *v = x; return 1; }
    case IO_GGUF_UINT64: {
        uint64_t x;
        memcpy(&x, p, 8);
        if (x > (uint64_t)INT64_MAX)
            return 0;
        *v = (int64_t)x;
        return 1;
    }
    default: return 0;
    }
}

enum status io_gguf_get_u32(const struct io_gguf *g, const char *key, uint32_t *out,
                            struct err_detail *err)
{
    const struct io_gguf_kv *kv;
    int64_t v;
    enum status st = find_typed(g, key, &kv, err);
    if (st)
        return st;
    if (!kv_int(kv, &v))
        return wrong_type(kv, key, "an integer", err);
    if (v < 0 || v > (int64_t)UINT32_MAX)
        return err_set(err, ST_ERR_FORMAT, "metadata key '%s' = %lld does not fit uint32", key,
                       (long long)v);
    *out = (uint32_t)v;
    return ST_OK;
}

enum status io_gguf_get_f32(const struct io_gguf *g, const char *key, float *out,
                            struct err_detail *err)
{
    const struct io_gguf_kv *kv;
    enum status st = find_typed(g, key, &kv, err);
    if (st)
        return st;
    if (kv->type == IO_GGUF_FLOAT32) {
        memcpy(out, kv->val, 4);
    } else if (kv->type == IO_GGUF_FLOAT64) {
        double d;
        memcpy(&d, kv->val, 8);
        *out = (float)d;
    } else {
        return wrong_type(kv, key, "float32", err);
    }
    return ST_OK;
}

enum status io_gguf_get_bool(const struct io_gguf *g, const char *key, int *out,
                             struct err_detail *err)
{
    const struct io_gguf_kv *kv;
    enum status st = find_typed(g, key, &kv, err);
    if (st)
        return st;
    if (kv->type != IO_GGUF_BOOL)
        return wrong_type(kv, key, "bool", err);
    *out = kv->val[0] != 0;
    return ST_OK;
}

enum status io_gguf_get_str(const struct io_gguf *g, const char *key, struct io_gguf_str *out,
                            struct err_detail *err)
{
    const struct io_gguf_kv *kv;
    enum status st = find_typed(g, key, &kv, err);
    if (st)
        return st;
    if (kv->type != IO_GGUF_STRING)
        return wrong_type(kv, key, "string", err);
    uint64_t len;
    memcpy(&len, kv->val, 8);
    out->len = len;
    out->ptr = (const char *)kv->val + 8;
    return ST_OK;
}

enum status io_gguf_get_arr(const struct io_gguf *g, const char *key, enum io_gguf_vtype elem,
                            const void **data, uint64_t *n, struct err_detail *err)
{
    const struct io_gguf_kv *kv;
    enum status st = find_typed(g, key, &kv, err);
    if (st)
        return st;
    if (kv->type != IO_GGUF_ARRAY || kv->arr_type != elem || !vtype_size(elem)) {
        char want[32];
        snprintf(want, sizeof(want), "array of %s", io_gguf_vtype_name(elem));
        return wrong_type(kv, key, want, err);
    }
    *data = kv->val;
    *n = kv->arr_n;
    return ST_OK;
}

enum status io_gguf_get_str_arr(const struct io_gguf *g, const char *key,
                                const struct io_gguf_str **strs, uint64_t *n,
                                struct err_detail *err)
{
    const struct io_gguf_kv *kv;
    enum status st = find_typed(g, key, &kv, err);
    if (st)
        return st;
    if (kv->type != IO_GGUF_ARRAY || kv->arr_type != IO_GGUF_STRING)
        return wrong_type(kv, key, "array of string", err);
    *strs = kv->strs;
    *n = kv->arr_n;
    return ST_OK;
}
