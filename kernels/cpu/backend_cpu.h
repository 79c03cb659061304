/* The CPU backend's own entry points, behind kern_backend_open("cpu"). Only kernels/ and the
 * kernel tests include this header; everything above kernels/ goes through kernels/kernels.h. */
#ifndef KERNELS_CPU_BACKEND_CPU_H
#define KERNELS_CPU_BACKEND_CPU_H

#include <stdio.h>

#include "kernels/kernels.h"

struct kern_cpu_opts {
    int n_threads;     /* threads including the caller, >= 1 */
    const char *isa;   /* NULL/"auto" = best the CPU supports; "scalar", "avx2", "avx512" */
    enum kern_act act; /* activation precision of matmuls */
    int as_device;     /* report host_memory 0 (struct kern_backend_opts) */
};

/* CPU backend; an ISA the CPU lacks is an error. Caller frees with kern_backend_free. */
enum status kern_cpu_backend_init(struct kern_backend **out, const struct kern_cpu_opts *o,
                                  struct err_detail *err);
/* 1 when the table --isa names (NULL/"auto": the best) runs the bf16 matmul mode (AMX-BF16). */
int kern_cpu_isa_bf16(const char *isa);
/* Name of the instruction set in use ("avx512-vnni", ...). */
const char *kern_cpu_backend_isa(const struct kern_backend *b);
/* Scratch allocations b's ops have made since it was opened because kern_ops.reserve had
 * not sized them for the call (tests: 0 for calls within what reserve was given). */
size_t kern_cpu_late_allocs(const struct kern_backend *b);
/* The CPU line of kern_backends_print. */
void kern_cpu_print(FILE *f);

#endif
