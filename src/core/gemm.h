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

/* Whether the CBLAS runs single-threaded inside an OpenMP parallel region
 * (OpenBLAS built with OpenMP reports this through openblas_get_parallel).
 * Then attn runs GEMM tiles in its own threads; otherwise it calls the BLAS
 * from one thread and lets it use its own thread pool. */
bool attn__blas_nests_in_openmp(void);

/* C = A · Bᵀ (+ C when accumulate) over fixed-size tiles of C, run on attn's
 * threads when the BLAS nests (see above). The tiles do not depend on the
 * thread count, so neither does the result. */
void attn__gemm_abt_tiled(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                          int64_t lda, const void *b, int64_t ldb, bool accumulate, void *c,
                          int64_t ldc);

/* Whether x fits a 32-bit BLAS integer (the common LP64 interface). */
static inline bool attn__blas_fits(int64_t x) { return x >= 0 && x <= INT32_MAX; }

#endif
