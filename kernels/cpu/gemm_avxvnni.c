/* The AVX-VNNI table's batched matmuls: gemm_avx2.c again, its int8 dot products on vpdpbusd
 * (avxvnni_names.h). */
#include "kernels/cpu/avxvnni_names.h"

#include "kernels/cpu/gemm_avx2.c"
