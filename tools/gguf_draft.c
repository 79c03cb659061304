/* Make a draft model for `--spec model` out of a model, where no smaller model of its family
 * (same vocabulary) is at hand: `make build/tools/gguf_draft && build/tools/gguf_draft IN.gguf
 * OUT.gguf FIRST LAST [q4_0]` drops blocks FIRST..LAST (inclusive, 0-based; LAST = FIRST - 1
 * drops none), renumbers those after them and writes the block count; with q4_0, each block's
 * 2-D weights are requantized to Q4_0 (from their dequantized values: scale = the block's
 * largest-magnitude value / -8, each nibble rounded to nearest), a coarser copy of the same model.
 * Every other tensor and metadata pair is copied as it is. A layer-skipping draft predicts the
 * model's tokens worse than a trained small model would (and for a model whose layers alternate
 * by index, as Gemma 3's sliding-window and global layers do, the blocks after the dropped ones
 * change kind unless a multiple of the pattern is dropped); a Q4_0 copy of a 4-bit model is a
 * coarser copy of it, not a close one (docs/BENCHMARKS.md, 2026-12-07). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "io/gguf.h"
#include "io/gguf_write.h"
#include "kernels/cpu/cpu_kernels.h"

/* rows rows of ne0 weights (a multiple of KERN_QK) of type `type` at src, requantized to Q4_0
 * blocks at dst; x holds ne0 floats. */
static void to_q4_0(uint32_t type, const void *src, struct kern_block_q4_0 *dst, int64_t ne0,
                    int64_t rows, float *x)
{
    const size_t row = dtype_row_bytes(type, ne0);
    for (int64_t r = 0; r < rows; r++) {
        kern_ref_dequant_row(type, (const uint8_t *)src + (size_t)r * row, x, ne0);
        for (int64_t b = 0; b < ne0 / KERN_QK; b++, dst++) {
            const float *v = x + b * KERN_QK;
            float big = 0;
            for (int i = 0; i < KERN_QK; i++)
                big = fabsf(v[i]) > fabsf(big) ? v[i] : big;
            const float d = big / -8.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
            dst->d = kern_f32_to_f16(d);
            for (int i = 0; i < 16; i++) {
                int lo = (int)lrintf(v[i] * inv) + 8, hi = (int)lrintf(v[i + 16] * inv) + 8;
                lo = lo < 0 ? 0 : lo > 15 ? 15 : lo;
                hi = hi < 0 ? 0 : hi > 15 ? 15 : hi;
                dst->qs[i] = (uint8_t)(lo | hi << 4);
            }
        }
    }
}

/* Block index of a tensor named "blk.N.rest" (rest in *rest), or -1 for any other name. */
static long block_of(const char *name, const char **rest)
{
    if (strncmp(name, "blk.", 4))
        return -1;
    char *end;
    long b = strtol(name + 4, &end, 10);
    if (end == name + 4 || *end != '.')
        return -1;
    *rest = end + 1;
    return b;
}

static int fail(const struct err_detail *err)
{
    fprintf(stderr, "gguf_draft: %s\n", err->msg);
    return 1;
}

int main(int argc, char **argv)
{
    if ((argc != 5 && argc != 6) || (argc == 6 && strcmp(argv[5], "q4_0"))) {
        fprintf(stderr, "usage: gguf_draft IN.gguf OUT.gguf FIRST LAST [q4_0]  (drops blocks "
                        "FIRST..LAST; q4_0: requantizes the blocks' weights)\n");
        return 2;
    }
    const long first = atol(argv[3]), last = atol(argv[4]), drop = last - first + 1;
    const int requant = argc == 6;
    struct err_detail err = {0};
    struct io_gguf *in, *out;
    struct io_gguf_writer *w;
    struct io_gguf_str arch;
    uint32_t n_block;
    char key[192];
    if (io_gguf_open(&in, argv[1], &err) ||
        io_gguf_get_str(in, "general.architecture", &arch, &err))
        return fail(&err);
    snprintf(key, sizeof(key), "%.*s.block_count", (int)arch.len, arch.ptr);
    if (io_gguf_get_u32(in, key, &n_block, &err))
        return fail(&err);
    if (first < 0 || last < first - 1 || last >= (long)n_block || drop >= (long)n_block) {
        fprintf(stderr, "gguf_draft: blocks %ld..%ld: the model has %u (keep at least one)\n",
                first, last, n_block);
        return 2;
    }
    if (io_gguf_writer_init(&w, &err))
        return fail(&err);
    for (uint64_t i = 0; i < in->n_kv; i++) {
        const struct io_gguf_kv *kv = &in->kv[i];
        const int is_count = kv->key.len == strlen(key) && !memcmp(kv->key.ptr, key, kv->key.len);
        enum status st = is_count ? io_gguf_writer_u32(w, key, n_block - (uint32_t)drop, &err)
                                  : io_gguf_writer_copy(w, kv, &err);
        if (st)
            return fail(&err);
    }
    /* the kept tensors, in the input's order, under their new names */
    char(*names)[128] = calloc(in->n_tensors, sizeof(*names));
    const struct io_gguf_tensor **src = calloc(in->n_tensors, sizeof(*src));
    uint8_t *q = calloc(in->n_tensors, 1); /* requantized */
    size_t n = 0;
    for (uint64_t i = 0; names && src && q && i < in->n_tensors; i++) {
        const struct io_gguf_tensor *t = &in->tensors[i];
        const char *rest = "";
        long b = block_of(t->name, &rest);
        if (b >= first && b <= last)
            continue;
        if (b > last)
            snprintf(names[n], sizeof(names[n]), "blk.%ld.%s", b - drop, rest);
        else
            snprintf(names[n], sizeof(names[n]), "%s", t->name);
        src[n] = t;
        q[n] = requant && b >= 0 && t->n_dims == 2 && t->ne[0] % KERN_QK == 0 &&
               t->type != DTYPE_Q4_0 && dtype_row_bytes(t->type, t->ne[0]) > 0;
        if (io_gguf_writer_tensor(w, names[n], q[n] ? DTYPE_Q4_0 : t->type, (int)t->n_dims, t->ne,
                                  &err))
            return fail(&err);
        n++;
    }
    if (!names || !src || !q) {
        fprintf(stderr, "gguf_draft: out of memory\n");
        return 1;
    }
    if (io_gguf_writer_open(w, &out, &err))
        return fail(&err);
    io_gguf_writer_free(w);
    for (size_t i = 0; i < n; i++) {
        const struct io_gguf_tensor *t = io_gguf_find_tensor(out, names[i]);
        if (!t || (!q[i] && t->nbytes != src[i]->nbytes)) {
            fprintf(stderr, "gguf_draft: tensor %s was not laid out as in the input\n", names[i]);
            return 1;
        }
        float *x = q[i] ? malloc(sizeof(float) * (size_t)t->ne[0]) : NULL;
        if (q[i] && !x) {
            fprintf(stderr, "gguf_draft: out of memory\n");
            return 1;
        }
        if (q[i])
            to_q4_0(src[i]->type, src[i]->data, (void *)t->data, t->ne[0], t->ne[1], x);
        else
            memcpy((void *)t->data, src[i]->data, t->nbytes);
        free(x);
    }
    if (io_gguf_save(out, argv[2], &err))
        return fail(&err);
    printf("%s: %u of %u blocks (dropped %ld..%ld)%s, %zu tensors, %zu bytes\n", argv[2],
           n_block - (uint32_t)drop, n_block, first, last, requant ? ", weights in Q4_0" : "", n,
           out->size);
    free(q);
    free(names);
    free(src);
    io_gguf_close(out);
    io_gguf_close(in);
    return 0;
}
