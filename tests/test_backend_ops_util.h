/* The checker of tests/test_backend_ops.c: the record of one backend's checks (failures counted,
 * printed unless quiet), backend-memory round trips, random inputs, weights made and dequantized
 * by the scalar table, and the double-precision references with their tolerances. */
#ifndef TESTS_TEST_BACKEND_OPS_UTIL_H
#define TESTS_TEST_BACKEND_OPS_UTIL_H

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
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernels.h"
#include "tests/test_rand.h"

struct check {
    struct kern_backend *be; /* backend under test */
    const char *label;       /* for messages */
    enum kern_act act;       /* its matmul mode */
    int fails;               /* failed comparisons */
    int quiet;               /* 1: count failures without printing (the broken backends) */
    struct rng r;            /* inputs */
    int keep;                /* 1: check_attention keeps its output in kept (kept_n floats) */
    float *kept;
    size_t kept_n;
    double att_tol; /* check_attention's tolerance for f16 KV (0: 2e-4, f32 sums) */
    int kv_block;   /* check_attention's positions per KV block (0: 16) */
    /* a CPU backend's table: its bf16 mode rounds only the packed weights of the types
     * gemm_bf16_packed takes and runs the rest exactly (kernels.h); NULL: every weight rounded
     * (CUDA) */
    const struct kern_cpu_fns *cpu;
};

static inline void report(struct check *c, const char *op, const char *fmt, ...)
{
    c->fails++;
    if (c->quiet || c->fails > 10)
        return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "  %s %s: ", c->label, op);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* Backend copy of host bytes (caller frees with buf_free). */
static inline void *to_be(struct check *c, const void *host, size_t bytes)
{
    void *d = c->be->ops->buf_alloc(c->be, bytes);
    assert_non_null(d);
    c->be->ops->upload(c->be, d, host, bytes);
    return d;
}

static inline void *from_be(struct check *c, const void *dev, size_t bytes)
{
    void *h = malloc(bytes ? bytes : 1);
    assert_non_null(h);
    c->be->ops->download(c->be, h, dev, bytes);
    return h;
}

static inline void bfree(struct check *c, void *d)
{
    c->be->ops->buf_free(c->be, d);
}

static inline void rand_floats(struct rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = rng_uniform(r, lo, hi);
}

/* A weight matrix of ne1 random rows of ne0 elements (host data: the reference reads it; the
 * backend gets its own copy through prepare). */
struct weight {
    struct kern_tensor t; /* as the engine hands it over */
    uint8_t *data;        /* host rows */
    float *deq;           /* ne1 x ne0, dequantized by the scalar table */
};

static inline void weight_make(struct check *c, struct weight *w, uint32_t type, int64_t ne0,
                               int64_t ne1)
{
    const size_t rb = dtype_row_bytes(type, ne0);
    w->data = malloc(rb * (size_t)ne1);
    w->deq = malloc(sizeof(float) * (size_t)(ne0 * ne1));
    assert_true(w->data && w->deq);
    const struct kern_cpu_fns *ref = kern_cpu_fns_get(KERN_ISA_SCALAR);
    for (int64_t i = 0; i < ne1; i++) {
        uint8_t *row = random_weights(type, ne0, &c->r);
        memcpy(w->data + (size_t)i * rb, row, rb);
        free(row);
        ref->dequant_row[type](w->data + (size_t)i * rb, w->deq + i * ne0, ne0);
    }
    memset(&w->t, 0, sizeof(w->t));
    w->t.type = type;
    w->t.ne0 = ne0;
    w->t.ne1 = ne1;
    w->t.row_bytes = rb;
    w->t.data = w->data;
    if (c->be->ops->prepare) {
        struct err_detail err = {0};
        assert_int_equal(c->be->ops->prepare(c->be, &w->t, &err), ST_OK);
    }
}

static inline void weight_free(struct check *c, struct weight *w)
{
    if (c->be->ops->release)
        c->be->ops->release(c->be, &w->t);
    free(w->data);
    free(w->deq);
}

/* Relative tolerance of a matmul element against the sum of |w x| of its terms, per mode: exact
 * f32 sums; 16-bit activations (1.5e-5 of a block maximum); bf16 products (8 mantissa bits of
 * both factors); 8-bit activations (1/254 of a block maximum). */
static inline double mm_tol(enum kern_act act)
{
    return act == KERN_ACT_F32    ? 2e-5
           : act == KERN_ACT_Q16  ? 2e-4
           : act == KERN_ACT_BF16 ? 1.2e-2
                                  : 2.5e-2;
}

/* v, or rounded to bfloat16 (nearest even) as the bf16 mode rounds weights and inputs. */
static inline float ref_round(float v, int bf16)
{
    return bf16 ? kern_bf16_to_f32(kern_f32_to_bf16(v)) : v;
}

/* y_ref[t][r] = row r of w . x[t] in double; mag[t][r] = sum of |terms|. With bf16 1 the
 * weights and inputs rounded first: what a bf16 backend must compute up to its sums' order. */
static inline void ref_matmul_r(const struct weight *w, const float *x, int n_tok, double *y,
                                double *mag, int bf16)
{
    const int64_t n = w->t.ne0, m = w->t.ne1;
    for (int t = 0; t < n_tok; t++)
        for (int64_t r = 0; r < m; r++) {
            double s = 0, a = 0;
            for (int64_t i = 0; i < n; i++) {
                const double p = (double)ref_round(w->deq[r * n + i], bf16) *
                                 ref_round(x[(size_t)t * n + i], bf16);
                s += p;
                a += fabs(p);
            }
            y[(size_t)t * m + r] = s;
            mag[(size_t)t * m + r] = a;
        }
}

static inline void ref_matmul(const struct weight *w, const float *x, int n_tok, double *y,
                              double *mag)
{
    ref_matmul_r(w, x, n_tok, y, mag, 0);
}

/* 1 for the weight types the q8 mode multiplies by quantized activations (the rest: exact). */
static inline int q8_type(uint32_t type)
{
    return type == DTYPE_Q4_0 || type == DTYPE_Q4_1 || type == DTYPE_Q5_0 || type == DTYPE_Q8_0 ||
           type == DTYPE_Q4_K || type == DTYPE_Q6_K;
}

/* ref_matmul with each input row first quantized by kern_ref_quantize_q8 (8 bits per block of
 * 32): what a q8 backend must compute up to its sums' order. */
static inline void ref_matmul_q8(const struct weight *w, const float *x, int n_tok, double *y,
                                 double *mag)
{
    const int64_t n = w->t.ne0, m = w->t.ne1;
    struct kern_q8 *xq = malloc(sizeof(*xq) * (size_t)(n / KERN_QK));
    double *xd = malloc(sizeof(double) * (size_t)n);
    assert_true(xq && xd);
    for (int t = 0; t < n_tok; t++) {
        kern_ref_quantize_q8(x + (size_t)t * n, xq, n);
        for (int64_t i = 0; i < n; i++)
            xd[i] = (double)xq[i / KERN_QK].d * xq[i / KERN_QK].q[i % KERN_QK];
        for (int64_t r = 0; r < m; r++) {
            double s = 0, a = 0;
            for (int64_t i = 0; i < n; i++) {
                const double p = (double)w->deq[r * n + i] * xd[i];
                s += p;
                a += fabs(p);
            }
            y[(size_t)t * m + r] = s;
            mag[(size_t)t * m + r] = a;
        }
    }
    free(xq);
    free(xd);
}

static inline void compare_mm(struct check *c, const char *op, const float *got, const double *want,
                              const double *mag, size_t n)
{
    const double tol = mm_tol(c->act);
    for (size_t i = 0; i < n; i++)
        if (!(fabs(got[i] - want[i]) <= tol * mag[i] + 1e-6)) {
            report(c, op, "element %zu: %g, reference %g (tolerance %g)", i, (double)got[i],
                   want[i], tol * mag[i] + 1e-6);
            return;
        }
}

/* rmsnorm in double: x / sqrt(mean(x^2) + eps) * w. */
static inline void ref_rmsnorm(const float *x, const float *w, double *y, int n, float eps)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    double k = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
        y[i] = x[i] * k * w[i];
}

static inline double silu(double g)
{
    return g / (1.0 + exp(-g));
}

#endif
