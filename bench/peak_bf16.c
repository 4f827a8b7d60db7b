/* peak_bf16.c — the AVX512-BF16 dot-product probe (compiled with
 * -mavx512f -mavx512bf16 only): vdpbf16ps does 32 bf16 multiply-adds per
 * instruction, twice a float32 FMA's 16, where the CPU runs both at one
 * rate (AMD Zen 4: 234 vs 117 GFLOP/s per core, measured). */
#include <immintrin.h>

#include "peak.h"

#define STEP(x) x = _mm512_dpbf16_ps(x, b, c)

double peak_dp_bf16(int64_t iters) {
    const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80), c = (__m512bh)_mm512_set1_epi16(0x3380);
    /* independent chains, each from its own value (see peak_avx512.c) */
    __m512 a0 = _mm512_set1_ps(1), a1 = _mm512_set1_ps(2), a2 = _mm512_set1_ps(3),
           a3 = _mm512_set1_ps(4), a4 = _mm512_set1_ps(5), a5 = _mm512_set1_ps(6),
           a6 = _mm512_set1_ps(7), a7 = _mm512_set1_ps(8), a8 = _mm512_set1_ps(9),
           a9 = _mm512_set1_ps(10), a10 = _mm512_set1_ps(11), a11 = _mm512_set1_ps(12);
    for (int64_t i = 0; i < iters; i++) {
        STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);
        STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return 2.0 * 32 * 12 * (double)iters;
}
