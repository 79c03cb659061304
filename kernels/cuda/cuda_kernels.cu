/* The CUDA backend's kernels, correctness first: f32 arithmetic on weights decoded in registers
 * by the very text the CPU tests check bit for bit (kernels/cuda/cuda_dequant.h for GGUF rows,
 * kernels/cuda/cuda_pack.h for the packed layout), so no weight is ever expanded in device
 * memory. Each kernel is the plain parallel form of the CPU's scalar reference for its op; the
 * matmuls also come as a GEMV and tensor-core kernels (mma.sync) over the packed layout.
 * Launchers: kernels/cuda/cuda_launch.h. */
#ifdef KCU_EMU
#include "kernels/cuda/emu/kemu.h" /* compiled as C++ for the CPU emulator (make CUDA=emu) */
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
/* kernel<<<grid, block, 0, stream>>>, written so that the emulator can run it too */
#define KCU_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#define KCU_SHARED(a)                           ((void)0) /* for the emulator (kemu.h) */
#endif
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_dequant.h"
#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_mma.h"
#include "kernels/cuda/cuda_pack.h"

#define WARP 32
#define FULL 0xffffffffu

static __device__ __forceinline__ float warp_sum(float v)
{
    for (int o = WARP / 2; o > 0; o /= 2)
        v += __shfl_xor_sync(FULL, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v)
{
    for (int o = WARP / 2; o > 0; o /= 2)
        v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

static int launched(void)
{
    return (int)cudaGetLastError();
}

/* ---- greedy epilogue: instead of storing logit v of (token, row), the matmul kernels fold it
 * into best[token] with one 64-bit atomicMax of key = order(v) << 32 | (~row): the larger value
 * wins and, among equal values, the lower row. NaN and -inf are never folded in, so a token
 * whose every value is NaN or -inf keeps key 0 and gets id 0 (kern_ops.matmul_argmax). ---- */

static __device__ __forceinline__ void fold_best(unsigned long long *best, int t, int64_t row,
                                                 float v)
{
    if (!(v > -INFINITY)) /* NaN or -inf */
        return;
    const uint32_t b = v == 0.0f ? 0u : __float_as_uint(v); /* -0 ties with +0, as values do */
    const uint32_t ord = b & 0x80000000u ? ~b : b | 0x80000000u;
    atomicMax(best + t, (unsigned long long)ord << 32 | (uint32_t) ~(uint32_t)row);
}

__global__ void k_best_ids(const unsigned long long *best, int32_t *ids, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        ids[i] = best[i] ? (int32_t) ~(uint32_t)(best[i] & 0xFFFFFFFFu) : 0;
}

/* ---- matmul input steps: one block of 256 threads per token row ---- */

#define PREP_THREADS 256

__global__ void k_mm_prep(float *x, const float *add, const float *norm, float eps, const float *up,
                          int glu, float *xn, int n)
{
    __shared__ float part[PREP_THREADS / WARP];
    float *xr = x + (size_t)blockIdx.x * n;
    const size_t off = (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (add) {
            v = __fadd_rn(v, add[off + i]);
            xr[i] = v;
        }
        ss = fmaf(v, v, ss);
    }
    if (norm) {
        ss = warp_sum(ss);
        if (threadIdx.x % WARP == 0)
            part[threadIdx.x / WARP] = ss;
        __syncthreads();
        double tot = 0;
        for (int w = 0; w < (int)(blockDim.x / WARP); w++)
            tot += part[w];
        const float scale = (float)(1.0 / sqrt(tot / (double)n + (double)eps));
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            xn[off + i] = __fmul_rn(__fmul_rn(xr[i], scale), norm[i]);
    } else if (up) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float g = xr[i];
            /* GeGLU as g / (1 + e^-2z), z = sqrt(2/pi) (g + 0.044715 g^3), as the CPU */
            /* (explicit roundings: nvcc would fuse a multiply and add the emulator rounds twice) */
            const float z =
                glu ? __fmul_rn(-1.5957691216057308f,
                                __fadd_rn(g, __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, g), g), g)))
                    : -g;
            const float a = __fdiv_rn(g, __fadd_rn(1.0f, expf(z)));
            xr[i] = __fmul_rn(a, up[off + i]);
        }
    }
}

extern "C" int kcu_mm_prep(void *stream, float *x, const float *add, const float *norm, float eps,
                           const float *up, int glu, float *xn, int n_tok, int n)
{
    if (n_tok <= 0 || (!add && !norm && !up))
        return 0;
    KCU_LAUNCH(k_mm_prep, n_tok, PREP_THREADS, (cudaStream_t)stream)
    (x, add, norm, eps, up, glu, xn, n);
    return launched();
}

/* Rows of x normed in place: the norm step of k_mm_prep with xn = x (QK-norm, post-norm). */
extern "C" int kcu_norm_rows(void *stream, float *x, const float *w, long n_rows, int width,
                             float eps)
{
    if (n_rows <= 0)
        return 0;
    KCU_LAUNCH(k_mm_prep, (unsigned)n_rows, PREP_THREADS, (cudaStream_t)stream)
    (x, NULL, w, eps, NULL, 0, x, width);
    return launched();
}

/* ---- matmul: a warp per weight row and MM_TOK tokens; lane l takes the row's sub-blocks
 * l, l + 32, ... (32 elements each), dequantizes one into registers and multiplies it with the
 * tokens' matching 32 inputs; the lanes' partial sums are added by shuffles. ---- */

#define MM_WARPS 4
#define MM_TOK   8

__global__ void k_matmul(uint32_t type, const uint8_t *w, size_t row_bytes, int64_t ne0,
                         int64_t ne1, const float *x, float *y, int n_tok, unsigned long long *best)
{
    const int lane = threadIdx.x % WARP;
    const int64_t r = (int64_t)blockIdx.x * MM_WARPS + threadIdx.x / WARP;
    const int t0 = blockIdx.y * MM_TOK;
    if (r >= ne1)
        return;
    const int nt = n_tok - t0 < MM_TOK ? n_tok - t0 : MM_TOK;
    const uint8_t *row = w + (size_t)r * row_bytes;
    float acc[MM_TOK];
    for (int t = 0; t < MM_TOK; t++)
        acc[t] = 0.0f;
    float v[32];
    for (int64_t j = lane; j < ne0 / 32; j += WARP) {
        kcu_dequant32(type, row, j, v);
        for (int t = 0; t < MM_TOK; t++) {
            if (t >= nt)
                break;
            const float4 *xp = (const float4 *)(x + (size_t)(t0 + t) * ne0 + j * 32);
            float a = acc[t];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float4 q = xp[i];
                a = fmaf(v[4 * i], q.x, a);
                a = fmaf(v[4 * i + 1], q.y, a);
                a = fmaf(v[4 * i + 2], q.z, a);
                a = fmaf(v[4 * i + 3], q.w, a);
            }
            acc[t] = a;
        }
    }
    for (int t = 0; t < nt; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && best)
            fold_best(best, t0 + t, r, s);
        else if (lane == 0)
            y[(size_t)(t0 + t) * ne1 + r] = s;
    }
}

/* ---- matmul in the bf16 mode, on tensor cores: the CPU's bf16 semantics (activations and
 * dequantized weights rounded to bfloat16, f32 sums) with mma.sync m16n8k16 bf16 -> f32. A block
 * computes a 64-token x 64-row tile of y in 32-wide k steps: its threads dequantize the 64
 * weight rows' 32-element units (cuda_dequant.h, any type) and round the tokens' inputs into
 * shared memory, then each of the 4 warps multiplies its 16 tokens by the 64 rows as 8 n8 tiles.
 * Which lane holds what: kernels/cuda/cuda_mma.h (checked on the CPU by tests/test_cuda_mma.c
 * against an emulation of the instruction). The weight rows are B's columns as GGUF stores
 * them (k contiguous). ---- */

#define TC_BM 64          /* tokens per block */
#define TC_BN 64          /* weight rows per block */
#define TC_BK 32          /* k per step: one dequantization unit */
#define TC_LD (TC_BK + 8) /* shared row pitch in bf16: rows 80 bytes apart spread the banks */

static __device__ __forceinline__ void mma_bf16(float *c, const uint32_t *a, const uint32_t *b)
{
#ifdef KCU_EMU
    kemu_mma(c, a, b, 0);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

/* The same with IEEE halves in (attention's keys and values are stored as halves). */
static __device__ __forceinline__ void mma_f16(float *c, const uint32_t *a, const uint32_t *b)
{
#ifdef KCU_EMU
    kemu_mma(c, a, b, 1);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

/* ldmatrix.x4 (docs/CUDA_NOTES.md §2.2): r gets the lane's registers of the four 8x8 b16
 * matrices whose rows lanes 0-7, 8-15, 16-23 and 24-31 point at (p: this lane's row); TRANS:
 * each matrix transposed (.trans). */
template <int TRANS> static __device__ __forceinline__ void ldsm_x4(const uint16_t *p, uint32_t *r)
{
#ifdef KCU_EMU
    kemu_ldmatrix(p, 4, TRANS, r);
#else
#define KCU_LDSM(T)                                                                                \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4" T ".shared.b16 {%0, %1, %2, %3}, [%4];\n"         \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                  \
                 : "r"((unsigned)__cvta_generic_to_shared(p)))
    if (TRANS)
        KCU_LDSM(".trans");
    else
        KCU_LDSM("");
#undef KCU_LDSM
#endif
}

/* 16 bytes from global to shared memory without a register on the way (cp.async.cg): src
 * bytes of them from src, zeros for the rest (src 0: all zeros, src not read). Waited for by
 * cp_wait after cp_commit. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes)
{
#ifdef KCU_EMU
    kemu_cp_async(dst, src, 16, src_bytes);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     (unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
#endif
}

static __device__ __forceinline__ void cp_commit(void)
{
#ifdef KCU_EMU
    kemu_cp_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/* Until at most N of this thread's committed groups are in flight. */
template <int N> static __device__ __forceinline__ void cp_wait(void)
{
#ifdef KCU_EMU
    kemu_cp_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

static __device__ __forceinline__ uint16_t bf16_bits(float v)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__global__ void __launch_bounds__(128)
    k_matmul_bf16(uint32_t type, const uint8_t *w, size_t row_bytes, int64_t ne0, int64_t ne1,
                  const float *x, float *y, int n_tok, unsigned long long *best)
{
    __shared__ __align__(16) uint16_t as[TC_BM * TC_LD]; /* tokens x k, bf16 bits */
    __shared__ __align__(16) uint16_t bs[TC_BN * TC_LD]; /* weight rows x k, bf16 bits */
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int64_t n0 = (int64_t)blockIdx.x * TC_BN;
    const int m0 = blockIdx.y * TC_BM;
    float acc[8][4];
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 4; i++)
            acc[j][i] = 0.0f;
    float v[32];
    for (int64_t k0 = 0; k0 < ne0; k0 += TC_BK) {
        /* inputs: 64 x 32 floats, 16 per thread, rounded to bf16 (0 past the last token) */
        for (int e = tid; e < TC_BM * TC_BK; e += blockDim.x) {
            const int r = e / TC_BK, c = e % TC_BK;
            as[r * TC_LD + c] =
                bf16_bits(m0 + r < n_tok ? x[(size_t)(m0 + r) * ne0 + k0 + c] : 0.0f);
        }
        /* weights: one row's 32-element unit per thread of the first 64 (0 past the last row) */
        if (tid < TC_BN) {
            if (n0 + tid < ne1)
                kcu_dequant32(type, w + (size_t)(n0 + tid) * row_bytes, k0 / 32, v);
            else
                for (int i = 0; i < 32; i++)
                    v[i] = 0.0f;
            for (int i = 0; i < 32; i++)
                bs[tid * TC_LD + i] = bf16_bits(v[i]);
        }
        __syncthreads();
        for (int ks = 0; ks < TC_BK; ks += 16) {
            uint32_t a[4], b[2];
            kcu_frag_a(as, TC_LD, warp * 16, ks, lane, a);
            for (int j = 0; j < 8; j++) {
                kcu_frag_b(bs, TC_LD, j * 8, ks, lane, b);
                mma_bf16(acc[j], a, b);
            }
        }
        __syncthreads();
    }
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 4; i++) {
            int r, c;
            kcu_frag_c(lane, i, &r, &c);
            const int m = m0 + warp * 16 + r;
            const int64_t n = n0 + j * 8 + c;
            if (m < n_tok && n < ne1 && best)
                fold_best(best, m, n, acc[j][i]);
            else if (m < n_tok && n < ne1)
                y[(size_t)m * ne1 + n] = acc[j][i];
        }
}

/* ---- the packed layout (kernels/cuda/cuda_pack.h: Q4_0, Q4_1, Q4_K, Q8_0 repacked at load).
 * Each lane loads 16 bytes (Q8_0: 32) per (8-row tile, 128-element group): its row's 8 values of
 * each of the group's 4 units, already in mma's B fragment order, and its row's scale record. The
 * weights are decoded in registers by the very functions the CPU test checks bit for bit. ---- */

#define MV_WARPS  4 /* warps of a GEMV block: one 8-row tile, the groups split among them */
#define MV_TOK    8 /* tokens per GEMV block */
#define MV_GROUPS 4 /* consecutive groups a warp loads before it multiplies them */

/* u32 words per unit and lane (kcu_p4_words) as a constant. */
template <uint32_t TYPE> struct p4_w {
    static constexpr int W = TYPE == KCU_Q8_0 ? 2 : 1;
};

/* The 8 weights of a unit's lane words w and high bits hi with parameters a, b. */
template <uint32_t TYPE>
static __device__ __forceinline__ void p4_values(const uint32_t *w, uint32_t hi, float a, float b,
                                                 float *v)
{
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = kcu_p4_val(TYPE, kcu_p4_q(TYPE, w, hi, i), a, b, i);
}

/* A lane's load of (tile, group): the quant words of its units j = 0..3 (unit j's W words at
 * qw[j * W]), its high field (Q5_0, Q6_K) and its row's record. */
template <uint32_t TYPE>
static __device__ __forceinline__ void p4_load(const uint8_t *w, size_t hbase, size_t sbase,
                                               int64_t groups, int64_t tile, int64_t q4, int lane,
                                               uint32_t *qw, uint32_t *hw, uint32_t *rw)
{
    constexpr int W = p4_w<TYPE>::W;
    const uint4 *q =
        (const uint4 *)(w + ((size_t)(tile * groups + q4) * 32 + lane) * (KCU_P4_LANE * W));
#pragma unroll
    for (int k = 0; k < W; k++) {
        const uint4 v = q[k];
        qw[4 * k] = v.x;
        qw[4 * k + 1] = v.y;
        qw[4 * k + 2] = v.z;
        qw[4 * k + 3] = v.w;
    }
    hw[0] = hw[1] = 0u;
    if (kcu_p4_hbits(TYPE) == 1)
        hw[0] = *(const uint32_t *)(w + hbase + kcu_p4_hoff(TYPE, groups, tile * 8, q4, lane));
    if (kcu_p4_hbits(TYPE) == 2) {
        const uint2 h = *(const uint2 *)(w + hbase + kcu_p4_hoff(TYPE, groups, tile * 8, q4, lane));
        hw[0] = h.x;
        hw[1] = h.y;
    }
    const uint32_t *r =
        (const uint32_t *)(w + sbase + kcu_p4_soff(TYPE, groups, tile * 8 + lane / 4, q4));
#pragma unroll
    for (int k = 0; k < 4; k++)
        rw[k] = k < kcu_p4_rec(TYPE) / 4 ? r[k] : 0u;
}

/* GEMV for few tokens: a block per (8-row tile, MV_TOK tokens), its warps taking runs of
 * MV_GROUPS groups in turn; lane 4g + t multiplies row g's values at k = kcu_p4_k(t, i) by the
 * tokens' inputs there (float2 loads), then the 4 lanes of a row and the warps are summed. */
template <uint32_t TYPE>
__global__ void __launch_bounds__(MV_WARPS *WARP)
    k_p4_mv(const uint8_t *w, size_t sbase, int64_t ne0, int64_t ne1, const float *x, float *y,
            int n_tok, unsigned long long *best)
{
    __shared__ float part[MV_WARPS][8][MV_TOK];
    KCU_SHARED(part);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, t = lane % 4;
    const int64_t tile = blockIdx.x, groups = kcu_p4_groups(ne0), units = ne0 / 32;
    const size_t hbase = kcu_p4_qbytes(TYPE, ne0, ne1);
    const int t0 = blockIdx.y * MV_TOK;
    const int nt = n_tok - t0 < MV_TOK ? n_tok - t0 : MV_TOK;
    float acc[MV_TOK];
#pragma unroll
    for (int k = 0; k < MV_TOK; k++)
        acc[k] = 0.0f;
    for (int64_t q0 = (int64_t)warp * MV_GROUPS; q0 < groups; q0 += MV_WARPS * MV_GROUPS) {
        uint32_t qw[MV_GROUPS][4 * p4_w<TYPE>::W], hw[MV_GROUPS][2], rw[MV_GROUPS][4];
#pragma unroll
        for (int q = 0; q < MV_GROUPS; q++) /* every load first: more bytes in flight */
            if (q0 + q < groups)
                p4_load<TYPE>(w, hbase, sbase, groups, tile, q0 + q, lane, qw[q], hw[q], rw[q]);
#pragma unroll
        for (int q = 0; q < MV_GROUPS; q++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int64_t u = (q0 + q) * 4 + j;
                if (u >= units)
                    break;
                float a, b, v[8];
                kcu_p4_par(TYPE, rw[q], j, &a, &b);
                p4_values<TYPE>(qw[q] + j * p4_w<TYPE>::W, kcu_p4_hi(TYPE, hw[q], j), a, b, v);
#pragma unroll
                for (int k = 0; k < MV_TOK; k++) {
                    if (k >= nt)
                        break;
                    const float *xp = x + (size_t)(t0 + k) * ne0 + u * 32 + 2 * t;
                    float s = acc[k];
#pragma unroll
                    for (int h = 0; h < 4; h++) { /* k 2t + 8h, 2t + 8h + 1: nibbles 2h, 2h + 1 */
                        const float2 xv = *(const float2 *)(xp + 8 * h);
                        s = fmaf(v[2 * h], xv.x, s);
                        s = fmaf(v[2 * h + 1], xv.y, s);
                    }
                    acc[k] = s;
                }
            }
    }
#pragma unroll
    for (int k = 0; k < MV_TOK; k++) {
        acc[k] += __shfl_xor_sync(FULL, acc[k], 1);
        acc[k] += __shfl_xor_sync(FULL, acc[k], 2);
        if (t == 0)
            part[warp][lane / 4][k] = acc[k];
    }
    __syncthreads();
    if (threadIdx.x < 8 * MV_TOK) {
        const int g = threadIdx.x / MV_TOK, k = threadIdx.x % MV_TOK;
        const int64_t r = tile * 8 + g;
        float s = part[0][g][k];
        for (int i = 1; i < MV_WARPS; i++)
            s += part[i][g][k];
        if (k < nt && r < ne1 && best)
            fold_best(best, t0 + k, r, s);
        else if (k < nt && r < ne1)
            y[(size_t)(t0 + k) * ne1 + r] = s;
    }
}

/* Tensor-core GEMMs (bf16 mode) over the packed layout. The inputs come already rounded to
 * bf16 (xb, made once per matmul by k_to_bf16, so each block reads half the bytes of f32 and never
 * converts) and are copied in 16-byte chunks to shared memory (A fragments as k_matmul_bf16);
 * each warp decodes its 2 tiles' values straight into B fragments: unit j's values 0..3 are the
 * fragment of k 32j..32j+15, values 4..7 of the next 16. Software pipelined: the next group's A
 * chunks and B words are loaded into registers while the current group is multiplied.
 *
 * K is cut into slices fixed by the shape alone (kcu_p4_slices: gps consecutive groups each):
 * each slice's chain of MMAs starts from zero and the slices' sums are added in slice order.
 * k_p4_mma16 (up to 16 tokens) runs a block's slices side by side, one warp per (slice, 16
 * rows), so a one-token matmul has enough blocks to stream the weights from every SM;
 * k_p4_mma (64-token blocks) runs them one after the other. Both add the same numbers in the
 * same order, so a token's result does not depend on its batch. */
#ifdef KCU_EMU
#define KCU_OPAQUE64(v) ((void)0)
#define KCU_OPAQUE32(v) ((void)0)
#else /* a value the compiler cannot see through (nor move computations on it across) */
#define KCU_OPAQUE64(v) asm volatile("" : "+l"(v))
#define KCU_OPAQUE32(v) asm volatile("" : "+r"(v))
#endif
#define PM_WARPS  8
#define PM_BN         (PM_WARPS * 16) /* rows per 64-token block: 2 tiles per warp */
#define PM_BK     128
#define PM_LD     (PM_BK + 8) /* shared row pitch in bf16: 272 bytes, 16-byte aligned */
#define PM_CHUNKS(BM) ((BM)*PM_BK / 8 / (PM_WARPS * WARP)) /* 16-byte A chunks per thread */

/* A warp's B words and records of its 2 tiles at group q4 (zero past the last tile). */
template <uint32_t TYPE>
static __device__ __forceinline__ void
p4_load2(const uint8_t *w, size_t hbase, size_t sbase, int64_t groups, int64_t tiles, int64_t tile0,
         int64_t q4, int lane, uint32_t (*qw)[4 * p4_w<TYPE>::W], uint32_t (*hw)[2],
         uint32_t (*rw)[4])
{
#pragma unroll
    for (int n = 0; n < 2; n++)
        if (tile0 + n < tiles)
            p4_load<TYPE>(w, hbase, sbase, groups, tile0 + n, q4, lane, qw[n], hw[n], rw[n]);
        else {
#pragma unroll
            for (int k = 0; k < 4 * p4_w<TYPE>::W; k++)
                qw[n][k] = 0u;
#pragma unroll
            for (int k = 0; k < 4; k++)
                rw[n][k] = 0u;
            hw[n][0] = hw[n][1] = 0u;
        }
}

/* A warp's loaded words of its 2 tiles (p4_load2's quant, high and record words) copied from s
 * to d: the kernels' software pipelines hand a group's words down a stage. */
template <uint32_t TYPE>
static __device__ __forceinline__ void
p4_move2(uint32_t (*dq)[4 * p4_w<TYPE>::W], uint32_t (*dh)[2], uint32_t (*dr)[4],
         const uint32_t (*sq)[4 * p4_w<TYPE>::W], const uint32_t (*sh)[2], const uint32_t (*sr)[4])
{
#pragma unroll
    for (int n = 0; n < 2; n++) {
#pragma unroll
        for (int k = 0; k < 4 * p4_w<TYPE>::W; k++)
            dq[n][k] = sq[n][k];
#pragma unroll
        for (int k = 0; k < 4; k++)
            dr[n][k] = sr[n][k];
        dh[n][0] = sh[n][0];
        dh[n][1] = sh[n][1];
    }
}

/* The B fragments (k 32j..32j+31 of its 2 tiles) of unit j from a warp's loaded words. */
template <uint32_t TYPE>
static __device__ __forceinline__ void p4_bfrag(const uint32_t (*cq)[4 * p4_w<TYPE>::W],
                                                const uint32_t (*ch)[2], const uint32_t (*cr)[4],
                                                int j, uint32_t (*bf)[4])
{
#pragma unroll
    for (int n = 0; n < 2; n++) {
        float a, b, v[8];
        kcu_p4_par(TYPE, cr[n], j, &a, &b);
        p4_values<TYPE>(cq[n] + j * p4_w<TYPE>::W, kcu_p4_hi(TYPE, ch[n], j), a, b, v);
#pragma unroll
        for (int i = 0; i < 4; i++)
            bf[n][i] = (uint32_t)bf16_bits(v[2 * i]) | (uint32_t)bf16_bits(v[2 * i + 1]) << 16;
    }
}

/* One group's MMAs: BM / 16 token rows of A in shared memory (pitch PM_LD) by a warp's 2 tiles. */
template <uint32_t TYPE, int BM>
static __device__ __forceinline__ void
p4_group_mma(const uint16_t *as, const uint32_t (*cq)[4 * p4_w<TYPE>::W], const uint32_t (*ch)[2],
             const uint32_t (*cr)[4], int lane, float (*acc)[2][4])
{
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t bf[2][4];
        p4_bfrag<TYPE>(cq, ch, cr, j, bf);
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int m = 0; m < BM / 16; m++) {
                uint32_t af[4];
                ldsm_x4<0>(kcu_ldsm_a(as, PM_LD, m * 16, j * 32 + h * 16, lane), af);
#pragma unroll
                for (int n = 0; n < 2; n++)
                    mma_bf16(acc[m][n], af, bf[n] + 2 * h);
            }
    }
}

/* Up to 16 tokens: a block of 8 warps, ks (1, 2, 4 or 8) K slices side by side, warp w taking
 * slice w % ks of 2 tiles (16 rows; 128 / ks rows a block). The warps never wait for each other
 * until the end: each reads its A fragments straight from xb (a few KB, in L1 after a block's
 * first warp) and keeps the B words of its next two groups in flight while it multiplies one.
 * Then the warps of slices 1.. hand their sums to slice 0's through shared memory, which adds
 * them in slice order. */
template <uint32_t TYPE>
__global__ void __launch_bounds__(PM_WARPS *WARP, 2)
    k_p4_mma16(const uint8_t *w, size_t sbase, int64_t ne0, int64_t ne1, const uint16_t *xb,
               float *y, int n_tok, unsigned long long *best, int ks, int64_t gps)
{
    constexpr int W = p4_w<TYPE>::W;
    __shared__ float sums[PM_WARPS * WARP * 8];
    KCU_SHARED(sums);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4;
    const int sl = warp % ks;
    const int64_t groups = kcu_p4_groups(ne0), tiles = kcu_p4_tiles(ne1);
    const int64_t nsl = (groups + gps - 1) / gps; /* slices with groups */
    const int64_t q0 = sl * gps, q1 = q0 + gps < groups ? q0 + gps : groups; /* this slice's */
    const size_t hbase = kcu_p4_qbytes(TYPE, ne0, ne1);
    const int64_t tile0 = (int64_t)blockIdx.x * (PM_WARPS / ks) * 2 + (warp / ks) * 2;
    const int m0 = blockIdx.y * 16;
    /* the lane's A rows (tokens m0 + g, m0 + g + 8), NULL past the batch: zeros */
    const uint16_t *x0 = m0 + g < n_tok ? xb + (size_t)(m0 + g) * ne0 : NULL;
    const uint16_t *x1 = m0 + g + 8 < n_tok ? xb + (size_t)(m0 + g + 8) * ne0 : NULL;
    float acc[1][2][4];
#pragma unroll
    for (int n = 0; n < 2; n++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            acc[0][n][i] = 0.0f;
    /* B words of groups q (a), q + 1 (b) and q + 2 (c) */
    uint32_t qa[2][4 * W], ha[2][2], ra[2][4], qb[2][4 * W] = {}, hb[2][2] = {}, rb[2][4] = {};
    uint32_t qc[2][4 * W] = {}, hc[2][2] = {}, rc[2][4] = {};
    if (q0 < q1)
        p4_load2<TYPE>(w, hbase, sbase, groups, tiles, tile0, q0, lane, qa, ha, ra);
    if (q0 + 1 < q1)
        p4_load2<TYPE>(w, hbase, sbase, groups, tiles, tile0, q0 + 1, lane, qb, hb, rb);
    for (int64_t q = q0; q < q1; q++) {
        if (q + 2 < q1) /* in flight while q is multiplied */
            p4_load2<TYPE>(w, hbase, sbase, groups, tiles, tile0, q + 2, lane, qc, hc, rc);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint32_t bf[2][4];
            p4_bfrag<TYPE>(qa, ha, ra, j, bf);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t af[4];
                kcu_frag_a_rows(x0, x1, ne0, q * PM_BK + j * 32 + h * 16, lane, af);
#pragma unroll
                for (int n = 0; n < 2; n++)
                    mma_bf16(acc[0][n], af, bf[n] + 2 * h);
            }
        }
        p4_move2<TYPE>(qa, ha, ra, qb, hb, rb);
        p4_move2<TYPE>(qb, hb, rb, qc, hc, rc);
    }
    if (sl > 0 && sl < nsl)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                sums[(warp * WARP + lane) * 8 + n * 4 + i] = acc[0][n][i];
    __syncthreads();
    if (sl != 0)
        return;
#pragma unroll
    for (int n = 0; n < 2; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float v = acc[0][n][i];
            for (int s = 1; s < nsl; s++)
                v += sums[((warp + s) * WARP + lane) * 8 + n * 4 + i];
            int r, c;
            kcu_frag_c(lane, i, &r, &c);
            const int tok = m0 + r;
            const int64_t row = (tile0 + n) * 8 + c;
            if (tok < n_tok && row < ne1 && best)
                fold_best(best, tok, row, v);
            else if (tok < n_tok && row < ne1)
                y[(size_t)tok * ne1 + row] = v;
        }
}

/* 64-token blocks: 8 warps, 2 tiles each (128 rows a block), the K slices one after the other:
 * at each slice's end a thread adds its sums to its outputs in y (the first slice stores them).
 * best (the greedy fold) only with one slice: p4_launch sends other greedy batches to
 * k_p4_mma16, whose sums are the same. A's groups come through shared memory in two stages:
 * cp.async brings group q + 1 into one while the warps multiply group q out of the other (A
 * fragments by ldmatrix), and each warp keeps its B words of group q + 1 in flight in
 * registers meanwhile: one barrier a group. */
template <uint32_t TYPE>
__global__ void __launch_bounds__(PM_WARPS *WARP, 2)
    k_p4_mma(const uint8_t *w, size_t sbase, int64_t ne0, int64_t ne1, const uint16_t *xb, float *y,
             int n_tok, unsigned long long *best, int64_t gps)
{
    constexpr int W = p4_w<TYPE>::W, BM = 64;
    __shared__ __align__(16) uint16_t as[2][BM * PM_LD]; /* group q's A in stage q % 2 */
    KCU_SHARED(as);
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int64_t groups = kcu_p4_groups(ne0), tiles = kcu_p4_tiles(ne1);
    const size_t hbase = kcu_p4_qbytes(TYPE, ne0, ne1);
    const int64_t tile0 = (int64_t)blockIdx.x * (PM_BN / 8) + warp * 2;
    const int m0 = blockIdx.y * BM;
    float acc[BM / 16][2][4];
#pragma unroll
    for (int m = 0; m < BM / 16; m++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[m][n][i] = 0.0f;
    /* group q4's A into its stage: chunk e = tid + 256 i is row e / 16, k 8 (e % 16) of the
     * group; zeros past the batch and past K */
    auto load_a = [&](int64_t q4) {
        uint16_t *st = as[q4 & 1];
#pragma unroll
        for (int i = 0; i < PM_CHUNKS(BM); i++) {
            const int e = tid + i * PM_WARPS * WARP, r = e / (PM_BK / 8);
            const int64_t k = q4 * PM_BK + (e % (PM_BK / 8)) * 8;
            const bool in = m0 + r < n_tok && k < ne0;
            cp_async16(st + r * PM_LD + (e % (PM_BK / 8)) * 8,
                       in ? xb + (size_t)(m0 + r) * ne0 + k : xb, in ? 16 : 0);
        }
        cp_commit();
    };
    uint32_t qw[2][4 * W], hw[2][2], rw[2][4]; /* this warp's B words and records, next group */
    load_a(0);
    p4_load2<TYPE>(w, hbase, sbase, groups, tiles, tile0, 0, lane, qw, hw, rw);
    for (int64_t s0 = 0; s0 < groups; s0 += gps) { /* slice [s0, s1) */
        const int64_t s1 = s0 + gps < groups ? s0 + gps : groups;
        for (int64_t q4 = s0; q4 < s1; q4++) {
            cp_wait<0>();
            __syncthreads(); /* group q4's A is in for every warp, and every warp is done with
                                group q4 - 1's stage, which group q4 + 1 now takes */
            if (q4 + 1 < groups)
                load_a(q4 + 1);
            uint32_t cq[2][4 * W], ch[2][2], cr[2][4];
            p4_move2<TYPE>(cq, ch, cr, qw, hw, rw);
            if (q4 + 1 < groups) /* in flight while this group is multiplied */
                p4_load2<TYPE>(w, hbase, sbase, groups, tiles, tile0, q4 + 1, lane, qw, hw, rw);
            p4_group_mma<TYPE, BM>(as[q4 & 1], cq, ch, cr, lane, acc);
        }
        int64_t rb = tile0 * 8; /* made opaque, so that the 32 outputs' addresses are not
                                   computed before the loop and kept in registers */
        int tb = m0;
        KCU_OPAQUE64(rb);
        KCU_OPAQUE32(tb);
#pragma unroll
        for (int m = 0; m < BM / 16; m++)
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int r, c;
                    kcu_frag_c(lane, i, &r, &c);
                    const int tok = tb + m * 16 + r;
                    const int64_t row = rb + n * 8 + c;
                    if (tok < n_tok && row < ne1 && best)
                        fold_best(best, tok, row, acc[m][n][i]);
                    else if (tok < n_tok && row < ne1) {
                        float *o = y + (size_t)tok * ne1 + row;
                        *o = s0 == 0 ? acc[m][n][i] : *o + acc[m][n][i];
                    }
                    acc[m][n][i] = 0.0f;
                }
    }
}

/* Inputs rounded to bf16 for the tensor-core kernel, once per matmul call. */
__global__ void k_to_bf16(const float *x, uint16_t *out, size_t n)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        out[i] = bf16_bits(x[i]);
}

extern "C" int kcu_to_bf16(void *stream, const float *x, uint16_t *out, size_t n)
{
    if (n == 0)
        return 0;
    KCU_LAUNCH(k_to_bf16, (unsigned)((n + 255) / 256), 256, (cudaStream_t)stream)(x, out, n);
    return launched();
}

/* ---- the q8 mode: activations quantized to 8 bits per block of 32 once per matmul, bitwise as
 * the CPU's kern_ref_quantize_q8, times the packed weights' integer values on int8 tensor cores
 * (mma.sync m16n8k32, int32 sums); each unit's sums are scaled in f32 as the CPU's q8 dot
 * products scale them. ---- */

static __device__ __forceinline__ void mma_s8(int32_t *c, const uint32_t *a, const uint32_t *b)
{
#ifdef KCU_EMU
    kemu_mma_s8(c, a, b);
#else
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

/* Token rows of x (n_tok x ne0, ne0 a multiple of 32) per block of 32 (block b = token b / units,
 * unit b % units): xq[32 b + kcu_q8_pos(k)] = q of element k, xs[b] = (d, d * sum(q)), with
 * kern_ref_quantize_q8's arithmetic. A warp a block, lane k its element k. */
__global__ void k_quant_q8(const float *x, int64_t n_blocks, int8_t *xq, float2 *xs)
{
    const int lane = threadIdx.x % WARP;
    const int64_t b = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (b >= n_blocks) /* the whole warp */
        return;
    const float v = x[b * 32 + lane];
    float d = warp_max(fabsf(v)) / 127.0f; /* fmaxf, like the reference, never picks a NaN */
    if (!(d >= FLT_MIN))
        d = 0.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    float r = v * id;
    if (!(r >= -127.0f))
        r = r != r ? 0.0f : -127.0f;
    if (r > 127.0f)
        r = 127.0f;
    const int q = (int)roundf(r);
    xq[b * 32 + kcu_q8_pos(lane)] = (int8_t)q;
    int sum = q;
    for (int o = WARP / 2; o > 0; o /= 2)
        sum += __shfl_xor_sync(FULL, sum, o);
    if (lane == 0)
        xs[b] = make_float2(d, d * (float)sum);
}

extern "C" int kcu_quant_q8(void *stream, const float *x, int64_t n, int8_t *xq, float *xs)
{
    const int64_t blocks = n / 32;
    if (blocks == 0)
        return 0;
    KCU_LAUNCH(k_quant_q8, (unsigned)((blocks + 7) / 8), 8 * WARP, (cudaStream_t)stream)
    (x, blocks, xq, (float2 *)xs);
    return launched();
}

#define Q8_NT 8 /* n8 token tiles a warp: 64 tokens a block */

/* The q8 GEMM over the packed layout, weights as mma's A: a warp's 2 tiles are its 16 rows (lane
 * (g, t) holds row g of each, its unit values at k = kcu_p4_k(t, i) as bytes: registers 0, 1 values
 * 0..3 of tiles 0, 1; registers 2, 3 values 4..7), tokens as B (up to Q8_NT n8 tiles; the bytes
 * of lane (g, t) are one aligned word of token g's quantized row, by kcu_q8_pos's order), C as
 * (row, token). Per unit one mma (Q6_K two: one per half, each with its scale), then in f32:
 * acc += (a d_x) sum + b s_x (Q4_1's m; -b for Q4_K's dmin m) with the unit's parameters
 * (kcu_p4_par). K is cut into the shape's slices side by side as in k_p4_mma16 (warp w: slice
 * w % ks of 2 tiles), slice 0's warps adding the others' sums in slice order: every output is the
 * same sum in the same order whatever the batch. */
template <uint32_t TYPE>
__global__ void __launch_bounds__(PM_WARPS *WARP, 2)
    k_p4_q8(const uint8_t *w, size_t sbase, int64_t ne0, int64_t ne1, const int8_t *xq,
            const float2 *xs, float *y, int n_tok, unsigned long long *best, int ks, int64_t gps)
{
    constexpr int W = p4_w<TYPE>::W;
    __shared__ float sums[PM_WARPS * WARP * 4 * Q8_NT];
    KCU_SHARED(sums);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4;
    const int sl = warp % ks;
    const int64_t groups = kcu_p4_groups(ne0), tiles = kcu_p4_tiles(ne1), units = ne0 / 32;
    const int64_t nsl = (groups + gps - 1) / gps; /* slices with groups */
    const int64_t q0 = sl * gps, q1 = q0 + gps < groups ? q0 + gps : groups; /* this slice's */
    const size_t hbase = kcu_p4_qbytes(TYPE, ne0, ne1);
    const int64_t tile0 = (int64_t)blockIdx.x * (PM_WARPS / ks) * 2 + (warp / ks) * 2;
    const int m0 = blockIdx.y * 8 * Q8_NT;
    const int nt_n = (n_tok - m0 + 7) / 8 < Q8_NT ? (n_tok - m0 + 7) / 8 : Q8_NT; /* tiles used */
    float acc[Q8_NT][4];
#pragma unroll
    for (int nt = 0; nt < Q8_NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            acc[nt][i] = 0.0f;
    /* B words of groups q (a) and q + 1 (b) */
    uint32_t qa[2][4 * W], ha[2][2], ra[2][4], qb[2][4 * W] = {}, hb[2][2] = {}, rb[2][4] = {};
    if (q0 < q1)
        p4_load2<TYPE>(w, hbase, sbase, groups, tiles, tile0, q0, lane, qa, ha, ra);
    for (int64_t q = q0; q < q1; q++) {
        if (q + 1 < q1) /* in flight while q is multiplied */
            p4_load2<TYPE>(w, hbase, sbase, groups, tiles, tile0, q + 1, lane, qb, hb, rb);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int64_t u = q * 4 + j;
            if (u >= units)
                break;
            uint32_t af[4];
            float pa[2], pb[2];
#pragma unroll
            for (int n = 0; n < 2; n++) {
                kcu_p4_par(TYPE, ra[n], j, &pa[n], &pb[n]);
                const uint32_t hi = kcu_p4_hi(TYPE, ha[n], j);
                uint32_t lo4 = 0u, hi4 = 0u;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    lo4 |= (uint32_t)(uint8_t)kcu_p4_int(TYPE, kcu_p4_q(TYPE, qa[n] + j * W, hi, e))
                           << (8 * e);
                    hi4 |= (uint32_t)(uint8_t)kcu_p4_int(TYPE,
                                                         kcu_p4_q(TYPE, qa[n] + j * W, hi, 4 + e))
                           << (8 * e);
                }
                af[n] = lo4;
                af[2 + n] = hi4;
            }
#pragma unroll
            for (int nt = 0; nt < Q8_NT; nt++) {
                if (nt >= nt_n)
                    break;
                const int tb = m0 + nt * 8 + g; /* B's column: this lane's token */
                uint32_t bf[2] = {0u, 0u};
                if (tb < n_tok) {
                    const uint32_t *xw = (const uint32_t *)(xq + (size_t)tb * ne0 + u * 32);
                    bf[0] = xw[t];
                    bf[1] = xw[4 + t];
                }
                float2 sx[2]; /* C's tokens: 2t, 2t + 1 of the tile */
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int tc = m0 + nt * 8 + 2 * t + e;
                    sx[e] = tc < n_tok ? xs[(size_t)tc * units + u] : make_float2(0.0f, 0.0f);
                }
                if (TYPE == KCU_Q6_K) { /* values 0..3 (the unit's first 16) scale by a, 4..7 b */
                    const uint32_t al[4] = {af[0], af[1], 0u, 0u}, ah[4] = {0u, 0u, af[2], af[3]};
                    int32_t cl[4] = {0, 0, 0, 0}, ch[4] = {0, 0, 0, 0};
                    mma_s8(cl, al, bf);
                    mma_s8(ch, ah, bf);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float dx = sx[i % 2].x;
                        acc[nt][i] = fmaf(pa[i / 2] * dx, (float)cl[i], acc[nt][i]);
                        acc[nt][i] = fmaf(pb[i / 2] * dx, (float)ch[i], acc[nt][i]);
                    }
                } else {
                    int32_t c[4] = {0, 0, 0, 0};
                    mma_s8(c, af, bf);
#pragma unroll
                    for (int i = 0; i < 4; i++) { /* row g of tile i / 2, token 2t + i % 2 */
                        acc[nt][i] = fmaf(pa[i / 2] * sx[i % 2].x, (float)c[i], acc[nt][i]);
                        if (TYPE == KCU_Q4_1)
                            acc[nt][i] = fmaf(pb[i / 2], sx[i % 2].y, acc[nt][i]);
                        if (TYPE == KCU_Q4_K)
                            acc[nt][i] = fmaf(-pb[i / 2], sx[i % 2].y, acc[nt][i]);
                    }
                }
            }
        }
        p4_move2<TYPE>(qa, ha, ra, qb, hb, rb);
    }
    if (sl > 0 && sl < nsl)
#pragma unroll
        for (int nt = 0; nt < Q8_NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                sums[((warp * WARP + lane) * Q8_NT + nt) * 4 + i] = acc[nt][i];
    __syncthreads();
    if (sl != 0)
        return;
#pragma unroll
    for (int nt = 0; nt < Q8_NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float v = acc[nt][i];
            for (int s = 1; s < nsl; s++)
                v += sums[(((warp + s) * WARP + lane) * Q8_NT + nt) * 4 + i];
            const int tok = m0 + nt * 8 + 2 * t + i % 2;
            const int64_t row = (tile0 + i / 2) * 8 + g;
            if (tok < n_tok && row < ne1 && best)
                fold_best(best, tok, row, v);
            else if (tok < n_tok && row < ne1)
                y[(size_t)tok * ne1 + row] = v;
        }
}

/* The packed layout: in the bf16 mode always a tensor-core kernel (k_p4_mma16 up to mm->small
 * tokens, k_p4_mma above, both over the shape's K slices: the same sums in the same order for
 * every output, so a token's result does not depend on its batch); in the exact mode the GEMV
 * (one kernel at every count). */
template <uint32_t TYPE>
static int p4_launch(cudaStream_t st, const struct kcu_mm *mm, const float *x, float *y, int n_tok,
                     unsigned long long *best)
{
    const struct kcu_weight *wt = &mm->w;
    const uint8_t *w = (const uint8_t *)wt->w;
    const unsigned tiles = (unsigned)kcu_p4_tiles(wt->ne1);
    if (mm->q8) {
        if (!mm->xq)
            return (int)cudaErrorInvalidValue; /* the caller owes the quantized inputs */
        int64_t gps;
        const int ks = kcu_p4_slices(wt->ne0, wt->ne1, &gps);
        const unsigned per = (unsigned)(PM_WARPS / ks) * 2; /* tiles a block */
        KCU_LAUNCH(k_p4_q8<TYPE>,
                   dim3((tiles + per - 1) / per, (unsigned)((n_tok + 8 * Q8_NT - 1) / (8 * Q8_NT))),
                   PM_WARPS * WARP, st)
        (w, wt->p4_scales, wt->ne0, wt->ne1, mm->xq, (const float2 *)mm->xs, y, n_tok, best, ks,
         gps);
        return 0;
    }
    if (mm->bf16) {
        if (!mm->xb)
            return (int)cudaErrorInvalidValue; /* the caller owes the bf16 inputs */
        int64_t gps;
        const int ks = kcu_p4_slices(wt->ne0, wt->ne1, &gps);
        if (n_tok > mm->small && (gps >= kcu_p4_groups(wt->ne0) || !best)) {
            KCU_LAUNCH(k_p4_mma<TYPE>,
                       dim3((tiles + PM_BN / 8 - 1) / (PM_BN / 8), (unsigned)((n_tok + 63) / 64)),
                       PM_WARPS * WARP, st)
            (w, wt->p4_scales, wt->ne0, wt->ne1, mm->xb, y, n_tok, best, gps);
            return 0;
        }
        const unsigned per = (unsigned)(PM_WARPS / ks) * 2; /* tiles a block */
        KCU_LAUNCH(k_p4_mma16<TYPE>, dim3((tiles + per - 1) / per, (unsigned)((n_tok + 15) / 16)),
                   PM_WARPS * WARP, st)
        (w, wt->p4_scales, wt->ne0, wt->ne1, mm->xb, y, n_tok, best, ks, gps);
        return 0;
    }
    KCU_LAUNCH(k_p4_mv<TYPE>, dim3(tiles, (unsigned)((n_tok + MV_TOK - 1) / MV_TOK)),
               MV_WARPS * WARP, st)
    (w, wt->p4_scales, wt->ne0, wt->ne1, x, y, n_tok, best);
    return 0;
}

/* One matmul (y) or its greedy fold (best) on the kernel its weight's layout and mode take. */
static int mm_launch(cudaStream_t st, const struct kcu_mm *mm, const float *x, float *y, int n_tok,
                     unsigned long long *best)
{
    const struct kcu_weight *w = &mm->w;
    if (w->p4_scales) {
        switch (w->type) {
        case KCU_Q4_0:
            return p4_launch<KCU_Q4_0>(st, mm, x, y, n_tok, best);
        case KCU_Q4_1:
            return p4_launch<KCU_Q4_1>(st, mm, x, y, n_tok, best);
        case KCU_Q8_0:
            return p4_launch<KCU_Q8_0>(st, mm, x, y, n_tok, best);
        case KCU_Q5_0:
            return p4_launch<KCU_Q5_0>(st, mm, x, y, n_tok, best);
        case KCU_Q6_K:
            return p4_launch<KCU_Q6_K>(st, mm, x, y, n_tok, best);
        default:
            return p4_launch<KCU_Q4_K>(st, mm, x, y, n_tok, best);
        }
    } else if (mm->bf16) {
        const dim3 grid((unsigned)((w->ne1 + TC_BN - 1) / TC_BN),
                        (unsigned)((n_tok + TC_BM - 1) / TC_BM));
        KCU_LAUNCH(k_matmul_bf16, grid, 128, st)
        (w->type, (const uint8_t *)w->w, w->row_bytes, w->ne0, w->ne1, x, y, n_tok, best);
    } else {
        const dim3 grid((unsigned)((w->ne1 + MM_WARPS - 1) / MM_WARPS),
                        (unsigned)((n_tok + MM_TOK - 1) / MM_TOK));
        KCU_LAUNCH(k_matmul, grid, MM_WARPS * WARP, st)
        (w->type, (const uint8_t *)w->w, w->row_bytes, w->ne0, w->ne1, x, y, n_tok, best);
    }
    return 0;
}

extern "C" int kcu_matmul(void *stream, const struct kcu_mm *mm, const float *x, float *y,
                          int n_tok)
{
    if (n_tok <= 0 || mm->w.ne1 <= 0)
        return 0;
    const int rc = mm_launch((cudaStream_t)stream, mm, x, y, n_tok, NULL);
    return rc ? rc : launched();
}

extern "C" int kcu_matmul_argmax(void *stream, const struct kcu_mm *mm, const float *x, int n_tok,
                                 unsigned long long *best, int32_t *ids)
{
    if (n_tok <= 0)
        return 0;
    cudaStream_t st = (cudaStream_t)stream;
    int rc = (int)cudaMemsetAsync(best, 0, sizeof(*best) * (size_t)n_tok, st);
    if (rc)
        return rc;
    if (mm->w.ne1 > 0 && (rc = mm_launch(st, mm, x, NULL, n_tok, best)))
        return rc;
    if ((rc = launched()))
        return rc;
    KCU_LAUNCH(k_best_ids, (unsigned)((n_tok + 127) / 128), 128, st)(best, ids, n_tok);
    return launched();
}

/* ---- get_rows: a block per requested row, a thread per sub-block ---- */

__global__ void k_get_rows(uint32_t type, const uint8_t *w, size_t row_bytes, int64_t ne0,
                           const int32_t *ids, float *out)
{
    const uint8_t *row = w + (size_t)ids[blockIdx.x] * row_bytes;
    float *o = out + (size_t)blockIdx.x * ne0;
    float v[32];
    for (int64_t j = threadIdx.x; j < ne0 / 32; j += blockDim.x) {
        kcu_dequant32(type, row, j, v);
        for (int i = 0; i < 32; i++)
            o[j * 32 + i] = v[i];
    }
}

/* get_rows of a packed weight: a thread per unit, through the text the CPU test checks. */
__global__ void k_p4_get_rows(uint32_t type, const uint8_t *w, size_t hbase, size_t sbase,
                              int64_t ne0, const int32_t *ids, float *out)
{
    float *o = out + (size_t)blockIdx.x * ne0;
    for (int64_t u = threadIdx.x; u < ne0 / 32; u += blockDim.x)
        kcu_p4_unit(type, w, hbase, sbase, ne0, ids[blockIdx.x], u, o + u * 32);
}

extern "C" int kcu_get_rows(void *stream, const struct kcu_weight *w, const int32_t *ids, int n,
                            float *out)
{
    if (n <= 0)
        return 0;
    if (w->p4_scales) {
        KCU_LAUNCH(k_p4_get_rows, n, 128, (cudaStream_t)stream)
        (w->type, (const uint8_t *)w->w, kcu_p4_qbytes(w->type, w->ne0, w->ne1), w->p4_scales,
         w->ne0, ids, out);
    } else {
        KCU_LAUNCH(k_get_rows, n, 128, (cudaStream_t)stream)
        (w->type, (const uint8_t *)w->w, w->row_bytes, w->ne0, ids, out);
    }
    return launched();
}

/* ---- element-wise ---- */

__global__ void k_rope(float *x, const float *cs, int n_tok, int n_head, int head_dim, int rot_dim,
                       int neox)
{
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x; /* one pair */
    const int half = rot_dim / 2;
    if (i >= (long)n_tok * n_head * half)
        return;
    const int p = (int)(i % half);
    const long th = i / half; /* token * n_head + head */
    const int t = (int)(th / n_head);
    float *v0 = x + th * head_dim + (neox ? p : 2 * p), *v1 = v0 + (neox ? half : 1);
    const float a = *v0, b = *v1, co = cs[(size_t)t * rot_dim + 2 * p],
                sn = cs[(size_t)t * rot_dim + 2 * p + 1];
    *v0 = __fsub_rn(__fmul_rn(a, co), __fmul_rn(b, sn));
    *v1 = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, co));
}

extern "C" int kcu_rope(void *stream, float *x, const float *cs, int n_tok, int n_head,
                        int head_dim, int rot_dim, int neox)
{
    const long n = (long)n_tok * n_head * (rot_dim / 2);
    if (n <= 0)
        return 0;
    KCU_LAUNCH(k_rope, (unsigned)((n + 255) / 256), 256, (cudaStream_t)stream)
    (x, cs, n_tok, n_head, head_dim, rot_dim, neox);
    return launched();
}

__global__ void k_add_rows(float *y, const float *bias, long n, int width)
{
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = __fadd_rn(y[i], bias[i % width]);
}

extern "C" int kcu_add_rows(void *stream, float *y, const float *bias, long n_rows, int width)
{
    const long n = n_rows * width;
    if (n <= 0)
        return 0;
    KCU_LAUNCH(k_add_rows, (unsigned)((n + 255) / 256), 256, (cudaStream_t)stream)
    (y, bias, n, width);
    return launched();
}

__global__ void k_scale(float *x, float s, long n)
{
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = __fmul_rn(x[i], s);
}

extern "C" int kcu_scale(void *stream, float *x, float s, long n)
{
    if (n <= 0)
        return 0;
    KCU_LAUNCH(k_scale, (unsigned)((n + 255) / 256), 256, (cudaStream_t)stream)(x, s, n);
    return launched();
}

__global__ void k_add(float *y, const float *x, long n)
{
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = __fadd_rn(y[i], x[i]);
}

extern "C" int kcu_add(void *stream, float *y, const float *x, long n)
{
    if (n <= 0)
        return 0;
    KCU_LAUNCH(k_add, (unsigned)((n + 255) / 256), 256, (cudaStream_t)stream)(y, x, n);
    return launched();
}

__global__ void k_gather(float *dst, const float *src, const int32_t *idx, long width)
{
    const float *s = src + (size_t)idx[blockIdx.x] * width;
    float *d = dst + (size_t)blockIdx.x * width;
    for (long i = threadIdx.x; i < width; i += blockDim.x)
        d[i] = s[i];
}

extern "C" int kcu_gather(void *stream, float *dst, const float *src, const int32_t *idx, int n,
                          long width)
{
    if (n <= 0 || width <= 0)
        return 0;
    KCU_LAUNCH(k_gather, n, 256, (cudaStream_t)stream)(dst, src, idx, width);
    return launched();
}

/* A thread per column: every row in order (kern_ops.moe_add). */
__global__ void k_moe_add(float *y, const float *x, const int32_t *rows, const float *w, int n,
                          long width)
{
    const long j = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= width)
        return;
    for (int i = 0; i < n; i++) {
        const int32_t r = rows[i];
        float *yr = y + (size_t)(r < 0 ? ~r : r) * width;
        const float p = __fmul_rn(w[i], x[(size_t)i * width + j]);
        yr[j] = r < 0 ? p : __fadd_rn(yr[j], p);
    }
}

extern "C" int kcu_moe_add(void *stream, float *y, const float *x, const int32_t *rows,
                           const float *w, int n, long width)
{
    if (n <= 0 || width <= 0)
        return 0;
    KCU_LAUNCH(k_moe_add, (unsigned)((width + 127) / 128), 128, (cudaStream_t)stream)
    (y, x, rows, w, n, width);
    return launched();
}

/* ---- KV cache ---- */

static __device__ __forceinline__ size_t tile_bytes(const struct kcu_kv *kv)
{
    const size_t B = (size_t)kv->block_size, D = (size_t)kv->head_dim;
    return kv->dtype == 1 ? B * (D + 4) : B * D * 2;
}

/* The 8-bit quant of x * id as the CPU rounds it (nearest even; NaN to 0). */
static __device__ __forceinline__ int8_t q8_of(float x, float id)
{
    const float s = __fmul_rn(x, id);
    return s == s ? (int8_t)__float2int_rn(s) : (int8_t)0;
}

/* A warp per (token, KV head): the head's D keys and values of the token into its slot. */
__global__ void k_kv_store(struct kcu_kv kv, const int32_t *pos, const float *k, const float *v,
                           int n_tok, const uint8_t *sel, int want)
{
    const int lane = threadIdx.x % WARP;
    const long wi = ((long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    if (wi >= (long)n_tok * kv.n_kv_head)
        return;
    const int t = (int)(wi / kv.n_kv_head), g = (int)(wi % kv.n_kv_head);
    if (sel && (sel[t] == KCU_STORE_PAD || (sel[t] != 0) != (want != 0)))
        return; /* another op's token, or padding */
    const int B = kv.block_size, D = kv.head_dim, p = pos[t];
    const int32_t blk = kv.ids[(size_t)kv.row[t] * kv.stride + p / B];
    const int i = p % B;
    const size_t tile = ((size_t)blk * kv.n_kv_head + g) * tile_bytes(&kv);
    uint8_t *kt = (uint8_t *)kv.k + tile, *vt = (uint8_t *)kv.v + tile;
    const float *kr = k + ((size_t)t * kv.n_kv_head + g) * D;
    const float *vr = v + ((size_t)t * kv.n_kv_head + g) * D;
    if (kv.dtype == 0) {
        for (int c = lane; c < D; c += WARP) {
            ((__half *)kt)[(size_t)c * B + i] = __float2half_rn(kr[c]);
            ((__half *)vt)[(size_t)i * D + c] = __float2half_rn(vr[c]);
        }
        return;
    }
    float ka = 0.0f, va = 0.0f;
    for (int c = lane; c < D; c += WARP) {
        ka = fmaxf(ka, fabsf(kr[c]));
        va = fmaxf(va, fabsf(vr[c]));
    }
    ka = warp_max(ka);
    va = warp_max(va);
    const float kid = kcu_kv_quant_inv(ka), vid = kcu_kv_quant_inv(va);
    for (int c = lane; c < D; c += WARP) {
        ((int8_t *)kt)[(size_t)c * B + i] = q8_of(kr[c], kid);
        ((int8_t *)vt)[(size_t)i * D + c] = q8_of(vr[c], vid);
    }
    if (lane == 0) {
        ((float *)(kt + (size_t)D * B))[i] = ka / 127.0f;
        ((float *)(vt + (size_t)D * B))[i] = va / 127.0f;
    }
}

extern "C" int kcu_kv_store(void *stream, const struct kcu_kv *kv, const int32_t *pos,
                            const float *k, const float *v, int n_tok, const uint8_t *sel, int want)
{
    const long warps = (long)n_tok * kv->n_kv_head;
    if (warps <= 0)
        return 0;
    KCU_LAUNCH(k_kv_store, (unsigned)((warps + 3) / 4), 4 * WARP, (cudaStream_t)stream)
    (*kv, pos, k, v, n_tok, sel, want);
    return launched();
}

/* Attention: a warp per (token, query head, split), online softmax over runs of 32 positions.
 * Lane l scores position p0 + l (its key read channel by channel from the channel-major tile),
 * then every lane accumulates its channels l, l + 32, ... of the run's values weighted by the
 * scores, which the lanes pass round by shuffles. GQA: the warps of the query heads that share a
 * KV head (up to ATT_MAX_HB of them) form one block, and for head_dim <= ATT_STAGE_D the block
 * stages each run's keys and values in shared memory once for all of them (one global read of
 * the KV cache per KV head instead of one per query head); each warp then computes exactly what
 * it computed alone, in the same order, so the output is bitwise that of one warp per head.
 * Flash-decoding: with split > 0 a token's positions are cut where multiples of `split` fall
 * (so every token of a sequence is cut at the same places), one block per piece (blockIdx.y),
 * each warp writing its running maximum, sum and weighted values to part, and k_attn_combine
 * merges them; a token with one piece, or with more than max_split (what the scratch holds,
 * fixed by the model), writes its output directly, as without splits. How a token is cut
 * depends only on its own positions, so its output does not depend on the batch. */
#define ATT_MAX_CH  (512 / WARP) /* channels per lane at KERN_MAX_HEAD_DIM */
#define ATT_MAX_HB  8            /* query heads (warps) per block */
#define ATT_STAGE_D 256          /* head_dim up to which a run's K and V are staged */

/* Token t's positions [*first, n) and the number of splits (1: none; also for a token of more
 * than max_split, whose shares would not fit): split j covers its positions in [(*s0 + j) *
 * split, (*s0 + j + 1) * split). */
static __device__ __forceinline__ int att_splits(const int32_t *pos, int t, int window, int split,
                                                 int max_split, int *first, int *n, int *s0)
{
    *n = pos[t] + 1;
    *first = window > 0 && *n > window ? *n - window : 0;
    *s0 = split > 0 ? *first / split : 0;
    const int runs = split > 0 ? (*n - 1) / split - *s0 + 1 : 1;
    return runs <= max_split ? runs : 1;
}

/* Split j's positions [*lo, *hi) of a token att_splits cut into ns (all of them when ns is 1). */
static __device__ __forceinline__ void att_split_range(int first, int n, int s0, int ns, int j,
                                                       int split, int *lo, int *hi)
{
    *lo = ns > 1 && (s0 + j) * split > first ? (s0 + j) * split : first;
    *hi = ns > 1 && (s0 + j + 1) * split < n ? (s0 + j + 1) * split : n;
}

/* The K or V tile (pool kv.k or kv.v) that holds position p of KV head g. */
static __device__ __forceinline__ const uint8_t *att_tile(const struct kcu_kv *kv, const void *pool,
                                                          const int32_t *table, int g, int p)
{
    return (const uint8_t *)pool +
           ((size_t)table[p / kv->block_size] * kv->n_kv_head + g) * tile_bytes(kv);
}

template <int STAGE, int HB>
__global__ void k_attention(struct kcu_kv kv, const float *q, float *out, const int32_t *pos,
                            int n_head, int hb, float scale, int window, float softcap, int split,
                            int max_split, float *part)
{
    /* STAGE: a run's keys [c][ii] and values [ii][c], raw (2 bytes f16, 1 byte int8), and the
     * 8-bit rows' scales */
    __shared__ float qs[HB][STAGE ? ATT_STAGE_D : 512];
    __shared__ __align__(16) uint8_t kst[STAGE ? 2 * ATT_STAGE_D * WARP : 16];
    __shared__ __align__(16) uint8_t vst[STAGE ? 2 * ATT_STAGE_D * WARP : 16];
    __shared__ float ksc[WARP], vsc[WARP];
    KCU_SHARED(qs);
    KCU_SHARED(kst);
    KCU_SHARED(vst);
    KCU_SHARED(ksc);
    KCU_SHARED(vsc);
    const int lane = threadIdx.x % WARP, wp = threadIdx.x / WARP;
    const int t = blockIdx.x / (n_head / hb), h = (blockIdx.x % (n_head / hb)) * hb + wp;
    const int B = kv.block_size, D = kv.head_dim, g = h / (n_head / kv.n_kv_head);
    const float *qr = q + ((size_t)t * n_head + h) * D;
    for (int c = lane; c < D; c += WARP)
        qs[wp][c] = qr[c];
    const int32_t *table = kv.ids + (size_t)kv.row[t] * kv.stride;
    int first, n, s0, lo;
    const int ns = att_splits(pos, t, window, split, max_split, &first, &n, &s0), sp = blockIdx.y;
    if (sp >= ns) /* the same for every warp of the block: one token, one KV head */
        return;
    att_split_range(first, n, s0, ns, sp, split, &lo, &n); /* this split's positions */
    const int q8 = kv.dtype == 1;
    float acc[ATT_MAX_CH];
    for (int j = 0; j < ATT_MAX_CH; j++)
        acc[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int p0 = lo; p0 < n; p0 += WARP) {
        const int cnt = n - p0 < WARP ? n - p0 : WARP;
        if (STAGE) {
            __syncthreads(); /* the previous run is read by every warp (and qs is written) */
            for (int e = threadIdx.x; e < D * WARP; e += blockDim.x) {
                const int c = e / WARP, ii = e % WARP; /* keys: positions fastest */
                if (ii < cnt) {
                    const int p = p0 + ii;
                    const uint8_t *kt = att_tile(&kv, kv.k, table, g, p);
                    const size_t at = (size_t)c * B + p % B;
                    if (q8)
                        kst[c * WARP + ii] = kt[at];
                    else
                        ((uint16_t *)kst)[c * WARP + ii] = ((const uint16_t *)kt)[at];
                }
            }
            for (int e = threadIdx.x; e < cnt * D; e += blockDim.x) {
                const int ii = e / D, c = e % D; /* values: channels fastest */
                const int p = p0 + ii;
                const uint8_t *vt = att_tile(&kv, kv.v, table, g, p);
                const size_t at = (size_t)(p % B) * D + c;
                if (q8)
                    vst[ii * D + c] = vt[at];
                else
                    ((uint16_t *)vst)[ii * D + c] = ((const uint16_t *)vt)[at];
            }
            if (q8 && (int)threadIdx.x < cnt) {
                const int p = p0 + (int)threadIdx.x;
                ksc[threadIdx.x] =
                    ((const float *)(att_tile(&kv, kv.k, table, g, p) + (size_t)D * B))[p % B];
                vsc[threadIdx.x] =
                    ((const float *)(att_tile(&kv, kv.v, table, g, p) + (size_t)D * B))[p % B];
            }
            __syncthreads();
        } else {
            __syncwarp();
        }
        const int p = p0 + lane;
        float s = -INFINITY;
        if (p < n) {
            const uint8_t *kt = STAGE ? kst : att_tile(&kv, kv.k, table, g, p);
            const size_t stride = STAGE ? WARP : (size_t)B, i = STAGE ? lane : p % B;
            float d = 0.0f;
            if (q8) {
                for (int c = 0; c < D; c++)
                    d = fmaf(qs[wp][c], (float)((const int8_t *)kt)[(size_t)c * stride + i], d);
                d *= STAGE ? ksc[lane] : ((const float *)(kt + (size_t)D * B))[i];
            } else {
                for (int c = 0; c < D; c++)
                    d = fmaf(qs[wp][c], __half2float(((const __half *)kt)[(size_t)c * stride + i]),
                             d);
            }
            s = d * scale;
            if (softcap > 0.0f) /* Gemma 2 */
                s = softcap * tanhf(s / softcap);
        }
        const float bm = warp_max(s);
        if (bm > m) {
            const float r = expf(m - bm); /* 0 on the first run */
            l *= r;
            for (int j = 0; j < ATT_MAX_CH; j++)
                acc[j] *= r;
            m = bm;
        }
        const float pl = p < n ? expf(s - m) : 0.0f;
        l += warp_sum(pl);
        for (int ii = 0; ii < cnt; ii++) {
            float w = __shfl_sync(FULL, pl, ii);
            const int pp = p0 + ii;
            const uint8_t *vt = STAGE ? vst : att_tile(&kv, kv.v, table, g, pp);
            const size_t i = STAGE ? ii : pp % B;
            if (q8) {
                w *= STAGE ? vsc[ii] : ((const float *)(vt + (size_t)D * B))[i];
                for (int j = 0; j < ATT_MAX_CH; j++) {
                    const int c = lane + j * WARP;
                    if (c < D)
                        acc[j] = fmaf(w, (float)((const int8_t *)vt)[i * D + c], acc[j]);
                }
            } else {
                for (int j = 0; j < ATT_MAX_CH; j++) {
                    const int c = lane + j * WARP;
                    if (c < D)
                        acc[j] = fmaf(w, __half2float(((const __half *)vt)[i * D + c]), acc[j]);
                }
            }
        }
    }
    const size_t th = (size_t)t * n_head + h; /* this (token, head) */
    float *o = out + th * D;
    if (ns > 1) { /* this split's share, for k_attn_combine */
        o = part + (th * gridDim.y + sp) * (size_t)(D + 2);
        if (lane == 0) {
            o[0] = m;
            o[1] = l;
        }
        for (int j = 0; j < ATT_MAX_CH; j++) {
            const int c = lane + j * WARP;
            if (c < D)
                o[2 + c] = acc[j];
        }
        return;
    }
    for (int j = 0; j < ATT_MAX_CH; j++) {
        const int c = lane + j * WARP;
        if (c < D)
            o[c] = acc[j] / l;
    }
}

/* ---- attention on tensor cores (the bf16 mode, f16 or 8-bit keys and values, head_dim a
 * multiple of 16 up to AMMA_D; 8-bit: values as exact halves, the keys' scales on the scores,
 * the values' folded into the probabilities): a warp takes a tile of up to 16 query rows that share
 * a KV head, `tt` consecutive tokens x `hq` of the KV head's query heads (row r: token t0 + r / hq,
 * head h0 + r % hq). The queries, times the scale and rounded to halves, are A fragments; each run
 * of 16 positions (at multiples of 16) gives the scores S = Q K^T by mma.sync, K's halves read
 * straight from the cache tiles as B fragments; then per row the soft-cap, the mask (positions
 * outside the row's range: -inf), an online softmax (the run's maximum; its probabilities rounded
 * to halves, which are both what the row's sum adds and what multiplies V) and O += P V by
 * mma.sync, V's halves as B fragments. A pass serves the rows of one sequence: rows of tokens of
 * another take no part (no state change, probabilities 0), and a tile whose tokens belong to
 * several sequences makes one pass each. Every row's inputs, runs and order of operations are its
 * own whatever shares its tile, and an MMA's row of results depends on that row's inputs alone, so
 * a token's output does not depend on its batch. Splits are att_splits' pieces: block y is split S0
 * + y of the tile, S0 the first split of any of its rows. ---- */
#define AMMA_D 128

/* v rounded to a half (nearest even), as its 16 bits; and back. */
static __device__ __forceinline__ uint32_t amma_half(float v)
{
    const __half h = __float2half_rn(v);
    return *(const uint16_t *)&h;
}

static __device__ __forceinline__ float amma_float(uint32_t u)
{
    const uint16_t b = (uint16_t)u;
    return __half2float(*(const __half *)&b);
}

static __device__ __forceinline__ int warp_min_i(int v)
{
    for (int o = WARP / 2; o > 0; o /= 2) {
        const int w = __shfl_xor_sync(FULL, v, o);
        v = w < v ? w : v;
    }
    return v;
}

static __device__ __forceinline__ int warp_max_i(int v)
{
    for (int o = WARP / 2; o > 0; o /= 2) {
        const int w = __shfl_xor_sync(FULL, v, o);
        v = w > v ? w : v;
    }
    return v;
}

/* head_dim / 16; 8-bit keys and values; STG (f16, blocks of a multiple of 16 positions): each
 * run's keys and values come through shared memory, two runs in flight (cp.async: the next
 * run's while this one is multiplied; 16-byte reads of whole channel and position rows), their
 * fragments by ldmatrix.trans; else each lane reads its own halves (2 bytes a load) */
template <int DC, int Q8, int STG>
__global__ void __launch_bounds__(WARP)
    k_attn_mma(struct kcu_kv kv, const float *q, float *out, const int32_t *pos, int n_tok,
               int n_head, int hq, int tt, float scale, int window, float softcap, int split,
               int max_split, int n_part, float *part)
{
    static_assert(!(STG && Q8), "8-bit K/V is read directly");
    constexpr int D = DC * 16;
    /* staged run s % 2: keys channel-major as in the cache (pitch 24 halves: the 8 rows an
     * ldmatrix reads fall in distinct banks), values position-major (pitch D + 8) */
    constexpr int KP = 24, VP = D + 8;
    __shared__ __align__(16) uint16_t kst[2][STG ? D * KP : 8];
    __shared__ __align__(16) uint16_t vst[2][STG ? 16 * VP : 8];
    KCU_SHARED(kst);
    KCU_SHARED(vst);
    const int lane = threadIdx.x, g = lane / 4, t4 = lane % 4;
    const int B = kv.block_size;
    const int group = n_head / kv.n_kv_head, per_kv = group / hq;
    const int ht = blockIdx.x % per_kv, kvh = blockIdx.x / per_kv % kv.n_kv_head;
    const int t0 = blockIdx.x / per_kv / kv.n_kv_head * tt, h0 = kvh * group + ht * hq;
    /* this lane's two rows, g and g + 8: token, head, whether real, their positions and splits */
    int rt[2], rh[2], rv[2], first[2], n[2], s0[2], ns[2];
    int smin = 1 << 30, smax = -1;
    for (int i = 0; i < 2; i++) {
        const int r = g + 8 * i;
        rt[i] = t0 + r / hq;
        rh[i] = h0 + r % hq;
        rv[i] = r < tt * hq && rt[i] < n_tok;
        ns[i] =
            rv[i] ? att_splits(pos, rt[i], window, split, max_split, &first[i], &n[i], &s0[i]) : 0;
        if (rv[i] && s0[i] < smin)
            smin = s0[i];
        if (rv[i] && s0[i] + ns[i] - 1 > smax)
            smax = s0[i] + ns[i] - 1;
    }
    smin = warp_min_i(smin);
    smax = warp_max_i(smax);
    const int ntt = n_tok - t0 < tt ? n_tok - t0 : tt; /* real tokens of the tile */
    /* the tile's splits smin .. smax, gridDim.y apart from blockIdx.y */
    for (int sy = smin + (int)blockIdx.y; sy <= smax; sy += (int)gridDim.y) {
        int lo[2], hi[2], act[2];
        for (int i = 0; i < 2; i++) {
            const int j = sy - (rv[i] ? s0[i] : 0);
            act[i] = rv[i] && j >= 0 && j < ns[i];
            if (act[i])
                att_split_range(first[i], n[i], s0[i], ns[i], j, split, &lo[i], &hi[i]);
        }
        unsigned done = 0;
        for (;;) {
            int i0 = 0; /* the first token not yet served: its sequence is this pass's */
            while (i0 < ntt && (done >> i0 & 1))
                i0++;
            if (i0 >= ntt)
                break;
            const int seq = kv.row[t0 + i0];
            for (int i = i0; i < ntt; i++)
                if (kv.row[t0 + i] == seq)
                    done |= 1u << i;
            int live[2], plo = 1 << 30, phi = -1;
            for (int i = 0; i < 2; i++) {
                live[i] = act[i] && kv.row[rt[i]] == seq;
                if (live[i]) {
                    plo = lo[i] < plo ? lo[i] : plo;
                    phi = hi[i] > phi ? hi[i] : phi;
                }
            }
            plo = warp_min_i(plo);
            phi = warp_max_i(phi);
            if (phi < 0)
                continue; /* no row of this sequence has positions in this split */
            const int32_t *table = kv.ids + (size_t)seq * kv.stride;
            /* the queries: rows g and g + 8, channels 16 kc + 2 t4 (+1, +8, +9) */
            uint32_t qa[DC][4];
            for (int kc = 0; kc < DC; kc++)
                for (int p = 0; p < 4; p++) {
                    const int i = p & 1, c = 16 * kc + 2 * t4 + (p >= 2 ? 8 : 0);
                    const float *qr = q + ((size_t)rt[i] * n_head + rh[i]) * D + c;
                    qa[kc][p] =
                        live[i] ? amma_half(qr[0] * scale) | amma_half(qr[1] * scale) << 16 : 0u;
                }
            float acc[2 * DC][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
            for (int j = 0; j < 2 * DC; j++)
                for (int e = 0; e < 4; e++)
                    acc[j][e] = 0.0f;
            /* STG: run p0's keys and values into stage s; values of positions outside the pass
             * as zeros (their probabilities are 0, and 0 * NaN would not be); keys all (the run
             * is in one tile; the mask drops the scores of other positions) */
            auto stage_run = [&](int p0, int s) {
                const uint8_t *kt = att_tile(&kv, kv.k, table, kvh, p0) + (size_t)(p0 % B) * 2;
                const uint8_t *vt = att_tile(&kv, kv.v, table, kvh, p0) + (size_t)(p0 % B) * D * 2;
                for (int i = 0; i < DC; i++) { /* 2 D 16-byte chunks of each */
                    const int e = lane + WARP * i, c = e / 2, h = e % 2;
                    cp_async16(&kst[s][c * KP + 8 * h], kt + ((size_t)c * B + 8 * h) * 2, 16);
                    const int pp = e / (D / 8), vc = e % (D / 8);
                    const bool in = p0 + pp >= plo && p0 + pp < phi;
                    cp_async16(&vst[s][pp * VP + 8 * vc],
                               in ? vt + ((size_t)pp * D + 8 * vc) * 2 : vt, in ? 16 : 0);
                }
                cp_commit();
            };
            if (STG) {
                __syncwarp(); /* a pass before this one may have read stage 0 last */
                stage_run(plo / 16 * 16, 0);
            }
            for (int p0 = plo / 16 * 16, s = 0; p0 < phi; p0 += 16, s ^= 1) {
                if (STG) {
                    __syncwarp(); /* every lane is done with stage s ^ 1 (the last run's) */
                    if (p0 + 16 < phi) {
                        stage_run(p0 + 16, s ^ 1);
                        cp_wait<1>();
                    } else {
                        cp_wait<0>();
                    }
                    __syncwarp(); /* run p0 is in for every lane */
                }
                /* S for positions p0 + 8 j + (0..7): lane's key position p0 + 8 j + g */
                float sc[2][4];
                /* the lane's positions p0 + 2 t4 (+1, +8, +9): its scores' columns and its
                 * values' rows; 8-bit: their keys' and values' scales (0 outside the pass) */
                float ksc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, vsc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if (Q8)
                    for (int k = 0; k < 4; k++) {
                        const int p = p0 + 2 * t4 + (k & 1) + (k >= 2 ? 8 : 0);
                        if (p >= plo && p < phi) {
                            const size_t at = (size_t)D * B;
                            ksc[k] =
                                ((const float *)(att_tile(&kv, kv.k, table, kvh, p) + at))[p % B];
                            vsc[k] =
                                ((const float *)(att_tile(&kv, kv.v, table, kvh, p) + at))[p % B];
                        }
                    }
                if (STG) { /* the same products, from the stage */
                    for (int j = 0; j < 2; j++)
                        for (int e = 0; e < 4; e++)
                            sc[j][e] = 0.0f;
                    for (int kc = 0; kc < DC; kc++) {
                        uint32_t kb[4];
                        ldsm_x4<1>(kcu_ldsm_bt(kst[s], KP, 0, 16 * kc, lane), kb);
                        mma_f16(sc[0], qa[kc], kb);
                        mma_f16(sc[1], qa[kc], kb + 2);
                    }
                }
                for (int j = 0; j < 2 && !STG; j++) {
                    const int p = p0 + 8 * j + g;
                    const uint8_t *kt = NULL; /* position p's first channel */
                    if (p >= plo && p < phi)
                        kt = att_tile(&kv, kv.k, table, kvh, p) + (size_t)(p % B) * (Q8 ? 1 : 2);
                    for (int e = 0; e < 4; e++)
                        sc[j][e] = 0.0f;
                    for (int kc = 0; kc < DC; kc++) {
                        uint32_t kb[2] = {0u, 0u};
                        if (kt) {
                            const int c = 16 * kc + 2 * t4;
                            uint32_t h[4];
                            for (int u = 0; u < 4; u++) {
                                const size_t at = (size_t)(c + (u & 1) + (u >= 2 ? 8 : 0)) * B;
                                if (Q8)
                                    h[u] = amma_half((float)((const int8_t *)kt)[at]);
                                else
                                    h[u] = ((const uint16_t *)kt)[at];
                            }
                            kb[0] = h[0] | h[1] << 16;
                            kb[1] = h[2] | h[3] << 16;
                        }
                        mma_f16(sc[j], qa[kc], kb);
                    }
                    if (Q8) /* the keys' scales, column by column (positions 2 t4, 2 t4 + 1) */
                        for (int e = 0; e < 4; e++)
                            sc[j][e] *= ksc[2 * j + e % 2];
                }
                /* per row: soft-cap, mask, the run's maximum */
                float mx[2] = {-INFINITY, -INFINITY};
                for (int j = 0; j < 2; j++)
                    for (int e = 0; e < 4; e++) {
                        const int i = e / 2, p = p0 + 8 * j + 2 * t4 + e % 2;
                        float v = sc[j][e];
                        if (softcap > 0.0f)
                            v = softcap * tanhf(v / softcap);
                        if (!live[i] || p < lo[i] || p >= hi[i])
                            v = -INFINITY;
                        sc[j][e] = v;
                        mx[i] = fmaxf(mx[i], v);
                    }
                uint32_t pa[4];
                for (int i = 0; i < 2; i++) {
                    mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL, mx[i], 1));
                    mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL, mx[i], 2));
                    if (mx[i] > m[i]) {
                        const float r = expf(m[i] - mx[i]); /* 0 on the row's first run */
                        l[i] *= r;
                        for (int j = 0; j < 2 * DC; j++) {
                            acc[j][2 * i] *= r;
                            acc[j][2 * i + 1] *= r;
                        }
                        m[i] = mx[i];
                    }
                    /* the probabilities as halves: A fragment registers i (positions 2 t4, +1 of
                     * the run's first 8) and 2 + i (of its second 8) */
                    float sum = 0.0f;
                    for (int j = 0; j < 2; j++) {
                        const float v0 = sc[j][2 * i], v1 = sc[j][2 * i + 1];
                        const uint32_t h0 = v0 == -INFINITY ? 0u : amma_half(expf(v0 - m[i]));
                        const uint32_t h1 = v1 == -INFINITY ? 0u : amma_half(expf(v1 - m[i]));
                        sum += amma_float(h0) + amma_float(h1);
                        /* 8-bit values: their scales go into P (rounded to halves again) */
                        pa[2 * j + i] = Q8 ? amma_half(amma_float(h0) * vsc[2 * j]) |
                                                 amma_half(amma_float(h1) * vsc[2 * j + 1]) << 16
                                           : h0 | h1 << 16;
                    }
                    sum += __shfl_xor_sync(FULL, sum, 1);
                    sum += __shfl_xor_sync(FULL, sum, 2);
                    l[i] += sum;
                }
                if (STG) { /* O += P V, V from the stage */
                    for (int jc = 0; jc < 2 * DC; jc += 2) {
                        uint32_t vb[4];
                        ldsm_x4<1>(kcu_ldsm_bt(vst[s], VP, 8 * jc, 0, lane), vb);
                        mma_f16(acc[jc], pa, vb);
                        mma_f16(acc[jc + 1], pa, vb + 2);
                    }
                }
                /* O += P V: the lane's value positions p0 + 2 t4 (+1, +8, +9), channel 8 jc + g */
                const uint8_t *vt[4]; /* each position's value row */
                for (int k = 0; k < 4 && !STG; k++) {
                    const int p = p0 + 2 * t4 + (k & 1) + (k >= 2 ? 8 : 0);
                    vt[k] = p >= plo && p < phi ? att_tile(&kv, kv.v, table, kvh, p) +
                                                      (size_t)(p % B) * D * (Q8 ? 1 : 2)
                                                : NULL;
                }
                for (int jc = 0; jc < 2 * DC && !STG; jc++) {
                    const int c = 8 * jc + g;
                    uint32_t h[4];
                    for (int k = 0; k < 4; k++)
                        h[k] = !vt[k] ? 0u
                               : Q8   ? amma_half((float)((const int8_t *)vt[k])[c])
                                      : ((const uint16_t *)vt[k])[c];
                    const uint32_t vb[2] = {h[0] | h[1] << 16, h[2] | h[3] << 16};
                    mma_f16(acc[jc], pa, vb);
                }
            }
            /* the pass's rows out: channels 8 jc + 2 t4 (+1) */
            for (int i = 0; i < 2; i++) {
                if (!live[i])
                    continue;
                const size_t th = (size_t)rt[i] * n_head + rh[i];
                if (ns[i] > 1) { /* this split's share, for k_attn_combine */
                    float *o = part + (th * n_part + (size_t)(sy - s0[i])) * (size_t)(D + 2);
                    if (t4 == 0) {
                        o[0] = m[i];
                        o[1] = l[i];
                    }
                    for (int jc = 0; jc < 2 * DC; jc++) {
                        o[2 + 8 * jc + 2 * t4] = acc[jc][2 * i];
                        o[2 + 8 * jc + 2 * t4 + 1] = acc[jc][2 * i + 1];
                    }
                } else {
                    float *o = out + th * D;
                    for (int jc = 0; jc < 2 * DC; jc++) {
                        o[8 * jc + 2 * t4] = acc[jc][2 * i] / l[i];
                        o[8 * jc + 2 * t4 + 1] = acc[jc][2 * i + 1] / l[i];
                    }
                }
            }
        }
    }
}

/* The splits of each (token, head) that has several, in split order: out = sum_s acc_s e^(m_s -
 * M) / sum_s l_s e^(m_s - M), M the largest m_s. */
__global__ void k_attn_combine(const float *part, float *out, const int32_t *pos, int n_head, int D,
                               int window, int split, int max_split, int n_split)
{
    const int lane = threadIdx.x, t = blockIdx.x / n_head, h = blockIdx.x % n_head;
    int first, n, s0;
    const int ns = att_splits(pos, t, window, split, max_split, &first, &n, &s0);
    if (ns <= 1)
        return;
    const float *pp = part + (size_t)blockIdx.x * n_split * (size_t)(D + 2);
    float M = -INFINITY;
    for (int s = 0; s < ns; s++)
        M = fmaxf(M, pp[(size_t)s * (D + 2)]);
    float L = 0.0f;
    for (int s = 0; s < ns; s++)
        L = fmaf(pp[(size_t)s * (D + 2) + 1], expf(pp[(size_t)s * (D + 2)] - M), L);
    float *o = out + ((size_t)t * n_head + h) * D;
    for (int c = lane; c < D; c += WARP) {
        float a = 0.0f;
        for (int s = 0; s < ns; s++)
            a = fmaf(pp[(size_t)s * (D + 2) + 2 + c], expf(pp[(size_t)s * (D + 2)] - M), a);
        o[c] = a / L;
    }
}

/* k_attn_mma for head_dim dc * 16 on a grid of tiles (grid.x) and splits (grid.y); staged
 * (stg) where the cache allows it. */
static int amma_launch(int dc, int stg, dim3 grid, cudaStream_t stream, const struct kcu_kv *kv,
                       const float *q, float *out, const int32_t *pos, int n_tok, int n_head,
                       int hq, int tt, float scale, int window, float softcap, int split,
                       int max_split, int n_part, float *part)
{
#define AMMA_CASE(DCV)                                                                             \
    case DCV: {                                                                                    \
        void (*kf)(struct kcu_kv, const float *, float *, const int32_t *, int, int, int, int,     \
                   float, int, float, int, int, int, float *) =                                    \
            kv->dtype == 1                    ? k_attn_mma<DCV, 1, 0>                              \
            : stg && kv->block_size % 16 == 0 ? k_attn_mma<DCV, 0, 1>                              \
                                              : k_attn_mma<DCV, 0, 0>;                             \
        KCU_LAUNCH(kf, grid, WARP, stream)                                                         \
        (*kv, q, out, pos, n_tok, n_head, hq, tt, scale, window, softcap, split, max_split,        \
         n_part, part);                                                                            \
        break;                                                                                     \
    }
    switch (dc) {
        AMMA_CASE(1)
        AMMA_CASE(2)
        AMMA_CASE(3)
        AMMA_CASE(4)
        AMMA_CASE(5)
        AMMA_CASE(6)
        AMMA_CASE(7)
        AMMA_CASE(8)
    default:
        return (int)cudaErrorInvalidValue;
    }
#undef AMMA_CASE
    return launched();
}

extern "C" int kcu_attention(void *stream, const struct kcu_kv *kv, const float *q, float *out,
                             const int32_t *pos, int n_tok, int n_head, float scale, int window,
                             float softcap, int split, float *part, size_t part_floats, int stage,
                             int mma, int n_seqs)
{
    if (n_tok <= 0)
        return 0;
    /* the most splits a token may have, from the model and the scratch alone (never from the
     * batch, so whether a token is split does not depend on its batch): the grid's y extent and
     * one token's shares must fit; a token of more runs (contexts of millions of positions, or a
     * small scratch) goes unsplit, one warp per head over all of its positions */
    const size_t per_split = (size_t)n_head * (size_t)(kv->head_dim + 2);
    const long max_split =
        part ? (long)(part_floats / per_split < 65535 ? part_floats / per_split : 65535) : 0;
    /* the most splits a token of these block tables can have (with a window its positions may
     * start anywhere in a split: one more than the span needs) */
    long span = (long)kv->stride * kv->block_size;
    if (window > 0 && window < span)
        span = window;
    long n_split = split > 0 ? (span + split - 1) / split + (window > 0) : 1;
    if (n_split > max_split)
        n_split = max_split;
    /* tensor cores: tiles of up to 16 rows, hq query heads of a KV head x tt tokens; the grid's y
     * extent covers every split of any row of a tile (their first splits may differ) */
    const int group = n_head / kv->n_kv_head;
    const int amma = mma && kv->head_dim % 16 == 0 && kv->head_dim <= AMMA_D;
    int hq = group < 16 ? group : 16;
    while (group % hq)
        hq--;
    /* decode-shaped calls (as many sequences as tokens) take one token a tile: a tile of tokens
     * of several sequences serves them one pass after another */
    const int tt = n_seqs > 0 && 2 * n_seqs > n_tok ? 1 : 16 / hq, per_kv = group / hq;
    long amma_y = n_split < 65535 ? n_split : 65535; /* blocks stride over a tile's splits */
    /* the query heads sharing a KV head, up to ATT_MAX_HB of them, per block; staged when there
     * are several (a block of one warp has nothing to share: its own small kernel) */
    int hb = group < ATT_MAX_HB ? group : ATT_MAX_HB;
    while (group % hb)
        hb--;
    void (*k)(struct kcu_kv, const float *, float *, const int32_t *, int, int, float, int, float,
              int, int, float *) = hb == 1 ? k_attention<0, 1>
                                   : stage && kv->head_dim <= ATT_STAGE_D
                                       ? k_attention<1, ATT_MAX_HB>
                                       : k_attention<0, ATT_MAX_HB>;
    if (n_split <= 1 || !part) {
        if (amma)
            return amma_launch(kv->head_dim / 16, stage,
                               dim3((unsigned)((n_tok + tt - 1) / tt * kv->n_kv_head * per_kv), 1),
                               (cudaStream_t)stream, kv, q, out, pos, n_tok, n_head, hq, tt, scale,
                               window, softcap, 0, 1, 1, NULL);
        KCU_LAUNCH(k, dim3((unsigned)(n_tok * (n_head / hb)), 1), hb * WARP, (cudaStream_t)stream)
        (*kv, q, out, pos, n_head, hb, scale, window, softcap, 0, 1, (float *)NULL);
        return launched();
    }
    /* tokens in slices whose shares fit part (the cut of a token is the same in any slice) */
    const int D = kv->head_dim;
    const size_t per_tok = per_split * (size_t)n_split;
    const int slice = (int)(part_floats / per_tok < (size_t)n_tok ? part_floats / per_tok : n_tok);
    for (int t0 = 0; t0 < n_tok; t0 += slice) {
        const int nt = n_tok - t0 < slice ? n_tok - t0 : slice;
        struct kcu_kv ks = *kv;
        ks.row = kv->row + t0;
        const size_t off = (size_t)t0 * (size_t)n_head * (size_t)D;
        int rc;
        if (amma) {
            rc = amma_launch(
                D / 16, stage,
                dim3((unsigned)((nt + tt - 1) / tt * kv->n_kv_head * per_kv), (unsigned)amma_y),
                (cudaStream_t)stream, &ks, q + off, out + off, pos + t0, nt, n_head, hq, tt, scale,
                window, softcap, split, (int)max_split, (int)n_split, part);
        } else {
            KCU_LAUNCH(k, dim3((unsigned)(nt * (n_head / hb)), (unsigned)n_split), hb * WARP,
                       (cudaStream_t)stream)
            (ks, q + off, out + off, pos + t0, n_head, hb, scale, window, softcap, split,
             (int)max_split, part);
            rc = launched();
        }
        if (rc)
            return rc;
        KCU_LAUNCH(k_attn_combine, (unsigned)(nt * n_head), WARP, (cudaStream_t)stream)
        (part, out + off, pos + t0, n_head, D, window, split, (int)max_split, (int)n_split);
        if ((rc = launched()))
            return rc;
    }
    return 0;
}
