/* What the CUDA backend holds in device memory, as plain functions of the model's shapes and
 * the batch limits: the one source for the backend's own allocations (backend_cuda.c) and for
 * `quern plan --device cuda`, which needs no GPU. */
#ifndef KERNELS_CUDA_CUDA_SIZES_H
#define KERNELS_CUDA_CUDA_SIZES_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_pack.h"

/* Split attention's partials, in floats (QUERN_CUDA_ATTN_PART's default): 64 MiB. */
#define KCU_ATTN_PART_FLOATS ((size_t)16 << 20)

/* A weight's device copy: the packed layout for the types cuda_pack.h repacks (pack set,
 * QUERN_CUDA_PACK's default), else its GGUF rows. */
static inline size_t kcu_weight_device_bytes(uint32_t type, int64_t ne0, int64_t ne1,
                                             size_t row_bytes, int pack)
{
    return pack && kcu_p4_type(type) ? kcu_p4_bytes(type, ne0, ne1) : (size_t)ne1 * row_bytes;
}

/* The device sampler's scratch for n rows of n_vocab (kcu_sample's operands in one buffer,
 * each 64-byte aligned): the work copy of the logits, the chunk sums, the rows' parameters,
 * n_pen penalty pairs, n_masks grammar masks and the outputs. */
struct kcu_sample_layout {
    size_t zc, mc, rows, pen, mask, out; /* byte offsets (the work copy at 0) */
    size_t bytes;                        /* the whole */
};

static inline size_t kcu_align64(size_t at, size_t bytes)
{
    return (at + bytes + 63) & ~(size_t)63;
}

static inline struct kcu_sample_layout kcu_sample_layout(int n, int n_vocab, int n_pen, int n_masks)
{
    const size_t nc = ((size_t)n_vocab + 255) / 256;
    struct kcu_sample_layout l;
    l.zc = kcu_align64(0, sizeof(float) * (size_t)n * (size_t)n_vocab);
    l.mc = kcu_align64(l.zc, sizeof(double) * (size_t)n * nc);
    l.rows = kcu_align64(l.mc, sizeof(float) * (size_t)n * nc);
    l.pen = kcu_align64(l.rows, sizeof(struct kcu_sample) * (size_t)n);
    l.mask = kcu_align64(l.pen, sizeof(int32_t) * 2 * (size_t)(n_pen > 0 ? n_pen : 1));
    l.out = kcu_align64(l.mask, sizeof(uint32_t) * (((size_t)n_vocab + 31) / 32) * (size_t)n_masks);
    l.bytes = kcu_align64(l.out, sizeof(struct kcu_sample_out) * (size_t)n);
    return l;
}

/* The q8 mode's matmul inputs for n floats: the quantized bytes, then from this offset (16-byte
 * aligned) a scale and a sum per block of 32 (kcu_quant_q8); kcu_q8_bytes in all. */
static inline size_t kcu_q8_scales_at(size_t n)
{
    return (n + 15) / 16 * 16;
}

static inline size_t kcu_q8_bytes(size_t n)
{
    return kcu_q8_scales_at(n) + n / 32 * 2 * sizeof(float);
}

/* The scratch `reserve` makes for batches of max_tok tokens of rows up to max_width floats
 * (the greedy keys; the matmul inputs rounded to bf16 (inputs 1: the bf16 mode) or quantized
 * (2: q8); split attention's partials), plus the sampler's for sample_rows rows of n_vocab
 * (grammar masks on every row), which it makes at the first sampled step. cuBLAS's weight copy
 * (off by default) is not counted. */
static inline size_t kcu_scratch_bytes(int inputs, int max_tok, int64_t max_width, int sample_rows,
                                       int n_vocab)
{
    size_t b = sizeof(unsigned long long) * (size_t)max_tok + sizeof(float) * KCU_ATTN_PART_FLOATS;
    if (inputs == 1)
        b += sizeof(uint16_t) * (size_t)max_tok * (size_t)max_width;
    if (inputs == 2)
        b += kcu_q8_bytes((size_t)max_tok * (size_t)max_width);
    return b + kcu_sample_layout(sample_rows, n_vocab, 0, sample_rows).bytes;
}

#endif
