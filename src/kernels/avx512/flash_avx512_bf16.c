/*
 * flash_avx512_bf16.c — the bfloat16 slots of ukernel.h with AVX512-BF16:
 * a bfloat16 call's prefill products in vdpbf16ps, which multiplies 16
 * pairs of bfloat16 values per instruction into float32 sums (twice the
 * multiply-adds of a float32 FMA; `attn_bench peak --bf16`). Only this
 * file is compiled with -mavx512bf16 (and BW, DQ, VL, which every CPU with
 * it has); the registry applies it on top of the AVX-512 context after
 * CPUID said the CPU has it.
 *
 * The register tiles are the float32 kernels' with a key pair (or feature
 * pair) where those have one key (feature):
 *   qkt  8 keys x 48 queries: 24 accumulators, 3 Qt pair vectors, a
 *        broadcast K pair (two adjacent features of one key, read in place)
 *   pv   6 query rows x 64 output features: 24 accumulators, 4 V pair
 *        vectors, a broadcast P pair (two adjacent keys of one row)
 * Operands enter as pairs (ukernel.h): Qt transposed as 32-bit elements,
 * V interleaved two rows at a time, P rounded and interleaved likewise.
 *
 * Arithmetic: each bfloat16 product is exact in float32; vdpbf16ps adds a
 * pair's two products to the sum one after the other, each rounded to
 * nearest even, with bfloat16 subnormal inputs read as zero and subnormal
 * sums flushed to zero (it ignores MXCSR). Scores therefore differ from the
 * widened float32 path's in the order of their roundings only; the weights
 * P lose their bits below bfloat16's (a relative 2^-9), as in every
 * bfloat16 attention (PyTorch's CPU kernel rounds P alike).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../ukernel.h"
#include "simd512.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 6  /* pv tile rows                             */
#define VECS 4  /* pv tile: 16-feature vectors per row       */
#define KEYS 8  /* qkt tile keys                            */
#define QVECS 3 /* qkt tile: 16-query vectors (48 queries)  */

/* A pair vector seen as what vdpbf16ps multiplies. */
ALWAYS_INLINE __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* Elements [0, n) of 16-bit values, zero past them: a bit per element. */
ALWAYS_INLINE __mmask32 first_n32(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1);
}
ALWAYS_INLINE __mmask16 first_n16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* ---- Qt in pairs ---- */

/* Unit column stride: the pair (2p, 2p+1) of a row is one 32-bit element,
 * so Qt in pairs is the transpose of the rows read as 32-bit elements, 16 x
 * 16 at a time. Loads mask by 16-bit element, so an odd E's last pair has a
 * zero high half and nothing past a row is read. */
static void pack_qt_rows(const uint16_t *q, int64_t rs, int64_t nr, int64_t E, uint32_t *qtp,
                         int64_t lanes) {
    const int64_t pairs = (E + 1) / 2;
    for (int64_t c = 0; c < nr; c += 16) {
        const int64_t live = nr - c < 16 ? nr - c : 16;
        const __mmask16 store = first_n16(live);
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
            const __mmask32 elems = first_n32(E - 2 * p0);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < live ? _mm512_castsi512_ps(
                                      _mm512_maskz_loadu_epi16(elems, q + (c + i) * rs + 2 * p0))
                                : _mm512_setzero_ps();
            transpose16(r);
            const int64_t np = pairs - p0 < 16 ? pairs - p0 : 16;
            for (int k = 0; k < np; k++)
                _mm512_mask_storeu_epi32(qtp + (p0 + k) * lanes + c, store,
                                         _mm512_castps_si512(r[k]));
        }
    }
}

static void pack_qt_bf(const uint16_t *q, int64_t rs, int64_t cs, int64_t nr, int64_t E,
                       uint32_t *qtp, int64_t lanes) {
    if (cs == 1) {
        pack_qt_rows(q, rs, nr, E, qtp, lanes);
        return;
    }
    for (int64_t p = 0; p < (E + 1) / 2; p++)
        for (int64_t r = 0; r < nr; r++) {
            const uint32_t lo = q[r * rs + 2 * p * cs];
            const uint32_t hi = 2 * p + 1 < E ? q[r * rs + (2 * p + 1) * cs] : 0;
            qtp[p * lanes + r] = lo | hi << 16;
        }
}

/* ---- St = K · Qt ---- */

/* K's pair p of row `row`, broadcast: features 2p and 2p+1, or (ODD, the
 * last step of an odd E) 2p and a zero, nothing past the row read. */
ALWAYS_INLINE __m512i k_pair(const uint16_t *row, int64_t p, const bool ODD) {
    uint32_t x;
    if (ODD)
        x = row[2 * p];
    else
        memcpy(&x, row + 2 * p, sizeof x);
    return _mm512_set1_epi32((int)x);
}

/* One pair of features for the tile's keys: JK x NV products. */
ALWAYS_INLINE void qkt_pair(__m512 acc[KEYS][QVECS], const uint32_t *qtp_p, const uint16_t *k,
                            int64_t ldk, int64_t p, const bool ODD, const int JK, const int NV) {
    __m512i q[QVECS];
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) q[v] = _mm512_loadu_si512(qtp_p + 16 * v);
#pragma GCC unroll 8
    for (int j = 0; j < JK; j++) {
        const __m512i kb = k_pair(k + j * ldk, p, ODD);
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], as_bh(kb), as_bh(q[v]));
    }
}

/* The whole pairs in a loop without a branch, an odd E's last feature
 * after it: with the test inside, GCC broadcast each pair from a general
 * register and spilled a Q vector to the stack. */
ALWAYS_INLINE void qkt_tile(const uint32_t *qtp, int64_t ldqt, const uint16_t *k, int64_t ldk,
                            int64_t E, float *st, int64_t ldst, const int JK, const int NV) {
    __m512 acc[KEYS][QVECS];
#pragma GCC unroll 8
    for (int j = 0; j < JK; j++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) acc[j][v] = _mm512_setzero_ps();
    const int64_t whole = E / 2;
    for (int64_t p = 0; p < whole; p++) qkt_pair(acc, qtp + p * ldqt, k, ldk, p, false, JK, NV);
    if (E % 2) qkt_pair(acc, qtp + whole * ldqt, k, ldk, whole, true, JK, NV);
#pragma GCC unroll 8
    for (int j = 0; j < JK; j++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(st + j * ldst + 16 * v, acc[j][v]);
}

#define QKT_NV(JK)                                                                            \
    case JK:                                                                                  \
        if (ng == 3)                                                                          \
            qkt_tile(qtp + c0, ldqt, k + j * ldk, ldk, E, st + j * ldst + c0, ldst, JK, 3);   \
        else if (ng == 2)                                                                     \
            qkt_tile(qtp + c0, ldqt, k + j * ldk, ldk, E, st + j * ldst + c0, ldst, JK, 2);   \
        else                                                                                  \
            qkt_tile(qtp + c0, ldqt, k + j * ldk, ldk, E, st + j * ldst + c0, ldst, JK, 1);   \
        break;

static void qkt_bf(const uint32_t *qtp, int64_t ldqt, const uint16_t *k, int64_t ldk, int64_t E,
                   int64_t nk, int64_t lanes, float *st, int64_t ldst, const int64_t *keys) {
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

/* ---- V and P in key pairs ---- */

/* Two rows interleaved 16 features at a time: word 2i of a pair vector is
 * row a's feature i, word 2i+1 row b's (vpermt2w). */
static bool pack_v_bf(const uint16_t *v, int64_t ldv, int64_t nk, int64_t Ev, uint32_t *vp,
                      int64_t ldvp) {
    const __m512i exp_mask = _mm512_set1_epi16(0x7f80); /* NaN and ±Inf: all ones */
    __mmask32 special = 0;
    __m512i lo_idx, hi_idx;
    {
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; i++) {
            lo[2 * i] = (uint16_t)i, lo[2 * i + 1] = (uint16_t)(32 + i);
            hi[2 * i] = (uint16_t)(16 + i), hi[2 * i + 1] = (uint16_t)(48 + i);
        }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
    }
    for (int64_t p = 0; 2 * p < nk; p++) {
        const bool has_b = 2 * p + 1 < nk;
        const uint16_t *a = v + 2 * p * ldv, *b = has_b ? a + ldv : a;
        uint32_t *dst = vp + p * ldvp;
        for (int64_t e = 0; e < Ev; e += 32) {
            const __mmask32 mk = first_n32(Ev - e);
            const __m512i x = _mm512_maskz_loadu_epi16(mk, a + e);
            const __m512i y = has_b ? _mm512_maskz_loadu_epi16(mk, b + e) : _mm512_setzero_si512();
            special |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, exp_mask), exp_mask) |
                       _mm512_cmpeq_epi16_mask(_mm512_and_si512(y, exp_mask), exp_mask);
            _mm512_mask_storeu_epi32(dst + e, first_n16(Ev - e),
                                     _mm512_permutex2var_epi16(x, lo_idx, y));
            if (Ev - e > 16)
                _mm512_mask_storeu_epi32(dst + e + 16, first_n16(Ev - e - 16),
                                         _mm512_permutex2var_epi16(x, hi_idx, y));
        }
    }
    return special == 0;
}

/* vpermw's index that interleaves the two halves of a vector: words i and
 * 16 + i become words 2i and 2i + 1. */
ALWAYS_INLINE __m512i zip_pairs(void) {
    uint16_t idx[32];
    for (int i = 0; i < 16; i++) idx[2 * i] = (uint16_t)i, idx[2 * i + 1] = (uint16_t)(16 + i);
    return _mm512_loadu_si512(idx);
}

/* Two rows of weights rounded (vcvtne2ps2bf16: row a in the low half) and
 * interleaved (vpermw). */
static void pack_p_bf(const float *st, int64_t ldst, int64_t nk, int64_t lanes, uint32_t *pp,
                      int64_t ldpp) {
    const __m512i zip = zip_pairs();
    for (int64_t p = 0; 2 * p < nk; p++) {
        const bool has_b = 2 * p + 1 < nk;
        const float *a = st + 2 * p * ldst, *b = has_b ? a + ldst : a;
        for (int64_t r = 0; r < lanes; r += 16) {
            const __m512 y = has_b ? _mm512_loadu_ps(b + r) : _mm512_setzero_ps();
            const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(y, _mm512_loadu_ps(a + r));
            _mm512_storeu_si512(pp + p * ldpp + r, _mm512_permutexvar_epi16(zip, x));
        }
    }
}

/* 2^x for a weight rounded to bfloat16 next: exp2.h's degree-4 fit. */
ALWAYS_INLINE __m512 exp2_bf16_ps(__m512 x) {
    static const float c[5] = {ATTN__EXP2F_BF16_C0, ATTN__EXP2F_BF16_C1, ATTN__EXP2F_BF16_C2,
                               ATTN__EXP2F_BF16_C3, ATTN__EXP2F_BF16_C4};
    return exp2_fit(x, c, 4);
}

/* The weights of keys 2p (row at) and 2p+1 (the next row; has_b false:
 * none, its weight 0) rounded and interleaved into pair row out, added to
 * the columns' sums in key order. */
ALWAYS_INLINE void pair_weights(const float *at, int64_t ldst, const bool has_b,
                                const __m512 *ref, __m512 cv, __m512 *sum, uint32_t *out,
                                __m512i zip, const int NV) {
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(at + 16 * v), ref[v]);
        const __m512 a = exp2_bf16_ps(_mm512_mul_ps(x, cv));
        sum[v] = _mm512_add_ps(sum[v], a);
        __m512 b = _mm512_setzero_ps();
        if (has_b) {
            const __m512 y = _mm512_sub_ps(_mm512_loadu_ps(at + ldst + 16 * v), ref[v]);
            b = exp2_bf16_ps(_mm512_mul_ps(y, cv));
            sum[v] = _mm512_add_ps(sum[v], b);
        }
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(out + 16 * v, _mm512_permutexvar_epi16(zip, w));
    }
}

/* softmax_t_f's column walk (flash_avx512.c: softmax_cols) with the
 * weights of keys 2p and 2p+1 rounded and interleaved into pair row p as
 * pack_p_bf does, never stored as float32. As the weights are rounded to
 * bfloat16 (2^-8), they take exp2.h's bfloat16 fit (2^f within 3e-6); the
 * sums add each key's weight in key order. The maxima, and so m and alpha,
 * are softmax_t_f's bits. (x = s·c - ref·c in one FMA measured 1% faster,
 * but s·c overflows where (s - ref)·c <= 0 does not.) */
ALWAYS_INLINE void softmax_cols_bf(const float *st, int64_t ldst, int64_t nk, float c, float *m,
                                   float *l, float *alpha, uint32_t *pp, int64_t ldpp,
                                   __m512i zip, const int NV) {
    const __m512 cv = _mm512_set1_ps(c);
    __m512 mx[QVECS], ref[QVECS], sum[QVECS];
    column_best(st, ldst, nk, c, m, mx, ref, NV);
#pragma GCC unroll 3
    for (int v = 0; v < NV; v++) sum[v] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; 2 * p + 1 < nk; p++)
        pair_weights(st + 2 * p * ldst, ldst, true, ref, cv, sum, pp + p * ldpp, zip, NV);
    if (2 * p < nk) /* an odd last key */
        pair_weights(st + 2 * p * ldst, ldst, false, ref, cv, sum, pp + p * ldpp, zip, NV);
    column_update(m, l, alpha, mx, ref, sum, c, NV);
}

static void softmax_t_bf(const float *st, int64_t ldst, int64_t nk, int64_t lanes, float c,
                         float *m, float *l, float *alpha, uint32_t *pp, int64_t ldpp) {
    const __m512i zip = zip_pairs();
    for (int64_t col = 0; col < lanes; col += 16 * QVECS) {
        const int64_t nv = (lanes - col) / 16 < QVECS ? (lanes - col) / 16 : QVECS;
        const float *s = st + col;
        uint32_t *q = pp + col;
        if (nv == 3)
            softmax_cols_bf(s, ldst, nk, c, m + col, l + col, alpha + col, q, ldpp, zip, 3);
        else if (nv == 2)
            softmax_cols_bf(s, ldst, nk, c, m + col, l + col, alpha + col, q, ldpp, zip, 2);
        else
            softmax_cols_bf(s, ldst, nk, c, m + col, l + col, alpha + col, q, ldpp, zip, 1);
    }
}

/* ---- O = alpha·O + P · V over key pairs ---- */

ALWAYS_INLINE __m512 load_part(const float *x, __mmask16 mk, bool partial) {
    return partial ? _mm512_maskz_loadu_ps(mk, x) : _mm512_loadu_ps(x);
}

ALWAYS_INLINE void pv_tile(const uint32_t *pp, int64_t ldpp, const uint32_t *vp, int64_t ldvp,
                           int64_t npairs, float *o, int64_t ldo, const float *alpha, const int R,
                           const int NV, __mmask16 last, const bool TAIL) {
    __m512 acc[ROWS][VECS];
    __m512i vv[VECS];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++)
            acc[r][vi] = _mm512_mul_ps(a, load_part(o + r * ldo + 16 * vi, last, TAIL && vi == NV - 1));
    }
    for (int64_t p = 0; p < npairs; p++) {
#pragma GCC unroll 4
        for (int vi = 0; vi < NV; vi++)
            vv[vi] = TAIL && vi == NV - 1 ? _mm512_maskz_loadu_epi32(last, vp + p * ldvp + 16 * vi)
                                          : _mm512_loadu_si512(vp + p * ldvp + 16 * vi);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512i pb = _mm512_set1_epi32((int)pp[p * ldpp + r]);
#pragma GCC unroll 4
            for (int vi = 0; vi < NV; vi++)
                acc[r][vi] = _mm512_dpbf16_ps(acc[r][vi], as_bh(pb), as_bh(vv[vi]));
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

#define PV_CALL(R, NV)                                                                      \
    (tail ? pv_tile(p, ldpp, ve, ldvp, npairs, o + e, ldo, alpha, R, NV, last, true)        \
          : pv_tile(p, ldpp, ve, ldvp, npairs, o + e, ldo, alpha, R, NV, last, false))
#define PV_CASE(R)                     \
    case R:                            \
        switch (nv) {                  \
        case 4: PV_CALL(R, 4); break;  \
        case 3: PV_CALL(R, 3); break;  \
        case 2: PV_CALL(R, 2); break;  \
        default: PV_CALL(R, 1); break; \
        }                              \
        break;

/* Feature chunks outside, row tiles inside, as pv_f: one chunk of the V
 * pairs stays in L1 while every row tile reads it. */
static void pv_bf(const uint32_t *pp, int64_t ldpp, const uint32_t *vp, int64_t ldvp,
                  int rows_all, int64_t npairs, int64_t Ev, float *o_all, int64_t ldo,
                  const float *alpha_all) {
    for (int64_t e = 0; e < Ev; e += 16 * VECS) {
        const uint32_t *ve = vp + e;
        const int64_t left = Ev - e;
        const int nv = (int)(left >= 16 * VECS ? VECS : (left + 15) / 16);
        const int64_t in_last = left - 16 * (nv - 1);
        const bool tail = in_last < 16;
        const __mmask16 last = first_n16(in_last);
        for (int rr = 0; rr < rows_all; rr += ROWS) {
            const int rows = rows_all - rr < ROWS ? rows_all - rr : ROWS;
            const uint32_t *p = pp + rr;
            const float *alpha = alpha_all + rr;
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

/* The bfloat16 slots, and their blocks: 96 query rows (two qkt tiles wide)
 * by 64 keys up to E = 128: each V block is packed into key pairs once per
 * query block, so wider blocks pack it half as often, and 64 keys keep the
 * score tile (24 KiB) in L1. Measured on Zen 4, 2 threads, bfloat16
 * (1,16,2048,2048,E) plain and causal, GFLOP/s for E = 64 / 128: 48 rows x
 * 128|64 keys (AVX-512's) 326 / 350, 303 / 326 causal; 96 x 64|64 333-338 /
 * 366-370, 308-311 / 341-344; 96 x 128|64 315 / 369; 144 x 64|64 328 / 362,
 * 290 / 321. Every other slot and block size is AVX-512's. */
void attn__ukernel_init_avx512_bf16(attn__ukernel *ctx) {
    ctx->name = "avx512_bf16";
    ctx->pairs_lanes = 2 * 16 * QVECS;
    ctx->pairs_keys = 64;
    ctx->pack_qt_bf = pack_qt_bf;
    ctx->qkt_bf = qkt_bf;
    ctx->pack_v_bf = pack_v_bf;
    ctx->pack_p_bf = pack_p_bf;
    ctx->softmax_t_bf = softmax_t_bf;
    ctx->pv_bf = pv_bf;
}
