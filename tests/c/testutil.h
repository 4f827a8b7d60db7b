/*
 * testutil.h — test-side tensors and the independent float64 oracle.
 *
 * The oracle shares no code with the library: it densifies every input by
 * reading it through its strides, broadcasts by explicit index arithmetic,
 * and draws dropout from its own Philox implementation.
 */
#ifndef ATTN_TESTUTIL_H
#define ATTN_TESTUTIL_H

#include <stdint.h>

#include "harness.h"

/* A tensor with a random memory layout over its own buffer. */
typedef struct test_tensor {
    attn_tensor t;
    void *storage;
} test_tensor;

enum {
    LAYOUT_CONTIGUOUS = 0,
    LAYOUT_RANDOM = 1 /* permuted dims, gaps, reversed dims, zero-stride broadcasts */
};

/* Allocates and fills with N(0,1) * amplitude (floats) or Bernoulli(p_true)
 * (bool). For LAYOUT_RANDOM, size-1 dims may also get odd strides. */
void tt_make(test_tensor *x, rng *r, attn_dtype dtype, int rank, const int64_t *shape,
             int layout, double amplitude, double p_true);
/* Zero-filled output with a random (non-overlapping) layout. */
void tt_make_output(test_tensor *x, rng *r, attn_dtype dtype, int rank, const int64_t *shape,
                    int layout);
void tt_free(test_tensor *x);

/* Element access through the strides; idx has t->rank entries. */
double tt_get(const attn_tensor *t, const int64_t *idx);
/* A contiguous copy of src's values in `dtype` (exact when it is wider). */
void tt_convert(const attn_tensor *src, attn_dtype dtype, test_tensor *dst);
/* float16/bfloat16 bits to their value, and a double to the nearest bits. */
double tt_half_value(uint16_t h, attn_dtype dtype);
uint16_t tt_half_bits(double x, attn_dtype dtype);
void tt_set(const attn_tensor *t, const int64_t *idx, double value);
/* A dense row-major double copy (caller frees). */
double *tt_dense(const attn_tensor *t);
/* Every element of t set to x (a sentinel before a call, say). */
void tt_fill(const attn_tensor *t, double x);
/* Whether two tensors of one shape hold the same values bit for bit (as
 * doubles: NaN payloads included). */
bool tt_same_bits(const attn_tensor *a, const attn_tensor *b);
/* max |a - b| over two tensors of one shape, and max |b|. */
void tt_compare(const attn_tensor *a, const attn_tensor *b, double *diff, double *mag);

/* Independent Philox-4x32-10. */
void oracle_philox(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

typedef struct oracle_sdpa_args {
    const attn_tensor *q, *k, *v, *mask;
    int mask_true_keeps;  /* 1: bool true = keep (SDPA); 0: true = masked (MHA) */
    int causal;           /* 0 none, 1 top-left, 2 bottom-right */
    int has_scale;
    double scale;
    int gqa;
    double dropout_p;
    uint64_t seed, rng_offset;
    const struct oracle_modifiers *mods; /* NULL: none */
} oracle_sdpa_args;

/* Score modifiers (attn_sdpa_params'): window_left/right bound the keys
 * (-1: unbounded), softcap 0 is none; alibi and sinks: one slope / sink
 * logit per batch index (nbatch, row-major), or NULL. */
typedef struct oracle_modifiers {
    int64_t window_left, window_right;
    double softcap;
    const double *alibi, *sinks;
} oracle_modifiers;

typedef struct oracle_sdpa_result {
    int rank;                    /* of out */
    int64_t shape[ATTN_MAX_RANK];/* out shape (B..., L, Ev) */
    int64_t nbatch, L, S, Ev;
    double *out, *weights, *lse; /* dense, row-major */
} oracle_sdpa_result;

/* Returns 0 on success, -1 if the arguments do not broadcast (the oracle's
 * own opinion, for cross-checking the library's validation). */
int oracle_sdpa(const oracle_sdpa_args *a, oracle_sdpa_result *res);
void oracle_free(oracle_sdpa_result *res);

/* max |a - b| over n elements, treating equal infinities and NaN==NaN as 0. */
double max_abs_diff(const double *a, const double *b, int64_t n);

/* ---- a failing allocator (attn_set_allocator), SQLite-style ---- */

/* Allocation number fail_at fails, and with `persistent` every later one
 * too; live counts blocks allocated and not yet released. The counters are
 * atomic: attn allocates from its worker threads too (two at once would
 * lose a count, and a test would see a block "not freed" that was). */
typedef struct test_failer {
    _Atomic long allocs, live, failed;
    long fail_at;
    bool persistent;
} test_failer;

/* Resets f to fail allocation number fail_at and installs it; the caller
 * restores malloc with attn_set_allocator(NULL). */
void failer_install(test_failer *f, long fail_at, bool persistent);

/* ---- files, for the tests of what is left on disk ---- */

/* The names in dir (without "." and ".."), sorted and joined by single
 * spaces into buf; returns how many there are, -1 if dir cannot be read. */
int tt_list_dir(const char *dir, char *buf, size_t size);
/* A whole file (caller frees), its size in *size; NULL if unreadable. */
unsigned char *tt_read_file(const char *path, size_t *size);
/* Creates or truncates path with these bytes; 0 on success. */
int tt_write_file(const char *path, const void *bytes, size_t size);
/* Removes path and everything under it (`rm -rf`). */
void tt_remove_tree(const char *path);

#endif
