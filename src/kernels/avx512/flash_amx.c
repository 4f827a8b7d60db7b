/*
 * flash_amx.c — a bfloat16 prefill's two products on AMX tiles (Intel
 * Sapphire Rapids and later): St = K · Qt and O += P · V in tdpbf16ps, which
 * multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into a 16 x 16 float32
 * tile, 8,192 multiply-adds an instruction against vdpbf16ps's 32. Only this
 * file is compiled with -mamx-tile -mamx-bf16; the registry applies it on
 * top of the AVX512-BF16 context after CPUID, XCR0 and the kernel said yes
 * (cpu.c asks Linux for the tile state with arch_prctl).
 *
 * The operands are the AVX512-BF16 slots' (ukernel.h), and two of them are
 * already what a tile multiply reads:
 *   St = K · Qt   A: 16 K rows x 32 features, in place (any row stride);
 *                 B: 16 Qt pair rows x 16 lanes (qtp: pairs are AMX's
 *                 "VNNI" layout); C: 16 keys x 16 lanes of St
 *   O += P · V    A: 16 rows x 32 keys of P, which the softmax wrote as key
 *                 pairs x lanes, so each 16 x 16 block of pairs is
 *                 transposed into a buffer here; B: 16 V pair rows x 16
 *                 features (pack_v_bf); C: 16 rows x 16 features of O
 * Four C tiles (2 x 2), two A and two B: the eight tiles there are.
 * An E that is not a multiple of 32 ends in a step copied with zeros
 * past E; keys, pairs, rows or features past the last 16 are the
 * AVX512-BF16 kernels' (the same contracts), so every call is exact to its
 * own rules and no tile reads past an operand.
 *
 * Arithmetic: as vdpbf16ps, each product exact in float32, sums rounded to
 * nearest even, bfloat16 subnormals read as zero and subnormal sums flushed
 * (attn.h, "Dtypes"); the order of the additions differs, so the bits may
 * differ from the avx512_bf16 path's, and never between thread counts
 * (blocks do not depend on them).
 *
 * Tile state: loading the configuration costs 150-260 cycles (measured
 * here, Xeon family 6 model 207), as much as a block's whole Q·Kᵀ at
 * E = 64, so the driver brackets each task's blocks with tiles_begin and
 * tiles_end; a kernel called outside them configures and releases the tiles
 * itself (slower, never wrong).
 */
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "../ukernel.h"
#include "amx_tiles.h"
#include "simd512.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Whether this thread's tiles are configured by tiles_begin. */
static _Thread_local bool tiles_ready;

static void tiles_begin(void) {
    if (!tiles_ready) attn__configure_tiles();
    tiles_ready = true;
}

/* Released, so that a context switch saves no tile data and other code on
 * the thread finds the tiles as the ABI leaves them. */
static void tiles_end(void) {
    if (tiles_ready) _tile_release();
    tiles_ready = false;
}

/* The AVX512-BF16 kernels, for the shapes the tiles leave (set once at init,
 * under the registry's pthread_once, then only read). */
static void (*vector_qkt_bf)(const uint32_t *, int64_t, const uint16_t *, int64_t, int64_t,
                             int64_t, int64_t, float *, int64_t, const int64_t *);
static void (*vector_pv_bf)(const uint32_t *, int64_t, const uint32_t *, int64_t, int, int64_t,
                            int64_t, float *, int64_t, const float *);

/* ---- St = K · Qt ---- */

/* The C tiles of a (16·JA) x (16·JB) block at c (row stride ldc floats):
 * tile 0 top left, 1 top right, 2 bottom left, 3 bottom right. */
ALWAYS_INLINE void load_c(float *c, int64_t ldc, const int JA, const int JB) {
    const int64_t stride = 4 * ldc;
    _tile_loadd(0, c, stride);
    if (JB > 1) _tile_loadd(1, c + 16, stride);
    if (JA > 1) _tile_loadd(2, c + 16 * ldc, stride);
    if (JA > 1 && JB > 1) _tile_loadd(3, c + 16 * ldc + 16, stride);
}

ALWAYS_INLINE void store_c(float *c, int64_t ldc, const int JA, const int JB) {
    const int64_t stride = 4 * ldc;
    _tile_stored(0, c, stride);
    if (JB > 1) _tile_stored(1, c + 16, stride);
    if (JA > 1) _tile_stored(2, c + 16 * ldc, stride);
    if (JA > 1 && JB > 1) _tile_stored(3, c + 16 * ldc + 16, stride);
}

/* One step of 32 bfloat16 products into the C tiles: A rows at a0 (and
 * a1, the next 16, when JA > 1), B pair rows at b (and b + 16 lanes when
 * JB > 1); strides in bytes. */
ALWAYS_INLINE void tile_step(const void *a0, const void *a1, int64_t a_stride, const uint32_t *b,
                             int64_t b_stride, const int JA, const int JB) {
    _tile_loadd(4, a0, a_stride);
    _tile_loadd(6, b, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (JB > 1) {
        _tile_loadd(7, b + 16, b_stride);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (JA > 1) {
        _tile_loadd(5, a1, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (JB > 1) _tile_dpbf16ps(3, 5, 7);
    }
}

/* The last step of an E that is not a multiple of 32, zero-padded: K's
 * 16·JK rows' features from e32 on (atail, 32 features a row) and Qt's pair
 * rows from e32/2 on (btail, 32 lanes a row), so the tiles read only what
 * the operands hold and add exact zeros past E. */
typedef struct qkt_tail {
    uint16_t a[32 * 32]; /* 32 keys x 32 features   */
    uint32_t b[16 * 32]; /* 16 pair rows x 32 lanes */
} qkt_tail;

static void tail_keys(const uint16_t *k, int64_t ldk, int64_t e32, int64_t E, int rows,
                      uint16_t *a) {
    const __mmask32 live = (__mmask32)((1ull << (E - e32)) - 1);
    for (int r = 0; r < rows; r++)
        _mm512_storeu_si512(a + 32 * r, _mm512_maskz_loadu_epi16(live, k + r * ldk + e32));
}

static void tail_pairs(const uint32_t *qtp, int64_t ldqt, int64_t e32, int64_t E, int width,
                       uint32_t *b) {
    const int64_t p0 = e32 / 2, np = (E + 1) / 2 - p0;
    const __mmask16 live = width >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << width) - 1);
    for (int64_t p = 0; p < 16; p++)
        for (int h = 0; h < 32; h += 16)
            _mm512_storeu_si512(b + 32 * p + h,
                                p < np && h < width
                                    ? _mm512_maskz_loadu_epi32(live, qtp + (p0 + p) * ldqt + h)
                                    : _mm512_setzero_si512());
}

/* One C block of (16·JK keys) x (16·JL lanes) over the E / 32 whole steps
 * and, with `tail`, the padded last one. */
ALWAYS_INLINE void qkt_block(const uint32_t *qtp, int64_t ldqt, const uint16_t *k, int64_t ldk,
                             int64_t E, const qkt_tail *tail, float *st, int64_t ldst,
                             const int JK, const int JL) {
    const int64_t a_stride = 2 * ldk, b_stride = 4 * ldqt; /* bytes */
    _tile_zero(0);
    if (JL > 1) _tile_zero(1);
    if (JK > 1) _tile_zero(2);
    if (JK > 1 && JL > 1) _tile_zero(3);
    for (int64_t s = 0; s < E / 32; s++) {
        const uint16_t *a = k + 32 * s; /* 16 keys x 32 features */
        tile_step(a, a + 16 * ldk, a_stride, qtp + 16 * s * ldqt, b_stride, JK, JL);
    }
    if (tail != NULL) tile_step(tail->a, tail->a + 16 * 32, 64, tail->b, 128, JK, JL);
    store_c(st, ldst, JK, JL);
}

/* Every lane group gets every key: the tiles cost the same whether a
 * group's last keys (`keys`) are past the causal diagonal or not. */
static void qkt_amx(const uint32_t *qtp, int64_t ldqt, const uint16_t *k, int64_t ldk, int64_t E,
                    int64_t nk, int64_t lanes, float *st, int64_t ldst, const int64_t *keys) {
    const int64_t nk16 = nk / 16 * 16, e32 = E / 32 * 32;
    if (lanes % 16 != 0 || nk16 == 0) {
        vector_qkt_bf(qtp, ldqt, k, ldk, E, nk, lanes, st, ldst, keys);
        return;
    }
    qkt_tail tail_buf __attribute__((aligned(64)));
    const qkt_tail *tail = e32 < E ? &tail_buf : NULL;
    const bool own = !tiles_ready;
    if (own) attn__configure_tiles();
    for (int64_t j = 0; j < nk16; j += 32) {
        const bool two_k = j + 32 <= nk16;
        const uint16_t *kj = k + j * ldk;
        if (tail) tail_keys(kj, ldk, e32, E, two_k ? 32 : 16, tail_buf.a);
        for (int64_t l = 0; l < lanes; l += 32) {
            const bool two_l = l + 32 <= lanes;
            if (tail) tail_pairs(qtp + l, ldqt, e32, E, two_l ? 32 : 16, tail_buf.b);
            float *s = st + j * ldst + l;
            if (two_k && two_l)
                qkt_block(qtp + l, ldqt, kj, ldk, E, tail, s, ldst, 2, 2);
            else if (two_k)
                qkt_block(qtp + l, ldqt, kj, ldk, E, tail, s, ldst, 2, 1);
            else if (two_l)
                qkt_block(qtp + l, ldqt, kj, ldk, E, tail, s, ldst, 1, 2);
            else
                qkt_block(qtp + l, ldqt, kj, ldk, E, tail, s, ldst, 1, 1);
        }
    }
    if (own) _tile_release();
    if (nk16 < nk) /* the last keys, fewer than a tile's 16 rows */
        vector_qkt_bf(qtp, ldqt, k + nk16 * ldk, ldk, E, nk - nk16, lanes, st + nk16 * ldst,
                      ldst, NULL);
}

/* ---- O = alpha·O + P · V ---- */

enum { PV_PAIRS = 64 }; /* key pairs transposed at a time: 32 rows x 64 pairs, 8 KiB */

/* P's pairs for `nr` (16 or 32) rows from r0, pairs p0 .. p0+np-1 (np a
 * multiple of 16): pt[r·PV_PAIRS + p] = pp[(p0 + p)·ldpp + r0 + r], the
 * rows of P with their keys side by side, as tile A reads them. */
static void transpose_pairs(const uint32_t *pp, int64_t ldpp, int nr, int64_t np, uint32_t *pt) {
    for (int r = 0; r < nr; r += 16)
        for (int64_t p = 0; p < np; p += 16) {
            __m512 x[16];
            for (int i = 0; i < 16; i++)
                x[i] = _mm512_castsi512_ps(_mm512_loadu_si512(pp + (p + i) * ldpp + r));
            transpose16(x);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512(pt + (r + i) * PV_PAIRS + p, _mm512_castps_si512(x[i]));
        }
}

/* O's (16·JR rows) x (16·JE features) block += P · V over np pairs. */
ALWAYS_INLINE void pv_block(const uint32_t *pt, const uint32_t *vp, int64_t ldvp, int64_t np,
                            float *o, int64_t ldo, const int JR, const int JE) {
    const int64_t a_stride = 4 * PV_PAIRS, b_stride = 4 * ldvp;
    load_c(o, ldo, JR, JE);
    for (int64_t s = 0; s < np; s += 16) /* 16 rows x 16 pairs of P; 16 pairs x 16 of V */
        tile_step(pt + s, pt + s + 16 * PV_PAIRS, a_stride, vp + s * ldvp, b_stride, JR, JE);
    store_c(o, ldo, JR, JE);
}

/* O rows scaled by alpha before the tiles add to them (a row whose alpha
 * is 1, most rows once their maximum settles, is left as it is). */
static void scale_rows(float *o, int64_t ldo, int rows, int64_t ev, const float *alpha) {
    for (int r = 0; r < rows; r++) {
        if (alpha[r] == 1.0f) continue;
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t e = 0; e < ev; e += 16)
            _mm512_storeu_ps(o + r * ldo + e, _mm512_mul_ps(a, _mm512_loadu_ps(o + r * ldo + e)));
    }
}

/* The core: rows16 x ev16 of O over np16 pairs, all multiples of 16. */
static void pv_tiles(const uint32_t *pp, int64_t ldpp, const uint32_t *vp, int64_t ldvp,
                     int rows16, int64_t np16, int64_t ev16, float *o, int64_t ldo) {
    uint32_t pt[32 * PV_PAIRS] __attribute__((aligned(64))); /* 32 rows x PV_PAIRS pairs */
    for (int64_t p0 = 0; p0 < np16; p0 += PV_PAIRS) {
        const int64_t np = np16 - p0 < PV_PAIRS ? np16 - p0 : PV_PAIRS;
        for (int r = 0; r < rows16; r += 32) {
            const bool two_r = r + 32 <= rows16;
            transpose_pairs(pp + p0 * ldpp + r, ldpp, two_r ? 32 : 16, np, pt);
            for (int64_t e = 0; e < ev16; e += 32) {
                const bool two_e = e + 32 <= ev16;
                const uint32_t *b = vp + p0 * ldvp + e;
                float *c = o + r * ldo + e;
                if (two_r && two_e)
                    pv_block(pt, b, ldvp, np, c, ldo, 2, 2);
                else if (two_r)
                    pv_block(pt, b, ldvp, np, c, ldo, 2, 1);
                else if (two_e)
                    pv_block(pt, b, ldvp, np, c, ldo, 1, 2);
                else
                    pv_block(pt, b, ldvp, np, c, ldo, 1, 1);
            }
        }
    }
}

enum { MAX_ROWS = 512 }; /* rows a call's tiles take; more go to the vector kernel */
static float ones[MAX_ROWS]; /* alpha 1 for the pairs past the tiles (set at init) */

/* Rows, features and pairs past the tiles' multiples of 16 are the vector
 * kernel's: the rows and features with everything (alpha included), the
 * pairs over the core's rows and features with alpha 1 after the tiles. */
static void pv_amx(const uint32_t *pp, int64_t ldpp, const uint32_t *vp, int64_t ldvp, int rows,
                   int64_t npairs, int64_t Ev, float *o, int64_t ldo, const float *alpha) {
    const int rows16 = rows / 16 * 16;
    const int64_t ev16 = Ev / 16 * 16, np16 = npairs / 16 * 16;
    if (rows16 == 0 || ev16 == 0 || np16 == 0 || rows16 > MAX_ROWS) {
        vector_pv_bf(pp, ldpp, vp, ldvp, rows, npairs, Ev, o, ldo, alpha);
        return;
    }
    if (rows16 < rows)
        vector_pv_bf(pp + rows16, ldpp, vp, ldvp, rows - rows16, npairs, Ev, o + rows16 * ldo,
                     ldo, alpha + rows16);
    if (ev16 < Ev)
        vector_pv_bf(pp, ldpp, vp + ev16, ldvp, rows16, npairs, Ev - ev16, o + ev16, ldo, alpha);
    scale_rows(o, ldo, rows16, ev16, alpha);
    const bool own = !tiles_ready;
    if (own) attn__configure_tiles();
    pv_tiles(pp, ldpp, vp, ldvp, rows16, np16, ev16, o, ldo);
    if (own) _tile_release();
    if (np16 < npairs)
        vector_pv_bf(pp + np16 * ldpp, ldpp, vp + np16 * ldvp, ldvp, rows16, npairs - np16, ev16,
                     o, ldo, ones);
}

/* On an AVX512-BF16 context: its two products on tiles, everything else
 * (packing, the softmax, the blocks) as it was. */
void attn__ukernel_init_amx(attn__ukernel *ctx) {
    vector_qkt_bf = ctx->qkt_bf;
    vector_pv_bf = ctx->pv_bf;
    for (int r = 0; r < MAX_ROWS; r++) ones[r] = 1.0f;
    ctx->name = "amx";
    ctx->qkt_bf = qkt_amx;
    ctx->pv_bf = pv_amx;
    ctx->pv_bf_whole = true; /* the causal diagonal on tiles too (ukernel.h) */
    /* Heads of 65-128 in blocks of 128 keys: each O tile that P·V loads and
     * stores then takes 64 key pairs, not 32. (1,16,2048,2048,128) 4-11%
     * faster, causal too; 256 keys 2-3% more, inside the noise; at E = 64
     * 128 keys took 1.05x the time (docs/design.md) */
    ctx->pairs_keys_wide = 128;
    ctx->tiles_begin = tiles_begin;
    ctx->tiles_end = tiles_end;
}
