/* gemm.h — C = A · Bᵀ (+ bias) on row-major matrices, through CBLAS, with
 * results that do not depend on the thread count.
 * A is m x k (row stride lda), B is n x k (ldb), C is m x n (ldc); unit
 * column strides. Dimensions must fit the BLAS integer type (checked by the
 * callers, see attn__blas_fits). */
#ifndef ATTN_GEMM_H
#define ATTN_GEMM_H

#include "internal.h"

/* C = A · Bᵀ, plus `bias` (n values, added to every row) when not NULL,
 * on attn's threads.
 *
 * C is cut into tiles by its shape alone (never by the thread count), and
 * each tile is one single-threaded BLAS call: every element of C is then
 * computed by the same call, with the same blocking, whatever the number of
 * threads, so its bits cannot depend on it. (One threaded OpenBLAS call
 * splits C where its thread count says, and its AVX2 / Zen / SkylakeX
 * kernels round edge tiles differently: docs/design.md has the measurements
 * behind the choice.)
 *
 * Returns ATTN_ERR_NOMEM when OpenBLAS could not map its buffer for a
 * thread (its allocator would otherwise retry forever), and
 * ATTN_ERR_CANCELLED when `cancel` was set; the message is set in the
 * calling thread. */
attn_status attn__gemm_abt(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                           int64_t lda, const void *b, int64_t ldb, const void *bias, void *c,
                           int64_t ldc, const volatile int *cancel);

/* bfloat16 dot-product kernels for attn__gemm_abt_bf16: the kernel
 * layer's pack_qt_bf and qkt_bf (kernels/ukernel.h has their contract),
 * here B's rows (n x k) packed as Qt pairs (k/2 x n) and A's rows read in
 * place as the keys; and its round_bf16_f for C's rows (optional: NULL
 * rounds element by element, the same bits). */
typedef struct attn__gemm_bf16 {
    void (*pack)(const uint16_t *b, int64_t rs, int64_t cs, int64_t n, int64_t k, uint32_t *bp,
                 int64_t ldbp);
    void (*tile)(const uint32_t *bp, int64_t ldbp, const uint16_t *a, int64_t lda, int64_t k,
                 int64_t m, int64_t lanes, float *c, int64_t ldc, const int64_t *keys);
    void (*round)(const float *src, const float *bias, int64_t n, uint16_t *dst);
} attn__gemm_bf16;

/* attn__gemm_abt for bfloat16 A, B, bias and C with the products in
 * bfloat16 dot products (vdpbf16ps: each product exact, summed in float32;
 * bfloat16 subnormals read as 0), each element of C rounded once. Tiled
 * like attn__gemm_abt, so the bits do not depend on the thread count.
 * kern NULL (or without tile): attn__gemm_abt's widened float32 path. */
attn_status attn__gemm_abt_bf16(const attn__gemm_bf16 *kern, int64_t m, int64_t n, int64_t k,
                                const void *a, int64_t lda, const void *b, int64_t ldb,
                                const void *bias, void *c, int64_t ldc,
                                const volatile int *cancel);

/* C = op(A) · op(B) + beta · C, tiled like attn__gemm_abt (by the shape of
 * C alone, so the bits do not depend on the thread count). op(A) is m x k:
 * A itself (m x k, row stride lda) or, with trans_a, the transpose of a
 * stored k x m A; op(B) is k x n: B (k x n, ldb) or, with trans_b, the
 * transpose of a stored n x k B. beta is 0 (C overwritten) or 1 (added to);
 * a weight gradient summed over blocks of rows is one call per block, in a
 * fixed order. */
attn_status attn__gemm(attn_dtype dtype, bool trans_a, bool trans_b, int64_t m, int64_t n,
                       int64_t k, const void *a, int64_t lda, const void *b, int64_t ldb,
                       double beta, void *c, int64_t ldc, const volatile int *cancel);

/* The OpenBLAS kernel set ("core") to switch to when the one it chose at
 * load, `current`, is weaker than what the CPU and OS run (an OpenBLAS older
 * than the CPU): "SkylakeX" or "Haswell"; NULL to keep it. Pure, for tests. */
const char *attn__blas_core_upgrade(const char *current, const attn__cpu_features *f);
/* Makes a DYNAMIC_ARCH OpenBLAS choose its kernels again with `core` forced
 * (its own OPENBLAS_CORETYPE mechanism). Only while no BLAS call runs: the
 * library does it once, as it loads, when OPENBLAS_CORETYPE is unset. False
 * when the BLAS is not such an OpenBLAS. */
bool attn__blas_switch_core(const char *core);

/* Whether x fits a 32-bit BLAS integer (the common LP64 interface). */
static inline bool attn__blas_fits(int64_t x) { return x >= 0 && x <= INT32_MAX; }

#endif
