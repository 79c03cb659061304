/* Time of one matmul on a backend, per kernel choice, shape and token count: what picks the
 * CUDA backend's defaults (QUERN_CUDA_MMA_SMALL, QUERN_CUDA_CUBLAS_MIN) and shows how close the
 * kernels come to the machine (weight bytes streamed per second, multiply-add rate).
 *   build/tools/bench_matmul [--device cuda|cpu] [--type q4_0|q4_1|q4_k|q8_0] [--quick]
 * Prints one line per (variant, shape, tokens): microseconds per call, the weight's bytes over
 * that time (GB/s: the batch-1 goal is 70 % of the HBM copy rate) and TFLOPS (2 per MAC). CUDA
 * variants, bf16 mode: "mma16" and "mma64" (the packed layout's tensor-core kernel in 16- and
 * 64-token blocks at every count), "gguf" (the GGUF-row kernels, QUERN_CUDA_PACK=0), "cublas"
 * (cublasGemmEx on bf16 copies made per call, QUERN_CUDA_CUBLAS_MIN=1; the same as the default
 * where libcublas.so.13 cannot be loaded, which the backend logs); exact mode: "gemv-exact" (the
 * packed layout's f32 GEMV); q8 mode: "q8-int8" (the packed layout on int8 tensor cores, inputs
 * quantized per call, the quantization timed with it). --quick: small shapes and few repetitions
 * (the emulator's smoke run in tests/e2e/cuda_emu.sh). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/dtype.h"
#include "kernels/kernels.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t next_u32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

/* ne1 rows of random weights with small positive half scales (values around +-0.05). */
static uint8_t *random_rows(uint32_t type, int64_t ne0, int64_t ne1)
{
    const struct dtype_info *di = dtype_get(type);
    const size_t bytes = dtype_row_bytes(type, ne0) * (size_t)ne1;
    uint8_t *p = malloc(bytes);
    if (!p)
        return NULL;
    for (size_t i = 0; i < bytes; i++)
        p[i] = (uint8_t)next_u32();
    for (size_t b = 0; b < bytes / di->block_bytes; b++) {
        uint8_t *blk = p + b * di->block_bytes;
        const uint16_t d = (uint16_t)(0x2000 + (next_u32() & 0x3FF)); /* ~0.008 */
        memcpy(blk, &d, 2);
        if (type == DTYPE_Q4_1 || type == DTYPE_Q4_K)
            memcpy(blk + 2, &d, 2); /* Q4_1's m, Q4_K's dmin */
    }
    return p;
}

struct variant {
    const char *name, *pack, *small, *blas;
    enum kern_act act;
};

int main(int argc, char **argv)
{
    const char *device = "cuda";
    uint32_t type = DTYPE_Q4_0;
    int quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc)
            device = argv[++i];
        else if (!strcmp(argv[i], "--type") && i + 1 < argc) {
            const char *t = argv[++i];
            type = !strcmp(t, "q4_0")   ? DTYPE_Q4_0
                   : !strcmp(t, "q4_1") ? DTYPE_Q4_1
                   : !strcmp(t, "q4_k") ? DTYPE_Q4_K
                   : !strcmp(t, "q8_0") ? DTYPE_Q8_0
                                        : 0;
            if (!type) {
                fprintf(stderr, "bench_matmul: --type q4_0|q4_1|q4_k|q8_0\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else {
            fprintf(
                stderr,
                "usage: bench_matmul [--device cuda|cpu] [--type q4_0|q4_1|q4_k|q8_0] [--quick]\n");
            return 2;
        }
    }
    /* (ne0, ne1): llama3-8b's attention output, up/gate and down; SmolLM2's up */
    static const int64_t full[][2] = {{4096, 4096}, {4096, 14336}, {14336, 4096}, {576, 1536}};
    static const int64_t small[][2] = {{512, 72}};
    static const int toks_full[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
    static const int toks_small[] = {1, 9, 70};
    const int64_t(*shapes)[2] = quick ? small : full;
    const int n_shapes = quick ? 1 : 4;
    const int *toks = quick ? toks_small : toks_full;
    const int n_toks = quick ? 3 : 10;
    static const struct variant cuda_v[] = {
        {"mma16", "1", "1048576", "0", KERN_ACT_BF16}, {"mma64", "1", "0", "0", KERN_ACT_BF16},
        {"gguf", "0", "16", "0", KERN_ACT_BF16},       {"cublas", "1", "16", "1", KERN_ACT_BF16},
        {"gemv-exact", "1", "16", "0", KERN_ACT_F32},  {"q8-int8", "1", "16", "0", KERN_ACT_Q8}};
    static const struct variant cpu_v[] = {{"cpu", NULL, NULL, NULL, KERN_ACT_F32}};
    const int is_cuda = !strcmp(device, "cuda");
    const struct variant *vs = is_cuda ? cuda_v : cpu_v;
    const int n_v = is_cuda ? (int)(sizeof(cuda_v) / sizeof(cuda_v[0])) : 1;
    printf("variant\ttype\tne0\tne1\ttokens\tus_per_call\tweight_GB_s\tTFLOPS\n");
    for (int v = 0; v < n_v; v++) {
        if (vs[v].pack) {
            setenv("QUERN_CUDA_PACK", vs[v].pack, 1);
            setenv("QUERN_CUDA_MMA_SMALL", vs[v].small, 1);
            setenv("QUERN_CUDA_CUBLAS_MIN", vs[v].blas, 1);
        }
        struct kern_backend_opts o = {device, 2, NULL, vs[v].act, 1, 1, 0};
        struct kern_backend *be = NULL;
        struct err_detail err = {0};
        if (kern_backend_open(&be, &o, &err)) {
            fprintf(stderr, "bench_matmul: %s: %s\n", device, err.msg);
            return 1;
        }
        const struct kern_ops *k = be->ops;
        for (int s = 0; s < n_shapes; s++) {
            const int64_t ne0 = shapes[s][0], ne1 = shapes[s][1];
            if (type == DTYPE_Q4_K && ne0 % 256)
                continue;
            struct kern_tensor w = {0};
            uint8_t *data = random_rows(type, ne0, ne1);
            if (!data) {
                fprintf(stderr, "bench_matmul: out of memory\n");
                return 1;
            }
            w.type = type;
            w.ne0 = ne0;
            w.ne1 = ne1;
            w.row_bytes = dtype_row_bytes(type, ne0);
            w.data = data;
            if (k->prepare && k->prepare(be, &w, &err)) {
                fprintf(stderr, "bench_matmul: prepare: %s\n", err.msg);
                return 1;
            }
            const size_t wbytes =
                k->weight_bytes ? k->weight_bytes(be, &w) : w.row_bytes * (size_t)ne1;
            const int max_tok = toks[n_toks - 1];
            float *hx = malloc(sizeof(float) * (size_t)(max_tok * ne0));
            if (!hx) {
                fprintf(stderr, "bench_matmul: out of memory\n");
                return 1;
            }
            for (int64_t i = 0; i < max_tok * ne0; i++)
                hx[i] = (float)(next_u32() % 2001) / 1000.0f - 1.0f;
            float *x = k->buf_alloc(be, sizeof(float) * (size_t)(max_tok * ne0));
            float *y = k->buf_alloc(be, sizeof(float) * (size_t)(max_tok * ne1));
            if (!x || !y) {
                fprintf(stderr, "bench_matmul: no backend memory\n");
                return 1;
            }
            k->upload(be, x, hx, sizeof(float) * (size_t)(max_tok * ne0));
            for (int t = 0; t < n_toks; t++) {
                const int n = toks[t];
                const struct kern_tensor *ws[1] = {&w};
                float *const ys[1] = {y};
                const struct kern_mm_in in = {.x = x};
                k->matmul(be, ws, ys, 1, &in, n); /* warm-up */
                k->sync(be);
                int reps = quick ? 1 : 4;
                double dt = 0;
                for (;;) { /* at least 0.2 s of calls (quick: one) */
                    const double t0 = now();
                    for (int r = 0; r < reps; r++)
                        k->matmul(be, ws, ys, 1, &in, n);
                    k->sync(be);
                    dt = now() - t0;
                    if (quick || dt >= 0.2 || reps >= (1 << 20))
                        break;
                    reps *= 4;
                }
                const double per = dt / reps;
                printf("%s\t%s\t%lld\t%lld\t%d\t%.2f\t%.1f\t%.2f\n", vs[v].name,
                       dtype_get(type)->name, (long long)ne0, (long long)ne1, n, per * 1e6,
                       (double)wbytes / per * 1e-9,
                       2.0 * (double)ne0 * (double)ne1 * n / per * 1e-12);
                fflush(stdout);
            }
            k->buf_free(be, x);
            k->buf_free(be, y);
            if (k->release)
                k->release(be, &w);
            free(hx);
            free(data);
        }
        kern_backend_free(be);
    }
    return 0;
}
