/* philox.c — the counter-based generator behind dropout. A weight's keep
 * decision depends only on (seed, offset, index), never on which thread or
 * kernel computes it, so results are reproducible and a backward pass can
 * regenerate the mask. Constants from Salmon et al., "Parallel random numbers:
 * as easy as 1, 2, 3" (SC'11). */
#include <math.h>

#include "internal.h"

enum {
    PHILOX_M0 = 0xD2511F53u,
    PHILOX_M1 = 0xCD9E8D57u,
    PHILOX_W0 = 0x9E3779B9u,
    PHILOX_W1 = 0xBB67AE85u
};

void attn__philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c0 = n0;
        c1 = (uint32_t)p1;
        c2 = n2;
        c3 = (uint32_t)p0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

uint64_t attn__dropout_threshold(double p) {
    /* p * 2^32 is exact in double; its ceiling is the number of words
     * (out of 2^32) that drop, so P(keep) = 1 - p to within 2^-32. */
    return (uint64_t)ceil(p * 4294967296.0);
}

uint32_t attn__dropout_word(uint64_t seed, uint64_t rng_offset, uint64_t index) {
    uint64_t block = index >> 2;
    uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), (uint32_t)rng_offset,
                       (uint32_t)(rng_offset >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t out[4];
    attn__philox4x32_10(ctr, key, out);
    return out[index & 3];
}
