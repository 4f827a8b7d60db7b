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

/* The sinks' gradient (sinks.c), shared by attn_sdpa_sinks_backward and
 * attn_sdpa_varlen_sinks_backward: a float64 sum per element of dsinks, in
 * C order, added to in (batch index, row) order and stored once. */
typedef struct attn__sinks_grad {
    attn__operand sink;        /* params.sinks over the batch shape      */
    const attn_tensor *sinks;
    double *acc;               /* dsinks' elements, dense                */
} attn__sinks_grad;

/* params (NULL: refused) read into *params; it must hold sinks. */
attn_status attn__sinks_params(attn_sdpa_params *params, const attn_sdpa_params *user);
/* Checks dsinks (params->sinks' shape and dtype, an output that overlaps
 * none of `inputs`) and the sinks against p's batch shape; allocates the
 * sums (g->acc, freed by attn__sinks_grad_end; on failure nothing is left
 * allocated). */
attn_status attn__sinks_grad_begin(const attn__problem *p, const attn_sdpa_params *params,
                                   attn_tensor *dsinks, const attn_tensor *const *inputs,
                                   int ninputs, attn__sinks_grad *g);
/* The sink batch index b reads. */
double attn__sinks_grad_sink(const attn__problem *p, const attn__sinks_grad *g, int64_t b);
/* One row's exp(sink - lse) · (dout · out), Ev features from the given
 * element offsets along each tensor's last stride; 0 when lse = -inf. */
double attn__sink_row_term(double sink, double lse, const attn_tensor *dout, int64_t dout_at,
                           const attn_tensor *out, int64_t out_at, int64_t Ev);
/* Subtracts batch index b's sum of row terms from its dsinks element. */
void attn__sinks_grad_add(const attn__problem *p, attn__sinks_grad *g, int64_t b, double sum);
/* Stores the sums into dsinks (rounded once) and frees them. */
void attn__sinks_grad_end(attn__sinks_grad *g, attn_tensor *dsinks);

/* Runs a backward problem on the current kernel path. */
attn_status attn__sdpa_backward_execute(const attn__problem *p);
/* The same for attn_sdpa_backward and attn_sdpa_varlen_backward: a 16-bit
 * out is first computed again in float32, for D (sdpa.c). */
attn_status attn__sdpa_backward_run(attn__problem *p);
/* The float64 reference backward: the oracle (reference_backward.c). */
attn_status attn__sdpa_backward_reference(const attn__problem *p);
/* dmask alone, in float64 (every path computes it this way). */
attn_status attn__sdpa_backward_dmask(const attn__problem *p);

#endif /* ATTN_SDPA_SDPA_H */
