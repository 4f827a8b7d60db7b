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
    case ATTN__DOUT: return "dout";
    case ATTN__DQ: return "dq";
    case ATTN__DK: return "dk";
    case ATTN__DV: return "dv";
    case ATTN__DMASK: return "dmask";
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
    /* paged rows stay where they are: attn__row_offset adds k_pos0 */
    if (whole->k.pages == NULL)
        slice->k.data = (char *)whole->k.data + (ptrdiff_t)(j0 * whole->k.rs) * (ptrdiff_t)k_size;
    if (whole->v.pages == NULL)
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

bool attn__operand_shared(const attn__problem *p, const attn__operand *op) {
    for (int d = 0; d < p->nb; d++)
        if (p->bshape[d] > 1 && (attn__dim_broadcast(op, d) || op->bdiv[d] > 1)) return true;
    return false;
}

/* The smallest batch index whose gradient elements in `op` are b's. */
static int64_t representative(const attn__problem *p, const attn__operand *op, int64_t b) {
    int64_t rep = 0, mult = 1;
    for (int d = p->nb - 1; d >= 0; d--) {
        const int64_t idx = b % p->bshape[d];
        b /= p->bshape[d];
        const int64_t canon = attn__dim_broadcast(op, d) ? 0 : idx / op->bdiv[d] * op->bdiv[d];
        rep += canon * mult;
        mult *= p->bshape[d];
    }
    return rep;
}

void attn__held_row_starts(const attn__problem *p, bool keys, int64_t *first) {
    first[0] = 0;
    for (int64_t b = 0; b < p->nbatch; b++)
        first[b + 1] = first[b] + attn__held(p, b, keys);
}

void attn__grad_fold(const attn__problem *p, const attn__operand *op, double *partial,
                     bool keys, int64_t width, const int64_t *first) {
    const int64_t rows = keys ? p->S : p->L;
#define START(b) (first != NULL ? first[b] * width : (b) * rows * width)
    for (int64_t b = 0; b < p->nbatch; b++) { /* batch indices onto their representative */
        const int64_t rep = representative(p, op, b);
        if (rep == b) continue;
        double *dst = partial + START(rep); /* (ragged: one sequence's, as many rows) */
        const double *src = partial + START(b);
        for (int64_t x = 0; x < attn__held(p, b, keys) * width; x++) dst[x] += src[x];
    }
    for (int64_t b = 0; b < p->nbatch; b++) {
        if (representative(p, op, b) != b) continue;
        double *m = partial + START(b);
        const int64_t held = attn__held(p, b, keys);
        if (op->rs == 0 || op->cs == 0) /* rows or columns onto the first */
            for (int64_t r = 0; r < held; r++)
                for (int64_t c = 0; c < width; c++) {
                    const int64_t rr = op->rs == 0 ? 0 : r, cc = op->cs == 0 ? 0 : c;
                    if (rr != r || cc != c) m[rr * width + cc] += m[r * width + c];
                }
        const int64_t off = attn__batch_offset(p, op, b);
        /* a ragged entry with no rows stores none: its start row may be
         * another's when the row stride is 0 (a packed tensor of one row) */
        const int64_t nr = op->rs == 0 && held > 0 ? 1 : held, nc = op->cs == 0 ? 1 : width;
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < nc; c++)
                attn__store(op->data, op->dtype, off + r * op->rs + c * op->cs, m[r * width + c]);
    }
#undef START
}
