/* gemm.h — C = A · Bᵀ + beta · C on row-major matrices, through CBLAS.
 * A is m x k (row stride lda), B is n x k (ldb), C is m x n (ldc); unit
 * column strides. Dimensions must fit the BLAS integer type (checked by the
 * callers, see attn__blas_fits). */
#ifndef ATTN_GEMM_H
#define ATTN_GEMM_H

#include "internal.h"

void attn__gemm_abt(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                    int64_t lda, const void *b, int64_t ldb, double beta, void *c,
                    int64_t ldc);

/* C = A · Bᵀ (+ C when accumulate) on attn's thread count when the CBLAS
 * is OpenBLAS built with OpenMP (it then takes its team size from the
 * calling thread's OpenMP setting); otherwise on the BLAS's own threads.
 * The BLAS splits C, not the sum over k, but whether an element's bits
 * depend on where the split falls is the BLAS's kernels' business:
 * OpenBLAS's AVX2 / AVX-512 kernels give the same bits for any thread
 * count, its SSE3 fallback does not (test_mha checks both). */
void attn__gemm_abt_threaded(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                             int64_t lda, const void *b, int64_t ldb, bool accumulate, void *c,
                             int64_t ldc);

/* Whether x fits a 32-bit BLAS integer (the common LP64 interface). */
static inline bool attn__blas_fits(int64_t x) { return x >= 0 && x <= INT32_MAX; }

#endif
