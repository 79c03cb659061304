/* The NCCL communicator (kernels/cuda/comm_nccl.h). Each rank grows one device scratch buffer
 * (through its backend, so graphs are dropped when it moves) to the largest all-reduce it has
 * seen: a model's collectives have a few fixed sizes, so after the first steps nothing is
 * allocated. A failed NCCL or CUDA call inside a collective ends the process, as in the CUDA
 * backend's ops: the other ranks are already waiting in it, and a device in that state cannot be
 * trusted. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/comm.h"
#include "kernels/cpu/comm_cpu.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/comm_nccl.h"
#include "kernels/cuda/cuda_launch.h"
#include "kernels/kernels.h"

struct nccl_rank {
    struct kern_comm pub;               /* the handle ranks use; impl points back here */
    struct kern_nccl_comm_group *group; /* owner */
    struct kern_backend *be;            /* this rank's backend (borrowed) */
    void *comm;                         /* its ncclComm_t */
    struct kern_comm *host;             /* its CPU communicator handle (barrier) */
    void *slots;                        /* device scratch: an all-reduce's chunks */
    size_t cap;                         /* its size in bytes */
};

struct kern_nccl_comm_group {
    int n;
    const struct kcu_nccl *lib;
    struct kern_cpu_comm_group *cpu;
    struct nccl_rank *ranks; /* n */
};

static struct nccl_rank *rank_of(struct kern_comm *c)
{
    return c->impl;
}

static void nccl_check(const struct nccl_rank *r, int rc, const char *what)
{
    if (rc) {
        LOG_ERROR("NCCL error in %s (rank %d of %d): %s", what, r->pub.rank, r->pub.size,
                  kcu_nccl_error(r->group->lib, rc));
        abort();
    }
}

/* The rank's scratch, at least bytes. */
static void *slots(struct nccl_rank *r, size_t bytes)
{
    if (bytes > r->cap) {
        if (r->slots)
            r->be->ops->buf_free(r->be, r->slots);
        r->cap = 0;
        if (!(r->slots = r->be->ops->buf_alloc(r->be, bytes))) {
            LOG_ERROR("tensor parallelism: no device memory for a %zu-byte all-reduce buffer",
                      bytes);
            abort();
        }
        r->cap = bytes;
    }
    return r->slots;
}

/* Both all-reduces: n elements of x (bf16: 16-bit, else f32). Rank q owns elements
 * [q * chunk, (q + 1) * chunk); its chunk's sums go to its slot, and the all-gather of the slots
 * (each chunk long, the last ones padded) lands every sum in every rank's scratch. */
static void nccl_reduce(struct kern_comm *c, void *x, size_t n, int bf16)
{
    struct nccl_rank *r = rank_of(c);
    if (!n)
        return;
    const size_t e = bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t chunk = (n + (size_t)c->size - 1) / (size_t)c->size;
    char *s = slots(r, chunk * (size_t)c->size * e);
    void *stream = kern_cuda_stream(r->be);
    const struct kcu_nccl *lib = r->group->lib;
    nccl_check(r, kcu_nccl_exchange(lib, r->comm, stream, c->rank, c->size, x, s, n * e, chunk * e),
               "all-reduce exchange");
    const int rc = kcu_rank_sum(stream, x, s, n, chunk, c->rank, c->size, bf16);
    if (rc) {
        LOG_ERROR("CUDA error in the all-reduce's sum (rank %d of %d): launch status %d", c->rank,
                  c->size, rc);
        abort();
    }
    nccl_check(r,
               kcu_nccl_gather(lib, r->comm, stream, s + (size_t)c->rank * chunk * e, s, chunk * e),
               "all-reduce gather");
    r->be->ops->copy(r->be, x, s, n * e);
}

static void nccl_reduce_f32(struct kern_comm *c, float *x, size_t n)
{
    nccl_reduce(c, x, n, 0);
}

static void nccl_reduce_bf16(struct kern_comm *c, uint16_t *x, size_t n)
{
    nccl_reduce(c, x, n, 1);
}

static void nccl_gather(struct kern_comm *c, const void *in, void *out, size_t bytes)
{
    struct nccl_rank *r = rank_of(c);
    if (!bytes)
        return;
    nccl_check(r, kcu_nccl_gather(r->group->lib, r->comm, kern_cuda_stream(r->be), in, out, bytes),
               "all-gather");
}

static void nccl_barrier(struct kern_comm *c)
{
    struct nccl_rank *r = rank_of(c);
    r->be->ops->sync(r->be);
    kern_comm_barrier(r->host);
}

static const struct kern_comm_ops nccl_ops = {
    .name = "nccl",
    .all_reduce_sum_f32 = nccl_reduce_f32,
    .all_reduce_sum_bf16 = nccl_reduce_bf16,
    .all_gather = nccl_gather,
    .barrier = nccl_barrier,
};

int kern_nccl_usable(int n, char *why, size_t why_size)
{
    char cwhy[128] = "";
    const int devs = kern_cuda_device_count(cwhy, sizeof(cwhy));
    if (devs < n) {
        if (devs > 0)
            snprintf(why, why_size, "%d ranks but %d CUDA device%s", n, devs, devs > 1 ? "s" : "");
        else
            snprintf(why, why_size, "no CUDA device (%s)", cwhy);
        return 0;
    }
    char lwhy[200] = "";
    if (!kcu_nccl_open(lwhy, sizeof(lwhy))) {
        snprintf(why, why_size, "NCCL not loaded: %s", lwhy);
        return 0;
    }
    return 1;
}

const char *kern_nccl_describe(void)
{
    const struct kcu_nccl *lib = kcu_nccl_open(NULL, 0);
    return lib ? kcu_nccl_name(lib) : "NCCL (not loaded)";
}

enum status kern_nccl_comm_group_init(struct kern_nccl_comm_group **out,
                                      struct kern_backend *const *be, int n, struct err_detail *err)
{
    *out = NULL;
    char why[200] = "";
    const struct kcu_nccl *lib = kcu_nccl_open(why, sizeof(why));
    if (!lib)
        return err_set(err, ST_ERR_UNSUPPORTED, "NCCL: %s", why);
    struct kern_nccl_comm_group *g = calloc(1, sizeof(*g));
    if (!g)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    g->n = n;
    g->lib = lib;
    g->ranks = calloc((size_t)n, sizeof(*g->ranks));
    void **comms = calloc((size_t)n, sizeof(*comms));
    int *devs = calloc((size_t)n, sizeof(*devs));
    enum status st = !g->ranks || !comms || !devs ? err_set(err, ST_ERR_NOMEM, "no memory")
                                                  : kern_cpu_comm_group_init(&g->cpu, n, err);
    if (!st) {
        for (int r = 0; r < n; r++)
            devs[r] = kern_cuda_device(be[r]);
        const int rc = kcu_nccl_init(lib, comms, n, devs);
        kern_cuda_forget_device(); /* NCCL made each device current in turn */
        if (rc)
            st = err_set(err, ST_ERR_IO, "NCCL: ncclCommInitAll over %d devices: %s", n,
                         kcu_nccl_error(lib, rc));
    }
    /* steps of NCCL ranks in CUDA graphs: opt-in (NCCL 2.9 or later captures; NCCL requires
     * every rank to capture or not alike, which the engine keeps, but warns that several GPUs
     * in one process capturing may deadlock: not yet run on such a machine) */
    const char *tg = getenv("QUERN_TP_GRAPHS");
    const int in_graphs = tg && !strcmp(tg, "1") && kcu_nccl_version(lib) >= 20900;
    for (int r = 0; !st && r < n; r++) {
        struct nccl_rank *s = &g->ranks[r];
        s->pub = (struct kern_comm){&nccl_ops, s, r, n, in_graphs};
        s->group = g;
        s->be = be[r];
        s->comm = comms[r];
        s->host = kern_cpu_comm_get(g->cpu, r);
    }
    /* (after a failed ncclCommInitAll there are no communicators to close: NCCL cleans up) */
    free(comms);
    free(devs);
    if (st) {
        kern_nccl_comm_group_free(g);
        return st;
    }
    *out = g;
    return ST_OK;
}

void kern_nccl_comm_group_free(struct kern_nccl_comm_group *g)
{
    if (!g)
        return;
    for (int r = 0; g->ranks && r < g->n; r++) {
        struct nccl_rank *s = &g->ranks[r];
        if (s->be)
            s->be->ops->sync(s->be);
        /* graphs holding this rank's collectives go first: from NCCL 2.26 destroying a
         * communicator waits until every graph that uses it is gone (here, forever) */
        if (s->be && s->be->ops->graphs_reset)
            s->be->ops->graphs_reset(s->be);
        if (s->slots)
            s->be->ops->buf_free(s->be, s->slots);
        kcu_nccl_close(g->lib, s->comm);
    }
    kern_cuda_forget_device();
    free(g->ranks);
    kern_cpu_comm_group_free(g->cpu);
    free(g);
}

struct kern_comm *kern_nccl_comm_get(struct kern_nccl_comm_group *g, int rank)
{
    return &g->ranks[rank].pub;
}
