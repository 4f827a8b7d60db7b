/*
 * flash_avx2.c — float32 fused-attention micro-kernels for AVX2 + FMA.
 * Only this file is compiled with -mavx2 -mfma.
 *
 * Register tiles (16 ymm registers):
 *   qkt  6 keys x 16 queries: 12 accumulators, 2 Qt vectors, 1 broadcast
 *   pv   6 query rows x 16 output features: 12 accumulators, 2 V vectors
 */
#include <immintrin.h>
#include <math.h>

#include "../../sdpa/flash.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 6
#define VECS 2 /* 8-float vectors per tile row */

/* ---- exp2 on 8 lanes: same polynomial as attn__exp2f ---- */

ALWAYS_INLINE __m256 exp2_ps(__m256 x0) {
    /* Without vscalefps, 2^n is built in the exponent field, valid for
     * n >= -126; lanes below that (masked keys are -inf) are set to an exact
     * 0 afterwards. NaN passes through both steps. */
    const __m256 x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x0);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(0.0001534581097075715661f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.001339993206784129143f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.009618489071726799011f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05550328642129898071f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.2402264624834060669f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.693147182464599609375f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    /* keep lanes with x0 >= -126 or NaN (not-less-than is true for NaN) */
    const __m256 keep = _mm256_cmp_ps(x0, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ);
    return _mm256_and_ps(p, keep);
}

ALWAYS_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A load mask for the first n (0..8) lanes. */
ALWAYS_INLINE __m256i lane_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
}

/* ---- St = K · Qt (queries in lanes) ---- */

#define KEYS 6 /* keys per qkt tile */

ALWAYS_INLINE void qkt_tile(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E,
                            float *st, int64_t ldst, const int JK) {
    __m256 acc[KEYS][2];
#pragma GCC unroll 6
    for (int j = 0; j < JK; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < E; e++) {
        const __m256 q0 = _mm256_loadu_ps(qt + e * ldqt), q1 = _mm256_loadu_ps(qt + e * ldqt + 8);
#pragma GCC unroll 6
        for (int j = 0; j < JK; j++) {
            const __m256 kb = _mm256_broadcast_ss(k + j * ldk + e);
            acc[j][0] = _mm256_fmadd_ps(kb, q0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(kb, q1, acc[j][1]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < JK; j++) {
        _mm256_storeu_ps(st + j * ldst, acc[j][0]);
        _mm256_storeu_ps(st + j * ldst + 8, acc[j][1]);
    }
}

#define QKT_CASE(JK)                                                                   \
    case JK: qkt_tile(qt + c, ldqt, k + j * ldk, ldk, E, st + j * ldst + c, ldst, JK); break;

/* lanes is a multiple of 16 (the driver uses 48). */
static void qkt_f(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E, int64_t nk,
                  int64_t lanes, float *st, int64_t ldst) {
    for (int64_t c = 0; c < lanes; c += 16)
        for (int64_t j = 0; j < nk; j += KEYS) {
            switch (nk - j < KEYS ? nk - j : KEYS) {
                QKT_CASE(6)
                QKT_CASE(5)
                QKT_CASE(4)
                QKT_CASE(3)
                QKT_CASE(2)
                QKT_CASE(1)
            default: break;
            }
        }
}

/* Online softmax down the columns of St, 8 queries per vector. */
static void softmax_t_f(float *st, int64_t ldst, int64_t nk, int64_t lanes, float *m, float *l,
                        float *alpha) {
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
    for (int64_t c = 0; c < lanes; c += 8) {
        __m256 mx = neg_inf;
        for (int64_t j = 0; j < nk; j++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(st + j * ldst + c));
        const __m256 m_old = _mm256_loadu_ps(m + c);
        const __m256 m_new = _mm256_max_ps(mx, m_old);
        const __m256 empty = _mm256_cmp_ps(m_new, neg_inf, _CMP_EQ_OQ);
        const __m256 ref = _mm256_blendv_ps(m_new, zero, empty);
        __m256 sum = zero;
        for (int64_t j = 0; j < nk; j++) {
            const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(st + j * ldst + c), ref));
            _mm256_storeu_ps(st + j * ldst + c, p);
            sum = _mm256_add_ps(sum, p);
        }
        const __m256 a = exp2_ps(_mm256_sub_ps(m_old, ref));
        _mm256_storeu_ps(alpha + c, a);
        _mm256_storeu_ps(l + c, _mm256_fmadd_ps(_mm256_loadu_ps(l + c), a, sum));
        _mm256_storeu_ps(m + c, m_new);
    }
}

static void qk_direct_f(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, float *s, int64_t lds) {
    const int64_t full = E / 8 * 8;
    const __m256i tail = lane_mask(E - full);
    for (int64_t j = 0; j < nk; j++) {
        const float *kj = k + j * ldk;
        __m256 acc[ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t e = 0; e < full; e += 8) {
            const __m256 kv = _mm256_loadu_ps(kj + e);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + e), kv, acc[r]);
        }
        if (E > full) {
            const __m256 kv = _mm256_maskload_ps(kj + full, tail);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(q + r * ldq + full, tail), kv, acc[r]);
        }
        for (int r = 0; r < rows; r++) s[r * lds + j] = hsum(acc[r]);
    }
}

/* ---- online softmax ---- */

static void softmax_f(float *s, int64_t lds, int rows, int64_t cols, float *m, float *l,
                      float *alpha) {
    for (int r = 0; r < rows; r++) {
        float *sr = s + r * lds;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < cols; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + j));
        const float block_max = hmax(mv);
        const float m_new = block_max > m[r] ? block_max : m[r];
        const float ref = m_new == -INFINITY ? 0.0f : m_new;
        const __m256 refv = _mm256_set1_ps(ref);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < cols; j += 8) {
            const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + j), refv));
            _mm256_storeu_ps(sr + j, p);
            sum = _mm256_add_ps(sum, p);
        }
        alpha[r] = attn__exp2f(m[r] - ref);
        l[r] = l[r] * alpha[r] + hsum(sum);
        m[r] = m_new;
    }
}

/* ---- O = alpha·O + P · V ---- */

ALWAYS_INLINE void pv_tile(const float *p, int64_t p_rs, int64_t p_cs, const float *v, int64_t ldv, int64_t nk,
                           float *o, int64_t ldo, const float *alpha, const int R, const int NV,
                           __m256i last) {
    const __m256i all = _mm256_set1_epi32(-1);
    __m256 acc[ROWS][VECS], vv[VECS];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        const __m256 a = _mm256_set1_ps(alpha[r]);
#pragma GCC unroll 2
        for (int vi = 0; vi < NV; vi++)
            acc[r][vi] = _mm256_mul_ps(a, _mm256_maskload_ps(o + r * ldo + 8 * vi, vi == NV - 1 ? last : all));
    }
    for (int64_t j = 0; j < nk; j++) {
#pragma GCC unroll 2
        for (int vi = 0; vi < NV; vi++)
            vv[vi] = _mm256_maskload_ps(v + j * ldv + 8 * vi, vi == NV - 1 ? last : all);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 pb = _mm256_broadcast_ss(p + r * p_rs + j * p_cs);
#pragma GCC unroll 2
            for (int vi = 0; vi < NV; vi++) acc[r][vi] = _mm256_fmadd_ps(pb, vv[vi], acc[r][vi]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int vi = 0; vi < NV; vi++)
            _mm256_maskstore_ps(o + r * ldo + 8 * vi, vi == NV - 1 ? last : all, acc[r][vi]);
}

#define PV_CASE(R)                                                                        \
    case R:                                                                               \
        if (nv == 2)                                                                      \
            pv_tile(p, p_rs, p_cs, v + e, ldv, nk, o + e, ldo, alpha, R, 2, last);        \
        else                                                                              \
            pv_tile(p, p_rs, p_cs, v + e, ldv, nk, o + e, ldo, alpha, R, 1, last);        \
        break;

static void pv_f(const float *p, int64_t p_rs, int64_t p_cs, const float *v, int64_t ldv, int rows,
                 int64_t nk, int64_t Ev, float *o, int64_t ldo, const float *alpha) {
    for (int64_t e = 0; e < Ev; e += 8 * VECS) {
        const int64_t left = Ev - e;
        const int nv = left > 8 ? 2 : 1;
        const int64_t in_last = left - 8 * (nv - 1);
        const __m256i last = lane_mask(in_last >= 8 ? 8 : in_last);
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

const attn__flash_kernels attn__flash_avx2 = {
    .name = "avx2",
    .pv_rows = ROWS,
    .col_step = 8,
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
