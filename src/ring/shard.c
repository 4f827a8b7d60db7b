/* shard.c — which positions a rank holds, and copies between strided views
 * (the shard helpers, and packing a shard for the ring's messages). */
#include <string.h>

#include "ring_internal.h"

void ring_runs_of(attn_ring_layout layout, int64_t total, int nranks, int rank,
                  const int64_t *lens, ring_runs *out) {
    memset(out, 0, sizeof *out);
    if (layout == ATTN_RING_CONTIGUOUS) {
        int64_t start = 0;
        for (int r = 0; r < rank; r++) start += lens != NULL ? lens[r] : 0;
        if (lens == NULL) start = total * rank / nranks;
        out->n = 1;
        out->start[0] = start;
        out->len[0] = lens != NULL ? lens[rank] : total * (rank + 1) / nranks - start;
        return;
    }
    /* zigzag: chunks rank and 2N - 1 - rank of 2N */
    const int64_t chunks = 2 * (int64_t)nranks, c[2] = {rank, chunks - 1 - rank};
    for (int i = 0; i < 2; i++) {
        out->start[i] = total * c[i] / chunks;
        out->len[i] = total * (c[i] + 1) / chunks - out->start[i];
    }
    out->n = 2;
    out->row[1] = out->len[0];
    if (out->start[0] + out->len[0] == out->start[1]) { /* one rank: one run */
        out->len[0] += out->len[1];
        out->n = 1;
    }
}

attn_status attn_ring_shard_runs(attn_ring_layout layout, int64_t total, int nranks, int rank,
                                 int *nruns, int64_t start[2], int64_t len[2]) {
    attn_clear_error();
    if (nruns == NULL || start == NULL || len == NULL)
        return attn_set_error(ATTN_ERR_NULL, nruns == NULL ? "nruns" : start == NULL ? "start" : "len",
                              "attn_ring_shard_runs: an output pointer is NULL");
    if (layout != ATTN_RING_ZIGZAG && layout != ATTN_RING_CONTIGUOUS)
        return attn_set_error(ATTN_ERR_INVALID, "layout",
                              "layout is %d; expected ATTN_RING_ZIGZAG or ATTN_RING_CONTIGUOUS",
                              (int)layout);
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return attn_set_error(ATTN_ERR_INVALID, nranks < 1 ? "nranks" : "rank",
                              "rank %d of %d: expected 0 <= rank < nranks", rank, nranks);
    const int64_t per = layout == ATTN_RING_ZIGZAG ? 2 : 1;
    if (total < per * nranks)
        return attn_set_error(ATTN_ERR_INVALID, "total",
                              "a sequence of %lld positions cannot give each of %d ranks %s "
                              "(the %s layout needs at least %lld)",
                              (long long)total, nranks, per == 2 ? "two chunks" : "a position",
                              per == 2 ? "zigzag" : "contiguous", (long long)(per * nranks));
    ring_runs runs;
    ring_runs_of(layout, total, nranks, rank, NULL, &runs);
    *nruns = runs.n;
    for (int i = 0; i < 2; i++) {
        start[i] = i < runs.n ? runs.start[i] : 0;
        len[i] = i < runs.n ? runs.len[i] : 0;
    }
    return ATTN_OK;
}

/* ---- strided copies ---- */

attn_tensor ring_rows(const attn_tensor *t, int dim, int64_t r0, int64_t n) {
    attn_tensor v = *t;
    v.data = (char *)t->data +
             (ptrdiff_t)(r0 * t->strides[dim]) * (ptrdiff_t)attn_dtype_size(t->dtype);
    v.shape[dim] = n;
    return v;
}

attn_tensor ring_dense_like(const attn_tensor *t, void *data, attn_dtype dtype) {
    attn_tensor v;
    attn_tensor_init(&v, data, dtype, t->rank, t->shape); /* t is valid: cannot fail */
    return v;
}

size_t ring_bytes(const attn_tensor *t, attn_dtype dtype) {
    size_t n = attn_dtype_size(dtype);
    for (int d = 0; d < t->rank; d++) n *= (size_t)t->shape[d];
    return n;
}

static double load(const void *p, attn_dtype dt) {
    return dt == ATTN_DTYPE_F32 ? (double)*(const float *)p : *(const double *)p;
}

/* Element offsets in a and b (one shape) of the first element of row `row`
 * (rows: every index but the last dimension's, in C order). */
static void row_start(const attn_tensor *a, const attn_tensor *b, int64_t row, int64_t *ao,
                      int64_t *bo) {
    *ao = *bo = 0;
    for (int d = a->rank - 2; d >= 0; d--) {
        *ao += row % a->shape[d] * a->strides[d];
        *bo += row % a->shape[d] * b->strides[d];
        row /= a->shape[d];
    }
}

/* dst = src (one dtype), or dst += src (dst float64), row by row. */
static void copy_rows(const attn_tensor *src, const attn_tensor *dst, bool add) {
    const size_t ss = attn_dtype_size(src->dtype), ds = attn_dtype_size(dst->dtype);
    int64_t n = 1;
    for (int d = 0; d < src->rank; d++) n *= src->shape[d];
    const int last = src->rank - 1;
    const int64_t width = src->shape[last], scs = src->strides[last], dcs = dst->strides[last];
    for (int64_t row = 0; row < n / width; row++) {
        int64_t so, dof;
        row_start(src, dst, row, &so, &dof);
        const char *s = (const char *)src->data + (ptrdiff_t)so * (ptrdiff_t)ss;
        char *t = (char *)dst->data + (ptrdiff_t)dof * (ptrdiff_t)ds;
        if (!add && scs == 1 && dcs == 1) {
            memcpy(t, s, (size_t)width * ss);
            continue;
        }
        for (int64_t e = 0; e < width; e++) {
            const char *se = s + (ptrdiff_t)(e * scs) * (ptrdiff_t)ss;
            char *te = t + (ptrdiff_t)(e * dcs) * (ptrdiff_t)ds;
            if (add) *(double *)te += load(se, src->dtype);
            else memcpy(te, se, ss);
        }
    }
}

void ring_copy(const attn_tensor *src, const attn_tensor *dst) {
    if (src->dtype == dst->dtype) {
        copy_rows(src, dst, false);
        return;
    }
    attn_tensor d = *dst; /* rounded once (or widened exactly) by the library */
    attn_tensor_convert(src, &d);
}

void ring_add(const attn_tensor *src, const attn_tensor *dst) { copy_rows(src, dst, true); }

/* ---- attn_ring_shard / attn_ring_unshard ---- */

/* Checks whole and shard against each other; the runs of `rank`. */
static attn_status check_shard(const attn_tensor *whole, const attn_tensor *shard, int *dim,
                               attn_ring_layout layout, int nranks, int rank, ring_runs *runs) {
    if (whole == NULL || shard == NULL || whole->data == NULL || shard->data == NULL)
        return attn_set_error(ATTN_ERR_NULL, whole == NULL || whole->data == NULL ? "whole" : "shard",
                              "attn_ring_shard: %s is NULL",
                              whole == NULL || whole->data == NULL ? "whole" : "shard");
    if (whole->rank < 1 || whole->rank > ATTN_MAX_RANK || shard->rank != whole->rank)
        return attn_set_error(ATTN_ERR_SHAPE, "shard", "whole has rank %d, shard %d: they must agree",
                              whole->rank, shard->rank);
    if (attn_dtype_size(whole->dtype) == 0 || shard->dtype != whole->dtype)
        return attn_set_error(ATTN_ERR_DTYPE, "shard", "whole is %s, shard %s: they must agree",
                              attn_dtype_name(whole->dtype), attn_dtype_name(shard->dtype));
    const int d = *dim < 0 ? *dim + whole->rank : *dim;
    if (d < 0 || d >= whole->rank)
        return attn_set_error(ATTN_ERR_INVALID, "dim", "dim %d is out of range for rank %d", *dim,
                              whole->rank);
    *dim = d;
    int nruns;
    int64_t start[2], len[2];
    attn_status st = attn_ring_shard_runs(layout, whole->shape[d], nranks, rank, &nruns, start, len);
    if (st != ATTN_OK) return st;
    ring_runs_of(layout, whole->shape[d], nranks, rank, NULL, runs);
    for (int e = 0; e < whole->rank; e++) {
        const int64_t want = e == d ? runs->len[0] + (runs->n > 1 ? runs->len[1] : 0) : whole->shape[e];
        if (shard->shape[e] != want)
            return attn_set_error(ATTN_ERR_SHAPE, "shard",
                                  "shard.shape[%d] is %lld; rank %d of %d holds %lld there",
                                  e, (long long)shard->shape[e], rank, nranks, (long long)want);
    }
    return ATTN_OK;
}

static attn_status shard_copy(const attn_tensor *whole, const attn_tensor *shard, int dim,
                              attn_ring_layout layout, int nranks, int rank, bool to_shard) {
    attn_clear_error();
    ring_runs runs;
    attn_status st = check_shard(whole, shard, &dim, layout, nranks, rank, &runs);
    if (st != ATTN_OK) return st;
    for (int i = 0; i < runs.n; i++) {
        const attn_tensor w = ring_rows(whole, dim, runs.start[i], runs.len[i]);
        const attn_tensor s = ring_rows(shard, dim, runs.row[i], runs.len[i]);
        ring_copy(to_shard ? &w : &s, to_shard ? &s : &w);
    }
    return ATTN_OK;
}

attn_status attn_ring_shard(const attn_tensor *whole, int dim, attn_ring_layout layout, int nranks,
                            int rank, attn_tensor *shard) {
    return shard_copy(whole, shard, dim, layout, nranks, rank, true);
}

attn_status attn_ring_unshard(const attn_tensor *shard, int dim, attn_ring_layout layout,
                              int nranks, int rank, attn_tensor *whole) {
    return shard_copy(whole, shard, dim, layout, nranks, rank, false);
}

