/* The CUDA backend: struct kern_ops over the kernels of cuda_kernels.cu (exact mode: f32 CUDA
 * cores; bf16 mode: tensor cores), with Q4_0/Q4_1/Q4_K/Q8_0 weights repacked for 16-byte lane
 * loads in mma fragment order (cuda_pack.h) and the other types kept in their GGUF blocks in device
 * memory (prepare uploads them), the KV pool in the CPU backend's tile layout in device memory, and
 * every op queued on one stream in call order. A failed CUDA call inside an op (a device fault, a
 * lost GPU) ends the process with the runtime's message: a device in that state cannot be trusted,
 * and the runner's checkpoints make a rerun lose nothing. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cuda_dequant.h"
#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_pack.h"
#include "kernels/cuda/cuda_sizes.h"
#include "kernels/kernels.h"

#define CUDA_GRAPHS 8 /* graphs kept (the least recently launched goes first) */
#define CUDA_SEEN   8 /* keys remembered as asked for once (a step may alternate shapes) */

struct cuda_state {
    int device;               /* ordinal */
    cudaStream_t stream;      /* every op and copy, in call order */
    enum kern_act act;        /* exact (f32 kernels), bf16 or q8 (tensor cores) */
    unsigned long long *best; /* matmul_argmax's per-token keys (device memory) */
    int best_cap;             /* tokens best holds */
    void *smp;                /* sample's device scratch (smp_bytes) */
    size_t smp_bytes;
    struct kcu_sample *smp_rows; /* ... and its host staging (smp_cap rows) */
    struct kcu_sample_out *smp_out;
    int smp_cap;
    int att_split;   /* attention's positions per split (flash-decoding); 0: none */
    float *att_part; /* ... its scratch (att_part_floats), made by reserve or the first call */
    size_t att_part_floats;
    int att_part_tried;
    int mma_small; /* the bf16 tensor-core kernel: 16-token blocks up to this many tokens */
    int pack;      /* repack Q4_0/Q4_1/Q4_K/Q8_0 weights at prepare (cuda_pack.h); 0: GGUF rows
                    * (QUERN_CUDA_PACK=0, ignored in the q8 mode) */
    int att_stage; /* attention stages K/V runs in shared memory (QUERN_CUDA_ATTN_STAGE) */
    int att_mma;   /* the bf16 mode's attention on tensor cores (QUERN_CUDA_ATTN_MMA) */
    uint16_t *xb;  /* the packed tensor-core kernels' inputs (xb_bytes: bf16, or q8's bytes and
                    * scales), made by reserve */
    size_t xb_bytes;
    int blas_min;  /* bf16 matmuls of at least this many tokens go to cuBLAS (0: never) */
    struct kcu_blas *blas;    /* ... loaded when blas_min > 0 in the bf16 mode, else NULL */
    int graphs;               /* make graphs (QUERN_CUDA_GRAPHS); 0 also after a failed one */
    struct {
        uint64_t key;
        cudaGraphExec_t exec; /* NULL: a free slot */
        unsigned long used;   /* when it was last launched (graph_tick) */
    } graph[CUDA_GRAPHS];
    uint64_t seen[CUDA_SEEN]; /* keys asked for without a graph (a ring; 0: none) */
    int seen_next;
    uint64_t capturing; /* the key being captured */
    int in_capture;     /* between a capture's begin and its end */
    int capture_broken; /* something in the capture failed (an allocation): it is dropped */
    unsigned long graph_tick;
    uint64_t graph_epoch;     /* graphs_drop calls so far */
    char name[160];           /* "cuda 0 NVIDIA H200 (sm_90, 139 GiB)" */
};

/* The device the calling thread's CUDA calls go to, as this file last set it (-1: unknown).
 * Ranks of a tensor-parallel group each own a device and may be driven from any thread, so every
 * op makes its backend's device current first (st_of); the cache makes that a compare. */
static _Thread_local int bound_device = -1;

static void bind_device(int device)
{
    if (bound_device != device) {
        const cudaError_t rc = cudaSetDevice(device);
        if (rc) {
            LOG_ERROR("CUDA error making device %d current: %s", device, cudaGetErrorString(rc));
            abort();
        }
        bound_device = device;
    }
}

/* The backend's state, its device made current for the calling thread. */
static struct cuda_state *st_of(struct kern_backend *b)
{
    struct cuda_state *s = b->impl;
    bind_device(s->device);
    return s;
}

void *kern_cuda_stream(struct kern_backend *b)
{
    return st_of(b)->stream;
}

int kern_cuda_device(const struct kern_backend *b)
{
    return ((const struct cuda_state *)b->impl)->device;
}

void kern_cuda_forget_device(void)
{
    bound_device = -1;
}

/* Every graph made so far goes: they hold device addresses, and memory given back may come back
 * from a later allocation in another role (graph_begin makes them anew). */
static void graphs_drop(struct cuda_state *s)
{
    s->graph_epoch++;
    for (int i = 0; i < CUDA_GRAPHS; i++) {
        if (s->graph[i].exec)
            cudaGraphExecDestroy(s->graph[i].exec);
        s->graph[i].exec = NULL;
    }
    memset(s->seen, 0, sizeof(s->seen));
}

/* Device memory given back (graphs dropped first). */
static void dev_free(struct cuda_state *s, void *p)
{
    if (!p)
        return;
    graphs_drop(s);
    cudaFree(p);
}

static void check(int rc, const char *what)
{
    if (rc) {
        LOG_ERROR("CUDA error in %s: %s", what, cudaGetErrorString((cudaError_t)rc));
        abort();
    }
}

/* A runtime call whose failure the caller handles (a status, a fallback): the error is also
 * taken out of the runtime's last-error slot, so that the next launch's check does not report
 * it again as its own (cudaGetLastError returns the last error of any call). */
static cudaError_t handled(cudaError_t rc)
{
    if (rc)
        (void)cudaGetLastError();
    return rc;
}

/* cudaMalloc for the backend: an allocation that fails inside a graph capture (where it is not
 * allowed) marks the capture broken, dropped at its end whatever the driver made of it. */
static cudaError_t dev_malloc(struct cuda_state *s, void **p, size_t bytes)
{
    const cudaError_t rc = handled(cudaMalloc(p, bytes));
    if (rc)
        s->capture_broken |= s->in_capture;
    return rc;
}

/* A matmul's input steps (struct kern_mm_in) queued; returns the rows the matmul reads. */
static const float *mm_input(struct cuda_state *s, const struct kern_mm_in *in, int n_tok,
                             int64_t n)
{
    check(kcu_mm_prep(s->stream, in->x, in->add, in->norm, in->eps, in->up, in->glu, in->xn, n_tok,
                      (int)n),
          "matmul input");
    return in->norm ? in->xn : in->x;
}

/* Attention's split scratch (s->att_part_floats, 16 Mi floats = 64 MiB unless
 * QUERN_CUDA_ATTN_PART says otherwise): partial results; tokens go in slices that fit it. Made
 * by reserve (or at the first call); without it every call of the run goes unsplit. */
static void att_part_make(struct cuda_state *s)
{
    if (s->att_split <= 0 || s->att_part_tried)
        return;
    s->att_part_tried = 1;
    void *p = NULL;
    if (dev_malloc(s, &p, sizeof(float) * s->att_part_floats))
        LOG_WARN("no device memory for split attention: long contexts run unsplit");
    else
        s->att_part = p;
}

/* How the kernels see weight w in the current mode. */
static struct kcu_mm mm_of(const struct cuda_state *s, const struct kern_tensor *w)
{
    return (struct kcu_mm){.w = {.type = w->type,
                                 .w = w->packed,
                                 .row_bytes = w->row_bytes,
                                 .ne0 = w->ne0,
                                 .ne1 = w->ne1,
                                 .p4_scales = w->packed_panel},
                           .bf16 = s->act == KERN_ACT_BF16,
                           .q8 = s->act == KERN_ACT_Q8,
                           .small = s->mma_small};
}

/* Grows device scratch *p (*have bytes) to n bytes; 0, or the runtime's error (handled). */
static cudaError_t grow(struct cuda_state *s, void **p, size_t *have, size_t n)
{
    if (n <= *have)
        return cudaSuccess;
    void *q = NULL;
    const cudaError_t rc = dev_malloc(s, &q, n);
    if (rc)
        return rc;
    dev_free(s, *p); /* waits for the kernels still using it */
    *p = q;
    *have = n;
    return cudaSuccess;
}

/* The packed tensor-core kernel's inputs in bf16 (s->xb), rounded once per matmul call. reserve
 * sized them; a device that cannot hold more cannot run the matmul (like a fault: abort). */
static const uint16_t *bf16_inputs(struct cuda_state *s, const float *x, size_t n)
{
    const cudaError_t rc = grow(s, (void **)&s->xb, &s->xb_bytes, n * sizeof(uint16_t));
    if (rc) {
        LOG_ERROR("CUDA: no device memory for %zu bf16 matmul inputs: %s", n,
                  cudaGetErrorString(rc));
        abort();
    }
    check(kcu_to_bf16(s->stream, x, s->xb, n), "matmul inputs");
    return s->xb;
}

/* The q8 mode's inputs (kcu_quant_q8) in s->xb, quantized once per matmul call into mm. */
static void q8_inputs(struct cuda_state *s, const float *x, size_t n, struct kcu_mm *mm)
{
    const cudaError_t rc = grow(s, (void **)&s->xb, &s->xb_bytes, kcu_q8_bytes(n));
    if (rc) {
        LOG_ERROR("CUDA: no device memory for %zu q8 matmul inputs: %s", n, cudaGetErrorString(rc));
        abort();
    }
    int8_t *xq = (int8_t *)s->xb;
    float *xs = (float *)(void *)(xq + kcu_q8_scales_at(n));
    check(kcu_quant_q8(s->stream, x, (int64_t)n, xq, xs), "matmul inputs (q8)");
    mm->xq = xq;
    mm->xs = xs;
}

/* 1 when a matmul of n_tok tokens goes to cuBLAS (QUERN_CUDA_CUBLAS_MIN). */
static int blas_takes(const struct cuda_state *s, int n_tok)
{
    return s->blas && n_tok >= s->blas_min;
}

static void cuda_matmul(struct kern_backend *b, const struct kern_tensor *const *w, float *const *y,
                        int n_w, const struct kern_mm_in *in, int n_tok)
{
    struct cuda_state *s = st_of(b);
    const float *x = mm_input(s, in, n_tok, w[0]->ne0);
    const uint16_t *xb = NULL; /* the weights share the inputs: rounded once */
    struct kcu_mm q8 = {0};    /* ... or quantized once */
    for (int i = 0; i < n_w; i++) {
        struct kcu_mm mm = mm_of(s, w[i]);
        if (mm.q8 && mm.w.p4_scales) {
            if (!q8.xq)
                q8_inputs(s, x, (size_t)n_tok * (size_t)w[i]->ne0, &q8);
            mm.xq = q8.xq;
            mm.xs = q8.xs;
        }
        if (mm.bf16 && (mm.w.p4_scales || blas_takes(s, n_tok)))
            mm.xb = xb ? xb : (xb = bf16_inputs(s, x, (size_t)n_tok * (size_t)w[i]->ne0));
        if (blas_takes(s, n_tok)) {
            const int rc = kcu_matmul_blas(s->stream, s->blas, &mm, y[i], n_tok);
            if (rc >= 1000) {
                LOG_ERROR("cuBLAS error in matmul: status %d", rc - 1000);
                abort();
            }
            if (rc != -1) {
                check(rc, "matmul (cuBLAS)");
                continue;
            }
        }
        check(kcu_matmul(s->stream, &mm, x, y[i], n_tok), "matmul");
    }
}

/* The output projection's greedy epilogue: only the ids leave the kernels. Not where matmul
 * would go to cuBLAS: its values are cuBLAS's, which the caller then takes the argmax of. */
static int cuda_matmul_argmax(struct kern_backend *b, const struct kern_tensor *w,
                              const struct kern_mm_in *in, int n_tok, int32_t *ids)
{
    struct cuda_state *s = st_of(b);
    if (blas_takes(s, n_tok))
        return 0;
    size_t have = (size_t)s->best_cap * sizeof(*s->best);
    if (grow(s, (void **)&s->best, &have, sizeof(*s->best) * (size_t)n_tok))
        return 0; /* not done: the caller computes the logits */
    s->best_cap = (int)(have / sizeof(*s->best));
    const float *x = mm_input(s, in, n_tok, w->ne0);
    struct kcu_mm mm = mm_of(s, w);
    if (mm.bf16 && mm.w.p4_scales)
        mm.xb = bf16_inputs(s, x, (size_t)n_tok * (size_t)w->ne0);
    if (mm.q8 && mm.w.p4_scales)
        q8_inputs(s, x, (size_t)n_tok * (size_t)w->ne0, &mm);
    check(kcu_matmul_argmax(s->stream, &mm, x, n_tok, s->best, ids), "matmul_argmax");
    return 1;
}

/* Scratch sized once for batches of up to max_tok tokens of rows up to max_width floats: the
 * bf16 or q8 inputs (bf16, q8 modes), the greedy keys and split attention's partials, so that no op
 * allocates in a forward pass. */
static enum status cuda_reserve(struct kern_backend *b, int max_tok, int64_t max_width,
                                int32_t max_pos, struct err_detail *err)
{
    (void)max_pos; /* split attention's partials are sized by their fixed cap */
    struct cuda_state *s = st_of(b);
    size_t have = (size_t)s->best_cap * sizeof(*s->best);
    cudaError_t rc = grow(s, (void **)&s->best, &have, sizeof(*s->best) * (size_t)max_tok);
    if (!rc)
        s->best_cap = (int)(have / sizeof(*s->best));
    if (!rc && s->act == KERN_ACT_BF16)
        rc = grow(s, (void **)&s->xb, &s->xb_bytes,
                  (size_t)max_tok * (size_t)max_width * sizeof(uint16_t));
    if (!rc && s->act == KERN_ACT_Q8)
        rc = grow(s, (void **)&s->xb, &s->xb_bytes,
                  kcu_q8_bytes((size_t)max_tok * (size_t)max_width));
    if (rc)
        return err_set(err, ST_ERR_NOMEM,
                       "no device memory for the scratch of %d-token batches: %s", max_tok,
                       cudaGetErrorString(rc));
    att_part_make(s);
    return ST_OK;
}

/* Sampling on the device (cuda_sample.cu): the rows' parameters and penalties go up, the kernel
 * draws, and only the ids (and log-probabilities) come back. Scratch that cannot be had leaves
 * every row to the caller. */
static int cuda_sample(struct kern_backend *b, const float *logits, int n, int32_t n_vocab,
                       const struct kern_sample_row *rows, const int32_t *pen_id,
                       const int32_t *pen_count, int n_pen, const uint32_t *masks, int n_masks,
                       struct kern_sample_out *out)
{
    _Static_assert(KCU_TOP_LP == KERN_TOP_LOGPROBS_MAX, "top log-probability rows differ");
    _Static_assert(KCU_STORE_PAD == KERN_STORE_PAD, "padding's store value differs");
    struct cuda_state *s = st_of(b);
    if (n <= 0)
        return 0;
    const struct kcu_sample_layout lay = kcu_sample_layout(n, n_vocab, n_pen, n_masks);
    const size_t o_work = 0, o_zc = lay.zc, o_mc = lay.mc, o_rows = lay.rows, o_pen = lay.pen;
    const size_t o_mask = lay.mask, o_out = lay.out, need = lay.bytes;
    const size_t mask_bytes = sizeof(uint32_t) * (((size_t)n_vocab + 31) / 32) * (size_t)n_masks;
    if (need > s->smp_bytes) {
        void *p = NULL;
        if (dev_malloc(s, &p, need))
            goto none;
        dev_free(s, s->smp);
        s->smp = p;
        s->smp_bytes = need;
    }
    if (n > s->smp_cap) {
        struct kcu_sample *r = malloc(sizeof(*r) * (size_t)n);
        struct kcu_sample_out *o = malloc(sizeof(*o) * (size_t)n);
        if (!r || !o) {
            free(r);
            free(o);
            goto none;
        }
        free(s->smp_rows);
        free(s->smp_out);
        s->smp_rows = r;
        s->smp_out = o;
        s->smp_cap = n;
    }
    for (int i = 0; i < n; i++) {
        const struct kern_sample_row *r = &rows[i];
        s->smp_rows[i] = (struct kcu_sample){.temperature = r->temperature,
                                             .top_p = r->top_p,
                                             .min_p = r->min_p,
                                             .top_k = r->top_k,
                                             .repeat_penalty = r->repeat_penalty,
                                             .frequency_penalty = r->frequency_penalty,
                                             .presence_penalty = r->presence_penalty,
                                             .pen_first = r->pen_first,
                                             .pen_n = r->pen_n,
                                             .lp_k = r->lp_k,
                                             .mask = r->mask,
                                             .host = r->host,
                                             .u = r->u};
    }
    uint8_t *d = s->smp;
    check((int)cudaMemcpyAsync(d + o_rows, s->smp_rows, sizeof(struct kcu_sample) * (size_t)n,
                               cudaMemcpyHostToDevice, s->stream),
          "sample");
    if (n_pen > 0) {
        check((int)cudaMemcpyAsync(d + o_pen, pen_id, sizeof(int32_t) * (size_t)n_pen,
                                   cudaMemcpyHostToDevice, s->stream),
              "sample");
        check((int)cudaMemcpyAsync(d + o_pen + sizeof(int32_t) * (size_t)n_pen, pen_count,
                                   sizeof(int32_t) * (size_t)n_pen, cudaMemcpyHostToDevice,
                                   s->stream),
              "sample");
    }
    if (n_masks > 0)
        check(
            (int)cudaMemcpyAsync(d + o_mask, masks, mask_bytes, cudaMemcpyHostToDevice, s->stream),
            "sample");
    check(kcu_sample(s->stream, logits, (float *)(d + o_work), (double *)(d + o_zc),
                     (float *)(d + o_mc), n, n_vocab, (const struct kcu_sample *)(d + o_rows),
                     (const int32_t *)(d + o_pen),
                     (const int32_t *)(d + o_pen + sizeof(int32_t) * (size_t)n_pen),
                     (const uint32_t *)(d + o_mask), (struct kcu_sample_out *)(d + o_out)),
          "sample");
    check((int)cudaMemcpyAsync(s->smp_out, d + o_out, sizeof(struct kcu_sample_out) * (size_t)n,
                               cudaMemcpyDeviceToHost, s->stream),
          "sample");
    check((int)cudaStreamSynchronize(s->stream), "sample");
    int drawn = 0;
    for (int i = 0; i < n; i++) {
        const struct kcu_sample_out *o = &s->smp_out[i];
        out[i].id = o->id;
        drawn += o->id >= 0;
        if (o->id < 0 || rows[i].lp_k < 0)
            continue;
        out[i].lp = o->lp;
        memcpy(out[i].top_id, o->top_id, sizeof(out[i].top_id[0]) * (size_t)rows[i].lp_k);
        memcpy(out[i].top_lp, o->top_lp, sizeof(out[i].top_lp[0]) * (size_t)rows[i].lp_k);
    }
    return drawn;
none:
    for (int i = 0; i < n; i++)
        out[i].id = -1;
    return 0;
}

static void cuda_ffn(struct kern_backend *b, const struct kern_tensor *gate,
                     const struct kern_tensor *up, const struct kern_tensor *down,
                     const struct kern_mm_in *in, int glu, float *y, float *gate_buf, float *up_buf,
                     int n_tok)
{
    const struct kern_tensor *gu[2] = {gate, up};
    float *const ys[2] = {gate_buf, up_buf};
    cuda_matmul(b, gu, ys, 2, in, n_tok);
    const struct kern_tensor *d[1] = {down};
    float *const yd[1] = {y};
    const struct kern_mm_in din = {.x = gate_buf, .up = up_buf, .glu = glu};
    cuda_matmul(b, d, yd, 1, &din, n_tok);
}

/* 1 when prepare repacks w into the packed layout of cuda_pack.h. */
static int packs(const struct cuda_state *s, const struct kern_tensor *w)
{
    return s->pack && kcu_p4_type(w->type);
}

/* Weights go up once, Q4_0/Q4_1/Q4_K/Q8_0 ones repacked (cuda_pack.h: 16-byte lane loads in mma
 * fragment order; packed_panel holds the scale plane's offset), the rest as their GGUF rows. */
static enum status cuda_prepare(struct kern_backend *b, struct kern_tensor *w,
                                struct err_detail *err)
{
    struct cuda_state *s = st_of(b);
    if (!kcu_type_ok(w->type) || w->ne0 % 32)
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "the CUDA backend has no kernels for tensor type %u with rows of %lld",
                       (unsigned)w->type, (long long)w->ne0);
    const int p4 = packs(s, w);
    const size_t bytes = p4 ? kcu_p4_bytes(w->type, w->ne0, w->ne1) : (size_t)w->ne1 * w->row_bytes;
    uint8_t *host = NULL;
    if (p4 && !(host = malloc(bytes)))
        return err_set(err, ST_ERR_NOMEM, "no memory to repack a %zu-byte weight", bytes);
    if (p4)
        kcu_p4_pack(w->type, w->data, w->row_bytes, w->ne0, w->ne1, host);
    void *p = NULL;
    cudaError_t rc = dev_malloc(s, &p, bytes ? bytes : 1);
    if (rc) {
        free(host);
        return err_set(err, ST_ERR_NOMEM, "no device memory for a %zu-byte weight: %s", bytes,
                       cudaGetErrorString(rc));
    }
    rc = cudaMemcpyAsync(p, p4 ? host : w->data, bytes, cudaMemcpyHostToDevice, s->stream);
    if (!rc)
        rc = cudaStreamSynchronize(s->stream);
    free(host);
    if (rc) {
        cudaFree(p);
        return err_set(err, ST_ERR_IO, "uploading a weight: %s", cudaGetErrorString(rc));
    }
    w->packed = p;
    w->packed_panel = p4 ? kcu_p4_sbase(w->type, w->ne0, w->ne1) : 0;
    return ST_OK;
}

static void cuda_release(struct kern_backend *b, struct kern_tensor *w)
{
    dev_free(st_of(b), w->packed);
    w->packed = NULL;
}

static void cuda_get_rows(struct kern_backend *b, const struct kern_tensor *w, const int32_t *ids,
                          int n, float *out)
{
    const struct kcu_mm mm = mm_of(st_of(b), w);
    check(kcu_get_rows(st_of(b)->stream, &mm.w, ids, n, out), "get_rows");
}

static void cuda_rope(struct kern_backend *b, float *x, const float *cs, int n_tok, int n_head,
                      int head_dim, int rot_dim, int neox)
{
    check(kcu_rope(st_of(b)->stream, x, cs, n_tok, n_head, head_dim, rot_dim, neox), "rope");
}

static void cuda_add(struct kern_backend *b, float *y, const float *x, long n)
{
    check(kcu_add(st_of(b)->stream, y, x, n), "add");
}

static void cuda_add_rows(struct kern_backend *b, float *y, const float *bias, long n_rows,
                          int width)
{
    check(kcu_add_rows(st_of(b)->stream, y, bias, n_rows, width), "add_rows");
}

static void cuda_norm_rows(struct kern_backend *b, float *x, const float *w, long n_rows, int width,
                           float eps)
{
    check(kcu_norm_rows(st_of(b)->stream, x, w, n_rows, width, eps), "norm_rows");
}

static void cuda_scale(struct kern_backend *b, float *x, float sc, long n)
{
    check(kcu_scale(st_of(b)->stream, x, sc, n), "scale");
}

static struct kcu_kv kv_of(struct kern_kv_layer kv, const struct kern_block_table *bt,
                           int block_size, int n_kv_head, int head_dim)
{
    const struct kcu_kv k = {kv.k,     kv.v,    kv.dtype, block_size, n_kv_head,
                             head_dim, bt->ids, bt->row,  bt->stride};
    return k;
}

static void cuda_kv_store(struct kern_backend *b, struct kern_kv_layer kv,
                          const struct kern_block_table *bt, const int32_t *pos, int block_size,
                          int n_kv_head, int head_dim, const float *k, const float *v, int n_tok,
                          const uint8_t *skip)
{
    const struct kcu_kv d = kv_of(kv, bt, block_size, n_kv_head, head_dim);
    check(kcu_kv_store(st_of(b)->stream, &d, pos, k, v, n_tok, skip, 0), "kv_store");
}

/* The tokens whose store the caller left to the attention are stored first: on one stream that
 * orders them before every read, which is all the contract asks. Long contexts are split over
 * their positions (flash-decoding, s->att_split per warp); without the scratch (no memory at
 * the first call) every call of the run goes unsplit, so a token's result still depends only on
 * itself. */
static void cuda_attention(struct kern_backend *b, const struct kern_attn *a)
{
    struct cuda_state *s = st_of(b);
    const struct kcu_kv d = kv_of(a->kv, &a->bt, a->block_size, a->n_kv_head, a->head_dim);
    if (a->store)
        check(kcu_kv_store(s->stream, &d, a->pos, a->k_new, a->v_new, a->n_tok, a->store, 1),
              "attention store");
    att_part_make(s);
    check(kcu_attention(s->stream, &d, a->q, a->out, a->pos, a->n_tok, a->n_head, a->scale,
                        a->window, a->softcap, s->att_part ? s->att_split : 0, s->att_part,
                        s->att_part_floats, s->att_stage, s->act == KERN_ACT_BF16 && s->att_mma,
                        a->n_seqs),
          "attention");
}

static void cuda_gather(struct kern_backend *b, float *dst, const float *src, const int32_t *idx,
                        int n, long width)
{
    check(kcu_gather(st_of(b)->stream, dst, src, idx, n, width), "gather");
}

static void cuda_moe_add(struct kern_backend *b, float *y, const float *x, const int32_t *rows,
                         const float *w, int n, long width)
{
    check(kcu_moe_add(st_of(b)->stream, y, x, rows, w, n, width), "moe_add");
}

static void *cuda_buf_alloc(struct kern_backend *b, size_t bytes)
{
    struct cuda_state *s = st_of(b); /* on the backend's device */
    void *p = NULL;                  /* cudaMalloc aligns to at least 256 bytes */
    return dev_malloc(s, &p, bytes ? bytes : 1) ? NULL : p;
}

static void cuda_buf_free(struct kern_backend *b, void *p)
{
    dev_free(st_of(b), p);
}

/* Synchronous on the backend's stream: the source may be reused when it returns. */
static void cuda_upload(struct kern_backend *b, void *dst, const void *src, size_t bytes)
{
    struct cuda_state *s = st_of(b);
    check((int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s->stream), "upload");
    check((int)cudaStreamSynchronize(s->stream), "upload");
}

static void cuda_download(struct kern_backend *b, void *dst, const void *src, size_t bytes)
{
    struct cuda_state *s = st_of(b);
    check((int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s->stream), "download");
    check((int)cudaStreamSynchronize(s->stream), "download");
}

static void cuda_copy(struct kern_backend *b, void *dst, const void *src, size_t bytes)
{
    check((int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st_of(b)->stream),
          "copy");
}

static void cuda_sync(struct kern_backend *b)
{
    check((int)cudaStreamSynchronize(st_of(b)->stream), "sync");
}

static size_t cuda_kv_block_bytes(struct kern_backend *b, const struct kern_kv_desc *d)
{
    (void)b;
    return (size_t)d->n_layer * 2 * (size_t)d->n_kv_head *
           KERN_KV_TILE_BYTES(d->dtype, d->block_size, d->head_dim);
}

/* One allocation for the keys of every layer and one for the values, zeroed. */
static enum status cuda_kv_alloc(struct kern_backend *b, const struct kern_kv_desc *d,
                                 int32_t n_blocks, struct kern_kv_layer *layers,
                                 struct err_detail *err)
{
    struct cuda_state *s = st_of(b);
    const size_t tb = KERN_KV_TILE_BYTES(d->dtype, d->block_size, d->head_dim);
    if (d->head_dim > KERN_MAX_HEAD_DIM)
        return err_set(err, ST_ERR_UNSUPPORTED, "head_dim %d > %d", d->head_dim, KERN_MAX_HEAD_DIM);
    if (n_blocks < 1 ||
        (size_t)n_blocks > SIZE_MAX / tb / (size_t)d->n_kv_head / 2 / (size_t)d->n_layer)
        return err_set(err, ST_ERR_INVALID_ARG, "bad KV pool size (%d blocks)", (int)n_blocks);
    const size_t per_layer = (size_t)n_blocks * (size_t)d->n_kv_head * tb;
    const size_t bytes = per_layer * (size_t)d->n_layer;
    void *k = NULL, *v = NULL;
    cudaError_t rc = dev_malloc(s, &k, bytes);
    if (!rc)
        rc = dev_malloc(s, &v, bytes);
    if (!rc)
        rc = cudaMemsetAsync(k, 0, bytes, s->stream);
    if (!rc)
        rc = cudaMemsetAsync(v, 0, bytes, s->stream);
    if (!rc)
        rc = cudaStreamSynchronize(s->stream);
    if (rc) {
        if (k)
            cudaFree(k);
        if (v)
            cudaFree(v);
        return err_set(err, ST_ERR_NOMEM, "no device memory for a KV pool of 2 x %zu bytes: %s",
                       bytes, cudaGetErrorString(rc));
    }
    for (int l = 0; l < d->n_layer; l++) {
        layers[l].k = (uint8_t *)k + (size_t)l * per_layer;
        layers[l].v = (uint8_t *)v + (size_t)l * per_layer;
        layers[l].dtype = d->dtype;
    }
    return ST_OK;
}

static void cuda_kv_free(struct kern_backend *b, const struct kern_kv_desc *d, int32_t n_blocks,
                         struct kern_kv_layer *layers)
{
    (void)n_blocks;
    if (!layers || !layers[0].k)
        return;
    dev_free(st_of(b), layers[0].k);
    dev_free(st_of(b), layers[0].v);
    for (int l = 0; l < d->n_layer; l++)
        layers[l].k = layers[l].v = NULL;
}

/* A block of one layer is contiguous (its n_kv_head tiles): each layer's K and V block move as
 * one device-to-device copy on the stream, in order with the ops around them. */
static void cuda_kv_copy(struct kern_backend *b, const struct kern_kv_desc *d,
                         const struct kern_kv_layer *layers, int32_t dst, int32_t src)
{
    cudaStream_t st = st_of(b)->stream;
    const size_t bb =
        (size_t)d->n_kv_head * KERN_KV_TILE_BYTES(d->dtype, d->block_size, d->head_dim);
    for (int l = 0; l < d->n_layer; l++) {
        check((int)cudaMemcpyAsync((uint8_t *)layers[l].k + (size_t)dst * bb,
                                   (const uint8_t *)layers[l].k + (size_t)src * bb, bb,
                                   cudaMemcpyDeviceToDevice, st),
              "kv_copy");
        check((int)cudaMemcpyAsync((uint8_t *)layers[l].v + (size_t)dst * bb,
                                   (const uint8_t *)layers[l].v + (size_t)src * bb, bb,
                                   cudaMemcpyDeviceToDevice, st),
              "kv_copy");
    }
}

static size_t cuda_weight_bytes(struct kern_backend *b, const struct kern_tensor *w)
{
    return kcu_weight_device_bytes(w->type, w->ne0, w->ne1, w->row_bytes, st_of(b)->pack);
}

/* CUDA graphs (kern_ops.graph_begin): a key is captured the second time it is asked for among
 * the CUDA_SEEN last keys without a graph (a decode step at a steady batch repeats its shape, a
 * speculative step alternates a few; a prefill chunk's seldom repeats, and a capture costs about
 * a step), then replayed for as long as it stays among the CUDA_GRAPHS last launched. Any device
 * memory given back drops them all (graphs_drop). Not with cuBLAS. Failures found at the
 * capture's end, at instantiation or at launch fall back (the caller runs the ops); an op whose
 * own launch fails inside a capture aborts, as any CUDA error in an op does (reserve makes sure
 * no op allocates there). */
static void graphs_off(struct cuda_state *s, const char *what, cudaError_t rc)
{
    (void)handled(rc);
    LOG_WARN("cuda: %s failed (%s): no more CUDA graphs this run", what, cudaGetErrorString(rc));
    s->graphs = 0;
}

static int cuda_graph_begin(struct kern_backend *b, uint64_t key)
{
    struct cuda_state *s = st_of(b);
    if (!s->graphs || s->blas)
        return KERN_GRAPH_NONE;
    for (int i = 0; i < CUDA_GRAPHS; i++)
        if (s->graph[i].exec && s->graph[i].key == key) {
            const cudaError_t rc = cudaGraphLaunch(s->graph[i].exec, s->stream);
            if (rc) {
                graphs_off(s, "a graph launch", rc);
                return KERN_GRAPH_NONE;
            }
            s->graph[i].used = ++s->graph_tick;
            return KERN_GRAPH_REPLAYED;
        }
    int seen = 0;
    for (int i = 0; i < CUDA_SEEN; i++)
        seen |= s->seen[i] == key;
    if (!seen) {
        s->seen[s->seen_next] = key;
        s->seen_next = (s->seen_next + 1) % CUDA_SEEN;
        return KERN_GRAPH_NONE;
    }
    att_part_make(s); /* no allocation may happen in the capture */
    const cudaError_t rc = cudaStreamBeginCapture(s->stream, cudaStreamCaptureModeThreadLocal);
    if (rc) {
        graphs_off(s, "beginning a stream capture", rc);
        return KERN_GRAPH_NONE;
    }
    s->capturing = key;
    s->in_capture = 1;
    s->capture_broken = 0;
    return KERN_GRAPH_CAPTURE;
}

static uint64_t cuda_graph_epoch(struct kern_backend *b)
{
    return st_of(b)->graph_epoch;
}

static void cuda_graphs_reset(struct kern_backend *b)
{
    graphs_drop(st_of(b));
}

static int cuda_graphs_on(struct kern_backend *b)
{
    const struct cuda_state *s = st_of(b);
    return s->graphs && !s->blas;
}

static int cuda_graph_end(struct kern_backend *b)
{
    struct cuda_state *s = st_of(b);
    cudaGraph_t g = NULL;
    cudaGraphExec_t e = NULL;
    cudaError_t rc = cudaStreamEndCapture(s->stream, &g);
    s->in_capture = 0;
    if (!rc && s->capture_broken) {
        cudaGraphDestroy(g);
        rc = cudaErrorStreamCaptureInvalidated;
    }
    if (rc) {
        graphs_off(s, "a stream capture", rc);
        return 0;
    }
    rc = cudaGraphInstantiate(&e, g, 0);
    cudaGraphDestroy(g);
    if (rc) {
        graphs_off(s, "instantiating a graph", rc);
        return 0;
    }
    int slot = 0; /* a free one, else the least recently launched */
    for (int i = 0; i < CUDA_GRAPHS; i++)
        if (!s->graph[i].exec || (s->graph[slot].exec && s->graph[i].used < s->graph[slot].used))
            slot = i;
    if (s->graph[slot].exec)
        cudaGraphExecDestroy(s->graph[slot].exec);
    s->graph[slot].key = s->capturing;
    s->graph[slot].exec = e;
    s->graph[slot].used = ++s->graph_tick;
    if ((rc = cudaGraphLaunch(e, s->stream))) {
        graphs_off(s, "a graph launch", rc);
        return 0;
    }
    return 1;
}

static int cuda_mem_info(struct kern_backend *b, struct kern_mem_info *out)
{
    struct cuda_state *s = st_of(b);
    cudaStreamSynchronize(s->stream);
    out->device = s->device;
    return !handled(cudaMemGetInfo(&out->avail, &out->total));
}

static const char *cuda_describe(const struct kern_backend *b)
{
    return ((const struct cuda_state *)b->impl)->name;
}

static void cuda_free(struct kern_backend *b)
{
    struct cuda_state *s = st_of(b);
    cudaStreamSynchronize(s->stream);
    if (s->best)
        cudaFree(s->best);
    if (s->smp)
        cudaFree(s->smp);
    if (s->att_part)
        cudaFree(s->att_part);
    kcu_blas_close(s->blas);
    for (int i = 0; i < CUDA_GRAPHS; i++)
        if (s->graph[i].exec)
            cudaGraphExecDestroy(s->graph[i].exec);
    cudaFree(s->xb);
    free(s->smp_rows);
    free(s->smp_out);
    cudaStreamDestroy(s->stream);
    free(s);
    free(b);
}

static const struct kern_ops cuda_ops = {
    .name = "cuda",
    .matmul = cuda_matmul,
    .matmul_argmax = cuda_matmul_argmax,
    .ffn = cuda_ffn,
    .sample = cuda_sample,
    .reserve = cuda_reserve,
    .prepare = cuda_prepare,
    .release = cuda_release,
    .get_rows = cuda_get_rows,
    .rope = cuda_rope,
    .add = cuda_add,
    .add_rows = cuda_add_rows,
    .norm_rows = cuda_norm_rows,
    .scale = cuda_scale,
    .kv_store = cuda_kv_store,
    .attention = cuda_attention,
    .gather = cuda_gather,
    .moe_add = cuda_moe_add,
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .copy = cuda_copy,
    .sync = cuda_sync,
    .kv_block_bytes = cuda_kv_block_bytes,
    .kv_alloc = cuda_kv_alloc,
    .kv_free = cuda_kv_free,
    .kv_copy = cuda_kv_copy,
    .weight_bytes = cuda_weight_bytes,
    .mem_info = cuda_mem_info,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graphs_on = cuda_graphs_on,
    .graph_epoch = cuda_graph_epoch,
    .graphs_reset = cuda_graphs_reset,
    .free = cuda_free,
    .describe = cuda_describe,
};

int kern_cuda_device_count(char *why, size_t why_size)
{
    int n = 0;
    const cudaError_t rc = cudaGetDeviceCount(&n);
    if (rc) {
        if (why && why_size)
            snprintf(why, why_size, "%s", cudaGetErrorString(rc));
        cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
        return 0;
    }
    if (n == 0 && why && why_size)
        snprintf(why, why_size, "no CUDA device");
    return n;
}

enum status kern_cuda_backend_init(struct kern_backend **out, const struct kern_cuda_opts *o,
                                   struct err_detail *err)
{
    *out = NULL;
    char why[128] = "";
    const int n = kern_cuda_device_count(why, sizeof(why));
    if (n < 1)
        return err_set(err, ST_ERR_UNSUPPORTED, "--device cuda: no usable CUDA device (%s)", why);
    if (o->device < 0 || o->device >= n)
        return err_set(err, ST_ERR_INVALID_ARG, "CUDA device %d: this machine has %d", o->device,
                       n);
    if (o->act != KERN_ACT_F32 && o->act != KERN_ACT_BF16 && o->act != KERN_ACT_Q8)
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "the CUDA backend runs the exact, bf16 and q8 matmul modes (not q16)");
    struct cudaDeviceProp prop;
    kern_cuda_forget_device();
    cudaError_t rc = cudaSetDevice(o->device);
    if (!rc)
        rc = cudaGetDeviceProperties(&prop, o->device);
    if (rc)
        return err_set(err, ST_ERR_IO, "CUDA device %d: %s", o->device, cudaGetErrorString(rc));
    struct kern_backend *b = calloc(1, sizeof(*b));
    struct cuda_state *s = calloc(1, sizeof(*s));
    if (!b || !s) {
        free(b);
        free(s);
        return err_set(err, ST_ERR_NOMEM, "no memory for the CUDA backend");
    }
    if ((rc = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking))) {
        free(b);
        free(s);
        return err_set(err, ST_ERR_IO, "CUDA stream: %s", cudaGetErrorString(rc));
    }
    if ((o->act == KERN_ACT_BF16 || o->act == KERN_ACT_Q8) && prop.major < 8) {
        cudaStreamDestroy(s->stream);
        free(b);
        free(s);
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "--matmul %s needs sm_80 or later (this GPU "
                       "is sm_%d%d)",
                       o->act == KERN_ACT_Q8 ? "q8" : "bf16", prop.major, prop.minor);
    }
    s->device = o->device;
    bound_device = o->device;
    s->act = o->act;
    /* tuning knobs for tests and the GPU check (docs/CUDA_NOTES.md): defaults until measured */
    static const struct {
        const char *name, *want;
        long def, max;
    } knobs[] = {
        {"QUERN_CUDA_ATTN_SPLIT", "positions per split (0: none)", 512, 1 << 20},
        {"QUERN_CUDA_MMA_SMALL",
         "the most tokens the bf16 tensor-core kernel takes in blocks of 16", 16, 1 << 20},
        {"QUERN_CUDA_PACK", "1 to repack 4- and 8-bit weights, 0 to keep GGUF rows", 1, 1},
        {"QUERN_CUDA_ATTN_STAGE",
         "1 to stage K/V runs in shared memory (for a KV head's query heads; on tensor cores by "
         "cp.async), 0 not",
         1, 1},
        {"QUERN_CUDA_CUBLAS_MIN", "the fewest tokens a bf16 matmul takes cuBLAS for (0: never)", 0,
         1 << 20},
        {"QUERN_CUDA_ATTN_PART", "floats of split attention's scratch (tests: small slices)",
         (long)KCU_ATTN_PART_FLOATS, 1L << 30},
        {"QUERN_CUDA_GRAPHS", "1 to replay repeated steps' layers as CUDA graphs, 0 not", 1, 1},
        {"QUERN_CUDA_ATTN_MMA", "1 for the bf16 mode's attention on tensor cores, 0 for f32", 1, 1},
    };
    long v[8];
    for (int i = 0; i < 8; i++) {
        v[i] = knobs[i].def;
        const char *e = getenv(knobs[i].name);
        char *end;
        if (e && *e && ((v[i] = strtol(e, &end, 10)), *end || v[i] < 0 || v[i] > knobs[i].max)) {
            cudaStreamDestroy(s->stream);
            free(b);
            free(s);
            return err_set(err, ST_ERR_INVALID_ARG, "%s=%s: want %s", knobs[i].name, e,
                           knobs[i].want);
        }
    }
    s->att_split = (int)v[0];
    s->mma_small = (int)v[1];
    s->pack = (int)v[2] || o->act == KERN_ACT_Q8; /* the q8 kernel reads only that layout */
    s->att_stage = (int)v[3];
    s->blas_min = (int)v[4];
    s->att_part_floats = (size_t)v[5];
    s->graphs = (int)v[6];
    s->att_mma = (int)v[7];
    if (s->blas_min > 0 && o->act == KERN_ACT_BF16) {
        char blas_why[200] = "";
        if (!(s->blas = kcu_blas_open(s->stream, blas_why, sizeof(blas_why)))) {
            (void)cudaGetLastError(); /* handled: a runtime error cuBLAS left is not ours */
            LOG_WARN("cuda: QUERN_CUDA_CUBLAS_MIN=%d but cuBLAS is not usable (%s): the bf16 "
                     "matmuls stay on quern's kernels",
                     s->blas_min, blas_why);
        }
    }
    snprintf(s->name, sizeof(s->name), "cuda %d %.100s (sm_%d%d, %.0f GiB)", o->device, prop.name,
             prop.major, prop.minor, (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
    b->ops = &cuda_ops;
    b->impl = s;
    b->host_memory = 0;
    *out = b;
    return ST_OK;
}

void kern_cuda_print(FILE *f)
{
    char why[128] = "";
    const int n = kern_cuda_device_count(why, sizeof(why));
    if (n < 1) {
        fprintf(f, "cuda: built in; no usable device here (%s)\n", why);
        return;
    }
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, i))
            continue;
        fprintf(f, "cuda %d: %s, sm_%d%d, %.0f GiB\n", i, prop.name, prop.major, prop.minor,
                (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
    }
}
