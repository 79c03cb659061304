/* The host-staged communicator (kernels/comm_staged.h). Each rank owns a staging buffer that
 * grows to the largest collective it has seen (a model's collectives have a few fixed sizes, so
 * after the first steps nothing is allocated); the CPU communicator's rank-order reduction makes
 * the results bitwise those of CPU ranks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/comm.h"
#include "kernels/comm_staged.h"
#include "kernels/cpu/comm_cpu.h"
#include "kernels/kernels.h"

struct staged_rank {
    struct kern_comm pub;         /* the handle ranks use; impl points back here */
    struct kern_staged_comm_group *group; /* owner */
    struct kern_backend *be;      /* this rank's backend (borrowed) */
    struct kern_comm *inner;      /* this rank's CPU communicator handle */
    uint8_t *host;                /* staging buffer */
    size_t cap;                   /* its size in bytes */
};

struct kern_staged_comm_group {
    int n;                           /* ranks */
    struct kern_cpu_comm_group *cpu; /* the collectives over the staging buffers */
    struct staged_rank *ranks;       /* n */
    size_t staged;                   /* bytes moved so far (atomic) */
};

static struct staged_rank *rank_of(struct kern_comm *c)
{
    return c->impl;
}

/* The staging buffer holds at least bytes; a failed allocation is fatal (the collective has no
 * way to report it, and the other ranks are already waiting in it). */
static uint8_t *staging(struct staged_rank *r, size_t bytes)
{
    if (bytes > r->cap) {
        uint8_t *p = realloc(r->host, bytes);
        if (!p) {
            LOG_ERROR("tensor parallelism: no memory for a %zu-byte staging buffer", bytes);
            abort();
        }
        r->host = p;
        r->cap = bytes;
    }
    return r->host;
}

static void count(struct staged_rank *r, size_t bytes)
{
    __atomic_fetch_add(&r->group->staged, bytes, __ATOMIC_RELAXED);
}

/* Both all-reduces: n elements of x (bf16: 16-bit, else f32) down, reduced, back up. */
static void staged_reduce(struct kern_comm *c, void *x, size_t n, int bf16)
{
    struct staged_rank *r = rank_of(c);
    const size_t bytes = n * (bf16 ? sizeof(uint16_t) : sizeof(float));
    void *h = staging(r, bytes);
    r->be->ops->download(r->be, h, x, bytes);
    if (bf16)
        kern_comm_all_reduce_sum_bf16(r->inner, h, n);
    else
        kern_comm_all_reduce_sum_f32(r->inner, h, n);
    r->be->ops->upload(r->be, x, h, bytes);
    count(r, 2 * bytes);
}

static void staged_reduce_f32(struct kern_comm *c, float *x, size_t n)
{
    staged_reduce(c, x, n, 0);
}

static void staged_reduce_bf16(struct kern_comm *c, uint16_t *x, size_t n)
{
    staged_reduce(c, x, n, 1);
}

static void staged_gather(struct kern_comm *c, const void *in, void *out, size_t bytes)
{
    struct staged_rank *r = rank_of(c);
    const size_t total = bytes * (size_t)c->size;
    uint8_t *h = staging(r, total);
    /* in may be out + rank * bytes: it is read before out is written */
    r->be->ops->download(r->be, h + (size_t)c->rank * bytes, in, bytes);
    kern_comm_all_gather(r->inner, h + (size_t)c->rank * bytes, h, bytes);
    r->be->ops->upload(r->be, out, h, total);
    count(r, bytes + total);
}

static void staged_barrier(struct kern_comm *c)
{
    struct staged_rank *r = rank_of(c);
    r->be->ops->sync(r->be);
    kern_comm_barrier(r->inner);
}

static const struct kern_comm_ops staged_ops = {
    .name = "staged",
    .all_reduce_sum_f32 = staged_reduce_f32,
    .all_reduce_sum_bf16 = staged_reduce_bf16,
    .all_gather = staged_gather,
    .barrier = staged_barrier,
};

enum status kern_staged_comm_group_init(struct kern_staged_comm_group **out,
                                        struct kern_backend *const *be, int n,
                                        struct err_detail *err)
{
    *out = NULL;
    struct kern_staged_comm_group *g = calloc(1, sizeof(*g));
    if (!g)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    enum status st = kern_cpu_comm_group_init(&g->cpu, n, err);
    if (st) {
        free(g);
        return st;
    }
    g->n = n;
    g->ranks = calloc((size_t)n, sizeof(*g->ranks));
    if (!g->ranks) {
        kern_staged_comm_group_free(g);
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    for (int r = 0; r < n; r++) {
        struct staged_rank *s = &g->ranks[r];
        s->pub = (struct kern_comm){&staged_ops, s, r, n, 0};
        s->group = g;
        s->be = be[r];
        s->inner = kern_cpu_comm_get(g->cpu, r);
    }
    *out = g;
    return ST_OK;
}

void kern_staged_comm_group_free(struct kern_staged_comm_group *g)
{
    if (!g)
        return;
    for (int r = 0; g->ranks && r < g->n; r++)
        free(g->ranks[r].host);
    free(g->ranks);
    kern_cpu_comm_group_free(g->cpu);
    free(g);
}

struct kern_comm *kern_staged_comm_get(struct kern_staged_comm_group *g, int rank)
{
    return &g->ranks[rank].pub;
}

size_t kern_staged_comm_bytes(const struct kern_staged_comm_group *g)
{
    return __atomic_load_n(&g->staged, __ATOMIC_RELAXED);
}
