/* Unit tests for the CPU communicator (kernels/cpu/comm_cpu.h), and the host-staged one
 * (kernels/comm_staged.h) and the NCCL one (kernels/cuda/comm_nccl.h, where CUDA devices are: on
 * the emulator, QUERN_CUDA_EMU_DEVICES of them) through the same checks: all-reduce in f32 and bf16
 * bitwise against a scalar sum in rank order (and edge cases with known answers), all-gather
 * (also in place), barrier ordering, and mixed collectives back to back, for 1 to 8 ranks, each
 * rank on its own thread. Races the results cannot show are ThreadSanitizer's to find: build
 * this file and kernels/cpu/comm_cpu.c with clang -fsanitize=thread, the rest from libquern.a. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/comm.h"
#include "kernels/comm_staged.h"
#include "kernels/cpu/comm_cpu.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernels.h"
#ifdef QUERN_CUDA
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/comm_nccl.h"
#endif

#define MAX_RANKS 8

static const size_t sizes[] = {0, 1, 2, 3, 7, 31, 1000, 4097, 65537, 1u << 20};
#define N_SIZES (sizeof(sizes) / sizeof(sizes[0]))

/* ---- helpers ---------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A float of either sign with a random exponent in [-20, 20]: sums of a few of these round
 * differently in different orders. */
static float mixed_from_bits(uint64_t r)
{
    float m = 1.0f + (float)((r >> 40) & 0xFFFFFF) / 16777216.0f;
    float v = ldexpf(m, (int)((r >> 8) % 41) - 20);
    return (r & 1) ? -v : v;
}

static float mixed(uint64_t *s)
{
    return mixed_from_bits(splitmix64(s));
}

/* One thread per rank runs fn(job); the main thread waits for all. */
struct rank_job {
    struct kern_comm *c; /* this rank's handle */
    struct kern_backend *dev; /* NULL: buffers are host memory; else the rank's device backend */
    void *ctx;           /* the test's shared state */
    long bad;            /* mismatches this rank found itself */
    void (*fn)(struct rank_job *j);
};

static void *rank_main(void *v)
{
    struct rank_job *j = v;
    j->fn(j);
    return NULL;
}

/* 1: run_ranks makes the host-staged communicator (kernels/comm_staged.h) over CPU backends
 * that report device memory, instead of the CPU one; g_staged_bytes adds up what it staged. */
static int g_staged;
static size_t g_staged_bytes;
#ifdef QUERN_CUDA
/* 1: run_ranks makes the NCCL communicator over CUDA backends on devices 0, 1, ... */
static int g_nccl;
#endif

/* The collectives as a rank calls them on its host buffers: directly, or, on a device rank,
 * through device copies of them (made, filled, and read back around the call). */
static void rank_reduce(struct rank_job *j, void *x, size_t n, int bf16)
{
    const size_t bytes = n * (bf16 ? sizeof(uint16_t) : sizeof(float));
    struct kern_backend *b = j->dev;
    void *d = x;
    if (b) {
        assert_non_null(d = b->ops->buf_alloc(b, bytes ? bytes : 1));
        b->ops->upload(b, d, x, bytes);
    }
    if (bf16)
        kern_comm_all_reduce_sum_bf16(j->c, d, n);
    else
        kern_comm_all_reduce_sum_f32(j->c, d, n);
    if (b) {
        b->ops->download(b, x, d, bytes);
        b->ops->buf_free(b, d);
    }
}

static void rank_gather(struct rank_job *j, const void *in, void *out, size_t bytes)
{
    struct kern_backend *b = j->dev;
    if (!b) {
        kern_comm_all_gather(j->c, in, out, bytes);
        return;
    }
    const size_t total = bytes * (size_t)kern_comm_size(j->c);
    const size_t mine = bytes * (size_t)kern_comm_rank(j->c);
    const int in_place = in == (const char *)out + mine;
    void *d_out, *d_in;
    assert_non_null(d_out = b->ops->buf_alloc(b, total ? total : 1));
    b->ops->upload(b, d_out, out, total); /* the rank's part, when in place */
    d_in = (char *)d_out + mine;
    if (!in_place) {
        assert_non_null(d_in = b->ops->buf_alloc(b, bytes ? bytes : 1));
        b->ops->upload(b, d_in, in, bytes);
    }
    kern_comm_all_gather(j->c, d_in, d_out, bytes);
    b->ops->download(b, out, d_out, total);
    b->ops->buf_free(b, d_out);
    if (!in_place)
        b->ops->buf_free(b, d_in);
}

/* Runs fn on n_ranks threads of a fresh group; returns the mismatches the ranks reported. */
static long run_ranks(int n_ranks, void (*fn)(struct rank_job *), void *ctx)
{
    struct kern_cpu_comm_group *g = NULL;
    struct kern_staged_comm_group *sg = NULL;
    struct kern_backend *be[MAX_RANKS] = {0};
    struct err_detail err = {0};
#ifdef QUERN_CUDA
    struct kern_nccl_comm_group *ng = NULL;
#endif
    if (g_staged) {
        const struct kern_backend_opts o = {"cpu", 1, NULL, KERN_ACT_F32, 1, 1, 0};
        for (int r = 0; r < n_ranks; r++)
            assert_int_equal(kern_backend_open(&be[r], &o, &err), ST_OK);
        assert_int_equal(kern_staged_comm_group_init(&sg, be, n_ranks, &err), ST_OK);
#ifdef QUERN_CUDA
    } else if (g_nccl) {
        for (int r = 0; r < n_ranks; r++) {
            const struct kern_backend_opts o = {"cuda", 1, NULL, KERN_ACT_F32, 0, 1, r};
            assert_int_equal(kern_backend_open(&be[r], &o, &err), ST_OK);
        }
        if (kern_nccl_comm_group_init(&ng, be, n_ranks, &err))
            fail_msg("NCCL group of %d: %s", n_ranks, err.msg);
#endif
    } else {
        assert_int_equal(kern_cpu_comm_group_init(&g, n_ranks, &err), ST_OK);
    }
    struct rank_job jobs[MAX_RANKS];
    pthread_t th[MAX_RANKS];
    for (int r = 0; r < n_ranks; r++) {
        jobs[r] = (struct rank_job){.c = sg  ? kern_staged_comm_get(sg, r)
                                         : g ? kern_cpu_comm_get(g, r)
                                             : NULL,
                                    .ctx = ctx,
                                    .fn = fn};
#ifdef QUERN_CUDA
        if (ng) {
            jobs[r].c = kern_nccl_comm_get(ng, r);
            jobs[r].dev = be[r];
        }
#endif
        assert_int_equal(kern_comm_rank(jobs[r].c), r);
        assert_int_equal(kern_comm_size(jobs[r].c), n_ranks);
        assert_int_equal(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
    }
    long bad = 0;
    for (int r = 0; r < n_ranks; r++) {
        pthread_join(th[r], NULL);
        bad += jobs[r].bad;
    }
    kern_cpu_comm_group_free(g);
    if (sg) {
        g_staged_bytes += kern_staged_comm_bytes(sg);
        kern_staged_comm_group_free(sg);
        for (int r = 0; r < n_ranks; r++)
            kern_backend_free(be[r]);
    }
#ifdef QUERN_CUDA
    if (ng) {
        kern_nccl_comm_group_free(ng);
        for (int r = 0; r < n_ranks; r++)
            kern_backend_free(be[r]);
    }
#endif
    return bad;
}

static int f32_bits_equal(float a, float b)
{
    return memcmp(&a, &b, sizeof(a)) == 0;
}

/* ---- group creation --------------------------------------------------------------------- */

static void test_group_init(void **state)
{
    (void)state;
    struct kern_cpu_comm_group *g = (void *)1;
    struct err_detail err = {0};
    assert_int_equal(kern_cpu_comm_group_init(&g, 0, &err), ST_ERR_INVALID_ARG);
    assert_null(g);
    assert_int_equal(kern_cpu_comm_group_init(&g, KERN_CPU_COMM_MAX_RANKS + 1, &err),
                     ST_ERR_INVALID_ARG);
    assert_int_equal(kern_cpu_comm_group_init(&g, 3, &err), ST_OK);
    assert_int_equal(kern_cpu_comm_group_size(g), 3);
    struct kern_comm *c = kern_cpu_comm_get(g, 2);
    assert_int_equal(kern_comm_rank(c), 2);
    assert_int_equal(kern_comm_size(c), 3);
    assert_string_equal(c->ops->name, "cpu");
    kern_cpu_comm_group_free(g);
    kern_cpu_comm_group_free(NULL);
}

/* ---- all-reduce against the reference --------------------------------------------------- */

struct reduce_ctx {
    int bf16;               /* 1: the bf16 reduction */
    size_t n;               /* elements */
    float *f32[MAX_RANKS];  /* each rank's buffer */
    uint16_t *h[MAX_RANKS]; /* each rank's buffer (bf16) */
};

static void reduce_rank(struct rank_job *j)
{
    struct reduce_ctx *x = j->ctx;
    int r = kern_comm_rank(j->c);
    if (x->bf16)
        rank_reduce(j, x->h[r], x->n, 1);
    else
        rank_reduce(j, x->f32[r], x->n, 0);
}

/* Rank r's buffer starts r elements into its allocation, so the ranks' buffers are not equally
 * aligned (the implementation's slices must not depend on it). */
static void check_reduce(int n_ranks, size_t n, int bf16, long *order_sensitive)
{
    struct reduce_ctx x = {.bf16 = bf16, .n = n};
    void *alloc[MAX_RANKS];
    float *in[MAX_RANKS];
    uint64_t seed = 0x1234u + (uint64_t)n * 31 + (uint64_t)n_ranks * 7 + (uint64_t)bf16;
    for (int r = 0; r < n_ranks; r++) {
        in[r] = malloc((n + 1) * sizeof(float));
        assert_non_null(in[r]);
        alloc[r] = malloc((n + (size_t)r + 1) * sizeof(float));
        assert_non_null(alloc[r]);
        x.f32[r] = (float *)alloc[r] + r;
        x.h[r] = (uint16_t *)alloc[r] + r;
        for (size_t i = 0; i < n; i++) {
            float v = mixed(&seed);
            if (bf16) {
                x.h[r][i] = kern_f32_to_bf16(v);
                in[r][i] = kern_bf16_to_f32(x.h[r][i]);
            } else {
                x.f32[r][i] = in[r][i] = v;
            }
        }
    }
    /* The reference: each element summed in rank order in f32 (then rounded to bf16); and the
     * same in reverse order, to show that the order matters for these inputs. */
    float *ref = malloc((n + 1) * sizeof(float));
    assert_non_null(ref);
    for (size_t i = 0; i < n; i++) {
        float s = in[0][i], rev = in[n_ranks - 1][i];
        for (int r = 1; r < n_ranks; r++) {
            s += in[r][i];
            rev += in[n_ranks - 1 - r][i];
        }
        if (bf16) {
            s = kern_bf16_to_f32(kern_f32_to_bf16(s));
            rev = kern_bf16_to_f32(kern_f32_to_bf16(rev));
        }
        *order_sensitive += !f32_bits_equal(s, rev);
        ref[i] = s;
    }

    assert_int_equal(run_ranks(n_ranks, reduce_rank, &x), 0);

    for (int r = 0; r < n_ranks; r++) {
        for (size_t i = 0; i < n; i++) {
            uint16_t want_h = kern_f32_to_bf16(ref[i]);
            int ok = bf16 ? x.h[r][i] == want_h : f32_bits_equal(x.f32[r][i], ref[i]);
            if (!ok) {
                fail_msg("%s ranks %d n %zu: rank %d element %zu is %.9g, want %.9g",
                         bf16 ? "bf16" : "f32", n_ranks, n, r, i,
                         bf16 ? kern_bf16_to_f32(x.h[r][i]) : x.f32[r][i], ref[i]);
            }
        }
    }
    for (int r = 0; r < n_ranks; r++) {
        free(in[r]);
        free(alloc[r]);
    }
    free(ref);
}

static void test_all_reduce_f32(void **state)
{
    (void)state;
    for (int ranks = 1; ranks <= 4; ranks++) {
        long sensitive = 0;
        for (size_t k = 0; k < N_SIZES; k++)
            check_reduce(ranks, sizes[k], 0, &sensitive);
        if (ranks >= 3)
            assert_true(sensitive > 0); /* a sum in another order would have failed */
    }
}

static void test_all_reduce_bf16(void **state)
{
    (void)state;
    for (int ranks = 1; ranks <= 4; ranks++) {
        long sensitive = 0;
        for (size_t k = 0; k < N_SIZES; k++)
            check_reduce(ranks, sizes[k], 1, &sensitive);
        if (ranks >= 3)
            assert_true(sensitive > 0);
    }
}

/* More ranks than this machine has cores: every rank count up to 8, on some sizes. */
static void test_all_reduce_many_ranks(void **state)
{
    (void)state;
    static const size_t some[] = {0, 1, 7, 1000, 4097, 65537};
    for (int ranks = 5; ranks <= MAX_RANKS; ranks++) {
        long sensitive = 0;
        for (size_t k = 0; k < sizeof(some) / sizeof(some[0]); k++) {
            check_reduce(ranks, some[k], 0, &sensitive);
            check_reduce(ranks, some[k], 1, &sensitive);
        }
        assert_true(sensitive > 0);
    }
}

/* Edge cases with known answers, 3 ranks, each element's values in rank order. bf16: ties
 * round to even, a sum past the largest bfloat16 rounds to inf, subnormals add exactly, and
 * infinities and NaNs come through. f32: the sum starts from rank 0's value, so -0 stays -0. */
struct special_ctx {
    const uint16_t (*h)[3]; /* bf16 inputs per element, per rank */
    const float (*f)[3];    /* f32 inputs per element, per rank */
    size_t n;               /* elements */
    uint16_t out_h[3][16];  /* each rank's bf16 buffer */
    float out_f[3][16];     /* each rank's f32 buffer */
};

static void special_rank(struct rank_job *j)
{
    struct special_ctx *x = j->ctx;
    int r = kern_comm_rank(j->c);
    for (size_t i = 0; i < x->n; i++) {
        x->out_h[r][i] = x->h[i][r];
        x->out_f[r][i] = x->f[i][r];
    }
    rank_reduce(j, x->out_h[r], x->n, 1);
    rank_reduce(j, x->out_f[r], x->n, 0);
}

static void test_all_reduce_special(void **state)
{
    (void)state;
    static const uint16_t h[][3] = {
        {0x3F80, 0x3B80, 0x0000}, /* 1 + 2^-8: a tie, to even 1 */
        {0x3F81, 0x3B80, 0x0000}, /* (1 + 2^-7) + 2^-8: a tie, to even 1 + 2^-6 */
        {0x3F80, 0x3B80, 0x3780}, /* 1 + 2^-8 + 2^-16: just past the tie, up */
        {0x7F7F, 0x7B00, 0x0000}, /* the largest bfloat16 + 2^119: rounds to inf */
        {0x0001, 0x0001, 0x8003}, /* subnormals: 2 - 3 = -1 units */
        {0x7F80, 0x3F80, 0x0000}, /* inf + 1 */
        {0x7F80, 0xFF80, 0x3F80}, /* inf - inf: NaN */
        {0x7FC0, 0x3F80, 0x4000}, /* NaN + 1 + 2 */
        {0x8000, 0x8000, 0x8000}, /* -0 - 0 - 0 = -0 */
    };
    static const uint16_t want_h[] = {0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x8001, 0x7F80, 0, 0, 0x8000};
    /* As many rows as h (the ones not written are zeros). */
    static const float f[sizeof(h) / sizeof(h[0])][3] = {
        {1.0f, 0x1p-24f, 0x1p-24f},   /* each 2^-24 is lost: 1 */
        {0x1p-24f, 0x1p-24f, 1.0f},   /* in another order they are not: 1 + 2^-23 */
        {-0.0f, -0.0f, -0.0f},        /* -0 */
        {3.0e38f, 3.0e38f, -3.0e38f}, /* overflows on the way: inf */
        {0x1p-149f, 0x1p-149f, 0.0f}, /* subnormals: 2^-148 */
    };
    static const float want_f[] = {1.0f, 1.0f + 0x1p-23f, -0.0f, INFINITY, 0x1p-148f};
    struct special_ctx x = {.h = h, .f = f, .n = sizeof(h) / sizeof(h[0])};
    assert_int_equal(run_ranks(3, special_rank, &x), 0);
    for (int r = 0; r < 3; r++) {
        for (size_t i = 0; i < x.n; i++) {
            float s = kern_bf16_to_f32(h[i][0]) + kern_bf16_to_f32(h[i][1]);
            uint16_t ref = kern_f32_to_bf16(s + kern_bf16_to_f32(h[i][2]));
            if (i == 6 ||
                i == 7) { /* NaN: its sign and payload are the adder's (a GPU's: 0x7FFF) */
                assert_true((x.out_h[r][i] & 0x7FFF) > 0x7F80);
            } else {
                assert_int_equal(x.out_h[r][i], ref);
                assert_int_equal(x.out_h[r][i], want_h[i]);
            }
        }
        for (size_t i = 0; i < sizeof(want_f) / sizeof(want_f[0]); i++)
            assert_true(f32_bits_equal(x.out_f[r][i], want_f[i]));
    }
}

/* ---- all-gather ------------------------------------------------------------------------- */

struct gather_ctx {
    size_t bytes;                  /* per rank */
    int in_place;                  /* 1: in = out + rank * bytes */
    unsigned char *in[MAX_RANKS];  /* each rank's contribution (unused in place) */
    unsigned char *out[MAX_RANKS]; /* each rank's output, n_ranks * bytes */
};

static unsigned char gather_byte(int rank, size_t i)
{
    return (unsigned char)(rank * 37 + i * 11 + (i >> 8) * 5 + 1);
}

static void gather_rank(struct rank_job *j)
{
    struct gather_ctx *x = j->ctx;
    int r = kern_comm_rank(j->c);
    const void *in = x->in_place ? x->out[r] + (size_t)r * x->bytes : x->in[r];
    rank_gather(j, in, x->out[r], x->bytes);
}

static void check_gather(int n_ranks, size_t bytes, int in_place)
{
    struct gather_ctx x = {.bytes = bytes, .in_place = in_place};
    size_t total = (size_t)n_ranks * bytes;
    for (int r = 0; r < n_ranks; r++) {
        x.in[r] = malloc(bytes + 1);
        x.out[r] = malloc(total + 1);
        assert_non_null(x.in[r]);
        assert_non_null(x.out[r]);
        memset(x.out[r], 0xEE, total);
        for (size_t i = 0; i < bytes; i++) {
            if (in_place)
                x.out[r][(size_t)r * bytes + i] = gather_byte(r, i);
            else
                x.in[r][i] = gather_byte(r, i);
        }
    }
    assert_int_equal(run_ranks(n_ranks, gather_rank, &x), 0);
    for (int r = 0; r < n_ranks; r++) {
        for (int s = 0; s < n_ranks; s++) {
            for (size_t i = 0; i < bytes; i++) {
                if (x.out[r][(size_t)s * bytes + i] != gather_byte(s, i))
                    fail_msg("gather ranks %d bytes %zu in_place %d: rank %d got a wrong byte "
                             "%zu of rank %d",
                             n_ranks, bytes, in_place, r, i, s);
            }
        }
        if (!in_place) {
            for (size_t i = 0; i < bytes; i++)
                assert_int_equal(x.in[r][i], gather_byte(r, i)); /* input untouched */
        }
        free(x.in[r]);
        free(x.out[r]);
    }
}

static void test_all_gather(void **state)
{
    (void)state;
    for (int ranks = 1; ranks <= 4; ranks++) {
        for (size_t k = 0; k < N_SIZES; k++) {
            check_gather(ranks, sizes[k], 0);
            check_gather(ranks, sizes[k], 1);
        }
    }
    check_gather(MAX_RANKS, 4097, 0);
    check_gather(MAX_RANKS, 4097, 1);
}

/* ---- barrier ---------------------------------------------------------------------------- */

#define BARRIER_ROUNDS 1000

struct barrier_ctx {
    atomic_long counter; /* every rank adds 1 per round */
};

/* Between the two barriers of round k every rank must see all k + 1 rounds' increments: a
 * rank let through early would see fewer, and one let through late would see some of the
 * next round's. */
static void barrier_rank(struct rank_job *j)
{
    struct barrier_ctx *x = j->ctx;
    int n = kern_comm_size(j->c);
    for (long k = 0; k < BARRIER_ROUNDS; k++) {
        atomic_fetch_add(&x->counter, 1);
        kern_comm_barrier(j->c);
        if (atomic_load(&x->counter) != (k + 1) * n)
            j->bad++;
        kern_comm_barrier(j->c);
    }
}

static void test_barrier(void **state)
{
    (void)state;
    static const int counts[] = {1, 2, 3, 4, MAX_RANKS};
    for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++) {
        struct barrier_ctx x;
        atomic_init(&x.counter, 0);
        assert_int_equal(run_ranks(counts[k], barrier_rank, &x), 0);
        assert_int_equal(atomic_load(&x.counter), (long)BARRIER_ROUNDS * counts[k]);
    }
}

/* ---- collectives back to back ----------------------------------------------------------- */

#define MIXED_ROUNDS 100
#define MIXED_MAX_N  4000

/* Rank r's element i in round k: every rank can compute every rank's inputs. */
static float mixed_value(int k, int r, size_t i)
{
    uint64_t s = ((uint64_t)k << 40) ^ ((uint64_t)r << 32) ^ i;
    return mixed(&s);
}

/* Each round: an f32 and a bf16 all-reduce of a size that changes every round (from one
 * element to several slices per rank), an all-gather, and every other round a barrier; no
 * other synchronization between rounds. Each rank checks each result against the sums it
 * computes itself right when the call returns, before it writes its next inputs: a rank let
 * out while others still read or write its buffer would see wrong values or make others see
 * them. */
static void mixed_rank(struct rank_job *j)
{
    int r = kern_comm_rank(j->c), n_ranks = kern_comm_size(j->c);
    float x[MIXED_MAX_N], want_x[MIXED_MAX_N];
    uint16_t h[MIXED_MAX_N], want_h[MIXED_MAX_N];
    int32_t mine, all[MAX_RANKS];
    for (int k = 0; k < MIXED_ROUNDS; k++) {
        size_t n = 1 + (size_t)k * 397 % MIXED_MAX_N;
        for (size_t i = 0; i < n; i++) {
            float s = mixed_value(k, 0, i);
            float sh = kern_bf16_to_f32(kern_f32_to_bf16(s));
            for (int q = 1; q < n_ranks; q++) {
                s += mixed_value(k, q, i);
                sh += kern_bf16_to_f32(kern_f32_to_bf16(mixed_value(k, q, i)));
            }
            want_x[i] = s;
            want_h[i] = kern_f32_to_bf16(sh);
        }
        for (size_t i = 0; i < n; i++)
            x[i] = mixed_value(k, r, i);
        rank_reduce(j, x, n, 0);
        j->bad += memcmp(x, want_x, n * sizeof(float)) != 0;
        for (size_t i = 0; i < n; i++)
            h[i] = kern_f32_to_bf16(mixed_value(k, r, i));
        rank_reduce(j, h, n, 1);
        j->bad += memcmp(h, want_h, n * sizeof(uint16_t)) != 0;
        mine = k * 1000 + r;
        rank_gather(j, &mine, all, sizeof(mine));
        for (int q = 0; q < n_ranks; q++)
            j->bad += all[q] != k * 1000 + q;
        if (k % 2)
            kern_comm_barrier(j->c);
    }
}

static void test_back_to_back(void **state)
{
    (void)state;
    for (int ranks = 1; ranks <= MAX_RANKS; ranks++)
        assert_int_equal(run_ranks(ranks, mixed_rank, NULL), 0);
}

/* The host-staged communicator through the same checks (fewer sizes and ranks): bitwise the
 * CPU communicator's results, every collective's bytes through the backends' download and
 * upload. */
static void test_staged(void **state)
{
    (void)state;
    g_staged = 1;
    g_staged_bytes = 0;
    long order_sensitive = 0;
    static const size_t ssizes[] = {0, 1, 31, 4097, 1u << 20};
    for (int ranks = 1; ranks <= 4; ranks++)
        for (size_t k = 0; k < sizeof(ssizes) / sizeof(ssizes[0]); k++) {
            check_reduce(ranks, ssizes[k], 0, &order_sensitive);
            check_reduce(ranks, ssizes[k], 1, &order_sensitive);
            check_gather(ranks, ssizes[k], 0);
            check_gather(ranks, ssizes[k], 1);
        }
    struct barrier_ctx x;
    atomic_init(&x.counter, 0);
    assert_int_equal(run_ranks(3, barrier_rank, &x), 0);
    for (int ranks = 1; ranks <= 4; ranks++)
        assert_int_equal(run_ranks(ranks, mixed_rank, NULL), 0);
    /* 4 ranks x (f32 + bf16 reduce of 1M: 2 x 4 MiB + 2 x 2 MiB) at least */
    printf("  staged: %zu bytes through host staging\n", g_staged_bytes);
    assert_true(g_staged_bytes > (size_t)4 * (12u << 20));
    g_staged = 0;
}

/* The NCCL communicator through the same checks, for as many ranks as there are devices (up to
 * 4): bitwise the CPU communicator's results; and kern_group_open's choice between it and host
 * staging (QUERN_TP_COMM; and, on the emulator, a failed NCCL start: staged with auto, an error
 * with nccl). Where there is no CUDA device or no NCCL it says so (a failure with
 * QUERN_REQUIRE_NCCL=1, as scripts/gpu-check.sh and the emulator's run set). */
static void test_nccl(void **state)
{
    (void)state;
    const char *req = getenv("QUERN_REQUIRE_NCCL");
    const int require = req && !strcmp(req, "1");
#ifndef QUERN_CUDA
    if (require)
        fail_msg("QUERN_REQUIRE_NCCL=1 but this build has no CUDA backend");
    printf("  nccl: not checked (no CUDA backend in this build)\n");
#else
    char why[256] = "";
    const int devs = kern_cuda_device_count(why, sizeof(why));
    if (devs < 1 || !kern_nccl_usable(1, why, sizeof(why))) {
        if (require)
            fail_msg("QUERN_REQUIRE_NCCL=1 but NCCL is not usable: %s", why);
        printf("  nccl: not checked (%s)\n", why);
        return;
    }
    const int max = devs < 4 ? devs : 4;
    printf("  nccl: %s, %d device(s), checking 1 to %d ranks\n", kern_nccl_describe(), devs, max);
    g_nccl = 1;
    long order_sensitive = 0;
    static const size_t nsizes[] = {0, 1, 2, 31, 4097, 65537};
    for (int ranks = 1; ranks <= max; ranks++)
        for (size_t k = 0; k < sizeof(nsizes) / sizeof(nsizes[0]); k++) {
            check_reduce(ranks, nsizes[k], 0, &order_sensitive);
            check_reduce(ranks, nsizes[k], 1, &order_sensitive);
            check_gather(ranks, nsizes[k], 0);
            check_gather(ranks, nsizes[k], 1);
        }
    if (max >= 3)
        test_all_reduce_special(NULL);
    struct barrier_ctx x;
    atomic_init(&x.counter, 0);
    assert_int_equal(run_ranks(max, barrier_rank, &x), 0);
    for (int ranks = 1; ranks <= max; ranks++)
        assert_int_equal(run_ranks(ranks, mixed_rank, NULL), 0);
    g_nccl = 0;
    if (max >= 2)
        assert_true(order_sensitive > 0); /* with 3+ ranks the order shows in these sums */

    /* kern_group_open's choice */
    assert_false(kern_nccl_usable(devs + 1, why, sizeof(why)));
    assert_non_null(strstr(why, "device"));
    struct err_detail err = {0};
    struct kern_group *grp;
    struct kern_backend_opts o = {"cuda", 2, NULL, KERN_ACT_F32, 0, max, 0};
    static const struct {
        const char *env;
        int tp;           /* 0: max ranks; -1: one more than the devices; 1: max, a failed start */
        const char *name; /* the communicator's name; NULL: the open fails */
    } cases[] = {
        {NULL, 0, "nccl"},
        {"auto", 0, "nccl"},
        {"nccl", 0, "nccl"},
        {"staged", 0, "staged"},
        {"auto", -1, "staged"},
        {"nccl", -1, NULL},
        {"ring", 0, NULL},
        /* a start that fails (the emulator's stand-in only: QUERN_CUDA_EMU_NCCL_FAIL) */
        {"auto", 1, "staged"},
        {"nccl", 1, NULL},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        const int fail_start = cases[k].tp == 1;
        if (fail_start && !strstr(kern_nccl_describe(), "2.28.0")) /* not the stand-in */
            continue;
        o.tp = cases[k].tp == -1 ? devs + 1 : max;
        if (o.tp < 2 || (cases[k].tp == -1 && o.tp > 8))
            continue;
        if (fail_start)
            setenv("QUERN_CUDA_EMU_NCCL_FAIL", "1", 1);
        if (cases[k].env)
            setenv("QUERN_TP_COMM", cases[k].env, 1);
        else
            unsetenv("QUERN_TP_COMM");
        const enum status st = kern_group_open(&grp, &o, &err);
        unsetenv("QUERN_CUDA_EMU_NCCL_FAIL");
        if (!cases[k].name) {
            assert_int_not_equal(st, ST_OK);
            continue;
        }
        if (st)
            fail_msg("QUERN_TP_COMM=%s tp %d: %s", cases[k].env, o.tp, err.msg);
        assert_string_equal(grp->comm[0]->ops->name, cases[k].name);
        for (int r = 0; r < o.tp; r++)
            assert_int_equal(kern_cuda_device(grp->be[r]), !strcmp(cases[k].name, "nccl") ? r : 0);
        kern_group_free(grp);
    }
    unsetenv("QUERN_TP_COMM");
#endif
}

int main(void)
{
    /* the emulator's devices (a GPU build ignores this) */
    setenv("QUERN_CUDA_EMU_DEVICES", "4", 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_group_init),
        cmocka_unit_test(test_all_reduce_f32),
        cmocka_unit_test(test_all_reduce_bf16),
        cmocka_unit_test(test_all_reduce_many_ranks),
        cmocka_unit_test(test_all_reduce_special),
        cmocka_unit_test(test_all_gather),
        cmocka_unit_test(test_barrier),
        cmocka_unit_test(test_back_to_back),
        cmocka_unit_test(test_staged),
        cmocka_unit_test(test_nccl),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
