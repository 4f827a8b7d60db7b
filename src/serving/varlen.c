/*
 * varlen.c — attn_sdpa_varlen: packed variable-length sequences
 * (FlashAttention's flash_attn_varlen_func) as one ragged problem.
 *
 * The problem's batch dimensions are (B sequences, Hq heads). Every operand
 * is the caller's packed tensor read in place: sequence n starts at its own
 * row (seq_start = cu_seqlens[n]) and holds its own rows (seq_len), token
 * rows one stride apart, heads along the second batch dimension (k and v
 * grouped by Hq / Hkv). Nothing is copied and no work is spent on padding:
 * rows past a sequence's length are neither read nor written.
 */
#include <stdio.h>
#include <string.h>

#include "../sdpa/sdpa.h"
#include "serving.h"

/* The caller's tensors and their names in messages. */
typedef struct varlen_args {
    const attn_tensor *q, *k, *v, *cu_q, *cu_k;
    attn_tensor *out, *lse;
    int64_t max_q, max_k;
    const char *qn, *kn, *vn, *outn, *lsen;
} varlen_args;

/* q (total_q, Hq, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev): one float
 * dtype, Hq a multiple of Hkv. Sets p's dtype, E, Ev and batch shape's heads. */
static attn_status check_packed(attn__problem *p, const varlen_args *a) {
    attn_status st;
    if ((st = attn__check_tensor(a->q, a->qn, 1, ATTN__INPUT)) != ATTN_OK ||
        (st = attn__check_tensor(a->k, a->kn, 1, ATTN__INPUT)) != ATTN_OK ||
        (st = attn__check_tensor(a->v, a->vn, 1, ATTN__INPUT)) != ATTN_OK)
        return st;
    const attn_tensor *views[3] = {a->q, a->k, a->v};
    const char *names[3] = {a->qn, a->kn, a->vn};
    for (int i = 0; i < 3; i++)
        if (views[i]->rank != 3)
            return attn__fail_arg(ATTN_ERR_SHAPE, names[i],
                                  "%s has rank %d; expected 3: packed (total_tokens, heads, "
                                  "features)",
                                  names[i], views[i]->rank);
    const attn_tensor *q = a->q, *k = a->k, *v = a->v;
    if ((st = attn__check_qkv_dtypes(q, a->qn, k, a->kn, v, a->vn, &p->dtype)) != ATTN_OK)
        return st;
    if (k->shape[2] != q->shape[2])
        return attn__fail_arg(ATTN_ERR_SHAPE, a->kn,
                              "%s.shape[2] is %lld but %s.shape[2] is %lld: queries and keys "
                              "must have the same feature size E",
                              a->kn, (long long)k->shape[2], a->qn, (long long)q->shape[2]);
    if (v->shape[0] != k->shape[0] || v->shape[1] != k->shape[1])
        return attn__fail_arg(ATTN_ERR_SHAPE, a->vn,
                              "%s is (%lld, %lld, ...) but %s is (%lld, %lld, ...): one value "
                              "row per key row, with as many heads",
                              a->vn, (long long)v->shape[0], (long long)v->shape[1], a->kn,
                              (long long)k->shape[0], (long long)k->shape[1]);
    if (q->shape[1] % k->shape[1] != 0)
        return attn__fail_arg(ATTN_ERR_SHAPE, a->kn,
                              "%s has %lld heads and %s %lld; the query heads must be a "
                              "multiple of the key/value heads (GQA)",
                              a->qn, (long long)q->shape[1], a->kn, (long long)k->shape[1]);
    p->E = q->shape[2];
    p->Ev = v->shape[2];
    return ATTN_OK;
}

/* cu_seqlens_q and cu_seqlens_k: int32 (B + 1,) each, the same B. */
static attn_status check_offset_tensors(const varlen_args *a, int64_t *B) {
    attn_status st = attn__check_index(a->cu_q, "cu_seqlens_q", 1, NULL,
                                       "rank 1: (B + 1,) offsets into the rows of q");
    if (st != ATTN_OK) return st;
    *B = a->cu_q->shape[0] - 1;
    char expected[96];
    snprintf(expected, sizeof expected, "(%lld,) like cu_seqlens_q (B + 1 offsets)",
             (long long)a->cu_q->shape[0]);
    return attn__check_index(a->cu_k, "cu_seqlens_k", 1, a->cu_q->shape, expected);
}

/* Reads cu_seqlens (B + 1,) into start[n] and len[n] for n < B and checks
 * them: 0 first, non-decreasing, the last <= total (rows of `rows_of`), no
 * length above max_seqlen. *longest gets the longest length. With B = 0
 * only the first entry is read: it must be 0 all the same. */
static attn_status read_offsets(const attn_tensor *cu, const char *name, int64_t total,
                                const char *rows_of, int64_t max_seqlen, const char *max_name,
                                int64_t *start, int64_t *len, int64_t *longest) {
    const int64_t B = cu->shape[0] - 1;
    int64_t prev = attn__index1(cu, 0);
    if (prev != 0)
        return attn__fail_arg(ATTN_ERR_INVALID, name,
                              "%s[0] is %lld; expected 0 (offsets start at the first row)", name,
                              (long long)prev);
    *longest = 0;
    for (int64_t n = 0; n < B; n++) {
        const int64_t next = attn__index1(cu, n + 1);
        if (next < prev)
            return attn__fail_arg(ATTN_ERR_INVALID, name,
                                  "%s[%lld] is %lld, below %s[%lld] = %lld: offsets must not "
                                  "decrease",
                                  name, (long long)(n + 1), (long long)next, name, (long long)n,
                                  (long long)prev);
        if (next > total)
            return attn__fail_arg(ATTN_ERR_SHAPE, name,
                                  "%s[%lld] is %lld, past the %lld rows of %s", name,
                                  (long long)(n + 1), (long long)next, (long long)total, rows_of);
        if (next - prev > max_seqlen)
            return attn__fail_arg(ATTN_ERR_INVALID, max_name,
                                  "%s is %lld but sequence %lld has %lld rows (%s[%lld] - "
                                  "%s[%lld]); it must be >= every sequence's length",
                                  max_name, (long long)max_seqlen, (long long)n,
                                  (long long)(next - prev), name, (long long)(n + 1), name,
                                  (long long)n);
        start[n] = prev;
        len[n] = next - prev;
        if (len[n] > *longest) *longest = len[n];
        prev = next;
    }
    return ATTN_OK;
}

/* out (total_q, Hq, Ev) in q's dtype; lse (Hq, total_q) in q's dtype or
 * float64; neither overlaps what the call reads, nor each other. */
static attn_status check_outputs(const attn__problem *p, const varlen_args *a,
                                 const attn_sdpa_params *params) {
    attn_status st;
    if ((st = attn__check_tensor(a->out, a->outn, 1, ATTN__OUTPUT)) != ATTN_OK) return st;
    const int64_t out_shape[3] = {a->q->shape[0], a->q->shape[1], p->Ev};
    const int64_t lse_shape[2] = {a->q->shape[1], a->q->shape[0]};
    char want[160], got[160];
    bool same = a->out->rank == 3;
    for (int d = 0; same && d < 3; d++) same = a->out->shape[d] == out_shape[d];
    if (!same)
        return attn__fail_arg(ATTN_ERR_SHAPE, a->outn, "%s has shape %s; expected %s", a->outn,
                              attn__shape_str(got, sizeof got, a->out->rank, a->out->shape),
                              attn__shape_str(want, sizeof want, 3, out_shape));
    if (a->out->dtype != a->q->dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, a->outn, "%s is %s; expected %s like the query",
                              a->outn, attn_dtype_name(a->out->dtype), attn_dtype_name(a->q->dtype));
    if (a->lse != NULL) {
        if ((st = attn__check_tensor(a->lse, a->lsen, 1, ATTN__OUTPUT)) != ATTN_OK) return st;
        same = a->lse->rank == 2 && a->lse->shape[0] == lse_shape[0] &&
               a->lse->shape[1] == lse_shape[1];
        if (!same)
            return attn__fail_arg(ATTN_ERR_SHAPE, a->lsen, "%s has shape %s; expected %s (Hq, "
                                  "total_q)",
                                  a->lsen,
                                  attn__shape_str(got, sizeof got, a->lse->rank, a->lse->shape),
                                  attn__shape_str(want, sizeof want, 2, lse_shape));
        if ((st = attn__check_lse_dtype(a->lse, a->lsen, p->dtype)) != ATTN_OK) return st;
    }
    const attn__named_view writes[2] = {{a->out, a->outn}, {a->lse, a->lsen}};
    const attn__named_view reads[7] = {{a->q, a->qn},
                                       {a->k, a->kn},
                                       {a->v, a->vn},
                                       {a->cu_q, "cu_seqlens_q"},
                                       {a->cu_k, "cu_seqlens_k"},
                                       {params->alibi_slopes, "params.alibi_slopes"},
                                       {params->sinks, "params.sinks"}};
    return attn__serving_overlaps(writes, 2, reads, 7);
}

/* A packed (total, heads, features) operand of sequence rows: token rows
 * one stride apart from the sequence's start, heads along batch dim 1
 * (`group` query heads per head of this operand). */
static void packed_operand(attn__operand *op, const attn_tensor *t, int64_t group,
                           const int64_t *start, const int64_t *len) {
    memset(op, 0, sizeof *op);
    op->data = t->data;
    op->dtype = t->dtype;
    op->bstride[0] = 0; /* the sequence's rows are located by seq_start */
    op->bdiv[0] = 1;
    op->bstride[1] = attn__stride(t, 1);
    op->bdiv[1] = group;
    op->rs = attn__stride(t, 0);
    op->cs = attn__stride(t, 2);
    op->seq_start = start;
    op->seq_len = len;
}

/* lse (Hq, total_q): heads along dim 0, the sequence's rows along dim 1. */
static void lse_operand(attn__operand *op, const attn_tensor *t, const int64_t *start,
                        const int64_t *len) {
    memset(op, 0, sizeof *op);
    op->data = t->data;
    op->dtype = t->dtype;
    op->bdiv[0] = op->bdiv[1] = 1;
    op->bstride[1] = attn__stride(t, 0);
    op->rs = attn__stride(t, 1);
    op->seq_start = start;
    op->seq_len = len;
}

/* Everything checkable before the offsets are read: tensors, outputs and
 * params. Sets p's dtype, sizes but L and S, batch shape and scalars. */
static attn_status check_args(attn__problem *p, const varlen_args *a,
                              const attn_sdpa_params *params, int64_t *B) {
    attn_status st;
    if ((st = check_packed(p, a)) != ATTN_OK || (st = check_offset_tensors(a, B)) != ATTN_OK ||
        (st = check_outputs(p, a, params)) != ATTN_OK)
        return st;
    if (a->max_q < 0 || a->max_k < 0)
        return attn__fail_arg(ATTN_ERR_INVALID, a->max_q < 0 ? "max_seqlen_q" : "max_seqlen_k",
                              "%s is %lld; expected >= 0 (the longest sequence's length)",
                              a->max_q < 0 ? "max_seqlen_q" : "max_seqlen_k",
                              (long long)(a->max_q < 0 ? a->max_q : a->max_k));
    p->nb = 2;
    p->bshape[0] = *B;
    p->bshape[1] = a->q->shape[1];
    return attn__serving_scalars(p, params);
}

attn_status attn_sdpa_varlen(const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                             const attn_tensor *cu_seqlens_q, const attn_tensor *cu_seqlens_k,
                             int64_t max_seqlen_q, int64_t max_seqlen_k,
                             const attn_sdpa_params *params, attn_tensor *out, attn_tensor *lse) {
    attn__clear_error();
    attn_sdpa_params prm;
    attn_status st = attn__serving_params(&prm, params, "attn_sdpa_varlen");
    if (st != ATTN_OK) return st;
    const varlen_args a = {q,
                           k,
                           v,
                           cu_seqlens_q,
                           cu_seqlens_k,
                           out,
                           lse,
                           max_seqlen_q,
                           max_seqlen_k,
                           attn__serving_name(&prm, ATTN__Q),
                           attn__serving_name(&prm, ATTN__K),
                           attn__serving_name(&prm, ATTN__V),
                           attn__serving_name(&prm, ATTN__OUT),
                           attn__serving_name(&prm, ATTN__LSE)};
    attn__problem p;
    memset(&p, 0, sizeof p);
    int64_t B = 0;
    if ((st = check_args(&p, &a, &prm, &B)) != ATTN_OK) return st;
    /* A call cancelled before it starts fails even when it has nothing to do. */
    if (attn__cancelled(p.cancel)) return attn__fail_cancelled();

    /* Starts and lengths per sequence, int64 as the problem reads them:
     * (4, B) = q starts, q lengths, k starts, k lengths. Copied, so that
     * the caller's offsets are read once, here, where they are checked:
     * with no sequence (B = 0) too, whose one offset must still be 0, and
     * where nothing is computed after (L = 0). */
    int64_t *seq = attn__alloc_array((size_t)(B > 0 ? B : 1) * 4, sizeof(int64_t));
    if (seq == NULL) return ATTN_ERR_NOMEM;
    int64_t *q_start = seq, *q_len = seq + B, *k_start = seq + 2 * B, *k_len = seq + 3 * B;
    int64_t longest_q = 0, longest_k = 0;
    st = read_offsets(cu_seqlens_q, "cu_seqlens_q", q->shape[0], a.qn, max_seqlen_q,
                      "max_seqlen_q", q_start, q_len, &longest_q);
    if (st == ATTN_OK)
        st = read_offsets(cu_seqlens_k, "cu_seqlens_k", k->shape[0], a.kn, max_seqlen_k,
                          "max_seqlen_k", k_start, k_len, &longest_k);
    /* L and S are the longest sequences (not max_seqlen, a bound the
     * caller may round up): the work and the dropout index depend on the
     * sequences alone. A row with no key still has an output (0), so S is
     * at least 1; k's seq_len keeps every key past a sequence's own out. */
    p.L = longest_q;
    p.S = longest_k > 0 ? longest_k : 1;
    if (st == ATTN_OK) st = attn__serving_sizes(&p, a.qn);
    if (st == ATTN_OK && p.L > 0) {
        const int64_t group = q->shape[1] / k->shape[1];
        packed_operand(&p.q, q, 1, q_start, q_len);
        packed_operand(&p.k, k, group, k_start, k_len);
        packed_operand(&p.v, v, group, k_start, k_len);
        packed_operand(&p.out, out, 1, q_start, q_len);
        if (lse != NULL) {
            lse_operand(&p.lse, lse, q_start, q_len);
            p.has_lse = true;
            p.lse_exact = true;
        }
        st = attn__sdpa_execute(&p);
    }
    attn__free(seq);
    return st;
}
