/* A communicator for ranks whose buffers are not host memory and that have no device
 * collective library at hand (a GPU backend without NCCL, or several backend instances sharing
 * one GPU): each collective downloads the rank's buffer through its own backend into a host
 * staging buffer, runs the CPU communicator (kernels/cpu/comm_cpu.h) over the staging buffers,
 * and uploads the result. Two host crossings per collective make it slow, but its results are
 * bitwise the CPU communicator's, and it lets `--tp N` run on a single GPU, which is how the
 * sharded device paths are tested where only one GPU exists. */
#ifndef KERNELS_COMM_STAGED_H
#define KERNELS_COMM_STAGED_H

#include <stddef.h>

#include "common/err.h"
#include "kernels/comm.h"
#include "kernels/kernels.h"

struct kern_staged_comm_group;

/* A group of n ranks, rank r moving its bytes through be[r] (borrowed; must outlive the
 * group). Caller frees with kern_staged_comm_group_free. */
enum status kern_staged_comm_group_init(struct kern_staged_comm_group **out,
                                        struct kern_backend *const *be, int n,
                                        struct err_detail *err);
void kern_staged_comm_group_free(struct kern_staged_comm_group *g); /* NULL: nothing */
/* Rank r's handle, owned by the group. */
struct kern_comm *kern_staged_comm_get(struct kern_staged_comm_group *g, int rank);
/* Bytes the group's collectives have moved through host staging so far (downloads + uploads,
 * all ranks): for tests and reports. */
size_t kern_staged_comm_bytes(const struct kern_staged_comm_group *g);

#endif
