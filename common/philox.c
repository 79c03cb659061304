/* Philox4x32-10 (see common/philox.h): ten rounds of two 32x32->64 multiplications, the high
 * halves XORed with the other counter words and the round key, the key bumped by the Weyl
 * constants between rounds. */
#include "common/philox.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        if (r) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

uint64_t philox_bits(uint64_t k, uint64_t c0, uint64_t c1)
{
    const uint32_t ctr[4] = {(uint32_t)c0, (uint32_t)(c0 >> 32), (uint32_t)c1,
                             (uint32_t)(c1 >> 32)};
    const uint32_t key[2] = {(uint32_t)k, (uint32_t)(k >> 32)};
    uint32_t o[4];
    philox4x32_10(ctr, key, o);
    return (uint64_t)o[0] << 32 | o[1];
}

double philox_uniform(uint64_t k, uint64_t c0, uint64_t c1)
{
    return (double)(philox_bits(k, c0, c1) >> 11) * 0x1.0p-53;
}
