/* The "avx-vnni" table is dot_avx2.c and gemm_avx2.c compiled a second time with QUERN_AVXVNNI
 * and -mavxvnni (dot_avxvnni.c, gemm_avxvnni.c): their int8 dot products through dpbusd
 * (simd_avx2.h; all but Q6_K's, which keeps vpmaddubsw for its 16-bit scale step) become
 * vpdpbusd, everything else is the AVX2 code. These renames, included first by both
 * files, give the second copy its own external names (the table refers to them, and to the
 * kern_avx2_* kernels of the other AVX2 files, which have no second copy). Every external name
 * dot_avx2.c and gemm_avx2.c define must be here, or the link fails with a duplicate. */
#ifndef KERNELS_CPU_AVXVNNI_NAMES_H
#define KERNELS_CPU_AVXVNNI_NAMES_H

#define QUERN_AVXVNNI 1
#define AVX2_TABLE_ISA  KERN_ISA_AVXVNNI
#define AVX2_TABLE_NAME "avx-vnni"

#define kern_avx2_dequant_f16 kern_avxvnni_dequant_f16
#define kern_avx2_dequant_q4_1 kern_avxvnni_dequant_q4_1
#define kern_avx2_dequant_q8_0 kern_avxvnni_dequant_q8_0
#define kern_avx2_dot_bf16_f32 kern_avxvnni_dot_bf16_f32
#define kern_avx2_dot_f16_f32 kern_avxvnni_dot_f16_f32
#define kern_avx2_dot_f32_f32 kern_avxvnni_dot_f32_f32
#define kern_avx2_dot_q4_0_q8 kern_avxvnni_dot_q4_0_q8
#define kern_avx2_dot_q4_1_q8 kern_avxvnni_dot_q4_1_q8
#define kern_avx2_dot_q4_k_q8 kern_avxvnni_dot_q4_k_q8
#define kern_avx2_dot_q5_0_q8 kern_avxvnni_dot_q5_0_q8
#define kern_avx2_dot_q6_k_q8 kern_avxvnni_dot_q6_k_q8
#define kern_avx2_dot_q8_0_q8 kern_avxvnni_dot_q8_0_q8
#define kern_avx2_gemm_bf16_f32 kern_avxvnni_gemm_bf16_f32
#define kern_avx2_gemm_f16_f32 kern_avxvnni_gemm_f16_f32
#define kern_avx2_gemm_f32_f32 kern_avxvnni_gemm_f32_f32
#define kern_avx2_gemm_q4_0_f32 kern_avxvnni_gemm_q4_0_f32
#define kern_avx2_gemm_q4_0_q8 kern_avxvnni_gemm_q4_0_q8
#define kern_avx2_gemm_q4_1_f32 kern_avxvnni_gemm_q4_1_f32
#define kern_avx2_gemm_q4_1_q8 kern_avxvnni_gemm_q4_1_q8
#define kern_avx2_gemm_q4_k_f32 kern_avxvnni_gemm_q4_k_f32
#define kern_avx2_gemm_q4_k_q8 kern_avxvnni_gemm_q4_k_q8
#define kern_avx2_gemm_q5_0_f32 kern_avxvnni_gemm_q5_0_f32
#define kern_avx2_gemm_q5_0_q8 kern_avxvnni_gemm_q5_0_q8
#define kern_avx2_gemm_q6_k_f32 kern_avxvnni_gemm_q6_k_f32
#define kern_avx2_gemm_q6_k_q8 kern_avxvnni_gemm_q6_k_q8
#define kern_avx2_gemm_q8_0_f32 kern_avxvnni_gemm_q8_0_f32
#define kern_avx2_gemm_q8_0_q8 kern_avxvnni_gemm_q8_0_q8
#define kern_avx2_int8_peak kern_avxvnni_int8_peak
#define kern_avx2_panel_bytes kern_avxvnni_panel_bytes
#define kern_avx2_panel_pack kern_avxvnni_panel_pack
#define kern_avx2_gemm_q4_0_q8_packed kern_avxvnni_gemm_q4_0_q8_packed
#define kern_avx2_gemm_q4_1_q8_packed kern_avxvnni_gemm_q4_1_q8_packed
#define kern_avx2_gemm_q8_0_q8_packed kern_avxvnni_gemm_q8_0_q8_packed
#define kern_avx2_matvec_q6_k_f32 kern_avxvnni_matvec_q6_k_f32
#define kern_avx2_quantize_q16 kern_avxvnni_quantize_q16
#define kern_cpu_fns_avx2 kern_cpu_fns_avxvnni

#endif
