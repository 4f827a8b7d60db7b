/*
 * flash_generic.c — the fused kernels in portable C: the fallback on every
 * CPU, the only float64 fused path, and the yardstick the vector kernels are
 * read against. Loops are ordered so a compiler can vectorize the inner one.
 */
#include <math.h>
#include <string.h>

#include "../exp2.h"
#include "../ukernel.h"


#define DEFINE_GENERIC(REAL, SFX, EXP2)                                                          \
    /* One online-softmax step over the n scores x[0], x[step], ...: m is the                    \
     * line's best raw score so far, the largest (c >= 0) or the smallest                        \
     * (c < 0), so x = (s - m)·c <= 0; p = 2^x in place, l <- l·alpha + sum p,                   \
     * alpha = 2^((m_old - m_new)·c). A line that has seen nothing visible                       \
     * (m = -inf·c) measures from 0, so hidden scores give exactly 0. */                         \
    static void softmax_line_##SFX(REAL *x, int64_t step, int64_t n, REAL c, REAL *m, REAL *l,   \
                                   REAL *alpha) {                                                \
        const REAL none = c >= 0 ? -(REAL)INFINITY : (REAL)INFINITY;                             \
        REAL best = none;                                                                        \
        for (int64_t j = 0; j < n; j++) {                                                        \
            const REAL v = x[j * step];                                                          \
            if (c >= 0 ? v > best : v < best) best = v;                                          \
        }                                                                                        \
        const REAL m_new = (c >= 0 ? best > *m : best < *m) ? best : *m;                         \
        const REAL ref = m_new == none ? 0 : m_new;                                              \
        REAL sum = 0;                                                                            \
        for (int64_t j = 0; j < n; j++) {                                                        \
            x[j * step] = EXP2((x[j * step] - ref) * c);                                         \
            sum += x[j * step];                                                                  \
        }                                                                                        \
        *alpha = EXP2((*m - ref) * c);                                                           \
        *l = *l * *alpha + sum;                                                                  \
        *m = m_new;                                                                              \
    }                                                                                            \
    /* St[j][r] = sum_e K[j][e] Qt[e][r]: keys down, queries across. */                          \
    static void generic_qkt_##SFX(const REAL *qt, int64_t ldqt, const REAL *k, int64_t ldk,      \
                                  int64_t E, int64_t nk, int64_t lanes, REAL *st, int64_t ldst,  \
                                  const int64_t *keys) {                                         \
        (void)keys; /* every key of every lane (allowed) */                                      \
        for (int64_t j = 0; j < nk; j++) {                                                       \
            REAL *sj = st + j * ldst;                                                            \
            for (int64_t r = 0; r < lanes; r++) sj[r] = 0;                                       \
            for (int64_t e = 0; e < E; e++) {                                                    \
                const REAL kje = k[j * ldk + e];                                                 \
                const REAL *qe = qt + e * ldqt;                                                  \
                for (int64_t r = 0; r < lanes; r++) sj[r] += kje * qe[r];                        \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    /* Online softmax down each column (query) of St. */                                         \
    static void generic_softmax_t_##SFX(REAL *st, int64_t ldst, int64_t nk, int64_t lanes,       \
                                        REAL c, REAL *m, REAL *l, REAL *alpha) {                 \
        for (int64_t r = 0; r < lanes; r++)                                                      \
            softmax_line_##SFX(st + r, ldst, nk, c, m + r, l + r, alpha + r);                    \
    }                                                                                            \
    static void generic_qk_direct_##SFX(const REAL *q, int64_t ldq, const REAL *k, int64_t ldk,  \
                                        int64_t E, int rows, int64_t nk, REAL *s, int64_t lds) { \
        for (int r = 0; r < rows; r++)                                                           \
            for (int64_t j = 0; j < nk; j++) {                                                   \
                double acc = 0;                                                                  \
                for (int64_t e = 0; e < E; e++)                                                  \
                    acc += (double)q[r * ldq + e] * (double)k[j * ldk + e];                      \
                s[r * lds + j] = (REAL)acc;                                                      \
            }                                                                                    \
    }                                                                                            \
    static void generic_softmax_##SFX(REAL *s, int64_t lds, int rows, int64_t cols, REAL c,      \
                                      REAL *m, REAL *l, REAL *alpha) {                           \
        for (int r = 0; r < rows; r++)                                                           \
            softmax_line_##SFX(s + r * lds, 1, cols, c, m + r, l + r, alpha + r);                \
    }                                                                                            \
    static void generic_pv_##SFX(const REAL *p, int64_t p_rs, int64_t p_cs, const REAL *v,       \
                                 int64_t ldv, int rows, int64_t nk, int64_t Ev, REAL *o,         \
                                 int64_t ldo, const REAL *alpha, int64_t streamed) {             \
        (void)streamed; /* the portable path leaves streams to the prefetchers */               \
        for (int r = 0; r < rows; r++) {                                                         \
            REAL *orow = o + r * ldo;                                                            \
            for (int64_t e = 0; e < Ev; e++) orow[e] *= alpha[r];                                \
            for (int64_t j = 0; j < nk; j++) {                                                   \
                const REAL pj = p[r * p_rs + j * p_cs];                                          \
                const REAL *vj = v + j * ldv;                                                    \
                for (int64_t e = 0; e < Ev; e++) orow[e] += pj * vj[e];                          \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    static void generic_softmax_bwd_t_##SFX(REAL *st, REAL *dpt, int64_t ld, int64_t nk,         \
                                            int64_t lanes, REAL c, const REAL *off,              \
                                            const REAL *off_lo, const REAL *D, REAL ds_scale) {  \
        for (int64_t j = 0; j < nk; j++) {                                                       \
            REAL *s = st + j * ld, *dp = dpt + j * ld;                                           \
            for (int64_t r = 0; r < lanes; r++) {                                                \
                const REAL pr = EXP2((s[r] * c - off[r]) - off_lo[r]);                           \
                s[r] = pr;                                                                       \
                dp[r] = pr == 0 ? 0 : ds_scale * pr * (dp[r] - D[r]);                           \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_GENERIC(float, f, attn__exp2f_inline)
DEFINE_GENERIC(double, d, attn__exp2d_inline)

/* Rows of an operand into the compute type (ukernel.h). The switch has no
 * default on purpose: a dtype added to attn_dtype is a compile error here
 * (-Wswitch, -Werror) until it gets its conversion, never a silent misread.
 * Bool and int32 are never a Q, K or V dtype (validation rejects them);
 * they read as attn__load reads them (bool as 0 or 1), so that the slot is
 * defined for every dtype. The 16-bit storage dtypes are a KV cache's. */
#define COPY_ROWS(CONVERT)                                                                      \
    if (cs == 1) { /* the common layout: a loop the compiler vectorizes */                      \
        for (int64_t i = 0; i < nrows; i++)                                                     \
            for (int64_t j = 0; j < width; j++) dst[i * ld + j] = CONVERT(i * rs + j);          \
        return;                                                                                 \
    }                                                                                           \
    for (int64_t i = 0; i < nrows; i++)                                                         \
        for (int64_t j = 0; j < width; j++) dst[i * ld + j] = CONVERT(i * rs + j * cs)
#define FROM_F32(at) ((const float *)src)[at]
#define FROM_F64(at) ((const double *)src)[at]
#define FROM_BOOL(at) (((const unsigned char *)src)[at] != 0)
#define FROM_F16(at) attn__f16_to_float(((const uint16_t *)src)[at])
#define FROM_BF16(at) attn__bf16_to_float(((const uint16_t *)src)[at])
#define FROM_I32(at) ((const int32_t *)src)[at]
#define DEFINE_LOAD(REAL, SFX)                                                                  \
    void attn__load_rows_generic_##SFX(const void *src, attn_dtype dtype, int64_t rs,           \
                                       int64_t cs, int64_t nrows, int64_t width, REAL *dst,     \
                                       int64_t ld) {                                            \
        /* rows already of the compute type: copies (the element loop was left scalar   \
         * at -O2, 3% of a 16-token call on Zen 3) */                                         \
        if (cs == 1 && dtype == (sizeof(REAL) == 4 ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64)) {        \
            for (int64_t i = 0; i < nrows; i++)                                                 \
                memcpy(dst + i * ld, (const REAL *)src + i * rs, sizeof(REAL) * (size_t)width); \
            return;                                                                             \
        }                                                                                       \
        switch (dtype) {                                                                        \
        case ATTN_DTYPE_F32: { COPY_ROWS(FROM_F32); return; }                                   \
        case ATTN_DTYPE_F64: { COPY_ROWS(FROM_F64); return; }                                   \
        case ATTN_DTYPE_BOOL: { COPY_ROWS(FROM_BOOL); return; }                                 \
        case ATTN_DTYPE_F16: { COPY_ROWS(FROM_F16); return; }                                   \
        case ATTN_DTYPE_BF16: { COPY_ROWS(FROM_BF16); return; }                                 \
        case ATTN_DTYPE_I32: { COPY_ROWS(FROM_I32); return; }                                   \
        }                                                                                       \
    }

DEFINE_LOAD(float, f)
DEFINE_LOAD(double, d)

/* The portable context. Its blocking is the AVX-512 kernels' measured one
 * (48 lanes; 128 / 64 / 32 keys per block up to widths 64 / 128 / more; 256
 * keys per block and up to 16 rows in the keys-in-columns layout), never
 * tuned for portable C; 16 lanes per step and 4 rows per micro-tile are
 * what the loops above were written for (any count works for them). */
void attn__ukernel_init_generic(attn__ukernel *ctx) {
    *ctx = (attn__ukernel){
        .name = "generic",
        .lanes = 48,
        .lane_step = 16,
        .key_block = {{64, 128}, {128, 64}, {INT64_MAX, 32}},
        .direct_keys = 256,
        .direct_rows = 16,
        .pv_rows = 4,
        .col_step = 1,
        .load_rows_f = attn__load_rows_generic_f,
        .load_rows_d = attn__load_rows_generic_d,
        .pack_qt_f = NULL,
        .qkt_f = generic_qkt_f,
        .softmax_t_f = generic_softmax_t_f,
        .qk_direct_f = generic_qk_direct_f,
        .softmax_f = generic_softmax_f,
        .pv_f = generic_pv_f,
        .softmax_bwd_t_f = generic_softmax_bwd_t_f,
        .pack_qt_d = NULL,
        .qkt_d = generic_qkt_d,
        .softmax_t_d = generic_softmax_t_d,
        .qk_direct_d = generic_qk_direct_d,
        .softmax_d = generic_softmax_d,
        .pv_d = generic_pv_d,
        .softmax_bwd_t_d = generic_softmax_bwd_t_d,
    };
}
