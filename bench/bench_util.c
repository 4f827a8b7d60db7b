/* bench_util.c — what attn_bench's commands share (bench.h): the clock,
 * options and medians. */
#define _DEFAULT_SOURCE /* clock_gettime, madvise */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "bench.h"

static clockid_t timer = CLOCK_MONOTONIC; /* CLOCK_THREAD_CPUTIME_ID with --cpu-time */

void bench_use_cpu_time(void) { timer = CLOCK_THREAD_CPUTIME_ID; }

void *bench_alloc_huge(size_t n) {
    const size_t huge = (size_t)2 << 20, rounded = (n + huge - 1) / huge * huge;
    void *p = NULL;
    if (rounded < n || posix_memalign(&p, huge, rounded) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

double bench_now(void) {
    struct timespec t;
    clock_gettime(timer, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

long bench_opt_long(int argc, char **argv, const char *name, long fallback) {
    for (int i = 0; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return strtol(argv[i + 1], NULL, 10);
    return fallback;
}

const char *bench_opt_str(int argc, char **argv, const char *name) {
    for (int i = 0; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return argv[i + 1];
    return NULL;
}

int bench_has_flag(int argc, char **argv, const char *name) {
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], name) == 0) return 1;
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(const double *x, int n) {
    double *s = malloc(sizeof(double) * (size_t)n);
    if (s == NULL) return NAN;
    memcpy(s, x, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    const double m = n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
    free(s);
    return m;
}
