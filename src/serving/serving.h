/*
 * serving.h — what attn_sdpa_varlen (varlen.c) and attn_sdpa_kvcache
 * (kvcache.c) share: reading attn_sdpa_params for a serving call, int32
 * index tensors, and the overlap rule for what a call writes.
 *
 * Both entry points describe their work as one attn__problem with batch
 * dimensions (B sequences, Hq heads) and run it with attn__sdpa_execute:
 * ragged rows (seq_start / seq_len) for packed sequences and filled caches,
 * paged rows for a block table. Validation happens here, before any write,
 * and every failure names its argument (attn_last_error_arg()).
 */
#ifndef ATTN_SERVING_SERVING_H
#define ATTN_SERVING_SERVING_H

#include "../problem/problem.h"

/* The caller's params (NULL: the defaults) read into *params, refusing the
 * fields a serving call has no use for: attn_mask, the slice fields
 * (q_offset, k_offset, q_total, k_total), and lse_for_backward unless the
 * call has a backward pass (`has_backward`: attn_sdpa_varlen and its
 * backward). `call` names the entry point in messages. */
attn_status attn__serving_params(attn_sdpa_params *params, const attn_sdpa_params *user,
                                 const char *call, bool has_backward);

/* What messages call operand `role` (q, k, v, out, lse): params->arg_names
 * when it renames it, else its C name. */
const char *attn__serving_name(const attn_sdpa_params *params, attn__role_id role);

/* Fills p's scalars from params: causal alignment, scale (needs p->E),
 * dropout, and the score modifiers (window, ALiBi, softcap, sinks; needs
 * p's batch shape), plus the caller's cancel flag. */
attn_status attn__serving_scalars(attn__problem *p, const attn_sdpa_params *params);

/* An int32 index tensor of exactly `rank` dims and `shape` (NULL: any);
 * `expected` says in messages what the shape should be. */
attn_status attn__check_index(const attn_tensor *t, const char *name, int rank,
                              const int64_t *shape, const char *expected);

/* Stride d of a checked view for the problem: 0 on a dimension of size 1,
 * whose stride is any number (attn.h) and must not scale a sequence's start
 * row: an empty sequence at the end of a packed tensor of one row starts
 * at row 1. */
static inline int64_t attn__stride(const attn_tensor *t, int d) {
    return t->shape[d] == 1 ? 0 : t->strides[d];
}

/* Element i (rank 1) or (i, j) (rank 2) of a checked int32 index tensor. */
static inline int64_t attn__index1(const attn_tensor *t, int64_t i) {
    return ((const int32_t *)t->data)[i * t->strides[0]];
}
static inline int64_t attn__index2(const attn_tensor *t, int64_t i, int64_t j) {
    return ((const int32_t *)t->data)[i * t->strides[0] + j * t->strides[1]];
}

/* A view and its name in messages; t may be NULL (absent). */
typedef struct attn__named_view {
    const attn_tensor *t;
    const char *name;
} attn__named_view;

/* The views a call writes must not map two elements to one address, and
 * must overlap neither each other nor any view it reads: the kernels write
 * while they read. */
attn_status attn__serving_overlaps(const attn__named_view *writes, int nwrites,
                                   const attn__named_view *reads, int nreads);

/* The problem's sizes must stay addressable: nbatch x L x S (the dropout
 * index and the weights' linear index) and nbatch x L x Ev. */
attn_status attn__serving_sizes(attn__problem *p, const char *qname);

#endif /* ATTN_SERVING_SERVING_H */
