/* Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
 * SC 2011): a counter-based generator. The output is a pure function of a 128-bit counter and
 * a 64-bit key, so a draw can be named by what it is for (request, position, draw) instead of
 * by how many draws came before it: results do not depend on batch composition, thread count,
 * preemption or backend. Matches Random123's known-answer vectors (tests/test_sampler.c). */
#ifndef COMMON_PHILOX_H
#define COMMON_PHILOX_H

#include <stdint.h>

/* out = Philox4x32-10(ctr, key). */
void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* The first two output words of Philox4x32-10 as one 64-bit value (word 0 high): key = the
 * 64-bit k (low word first), counter words {c0, c0 >> 32, c1, c1 >> 32}. */
uint64_t philox_bits(uint64_t k, uint64_t c0, uint64_t c1);

/* A uniform double in [0, 1): the top 53 bits of philox_bits(k, c0, c1) times 2^-53. */
double philox_uniform(uint64_t k, uint64_t c0, uint64_t c1);

#endif
