/* cuBLAS for the bf16 mode's large matmuls: the weight dequantized to a bf16 copy in scratch
 * (any type, the same decoding text as every kernel), the inputs as the caller rounded them
 * for the tensor-core kernel (kcu_to_bf16), and
 * cublasGemmEx (bf16 x bf16, f32 compute and output): the bf16 mode's semantics exactly, since
 * a product of two bf16 values is exact in f32. cuBLAS is loaded at run time (dlopen
 * libcublas.so.13), so a binary built here runs where it is missing, without this path. On the
 * emulator (KCU_EMU) cublasGemmEx is replaced by a plain kernel with its documented semantics
 * (column-major, op(A) m x k, op(B) k x n, C m x n), so everything around the call - the copies,
 * the transposes and leading dimensions - is checked by the op test where no GPU is. */
#ifdef KCU_EMU
#include "kernels/cuda/emu/kemu.h"
#else
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#define KCU_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_dequant.h"
#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_pack.h"

/* ---- the pieces of cuBLAS used, as its ABI has them (cublas_api.h), resolved by dlsym ---- */
enum { BLAS_OP_N = 0, BLAS_OP_T = 1 };                  /* cublasOperation_t */
enum { BLAS_R_32F = 0, BLAS_R_16BF = 14 };              /* cudaDataType */
enum { BLAS_COMPUTE_32F = 68, BLAS_GEMM_DEFAULT = -1 }; /* cublasComputeType_t, cublasGemmAlgo_t */

struct kcu_blas {
    void *lib, *handle;
    int (*create)(void **);
    int (*destroy)(void *);
    int (*set_stream)(void *, void *);
    int (*gemm)(void *, int, int, int, int, int, const void *, const void *, int, int, const void *,
                int, int, const void *, void *, int, int, int, int);
    uint16_t *wb; /* scratch: the weight's bf16 copy */
    size_t wb_elems;
};

static int launched(void)
{
    return (int)cudaGetLastError();
}

#ifdef KCU_EMU
/* cublasGemmEx as documented, for bf16 A and B and f32 C with alpha 1, beta 0: C(i, j) = sum_l
 * op(A)(i, l) op(B)(l, j), column-major (element (r, c) of X at X[r + c * ldx]), op(X) = X or
 * its transpose. A thread per C element, f32 sums in l order. */
__global__ void k_emu_gemm(int ta, int tb, int m, int n, int k, const uint16_t *a, int lda,
                           const uint16_t *b, int ldb, float *c, int ldc)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x, j = blockIdx.y;
    if (i >= m)
        return;
    float s = 0.0f;
    for (int l = 0; l < k; l++) {
        const uint16_t av = ta ? a[l + (size_t)i * lda] : a[i + (size_t)l * lda];
        const uint16_t bv = tb ? b[j + (size_t)l * ldb] : b[l + (size_t)j * ldb];
        s = fmaf(kcu_bits_f32((uint32_t)av << 16), kcu_bits_f32((uint32_t)bv << 16), s);
    }
    c[i + (size_t)j * ldc] = s;
}

/* A handle is its stream (as cuBLAS's is per device and stream: ranks on several emulated
 * devices each have their own). */
struct emu_handle {
    void *stream;
};
static int emu_create(void **h)
{
    *h = calloc(1, sizeof(struct emu_handle));
    return *h ? 0 : 3; /* CUBLAS_STATUS_ALLOC_FAILED */
}
static int emu_destroy(void *h)
{
    free(h);
    return 0;
}
static int emu_set_stream(void *h, void *st)
{
    ((struct emu_handle *)h)->stream = st;
    return 0;
}
static int emu_gemm(void *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *a,
                    int at, int lda, const void *b, int bt, int ldb, const void *beta, void *c,
                    int ct, int ldc, int compute, int algo)
{
    (void)algo;
    if (*(const float *)alpha != 1.0f || *(const float *)beta != 0.0f || at != BLAS_R_16BF ||
        bt != BLAS_R_16BF || ct != BLAS_R_32F || compute != BLAS_COMPUTE_32F)
        return 7; /* CUBLAS_STATUS_INVALID_VALUE: only the call this file makes */
    KCU_LAUNCH(k_emu_gemm, dim3((unsigned)((m + 31) / 32), (unsigned)n), 32,
               (cudaStream_t)((struct emu_handle *)h)->stream)
    (ta == BLAS_OP_T, tb == BLAS_OP_T, m, n, k, (const uint16_t *)a, lda, (const uint16_t *)b, ldb,
     (float *)c, ldc);
    return launched() ? 13 : 0; /* CUBLAS_STATUS_EXECUTION_FAILED */
}
#endif

extern "C" struct kcu_blas *kcu_blas_open(void *stream, char *why, size_t why_size)
{
    struct kcu_blas *b = (struct kcu_blas *)calloc(1, sizeof(*b));
    if (!b) {
        snprintf(why, why_size, "out of memory");
        return NULL;
    }
#ifdef KCU_EMU
    b->create = emu_create;
    b->destroy = emu_destroy;
    b->set_stream = emu_set_stream;
    b->gemm = emu_gemm;
#else
    b->lib = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!b->lib) {
        snprintf(why, why_size, "%s", dlerror());
        free(b);
        return NULL;
    }
    *(void **)&b->create = dlsym(b->lib, "cublasCreate_v2");
    *(void **)&b->destroy = dlsym(b->lib, "cublasDestroy_v2");
    *(void **)&b->set_stream = dlsym(b->lib, "cublasSetStream_v2");
    *(void **)&b->gemm = dlsym(b->lib, "cublasGemmEx");
    if (!b->create || !b->destroy || !b->set_stream || !b->gemm) {
        snprintf(why, why_size, "libcublas.so.13 lacks cublasGemmEx or its handle calls");
        dlclose(b->lib);
        free(b);
        return NULL;
    }
#endif
    int rc = b->create(&b->handle);
    if (!rc)
        rc = b->set_stream(b->handle, stream);
    if (rc) {
        snprintf(why, why_size, "cublasCreate/SetStream: status %d", rc);
        if (b->handle)
            b->destroy(b->handle);
#ifndef KCU_EMU
        dlclose(b->lib);
#endif
        free(b);
        return NULL;
    }
    return b;
}

extern "C" void kcu_blas_close(struct kcu_blas *b)
{
    if (!b)
        return;
    b->destroy(b->handle);
    cudaFree(b->wb);
#ifndef KCU_EMU
    dlclose(b->lib);
#endif
    free(b);
}

static __device__ __forceinline__ uint16_t blas_bf16(float v)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

/* The weight's rows, dequantized as every kernel does and rounded to bf16: a thread per unit. */
__global__ void k_weight_bf16(struct kcu_weight w, uint16_t *out)
{
    const int64_t units = w.ne0 / 32, e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= w.ne1 * units)
        return;
    const int64_t r = e / units, u = e % units;
    float v[32];
    if (w.p4_scales)
        kcu_p4_unit(w.type, (const uint8_t *)w.w, kcu_p4_qbytes(w.type, w.ne0, w.ne1), w.p4_scales,
                    w.ne0, r, u, v);
    else
        kcu_dequant32(w.type, (const uint8_t *)w.w + (size_t)r * w.row_bytes, u, v);
    uint4 *o = (uint4 *)(out + r * w.ne0 + u * 32); /* 64 aligned bytes: four 16-byte stores */
    for (int q = 0; q < 4; q++) {
        uint32_t p[4];
        for (int i = 0; i < 4; i++)
            p[i] = (uint32_t)blas_bf16(v[8 * q + 2 * i]) | (uint32_t)blas_bf16(v[8 * q + 2 * i + 1])
                                                               << 16;
        o[q] = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

/* Grows scratch *p to n bf16 values; 0 on success. */
static int grow(uint16_t **p, size_t *have, size_t n)
{
    if (n <= *have)
        return 0;
    void *q = NULL;
    if (cudaMalloc(&q, n * sizeof(uint16_t))) {
        (void)cudaGetLastError(); /* handled: the caller falls back */
        return -1;
    }
    cudaFree(*p);
    *p = (uint16_t *)q;
    *have = n;
    return 0;
}

extern "C" int kcu_matmul_blas(void *stream, struct kcu_blas *b, const struct kcu_mm *mm, float *y,
                               int n_tok)
{
    const struct kcu_weight *w = &mm->w;
    if (n_tok <= 0 || w->ne1 <= 0)
        return 0;
    if (!mm->xb || w->ne1 > INT32_MAX || w->ne0 > INT32_MAX ||
        grow(&b->wb, &b->wb_elems, (size_t)(w->ne1 * w->ne0)))
        return -1; /* not done: the caller runs its own kernel */
    cudaStream_t st = (cudaStream_t)stream;
    const int64_t units = w->ne1 * (w->ne0 / 32);
    KCU_LAUNCH(k_weight_bf16, (unsigned)((units + 127) / 128), 128, st)(*w, b->wb);
    int rc = launched();
    if (rc)
        return rc;
    /* y (n_tok x ne1, row-major) is column-major ne1 x n_tok: y = W x per token, W row-major
     * ne1 x ne0 = column-major ne0 x ne1, so op(A) = A^T with lda ne0; x column-major ne0 x
     * n_tok, ldb ne0 */
    const float one = 1.0f, zero = 0.0f;
    rc = b->gemm(b->handle, BLAS_OP_T, BLAS_OP_N, (int)w->ne1, n_tok, (int)w->ne0, &one, b->wb,
                 BLAS_R_16BF, (int)w->ne0, mm->xb, BLAS_R_16BF, (int)w->ne0, &zero, y, BLAS_R_32F,
                 (int)w->ne1, BLAS_COMPUTE_32F, BLAS_GEMM_DEFAULT);
    return rc ? 1000 + rc : 0; /* a cuBLAS status, told apart from the runtime's codes */
}
