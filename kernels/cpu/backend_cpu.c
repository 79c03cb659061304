/* The CPU backend: fills struct kern_ops with threaded kernels built on the per-ISA dot
 * products of cpu_kernels.h. Matmuls split weight rows across threads and either dequantize
 * each weight row to f32 (exact mode) or quantize activations to 8-bit blocks once per call
 * (fast mode). Every output element is computed by the same code whatever the batch, so
 * results are independent of batch size and thread count. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/dtype.h"
#include "common/pool.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/kernels.h"


struct cpu_state {
    struct pool *pool;             /* worker threads */
    const struct kern_cpu_fns *fn; /* per-ISA kernels */
    enum kern_act act;             /* activation precision of matmuls */
    struct kern_q8 *xq;            /* quantized activations scratch (thread 0 owns) */
    size_t xq_cap;                 /* blocks allocated in xq */
    struct kern_q16 *xq16;         /* 16-bit activations scratch (q16 mode) */
    size_t xq16_cap;               /* blocks allocated in xq16 */
    void *xs;                      /* split (exact) or bf16 activations on the AMX table */
    size_t xs_cap;                 /* bytes allocated in xs */
    void *xh;                      /* bf16 mode: the fused SwiGLU's output (the down input) */
    size_t xh_cap;                 /* bytes allocated in xh */
    float *bv;                     /* greedy output projection: per-thread best values */
    size_t bv_cap;                 /* entries allocated in bv */
    int32_t *bi;                   /* ... and their rows */
    size_t bi_cap;                 /* entries allocated in bi */
    float *hb;                     /* matmul_hook: per-thread output blocks */
    size_t hb_cap;                 /* floats allocated in hb */
    int attn_tiles;                /* bf16 mode on the AMX table: attention on the tiles */
    int tile_hd;                   /* largest head_dim of a KERN_KV_BF16T pool made (0: none) */
    void *aw;                      /* attention on the tiles: per-thread workspaces */
    size_t aw_cap;                 /* bytes allocated in aw */
    struct tile_item *items;       /* attention on the tiles: the call's items */
    size_t items_cap;              /* entries allocated in items */
    char name[32];                 /* "cpu " + the table's name (kern_backend_describe) */
    size_t late;                   /* scratch allocations made in ops (kern_cpu_late_allocs) */
};

static int packs(const struct cpu_state *s, const struct kern_tensor *w);

static struct cpu_state *st_of(struct kern_backend *b)
{
    return b->impl;
}

/* Parallel loop over n items in contiguous ranges, one per thread. */
struct range_job {
    void (*body)(void *ctx, long lo, long hi); /* processes items [lo, hi) */
    void *ctx;                                 /* its argument */
    long n;                                    /* items */
};

static void range_worker(void *arg, int ith, int nth)
{
    const struct range_job *j = arg;
    long lo, hi;
    pool_range(j->n, ith, nth, &lo, &hi);
    if (lo < hi)
        j->body(j->ctx, lo, hi);
}

static void parallel_ranges(struct cpu_state *s, long n, void (*body)(void *, long, long),
                            void *ctx)
{
    struct range_job j = {body, ctx, n};
    pool_run(s->pool, range_worker, &j);
}

struct matmul_job {
    const struct kern_cpu_fns *fn;       /* kernels */
    const struct kern_tensor *const *w;  /* weights */
    float *const *y;                     /* outputs, n_tok x w[i]->ne1 */
    int n_w;                             /* weights */
    long rows;                           /* sum of their panels (KERN_PANEL_ROWS rows) */
    const float *x;                      /* float activations (exact mode) */
    const struct kern_q8 *xq;            /* quantized activations (q8 mode), else NULL */
    const struct kern_q16 *xq16;         /* 16-bit activations (q16 mode), else NULL */
    const void *xs;                      /* prep_x3 activations (exact mode, AMX), else NULL */
    const void *xb;                      /* prep_bf16 activations (bf16 mode), else NULL */
    int n_tok;                           /* tokens */
};

/* Rows [r0, r1) of w (r0 a multiple of KERN_PANEL_ROWS) times every token into y_all (token t's
 * row r at t * ldy + r), by whichever GEMM the job's activations and w's layout take. */
static void gemm_rows(const struct matmul_job *j, const struct kern_tensor *w, long r0, long r1,
                      size_t ldy, float *y_all)
{
    const char *w0 = (const char *)w->data + (size_t)r0 * w->row_bytes;
    const char *pk =
        w->packed ? (const char *)w->packed + (size_t)(r0 / KERN_PANEL_ROWS) * w->packed_panel
                  : NULL;
    float *y = y_all + r0;
    const size_t ldxq = (size_t)(w->ne0 / KERN_QK);
    if (j->xb && pk && j->fn->gemm_bf16_packed[w->type])
        j->fn->gemm_bf16_packed[w->type](pk, r1 - r0, j->xb, j->n_tok, w->ne0, y, ldy);
    else if (j->xs && pk && j->fn->gemm_x3_packed[w->type])
        j->fn->gemm_x3_packed[w->type](pk, r1 - r0, j->xs, j->n_tok, w->ne0, y, ldy);
    else if (j->xq16 && pk)
        j->fn->gemm_q16_packed[w->type](pk, r1 - r0, j->xq16, ldxq, j->n_tok, w->ne0, y, ldy);
    else if (j->xq16 && j->fn->gemm_q16[w->type])
        j->fn->gemm_q16[w->type](w0, w->row_bytes, r1 - r0, j->xq16, ldxq, j->n_tok, w->ne0, y,
                                 ldy);
    else if (j->xq && pk)
        j->fn->gemm_q8_packed[w->type](pk, r1 - r0, j->xq, ldxq, j->n_tok, w->ne0, y, ldy);
    else if (j->xq && j->fn->gemm_q8[w->type])
        j->fn->gemm_q8[w->type](w0, w->row_bytes, r1 - r0, j->xq, ldxq, j->n_tok, w->ne0, y, ldy);
    else if (pk)
        j->fn->gemm_f32_packed[w->type](pk, r1 - r0, j->x, (size_t)w->ne0, j->n_tok, w->ne0, y,
                                        ldy);
    else
        j->fn->gemm_f32[w->type](w0, w->row_bytes, r1 - r0, j->x, (size_t)w->ne0, j->n_tok, w->ne0,
                                 y, ldy);
}

/* Each thread takes an even share of the concatenated 16-row panels of all weights (the unit
 * of packed weights) and runs one batch-invariant GEMM per weight it touches: a (row, token)
 * result is bitwise the same whatever the batch size or the row split. */
static void matmul_worker(void *arg, int ith, int nth)
{
    const struct matmul_job *j = arg;
    const long P = KERN_PANEL_ROWS;
    long lo, hi, base = 0;
    pool_range(j->rows, ith, nth, &lo, &hi); /* in panels */
    for (int i = 0; i < j->n_w && lo < hi; i++) {
        const struct kern_tensor *w = j->w[i];
        long np = ((long)w->ne1 + P - 1) / P;
        long p0 = lo > base ? lo - base : 0, p1 = hi - base < np ? hi - base : np;
        base += np;
        if (p0 >= p1)
            continue;
        long r0 = p0 * P, r1 = p1 * P < (long)w->ne1 ? p1 * P : (long)w->ne1;
        gemm_rows(j, w, r0, r1, (size_t)w->ne1, j->y[i]);
    }
}

/* Grows the 64-byte aligned scratch array *p to hold need elements of size sz; 0 when out of
 * memory (*p then unchanged). */
static int grow_to(void **p, size_t *cap, size_t need, size_t sz)
{
    if (need <= *cap)
        return 1;
    void *q = aligned_alloc(64, (need * sz + 63) / 64 * 64);
    if (!q)
        return 0;
    free(*p);
    *p = q;
    *cap = need;
    return 1;
}

/* grow_to for the forward pass, where kern_ops.reserve has sized every array already (a
 * caller that skipped it gets the memory now, counted in s->late; aborts when out of memory:
 * nothing sensible to do mid-forward). */
static void *grow(struct cpu_state *s, void *p, size_t *cap, size_t need, size_t sz)
{
    if (*cap < need)
        s->late++;
    if (!grow_to(&p, cap, need, sz))
        abort();
    return p;
}

/* The matmul input pass: in's element-wise steps, then the activations in the form the
 * GEMMs take (quantized blocks, or prep_x3 / prep_bf16 tiles), one 16-token group at a time
 * (the unit of the tile layouts) so each row is still in cache when it is prepared. */
struct in_job {
    const struct kern_cpu_fns *fn;  /* kernels */
    const struct kern_mm_in *in;    /* input and its steps */
    const float *src;               /* the GEMM's float input rows (in->xn or in->x) */
    int64_t n;                      /* elements per token */
    long n_tok;                     /* tokens */
    struct kern_q8 *xq;             /* q8 blocks, or NULL */
    struct kern_q16 *xq16;          /* q16 blocks, or NULL */
    void (*prep)(const float *x, size_t ldx, int64_t n_tok, int64_t n, void *xs); /* or NULL */
    size_t group_bytes;             /* prep's output for 16 tokens */
    void *xs;                       /* prep's output */
};

static void in_groups(void *arg, long lo, long hi)
{
    const struct in_job *j = arg;
    const struct kern_mm_in *in = j->in;
    const int64_t n = j->n, nb = n / KERN_QK;
    long t0 = lo * 16, t1 = hi * 16 < j->n_tok ? hi * 16 : j->n_tok;
    for (long t = t0; t < t1; t++) {
        float *x = in->x + (size_t)t * (size_t)n;
        if (in->add) {
            const float *a = in->add + (size_t)t * (size_t)n;
            for (int64_t i = 0; i < n; i++)
                x[i] += a[i];
        }
        if (in->norm)
            j->fn->rmsnorm(x, in->norm, in->xn + (size_t)t * (size_t)n, (int)n, in->eps);
        else if (in->up && in->glu == KERN_GLU_GELU)
            j->fn->geglu(x, in->up + (size_t)t * (size_t)n, n);
        else if (in->up)
            j->fn->swiglu(x, in->up + (size_t)t * (size_t)n, n);
        const float *r = j->src + (size_t)t * (size_t)n;
        if (j->xq16)
            j->fn->quantize_q16(r, j->xq16 + (size_t)t * (size_t)nb, n);
        else if (j->xq)
            j->fn->quantize_q8(r, j->xq + (size_t)t * (size_t)nb, n);
    }
    if (j->prep)
        j->prep(j->src + (size_t)t0 * (size_t)n, (size_t)n, t1 - t0, n,
                (char *)j->xs + (size_t)lo * j->group_bytes);
}

/* The input pass of a matmul of w[0 .. n_w) (in's steps, the activations prepared for the
 * GEMMs); *jp is then what matmul_worker takes (outputs y). */
static void mm_input(struct cpu_state *s, const struct kern_tensor *const *w, float *const *y,
                     int n_w, const struct kern_mm_in *in, int n_tok, struct matmul_job *jp)
{
    const int64_t n = w[0]->ne0;
    const float *src = in->norm ? in->xn : in->x;
    struct matmul_job j = {s->fn, w, y, n_w, 0, src, NULL, NULL, NULL, NULL, n_tok};
    struct in_job ij = {s->fn, in, src, n, n_tok, NULL, NULL, NULL, 0, NULL};
    int quant = 0; /* some weight takes quantized activations (float weight types do not) */
    int x3 = 0;    /* some weight takes split activations */
    int bf = 0;    /* some weight takes bf16 activations */
    for (int i = 0; i < n_w; i++) {
        j.rows += ((long)w[i]->ne1 + KERN_PANEL_ROWS - 1) / KERN_PANEL_ROWS;
        quant |= (s->act == KERN_ACT_Q8 && s->fn->gemm_q8[w[i]->type] != NULL) ||
                 (s->act == KERN_ACT_Q16 && s->fn->gemm_q16[w[i]->type] != NULL);
        x3 |= s->act == KERN_ACT_F32 && w[i]->packed && s->fn->gemm_x3_packed[w[i]->type] != NULL;
        bf |= s->act == KERN_ACT_BF16 && w[i]->packed &&
              s->fn->gemm_bf16_packed[w[i]->type] != NULL;
    }
    if (quant) {
        size_t need = (size_t)n_tok * (size_t)(n / KERN_QK);
        if (s->act == KERN_ACT_Q16)
            j.xq16 = ij.xq16 = s->xq16 = grow(s, s->xq16, &s->xq16_cap, need, sizeof(*s->xq16));
        else
            j.xq = ij.xq = s->xq = grow(s, s->xq, &s->xq_cap, need, sizeof(*s->xq));
    }
    if (x3 || bf) {
        ij.prep = bf ? s->fn->prep_bf16 : s->fn->prep_x3;
        ij.group_bytes = bf ? KERN_BF16_BYTES(16, n) : KERN_X3_BYTES(16, n);
        ij.xs = s->xs =
            grow(s, s->xs, &s->xs_cap, bf ? KERN_BF16_BYTES(n_tok, n) : KERN_X3_BYTES(n_tok, n), 1);
        if (bf)
            j.xb = ij.xs;
        else
            j.xs = ij.xs;
    }
    if (quant || x3 || bf || in->add || in->norm || in->up) {
        long groups = (n_tok + 15) / 16;
        if (groups > 1)
            parallel_ranges(s, groups, in_groups, &ij);
        else /* one group: not worth waking the pool */
            in_groups(&ij, 0, 1);
    }
    *jp = j;
}

static void cpu_matmul(struct kern_backend *b, const struct kern_tensor *const *w,
                       float *const *y, int n_w, const struct kern_mm_in *in, int n_tok)
{
    struct cpu_state *s = st_of(b);
    struct matmul_job j;
    mm_input(s, w, y, n_w, in, n_tok, &j);
    pool_run(s->pool, matmul_worker, &j);
}

/* bf16 mode's greedy output projection: each thread keeps per-token bests over its even share
 * of the panels (increasing rows), merged in thread order so ties keep the lowest row. */
struct argmax_job {
    const struct kern_cpu_fns *fn;
    const struct kern_tensor *w;
    const void *xb;  /* prep_bf16 of the input */
    int n_tok;
    float *bv;       /* nth x n_tok best values */
    int32_t *bi;     /* nth x n_tok their rows */
};

static void argmax_worker(void *arg, int ith, int nth)
{
    const struct argmax_job *j = arg;
    const struct kern_tensor *w = j->w;
    float *bv = j->bv + (size_t)ith * (size_t)j->n_tok;
    int32_t *bi = j->bi + (size_t)ith * (size_t)j->n_tok;
    for (int t = 0; t < j->n_tok; t++) {
        bv[t] = -1.0f / 0.0f;
        bi[t] = 0;
    }
    long lo, hi;
    pool_range((w->ne1 + KERN_PANEL_ROWS - 1) / KERN_PANEL_ROWS, ith, nth, &lo, &hi);
    if (lo >= hi)
        return;
    long r0 = lo * KERN_PANEL_ROWS, r1 = hi * KERN_PANEL_ROWS < (long)w->ne1 ? hi * KERN_PANEL_ROWS
                                                                           : (long)w->ne1;
    j->fn->gemm_bf16_argmax[w->type]((const char *)w->packed + (size_t)lo * w->packed_panel,
                                     r1 - r0, j->xb, j->n_tok, w->ne0, r0, bv, bi);
}

static int cpu_matmul_argmax(struct kern_backend *b, const struct kern_tensor *w,
                             const struct kern_mm_in *in, int n_tok, int32_t *ids)
{
    struct cpu_state *s = st_of(b);
    if (s->act != KERN_ACT_BF16 || !w->packed || !s->fn->gemm_bf16_argmax[w->type] ||
        !s->fn->gemm_bf16_packed[w->type] || w->ne1 > INT32_MAX)
        return 0;
    struct matmul_job j;
    float *const y[1] = {NULL}; /* no outputs: the epilogue replaces the stores */
    mm_input(s, &w, y, 1, in, n_tok, &j);
    const int nth = pool_size(s->pool);
    size_t need = (size_t)nth * (size_t)n_tok;
    struct argmax_job aj = {s->fn, w, j.xb, n_tok, NULL, NULL};
    aj.bv = s->bv = grow(s, s->bv, &s->bv_cap, need, sizeof(*s->bv));
    aj.bi = s->bi = grow(s, s->bi, &s->bi_cap, need, sizeof(*s->bi));
    pool_run(s->pool, argmax_worker, &aj);
    for (int t = 0; t < n_tok; t++) {
        float best = aj.bv[t];
        ids[t] = aj.bi[t];
        for (int th = 1; th < nth; th++)
            if (aj.bv[(size_t)th * (size_t)n_tok + (size_t)t] > best) {
                best = aj.bv[(size_t)th * (size_t)n_tok + (size_t)t];
                ids[t] = aj.bi[(size_t)th * (size_t)n_tok + (size_t)t];
            }
    }
    return 1;
}

/* matmul_hook: each thread takes an even share of the KERN_HOOK_ROWS-row ranges, in order, and
 * runs one GEMM over as many of them as fill HOOK_L2_BYTES of its own compact block (token t's
 * values at t * ld, ld = the call's rows), then the hook on each range. The block stays in L2:
 * rows of the logits themselves lie n_vocab floats apart, a stride that maps every token's
 * piece of a range to the same few L2 sets (49,152 floats = 3 * 2^16 bytes), so they would not. */
#define HOOK_L2_BYTES (1u << 20)

/* Ranges per GEMM call for n_tok tokens; a thread's block is n_tok * KERN_HOOK_ROWS * that
 * floats, at most hook_block_max(n_tok). */
static long hook_step(int n_tok)
{
    const size_t range_bytes = (size_t)n_tok * KERN_HOOK_ROWS * sizeof(float);
    return range_bytes < HOOK_L2_BYTES ? (long)(HOOK_L2_BYTES / range_bytes) : 1;
}

/* The most floats a thread's block takes for up to max_tok tokens. */
static size_t hook_block_max(int max_tok)
{
    const size_t range = (size_t)max_tok * KERN_HOOK_ROWS, l2 = HOOK_L2_BYTES / sizeof(float);
    return range > l2 ? range : l2;
}

struct hook_job {
    struct matmul_job mm;
    float *blk; /* per thread: blk_floats of scratch */
    size_t blk_floats;
    long step; /* ranges per GEMM call */
    void (*hook)(void *ctx, int ith, int64_t r0, int64_t r1, float *blk, size_t ld);
    void *ctx;
};

static void hook_worker(void *arg, int ith, int nth)
{
    const struct hook_job *h = arg;
    const struct kern_tensor *w = h->mm.w[0];
    const long ne1 = (long)w->ne1;
    _Static_assert(KERN_HOOK_ROWS % KERN_PANEL_ROWS == 0, "hook ranges are whole panels");
    float *blk = h->blk + (size_t)ith * h->blk_floats;
    long lo, hi;
    pool_range((ne1 + KERN_HOOK_ROWS - 1) / KERN_HOOK_ROWS, ith, nth, &lo, &hi);
    for (long c0 = lo; c0 < hi; c0 += h->step) {
        const long c1 = hi - c0 < h->step ? hi : c0 + h->step;
        const long r0 = c0 * KERN_HOOK_ROWS,
                   r1 = ne1 < c1 * KERN_HOOK_ROWS ? ne1 : c1 * KERN_HOOK_ROWS;
        const size_t ld = (size_t)(r1 - r0);
        gemm_rows(&h->mm, w, r0, r1, ld, blk - r0);
        for (long r = r0; r < r1; r += KERN_HOOK_ROWS)
            h->hook(h->ctx, ith, r, r1 - r < KERN_HOOK_ROWS ? r1 : r + KERN_HOOK_ROWS,
                    blk + (r - r0), ld);
    }
}

static int cpu_matmul_hook(
    struct kern_backend *b, const struct kern_tensor *w, const struct kern_mm_in *in, int n_tok,
    void (*hook)(void *ctx, int ith, int64_t r0, int64_t r1, float *blk, size_t ld), void *ctx)
{
    struct cpu_state *s = st_of(b);
    struct hook_job h = {.hook = hook, .ctx = ctx, .step = hook_step(n_tok)};
    h.blk_floats = (size_t)n_tok * KERN_HOOK_ROWS * (size_t)h.step;
    const size_t nth = (size_t)pool_size(s->pool);
    h.blk = s->hb = grow(s, s->hb, &s->hb_cap, nth * h.blk_floats, sizeof(float));
    mm_input(s, &w, NULL, 1, in, n_tok, &h.mm);
    pool_run(s->pool, hook_worker, &h);
    return 1;
}

/* bf16 mode's fused gate/up GEMM + SwiGLU: threads take even shares of the panel pairs. */
struct swiglu_job {
    const struct kern_cpu_fns *fn;
    const struct kern_tensor *gate, *up;
    const void *xb;   /* prep_bf16 of the FFN input */
    void *h;          /* prep_bf16 of silu(gate) * up, the down projection's input */
    int n_tok;
};

static void swiglu_worker(void *arg, int ith, int nth)
{
    const struct swiglu_job *j = arg;
    const struct kern_tensor *g = j->gate;
    long lo, hi;
    pool_range(g->ne1 / KERN_PANEL_ROWS, ith, nth, &lo, &hi);
    if (lo < hi)
        j->fn->gemm_bf16_swiglu[g->type]((const char *)g->packed + (size_t)lo * g->packed_panel,
                                         (const char *)j->up->packed +
                                             (size_t)lo * j->up->packed_panel,
                                         (hi - lo) * KERN_PANEL_ROWS, j->xb, j->n_tok, g->ne0,
                                         j->h, lo * KERN_PANEL_ROWS, (size_t)g->ne1);
}

static void cpu_ffn(struct kern_backend *b, const struct kern_tensor *gate,
                    const struct kern_tensor *up, const struct kern_tensor *down,
                    const struct kern_mm_in *in, int glu, float *y, float *gate_buf,
                    float *up_buf, int n_tok)
{
    struct cpu_state *s = st_of(b);
    const struct kern_tensor *gu[2] = {gate, up};
    float *const guy[2] = {gate_buf, up_buf};
    if (s->act != KERN_ACT_BF16 || glu != KERN_GLU_SILU || !gate->packed || !up->packed || !down->packed ||
        gate->type != up->type || !s->fn->gemm_bf16_swiglu[gate->type] ||
        !s->fn->gemm_bf16_packed[down->type] || gate->ne1 != up->ne1 || gate->ne0 != up->ne0 ||
        gate->ne1 % KERN_QK || down->ne0 != gate->ne1) {
        const struct kern_mm_in down_in = {.x = gate_buf, .up = up_buf, .glu = glu};
        cpu_matmul(b, gu, guy, 2, in, n_tok);
        cpu_matmul(b, &down, &y, 1, &down_in, n_tok);
        return;
    }
    struct matmul_job j;
    mm_input(s, gu, guy, 2, in, n_tok, &j);
    struct swiglu_job sj = {s->fn, gate, up, j.xb, NULL, n_tok};
    sj.h = s->xh = grow(s, s->xh, &s->xh_cap, KERN_BF16_BYTES(n_tok, gate->ne1), 1);
    pool_run(s->pool, swiglu_worker, &sj);
    const long down_panels = (down->ne1 + KERN_PANEL_ROWS - 1) / KERN_PANEL_ROWS;
    struct matmul_job jd = {s->fn, &down, &y, 1, down_panels, NULL, NULL, NULL, NULL, sj.h, n_tok};
    pool_run(s->pool, matmul_worker, &jd);
}

/* Q5_0 rows as Q8_0 (the same scale; quants -16..15 fit a byte): every weight the same value,
 * so the products are too, and they run on the packed Q8_0 GEMMs (Q5_0 has none; Gemma 3's
 * Q4_K_M file keeps most of its matrices in it). 34 bytes per block instead of 22. */
static int widens(const struct cpu_state *s, const struct kern_tensor *w)
{
    struct kern_tensor q8 = *w;
    q8.type = DTYPE_Q8_0;
    return w->type == DTYPE_Q5_0 && !w->widened && packs(s, &q8);
}

static enum status widen_q5_0(struct kern_tensor *w, struct err_detail *err)
{
    const size_t rb = dtype_row_bytes(DTYPE_Q8_0, w->ne0), nb = (size_t)(w->ne0 / 32);
    uint8_t *d = malloc(rb * (size_t)w->ne1);
    if (!d)
        return err_set(err, ST_ERR_NOMEM, "no memory to widen a Q5_0 matrix");
    for (int64_t r = 0; r < w->ne1; r++) {
        const struct kern_block_q5_0 *src =
            (const void *)((const uint8_t *)w->data + (size_t)r * w->row_bytes);
        struct kern_block_q8_0 *dst = (void *)(d + (size_t)r * rb);
        for (size_t k = 0; k < nb; k++) {
            uint32_t qh;
            memcpy(&qh, src[k].qh, 4);
            dst[k].d = src[k].d;
            for (int j = 0; j < 32; j++) {
                const int lo = j < 16 ? src[k].qs[j] & 0xF : src[k].qs[j - 16] >> 4;
                dst[k].qs[j] = (int8_t)((lo | (int)((qh >> j) & 1) << 4) - 16);
            }
        }
    }
    w->widened = d;
    w->data = d;
    w->type = DTYPE_Q8_0;
    w->row_bytes = rb;
    return ST_OK;
}

/* Weights the active matmul mode reads through a packed GEMM are packed once here (Q5_0 ones
 * first widened to Q8_0, widen_q5_0). */
static enum status cpu_prepare(struct kern_backend *b, struct kern_tensor *w,
                               struct err_detail *err)
{
    struct cpu_state *s = st_of(b);
    const int act = (int)s->act;
    enum status st;
    if (widens(s, w) && (st = widen_q5_0(w, err)))
        return st;
    if (w->packed || !packs(s, w))
        return ST_OK;
    size_t bytes = s->fn->panel_bytes(w->type, w->ne1, w->ne0, act);
    if (!bytes)
        return ST_OK;
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p)
        return err_set(err, ST_ERR_NOMEM, "no memory for %zu bytes of packed weights", bytes);
    s->fn->panel_pack(w->type, w->data, w->row_bytes, w->ne1, w->ne0, p);
    w->packed = p;
    w->packed_panel = s->fn->panel_bytes(w->type, KERN_PANEL_ROWS, w->ne0, act);
    return ST_OK;
}

static void cpu_release(struct kern_backend *b, struct kern_tensor *w)
{
    (void)b;
    free(w->packed);
    free(w->widened); /* data pointed at it: the tensor is not used after release */
    w->packed = NULL;
    w->packed_panel = 0;
    w->widened = NULL;
}

static void cpu_get_rows(struct kern_backend *b, const struct kern_tensor *w, const int32_t *ids,
                         int n, float *out)
{
    struct cpu_state *s = st_of(b);
    for (int i = 0; i < n; i++)
        s->fn->dequant_row[w->type]((const char *)w->data + (size_t)ids[i] * w->row_bytes,
                                    out + (size_t)i * w->ne0, w->ne0);
}

struct rope_ctx {
    const struct kern_cpu_fns *fn; /* kernels */
    float *x;        /* n_tok x n_head x head_dim */
    const float *cs; /* n_tok x rot_dim: cos, sin per pair */
    int n_head, head_dim, rot_dim, neox;
};

static void rope_rows(void *arg, long lo, long hi)
{
    const struct rope_ctx *c = arg;
    for (long t = lo; t < hi; t++)
        (c->neox ? kern_ref_rope_neox : c->fn->rope)(c->x + (size_t)t * c->n_head * c->head_dim,
                                                     c->cs + (size_t)t * c->rot_dim, c->n_head,
                                                     c->head_dim, c->rot_dim);
}

static void cpu_rope(struct kern_backend *b, float *x, const float *cs, int n_tok, int n_head,
                     int head_dim, int rot_dim, int neox)
{
    struct rope_ctx c = {st_of(b)->fn, x, cs, n_head, head_dim, rot_dim, neox};
    parallel_ranges(st_of(b), n_tok, rope_rows, &c);
}

/* Row-wise ops of the other architectures (biases, QK- and post-norms, embedding scale). */
struct rows_ctx {
    const struct kern_cpu_fns *fn;
    float *x;       /* n_rows x width */
    const float *w; /* width: bias or norm weights */
    int width;
    float eps;
};

static void bias_rows(void *arg, long lo, long hi)
{
    const struct rows_ctx *c = arg;
    for (long r = lo; r < hi; r++)
        for (int i = 0; i < c->width; i++)
            c->x[(size_t)r * (size_t)c->width + (size_t)i] += c->w[i];
}

static void cpu_add_rows(struct kern_backend *b, float *y, const float *bias, long n_rows, int width)
{
    struct rows_ctx c = {st_of(b)->fn, y, bias, width, 0.0f};
    parallel_ranges(st_of(b), n_rows, bias_rows, &c);
}

static void norm_rows(void *arg, long lo, long hi)
{
    const struct rows_ctx *c = arg;
    for (long r = lo; r < hi; r++) {
        float *x = c->x + (size_t)r * (size_t)c->width;
        c->fn->rmsnorm(x, c->w, x, c->width, c->eps);
    }
}

static void cpu_norm_rows(struct kern_backend *b, float *x, const float *w, long n_rows,
                          int width, float eps)
{
    struct rows_ctx c = {st_of(b)->fn, x, w, width, eps};
    parallel_ranges(st_of(b), n_rows, norm_rows, &c);
}

static void cpu_scale(struct kern_backend *b, float *x, float s, long n)
{
    (void)b;
    for (long i = 0; i < n; i++)
        x[i] *= s;
}

/* Element-wise ops are split in chunks of EW_CHUNK elements. */
#define EW_CHUNK 4096

struct ew_ctx {
    const struct kern_cpu_fns *fn; /* kernels */
    float *y;       /* y */
    const float *x; /* x */
    long n;         /* elements */
};

static void add_chunks(void *arg, long lo, long hi)
{
    const struct ew_ctx *c = arg;
    long e = hi * EW_CHUNK < c->n ? hi * EW_CHUNK : c->n;
    for (long i = lo * EW_CHUNK; i < e; i++)
        c->y[i] += c->x[i];
}

static void cpu_add(struct kern_backend *b, float *y, const float *x, long n)
{
    struct ew_ctx c = {st_of(b)->fn, y, x, n};
    parallel_ranges(st_of(b), (n + EW_CHUNK - 1) / EW_CHUNK, add_chunks, &c);
}

/* Token t's keys go channel-major into its block's tiles, values token-major (layout in
 * struct kern_kv_layer): rounded to half by the table's to_f16, or quantized to 8 bits by
 * kern_kv_quant_q8 with the token's scale after the tile's quants. */
struct kv_store_job {
    const struct kern_cpu_fns *fn;
    struct kern_kv_layer kv;
    const struct kern_block_table *bt;
    const int32_t *pos;
    int block_size, n_kv_head, head_dim;
    const float *k, *v;
    int n_tok;
    const uint8_t *skip; /* tokens to leave out, or NULL */
    long n_store;        /* tokens not skipped */
};

/* Token row kr / vr (KV head g) into its slot of the pool: position pos of the sequence whose
 * block table is table. */
static void kv_store_head(const struct kern_cpu_fns *fn, struct kern_kv_layer kv,
                          const int32_t *table, int32_t pos, int B, int n_kv_head, int D, int g,
                          const float *kr, const float *vr)
{
    const size_t tb = KERN_KV_TILE_BYTES(kv.dtype, B, D);
    const int32_t blk = table[pos / B], i = pos % B;
    const size_t tile = (size_t)blk * (size_t)n_kv_head + (size_t)g;
    uint8_t *kt = (uint8_t *)kv.k + tile * tb, *vt = (uint8_t *)kv.v + tile * tb;
    if (kv.dtype == KERN_KV_Q8) {
        int8_t kq[KERN_MAX_HEAD_DIM];
        float ks, vs;
        fn->kv_quant_q8(kr, D, kq, &ks);
        for (int c = 0; c < D; c++)
            ((int8_t *)kt)[(size_t)c * B + i] = kq[c];
        fn->kv_quant_q8(vr, D, (int8_t *)vt + (size_t)i * D, &vs);
        memcpy(kt + (size_t)D * B + 4 * (size_t)i, &ks, sizeof ks);
        memcpy(vt + (size_t)D * B + 4 * (size_t)i, &vs, sizeof vs);
    } else if (kv.dtype == KERN_KV_BF16T) {
        fn->kv_store_tiles(kr, vr, (uint16_t *)kt, (uint16_t *)vt, B, D, i);
    } else {
        uint16_t kh[KERN_MAX_HEAD_DIM];
        fn->to_f16(kr, kh, D);
        for (int c = 0; c < D; c++)
            ((uint16_t *)kt)[(size_t)c * B + i] = kh[c];
        fn->to_f16(vr, (uint16_t *)vt + (size_t)i * D, D);
    }
}

/* Tokens split evenly between threads: every token writes its own slots. */
static void kv_store_worker(void *arg, int ith, int nth)
{
    const struct kv_store_job *j = arg;
    const int D = j->head_dim, kv_dim = j->n_kv_head * j->head_dim;
    long lo, hi, k = 0; /* an even share of the tokens stored (skipped ones are not counted) */
    pool_range(j->n_store, ith, nth, &lo, &hi);
    for (long t = 0; t < j->n_tok && k < hi; t++) {
        if (j->skip && j->skip[t])
            continue;
        if (k++ < lo)
            continue;
        for (int g = 0; g < j->n_kv_head; g++)
            kv_store_head(j->fn, j->kv, kern_block_row(j->bt, (int)t), j->pos[t], j->block_size,
                          j->n_kv_head, D, g, j->k + (size_t)t * kv_dim + (size_t)g * D,
                          j->v + (size_t)t * kv_dim + (size_t)g * D);
    }
}

static void cpu_kv_store(struct kern_backend *b, struct kern_kv_layer kv,
                         const struct kern_block_table *bt, const int32_t *pos, int block_size,
                         int n_kv_head, int head_dim, const float *k, const float *v, int n_tok,
                         const uint8_t *skip)
{
    long n_store = n_tok;
    for (int t = 0; skip && t < n_tok; t++)
        n_store -= skip[t] != 0;
    if (n_store == 0)
        return;
    struct kv_store_job j = {st_of(b)->fn, kv, bt, pos, block_size, n_kv_head, head_dim,
                             k, v, n_tok, skip, n_store};
    if (n_store > 16)
        pool_run(st_of(b)->pool, kv_store_worker, &j);
    else /* a few tokens: not worth waking the pool */
        kv_store_worker(&j, 0, 1);
}

/* Token t's key and value rows of KV head g into the pool, as kern_attn.store defers them to
 * the attention pass. */
static void store_deferred(const struct kern_cpu_fns *fn, const struct kern_attn *a, int t, int g)
{
    const int KV = a->n_kv_head, D = a->head_dim;
    const size_t row = (size_t)t * (size_t)KV * (size_t)D + (size_t)g * (size_t)D;
    kv_store_head(fn, a->kv, kern_block_row(&a->bt, t), a->pos[t], a->block_size, KV, D, g,
                  a->k_new + row, a->v_new + row);
}

/* Work items are tokens, claimed one at a time from a shared counter: their cost grows with
 * the token's position, so a static split would leave threads idle. A token's KV heads run in
 * order on one thread. Items are claimed one ahead so each call can prefetch the next one's
 * first blocks while it ends. Which thread runs an item never changes its result. */
struct attn_job {
    const struct kern_attn *a;     /* arguments */
    const struct kern_cpu_fns *fn; /* kernels */
    long n_items;                  /* n_tok */
    long next;                     /* next unclaimed item (atomic) */
};

static void attn_worker(void *arg, int ith, int nth)
{
    (void)ith;
    (void)nth;
    struct attn_job *j = arg;
    const int KV = j->a->n_kv_head;
    const struct kern_attn *a = j->a;
    /* the next item is claimed as this one's last KV head starts, so that call knows it (for
     * its prefetches) while no item waits on a busy thread longer than one head */
    long t = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    int cold = 1;
    while (t < j->n_items) {
        long tn = -1;
        for (int g = 0; g < KV; g++) {
            if (a->store && a->store[t])
                store_deferred(j->fn, a, (int)t, g);
            if (g + 1 < KV) {
                j->fn->attn_group(a, (int)t, g, (int)t, g + 1, cold);
            } else {
                tn = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
                j->fn->attn_group(a, (int)t, g, tn < j->n_items ? (int)tn : -1, 0, cold);
            }
            cold = 0;
        }
        t = tn;
    }
}

/* bf16 mode's attention on the AMX tiles (kern_cpu_fns.attn_tiles) over a KERN_KV_BF16T pool,
 * which kv_alloc picks in that mode. Items are runs of consecutive tokens of one sequence in
 * the batch, at consecutive positions (a prefill chunk, a speculative step's tokens, a decode
 * token), at most TILE_ITEM_ROWS query rows each, so that each tile load of keys and values serves
 * many rows. Items are claimed from a shared counter, the costliest first; an item's KV heads run
 * in order on one thread. Which thread runs an item never changes its result. */
#define TILE_ITEM_ROWS 128

struct tile_item {
    int32_t first, n; /* tokens [first, first + n) of the batch */
    int32_t stored;   /* 1: its deferred stores are done (its sequence has several items) */
    int64_t cost;     /* rows x positions: the order of the work */
};

struct tile_job {
    const struct kern_attn *a;
    const struct kern_cpu_fns *fn;
    const struct tile_item *items;
    const int32_t *toks; /* 0 .. n_tok - 1 */
    char *ws;            /* per-thread workspaces of ws_bytes */
    size_t ws_bytes;
    long n_units; /* items */
    long next;    /* next unclaimed unit (atomic) */
};

static int tile_item_cmp(const void *x, const void *y)
{
    const struct tile_item *a = x, *b = y;
    return a->cost != b->cost ? (a->cost < b->cost ? 1 : -1)
                              : (a->first > b->first) - (a->first < b->first);
}

static void tile_worker(void *arg, int ith, int nth)
{
    (void)nth;
    struct tile_job *j = arg;
    const struct kern_attn *a = j->a;
    const int KV = a->n_kv_head;
    /* an item's KV heads run in order on one thread (their tiles are neighbours in the pool);
     * the next item is claimed as this one's last head starts, so that call can prefetch its
     * first keys */
    long u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    int cold = 1;
    while (u < j->n_units) {
        const struct tile_item *it = &j->items[u];
        long un = -1;
        for (int g = 0; g < KV; g++) {
            struct kern_tiles_next nx = {j->toks + it->first, it->n, g + 1, cold};
            if (g + 1 == KV) {
                un = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
                nx.n = 0;
                if (un < j->n_units) {
                    nx.toks = j->toks + j->items[un].first;
                    nx.n = j->items[un].n;
                    nx.g = 0;
                }
            }
            for (int32_t t = it->first; a->store && !it->stored && t < it->first + it->n; t++)
                if (a->store[t])
                    store_deferred(j->fn, a, t, g);
            j->fn->attn_tiles(a, j->toks + it->first, it->n, g, j->ws + (size_t)ith * j->ws_bytes,
                              &nx);
            cold = 0;
        }
        u = un;
    }
}

/* attn_tiles' workspace rounded to whole cache lines, for keys from position lo to hi. */
static size_t tiles_ws_bytes(int head_dim, int32_t lo, int32_t hi)
{
    const size_t b =
        KERN_ATTN_TILES_BYTES(head_dim, hi / KERN_ATTN_TILE_KEYS - lo / KERN_ATTN_TILE_KEYS + 1);
    return (b + 63) / 64 * 64;
}

static void attention_tiles(struct cpu_state *s, const struct kern_attn *a)
{
    const int G = a->n_head / a->n_kv_head;
    const int per = TILE_ITEM_ROWS / G > 1 ? TILE_ITEM_ROWS / G : 1; /* tokens per item */
    s->items = grow(s, s->items, &s->items_cap, (size_t)a->n_tok * 2, sizeof(*s->items));
    int32_t *toks = (int32_t *)(s->items + a->n_tok); /* n_tok ids after the items */
    size_t n_items = 0, ws = 0, chain = 0; /* chain: the first item of the current sequence */
    for (int t = 0; t < a->n_tok;) {
        struct tile_item *it = &s->items[n_items++];
        int32_t lo = INT32_MAX, hi = -1;
        it->first = t;
        it->stored = 0;
        do {
            toks[t] = t;
            const int32_t f = kern_attn_first(a, t);
            lo = f < lo ? f : lo;
            hi = a->pos[t] > hi ? a->pos[t] : hi;
            t++;
        } while (t < a->n_tok && t - it->first < per && a->bt.row[t] == a->bt.row[t - 1] &&
                 a->pos[t] == a->pos[t - 1] + 1); /* (a window's keys: between its tokens') */
        it->n = t - it->first;
        it->cost = (int64_t)it->n * (hi - lo + 1);
        const size_t need = tiles_ws_bytes(a->head_dim, lo, hi);
        ws = need > ws ? need : ws;
        const int more = t < a->n_tok && a->bt.row[t] == a->bt.row[t - 1] &&
                         a->pos[t] == a->pos[t - 1] + 1; /* the next item goes on with it */
        if (!more && n_items - chain > 1 && a->store) {
            /* A sequence cut in several items: its other items read (with weight 0) the whole
             * key blocks around the slots its last token's deferred store writes, so those stores
             * are done before any thread reads. */
            for (size_t i = chain; i < n_items; i++) {
                s->items[i].stored = 1;
                for (int32_t u = s->items[i].first; u < s->items[i].first + s->items[i].n; u++)
                    for (int g = 0; a->store[u] && g < a->n_kv_head; g++)
                        store_deferred(s->fn, a, u, g);
            }
        }
        if (!more)
            chain = n_items;
    }
    qsort(s->items, n_items, sizeof(*s->items), tile_item_cmp);
    const int nth = pool_size(s->pool);
    s->aw = grow(s, s->aw, &s->aw_cap, ws * (size_t)nth, 1);
    struct tile_job j = {a, s->fn, s->items, toks, s->aw, ws, (long)n_items, 0};
    pool_run(s->pool, tile_worker, &j);
}

static void cpu_attention(struct kern_backend *b, const struct kern_attn *a)
{
    struct cpu_state *s = st_of(b);
    if (a->kv.dtype == KERN_KV_BF16T) {
        attention_tiles(s, a);
        return;
    }
    struct attn_job j = {a, s->fn, (long)a->n_tok, 0};
    pool_run(s->pool, attn_worker, &j);
}

/* Rows are copied in parallel chunks of rows. */
struct gather_ctx {
    float *dst;         /* n x width */
    const float *src;   /* rows */
    const int32_t *idx; /* source row of each destination row */
    long width;         /* floats per row */
};

static void gather_rows(void *arg, long lo, long hi)
{
    const struct gather_ctx *c = arg;
    for (long i = lo; i < hi; i++)
        memcpy(c->dst + (size_t)i * (size_t)c->width,
               c->src + (size_t)c->idx[i] * (size_t)c->width, sizeof(float) * (size_t)c->width);
}

static void cpu_gather(struct kern_backend *b, float *dst, const float *src, const int32_t *idx,
                       int n, long width)
{
    struct gather_ctx c = {dst, src, idx, width};
    if ((long)n * width < 65536)
        gather_rows(&c, 0, n);
    else
        parallel_ranges(st_of(b), n, gather_rows, &c);
}

/* The experts' sum: threads take ranges of 16-float columns and run every row in order. */
struct moe_add_ctx {
    float *y;
    const float *x;
    const int32_t *rows;
    const float *w;
    int n;
    long width;
};

static void moe_add_cols(void *arg, long lo, long hi)
{
    const struct moe_add_ctx *c = arg;
    const long c0 = lo * 16, c1 = hi * 16 < c->width ? hi * 16 : c->width;
    for (int i = 0; i < c->n; i++) {
        const int32_t r = c->rows[i];
        float *y = c->y + (size_t)(r < 0 ? ~r : r) * (size_t)c->width;
        const float *x = c->x + (size_t)i * (size_t)c->width, w = c->w[i];
        if (r < 0)
            for (long j = c0; j < c1; j++)
                y[j] = w * x[j];
        else
            for (long j = c0; j < c1; j++) {
                const float p = w * x[j];
                y[j] += p;
            }
    }
}

static void cpu_moe_add(struct kern_backend *b, float *y, const float *x, const int32_t *rows,
                        const float *w, int n, long width)
{
    struct moe_add_ctx c = {y, x, rows, w, n, width};
    const long cols = (width + 15) / 16;
    if ((long)n * width < 65536)
        moe_add_cols(&c, 0, cols);
    else
        parallel_ranges(st_of(b), cols, moe_add_cols, &c);
}

/* Backend memory is host memory: 64-byte aligned heap blocks, moved with memcpy. */
static void *cpu_buf_alloc(struct kern_backend *b, size_t bytes)
{
    (void)b;
    return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64 * (bytes == 0));
}

static void cpu_buf_free(struct kern_backend *b, void *p)
{
    (void)b;
    free(p);
}

static void cpu_memcpy(struct kern_backend *b, void *dst, const void *src, size_t bytes)
{
    (void)b;
    if (bytes)
        memmove(dst, src, bytes);
}

static void cpu_sync(struct kern_backend *b)
{
    (void)b;
}

static size_t cpu_kv_block_bytes(struct kern_backend *b, const struct kern_kv_desc *d)
{
    (void)b;
    return (size_t)d->n_layer * 2 * (size_t)d->n_kv_head *
           KERN_KV_TILE_BYTES(d->dtype, d->block_size, d->head_dim);
}

/* One mapping for the keys of every layer and one for the values: page aligned, so tiles start
 * on cache lines, zeroed, and only resident once touched (peak RSS counts the blocks used). */
static enum status cpu_kv_alloc(struct kern_backend *b, const struct kern_kv_desc *d,
                                int32_t n_blocks, struct kern_kv_layer *layers,
                                struct err_detail *err)
{
    const size_t tb = KERN_KV_TILE_BYTES(d->dtype, d->block_size, d->head_dim);
    if (n_blocks < 1 || (size_t)n_blocks > SIZE_MAX / tb / (size_t)d->n_kv_head / 2 /
                                               (size_t)d->n_layer)
        return err_set(err, ST_ERR_INVALID_ARG, "bad KV pool size (%d blocks)", (int)n_blocks);
    const size_t per_layer = (size_t)n_blocks * (size_t)d->n_kv_head * tb;
    const size_t bytes = per_layer * (size_t)d->n_layer;
    void *k = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void *v = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (k == MAP_FAILED || v == MAP_FAILED) {
        if (k != MAP_FAILED)
            munmap(k, bytes);
        if (v != MAP_FAILED)
            munmap(v, bytes);
        return err_set(err, ST_ERR_NOMEM,
                       "no memory for a KV pool of 2 x %zu bytes (lower --kv-mem)", bytes);
    }
    for (int l = 0; l < d->n_layer; l++) {
        layers[l].k = (uint8_t *)k + (size_t)l * per_layer;
        layers[l].v = (uint8_t *)v + (size_t)l * per_layer;
        layers[l].dtype = d->dtype;
        if (st_of(b)->attn_tiles && d->dtype == KERN_KV_F16 && d->block_size % 16 == 0 &&
            d->head_dim % 32 == 0 && d->head_dim <= KERN_MAX_HEAD_DIM)
            layers[l].dtype = KERN_KV_BF16T; /* the tile unit's layout (kernels.h) */
    }
    if (layers[0].dtype == KERN_KV_BF16T && d->head_dim > st_of(b)->tile_hd)
        st_of(b)->tile_hd = d->head_dim; /* for reserve's workspace */
    return ST_OK;
}

static void cpu_kv_free(struct kern_backend *b, const struct kern_kv_desc *d, int32_t n_blocks,
                        struct kern_kv_layer *layers)
{
    (void)b;
    if (!layers || !layers[0].k)
        return;
    const size_t bytes = (size_t)n_blocks * (size_t)d->n_kv_head *
                         KERN_KV_TILE_BYTES(d->dtype, d->block_size, d->head_dim) *
                         (size_t)d->n_layer;
    munmap(layers[0].k, bytes);
    munmap(layers[0].v, bytes);
    for (int l = 0; l < d->n_layer; l++)
        layers[l].k = layers[l].v = NULL;
}



static void cpu_kv_copy(struct kern_backend *b, const struct kern_kv_desc *d,
                        const struct kern_kv_layer *layers, int32_t dst, int32_t src)
{
    (void)b;
    const size_t bb = (size_t)d->n_kv_head * KERN_KV_TILE_BYTES(d->dtype, d->block_size,
                                                                 d->head_dim);
    for (int l = 0; l < d->n_layer; l++) {
        memcpy((uint8_t *)layers[l].k + (size_t)dst * bb,
               (const uint8_t *)layers[l].k + (size_t)src * bb, bb);
        memcpy((uint8_t *)layers[l].v + (size_t)dst * bb,
               (const uint8_t *)layers[l].v + (size_t)src * bb, bb);
    }
}

/* The int8 peak loop of the backend's table (or an AMX tile loop) on every thread at once. */
struct peak_job {
    const struct kern_cpu_fns *fn; /* kernels to measure; NULL = an AMX tile loop */
    int amx;                       /* with fn NULL: 1 = int8 tiles, 2 = bf16 tiles */
    double seconds;                /* per thread */
    double *ops;                   /* per-thread result */
};

static void peak_worker(void *arg, int ith, int nth)
{
    struct peak_job *j = arg;
    (void)nth;
    j->ops[ith] = j->fn           ? kern_cpu_int8_peak(j->fn, j->seconds)
                  : j->amx == 2 ? kern_cpu_amx_bf16_peak(j->seconds)
                                : kern_cpu_amx_int8_peak(j->seconds);
}

static int cpu_peaks(struct kern_backend *b, double seconds, struct kern_peak *out, int max)
{
    struct cpu_state *s = st_of(b);
    static const char *const names[3] = {"int8", "amx_int8", "amx_bf16"};
    const int nth = pool_size(s->pool);
    double *ops = calloc((size_t)nth, sizeof(*ops));
    int n = 0;
    for (int k = 0; k < 3 && n < max; k++) {
        double sum = 0;
        if (ops) {
            struct peak_job j = {k ? NULL : s->fn, k, seconds, ops};
            pool_run(s->pool, peak_worker, &j);
            for (int i = 0; i < nth; i++)
                sum += ops[i];
        }
        out[n].name = names[k];
        out[n++].ops = sum;
    }
    free(ops);
    return n;
}

/* Whether the active matmul mode reads w through a packed GEMM (prepare then packs it). */
static int packs(const struct cpu_state *s, const struct kern_tensor *w)
{
    if (!s->fn->panel_bytes || w->type >= DTYPE_COUNT)
        return 0;
    return s->act == KERN_ACT_Q16    ? s->fn->gemm_q16_packed[w->type] != NULL
           : s->act == KERN_ACT_Q8   ? s->fn->gemm_q8_packed[w->type] != NULL
           : s->act == KERN_ACT_BF16 ? s->fn->gemm_bf16_packed[w->type] != NULL
                                     : s->fn->gemm_f32_packed[w->type] != NULL;
}

static size_t cpu_weight_bytes(struct kern_backend *b, const struct kern_tensor *w)
{
    struct cpu_state *s = st_of(b);
    if (widens(s, w))
        return dtype_row_bytes(DTYPE_Q8_0, w->ne0) * (size_t)w->ne1 +
               s->fn->panel_bytes(DTYPE_Q8_0, w->ne1, w->ne0, (int)s->act);
    return packs(s, w) ? s->fn->panel_bytes(w->type, w->ne1, w->ne0, (int)s->act) : 0;
}

static void cpu_free(struct kern_backend *b);

/* Every scratch array at its largest for batches of max_tok tokens of rows up to max_width,
 * attention over up to max_pos positions of a sequence. */
static enum status cpu_reserve(struct kern_backend *b, int max_tok, int64_t max_width,
                               int32_t max_pos, struct err_detail *err)
{
    struct cpu_state *s = st_of(b);
    const size_t T = (size_t)max_tok, W = (size_t)max_width;
    const size_t nth = (size_t)pool_size(s->pool);
    size_t xs = KERN_BF16_BYTES(T, W) > KERN_X3_BYTES(T, W) ? KERN_BF16_BYTES(T, W)
                                                            : KERN_X3_BYTES(T, W);
    int ok = 1;
    if (s->act == KERN_ACT_Q8)
        ok = ok && grow_to((void **)&s->xq, &s->xq_cap, T * (W / KERN_QK), sizeof(*s->xq));
    if (s->act == KERN_ACT_Q16)
        ok = ok && grow_to((void **)&s->xq16, &s->xq16_cap, T * (W / KERN_QK), sizeof(*s->xq16));
    if (s->fn->prep_x3 || s->fn->prep_bf16) {
        ok = ok && grow_to(&s->xs, &s->xs_cap, xs, 1);
        ok = ok && grow_to(&s->xh, &s->xh_cap, KERN_BF16_BYTES(T, W), 1);
        ok = ok && grow_to((void **)&s->bv, &s->bv_cap, nth * T, sizeof(*s->bv));
        ok = ok && grow_to((void **)&s->bi, &s->bi_cap, nth * T, sizeof(*s->bi));
    }
    ok = ok && grow_to((void **)&s->hb, &s->hb_cap, nth * hook_block_max(max_tok), sizeof(*s->hb));
    if (s->tile_hd && max_pos > 0) { /* attention_tiles' items and workspaces */
        ok = ok && grow_to((void **)&s->items, &s->items_cap, T * 2, sizeof(*s->items));
        ok = ok && grow_to(&s->aw, &s->aw_cap, nth * tiles_ws_bytes(s->tile_hd, 0, max_pos - 1), 1);
    }
    return ok ? ST_OK
              : err_set(err, ST_ERR_NOMEM, "no memory for the CPU kernels' scratch (%d tokens)",
                        max_tok);
}

static const char *cpu_describe(const struct kern_backend *b)
{
    return ((const struct cpu_state *)b->impl)->name;
}

static const struct kern_ops cpu_ops = {
    .name = "cpu",
    .matmul = cpu_matmul,
    .ffn = cpu_ffn,
    .matmul_argmax = cpu_matmul_argmax,
    .matmul_hook = cpu_matmul_hook,
    .prepare = cpu_prepare,
    .release = cpu_release,
    .get_rows = cpu_get_rows,
    .rope = cpu_rope,
    .add = cpu_add,
    .add_rows = cpu_add_rows,
    .norm_rows = cpu_norm_rows,
    .scale = cpu_scale,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .gather = cpu_gather,
    .moe_add = cpu_moe_add,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_memcpy,
    .download = cpu_memcpy,
    .copy = cpu_memcpy,
    .sync = cpu_sync,
    .kv_block_bytes = cpu_kv_block_bytes,
    .kv_alloc = cpu_kv_alloc,
    .kv_free = cpu_kv_free,
    .kv_copy = cpu_kv_copy,
    .reserve = cpu_reserve,
    .peaks = cpu_peaks,
    .weight_bytes = cpu_weight_bytes,
    .free = cpu_free,
    .describe = cpu_describe,
};

/* The table --isa names (NULL or "auto": this CPU's best); NULL when this CPU lacks it, and
 * *known 0 for a name that is none. */
static const struct kern_cpu_fns *fns_named(const char *isa, int *known)
{
    *known = 1;
    if (!isa || !strcmp(isa, "auto"))
        return kern_cpu_fns_best();
    if (!strcmp(isa, "scalar"))
        return kern_cpu_fns_get(KERN_ISA_SCALAR);
    if (!strcmp(isa, "avx2"))
        return kern_cpu_fns_get(KERN_ISA_AVX2);
    if (!strcmp(isa, "avxvnni") || !strcmp(isa, "avx-vnni"))
        return kern_cpu_fns_get(KERN_ISA_AVXVNNI);
    if (!strcmp(isa, "avx512"))
        return kern_cpu_fns_get(KERN_ISA_AVX512);
    if (!strcmp(isa, "amx"))
        return kern_cpu_fns_get(KERN_ISA_AMX);
    *known = 0;
    return NULL;
}

int kern_cpu_isa_bf16(const char *isa)
{
    int known;
    const struct kern_cpu_fns *fn = fns_named(isa, &known);
    return fn && fn->prep_bf16;
}

enum status kern_cpu_backend_init(struct kern_backend **out, const struct kern_cpu_opts *o,
                                  struct err_detail *err)
{
    *out = NULL;
    const char *isa = o->isa;
    int known;
    const struct kern_cpu_fns *fn = fns_named(isa, &known);
    if (!known)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "unknown ISA '%s' (auto|scalar|avx2|avxvnni|avx512|amx)", isa);
    if (!fn)
        return err_set(err, ST_ERR_UNSUPPORTED, "this CPU does not support ISA '%s'", isa);
    if (o->act == KERN_ACT_BF16 && !fn->prep_bf16)
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "the bf16 matmul mode needs AMX-BF16 tiles (Sapphire Rapids or later, tile "
                       "state granted by the OS); the '%s' kernels do not have it",
                       fn->name);
    struct kern_backend *b = calloc(1, sizeof(*b));
    struct cpu_state *s = calloc(1, sizeof(*s));
    if (!b || !s) {
        free(b);
        free(s);
        return err_set(err, ST_ERR_NOMEM, "no memory for the CPU backend");
    }
    enum status st = pool_init(&s->pool, o->n_threads, err);
    if (st) {
        free(b);
        free(s);
        return st;
    }
    s->fn = fn;
    s->act = o->act;
    const char *tiles = getenv("QUERN_ATTN_TILES"); /* "0": the vector kernels (measurements) */
    s->attn_tiles = o->act == KERN_ACT_BF16 && fn->attn_tiles && !(tiles && !strcmp(tiles, "0"));
    snprintf(s->name, sizeof(s->name), "cpu %s", fn->name);
    b->ops = &cpu_ops;
    b->impl = s;
    b->host_memory = !o->as_device;
    *out = b;
    return ST_OK;
}

static void cpu_free(struct kern_backend *b)
{
    struct cpu_state *s = b->impl;
    pool_free(s->pool);
    free(s->xq);
    free(s->xq16);
    free(s->xs);
    free(s->xh);
    free(s->bv);
    free(s->bi);
    free(s->hb);
    free(s->aw);
    free(s->items);
    free(s);
    free(b);
}

const char *kern_cpu_backend_isa(const struct kern_backend *b)
{
    return ((const struct cpu_state *)b->impl)->fn->name;
}

size_t kern_cpu_late_allocs(const struct kern_backend *b)
{
    return ((const struct cpu_state *)b->impl)->late;
}

void kern_cpu_print(FILE *f)
{
    const struct kern_cpu_fns *best = kern_cpu_fns_best();
    fprintf(f, "cpu kernels: %s (best this CPU supports: %s)%s; default matmul mode %s\n",
            best->name, kern_isa_name(kern_cpu_detect()),
            kern_cpu_detect() == KERN_ISA_AMX
                ? "; AMX-BF16 tiles: exact and bf16 matmul modes run on them (AMX-INT8 unused)"
            : kern_cpu_has_amx() ? "; AMX-INT8 tiles present (not used by the kernels)"
                                 : "",
            best->prep_bf16 ? "bf16" : "q8");
}
