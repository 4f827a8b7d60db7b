/* gemm.c — the one place libattn calls CBLAS (the projection GEMMs). */
#include <cblas.h>
#include <stdio.h>

#include "internal.h"
#include "gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* OpenBLAS's own queries, when the linked CBLAS is OpenBLAS; absent
 * otherwise (a weak reference resolves to NULL). */
extern int openblas_get_parallel(void) __attribute__((weak));
extern char *openblas_get_config(void) __attribute__((weak));
extern char *openblas_get_corename(void) __attribute__((weak));

#ifdef _OPENMP
/* openblas_get_parallel() == 2: OpenBLAS built with OpenMP. */
static bool blas_uses_openmp(void) {
    return openblas_get_parallel != NULL && openblas_get_parallel() == 2;
}
#endif

const char *attn_blas_info(void) {
    if (openblas_get_config == NULL || openblas_get_corename == NULL) return "CBLAS";
    /* Per thread, like the error messages: no locking, no race. The core
     * OpenBLAS picked at load time is what decides its speed. */
    static _Thread_local char info[256];
    snprintf(info, sizeof info, "%s; core %s", openblas_get_config(), openblas_get_corename());
    return info;
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

void attn__gemm_abt_threaded(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                             int64_t lda, const void *b, int64_t ldb, bool accumulate, void *c,
                             int64_t ldc) {
    const double beta = accumulate ? 1.0 : 0.0;
#ifdef _OPENMP
    if (blas_uses_openmp()) {
        /* OpenMP OpenBLAS sizes its team from the calling thread's nthreads
         * setting: attn's thread count for this call (one thread for tiny
         * ones, where waking a team costs more than it saves), then the
         * caller's setting back. One BLAS call packs each operand once;
         * splitting C into tiles on attn's own threads repacked B per tile
         * and measured 1.5-2.8x slower. */
        const bool tiny = (double)m * (double)n * (double)k < ATTN_PARALLEL_MIN_WORK;
        const int saved = omp_get_max_threads();
        omp_set_num_threads(tiny ? 1 : attn__threads());
        attn__gemm_abt(dtype, m, n, k, a, lda, b, ldb, beta, c, ldc);
        omp_set_num_threads(saved);
        return;
    }
#endif
    attn__gemm_abt(dtype, m, n, k, a, lda, b, ldb, beta, c, ldc);
}
