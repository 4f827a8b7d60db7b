/* peak_avx2.c — the AVX2+FMA probe (compiled with -mavx2 -mfma only). */
#include <immintrin.h>

#include "peak.h"

#define STEP(x) x = _mm256_fmadd_ps(x, b, c)

double peak_fma_avx2(int64_t iters) {
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
    __m256 a0 = b, a1 = c, a2 = b, a3 = c, a4 = b, a5 = c, a6 = b, a7 = c, a8 = b, a9 = c;
    for (int64_t i = 0; i < iters; i++) { /* 10 chains: > 5-cycle latency x 2 ports */
        STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4);
        STEP(a5); STEP(a6); STEP(a7); STEP(a8); STEP(a9);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(a8, a9));
    float out[8];
    _mm256_storeu_ps(out, s);
    volatile float sink = out[0] + out[7];
    (void)sink;
    return 2.0 * 8 * 10 * (double)iters;
}
