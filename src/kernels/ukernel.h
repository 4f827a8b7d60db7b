/*
 * ukernel.h — the contract between the fused driver (src/sdpa/flash.c) and
 * the micro-kernels of one ISA (src/kernels/<isa>/). The kernels never see
 * the problem: only tiles (pointers and leading dimensions, in elements).
 *
 * A context, attn__ukernel, holds everything the driver asks of an ISA: its
 * blocking, its micro-kernels for float32 (`_f`) and float64 (`_d`), and the
 * loads that bring operand rows into the compute type. BLIS's pattern:
 * attn__ukernel_init_generic fills every slot and parameter with the
 * portable kernels, and an ISA's init, applied on top of that, overrides
 * only what it improves — so no slot is ever empty, and an ISA without
 * float64 kernels runs the portable ones. The registry (registry.c) builds
 * each context once; the driver reads it and never names an ISA.
 *
 * The micro-kernels, on small contiguous tiles:
 *
 *   qkt / qk_direct   scores of a block of queries against a block of keys
 *   softmax(_t)       P = 2^((S - m)·c) in place; updates the running maximum
 *                     m and sum l, and returns alpha = 2^((m_old - m_new)·c)
 *   pv                O = alpha·O + P · V, V rows with unit column stride
 *   softmax_bwd_t     the backward's elementwise step on a keys x lanes tile:
 *                     P = 2^(S·c - off) from the forward's log-sum-exp, and
 *                     dS = ds_scale · P · (dP - D) (0 where P is 0)
 *
 * The backward (flash_backward.inc) runs on the same kernels: St = K · Qt
 * and dPt = V · dOt are qkt's, and dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K are
 * pv's with alpha = 1, reading the transposed tile through p_rs and p_cs.
 *
 * Scores are raw dot products, and the running maximum m is one of them
 * (the smallest when c < 0): the softmax forms x = (s - m)·c with
 * c = scale·log2 e, so the subtraction is exact near the maximum and the
 * constant's rounding costs only a relative u on the small x; scores of any
 * magnitude work. A tile that had masks with values applied under a zero
 * scale is already in base-2 units (c = 1). A hidden key has the infinity
 * that c turns into x = -inf, and weight exactly 0. exp2 only (exp2.h).
 *
 * Two score layouts:
 *
 *  - queries in lanes (prefill): Qt is E x lanes (block rows transposed, a
 *    multiple of lane_step lanes), K rows are read in place, and
 *    St = K · Qt is keys x lanes. The online softmax then works down
 *    columns: the running max and sum of each query are vectors, with no
 *    horizontal reductions.
 *  - keys in columns (few query rows, decoding): S = Q · Kᵀ is rows x keys,
 *    each score a dot product over E summed in float64 (the layout is
 *    memory-bound, so it costs nothing) and rounded once; `cols` is nk
 *    padded to `col_step`.
 *
 * pv reads the weight of (row r, key j) at p[r * p_rs + j * p_cs], so it
 * serves both layouts, for any number of rows.
 */
#ifndef ATTN_KERNELS_UKERNEL_H
#define ATTN_KERNELS_UKERNEL_H

#include "../core/internal.h"

/* Streamed K and V (qk_rows_f, pv_f with `streamed` rows): on CPUs where
 * it was measured faster (attn__stream_prefetch), the kernels request each
 * row's lines this many bytes of rows ahead of their loads (four times as
 * far where memory was measured to answer slower, attn__stream_far), among
 * the rows the call reads. K's walk reads a row whole; pv's reads it in 64-feature
 * chunks, so its rows are requested further ahead (docs/design.md, "Rows
 * requested ahead of a streamed walk"). */
enum { ATTN__K_AHEAD = 4096, ATTN__V_AHEAD = 8192 };

/* Rows of `row_bytes` that a streamed walk requests ahead: 0 (none) where
 * the CPU's own prefetchers do better. */
static inline int64_t attn__rows_ahead(int64_t ahead_bytes, int64_t row_bytes) {
    if (!attn__stream_prefetch() || row_bytes <= 0) return 0;
    const int64_t rows = (attn__stream_far() ? 4 * ahead_bytes : ahead_bytes) / row_bytes;
    return rows < 1 ? 1 : rows;
}

/* Classes of head width (max(E, Ev)) with their own key block size. */
enum { ATTN__KEY_BLOCK_CLASSES = 3 };

typedef struct attn__ukernel {
    const char *name; /* "generic", "avx2", "avx512", "avx512_bf16", "amx" */

    /* ---- blocking: the driver derives every block size from these ---- */
    int lanes;       /* queries in lanes: query rows per block, at most       */
    int lane_step;   /* ... a multiple of this (qkt, softmax_t, pack_qt)      */
    /* queries in lanes: keys per block for the first class whose max_width
     * >= max(E, Ev) (the last class's is INT64_MAX), chosen so the score
     * tile (keys x lanes), Qt (E x lanes) and a slice of V share L1 */
    struct {
        int64_t max_width;
        int keys;
    } key_block[ATTN__KEY_BLOCK_CLASSES];
    /* bfloat16 products (below): rows and keys per block of the
     * queries-in-lanes layout for heads up to 128 wide (wider: key_block) */
    int pairs_lanes;
    int pairs_keys;
    int pairs_keys_wide; /* heads of 65-128 (0: pairs_keys)                   */
    int direct_keys; /* keys in columns: keys per block                       */
    int direct_rows; /* keys in columns for head groups of at most this many
                        query rows (decoding)                                 */
    int pv_rows;     /* rows of a micro-tile: qk_direct_d and qk_rows_f take
                        1..pv_rows, qk_direct_f any number (a tiny call's
                        head at once, so K is transposed once)               */
    int col_step;    /* keys in columns: S columns are padded to this         */

    /* ---- operand loads: rows of an operand into the compute type ----
     * dst[i * ld + j] = src[i * rs + j * cs] converted from `dtype`, for
     * i < nrows, j < width; src points at element (0, 0), strides are in
     * elements of `dtype`. The driver reads K and V in place, and gives Q
     * to pack_qt, only when they already have the compute type (K and V
     * also a unit column stride); every other copy of Q, K or V rows goes
     * through these, so a new operand dtype (bf16 K/V) is a case here, not
     * a new driver. */
    void (*load_rows_f)(const void *src, attn_dtype dtype, int64_t rs, int64_t cs,
                        int64_t nrows, int64_t width, float *dst, int64_t ld);
    void (*load_rows_d)(const void *src, attn_dtype dtype, int64_t rs, int64_t cs,
                        int64_t nrows, int64_t width, double *dst, int64_t ld);

    /* ---- micro-kernels, float32 ---- */
    /* Optional (NULL: the driver transposes through load_rows): Qt[e·ldqt +
     * r] = scale · q[r·rs + e·cs] for r < nr, 0 for nr <= r < lanes; rows
     * uniformly strided, q already in the compute type; ldqt >= lanes (a
     * block's columns of a wider Qt, as the backward packs a group's). */
    void (*pack_qt_f)(const float *q, int64_t rs, int64_t cs, int64_t nr, int64_t E, float scale,
                      float *qt, int64_t lanes, int64_t ldqt);
    /* St = K · Qt (keys x lanes). keys (or NULL: all nk): for each group of
     * lane_step lanes, the keys it needs; St entries of a group past its
     * count may be left as they are (rows past the causal diagonal, hidden
     * by the driver's masks afterwards). */
    void (*qkt_f)(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int64_t E,
                  int64_t nk, int64_t lanes, float *st, int64_t ldst, const int64_t *keys);
    void (*softmax_t_f)(float *st, int64_t ldst, int64_t nk, int64_t lanes, float c, float *m,
                        float *l, float *alpha);
    void (*qk_direct_f)(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, float *s, int64_t lds);
    /* Optional (NULL: qk_direct_f): qk_direct_f's scores with float32 sums,
     * for keys-in-columns blocks that are not tiny (decoding), where the
     * float64 sums cost more than streaming K (about four times the
     * multiply-adds, measured on Zen 4). `streamed` > 0: K is read in
     * place from memory (not from a buffer the driver filled), so keys are
     * read in address order, and rows 0 .. streamed-1 of k (at least nk,
     * possibly more: the attention call reads them in later blocks) lie one
     * stride apart, so the kernel may request them ahead; 0: K is in a
     * buffer. */
    void (*qk_rows_f)(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t E,
                      int rows, int64_t nk, float *s, int64_t lds, int64_t streamed);
    void (*softmax_f)(float *s, int64_t lds, int rows, int64_t cols, float c, float *m,
                      float *l, float *alpha);
    /* Optional (NULL: the driver widens 16-bit rows through load_rows):
     * qk_rows_f and pv_f over K or V rows of a 16-bit dtype (kdt, vdt:
     * ATTN_DTYPE_F16 or ATTN_DTYPE_BF16) widened in registers, the same
     * bits as over widened rows; a decode from a 16-bit cache then reads
     * half the bytes and writes no widened copy. */
    void (*qk_rows_h)(const float *q, int64_t ldq, const uint16_t *k, int64_t ldk, attn_dtype kdt,
                      int64_t E, int rows, int64_t nk, float *s, int64_t lds, int64_t streamed);
    void (*pv_h)(const float *p, int64_t p_rs, int64_t p_cs, const uint16_t *v, int64_t ldv,
                 attn_dtype vdt, int rows, int64_t nk, int64_t Ev, float *o, int64_t ldo,
                 const float *alpha, int64_t streamed);
    /* `streamed`: V is read in place from memory (a decode's rows), as
     * qk_rows_f's K (rows of v the call reads); 0 for tiles in cache
     * (prefill, the backward). */
    void (*pv_f)(const float *p, int64_t p_rs, int64_t p_cs, const float *v, int64_t ldv,
                 int rows, int64_t nk, int64_t Ev, float *o, int64_t ldo, const float *alpha,
                 int64_t streamed);
    /* st[j][r] <- P = 2^((st[j][r]·c - off[r]) - off_lo[r]) (off + off_lo: the row's
     * lse·log2 e to twice the compute type's precision; its rounding would
     * shift every weight of the row alike); dpt[j][r] <- ds_scale·P·(dpt[j][r] - D[r]),
     * exactly 0 where P is 0 (a hidden key's dP may be anything); for j < nk,
     * r < lanes (a multiple of lane_step), both tiles with leading dimension ld. */
    void (*softmax_bwd_t_f)(float *st, float *dpt, int64_t ld, int64_t nk, int64_t lanes, float c,
                            const float *off, const float *off_lo, const float *D,
                            float ds_scale);

    /* Optional (NULL: attn__store per element): dst[e] = o[e]·inv for e < n,
     * computed in float64 and rounded once to dtype (ATTN_DTYPE_F16 or
     * ATTN_DTYPE_BF16) as attn__store does; returns whether every o[e]·inv
     * is finite. A 16-bit call's output rows. */
    bool (*store_half_f)(const float *o, double inv, int64_t n, attn_dtype dtype, uint16_t *dst);
    /* Optional (NULL: the driver's loop, which the portable build keeps to
     * SSE2): dst[e] = o[e]·inv in float32 for e < n; returns whether every
     * dst[e] is finite. A float32 output row: at L = S = 32, E = 128 the
     * SSE2 loop took 12% of a call (perf, Intel), as much as a score tile. */
    bool (*store_row_f)(const float *o, float inv, int64_t n, float *dst);
    /* Optional (NULL: attn__float_to_bf16 per element): dst[j] =
     * attn__float_to_bf16(src[j] + bias[j]) (the float32 sum; src[j] alone
     * when bias is NULL) for j < n, the same bits, NaN included: a bfloat16
     * GEMM's rows of C (core/gemm.c), 20% of its time element by element. */
    void (*round_bf16_f)(const float *src, const float *bias, int64_t n, uint16_t *dst);

    /* ---- bfloat16 products (optional, all or none; NULL: a bfloat16 call
     * widens its rows and runs float32's kernels) ----
     * A bfloat16 call's queries-in-lanes blocks (prefill) multiply in
     * bfloat16: Q, K and V as they are and P rounded to bfloat16 (round to
     * nearest even), each product exact and summed in float32; the softmax
     * between them is softmax_t_f's. A pair is two bfloat16 values in a
     * uint32_t, the lower-indexed one in the low half: the operand of one
     * dot-product step (vdpbf16ps); an odd count is completed by a zero. */
    /* qtp[p·lanes + r] = (q[r·rs + 2p·cs], q[r·rs + (2p+1)·cs]) for r < nr,
     * p < ceil(E/2); lanes nr .. lanes-1 are left alone. Not scaled. */
    void (*pack_qt_bf)(const uint16_t *q, int64_t rs, int64_t cs, int64_t nr, int64_t E,
                       uint32_t *qtp, int64_t lanes);
    /* St = K · Qt as qkt_f, from qtp (ceil(E/2) x lanes pairs, leading
     * dimension ldqt) and bfloat16 K rows with unit column stride, in place */
    void (*qkt_bf)(const uint32_t *qtp, int64_t ldqt, const uint16_t *k, int64_t ldk, int64_t E,
                   int64_t nk, int64_t lanes, float *st, int64_t ldst, const int64_t *keys);
    /* vp[p·ldvp + e] = (v[2p·ldv + e], v[(2p+1)·ldv + e]) for p < ceil(nk/2),
     * e < Ev: V rows in key pairs. Returns whether every value is finite
     * (the driver then handles NaN/Inf values itself: v_pairs). */
    bool (*pack_v_bf)(const uint16_t *v, int64_t ldv, int64_t nk, int64_t Ev, uint32_t *vp,
                      int64_t ldvp);
    /* pp[p·ldpp + r] = the pair of st[2p·ldst + r], st[(2p+1)·ldst + r]
     * rounded to bfloat16, for p < ceil(nk/2), r < lanes (a multiple of
     * lane_step): a softmax tile's weights in key pairs */
    void (*pack_p_bf)(const float *st, int64_t ldst, int64_t nk, int64_t lanes, uint32_t *pp,
                      int64_t ldpp);
    /* softmax_t_f's update (m and alpha bit for bit) with the weights
     * rounded and paired as pack_p_bf writes them, not to st, and taken
     * from exp2.h's bfloat16 fit, which l sums too: without dropout, which
     * needs them in st first (softmax_t_f, then pack_p_bf) */
    void (*softmax_t_bf)(const float *st, int64_t ldst, int64_t nk, int64_t lanes, float c,
                         float *m, float *l, float *alpha, uint32_t *pp, int64_t ldpp);
    /* O = alpha·O + P·V as pv_f, over npairs key pairs: weights pp[p·ldpp + r]
     * (pack_p_bf), V rows vp (pack_v_bf) */
    void (*pv_bf)(const uint32_t *pp, int64_t ldpp, const uint32_t *vp, int64_t ldvp, int rows,
                  int64_t npairs, int64_t Ev, float *o, int64_t ldo, const float *alpha);
    /* pv_bf over a lanes block's every row and key in one call, also where
     * the block crosses the causal diagonal (whose weights past a row's
     * last key are 0), instead of pv_rows rows at a time up to their last
     * key: AMX's tiles take 16 rows at a time, and multiply those zeros
     * faster than the vector kernel runs a 6-row tile's keys. */
    bool pv_bf_whole;
    /* Optional (NULL: nothing to do): around a task's blocks of bfloat16
     * products, on the thread that runs them, so that state the products
     * keep (AMX's tile configuration) is set up once a task, not once a
     * call, and released after it; qkt_bf and pv_bf also work outside. */
    void (*tiles_begin)(void);
    void (*tiles_end)(void);

    /* ---- micro-kernels, float64: the same contracts ---- */
    void (*pack_qt_d)(const double *q, int64_t rs, int64_t cs, int64_t nr, int64_t E,
                      double scale, double *qt, int64_t lanes, int64_t ldqt);
    void (*qkt_d)(const double *qt, int64_t ldqt, const double *k, int64_t ldk, int64_t E,
                  int64_t nk, int64_t lanes, double *st, int64_t ldst, const int64_t *keys);
    void (*softmax_t_d)(double *st, int64_t ldst, int64_t nk, int64_t lanes, double c,
                        double *m, double *l, double *alpha);
    void (*qk_direct_d)(const double *q, int64_t ldq, const double *k, int64_t ldk, int64_t E,
                        int rows, int64_t nk, double *s, int64_t lds);
    void (*softmax_d)(double *s, int64_t lds, int rows, int64_t cols, double c, double *m,
                      double *l, double *alpha);
    void (*pv_d)(const double *p, int64_t p_rs, int64_t p_cs, const double *v, int64_t ldv,
                 int rows, int64_t nk, int64_t Ev, double *o, int64_t ldo, const double *alpha,
                 int64_t streamed);
    void (*softmax_bwd_t_d)(double *st, double *dpt, int64_t ld, int64_t nk, int64_t lanes,
                            double c, const double *off, const double *off_lo, const double *D,
                            double ds_scale);
} attn__ukernel;

/* The portable loads (load_rows_f/_d's contract), which an ISA's loads
 * call for the layouts and dtypes they leave to them. */
void attn__load_rows_generic_f(const void *src, attn_dtype dtype, int64_t rs, int64_t cs,
                               int64_t nrows, int64_t width, float *dst, int64_t ld);
void attn__load_rows_generic_d(const void *src, attn_dtype dtype, int64_t rs, int64_t cs,
                               int64_t nrows, int64_t width, double *dst, int64_t ld);

/* Every slot and parameter: the portable kernels (generic/flash_generic.c). */
void attn__ukernel_init_generic(attn__ukernel *ctx);
/* The slots and parameters an ISA improves, on a generic-initialised
 * context; each exists only when its file was compiled (ATTN_HAVE_AVX2,
 * ATTN_HAVE_AVX512). */
void attn__ukernel_init_avx2(attn__ukernel *ctx);
void attn__ukernel_init_avx512(attn__ukernel *ctx);
/* The bfloat16 slots, on an AVX-512 context (ATTN_HAVE_AVX512_BF16). */
void attn__ukernel_init_avx512_bf16(attn__ukernel *ctx);
/* The bfloat16 products on AMX tiles, on an AVX512-BF16 context
 * (ATTN_HAVE_AMX). */
void attn__ukernel_init_amx(attn__ukernel *ctx);

/* The context of a fused path, built once (thread-safe) and then constant:
 * ATTN_ISA_AVX2, ATTN_ISA_AVX512, ATTN_ISA_AVX512_BF16 (AVX-512's
 * context with the bfloat16 slots) and ATTN_ISA_AMX (that one with its
 * products on tiles) get theirs when it was compiled in,
 * every other value (and an ISA not compiled in) the generic one. Whether
 * the CPU can run it is the caller's question (attn_isa_supported). */
const attn__ukernel *attn__ukernel_for(attn_isa isa);

#endif /* ATTN_KERNELS_UKERNEL_H */
