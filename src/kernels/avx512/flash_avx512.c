/*
 * flash_avx512.c — float32 fused-attention micro-kernels for AVX-512F.
 * Only this file is compiled with -mavx512f; the driver calls it through
 * its context (attn__ukernel_init_avx512) after CPUID + xgetbv said the CPU
 * and OS support it.
 *
 * Register tiles (32 zmm registers):
 *   qkt  8 keys x 48 queries: 24 accumulators, 3 Qt vectors, broadcast k
 *   pv   6 query rows x 64 output features: 24 accumulators, 4 V vectors
 *   qk_rows  6 query rows x 4 keys (decoding): 24 accumulators, 4 K vectors
 * Edge tiles (fewer keys, rows or features) are the same code specialised
 * by the compiler for each shape, with masked loads and stores for tails.
 */
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "../exp2.h"
#include "../ukernel.h"
#include "simd512.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 6
#define VECS 4 /* 16-float vectors per tile row */

/* ---- Qt: a block of query rows, transposed ---- */

/* Rows with unit column stride: 16 x 16 blocks loaded row by row and
 * transposed in registers (about 4x fewer cycles than gathers; small heads,
 * MHA's 32 x 40 for one, spent 13% of their time packing with gathers). */
static void pack_qt_rows_f(const float *q, int64_t rs, int64_t nr, int64_t E, float scale,
                           float *qt, int64_t lanes, int64_t ldqt) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < lanes; c += 16) {
        const int64_t live = nr - c < 0 ? 0 : nr - c < 16 ? nr - c : 16;
        for (int64_t e0 = 0; e0 < E; e0 += 16) {
            const int64_t ne = E - e0 < 16 ? E - e0 : 16;
            const __mmask16 em = (__mmask16)((1u << ne) - 1);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < live ? _mm512_maskz_loadu_ps(em, q + (c + i) * rs + e0) : _mm512_setzero_ps();
            transpose16(r);
            for (int k = 0; k < ne; k++) _mm512_storeu_ps(qt + (e0 + k) * ldqt + c, _mm512_mul_ps(r[k], sc));
        }
    }
}

/* Otherwise one 16-lane gather per (e, 16 rows): far cheaper than a scalar
 * transpose. Falls back to the portable loop when row offsets exceed 32 bits. */
static void pack_qt_f(const float *q, int64_t rs, int64_t cs, int64_t nr, int64_t E, float scale,
                      float *qt, int64_t lanes, int64_t ldqt) {
    if (cs == 1) {
        pack_qt_rows_f(q, rs, nr, E, scale, qt, lanes, ldqt);
        return;
    }
    const int64_t span = (nr > 0 ? nr - 1 : 0) * (rs < 0 ? -rs : rs);
    if (span > INT32_MAX / 4) {
        for (int64_t e = 0; e < E; e++)
            for (int64_t r = 0; r < lanes; r++) qt[e * ldqt + r] = r < nr ? q[r * rs + e * cs] * scale : 0;
        return;
    }
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t c = 0; c < lanes; c += 16) {
        const __mmask16 live = nr - c >= 16 ? (__mmask16)0xffff
                               : nr > c    ? (__mmask16)((1u << (nr - c)) - 1)
                                           : 0;
        const __m512i idx = _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32((int)c)),
                                               _mm512_set1_epi32((int)rs));
        for (int64_t e = 0; e < E; e++) {
            const __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, q + e * cs, 4);
            _mm512_storeu_ps(qt + e * ldqt + c, _mm512_mul_ps(x, sc));
        }
    }
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

#define QKT_NV(JK)                                                                            \
    case JK:                                                                                  \
        if (ng == 3)                                                                          \
            qkt_tile(qt + c0, ldqt, k + j * ldk, ldk, E, st + j * ldst + c0, ldst, JK, 3);   \
        else if (ng == 2)                                                                     \
            qkt_tile(qt + c0, ldqt, k + j * ldk, ldk, E, st + j * ldst + c0, ldst, JK, 2);   \
        else                                                                                  \
            qkt_tile(qt + c0, ldqt, k + j * ldk, ldk, E, st + j * ldst + c0, ldst, JK, 1);   \
        break;

static void qkt_f(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E, int64_t nk,
                  int64_t lanes, float *st, int64_t ldst, const int64_t *keys) {
    for (int64_t c = 0; c < lanes; c += 16 * QVECS) {
        const int nv = (int)((lanes - c) / 16 < QVECS ? (lanes - c) / 16 : QVECS);
        const int64_t nt = tile_keys(keys, c, nv, nk);
        for (int64_t j = 0; j < nt; j += KEYS) {
            int lo;
            const int ng = tile_groups(keys, c, nv, j, &lo);
            const int64_t c0 = c + 16 * lo;
            switch (nt - j < KEYS ? nt - j : KEYS) {
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
 * running maximum and sum need no horizontal reductions. Three column
 * vectors (48 queries) are walked together, so the chains of one run in the
 * latency shadow of the others. m is each column's best raw score so far
 * (the largest when c >= 0, the smallest when c < 0) and x = (s - m)·c. */
ALWAYS_INLINE void softmax_cols(float *st, int64_t ldst, int64_t nk, float c, float *m, float *l,
                                float *alpha, const int NV) {
    const __m512 cv = _mm512_set1_ps(c);
    __m512 mx[QVECS], ref[QVECS], sum[QVECS];
    column_best(st, ldst, nk, c, m, mx, ref, NV);
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) sum[v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) {
            float *at = st + j * ldst + 16 * v;
            const __m512 p = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(at), ref[v]), cv));
            _mm512_storeu_ps(at, p);
            sum[v] = _mm512_add_ps(sum[v], p);
        }
    column_update(m, l, alpha, mx, ref, sum, c, NV);
}

static void softmax_t_f(float *st, int64_t ldst, int64_t nk, int64_t lanes, float c, float *m,
                        float *l, float *alpha) {
    for (int64_t col = 0; col < lanes; col += 16 * QVECS) {
        const int64_t nv = (lanes - col) / 16 < QVECS ? (lanes - col) / 16 : QVECS;
        if (nv == 3)
            softmax_cols(st + col, ldst, nk, c, m + col, l + col, alpha + col, 3);
        else if (nv == 2)
            softmax_cols(st + col, ldst, nk, c, m + col, l + col, alpha + col, 2);
        else
            softmax_cols(st + col, ldst, nk, c, m + col, l + col, alpha + col, 1);
    }
}

/* S = Q · Kᵀ with K read in place and the products summed in float64,
 * each score rounded once to float32 (tiny calls, whose error float32 sums
 * would dominate; see exact_scores). qk_direct_f below for heads of up to
 * DIRECT_E features; this one-key-at-a-time loop (8 lanes, then a
 * horizontal sum per score) for wider ones. */
static void qk_direct_keys_f(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                             int rows, int64_t nk, float *s, int64_t lds) {
    const int64_t full = E / 8 * 8;
    /* AVX-512F only (no VL): a masked 16-lane load, low 8 lanes used */
    const __mmask16 tail = (__mmask16)((1u << (E - full)) - 1);
    for (int64_t j = 0; j < nk; j++) {
        const float *kj = k + j * ldk;
        __m512d acc[ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_pd();
        for (int64_t e = 0; e < full; e += 8) {
            const __m512d kv = _mm512_cvtps_pd(_mm256_loadu_ps(kj + e));
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(q + r * ldq + e)), kv, acc[r]);
        }
        if (tail) {
            const __m512d kv =
                _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_maskz_loadu_ps(tail, kj + full)));
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(
                                             _mm512_maskz_loadu_ps(tail, q + r * ldq + full))),
                                         kv, acc[r]);
        }
        for (int r = 0; r < rows; r++) s[r * lds + j] = (float)_mm512_reduce_add_pd(acc[r]);
    }
}

enum { DIRECT_E = 256 }; /* qk_direct_f's widened Q rows: 6 x 256 doubles on the stack */

/* Transposes an 8 x 8 block of doubles held as 8 row vectors. */
ALWAYS_INLINE void transpose8d(__m512d r[8]) {
    __m512d t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_pd(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_pd(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) { /* rows h .. h+3: 128-bit lanes 0,2 and 1,3 */
        u[h] = _mm512_shuffle_f64x2(t[h], t[h + 2], 0x88);
        u[h + 1] = _mm512_shuffle_f64x2(t[h], t[h + 2], 0xDD);
        u[h + 2] = _mm512_shuffle_f64x2(t[h + 1], t[h + 3], 0x88);
        u[h + 3] = _mm512_shuffle_f64x2(t[h + 1], t[h + 3], 0xDD);
    }
    /* u[0..3]: columns {0,4}, {2,6}, {1,5}, {3,7} of rows 0-3; u[4..7] of rows 4-7 */
    static const int col[4][2] = {{0, 4}, {2, 6}, {1, 5}, {3, 7}};
    for (int i = 0; i < 4; i++) {
        r[col[i][0]] = _mm512_shuffle_f64x2(u[i], u[i + 4], 0x88);
        r[col[i][1]] = _mm512_shuffle_f64x2(u[i], u[i + 4], 0xDD);
    }
}

/* Keys j0 .. j0+nj-1 (nj <= 8; the rest zero), features e0 .. e0+7 (zero
 * past E), widened and transposed in registers: c[e] holds feature e0 + e
 * of the 8 keys. */
ALWAYS_INLINE void widen_keys8(const float *k, int64_t ldk, int64_t E, int64_t j0, int nj,
                               int64_t e0, __m512d c[8]) {
    const __mmask16 em = (__mmask16)(E - e0 >= 8 ? 0xff : (1u << (E - e0)) - 1);
    for (int i = 0; i < 8; i++)
        c[i] = i < nj ? _mm512_cvtps_pd(_mm512_castps512_ps256(
                            _mm512_maskz_loadu_ps(em, k + (j0 + i) * ldk + e0)))
                      : _mm512_setzero_pd();
    transpose8d(c);
}

/* R rows of scores, 8 keys a vector: each 8 x 8 block of K widened and
 * transposed in registers, so a multiply-add with a broadcast Q element
 * gives a lane of 8 scores and no score needs a horizontal sum. q64: the
 * rows widened, ld8 (a multiple of 8) doubles apart, zero past E. */
ALWAYS_INLINE void qk_direct_tile(const double *q64, int64_t ld8, const float *k, int64_t ldk,
                                  int64_t E, int64_t nk, float *s, int64_t lds, const int R) {
    for (int64_t j0 = 0; j0 < nk; j0 += 8) {
        const int nj = nk - j0 < 8 ? (int)(nk - j0) : 8;
        __m512d acc[ROWS];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_pd();
        for (int64_t e0 = 0; e0 < ld8; e0 += 8) {
            __m512d c[8];
            widen_keys8(k, ldk, E, j0, nj, e0, c);
            for (int e = 0; e < 8; e++)
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_fmadd_pd(_mm512_set1_pd(q64[r * ld8 + e0 + e]), c[e], acc[r]);
        }
        const __mmask16 jm = (__mmask16)((1u << nj) - 1);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(s + r * lds + j0, jm,
                                  _mm512_castps256_ps512(_mm512_cvtpd_ps(acc[r])));
    }
}

/* Q rows rr .. rr+rows-1 widened into q64 (rows x ld8 doubles, zero past E). */
static void widen_rows(const float *q, int64_t ldq, int64_t E, int64_t ld8, int rows,
                       double *q64) {
    for (int r = 0; r < rows; r++)
        for (int64_t e = 0; e < ld8; e++) q64[r * ld8 + e] = e < E ? (double)q[r * ldq + e] : 0.0;
}

/* One row tile of qk_direct_tile's sums over K widened and transposed
 * beforehand (kt: per 8 keys, ld8 features x 8 keys), the same
 * multiply-adds in the same order, so the same bits. Two groups of 8 keys
 * at a time: 12 sums in flight, where 6 left the FMA pipes waiting on
 * each other's latency. */
ALWAYS_INLINE void qk_direct_kt(const double *q64, int64_t ld8, const double *kt, int64_t nk,
                                float *s, int64_t lds, const int R) {
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
        const int64_t left = nk - j0;
        const int n0 = left < 8 ? (int)left : 8, n1 = left <= 8 ? 0 : left < 16 ? (int)(left - 8) : 8;
        /* no second group: k1 reads k0 again and its sums are not stored */
        const double *k0 = kt + j0 * ld8, *k1 = n1 > 0 ? k0 + 8 * ld8 : k0;
        __m512d a0[ROWS], a1[ROWS];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_pd();
        for (int64_t e = 0; e < ld8; e++) {
            const __m512d c0 = _mm512_loadu_pd(k0 + 8 * e), c1 = _mm512_loadu_pd(k1 + 8 * e);
            for (int r = 0; r < R; r++) {
                const __m512d qe = _mm512_set1_pd(q64[r * ld8 + e]);
                a0[r] = _mm512_fmadd_pd(qe, c0, a0[r]);
                a1[r] = _mm512_fmadd_pd(qe, c1, a1[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm512_mask_storeu_ps(s + r * lds + j0, (__mmask16)((1u << n0) - 1),
                                  _mm512_castps256_ps512(_mm512_cvtpd_ps(a0[r])));
            if (n1 > 0)
                _mm512_mask_storeu_ps(s + r * lds + j0 + 8, (__mmask16)((1u << n1) - 1),
                                      _mm512_castps256_ps512(_mm512_cvtpd_ps(a1[r])));
        }
    }
}

/* Keys j0 .. j0+nk-1 of K widened and transposed into kt as qk_direct_kt
 * reads them (8 keys a group; keys past nk zero). */
static void transpose_keys(const float *k, int64_t ldk, int64_t E, int64_t ld8, int64_t nk,
                           double *kt) {
    for (int64_t j0 = 0; j0 < nk; j0 += 8) {
        const int nj = nk - j0 < 8 ? (int)(nk - j0) : 8;
        for (int64_t e0 = 0; e0 < ld8; e0 += 8) {
            __m512d c[8];
            widen_keys8(k, ldk, E, j0, nj, e0, c);
            for (int e = 0; e < 8; e++) _mm512_storeu_pd(kt + j0 * ld8 + (e0 + e) * 8, c[e]);
        }
    }
}

enum { KT_DOUBLES = 2048 }; /* qk_direct_f's transposed keys on the stack: 16 KiB */

/* Float64 sums of any number of rows' scores (the exact scores: see
 * qk_direct_keys_f). On heads of 64, keys 8 to a vector took a third of
 * the one-key-at-a-time loop's time, its horizontal sums and Q widened per
 * key gone (a 32-token call spent half its time there). Up to ROWS rows
 * widen and transpose K in registers as they go; more rows (a tiny call's
 * every row of a head at once) share each chunk of K widened and
 * transposed once, where each tile of ROWS had done it again: 41-43% of
 * the C call of (1,1,16,16,128) and (1,1,32,32,32) had been this kernel. */
static void qk_direct_f(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, float *s, int64_t lds) {
    if (E > DIRECT_E) {
        for (int r0 = 0; r0 < rows; r0 += ROWS)
            qk_direct_keys_f(q + r0 * ldq, ldq, k, ldk, E, rows - r0 < ROWS ? rows - r0 : ROWS,
                             nk, s + r0 * lds, lds);
        return;
    }
    const int64_t ld8 = (E + 7) / 8 * 8;
    double q64[ROWS * DIRECT_E]; /* a row tile, rows x ld8 */
    if (rows <= ROWS) {
        widen_rows(q, ldq, E, ld8, rows, q64);
        switch (rows) {
        case 1: qk_direct_tile(q64, ld8, k, ldk, E, nk, s, lds, 1); break;
        case 2: qk_direct_tile(q64, ld8, k, ldk, E, nk, s, lds, 2); break;
        case 3: qk_direct_tile(q64, ld8, k, ldk, E, nk, s, lds, 3); break;
        case 4: qk_direct_tile(q64, ld8, k, ldk, E, nk, s, lds, 4); break;
        case 5: qk_direct_tile(q64, ld8, k, ldk, E, nk, s, lds, 5); break;
        default: qk_direct_tile(q64, ld8, k, ldk, E, nk, s, lds, ROWS); break;
        }
        return;
    }
    double kt[KT_DOUBLES] __attribute__((aligned(64)));
    const int64_t chunk = KT_DOUBLES / ld8 / 8 * 8; /* keys, >= 8 as ld8 <= DIRECT_E */
    for (int64_t j0 = 0; j0 < nk; j0 += chunk) {
        const int64_t n = nk - j0 < chunk ? nk - j0 : chunk;
        transpose_keys(k + j0 * ldk, ldk, E, ld8, n, kt);
        for (int r0 = 0; r0 < rows; r0 += ROWS) {
            const int R = rows - r0 < ROWS ? rows - r0 : ROWS;
            widen_rows(q + r0 * ldq, ldq, E, ld8, R, q64);
            float *sr = s + r0 * lds + j0;
            switch (R) {
            case 1: qk_direct_kt(q64, ld8, kt, n, sr, lds, 1); break;
            case 2: qk_direct_kt(q64, ld8, kt, n, sr, lds, 2); break;
            case 3: qk_direct_kt(q64, ld8, kt, n, sr, lds, 3); break;
            case 4: qk_direct_kt(q64, ld8, kt, n, sr, lds, 4); break;
            case 5: qk_direct_kt(q64, ld8, kt, n, sr, lds, 5); break;
            default: qk_direct_kt(q64, ld8, kt, n, sr, lds, ROWS); break;
            }
        }
    }
}

/* ---- K and V elements: float32, or 16-bit widened in registers ---- */

/* HK: what K or V rows hold. 16-bit rows (a decode from a float16/bfloat16
 * cache) are widened exactly as load_rows_f would, so the scores and sums
 * are the same bits as over widened rows, without writing them anywhere. */
enum { HK_F32, HK_F16, HK_BF16 };

/* Elements at .. at+15 of `base` (lanes past `mk` zero). 16-bit masked
 * loads need AVX-512BW, which this file does not assume: a partial vector
 * (a head width not a multiple of 16) is widened one element at a time. */
ALWAYS_INLINE __m512 load16(const void *base, int64_t at, __mmask16 mk, const int HK) {
    if (HK == HK_F32) return _mm512_maskz_loadu_ps(mk, (const float *)base + at);
    const uint16_t *h = (const uint16_t *)base + at;
    uint16_t part[16] = {0};
    if (mk != 0xffff) {
        for (int i = 0; i < 16; i++)
            if (mk >> i & 1) part[i] = h[i];
        h = part;
    }
    const __m256i x = _mm256_loadu_si256((const __m256i *)h);
    return HK == HK_F16 ? _mm512_cvtph_ps(x)
                        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* Requests the cache line of element `at` of `base` into L1: a streamed
 * walk's row ahead of its loads. Callers request only rows below
 * `streamed` (ukernel.h), which may lie past the kernel's own nk keys but
 * are rows the attention call reads. */
ALWAYS_INLINE void request_line(const void *base, int64_t at, const int HK) {
    _mm_prefetch((const char *)base + (size_t)at * (HK == HK_F32 ? 4 : 2), _MM_HINT_T0);
}

/* The four lane sums of a, b, c, d, in that order. */
ALWAYS_INLINE __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* each 128-bit lane: a, b, c, d partial sums */
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/* Scores of `R` rows against keys j .. j+3, float32 sums: 4R accumulators,
 * reduced four keys at a time (sum4). K in cache (SEQ false): the four
 * keys side by side, each Q vector loaded once for four products. K
 * streamed from memory (SEQ true): each key whole before the next, front to
 * back, the order the prefetchers follow. Each order costs the other's case
 * 10-25% (measured on Zen 4, docs/design.md). Tail features through a lane
 * mask. */
ALWAYS_INLINE void qk_rows_tile(const float *q, int64_t ldq, const void *k, int64_t ldk,
                                int64_t E, const int R, float *s, int64_t lds, const bool SEQ,
                                const int HK, int64_t ahead) {
    /* (the loops over rows and keys unrolled, so the accumulators stay in
     * registers: left rolled, GCC kept them on the stack, a store and a
     * load per multiply-add that bounded decoding from a bfloat16 cache) */
    __m512 acc[ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    if (SEQ)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            for (int64_t e = 0; e < E; e += 16) {
                const __mmask16 mk = E - e >= 16 ? 0xffff : (__mmask16)((1u << (E - e)) - 1);
                if (ahead && e % (HK == HK_F32 ? 16 : 32) == 0) /* one per line */
                    request_line(k, (c + ahead) * ldk + e, HK);
                const __m512 kv = load16(k, c * ldk + e, mk, HK);
#pragma GCC unroll 6
                for (int r = 0; r < R; r++)
                    acc[r][c] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + r * ldq + e), kv,
                                                acc[r][c]);
            }
    else
        for (int64_t e = 0; e < E; e += 16) {
            const __mmask16 mk = E - e >= 16 ? 0xffff : (__mmask16)((1u << (E - e)) - 1);
            __m512 kv[4];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) kv[c] = load16(k, c * ldk + e, mk, HK);
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                const __m512 qv = _mm512_maskz_loadu_ps(mk, q + r * ldq + e);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(qv, kv[c], acc[r][c]);
            }
        }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
        _mm_storeu_ps(s + r * lds, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* One score, float32 sums: the tail keys of qk_rows. */
ALWAYS_INLINE float dot_ps(const float *q, const void *k, int64_t at, int64_t E, const int HK) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t e = 0; e < E; e += 16) {
        const __mmask16 mk = E - e >= 16 ? 0xffff : (__mmask16)((1u << (E - e)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + e), load16(k, at + e, mk, HK), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

#define QK_ROWS_CASE(R)                                                             \
    case R:                                                                         \
        if (streamed > 0)                                                           \
            qk_rows_tile(q, ldq, k, ldk, E, R, s + j, lds, true, HK,                \
                         j + 4 + ahead <= streamed ? ahead : 0);                    \
        else                                                                        \
            qk_rows_tile(q, ldq, k, ldk, E, R, s + j, lds, false, HK, 0);           \
        break;

/* S = Q · Kᵀ, float32 sums (ukernel.h: qk_rows_f): keys four at a time,
 * then the last 1-3 one by one. */
ALWAYS_INLINE void qk_rows(const float *q, int64_t ldq, const void *k_all, int64_t ldk,
                           int64_t E, int rows, int64_t nk, float *s, int64_t lds,
                           int64_t streamed, const int HK) {
    const size_t es = HK == HK_F32 ? 4 : 2;
    const int64_t ahead = streamed > 0 ? attn__rows_ahead(ATTN__K_AHEAD, E * (int64_t)es) : 0;
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
        const void *k = (const char *)k_all + (size_t)(j * ldk) * es;
        switch (rows) {
            QK_ROWS_CASE(6)
            QK_ROWS_CASE(5)
            QK_ROWS_CASE(4)
            QK_ROWS_CASE(3)
            QK_ROWS_CASE(2)
        default:
            QK_ROWS_CASE(1)
        }
    }
    for (; j < nk; j++)
        for (int r = 0; r < rows; r++) s[r * lds + j] = dot_ps(q + r * ldq, k_all, j * ldk, E, HK);
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

static void softmax_f(float *s, int64_t lds, int rows, int64_t cols, float c, float *m, float *l,
                      float *alpha) {
    const float none = c >= 0 ? -INFINITY : INFINITY;
    const __m512 cv = _mm512_set1_ps(c);
    for (int r = 0; r < rows; r++) {
        float *sr = s + r * lds;
        __m512 mv = _mm512_set1_ps(none);
        if (c >= 0)
            for (int64_t j = 0; j < cols; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + j));
        else
            for (int64_t j = 0; j < cols; j += 16) mv = _mm512_min_ps(mv, _mm512_loadu_ps(sr + j));
        const float best = c >= 0 ? _mm512_reduce_max_ps(mv) : _mm512_reduce_min_ps(mv);
        const float m_new = (c >= 0 ? best > m[r] : best < m[r]) ? best : m[r];
        const float ref = m_new == none ? 0.0f : m_new;
        const __m512 refv = _mm512_set1_ps(ref);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < cols; j += 16) {
            const __m512 p = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), refv), cv));
            _mm512_storeu_ps(sr + j, p);
            sum = _mm512_add_ps(sum, p);
        }
        alpha[r] = attn__exp2f((m[r] - ref) * c);
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        m[r] = m_new;
    }
}

/* ---- O = alpha·O + P · V ---- */

/* TAIL: the last vector is partial and uses `last` as a lane mask; full
 * tiles use plain loads and stores (no mask register to keep live). */
ALWAYS_INLINE __m512 load_part(const float *x, __mmask16 mk, bool partial) {
    return partial ? _mm512_maskz_loadu_ps(mk, x) : _mm512_loadu_ps(x);
}

ALWAYS_INLINE void pv_tile(const float *p, int64_t p_rs, int64_t p_cs, const void *v, int64_t ldv,
                           int64_t nk, float *o, int64_t ldo, const float *alpha, const int R,
                           const int NV, __mmask16 last, const bool TAIL, const int HK,
                           int64_t ahead, int64_t held) {
    __m512 acc[ROWS][VECS], vv[VECS];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++)
            acc[r][vi] = _mm512_mul_ps(a, load_part(o + r * ldo + 16 * vi, last, TAIL && vi == NV - 1));
    }
    /* The weights of key j: rows 0-2 at p0 + {0, 1, 2}·p_rs, rows 3-5 at
     * p3 + the same, both pointers moving p_cs a key. Indexed as
     * p[r·p_rs + j·p_cs], GCC kept six row pointers, spilled to the stack
     * and to xmm registers, a reload and an add to memory beside each
     * row's four multiply-adds: the backward's dK and dV products (p_rs =
     * lanes) ran at 0.78-0.95x the speed of dQ's (p_rs = 1), now at
     * 0.93-1.03x (tiles in cache, Emerald Rapids, one thread). */
    const float *p0 = p, *p3 = R > 3 ? p + 3 * p_rs : p;
    for (int64_t j = 0; j < nk; j++, p0 += p_cs, p3 += p_cs) {
        if (ahead && j + ahead < held) /* below `streamed` */
#pragma GCC unroll 4
            for (int vi = 0; vi < NV; vi++) /* one per line: 16-bit vectors are half one */
                if (HK == HK_F32 || vi % 2 == 0)
                    request_line(v, (j + ahead) * ldv + 16 * vi, HK);
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++)
            vv[vi] = HK == HK_F32
                         ? load_part((const float *)v + j * ldv + 16 * vi, last, TAIL && vi == NV - 1)
                         : load16(v, j * ldv + 16 * vi, TAIL && vi == NV - 1 ? last : 0xffff, HK);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512 pb = _mm512_set1_ps(r < 3 ? p0[r * p_rs] : p3[(r - 3) * p_rs]);
#pragma GCC unroll 4
            for (int vi = 0; vi < NV; vi++) acc[r][vi] = _mm512_fmadd_ps(pb, vv[vi], acc[r][vi]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++) {
            if (TAIL && vi == NV - 1)
                _mm512_mask_storeu_ps(o + r * ldo + 16 * vi, last, acc[r][vi]);
            else
                _mm512_storeu_ps(o + r * ldo + 16 * vi, acc[r][vi]);
        }
}

#define PV_CALL(R, NV)                                                                         \
    (tail ? pv_tile(p, P1 ? 1 : p_rs, p_cs, ve, ldv, nk, o + e, ldo, alpha, R, NV, last, true, HK, \
                    ahead, held)                                                               \
          : pv_tile(p, P1 ? 1 : p_rs, p_cs, ve, ldv, nk, o + e, ldo, alpha, R, NV, last, false,   \
                    HK, ahead, held))
#define PV_CASE(R)                                    \
    case R:                                           \
        switch (nv) {                                 \
        case 4: PV_CALL(R, 4); break;                 \
        case 3: PV_CALL(R, 3); break;                 \
        case 2: PV_CALL(R, 2); break;                 \
        default: PV_CALL(R, 1); break;                \
        }                                             \
        break;

/* Feature chunks outside, row tiles inside: one chunk of the V block
 * (keys x 64 features) stays in L1 while every row tile reads it. P1: the
 * weights of a tile's rows lie side by side (p_rs == 1, the queries-in-lanes
 * layout), so one pointer reaches all six; with p_rs a variable, GCC kept
 * six row pointers and moved the loop's counter and V pointer to the stack,
 * a load and store per key beside the 24 multiply-adds. */
ALWAYS_INLINE void pv_chunks(const float *p_all, int64_t p_rs, int64_t p_cs, const void *v,
                             int64_t ldv, int rows_all, int64_t nk, int64_t Ev, float *o_all,
                             int64_t ldo, const float *alpha_all, const int HK, const bool P1,
                             int64_t ahead, int64_t held) {
    const size_t es = HK == HK_F32 ? 4 : 2;
    for (int64_t e = 0; e < Ev; e += 16 * VECS) {
        const void *ve = (const char *)v + (size_t)e * es;
        const int64_t left = Ev - e;
        const int nv = (int)(left >= 16 * VECS ? VECS : (left + 15) / 16);
        const int64_t in_last = left - 16 * (nv - 1);
        const bool tail = in_last < 16;
        const __mmask16 last = (__mmask16)(tail ? (1u << in_last) - 1 : 0xffff);
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
 * back, and the next chunk finds them in L1 (chunk after chunk over the
 * whole block read each 512-byte row of E = 128 in two strided walks). The
 * same multiply-adds in the same order: O is stored and reloaded between
 * sub-blocks (times 1). V streamed from memory: rows requested ahead of
 * each chunk's walk (ukernel.h, attn__rows_ahead). */
ALWAYS_INLINE void pv(const float *p_all, int64_t p_rs, int64_t p_cs, const void *v, int64_t ldv,
                      int rows_all, int64_t nk, int64_t Ev, float *o_all, int64_t ldo,
                      const float *alpha_all, int64_t streamed, const int HK) {
    const size_t es = HK == HK_F32 ? 4 : 2;
    const int64_t ahead = streamed > 0 ? attn__rows_ahead(ATTN__V_AHEAD, Ev * (int64_t)es) : 0;
    if (rows_all > ROWS || Ev <= 16 * VECS || nk <= PV_KEYS) {
        if (p_rs == 1) /* the lanes layout: a tile's weights side by side, one pointer */
            pv_chunks(p_all, 1, p_cs, v, ldv, rows_all, nk, Ev, o_all, ldo, alpha_all, HK, true,
                      0, 0);
        else
            pv_chunks(p_all, p_rs, p_cs, v, ldv, rows_all, nk, Ev, o_all, ldo, alpha_all, HK,
                      false, ahead, streamed);
        return;
    }
    static const float ones[ROWS] = {1, 1, 1, 1, 1, 1};
    for (int64_t j0 = 0; j0 < nk; j0 += PV_KEYS)
        pv_chunks(p_all + j0 * p_cs, p_rs, p_cs, (const char *)v + (size_t)(j0 * ldv) * es, ldv,
                  rows_all, nk - j0 < PV_KEYS ? nk - j0 : PV_KEYS, Ev, o_all, ldo,
                  j0 == 0 ? alpha_all : ones, HK, false, ahead, streamed - j0);
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

/* ---- 16-bit output rows (ukernel.h: store_half_f) ---- */

/* o·inv in float64, truncated to float32 and its last bit set when that
 * was inexact (rounding "to odd"), then rounded to nearest even: float16
 * by vcvtps2ph, bfloat16 by adding 0x7fff plus the kept bit's parity.
 * The same bits as attn__store, 16 values per step. */
static bool store_half_f(const float *o, double inv, int64_t n, attn_dtype dtype, uint16_t *dst) {
    const __m512d iv = _mm512_set1_pd(inv), inf = _mm512_set1_pd(INFINITY);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    __mmask8 special = 0;
    for (int64_t e = 0; e < n; e += 16) {
        const __mmask16 mk = n - e >= 16 ? 0xffff : (__mmask16)((1u << (n - e)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(mk, o + e);
        const __m512d lo = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), iv);
        const __m512d hi = _mm512_mul_pd(
            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), iv);
        special |= _mm512_cmp_pd_mask(_mm512_abs_pd(lo), inf, _CMP_NLT_UQ) |
                   _mm512_cmp_pd_mask(_mm512_abs_pd(hi), inf, _CMP_NLT_UQ);
        const __m256 tlo = _mm512_cvt_roundpd_ps(lo, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 thi = _mm512_cvt_roundpd_ps(hi, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __mmask16 inexact =
            (__mmask16)(_mm512_cmp_pd_mask(_mm512_cvtps_pd(tlo), lo, _CMP_NEQ_UQ) |
                        _mm512_cmp_pd_mask(_mm512_cvtps_pd(thi), hi, _CMP_NEQ_UQ) << 8);
        __m512i u = _mm512_castpd_si512(_mm512_insertf64x4(
            _mm512_castpd256_pd512(_mm256_castps_pd(tlo)), _mm256_castps_pd(thi), 1));
        u = _mm512_mask_or_epi32(u, inexact, u, one); /* to odd */
        if (dtype == ATTN_DTYPE_BF16) {
            const __m512i parity = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
            u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, parity)), 16);
            _mm512_mask_cvtepi32_storeu_epi16(dst + e, mk, u);
        } else {
            uint16_t h[16];
            _mm256_storeu_si256((__m256i *)h, _mm512_cvtps_ph(_mm512_castsi512_ps(u),
                                                              _MM_FROUND_TO_NEAREST_INT));
            for (int64_t i = 0; i < 16 && e + i < n; i++) dst[e + i] = h[i];
        }
    }
    return special == 0;
}

/* A float32 output row (ukernel.h: store_row_f): one multiply a value, as
 * the portable loop, so the same bits; an all-ones exponent marks NaN/Inf. */
static bool store_row_f(const float *o, float inv, int64_t n, float *dst) {
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i exp = _mm512_set1_epi32(0x7f800000);
    __mmask16 special = 0;
    for (int64_t e = 0; e < n; e += 16) {
        const __mmask16 mk = n - e >= 16 ? 0xffff : (__mmask16)((1u << (n - e)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, o + e), iv);
        _mm512_mask_storeu_ps(dst + e, mk, x);
        special |= _mm512_mask_cmpeq_epi32_mask(
            mk, _mm512_and_si512(_mm512_castps_si512(x), exp), exp);
    }
    return special == 0;
}

/* attn__float_to_bf16 16 values at a time (ukernel.h: round_bf16_f):
 * 0x7fff plus the kept bit's parity added, and a NaN quieted instead. */
static void round_bf16_f(const float *src, const float *bias, int64_t n, uint16_t *dst) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mk = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(mk, src + j);
        if (bias != NULL) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mk, bias + j));
        const __m512i u = _mm512_castps_si512(x);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
        const __m512i parity = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, parity)), 16);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm512_mask_cvtepi32_storeu_epi16(dst + j, mk, r);
    }
}

/* ---- the backward's elementwise step (ukernel.h) ---- */

/* P = 2^(S·c - off) and dS = ds_scale·P·(dP - D), 16 queries per vector.
 * The exponent is one fused multiply-add, so it is rounded once. A lane
 * whose P is 0 (a hidden key, whose dP may be anything) gets dS = 0. */
static void softmax_bwd_t_f(float *st, float *dpt, int64_t ld, int64_t nk, int64_t lanes, float c,
                            const float *off, const float *off_lo, const float *D,
                            float ds_scale) {
    const __m512 cv = _mm512_set1_ps(c), sc = _mm512_set1_ps(ds_scale), zero = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        float *s = st + j * ld, *dp = dpt + j * ld;
        for (int64_t r = 0; r < lanes; r += 16) {
            const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + r), cv, _mm512_loadu_ps(off + r));
            const __m512 pr = exp2_ps(_mm512_sub_ps(x, _mm512_loadu_ps(off_lo + r)));
            _mm512_storeu_ps(s + r, pr);
            _mm512_storeu_ps(dp + r, _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(pr, zero, _CMP_NEQ_UQ), _mm512_mul_ps(pr, sc), _mm512_sub_ps(_mm512_loadu_ps(dp + r), _mm512_loadu_ps(D + r))));
        }
    }
}

/* ---- operand loads (ukernel.h): 16-bit rows widened 16 at a time ---- */

/* float16 (vcvtph2ps) or bfloat16 (the bits shifted into a float32's top
 * half): both exact. A row's last 1-15 elements, rows with a column stride
 * and other dtypes take the portable loads (16-bit masked loads would need
 * AVX-512BW, which this file does not assume). */
static void load_rows_f(const void *src, attn_dtype dtype, int64_t rs, int64_t cs, int64_t nrows,
                        int64_t width, float *dst, int64_t ld) {
    const bool f16 = dtype == ATTN_DTYPE_F16;
    if (cs != 1 || !(f16 || dtype == ATTN_DTYPE_BF16)) {
        attn__load_rows_generic_f(src, dtype, rs, cs, nrows, width, dst, ld);
        return;
    }
    const int64_t body = width / 16 * 16;
    for (int64_t i = 0; i < nrows; i++) {
        const uint16_t *s = (const uint16_t *)src + i * rs;
        float *d = dst + i * ld;
        for (int64_t j = 0; j < body; j += 16)
            _mm512_storeu_ps(d + j, f16 ? load16(s, j, 0xffff, HK_F16) : load16(s, j, 0xffff, HK_BF16));
        if (body < width)
            attn__load_rows_generic_f(s + body, dtype, rs, 1, 1, width - body, d + body, ld);
    }
}

/* The float32 slots; float64 keeps the portable kernels. The blocking is
 * the one these kernels were measured with: 48 lanes are the qkt tile's
 * three 16-query vectors; 128 keys per block at widths up to 64 and 64 up
 * to 128 (measured best) let the score tile, Qt and a V slice share L1;
 * 256 keys per block and up to 16 rows in the keys-in-columns layout; S
 * padded to 16 columns (one vector) and pv's 6-row register tile. */
void attn__ukernel_init_avx512(attn__ukernel *ctx) {
    ctx->name = "avx512";
    ctx->lanes = 16 * QVECS;
    ctx->lane_step = 16;
    ctx->key_block[0].max_width = 64;
    ctx->key_block[0].keys = 128;
    ctx->key_block[1].max_width = 128;
    ctx->key_block[1].keys = 64;
    ctx->key_block[2].max_width = INT64_MAX;
    ctx->key_block[2].keys = 32;
    ctx->direct_keys = 256;
    ctx->direct_rows = 16;
    ctx->pv_rows = ROWS;
    ctx->col_step = 16;
    ctx->load_rows_f = load_rows_f;
    ctx->pack_qt_f = pack_qt_f;
    ctx->qkt_f = qkt_f;
    ctx->softmax_t_f = softmax_t_f;
    ctx->qk_direct_f = qk_direct_f;
    ctx->qk_rows_f = qk_rows_f;
    ctx->qk_rows_h = qk_rows_h;
    ctx->pv_h = pv_h;
    ctx->softmax_f = softmax_f;
    ctx->pv_f = pv_f;
    ctx->softmax_bwd_t_f = softmax_bwd_t_f;
    ctx->store_half_f = store_half_f;
    ctx->store_row_f = store_row_f;
    ctx->round_bf16_f = round_bf16_f;
}
