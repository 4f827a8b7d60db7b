/* gemm.c — the one place libattn calls CBLAS (the projection GEMMs). */
#include <cblas.h>

#include "internal.h"
#include "gemm.h"

void attn__gemm_abt(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                    int64_t lda, const void *b, int64_t ldb, double beta, void *c,
                    int64_t ldc) {
    /* BLAS checks lda >= k and ldc >= n even for a single row, where the
     * row stride is never used. */
    if (m == 1 && lda < k) lda = k;
    if (m == 1 && ldc < n) ldc = n;
    if (dtype == ATTN_DTYPE_F32)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n,
                    (int)k, 1.0f, a, (int)lda, b, (int)ldb, (float)beta, c,
                    (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n,
                    (int)k, 1.0, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}
