/* AVX-512 attention over the paged KV cache, f16 or 8-bit (algorithm in attn_ref.c). One call
 * handles the G query heads that share a KV head, so each key and value tile is read once for
 * the group: a run of 16 keys is one masked 16-value load per channel (keys are channel-major),
 * scored against every head with broadcast FMAs; the weighted values accumulate in G x D/16
 * vector registers (8-bit KV: the quants are widened to floats the same way, a run's scores are
 * multiplied by the keys' scales and the softmax weights by the values' scales). Specialized
 * for G <= 8 and head_dim 64 or 128; other shapes use the AVX2 kernel (f16 KV). Only reached
 * through kern_cpu_fns_get(), which checks the CPU first. */
#include <immintrin.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx512.h"

#define AG_MAX_G 8
#define AG_AHEAD 4 /* blocks ahead whose tiles are prefetched into L2 */

/* Bytes [o0, o1) of block id's key and value tiles for KV head g (tb bytes each) into L1 (l1)
 * or L2. */
static ALWAYS_INLINE void prefetch_tiles(const struct kern_attn *a, int32_t id, int g, size_t tb,
                                         size_t o0, size_t o1, const int l1)
{
    const size_t tile = ((size_t)id * a->n_kv_head + (size_t)g) * tb;
    const char *k = (const char *)a->kv.k + tile;
    const char *v = (const char *)a->kv.v + tile;
    o1 = o1 < tb ? o1 : tb;
    for (size_t o = o0; o < o1; o += 64) {
        if (l1) {
            _mm_prefetch(k + o, _MM_HINT_T0);
            _mm_prefetch(v + o, _MM_HINT_T0);
        } else {
            _mm_prefetch(k + o, _MM_HINT_T1);
            _mm_prefetch(v + o, _MM_HINT_T1);
        }
    }
}

/* The prefetch stream: this call's KV blocks, then the next call's (the same thread's next
 * (token, KV head)), so the misses stay in flight across calls instead of restarting at each. */
struct pf_stream {
    const int32_t *table[2]; /* block tables */
    int32_t n[2];            /* blocks in each */
    int g[2];                /* KV heads */
};

/* Block j of the stream: its id and KV head; 0 past the end. */
static ALWAYS_INLINE int stream_block(const struct pf_stream *s, int32_t j, int32_t *id, int *g)
{
    for (int i = 0; i < 2; i++) {
        if (j < s->n[i]) {
            *id = s->table[i][j];
            *g = s->g[i];
            return 1;
        }
        j -= s->n[i];
    }
    return 0;
}

/* 16 keys or values from an f16 or 8-bit tile as floats (lanes past the mask zero). */
static ALWAYS_INLINE __m512 kv_load16(const void *p, __mmask16 m, const int Q8)
{
    if (Q8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

static ALWAYS_INLINE void attn_gn(const struct kern_attn *a, int t, int g, int tn, int gn, int cold,
                                  const int G, const int NV, const int Q8)
{
    const int D = NV * 16, B = a->block_size;
    const size_t tb = KERN_KV_TILE_BYTES(Q8 ? KERN_KV_Q8 : KERN_KV_F16, B, D), es = Q8 ? 1 : 2;
    const int32_t *table = kern_block_row(&a->bt, t);
    const int32_t n = a->pos[t] + 1;
    const float *q = a->q + ((size_t)t * a->n_head + (size_t)g * G) * D;
    float *out = a->out + ((size_t)t * a->n_head + (size_t)g * G) * D;
    __m512 acc[AG_MAX_G][NV], lsum[AG_MAX_G];
    float m[AG_MAX_G];
    _Alignas(64) float pw[AG_MAX_G][16];
    UNROLL
    for (int h = 0; h < G; h++) {
        m[h] = -1.0f / 0.0f;
        lsum[h] = _mm512_setzero_ps();
        UNROLL
        for (int j = 0; j < NV; j++)
            acc[h][j] = _mm512_setzero_ps();
    }
    struct pf_stream ps = {{table, table}, {(n + B - 1) / B, 0}, {g, gn}};
    if (tn >= 0) {
        ps.table[1] = kern_block_row(&a->bt, tn);
        ps.n[1] = (a->pos[tn] + B) / B;
    }
    int32_t pid;
    int pg;
    if (cold) { /* the first blocks' misses all in flight at once; later ones stream below */
        prefetch_tiles(a, table[0], g, tb, 0, tb, 1);
        for (int32_t b = 1; b < AG_AHEAD; b++)
            if (stream_block(&ps, b, &pid, &pg))
                prefetch_tiles(a, pid, pg, tb, 0, tb, 0);
    }
    /* bytes of each tile to prefetch per channel pair of the scores loop, whole lines */
    const size_t pstep = (tb + 64 * (size_t)(D / 2) - 1) / (64 * (size_t)(D / 2)) * 64;
    for (int32_t p0 = kern_attn_first(a, t); p0 < n;) {
        const int i0 = p0 % B;
        int cnt = B - i0 < KERN_ATTN_RUN ? B - i0 : KERN_ATTN_RUN;
        cnt = n - p0 < cnt ? (int)(n - p0) : cnt;
        const __mmask16 km = (__mmask16)((1u << cnt) - 1);
        const size_t tile = (size_t)table[p0 / B] * a->n_kv_head + (size_t)g;
        const char *kb = (const char *)a->kv.k + tile * tb, *vb = (const char *)a->kv.v + tile * tb;
        const char *kt = kb + (size_t)i0 * es;             /* channel c at kt + c * B * es */
        const char *vt = vb + (size_t)i0 * (size_t)D * es; /* token i at vt + i * D * es */
        /* while the run that ends a block computes: the next block of the stream into L1, and
         * the one AG_AHEAD blocks ahead from memory into L2 (more misses in flight than L1 can
         * track), a few lines per channel pair of the scores loop: issued all at once they
         * fill the fill buffers and stall the loads behind them */
        const char *nk = NULL, *nv = NULL, *fk = NULL, *fv = NULL; /* those tiles, or NULL */
        if (i0 + cnt == B || p0 + cnt == n) {
            const int32_t nb = p0 / B + 1;
            int32_t id;
            int kg;
            if (stream_block(&ps, nb, &id, &kg)) {
                const size_t o = ((size_t)id * a->n_kv_head + (size_t)kg) * tb;
                nk = (const char *)a->kv.k + o;
                nv = (const char *)a->kv.v + o;
            }
            if (stream_block(&ps, nb + AG_AHEAD - 1, &id, &kg)) {
                const size_t o = ((size_t)id * a->n_kv_head + (size_t)kg) * tb;
                fk = (const char *)a->kv.k + o;
                fv = (const char *)a->kv.v + o;
            }
        }
        /* scores: two partial sums per head (even and odd channels) */
        __m512 s0[AG_MAX_G], s1[AG_MAX_G];
        UNROLL
        for (int h = 0; h < G; h++)
            s0[h] = s1[h] = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 2) {
            /* (the addresses worked out once a run: recomputed here, they cost more than the
             * prefetches; past a tile's end they prefetch the next tile's first lines, which
             * never faults) */
            const size_t o0 = (size_t)(c / 2) * pstep;
            if (nk)
                for (size_t o = o0; o < o0 + pstep; o += 64) {
                    _mm_prefetch(nk + o, _MM_HINT_T0);
                    _mm_prefetch(nv + o, _MM_HINT_T0);
                }
            if (fk)
                for (size_t o = o0; o < o0 + pstep; o += 64) {
                    _mm_prefetch(fk + o, _MM_HINT_T1);
                    _mm_prefetch(fv + o, _MM_HINT_T1);
                }
            __m512 k0 = kv_load16(kt + (size_t)c * B * es, km, Q8);
            __m512 k1 = kv_load16(kt + (size_t)(c + 1) * B * es, km, Q8);
            UNROLL
            for (int h = 0; h < G; h++) {
                s0[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + c]), k0, s0[h]);
                s1[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + c + 1]), k1, s1[h]);
            }
        }
        UNROLL
        for (int h = 0; h < G; h++) {
            __m512 sc = _mm512_add_ps(s0[h], s1[h]);
            if (Q8) /* the keys' scales */
                sc = _mm512_mul_ps(sc, _mm512_maskz_loadu_ps(km, kb + (size_t)D * B + 4 * i0));
            sc = _mm512_mul_ps(sc, _mm512_set1_ps(a->scale));
            if (a->softcap > 0) { /* Gemma 2: scalar tanhf, as the reference */
                _Alignas(64) float sv[16];
                _mm512_store_ps(sv, sc);
                for (int i = 0; i < 16; i++)
                    sv[i] = kern_attn_softcap(sv[i], a->softcap);
                sc = _mm512_load_ps(sv);
            }
            sc = _mm512_mask_mov_ps(_mm512_set1_ps(-1.0f / 0.0f), km, sc);
            float bm = _mm512_reduce_max_ps(sc);
            if (bm > m[h]) {
                __m512 r = _mm512_set1_ps(kern_attn_exp(m[h] - bm)); /* 0 on the first run */
                lsum[h] = _mm512_mul_ps(lsum[h], r);
                UNROLL
                for (int j = 0; j < NV; j++)
                    acc[h][j] = _mm512_mul_ps(acc[h][j], r);
                m[h] = bm;
            }
            __m512 p = exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m[h])));
            lsum[h] = _mm512_add_ps(lsum[h], p);
            if (Q8) /* the values' scales */
                p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(km, vb + (size_t)D * B + 4 * i0));
            _mm512_store_ps(pw[h], p);
        }
        /* weighted values, two 16-channel slices at a time so their 2 G accumulators stay in
         * registers across the run (acc[][] itself does not fit them); tokens in order */
        UNROLL
        for (int j = 0; j < NV; j += 2) {
            __m512 a0[AG_MAX_G], a1[AG_MAX_G];
            UNROLL
            for (int h = 0; h < G; h++) {
                a0[h] = acc[h][j];
                a1[h] = acc[h][j + 1];
            }
            for (int i = 0; i < cnt; i++) {
                const char *vr = vt + ((size_t)i * D + 16 * (size_t)j) * es;
                const __m512 x0 = kv_load16(vr, 0xFFFF, Q8),
                             x1 = kv_load16(vr + 16 * es, 0xFFFF, Q8);
                UNROLL
                for (int h = 0; h < G; h++) {
                    const __m512 p = _mm512_set1_ps(pw[h][i]);
                    a0[h] = _mm512_fmadd_ps(p, x0, a0[h]);
                    a1[h] = _mm512_fmadd_ps(p, x1, a1[h]);
                }
            }
            UNROLL
            for (int h = 0; h < G; h++) {
                acc[h][j] = a0[h];
                acc[h][j + 1] = a1[h];
            }
        }
        p0 += cnt;
    }
    UNROLL
    for (int h = 0; h < G; h++) {
        __m512 l = _mm512_set1_ps(_mm512_reduce_add_ps(lsum[h]));
        UNROLL
        for (int j = 0; j < NV; j++)
            _mm512_storeu_ps(out + h * D + 16 * j, _mm512_div_ps(acc[h][j], l));
    }
}

/* kern_kv_quant_q8 on vectors, the same operations in the same order per element: |x| by
 * clearing the sign, the maximum over lanes (vmaxps returns its second operand, the running
 * maximum, when x is NaN: NaN is skipped as the scalar compare skips it; max is exact, so the
 * order does not matter), then x * id + 1.5 * 2^23 - 1.5 * 2^23, each rounded, truncated. */
void kern_avx512_kv_quant_q8(const float *x, int n, int8_t *q, float *scale)
{
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512i nosign = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 a = _mm512_castsi512_ps(
            _mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, x + i)), nosign));
        mx = _mm512_max_ps(a, mx);
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const float id = kern_kv_quant_inv(amax);
    const __m512 vid = _mm512_set1_ps(id);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_sub_ps(
            _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vid), magic), magic);
        _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
    }
    *scale = amax / 127.0f;
}

/* One function per shape (G heads, NV 16-channel vectors, 8-bit or f16 KV): compiled apart, each
 * gets the registers to itself (inlined together into one switch, GCC kept most of the scores'
 * accumulators on the stack inside the channel loop). */
#define AG_FN(G, NV, Q8)                                                                           \
    static __attribute__((noinline)) void attn_##G##_##NV##_##Q8(const struct kern_attn *a, int t, \
                                                                 int g, int tn, int gn, int cold)  \
    {                                                                                              \
        attn_gn(a, t, g, tn, gn, cold, G, NV, Q8);                                                 \
    }
#define AG_FNS(G) AG_FN(G, 4, 0) AG_FN(G, 4, 1) AG_FN(G, 8, 0) AG_FN(G, 8, 1)
AG_FNS(1)
AG_FNS(2)
AG_FNS(3)
AG_FNS(4)
AG_FNS(5)
AG_FNS(6)
AG_FNS(7)
AG_FNS(8)

#define AG_CASE(G)                                                                                 \
    case (G)*16 + 4:                                                                               \
        (q8 ? attn_##G##_4_1 : attn_##G##_4_0)(a, t, g, tn, gn, cold);                             \
        return;                                                                                    \
    case (G)*16 + 8:                                                                               \
        (q8 ? attn_##G##_8_1 : attn_##G##_8_0)(a, t, g, tn, gn, cold);                             \
        return;

void kern_avx512_attn_group(const struct kern_attn *a, int t, int g, int tn, int gn, int cold)
{
    const int G = a->n_head / a->n_kv_head, q8 = a->kv.dtype == KERN_KV_Q8;
    if (a->head_dim % 16 == 0 && G <= AG_MAX_G) {
        switch (G * 16 + a->head_dim / 16) {
            AG_CASE(1)
            AG_CASE(2)
            AG_CASE(3)
            AG_CASE(4)
            AG_CASE(5)
            AG_CASE(6)
            AG_CASE(7)
            AG_CASE(8)
        default:
            break;
        }
    }
    /* other shapes (Gemma's head_dim 256: 16 vectors per head would not fit the registers for
     * a whole group): the AVX2 kernel, one head at a time, itself the scalar one for 8-bit KV */
    kern_avx2_attn_group(a, t, g, tn, gn, cold);
}
