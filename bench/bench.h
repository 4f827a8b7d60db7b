/* bench.h — what attn_bench's commands share (bench_util.c): the clock,
 * options, medians, and the counter-based values run.py can draw
 * identically in NumPy. */
#ifndef ATTN_BENCH_BENCH_H
#define ATTN_BENCH_BENCH_H

#include <stddef.h>
#include <stdint.h>

/* Seconds on the bench's clock (CLOCK_MONOTONIC; the calling thread's CPU
 * time after bench_use_cpu_time, which --cpu-time calls). */
double bench_now(void);
void bench_use_cpu_time(void);

/* Value of "--name V" in argv, or fallback / NULL; whether argv holds name. */
long bench_opt_long(int argc, char **argv, const char *name, long fallback);
const char *bench_opt_str(int argc, char **argv, const char *name);
int bench_has_flag(int argc, char **argv, const char *name);

/* n bytes aligned to 2 MiB and advised onto transparent huge pages (a
 * hint: 4 KiB pages where THP is off); free() releases them. NULL when out
 * of memory. */
void *bench_alloc_huge(size_t n);

/* Median of n values (NaN if out of memory); x is not reordered. */
double bench_median(const double *x, int n);

/* Value i of stream `seed`: splitmix64 of i + (seed + 1) * golden ratio,
 * its top 24 bits as (z >> 40) * 2^-23 - 1, exactly representable in
 * float32 and uniform in [-1, 1). bench/run.py's hashed() draws the same
 * values with NumPy, so attn_bench and PyTorch see the same inputs without
 * files between them. */
static inline float bench_hashed(uint64_t seed, uint64_t i) {
    uint64_t z = i + (seed + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

/* The serving cases (bench/serving_bench.c): decode, window, varlen. */
int bench_serving(const char *cmd, int argc, char **argv);

/* bfloat16 bits of a finite float, rounded to nearest even. */
static inline uint16_t bench_bf16(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fffu + (u >> 16 & 1u)) >> 16);
}

#endif
