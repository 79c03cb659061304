/* SHA-256 per FIPS 180-4 section 6.2, written from the standard: message schedule of 64
 * words, 64 rounds per 512-bit block, big-endian length padding. */
#include "common/sha256.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* First 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static inline uint32_t rotr(uint32_t x, unsigned n)
{
    return (x >> n) | (x << (32 - n));
}

static void compress_block(uint32_t h[8], const uint8_t *p)
{
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 |
               (uint32_t)p[4 * t + 2] << 8 | (uint32_t)p[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = k + S1 + ch + K[t] + w[t];
        uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = S0 + maj;
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += k;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>

/* The same compression on the x86 SHA extensions (SHA-NI): the state as the two vectors the
 * sha256rnds2 instruction takes (ABEF and CDGH), two rounds per instruction, the message
 * schedule four words at a time with sha256msg1/msg2. Checked against compress_block in
 * tests/test_shard.c (test_sha256_shani). */
__attribute__((target("sha,sse4.1"))) static void compress_shani(uint32_t h[8], const uint8_t *p,
                                                                 size_t n)
{
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&h[0]); /* lanes h0..h3 */
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&h[4]); /* lanes h4..h7 */
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; n; n--, p += 64) {
        const __m128i abef0 = abef, cdgh0 = cdgh;
        __m128i w[4];
        for (int i = 0; i < 16; i++) {
            if (i < 4) {
                w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
            } else { /* words 4i..4i+3 from the four vectors before them */
                __m128i x = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
                w[i & 3] = _mm_sha256msg2_epu32(x, w[(i + 3) & 3]);
            }
            __m128i m = _mm_add_epi32(w[i & 3], _mm_loadu_si128((const __m128i *)&K[4 * i]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, m);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(m, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(dchg, feba, 8));
}

static int use_shani = -1; /* unknown yet; sha256_force_scalar sets 0 */

static int shani(void)
{
    int u = __atomic_load_n(&use_shani, __ATOMIC_RELAXED);
    if (u < 0) { /* CPUID: leaf 7 EBX bit 29 SHA, leaf 1 ECX bit 19 SSE4.1 */
        unsigned a, b, c, d;
        u = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 29 & 1) &&
            __get_cpuid(1, &a, &b, &c, &d) && (c >> 19 & 1);
        __atomic_store_n(&use_shani, u, __ATOMIC_RELAXED);
    }
    return u;
}

int sha256_force_scalar(int scalar)
{
    int was = shani();
    __atomic_store_n(&use_shani, scalar ? 0 : -1, __ATOMIC_RELAXED);
    return was;
}
#else
int sha256_force_scalar(int scalar)
{
    (void)scalar;
    return 0;
}
#endif

/* n whole blocks at p. */
static void compress_blocks(uint32_t h[8], const uint8_t *p, size_t n)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (shani()) {
        compress_shani(h, p, n);
        return;
    }
#endif
    for (; n; n--, p += 64)
        compress_block(h, p);
}

void sha256_init(struct sha256 *s)
{
    /* First 32 bits of the fractional parts of the square roots of the first 8 primes. */
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof(h0));
    s->nbytes = 0;
    s->block_len = 0;
}

void sha256_update(struct sha256 *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    s->nbytes += len;
    if (s->block_len) {
        size_t take = 64 - s->block_len;
        if (take > len)
            take = len;
        memcpy(s->block + s->block_len, p, take);
        s->block_len += take;
        p += take;
        len -= take;
        if (s->block_len < 64)
            return;
        compress_blocks(s->h, s->block, 1);
        s->block_len = 0;
    }
    compress_blocks(s->h, p, len / 64);
    p += len / 64 * 64;
    len %= 64;
    memcpy(s->block, p, len);
    s->block_len = len;
}

void sha256_final(struct sha256 *s, uint8_t digest[SHA256_DIGEST_LEN])
{
    uint64_t bits = s->nbytes * 8;
    s->block[s->block_len++] = 0x80;
    if (s->block_len > 56) {
        memset(s->block + s->block_len, 0, 64 - s->block_len);
        compress_blocks(s->h, s->block, 1);
        s->block_len = 0;
    }
    memset(s->block + s->block_len, 0, 56 - s->block_len);
    for (int i = 0; i < 8; i++)
        s->block[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    compress_blocks(s->h, s->block, 1);
    for (int i = 0; i < 8; i++) {
        digest[4 * i] = (uint8_t)(s->h[i] >> 24);
        digest[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        digest[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        digest[4 * i + 3] = (uint8_t)s->h[i];
    }
    memset(s, 0, sizeof(*s));
}

void sha256_hex(const uint8_t digest[SHA256_DIGEST_LEN], char hex[SHA256_HEX_LEN])
{
    static const char xd[] = "0123456789abcdef";
    for (int i = 0; i < SHA256_DIGEST_LEN; i++) {
        hex[2 * i] = xd[digest[i] >> 4];
        hex[2 * i + 1] = xd[digest[i] & 15];
    }
    hex[64] = 0;
}

void sha256_buf_hex(const void *data, size_t len, char hex[SHA256_HEX_LEN])
{
    struct sha256 s;
    uint8_t d[SHA256_DIGEST_LEN];
    sha256_init(&s);
    sha256_update(&s, data, len);
    sha256_final(&s, d);
    sha256_hex(d, hex);
}

enum status sha256_file(const char *path, uint64_t limit, char hex[SHA256_HEX_LEN],
                        struct err_detail *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return err_set(err, ST_ERR_IO, "sha256: cannot open %s: %s", path, strerror(errno));
    enum { BUF = 1 << 20 };
    uint8_t *buf = malloc(BUF);
    if (!buf) {
        close(fd);
        return err_set(err, ST_ERR_NOMEM, "sha256: out of memory");
    }
    struct sha256 s;
    sha256_init(&s);
    uint64_t done = 0;
    enum status st = ST_OK;
    while (done < limit) {
        size_t want = limit - done < BUF ? (size_t)(limit - done) : BUF;
        ssize_t n = read(fd, buf, want);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            st = err_set(err, ST_ERR_IO, "sha256: reading %s at offset %llu: %s", path,
                         (unsigned long long)done, strerror(errno));
            break;
        }
        if (n == 0) {
            if (limit != SHA256_WHOLE_FILE)
                st = err_set(err, ST_ERR_FORMAT,
                             "sha256: %s has %llu bytes, fewer than the %llu to hash", path,
                             (unsigned long long)done, (unsigned long long)limit);
            break;
        }
        sha256_update(&s, buf, (size_t)n);
        done += (uint64_t)n;
    }
    free(buf);
    close(fd);
    if (st != ST_OK)
        return st;
    uint8_t d[SHA256_DIGEST_LEN];
    sha256_final(&s, d);
    sha256_hex(d, hex);
    return ST_OK;
}
