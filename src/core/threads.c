/* threads.c — the one piece of global state: how many threads a call uses. */
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static atomic_int requested; /* 0: use the default */

static int default_threads(void) {
    const char *env = getenv("ATTN_NUM_THREADS");
    if (env != NULL) {
        char *end;
        long n = strtol(env, &end, 10);
        if (end != env && *end == '\0' && n >= 1 && n <= 4096) return (int)n;
    }
#ifdef _OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}

void attn_set_num_threads(int n) { atomic_store(&requested, n > 0 ? n : 0); }

int attn_get_num_threads(void) {
    int n = atomic_load(&requested);
    return n > 0 ? n : default_threads();
}

int attn__threads(void) {
#ifdef _OPENMP
    return attn_get_num_threads();
#else
    return 1;
#endif
}
