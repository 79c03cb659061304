/* The CUDA kernels' launchers (kernels/cuda/cuda_kernels.cu), in plain C for the backend
 * (kernels/cuda/backend_cuda.c): the CUDA boundary. Every pointer is device memory; every launch
 * goes on `stream` (a cudaStream_t; NULL: the default stream) and returns at once with the
 * launch's status (0 = cudaSuccess, else a cudaError_t), the work itself running later in stream
 * order. The semantics are those of the struct kern_ops op of the same name (kernels/kernels.h). */
#ifndef KERNELS_CUDA_CUDA_LAUNCH_H
#define KERNELS_CUDA_CUDA_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A matmul's input steps, in order: x += add (when add); then xn = rmsnorm(x) * norm (when norm)
 * or x = act(x) * up (when up; act: silu, or the tanh GELU with glu 1). n_tok rows of n floats. */
int kcu_mm_prep(void *stream, float *x, const float *add, const float *norm, float eps,
                const float *up, int glu, float *xn, int n_tok, int n);
int kcu_norm_rows(void *stream, float *x, const float *w, long n_rows, int width, float eps);
/* A weight in device memory as the matmul kernels read it. */
struct kcu_weight {
    uint32_t type;    /* GGUF type (cuda_dequant.h) */
    const void *w;    /* the GGUF rows (row_bytes apart), or the packed planes (cuda_pack.h) */
    size_t row_bytes; /* bytes of a GGUF row */
    int64_t ne0, ne1; /* elements per row (a multiple of 32), rows */
    size_t p4_scales; /* 0: GGUF rows; else w is in the packed layout of cuda_pack.h and
                       * its scale plane starts at this byte offset */
};

/* How a matmul runs: f32 (bf16 0: exact mode, f32 products of the dequantized weights) or the
 * bf16 mode (bf16 1: activations and dequantized weights rounded to bfloat16, nearest even,
 * products summed in f32; tensor cores, sm_80 and later). In the bf16 mode a packed weight is
 * multiplied by the tensor-core kernel from xb, the inputs already rounded (kcu_to_bf16), in
 * blocks of 16 tokens up to `small` tokens and of 64 above: every output the same chain of MMAs
 * whatever the batch. */
struct kcu_mm {
    struct kcu_weight w;
    int bf16;
    int small;
    const uint16_t *xb; /* the bf16 mode, packed weights: the n_tok x ne0 inputs in bf16 */
    int q8;             /* the q8 mode (packed weights; the rest run as in the exact mode) */
    const int8_t *xq;   /* ... its inputs by kcu_quant_q8 */
    const float *xs;
};

/* The q8 mode's inputs: x (n floats, a multiple of 32: n_tok rows of ne0) quantized per block of
 * 32 bitwise as kern_ref_quantize_q8: xq (n bytes; element k of block b at 32 b + kcu_q8_pos(k))
 * and per block its scale d and s = d * sum(q) at xs[2 b], xs[2 b + 1] (8-byte aligned). */
int kcu_quant_q8(void *stream, const float *x, int64_t n, int8_t *xq, float *xs);

/* xb[i] = x[i] rounded to bfloat16 (nearest even), i < n. */
int kcu_to_bf16(void *stream, const float *x, uint16_t *xb, size_t n);
/* y[t * ne1 + r] = dot(dequantized row r of the weight, x[t * ne0 ..]) for t < n_tok, r < ne1. */
int kcu_matmul(void *stream, const struct kcu_mm *mm, const float *x, float *y, int n_tok);
/* ids[t] = the row of the weight with the largest product with x[t] (NaN never wins, ties to
 * the lowest row, 0 when every value is NaN or -inf), the values bitwise those kcu_matmul would
 * write, without writing them; best is n_tok 64-bit scratch. */
int kcu_matmul_argmax(void *stream, const struct kcu_mm *mm, const float *x, int n_tok,
                      unsigned long long *best, int32_t *ids);
/* cuBLAS (kernels/cuda/cuda_blas.cu), loaded at run time: NULL with the reason in why when
 * libcublas.so.13 cannot be had. kcu_matmul_blas is kcu_matmul in the bf16 mode through
 * cublasGemmEx on a bf16 copy of the weight (scratch it grows) and mm->xb, the inputs already
 * rounded; returns -1 when the scratch cannot be had or xb is NULL (nothing queued: the caller
 * runs kcu_matmul), 0, a runtime error, or 1000 + a cuBLAS status. */
struct kcu_blas;
struct kcu_blas *kcu_blas_open(void *stream, char *why, size_t why_size);
void kcu_blas_close(struct kcu_blas *b);
int kcu_matmul_blas(void *stream, struct kcu_blas *b, const struct kcu_mm *mm, float *y, int n_tok);
/* out row i = dequantized row ids[i] of w, bitwise as the CPU reference dequantizes it. */
int kcu_get_rows(void *stream, const struct kcu_weight *w, const int32_t *ids, int n, float *out);
int kcu_rope(void *stream, float *x, const float *cs, int n_tok, int n_head, int head_dim,
             int rot_dim, int neox);
int kcu_add(void *stream, float *y, const float *x, long n);
int kcu_add_rows(void *stream, float *y, const float *bias, long n_rows, int width);
int kcu_scale(void *stream, float *x, float s, long n);
int kcu_gather(void *stream, float *dst, const float *src, const int32_t *idx, int n, long width);
int kcu_moe_add(void *stream, float *y, const float *x, const int32_t *rows, const float *w, int n,
                long width);

/* One KV layer as the kernels see it (the CPU backend's tile layout, kernels/kernels.h). */
struct kcu_kv {
    void *k, *v;           /* pools: tile (block * n_kv_head + head) at tile * tile_bytes */
    int dtype;             /* enum kern_kv_dtype: 0 f16, 1 8-bit */
    int block_size;        /* tokens per block (B) */
    int n_kv_head;         /* key/value heads */
    int head_dim;          /* channels per head (D) */
    const int32_t *ids;    /* block tables: row r's blocks at ids[r * stride ..] */
    const int32_t *row;    /* per token: its sequence's row */
    int stride;            /* ids per row */
};

/* Write token rows of k and v (n_tok x n_kv_head * head_dim) into their slots. sel NULL: every
 * token; else only tokens with sel[t] == want (want 0: kv_store's skip; 1: attention's store;
 * either nonzero); never a token with sel[t] == KCU_STORE_PAD (KERN_STORE_PAD: padding). */
#define KCU_STORE_PAD 2
int kcu_kv_store(void *stream, const struct kcu_kv *kv, const int32_t *pos, const float *k,
                 const float *v, int n_tok, const uint8_t *sel, int want);
/* Softmax attention of every (token, query head) over positions 0..pos[t] of its sequence (the
 * last `window` of them when window > 0), scores soft-capped when softcap > 0. split > 0: a
 * token's positions are cut into runs of `split` (best a multiple of 32) computed in parallel and
 * merged (flash-decoding) through part (part_floats floats of scratch; tokens go in slices that
 * fit it); 0 or part NULL: one warp per (token, head) over all its positions. The warps of
 * query heads sharing a KV head go in one block, which with stage 1 (and head_dim <= 256) reads
 * each run of keys and values into shared memory once for all of them; the output is bitwise
 * the same either way. mma 1: with head_dim a multiple of 16 up to 128 (f16 or 8-bit K/V),
 * the tensor-core kernel instead (the bf16 mode's attention: queries times the scale and the
 * softmax's probabilities rounded to halves, f32 sums), splits cut at the same places; n_seqs
 * (the sequences among the tokens, 0: unknown) only shapes its tiles. */
int kcu_attention(void *stream, const struct kcu_kv *kv, const float *q, float *out,
                  const int32_t *pos, int n_tok, int n_head, float scale, int window, float softcap,
                  int split, float *part, size_t part_floats, int stage, int mma, int n_seqs);

/* One row's draw (struct kern_sample_row, kernels/kernels.h: the same fields). */
struct kcu_sample {
    float temperature, top_p, min_p;
    int32_t top_k;
    float repeat_penalty, frequency_penalty, presence_penalty;
    int32_t pen_first, pen_n;
    int32_t lp_k, mask, host;
    double u;
};
#define KCU_TOP_LP 20 /* KERN_TOP_LOGPROBS_MAX */
struct kcu_sample_out {
    int32_t id; /* -1: left to the host */
    float lp;
    int32_t top_id[KCU_TOP_LP];
    float top_lp[KCU_TOP_LP];
};
/* kern_ops.sample over n rows of logits (n x n_vocab, unchanged): work (n x n_vocab floats),
 * zc (n x chunks doubles) and mc (n x chunks floats, chunks = ceil(n_vocab / 256)) are scratch;
 * rows, pen_id/pen_count, masks and out are device memory. */
int kcu_sample(void *stream, const float *logits, float *work, double *zc, float *mc, int n,
               int n_vocab, const struct kcu_sample *rows, const int32_t *pen_id,
               const int32_t *pen_count, const uint32_t *masks, struct kcu_sample_out *out);

/* NCCL (kernels/cuda/cuda_nccl.cu), loaded once per process at the first call (QUERN_NCCL_LIB,
 * else libnccl.so.2): NULL, with the reason in why, when it cannot be had. Moves bytes only; the
 * calls return 0 or an ncclResult_t (kcu_nccl_error names it). */
struct kcu_nccl;
const struct kcu_nccl *kcu_nccl_open(char *why, size_t why_size);
const char *kcu_nccl_name(const struct kcu_nccl *l); /* "NCCL 2.28.9" */
int kcu_nccl_version(const struct kcu_nccl *l);      /* 22809 */
/* n communicators, rank r's on device devs[r] (distinct devices), from one thread
 * (ncclCommInitAll); it may leave another device current. */
int kcu_nccl_init(const struct kcu_nccl *l, void **comms, int n, const int *devs);
void kcu_nccl_close(const struct kcu_nccl *l, void *comm);
const char *kcu_nccl_error(const struct kcu_nccl *l, int rc);
/* The exchange of a rank-order all-reduce over n_bytes at x cut into chunks of chunk_bytes
 * (rank q's: bytes [q * chunk_bytes, min(n_bytes, (q + 1) * chunk_bytes)) of x): rank `rank`
 * sends each peer q its chunk of x and receives each peer's copy of its own chunk into
 * slots + q * chunk_bytes. Every rank calls it, on its own thread and stream. */
int kcu_nccl_exchange(const struct kcu_nccl *l, void *comm, void *stream, int rank, int size,
                      const void *x, void *slots, size_t n_bytes, size_t chunk_bytes);
/* ncclAllGather of bytes from each rank (in may be out + rank * bytes). */
int kcu_nccl_gather(const struct kcu_nccl *l, void *comm, void *stream, const void *in, void *out,
                    size_t bytes);
/* After kcu_nccl_exchange over n elements (f32, or bf16 when bf16) in chunks of `chunk`: slots
 * + rank * chunk gets rank `rank`'s chunk summed over the ranks in rank order in f32 (rank's own
 * values read from x), rounded once to bf16 when bf16 (kern_f32_to_bf16's rounding). */
int kcu_rank_sum(void *stream, const void *x, void *slots, size_t n, size_t chunk, int rank,
                 int size, int bf16);

#ifdef __cplusplus
}
#endif

#endif
