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

/* The backward's tensors (the forward's out and lse are inputs there). */
typedef struct varlen_grads {
    const attn_tensor *dout;
    attn_tensor *dq, *dk, *dv;
} varlen_grads;

static attn_status check_backward_args(const attn__problem *p, const varlen_args *a,
                                       const varlen_grads *g, const attn_sdpa_params *params);

/* Everything checkable before the offsets are read: tensors, the outputs
 * (a forward call), or the backward's tensors (g: a backward call), and
 * params. Sets p's dtype, sizes but L and S, batch shape and scalars. */
static attn_status check_args(attn__problem *p, const varlen_args *a, const varlen_grads *g,
                              const attn_sdpa_params *params, int64_t *B) {
    attn_status st;
    if (g != NULL && ((st = attn__check_tensor(g->dout, "dout", 1, ATTN__INPUT)) != ATTN_OK ||
                      (st = attn__check_tensor(a->out, a->outn, 1, ATTN__INPUT)) != ATTN_OK ||
                      (st = attn__check_tensor(a->lse, a->lsen, 1, ATTN__INPUT)) != ATTN_OK))
        return st;
    if ((st = check_packed(p, a)) != ATTN_OK || (st = check_offset_tensors(a, B)) != ATTN_OK ||
        (st = g != NULL ? check_backward_args(p, a, g, params) : check_outputs(p, a, params)) !=
            ATTN_OK)
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

/* A call's tensors with their names in messages (params->arg_names). out
 * and lse are the backward's inputs, read only there. */
static varlen_args args_of(const attn_sdpa_params *prm, const attn_tensor *q,
                           const attn_tensor *k, const attn_tensor *v, const attn_tensor *cu_q,
                           const attn_tensor *cu_k, const attn_tensor *out, const attn_tensor *lse,
                           int64_t max_q, int64_t max_k) {
    varlen_args a = {q, k, v, cu_q, cu_k, (attn_tensor *)out, (attn_tensor *)lse, max_q, max_k,
                     NULL, NULL, NULL, NULL, NULL};
    a.qn = attn__serving_name(prm, ATTN__Q);
    a.kn = attn__serving_name(prm, ATTN__K);
    a.vn = attn__serving_name(prm, ATTN__V);
    a.outn = attn__serving_name(prm, ATTN__OUT);
    a.lsen = attn__serving_name(prm, ATTN__LSE);
    return a;
}

/* The sequences of a call, read once from the caller's offsets where they
 * are checked: (4, B) int64 = q starts, q lengths, k starts, k lengths. */
typedef struct varlen_seqs {
    int64_t *buf;
    int64_t *q_start, *q_len, *k_start, *k_len;
} varlen_seqs;

/* Reads and checks the offsets into s (freed by the caller, also on
 * failure) and sets p's L and S: the longest sequences (not max_seqlen, a
 * bound the caller may round up), so the work and the dropout index depend
 * on the sequences alone. A row with no key still has an output (0), so S
 * is at least 1; k's seq_len keeps every key past a sequence's own out.
 * With no sequence (B = 0) the one offset must still be 0, and L is 0. */
static attn_status read_sequences(attn__problem *p, const varlen_args *a, int64_t B,
                                  varlen_seqs *s) {
    s->buf = attn__alloc_array((size_t)(B > 0 ? B : 1) * 4, sizeof(int64_t));
    if (s->buf == NULL) return ATTN_ERR_NOMEM;
    s->q_start = s->buf;
    s->q_len = s->buf + B;
    s->k_start = s->buf + 2 * B;
    s->k_len = s->buf + 3 * B;
    int64_t longest_q = 0, longest_k = 0;
    attn_status st = read_offsets(a->cu_q, "cu_seqlens_q", a->q->shape[0], a->qn, a->max_q,
                                  "max_seqlen_q", s->q_start, s->q_len, &longest_q);
    if (st == ATTN_OK)
        st = read_offsets(a->cu_k, "cu_seqlens_k", a->k->shape[0], a->kn, a->max_k,
                          "max_seqlen_k", s->k_start, s->k_len, &longest_k);
    p->L = longest_q;
    p->S = longest_k > 0 ? longest_k : 1;
    if (st == ATTN_OK) st = attn__serving_sizes(p, a->qn);
    return st;
}

/* q, k, v (and the backward's dout, out, dq, dk, dv, which take q's, k's
 * or v's layout) as packed operands of the sequences in s. */
static void packed_inputs(attn__problem *p, const varlen_args *a, const varlen_seqs *s) {
    const int64_t group = a->q->shape[1] / a->k->shape[1];
    packed_operand(&p->q, a->q, 1, s->q_start, s->q_len);
    packed_operand(&p->k, a->k, group, s->k_start, s->k_len);
    packed_operand(&p->v, a->v, group, s->k_start, s->k_len);
}

attn_status attn_sdpa_varlen(const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                             const attn_tensor *cu_seqlens_q, const attn_tensor *cu_seqlens_k,
                             int64_t max_seqlen_q, int64_t max_seqlen_k,
                             const attn_sdpa_params *params, attn_tensor *out, attn_tensor *lse) {
    attn__clear_error();
    attn_sdpa_params prm;
    attn_status st = attn__serving_params(&prm, params, "attn_sdpa_varlen", true);
    if (st != ATTN_OK) return st;
    const varlen_args a = args_of(&prm, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse,
                                  max_seqlen_q, max_seqlen_k);
    attn__problem p;
    memset(&p, 0, sizeof p);
    int64_t B = 0;
    if ((st = check_args(&p, &a, NULL, &prm, &B)) != ATTN_OK) return st;
    /* A call cancelled before it starts fails even when it has nothing to do. */
    if (attn__cancelled(p.cancel)) return attn__fail_cancelled();
    varlen_seqs seqs;
    st = read_sequences(&p, &a, B, &seqs);
    if (st == ATTN_OK && p.L > 0) {
        packed_inputs(&p, &a, &seqs);
        packed_operand(&p.out, out, 1, seqs.q_start, seqs.q_len);
        if (lse != NULL) {
            lse_operand(&p.lse, lse, seqs.q_start, seqs.q_len);
            p.has_lse = true;
            /* for attn_sdpa_varlen_backward: the lse of the scores it
             * recomputes (the fused kernels' layout), as attn_sdpa's */
            p.lse_for_backward = prm.lse_for_backward != 0;
            p.lse_exact = !p.lse_for_backward;
        }
        st = attn__sdpa_execute(&p);
    }
    attn__free(seqs.buf);
    return st;
}

/* ---- the backward pass ---- */

/* A gradient (optional): the shape and dtype of its input. */
static attn_status check_grad(const attn_tensor *g, const char *name, const attn_tensor *input,
                              const char *input_name) {
    if (g == NULL) return ATTN_OK;
    attn_status st = attn__check_shape(g, name, ATTN__OUTPUT, 3, input->shape, NULL);
    if (st != ATTN_OK) return st;
    if (g->dtype != input->dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; expected %s like %s", name,
                              attn_dtype_name(g->dtype), attn_dtype_name(input->dtype),
                              input_name);
    return ATTN_OK;
}

/* dout and out (total_q, Hq, Ev) in q's dtype, lse (Hq, total_q) in the
 * compute dtype or float64; dq, dk, dv like q, k, v, writing nothing the
 * call reads nor each other. */
static attn_status check_backward_args(const attn__problem *p, const varlen_args *a,
                                       const varlen_grads *g, const attn_sdpa_params *params) {
    const int64_t out_shape[3] = {a->q->shape[0], a->q->shape[1], p->Ev};
    const int64_t lse_shape[2] = {a->q->shape[1], a->q->shape[0]};
    const attn_tensor *outs[2] = {g->dout, a->out};
    const char *out_names[2] = {"dout", a->outn};
    attn_status st;
    for (int i = 0; i < 2; i++) {
        if ((st = attn__check_shape(outs[i], out_names[i], ATTN__INPUT, 3, out_shape,
                                    "(total_q, Hq, Ev)")) != ATTN_OK)
            return st;
        if (outs[i]->dtype != a->q->dtype)
            return attn__fail_arg(ATTN_ERR_DTYPE, out_names[i], "%s is %s; expected %s like %s",
                                  out_names[i], attn_dtype_name(outs[i]->dtype),
                                  attn_dtype_name(a->q->dtype), a->qn);
    }
    if ((st = attn__check_shape(a->lse, a->lsen, ATTN__INPUT, 2, lse_shape, "(Hq, total_q)")) !=
            ATTN_OK ||
        (st = attn__check_lse_dtype(a->lse, a->lsen, p->dtype)) != ATTN_OK ||
        (st = check_grad(g->dq, "dq", a->q, a->qn)) != ATTN_OK ||
        (st = check_grad(g->dk, "dk", a->k, a->kn)) != ATTN_OK ||
        (st = check_grad(g->dv, "dv", a->v, a->vn)) != ATTN_OK)
        return st;
    const attn__named_view writes[3] = {{g->dq, "dq"}, {g->dk, "dk"}, {g->dv, "dv"}};
    const attn__named_view reads[10] = {{g->dout, "dout"},
                                        {a->q, a->qn},
                                        {a->k, a->kn},
                                        {a->v, a->vn},
                                        {a->out, a->outn},
                                        {a->lse, a->lsen},
                                        {a->cu_q, "cu_seqlens_q"},
                                        {a->cu_k, "cu_seqlens_k"},
                                        {params->alibi_slopes, "params.alibi_slopes"},
                                        {params->sinks, "params.sinks"}};
    return attn__serving_overlaps(writes, 3, reads, 10);
}

/* Rows from .. total-1 of a packed (total, heads, width) gradient set to 0:
 * rows no sequence holds (past the last offset), whose gradient is 0. */
static void zero_rows_from(attn_tensor *g, int64_t from) {
    if (g == NULL) return;
    const size_t size = attn_dtype_size(g->dtype);
    for (int64_t r = from; r < g->shape[0]; r++)
        for (int64_t h = 0; h < g->shape[1]; h++)
            for (int64_t e = 0; e < g->shape[2]; e++) {
                const int64_t at = r * g->strides[0] + h * g->strides[1] + e * g->strides[2];
                memset((char *)g->data + at * (int64_t)size, 0, size); /* 0.0 in every dtype */
            }
}

attn_status attn_sdpa_varlen_backward(const attn_tensor *dout, const attn_tensor *q,
                                      const attn_tensor *k, const attn_tensor *v,
                                      const attn_tensor *out, const attn_tensor *lse,
                                      const attn_tensor *cu_seqlens_q,
                                      const attn_tensor *cu_seqlens_k, int64_t max_seqlen_q,
                                      int64_t max_seqlen_k, const attn_sdpa_params *params,
                                      attn_tensor *dq, attn_tensor *dk, attn_tensor *dv) {
    attn__clear_error();
    attn_sdpa_params prm;
    attn_status st = attn__serving_params(&prm, params, "attn_sdpa_varlen_backward", true);
    if (st != ATTN_OK) return st;
    const varlen_args a = args_of(&prm, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse,
                                  max_seqlen_q, max_seqlen_k);
    const varlen_grads g = {dout, dq, dk, dv};
    attn__problem p;
    memset(&p, 0, sizeof p);
    int64_t B = 0;
    if ((st = check_args(&p, &a, &g, &prm, &B)) != ATTN_OK) return st;
    if (attn__cancelled(p.cancel)) return attn__fail_cancelled();
    varlen_seqs seqs;
    st = read_sequences(&p, &a, B, &seqs);
    if (st == ATTN_OK && p.L > 0 && (dq != NULL || dk != NULL || dv != NULL)) {
        packed_inputs(&p, &a, &seqs);
        packed_operand(&p.out, (attn_tensor *)out, 1, seqs.q_start, seqs.q_len);
        packed_operand(&p.dout, dout, 1, seqs.q_start, seqs.q_len);
        lse_operand(&p.lse, lse, seqs.q_start, seqs.q_len);
        p.has_lse = true;
        attn__operand *const ops[3] = {&p.dq, &p.dk, &p.dv};
        const attn__operand *const like[3] = {&p.q, &p.k, &p.v};
        attn_tensor *const grads[3] = {dq, dk, dv};
        bool *const has[3] = {&p.has_dq, &p.has_dk, &p.has_dv};
        for (int i = 0; i < 3; i++) {
            if (grads[i] == NULL) continue;
            packed_operand(ops[i], grads[i], like[i]->bdiv[1], like[i]->seq_start,
                           like[i]->seq_len);
            *has[i] = true;
        }
        st = attn__sdpa_backward_run(&p);
    }
    if (st == ATTN_OK) { /* rows no sequence holds: all of them with no query row */
        const int64_t end_q = B > 0 && p.L > 0 ? seqs.q_start[B - 1] + seqs.q_len[B - 1] : 0;
        const int64_t end_k = B > 0 && p.L > 0 ? seqs.k_start[B - 1] + seqs.k_len[B - 1] : 0;
        zero_rows_from(dq, end_q);
        zero_rows_from(dk, end_k);
        zero_rows_from(dv, end_k);
    }
    attn__free(seqs.buf);
    return st;
}

/* ---- the sinks' gradient ---- */

/* dout and out (total_q, Hq, Ev), one float dtype; lse (Hq, total_q) in
 * its compute dtype or float64; cu_seqlens_q (B + 1,) int32. *B gets B. */
static attn_status check_sinks_rows(const attn_tensor *dout, const attn_tensor *out,
                                    const attn_tensor *lse, const attn_tensor *cu_q, int64_t *B) {
    attn_status st;
    if ((st = attn__check_tensor(out, "out", 1, ATTN__INPUT)) != ATTN_OK) return st;
    if (out->rank != 3)
        return attn__fail_arg(ATTN_ERR_SHAPE, "out",
                              "out has rank %d; expected 3: (total_q, Hq, Ev)", out->rank);
    if (!attn__is_floating(out->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, "out",
                              "out is %s; expected float32, float64, float16 or bfloat16",
                              attn_dtype_name(out->dtype));
    if ((st = attn__check_shape(dout, "dout", ATTN__INPUT, 3, out->shape, "(total_q, Hq, Ev) "
                                "like out")) != ATTN_OK)
        return st;
    if (dout->dtype != out->dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, "dout", "dout is %s; expected %s like out",
                              attn_dtype_name(dout->dtype), attn_dtype_name(out->dtype));
    const int64_t lse_shape[2] = {out->shape[1], out->shape[0]};
    if ((st = attn__check_shape(lse, "lse", ATTN__INPUT, 2, lse_shape, "(Hq, total_q)")) !=
            ATTN_OK ||
        (st = attn__check_lse_dtype(lse, "lse", attn__compute_dtype(out->dtype))) != ATTN_OK ||
        (st = attn__check_index(cu_q, "cu_seqlens_q", 1, NULL,
                                "rank 1: (B + 1,) offsets into the rows of out")) != ATTN_OK)
        return st;
    *B = cu_q->shape[0] - 1;
    return ATTN_OK;
}

attn_status attn_sdpa_varlen_sinks_backward(const attn_tensor *dout, const attn_tensor *out,
                                            const attn_tensor *lse,
                                            const attn_tensor *cu_seqlens_q,
                                            const attn_sdpa_params *params, attn_tensor *dsinks) {
    attn__clear_error();
    attn_sdpa_params prm;
    attn_status st = attn__sinks_params(&prm, params);
    int64_t B = 0;
    if (st != ATTN_OK || (st = check_sinks_rows(dout, out, lse, cu_seqlens_q, &B)) != ATTN_OK)
        return st;
    attn__problem p; /* the batch shape (B sequences, Hq heads) the sinks broadcast to */
    memset(&p, 0, sizeof p);
    p.nb = 2;
    p.bshape[0] = B;
    p.bshape[1] = out->shape[1];
    /* B need not be at most out's rows: cu_seqlens_q may repeat one offset
     * through a zero stride */
    if (attn__mul_overflows(B, p.bshape[1], &p.nbatch))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, "cu_seqlens_q",
                              "cu_seqlens_q's %lld sequences x %lld heads overflow int64",
                              (long long)B, (long long)p.bshape[1]);
    const attn_tensor *ins[5] = {dout, out, lse, cu_seqlens_q, prm.sinks};
    attn__sinks_grad g; /* the sinks and dsinks checked first, then the offsets */
    if ((st = attn__sinks_grad_begin(&p, &prm, dsinks, ins, 5, &g)) != ATTN_OK) return st;
    /* start[n], len[n] of sequence n; no length limit (max_seqlen) here */
    int64_t *start = attn__alloc_array((size_t)(2 * B + 1), sizeof(int64_t)), longest;
    if (start == NULL) st = ATTN_ERR_NOMEM;
    if (st == ATTN_OK)
        st = read_offsets(cu_seqlens_q, "cu_seqlens_q", out->shape[0], "out", INT64_MAX,
                          "cu_seqlens_q", start, start + B, &longest);
    if (st != ATTN_OK) {
        attn__free(g.acc);
        attn__free(start);
        return st;
    }
    const int64_t *len = start + B, Ev = out->shape[2];
    for (int64_t b = 0; b < p.nbatch; b++) { /* (sequence n, head h), rows in order */
        const int64_t n = b / p.bshape[1], h = b % p.bshape[1];
        const double s = attn__sinks_grad_sink(&p, &g, b);
        double sum = 0;
        for (int64_t r = start[n]; r < start[n] + len[n]; r++)
            sum += attn__sink_row_term(
                s, attn__load(lse->data, lse->dtype, h * lse->strides[0] + r * lse->strides[1]),
                dout, r * dout->strides[0] + h * dout->strides[1], out,
                r * out->strides[0] + h * out->strides[1], Ev);
        attn__sinks_grad_add(&p, &g, b, sum);
    }
    attn__sinks_grad_end(&g, dsinks);
    attn__free(start);
    return ATTN_OK;
}
