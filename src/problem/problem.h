/*
 * plan.h — a validated SDPA problem, ready for a kernel.
 *
 * attn_sdpa() and attn_mha_forward() both reduce to a plan: a batch of
 * independent attention problems, each (L x E) queries against (S x E) keys
 * and (S x Ev) values, with every operand located by per-batch-dimension
 * strides. Kernels see only plans, never the public argument structs.
 */
#ifndef ATTN_SDPA_PLAN_H
#define ATTN_SDPA_PLAN_H

#include "../core/internal.h"

/* A 2-D operand repeated over the batch dimensions.
 * Element (batch index b = (b_0, ..., b_{nb-1}), row r, column c) lives at
 *   data + sum_d (b_d / bdiv[d]) * bstride[d] + r * rs + c * cs
 * (elements, not bytes). bstride is 0 along broadcast dimensions; bdiv is the
 * GQA group size along the head dimension of k and v, else 1. */
typedef struct attn__operand {
    void *data;
    int64_t bstride[ATTN_MAX_RANK];
    int64_t bdiv[ATTN_MAX_RANK];
    int64_t rs, cs;
} attn__operand;

/* A mask over (B..., L, S). Bool masks keep a key where the byte equals
 * `bool_keep` after normalising to 0/1 (1 for attn_sdpa, 0 for torch MHA's
 * "true = masked out"); float masks are added and -inf removes the key. */
typedef struct attn__mask {
    attn__operand op;
    attn_dtype dtype;
    int bool_keep;
} attn__mask;

enum { ATTN__MAX_MASKS = 2 };

typedef struct attn__problem {
    attn_dtype dtype;               /* of q, k, v, out, weights, lse       */
    int nb;                         /* number of batch dimensions          */
    int64_t bshape[ATTN_MAX_RANK];  /* their (broadcast) sizes             */
    int64_t nbatch;                 /* product of bshape                   */
    int64_t L, S, E, Ev;
    attn__operand q, k, v;          /* q: L x E, k: S x E, v: S x Ev       */
    attn__operand out;              /* L x Ev                              */
    attn__operand weights;          /* L x S, when has_weights             */
    attn__operand lse;              /* L x 1 (rs only), when has_lse       */
    bool has_weights, has_lse;
    int nmask;
    attn__mask mask[ATTN__MAX_MASKS];
    double scale;
    bool causal;                    /* key j visible iff j <= i + shift    */
    int64_t causal_shift;           /* 0 top-left, S - L bottom-right      */
    bool dropout;
    double dropout_p;
    uint64_t keep_threshold;        /* see attn__dropout_threshold         */
    uint64_t seed, rng_offset;
    const volatile int *cancel;     /* the caller's cancel flag, or NULL   */
} attn__problem;

/* Builds and validates a plan from attn_sdpa's public arguments. */
attn_status attn__problem_from_sdpa(attn__problem *plan, const attn_tensor *q,
                                  const attn_tensor *k, const attn_tensor *v,
                                  const attn_sdpa_params *params, attn_tensor *out,
                                  attn_tensor *weights, attn_tensor *lse);


/* Element offset of operand `op` for batch index `b` (linear, row-major over
 * plan->bshape). */
static inline int64_t attn__batch_offset(const attn__problem *plan, const attn__operand *op,
                                         int64_t b) {
    int64_t off = 0;
    for (int d = plan->nb - 1; d >= 0; d--) {
        int64_t idx = b % plan->bshape[d];
        b /= plan->bshape[d];
        off += (idx / op->bdiv[d]) * op->bstride[d];
    }
    return off;
}

/* Whether query row i may see key j under the causal rule. */
static inline bool attn__causal_visible(const attn__problem *plan, int64_t i, int64_t j) {
    return !plan->causal || j <= i + plan->causal_shift;
}



/* The general form of a plan request, for callers inside the library (MHA
 * passes a key-padding mask as a second mask). attn_sdpa fills one mask. */
typedef struct attn__problem_request {
    const attn_tensor *q, *k, *v;
    int nmask;
    const attn_tensor *mask[ATTN__MAX_MASKS];
    const char *mask_name[ATTN__MAX_MASKS];
    int mask_bool_keep[ATTN__MAX_MASKS];
    attn_causal causal;
    int has_scale;
    double scale;
    int enable_gqa;
    double dropout_p;
    uint64_t seed, rng_offset;
    attn_tensor *out, *weights, *lse; /* out may be NULL to only infer shapes */
} attn__problem_request;

attn_status attn__problem_build(attn__problem *plan, const attn__problem_request *req);
#endif /* ATTN_SDPA_PLAN_H */
