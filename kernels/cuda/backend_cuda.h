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
/* The CUDA lines of kern_backends_print. */
void kern_cuda_print(FILE *f);

#endif
