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
#include <math.h>
#include <stdint.h>

#include "../exp2.h"

/* ---- exp2 on 16 lanes: the polynomial of exp2.h ---- */

/* 2^x for a fit of 2^f on [-0.5, 0.5] with coefficients c[0..degree]
 * (exp2.h): x = n + f, 2^f by Horner from c[degree] down, then scaled by
 * 2^n, exactly. */
static inline __attribute__((always_inline)) __m512 exp2_fit(__m512 x, const float *c,
                                                            const int degree) {
    /* Lanes below -125 (masked keys are -inf) give an exact 0 through the
     * zeroing mask, so no subnormal is ever produced: on Intel cores a
     * subnormal result costs a microcode assist per lane. Weights that small
     * are below float32 resolution next to the row's largest weight (1).
     * What such a lane computes before the mask (NaN from -inf) is dropped
     * with it: no clamp of x at -125, which cost the softmax 4-8% (one more
     * operation on each vector's dependent chain). NaN keeps its lane: "not
     * less than" is true for unordered operands. */
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(ATTN__EXP2F_MIN), _CMP_NLT_UQ);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(c[degree]);
#pragma GCC unroll 8
    for (int k = degree - 1; k >= 0; k--) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[k]));
    return _mm512_maskz_scalef_ps(keep, p, n); /* p * 2^n, exact */
}

/* 2^x as exp2.h's polynomial. */
static inline __attribute__((always_inline)) __m512 exp2_ps(__m512 x) {
    static const float c[7] = {ATTN__EXP2F_C0, ATTN__EXP2F_C1, ATTN__EXP2F_C2, ATTN__EXP2F_C3,
                               ATTN__EXP2F_C4, ATTN__EXP2F_C5, ATTN__EXP2F_C6};
    return exp2_fit(x, c, 6);
}

/* ---- the online softmax down columns (queries in lanes) ---- */

/* Each column's best raw score so far over a tile of nk keys (16 queries
 * per vector, NV vectors), from m: the largest when c >= 0, the smallest
 * when c < 0; and the reference its weights measure from, x = (s - ref)·c
 * (0 for a column that has seen nothing visible). */
static inline __attribute__((always_inline)) void column_best(const float *st, int64_t ldst,
                                                              int64_t nk, float c, const float *m,
                                                              __m512 *mx, __m512 *ref,
                                                              const int NV) {
    const __m512 none = _mm512_set1_ps(c >= 0 ? -INFINITY : INFINITY);
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) mx[v] = _mm512_loadu_ps(m + 16 * v);
    if (c >= 0) {
        for (int64_t j = 0; j < nk; j++)
#pragma GCC unroll 3
            for (int v = 0; v < NV; v++)
                mx[v] = _mm512_max_ps(mx[v], _mm512_loadu_ps(st + j * ldst + 16 * v));
    } else {
        for (int64_t j = 0; j < nk; j++)
#pragma GCC unroll 3
            for (int v = 0; v < NV; v++)
                mx[v] = _mm512_min_ps(mx[v], _mm512_loadu_ps(st + j * ldst + 16 * v));
    }
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) {
        const __mmask16 empty = _mm512_cmp_ps_mask(mx[v], none, _CMP_EQ_OQ);
        ref[v] = _mm512_mask_blend_ps(empty, mx[v], _mm512_setzero_ps());
    }
}

/* The columns' running state after a tile whose weights summed to `sum`:
 * alpha = 2^((m - ref)·c) rescales what came before, l = l·alpha + sum,
 * m = the new best. */
static inline __attribute__((always_inline)) void column_update(float *m, float *l, float *alpha,
                                                                const __m512 *mx,
                                                                const __m512 *ref,
                                                                const __m512 *sum, float c,
                                                                const int NV) {
    const __m512 cv = _mm512_set1_ps(c);
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) {
        const __m512 a = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(m + 16 * v), ref[v]), cv));
        _mm512_storeu_ps(alpha + 16 * v, a);
        _mm512_storeu_ps(l + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * v), a, sum[v]));
        _mm512_storeu_ps(m + 16 * v, mx[v]);
    }
}

/* The keys a qkt tile of nv 16-lane groups from lane c needs (ukernel.h:
 * qkt's `keys`, NULL for all nk). */
static inline int64_t tile_keys(const int64_t *keys, int64_t c, int nv, int64_t nk) {
    if (keys == NULL) return nk;
    int64_t n = 0;
    for (int v = 0; v < nv; v++)
        if (keys[c / 16 + v] > n) n = keys[c / 16 + v];
    return n < nk ? n : nk;
}

/* The groups of that tile a step of keys from key j needs: [*lo, *lo + n),
 * n returned; groups outside it need none of the step's keys. On the causal
 * diagonal the first groups drop out as j grows (a 48-lane tile computes 2/3
 * of its diagonal block), and their lanes are not computed, only hidden. */
static inline int tile_groups(const int64_t *keys, int64_t c, int nv, int64_t j, int *lo) {
    int a = 0, b = nv;
    if (keys != NULL) {
        while (a < b && keys[c / 16 + a] <= j) a++;
        while (b > a && keys[c / 16 + b - 1] <= j) b--;
    }
    *lo = a;
    return b - a;
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
