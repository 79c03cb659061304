/* The device communicator: the ranks of a tensor-parallel group are CUDA backends on distinct
 * GPUs of this process, one host thread each, joined by NCCL (loaded at run time,
 * kernels/cuda/cuda_nccl.cu). Results are bitwise those of the CPU communicator: an all-reduce
 * is NCCL point-to-point copies of each rank's chunk to its owner, a kernel that adds the ranks'
 * values in rank order, and an NCCL all-gather of the sums; its traffic is that of NCCL's ring
 * all-reduce, 2 (n - 1) / n of the buffer per rank. Every collective is queued on the rank's
 * stream: on return its result is complete in that stream's order (the rank's later ops and
 * copies see it), its inputs free to overwrite by later ops. Only kernels/ includes this. */
#ifndef KERNELS_CUDA_COMM_NCCL_H
#define KERNELS_CUDA_COMM_NCCL_H

#include <stddef.h>

#include "common/err.h"
#include "kernels/comm.h"
#include "kernels/kernels.h"

struct kern_nccl_comm_group;

/* 1 when n ranks can use NCCL here: the library loads and the process sees at least n CUDA
 * devices; else 0 with the reason in why. */
int kern_nccl_usable(int n, char *why, size_t why_size);
/* A group of n ranks, rank r on be[r] (CUDA backends on distinct devices, borrowed: they must
 * outlive the group). Caller frees with kern_nccl_comm_group_free. */
enum status kern_nccl_comm_group_init(struct kern_nccl_comm_group **out,
                                      struct kern_backend *const *be, int n,
                                      struct err_detail *err);
void kern_nccl_comm_group_free(struct kern_nccl_comm_group *g); /* NULL: nothing */
/* Rank r's handle, owned by the group. */
struct kern_comm *kern_nccl_comm_get(struct kern_nccl_comm_group *g, int rank);
/* "NCCL 2.28.9" (static storage; "NCCL (not loaded)" when it is not), for logs. */
const char *kern_nccl_describe(void);

#endif
