/* The AVX-VNNI table: dot_avx2.c again, its int8 dot products on vpdpbusd (avxvnni_names.h). */
#include "kernels/cpu/avxvnni_names.h"

#include "kernels/cpu/dot_avx2.c"
