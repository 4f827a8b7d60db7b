/* problem.c — operands by role, and slices of a problem. */
#include <string.h>

#include "problem.h"

attn__operand *attn__problem_operand(attn__problem *p, attn__role_id role) {
    switch (role) {
    case ATTN__Q: return &p->q;
    case ATTN__K: return &p->k;
    case ATTN__V: return &p->v;
    case ATTN__OUT: return &p->out;
    case ATTN__LSE: return &p->lse;
    case ATTN__WEIGHTS: return &p->weights;
    case ATTN__NUM_ROLES: break;
    }
    return NULL;
}

const char *attn__role_name(attn__role_id role) {
    switch (role) {
    case ATTN__Q: return "q";
    case ATTN__K: return "k";
    case ATTN__V: return "v";
    case ATTN__OUT: return "out";
    case ATTN__LSE: return "lse";
    case ATTN__WEIGHTS: return "weights";
    case ATTN__NUM_ROLES: break;
    }
    return "?";
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
