/* GGUF writer: the header (metadata and tensor table) grows in a heap buffer; open lays header
 * and zeroed, aligned tensor data out in one anonymous mapping and parses it back with the
 * reader, so whatever is made here is checked by the same code that checks files. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/dtype.h"
#include "io/gguf.h"
#include "io/gguf_write.h"

#define ALIGN 32 /* GGUF's default general.alignment */

struct io_gguf_writer {
    uint8_t *kv;       /* metadata pairs, encoded */
    size_t kv_len;     /* bytes used */
    size_t kv_cap;     /* bytes allocated */
    uint64_t n_kv;     /* pairs */
    uint8_t *ti;       /* tensor infos, encoded (offsets relative to the data section) */
    size_t ti_len;     /* bytes used */
    size_t ti_cap;     /* bytes allocated */
    uint64_t n_tensor; /* tensors */
    uint64_t data_len; /* data section bytes so far (each tensor aligned) */
};

enum status io_gguf_writer_init(struct io_gguf_writer **out, struct err_detail *err)
{
    *out = calloc(1, sizeof(**out));
    return *out ? ST_OK : err_set(err, ST_ERR_NOMEM, "no memory");
}

void io_gguf_writer_free(struct io_gguf_writer *w)
{
    if (!w)
        return;
    free(w->kv);
    free(w->ti);
    free(w);
}

static enum status put(uint8_t **buf, size_t *len, size_t *cap, const void *p, size_t n,
                       struct err_detail *err)
{
    if (!n) /* an empty string: nothing to copy, and *buf may not exist yet */
        return ST_OK;
    if (*len + n > *cap) {
        size_t c = *cap ? *cap : 4096;
        while (c < *len + n)
            c *= 2;
        uint8_t *nb = realloc(*buf, c);
        if (!nb)
            return err_set(err, ST_ERR_NOMEM, "no memory for a GGUF header of %zu bytes", c);
        *buf = nb;
        *cap = c;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    return ST_OK;
}

static enum status kv_put(struct io_gguf_writer *w, const void *p, size_t n, struct err_detail *err)
{
    return put(&w->kv, &w->kv_len, &w->kv_cap, p, n, err);
}

static enum status kv_u64(struct io_gguf_writer *w, uint64_t v, struct err_detail *err)
{
    return kv_put(w, &v, 8, err);
}

static enum status kv_u32(struct io_gguf_writer *w, uint32_t v, struct err_detail *err)
{
    return kv_put(w, &v, 4, err);
}

static enum status kv_string(struct io_gguf_writer *w, const char *s, uint64_t n,
                             struct err_detail *err)
{
    enum status st = kv_u64(w, n, err);
    return st ? st : kv_put(w, s, (size_t)n, err);
}

/* Key and type of a new pair. */
static enum status kv_head(struct io_gguf_writer *w, const char *key, uint64_t key_len,
                           enum io_gguf_vtype type, struct err_detail *err)
{
    enum status st = kv_string(w, key, key_len, err);
    if (!st)
        st = kv_u32(w, (uint32_t)type, err);
    if (!st)
        w->n_kv++;
    return st;
}

enum status io_gguf_writer_u32(struct io_gguf_writer *w, const char *key, uint32_t v,
                               struct err_detail *err)
{
    enum status st = kv_head(w, key, strlen(key), IO_GGUF_UINT32, err);
    return st ? st : kv_u32(w, v, err);
}

enum status io_gguf_writer_f32(struct io_gguf_writer *w, const char *key, float v,
                               struct err_detail *err)
{
    enum status st = kv_head(w, key, strlen(key), IO_GGUF_FLOAT32, err);
    return st ? st : kv_put(w, &v, 4, err);
}

enum status io_gguf_writer_str(struct io_gguf_writer *w, const char *key, const char *v,
                               struct err_detail *err)
{
    enum status st = kv_head(w, key, strlen(key), IO_GGUF_STRING, err);
    return st ? st : kv_string(w, v, strlen(v), err);
}

/* Bytes of one scalar of type t (strings excepted); 0 for the others. */
static size_t scalar_bytes(enum io_gguf_vtype t)
{
    switch (t) {
    case IO_GGUF_UINT8:
    case IO_GGUF_INT8:
    case IO_GGUF_BOOL:
        return 1;
    case IO_GGUF_UINT16:
    case IO_GGUF_INT16:
        return 2;
    case IO_GGUF_UINT32:
    case IO_GGUF_INT32:
    case IO_GGUF_FLOAT32:
        return 4;
    case IO_GGUF_UINT64:
    case IO_GGUF_INT64:
    case IO_GGUF_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

enum status io_gguf_writer_copy(struct io_gguf_writer *w, const struct io_gguf_kv *kv,
                                struct err_detail *err)
{
    const size_t before = w->kv_len;
    const uint64_t n_before = w->n_kv;
    enum status st = kv_head(w, kv->key.ptr, kv->key.len, kv->type, err);
    if (st)
        return st;
    if (kv->type == IO_GGUF_STRING) {
        uint64_t len;
        memcpy(&len, kv->val, 8);
        st = kv_string(w, (const char *)kv->val + 8, len, err);
    } else if (kv->type != IO_GGUF_ARRAY) {
        st = kv_put(w, kv->val, scalar_bytes(kv->type), err);
    } else if (!(st = kv_u32(w, (uint32_t)kv->arr_type, err)) &&
               !(st = kv_u64(w, kv->arr_n, err))) {
        if (kv->arr_type == IO_GGUF_STRING) {
            for (uint64_t i = 0; i < kv->arr_n && !st; i++)
                st = kv_string(w, kv->strs[i].ptr, kv->strs[i].len, err);
        } else if (scalar_bytes(kv->arr_type)) {
            st = kv_put(w, kv->val, (size_t)kv->arr_n * scalar_bytes(kv->arr_type), err);
        } else {
            st = err_set(err, ST_ERR_UNSUPPORTED, "metadata '%.*s': arrays of arrays are not "
                         "copied", (int)kv->key.len, kv->key.ptr);
        }
    }
    if (st) { /* leave the writer as it was */
        w->kv_len = before;
        w->n_kv = n_before;
    }
    return st;
}

enum status io_gguf_writer_tensor(struct io_gguf_writer *w, const char *name, uint32_t type,
                                  int n_dims, const int64_t *ne, struct err_detail *err)
{
    if (n_dims < 1 || n_dims > IO_GGUF_MAX_DIMS || !dtype_get(type))
        return err_set(err, ST_ERR_INVALID_ARG, "tensor %s: bad shape or type", name);
    int64_t rows = 1;
    for (int i = 1; i < n_dims; i++)
        rows *= ne[i];
    const size_t row = dtype_row_bytes(type, ne[0]);
    if (!row || rows < 1)
        return err_set(err, ST_ERR_INVALID_ARG, "tensor %s: %lld elements per row do not fit %s",
                       name, (long long)ne[0], dtype_get(type)->name);
    const uint64_t bytes = (uint64_t)row * (uint64_t)rows;
    const uint64_t nlen = strlen(name), nd = (uint64_t)n_dims;
    const uint32_t t = type;
    enum status st = put(&w->ti, &w->ti_len, &w->ti_cap, &nlen, 8, err);
    if (!st)
        st = put(&w->ti, &w->ti_len, &w->ti_cap, name, (size_t)nlen, err);
    if (!st)
        st = put(&w->ti, &w->ti_len, &w->ti_cap, &(uint32_t){(uint32_t)nd}, 4, err);
    for (int i = 0; i < n_dims && !st; i++)
        st = put(&w->ti, &w->ti_len, &w->ti_cap, &(uint64_t){(uint64_t)ne[i]}, 8, err);
    if (!st)
        st = put(&w->ti, &w->ti_len, &w->ti_cap, &t, 4, err);
    if (!st)
        st = put(&w->ti, &w->ti_len, &w->ti_cap, &w->data_len, 8, err);
    if (st)
        return st;
    w->n_tensor++;
    w->data_len += (bytes + ALIGN - 1) / ALIGN * ALIGN;
    return ST_OK;
}

enum status io_gguf_writer_open(struct io_gguf_writer *w, struct io_gguf **out,
                                struct err_detail *err)
{
    *out = NULL;
    const size_t head = 4 + 4 + 8 + 8 + w->kv_len + w->ti_len;
    const size_t data_at = (head + ALIGN - 1) / ALIGN * ALIGN;
    const size_t total = data_at + (size_t)w->data_len;
    uint8_t *map = mmap(NULL, total, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED)
        return err_set(err, ST_ERR_NOMEM, "cannot map %zu bytes for a GGUF: %s", total,
                       strerror(errno));
    const uint32_t version = 3;
    memcpy(map, "GGUF", 4);
    memcpy(map + 4, &version, 4);
    memcpy(map + 8, &w->n_tensor, 8);
    memcpy(map + 16, &w->n_kv, 8);
    if (w->kv_len) /* an empty writer has no buffers at all */
        memcpy(map + 24, w->kv, w->kv_len);
    if (w->ti_len)
        memcpy(map + 24 + w->kv_len, w->ti, w->ti_len);
    enum status st = io_gguf_open_mem(out, map, total, err);
    if (st) {
        munmap(map, total);
        return st;
    }
    (*out)->mapped = 1; /* io_gguf_close unmaps it */
    return ST_OK;
}

enum status io_gguf_save(const struct io_gguf *g, const char *path, struct err_detail *err)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return err_set(err, ST_ERR_INVALID_ARG, "path too long: %s", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return err_set(err, ST_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    size_t done = 0;
    while (done < g->size) {
        ssize_t n = write(fd, g->base + done, g->size - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            enum status st = err_set(err, ST_ERR_IO, "writing %s: %s", tmp, strerror(errno));
            close(fd);
            unlink(tmp);
            return st;
        }
        done += (size_t)n;
    }
    int bad = fsync(fd) != 0;
    bad |= close(fd) != 0;
    if (bad || rename(tmp, path)) {
        enum status st = err_set(err, ST_ERR_IO, "finishing %s: %s", path, strerror(errno));
        unlink(tmp);
        return st;
    }
    return ST_OK;
}
