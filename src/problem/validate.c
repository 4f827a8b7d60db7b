/* validate.c — argument validation for attention: every check, with a message
 * that names the argument, the dimension and what was expected. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "problem.h"

/* Size of batch dimension d (of nb) of tensor t, whose last two dims are
 * matrix dims; 1 where t has fewer dimensions (NumPy right-alignment). */
static int64_t batch_size(const attn_tensor *t, int nb, int d) {
    int td = d - (nb - (t->rank - 2));
    return td < 0 ? 1 : t->shape[td];
}
static int64_t batch_stride(const attn_tensor *t, int nb, int d) {
    int td = d - (nb - (t->rank - 2));
    return td < 0 || t->shape[td] == 1 ? 0 : t->strides[td];
}

/* "dim -3" style names read better than absolute indices when ranks differ. */
static int neg_dim(int nb, int d) { return d - nb - 2; }

/* What messages call argument i of q, k, v, out, weights, lse. */
#define NAME(r, role)                                                                \
    ((role) < ATTN__NAMED_ROLES && (r)->names != NULL && (r)->names[role] != NULL \
         ? (r)->names[role]                                                        \
         : attn__role_name(role))

static void fill_operand(attn__operand *op, const attn_tensor *t, int nb) {
    memset(op, 0, sizeof *op);
    op->data = t->data;
    op->dtype = t->dtype;
    for (int d = 0; d < nb; d++) {
        op->bstride[d] = batch_stride(t, nb, d);
        op->bdiv[d] = 1;
    }
    op->rs = t->strides[t->rank - 2];
    op->cs = t->strides[t->rank - 1];
}

attn_status attn__check_shape(const attn_tensor *t, const char *name, attn__role role, int rank,
                              const int64_t *shape, const char *what) {
    attn_status st = attn__check_tensor(t, name, 1, role);
    if (st != ATTN_OK) return st;
    bool same = t->rank == rank;
    for (int d = 0; same && d < rank; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char want[160], got[160];
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has shape %s; expected %s%s%s", name,
                              attn__shape_str(got, sizeof got, t->rank, t->shape),
                              attn__shape_str(want, sizeof want, rank, shape),
                              what != NULL ? " " : "", what != NULL ? what : "");
    }
    return ATTN_OK;
}

/* A tensor of one exact shape and dtype: an output, or (role ATTN__INPUT)
 * an input the backward pass reads (dout, out, lse). */
static attn_status check_exact(const attn_tensor *t, const char *name, attn__role role,
                               attn_dtype dtype, int rank, const int64_t *shape) {
    attn_status st = attn__check_shape(t, name, role, rank, shape, NULL);
    if (st != ATTN_OK) return st;
    if (t->dtype != dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; expected %s like the query", name,
                          attn_dtype_name(t->dtype), attn_dtype_name(dtype));
    return ATTN_OK;
}

static attn_status check_output(const attn_tensor *t, const char *name, attn_dtype dtype,
                                int rank, const int64_t *shape) {
    return check_exact(t, name, ATTN__OUTPUT, dtype, rank, shape);
}

/* lse: the compute dtype (q's, float32 for 16-bit queries), or float64 for
 * any call (a float32 call's lse then keeps the digits float32 would round
 * off, which the backward's recomputed weights would inherit). */
attn_status attn__check_lse_dtype(const attn_tensor *lse, const char *name, attn_dtype compute) {
    if (lse->dtype == compute || lse->dtype == ATTN_DTYPE_F64) return ATTN_OK;
    if (compute == ATTN_DTYPE_F64)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; expected float64 (the computation's)",
                              name, attn_dtype_name(lse->dtype));
    return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; expected %s (the computation's), or float64",
                          name, attn_dtype_name(lse->dtype), attn_dtype_name(compute));
}

attn_status attn__check_qkv_dtypes(const attn_tensor *q, const char *qn, const attn_tensor *k,
                                   const char *kn, const attn_tensor *v, const char *vn,
                                   attn_dtype *compute) {
    const attn_tensor *all[3] = {q, k, v};
    const char *names[3] = {qn, kn, vn};
    for (int i = 0; i < 3; i++)
        if (!attn__is_floating(all[i]->dtype))
            return attn__fail_arg(ATTN_ERR_DTYPE, names[i],
                                  "%s is %s; expected float32, float64, float16 or bfloat16",
                                  names[i], attn_dtype_name(all[i]->dtype));
    if (v->dtype != k->dtype) { /* name the one that differs from the query */
        const bool k_odd = v->dtype == q->dtype;
        return attn__fail_arg(ATTN_ERR_DTYPE, k_odd ? kn : vn,
                              "%s is %s but %s is %s; keys and values share one dtype",
                              k_odd ? kn : vn, attn_dtype_name(k_odd ? k->dtype : v->dtype),
                              k_odd ? vn : kn, attn_dtype_name(k_odd ? v->dtype : k->dtype));
    }
    const bool kv_cache = q->dtype == ATTN_DTYPE_F32 && attn__is_half(k->dtype);
    if (q->dtype != k->dtype && !kv_cache)
        return attn__fail_arg(ATTN_ERR_DTYPE, kn,
                              "%s is %s but %s is %s; expected %s like the query (or float16/bfloat16 "
                              "keys and values under a float32 query)",
                              kn, attn_dtype_name(k->dtype), qn, attn_dtype_name(q->dtype),
                              attn_dtype_name(q->dtype));
    *compute = attn__compute_dtype(q->dtype);
    return ATTN_OK;
}

static attn_status check_mask(attn__problem *p, const attn_tensor *m, const char *name,
                              int bool_keep, attn__mask *out) {
    attn_status st = attn__check_tensor(m, name, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (m->dtype != ATTN_DTYPE_BOOL && !attn__is_floating(m->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, name,
                              "%s is %s; expected bool, float32, float64, float16 or bfloat16", name,
                              attn_dtype_name(m->dtype));
    int full = p->nb + 2;
    int64_t target[ATTN_MAX_RANK];
    memcpy(target, p->bshape, sizeof(int64_t) * (size_t)p->nb);
    target[p->nb] = p->L;
    target[p->nb + 1] = p->S;
    char want[160], got[160];
    if (m->rank > full)
        return attn__fail_arg(ATTN_ERR_SHAPE, name,
                          "%s has rank %d, more than the attention weights %s it must "
                          "broadcast to",
                          name, m->rank, attn__shape_str(want, sizeof want, full, target));
    /* Right-align the mask against (B..., L, S); size-1 dims broadcast. */
    attn__operand *op = &out->op;
    memset(op, 0, sizeof *op);
    op->data = m->data;
    op->dtype = m->dtype;
    int64_t stride_full[ATTN_MAX_RANK];
    for (int d = 0; d < full; d++) {
        int md = d - (full - m->rank);
        int64_t size = md < 0 ? 1 : m->shape[md];
        if (size != 1 && size != target[d])
            return attn__fail_arg(ATTN_ERR_SHAPE, name,
                              "%s has shape %s, which does not broadcast to the attention "
                              "weights %s (dim %d is %lld, expected 1 or %lld)",
                              name, attn__shape_str(got, sizeof got, m->rank, m->shape),
                              attn__shape_str(want, sizeof want, full, target), d - full,
                              (long long)size, (long long)target[d]);
        stride_full[d] = (md < 0 || size == 1) ? 0 : m->strides[md];
    }
    for (int d = 0; d < p->nb; d++) {
        op->bstride[d] = stride_full[d];
        op->bdiv[d] = 1;
    }
    op->rs = stride_full[p->nb];
    op->cs = stride_full[p->nb + 1];
    out->bool_keep = bool_keep ? 1 : 0;
    return ATTN_OK;
}

/* Appends r's masks and modifier tensors to ins / in_names from index n;
 * returns the new count. (The modifiers' tensors are read as the rows run:
 * an output over them would change the slopes and sinks of later rows.) */
static int masks_and_modifiers(const attn__problem_request *r, const attn_tensor **ins,
                               const char **in_names, int n) {
    for (int i = 0; i < r->nmask; i++, n++) {
        ins[n] = r->mask[i];
        in_names[n] = r->mask_name[i];
    }
    if (r->modifiers != NULL) {
        ins[n] = r->modifiers->alibi_slopes;
        in_names[n++] = "params.alibi_slopes";
        ins[n] = r->modifiers->sinks;
        in_names[n++] = "params.sinks";
    }
    return n;
}

/* Outputs must not share memory with an input or with each other: the
 * kernels write out, weights and lse while they still read q, k, v and the
 * masks. Tested on address ranges (attn__views_overlap). */
static attn_status check_overlaps(const attn__problem_request *r) {
    const attn_tensor *outs[3] = {r->out, r->weights, r->lse};
    const char *out_names[3] = {NAME(r, ATTN__OUT), NAME(r, ATTN__WEIGHTS), NAME(r, ATTN__LSE)};
    const attn_tensor *ins[5 + ATTN__MAX_MASKS] = {r->q, r->k, r->v};
    const char *in_names[5 + ATTN__MAX_MASKS] = {NAME(r, ATTN__Q), NAME(r, ATTN__K), NAME(r, ATTN__V)};
    const int nin = masks_and_modifiers(r, ins, in_names, 3);
    for (int o = 0; o < 3; o++) {
        attn_status st = attn__check_output_layout(outs[o], out_names[o]);
        if (st != ATTN_OK) return st;
        for (int i = 0; i < nin; i++)
            if (attn__views_overlap(outs[o], ins[i]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, out_names[o],
                                  "%s overlaps %s in memory: attention is not computed in place; "
                                  "give %s a buffer of its own",
                                  out_names[o], in_names[i], out_names[o]);
        for (int o2 = o + 1; o2 < 3; o2++)
            if (attn__views_overlap(outs[o], outs[o2]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, out_names[o2], "%s and %s overlap in memory",
                                  out_names[o], out_names[o2]);
    }
    return ATTN_OK;
}

/* q, k and v: views, one float dtype, and matching E and S. */
static attn_status check_inputs(attn__problem *p, const attn__problem_request *r) {
    attn_status st;
    const char *qn = NAME(r, ATTN__Q), *kn = NAME(r, ATTN__K), *vn = NAME(r, ATTN__V);
    if ((st = attn__check_tensor(r->q, qn, 2, ATTN__INPUT)) != ATTN_OK ||
        (st = attn__check_tensor(r->k, kn, 2, ATTN__INPUT)) != ATTN_OK ||
        (st = attn__check_tensor(r->v, vn, 2, ATTN__INPUT)) != ATTN_OK)
        return st;
    const attn_tensor *q = r->q, *k = r->k, *v = r->v;
    if ((st = attn__check_qkv_dtypes(q, qn, k, kn, v, vn, &p->dtype)) != ATTN_OK) return st;
    p->L = q->shape[q->rank - 2];
    p->E = q->shape[q->rank - 1];
    p->S = k->shape[k->rank - 2];
    p->Ev = v->shape[v->rank - 1];
    if (k->shape[k->rank - 1] != p->E)
        return attn__fail_arg(ATTN_ERR_SHAPE, kn,
                              "%s.shape[-1] is %lld but %s.shape[-1] is %lld: queries and keys "
                              "must have the same feature size E",
                              kn, (long long)k->shape[k->rank - 1], qn, (long long)p->E);
    if (v->shape[v->rank - 2] != p->S)
        return attn__fail_arg(ATTN_ERR_SHAPE, vn,
                              "%s.shape[-2] is %lld but %s.shape[-2] is %lld: there must be one "
                              "value per key (S)",
                              vn, (long long)v->shape[v->rank - 2], kn, (long long)p->S);
    p->L_total = p->L; /* a whole problem: its slices set these (key_slice) */
    p->S_total = p->S;
    return ATTN_OK;
}

/* Batch dimension d of q, k, v: broadcast, or grouped (GQA) on the head
 * dimension. Sets p->bshape[d] and the divisors of k and v. */
static attn_status batch_dim(attn__problem *p, const attn__problem_request *r, int d) {
    const char *qn = NAME(r, ATTN__Q), *kn = NAME(r, ATTN__K), *vn = NAME(r, ATTN__V);
    const attn_tensor *q = r->q, *k = r->k, *v = r->v;
    const int nb = p->nb;
    const int64_t sq = batch_size(q, nb, d), sk = batch_size(k, nb, d), sv = batch_size(v, nb, d);
    if (r->enable_gqa && d == nb - 1) {
        if (sq % sk != 0 || sq % sv != 0)
            return attn__fail_arg(ATTN_ERR_SHAPE, sq % sk != 0 ? kn : vn,
                                  "enable_gqa: %s has %lld heads, %s %lld and %s %lld; the "
                                  "query heads must be a multiple of the key and value heads",
                                  qn, (long long)sq, kn, (long long)sk, vn, (long long)sv);
        p->k.bdiv[d] = sq / sk;
        p->v.bdiv[d] = sq / sv;
        p->bshape[d] = sq;
        return ATTN_OK;
    }
    int64_t size = sq;
    if (sk > size) size = sk;
    if (sv > size) size = sv;
    const attn_tensor *bad = (sq != 1 && sq != size)   ? q
                             : (sk != 1 && sk != size) ? k
                             : (sv != 1 && sv != size) ? v
                                                       : NULL;
    if (bad != NULL) {
        const char *hint = "";
        if (d == nb - 1 && sq % sk == 0 && sq % sv == 0)
            hint = " (grouped-query attention: set enable_gqa)";
        return attn__fail_arg(ATTN_ERR_SHAPE, bad == q ? qn : bad == k ? kn : vn,
                              "batch dimension %d does not broadcast: %s has %lld, %s "
                              "%lld, %s %lld%s",
                              neg_dim(nb, d), qn, (long long)sq, kn, (long long)sk, vn,
                              (long long)sv, hint);
    }
    p->bshape[d] = size;
    return ATTN_OK;
}

/* The batch dimensions and the sizes they lead to. */
static attn_status batch_dims(attn__problem *p, const attn__problem_request *r) {
    const char *qn = NAME(r, ATTN__Q), *kn = NAME(r, ATTN__K), *vn = NAME(r, ATTN__V);
    const attn_tensor *q = r->q, *k = r->k, *v = r->v;
    int nb = q->rank;
    if (k->rank > nb) nb = k->rank;
    if (v->rank > nb) nb = v->rank;
    nb -= 2;
    p->nb = nb;
    fill_operand(&p->q, q, nb);
    fill_operand(&p->k, k, nb);
    fill_operand(&p->v, v, nb);
    if (r->enable_gqa && (q->rank < 3 || k->rank < 3 || v->rank < 3))
        return attn__fail_arg(ATTN_ERR_SHAPE, q->rank < 3 ? qn : k->rank < 3 ? kn : vn,
                              "enable_gqa needs a head dimension (dim -3) in %s, %s and %s; "
                              "their ranks are %d, %d and %d",
                              qn, kn, vn, q->rank, k->rank, v->rank);
    p->nbatch = 1;
    for (int d = 0; d < nb; d++) {
        attn_status st = batch_dim(p, r, d);
        if (st != ATTN_OK) return st;
        if (attn__mul_overflows(p->nbatch, p->bshape[d], &p->nbatch))
            return attn__fail_arg(ATTN_ERR_OVERFLOW, qn, "the batch size overflows 64 bits");
    }
    int64_t rows, cells, outs;
    if (attn__mul_overflows(p->nbatch, p->L, &rows) ||
        attn__mul_overflows(rows, p->S, &cells) || attn__mul_overflows(rows, p->Ev, &outs))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, qn,
                              "batch x L x S = %lld x %lld x %lld overflows 64 bits",
                              (long long)p->nbatch, (long long)p->L, (long long)p->S);
    return ATTN_OK;
}

attn_status attn__problem_scalars(attn__problem *p, attn_causal causal, int has_scale,
                                  double scale, double dropout_p, uint64_t seed,
                                  uint64_t rng_offset) {
    if (causal != ATTN_CAUSAL_NONE && causal != ATTN_CAUSAL_TOP_LEFT &&
        causal != ATTN_CAUSAL_BOTTOM_RIGHT)
        return attn__fail_arg(ATTN_ERR_INVALID, "params.causal",
                              "causal is %d; expected ATTN_CAUSAL_NONE, ATTN_CAUSAL_TOP_LEFT or "
                              "ATTN_CAUSAL_BOTTOM_RIGHT",
                              (int)causal);
    p->causal = causal;
    if (has_scale && !isfinite(scale))
        return attn__fail_arg(ATTN_ERR_INVALID, "params.scale",
                              "scale is %g; expected a finite number", scale);
    p->scale = has_scale ? scale : 1.0 / sqrt((double)p->E);
    if (!(dropout_p >= 0.0 && dropout_p <= 1.0))
        return attn__fail_arg(ATTN_ERR_INVALID, "params.dropout_p",
                              "dropout_p is %g; expected a probability in [0, 1]", dropout_p);
    p->dropout = dropout_p > 0.0;
    p->dropout_p = dropout_p;
    p->keep_threshold = attn__dropout_threshold(dropout_p);
    p->seed = seed;
    p->rng_offset = rng_offset;
    return ATTN_OK;
}

/* Causality, scale, dropout. */
static attn_status check_scalars(attn__problem *p, const attn__problem_request *r) {
    return attn__problem_scalars(p, r->causal, r->has_scale, r->scale, r->dropout_p, r->seed,
                                 r->rng_offset);
}

/* Where the problem sits in a larger one (attn_sdpa_params' slice fields):
 * offsets >= 0, totals 0 (the slice's own length) or reaching past it. */
static attn_status check_slice(attn__problem *p, const attn__problem_request *r) {
    const struct { int64_t off, total, len; const char *name, *tname, *what; } dims[2] = {
        {r->q_offset, r->q_total, p->L, "params.q_offset", "params.q_total", "query rows (L)"},
        {r->k_offset, r->k_total, p->S, "params.k_offset", "params.k_total", "keys (S)"}};
    for (int i = 0; i < 2; i++) {
        const int64_t off = dims[i].off, total = dims[i].total, len = dims[i].len;
        if (off < 0)
            return attn__fail_arg(ATTN_ERR_INVALID, dims[i].name, "%s is %lld; expected >= 0",
                                  dims[i].name, (long long)off);
        if (total < 0 || (total == 0 && off != 0) ||
            (total != 0 && (off > total || len > total - off)))
            return attn__fail_arg(ATTN_ERR_INVALID, dims[i].tname,
                                  "%s is %lld but the slice holds %s %lld..%lld: the total must "
                                  "reach past the slice (0: the slice is the whole)",
                                  dims[i].tname, (long long)total, dims[i].what, (long long)off,
                                  (long long)(off > INT64_MAX - len ? INT64_MAX : off + len));
    }
    p->q_pos0 = r->q_offset;
    p->k_pos0 = r->k_offset;
    p->L_total = r->q_total != 0 ? r->q_total : p->L;
    p->S_total = r->k_total != 0 ? r->k_total : p->S;
    int64_t cells;
    if (attn__mul_overflows(p->nbatch, p->L_total, &cells) ||
        attn__mul_overflows(cells, p->S_total, &cells))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, "params.q_total",
                              "batch x q_total x k_total overflows 64 bits (the dropout index)");
    return ATTN_OK;
}

/* ALiBi slopes or sinks: one float per query head, broadcastable to the
 * batch dimensions (right-aligned, size-1 dims stretch). */
attn_status attn__per_head_operand(const attn__problem *p, const attn_tensor *t,
                                   const char *name, attn__operand *op) {
    attn_status st = attn__check_tensor(t, name, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (!attn__is_floating(t->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, name,
                              "%s is %s; expected float32, float64, float16 or bfloat16", name,
                              attn_dtype_name(t->dtype));
    char want[160], got[160];
    const int nb = p->nb;
    if (t->rank > (nb > 0 ? nb : 1))
        return attn__fail_arg(ATTN_ERR_SHAPE, name,
                              "%s has shape %s; expected one value per query head, "
                              "broadcastable to the batch dimensions %s",
                              name, attn__shape_str(got, sizeof got, t->rank, t->shape),
                              attn__shape_str(want, sizeof want, nb, p->bshape));
    memset(op, 0, sizeof *op);
    op->data = t->data;
    op->dtype = t->dtype;
    for (int d = 0; d < nb; d++) op->bdiv[d] = 1;
    for (int td = 0; td < t->rank; td++) {
        const int d = nb - t->rank + td; /* the batch dim it aligns with; < 0 only if nb == 0 */
        const int64_t want_size = d >= 0 ? p->bshape[d] : 1;
        if (t->shape[td] != 1 && t->shape[td] != want_size)
            return attn__fail_arg(ATTN_ERR_SHAPE, name,
                                  "%s has shape %s, which does not broadcast to the batch "
                                  "dimensions %s (one value per query head)",
                                  name, attn__shape_str(got, sizeof got, t->rank, t->shape),
                                  attn__shape_str(want, sizeof want, nb, p->bshape));
        if (d >= 0) op->bstride[d] = t->shape[td] == 1 ? 0 : t->strides[td];
    }
    return ATTN_OK;
}

/* The first infinite element of t (only +inf when `plus_only`), as a flat
 * index, or -1. A sink of +inf would take the whole denominator (every
 * weight 0, lse +inf), which the kernels' exp(sink - max) turns into NaN;
 * an infinite ALiBi slope times the distance 0 is NaN too: both refused. */
static int64_t first_infinite(const attn_tensor *t, bool plus_only) {
    const int64_t n = attn_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        const double x = attn__load(t->data, t->dtype, attn__linear_offset(t, t->rank, i));
        if (isinf(x) && (x > 0 || !plus_only)) return i;
    }
    return -1;
}

attn_status attn__problem_modifiers(attn__problem *p, const attn_sdpa_params *m) {
    p->window_left = p->window_right = -1;
    p->softcap = 0;
    p->has_alibi = p->has_sinks = false;
    if (m == NULL) return ATTN_OK;
    const int64_t sides[2] = {m->window_left, m->window_right};
    const char *side_names[2] = {"params.window_left", "params.window_right"};
    for (int i = 0; i < 2; i++)
        if (sides[i] < -1)
            return attn__fail_arg(ATTN_ERR_INVALID, side_names[i],
                                  "%s is %lld; expected -1 (unbounded) or a number of keys >= 0",
                                  side_names[i], (long long)sides[i]);
    p->window_left = m->window_left;
    p->window_right = m->window_right;
    if (!(isfinite(m->softcap) && m->softcap >= 0))
        return attn__fail_arg(ATTN_ERR_INVALID, "params.softcap",
                              "softcap is %g; expected 0 (none) or a finite cap > 0", m->softcap);
    p->softcap = m->softcap;
    attn_status st;
    if (m->alibi_slopes != NULL) {
        if ((st = attn__per_head_operand(p, m->alibi_slopes, "params.alibi_slopes", &p->alibi)) != ATTN_OK)
            return st;
        const int64_t at = first_infinite(m->alibi_slopes, false);
        if (at >= 0)
            return attn__fail_arg(ATTN_ERR_INVALID, "params.alibi_slopes",
                                  "params.alibi_slopes holds an infinite slope (element %lld); "
                                  "slopes must be finite",
                                  (long long)at);
        p->has_alibi = true;
    }
    if (m->sinks != NULL) {
        if ((st = attn__per_head_operand(p, m->sinks, "params.sinks", &p->sinks)) != ATTN_OK) return st;
        const int64_t at = first_infinite(m->sinks, true);
        if (at >= 0)
            return attn__fail_arg(ATTN_ERR_INVALID, "params.sinks",
                                  "params.sinks holds +inf (element %lld): a sink's logit must be "
                                  "finite, or -inf for no sink",
                                  (long long)at);
        p->has_sinks = true;
    }
    return ATTN_OK;
}

/* lse is (B..., L): its last dimension is the row dimension. */
static void fill_lse(attn__operand *op, const attn_tensor *t, int nb) {
    memset(op, 0, sizeof *op);
    op->data = t->data;
    op->dtype = t->dtype;
    for (int d = 0; d < nb; d++) {
        op->bstride[d] = t->shape[d] == 1 ? 0 : t->strides[d];
        op->bdiv[d] = 1;
    }
    op->rs = t->strides[nb];
    op->cs = 0;
}

/* out's shape (B..., L, Ev); lse's is its first nb + 1 entries. */
static void out_shape(const attn__problem *p, int64_t shape[ATTN_MAX_RANK]) {
    memcpy(shape, p->bshape, sizeof(int64_t) * (size_t)p->nb);
    shape[p->nb] = p->L;
    shape[p->nb + 1] = p->Ev;
}

/* out (B..., L, Ev), weights (B..., L, S), lse (B..., L). */
static attn_status check_outputs(attn__problem *p, const attn__problem_request *r) {
    const int nb = p->nb;
    attn_status st;
    int64_t shape[ATTN_MAX_RANK];
    out_shape(p, shape);
    if ((st = check_output(r->out, NAME(r, ATTN__OUT), r->q->dtype, nb + 2, shape)) != ATTN_OK) return st;
    fill_operand(&p->out, r->out, nb);
    if (r->weights != NULL) {
        shape[nb + 1] = p->S;
        if ((st = check_output(r->weights, NAME(r, ATTN__WEIGHTS), r->q->dtype, nb + 2, shape)) != ATTN_OK)
            return st;
        fill_operand(&p->weights, r->weights, nb);
        p->has_weights = true;
    }
    if (r->lse != NULL) {
        if ((st = attn__check_shape(r->lse, NAME(r, ATTN__LSE), ATTN__OUTPUT, nb + 1, shape, NULL)) != ATTN_OK ||
            (st = attn__check_lse_dtype(r->lse, NAME(r, ATTN__LSE), p->dtype)) != ATTN_OK)
            return st;
        fill_lse(&p->lse, r->lse, nb);
        p->has_lse = true;
        p->lse_for_backward = r->lse_for_backward;
        p->lse_exact = !p->lse_for_backward;
    }
    return check_overlaps(r);
}

attn_status attn__problem_build(attn__problem *p, const attn__problem_request *r) {
    memset(p, 0, sizeof *p);
    attn_status st;
    if ((st = check_inputs(p, r)) != ATTN_OK || (st = batch_dims(p, r)) != ATTN_OK ||
        (st = check_scalars(p, r)) != ATTN_OK || (st = check_slice(p, r)) != ATTN_OK)
        return st;
    p->cancel = attn__cancel_flag();
    if ((st = attn__problem_modifiers(p, r->modifiers)) != ATTN_OK) return st;
    for (int i = 0; i < r->nmask; i++) {
        if (r->mask[i] == NULL) continue;
        if ((st = check_mask(p, r->mask[i], r->mask_name[i], r->mask_bool_keep[i],
                             &p->mask[p->nmask])) != ATTN_OK)
            return st;
        p->nmask++;
    }
    if (r->out == NULL) return ATTN_OK; /* shape inference only */
    return check_outputs(p, r);
}

void attn_sdpa_params_init(attn_sdpa_params *params) {
    if (params == NULL) return;
    memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params;
    params->causal = ATTN_CAUSAL_NONE;
    params->window_left = params->window_right = -1;
}

/* attn_sdpa_params as 0.2.0 had it: the smallest struct_size accepted. */
#define SDPA_PARAMS_FIRST_SIZE ATTN__SIZE_THROUGH(attn_sdpa_params, arg_names)

static attn_status request_from_public(attn__problem_request *r, const attn_tensor *q,
                                       const attn_tensor *k, const attn_tensor *v,
                                       const attn_sdpa_params *user) {
    attn_sdpa_params params;
    attn_sdpa_params_init(&params);
    if (user != NULL) {
        attn_status st = attn__read_params(&params, sizeof params, SDPA_PARAMS_FIRST_SIZE, user,
                                           "params", "attn_sdpa_params_init");
        if (st != ATTN_OK) return st;
    }
    memset(r, 0, sizeof *r);
    r->q = q;
    r->k = k;
    r->v = v;
    r->nmask = 1;
    r->mask[0] = params.attn_mask;
    r->mask_name[0] = "attn_mask";
    r->mask_bool_keep[0] = 1;
    r->causal = params.causal;
    r->has_scale = params.has_scale;
    r->scale = params.scale;
    r->enable_gqa = params.enable_gqa;
    r->dropout_p = params.dropout_p;
    r->seed = params.seed;
    r->rng_offset = params.rng_offset;
    r->names = params.arg_names;
    r->lse_for_backward = params.lse_for_backward != 0;
    r->q_offset = params.q_offset;
    r->k_offset = params.k_offset;
    r->q_total = params.q_total;
    r->k_total = params.k_total;
    r->modifiers_copy = params;
    r->modifiers = &r->modifiers_copy;
    return ATTN_OK;
}

attn_status attn__problem_from_sdpa(attn__problem *plan, const attn_tensor *q,
                                  const attn_tensor *k, const attn_tensor *v,
                                  const attn_sdpa_params *params, attn_tensor *out,
                                  attn_tensor *weights, attn_tensor *lse) {
    attn__problem_request r;
    attn_status st = request_from_public(&r, q, k, v, params);
    if (st != ATTN_OK) return st;
    if (out == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, NAME(&r, ATTN__OUT), "%s is NULL", NAME(&r, ATTN__OUT));
    r.out = out;
    r.weights = weights;
    r.lse = lse;
    return attn__problem_build(plan, &r);
}

attn_status attn_sdpa_out_shape(const attn_tensor *q, const attn_tensor *k,
                                const attn_tensor *v, const attn_sdpa_params *params, int *rank,
                                int64_t shape[ATTN_MAX_RANK]) {
    attn__clear_error();
    if (rank == NULL || shape == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, rank == NULL ? "rank" : "shape", "attn_sdpa_out_shape: %s is NULL",
                          rank == NULL ? "rank" : "shape");
    attn__problem_request r;
    attn__problem plan;
    attn_status st = request_from_public(&r, q, k, v, params);
    if (st == ATTN_OK) st = attn__problem_build(&plan, &r);
    if (st != ATTN_OK) return st;
    *rank = plan.nb + 2;
    memcpy(shape, plan.bshape, sizeof(int64_t) * (size_t)plan.nb);
    shape[plan.nb] = plan.L;
    shape[plan.nb + 1] = plan.Ev;
    return ATTN_OK;
}

/* ---- the backward pass ---- */

/* dout, out (B..., L, Ev) and lse (B..., L): inputs of one exact shape. */
static attn_status check_backward_inputs(attn__problem *p, const attn_tensor *dout,
                                         const attn_tensor *out, const attn_tensor *lse,
                                         const char *out_name, const char *lse_name) {
    const int nb = p->nb;
    attn_status st;
    int64_t shape[ATTN_MAX_RANK];
    out_shape(p, shape);
    if ((st = check_exact(dout, "dout", ATTN__INPUT, p->q.dtype, nb + 2, shape)) != ATTN_OK ||
        (st = check_exact(out, out_name, ATTN__INPUT, p->q.dtype, nb + 2, shape)) != ATTN_OK ||
        (st = attn__check_shape(lse, lse_name, ATTN__INPUT, nb + 1, shape, NULL)) != ATTN_OK ||
        (st = attn__check_lse_dtype(lse, lse_name, p->dtype)) != ATTN_OK)
        return st;
    fill_operand(&p->dout, dout, nb);
    fill_operand(&p->out, out, nb);
    fill_lse(&p->lse, lse, nb);
    p->has_lse = true;
    return ATTN_OK;
}

/* A gradient: the shape and dtype of the input it belongs to, laid out by
 * that input's batch mapping (`like`: its divisors). */
static attn_status check_grad(const attn__problem *p, attn_tensor *g, const char *name,
                              const attn_tensor *input, const char *input_name,
                              const attn__operand *like, attn__operand *op, bool *has) {
    if (g == NULL) return ATTN_OK;
    attn_status st = attn__check_tensor(g, name, 1, ATTN__OUTPUT);
    if (st != ATTN_OK) return st;
    bool same = g->rank == input->rank;
    for (int d = 0; same && d < g->rank; d++) same = g->shape[d] == input->shape[d];
    if (!same) {
        char want[160], got[160];
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has shape %s; expected %s, the shape of %s",
                              name, attn__shape_str(got, sizeof got, g->rank, g->shape),
                              attn__shape_str(want, sizeof want, input->rank, input->shape),
                              input_name);
    }
    if (g->dtype != input->dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; expected %s like %s", name,
                              attn_dtype_name(g->dtype), attn_dtype_name(input->dtype),
                              input_name);
    const int nb = p->nb;
    *op = *like;
    op->data = g->data;
    op->dtype = g->dtype;
    if (like == &p->mask[p->dmask_of].op) { /* right-aligned to (B..., L, S) */
        const int full = nb + 2;
        for (int d = 0; d < full; d++) {
            const int gd = d - (full - g->rank);
            const int64_t stride = gd < 0 || g->shape[gd] == 1 ? 0 : g->strides[gd];
            if (d < nb) op->bstride[d] = stride;
            else if (d == nb) op->rs = stride;
            else op->cs = stride;
        }
    } else {
        for (int d = 0; d < nb; d++) op->bstride[d] = batch_stride(g, nb, d);
        op->rs = g->strides[g->rank - 2];
        op->cs = g->strides[g->rank - 1];
    }
    *has = true;
    return attn__check_output_layout(g, name);
}

/* Gradients must not share memory with what the backward reads or with
 * each other. */
static attn_status check_backward_overlaps(const attn_tensor *const grads[4],
                                           const char *const grad_names[4],
                                           const attn_tensor *const *ins,
                                           const char *const *in_names, int nin) {
    for (int g = 0; g < 4; g++) {
        if (grads[g] == NULL) continue;
        for (int i = 0; i < nin; i++)
            if (attn__views_overlap(grads[g], ins[i]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, grad_names[g],
                                      "%s overlaps %s in memory: give each gradient a buffer "
                                      "of its own",
                                      grad_names[g], in_names[i]);
        for (int g2 = g + 1; g2 < 4; g2++)
            if (attn__views_overlap(grads[g], grads[g2]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, grad_names[g2],
                                      "%s and %s overlap in memory", grad_names[g],
                                      grad_names[g2]);
    }
    return ATTN_OK;
}

attn_status attn__problem_build_backward(attn__problem *p, const attn__problem_request *r,
                                         const attn__backward_request *g) {
    attn__problem_request inputs = *r; /* the forward's outputs are inputs here */
    inputs.out = inputs.weights = inputs.lse = NULL;
    attn_status st = attn__problem_build(p, &inputs);
    if (st != ATTN_OK) return st;
    const char *out_name = NAME(r, ATTN__OUT), *lse_name = NAME(r, ATTN__LSE);
    if ((st = check_backward_inputs(p, g->dout, g->out, g->lse, out_name, lse_name)) != ATTN_OK)
        return st;
    const attn_tensor *mask = NULL;
    const char *mask_name = "attn_mask";
    if (g->dmask != NULL) {
        const int m = g->dmask_of;
        mask = m < r->nmask ? r->mask[m] : NULL;
        if (mask != NULL) mask_name = r->mask_name[m];
        if (mask == NULL || !attn__is_floating(mask->dtype))
            return attn__fail_arg(ATTN_ERR_INVALID, "dmask",
                                  "dmask is the gradient of a float %s, but it is %s", mask_name,
                                  mask == NULL ? "not given" : attn_dtype_name(mask->dtype));
        /* the mask's index among the problem's masks (absent ones are skipped) */
        p->dmask_of = 0;
        for (int i = 0; i < m; i++) p->dmask_of += r->mask[i] != NULL;
    }
    const char *qn = NAME(r, ATTN__Q), *kn = NAME(r, ATTN__K), *vn = NAME(r, ATTN__V);
    if ((st = check_grad(p, g->dq, "dq", r->q, qn, &p->q, &p->dq, &p->has_dq)) != ATTN_OK ||
        (st = check_grad(p, g->dk, "dk", r->k, kn, &p->k, &p->dk, &p->has_dk)) != ATTN_OK ||
        (st = check_grad(p, g->dv, "dv", r->v, vn, &p->v, &p->dv, &p->has_dv)) != ATTN_OK ||
        (g->dmask != NULL && (st = check_grad(p, g->dmask, "dmask", mask, mask_name,
                                              &p->mask[p->dmask_of].op, &p->dmask,
                                              &p->has_dmask)) != ATTN_OK))
        return st;
    const attn_tensor *const grads[4] = {g->dq, g->dk, g->dv, g->dmask};
    const char *const grad_names[4] = {"dq", "dk", "dv", "dmask"};
    /* everything the backward reads: the forward's inputs and outputs, every
     * mask and the modifiers' tensors */
    const attn_tensor *ins[8 + ATTN__MAX_MASKS] = {g->dout, r->q, r->k, r->v, g->out, g->lse};
    const char *in_names[8 + ATTN__MAX_MASKS] = {"dout", qn, kn, vn, out_name, lse_name};
    const int nin = masks_and_modifiers(r, ins, in_names, 6);
    return check_backward_overlaps(grads, grad_names, ins, in_names, nin);
}

attn_status attn__problem_from_sdpa_backward(attn__problem *p, const attn_tensor *dout,
                                             const attn_tensor *q, const attn_tensor *k,
                                             const attn_tensor *v, const attn_tensor *out,
                                             const attn_tensor *lse,
                                             const attn_sdpa_params *params, attn_tensor *dq,
                                             attn_tensor *dk, attn_tensor *dv,
                                             attn_tensor *dmask) {
    attn__problem_request r;
    attn_status st = request_from_public(&r, q, k, v, params);
    if (st != ATTN_OK) return st;
    const attn__backward_request g = {dout, out, lse, dq, dk, dv, dmask, 0};
    return attn__problem_build_backward(p, &r, &g);
}
