/* One test for every backend (the idea of ggml's test-backend-ops): each op of struct kern_ops,
 * on random inputs over the shapes the models use and odd ones, on every backend and
 * instruction set compiled in and every matmul mode, against a reference written here in
 * double precision on the scalar table's dequantized weights, with a tolerance per op and mode.
 * Data reaches the backend only through buf_alloc/upload/download, as a device backend needs.
 * A backend with one op deliberately broken must fail the same checks (the test of the test).
 * A new backend adds a test like test_cuda_backend. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "engine/sampler.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernels.h"
#include "tests/test_backend_ops_util.h"
#include "tests/test_rand.h"

/* What check_matmul's matmul_hook saw: per range, its calls, and whether each was aligned;
 * the blocks' values are copied to y (token t's row at t * ne1) to be compared with matmul's. */
#define HOOK_MAX_RANGES 8
struct hook_seen {
    float *y;
    int64_t ne1;
    int n_tok;
    int calls[HOOK_MAX_RANGES];
    int bad;
};

static void hook_check(void *ctx, int ith, int64_t r0, int64_t r1, float *blk, size_t ld)
{
    (void)ith;
    struct hook_seen *h = ctx;
    const int64_t c = r0 / KERN_HOOK_ROWS;
    const int64_t end = r0 + KERN_HOOK_ROWS < h->ne1 ? r0 + KERN_HOOK_ROWS : h->ne1;
    if (r0 % KERN_HOOK_ROWS || r1 != end || c >= HOOK_MAX_RANGES || ld < (size_t)(r1 - r0)) {
        __atomic_fetch_add(&h->bad, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int t = 0; t < h->n_tok; t++) {
        memcpy(h->y + (size_t)t * (size_t)h->ne1 + r0, blk + (size_t)t * ld,
               sizeof(float) * (size_t)(r1 - r0));
        blk[(size_t)t * ld] = NAN; /* the block is the hook's to overwrite */
    }
    __atomic_fetch_add(&h->calls[c], 1, __ATOMIC_RELAXED);
}

/* matmul with each input form (plain with two weights, residual add + rmsnorm, SwiGLU), then
 * matmul_argmax against argmax of the backend's own matmul output (bitwise by contract). */
static void check_matmul(struct check *c, uint32_t type, int64_t ne0, int64_t ne1, int n_tok)
{
    const struct kern_ops *k = c->be->ops;
    const size_t nx = (size_t)n_tok * (size_t)ne0, ny = (size_t)n_tok * (size_t)ne1;
    struct weight w[2];
    weight_make(c, &w[0], type, ne0, ne1);
    weight_make(c, &w[1], type, ne0, ne1 / 2 + 1);
    float *x = malloc(sizeof(float) * nx), *add = malloc(sizeof(float) * nx);
    float *nw = malloc(sizeof(float) * (size_t)ne0);
    double *xr = malloc(sizeof(double) * nx);
    float *xf = malloc(sizeof(float) * nx);
    double *yr = malloc(sizeof(double) * ny), *mag = malloc(sizeof(double) * ny);
    assert_true(x && add && nw && xr && xf && yr && mag);
    rand_floats(&c->r, x, nx, -1, 1);
    rand_floats(&c->r, add, nx, -0.5f, 0.5f);
    rand_floats(&c->r, nw, (size_t)ne0, 0.5f, 1.5f);
    char op[64];
    for (int form = 0; form < 3; form++) {
        float *dx = to_be(c, x, sizeof(float) * nx), *dadd = to_be(c, add, sizeof(float) * nx);
        float *dnw = to_be(c, nw, sizeof(float) * (size_t)ne0);
        float *dxn = k->buf_alloc(c->be, sizeof(float) * nx);
        float *dy0 = k->buf_alloc(c->be, sizeof(float) * ny);
        float *dy1 = k->buf_alloc(c->be, sizeof(float) * ny);
        struct kern_mm_in in = {.x = dx};
        /* the reference input rows */
        for (size_t i = 0; i < nx; i++)
            xf[i] = x[i];
        if (form == 1) {
            in.add = dadd;
            in.norm = dnw;
            in.eps = 1e-5f;
            in.xn = dxn;
            for (size_t i = 0; i < nx; i++)
                xf[i] = x[i] + add[i];
            for (int t = 0; t < n_tok; t++)
                ref_rmsnorm(xf + (size_t)t * ne0, nw, xr + (size_t)t * ne0, (int)ne0, 1e-5f);
        } else if (form == 2) {
            in.up = dadd;
            for (size_t i = 0; i < nx; i++)
                xr[i] = silu(x[i]) * add[i];
        } else {
            for (size_t i = 0; i < nx; i++)
                xr[i] = x[i];
        }
        float *xin = malloc(sizeof(float) * nx);
        for (size_t i = 0; i < nx; i++)
            xin[i] = (float)xr[i];
        const struct kern_tensor *ws[2] = {&w[0].t, &w[1].t};
        float *const ys[2] = {dy0, dy1};
        k->matmul(c->be, ws, ys, form == 0 ? 2 : 1, &in, n_tok);
        for (int i = 0; i < (form == 0 ? 2 : 1); i++) {
            const size_t m = (size_t)n_tok * (size_t)w[i].t.ne1;
            float *y = from_be(c, ys[i], sizeof(float) * m);
            ref_matmul(&w[i], xin, n_tok, yr, mag);
            snprintf(op, sizeof(op), "matmul %s %lldx%lld n_tok %d form %d w%d",
                     dtype_get(type)->name, (long long)ne0, (long long)w[i].t.ne1, n_tok, form, i);
            compare_mm(c, op, y, yr, mag, m);
            if (c->act == KERN_ACT_BF16 && form == 0) {
                /* the mode's rounding itself, which the tolerance above would let pass unrounded
                 * (or its absence, for the weights a CPU table's bf16 mode runs exactly; its
                 * type after prepare: the CPU widens Q5_0 to Q8_0) */
                ref_matmul_r(&w[i], xin, n_tok, yr, mag,
                             !c->cpu || (w[i].t.packed && c->cpu->gemm_bf16_packed[w[i].t.type]));
                const struct check strict = {.act = KERN_ACT_F32};
                for (size_t e = 0; e < m; e++)
                    if (!(fabs(y[e] - yr[e]) <= mm_tol(strict.act) * mag[e] + 1e-6)) {
                        report(c, op, "bf16 rounding: element %zu: %g, bf16 reference %g", e,
                               (double)y[e], yr[e]);
                        break;
                    }
            }
            if (c->act == KERN_ACT_Q8 && form == 0 && q8_type(type)) {
                /* likewise the 8-bit quantization: the inputs as kern_ref_quantize_q8 makes them */
                ref_matmul_q8(&w[i], xin, n_tok, yr, mag);
                for (size_t e = 0; e < m; e++)
                    if (!(fabs(y[e] - yr[e]) <= mm_tol(KERN_ACT_F32) * mag[e] + 1e-6)) {
                        report(c, op, "q8 quantization: element %zu: %g, q8 reference %g", e,
                               (double)y[e], yr[e]);
                        break;
                    }
            }
            free(y);
        }
        /* the element-wise steps' own outputs: x updated by the add, xn the norm, x the SwiGLU */
        if (form) {
            float *gx = from_be(c, dx, sizeof(float) * nx);
            float *gn = form == 1 ? from_be(c, dxn, sizeof(float) * nx) : NULL;
            for (size_t i = 0; i < nx; i++) {
                double want_x = form == 1 ? xf[i] : xr[i];
                if (!(fabs(gx[i] - want_x) <= 1e-5 * fabs(want_x) + 1e-6)) {
                    report(c, op, "input pass: x[%zu] = %g, reference %g", i, (double)gx[i],
                           want_x);
                    break;
                }
                if (gn && !(fabs(gn[i] - xr[i]) <= 1e-5 * fabs(xr[i]) + 1e-6)) {
                    report(c, op, "input pass: xn[%zu] = %g, reference %g", i, (double)gn[i],
                           xr[i]);
                    break;
                }
            }
            free(gx);
            free(gn);
        }
        /* greedy: the argmax of what matmul wrote, ties to the lowest row */
        if (form == 1 && k->matmul_argmax) {
            float *dx2 = to_be(c, x, sizeof(float) * nx);
            struct kern_mm_in in2 = in;
            in2.x = dx2;
            int32_t *dids = k->buf_alloc(c->be, sizeof(int32_t) * (size_t)n_tok);
            if (k->matmul_argmax(c->be, &w[0].t, &in2, n_tok, dids)) {
                int32_t *ids = from_be(c, dids, sizeof(int32_t) * (size_t)n_tok);
                float *y = from_be(c, dy0, sizeof(float) * ny);
                for (int t = 0; t < n_tok; t++) {
                    int32_t best = 0;
                    for (int64_t r = 1; r < ne1; r++)
                        if (y[(size_t)t * ne1 + r] > y[(size_t)t * ne1 + best])
                            best = (int32_t)r;
                    if (ids[t] != best)
                        report(c, "matmul_argmax", "%s token %d: %d, argmax of matmul %d",
                               dtype_get(type)->name, t, ids[t], best);
                }
                free(ids);
                free(y);
            }
            bfree(c, dids);
            bfree(c, dx2);
        }
        /* the epilogue hook: matmul's values, each range handed over once */
        if (form == 1 && k->matmul_hook && c->be->host_memory) {
            float *x2 = malloc(sizeof(float) * nx), *y2 = malloc(sizeof(float) * ny);
            assert_true(x2 && y2);
            memcpy(x2, x, sizeof(float) * nx);
            for (size_t e = 0; e < ny; e++)
                y2[e] = NAN;
            struct kern_mm_in in2 = in;
            in2.x = x2;
            struct hook_seen hs = {y2, ne1, n_tok, {0}, 0};
            assert_true(ne1 <= KERN_HOOK_ROWS * HOOK_MAX_RANGES);
            if (k->matmul_hook(c->be, &w[0].t, &in2, n_tok, hook_check, &hs)) {
                const int64_t nr = (ne1 + KERN_HOOK_ROWS - 1) / KERN_HOOK_ROWS;
                for (int64_t r = 0; r < nr; r++)
                    if (hs.calls[r] != 1)
                        report(c, "matmul_hook", "%s range %lld: %d calls", dtype_get(type)->name,
                               (long long)r, hs.calls[r]);
                if (hs.bad)
                    report(c, "matmul_hook", "%s: %d calls with a wrong range",
                           dtype_get(type)->name, hs.bad);
                if (memcmp(y2, dy0, sizeof(float) * ny))
                    report(c, "matmul_hook", "%s: values differ from matmul's",
                           dtype_get(type)->name);
            }
            free(x2);
            free(y2);
        }
        free(xin);
        bfree(c, dx);
        bfree(c, dadd);
        bfree(c, dnw);
        bfree(c, dxn);
        bfree(c, dy0);
        bfree(c, dy1);
    }
    weight_free(c, &w[0]);
    weight_free(c, &w[1]);
    free(x);
    free(add);
    free(nw);
    free(xr);
    free(xf);
    free(yr);
    free(mag);
}

/* The tanh GELU (enum kern_glu). */
static double gelu(double g)
{
    return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
}

/* Batch invariance (kern_ops.matmul): the first token's row of y is bitwise the same computed
 * alone, among 20 and among 70 (on CUDA in the bf16 mode: 16-token and 64-token blocks). */
static void check_invariance(struct check *c, uint32_t type, int64_t ne0, int64_t ne1)
{
    const struct kern_ops *k = c->be->ops;
    static const int counts[3] = {1, 20, 70};
    struct weight w;
    weight_make(c, &w, type, ne0, ne1);
    const size_t nx = (size_t)70 * (size_t)ne0;
    float *x = malloc(sizeof(float) * nx), *first = NULL;
    assert_non_null(x);
    rand_floats(&c->r, x, nx, -1, 1);
    for (int i = 0; i < 3; i++) {
        float *dx = to_be(c, x, sizeof(float) * (size_t)counts[i] * (size_t)ne0);
        float *dy = k->buf_alloc(c->be, sizeof(float) * (size_t)counts[i] * (size_t)ne1);
        const struct kern_tensor *ws[1] = {&w.t};
        float *const ys[1] = {dy};
        const struct kern_mm_in in = {.x = dx};
        k->matmul(c->be, ws, ys, 1, &in, counts[i]);
        float *y = from_be(c, dy, sizeof(float) * (size_t)ne1);
        if (!first)
            first = y;
        else {
            if (memcmp(first, y, sizeof(float) * (size_t)ne1)) {
                char op[64];
                snprintf(op, sizeof(op), "matmul %s %lldx%lld batch invariance",
                         dtype_get(type)->name, (long long)ne0, (long long)ne1);
                report(c, op, "token 0 alone differs from token 0 among %d", counts[i]);
            }
            free(y);
        }
        bfree(c, dx);
        bfree(c, dy);
    }
    free(first);
    free(x);
    weight_free(c, &w);
}

/* ffn: down(act(gate(norm(x + add))) * up(norm(x + add))), act SiLU or GELU (glu). */
static void check_ffn(struct check *c, uint32_t type, int64_t E, int64_t F, int n_tok, int glu)
{
    const struct kern_ops *k = c->be->ops;
    struct weight g, u, d;
    weight_make(c, &g, type, E, F);
    weight_make(c, &u, type, E, F);
    weight_make(c, &d, type, F, E);
    const size_t nx = (size_t)n_tok * (size_t)E, nh = (size_t)n_tok * (size_t)F;
    float *x = malloc(sizeof(float) * nx), *nw = malloc(sizeof(float) * (size_t)E);
    rand_floats(&c->r, x, nx, -1, 1);
    rand_floats(&c->r, nw, (size_t)E, 0.5f, 1.5f);
    double *xn = malloc(sizeof(double) * nx), *gr = malloc(sizeof(double) * nh);
    double *ur = malloc(sizeof(double) * nh), *gm = malloc(sizeof(double) * nh);
    double *um = malloc(sizeof(double) * nh), *yr = malloc(sizeof(double) * nx);
    double *ym = malloc(sizeof(double) * nx);
    float *xnf = malloc(sizeof(float) * nx), *hf = malloc(sizeof(float) * nh);
    for (int t = 0; t < n_tok; t++)
        ref_rmsnorm(x + (size_t)t * E, nw, xn + (size_t)t * E, (int)E, 1e-5f);
    for (size_t i = 0; i < nx; i++)
        xnf[i] = (float)xn[i];
    ref_matmul(&g, xnf, n_tok, gr, gm);
    ref_matmul(&u, xnf, n_tok, ur, um);
    for (size_t i = 0; i < nh; i++)
        hf[i] = (float)((glu ? gelu(gr[i]) : silu(gr[i])) * ur[i]);
    ref_matmul(&d, hf, n_tok, yr, ym);
    /* the hidden rows' own error feeds the down projection: widen its magnitude by theirs */
    for (int t = 0; t < n_tok; t++)
        for (int64_t r = 0; r < E; r++) {
            double a = 0;
            for (int64_t j = 0; j < F; j++) {
                size_t h = (size_t)t * F + j;
                double dh = fabs(glu ? gelu(gr[h]) : silu(gr[h])) * um[h] + fabs(ur[h]) * gm[h];
                a += fabs(d.deq[r * F + j]) * dh;
            }
            ym[(size_t)t * E + r] += a;
        }
    float *dx = to_be(c, x, sizeof(float) * nx), *dnw = to_be(c, nw, sizeof(float) * (size_t)E);
    float *dxn = k->buf_alloc(c->be, sizeof(float) * nx),
          *dy = k->buf_alloc(c->be, sizeof(float) * nx);
    float *dg = k->buf_alloc(c->be, sizeof(float) * nh),
          *du = k->buf_alloc(c->be, sizeof(float) * nh);
    struct kern_mm_in in = {.x = dx, .norm = dnw, .eps = 1e-5f, .xn = dxn};
    k->ffn(c->be, &g.t, &u.t, &d.t, &in, glu, dy, dg, du, n_tok);
    float *y = from_be(c, dy, sizeof(float) * nx);
    char op[64];
    snprintf(op, sizeof(op), "ffn %s %s %lld/%lld n_tok %d", glu ? "geglu" : "swiglu",
             dtype_get(type)->name, (long long)E, (long long)F, n_tok);
    compare_mm(c, op, y, yr, ym, nx);
    free(y);
    bfree(c, dx);
    bfree(c, dnw);
    bfree(c, dxn);
    bfree(c, dy);
    bfree(c, dg);
    bfree(c, du);
    weight_free(c, &g);
    weight_free(c, &u);
    weight_free(c, &d);
    free(x);
    free(nw);
    free(xn);
    free(gr);
    free(ur);
    free(gm);
    free(um);
    free(yr);
    free(ym);
    free(xnf);
    free(hf);
}

/* add_rows (exact), scale (exact) and norm_rows (against a double RMS norm) over 13 rows of 40
 * and 7 rows of 576: a projection's bias, the embedding scale, a QK- or post-norm. */
static void check_row_ops(struct check *c)
{
    const struct kern_ops *k = c->be->ops;
    static const int shape[2][2] = {{13, 40}, {7, 576}};
    for (int si = 0; si < 2; si++) {
        const int R = shape[si][0], W = shape[si][1];
        const size_t n = (size_t)R * (size_t)W;
        float *x = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * (size_t)W);
        rand_floats(&c->r, x, n, -3, 3);
        rand_floats(&c->r, w, (size_t)W, 0.5f, 1.5f);
        float *dx = to_be(c, x, sizeof(float) * n), *dw = to_be(c, w, sizeof(float) * (size_t)W);
        k->add_rows(c->be, dx, dw, R, W);
        float *got = from_be(c, dx, sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            if (got[i] != x[i] + w[i % (size_t)W]) {
                report(c, "add_rows", "%d x %d element %zu: %g, want %g", R, W, i, (double)got[i],
                       (double)(x[i] + w[i % (size_t)W]));
                break;
            }
        free(got);
        k->upload(c->be, dx, x, sizeof(float) * n);
        k->scale(c->be, dx, 0.37f, (long)n);
        got = from_be(c, dx, sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            if (got[i] != x[i] * 0.37f) {
                report(c, "scale", "%zu floats, element %zu: %g, want %g", n, i, (double)got[i],
                       (double)(x[i] * 0.37f));
                break;
            }
        free(got);
        k->upload(c->be, dx, x, sizeof(float) * n);
        k->norm_rows(c->be, dx, dw, R, W, 1e-6f);
        got = from_be(c, dx, sizeof(float) * n);
        double *ref = malloc(sizeof(double) * (size_t)W);
        for (int r = 0; r < R; r++) {
            ref_rmsnorm(x + (size_t)r * W, w, ref, W, 1e-6f);
            int j;
            for (j = 0; j < W; j++)
                if (!(fabs(got[(size_t)r * W + j] - ref[j]) <= 1e-5 * (1 + fabs(ref[j]))))
                    break;
            if (j < W) {
                report(c, "norm_rows", "%d x %d row %d element %d: %g, want %g", R, W, r, j,
                       (double)got[(size_t)r * W + j], ref[j]);
                break;
            }
        }
        free(ref);
        free(got);
        bfree(c, dx);
        bfree(c, dw);
        free(x);
        free(w);
    }
}

/* moe_add over n slots of 5 tokens' rows (width floats), in slot order, each token's first
 * slot setting its row and the others adding, a token with no slot left as it was: bitwise the
 * host's sums in the same order. */
static void check_moe_add(struct check *c, int n, long width)
{
    const struct kern_ops *k = c->be->ops;
    enum { T = 6 }; /* token 5 gets no slot */
    const size_t xs = sizeof(float) * (size_t)n * (size_t)width, ys = sizeof(float) * T * width;
    float *x = malloc(xs), *y = malloc(ys), *wt = malloc(sizeof(float) * (size_t)n);
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)n);
    rand_floats(&c->r, x, (size_t)n * (size_t)width, -4, 4);
    rand_floats(&c->r, y, (size_t)T * (size_t)width, -4, 4);
    rand_floats(&c->r, wt, (size_t)n, 0, 1);
    int seen[T] = {0};
    for (int i = 0; i < n; i++) {
        const int t = i < T - 1 ? (i * 3) % (T - 1) : (int)(rng_u64(&c->r) % (T - 1));
        rows[i] = seen[t]++ ? t : ~t;
    }
    float *dy = to_be(c, y, ys), *dx = to_be(c, x, xs);
    float *dw = to_be(c, wt, sizeof(float) * (size_t)n);
    int32_t *dr = to_be(c, rows, sizeof(int32_t) * (size_t)n);
    k->moe_add(c->be, dy, dx, dr, dw, n, width);
    float *got = from_be(c, dy, ys);
    for (int i = 0; i < n; i++) {
        const int t = rows[i] < 0 ? ~rows[i] : rows[i];
        for (long j = 0; j < width; j++) {
            const float p = wt[i] * x[(size_t)i * width + j];
            float *yj = &y[(size_t)t * width + j];
            *yj = rows[i] < 0 ? p : *yj + p;
        }
    }
    if (memcmp(got, y, ys))
        report(c, "moe_add", "%d slots of width %ld: not the host's sums in slot order", n, width);
    free(got);
    bfree(c, dr);
    bfree(c, dw);
    bfree(c, dx);
    bfree(c, dy);
    free(rows);
    free(wt);
    free(y);
    free(x);
}

/* get_rows (exact: dequantization is exact), gather, moe_add, add (exact), rope, the row ops,
 * memory round trips. */
static void check_small_ops(struct check *c, uint32_t type, int64_t ne0)
{
    const struct kern_ops *k = c->be->ops;
    struct weight w;
    weight_make(c, &w, type, ne0, 50);
    int32_t ids[7] = {3, 0, 49, 3, 17, 48, 1};
    int32_t *dids = to_be(c, ids, sizeof(ids));
    float *dout = k->buf_alloc(c->be, sizeof(float) * 7 * (size_t)ne0);
    k->get_rows(c->be, &w.t, dids, 7, dout);
    float *out = from_be(c, dout, sizeof(float) * 7 * (size_t)ne0);
    for (int i = 0; i < 7; i++)
        if (memcmp(out + (size_t)i * ne0, w.deq + (size_t)ids[i] * ne0,
                   sizeof(float) * (size_t)ne0))
            report(c, "get_rows", "%s row %d differs from its dequantization",
                   dtype_get(type)->name, ids[i]);
    /* gather the same rows back out of the 7 in a new order */
    int32_t gi[5] = {6, 0, 0, 3, 2};
    int32_t *dgi = to_be(c, gi, sizeof(gi));
    float *dg = k->buf_alloc(c->be, sizeof(float) * 5 * (size_t)ne0);
    k->gather(c->be, dg, dout, dgi, 5, (long)ne0);
    float *g = from_be(c, dg, sizeof(float) * 5 * (size_t)ne0);
    for (int i = 0; i < 5; i++)
        if (memcmp(g + (size_t)i * ne0, out + (size_t)gi[i] * ne0, sizeof(float) * (size_t)ne0))
            report(c, "gather", "row %d is not source row %d", i, gi[i]);
    free(g);
    bfree(c, dg);
    bfree(c, dgi);
    free(out);
    bfree(c, dout);
    bfree(c, dids);
    weight_free(c, &w);
    check_moe_add(c, 7, ne0);
    check_moe_add(c, 40, 2001); /* past the CPU's threading threshold, ragged columns */

    /* add over sizes around the backend's chunking */
    static const long sizes[] = {1, 7, 4096, 4097, 100000};
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        const long n = sizes[s];
        float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
        rand_floats(&c->r, a, (size_t)n, -10, 10);
        rand_floats(&c->r, b, (size_t)n, -10, 10);
        float *da = to_be(c, a, sizeof(float) * (size_t)n),
              *db = to_be(c, b, sizeof(float) * (size_t)n);
        k->add(c->be, da, db, n);
        float *got = from_be(c, da, sizeof(float) * (size_t)n);
        for (long i = 0; i < n; i++)
            if (got[i] != a[i] + b[i]) {
                report(c, "add", "n %ld element %ld: %g, want %g", n, i, (double)got[i],
                       (double)(a[i] + b[i]));
                break;
            }
        /* copy: backend to backend */
        float *dc = k->buf_alloc(c->be, sizeof(float) * (size_t)n);
        k->copy(c->be, dc, db, sizeof(float) * (size_t)n);
        float *cb = from_be(c, dc, sizeof(float) * (size_t)n);
        if (memcmp(cb, b, sizeof(float) * (size_t)n))
            report(c, "copy/download", "n %ld: a round trip changed the bytes", n);
        free(cb);
        bfree(c, dc);
        free(got);
        bfree(c, da);
        bfree(c, db);
        free(a);
        free(b);
    }

    /* rope: heads of head_dim 64 with 64 or 32 rotated channels, angles of real positions,
     * pairs (2i, 2i + 1) (NORM) or (i, i + rot / 2) (NEOX) */
    for (int mode = 0; mode < 4; mode++) {
        const int rot = mode % 2 ? 64 : 32, neox = mode / 2;
        const int n_tok = 5, H = 3, D = 64;
        const size_t nx = (size_t)n_tok * H * D;
        float *x = malloc(sizeof(float) * nx), *cs = malloc(sizeof(float) * (size_t)n_tok * rot);
        rand_floats(&c->r, x, nx, -2, 2);
        for (int t = 0; t < n_tok; t++)
            for (int i = 0; i < rot; i += 2) {
                double ang = (t * 37 + 5) * pow(10000.0, -(double)i / rot);
                cs[t * rot + i] = (float)cos(ang);
                cs[t * rot + i + 1] = (float)sin(ang);
            }
        float *dx = to_be(c, x, sizeof(float) * nx);
        float *dcs = to_be(c, cs, sizeof(float) * (size_t)n_tok * rot);
        k->rope(c->be, dx, dcs, n_tok, H, D, rot, neox);
        float *got = from_be(c, dx, sizeof(float) * nx);
        for (int t = 0; t < n_tok; t++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < D / 2; i++) {
                    /* pair i: channels o0, o1 (untouched past rot) */
                    const size_t hb = ((size_t)t * H + h) * D;
                    const size_t o0 = hb + (neox && i < rot / 2 ? (size_t)i : 2 * (size_t)i);
                    const size_t o1 = o0 + (neox && i < rot / 2 ? (size_t)rot / 2 : 1);
                    double a = x[o0], b = x[o1], r0 = a, r1 = b;
                    if (i < rot / 2) {
                        double co = cs[t * rot + 2 * i], si = cs[t * rot + 2 * i + 1];
                        r0 = a * co - b * si;
                        r1 = a * si + b * co;
                    }
                    if (fabs(got[o0] - r0) > 1e-6 * (fabs(a) + fabs(b)) + 1e-7 ||
                        fabs(got[o1] - r1) > 1e-6 * (fabs(a) + fabs(b)) + 1e-7) {
                        report(c, "rope",
                               "%s rot %d token %d head %d pair %d: (%g, %g), want "
                               "(%g, %g)",
                               neox ? "neox" : "norm", rot, t, h, i, (double)got[o0],
                               (double)got[o1], r0, r1);
                        t = n_tok, h = H, i = D;
                    }
                }
        free(got);
        bfree(c, dx);
        bfree(c, dcs);
        free(x);
        free(cs);
    }
    check_row_ops(c);
}

/* kv_store then attention over a pool the backend allocated: three sequences with shuffled
 * blocks, every position stored (half of the last tokens by attention's deferred store), and
 * each token's output against softmax attention in double over the keys and values as the
 * pool's dtype rounds them (f16: exact f16 of the inputs; q8: within a scale step). The pool
 * has two layers and the second is used; one stored block is moved by kv_copy to a spare block
 * (its sequence's table repointed, the old block overwritten with an empty one), so a copy
 * that misses a layer, keys or values, or part of a block changes the output. */
static void check_attention(struct check *c, int dtype, int H, int KV, int D, int window,
                            float softcap)
{
    const struct kern_ops *k = c->be->ops;
    const int B = c->kv_block ? c->kv_block : 16, NB = 24, S = 3;
    const int len[3] = {37, 16, 70};
    struct kern_kv_desc desc = {2, KV, D, B, dtype};
    struct kern_kv_layer layers[2];
    struct err_detail err = {0};
    assert_int_equal(k->kv_alloc(c->be, &desc, NB, layers, &err), ST_OK);
    const struct kern_kv_layer layer = layers[1];
    /* the CPU's bf16 mode on AMX stores bfloat16 for its tile attention (kernels.h) */
    const int t16 = layer.dtype == KERN_KV_BF16T;
    if (dtype == KERN_KV_F16) { /* positions never written hold infinities (a stale one may
                                   have overflowed): no kernel may let them into an output;
                                   bfloat16 stores never write one (kv_store_tiles), so there
                                   the largest finite value */
        const size_t bytes = (size_t)NB * KV * KERN_KV_TILE_BYTES(dtype, B, D);
        uint16_t *inf = malloc(bytes);
        for (size_t i = 0; i < bytes / 2; i++)
            inf[i] = t16 ? 0x7F7F : 0x7C00;
        k->upload(c->be, layer.k, inf, bytes);
        k->upload(c->be, layer.v, inf, bytes);
        free(inf);
    }
    /* block tables: a shuffled pool split between the sequences */
    int32_t perm[24], tables[3 * 8];
    for (int i = 0; i < NB; i++)
        perm[i] = i;
    for (int i = NB - 1; i > 0; i--) {
        int j = (int)(rng_u64(&c->r) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int s = 0; s < S; s++)
        for (int b = 0; b < 8; b++)
            tables[s * 8 + b] = perm[s * 8 + b];
    int n = 0;
    for (int s = 0; s < S; s++)
        n += len[s];
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n), *row = malloc(sizeof(int32_t) * (size_t)n);
    uint8_t *last = malloc((size_t)n);
    for (int s = 0, t = 0; s < S; s++)
        for (int i = 0; i < len[s]; i++, t++) {
            pos[t] = i;
            row[t] = s;
            last[t] = i == len[s] - 1 && s != 1; /* sequence 1 stores its last by kv_store */
        }
    const size_t nq = (size_t)n * H * D, nk = (size_t)n * KV * D;
    float *q = malloc(sizeof(float) * nq), *kk = malloc(sizeof(float) * nk);
    float *vv = malloc(sizeof(float) * nk);
    rand_floats(&c->r, q, nq, -1.5f, 1.5f);
    rand_floats(&c->r, kk, nk, -2, 2);
    rand_floats(&c->r, vv, nk, -1, 1);
    int32_t *dpos = to_be(c, pos, sizeof(int32_t) * (size_t)n);
    int32_t *drow = to_be(c, row, sizeof(int32_t) * (size_t)n);
    int32_t *dtab = to_be(c, tables, sizeof(tables));
    uint8_t *dlast = to_be(c, last, (size_t)n);
    float *dq = to_be(c, q, sizeof(float) * nq), *dk = to_be(c, kk, sizeof(float) * nk);
    float *dv = to_be(c, vv, sizeof(float) * nk), *dout = k->buf_alloc(c->be, sizeof(float) * nq);
    const struct kern_block_table bt = {dtab, drow, 8};
    k->kv_store(c->be, layer, &bt, dpos, B, KV, D, dk, dv, n, dlast);
    /* sequence 2's third block (positions 32..47, all stored above) to sequence 1's unused
     * second block; its never-written third block over the original */
    const int32_t moved = tables[2 * 8 + 2], spare = tables[1 * 8 + 1], empty = tables[1 * 8 + 2];
    k->kv_copy(c->be, &desc, layers, spare, moved);
    k->kv_copy(c->be, &desc, layers, moved, empty);
    tables[2 * 8 + 2] = spare;
    k->upload(c->be, dtab, tables, sizeof(tables));
    struct kern_attn a = {.n_tok = n,
                          .q = dq,
                          .out = dout,
                          .pos = dpos,
                          .bt = bt,
                          .kv = layer,
                          .block_size = B,
                          .n_head = H,
                          .n_kv_head = KV,
                          .head_dim = D,
                          .scale = 1.0f / sqrtf((float)D),
                          .window = window,
                          .softcap = softcap,
                          .store = dlast,
                          .k_new = dk,
                          .v_new = dv,
                          .n_seqs = S};
    /* reserve sizes the attention's scratch (the tiles' workspaces grow with the positions):
     * the call allocates nothing more */
    size_t late = 0;
    if (c->cpu && k->reserve) {
        assert_int_equal(k->reserve(c->be, n, (int64_t)H * D, 8 * B, &err), ST_OK);
        late = kern_cpu_late_allocs(c->be);
    }
    k->attention(c->be, &a);
    if (c->cpu && kern_cpu_late_allocs(c->be) != late)
        report(c, "attention", "allocated %zu scratch arrays that reserve had not sized",
               kern_cpu_late_allocs(c->be) - late);
    float *out = from_be(c, dout, sizeof(float) * nq);
    /* batch invariance: sequence 0's tokens again alone, then sequence 2's (which start 53 tokens
     * into the batch, so whatever groups tokens meets other neighbours), each with a block table
     * of its own blocks (as the engine makes one for a batch), and the last token of each
     * sequence as a decode step (3 tokens, 3 sequences): bitwise their outputs in the batch */
    static const char *const sub_what[3] = {"sequence 0 alone", "sequence 2 alone",
                                            "the sequences' last tokens as a decode step"};
    for (int v = 0; v < 3 && !c->fails; v++) {
        int idx[80], m = 0, rows = 1, stride = 8;
        int32_t sub_pos[80], sub_row[80], sub_tab[3 * 8];
        if (v < 2) {
            const int sq = v ? 2 : 0, base = v ? len[0] + len[1] : 0;
            stride = (len[sq] + B - 1) / B;
            memcpy(sub_tab, tables + sq * 8, sizeof(int32_t) * (size_t)stride);
            for (int i = 0; i < len[sq]; i++, m++) {
                idx[m] = base + i;
                sub_pos[m] = i;
                sub_row[m] = 0;
            }
        } else {
            rows = S;
            memcpy(sub_tab, tables, sizeof(tables));
            for (int sq = 0, base = 0; sq < S; base += len[sq++], m++) {
                idx[m] = base + len[sq] - 1;
                sub_pos[m] = len[sq] - 1;
                sub_row[m] = sq;
            }
        }
        const size_t row_floats = (size_t)H * D;
        float *sub_q = malloc(sizeof(float) * row_floats * (size_t)m);
        for (int i = 0; i < m; i++)
            memcpy(sub_q + (size_t)i * row_floats, q + (size_t)idx[i] * row_floats,
                   sizeof(float) * row_floats);
        float *dsq = to_be(c, sub_q, sizeof(float) * row_floats * (size_t)m);
        int32_t *dsp = to_be(c, sub_pos, sizeof(int32_t) * (size_t)m);
        int32_t *dsr = to_be(c, sub_row, sizeof(int32_t) * (size_t)m);
        int32_t *dst = to_be(c, sub_tab, sizeof(int32_t) * (size_t)(rows * stride));
        float *dso = k->buf_alloc(c->be, sizeof(float) * row_floats * (size_t)m);
        struct kern_attn a0 = a;
        a0.n_tok = m;
        a0.q = dsq;
        a0.out = dso;
        a0.pos = dsp;
        a0.bt = (struct kern_block_table){dst, dsr, stride};
        a0.store = NULL;
        a0.n_seqs = rows;
        k->attention(c->be, &a0);
        float *sub_out = from_be(c, dso, sizeof(float) * row_floats * (size_t)m);
        for (int i = 0; i < m; i++)
            if (memcmp(sub_out + (size_t)i * row_floats, out + (size_t)idx[i] * row_floats,
                       sizeof(float) * row_floats)) {
                char op0[96];
                snprintf(op0, sizeof(op0), "attention H %d KV %d D %d window %d batch invariance",
                         H, KV, D, window);
                report(c, op0, "%s: token %d differs from itself in the batch", sub_what[v],
                       idx[i]);
                break;
            }
        free(sub_q);
        free(sub_out);
        bfree(c, dsq);
        bfree(c, dsp);
        bfree(c, dsr);
        bfree(c, dst);
        bfree(c, dso);
    }
    /* the reference: keys and values as stored */
    float *kr = malloc(sizeof(float) * nk), *vr = malloc(sizeof(float) * nk);
    for (size_t i = 0; i < nk; i += (size_t)D)
        for (int j = 0; j < D; j++) {
            if (t16) {
                kr[i + j] = kern_bf16_to_f32(kern_f32_to_bf16(kk[i + j]));
                vr[i + j] = kern_bf16_to_f32(kern_f32_to_bf16(vv[i + j]));
            } else if (dtype == KERN_KV_F16) {
                kr[i + j] = kern_f16_to_f32(kern_f32_to_f16(kk[i + j]));
                vr[i + j] = kern_f16_to_f32(kern_f32_to_f16(vv[i + j]));
            } else {
                kr[i + j] = kk[i + j];
                vr[i + j] = vv[i + j];
            }
        }
    /* f16: the kernels' polynomial exp and f32 sums; q8: plus a quantization step of the
     * keys' and values' row maxima (2 and 1) / 127 */
    const double tol = t16                    ? 5e-3 /* bfloat16 queries and softmax weights */
                       : dtype == KERN_KV_F16 ? (c->att_tol > 0 ? c->att_tol : 2e-4)
                                              : 0.05;
    double *sc = malloc(sizeof(double) * (size_t)n);
    char op[96];
    snprintf(op, sizeof(op), "kv_store+attention %s H %d KV %d D %d window %d softcap %g",
             dtype ? "q8" : "f16", H, KV, D, window, (double)softcap);
    int bad = 0;
    for (int t = 0, base = 0, s = 0; t < n && !bad; t++) {
        if (t - base == len[s])
            base += len[s++];
        for (int h = 0; h < H && !bad; h++) {
            const int g = h / (H / KV);
            double mx = -INFINITY, sum = 0;
            const int p_lo = window && pos[t] + 1 > window ? pos[t] + 1 - window : 0;
            for (int p = p_lo; p <= pos[t]; p++) {
                double d = 0;
                const size_t kt = ((size_t)(base + p) * KV + g) * D;
                for (int j = 0; j < D; j++) {
                    const float qj = q[((size_t)t * H + h) * D + j];
                    d += (double)(t16 ? kern_bf16_to_f32(kern_f32_to_bf16(qj)) : qj) * kr[kt + j];
                }
                sc[p] = d * a.scale;
                if (softcap > 0)
                    sc[p] = softcap * tanh(sc[p] / softcap);
                mx = sc[p] > mx ? sc[p] : mx;
            }
            for (int p = p_lo; p <= pos[t]; p++)
                sum += (sc[p] = exp(sc[p] - mx));
            for (int j = 0; j < D && !bad; j++) {
                double acc = 0;
                for (int p = p_lo; p <= pos[t]; p++)
                    acc += sc[p] * vr[((size_t)(base + p) * KV + g) * D + j];
                const double want = acc / sum, got = out[((size_t)t * H + h) * D + j];
                if (!(fabs(got - want) <= tol)) {
                    report(c, op, "token %d head %d channel %d: %g, reference %g", t, h, j, got,
                           want);
                    bad = 1;
                }
            }
        }
    }
    if (c->keep) {
        free(c->kept);
        c->kept = out;
        c->kept_n = nq;
        out = NULL;
    }
    free(sc);
    free(kr);
    free(vr);
    free(out);
    k->kv_free(c->be, &desc, NB, layers);
    void *bufs[] = {dpos, drow, dtab, dlast, dq, dk, dv, dout};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        bfree(c, bufs[i]);
    free(pos);
    free(row);
    free(last);
    free(q);
    free(kk);
    free(vv);
}

/* Every op over the model shapes (SmolLM2: 576 hidden, 192 KV, 1536 FFN, head_dim 64) and odd
 * ones (row counts that are not a multiple of the 16-row panels, one token, 17 tokens). The
 * matmul-free ops run once per backend; matmuls in every mode. */
/* One logit row of n_vocab for the sampling check, by shape: 0 peaked (a few strong tokens over
 * a normal-looking bulk), 1 flat (a nucleus of thousands of tokens), 2 heavy-tailed, 3 with
 * NaN, -inf and tied values. */
static void sample_row(struct check *c, float *x, int n_vocab, int shape)
{
    for (int i = 0; i < n_vocab; i++) {
        const float a = rng_uniform(&c->r, -1.0f, 1.0f), b = rng_uniform(&c->r, -1.0f, 1.0f);
        x[i] = shape == 1 ? 0.05f * a : shape == 2 ? 6.0f * a * a * a : 3.0f * (a + b);
    }
    for (int j = 0; j < 12; j++)
        x[rng_u64(&c->r) % (uint64_t)n_vocab] += shape == 1 ? 0.3f : 9.0f + (float)j;
    if (shape == 3) { /* NaN, -inf, and the largest value tied between several tokens */
        for (int j = 0; j < 40; j++) {
            const int i = (int)(rng_u64(&c->r) % (uint64_t)n_vocab);
            x[i] = j % 3 == 0 ? NAN : j % 3 == 1 ? -INFINITY : 30.0f;
        }
    }
}

/* kern_ops.sample (backends that have it) against engine_sample and engine_logprobs on the host:
 * the same ids and log-probabilities for every sampling mode, row shape, penalty and grammar
 * mask (every third row: random bits, the engine masks the row before both), with the
 * rows the backend leaves to the caller only where its limits say (a top_k or nucleus beyond
 * its ranking capacity); the check fails if too few rows were drawn on the device. */
static void check_sample(struct check *c, int n_vocab)
{
    const int lp_same = c->label && strstr(c->label, "emulator") != NULL;
    const struct kern_ops *k = c->be->ops;
    struct engine_sampling ps[14];
    for (int i = 0; i < 14; i++)
        engine_sampling_default(&ps[i]);
    ps[0].temperature = 0.0f; /* greedy */
    ps[1].temperature = 0.0f;
    ps[1].repeat_penalty = 1.3f;
    ps[1].frequency_penalty = 0.5f;
    ps[1].presence_penalty = 0.4f;
    ps[1].counted_from = 30;  /* history 0..29 the prompt: repeated, not counted (count 0) */
    ps[2].temperature = 0.8f; /* the whole row */
    ps[3].temperature = 1.0f;
    ps[4].temperature = 0.7f;
    ps[4].top_k = 40;
    ps[5].temperature = 1.2f;
    ps[5].top_k = 1;
    ps[6].temperature = 0.8f;
    ps[6].top_p = 0.95f;
    ps[7].temperature = 1.0f;
    ps[7].top_p = 0.9f;
    ps[7].presence_penalty = 0.7f;
    ps[8].min_p = 0.05f;
    ps[9].temperature = 0.9f;
    ps[9].top_p = 0.8f;
    ps[9].min_p = 0.02f;
    ps[9].repeat_penalty = 1.1f;
    ps[9].repeat_last_n = 16;
    ps[10].temperature = 0.6f;
    ps[10].top_k = 500;
    ps[10].top_p = 0.9f;
    ps[11].top_k = 4500; /* beyond the CUDA backend's ranking (4096): left to the host */
    ps[12].temperature = 1.5f;
    ps[12].top_p = 0.999f; /* on flat rows a nucleus of thousands: may be left to the host */
    ps[13].temperature = 0.5f;
    ps[13].frequency_penalty = -0.5f;
    ps[13].presence_penalty = 0.3f;
    ps[13].counted_from = 40;
    enum { NP = 14, NSHAPE = 4, NH = 48 };
    const int n = NP * NSHAPE;
    float *x = malloc(sizeof(float) * (size_t)n * (size_t)n_vocab);
    float *row = malloc(sizeof(float) * (size_t)n_vocab);
    float *ref = malloc(sizeof(float) * (size_t)n * (size_t)n_vocab); /* the rows masked */
    int32_t *hist = malloc(sizeof(int32_t) * (size_t)n * NH);
    int32_t *pen_id = malloc(sizeof(int32_t) * (size_t)n * NH);
    int32_t *pen_cnt = malloc(sizeof(int32_t) * (size_t)n * NH);
    struct kern_sample_row *rows = calloc((size_t)n, sizeof(*rows));
    struct kern_sample_out *out = calloc((size_t)n, sizeof(*out));
    const size_t words = ((size_t)n_vocab + 31) / 32;
    uint32_t *masks = malloc(sizeof(uint32_t) * words * (size_t)n);
    int n_masks = 0;
    struct engine_sampler *smp = NULL;
    struct err_detail err = {0};
    assert_true(x && row && ref && hist && pen_id && pen_cnt && rows && out && masks);
    assert_int_equal(engine_sampler_init(&smp, n_vocab, &err), ST_OK);
    struct engine_rng rng;
    engine_rng_seed(&rng, c->r.s, "sample", 6);
    int n_pen = 0;
    for (int r = 0; r < n; r++) {
        const struct engine_sampling *p = &ps[r % NP];
        float *xr = x + (size_t)r * (size_t)n_vocab;
        sample_row(c, xr, n_vocab, r / NP);
        for (int h = 0; h < NH; h++) { /* a history that repeats the row's strong tokens */
            const int32_t t = (int32_t)(rng_u64(&c->r) % (uint64_t)n_vocab);
            hist[r * NH + h] = h % 3 ? t : hist[r * NH + h / 2];
        }
        struct kern_sample_row *R = &rows[r];
        R->temperature = p->temperature;
        R->top_k = p->top_k;
        R->top_p = p->top_p;
        R->min_p = p->min_p;
        R->repeat_penalty = p->repeat_penalty;
        R->frequency_penalty = p->frequency_penalty;
        R->presence_penalty = p->presence_penalty;
        R->pen_first = n_pen;
        R->pen_n = (int32_t)engine_sampler_counts(smp, p, hist + r * NH, NH, pen_id + n_pen,
                                                  pen_cnt + n_pen);
        n_pen += R->pen_n;
        R->u = engine_rng_at(&rng, (uint64_t)r, 0); /* what the engine passes for position r */
        R->lp_k = r % 5 == 0 ? -1 : r % 5 == 1 ? 0 : r % 5 == 2 ? 3 : KERN_TOP_LOGPROBS_MAX;
        R->host = r == n - 1; /* the caller's own row */
        R->mask = -1;
        if (r % 3 == 2) { /* about 3 tokens in 4 allowed, and the row's best ones forbidden */
            uint32_t *mk = masks + (size_t)n_masks * words;
            for (size_t w = 0; w < words; w++)
                mk[w] = (uint32_t)(rng_u64(&c->r) | rng_u64(&c->r));
            for (int i = 0; i < n_vocab; i++)
                if (xr[i] > 8.0f)
                    mk[i / 32] &= ~(1u << (i % 32));
            R->mask = n_masks++;
        }
    }
    float *d = to_be(c, x, sizeof(float) * (size_t)n * (size_t)n_vocab);
    const int drawn =
        k->sample(c->be, d, n, n_vocab, rows, pen_id, pen_cnt, n_pen, masks, n_masks, out);
    float *after = from_be(c, d, sizeof(float) * (size_t)n * (size_t)n_vocab);
    if (memcmp(after, x, sizeof(float) * (size_t)n * (size_t)n_vocab))
        report(c, "sample", "the logits changed");
    free(after);
    bfree(c, d);
    /* pass 2 (below): rows drawn again at the two adjacent uniforms u1 < u2 where the host's
     * token changes, so a last-bit difference in any weight or total shows */
    struct kern_sample_row *rows2 = calloc((size_t)n * 2, sizeof(*rows2));
    int32_t *want2 = malloc(sizeof(int32_t) * (size_t)n * 2),
            *src2 = malloc(sizeof(int32_t) * (size_t)n * 2);
    assert_true(rows2 && want2 && src2);
    int n2 = 0;
    int left = 0, nucleus = 0, nucleus_left = 0;
    for (int r = 0; r < n; r++) {
        const struct engine_sampling *p = &ps[r % NP];
        const float *xr = x + (size_t)r * (size_t)n_vocab;
        const int pi = r % NP;
        float *xm = ref + (size_t)r * (size_t)n_vocab; /* as the engine does: the row masked */
        memcpy(xm, xr, sizeof(float) * (size_t)n_vocab);
        if (rows[r].mask >= 0) /* forbidden tokens -inf before all else */
            for (int i = 0; i < n_vocab; i++)
                if (!(masks[(size_t)rows[r].mask * words + (size_t)i / 32] >> (i % 32) & 1u))
                    xm[i] = -INFINITY;
        /* left to the host: its own row and top_k 4500; may be: a top_p/min_p row whose
         * nucleus needs more than the backend ranks (flat rows: thousands of tokens) */
        const int must = rows[r].host || pi == 11;
        const int may =
            p->top_k == 0 && p->temperature > 0.0f && (p->top_p < 1.0f || p->min_p > 0.0f);
        nucleus += may;
        if (out[r].id < 0) {
            left++;
            nucleus_left += may;
            if (!must && !may)
                report(c, "sample", "row %d (params %d, shape %d) left to the host", r, pi, r / NP);
            continue;
        }
        if (must) {
            report(c, "sample", "row %d (params %d, shape %d) drawn, expected left to the host", r,
                   pi, r / NP);
            continue;
        }
        memcpy(row, xm, sizeof(float) * (size_t)n_vocab);
        const int32_t want = engine_sample_u(smp, p, rows[r].u, row, hist + r * NH, NH, NULL);
        if (out[r].id != want)
            report(c, "sample", "row %d (params %d, shape %d): id %d, host %d", r, r % NP, r / NP,
                   out[r].id, want);
        if (p->temperature > 0.0f) { /* bisect the host's draw over u in [0, 1) */
            uint64_t lo = 0, hi = 0x3fefffffffffffffull; /* 0 and the largest double below 1 */
            double u;
            memcpy(&u, &hi, sizeof(u));
            memcpy(row, xm, sizeof(float) * (size_t)n_vocab);
            const int32_t t_lo = engine_sample_u(smp, p, 0.0, row, hist + r * NH, NH, NULL);
            memcpy(row, xm, sizeof(float) * (size_t)n_vocab);
            int32_t t_hi = engine_sample_u(smp, p, u, row, hist + r * NH, NH, NULL);
            while (t_hi != t_lo && hi - lo > 1) { /* doubles in [0, 1) order as their bits */
                const uint64_t mid = lo + (hi - lo) / 2;
                memcpy(&u, &mid, sizeof(u));
                memcpy(row, xm, sizeof(float) * (size_t)n_vocab);
                const int32_t t = engine_sample_u(smp, p, u, row, hist + r * NH, NH, NULL);
                if (t == t_lo)
                    lo = mid;
                else {
                    hi = mid;
                    t_hi = t;
                }
            }
            if (t_hi != t_lo) {
                for (int e = 0; e < 2; e++) {
                    rows2[n2] = rows[r];
                    memcpy(&rows2[n2].u, e ? &hi : &lo, sizeof(double));
                    want2[n2] = e ? t_hi : t_lo;
                    src2[n2++] = r;
                }
            }
        }
        if (rows[r].lp_k < 0 || out[r].id != want)
            continue;
        float lp;
        int32_t top_id[KERN_TOP_LOGPROBS_MAX];
        float top_lp[KERN_TOP_LOGPROBS_MAX];
        engine_logprobs(xm, n_vocab, want, rows[r].lp_k, &lp, top_id, top_lp);
        if (!(fabsf(out[r].lp - lp) <= 1e-5f * (1.0f + fabsf(lp))) && !(lp == out[r].lp))
            report(c, "sample", "row %d: logprob %g, host %g", r, out[r].lp, lp);
        /* the same sums in the same order: on the emulator (glibc's log) the same bits */
        if (lp_same && memcmp(&out[r].lp, &lp, sizeof(lp)))
            report(c, "sample", "row %d: logprob %a, host %a (the emulator's differs)", r,
                   (double)out[r].lp, (double)lp);
        for (int j = 0; j < rows[r].lp_k; j++)
            if (out[r].top_id[j] != top_id[j] ||
                !(fabsf(out[r].top_lp[j] - top_lp[j]) <= 1e-5f * (1.0f + fabsf(top_lp[j])) ||
                  out[r].top_lp[j] == top_lp[j]))
                report(c, "sample", "row %d: top %d is %d (%g), host %d (%g)", r, j,
                       out[r].top_id[j], out[r].top_lp[j], top_id[j], top_lp[j]);
    }
    if (drawn != n - left)
        report(c, "sample", "returned %d rows drawn, %d have ids", drawn, n - left);
    if (4 * nucleus_left > 3 * nucleus) /* the device's nucleus path must run for most */
        report(c, "sample", "%d of %d top_p/min_p rows left to the host", nucleus_left, nucleus);
    /* pass 2: each boundary pair's rows (the same logits, penalties and mask) */
    float *x2 = malloc(sizeof(float) * (size_t)(n2 ? n2 : 1) * (size_t)n_vocab);
    struct kern_sample_out *out2 = calloc((size_t)(n2 ? n2 : 1), sizeof(*out2));
    assert_true(x2 && out2);
    for (int i = 0; i < n2; i++) {
        memcpy(x2 + (size_t)i * (size_t)n_vocab, x + (size_t)src2[i] * (size_t)n_vocab,
               sizeof(float) * (size_t)n_vocab);
        rows2[i].lp_k = -1;
    }
    int drawn2 = 0;
    if (n2) {
        float *d2 = to_be(c, x2, sizeof(float) * (size_t)n2 * (size_t)n_vocab);
        k->sample(c->be, d2, n2, n_vocab, rows2, pen_id, pen_cnt, n_pen, masks, n_masks, out2);
        bfree(c, d2);
    }
    for (int i = 0; i < n2; i++) {
        drawn2 += out2[i].id >= 0;
        if (out2[i].id >= 0 && out2[i].id != want2[i])
            report(c, "sample", "row %d at the boundary uniform %.17g: id %d, host %d", src2[i],
                   rows2[i].u, out2[i].id, want2[i]);
    }
    if (2 * drawn2 < n2 || n2 < n / 2)
        report(c, "sample", "only %d of %d boundary draws on the backend (%d rows)", drawn2, n2,
               n2 / 2);
    if (!c->quiet)
        printf("  %s sample over %d tokens: %d rows drawn on the backend, %d left to the host; "
               "%d boundary draws\n",
               c->label, n_vocab, drawn, left, drawn2);
    free(x2);
    free(out2);
    free(rows2);
    free(want2);
    free(src2);
    free(masks);
    engine_sampler_free(smp);
    free(x);
    free(ref);
    free(row);
    free(hist);
    free(pen_id);
    free(pen_cnt);
    free(rows);
    free(out);
}

static void check_attentions(struct check *c);

static void check_backend(struct check *c, int all_ops)
{
    static const uint32_t types[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0, DTYPE_Q8_0,
                                     DTYPE_Q4_K, DTYPE_Q6_K, DTYPE_F16,  DTYPE_F32};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        const int ksz = dtype_get(types[i])->block_elems == 256;
        check_matmul(c, types[i], ksz ? 512 : 576, 33, 1);
        check_matmul(c, types[i], ksz ? 256 : 192, 100, 17);
    }
    check_matmul(c, DTYPE_Q4_1, 576, 192, 5);
    check_matmul(c, DTYPE_Q8_0, 576, 600, 19); /* three hook ranges, the last partial */
    check_ffn(c, DTYPE_Q4_1, 576, 256, 3, KERN_GLU_SILU);
    check_invariance(c, DTYPE_Q4_0, 256, 72);
    check_invariance(c, DTYPE_Q6_K, 256, 40);
    check_invariance(c, DTYPE_F16, 96, 40);
    /* CUDA bf16: K in 4 and 8 slices, side by side for 1 token, in turn for 20 and 70 */
    check_invariance(c, DTYPE_Q4_0, 1024, 72);
    check_invariance(c, DTYPE_Q4_K, 2560, 40);
    if (!all_ops)
        return;
    check_ffn(c, DTYPE_Q8_0, 96, 160, 1, KERN_GLU_SILU);
    check_ffn(c, DTYPE_Q4_1, 96, 160, 5, KERN_GLU_GELU);
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        check_small_ops(c, types[i], dtype_get(types[i])->block_elems == 256 ? 256 : 96);
    check_attentions(c);
    if (c->be->ops->sample) {
        check_sample(c, 5000);
        check_sample(c, 49152);
    }
}

/* Attention over every KV type, head shape, window and softcap the models use. */
static void check_attentions(struct check *c)
{
    check_attention(c, KERN_KV_F16, 9, 3, 64, 0, 0);
    check_attention(c, KERN_KV_Q8, 9, 3, 64, 0, 0);
    check_attention(c, KERN_KV_F16, 4, 4, 32, 0, 0);
    check_attention(c, KERN_KV_F16, 8, 1, 128, 0, 0);
    /* sliding windows: inside a block, across blocks, at a block's edge; Gemma's head_dim 256 */
    check_attention(c, KERN_KV_F16, 9, 3, 64, 5, 0);
    check_attention(c, KERN_KV_Q8, 4, 2, 64, 23, 0);
    check_attention(c, KERN_KV_F16, 4, 1, 256, 16, 0);
    /* soft-capped scores (Gemma 2; a cap the scores here reach, so tanh bends them) */
    check_attention(c, KERN_KV_F16, 9, 3, 64, 0, 1.5f);
    check_attention(c, KERN_KV_Q8, 4, 2, 128, 0, 1.5f);
    check_attention(c, KERN_KV_F16, 4, 1, 256, 16, 1.5f);
}

/* ---- the backends ---------------------------------------------------------------------------- */

static const char *const isas[] = {"scalar", "avx2", "avxvnni", "avx512", "amx"};
static const enum kern_act acts[] = {KERN_ACT_F32, KERN_ACT_Q16, KERN_ACT_Q8, KERN_ACT_BF16};
static const char *const act_names[] = {"exact", "q16", "q8", "bf16"};

/* Every CPU table this machine runs, in every matmul mode it offers, as a device (every byte
 * through upload/download) and with the exact mode also as host memory. */
static void test_cpu_backends(void **state)
{
    (void)state;
    /* the default matmul mode: bf16 where the table that runs has AMX-BF16 tiles, else q8 */
    assert_int_equal(kern_default_act("cpu", "scalar"), KERN_ACT_Q8);
    assert_int_equal(kern_default_act("cpu", NULL),
                     kern_cpu_fns_best()->prep_bf16 ? KERN_ACT_BF16 : KERN_ACT_Q8);
    assert_int_equal(kern_default_act("cpu", "amx"),
                     kern_cpu_fns_get(KERN_ISA_AMX) && kern_cpu_fns_get(KERN_ISA_AMX)->prep_bf16
                         ? KERN_ACT_BF16
                         : KERN_ACT_Q8);
    assert_int_equal(kern_default_act("cuda", NULL), KERN_ACT_F32);
    int tested = 0;
    for (size_t i = 0; i < sizeof(isas) / sizeof(isas[0]); i++)
        for (size_t m = 0; m < sizeof(acts) / sizeof(acts[0]); m++)
            for (int dev = 1; dev >= (m == 0 ? 0 : 1); dev--) {
                struct kern_backend_opts o = {"cpu", 2, isas[i], acts[m], dev, 1, 0};
                struct err_detail err = {0};
                struct check c = {0};
                if (kern_backend_open(&c.be, &o, &err)) {
                    if (dev)
                        printf("  cpu %s %s: not on this machine (%s)\n", isas[i], act_names[m],
                               err.msg);
                    continue;
                }
                char label[64];
                snprintf(label, sizeof(label), "%s %s%s", kern_backend_describe(c.be), act_names[m],
                         dev ? " (device path)" : "");
                c.label = label;
                c.act = acts[m];
                c.cpu = kern_cpu_fns_get((enum kern_isa)i);
                c.r.s = 1000 + i * 10 + m;
                check_backend(&c, m == 0);
                if (acts[m] == KERN_ACT_BF16) /* its attention runs on the tiles */
                    check_attentions(&c);
                printf("  %s: %s\n", label, c.fails ? "FAILED" : "every op within tolerance");
                assert_int_equal(c.fails, 0);
                kern_backend_free(c.be);
                tested++;
            }
    assert_true(tested >= 2); /* at least the scalar table, both ways */
}

/* kern_ops.sample broken three ways (the test of check_sample): 0 the temperature ignored, 1 the
 * penalties dropped, 2 the masks dropped. */
static const struct kern_ops *g_sample_real;
static int g_sample_bad;

static int bad_sample(struct kern_backend *b, const float *logits, int n, int32_t n_vocab,
                      const struct kern_sample_row *rows, const int32_t *pen_id,
                      const int32_t *pen_count, int n_pen, const uint32_t *masks, int n_masks,
                      struct kern_sample_out *out)
{
    struct kern_sample_row *r = malloc(sizeof(*r) * (size_t)n);
    assert_non_null(r);
    for (int i = 0; i < n; i++) {
        r[i] = rows[i];
        if (g_sample_bad == 0 && r[i].temperature > 0.0f)
            r[i].temperature = 1.0f;
        if (g_sample_bad == 1)
            r[i].pen_n = 0;
        if (g_sample_bad == 2)
            r[i].mask = -1;
    }
    const int drawn = g_sample_real->sample(b, logits, n, n_vocab, r, pen_id, pen_count, n_pen,
                                            masks, n_masks, out);
    free(r);
    return drawn;
}

static void check_broken_sample(struct kern_backend *real)
{
    static const char *const what[3] = {"temperature ignored", "penalties dropped",
                                        "masks dropped"};
    g_sample_real = real->ops;
    struct kern_ops bad = *real->ops;
    bad.sample = bad_sample;
    struct kern_backend be = *real;
    be.ops = &bad;
    for (g_sample_bad = 0; g_sample_bad < 3; g_sample_bad++) {
        struct check c = {.be = &be, .label = what[g_sample_bad], .quiet = 1};
        c.r.s = 99;
        check_sample(&c, 5000);
        printf("  sample broken (%s): %d failed checks\n", what[g_sample_bad], c.fails);
        if (!c.fails)
            fail_msg("a backend with sample broken (%s) passed every check", what[g_sample_bad]);
    }
}

/* The CUDA backend in its three modes (exact: f32 kernels; bf16, q8: tensor cores), when this build
 * has it and a GPU is here. Elsewhere it says why it did not run; with QUERN_REQUIRE_CUDA=1
 * (scripts/gpu-check.sh) no GPU is a failure. */
/* The bf16 mode's attention on tensor cores (QUERN_CUDA_ATTN_MMA, on by default: f16 K/V and
 * head_dim a multiple of 16 up to 128), against the double reference within what rounding the
 * scaled queries and the probabilities to halves costs (5e-3; the f32 kernel is held to 2e-4),
 * and bitwise alone as in its batch (check_attention): heads per KV head 1 to 32 (tiles of 16
 * tokens of one head to one token of 16 heads, and 5 tokens of 3: tiles that span two
 * sequences), head_dim 32 to 128, a window, a soft-cap, splits of 24 positions (pieces that
 * straddle the 16-position runs) and token slices; 8-bit KV too (its values as halves, the
 * keys' scales applied to the scores, the values' folded into the probabilities; held to the
 * 8-bit tolerance). head_dim 256 falls back to the f32 kernel. QUERN_CUDA_ATTN_MMA=0 changes the
 * output (f16 and 8-bit), so the kernel runs. */
static void check_cuda_attn_mma(void)
{
    static const struct {
        const char *split, *part, *label;
    } cfg[] = {{"0", "", "cuda bf16 attention on tensor cores"},
               {"24", "", "cuda bf16 attention on tensor cores, split by 24"},
               {"24", "20000", "cuda bf16 attention on tensor cores, split, token slices"}};
    for (size_t i = 0; i < sizeof(cfg) / sizeof(cfg[0]); i++) {
        setenv("QUERN_CUDA_ATTN_SPLIT", cfg[i].split, 1);
        if (*cfg[i].part)
            setenv("QUERN_CUDA_ATTN_PART", cfg[i].part, 1);
        struct kern_backend_opts o = {"cuda", 2, NULL, KERN_ACT_BF16, 1, 1, 0};
        struct err_detail err = {0};
        struct check c = {.label = cfg[i].label, .act = KERN_ACT_BF16, .att_tol = 5e-3};
        c.r.s = 4800 + i;
        assert_int_equal(kern_backend_open(&c.be, &o, &err), ST_OK);
        check_attention(&c, KERN_KV_F16, 9, 3, 64, 0, 0);
        check_attention(&c, KERN_KV_F16, 4, 4, 32, 0, 0);
        check_attention(&c, KERN_KV_F16, 8, 1, 128, 0, 0);
        check_attention(&c, KERN_KV_F16, 16, 1, 48, 0, 0);
        check_attention(&c, KERN_KV_F16, 32, 1, 32, 0, 0); /* two tiles of 16 heads a KV head */
        check_attention(&c, KERN_KV_F16, 12, 2, 32, 7, 0); /* 6 heads a KV head: 12 rows of 16 */
        check_attention(&c, KERN_KV_F16, 9, 3, 64, 5, 0);
        check_attention(&c, KERN_KV_F16, 8, 2, 64, 23, 1.5f);
        check_attention(&c, KERN_KV_Q8, 4, 2, 64, 0, 0);
        check_attention(&c, KERN_KV_Q8, 9, 3, 64, 5, 0);
        check_attention(&c, KERN_KV_Q8, 8, 1, 128, 0, 1.5f);
        check_attention(&c, KERN_KV_F16, 4, 1, 256, 16, 0);
        printf("  %s: %s\n", c.label, c.fails ? "FAILED" : "within tolerance");
        assert_int_equal(c.fails, 0);
        kern_backend_free(c.be);
        unsetenv("QUERN_CUDA_ATTN_PART");
    }
    unsetenv("QUERN_CUDA_ATTN_SPLIT");
    for (int q8 = 0; q8 < 2; q8++) {
        float *got[2] = {NULL, NULL};
        size_t n_got = 0;
        for (int mma = 1; mma >= 0; mma--) {
            setenv("QUERN_CUDA_ATTN_MMA", mma ? "1" : "0", 1);
            struct kern_backend_opts o = {"cuda", 2, NULL, KERN_ACT_BF16, 1, 1, 0};
            struct err_detail err = {0};
            struct check c = {
                .label = "cuda bf16 attention", .act = KERN_ACT_BF16, .keep = 1, .att_tol = 5e-3};
            c.r.s = 4900;
            assert_int_equal(kern_backend_open(&c.be, &o, &err), ST_OK);
            check_attention(&c, q8 ? KERN_KV_Q8 : KERN_KV_F16, 9, 3, 64, 0, 0);
            assert_int_equal(c.fails, 0);
            got[mma] = c.kept;
            n_got = c.kept_n;
            kern_backend_free(c.be);
        }
        unsetenv("QUERN_CUDA_ATTN_MMA");
        assert_true(memcmp(got[0], got[1], sizeof(float) * n_got) != 0);
        free(got[0]);
        free(got[1]);
    }
}

/* kern_ops.graph_begin/graph_end (CUDA graphs): a key is captured the second time it is asked
 * for, the captured ops run once (when the graph is launched at graph_end, not while
 * recorded), a replay reads device memory as it is then, freed memory drops the graphs; a
 * capture broken by an allocation fails at graph_end and turns graphs off. y += x stands for a
 * step's ops. */
static void check_graphs(struct kern_backend *be)
{
    const struct kern_ops *k = be->ops;
    enum { N = 100 };
    float a[N], b[N], y[N], want[N];
    for (int i = 0; i < N; i++) {
        a[i] = (float)i;
        b[i] = 1000.0f + (float)i;
    }
    float *dx = k->buf_alloc(be, sizeof(a)), *dy = k->buf_alloc(be, sizeof(a));
    assert_true(dx && dy);
    memset(y, 0, sizeof(y));
    k->upload(be, dx, a, sizeof(a));
    k->upload(be, dy, y, sizeof(y));
    const uint64_t key = 0x5eed;
    assert_int_equal(k->graph_begin(be, key), KERN_GRAPH_NONE); /* first time: run */
    k->add(be, dy, dx, N);
    assert_int_equal(k->graph_begin(be, key), KERN_GRAPH_CAPTURE); /* again: recorded */
    k->add(be, dy, dx, N);
    assert_int_equal(k->graph_end(be), 1); /* ... and launched once */
    k->upload(be, dx, b, sizeof(b));
    assert_int_equal(k->graph_begin(be, key), KERN_GRAPH_REPLAYED); /* reads the new x */
    k->download(be, y, dy, sizeof(y));
    for (int i = 0; i < N; i++)
        want[i] = a[i] + a[i] + b[i];
    assert_memory_equal(y, want, sizeof(y));
    /* memory given back drops every graph (a later allocation could reuse its address in
     * another role): the key is new again */
    k->buf_free(be, k->buf_alloc(be, 64));
    assert_int_equal(k->graph_begin(be, key), KERN_GRAPH_NONE);
    k->add(be, dy, dx, N);
    assert_int_equal(k->graph_begin(be, key), KERN_GRAPH_CAPTURE);
    k->add(be, dy, dx, N);
    assert_int_equal(k->graph_end(be), 1);
    k->download(be, y, dy, sizeof(y));
    for (int i = 0; i < N; i++)
        want[i] += b[i] + b[i];
    assert_memory_equal(y, want, sizeof(y));
    /* an allocation inside a capture breaks it: graph_end fails, graphs are off */
    assert_int_equal(k->graph_begin(be, key + 1), KERN_GRAPH_NONE);
    assert_int_equal(k->graph_begin(be, key + 1), KERN_GRAPH_CAPTURE);
    assert_null(k->buf_alloc(be, 64));
    assert_int_equal(k->graph_end(be), 0);
    assert_int_equal(k->graph_begin(be, key), KERN_GRAPH_NONE);
    assert_int_equal(k->graph_begin(be, key), KERN_GRAPH_NONE);
    k->buf_free(be, dx);
    k->buf_free(be, dy);
    printf("  cuda graphs: captured the second time, launched once, replayed with new inputs, "
           "dropped when memory is freed; a broken capture fails and turns them off\n");
}

static void test_cuda_backend(void **state)
{
    (void)state;
    static const enum kern_act modes[3] = {KERN_ACT_F32, KERN_ACT_BF16, KERN_ACT_Q8};
    static const char *const mode_names[3] = {"exact", "bf16", "q8"};
    for (int i = 0; i < 3; i++) {
        struct kern_backend_opts o = {"cuda", 2, NULL, modes[i], 1, 1, 0};
        struct err_detail err = {0};
        struct check c = {0};
        if (kern_backend_open(&c.be, &o, &err)) {
            const char *req = getenv("QUERN_REQUIRE_CUDA");
            if (req && !strcmp(req, "1"))
                fail_msg("QUERN_REQUIRE_CUDA=1 but the CUDA backend did not open: %s", err.msg);
            printf("  cuda: not tested here (%s)\n", err.msg);
            return;
        }
        char label[200];
        snprintf(label, sizeof(label), "%s %s", kern_backend_describe(c.be), mode_names[i]);
        c.label = label;
        c.act = modes[i];
        c.r.s = 4242 + (uint64_t)i;
        check_backend(&c, i == 0);
        printf("  %s: %s\n", label, c.fails ? "FAILED" : "every op within tolerance");
        assert_int_equal(c.fails, 0);
        if (i == 0 && c.be->ops->sample)
            check_broken_sample(c.be);
        if (i == 0 && c.be->ops->graph_begin)
            check_graphs(c.be);
        kern_backend_free(c.be);
    }
    /* the matmul kernels each layout and mode can take: weights as GGUF rows (the kernels F16
     * and F32 use), and the packed layout (cuda_pack.h) on the tensor-core kernel in 64-token
     * blocks from one token and in 16-token blocks up to 70 tokens (nine blocks); and cuBLAS on
     * bf16 copies from one token, of the packed and of the GGUF rows (on the emulator, a kernel
     * with cublasGemmEx's semantics) */
    static const struct {
        const char *pack, *small, *blas;
        enum kern_act act;
    } knobs[] = {{"0", "16", "0", KERN_ACT_F32},  {"0", "16", "0", KERN_ACT_BF16},
                 {"1", "0", "0", KERN_ACT_BF16},  {"1", "100", "0", KERN_ACT_BF16},
                 {"1", "16", "1", KERN_ACT_BF16}, {"0", "16", "1", KERN_ACT_BF16},
                 {"0", "16", "0", KERN_ACT_Q8}};
    for (size_t i = 0; i < sizeof(knobs) / sizeof(knobs[0]); i++) {
        setenv("QUERN_CUDA_PACK", knobs[i].pack, 1);
        setenv("QUERN_CUDA_MMA_SMALL", knobs[i].small, 1);
        setenv("QUERN_CUDA_CUBLAS_MIN", knobs[i].blas, 1);
        struct kern_backend_opts o = {"cuda", 2, NULL, knobs[i].act, 1, 1, 0};
        struct err_detail err = {0};
        char label[128];
        snprintf(label, sizeof(label),
                 "cuda %s, QUERN_CUDA_PACK=%s QUERN_CUDA_MMA_SMALL=%s QUERN_CUDA_CUBLAS_MIN=%s",
                 knobs[i].act == KERN_ACT_BF16 ? "bf16"
                 : knobs[i].act == KERN_ACT_Q8 ? "q8"
                                               : "exact",
                 knobs[i].pack, knobs[i].small, knobs[i].blas);
        struct check c = {.label = label, .act = knobs[i].act};
        c.r.s = 4400 + i;
        assert_int_equal(kern_backend_open(&c.be, &o, &err), ST_OK);
        static const uint32_t p4[] = {DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q4_K,
                                      DTYPE_Q8_0, DTYPE_Q5_0, DTYPE_Q6_K};
        for (size_t t = 0; t < sizeof(p4) / sizeof(p4[0]); t++) {
            const int ksz = dtype_get(p4[t])->block_elems == 256;
            check_matmul(&c, p4[t], ksz ? 768 : 160, 41, 1);
            check_matmul(&c, p4[t], ksz ? 256 : 96, 70, 70);
            check_matmul(&c, p4[t], ksz ? 2560 : 2336, 9,
                         3); /* > 16 groups: the exact GEMV's warps take several runs */
        }
        check_ffn(&c, DTYPE_Q4_1, 96, 160, 9, KERN_GLU_SILU);
        check_matmul(&c, DTYPE_Q4_0, 160, 300, 20); /* three blocks of 128 rows, the last partial */
        /* the bf16 kernels' K slices (kcu_p4_slices): 4 of 2 groups; 8 of 3, the last of 1 and
         * one empty (check_backend checks their batch invariance) */
        check_matmul(&c, DTYPE_Q4_0, 1024, 72, 18);
        printf("  %s: %s\n", c.label, c.fails ? "FAILED" : "within tolerance");
        assert_int_equal(c.fails, 0);
        kern_backend_free(c.be);
    }
    unsetenv("QUERN_CUDA_PACK");
    unsetenv("QUERN_CUDA_MMA_SMALL");
    unsetenv("QUERN_CUDA_CUBLAS_MIN");
    /* attention with each run of keys and values staged in shared memory once for the query
     * heads of a KV head (the default) and read by each head's warp itself
     * (QUERN_CUDA_ATTN_STAGE=0): bitwise the same, for groups of 1, 3, 4 and 8 heads, f16 and
     * 8-bit KV, head_dim 64 to 256 (the largest staged), windows, soft-caps and splits; in
     * both modes (bf16: the tensor-core kernel's runs through shared memory by cp.async and
     * ldmatrix, or each lane's halves read directly), the bf16 mode also over blocks of 32
     * positions (runs that start inside a block) */
    static const struct {
        int dtype, H, KV, D, window;
        float softcap;
        const char *split;
    } att[] = {{KERN_KV_F16, 9, 3, 64, 0, 0, "0"},     {KERN_KV_Q8, 9, 3, 64, 0, 0, "0"},
               {KERN_KV_F16, 4, 4, 32, 0, 0, "0"},     {KERN_KV_F16, 8, 1, 128, 0, 0, "24"},
               {KERN_KV_Q8, 4, 1, 256, 16, 1.5f, "0"}, {KERN_KV_F16, 8, 2, 64, 23, 0, "24"}};
    for (size_t i = 0; i < 3 * sizeof(att) / sizeof(att[0]); i++) {
        const int bf = i % 3 > 0; /* the mode */
        float *got[2] = {NULL, NULL};
        size_t n_got = 0;
        for (int stage = 1; stage >= 0; stage--) {
            setenv("QUERN_CUDA_ATTN_STAGE", stage ? "1" : "0", 1);
            setenv("QUERN_CUDA_ATTN_SPLIT", att[i / 3].split, 1);
            const int act = bf ? KERN_ACT_BF16 : KERN_ACT_F32;
            struct kern_backend_opts o = {"cuda", 2, NULL, act, 1, 1, 0};
            struct err_detail err = {0};
            struct check c = {.label = "cuda attention staged / unstaged",
                              .act = act,
                              .keep = 1,
                              .att_tol = bf ? 5e-3 : 0,
                              .kv_block = i % 3 == 2 ? 32 : 16};
            c.r.s = 4500 + i / 3;
            assert_int_equal(kern_backend_open(&c.be, &o, &err), ST_OK);
            check_attention(&c, att[i / 3].dtype, att[i / 3].H, att[i / 3].KV, att[i / 3].D,
                            att[i / 3].window, att[i / 3].softcap);
            assert_int_equal(c.fails, 0);
            got[stage] = c.kept;
            n_got = c.kept_n;
            kern_backend_free(c.be);
        }
        if (memcmp(got[0], got[1], sizeof(float) * n_got))
            fail_msg("attention %zu (%s, blocks of %d): staged output differs from unstaged", i / 3,
                     bf ? "bf16" : "exact", i % 3 == 2 ? 32 : 16);
        free(got[0]);
        free(got[1]);
    }
    unsetenv("QUERN_CUDA_ATTN_STAGE");
    unsetenv("QUERN_CUDA_ATTN_SPLIT");
    printf("  cuda attention, K/V staged: bitwise the unstaged output (6 shapes, both modes; "
           "bf16 also in blocks of 32)\n");
    /* head_dim 512 (KERN_MAX_HEAD_DIM): too wide to stage, read directly */
    {
        struct kern_backend_opts o = {"cuda", 2, NULL, KERN_ACT_F32, 1, 1, 0};
        struct err_detail err = {0};
        struct check c = {.label = "cuda attention head_dim 512", .act = KERN_ACT_F32};
        c.r.s = 4600;
        assert_int_equal(kern_backend_open(&c.be, &o, &err), ST_OK);
        check_attention(&c, KERN_KV_F16, 4, 2, 512, 0, 0);
        assert_int_equal(c.fails, 0);
        kern_backend_free(c.be);
    }
    /* attention split over the positions (flash-decoding) in runs of 24, so that these short
     * sequences (up to 70 positions) take 1 to 3 splits, sliding windows across splits too */
    setenv("QUERN_CUDA_ATTN_SPLIT", "24", 1);
    struct kern_backend_opts o = {"cuda", 2, NULL, KERN_ACT_F32, 1, 1, 0};
    struct err_detail err = {0};
    struct check c = {.label = "cuda attention split by 24", .act = KERN_ACT_F32};
    c.r.s = 4343;
    assert_int_equal(kern_backend_open(&c.be, &o, &err), ST_OK);
    check_attention(&c, KERN_KV_F16, 9, 3, 64, 0, 0);
    check_attention(&c, KERN_KV_Q8, 4, 2, 128, 0, 1.5f);
    check_attention(&c, KERN_KV_F16, 4, 2, 64, 40, 0);
    check_attention(&c, KERN_KV_F16, 4, 1, 256, 48, 0);
    printf("  %s: %s\n", c.label, c.fails ? "FAILED" : "within tolerance");
    assert_int_equal(c.fails, 0);
    kern_backend_free(c.be);
    /* ... with a scratch of 20,000 floats: tokens in slices of 2 to 5 (every slice after the
     * first offsets its rows, queries and outputs), of 1,000: too small for one token's
     * shares, so unsplit, and of 1,500: 2 splits a token of 9 heads, so a token of more runs goes
     * unsplit while sequence 0's tokens (2 runs) stay split in the batch as alone */
    static const char *const parts[3] = {"20000", "1000", "1500"};
    static const char *const part_labels[3] = {
        "cuda attention split in token slices", "cuda attention, split scratch too small",
        "cuda attention, scratch for 2 splits a token (longer tokens unsplit, in any batch)"};
    for (int i = 0; i < 3; i++) {
        setenv("QUERN_CUDA_ATTN_PART", parts[i], 1);
        struct check cs = {.label = part_labels[i], .act = KERN_ACT_F32};
        cs.r.s = 4700 + (uint64_t)i;
        assert_int_equal(kern_backend_open(&cs.be, &o, &err), ST_OK);
        check_attention(&cs, KERN_KV_F16, 9, 3, 64, 0, 0);
        check_attention(&cs, KERN_KV_F16, 4, 1, 256, 48, 0);
        printf("  %s: %s\n", cs.label, cs.fails ? "FAILED" : "within tolerance");
        assert_int_equal(cs.fails, 0);
        kern_backend_free(cs.be);
    }
    unsetenv("QUERN_CUDA_ATTN_PART");
    unsetenv("QUERN_CUDA_ATTN_SPLIT");
    check_cuda_attn_mma();
}

/* ---- the test of the test: one op broken at a time -------------------------------------- */

static struct kern_ops g_real; /* the working table the broken ones call */

static void bad_matmul(struct kern_backend *b, const struct kern_tensor *const *w, float *const *y,
                       int n_w, const struct kern_mm_in *in, int n_tok)
{
    g_real.matmul(b, w, y, n_w, in, n_tok);
    float v; /* one output element off by a relative 1e-3 */
    g_real.download(b, &v, y[n_w - 1] + 3, sizeof v);
    v *= 1.001f;
    g_real.upload(b, y[n_w - 1] + 3, &v, sizeof v);
}

static void bad_ffn(struct kern_backend *b, const struct kern_tensor *gate,
                    const struct kern_tensor *up, const struct kern_tensor *down,
                    const struct kern_mm_in *in, int glu, float *y, float *gate_buf, float *up_buf,
                    int n_tok)
{
    (void)gate; /* the up projection read as the gate too */
    g_real.ffn(b, up, up, down, in, glu, y, gate_buf, up_buf, n_tok);
}

static int bad_argmax(struct kern_backend *b, const struct kern_tensor *w,
                      const struct kern_mm_in *in, int n_tok, int32_t *ids)
{
    if (!g_real.matmul_argmax(b, w, in, n_tok, ids))
        return 0;
    int32_t id; /* ties to the highest row instead: here, any other row */
    g_real.download(b, &id, ids, sizeof id);
    id = (int32_t)((id + 1) % w->ne1);
    g_real.upload(b, ids, &id, sizeof id);
    return 1;
}

static void bad_add(struct kern_backend *b, float *y, const float *x, long n)
{
    g_real.add(b, y, x, n > 1 ? n - 1 : n); /* forgets the last element */
}

static void bad_rope(struct kern_backend *b, float *x, const float *cs, int n_tok, int n_head,
                     int head_dim, int rot_dim, int neox)
{
    g_real.rope(b, x, cs, n_tok, n_head, head_dim, rot_dim > 2 ? rot_dim - 2 : rot_dim, neox);
}

static void bad_rope_mode(struct kern_backend *b, float *x, const float *cs, int n_tok, int n_head,
                          int head_dim, int rot_dim, int neox)
{
    g_real.rope(b, x, cs, n_tok, n_head, head_dim, rot_dim, 0); /* NORM pairs for NEOX */
    (void)neox;
}

static void bad_add_rows(struct kern_backend *b, float *y, const float *bias, long n_rows,
                         int width)
{
    g_real.add_rows(b, y, bias, n_rows > 1 ? n_rows - 1 : n_rows, width); /* the last row */
}

static void bad_norm_rows(struct kern_backend *b, float *x, const float *w, long n_rows, int width,
                          float eps)
{
    g_real.norm_rows(b, x, w, n_rows, width, eps * 1e5f); /* a far larger epsilon */
}

static void bad_scale(struct kern_backend *b, float *x, float s, long n)
{
    g_real.scale(b, x, s, n > 1 ? n - 1 : n);
}

static void bad_window(struct kern_backend *b, const struct kern_attn *a)
{
    struct kern_attn a2 = *a;
    a2.window = a->window ? a->window + 1 : 0; /* one key too many */
    g_real.attention(b, &a2);
}

static void bad_softcap(struct kern_backend *b, const struct kern_attn *a)
{
    struct kern_attn a2 = *a;
    a2.softcap = 0; /* the cap forgotten */
    g_real.attention(b, &a2);
}

static void bad_get_rows(struct kern_backend *b, const struct kern_tensor *w, const int32_t *ids,
                         int n, float *out)
{
    g_real.get_rows(b, w, ids, n > 1 ? n - 1 : n, out); /* the last row is left unwritten */
    if (n > 1) {
        float z = 0;
        g_real.upload(b, out + (size_t)(n - 1) * (size_t)w->ne0, &z, sizeof z);
    }
}

static void bad_attention(struct kern_backend *b, const struct kern_attn *a)
{
    struct kern_attn a2 = *a;
    a2.scale *= 1.01f; /* a slightly wrong softmax temperature */
    g_real.attention(b, &a2);
}

static void bad_kv_store(struct kern_backend *b, struct kern_kv_layer kv,
                         const struct kern_block_table *bt, const int32_t *pos, int block_size,
                         int n_kv_head, int head_dim, const float *k, const float *v, int n_tok,
                         const uint8_t *skip)
{
    g_real.kv_store(b, kv, bt, pos, block_size, n_kv_head, head_dim, k, v, n_tok / 2, skip);
}

static void bad_kv_copy(struct kern_backend *b, const struct kern_kv_desc *d,
                        const struct kern_kv_layer *layers, int32_t dst, int32_t src)
{
    struct kern_kv_desc d1 = *d;
    d1.n_layer--; /* the last layer left out */
    g_real.kv_copy(b, &d1, layers, dst, src);
}

/* sizes the scratch for one position: attention's workspaces are then made in the call */
static enum status bad_reserve(struct kern_backend *b, int max_tok, int64_t max_width,
                               int32_t max_pos, struct err_detail *err)
{
    (void)max_pos;
    return g_real.reserve(b, max_tok, max_width, 1, err);
}

/* every slot adds: a token's first slot does not reset its row */
static void bad_moe_add(struct kern_backend *b, float *y, const float *x, const int32_t *rows,
                        const float *w, int n, long width)
{
    int32_t *r = malloc(sizeof(int32_t) * (size_t)n);
    g_real.download(b, r, rows, sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        r[i] = r[i] < 0 ? ~r[i] : r[i];
    int32_t *dr = g_real.buf_alloc(b, sizeof(int32_t) * (size_t)n);
    g_real.upload(b, dr, r, sizeof(int32_t) * (size_t)n);
    g_real.moe_add(b, y, x, dr, w, n, width);
    g_real.buf_free(b, dr);
    free(r);
}

static void bad_gather(struct kern_backend *b, float *dst, const float *src, const int32_t *idx,
                       int n, long width)
{
    g_real.gather(b, dst, src, idx, n, width > 1 ? width - 1 : width);
}

/* Broken copies of the scalar table (and of the AMX table in bf16 mode where this machine has
 * it: its greedy epilogue is the only matmul_argmax the CPU backend offers, and only its
 * attention's scratch grows with the positions). */
static void test_broken_ops_fail(void **state)
{
    (void)state;
    struct kern_backend_opts o = {"cpu", 2, "scalar", KERN_ACT_F32, 1, 1, 0};
    struct kern_backend_opts o_amx = {"cpu", 2, "amx", KERN_ACT_BF16, 1, 1, 0};
    struct err_detail err = {0};
    struct kern_backend *real, *amx = NULL;
    assert_int_equal(kern_backend_open(&real, &o, &err), ST_OK);
    if (kern_backend_open(&amx, &o_amx, &err))
        amx = NULL;
    g_real = *real->ops;
    static const char *const names[] = {"matmul",
                                        "matmul_argmax",
                                        "add",
                                        "rope",
                                        "get_rows",
                                        "attention",
                                        "kv_store",
                                        "gather",
                                        "ffn",
                                        "rope (neox)",
                                        "add_rows",
                                        "norm_rows",
                                        "scale",
                                        "attention (window)",
                                        "attention (softcap)",
                                        "kv_copy",
                                        "reserve",
                                        "moe_add"};
    for (int m = 0; m < (int)(sizeof(names) / sizeof(names[0])); m++) {
        if (m == 16 && amx) { /* a fresh one: the checks before grew its scratch already */
            kern_backend_free(amx);
            assert_int_equal(kern_backend_open(&amx, &o_amx, &err), ST_OK);
        }
        struct kern_backend *base = m == 1 || m == 16 ? amx : real;
        if (!base) {
            printf("  %s broken: no backend here offers it (AMX bf16 mode)\n", names[m]);
            continue;
        }
        g_real = *base->ops;
        struct kern_ops bad = g_real;
        switch (m) {
        case 0:
            bad.matmul = bad_matmul;
            break;
        case 1:
            bad.matmul_argmax = bad_argmax;
            break;
        case 2:
            bad.add = bad_add;
            break;
        case 3:
            bad.rope = bad_rope;
            break;
        case 4:
            bad.get_rows = bad_get_rows;
            break;
        case 5:
            bad.attention = bad_attention;
            break;
        case 6:
            bad.kv_store = bad_kv_store;
            break;
        case 7:
            bad.gather = bad_gather;
            break;
        case 8:
            bad.ffn = bad_ffn;
            break;
        case 9:
            bad.rope = bad_rope_mode;
            break;
        case 10:
            bad.add_rows = bad_add_rows;
            break;
        case 11:
            bad.norm_rows = bad_norm_rows;
            break;
        case 12:
            bad.scale = bad_scale;
            break;
        case 13:
            bad.attention = bad_window;
            break;
        case 14:
            bad.attention = bad_softcap;
            break;
        case 15:
            bad.kv_copy = bad_kv_copy;
            break;
        case 16: /* the tiles' workspaces (bf16 mode) */
            bad.reserve = bad_reserve;
            break;
        case 17:
            bad.moe_add = bad_moe_add;
            break;
        }
        struct kern_backend be = *base;
        be.ops = &bad;
        struct check c = {.be = &be,
                          .label = names[m],
                          .act = base == amx ? KERN_ACT_BF16 : KERN_ACT_F32,
                          .quiet = 1,
                          .cpu = kern_cpu_fns_get(base == amx ? KERN_ISA_AMX : KERN_ISA_SCALAR)};
        c.r.s = 77;
        check_backend(&c, 1);
        printf("  %s broken: %d failed checks\n", names[m], c.fails);
        if (!c.fails)
            fail_msg("a backend with %s broken passed every check", names[m]);
    }
    kern_backend_free(real);
    kern_backend_free(amx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_backends),
        cmocka_unit_test(test_cuda_backend),
        cmocka_unit_test(test_broken_ops_fail),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
