/* CPU compute kernels: fp16/bf16 conversion, activation quantization, row dequantization and
 * dot products of weight rows (any supported GGUF type) with activations, as scalar reference
 * code plus AVX2 and AVX-512 VNNI versions chosen at run time through a function table. */
#ifndef KERNELS_CPU_CPU_KERNELS_H
#define KERNELS_CPU_CPU_KERNELS_H

#include <stdint.h>

#include "common/dtype.h"
#include "kernels/kernels.h"

#define KERN_QK   32  /* elements per activation block (and per Q4_0/Q4_1/Q5_0/Q8_0 block) */
#define KERN_PANEL_ROWS 16 /* rows per panel of weights packed at load (panel_pack) */
/* Bytes of prep_x3's output for n_tok tokens of n elements: per 16-token group and 32-element
 * block, three 16 x 32 bfloat16 tiles and 16 block sums. */
#define KERN_X3_BYTES(n_tok, n)                                                                    \
    ((((size_t)(n_tok) + 15) / 16) * ((size_t)(n) / 32) * (3 * 1024 + 64))
/* Bytes of prep_bf16's output: n_tok rows of n bfloat16. */
#define KERN_BF16_BYTES(n_tok, n) ((size_t)(n_tok) * (size_t)(n) * 2)
#define KERN_QK_K 256 /* elements per Q4_K/Q6_K super-block */
#define KERN_ATTN_RUN 16 /* keys per attention step (one AVX-512 vector of scores) */
#define KERN_ATTN_TILE_KEYS       32 /* positions per key block of attn_tiles */
/* attn_tiles' workspace for head_dim D and `blocks` key blocks (from the first position any of
 * the call's tokens reads to the last): one query tile's rows (bf16 queries; f32 scores and
 * bf16 weights of every position; f32 value sums of 64 channels). */
#define KERN_ATTN_TILES_BYTES(D, blocks)                                                           \
    (16 * (size_t)(D)*2 + 16 * (size_t)(blocks)*KERN_ATTN_TILE_KEYS * 6 + 16 * 64 * 4)

/* Activations quantized per block of 32: q = round(x/d) (halves away from zero, as roundf),
 * d = max|x|/127, s = d * sum(q). A block whose d would be below FLT_MIN (all zeros, or so tiny
 * that 1/d overflows) is stored as d = s = 0, q = 0. q is always in [-127, 127] for finite x; the
 * SIMD dot kernels rely on that (-128 would break their sign tricks). A row of n activations is
 * n/KERN_QK consecutive blocks. */
struct kern_q8 {
    float d;           /* scale: max|x| / 127 (0 for an all-zero block) */
    float s;           /* d * sum(q), used for the min/offset terms of Q4_1 and Q4_K */
    int8_t q[KERN_QK]; /* quantized values */
};

/* Activations quantized to 16 bits per block of 32: q = round(x/d) (halves away from zero),
 * d = max|x|/32767, s = d * sum(q); blocks with d below FLT_MIN are zeros. The q16 matmul mode
 * multiplies these with integer weight quants exactly (int32 sums), so its only rounding
 * beyond f32 is this quantization: a relative error of at most 1.5e-5 of the block maximum. */
struct kern_q16 {
    float d;            /* scale: max|x| / 32767 */
    float s;            /* d * sum(q) */
    int16_t q[KERN_QK]; /* quantized values in [-32767, 32767] */
};

/* GGUF/ggml weight blocks, little-endian, fp16 = IEEE half. Weight rows handed to the kernels
 * must be 2-byte aligned (every block size is even and GGUF aligns tensor data to 32). */
struct kern_block_q4_0 {
    uint16_t d;     /* fp16 scale; x = d * (nibble - 8) */
    uint8_t qs[16]; /* element i in the low nibble of qs[i], element i+16 in the high */
};

struct kern_block_q4_1 {
    uint16_t d;     /* fp16 scale; x = d * nibble + m */
    uint16_t m;     /* fp16 offset (the block minimum) */
    uint8_t qs[16]; /* element i in the low nibble of qs[i], element i+16 in the high */
};

struct kern_block_q5_0 {
    uint16_t d;     /* fp16 scale; x = d * (q5 - 16) */
    uint8_t qh[4];  /* bit j of this little-endian uint32 is bit 4 of element j */
    uint8_t qs[16]; /* low 4 bits: element i in the low nibble, element i+16 in the high */
};

struct kern_block_q8_0 {
    uint16_t d;    /* fp16 scale; x = d * q */
    int8_t qs[32]; /* quantized values */
};

struct kern_block_q4_k {
    uint16_t d;         /* fp16 super-scale for the 6-bit sub-block scales */
    uint16_t dmin;      /* fp16 super-scale for the 6-bit sub-block mins */
    uint8_t scales[12]; /* 8 scales and 8 mins of 6 bits, packed (see kern_q4_k_scale_min) */
    uint8_t qs[128];    /* 64-element group g: qs[32g..32g+31], low nibbles then high nibbles */
};

struct kern_block_q6_k {
    uint8_t ql[128];   /* low 4 bits of the 256 quants */
    uint8_t qh[64];    /* high 2 bits, four elements per byte */
    int8_t scales[16]; /* one scale per 16 consecutive elements */
    uint16_t d;        /* fp16 super-scale */
};

_Static_assert(sizeof(struct kern_q8) == 40, "kern_q8 layout");
_Static_assert(sizeof(struct kern_q16) == 72, "kern_q16 layout");
_Static_assert(sizeof(struct kern_block_q4_0) == 18, "Q4_0 block size");
_Static_assert(sizeof(struct kern_block_q4_1) == 20, "Q4_1 block size");
_Static_assert(sizeof(struct kern_block_q5_0) == 22, "Q5_0 block size");
_Static_assert(sizeof(struct kern_block_q8_0) == 34, "Q8_0 block size");
_Static_assert(sizeof(struct kern_block_q4_k) == 144, "Q4_K block size");
_Static_assert(sizeof(struct kern_block_q6_k) == 210, "Q6_K block size");

/* IEEE half and bfloat16 conversions; float -> half/bf16 rounds to nearest even, overflows to
 * inf, keeps subnormals, and maps NaN to a quiet NaN of the same sign. */
float kern_f16_to_f32(uint16_t h);
uint16_t kern_f32_to_f16(float f);
float kern_bf16_to_f32(uint16_t h);
uint16_t kern_f32_to_bf16(float f);

/* Sub-block j (0..7) scale and min of a Q4_K block, unpacked from its 12 scale bytes. */
void kern_q4_k_scale_min(const uint8_t scales[12], int j, uint8_t *sc, uint8_t *m);

/* Scalar reference implementations: the ground truth for every SIMD kernel. n is a multiple of
 * the type's block size (and of KERN_QK); x must be finite. Passing a type a function does not
 * handle is a programmer error and aborts. */
void kern_ref_quantize_q8(const float *x, struct kern_q8 *y, int64_t n);
void kern_ref_quantize_q16(const float *x, struct kern_q16 *y, int64_t n);
/* Q4_0, Q4_1, Q8_0 weight row . 16-bit activations. */
float kern_ref_vec_dot_q16(uint32_t type, const void *w, const struct kern_q16 *x, int64_t n);
/* All 9 types. */
void kern_ref_dequant_row(uint32_t type, const void *src, float *dst, int64_t n);
/* Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K weight row . quantized activations. */
float kern_ref_vec_dot_q8(uint32_t type, const void *w, const struct kern_q8 *x, int64_t n);
/* F32, F16, BF16 weight row . float activations. */
float kern_ref_vec_dot_f32(uint32_t type, const void *w, const float *x, int64_t n);
/* All 9 types: n_rows weight rows (row_bytes apart) . float activations, one float per row.
 * Row r's result is bitwise kern_ref_vec_dot_f32(DTYPE_F32, dequantized row r, x, n): every
 * weight is dequantized exactly as kern_ref_dequant_row does, times x, summed in order. */
void kern_ref_matvec_f32(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows,
                         const float *x, int64_t n, float *y);

enum kern_isa {
    KERN_ISA_SCALAR = 0,
    KERN_ISA_AVX2 = 1,    /* AVX2 + FMA + F16C */
    KERN_ISA_AVXVNNI = 2, /* the AVX2 table with its int8 dot products on AVX-VNNI (VEX
                           * vpdpbusd: Alder Lake, Sierra Forest, Zen 5, Sapphire Rapids...) */
    KERN_ISA_AVX512 = 3,  /* AVX-512 F/BW/VL/DQ + VNNI */
    KERN_ISA_AMX = 4,     /* the AVX-512 table, exact mode on AMX-BF16 tiles (OS grants tiles) */
    KERN_ISA_COUNT,
};

/* One instruction set's kernels. Every table is fully populated: entries a SIMD file does not
 * implement point at the scalar reference (or, in the AVX-512 table, at the AVX2 kernel). Results
 * are deterministic for a given table (same inputs, same bits) but may differ slightly between
 * tables (summation order, FMA). */
/* The call to attn_tiles a thread makes next (its first keys are prefetched while the current
 * one ends); n 0: none. cold: no earlier call prefetched for this one. */
struct kern_tiles_next {
    const int32_t *toks;
    int n, g, cold;
};

struct kern_cpu_fns {
    enum kern_isa isa; /* which instruction set these use */
    const char *name;  /* "scalar", "avx2", "avx-vnni", "avx512-vnni", "amx" */
    void (*quantize_q8)(const float *x, struct kern_q8 *y, int64_t n); /* never NULL */
    /* Quantized weight row . quantized activations; NULL for float types. */
    float (*vec_dot_q8[DTYPE_COUNT])(const void *w, const struct kern_q8 *x, int64_t n);
    /* Float weight row . float activations; only F32/F16/BF16, NULL otherwise. */
    float (*vec_dot_f32[DTYPE_COUNT])(const void *w, const float *x, int64_t n);
    /* Weight row -> floats, bitwise equal to the reference; all 9 types. */
    void (*dequant_row[DTYPE_COUNT])(const void *src, float *dst, int64_t n);
    /* Weight rows . float activations without a dequantized copy: y[r] = sum_i w_r[i] * x[i]
     * for r < n_rows, row r at w + r * row_bytes (2-byte aligned; 4 for F32); all 9 types. Each
     * weight is dequantized exactly (as dequant_row) before it is multiplied, so the result
     * agrees with dequant_row + vec_dot_f32 up to float summation order. A row's result uses one
     * fixed accumulation order: it is bitwise the same whatever n_rows is and wherever the row
     * sits in the call, so splitting rows across threads or calls never changes a bit. */
    void (*matvec_f32[DTYPE_COUNT])(const void *w, size_t row_bytes, int64_t n_rows, const float *x,
                                    int64_t n, float *y);
    /* Batched matmul, exact f32 math: y[t*ldy + r] = sum_i w_r[i] * x[t*ldx + i] for r < n_rows,
     * t < n_tok; row r at w + r * row_bytes (as matvec_f32), n a multiple of the type's block
     * size (any n for the float types). Weights are dequantized bitwise as dequant_row. Batch
     * invariant: each (row, token) result follows one fixed accumulation order, so it is bitwise
     * the same whatever n_tok and n_rows are and wherever the row and token sit in the call;
     * rows may be split across threads and calls freely. Thread-safe, allocates nothing (uses a
     * bounded stack buffer). All 9 types. */
    void (*gemm_f32[DTYPE_COUNT])(const void *w, size_t row_bytes, int64_t n_rows, const float *x,
                                  size_t ldx, int64_t n_tok, int64_t n, float *y, size_t ldy);
    /* The same with quantized activations: token t's n/KERN_QK blocks start at xq + t * ldxq;
     * y agrees with vec_dot_q8 up to float rounding (integer parts exact) and has the same
     * batch invariance. Quantized types only (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), NULL
     * otherwise. */
    void (*gemm_q8[DTYPE_COUNT])(const void *w, size_t row_bytes, int64_t n_rows,
                                 const struct kern_q8 *xq, size_t ldxq, int64_t n_tok, int64_t n,
                                 float *y, size_t ldy);
    /* 16-bit activation quantization (struct kern_q16), as kern_ref_quantize_q16; never NULL. */
    void (*quantize_q16)(const float *x, struct kern_q16 *y, int64_t n);
    /* Batched matmul with 16-bit activations: as gemm_q8 (same layout of y, same batch
     * invariance), each pair agreeing with kern_ref_vec_dot_q16 up to float rounding (integer
     * parts exact). Q4_0, Q4_1 and Q8_0 only, NULL otherwise. */
    void (*gemm_q16[DTYPE_COUNT])(const void *w, size_t row_bytes, int64_t n_rows,
                                  const struct kern_q16 *xq, size_t ldxq, int64_t n_tok, int64_t n,
                                  float *y, size_t ldy);
    /* Weights repacked once (at model load) for this table's matmuls: panel_bytes(type, n_rows,
     * n, act) is the packed size of an n_rows x n matrix for the exact (act 0), q8 (1) or q16
     * (2) GEMM (the values of enum kern_act), 0 when this table does not pack that type or shape
     * for that mode (then the unpacked GEMMs are used); panel_pack writes it (64-byte aligned
     * dst; one form for every mode). The packed form is a sequence of panels of KERN_PANEL_ROWS
     * rows, panel_bytes(type, KERN_PANEL_ROWS, n, act) bytes each. The *_packed GEMMs take the
     * panel of a row range's first row (a multiple of KERN_PANEL_ROWS). gemm_q8_packed /
     * gemm_q16_packed give bitwise the results of gemm_q8 / gemm_q16 on the original rows;
     * gemm_f32_packed is exact like gemm_f32 (weights dequantized bitwise as dequant_row) but
     * sums in its own fixed order (see gemm_avx512.c), also batch invariant. NULL in tables
     * without packing. */
    size_t (*panel_bytes)(uint32_t type, int64_t n_rows, int64_t n, int act);
    void (*panel_pack)(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows, int64_t n,
                       void *dst);
    void (*gemm_q8_packed[DTYPE_COUNT])(const void *pk, int64_t n_rows, const struct kern_q8 *xq,
                                        size_t ldxq, int64_t n_tok, int64_t n, float *y,
                                        size_t ldy);
    void (*gemm_f32_packed[DTYPE_COUNT])(const void *pk, int64_t n_rows, const float *x,
                                         size_t ldx, int64_t n_tok, int64_t n, float *y,
                                         size_t ldy);
    void (*gemm_q16_packed[DTYPE_COUNT])(const void *pk, int64_t n_rows,
                                         const struct kern_q16 *xq, size_t ldxq, int64_t n_tok,
                                         int64_t n, float *y, size_t ldy);
    /* Exact mode on bf16 tile products (the AMX table; NULL elsewhere). prep_x3 writes n_tok
     * activation rows of n floats as KERN_X3_BYTES(n_tok, n) bytes: every float split exactly
     * into three bfloat16 parts (x = hi + mid + lo), in 16-token tiles, plus each token's
     * per-block sums. gemm_x3_packed then multiplies weights packed at load (as for
     * gemm_f32_packed) with it: per 32-element block the exact products of the integer quants
     * with the three parts, summed in f32 by the tile unit, times the block scale (plus the
     * Q4_1 offset times the block sum), blocks in order. Batch invariant. */
    void (*prep_x3)(const float *x, size_t ldx, int64_t n_tok, int64_t n, void *xs);
    void (*gemm_x3_packed[DTYPE_COUNT])(const void *pk, int64_t n_rows, const void *xs,
                                        int64_t n_tok, int64_t n, float *y, size_t ldy);
    /* bf16 mode on bf16 tile products (the AMX table; NULL elsewhere). prep_bf16 writes n_tok
     * activation rows of n floats as KERN_BF16_BYTES(n_tok, n) bytes, every value rounded to
     * bfloat16 (nearest even, subnormals to zero); gemm_bf16_packed multiplies the weights
     * packed at load (as for gemm_f32_packed), each dequantized as dequant_row and rounded to
     * bfloat16, with it: exact products summed in f32 by the tile unit over the whole row, in
     * one fixed order (gemm_avx512.c). Batch invariant. */
    void (*prep_bf16)(const float *x, size_t ldx, int64_t n_tok, int64_t n, void *xs);
    void (*gemm_bf16_packed[DTYPE_COUNT])(const void *pk, int64_t n_rows, const void *xs,
                                          int64_t n_tok, int64_t n, float *y, size_t ldy);
    /* gemm_bf16_packed with a greedy epilogue instead of stores (for an output projection whose
     * rows are only argmax'ed): rows [0, n_rows) of this call are the matrix's rows r0 ..; for
     * each token t, bv[t] / bi[t] become the largest value and its first row where a value
     * exceeds bv[t] (NaN never does); the caller initialises them (e.g. -inf, 0). The values
     * compared are bitwise gemm_bf16_packed's. */
    void (*gemm_bf16_argmax[DTYPE_COUNT])(const void *pk, int64_t n_rows, const void *xs,
                                          int64_t n_tok, int64_t n, int64_t r0, float *bv,
                                          int32_t *bi);
    /* The FFN's gate and up GEMMs in bf16 mode with the SwiGLU fused: for rows [0, n_rows) of
     * gate and up (both packed, pg / pu at the panel of the range's first row, n_rows a
     * multiple of 16), h[t][r] = silu(gate[t][r]) * up[t][r] from the bf16 products, written
     * as prep_bf16 would write the rows h (o: token t's row at o + t * ldo words; this range is
     * its rows r0 .., r0 a multiple of 16). Bitwise gemm_bf16_packed of both, kern swiglu,
     * then prep_bf16. */
    void (*gemm_bf16_swiglu[DTYPE_COUNT])(const void *pg, const void *pu, int64_t n_rows,
                                          const void *xs, int64_t n_tok, int64_t n, void *o,
                                          int64_t r0, size_t ldo);
    /* y[i] = x[i] rounded to IEEE half, nearest even, bitwise as kern_f32_to_f16 (finite x). */
    void (*to_f16)(const float *x, uint16_t *y, int64_t n);
    /* One 8-bit KV row, bitwise as kern_kv_quant_q8 (below). */
    void (*kv_quant_q8)(const float *x, int n, int8_t *q, float *scale);
    /* Attention of token t's query heads g*G .. g*G+G-1 (G = n_head / n_kv_head) over KV head g
     * of its sequence, positions 0..pos[t] (layout in struct kern_kv_layer). Every table runs
     * the same algorithm (attn_ref.c): keys in runs of at most 16 inside a block, scores
     * q . k * scale, online softmax (running max, rescale on a new max, exp by the polynomial of
     * kern_attn_exp), values accumulated with the weights, and out = acc / sum at the end. The
     * result depends only on the token's own q and KV: batch invariant. Any head_dim that is
     * even and <= KERN_MAX_HEAD_DIM. (tn, gn): the call the same thread makes next (tn < 0:
     * none), whose first KV blocks a kernel may prefetch while it ends this one; cold: no
     * earlier call did that for this one. Neither changes a result. */
    void (*attn_group)(const struct kern_attn *a, int t, int g, int tn, int gn, int cold);
    /* bf16 mode's attention on AMX-BF16 tiles (the AMX table; NULL elsewhere), over a
     * KERN_KV_BF16T pool (kernels.h; block_size a multiple of 16, head_dim of 32). Tokens
     * toks[0 .. n) of the batch, all of one sequence, KV head g: each of their query heads of
     * the group (a row) attends to its own positions (kern_attn_first .. pos[t]). Queries are
     * rounded to bfloat16 (nearest even) like the pool's keys and values. Two passes per row:
     * every score q . k (summed in f32 by the tile unit), times scale (then softcap), and
     * their maximum m; then the weights exp(s - m) (exp16) rounded to bfloat16, their sum l
     * (f32: 32 positions at a time in one fixed order, then in position order), and the tile
     * unit's sums of weights times values, 16 positions at a time in position order;
     * out = sums / l. A row's result depends on nothing but its query, its positions and the
     * KV (positions that are not the row's weigh exactly 0, and a run of 16 of them adds
     * zeros to sums the tile unit wrote), so results are batch invariant. ws:
     * KERN_ATTN_TILES_BYTES bytes, 64-byte aligned. next (or NULL: the call stands alone): the
     * call this thread makes next, whose first keys it may prefetch; the tile configuration
     * stays loaded from a call with next->cold (the thread's first of a pass) to one with
     * next->n 0 (its last). No result changes. */
    void (*attn_tiles)(const struct kern_attn *a, const int32_t *toks, int n, int g, void *ws,
                       const struct kern_tiles_next *next);
    /* Token i's key and value rows k, v (D floats) of one head into its KERN_KV_BF16T tiles
     * (kt, vt: block_size B), rounded to bfloat16 (nearest even), NaN and infinities (also those
     * a finite value rounds to) as 0 (so
     * that the slots attn_tiles weighs 0 hold finite values). With attn_tiles. */
    void (*kv_store_tiles)(const float *k, const float *v, uint16_t *kt, uint16_t *vt, int B, int D,
                           int i);
    /* y[i] = x[i] * (1 / sqrt(mean(x^2) + eps)) * w[i], the sum of squares in double; y may
     * alias x. */
    void (*rmsnorm)(const float *x, const float *w, float *y, int64_t n, float eps);
    /* gate[i] = gate[i] / (1 + e^-gate[i]) * up[i] (SiLU-gated product). Scalar: libm expf;
     * SIMD: polynomial e^x, relative error < 3e-7. */
    void (*swiglu)(float *gate, const float *up, int64_t n);
    /* gate[i] = gelu_tanh(gate[i]) * up[i] (GeGLU): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
     * written g / (1 + e^-2z) with z the tanh's argument (no cancellation). Scalar: libm expf;
     * SIMD: the polynomial e^x. */
    void (*geglu)(float *gate, const float *up, int64_t n);
    /* RoPE of one token's n_head heads (x: n_head x head_dim): pairs (x[2i], x[2i+1]) of each
     * head's first rot_dim channels rotated by cs[2i] (cosine), cs[2i+1] (sine), rounded as
     * x[2i] cos - x[2i+1] sin and x[2i] sin + x[2i+1] cos (every table the same bits). */
    void (*rope)(float *x, const float *cs, int n_head, int head_dim, int rot_dim);
};

/* 8-bit KV (struct kern_kv_layer): q[i] = round(x[i] * (127 / max|x|)) (nearest even), scale
 * s = max|x| / 127 (0 for all-zero x). The reference of every table's kv_quant_q8 (a NaN is
 * skipped by the maximum and stored as 0). */
void kern_kv_quant_q8(const float *x, int n, int8_t *q, float *scale);
/* The quantizer's 127 / amax: 0 for an all-zero row, and also when it would overflow (amax
 * below 127 / FLT_MAX, ~4e-37: such a row is stored as zeros with its tiny scale). */
static inline float kern_kv_quant_inv(float amax)
{
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    return id <= 3.40282347e+38f ? id : 0.0f;
}

/* Best ISA this CPU and OS support (cpuid + xgetbv; AVX-512 needs OS-enabled ZMM state).
 * Detected once, then cached; thread-safe. */
enum kern_isa kern_cpu_detect(void);
/* The table for isa, or NULL if this CPU lacks it (or isa is out of range). Static storage. */
const struct kern_cpu_fns *kern_cpu_fns_get(enum kern_isa isa);
/* The best table, or the one named by env QUERN_ISA=scalar|avx2|avxvnni|avx512|amx when that is
 * set and supported (otherwise a warning is logged and the best is used). Never NULL. */
const struct kern_cpu_fns *kern_cpu_fns_best(void);
/* "scalar", "avx2", "avx-vnni", "avx512-vnni", "amx"; "?" when out of range. */
const char *kern_isa_name(enum kern_isa isa);

/* Single-thread microbenchmark of f's best int8 dot-product instruction loop (vpdpbusd on
 * AVX-512 VNNI, VEX vpdpbusd on AVX-VNNI, vpmaddubsw + vpmaddwd on AVX2, a scalar loop
 * otherwise) with independent
 * accumulators, run for about `seconds`: the achieved int8 operations per second, counting a
 * multiply and an add per multiply-accumulate (2 ops per MAC). Run it on every thread at once
 * for the machine's peak. */
double kern_cpu_int8_peak(const struct kern_cpu_fns *f, double seconds);
/* The same for AMX int8 tile products (tdpbusd, 16 x 16 x 64 per instruction) when the CPU has
 * AMX-INT8 and the OS grants tile state; 0 otherwise. The q8 kernels do not use it: with
 * 32-element weight blocks each product needs its own scale fold on the vector units, and in
 * our measurements an int8 tile GEMM was no faster than vpdpbusd (docs/BENCHMARKS.md).
 * Reported so the achieved fraction can be read against the whole machine. */
double kern_cpu_amx_int8_peak(double seconds);
/* The same for AMX bf16 tile products (tdpbf16ps, 16 x 16 x 32 per instruction, the bf16
 * matmul mode's instruction) where the AMX table is available; 0 otherwise. */
double kern_cpu_amx_bf16_peak(double seconds);
/* 1 when the AMX int8 loop above runs here (AMX-TILE + AMX-INT8 on an AVX-512 VNNI CPU, tile
 * state enabled by the OS and granted to this process). */
int kern_cpu_has_amx(void);

#endif
