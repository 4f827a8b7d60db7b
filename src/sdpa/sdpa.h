/*
 * sdpa.h — running a validated problem (src/problem) on a kernel path.
 */
#ifndef ATTN_SDPA_SDPA_H
#define ATTN_SDPA_SDPA_H

#include "../problem/problem.h"

/* Runs a problem on the current kernel path (attn_get_isa()). */
attn_status attn__sdpa_execute(const attn__problem *p);

/* The float64-accumulating reference kernel: the oracle. */
attn_status attn__sdpa_reference(const attn__problem *p);
/* One query row of it (out, weights and lse of row i of batch b); `s` and
 * `visible` have room for S entries. The fused kernels hand it the rows
 * whose fused result is not finite, so NaN/Inf rules hold on every path. */
void attn__sdpa_reference_row(const attn__problem *p, int64_t b, int64_t i, double *s,
                              bool *visible);

#endif /* ATTN_SDPA_SDPA_H */
