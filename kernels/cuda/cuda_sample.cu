/* Sampling on the device (kern_ops.sample): engine_sample's algorithm (engine/sampler.c and
 * engine/sampler_rows.c) step for step, one block of SMP_THREADS threads per row, so that a row
 * drawn here gives bitwise the token the host sampler gives for the same logits and uniform:
 * the same weights (the same e^x polynomial, no fused multiply-adds: every float step is an
 * __f*_rn intrinsic, which nvcc never contracts), the same sums in the same order (per 256-token
 * chunk 16 lanes of float sums, combined in double, chunks added in order), the same ranking
 * (larger weight first, ties to the lower id). Only ranking is done differently: a radix select
 * (top_k, top log-probabilities) or a bound (top_p, min_p) picks the candidates, and a bitonic
 * sort in shared memory ranks at most SMP_CAP of them; a row that needs more is left to the host
 * (id -1), which draws the same token from the whole row. */
#ifdef KCU_EMU
#include "kernels/cuda/emu/kemu.h" /* compiled as C++ for the CPU emulator (make CUDA=emu) */
#else
#include <cuda_runtime.h>
#define KCU_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#endif
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_launch.h"

#define SMP_THREADS 256
#define SMP_WARPS   (SMP_THREADS / 32)
#define SMP_CAP     4096 /* most candidates a row ranks on the device */
#define SMP_CHUNK   256  /* tokens per chunk of the row total (engine/sampler_internal.h) */
#define SMP_LANES   16   /* lanes of a chunk's float sums */
#define SMP_GROUPS  (SMP_THREADS / SMP_LANES)
#define SMP_TIGHT   1e-3f /* top_p's first, tighter bound (engine/sampler_rows.c TOP_P_TIGHT) */
#define SMP_FULL    0xffffffffu

typedef unsigned long long u64;

/* The block's shared state: the candidates being ranked (64-bit keys, see cand_key) and the
 * scratch of the reductions. */
struct smp_shared {
    u64 key[SMP_CAP];
    int hist[256];
    u64 red[SMP_WARPS];
    float redf[SMP_WARPS];
    int count;
    int done;
    int id;
    u64 prefix;
    int shift;
    float mx;
    double total;
};

/* engine_sampler_exp_nonpos: e^x for x <= 0 (0 below -80, for -inf and for NaN), the same
 * float operations in the same order. */
static __device__ __forceinline__ float smp_exp(float x)
{
    const float log2e = 1.44269504f, ln2_hi = 0.693145751953125f, ln2_lo = 1.42860677e-6f;
    const float magic = 12582912.0f;
    if (!(x >= -80.0f))
        return 0.0f;
    const float n = __fsub_rn(__fadd_rn(__fmul_rn(x, log2e), magic), magic);
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, ln2_hi)), __fmul_rn(n, ln2_lo));
    float p = 1.0f / 720.0f;
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 120.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 24.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 6.0f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    const float scale = __uint_as_float((uint32_t)((int32_t)n + 127) << 23);
    return __fmul_rn(p, scale);
}

/* engine_sampler_cand_weight */
static __device__ __forceinline__ float smp_weight(float l, float mx)
{
    return l == mx ? 1.0f : smp_exp(__fsub_rn(l, mx));
}

/* rank_key (engine/sampler_rows.c): a smaller key is a larger value; -0 folds into +0. */
static __device__ __forceinline__ uint32_t rank_key(float v)
{
    const uint32_t u = __float_as_uint(__fadd_rn(v, 0.0f));
    const uint32_t neg = 0u - (u >> 31);
    return u ^ (~neg & 0x7fffffffu);
}

/* The value of a rank key (+0 for a folded -0). */
static __device__ __forceinline__ float key_value(uint32_t k)
{
    return __uint_as_float(k & 0x80000000u ? k : k ^ 0x7fffffffu);
}

/* A candidate's sort key: rank first, then the id, so ascending keys are the ranking and every
 * key of a row is distinct. */
static __device__ __forceinline__ u64 cand_key(float v, int id)
{
    return (u64)rank_key(v) << 32 | (uint32_t)id;
}

static __device__ __forceinline__ float cand_value(u64 k)
{
    return key_value((uint32_t)(k >> 32));
}

static __device__ __forceinline__ int cand_id(u64 k)
{
    return (int)(uint32_t)k;
}

static __device__ __forceinline__ float nan_to_ninf(float v)
{
    return v == v ? v : -INFINITY;
}

/* Logit i of a row as the sampler sees it: -inf where the row's mask (NULL: none) forbids it. */
static __device__ __forceinline__ float masked(const float *x, const uint32_t *mask, int i)
{
    return mask && !(mask[i / 32] >> (i % 32) & 1u) ? -INFINITY : x[i];
}

/* ---- block reductions (every thread calls them; all get the result) ---- */

/* The largest v over the block (`>`: a NaN never wins over a number); red: one slot a warp. */
template <class T> static __device__ T block_max(T *red, T v)
{
    for (int o = 16; o > 0; o /= 2) {
        const T x = __shfl_xor_sync(SMP_FULL, v, o);
        v = x > v ? x : v;
    }
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    T r = red[0];
    for (int w = 1; w < SMP_WARPS; w++)
        r = red[w] > r ? red[w] : r;
    __syncthreads();
    return r;
}

/* Sort sh->key[0..n) ascending (n <= SMP_CAP): bitonic, padded to a power of two. */
static __device__ void sort_keys(struct smp_shared *sh, int n)
{
    int N = 1;
    while (N < n)
        N *= 2;
    for (int i = n + (int)threadIdx.x; i < N; i += SMP_THREADS)
        sh->key[i] = ~0ull;
    __syncthreads();
    for (int k = 2; k <= N; k *= 2)
        for (int j = k / 2; j > 0; j /= 2) {
            for (int i = threadIdx.x; i < N; i += SMP_THREADS) {
                const int p = i ^ j;
                if (p > i) {
                    const u64 a = sh->key[i], b = sh->key[p];
                    if ((a > b) == ((i & k) == 0)) {
                        sh->key[i] = b;
                        sh->key[p] = a;
                    }
                }
            }
            __syncthreads();
        }
}

/* The k (1 <= k <= min(SMP_CAP, n)) best tokens of row x (NaN ranks as -inf), ranked, in
 * sh->key[0..k): a radix select of the k-th smallest cand_key, 8 bits a pass from the top,
 * stopping once every key left in the chosen bin is taken. */
static __device__ void select_top(struct smp_shared *sh, const float *x, const uint32_t *mask,
                                  int n, int k)
{
    if (threadIdx.x == 0) {
        sh->prefix = 0;
        sh->shift = 64;
        sh->count = k; /* still to take */
        sh->done = 0;
    }
    __syncthreads();
    while (!sh->done) {
        const int shift = sh->shift - 8, hi = shift + 8;
        const u64 prefix = sh->prefix;
        for (int b = threadIdx.x; b < 256; b += SMP_THREADS)
            sh->hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += SMP_THREADS) {
            const u64 key = cand_key(nan_to_ninf(masked(x, mask, i)), i);
            if (hi >= 64 || key >> hi == prefix >> hi)
                atomicAdd(&sh->hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int cum = 0, b = 0;
            for (; b < 255 && cum + sh->hist[b] < sh->count; b++)
                cum += sh->hist[b];
            sh->prefix |= (u64)b << shift;
            sh->count -= cum;
            sh->shift = shift;
            sh->done = sh->hist[b] == sh->count;
        }
        __syncthreads();
    }
    const int shift = sh->shift;
    const u64 bar = sh->prefix >> shift;
    __syncthreads();
    if (threadIdx.x == 0)
        sh->count = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += SMP_THREADS) {
        const u64 key = cand_key(nan_to_ninf(masked(x, mask, i)), i);
        if (key >> shift <= bar)
            sh->key[atomicAdd(&sh->count, 1)] = key;
    }
    __syncthreads();
    sort_keys(sh, k);
}

/* engine_sample's end (thread 0): over the ranked weights sh->key[0..m), the top_p prefix, then
 * min_p, then the inverse-CDF draw with the uniform u over what is kept. total: the weights'
 * total (the row's, or the top_k candidates'); top_k: whether these are top_k's candidates
 * (then their total stands when nothing more is cut). */
static __device__ int draw_ranked(const struct smp_shared *sh, int m, double total, int top_k,
                                  const struct kcu_sample *R)
{
    const int m_weighed = m;
    if (R->top_p < 1.0f) {
        const double target = (double)R->top_p * total;
        double cum = 0.0;
        for (int j = 0; j < m; j++) {
            cum += cand_value(sh->key[j]);
            if (cum >= target) {
                m = j + 1;
                break;
            }
        }
    }
    if (R->min_p > 0.0f) {
        int kept = 0;
        while (kept < m && cand_value(sh->key[kept]) >= R->min_p)
            kept++;
        m = kept;
    }
    double kept_total = total;
    if (m != m_weighed || !top_k) {
        kept_total = 0.0;
        for (int j = 0; j < m; j++)
            kept_total += cand_value(sh->key[j]);
    }
    const double u = R->u * kept_total;
    double cum = 0.0;
    int last = 0;
    for (int j = 0; j < m; j++) {
        const float w = cand_value(sh->key[j]);
        cum += w;
        if (w > 0.0f)
            last = j;
        if (u < cum)
            return cand_id(sh->key[j]);
    }
    return cand_id(sh->key[last]);
}

/* engine_sampler_scale_chunks: row l scaled in place by 1/t (NaN -> -inf); zc[c], mc[c] the
 * weight and maximum of chunk c; returns the row maximum in sh->mx and the total in sh->total.
 * Group g of SMP_LANES threads does chunks g, g + SMP_GROUPS, ..., lane k summing the chunk's
 * elements k, k + 16, ... as the host's vector lane k does. */
static __device__ void scale_chunks(struct smp_shared *sh, float *l, int n, float t, double *zc,
                                    float *mc)
{
    const int nc = (n + SMP_CHUNK - 1) / SMP_CHUNK, lane = threadIdx.x % SMP_LANES;
    const int g = threadIdx.x / SMP_LANES, base = (threadIdx.x & 31) & ~(SMP_LANES - 1);
    for (int q = 0; q * SMP_GROUPS < nc; q++) { /* every lane of a warp goes round together */
        const int c = q * SMP_GROUPS + g, ok = c < nc;
        const int i0 = c * SMP_CHUNK, i1 = ok ? (n - i0 < SMP_CHUNK ? n : i0 + SMP_CHUNK) : i0;
        const int iv = i0 + (i1 - i0) / SMP_LANES * SMP_LANES; /* end of the vector part */
        float hi = -INFINITY;
        for (int i = i0 + lane; i < i1; i += SMP_LANES) {
            float v = l[i];
            if (t != 1.0f)
                v = __fdiv_rn(v, t);
            v = nan_to_ninf(v);
            l[i] = v;
            hi = v > hi ? v : hi;
        }
        for (int o = SMP_LANES / 2; o > 0; o /= 2) {
            const float x = __shfl_xor_sync(SMP_FULL, hi, o);
            hi = x > hi ? x : hi;
        }
        __syncwarp();
        float acc = 0.0f;
        for (int i = i0 + lane; i < iv; i += SMP_LANES) {
            const float v = l[i];
            acc = __fadd_rn(acc, v == hi ? 1.0f : smp_exp(__fsub_rn(v, hi)));
        }
        float a[SMP_LANES];
        for (int k = 0; k < SMP_LANES; k++)
            a[k] = __shfl_sync(SMP_FULL, acc, base + k);
        if (ok && lane == 0) {
            float tail = 0.0f;
            for (int i = iv; i < i1; i++)
                tail = __fadd_rn(tail, smp_weight(l[i], hi));
            double z = tail;
            for (int k = 0; k < SMP_LANES; k += 4)
                z += ((double)a[k] + a[k + 1]) + ((double)a[k + 2] + a[k + 3]);
            zc[c] = z;
            mc[c] = hi;
        }
        __syncwarp();
    }
    __syncthreads();
    float m = -INFINITY;
    for (int c = threadIdx.x; c < nc; c += SMP_THREADS)
        m = mc[c] > m ? mc[c] : m;
    const float mx = block_max(sh->redf, m);
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int c = 0; c < nc; c++) { /* (the intrinsics: never fused into an FMA) */
            zc[c] = __dmul_rn(zc[c], (double)smp_weight(mc[c], mx));
            sum = __dadd_rn(sum, zc[c]);
        }
        sh->mx = mx;
        sh->total = sum;
    }
    __syncthreads();
}

/* engine_sampler_draw_row (thread 0): the inverse CDF over the whole scaled row in id order. */
static __device__ int draw_row(const float *l, int n, float mx, const double *zc, double total,
                               double u)
{
    const int nc = (n + SMP_CHUNK - 1) / SMP_CHUNK;
    const double target = u * total;
    double cum = 0.0;
    int c = 0, last_c = 0;
    for (; c < nc; c++) {
        if (zc[c] > 0.0)
            last_c = c;
        if (target < cum + zc[c])
            break;
        cum += zc[c];
    }
    if (c == nc)
        c = last_c;
    const int i0 = c * SMP_CHUNK, i1 = n - i0 < SMP_CHUNK ? n : i0 + SMP_CHUNK;
    int last = i0;
    for (int i = i0; i < i1; i++) {
        const float w = smp_weight(l[i], mx);
        if (w > 0.0f)
            last = i;
        cum += w;
        if (target < cum && w > 0.0f)
            return i;
    }
    return last;
}

/* The tokens of weight >= b (engine_sampler_truncate_row's bound) ranked into sh->key; returns
 * how many, or SMP_CAP + 1 when there are more than SMP_CAP. */
static __device__ int collect(struct smp_shared *sh, const float *l, int n, float mx, float b)
{
    if (threadIdx.x == 0)
        sh->count = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += SMP_THREADS) {
        const float w = smp_weight(l[i], mx);
        if (w >= b) {
            const int at = atomicAdd(&sh->count, 1);
            if (at < SMP_CAP)
                sh->key[at] = cand_key(w, i);
        }
    }
    __syncthreads();
    const int m = sh->count;
    __syncthreads();
    if (m > SMP_CAP)
        return SMP_CAP + 1;
    sort_keys(sh, m);
    return m;
}

/* engine_logprobs of the raw row x (masked) for the chosen token: its log-probability and the
 * lp_k most likely tokens' (thread 0 writes them). The normaliser's sum as the host's
 * (engine_sampler_weight_sum): one thread a chunk, lane k of 16 adding the chunk's tokens k,
 * k + 16, ... in float, the tail apart, the lanes pairwise in double, the chunks in double in
 * order. part: one double per chunk of scratch. */
static __device__ void logprobs(struct smp_shared *sh, const float *x, const uint32_t *mask, int n,
                                int chosen, int lp_k, double *part, struct kcu_sample_out *o)
{
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += SMP_THREADS) {
        const float v = masked(x, mask, i);
        m = v > m ? v : m;
    }
    const float mx = block_max(sh->redf, m);
    const int nc = (n + SMP_CHUNK - 1) / SMP_CHUNK;
    for (int c = threadIdx.x; c < nc; c += SMP_THREADS) {
        const int i0 = c * SMP_CHUNK, i1 = n - i0 < SMP_CHUNK ? n : i0 + SMP_CHUNK;
        const int iv = i0 + (i1 - i0) / SMP_LANES * SMP_LANES; /* end of the lanes' part */
        float a[SMP_LANES];
        for (int k = 0; k < SMP_LANES; k++)
            a[k] = 0.0f;
        for (int b = i0; b < iv; b += SMP_LANES)
            for (int k = 0; k < SMP_LANES; k++)
                a[k] = __fadd_rn(a[k], smp_weight(masked(x, mask, b + k), mx));
        float tail = 0.0f;
        for (int i = iv; i < i1; i++)
            tail = __fadd_rn(tail, smp_weight(masked(x, mask, i), mx));
        double z = tail;
        for (int k = 0; k < SMP_LANES; k += 4)
            z += ((double)a[k] + a[k + 1]) + ((double)a[k + 2] + a[k + 3]);
        part[c] = z;
    }
    __syncthreads();
    const int k = lp_k < n ? lp_k : n;
    if (k > 0)
        select_top(sh, x, mask, n, k);
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int c = 0; c < nc; c++)
            sum += part[c];
        const double norm = (double)mx + log(sum);
        const float lc = masked(x, mask, chosen);
        o->lp = lc == lc ? (float)((double)lc - norm) : -INFINITY;
        for (int j = 0; j < k; j++) {
            o->top_id[j] = cand_id(sh->key[j]);
            o->top_lp[j] = (float)((double)cand_value(sh->key[j]) - norm);
        }
    }
    __syncthreads();
}

/* One row: penalties, then greedy, top_k, the whole row, or top_p/min_p (engine_sample). */
__global__ void __launch_bounds__(SMP_THREADS)
    k_sample(const float *logits, float *work, double *zc_all, float *mc_all, int n,
             const struct kcu_sample *rows, const int32_t *pen_id, const int32_t *pen_count,
             const uint32_t *masks, struct kcu_sample_out *out)
{
    __shared__ struct smp_shared sh;
    const struct kcu_sample R = rows[blockIdx.x];
    struct kcu_sample_out *o = out + blockIdx.x;
    if (R.host) {
        if (threadIdx.x == 0)
            o->id = -1;
        return;
    }
    const int nc = (n + SMP_CHUNK - 1) / SMP_CHUNK;
    const float *raw = logits + (size_t)blockIdx.x * n;
    float *l = work + (size_t)blockIdx.x * n;
    double *zc = zc_all + (size_t)blockIdx.x * nc;
    float *mc = mc_all + (size_t)blockIdx.x * nc;
    const uint32_t *mask = R.mask >= 0 ? masks + (size_t)R.mask * (size_t)((n + 31) / 32) : NULL;
    for (int i = threadIdx.x; i < n; i += SMP_THREADS)
        l[i] = masked(raw, mask, i);
    __syncthreads();
    for (int e = threadIdx.x; e < R.pen_n; e += SMP_THREADS) { /* distinct tokens */
        const int t = pen_id[R.pen_first + e];
        float v = l[t];
        if (R.repeat_penalty != 1.0f)
            v = v > 0.0f ? __fdiv_rn(v, R.repeat_penalty) : __fmul_rn(v, R.repeat_penalty);
        const int32_t c = pen_count[R.pen_first + e]; /* generated occurrences (0: prompt only) */
        v = __fsub_rn(v, __fadd_rn(__fmul_rn((float)c, R.frequency_penalty),
                                   c > 0 ? R.presence_penalty : 0.0f));
        l[t] = v;
    }
    __syncthreads();
    const float t = R.temperature;
    int id = -1;
    if (t == 0.0f) { /* the largest value (NaN as -inf), ties to the lowest id */
        u64 best = 0;
        for (int i = threadIdx.x; i < n; i += SMP_THREADS) {
            const uint32_t b = __float_as_uint(__fadd_rn(nan_to_ninf(l[i]), 0.0f));
            const uint32_t ord = b & 0x80000000u ? ~b : b | 0x80000000u;
            const u64 k = (u64)ord << 32 | (uint32_t) ~(uint32_t)i;
            best = k > best ? k : best;
        }
        id = (int)~(uint32_t)block_max(sh.red, best);
    } else if (R.top_k > 0 && R.top_k < n) {
        if (R.top_k <= SMP_CAP) {
            const int k = R.top_k;
            select_top(&sh, l, NULL, n, k);
            if (threadIdx.x == 0) { /* scaled by t, weighed against the best, re-ranked */
                const float best = cand_value(sh.key[0]);
                const float mx = t == 1.0f ? best : __fdiv_rn(best, t);
                double total = 0.0;
                for (int j = 0; j < k; j++) {
                    const float v = cand_value(sh.key[j]);
                    const float w = smp_weight(t == 1.0f ? v : __fdiv_rn(v, t), mx);
                    total += w;
                    sh.key[j] = cand_key(w, cand_id(sh.key[j]));
                }
                sh.total = total;
            }
            __syncthreads();
            sort_keys(&sh, k);
            if (threadIdx.x == 0)
                sh.id = draw_ranked(&sh, k, sh.total, 1, &R);
            __syncthreads();
            id = sh.id;
        }
    } else {
        scale_chunks(&sh, l, n, t, zc, mc);
        const float mx = sh.mx;
        const double total = sh.total;
        if (R.top_p >= 1.0f && R.min_p <= 0.0f) {
            if (threadIdx.x == 0)
                sh.id = draw_row(l, n, mx, zc, total, R.u);
        } else {
            const double target = (double)R.top_p * total;
            float bound = R.min_p;
            if (R.top_p < 1.0f) {
                const float loose = (float)((1.0 - (double)R.top_p) * total / (double)n);
                bound = loose > bound ? loose : bound;
            }
            if (threadIdx.x == 0)
                sh.id = -1;
            for (int tier = R.top_p < 1.0f && SMP_TIGHT > bound ? 0 : 1; tier < 2; tier++) {
                const float b = tier ? bound : SMP_TIGHT;
                const int m = collect(&sh, l, n, mx, b);
                if (m > SMP_CAP)
                    break; /* too many: the host ranks the whole row */
                if (threadIdx.x == 0) {
                    double cum = 0.0;
                    for (int j = 0; j < m && R.top_p < 1.0f; j++)
                        cum += cand_value(sh.key[j]);
                    if (R.top_p >= 1.0f || cum >= target || R.min_p >= b)
                        sh.id = draw_ranked(&sh, m, total, 0, &R);
                }
                __syncthreads();
                if (sh.id >= 0)
                    break;
            }
        }
        __syncthreads();
        id = sh.id;
    }
    if (id >= 0 && R.lp_k >= 0)
        logprobs(&sh, raw, mask, n, id, R.lp_k, zc, o); /* zc is free after the draw */
    if (threadIdx.x == 0)
        o->id = id;
}

extern "C" int kcu_sample(void *stream, const float *logits, float *work, double *zc, float *mc,
                          int n, int n_vocab, const struct kcu_sample *rows, const int32_t *pen_id,
                          const int32_t *pen_count, const uint32_t *masks,
                          struct kcu_sample_out *out)
{
    if (n <= 0)
        return 0;
    KCU_LAUNCH(k_sample, n, SMP_THREADS, (cudaStream_t)stream)
    (logits, work, zc, mc, n_vocab, rows, pen_id, pen_count, masks, out);
    return (int)cudaGetLastError();
}
