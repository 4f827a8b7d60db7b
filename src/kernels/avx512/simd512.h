/*
 * simd512.h — AVX-512F building blocks shared by the AVX-512 kernel files,
 * each of which includes it under its own ISA flags (flash_avx512.c and
 * flash_avx512_bf16.c): exp2 on 16 lanes, and a 16 x 16 transpose of
 * 32-bit elements (float32 Qt, or Qt in bfloat16 pairs, a pair being one
 * 32-bit element).
 */
#ifndef ATTN_KERNELS_AVX512_SIMD512_H
#define ATTN_KERNELS_AVX512_SIMD512_H

#include <immintrin.h>

#include "../exp2.h"

/* ---- exp2 on 16 lanes: the polynomial of exp2.h ---- */

static inline __attribute__((always_inline)) __m512 exp2_ps(__m512 x) {
    /* Lanes below -125 (masked keys are -inf) give an exact 0 through the
     * zeroing mask, so no subnormal is ever produced: on Intel cores a
     * subnormal result costs a microcode assist per lane. Weights that small
     * are below float32 resolution next to the row's largest weight (1).
     * NaN keeps its lane: "not less than" is true for unordered operands. */
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(ATTN__EXP2F_MIN), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(ATTN__EXP2F_MIN), x);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(ATTN__EXP2F_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ATTN__EXP2F_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ATTN__EXP2F_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ATTN__EXP2F_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ATTN__EXP2F_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ATTN__EXP2F_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ATTN__EXP2F_C0));
    return _mm512_maskz_scalef_ps(keep, p, n); /* p * 2^n, exact */
}

/* ---- a 16 x 16 transpose ---- */

/* r[k] becomes column k of the 16 x 16 block: pairs, quads, then 128-bit
 * lanes across 8 and 16 rows. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
                      c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

#endif /* ATTN_KERNELS_AVX512_SIMD512_H */
