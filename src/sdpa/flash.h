/*
 * flash.h — the fused (FlashAttention-2 style) forward pass.
 *
 * The driver (flash.c, portable) walks query blocks against key/value blocks
 * with an online softmax: a running row maximum m and sum l, one rescale of
 * the output accumulator per key block, one division at the end. It packs
 * what it needs per block, applies masks, causality and dropout, and
 * schedules threads. The arithmetic lives in micro-kernels per ISA, which
 * the driver calls on small contiguous tiles:
 *
 *   qkt / qk_direct   scores of a block of queries against a block of keys
 *   softmax(_t)       P = 2^((S - m)·c) in place; updates the running maximum
 *                     m and sum l, and returns alpha = 2^((m_old - m_new)·c)
 *   pv                O = alpha·O + P · V, V rows with unit column stride
 *
 * Scores are raw dot products, and the running maximum m is one of them
 * (the smallest when c < 0): the softmax forms x = (s - m)·c with
 * c = scale·log2 e, so the subtraction is exact near the maximum and the
 * constant's rounding costs only a relative u on the small x; scores of any
 * magnitude work. A tile that had masks with values applied under a zero
 * scale is already in base-2 units (c = 1). A hidden key has the infinity
 * that c turns into x = -inf, and weight exactly 0. exp2 only.
 */
#ifndef ATTN_SDPA_FLASH_H
#define ATTN_SDPA_FLASH_H

#include "../kernels/exp2.h"
#include "sdpa.h"

/* Micro-kernels of one ISA, for float32 (`f`) and float64 (`d`). Leading
 * dimensions are in elements. Two score layouts:
 *
 *  - queries in lanes (prefill): Qt is E x lanes (block rows transposed, a
 *    multiple of 16 lanes), K rows are read in place, and St = K · Qt is
 *    keys x lanes. The online softmax then works down columns: the running
 *    max and sum of each query are vectors, with no horizontal reductions.
 *  - keys in columns (few query rows, decoding): S = Q · Kᵀ is rows x keys,
 *    each score a dot product over E summed in float64 (the layout is
 *    memory-bound, so it costs nothing) and rounded once; `cols` is nk
 *    padded to `col_step`.
 *
 * pv reads the weight of (row r, key j) at p[r * p_rs + j * p_cs], so it
 * serves both layouts, for any number of rows. */
typedef struct attn__flash_kernels {
    const char *name;
    int pv_rows;  /* rows of a micro-tile: qk_direct takes 1..pv_rows at a time */
    int col_step; /* keys-in-columns layout: S columns are padded to this        */

    /* Optional (NULL: the driver's portable loop): Qt[e][r] = scale · q[r·rs +
     * e·cs] for r < nr, 0 for nr <= r < lanes; rows uniformly strided. */
    void (*pack_qt_f)(const float *q, int64_t rs, int64_t cs, int64_t nr, int64_t E, float scale,
                      float *qt, int64_t lanes);
    void (*qkt_f)(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E,
                  int64_t nk, int64_t lanes, float *st, int64_t ldst);
    void (*softmax_t_f)(float *st, int64_t ldst, int64_t nk, int64_t lanes, float c, float *m,
                        float *l, float *alpha);
    void (*qk_direct_f)(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, float *s, int64_t lds);
    void (*softmax_f)(float *s, int64_t lds, int rows, int64_t cols, float c, float *m,
                      float *l, float *alpha);
    void (*pv_f)(const float *p, int64_t p_rs, int64_t p_cs, const float *v, int64_t ldv,
                 int rows, int64_t nk, int64_t Ev, float *o, int64_t ldo, const float *alpha);

    void (*pack_qt_d)(const double *q, int64_t rs, int64_t cs, int64_t nr, int64_t E,
                      double scale, double *qt, int64_t lanes);
    void (*qkt_d)(const double *qt, int64_t ldqt, const double *k, int64_t ldk, int64_t E,
                  int64_t nk, int64_t lanes, double *st, int64_t ldst);
    void (*softmax_t_d)(double *st, int64_t ldst, int64_t nk, int64_t lanes, double c,
                        double *m, double *l, double *alpha);
    void (*qk_direct_d)(const double *q, int64_t ldq, const double *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, double *s, int64_t lds);
    void (*softmax_d)(double *s, int64_t lds, int rows, int64_t cols, double c, double *m,
                      double *l, double *alpha);
    void (*pv_d)(const double *p, int64_t p_rs, int64_t p_cs, const double *v, int64_t ldv,
                 int rows, int64_t nk, int64_t Ev, double *o, int64_t ldo, const double *alpha);
} attn__flash_kernels;

/* The portable kernels; the ISA sets reuse the float64 ones and may use the
 * float32 ones for edge cases. */
#define ATTN__DECLARE_GENERIC(REAL, SFX)                                                        \
    void attn__generic_qkt_##SFX(const REAL *qt, int64_t ldqt, const REAL *k, int64_t ldk,      \
                                 int64_t E, int64_t nk, int64_t lanes, REAL *st, int64_t ldst); \
    void attn__generic_softmax_t_##SFX(REAL *st, int64_t ldst, int64_t nk, int64_t lanes,      \
                                       REAL c, REAL *m, REAL *l, REAL *alpha);                 \
    void attn__generic_qk_direct_##SFX(const REAL *q, int64_t ldq, const REAL *k, int64_t ldk, \
                                       int64_t E, int rows, int64_t nk, REAL *s, int64_t lds); \
    void attn__generic_softmax_##SFX(REAL *s, int64_t lds, int rows, int64_t cols, REAL c,     \
                                     REAL *m, REAL *l, REAL *alpha);                           \
    void attn__generic_pv_##SFX(const REAL *p, int64_t p_rs, int64_t p_cs, const REAL *v,      \
                                int64_t ldv, int rows, int64_t nk, int64_t Ev, REAL *o,        \
                                int64_t ldo, const REAL *alpha);
ATTN__DECLARE_GENERIC(float, f)
ATTN__DECLARE_GENERIC(double, d)

/* The kernel sets. The ISA ones exist only when their files were compiled
 * (ATTN_HAVE_AVX2 / ATTN_HAVE_AVX512); the generic one always. */
extern const attn__flash_kernels attn__flash_generic;
extern const attn__flash_kernels attn__flash_avx2;
extern const attn__flash_kernels attn__flash_avx512;

/* Runs a plan with the given kernels. */
attn_status attn__sdpa_flash(const attn__problem *plan, const attn__flash_kernels *kernels);

#endif /* ATTN_SDPA_FLASH_H */
