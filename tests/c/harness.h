/*
 * harness.h — a minimal test harness: CHECK records a failure and goes on,
 * so one run reports every broken property; main() prints a summary line and
 * exits non-zero on any failure.
 */
#ifndef ATTN_TEST_HARNESS_H
#define ATTN_TEST_HARNESS_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"

extern int harness_checks, harness_failures;

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        harness_checks++;                                                     \
        if (!(cond)) {                                                        \
            harness_failures++;                                               \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, "\n");                                            \
        }                                                                     \
    } while (0)

/* A call must fail with `want` and leave a non-empty message. */
#define CHECK_STATUS(call, want)                                                        \
    do {                                                                                \
        attn_status st_ = (call);                                                       \
        CHECK(st_ == (want), "%s returned %d (%s), expected %d; message: %s", #call,    \
              (int)st_, attn_strerror(st_), (int)(want), attn_last_error());            \
        if ((want) != ATTN_OK)                                                          \
            CHECK(attn_last_error()[0] != '\0', "%s left no message", #call);           \
    } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, ATTN_OK)

typedef void (*harness_fn)(void);
typedef struct harness_test {
    const char *name;
    harness_fn fn;
} harness_test;

/* Runs the tests (all, or those named on the command line). */
int harness_main(int argc, char **argv, const harness_test *tests, int count);

#define HARNESS_MAIN(...)                                                   \
    int main(int argc, char **argv) {                                       \
        static const harness_test tests_[] = {__VA_ARGS__};                 \
        return harness_main(argc, argv, tests_,                             \
                            (int)(sizeof tests_ / sizeof tests_[0]));       \
    }
#define T(fn) {#fn, fn}

/* ---- helpers shared by the tests ---- */

/* xorshift64*: reproducible test data. */
typedef struct rng {
    unsigned long long s;
} rng;
static inline unsigned long long rng_next(rng *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 2685821657736338717ull;
}
static inline double rng_uniform(rng *r) { return (double)(rng_next(r) >> 11) / 9007199254740992.0; }
static inline long rng_int(rng *r, long lo, long hi) { /* inclusive */
    return lo + (long)(rng_next(r) % (unsigned long long)(hi - lo + 1));
}
static inline double rng_normal(rng *r) {
    double u = rng_uniform(r) + 1e-300, v = rng_uniform(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* The seed for randomized tests: ATTN_TEST_SEED if set, else a fixed one;
 * printed so that a failure can be replayed. */
unsigned long long harness_seed(void);

#endif
