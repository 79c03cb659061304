/* CPU communicator: ranks are threads sharing memory. A collective publishes each rank's buffer
 * in its slot, meets at a barrier, works directly on the other ranks' buffers, and meets again
 * before anyone returns. An all-reduce is a reduce-scatter and an all-gather in one pass: each
 * rank owns a disjoint slice of the elements, sums that slice across every rank's buffer in
 * rank order, and writes the sum back into every buffer. */
#include "kernels/cpu/comm_cpu.h"

#include <assert.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/pool.h"

#define COMM_LINE  64  /* cache line bytes: slices start on multiples of it */
#define COMM_CHUNK 512 /* elements summed at a time on the stack */

/* Ranks often share cores with other ranks or their thread pools, so a barrier waiter spins
 * only a few microseconds before it yields, and soon sleeps. */
#define COMM_SPIN   128 /* barrier polls (pause) before yielding the CPU */
#define COMM_YIELDS 8   /* barrier polls with sched_yield before sleeping on the futex */

/* What a rank is doing in the current collective, for the others to read after the first
 * barrier (and for the checks that all ranks called the same thing). */
enum comm_op { COMM_OP_BARRIER, COMM_OP_SUM_F32, COMM_OP_SUM_BF16, COMM_OP_GATHER };

struct comm_slot {
    _Alignas(COMM_LINE) void *buf; /* this rank's in/out buffer (gather: its output) */
    const void *in;                /* gather: this rank's contribution */
    size_t n;                      /* elements (reductions) or bytes (gather) */
    int op;                        /* enum comm_op */
};

/* A central barrier with a generation number (sense reversal): the last rank to arrive resets
 * the count and starts the next generation; the others wait for the generation to change,
 * first spinning, then yielding, then asleep on a futex. */
struct comm_barrier {
    atomic_int count;    /* ranks arrived in this generation */
    atomic_uint gen;     /* generation; the futex word */
    atomic_int sleepers; /* ranks asleep (or about to be) on the futex */
};

struct kern_cpu_comm_group {
    struct comm_slot slots[KERN_CPU_COMM_MAX_RANKS]; /* one per rank, on its own cache line */
    _Alignas(COMM_LINE) struct comm_barrier bar;     /* shared by every collective */
    int n;                                           /* ranks */
    struct kern_comm comms[KERN_CPU_COMM_MAX_RANKS]; /* the ranks' handles (first n used) */
};

/* kern_bf16_to_f32 and kern_f32_to_bf16 (the same bits: test_comm holds them to those), inline
 * so that summing costs no call per element. */
static inline float bf16_to_f32(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, sizeof(f));
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: keep the top bits, force quiet */
        return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1)) >> 16); /* nearest even */
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void futex_wait(atomic_uint *word, unsigned expected)
{
    /* Returns at once if *word != expected; spurious wakeups are fine (the caller loops). */
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *word)
{
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void barrier_wait(struct comm_barrier *b, int n)
{
    /* Read the generation before arriving: once we have arrived it may move on. */
    unsigned gen = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == n - 1) {
        /* Last to arrive: nobody touches count until they see the new generation. */
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_fetch_add(&b->gen, 1); /* seq_cst: ordered against the sleepers load */
        if (atomic_load(&b->sleepers) > 0)
            futex_wake_all(&b->gen);
        return;
    }
    for (int spins = 0; spins < COMM_SPIN + COMM_YIELDS; spins++) {
        if (atomic_load_explicit(&b->gen, memory_order_acquire) != gen)
            return;
        if (spins < COMM_SPIN)
            cpu_relax();
        else
            sched_yield();
    }
    /* Either the waker sees sleepers > 0 and wakes us, or we see the new generation (both
     * sides seq_cst); futex_wait itself returns at once if the generation already moved. */
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->gen) == gen)
        futex_wait(&b->gen, gen);
    atomic_fetch_sub(&b->sleepers, 1);
}

static struct kern_cpu_comm_group *group_of(struct kern_comm *c)
{
    return c->impl;
}

/* Publish this rank's part of a collective, then wait until every rank has published. */
static struct kern_cpu_comm_group *comm_enter(struct kern_comm *c, int op, void *buf,
                                              const void *in, size_t n)
{
    struct kern_cpu_comm_group *g = group_of(c);
    struct comm_slot *s = &g->slots[c->rank];
    s->buf = buf;
    s->in = in;
    s->n = n;
    s->op = op;
    barrier_wait(&g->bar, g->n);
#ifndef NDEBUG
    for (int r = 0; r < g->n; r++)
        assert(g->slots[r].op == op && g->slots[r].n == n); /* every rank called the same */
#endif
    return g;
}

/* The slice [lo, hi) of n elements of elem bytes this rank sums: whole cache lines (assuming
 * equally aligned buffers), spread evenly over the ranks, the rest to the last. */
static void comm_slice(size_t n, size_t elem, int rank, int size, size_t *lo, size_t *hi)
{
    size_t per_line = COMM_LINE / elem;
    size_t lines = n / per_line;
    long l0, l1;
    pool_range((long)lines, rank, size, &l0, &l1);
    *lo = (size_t)l0 * per_line;
    *hi = rank == size - 1 ? n : (size_t)l1 * per_line;
}

static void sum_f32(struct kern_comm *c, float *x, size_t n)
{
    struct kern_cpu_comm_group *g = comm_enter(c, COMM_OP_SUM_F32, x, NULL, n);
    size_t lo, hi;
    comm_slice(n, sizeof(float), c->rank, g->n, &lo, &hi);
    float acc[COMM_CHUNK];
    for (size_t i = lo; i < hi; i += COMM_CHUNK) {
        size_t m = hi - i < COMM_CHUNK ? hi - i : COMM_CHUNK;
        memcpy(acc, (const float *)g->slots[0].buf + i, m * sizeof(float));
        for (int r = 1; r < g->n; r++) {
            const float *src = (const float *)g->slots[r].buf + i;
            for (size_t j = 0; j < m; j++)
                acc[j] += src[j];
        }
        for (int r = 0; r < g->n; r++)
            memcpy((float *)g->slots[r].buf + i, acc, m * sizeof(float));
    }
    barrier_wait(&g->bar, g->n); /* nobody returns while others still write its buffer */
}

static void sum_bf16(struct kern_comm *c, uint16_t *x, size_t n)
{
    struct kern_cpu_comm_group *g = comm_enter(c, COMM_OP_SUM_BF16, x, NULL, n);
    size_t lo, hi;
    comm_slice(n, sizeof(uint16_t), c->rank, g->n, &lo, &hi);
    float acc[COMM_CHUNK];
    uint16_t out[COMM_CHUNK];
    for (size_t i = lo; i < hi; i += COMM_CHUNK) {
        size_t m = hi - i < COMM_CHUNK ? hi - i : COMM_CHUNK;
        const uint16_t *src0 = (const uint16_t *)g->slots[0].buf + i;
        for (size_t j = 0; j < m; j++)
            acc[j] = bf16_to_f32(src0[j]);
        for (int r = 1; r < g->n; r++) {
            const uint16_t *src = (const uint16_t *)g->slots[r].buf + i;
            for (size_t j = 0; j < m; j++)
                acc[j] += bf16_to_f32(src[j]);
        }
        for (size_t j = 0; j < m; j++)
            out[j] = f32_to_bf16(acc[j]);
        for (int r = 0; r < g->n; r++)
            memcpy((uint16_t *)g->slots[r].buf + i, out, m * sizeof(uint16_t));
    }
    barrier_wait(&g->bar, g->n);
}

static void gather(struct kern_comm *c, const void *in, void *out, size_t bytes)
{
    struct kern_cpu_comm_group *g = comm_enter(c, COMM_OP_GATHER, out, in, bytes);
    for (int r = 0; r < g->n; r++) {
        char *dst = (char *)out + (size_t)r * bytes;
        if (dst != g->slots[r].in) /* in place: rank r's part is already there */
            memcpy(dst, g->slots[r].in, bytes);
    }
    barrier_wait(&g->bar, g->n); /* nobody changes its input while others still read it */
}

static void barrier(struct kern_comm *c)
{
    struct kern_cpu_comm_group *g = group_of(c);
    g->slots[c->rank].op = COMM_OP_BARRIER;
    g->slots[c->rank].n = 0;
    barrier_wait(&g->bar, g->n);
}

static const struct kern_comm_ops cpu_comm_ops = {
    .name = "cpu",
    .all_reduce_sum_f32 = sum_f32,
    .all_reduce_sum_bf16 = sum_bf16,
    .all_gather = gather,
    .barrier = barrier,
};

enum status kern_cpu_comm_group_init(struct kern_cpu_comm_group **out, int n_ranks,
                                     struct err_detail *err)
{
    *out = NULL;
    if (n_ranks < 1 || n_ranks > KERN_CPU_COMM_MAX_RANKS)
        return err_set(err, ST_ERR_INVALID_ARG, "rank count %d not in 1..%d", n_ranks,
                       KERN_CPU_COMM_MAX_RANKS);
    size_t size = (sizeof(struct kern_cpu_comm_group) + COMM_LINE - 1) / COMM_LINE * COMM_LINE;
    struct kern_cpu_comm_group *g = aligned_alloc(COMM_LINE, size);
    if (!g)
        return err_set(err, ST_ERR_NOMEM, "no memory for a communicator group");
    memset(g, 0, size);
    atomic_init(&g->bar.count, 0);
    atomic_init(&g->bar.gen, 0);
    atomic_init(&g->bar.sleepers, 0);
    g->n = n_ranks;
    for (int r = 0; r < n_ranks; r++)
        g->comms[r] =
            (struct kern_comm){.ops = &cpu_comm_ops, .impl = g, .rank = r, .size = n_ranks};
    *out = g;
    return ST_OK;
}

void kern_cpu_comm_group_free(struct kern_cpu_comm_group *g)
{
    free(g);
}

int kern_cpu_comm_group_size(const struct kern_cpu_comm_group *g)
{
    return g->n;
}

struct kern_comm *kern_cpu_comm_get(struct kern_cpu_comm_group *g, int rank)
{
    assert(rank >= 0 && rank < g->n);
    return &g->comms[rank];
}
