/* Private to kernels/cpu: the per-type scalar kernels that the SIMD tables fall back to, and the
 * per-ISA tables that dispatch.c hands out only after checking the CPU supports them. */
#ifndef KERNELS_CPU_CPU_KERNELS_INTERNAL_H
#define KERNELS_CPU_CPU_KERNELS_INTERNAL_H

#include <string.h>
#include <time.h>

#include "kernels/cpu/cpu_kernels.h"

/* One table per ISA, each defined in that ISA's file (quant_ref.c, dot_avx2.c, dot_avxvnni.c,
 * dot_avx512.c).
 * Calling through the AVX tables on a CPU without those instructions crashes: go through
 * kern_cpu_fns_get(). */
extern const struct kern_cpu_fns kern_cpu_fns_scalar;
extern const struct kern_cpu_fns kern_cpu_fns_avx2;
extern const struct kern_cpu_fns kern_cpu_fns_avxvnni;
extern const struct kern_cpu_fns kern_cpu_fns_avx512;

/* Scalar per-type kernels (quant_ref.c); semantics as kern_ref_dequant_row and friends. */
void kern_ref_dequant_f32(const void *src, float *dst, int64_t n);
void kern_ref_dequant_f16(const void *src, float *dst, int64_t n);
void kern_ref_dequant_bf16(const void *src, float *dst, int64_t n);
void kern_ref_dequant_q4_0(const void *src, float *dst, int64_t n);
void kern_ref_dequant_q4_1(const void *src, float *dst, int64_t n);
void kern_ref_dequant_q5_0(const void *src, float *dst, int64_t n);
void kern_ref_dequant_q8_0(const void *src, float *dst, int64_t n);
void kern_ref_dequant_q4_k(const void *src, float *dst, int64_t n);
void kern_ref_dequant_q6_k(const void *src, float *dst, int64_t n);

float kern_ref_dot_q4_0_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_ref_dot_q4_1_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_ref_dot_q5_0_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_ref_dot_q8_0_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_ref_dot_q4_k_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_ref_dot_q6_k_q8(const void *w, const struct kern_q8 *x, int64_t n);

float kern_ref_dot_f32_f32(const void *w, const float *x, int64_t n);
float kern_ref_dot_f16_f32(const void *w, const float *x, int64_t n);
float kern_ref_dot_bf16_f32(const void *w, const float *x, int64_t n);

/* Weight rows . float activations, the scalar per-type matvec_f32 entries (any n for the float
 * types); semantics as kern_ref_matvec_f32. */
#define KERN_MATVEC_ARGS                                                                           \
    const void *w, size_t row_bytes, int64_t n_rows, const float *x, int64_t n, float *y
void kern_ref_matvec_f32_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_f16_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_bf16_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_q4_0_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_q4_1_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_q5_0_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_q8_0_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_q4_k_f32(KERN_MATVEC_ARGS);
void kern_ref_matvec_q6_k_f32(KERN_MATVEC_ARGS);

/* Batched matmul argument lists (see gemm_f32 / gemm_q8 in struct kern_cpu_fns). */
#define KERN_GEMM_F32_ARGS                                                                         \
    const void *w, size_t row_bytes, int64_t n_rows, const float *x, size_t ldx, int64_t n_tok,    \
        int64_t n, float *y, size_t ldy
#define KERN_GEMM_Q8_ARGS                                                                          \
    const void *w, size_t row_bytes, int64_t n_rows, const struct kern_q8 *xq, size_t ldxq,        \
        int64_t n_tok, int64_t n, float *y, size_t ldy

#define KERN_GEMM_Q16_ARGS                                                                         \
    const void *w, size_t row_bytes, int64_t n_rows, const struct kern_q16 *xq, size_t ldxq,       \
        int64_t n_tok, int64_t n, float *y, size_t ldy

/* Matmul over weights packed at load (struct kern_cpu_fns panel_pack); XT = kern_q8 or
 * kern_q16. */
#define KERN_GEMM_PK_ARGS(XT)                                                                      \
    const void *pk, int64_t n_rows, const struct XT *xq, size_t ldxq, int64_t n_tok, int64_t n,    \
        float *y, size_t ldy
#define KERN_GEMM_PK_ARGS_F32                                                                      \
    const void *pk, int64_t n_rows, const float *x, size_t ldx, int64_t n_tok, int64_t n,         \
        float *y, size_t ldy
#define KERN_G16_BLKS       64 /* longest rows (in blocks) of the AVX-512 q16 tiles */
#define KERN_PANEL_F32_BLKS 48 /* and of the packed exact tiles (2 x 96 KiB float panels) */
#define KERN_PANEL_BF16_BLKS 128 /* and of the bf16 tiles (two panels' B tiles in 256 KiB) */
size_t kern_avx512_panel_bytes(uint32_t type, int64_t n_rows, int64_t n, int act);
void kern_avx512_gemm_q4_0_f32_packed(KERN_GEMM_PK_ARGS_F32);
void kern_avx512_gemm_q4_1_f32_packed(KERN_GEMM_PK_ARGS_F32);
void kern_avx512_gemm_q8_0_f32_packed(KERN_GEMM_PK_ARGS_F32);
void kern_avx512_panel_pack(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows,
                            int64_t n, void *dst);
void kern_avx512_gemm_q4_0_q8_packed(KERN_GEMM_PK_ARGS(kern_q8));
void kern_avx512_gemm_q4_1_q8_packed(KERN_GEMM_PK_ARGS(kern_q8));
void kern_avx512_gemm_q8_0_q8_packed(KERN_GEMM_PK_ARGS(kern_q8));
void kern_avx512_gemm_q4_0_q16_packed(KERN_GEMM_PK_ARGS(kern_q16));
void kern_avx512_gemm_q4_1_q16_packed(KERN_GEMM_PK_ARGS(kern_q16));
void kern_avx512_gemm_q8_0_q16_packed(KERN_GEMM_PK_ARGS(kern_q16));

/* 16-bit activation kernels: scalar (q16_ref.c), AVX2 (gemm16_avx2.c, quantize in dot_avx2.c)
 * and AVX-512 (gemm16_avx512.c, quantize in dot_avx512.c). */
float kern_ref_dot_q4_0_q16(const void *w, const struct kern_q16 *x, int64_t n);
float kern_ref_dot_q4_1_q16(const void *w, const struct kern_q16 *x, int64_t n);
float kern_ref_dot_q8_0_q16(const void *w, const struct kern_q16 *x, int64_t n);
void kern_ref_gemm_q4_0_q16(KERN_GEMM_Q16_ARGS);
void kern_ref_gemm_q4_1_q16(KERN_GEMM_Q16_ARGS);
void kern_ref_gemm_q8_0_q16(KERN_GEMM_Q16_ARGS);
void kern_avx2_quantize_q16(const float *x, struct kern_q16 *y, int64_t n);
void kern_avx2_gemm_q4_0_q16(KERN_GEMM_Q16_ARGS);
void kern_avx2_gemm_q4_1_q16(KERN_GEMM_Q16_ARGS);
void kern_avx2_gemm_q8_0_q16(KERN_GEMM_Q16_ARGS);
void kern_avx512_quantize_q16(const float *x, struct kern_q16 *y, int64_t n);
void kern_avx512_gemm_q4_0_q16(KERN_GEMM_Q16_ARGS);
void kern_avx512_gemm_q4_1_q16(KERN_GEMM_Q16_ARGS);
void kern_avx512_gemm_q8_0_q16(KERN_GEMM_Q16_ARGS);

/* Scalar per-type gemm entries (quant_ref.c): every pair bitwise as kern_ref_matvec_f32 /
 * kern_ref_vec_dot_q8 would compute it. */
void kern_ref_gemm_f32_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_f16_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_bf16_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_q4_0_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_q4_1_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_q5_0_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_q8_0_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_q4_k_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_q6_k_f32(KERN_GEMM_F32_ARGS);
void kern_ref_gemm_q4_0_q8(KERN_GEMM_Q8_ARGS);
void kern_ref_gemm_q4_1_q8(KERN_GEMM_Q8_ARGS);
void kern_ref_gemm_q5_0_q8(KERN_GEMM_Q8_ARGS);
void kern_ref_gemm_q8_0_q8(KERN_GEMM_Q8_ARGS);
void kern_ref_gemm_q4_k_q8(KERN_GEMM_Q8_ARGS);
void kern_ref_gemm_q6_k_q8(KERN_GEMM_Q8_ARGS);

/* Generic batch-invariant gemm: one dot(row, token) call per pair, so each pair's result is
 * bitwise that dot's. The fallback of the SIMD tables for types without a tiled kernel. */
void kern_gemm_q8_pairs(float (*dot)(const void *, const struct kern_q8 *, int64_t),
                        KERN_GEMM_Q8_ARGS);
void kern_gemm_f32_pairs(float (*dot)(const void *, const float *, int64_t), KERN_GEMM_F32_ARGS);

/* Tiled gemm kernels (gemm_avx2.c, gemm_avx512.c). gemm_f32 handles every type by dequantizing
 * row panels with the given ISA table's dequant_row; see those files for the pair order. */
#define KERN_GEMM_DECL(isa)                                                                        \
    void kern_##isa##_gemm_f32_f32(KERN_GEMM_F32_ARGS);                                            \
    void kern_##isa##_gemm_f16_f32(KERN_GEMM_F32_ARGS);                                            \
    void kern_##isa##_gemm_bf16_f32(KERN_GEMM_F32_ARGS);                                           \
    void kern_##isa##_gemm_q4_0_f32(KERN_GEMM_F32_ARGS);                                           \
    void kern_##isa##_gemm_q4_1_f32(KERN_GEMM_F32_ARGS);                                           \
    void kern_##isa##_gemm_q5_0_f32(KERN_GEMM_F32_ARGS);                                           \
    void kern_##isa##_gemm_q8_0_f32(KERN_GEMM_F32_ARGS);                                           \
    void kern_##isa##_gemm_q4_k_f32(KERN_GEMM_F32_ARGS);                                           \
    void kern_##isa##_gemm_q6_k_f32(KERN_GEMM_F32_ARGS);                                           \
    void kern_##isa##_gemm_q4_0_q8(KERN_GEMM_Q8_ARGS);                                             \
    void kern_##isa##_gemm_q4_1_q8(KERN_GEMM_Q8_ARGS);                                             \
    void kern_##isa##_gemm_q5_0_q8(KERN_GEMM_Q8_ARGS);                                             \
    void kern_##isa##_gemm_q8_0_q8(KERN_GEMM_Q8_ARGS);                                             \
    void kern_##isa##_gemm_q4_k_q8(KERN_GEMM_Q8_ARGS);                                             \
    void kern_##isa##_gemm_q6_k_q8(KERN_GEMM_Q8_ARGS);                                             \
    double kern_##isa##_int8_peak(double seconds);
KERN_GEMM_DECL(avx2)
KERN_GEMM_DECL(avxvnni)
/* The AVX2 (and AVX-VNNI) q8 GEMMs over weights packed at load (gemm_avx2.c). */
#define KERN_GEMM_PACKED_DECL(isa)                                                                 \
    size_t kern_##isa##_panel_bytes(uint32_t type, int64_t n_rows, int64_t n, int act);            \
    void kern_##isa##_panel_pack(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows,   \
                                 int64_t n, void *dst);                                            \
    void kern_##isa##_gemm_q4_0_q8_packed(KERN_GEMM_PK_ARGS(kern_q8));                             \
    void kern_##isa##_gemm_q4_1_q8_packed(KERN_GEMM_PK_ARGS(kern_q8));                             \
    void kern_##isa##_gemm_q8_0_q8_packed(KERN_GEMM_PK_ARGS(kern_q8));
KERN_GEMM_PACKED_DECL(avx2)
KERN_GEMM_PACKED_DECL(avxvnni)
KERN_GEMM_DECL(avx512)

/* The tdpbusd peak loop (gemm_avx512.c); only on CPUs and processes with AMX tiles. */
double kern_amx_peak(int bf16, double seconds); /* tdpbf16ps when bf16, else tdpbusd */
/* Adds the AMX-BF16 exact-mode kernels (prep_x3, gemm_x3_packed) to a copy of the AVX-512
 * table (gemm_avx512.c). */
void kern_amx_patch(struct kern_cpu_fns *f);

/* The scalar int8 peak loop (quant_ref.c). */
double kern_ref_int8_peak(double seconds);

/* Monotonic wall clock in seconds, for the microbenchmarks. */
static inline double kern_now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* All 8 sub-block scales (out[0..7]) and mins (out[8..15]) of a Q4_K block at once, unpacked
 * from their 12-byte packing with 32-bit integer ops (same result as kern_q4_k_scale_min). */
static inline void kern_q4_k_unpack(const uint8_t packed[12], uint8_t out[16])
{
    uint32_t a, b, c;
    memcpy(&a, packed, 4);     /* low 6 bits: scales 0-3; top 2 bits: scales 4-7 bits 4-5 */
    memcpy(&b, packed + 4, 4); /* low 6 bits: mins 0-3; top 2 bits: mins 4-7 bits 4-5 */
    memcpy(&c, packed + 8, 4); /* low nibbles: scales 4-7 bits 0-3; high nibbles: mins 4-7 */
    uint32_t u[4] = {
        a & 0x3F3F3F3Fu,
        (c & 0x0F0F0F0Fu) | ((a >> 6) & 0x03030303u) << 4,
        b & 0x3F3F3F3Fu,
        ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 6) & 0x03030303u) << 4,
    };
    memcpy(out, u, sizeof u); /* x86 and the format are both little-endian */
}

/* e^x for x <= 0 in plain float arithmetic (no libm call, the same bits everywhere):
 * x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r, times 2^n built in the exponent
 * bits. Relative error < 2e-7; 0 below -87 (and for -inf). The SIMD attention kernels evaluate
 * the same polynomial lane by lane. */
#define KERN_EXP_C6 0.00138888933f
#define KERN_EXP_C5 0.00833336729f
#define KERN_EXP_C4 0.0416666418f
#define KERN_EXP_C3 0.166666672f
#define KERN_EXP_LN2_HI 0.693145752f
#define KERN_EXP_LN2_LO 1.42860677e-6f
static inline float kern_attn_exp(float x)
{
    if (!(x >= -87.0f))
        return 0.0f;
    float n = (float)(int)(x * 1.44269504f - 0.5f); /* round to nearest for x <= 0 */
    float r = x - n * KERN_EXP_LN2_HI - n * KERN_EXP_LN2_LO;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (KERN_EXP_C3 + r * (KERN_EXP_C4 +
              r * (KERN_EXP_C5 + r * KERN_EXP_C6)))));
    union {
        float f;
        int32_t i;
    } u = {p};
    u.i += (int32_t)n * (1 << 23);
    return u.f;
}

/* Attention kernels: the scalar reference (attn_ref.c) and the SIMD ones. */
void kern_ref_attn_group(const struct kern_attn *a, int t, int g, int tn, int gn, int cold);
void kern_ref_to_f16(const float *x, uint16_t *y, int64_t n);
void kern_avx2_attn_group(const struct kern_attn *a, int t, int g, int tn, int gn, int cold);
void kern_avx2_to_f16(const float *x, uint16_t *y, int64_t n);
void kern_avx512_kv_quant_q8(const float *x, int n, int8_t *q, float *scale);
void kern_avx512_attn_group(const struct kern_attn *a, int t, int g, int tn, int gn,
                            int cold);
void kern_amx_attn_tiles(const struct kern_attn *a, const int32_t *toks, int n, int g, void *ws,
                         const struct kern_tiles_next *next);
void kern_amx_kv_store_tiles(const float *k, const float *v, uint16_t *kt, uint16_t *vt, int B,
                             int D, int i);

/* Row operations (ew_ref.c, ew_avx2.c, ew_avx512.c). */
void kern_ref_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps);
void kern_ref_swiglu(float *gate, const float *up, int64_t n);
void kern_avx2_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps);
void kern_avx2_swiglu(float *gate, const float *up, int64_t n);
void kern_avx512_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps);
void kern_avx512_swiglu(float *gate, const float *up, int64_t n);
void kern_avx2_geglu(float *gate, const float *up, int64_t n);
void kern_avx512_geglu(float *gate, const float *up, int64_t n);
void kern_ref_rope(float *x, const float *cs, int n_head, int head_dim, int rot_dim);
/* GeGLU (tanh GELU as g / (1 + e^-2z), libm expf) and NEOX-paired RoPE (pairs (i, i + rot_dim / 2)): scalar in
 * every table. */
void kern_ref_geglu(float *gate, const float *up, int64_t n);
void kern_ref_rope_neox(float *x, const float *cs, int n_head, int head_dim, int rot_dim);
void kern_avx512_rope(float *x, const float *cs, int n_head, int head_dim, int rot_dim);

/* AVX2 kernels (dot_avx2.c), also used by the AVX-512 table where it has nothing better. */
float kern_avx2_dot_q4_0_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_avx2_dot_q4_1_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_avx2_dot_q5_0_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_avx2_dot_q8_0_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_avx2_dot_q4_k_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_avx2_dot_q6_k_q8(const void *w, const struct kern_q8 *x, int64_t n);
float kern_avx2_dot_f32_f32(const void *w, const float *x, int64_t n);
float kern_avx2_dot_f16_f32(const void *w, const float *x, int64_t n);
float kern_avx2_dot_bf16_f32(const void *w, const float *x, int64_t n);
void kern_avx2_dequant_f16(const void *src, float *dst, int64_t n);
void kern_avx2_dequant_q4_1(const void *src, float *dst, int64_t n);
void kern_avx2_dequant_q8_0(const void *src, float *dst, int64_t n);
void kern_avx2_matvec_q6_k_f32(KERN_MATVEC_ARGS);

#endif
