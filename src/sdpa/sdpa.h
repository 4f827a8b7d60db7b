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

/* Scores of the keys row i of batch b sees, in float64 (see reference.c);
 * dcap (NULL, or room for S) takes the soft-cap's derivative per key;
 * q_i (NULL, or the row's E values already read) saves reading them per key. */
double attn__reference_scores(const attn__problem *p, int64_t b, int64_t i, double *s,
                              bool *visible, double *dcap, const double *q_i);

/* ---- the backward pass ---- */

/* Runs a backward problem on the current kernel path. */
attn_status attn__sdpa_backward_execute(const attn__problem *p);
/* The float64 reference backward: the oracle (reference_backward.c). */
attn_status attn__sdpa_backward_reference(const attn__problem *p);
/* dmask alone, in float64 (every path computes it this way). */
attn_status attn__sdpa_backward_dmask(const attn__problem *p);

#endif /* ATTN_SDPA_SDPA_H */
