/* GGUF writer: lays out a version-3 GGUF (metadata, tensor table, aligned data) in an anonymous
 * mapping and opens it with the reader, for models made in memory (engine/dummy.c: random weights
 * at a preset's real sizes) and for writing such a model to a file. Tensor data starts as zero
 * pages that cost no memory until written. */
#ifndef IO_GGUF_WRITE_H
#define IO_GGUF_WRITE_H

#include <stdint.h>

#include "common/err.h"
#include "io/gguf.h"

struct io_gguf_writer; /* opaque */

enum status io_gguf_writer_init(struct io_gguf_writer **out, struct err_detail *err);
void io_gguf_writer_free(struct io_gguf_writer *w); /* NULL: nothing */

/* Metadata, in the order added (keys are not checked for duplicates). */
enum status io_gguf_writer_u32(struct io_gguf_writer *w, const char *key, uint32_t v,
                               struct err_detail *err);
enum status io_gguf_writer_f32(struct io_gguf_writer *w, const char *key, float v,
                               struct err_detail *err);
enum status io_gguf_writer_str(struct io_gguf_writer *w, const char *key, const char *v,
                               struct err_detail *err);
/* A pair of another file copied verbatim, whatever its type (arrays of arrays excepted). */
enum status io_gguf_writer_copy(struct io_gguf_writer *w, const struct io_gguf_kv *kv,
                                struct err_detail *err);
/* A tensor of n_dims dimensions ne[0] (innermost) .. of GGUF type `type` (enum dtype). */
enum status io_gguf_writer_tensor(struct io_gguf_writer *w, const char *name, uint32_t type,
                                  int n_dims, const int64_t *ne, struct err_detail *err);

/* The file in a private anonymous mapping, opened: *out owns the mapping (io_gguf_close unmaps
 * it). The mapping is writable: the caller fills tensor data through (void *)t->data before it
 * reads them. The writer may be freed afterwards. */
enum status io_gguf_writer_open(struct io_gguf_writer *w, struct io_gguf **out,
                                struct err_detail *err);

/* g's bytes (a whole GGUF, as io_gguf_writer_open made it) to a new file at path: written to
 * path.tmp (O_EXCL), fsynced, renamed. */
enum status io_gguf_save(const struct io_gguf *g, const char *path, struct err_detail *err);

#endif
