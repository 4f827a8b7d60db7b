/*
 * lse_merge.h — attention over disjoint key sets, combined exactly.
 *
 * A row's attention over keys K = K_1 ∪ ... ∪ K_n is the mix of its
 * attention over each part: with out_c normalised over K_c and lse_c its
 * log-sum-exp,
 *   lse = log sum_c exp(lse_c),   out = sum_c exp(lse_c - lse) · out_c,
 * computed as m + log sum_c exp(lse_c - m) and exp(lse_c - m) / sum with m
 * the largest lse_c, which stays exact when |lse| is too large for
 * lse - m - log(sum) to carry the log (masks of -3.4e38).
 * The split decode path merges its key chunks with it today; a ring step or
 * a cache extended by new keys merges the same way. Parts are visited in
 * the order given, so the result does not depend on who computed them.
 */
#ifndef ATTN_PROBLEM_LSE_MERGE_H
#define ATTN_PROBLEM_LSE_MERGE_H

#include "problem.h"

/* Merges n parts of one row: part c's output is out_parts[c * part_stride +
 * e] (e < Ev), its lse lse_parts[c * lse_stride] (natural log, -inf for a
 * part that saw no key). Writes the row at element out_at of `out` (any
 * float dtype: the float64 sum rounded once to it) and *lse; returns false
 * when lse is NaN or a sum is not finite (lse = -inf, no key, is fine).
 * Rules, those of the reference kernel: a part whose lse is -inf, or whose
 * weight exp(lse_c - lse) is exactly 0, contributes nothing (not even a NaN
 * or Inf output); no part with a key gives out = 0, lse = -inf; a NaN lse
 * gives NaN everywhere. Sums are in float64, rounded once. */
bool attn__lse_merge_f(int64_t n, const float *out_parts, int64_t part_stride,
                       const double *lse_parts, int64_t lse_stride, int64_t Ev,
                       const attn__operand *out, int64_t out_at, double *lse);
bool attn__lse_merge_d(int64_t n, const double *out_parts, int64_t part_stride,
                       const double *lse_parts, int64_t lse_stride, int64_t Ev,
                       const attn__operand *out, int64_t out_at, double *lse);

#endif /* ATTN_PROBLEM_LSE_MERGE_H */
