/* The CPU communicator: the ranks of a tensor-parallel group are threads of one process and
 * reduce through shared memory (struct kern_comm in kernels/comm.h). A group is made once for
 * n ranks; each rank's thread takes its handle with kern_cpu_comm_get. */
#ifndef KERNELS_CPU_COMM_CPU_H
#define KERNELS_CPU_COMM_CPU_H

#include "common/err.h"
#include "kernels/comm.h"

#define KERN_CPU_COMM_MAX_RANKS 64 /* most ranks one group takes */

struct kern_cpu_comm_group;

/* A group of n_ranks (1..KERN_CPU_COMM_MAX_RANKS) ranks. Caller frees with
 * kern_cpu_comm_group_free once no rank uses its handle any more. */
enum status kern_cpu_comm_group_init(struct kern_cpu_comm_group **out, int n_ranks,
                                     struct err_detail *err);
void kern_cpu_comm_group_free(struct kern_cpu_comm_group *g); /* NULL ok */
int kern_cpu_comm_group_size(const struct kern_cpu_comm_group *g);
/* Rank `rank`'s handle (0 <= rank < size), owned by the group: valid until it is freed. */
struct kern_comm *kern_cpu_comm_get(struct kern_cpu_comm_group *g, int rank);

#endif
