/* threads.c — how many threads a call uses, what happens to them across
 * fork(), and the per-thread cancel flag. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* OpenMP's runtime ends the process when it cannot start a thread (libgomp:
 * "Thread creation failed"), so attn never asks for more than a small
 * multiple of the processors: oversubscription past that only slows a call
 * down, and a request of thousands would risk the whole process. */
enum { THREADS_PER_PROCESSOR = 4, THREADS_CEILING = 1024 };

int attn_max_threads(void) {
#ifdef _OPENMP
    int procs = omp_get_num_procs();
    if (procs < 1) procs = 1;
    return procs >= THREADS_CEILING / THREADS_PER_PROCESSOR ? THREADS_CEILING
                                                            : procs * THREADS_PER_PROCESSOR;
#else
    return 1;
#endif
}

static int clamp_threads(long n) { return n > attn_max_threads() ? attn_max_threads() : (int)n; }

static atomic_int requested;   /* 0: use the default */
static atomic_int env_threads; /* 0: not read yet; the default after that */

/* ATTN_NUM_THREADS if it is a whole number >= 1, else the processor count.
 * A value that cannot be used is reported once on stderr (the library has no
 * other channel at that point), and the default used instead. */
static int read_default(void) {
#ifdef _OPENMP
    const int procs = omp_get_num_procs() > 0 ? omp_get_num_procs() : 1;
#else
    const int procs = 1;
#endif
    const char *env = getenv("ATTN_NUM_THREADS");
    if (env == NULL || *env == '\0') return clamp_threads(procs);
    char *end;
    long n = strtol(env, &end, 10);
    if (end == env || *end != '\0' || n < 1) {
        fprintf(stderr,
                "attn: ignoring ATTN_NUM_THREADS=%.64s: expected a whole number >= 1; "
                "using %d threads\n",
                env, clamp_threads(procs));
        return clamp_threads(procs);
    }
    if (n > attn_max_threads())
        fprintf(stderr,
                "attn: ATTN_NUM_THREADS=%.64s is more than the %d threads attn runs on this "
                "machine (%d per processor); using %d\n",
                env, attn_max_threads(), THREADS_PER_PROCESSOR, attn_max_threads());
    return clamp_threads(n);
}

static int default_threads(void) {
    int n = atomic_load(&env_threads);
    if (n == 0) {
        n = read_default();
        int expected = 0; /* first reader wins: the warning is printed at most by racers */
        if (!atomic_compare_exchange_strong(&env_threads, &expected, n)) n = expected;
    }
    return n;
}

void attn_set_num_threads(int n) { atomic_store(&requested, n > 0 ? clamp_threads(n) : 0); }

int attn_get_num_threads(void) {
    int n = atomic_load(&requested);
    return n > 0 ? n : default_threads();
}

/* GNU OpenMP keeps its worker threads in a pool that fork() does not copy:
 * a child whose parent had started them waits forever in its first parallel
 * region. attn notes when it asks for more than one thread, and a child
 * forked after that runs attn single-threaded (correct, and never a hang;
 * a child that wants threads should be started with exec or spawn). */
#ifdef _OPENMP
static atomic_bool pool_started;
static atomic_bool forked_child;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void in_child(void) {
    if (atomic_load(&pool_started)) atomic_store(&forked_child, true);
}
static void register_atfork(void) { pthread_atfork(NULL, NULL, in_child); }
#endif

int attn__threads(void) {
#ifdef _OPENMP
    if (atomic_load(&forked_child)) return 1;
    const int n = attn_get_num_threads();
    if (n > 1 && !atomic_load(&pool_started)) {
        pthread_once(&atfork_once, register_atfork);
        atomic_store(&pool_started, true);
    }
    return n;
#else
    return 1;
#endif
}

int attn__thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

bool attn__run_inline(int team) {
#ifdef _OPENMP
    return team <= 1 && omp_get_level() == 0;
#else
    (void)team;
    return true;
#endif
}

/* ---- cancellation ---- */

static _Thread_local const volatile int *cancel_flag;

void attn_set_cancel_flag(const volatile int *flag) { cancel_flag = flag; }

const volatile int *attn__cancel_flag(void) { return cancel_flag; }

attn_status attn__fail_cancelled(void) {
    return attn__fail(ATTN_ERR_CANCELLED,
                      "the call was cancelled: its cancel flag (attn_set_cancel_flag) was set; "
                      "the outputs hold partial results");
}
