/*
 * gemm_tiles.c — why MHA's projections are cut into tiles by shape
 * (docs/design.md). For the projection GEMMs of `make bench`'s MHA shapes,
 * float32, on attn's thread count: the time of attn__gemm_abt (shape tiles,
 * one single-threaded BLAS call each) against one BLAS call threaded by the
 * BLAS itself (OpenMP OpenBLAS reads omp_set_num_threads), best of 15, and
 * how many elements that threaded call changes between 1 and N threads.
 * Run under each OPENBLAS_CORETYPE to compare kernel sets.
 */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gemm.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* C = A·Bᵀ + bias with one BLAS call on `threads` threads. */
static void threaded_call(int threads, int m, int n, int k, const float *a, const float *b,
                          const float *bias, float *c) {
#ifdef _OPENMP
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    for (int r = 0; r < m; r++) memcpy(c + (size_t)r * n, bias, sizeof(float) * (size_t)n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, k, b, k, 1.0f, c, n);
}

int main(void) {
    /* (rows, out features, in features): in- and out-projection of MHA
     * "seed 000" (128 x 32 tokens, E 200) and "BERT-base" (8 x 512, E 768). */
    static const int shapes[4][3] = {{4096, 600, 200}, {4096, 200, 200},
                                     {4096, 2304, 768}, {4096, 768, 768}};
    const int threads = attn_get_num_threads();
    printf("BLAS: %s; %d threads\n", attn_blas_info(), threads);
    for (int s = 0; s < 4; s++) {
        const int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        const size_t mk = (size_t)m * k, nk = (size_t)n * k, mn = (size_t)m * n;
        float *a = malloc(sizeof(float) * mk), *b = malloc(sizeof(float) * nk);
        float *bias = malloc(sizeof(float) * (size_t)n), *c = malloc(sizeof(float) * mn);
        float *c1 = malloc(sizeof(float) * mn), *cn = malloc(sizeof(float) * mn);
        if (!a || !b || !bias || !c || !c1 || !cn) return 1;
        for (size_t i = 0; i < mk; i++) a[i] = (float)(i * 7919 % 1000) / 1000.0f - 0.5f;
        for (size_t i = 0; i < nk; i++) b[i] = (float)(i * 104729 % 1000) / 1000.0f - 0.5f;
        for (int i = 0; i < n; i++) bias[i] = 0.01f * (float)i;
        double tiles = 1e9, one = 1e9;
        for (int rep = 0; rep < 15; rep++) {
            double t0 = now();
            if (attn__gemm_abt(ATTN_DTYPE_F32, m, n, k, a, k, b, k, bias, c, n, NULL) != ATTN_OK)
                return 1;
            double t1 = now();
            threaded_call(threads, m, n, k, a, b, bias, cn);
            double t2 = now();
            if (t1 - t0 < tiles) tiles = t1 - t0;
            if (t2 - t1 < one) one = t2 - t1;
        }
        threaded_call(1, m, n, k, a, b, bias, c1);
        long differ = 0;
        for (size_t i = 0; i < mn; i++) differ += c1[i] != cn[i];
        const double gflop = 2.0 * m * n * k / 1e9;
        printf("%5d x %4d x %4d: tiles %7.2f ms (%3.0f GFLOP/s), one threaded call %7.2f ms "
               "(%3.0f GFLOP/s), time ratio %.2f; the threaded call changes %ld of %ld "
               "elements between 1 and %d threads\n",
               m, n, k, 1e3 * tiles, gflop / tiles, 1e3 * one, gflop / one, tiles / one, differ,
               (long)m * n, threads);
        free(a), free(b), free(bias), free(c), free(c1), free(cn);
    }
    return 0;
}
