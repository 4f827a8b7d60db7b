/* tensor.c — strided views: construction, permutation and validation. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

size_t attn_dtype_size(attn_dtype dtype) {
    switch (dtype) {
    case ATTN_DTYPE_F32: return 4;
    case ATTN_DTYPE_F64: return 8;
    case ATTN_DTYPE_BOOL: return 1;
    case ATTN_DTYPE_F16:
    case ATTN_DTYPE_BF16: return 2;
    case ATTN_DTYPE_I32: return 4;
    }
    return 0;
}

const char *attn_dtype_name(attn_dtype dtype) {
    switch (dtype) {
    case ATTN_DTYPE_F32: return "float32";
    case ATTN_DTYPE_F64: return "float64";
    case ATTN_DTYPE_BOOL: return "bool";
    case ATTN_DTYPE_F16: return "float16";
    case ATTN_DTYPE_BF16: return "bfloat16";
    case ATTN_DTYPE_I32: return "int32";
    }
    return "unknown";
}

const char *attn__shape_str(char *buf, size_t size, int rank, const int64_t *shape) {
    size_t used = 0;
    buf[0] = '\0';
    used += (size_t)snprintf(buf, size, "(");
    for (int d = 0; d < rank && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld",
                                 (long long)shape[d]);
    if (used < size) snprintf(buf + used, size - used, rank == 1 ? ",)" : ")");
    return buf;
}

attn_status attn_tensor_init(attn_tensor *t, void *data, attn_dtype dtype, int rank,
                             const int64_t *shape) {
    attn__clear_error();
    if (t == NULL) return attn__fail_arg(ATTN_ERR_NULL, "t", "attn_tensor_init: t is NULL");
    if (shape == NULL && rank > 0)
        return attn__fail_arg(ATTN_ERR_NULL, "shape", "attn_tensor_init: shape is NULL");
    if (rank < 1 || rank > ATTN_MAX_RANK)
        return attn__fail_arg(ATTN_ERR_SHAPE, "rank", "attn_tensor_init: rank %d is outside 1..%d", rank,
                          ATTN_MAX_RANK);
    memset(t, 0, sizeof *t);
    t->data = data;
    t->dtype = dtype;
    t->rank = rank;
    int64_t stride = 1;
    for (int d = rank - 1; d >= 0; d--) {
        if (shape[d] < 1)
            return attn__fail_arg(ATTN_ERR_SHAPE, "shape", "attn_tensor_init: shape[%d] is %lld; it must be >= 1",
                              d, (long long)shape[d]);
        t->shape[d] = shape[d];
        t->strides[d] = stride;
        if (attn__mul_overflows(stride, shape[d], &stride))
            return attn__fail_arg(ATTN_ERR_OVERFLOW, "shape",
                              "attn_tensor_init: the element count overflows 64 bits");
    }
    return ATTN_OK;
}

static int normalize_dim(int dim, int rank) { return dim < 0 ? dim + rank : dim; }

attn_status attn_tensor_permute(attn_tensor *t, const int *perm) {
    attn__clear_error();
    if (t == NULL || perm == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, t ? "perm" : "t", "attn_tensor_permute: %s is NULL",
                              t ? "perm" : "t");
    if (t->rank < 1 || t->rank > ATTN_MAX_RANK)
        return attn__fail_arg(ATTN_ERR_SHAPE, "t", "attn_tensor_permute: rank %d is outside 1..%d",
                          t->rank, ATTN_MAX_RANK);
    bool seen[ATTN_MAX_RANK] = {false};
    int64_t shape[ATTN_MAX_RANK], strides[ATTN_MAX_RANK];
    for (int i = 0; i < t->rank; i++) {
        int d = normalize_dim(perm[i], t->rank);
        if (d < 0 || d >= t->rank || seen[d])
            return attn__fail_arg(ATTN_ERR_INVALID, "perm",
                              "attn_tensor_permute: perm is not a permutation of 0..%d "
                              "(entry %d is %d)",
                              t->rank - 1, i, perm[i]);
        seen[d] = true;
        shape[i] = t->shape[d];
        strides[i] = t->strides[d];
    }
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)t->rank);
    memcpy(t->strides, strides, sizeof(int64_t) * (size_t)t->rank);
    return ATTN_OK;
}

attn_status attn_tensor_transpose(attn_tensor *t, int dim0, int dim1) {
    attn__clear_error();
    if (t == NULL) return attn__fail_arg(ATTN_ERR_NULL, "t", "attn_tensor_transpose: t is NULL");
    if (t->rank < 1 || t->rank > ATTN_MAX_RANK)
        return attn__fail_arg(ATTN_ERR_SHAPE, "t", "attn_tensor_transpose: rank %d is outside 1..%d",
                          t->rank, ATTN_MAX_RANK);
    int a = normalize_dim(dim0, t->rank), b = normalize_dim(dim1, t->rank);
    if (a < 0 || a >= t->rank || b < 0 || b >= t->rank)
        return attn__fail_arg(ATTN_ERR_INVALID, "dim0",
                          "attn_tensor_transpose: dims (%d, %d) out of range for rank %d", dim0,
                          dim1, t->rank);
    int64_t s = t->shape[a], st = t->strides[a];
    t->shape[a] = t->shape[b];
    t->strides[a] = t->strides[b];
    t->shape[b] = s;
    t->strides[b] = st;
    return ATTN_OK;
}

int64_t attn_tensor_numel(const attn_tensor *t) {
    if (t == NULL || t->rank < 1 || t->rank > ATTN_MAX_RANK) return -1;
    int64_t n = 1;
    for (int d = 0; d < t->rank; d++)
        if (t->shape[d] < 1 || attn__mul_overflows(n, t->shape[d], &n)) return -1;
    return n;
}

/* Whether a view maps two elements to one address. Sufficient test (as
 * PyTorch's internal-overlap check): with the dimensions of size > 1 sorted
 * by |stride|, each |stride| must exceed the reach of all smaller ones. A
 * view that interleaves in some exotic way and fails it is refused too. */
static bool self_overlapping(const attn_tensor *t) {
    int64_t size[ATTN_MAX_RANK], stride[ATTN_MAX_RANK];
    int n = 0;
    for (int d = 0; d < t->rank; d++) {
        if (t->shape[d] == 1) continue;
        int64_t s = t->strides[d] < 0 ? -t->strides[d] : t->strides[d];
        int at = n++; /* insertion sort by stride: at most 8 entries */
        while (at > 0 && stride[at - 1] > s) {
            stride[at] = stride[at - 1];
            size[at] = size[at - 1];
            at--;
        }
        stride[at] = s;
        size[at] = t->shape[d];
    }
    int64_t reach = 0; /* largest offset the smaller dimensions reach */
    for (int i = 0; i < n; i++) {
        if (stride[i] <= reach) return true;
        reach += stride[i] * (size[i] - 1); /* fits: checked by attn__check_tensor */
    }
    return false;
}

attn_status attn__check_tensor(const attn_tensor *t, const char *name, int min_rank,
                               attn__role role) {
    if (t == NULL) return attn__fail_arg(ATTN_ERR_NULL, name, "%s is NULL", name);
    if (t->rank < min_rank || t->rank > ATTN_MAX_RANK) {
        if (min_rank == 1)
            return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has rank %d; expected 1 to %d", name, t->rank,
                              ATTN_MAX_RANK);
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has rank %d; expected %d to %d dimensions", name,
                          t->rank, min_rank, ATTN_MAX_RANK);
    }
    size_t elem = attn_dtype_size(t->dtype);
    if (elem == 0)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s has an unknown dtype code %d", name, (int)t->dtype);
    if (t->data == NULL) return attn__fail_arg(ATTN_ERR_NULL, name, "%s->data is NULL", name);
    /* The span of addresses the view touches, |stride| * (n - 1) summed, and
     * the element count must both fit, in bytes, in 64 bits. */
    int64_t span = 0, numel = 1;
    for (int d = 0; d < t->rank; d++) {
        int64_t n = t->shape[d], s = t->strides[d], reach;
        if (n < 1)
            return attn__fail_arg(ATTN_ERR_SHAPE, name,
                              "%s.shape[%d] is %lld; every dimension must be >= 1 "
                              "(attn does not accept empty tensors)",
                              name, d, (long long)n);
        if (s == INT64_MIN || attn__mul_overflows(s < 0 ? -s : s, n - 1, &reach) ||
            attn__add_overflows(span, reach, &span) || attn__mul_overflows(numel, n, &numel))
            return attn__fail_arg(ATTN_ERR_OVERFLOW, name,
                              "%s: shape and strides address more than 2^63 elements", name);
        if (role == ATTN__OUTPUT && s == 0 && n > 1)
            return attn__fail_arg(ATTN_ERR_INVALID, name,
                              "%s.strides[%d] is 0 on a dimension of size %lld: output "
                              "elements would overlap",
                              name, d, (long long)n);
    }
    int64_t slots, bytes;
    if (attn__add_overflows(span, 1, &slots) || attn__mul_overflows(slots, (int64_t)elem, &bytes) ||
        attn__mul_overflows(numel, (int64_t)elem, &bytes))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, name, "%s: its byte count does not fit in 64 bits", name);
    return ATTN_OK;
}

attn_status attn__check_output_layout(const attn_tensor *t, const char *name) {
    if (t != NULL && self_overlapping(t))
        return attn__fail_arg(ATTN_ERR_OVERLAP, name,
                          "%s: its strides make two elements share one address (each "
                          "dimension's |stride| must exceed the reach of the dimensions with "
                          "smaller strides)",
                          name);
    return ATTN_OK;
}

/* The lowest and one-past-highest byte a checked view touches. */
static void byte_span(const attn_tensor *t, uintptr_t *lo, uintptr_t *hi) {
    int64_t below = 0, above = 0; /* element offsets reached below and above data */
    for (int d = 0; d < t->rank; d++) {
        const int64_t reach = t->strides[d] * (t->shape[d] - 1);
        if (reach < 0)
            below += reach;
        else
            above += reach;
    }
    const int64_t es = (int64_t)attn_dtype_size(t->dtype);
    *lo = (uintptr_t)t->data - (uintptr_t)(-below * es);
    *hi = (uintptr_t)t->data + (uintptr_t)((above + 1) * es);
}

int64_t attn__linear_offset(const attn_tensor *t, int nd, int64_t i) {
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; d--) {
        off += i % t->shape[d] * t->strides[d];
        i /= t->shape[d];
    }
    return off;
}

/* ---- whether two views share a byte ---- */

/* An element's byte offset is a sum of index x stride terms; the bytes of an
 * element of a and one of b meet when the difference of their offsets lies
 * in [lo, hi] (the element sizes'). Each dimension becomes a term u·w, u in
 * [0, n), w its byte stride (a negative stride flipped into the constant,
 * b's terms negated), and the question whether some choice of the u puts
 * the sum in [lo, hi] is searched largest |w| first, each term's choices
 * cut to those the smaller ones can still reach. Views laid out like
 * arrays leave one or two choices per term; OVERLAP_WORK bounds the search
 * for strides made to defeat it, past which the answer is "they may". */
enum { OVERLAP_WORK = 1 << 16 };

typedef struct overlap_term {
    int64_t w, n;        /* stride in bytes (signed), index count */
    int64_t rest_lo, rest_hi; /* the range of the terms after this one */
} overlap_term;

static bool overlap_search(const overlap_term *t, int nt, int64_t sum, int64_t lo, int64_t hi,
                           int64_t *work) {
    if (nt == 0) return lo <= sum && sum <= hi;
    if (++*work > OVERLAP_WORK) return true;
    /* u·w must land in [lo - sum - rest_hi, hi - sum - rest_lo] */
    const int64_t want_lo = lo - sum - t->rest_hi, want_hi = hi - sum - t->rest_lo;
    int64_t u0, u1; /* the u with u·w in [want_lo, want_hi], clamped to [0, n) */
    if (t->w > 0) {
        u0 = want_lo <= 0 ? 0 : (want_lo + t->w - 1) / t->w;
        u1 = want_hi < 0 ? -1 : want_hi / t->w;
    } else {
        const int64_t w = -t->w; /* u·w in [-want_hi, -want_lo] */
        u0 = -want_hi <= 0 ? 0 : (-want_hi + w - 1) / w;
        u1 = -want_lo < 0 ? -1 : -want_lo / w;
    }
    if (u1 > t->n - 1) u1 = t->n - 1;
    for (int64_t u = u0; u <= u1; u++)
        if (overlap_search(t + 1, nt - 1, sum + u * t->w, lo, hi, work)) return true;
    return false;
}

static int by_size_desc(const void *x, const void *y) {
    const int64_t a = llabs(((const overlap_term *)x)->w), b = llabs(((const overlap_term *)y)->w);
    return a < b ? 1 : a > b ? -1 : 0;
}

/* The terms of view t (sign +1 for a, -1 for b) appended to `terms`; its
 * flipped negative strides added to *c. Returns false for an empty view. */
static bool view_terms(const attn_tensor *t, int sign, overlap_term *terms, int *nt, int64_t *c) {
    const int64_t es = (int64_t)attn_dtype_size(t->dtype);
    *c += sign * (int64_t)(intptr_t)t->data;
    for (int d = 0; d < t->rank; d++) {
        if (t->shape[d] == 0) return false;
        if (t->shape[d] == 1 || t->strides[d] == 0) continue;
        int64_t w = t->strides[d] * es;
        if (w < 0) { /* index i at w is index n-1-i at -w, from (n-1)·w */
            *c += sign * (t->shape[d] - 1) * w;
            w = -w;
        }
        terms[(*nt)++] = (overlap_term){sign * w, t->shape[d], 0, 0};
    }
    return true;
}

bool attn__views_overlap(const attn_tensor *a, const attn_tensor *b) {
    if (a == NULL || b == NULL) return false;
    uintptr_t alo, ahi, blo, bhi;
    byte_span(a, &alo, &ahi);
    byte_span(b, &blo, &bhi);
    if (!(alo < bhi && blo < ahi)) return false;
    overlap_term terms[2 * ATTN_MAX_RANK];
    int nt = 0;
    int64_t c = 0; /* offset(a element) - offset(b element) = c + the terms */
    if (!view_terms(a, 1, terms, &nt, &c) || !view_terms(b, -1, terms, &nt, &c)) return false;
    qsort(terms, (size_t)nt, sizeof terms[0], by_size_desc);
    int64_t lo = 0, hi = 0;
    for (int i = nt - 1; i >= 0; i--) { /* what the terms after i can add */
        terms[i].rest_lo = lo, terms[i].rest_hi = hi;
        const int64_t reach = (terms[i].n - 1) * terms[i].w;
        if (reach < 0) lo += reach;
        else hi += reach;
    }
    /* a's element [x, x + ea) meets b's [y, y + eb) when -ea < x - y < eb */
    const int64_t ea = (int64_t)attn_dtype_size(a->dtype), eb = (int64_t)attn_dtype_size(b->dtype);
    int64_t work = 0;
    return overlap_search(terms, nt, c, 1 - ea, eb - 1, &work);
}

/* ---- conversion ---- */

attn_status attn_tensor_convert(const attn_tensor *src, attn_tensor *dst) {
    attn__clear_error();
    attn_status st = attn__check_tensor(src, "src", 1, ATTN__INPUT);
    if (st == ATTN_OK) st = attn__check_tensor(dst, "dst", 1, ATTN__OUTPUT);
    if (st != ATTN_OK) return st;
    bool same = src->rank == dst->rank;
    for (int d = 0; same && d < src->rank; d++) same = src->shape[d] == dst->shape[d];
    if (!same) {
        char a[160], b[160];
        return attn__fail_arg(ATTN_ERR_SHAPE, "dst", "dst has shape %s; src has %s",
                              attn__shape_str(a, sizeof a, dst->rank, dst->shape),
                              attn__shape_str(b, sizeof b, src->rank, src->shape));
    }
    const bool bools = src->dtype == ATTN_DTYPE_BOOL && dst->dtype == ATTN_DTYPE_BOOL;
    if (!bools && !(attn__is_floating(src->dtype) && attn__is_floating(dst->dtype)))
        return attn__fail_arg(ATTN_ERR_DTYPE, attn__is_floating(src->dtype) ? "dst" : "src",
                              "src is %s and dst %s: a float dtype converts to a float dtype, "
                              "bool to bool", attn_dtype_name(src->dtype),
                              attn_dtype_name(dst->dtype));
    if ((st = attn__check_output_layout(dst, "dst")) != ATTN_OK) return st;
    if (attn__views_overlap(src, dst))
        return attn__fail_arg(ATTN_ERR_OVERLAP, "dst", "dst overlaps src in memory");
    attn__tensor_copy(src, dst);
    return ATTN_OK;
}

void attn__tensor_copy(const attn_tensor *src, const attn_tensor *dst) {
    int64_t idx[ATTN_MAX_RANK] = {0};
    const int64_t n = attn_tensor_numel(src);
    for (int64_t i = 0; i < n; i++) {
        int64_t so = 0, dof = 0;
        for (int d = 0; d < src->rank; d++) {
            so += idx[d] * src->strides[d];
            dof += idx[d] * dst->strides[d];
        }
        attn__store(dst->data, dst->dtype, dof, attn__load(src->data, src->dtype, so));
        for (int d = src->rank - 1; d >= 0; d--) {
            if (++idx[d] < src->shape[d]) break;
            idx[d] = 0;
        }
    }
}
