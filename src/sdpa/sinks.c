/*
 * sinks.c — the gradient of attention sinks (attn_sdpa_sinks_backward).
 *
 * A sink is one more term of each row's softmax denominator with no value,
 * so with p_sink = exp(sink - lse) and D = dout · out,
 *   d loss / d sink = - Σ_rows p_sink · D
 * It needs only what the forward returned (out, lse) and dout: no scores,
 * no kernel. Sums run in float64 in (batch index, row) order, one rounding.
 */
#include <math.h>
#include <string.h>

#include "sdpa.h"

/* dout and out (B..., L, Ev) of one shape and float dtype; lse (B..., L). */
static attn_status check_rows(const attn_tensor *dout, const attn_tensor *out,
                              const attn_tensor *lse) {
    attn_status st;
    if ((st = attn__check_tensor(out, "out", 2, ATTN__INPUT)) != ATTN_OK ||
        (st = attn__check_tensor(dout, "dout", 2, ATTN__INPUT)) != ATTN_OK ||
        (st = attn__check_tensor(lse, "lse", 1, ATTN__INPUT)) != ATTN_OK)
        return st;
    if (!attn__is_floating(out->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, "out",
                              "out is %s; expected float32, float64, float16 or bfloat16",
                              attn_dtype_name(out->dtype));
    char a[160], b[160];
    bool same = dout->rank == out->rank && dout->dtype == out->dtype;
    for (int d = 0; same && d < out->rank; d++) same = dout->shape[d] == out->shape[d];
    if (!same)
        return attn__fail_arg(ATTN_ERR_SHAPE, "dout", "dout is %s %s; expected %s %s like out",
                              attn_dtype_name(dout->dtype),
                              attn__shape_str(a, sizeof a, dout->rank, dout->shape),
                              attn_dtype_name(out->dtype),
                              attn__shape_str(b, sizeof b, out->rank, out->shape));
    const attn_dtype lse_own = attn__compute_dtype(out->dtype);
    same = lse->rank == out->rank - 1 && (lse->dtype == lse_own || lse->dtype == ATTN_DTYPE_F64);
    for (int d = 0; same && d < lse->rank; d++) same = lse->shape[d] == out->shape[d];
    if (!same)
        return attn__fail_arg(ATTN_ERR_SHAPE, "lse",
                              "lse is %s %s; expected out's shape without its last dimension "
                              "%s, float32 (float64 for float64 out) or float64",
                              attn_dtype_name(lse->dtype),
                              attn__shape_str(a, sizeof a, lse->rank, lse->shape),
                              attn__shape_str(b, sizeof b, out->rank - 1, out->shape));
    return ATTN_OK;
}

/* The dense index, over dsinks' own elements (C order), of batch index b. */
static int64_t dense_index(const attn__problem *p, const attn_tensor *sinks, int64_t b) {
    int64_t idx = 0, span = 1;
    for (int td = sinks->rank - 1; td >= 0; td--) {
        const int d = p->nb - sinks->rank + td;
        int64_t bd = 0;
        if (d >= 0) { /* batch index b's coordinate along dim d */
            int64_t rest = b;
            for (int e = p->nb - 1; e > d; e--) rest /= p->bshape[e];
            bd = rest % p->bshape[d];
        }
        if (sinks->shape[td] != 1) idx += bd * span;
        span *= sinks->shape[td];
    }
    return idx;
}

attn_status attn__sinks_grad_begin(const attn__problem *p, const attn_sdpa_params *params,
                                   attn_tensor *dsinks, const attn_tensor *const *inputs,
                                   int ninputs, attn__sinks_grad *g) {
    memset(g, 0, sizeof *g);
    attn_status st;
    if ((st = attn__per_head_operand(p, params->sinks, "params.sinks", &g->sink)) != ATTN_OK ||
        (st = attn__check_tensor(dsinks, "dsinks", 1, ATTN__OUTPUT)) != ATTN_OK)
        return st;
    bool same = dsinks->rank == params->sinks->rank;
    for (int d = 0; same && d < dsinks->rank; d++) same = dsinks->shape[d] == params->sinks->shape[d];
    if (!same)
        return attn__fail_arg(ATTN_ERR_SHAPE, "dsinks",
                              "dsinks must have the shape of params.sinks");
    if (dsinks->dtype != params->sinks->dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, "dsinks",
                              "dsinks is %s; it must have params.sinks' dtype, %s",
                              attn_dtype_name(dsinks->dtype),
                              attn_dtype_name(params->sinks->dtype));
    if ((st = attn__check_output_layout(dsinks, "dsinks")) != ATTN_OK) return st;
    for (int i = 0; i < ninputs; i++)
        if (attn__views_overlap(dsinks, inputs[i]))
            return attn__fail_arg(ATTN_ERR_OVERLAP, "dsinks", "dsinks overlaps an input in memory");
    g->sinks = params->sinks;
    g->acc = attn__alloc_array((size_t)attn_tensor_numel(dsinks), sizeof(double));
    return g->acc == NULL ? ATTN_ERR_NOMEM : ATTN_OK;
}

double attn__sinks_grad_sink(const attn__problem *p, const attn__sinks_grad *g, int64_t b) {
    return attn__load(g->sink.data, g->sink.dtype, attn__batch_offset(p, &g->sink, b));
}

double attn__sink_row_term(double sink, double lse, const attn_tensor *dout, int64_t dout_at,
                           const attn_tensor *out, int64_t out_at, int64_t Ev) {
    if (lse == -INFINITY) return 0.0; /* a row that saw nothing weighs nothing */
    const int64_t gcs = dout->strides[dout->rank - 1], ocs = out->strides[out->rank - 1];
    double D = 0;
    for (int64_t e = 0; e < Ev; e++)
        D += attn__load(dout->data, dout->dtype, dout_at + e * gcs) *
             attn__load(out->data, out->dtype, out_at + e * ocs);
    return exp(sink - lse) * D;
}

void attn__sinks_grad_add(const attn__problem *p, attn__sinks_grad *g, int64_t b, double sum) {
    g->acc[dense_index(p, g->sinks, b)] -= sum;
}

void attn__sinks_grad_end(attn__sinks_grad *g, attn_tensor *dsinks) {
    const int64_t n = attn_tensor_numel(dsinks);
    for (int64_t x = 0; x < n; x++) { /* dense C order -> dsinks' strides */
        int64_t off = 0, rest = x;
        for (int d = dsinks->rank - 1; d >= 0; d--) {
            off += (rest % dsinks->shape[d]) * dsinks->strides[d];
            rest /= dsinks->shape[d];
        }
        attn__store(dsinks->data, dsinks->dtype, off, g->acc[x]);
    }
    attn__free(g->acc);
    g->acc = NULL;
}

/* params (NULL: the defaults, which have none) read into *params, with
 * sinks to differentiate. */
attn_status attn__sinks_params(attn_sdpa_params *params, const attn_sdpa_params *user) {
    if (user == NULL) /* the defaults have no sinks */
        return attn__fail_arg(ATTN_ERR_NULL, "params.sinks",
                              "params is NULL: there are no sinks to differentiate");
    attn_sdpa_params_init(params);
    attn_status st = attn__read_params(params, sizeof *params,
                                       ATTN__SIZE_THROUGH(attn_sdpa_params, arg_names), user,
                                       "params", "attn_sdpa_params_init");
    if (st != ATTN_OK) return st;
    if (params->sinks == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, "params.sinks",
                              "params.sinks is NULL: there are no sinks to differentiate");
    return ATTN_OK;
}

attn_status attn_sdpa_sinks_backward(const attn_tensor *dout, const attn_tensor *out,
                                     const attn_tensor *lse, const attn_sdpa_params *user,
                                     attn_tensor *dsinks) {
    attn__clear_error();
    attn_sdpa_params params;
    attn_status st = attn__sinks_params(&params, user);
    if (st != ATTN_OK) return st;
    if ((st = check_rows(dout, out, lse)) != ATTN_OK) return st;
    attn__problem p; /* only the batch shape, to broadcast the sinks against */
    memset(&p, 0, sizeof p);
    p.nb = out->rank - 2;
    p.nbatch = 1;
    for (int d = 0; d < p.nb; d++) p.nbatch *= p.bshape[d] = out->shape[d];
    const attn_tensor *ins[4] = {dout, out, lse, params.sinks};
    attn__sinks_grad g;
    if ((st = attn__sinks_grad_begin(&p, &params, dsinks, ins, 4, &g)) != ATTN_OK) return st;
    const int64_t L = out->shape[out->rank - 2], Ev = out->shape[out->rank - 1];
    for (int64_t b = 0; b < p.nbatch; b++) {
        int64_t ob = 0, gb = 0, lb = 0, rest = b; /* batch offsets of out, dout, lse */
        for (int d = p.nb - 1; d >= 0; d--) {
            const int64_t x = rest % p.bshape[d];
            rest /= p.bshape[d];
            ob += x * out->strides[d];
            gb += x * dout->strides[d];
            lb += x * lse->strides[d];
        }
        const double s = attn__sinks_grad_sink(&p, &g, b);
        double sum = 0;
        for (int64_t i = 0; i < L; i++)
            sum += attn__sink_row_term(
                s, attn__load(lse->data, lse->dtype, lb + i * lse->strides[p.nb]), dout,
                gb + i * dout->strides[p.nb], out, ob + i * out->strides[p.nb], Ev);
        attn__sinks_grad_add(&p, &g, b, sum);
    }
    attn__sinks_grad_end(&g, dsinks);
    return ATTN_OK;
}
