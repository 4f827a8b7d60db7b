/* problem.c — operands by role, and slices of a problem. */
#include <string.h>

#include "problem.h"

const char *attn__role_name(attn__role_id role) {
    switch (role) {
    case ATTN__Q: return "q";
    case ATTN__K: return "k";
    case ATTN__V: return "v";
    case ATTN__OUT: return "out";
    case ATTN__WEIGHTS: return "weights";
    case ATTN__LSE: return "lse";
    case ATTN__NUM_ROLES: break;
    }
    return "?";
}

void attn__operand_dense(const attn__problem *p, attn__operand *op, void *data, attn_dtype dtype,
                         int64_t width) {
    memset(op, 0, sizeof *op);
    op->data = data;
    op->dtype = dtype;
    op->rs = width;
    op->cs = 1;
    int64_t span = p->L * width; /* row-major over (B..., L, width) */
    for (int d = p->nb - 1; d >= 0; d--) {
        op->bstride[d] = span;
        op->bdiv[d] = 1;
        span *= p->bshape[d];
    }
}

void attn__problem_key_slice(const attn__problem *whole, int64_t j0, int64_t nk,
                             attn__problem *slice) {
    *slice = *whole;
    const size_t k_size = attn_dtype_size(whole->k.dtype), v_size = attn_dtype_size(whole->v.dtype);
    slice->k.data = (char *)whole->k.data + (ptrdiff_t)(j0 * whole->k.rs) * (ptrdiff_t)k_size;
    slice->v.data = (char *)whole->v.data + (ptrdiff_t)(j0 * whole->v.rs) * (ptrdiff_t)v_size;
    for (int m = 0; m < whole->nmask; m++) {
        attn__operand *op = &slice->mask[m].op;
        op->data = (char *)op->data +
                   (ptrdiff_t)(j0 * op->cs) * (ptrdiff_t)attn_dtype_size(op->dtype);
    }
    if (whole->has_weights) {
        attn__operand *op = &slice->weights;
        op->data = (char *)op->data +
                   (ptrdiff_t)(j0 * op->cs) * (ptrdiff_t)attn_dtype_size(op->dtype);
    }
    slice->S = nk;
    slice->k_pos0 = whole->k_pos0 + j0;
}
