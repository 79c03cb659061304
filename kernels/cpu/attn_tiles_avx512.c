/* bf16 mode's attention on AMX-BF16 tiles (kern_cpu_fns.attn_tiles; the algorithm is stated
 * there), over the CPU backend's KERN_KV_BF16T pool, whose keys and values are laid out as the
 * tile unit reads them (kernels.h), so nothing is converted on the way. One call takes some
 * tokens of one sequence and one KV head; their query rows go through in tiles of 16 rows (any
 * mix of tokens and heads): every score on the tiles, 32 positions at a time, into memory; the
 * softmax weights on 16-lane vectors; the weighted values on the tiles again, 16 positions at a
 * time into sums that stay in the tiles. Rows never mix: a row's result is the same whichever
 * rows share its tile, so the results are batch invariant. Only reached through the AMX
 * table. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"
#include "kernels/cpu/simd_avx512.h"

#define AT_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define AT_KEYS   KERN_ATTN_TILE_KEYS /* positions per key block */

/* Tiles: 0, 1 the scores of positions 0-15 / 16-31 of a block; 2, 3 the queries (32 channels
 * each); 6, 7 16 positions' keys (16 rows of channel pairs); then 0-3 the value sums of 16
 * channels each, 5 the weights of 16 positions, 4 16 positions' values (8 rows of position
 * pairs). nr: the tile's query rows. */
static __thread int at_rows; /* the loaded configuration's query rows (0: none known) */

static AT_TARGET void at_config(int nr)
{
    struct amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = i == 5 ? 32 : 64;
        c.rows[i] = (uint8_t)(i >= 6 ? 16 : i == 4 ? 8 : nr);
    }
    _tile_loadconfig(&c);
}

/* hi's and lo's 16 floats rounded to bfloat16 (nearest even; lo's in words 0-15), each NaN or
 * infinity (also one a finite value rounded to) made 0. */
static ALWAYS_INLINE AT_TARGET __m512i at_bf16_finite(__m512 hi, __m512 lo)
{
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(hi, lo), e = _mm512_set1_epi16(0x7F80);
    return _mm512_maskz_mov_epi16(_mm512_cmpneq_epi16_mask(_mm512_and_si512(w, e), e), w);
}

/* Token i's key and value rows of one head into a KERN_KV_BF16T tile (kt, vt: words), rounded
 * to bfloat16 (nearest even), NaN and infinities (also a finite value that rounds to one)
 * stored as 0: a tile product reads whole runs
 * of 16 positions, weighing the ones past a sequence's end 0, and 0 times what an earlier owner
 * of the block left there must be 0. */
AT_TARGET void kern_amx_kv_store_tiles(const float *k, const float *v, uint16_t *kt, uint16_t *vt,
                                       int B, int D, int i)
{
    const __m512i lane =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32(B));
    uint32_t *kd = (uint32_t *)kt + i; /* channel pair r at kd[r * B] */
    for (int c = 0; c < D; c += 32)    /* dword r = channels (2r, 2r + 1) */
        _mm512_i32scatter_epi32(kd + (size_t)(c / 2) * B, lane,
                                at_bf16_finite(_mm512_loadu_ps(k + c + 16), _mm512_loadu_ps(k + c)),
                                4);
    uint16_t *vr = vt + (size_t)(i / 2) * D * 2 + (i & 1); /* channel c at vr[2c] */
    for (int c = 0; c < D; c += 32) {
        const __m512i w = at_bf16_finite(_mm512_loadu_ps(v + c + 16), _mm512_loadu_ps(v + c));
        /* word j to dword j's low (even i) or high (odd i) half */
        const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(w));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1));
        const __mmask32 keep = i & 1 ? 0xAAAAAAAAu : 0x55555555u;
        uint16_t *o = vr - (i & 1) + (size_t)c * 2;
        _mm512_mask_storeu_epi16(o, keep, i & 1 ? _mm512_slli_epi32(lo, 16) : lo);
        _mm512_mask_storeu_epi16(o + 32, keep, i & 1 ? _mm512_slli_epi32(hi, 16) : hi);
    }
}

/* 32 lanes of bfloat16 (words) summed as floats, in one fixed order. */
static ALWAYS_INLINE AT_TARGET float at_sum_bf16(__m512i w)
{
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    return _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
}

/* Where positions [p, p + 16) of KV head g are in the pool: their keys (16 rows of channel
 * pairs, B * 4 bytes apart) and values (8 rows of position pairs, D * 4 bytes apart). */
static ALWAYS_INLINE void at_where(const struct kern_attn *a, const int32_t *table, int g,
                                   int32_t p, const uint16_t **k, const uint16_t **v)
{
    const int D = a->head_dim, B = a->block_size;
    const size_t tile = ((size_t)table[p / B] * (size_t)a->n_kv_head + (size_t)g) * (size_t)B * D;
    *k = (const uint16_t *)a->kv.k + tile + (size_t)(p % B) * 2;
    *v = (const uint16_t *)a->kv.v + tile + (size_t)(p % B) * D;
}

/* Positions [p, p + 16) of one pool block (KV head g) toward L2: their key rows (D / 2 lines,
 * B * 4 bytes apart) and their values (D / 2 lines in a row). */
static ALWAYS_INLINE void at_prefetch(const struct kern_attn *a, const int32_t *table, int g,
                                      int32_t p)
{
    const uint16_t *k, *v;
    at_where(a, table, g, p, &k, &v);
    for (int r = 0; r < a->head_dim / 2; r++) {
        _mm_prefetch((const char *)k + (size_t)r * a->block_size * 4, _MM_HINT_T1);
        _mm_prefetch((const char *)v + (size_t)r * 64, _MM_HINT_T1);
    }
}

AT_TARGET void kern_amx_attn_tiles(const struct kern_attn *a, const int32_t *toks, int n, int g,
                                   void *ws, const struct kern_tiles_next *next)
{
    const int D = a->head_dim, G = a->n_head / a->n_kv_head, NC = D / 32, NV = D / 16;
    const int32_t *table = kern_block_row(&a->bt, toks[0]);
    int32_t lo = INT32_MAX, hi = -1;
    for (int i = 0; i < n; i++) {
        const int32_t f = kern_attn_first(a, toks[i]);
        lo = f < lo ? f : lo;
        hi = a->pos[toks[i]] > hi ? a->pos[toks[i]] : hi;
    }
    if (!next || next->cold)
        at_rows = 0; /* the first call of a pass: another configuration may be loaded */
    const int32_t np = (hi / AT_KEYS - lo / AT_KEYS + 1) * AT_KEYS; /* positions spanned */
    uint16_t *qb = ws;                                              /* 16 rows x D: the queries */
    float *sb = (float *)(qb + 16 * (size_t)D);                     /* 16 rows x np: scores */
    uint16_t *pb = (uint16_t *)(sb + 16 * (size_t)np);              /* 16 rows x np: weights */
    float *cb = (float *)(pb + 16 * (size_t)np);                    /* 16 rows x 64: value sums */
    const int rows = n * G;
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int nr = rows - r0 < 16 ? rows - r0 : 16;
        int32_t rf[16], rp[16];
        float m[16], l[16];
        float *out[16];
        int32_t rlo = INT32_MAX, rhi = -1;
        for (int i = 0; i < nr; i++) {
            const int t = toks[(r0 + i) / G], hd = g * G + (r0 + i) % G;
            const float *q = a->q + ((size_t)t * a->n_head + (size_t)hd) * D;
            rf[i] = kern_attn_first(a, t);
            rp[i] = a->pos[t];
            rlo = rf[i] < rlo ? rf[i] : rlo;
            rhi = rp[i] > rhi ? rp[i] : rhi;
            out[i] = a->out + ((size_t)t * a->n_head + (size_t)hd) * D;
            for (int c = 0; c < D; c += 32)
                _mm512_store_si512((__m512i *)(qb + (size_t)i * D + c),
                                   (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 16),
                                                                _mm512_loadu_ps(q + c)));
        }
        const int32_t j0 = rlo / AT_KEYS, j1 = rhi / AT_KEYS, base = (lo / AT_KEYS) * AT_KEYS;
        if (at_rows != nr) { /* (the configuration stays loaded from call to call) */
            at_config(nr);
            at_rows = nr;
        }
        if (r0 || !next || next->cold)
            for (int32_t p = rlo / 16 * 16; p <= rhi && p < rlo / 16 * 16 + 32; p += 16)
                at_prefetch(a, table, g, p); /* the first block's (else the last call did) */
        AMX_FENCE();
        if (NC <= 2) { /* the queries stay in tiles 2, 3 */
            _tile_loadd(2, qb, 2 * D);
            if (NC == 2)
                _tile_loadd(3, qb + 32, 2 * D);
        }
        /* pass 1: every score of the tile's rows */
        for (int32_t j = j0; j <= j1; j++) {
            const int32_t p0 = j * AT_KEYS;
            for (int32_t p = p0 + AT_KEYS; p <= rhi && p < p0 + 2 * AT_KEYS; p += 16)
                at_prefetch(a, table, g, p); /* the next block's, while this one computes */
            const int use0 = p0 <= rhi && p0 + 15 >= rlo, use1 = p0 + 16 <= rhi && p0 + 31 >= rlo;
            const uint16_t *k0 = NULL, *k1 = NULL, *v;
            if (use0)
                at_where(a, table, g, p0, &k0, &v);
            if (use1)
                at_where(a, table, g, p0 + 16, &k1, &v);
            _tile_zero(0);
            _tile_zero(1);
            for (int ch = 0; ch < NC; ch++) {
                if (NC > 2) {
                    if (ch & 1)
                        _tile_loadd(3, qb + 32 * ch, 2 * D);
                    else
                        _tile_loadd(2, qb + 32 * ch, 2 * D);
                }
                const size_t ko = (size_t)ch * 32 * a->block_size;
/* the keys of the two halves times query tile QT (tile numbers are immediates) */
#define AT_SCORES(QT)                                                                              \
    do {                                                                                           \
        if (k0) {                                                                                  \
            _tile_loadd(6, k0 + ko, 4 * a->block_size);                                            \
            _tile_dpbf16ps(0, QT, 6);                                                              \
        }                                                                                          \
        if (k1) {                                                                                  \
            _tile_loadd(7, k1 + ko, 4 * a->block_size);                                            \
            _tile_dpbf16ps(1, QT, 7);                                                              \
        }                                                                                          \
    } while (0)
                if (ch & 1)
                    AT_SCORES(3);
                else
                    AT_SCORES(2);
#undef AT_SCORES
            }
            _tile_stored(0, sb + (p0 - base), 4 * np);
            _tile_stored(1, sb + (p0 - base) + 16, 4 * np);
        }
        AMX_FENCE();
        /* the rows' own scores (scaled, capped), their maximum, the weights and their sum */
        const __m512 ninf = _mm512_set1_ps(-1.0f / 0.0f), sv = _mm512_set1_ps(a->scale);
        for (int i = 0; i < nr; i++) {
            float *sr = sb + (size_t)i * np - base;
            uint16_t *pr = pb + (size_t)i * np - base;
            __m512 mx = ninf;
            for (int32_t p0 = j0 * AT_KEYS; p0 < (j1 + 1) * AT_KEYS; p0 += 16) {
                const int32_t k0 = rf[i] > p0 ? rf[i] - p0 : 0;
                const int32_t k1 = rp[i] - p0 < 15 ? rp[i] - p0 : 15;
                const __mmask16 km =
                    k0 > k1 ? 0 : (__mmask16)(((2u << k1) - 1) & ~((1u << k0) - 1));
                __m512 x = _mm512_mask_mul_ps(ninf, km, _mm512_load_ps(sr + p0), sv);
                if (a->softcap > 0 && km) {
                    _mm512_store_ps(sr + p0, x);
                    for (int k = k0; k <= k1; k++)
                        sr[p0 + k] = kern_attn_softcap(sr[p0 + k], a->softcap);
                    x = _mm512_load_ps(sr + p0);
                }
                _mm512_store_ps(sr + p0, x);
                mx = _mm512_max_ps(mx, x);
            }
            m[i] = _mm512_reduce_max_ps(mx);
            const __m512 mv = _mm512_set1_ps(m[i]);
            float li = 0.0f;
            for (int32_t p0 = j0 * AT_KEYS; p0 <= j1 * AT_KEYS; p0 += AT_KEYS) {
                const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(
                    exp16(_mm512_sub_ps(_mm512_load_ps(sr + p0 + 16), mv)),
                    exp16(_mm512_sub_ps(_mm512_load_ps(sr + p0), mv)));
                _mm512_store_si512((__m512i *)(pr + p0), w);
                li += at_sum_bf16(w);
            }
            l[i] = li;
        }
        AMX_FENCE();
        /* pass 2: weights times values, 64 channels (tiles 0-3) at a time */
        for (int c0 = 0; c0 < NV; c0 += 4) {
            const int nc = NV - c0 < 4 ? NV - c0 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int32_t p = j0 * AT_KEYS; p <= rhi; p += 16) {
                if (p + 15 < rlo)
                    continue;
                const uint16_t *k, *v;
                at_where(a, table, g, p, &k, &v);
                _tile_loadd(5, pb + (p - base), 2 * np);
                for (int k4 = 0; k4 < nc; k4++) {
                    _tile_loadd(4, v + (size_t)(c0 + k4) * 32, 4 * D);
                    switch (k4) { /* tile numbers are immediates */
                    case 0:
                        _tile_dpbf16ps(0, 5, 4);
                        break;
                    case 1:
                        _tile_dpbf16ps(1, 5, 4);
                        break;
                    case 2:
                        _tile_dpbf16ps(2, 5, 4);
                        break;
                    default:
                        _tile_dpbf16ps(3, 5, 4);
                        break;
                    }
                }
            }
            _tile_stored(0, cb, 256);
            _tile_stored(1, cb + 16, 256);
            _tile_stored(2, cb + 32, 256);
            _tile_stored(3, cb + 48, 256);
            AMX_FENCE();
            for (int i = 0; i < nr; i++) {
                const __m512 lv = _mm512_set1_ps(l[i]);
                for (int k4 = 0; k4 < nc; k4++)
                    _mm512_storeu_ps(out[i] + 16 * (c0 + k4),
                                     _mm512_div_ps(_mm512_load_ps(cb + 64 * i + 16 * k4), lv));
            }
        }
        if (r0 + 16 >= rows && next && next->n > 0) { /* the next call's first keys */
            int32_t f = INT32_MAX, e = -1;
            for (int i = 0; i < next->n; i++) {
                const int32_t fi = kern_attn_first(a, next->toks[i]);
                f = fi < f ? fi : f;
                e = a->pos[next->toks[i]] > e ? a->pos[next->toks[i]] : e;
            }
            const int32_t *nt = kern_block_row(&a->bt, next->toks[0]);
            for (int32_t p = f / 16 * 16; p <= e && p < f / 16 * 16 + 32; p += 16)
                at_prefetch(a, nt, next->g, p);
        }
    }
    if (!next || next->n == 0) { /* the pass's last call */
        _tile_release();
        at_rows = 0;
    }
}
