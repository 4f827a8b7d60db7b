/* gemm.c — the one place libattn calls CBLAS (the projection GEMMs). */
#include <cblas.h>

#include "internal.h"
#include "gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* OpenBLAS's own query, when the linked CBLAS is OpenBLAS; absent otherwise
 * (a weak reference resolves to NULL). 2 means "built with OpenMP". */
extern int openblas_get_parallel(void) __attribute__((weak));

bool attn__blas_nests_in_openmp(void) {
    return openblas_get_parallel != NULL && openblas_get_parallel() == 2;
}

void attn__gemm_abt(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                    int64_t lda, const void *b, int64_t ldb, double beta, void *c,
                    int64_t ldc) {
    /* BLAS checks lda >= k and ldc >= n even for a single row, where the
     * row stride is never used (and may be anything, even beyond int). */
    if (m == 1) {
        lda = k;
        ldc = n;
    }
    if (dtype == ATTN_DTYPE_F32)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n,
                    (int)k, 1.0f, a, (int)lda, b, (int)ldb, (float)beta, c,
                    (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n,
                    (int)k, 1.0, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

enum { TILE_M = 128, TILE_N = 512 };

void attn__gemm_abt_tiled(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                          int64_t lda, const void *b, int64_t ldb, bool accumulate, void *c,
                          int64_t ldc) {
    const size_t es = attn_dtype_size(dtype);
    const int64_t tm = (m + TILE_M - 1) / TILE_M, tn = (n + TILE_N - 1) / TILE_N;
    const int threads = attn__threads();
    const bool nest = attn__blas_nests_in_openmp() && tm * tn > 1 && threads > 1 &&
                      (double)m * (double)n * (double)k >= ATTN_PARALLEL_MIN_WORK;
    if (!nest) {
        attn__gemm_abt(dtype, m, n, k, a, lda, b, ldb, accumulate ? 1.0 : 0.0, c, ldc);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tm * tn; t++) {
        const int64_t i0 = t / tn * TILE_M, j0 = t % tn * TILE_N;
        const int64_t mi = m - i0 < TILE_M ? m - i0 : TILE_M, nj = n - j0 < TILE_N ? n - j0 : TILE_N;
        attn__gemm_abt(dtype, mi, nj, k, (const char *)a + (size_t)(i0 * lda) * es, lda,
                       (const char *)b + (size_t)(j0 * ldb) * es, ldb, accumulate ? 1.0 : 0.0,
                       (char *)c + (size_t)(i0 * ldc + j0) * es, ldc);
    }
}
