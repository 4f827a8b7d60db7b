/*
 * flash_avx512.c — float32 fused-attention micro-kernels for AVX-512F.
 * Only this file is compiled with -mavx512f; the driver calls it through
 * attn__flash_avx512 after CPUID + xgetbv said the CPU and OS support it.
 *
 * Register tiles (32 zmm registers):
 *   qkt  8 keys x 48 queries: 24 accumulators, 3 Qt vectors, broadcast k
 *   pv   6 query rows x 64 output features: 24 accumulators, 4 V vectors
 * Edge tiles (fewer keys, rows or features) are the same code specialised
 * by the compiler for each shape, with masked loads and stores for tails.
 */
#include <immintrin.h>
#include <math.h>

#include "../../sdpa/flash.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 6
#define VECS 4 /* 16-float vectors per tile row */

/* ---- exp2 on 16 lanes: same polynomial as attn__exp2f ---- */

ALWAYS_INLINE __m512 exp2_ps(__m512 x) {
    /* -inf (a masked key) clamps to -150, whose power of two rounds to an
     * exact 0; NaN passes through (vmaxps returns its second operand). */
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.0001534581097075715661f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.001339993206784129143f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009618489071726799011f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550328642129898071f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402264624834060669f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147182464599609375f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n); /* p * 2^n, exact, underflows to 0 */
}

/* ---- St = K · Qt (queries in lanes) ---- */

#define KEYS 8   /* keys per qkt tile                  */
#define QVECS 3  /* 16-query vectors per qkt tile (48) */

ALWAYS_INLINE void qkt_tile(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E,
                            float *st, int64_t ldst, const int JK, const int NV) {
    __m512 acc[KEYS][QVECS];
#pragma GCC unroll 8
    for (int j = 0; j < JK; j++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) acc[j][v] = _mm512_setzero_ps();
    for (int64_t e = 0; e < E; e++) {
        __m512 q[QVECS];
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) q[v] = _mm512_loadu_ps(qt + e * ldqt + 16 * v);
#pragma GCC unroll 8
        for (int j = 0; j < JK; j++) {
            const __m512 kb = _mm512_set1_ps(k[j * ldk + e]);
#pragma GCC unroll 3
            for (int v = 0; v < NV; v++) acc[j][v] = _mm512_fmadd_ps(kb, q[v], acc[j][v]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < JK; j++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(st + j * ldst + 16 * v, acc[j][v]);
}

#define QKT_NV(JK)                                                                           \
    case JK:                                                                                 \
        if (nv == 3)                                                                         \
            qkt_tile(qt + c, ldqt, k + j * ldk, ldk, E, st + j * ldst + c, ldst, JK, 3);     \
        else if (nv == 2)                                                                    \
            qkt_tile(qt + c, ldqt, k + j * ldk, ldk, E, st + j * ldst + c, ldst, JK, 2);     \
        else                                                                                 \
            qkt_tile(qt + c, ldqt, k + j * ldk, ldk, E, st + j * ldst + c, ldst, JK, 1);     \
        break;

static void qkt_f(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E, int64_t nk,
                  int64_t lanes, float *st, int64_t ldst) {
    for (int64_t c = 0; c < lanes; c += 16 * QVECS) {
        const int nv = (int)((lanes - c) / 16 < QVECS ? (lanes - c) / 16 : QVECS);
        for (int64_t j = 0; j < nk; j += KEYS) {
            switch (nk - j < KEYS ? nk - j : KEYS) {
                QKT_NV(8)
                QKT_NV(7)
                QKT_NV(6)
                QKT_NV(5)
                QKT_NV(4)
                QKT_NV(3)
                QKT_NV(2)
                QKT_NV(1)
            default: break;
            }
        }
    }
}

/* Online softmax down the columns of St: 16 queries per vector, so the
 * running max and sum need no horizontal reductions. */
static void softmax_t_f(float *st, int64_t ldst, int64_t nk, int64_t lanes, float *m, float *l,
                        float *alpha) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    for (int64_t c = 0; c < lanes; c += 16) {
        __m512 mx = neg_inf;
        for (int64_t j = 0; j < nk; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(st + j * ldst + c));
        const __m512 m_old = _mm512_loadu_ps(m + c);
        const __m512 m_new = _mm512_max_ps(mx, m_old);
        /* a column that has seen nothing visible measures from 0 */
        const __mmask16 empty = _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ);
        const __m512 ref = _mm512_mask_blend_ps(empty, m_new, zero);
        __m512 sum = zero;
        for (int64_t j = 0; j < nk; j++) {
            const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(st + j * ldst + c), ref));
            _mm512_storeu_ps(st + j * ldst + c, p);
            sum = _mm512_add_ps(sum, p);
        }
        const __m512 a = exp2_ps(_mm512_sub_ps(m_old, ref));
        _mm512_storeu_ps(alpha + c, a);
        _mm512_storeu_ps(l + c, _mm512_fmadd_ps(_mm512_loadu_ps(l + c), a, sum));
        _mm512_storeu_ps(m + c, m_new);
    }
}

/* S = Q · Kᵀ with K read in place: one dot product per (row, key), each a
 * 16-lane accumulation over E and a horizontal sum. Used for few rows. */
static void qk_direct_f(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, float *s, int64_t lds) {
    const int64_t full = E / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (E - full)) - 1);
    for (int64_t j = 0; j < nk; j++) {
        const float *kj = k + j * ldk;
        __m512 acc[ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t e = 0; e < full; e += 16) {
            const __m512 kv = _mm512_loadu_ps(kj + e);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * ldq + e), kv, acc[r]);
        }
        if (tail) {
            const __m512 kv = _mm512_maskz_loadu_ps(tail, kj + full);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + r * ldq + full), kv, acc[r]);
        }
        for (int r = 0; r < rows; r++) s[r * lds + j] = _mm512_reduce_add_ps(acc[r]);
    }
}

/* ---- online softmax ---- */

static void softmax_f(float *s, int64_t lds, int rows, int64_t cols, float *m, float *l,
                      float *alpha) {
    for (int r = 0; r < rows; r++) {
        float *sr = s + r * lds;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < cols; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + j));
        const float block_max = _mm512_reduce_max_ps(mv);
        const float m_new = block_max > m[r] ? block_max : m[r];
        const float ref = m_new == -INFINITY ? 0.0f : m_new;
        const __m512 refv = _mm512_set1_ps(ref);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < cols; j += 16) {
            const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), refv));
            _mm512_storeu_ps(sr + j, p);
            sum = _mm512_add_ps(sum, p);
        }
        alpha[r] = attn__exp2f(m[r] - ref);
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        m[r] = m_new;
    }
}

/* ---- O = alpha·O + P · V ---- */

ALWAYS_INLINE void pv_tile(const float *p, int64_t p_rs, int64_t p_cs, const float *v, int64_t ldv, int64_t nk,
                           float *o, int64_t ldo, const float *alpha, const int R, const int NV,
                           __mmask16 last) {
    __m512 acc[ROWS][VECS], vv[VECS];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++) {
            const __mmask16 mk = vi == NV - 1 ? last : (__mmask16)0xffff;
            acc[r][vi] = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(mk, o + r * ldo + 16 * vi));
        }
    }
    for (int64_t j = 0; j < nk; j++) {
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++) {
            const __mmask16 mk = vi == NV - 1 ? last : (__mmask16)0xffff;
            vv[vi] = _mm512_maskz_loadu_ps(mk, v + j * ldv + 16 * vi);
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512 pb = _mm512_set1_ps(p[r * p_rs + j * p_cs]);
#pragma GCC unroll 4
            for (int vi = 0; vi < NV; vi++) acc[r][vi] = _mm512_fmadd_ps(pb, vv[vi], acc[r][vi]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++) {
            const __mmask16 mk = vi == NV - 1 ? last : (__mmask16)0xffff;
            _mm512_mask_storeu_ps(o + r * ldo + 16 * vi, mk, acc[r][vi]);
        }
}

#define PV_CASE(R)                                                                              \
    case R:                                                                                     \
        switch (nv) {                                                                           \
        case 4: pv_tile(p, p_rs, p_cs, v + e, ldv, nk, o + e, ldo, alpha, R, 4, last); break;   \
        case 3: pv_tile(p, p_rs, p_cs, v + e, ldv, nk, o + e, ldo, alpha, R, 3, last); break;   \
        case 2: pv_tile(p, p_rs, p_cs, v + e, ldv, nk, o + e, ldo, alpha, R, 2, last); break;   \
        default: pv_tile(p, p_rs, p_cs, v + e, ldv, nk, o + e, ldo, alpha, R, 1, last); break;  \
        }                                                                                       \
        break;

static void pv_f(const float *p, int64_t p_rs, int64_t p_cs, const float *v, int64_t ldv, int rows,
                 int64_t nk, int64_t Ev, float *o, int64_t ldo, const float *alpha) {
    for (int64_t e = 0; e < Ev; e += 16 * VECS) {
        const int64_t left = Ev - e;
        const int nv = (int)(left >= 16 * VECS ? VECS : (left + 15) / 16);
        const int64_t in_last = left - 16 * (nv - 1);
        const __mmask16 last = (__mmask16)(in_last >= 16 ? 0xffff : (1u << in_last) - 1);
        switch (rows) {
            PV_CASE(6)
            PV_CASE(5)
            PV_CASE(4)
            PV_CASE(3)
            PV_CASE(2)
            PV_CASE(1)
        default: break;
        }
    }
}

const attn__flash_kernels attn__flash_avx512 = {
    .name = "avx512",
    .pv_rows = ROWS,
    .col_step = 16,
    .qkt_f = qkt_f,
    .softmax_t_f = softmax_t_f,
    .qk_direct_f = qk_direct_f,
    .softmax_f = softmax_f,
    .pv_f = pv_f,
    .qkt_d = attn__generic_qkt_d,
    .softmax_t_d = attn__generic_softmax_t_d,
    .qk_direct_d = attn__generic_qk_direct_d,
    .softmax_d = attn__generic_softmax_d,
    .pv_d = attn__generic_pv_d,
};
