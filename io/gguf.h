/* GGUF reader: maps a model file read-only and exposes its metadata and tensors.
 * Every length, count, dimension, type and offset is validated against the file size with
 * overflow-safe arithmetic when the file is opened, so accessors never read out of bounds. */
#ifndef IO_GGUF_H
#define IO_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

enum io_gguf_vtype {
    IO_GGUF_UINT8 = 0,
    IO_GGUF_INT8 = 1,
    IO_GGUF_UINT16 = 2,
    IO_GGUF_INT16 = 3,
    IO_GGUF_UINT32 = 4,
    IO_GGUF_INT32 = 5,
    IO_GGUF_FLOAT32 = 6,
    IO_GGUF_BOOL = 7,
    IO_GGUF_STRING = 8,
    IO_GGUF_ARRAY = 9,
    IO_GGUF_UINT64 = 10,
    IO_GGUF_INT64 = 11,
    IO_GGUF_FLOAT64 = 12,
    IO_GGUF_VTYPE_COUNT,
};

/* A string inside the mapping: NOT NUL-terminated; valid until io_gguf_close. */
struct io_gguf_str {
    const char *ptr; /* first byte */
    uint64_t len;    /* length in bytes */
};

#define IO_GGUF_MAX_DIMS 4

struct io_gguf_kv {
    struct io_gguf_str key;        /* metadata key, e.g. "llama.block_count" */
    enum io_gguf_vtype type;       /* value type; IO_GGUF_ARRAY for arrays */
    enum io_gguf_vtype arr_type;   /* element type when type == IO_GGUF_ARRAY */
    uint64_t arr_n;                /* element count when type == IO_GGUF_ARRAY */
    const uint8_t *val;            /* raw little-endian value (for arrays: first element) */
    const struct io_gguf_str *strs; /* arr_n strings when arr_type == STRING (reader-owned);
                                     * NULL when there are none */
};

struct io_gguf_tensor {
    char name[128];                /* NUL-terminated copy of the tensor name */
    uint32_t n_dims;               /* 1..IO_GGUF_MAX_DIMS */
    int64_t ne[IO_GGUF_MAX_DIMS];  /* elements per dimension, ne[0] innermost; unused = 1 */
    uint32_t type;                 /* enum dtype (common/dtype.h) */
    uint64_t offset;               /* offset from the start of the data section */
    uint64_t nbytes;               /* size of the data in bytes */
    const void *data;              /* points into the mapping */
};

struct io_gguf {
    uint32_t version;              /* 2 or 3 */
    uint64_t n_kv;                 /* number of metadata pairs */
    struct io_gguf_kv *kv;         /* n_kv pairs (reader-owned) */
    uint64_t n_tensors;            /* number of tensors */
    struct io_gguf_tensor *tensors; /* n_tensors infos (reader-owned) */
    uint32_t alignment;            /* general.alignment or 32 */
    const uint8_t *base;           /* start of the mapping or buffer */
    size_t size;                   /* its size in bytes */
    int mapped;                    /* 1 when base came from mmap and must be unmapped */
    struct io_gguf_str *str_pool;  /* storage behind every kv->strs (reader-owned) */
};

/* Map and validate the file at path. On success *out owns the mapping; free with
 * io_gguf_close. On failure err names the problem (offset, field) and *out is NULL. */
enum status io_gguf_open(struct io_gguf **out, const char *path, struct err_detail *err);

/* Same over a caller-owned buffer that must outlive the reader (used by fuzz tests). */
enum status io_gguf_open_mem(struct io_gguf **out, const void *buf, size_t len,
                             struct err_detail *err);

/* Unmap and free; NULL is a no-op. */
void io_gguf_close(struct io_gguf *g);

/* Lookups return NULL when absent. */
const struct io_gguf_kv *io_gguf_find_kv(const struct io_gguf *g, const char *key);
const struct io_gguf_tensor *io_gguf_find_tensor(const struct io_gguf *g, const char *name);

/* Typed getters: ST_ERR_NOT_FOUND when the key is absent, ST_ERR_FORMAT when it has another
 * type. Integer getters accept any integer type whose value fits. */
enum status io_gguf_get_u32(const struct io_gguf *g, const char *key, uint32_t *out,
                            struct err_detail *err);
enum status io_gguf_get_f32(const struct io_gguf *g, const char *key, float *out,
                            struct err_detail *err);
enum status io_gguf_get_bool(const struct io_gguf *g, const char *key, int *out,
                             struct err_detail *err);
enum status io_gguf_get_str(const struct io_gguf *g, const char *key, struct io_gguf_str *out,
                            struct err_detail *err);
/* An array of the given element type; *n elements at *data (raw little-endian). */
enum status io_gguf_get_arr(const struct io_gguf *g, const char *key, enum io_gguf_vtype elem,
                            const void **data, uint64_t *n, struct err_detail *err);
/* A string array; *strs points at reader-owned storage (NULL when *n is 0). */
enum status io_gguf_get_str_arr(const struct io_gguf *g, const char *key,
                                const struct io_gguf_str **strs, uint64_t *n,
                                struct err_detail *err);

/* Name of a value type ("uint32", "array", ...). */
const char *io_gguf_vtype_name(enum io_gguf_vtype t);

/* 1 when s equals the NUL-terminated c string. */
int io_gguf_str_eq(struct io_gguf_str s, const char *c);

#endif
