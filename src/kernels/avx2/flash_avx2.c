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
#include <stdbool.h>

#include "../exp2.h"
#include "../ukernel.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 6
#define VECS 2 /* 8-float vectors per tile row */

/* ---- exp2 on 8 lanes: the polynomial of exp2.h ---- */

ALWAYS_INLINE __m256 exp2_ps(__m256 x) {
    /* Without vscalefps, 2^n is built in the exponent field. Lanes below
     * -125 (masked keys are -inf) are set to an exact 0 afterwards: what
     * they computed (an exponent field out of range, NaN from -inf) is
     * dropped, and no subnormal is produced on the way (each costs a
     * microcode assist on Intel cores; a field of 0 or below gives +0, -inf
     * or a large negative value, never a subnormal). Weights that small are
     * below float32 resolution next to the row's largest weight (1). NaN
     * passes through. (A clamp of x at -125 first kept the lanes finite,
     * one operation per vector on the softmax's critical path.) */
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(ATTN__EXP2F_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ATTN__EXP2F_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ATTN__EXP2F_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ATTN__EXP2F_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ATTN__EXP2F_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ATTN__EXP2F_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ATTN__EXP2F_C0));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    /* keep lanes with x >= -125 or NaN (not-less-than is true for NaN) */
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(ATTN__EXP2F_MIN), _CMP_NLT_UQ);
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

/* ---- Qt: a block of query rows, transposed ---- */

/* r[k] = column k of the 8 x 8 block whose rows were r[0..7]. */
ALWAYS_INLINE void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* Rows with unit column stride go through 8 x 8 blocks transposed in
 * registers; the portable path (load_rows with the strides swapped) reads
 * them one float at a time: MHA seed 000's heads (32 x 40 each) spent 5% of
 * their time there on Zen 3. Copies (scale 1 in every caller) are exact,
 * so the bits are those of the portable path. Other column strides: the
 * scalar loop (no fast gather on AVX2 CPUs). */
static void pack_qt_f(const float *q, int64_t rs, int64_t cs, int64_t nr, int64_t E, float scale,
                      float *qt, int64_t lanes, int64_t ldqt) {
    if (cs != 1) {
        for (int64_t e = 0; e < E; e++)
            for (int64_t r = 0; r < lanes; r++)
                qt[e * ldqt + r] = r < nr ? q[r * rs + e * cs] * scale : 0;
        return;
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t c = 0; c < lanes; c += 8) { /* lanes: a multiple of 16 */
        const int64_t live = nr - c < 0 ? 0 : nr - c < 8 ? nr - c : 8;
        for (int64_t e0 = 0; e0 < E; e0 += 8) {
            const int64_t ne = E - e0 < 8 ? E - e0 : 8;
            const __m256i em = lane_mask(ne);
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = i >= live ? _mm256_setzero_ps()
                       : ne == 8 ? _mm256_loadu_ps(q + (c + i) * rs + e0)
                                 : _mm256_maskload_ps(q + (c + i) * rs + e0, em);
            transpose8(r);
            for (int k = 0; k < ne; k++)
                _mm256_storeu_ps(qt + (e0 + k) * ldqt + c, _mm256_mul_ps(r[k], sc));
        }
    }
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

/* lanes is a multiple of 16 (lane_step). Keys outside, lanes inside: the
 * 6 K rows of a tile are read from memory once and the packed queries
 * (E x 48 floats, 12 KiB at E = 64) stay in L1; lanes outside read the
 * whole K block once per 16 lanes, and a block of 128 keys at E = 64 is
 * all of Zen 4's 32 KiB L1 (qkt took 1.35x the AVX-512 kernel's time). */
static void qkt_f(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E, int64_t nk,
                  int64_t lanes, float *st, int64_t ldst, const int64_t *keys) {
    for (int64_t j = 0; j < nk; j += KEYS)
        for (int64_t c = 0; c < lanes; c += 16) {
            if (keys != NULL && keys[c / 16] <= j) continue; /* past its rows' diagonal */
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

/* Online softmax down the columns of St, 8 queries per vector; m is each
 * column's best raw score and x = (s - m)·c (see the AVX-512 kernel). */
static void softmax_t_f(float *st, int64_t ldst, int64_t nk, int64_t lanes, float c, float *m,
                        float *l, float *alpha) {
    const float none = c >= 0 ? -INFINITY : INFINITY;
    const __m256 nonev = _mm256_set1_ps(none), zero = _mm256_setzero_ps();
    const __m256 cv = _mm256_set1_ps(c);
    for (int64_t col = 0; col < lanes; col += 8) {
        const __m256 m_old = _mm256_loadu_ps(m + col);
        __m256 mx = m_old;
        if (c >= 0)
            for (int64_t j = 0; j < nk; j++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(st + j * ldst + col));
        else
            for (int64_t j = 0; j < nk; j++) mx = _mm256_min_ps(mx, _mm256_loadu_ps(st + j * ldst + col));
        const __m256 empty = _mm256_cmp_ps(mx, nonev, _CMP_EQ_OQ);
        const __m256 ref = _mm256_blendv_ps(mx, zero, empty);
        __m256 sum = zero;
        for (int64_t j = 0; j < nk; j++) {
            const __m256 p =
                exp2_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(st + j * ldst + col), ref), cv));
            _mm256_storeu_ps(st + j * ldst + col, p);
            sum = _mm256_add_ps(sum, p);
        }
        const __m256 a = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(m_old, ref), cv));
        _mm256_storeu_ps(alpha + col, a);
        _mm256_storeu_ps(l + col, _mm256_fmadd_ps(_mm256_loadu_ps(l + col), a, sum));
        _mm256_storeu_ps(m + col, mx);
    }
}

/* S = Q · Kᵀ with K read in place, for blocks with few rows (decoding):
 * memory-bound, so the products are summed in float64 (see the AVX-512
 * kernel) and each score is rounded once. */
ALWAYS_INLINE double hsum_pd(__m256d v) {
    __m128d x = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(x, _mm_unpackhi_pd(x, x)));
}

static void qk_direct_keys_f(const float *q, int64_t ldq, const float *k, int64_t ldk,
                             int64_t E, int rows, int64_t nk, float *s, int64_t lds) {
    const int64_t full = E / 4 * 4;
    for (int64_t j = 0; j < nk; j++) {
        const float *kj = k + j * ldk;
        __m256d acc[ROWS];
        double tail[ROWS];
        for (int r = 0; r < rows; r++) {
            acc[r] = _mm256_setzero_pd();
            tail[r] = 0;
        }
        for (int64_t e = 0; e < full; e += 4) {
            const __m256d kv = _mm256_cvtps_pd(_mm_loadu_ps(kj + e));
            for (int r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(q + r * ldq + e)), kv, acc[r]);
        }
        for (int64_t e = full; e < E; e++)
            for (int r = 0; r < rows; r++) tail[r] += (double)q[r * ldq + e] * (double)kj[e];
        for (int r = 0; r < rows; r++) s[r * lds + j] = (float)(hsum_pd(acc[r]) + tail[r]);
    }
}

enum { DIRECT_E = 256 }; /* qk_direct_f's widened Q rows: 6 x 256 doubles on the stack */

/* R rows of scores against keys j0 .. j0+3, 4 keys a vector: each 4 x 4
 * block of K widened and transposed in registers, so a multiply-add with a
 * broadcast Q element gives a lane of 4 scores and no score needs a
 * horizontal sum. q64: the rows widened, ld4 (a multiple of 4) doubles
 * apart, zero past E. FULL: four keys and E a multiple of 4, read with
 * plain loads (the masks and the selects were a fifth of the kernel). */
ALWAYS_INLINE void qk_direct_keys4(const double *q64, int64_t ld4, const float *k, int64_t ldk,
                                   int64_t E, int nj, float *s, int64_t lds, const int R,
                                   const bool FULL) {
    __m256d acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_pd();
    for (int64_t e0 = 0; e0 < ld4; e0 += 4) {
        __m256d c[4];
        if (FULL) {
            for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_pd(_mm_loadu_ps(k + i * ldk + e0));
        } else {
            const int64_t ne = E - e0 < 4 ? E - e0 : 4;
            const __m128i em = _mm_cmpgt_epi32(_mm_set1_epi32((int)ne), _mm_setr_epi32(0, 1, 2, 3));
            for (int i = 0; i < 4; i++)
                c[i] = i < nj ? _mm256_cvtps_pd(_mm_maskload_ps(k + i * ldk + e0, em))
                              : _mm256_setzero_pd();
        }
        const __m256d t0 = _mm256_unpacklo_pd(c[0], c[1]), t1 = _mm256_unpackhi_pd(c[0], c[1]);
        const __m256d t2 = _mm256_unpacklo_pd(c[2], c[3]), t3 = _mm256_unpackhi_pd(c[2], c[3]);
        c[0] = _mm256_permute2f128_pd(t0, t2, 0x20); /* c[e]: feature e0 + e of the 4 keys */
        c[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
        c[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
        c[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
        for (int e = 0; e < 4; e++)
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_pd(_mm256_broadcast_sd(q64 + r * ld4 + e0 + e), c[e], acc[r]);
    }
    if (FULL) {
        for (int r = 0; r < R; r++) _mm_storeu_ps(s + r * lds, _mm256_cvtpd_ps(acc[r]));
        return;
    }
    const __m128i jm = _mm_cmpgt_epi32(_mm_set1_epi32(nj), _mm_setr_epi32(0, 1, 2, 3));
    for (int r = 0; r < R; r++) _mm_maskstore_ps(s + r * lds, jm, _mm256_cvtpd_ps(acc[r]));
}

/* R rows of scores against nk keys, four at a time (qk_direct_keys4). */
ALWAYS_INLINE void qk_direct_tile(const double *q64, int64_t ld4, const float *k, int64_t ldk,
                                  int64_t E, int64_t nk, float *s, int64_t lds, const int R) {
    for (int64_t j0 = 0; j0 < nk; j0 += 4) {
        const int nj = nk - j0 < 4 ? (int)(nk - j0) : 4;
        if (nj == 4 && E % 4 == 0)
            qk_direct_keys4(q64, ld4, k + j0 * ldk, ldk, E, 4, s + j0, lds, R, true);
        else
            qk_direct_keys4(q64, ld4, k + j0 * ldk, ldk, E, nj, s + j0, lds, R, false);
    }
}

/* Float64 sums of any number of rows' scores (see qk_direct_keys_f): keys 4 to
 * a vector, without a horizontal sum per score or Q widened per key (the
 * AVX-512 kernel's scheme; see there). */
static void qk_direct_f(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, float *s, int64_t lds) {
    if (rows > ROWS) { /* a tiny call's every row of a head: tile by tile */
        for (int r0 = 0; r0 < rows; r0 += ROWS)
            qk_direct_f(q + r0 * ldq, ldq, k, ldk, E, rows - r0 < ROWS ? rows - r0 : ROWS, nk,
                        s + r0 * lds, lds);
        return;
    }
    if (E > DIRECT_E) {
        qk_direct_keys_f(q, ldq, k, ldk, E, rows, nk, s, lds);
        return;
    }
    const int64_t ld4 = (E + 3) / 4 * 4, body = E / 4 * 4;
    double q64[ROWS * DIRECT_E]; /* rows x ld4 */
    for (int r = 0; r < rows; r++) { /* (element by element: a tenth of a 16-token call) */
        for (int64_t e = 0; e < body; e += 4)
            _mm256_storeu_pd(q64 + r * ld4 + e, _mm256_cvtps_pd(_mm_loadu_ps(q + r * ldq + e)));
        for (int64_t e = body; e < ld4; e++) q64[r * ld4 + e] = e < E ? (double)q[r * ldq + e] : 0.0;
    }
    switch (rows) {
    case 1: qk_direct_tile(q64, ld4, k, ldk, E, nk, s, lds, 1); break;
    case 2: qk_direct_tile(q64, ld4, k, ldk, E, nk, s, lds, 2); break;
    case 3: qk_direct_tile(q64, ld4, k, ldk, E, nk, s, lds, 3); break;
    case 4: qk_direct_tile(q64, ld4, k, ldk, E, nk, s, lds, 4); break;
    case 5: qk_direct_tile(q64, ld4, k, ldk, E, nk, s, lds, 5); break;
    default: qk_direct_tile(q64, ld4, k, ldk, E, nk, s, lds, ROWS); break;
    }
}

/* The four lane sums of a, b, c, d, in that order. */
ALWAYS_INLINE __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

/* ---- K and V elements: float32, or 16-bit widened in registers ---- */

/* HK: what K or V rows hold; 16-bit rows (a decode from a float16/bfloat16
 * cache) are widened exactly as load_rows_f would (same bits after). */
enum { HK_F32, HK_F16, HK_BF16 };

/* Elements at .. at+7 of `base`. */
ALWAYS_INLINE __m256 load8(const void *base, int64_t at, const int HK) {
    if (HK == HK_F32) return _mm256_loadu_ps((const float *)base + at);
    const __m128i x = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return HK == HK_F16 ? _mm256_cvtph_ps(x)
                        : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

/* The first n < 8 elements at `at` (the rest zero): a partial vector. */
ALWAYS_INLINE __m256 load_part8(const void *base, int64_t at, int n, const int HK) {
    if (HK == HK_F32) return _mm256_maskload_ps((const float *)base + at, lane_mask(n));
    uint16_t part[8] = {0};
    for (int i = 0; i < n; i++) part[i] = ((const uint16_t *)base)[at + i];
    return load8(part, 0, HK);
}

/* Requests the cache line of element `at` of `base` into L1: a streamed
 * walk's row ahead of its loads. Callers request only rows below
 * `streamed` (ukernel.h), which may lie past the kernel's own nk keys but
 * are rows the attention call reads. */
ALWAYS_INLINE void request_line(const void *base, int64_t at, const int HK) {
    _mm_prefetch((const char *)base + (size_t)at * (HK == HK_F32 ? 4 : 2), _MM_HINT_T0);
}

/* Element `at` as a float. */
ALWAYS_INLINE float element(const void *base, int64_t at, const int HK) {
    return _mm256_cvtss_f32(HK == HK_F32 ? _mm256_set1_ps(((const float *)base)[at])
                                         : load_part8(base, at, 1, HK));
}

/* R rows' sums against key c of k, walked whole in address order (K
 * streamed from memory), its lines requested `ahead` keys on: acc[r]
 * (zero on entry) for r < R. Both score tiles' streamed order. */
ALWAYS_INLINE void key_sums_seq(const float *q, int64_t ldq, const void *k, int64_t ldk,
                                int64_t E, int c, const int R, const int HK, int64_t ahead,
                                __m256 acc[4]) {
    for (int64_t e = 0; e < E; e += 8) {
        if (ahead && e % (HK == HK_F32 ? 16 : 32) == 0) /* one per line */
            request_line(k, (c + ahead) * ldk + e, HK);
        const __m256 kv = load8(k, c * ldk + e, HK);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + e), kv, acc[r]);
    }
}

/* Scores of `R` rows (at most 3: 4R accumulators and the K vectors in 16
 * registers) against keys j .. j+3, float32 sums; E a multiple of 8. The
 * two key orders of the AVX-512 kernel (SEQ: K streamed from memory). */
ALWAYS_INLINE void qk_rows_tile(const float *q, int64_t ldq, const void *k, int64_t ldk,
                                int64_t E, const int R, float *s, int64_t lds, const bool SEQ,
                                const int HK, int64_t ahead) {
    /* (loops unrolled so the accumulators stay in registers, as in the
     * AVX-512 file: rolled, GCC kept them on the stack) */
    __m256 acc[3][4];
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    if (SEQ)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m256 key[4] = {acc[0][c], acc[0][c], acc[0][c], acc[0][c]}; /* zeros */
            key_sums_seq(q, ldq, k, ldk, E, c, R, HK, ahead, key);
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) acc[r][c] = key[r];
        }
    else
        /* the R query vectors held and each key loaded (widened) once, used
         * and dropped: 4R + R + 1 registers. Four keys held instead left GCC
         * one register short at R = 3 on 16-bit K: an accumulator went to
         * the stack, its store and reload on the loop's chain (a third of a
         * bfloat16 decode's scores). */
        for (int64_t e = 0; e < E; e += 8) {
            __m256 qv[3];
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) qv[r] = _mm256_loadu_ps(q + r * ldq + e);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m256 kv = load8(k, c * ldk + e, HK);
#pragma GCC unroll 3
                for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(qv[r], kv, acc[r][c]);
            }
        }
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
        _mm_storeu_ps(s + r * lds, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* Scores of 4 rows against keys j .. j+3, float32 sums, two keys a pass:
 * 8 accumulators, and the 4 query vectors and a key (widened) in
 * registers. Four rows went as 3 + 1 through qk_rows_tile: a 16-bit key
 * was widened twice, and the single row's 4 sums were one multiply-add
 * chain a key, bound by its latency (the grouped query heads of a decode
 * are 4 rows: Llama's 32 over 8). Each accumulator takes the same
 * multiply-adds in the same order as there, and the pairs' sums meet in
 * the same tree as sum4: the same bits. */
ALWAYS_INLINE void qk_rows_tile4(const float *q, int64_t ldq, const void *k, int64_t ldk,
                                 int64_t E, float *s, int64_t lds, const bool SEQ, const int HK,
                                 int64_t ahead) {
    __m256 pair01[4]; /* per row: hadd of keys j, j+1's accumulators */
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
        const void *kp = (const char *)k + (size_t)(2 * half * ldk) * (HK == HK_F32 ? 4 : 2);
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        if (SEQ)
#pragma GCC unroll 2
            for (int c = 0; c < 2; c++) {
                __m256 key[4] = {acc[0][c], acc[1][c], acc[2][c], acc[3][c]}; /* zeros */
                key_sums_seq(q, ldq, kp, ldk, E, c, 4, HK, ahead, key);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) acc[r][c] = key[r];
            }
        else
            for (int64_t e = 0; e < E; e += 8) {
                __m256 qv[4];
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) qv[r] = _mm256_loadu_ps(q + r * ldq + e);
#pragma GCC unroll 2
                for (int c = 0; c < 2; c++) {
                    const __m256 kv = load8(kp, c * ldk + e, HK);
#pragma GCC unroll 4
                    for (int r = 0; r < 4; r++) acc[r][c] = _mm256_fmadd_ps(qv[r], kv, acc[r][c]);
                }
            }
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256 h = _mm256_hadd_ps(acc[r][0], acc[r][1]);
            if (half == 0) {
                pair01[r] = h;
            } else {
                const __m256 x = _mm256_hadd_ps(pair01[r], h);
                _mm_storeu_ps(s + r * lds,
                              _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
            }
        }
    }
}

/* One score, float32 sums: tail keys and widths that are not a multiple of 8. */
ALWAYS_INLINE float dot_ps(const float *q, const void *k, int64_t at, int64_t E, const int HK) {
    __m256 acc = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 8 <= E; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(k, at + e, HK), acc);
    float x = hsum(acc);
    for (; e < E; e++) x += q[e] * element(k, at + e, HK);
    return x;
}

/* S = Q · Kᵀ, float32 sums (ukernel.h: qk_rows_f): four or three rows by
 * four keys at a time. */
ALWAYS_INLINE void qk_rows(const float *q, int64_t ldq, const void *k, int64_t ldk, int64_t E,
                           int rows, int64_t nk, float *s, int64_t lds, int64_t streamed,
                           const int HK) {
    const size_t es = HK == HK_F32 ? 4 : 2;
    const int64_t ahead = streamed > 0 ? attn__rows_ahead(ATTN__K_AHEAD, E * (int64_t)es) : 0;
    int64_t j = 0;
    if (E % 8 == 0)
        for (; j + 4 <= nk; j += 4) {
            const int64_t within = j + 4 + ahead <= streamed ? ahead : 0; /* rows read */
            for (int r = 0; r < rows;) {
                const float *qr = q + r * ldq;
                const void *kj = (const char *)k + (size_t)(j * ldk) * es;
                float *sr = s + r * lds + j;
                const int left = rows - r;
                /* 4 rows where the rest is not 5 or 6 (3 + 2, 3 + 3: no
                 * single row left over); not for float32 K read in place
                 * across rows (the ganged decode): there the 3-row tile's
                 * walk over four keys at once kept more rows in flight
                 * from memory, and two keys a pass measured 1.05-1.10x
                 * its time (Zen 3, (1,32,1,16384,128), 8 KV heads) */
                const bool four = (HK != HK_F32 || streamed > 0) && (left == 4 || left >= 7);
                const int R = four ? 4 : left < 3 ? left : 3;
                r += R;
                if (R == 4 && streamed > 0)
                    qk_rows_tile4(qr, ldq, kj, ldk, E, sr, lds, true, HK, within);
                else if (R == 4)
                    qk_rows_tile4(qr, ldq, kj, ldk, E, sr, lds, false, HK, 0);
                else if (streamed > 0)
                    R == 3   ? qk_rows_tile(qr, ldq, kj, ldk, E, 3, sr, lds, true, HK, within)
                    : R == 2 ? qk_rows_tile(qr, ldq, kj, ldk, E, 2, sr, lds, true, HK, within)
                             : qk_rows_tile(qr, ldq, kj, ldk, E, 1, sr, lds, true, HK, within);
                else
                    R == 3   ? qk_rows_tile(qr, ldq, kj, ldk, E, 3, sr, lds, false, HK, 0)
                    : R == 2 ? qk_rows_tile(qr, ldq, kj, ldk, E, 2, sr, lds, false, HK, 0)
                             : qk_rows_tile(qr, ldq, kj, ldk, E, 1, sr, lds, false, HK, 0);
            }
        }
    for (; j < nk; j++)
        for (int r = 0; r < rows; r++) s[r * lds + j] = dot_ps(q + r * ldq, k, j * ldk, E, HK);
}

static void qk_rows_f(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                      int rows, int64_t nk, float *s, int64_t lds, int64_t streamed) {
    qk_rows(q, ldq, k, ldk, E, rows, nk, s, lds, streamed, HK_F32);
}

/* qk_rows_f over 16-bit K rows (ukernel.h: qk_rows_h). */
static void qk_rows_h(const float *q, int64_t ldq, const uint16_t *k, int64_t ldk,
                      attn_dtype kdt, int64_t E, int rows, int64_t nk, float *s, int64_t lds,
                      int64_t streamed) {
    if (kdt == ATTN_DTYPE_F16)
        qk_rows(q, ldq, k, ldk, E, rows, nk, s, lds, streamed, HK_F16);
    else
        qk_rows(q, ldq, k, ldk, E, rows, nk, s, lds, streamed, HK_BF16);
}

/* ---- online softmax, one row per query (keys-in-columns layout) ---- */

ALWAYS_INLINE float hmin(__m256 v) {
    __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_min_ps(s, _mm_movehl_ps(s, s));
    s = _mm_min_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void softmax_f(float *s, int64_t lds, int rows, int64_t cols, float c, float *m, float *l,
                      float *alpha) {
    const float none = c >= 0 ? -INFINITY : INFINITY;
    const __m256 cv = _mm256_set1_ps(c);
    for (int r = 0; r < rows; r++) {
        float *sr = s + r * lds;
        __m256 mv = _mm256_set1_ps(none);
        if (c >= 0)
            for (int64_t j = 0; j < cols; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + j));
        else
            for (int64_t j = 0; j < cols; j += 8) mv = _mm256_min_ps(mv, _mm256_loadu_ps(sr + j));
        const float best = c >= 0 ? hmax(mv) : hmin(mv);
        const float m_new = (c >= 0 ? best > m[r] : best < m[r]) ? best : m[r];
        const float ref = m_new == none ? 0.0f : m_new;
        const __m256 refv = _mm256_set1_ps(ref);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < cols; j += 8) {
            const __m256 p = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + j), refv), cv));
            _mm256_storeu_ps(sr + j, p);
            sum = _mm256_add_ps(sum, p);
        }
        alpha[r] = attn__exp2f((m[r] - ref) * c);
        l[r] = l[r] * alpha[r] + hsum(sum);
        m[r] = m_new;
    }
}

/* ---- O = alpha·O + P · V ---- */

/* Loads and stores of a tile row's vector vi: plain ones, unless it is the
 * last vector of a chunk that ends in a partial one (TAIL). vmaskmovps is
 * the slow instruction on AMD cores (loads: about one per cycle; stores:
 * microcoded), and pv's inner loop loads V for every key: with masked V
 * loads throughout, pv on Zen 4 took 1.65x the AVX-512 kernel's time for
 * the same FMAs (perf, (1,4,2048,2048,128), one thread). */
ALWAYS_INLINE __m256 load_vec(const float *x, int vi, int NV, bool TAIL, __m256i last) {
    return TAIL && vi == NV - 1 ? _mm256_maskload_ps(x, last) : _mm256_loadu_ps(x);
}
ALWAYS_INLINE void store_vec(float *x, __m256 v, int vi, int NV, bool TAIL, __m256i last) {
    if (TAIL && vi == NV - 1)
        _mm256_maskstore_ps(x, last, v);
    else
        _mm256_storeu_ps(x, v);
}

ALWAYS_INLINE void pv_tile(const float *p, int64_t p_rs, int64_t p_cs, const void *v, int64_t ldv, int64_t nk,
                           float *o, int64_t ldo, const float *alpha, const int R, const int NV,
                           const bool TAIL, __m256i last, int in_last, const int HK,
                           int64_t ahead, int64_t held) {
    __m256 acc[ROWS][VECS], vv[VECS];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        const __m256 a = _mm256_set1_ps(alpha[r]);
#pragma GCC unroll 2
        for (int vi = 0; vi < NV; vi++)
            acc[r][vi] = _mm256_mul_ps(a, load_vec(o + r * ldo + 8 * vi, vi, NV, TAIL, last));
    }
    /* key j's weights: rows 0-2 at p0 + {0, 1, 2}·p_rs, rows 3-5 at p3 +
     * the same (flash_avx512.c's pv_tile says why) */
    const float *p0 = p, *p3 = R > 3 ? p + 3 * p_rs : p;
    for (int64_t j = 0; j < nk; j++, p0 += p_cs, p3 += p_cs) {
        if (ahead && j + ahead < held) /* below `streamed`; a chunk: 64 bytes or less */
            request_line(v, (j + ahead) * ldv, HK);
#pragma GCC unroll 2
        for (int vi = 0; vi < NV; vi++)
            vv[vi] = HK == HK_F32 ? load_vec((const float *)v + j * ldv + 8 * vi, vi, NV, TAIL, last)
                     : TAIL && vi == NV - 1 ? load_part8(v, j * ldv + 8 * vi, in_last, HK)
                                            : load8(v, j * ldv + 8 * vi, HK);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 pb = _mm256_broadcast_ss(r < 3 ? p0 + r * p_rs : p3 + (r - 3) * p_rs);
#pragma GCC unroll 2
            for (int vi = 0; vi < NV; vi++) acc[r][vi] = _mm256_fmadd_ps(pb, vv[vi], acc[r][vi]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int vi = 0; vi < NV; vi++) store_vec(o + r * ldo + 8 * vi, acc[r][vi], vi, NV, TAIL, last);
}

#define PV_CASE(R)                                                                         \
    case R:                                                                                \
        if (nv == 2 && full)                                                               \
            pv_tile(p, p_rs, p_cs, ve, ldv, nk, o + e, ldo, alpha, R, 2, false, last, n, HK, \
                    ahead, held);                                                          \
        else if (nv == 2)                                                                  \
            pv_tile(p, p_rs, p_cs, ve, ldv, nk, o + e, ldo, alpha, R, 2, true, last, n, HK,  \
                    ahead, held);                                                          \
        else                                                                               \
            pv_tile(p, p_rs, p_cs, ve, ldv, nk, o + e, ldo, alpha, R, 1, !full, last, n, HK, \
                    ahead, held);                                                          \
        break;

/* pv_chunks for a single row tile of R rows: its shape chosen once, then
 * every full chunk of 8·VECS features, then the partial one. A decode step
 * calls pv over 8 keys at a time, and choosing the tile and the chunk's
 * masks anew for each chunk had been two fifths of pv's instructions (Zen 3
 * ganged decode, callgrind: 110 of a chunk's 270). The same tiles over the
 * same chunks: the same multiply-adds in the same order. */
ALWAYS_INLINE void pv_chunks_tile(const float *p, int64_t p_rs, int64_t p_cs, const void *v,
                                  int64_t ldv, int64_t nk, int64_t Ev, float *o, int64_t ldo,
                                  const float *alpha, const int R, const int HK, int64_t ahead,
                                  int64_t held) {
    const size_t es = HK == HK_F32 ? 4 : 2;
    const __m256i all = _mm256_set1_epi32(-1);
    int64_t e = 0;
    for (; e + 8 * VECS <= Ev; e += 8 * VECS)
        pv_tile(p, p_rs, p_cs, (const char *)v + (size_t)e * es, ldv, nk, o + e, ldo, alpha, R,
                2, false, all, 8, HK, ahead, held);
    if (e == Ev) return;
    const int64_t left = Ev - e, in_last = left > 8 ? left - 8 : left;
    const __m256i last = lane_mask(in_last);
    const void *ve = (const char *)v + (size_t)e * es;
    if (left > 8)
        pv_tile(p, p_rs, p_cs, ve, ldv, nk, o + e, ldo, alpha, R, 2, true, last, (int)in_last, HK,
                ahead, held);
    else
        pv_tile(p, p_rs, p_cs, ve, ldv, nk, o + e, ldo, alpha, R, 1, in_last < 8, last,
                (int)in_last, HK, ahead, held);
}

#define PV_ONE_TILE(R)                                                                     \
    case R:                                                                                \
        pv_chunks_tile(p_all, p_rs, p_cs, v, ldv, nk, Ev, o_all, ldo, alpha_all, R, HK, ahead, \
                       held);                                                              \
        return;

/* Feature chunks outside, row tiles inside, so a V chunk stays in L1. */
ALWAYS_INLINE void pv_chunks(const float *p_all, int64_t p_rs, int64_t p_cs, const void *v,
                             int64_t ldv, int rows_all, int64_t nk, int64_t Ev, float *o_all,
                             int64_t ldo, const float *alpha_all, const int HK, int64_t ahead,
                             int64_t held) {
    const size_t es = HK == HK_F32 ? 4 : 2;
    switch (rows_all) { /* one row tile: the chunks inside it */
        PV_ONE_TILE(6)
        PV_ONE_TILE(5)
        PV_ONE_TILE(4)
        PV_ONE_TILE(3)
        PV_ONE_TILE(2)
        PV_ONE_TILE(1)
    default: break;
    }
    for (int64_t e = 0; e < Ev; e += 8 * VECS) {
        const void *ve = (const char *)v + (size_t)e * es;
        const int64_t left = Ev - e;
        const int nv = left > 8 ? 2 : 1;
        const int64_t in_last = left - 8 * (nv - 1);
        const __m256i last = lane_mask(in_last >= 8 ? 8 : in_last);
        const bool full = in_last >= 8; /* no partial vector in this chunk */
        const int n = (int)(in_last >= 8 ? 8 : in_last);
        for (int rr = 0; rr < rows_all; rr += ROWS) {
            const int rows = rows_all - rr < ROWS ? rows_all - rr : ROWS;
            const float *p = p_all + rr * p_rs, *alpha = alpha_all + rr;
            float *o = o_all + rr * ldo;
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
}

/* Keys per sub-block of pv for one row tile (decoding). */
enum { PV_KEYS = 32 };

/* O = alpha·O + P·V. One row tile over several feature chunks (decoding:
 * a few query rows over a long V block): keys in sub-blocks of PV_KEYS
 * outside the chunks, so each sub-block's V rows are read whole, front to
 * back, and every chunk then finds them in L1. Chunk after chunk over the
 * whole block read each V row 64 bytes at a time, 8 strided walks per
 * block (E = 128), and left the AVX2 decode's P·V three times slower than
 * its scores (Zen 4, (1,32,1,32768,128), 8 KV heads). The same multiply-adds
 * in the same order: O is stored and reloaded between sub-blocks (times 1). */
ALWAYS_INLINE void pv(const float *p_all, int64_t p_rs, int64_t p_cs, const void *v, int64_t ldv,
                      int rows_all, int64_t nk, int64_t Ev, float *o_all, int64_t ldo,
                      const float *alpha_all, int64_t streamed, const int HK) {
    const size_t es = HK == HK_F32 ? 4 : 2;
    const int64_t ahead = streamed > 0 ? attn__rows_ahead(ATTN__V_AHEAD, Ev * (int64_t)es) : 0;
    if (rows_all > ROWS || Ev <= 8 * VECS || nk <= PV_KEYS) {
        /* Constant strides where the layout fixes one (a tile's weights at
         * fixed offsets or one pointer apart) and, without requests ahead,
         * no per-key test for them: the lanes layout's P (p_rs 1) and the
         * backward's Pᵀ and dSᵀ products (p_cs 1) spent a fifth of their
         * instructions on address arithmetic and that test. */
        if (p_rs == 1 && ahead == 0)
            pv_chunks(p_all, 1, p_cs, v, ldv, rows_all, nk, Ev, o_all, ldo, alpha_all, HK, 0, 0);
        else if (p_cs == 1 && ahead == 0)
            pv_chunks(p_all, p_rs, 1, v, ldv, rows_all, nk, Ev, o_all, ldo, alpha_all, HK, 0, 0);
        else
            pv_chunks(p_all, p_rs, p_cs, v, ldv, rows_all, nk, Ev, o_all, ldo, alpha_all, HK,
                      ahead, streamed);
        return;
    }
    static const float ones[ROWS] = {1, 1, 1, 1, 1, 1};
    for (int64_t j0 = 0; j0 < nk; j0 += PV_KEYS)
        pv_chunks(p_all + j0 * p_cs, p_rs, p_cs, (const char *)v + (size_t)(j0 * ldv) * es, ldv,
                  rows_all, nk - j0 < PV_KEYS ? nk - j0 : PV_KEYS, Ev, o_all, ldo,
                  j0 == 0 ? alpha_all : ones, HK, ahead, streamed - j0);
}

static void pv_f(const float *p, int64_t p_rs, int64_t p_cs, const float *v, int64_t ldv, int rows,
                 int64_t nk, int64_t Ev, float *o, int64_t ldo, const float *alpha,
                 int64_t streamed) {
    pv(p, p_rs, p_cs, v, ldv, rows, nk, Ev, o, ldo, alpha, streamed, HK_F32);
}

/* pv_f over 16-bit V rows (ukernel.h: pv_h). */
static void pv_h(const float *p, int64_t p_rs, int64_t p_cs, const uint16_t *v, int64_t ldv,
                 attn_dtype vdt, int rows, int64_t nk, int64_t Ev, float *o, int64_t ldo,
                 const float *alpha, int64_t streamed) {
    if (vdt == ATTN_DTYPE_F16)
        pv(p, p_rs, p_cs, v, ldv, rows, nk, Ev, o, ldo, alpha, streamed, HK_F16);
    else
        pv(p, p_rs, p_cs, v, ldv, rows, nk, Ev, o, ldo, alpha, streamed, HK_BF16);
}

/* ---- the backward's elementwise step (ukernel.h) ---- */

/* P = 2^(S·c - off) and dS = ds_scale·P·(dP - D), 8 queries per vector.
 * The exponent is one fused multiply-add, so it is rounded once. A lane
 * whose P is 0 (a hidden key, whose dP may be anything) gets dS = 0. */
static void softmax_bwd_t_f(float *st, float *dpt, int64_t ld, int64_t nk, int64_t lanes, float c,
                            const float *off, const float *off_lo, const float *D,
                            float ds_scale) {
    const __m256 cv = _mm256_set1_ps(c), sc = _mm256_set1_ps(ds_scale), zero = _mm256_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        float *s = st + j * ld, *dp = dpt + j * ld;
        for (int64_t r = 0; r < lanes; r += 8) {
            const __m256 x = _mm256_fmsub_ps(_mm256_loadu_ps(s + r), cv, _mm256_loadu_ps(off + r));
            const __m256 pr = exp2_ps(_mm256_sub_ps(x, _mm256_loadu_ps(off_lo + r)));
            _mm256_storeu_ps(s + r, pr);
            _mm256_storeu_ps(dp + r, _mm256_and_ps(_mm256_cmp_ps(pr, zero, _CMP_NEQ_UQ), _mm256_mul_ps(_mm256_mul_ps(pr, sc), _mm256_sub_ps(_mm256_loadu_ps(dp + r), _mm256_loadu_ps(D + r)))));
        }
    }
}

/* ---- operand loads (ukernel.h): 16-bit rows widened 8 at a time ---- */

/* float16 (F16C's vcvtph2ps) or bfloat16 (the bits shifted into a float32's
 * top half): both exact. A row's last 1-7 elements, rows with a column
 * stride and other dtypes take the portable loads (which copy rows already
 * of the compute type). */
static void load_rows_f(const void *src, attn_dtype dtype, int64_t rs, int64_t cs, int64_t nrows,
                        int64_t width, float *dst, int64_t ld) {
    const bool f16 = dtype == ATTN_DTYPE_F16;
    if (cs != 1 || !(f16 || dtype == ATTN_DTYPE_BF16)) {
        attn__load_rows_generic_f(src, dtype, rs, cs, nrows, width, dst, ld);
        return;
    }
    const int64_t body = width / 8 * 8;
    for (int64_t i = 0; i < nrows; i++) {
        const uint16_t *s = (const uint16_t *)src + i * rs;
        float *d = dst + i * ld;
        for (int64_t j = 0; j < body; j += 8)
            _mm256_storeu_ps(d + j, f16 ? load8(s, j, HK_F16) : load8(s, j, HK_BF16));
        if (body < width)
            attn__load_rows_generic_f(s + body, dtype, rs, 1, 1, width - body, d + body, ld);
    }
}

/* The float32 slots; float64 keeps the portable kernels. S is padded to
 * 8 columns (one vector) and pv has a 6-row register tile. Blocks: the
 * portable context's 48 lanes (three 16-query qkt tiles per 6 keys), and
 * key blocks measured on AMD Zen 3 (32 KiB L1, one thread, best of 96-128
 * calls alternating, docs/design.md "AVX2 on Zen 3"): heads up to 64 wide
 * take 64 keys (the 128 of AVX-512 left the score tile and Qt, 24 + 12 KiB,
 * past L1: 73 against 79 GFLOP/s at (1,1,2048,2048,64), and 61 against 67
 * for causal (1,12,512,512,64)); up to 128 wide, 48 keys (80-82 against
 * 77-79 for 64, causal and not). */
/* A float32 output row (ukernel.h: store_row_f): one multiply a value, as
 * the portable loop, so the same bits; an all-ones exponent marks NaN/Inf. */
static bool store_row_f(const float *o, float inv, int64_t n, float *dst) {
    const __m256 iv = _mm256_set1_ps(inv);
    const __m256i exp = _mm256_set1_epi32(0x7f800000);
    __m256i special = _mm256_setzero_si256();
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(o + e), iv);
        _mm256_storeu_ps(dst + e, x);
        special = _mm256_or_si256(
            special, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), exp), exp));
    }
    bool finite = _mm256_testz_si256(special, special);
    for (; e < n; e++) {
        dst[e] = o[e] * inv;
        finite &= isfinite(dst[e]);
    }
    return finite;
}

void attn__ukernel_init_avx2(attn__ukernel *ctx) {
    ctx->name = "avx2";
    ctx->load_rows_f = load_rows_f;
    ctx->pack_qt_f = pack_qt_f;
    ctx->key_block[0].keys = 64; /* max_width 64  */
    ctx->key_block[1].keys = 48; /* max_width 128 */
    ctx->pv_rows = ROWS;
    ctx->col_step = 8;
    ctx->qkt_f = qkt_f;
    ctx->softmax_t_f = softmax_t_f;
    ctx->qk_direct_f = qk_direct_f;
    ctx->qk_rows_f = qk_rows_f;
    ctx->qk_rows_h = qk_rows_h;
    ctx->pv_h = pv_h;
    ctx->softmax_f = softmax_f;
    ctx->pv_f = pv_f;
    ctx->softmax_bwd_t_f = softmax_bwd_t_f;
    ctx->store_row_f = store_row_f;
}
