/* The CUDA kernels on the CPU: what kernels/cuda/cuda_kernels.cu needs of the CUDA language when
 * it is compiled as plain C++ (`make CUDA=emu`, build-emu/), so that the CUDA backend's kernels
 * and host code run, and are tested, where no GPU is. Every CUDA thread is a fiber; a block's
 * fibers run one at a time and switch only at the points where CUDA threads synchronise
 * (__syncthreads, __syncwarp, warp shuffles, mma.sync, ldmatrix), so the kernels' results are
 * those of one legal schedule: lane after lane, warp operation by warp operation, or (under
 * QUERN_CUDA_EMU_ORDER=reverse) the last warp first, each alone up to its next barrier. What it
 * checks beyond the results: a barrier or warp operation that not all the threads reach
 * (divergence, a lane that returned) stops the run with a message, and device memory is the host
 * heap, so ASan sees a kernel's out-of-bounds access. What it cannot show: speed, races that
 * another schedule would expose, and the GPU's own rounding of expf and friends (glibc's here). The
 * runtime API the backend calls (cudaMalloc, cudaMemcpyAsync, ...) is kernels/cuda/emu/kemu.cc,
 * linked instead of libcudart. */
#ifndef KERNELS_CUDA_EMU_KEMU_H
#define KERNELS_CUDA_EMU_KEMU_H

#ifndef __cplusplus
#error "kemu.h is C++ (cuda_kernels.cu compiled by the host compiler)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <utility>

#include "kernels/cuda/emu/mma_ref.h"

/* ---- the language's qualifiers: kernels are plain functions; __shared__ arrays are static, so
 * the fibers of a block (run one block at a time) share them ---- */
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#if defined(__SANITIZE_ADDRESS__)
#define __shared__ static
#else /* in one section, which the emulator fills with 0xFF (NaN) before each block */
#define __shared__ static __attribute__((section("kemu_shared")))
#endif
#define __forceinline__ inline
#define __launch_bounds__(...)

/* GCC ignores the section of a function template's static, so a template kernel's __shared__
 * arrays name themselves (KCU_SHARED(array) after the declaration; nothing on a GPU): the
 * emulator then fills them with NaN before each block as it does the section, and lets
 * cp.async and ldmatrix use them. */
void kemu_shared_extent(void *p, size_t n);
#define KCU_SHARED(a) kemu_shared_extent((a), sizeof(a))

/* ---- the executing thread ---- */
struct kemu_thread {
    uint3 tid; /* threadIdx */
    int lane;  /* linear thread index % 32 */
    int warp;  /* linear thread index / 32 */
    /* the warp operation it waits in: kind, operand, source lane, result */
    int op;
    uint64_t val, res;
    int src;
    uint32_t mma_a[4], mma_b[2];
    float mma_c[4];
    int mma_f16; /* the inputs: 0 bfloat16, 1 halves (m16n8k16, f32 sums), 2 signed bytes
                  * (m16n8k32, int32 sums, their bits in mma_c) */
    int ldsm;    /* ldmatrix: matrices | 16 for .trans */
    /* cp.async copies not waited for yet (kemu_cp_async) */
    struct {
        void *dst;
        const void *src;
        int bytes, src_bytes, group; /* group -1: not committed yet */
    } cp[64];
    int cp_n, cp_groups; /* pending copies; groups committed so far */
};

extern struct kemu_thread *kemu_cur;
extern dim3 kemu_block_idx, kemu_block_dim, kemu_grid_dim;

#define threadIdx (kemu_cur->tid)
#define blockIdx  kemu_block_idx
#define blockDim  kemu_block_dim
#define gridDim   kemu_grid_dim

enum { KEMU_OP_SYNCTHREADS = 1, KEMU_OP_SYNCWARP, KEMU_OP_SHFL, KEMU_OP_MMA, KEMU_OP_LDSM };

/* Suspend the current thread in warp or block operation `op` until its peers arrive. */
void kemu_wait(int op);
/* Stops the run unless mask names the whole warp (the only form the emulator knows). */
void kemu_full_mask(unsigned mask);

static inline void __syncthreads(void)
{
    kemu_wait(KEMU_OP_SYNCTHREADS);
}

static inline void __syncwarp(unsigned mask = 0xffffffffu)
{
    kemu_full_mask(mask);
    kemu_wait(KEMU_OP_SYNCWARP);
}

/* Shuffles over the whole warp (the full mask: every lane of the warp takes part). */
template <class T> static inline T kemu_shfl(T v, int src)
{
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffled value wider than 64 bits");
    kemu_cur->val = 0;
    memcpy(&kemu_cur->val, &v, sizeof(v));
    kemu_cur->src = src & 31;
    kemu_wait(KEMU_OP_SHFL);
    T r;
    memcpy(&r, &kemu_cur->res, sizeof(r));
    return r;
}

template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask)
{
    kemu_full_mask(mask);
    return kemu_shfl(v, kemu_cur->lane ^ lane_mask);
}

template <class T> static inline T __shfl_sync(unsigned mask, T v, int src)
{
    kemu_full_mask(mask);
    return kemu_shfl(v, src);
}

/* mma.sync.m16n8k16 bf16 (or f16) -> f32 for the warp (kernels/cuda/emu/mma_ref.h). */
static inline void kemu_mma(float *c, const uint32_t *a, const uint32_t *b, int f16)
{
    kemu_cur->mma_f16 = f16;
    memcpy(kemu_cur->mma_a, a, sizeof(kemu_cur->mma_a));
    memcpy(kemu_cur->mma_b, b, sizeof(kemu_cur->mma_b));
    memcpy(kemu_cur->mma_c, c, sizeof(kemu_cur->mma_c));
    kemu_wait(KEMU_OP_MMA);
    memcpy(c, kemu_cur->mma_c, sizeof(kemu_cur->mma_c));
}

/* mma.sync.m16n8k32 s8 -> s32 for the warp (mma_ref.h). */
static inline void kemu_mma_s8(int32_t *c, const uint32_t *a, const uint32_t *b)
{
    kemu_cur->mma_f16 = 2;
    memcpy(kemu_cur->mma_a, a, sizeof(kemu_cur->mma_a));
    memcpy(kemu_cur->mma_b, b, sizeof(kemu_cur->mma_b));
    memcpy(kemu_cur->mma_c, c, sizeof(kemu_cur->mma_c));
    kemu_wait(KEMU_OP_MMA);
    memcpy(c, kemu_cur->mma_c, sizeof(kemu_cur->mma_c));
}

/* ldmatrix.sync.aligned.m8n8.x{nmat}{.trans}.shared.b16 for the warp (mma_ref.h): p is the row
 * this lane supplies; r gets the lane's nmat registers. */
static inline void kemu_ldmatrix(const void *p, int nmat, int trans, uint32_t *r)
{
    kemu_cur->val = (uint64_t)(uintptr_t)p;
    kemu_cur->ldsm = nmat | (trans ? 16 : 0);
    kemu_wait(KEMU_OP_LDSM);
    memcpy(r, kemu_cur->mma_a, sizeof(uint32_t) * (size_t)nmat);
}

/* cp.async.{ca,cg}.shared.global [dst], [src], bytes, src_bytes (the rest zeros), commit_group
 * and wait_group n, for the running thread. Copies land at the wait, the latest moment CUDA
 * allows, so a read of shared memory before its wait sees the old bytes; under
 * QUERN_CUDA_EMU_ORDER=reverse they land at once instead, so a copy issued into memory other
 * threads still read (before the barrier that frees it) changes what they read. A thread that
 * returns with copies it never waited for stops the run, and so does an ldmatrix that reads a
 * landed copy no __syncwarp or __syncthreads has published since. */
void kemu_cp_async(void *dst, const void *src, int bytes, int src_bytes);
void kemu_cp_commit(void);
void kemu_cp_wait(int n);

/* Stream work other than kernels, copies and memsets (the NCCL stand-in's collectives): 0 when
 * stream s is not being captured (the caller does the work now), 1 when op went into the
 * capture's graph (to run at each launch), -1 when the capture is invalidated. */
int kemu_capture_record(cudaStream_t s, const std::function<void()> &op);

/* Atomics: fibers switch only at the waits above, so a read-modify-write is never interleaved. */
static inline unsigned long long atomicMax(unsigned long long *p, unsigned long long v)
{
    const unsigned long long old = *p;
    if (v > old)
        *p = v;
    return old;
}

static inline int atomicAdd(int *p, int v)
{
    const int old = *p;
    *p = old + v;
    return old;
}

/* ---- intrinsics: IEEE single precision with the stated rounding (the build uses
 * -ffp-contract=off, so a * b + c is never fused behind the kernel's back) ---- */
static inline float __fadd_rn(float a, float b)
{
    return a + b;
}
static inline float __fsub_rn(float a, float b)
{
    return a - b;
}
static inline float __fmul_rn(float a, float b)
{
    return a * b;
}
static inline float __fdiv_rn(float a, float b)
{
    return a / b;
}
static inline double __dadd_rn(double a, double b)
{
    return a + b;
}
static inline double __dmul_rn(double a, double b)
{
    return a * b;
}
static inline int __float2int_rn(float x)
{
    return (int)nearbyintf(x);
}
static inline unsigned __float_as_uint(float x)
{
    unsigned u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static inline float __uint_as_float(unsigned u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* ---- launches: KCU_LAUNCH(kernel, grid, block, stream)(arguments) ---- */

/* Run `body` as every thread of every block of the grid; returns the launch's cudaError_t
 * (also kept for cudaGetLastError). Exits the process when the kernel diverges at a barrier. */
int kemu_run(const char *name, dim3 grid, dim3 block, cudaStream_t stream,
             const std::function<void()> &body);

template <class... P> struct kemu_launch {
    void (*kernel)(P...);
    const char *name;
    dim3 grid, block;
    cudaStream_t stream;
    int operator()(P... args) const /* converted to the kernel's parameter types, as in CUDA */
    {
        const std::tuple<P...> bound(args...);
        void (*k)(P...) = kernel;
        /* the arguments by value: a stream being captured keeps the launch for its graph */
        return kemu_run(name, grid, block, stream, [bound, k] { std::apply(k, bound); });
    }
};

template <class... P>
static inline kemu_launch<P...> kemu_launcher(void (*kernel)(P...), const char *name, dim3 grid,
                                              dim3 block, cudaStream_t stream)
{
    return kemu_launch<P...>{kernel, name, grid, block, stream};
}

#define KCU_LAUNCH(kernel, grid, block, stream)                                                    \
    kemu_launcher(kernel, #kernel, dim3(grid), dim3(block), (cudaStream_t)(stream))

#endif
