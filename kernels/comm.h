/* The communicator interface for tensor parallelism: the collectives (all-reduce, all-gather,
 * barrier) that the ranks of one model, each driving its own share of the weights, call to
 * combine their partial results. Backend-neutral: the CPU implementation (ranks are threads
 * of one process, kernels/cpu/comm_cpu.h) and a GPU one sit behind the same op table. */
#ifndef KERNELS_COMM_H
#define KERNELS_COMM_H

#include <stddef.h>
#include <stdint.h>

struct kern_comm;

/* Every operation is collective: all `size` ranks of the communicator call it, each from its
 * own thread, with the same arguments where stated, and all ranks call the same operations in
 * the same order. A rank that skips one or calls another deadlocks the group (or, in debug
 * builds, fails an assertion); these are programmer errors, so the operations return nothing.
 * Buffers are memory of the backend the communicator belongs to (host memory for the CPU);
 * different ranks' buffers must not overlap. On return, the rank's output is complete and its
 * buffers are free for it to reuse (for a device communicator, in the order of the rank's
 * stream: the backend's later ops and copies see the output and may overwrite the inputs);
 * nothing is allocated per call once a size has been seen.
 *
 * Determinism: a reduction adds, for each element, rank 0's value, then rank 1's, ..., then
 * rank size-1's, in that order and in the precision stated below, whatever the thread timing:
 * every rank gets bitwise the same result, and so does every run with the same inputs. */
struct kern_comm_ops {
    const char *name; /* "cpu", "staged", "nccl" */
    /* x (n floats, the same n on every rank) becomes, in place on every rank, the element-wise
     * sum over ranks in rank order, in f32: ((x_0 + x_1) + x_2) + ... */
    void (*all_reduce_sum_f32)(struct kern_comm *c, float *x, size_t n);
    /* The same for n bfloat16 values (the upper 16 bits of an f32): each element's sum is taken
     * in f32 in rank order, then rounded once to bfloat16, nearest even (kern_f32_to_bf16's
     * rounding: overflow to inf, subnormals kept, NaN quiet of the same sign). A sum that is
     * NaN is NaN; its sign and payload are the adding hardware's (x86 and GPUs differ). */
    void (*all_reduce_sum_bf16)(struct kern_comm *c, uint16_t *x, size_t n);
    /* Every rank's `bytes` bytes at `in` (the same `bytes` on every rank) are gathered, in rank
     * order, into each rank's out (size * bytes): rank r's at out + r * bytes. in may be
     * out + rank * bytes (in place); otherwise in and out must not overlap. */
    void (*all_gather)(struct kern_comm *c, const void *in, void *out, size_t bytes);
    /* Returns on any rank only after every rank has called it. */
    void (*barrier)(struct kern_comm *c);
};

/* One rank's handle. Owned by whatever made it (for the CPU, a kern_cpu_comm_group); used by
 * that rank's thread only. */
struct kern_comm {
    const struct kern_comm_ops *ops; /* dispatch table */
    void *impl;                      /* backend-private state (shared by the group's ranks) */
    int rank;                        /* this rank, in [0, size) */
    int size;                        /* ranks in the communicator, >= 1 */
    /* 1: the collectives are work queued on the rank's backend stream and nothing else (no host
     * wait, no host memory), and may go into CUDA graphs of a step (NCCL's, with
     * QUERN_TP_GRAPHS=1); 0 for the host-staged and CPU communicators */
    int in_graphs;
};

static inline int kern_comm_rank(const struct kern_comm *c)
{
    return c->rank;
}

static inline int kern_comm_size(const struct kern_comm *c)
{
    return c->size;
}

static inline void kern_comm_all_reduce_sum_f32(struct kern_comm *c, float *x, size_t n)
{
    c->ops->all_reduce_sum_f32(c, x, n);
}

static inline void kern_comm_all_reduce_sum_bf16(struct kern_comm *c, uint16_t *x, size_t n)
{
    c->ops->all_reduce_sum_bf16(c, x, n);
}

static inline void kern_comm_all_gather(struct kern_comm *c, const void *in, void *out,
                                        size_t bytes)
{
    c->ops->all_gather(c, in, out, bytes);
}

static inline void kern_comm_barrier(struct kern_comm *c)
{
    c->ops->barrier(c);
}

#endif
