/* peak_avx512.c — the AVX-512 FMA probe (compiled with -mavx512f only). */
#include <immintrin.h>

#include "peak.h"

#define STEP(x) x = _mm512_fmadd_ps(x, b, c)

double peak_fma_avx512(int64_t iters) {
    const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-6f);
    __m512 a0 = b, a1 = c, a2 = b, a3 = c, a4 = b, a5 = c, a6 = b, a7 = c, a8 = b, a9 = c,
           a10 = b, a11 = c;
    for (int64_t i = 0; i < iters; i++) { /* 12 chains: > 4-cycle latency x 2 ports */
        STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);
        STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    volatile float sink = _mm512_reduce_add_ps(s); /* keep the chains alive */
    (void)sink;
    return 2.0 * 16 * 12 * (double)iters;
}
