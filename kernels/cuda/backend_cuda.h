/* The CUDA backend's own entry points, behind kern_backend_open("cuda") (kernels/backend.c). Only
 * built when nvcc is found (Makefile CUDA=auto|0|1, which defines QUERN_CUDA); only kernels/ and
 * the kernel tests include this header. */
#ifndef KERNELS_CUDA_BACKEND_CUDA_H
#define KERNELS_CUDA_BACKEND_CUDA_H

#include <stddef.h>
#include <stdio.h>

#include "kernels/kernels.h"

struct kern_cuda_opts {
    int device;        /* CUDA device ordinal */
    enum kern_act act; /* matmul mode: KERN_ACT_F32 (exact) or KERN_ACT_BF16 */
};

/* CUDA devices this process can use (0 when there is no driver or no GPU: then `why`, when not
 * NULL, gets the CUDA runtime's reason). */
int kern_cuda_device_count(char *why, size_t why_size);
/* A backend on device o->device. Caller frees with kern_backend_free. */
enum status kern_cuda_backend_init(struct kern_backend **out, const struct kern_cuda_opts *o,
                                   struct err_detail *err);
/* For a device communicator (kernels/cuda/comm_nccl.c): the backend's stream (a cudaStream_t),
 * its device made current for the calling thread; its device ordinal; and, after a library call
 * that may have changed the calling thread's current device (NCCL's initialisation), word that
 * the next op must make its device current again. */
void *kern_cuda_stream(struct kern_backend *b);
int kern_cuda_device(const struct kern_backend *b);
void kern_cuda_forget_device(void);
/* The CUDA lines of kern_backends_print. */
void kern_cuda_print(FILE *f);

#endif
