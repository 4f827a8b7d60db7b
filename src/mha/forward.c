/*
 * forward.c — attn_mha_forward as torch.nn.MultiheadAttention computes it,
 * in five named steps:
 *
 *   project       Q = query·Wqᵀ + bq, K = key·Wkᵀ + bk, V = value·Wvᵀ + bv
 *   split heads   (N, T, D) -> (N, H, T, hd): strided views, no copies
 *   attend        O_h = attention(Q_h, K_h, V_h) on the SDPA problem path
 *   merge heads   (N, H, L, hd) -> (N, L, D): again a view of the same buffer
 *   project out   out = O·Woᵀ + bo
 *
 * Heads are never copied apart: the projections write (batch, time, D)
 * buffers, and each head is a strided view into them, so SDPA reads
 * Q_h, K_h, V_h and writes O_h in place. D = num_heads * head_dim; N batch,
 * L target length, S source length, S_ext = S + add_bias_kv + add_zero_attn.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../core/gemm.h"
#include "../kernels/ukernel.h"
#include "../sdpa/sdpa.h"
#include "mha.h"

typedef attn__mha_shapes mha_shapes;
typedef attn__mha_work mha_work;
typedef attn__mha_heads mha_heads;

/* attn_mha_forward_params as 0.2.0 had it: the smallest struct_size accepted. */
#define FORWARD_PARAMS_FIRST_SIZE ATTN__SIZE_THROUGH(attn_mha_forward_params, batch_first)

void attn_mha_forward_params_init(attn_mha_forward_params *p) {
    if (p == NULL) return;
    memset(p, 0, sizeof *p);
    p->struct_size = sizeof *p;
    p->average_attn_weights = 1;
    p->batch_first = -1;
}

/* ---- the call: its parameters and shapes ---- */

/* Reads the caller's params (NULL: the defaults) over the defaults and checks
 * the fields that are not tensors. */
static attn_status read_params(const attn_mha_forward_params *user, attn_mha_forward_params *p) {
    attn_mha_forward_params_init(p);
    if (user != NULL) {
        attn_status st = attn__read_params(p, sizeof *p, FORWARD_PARAMS_FIRST_SIZE, user,
                                           "params", "attn_mha_forward_params_init");
        if (st != ATTN_OK) return st;
    }
    /* [attn] A per-call dropout must be a probability, like config.dropout. */
    if (p->has_dropout && !(p->dropout >= 0.0 && p->dropout <= 1.0))
        return attn__fail_arg(ATTN_ERR_INVALID, "params.dropout",
                              "dropout is %g; expected a probability in [0, 1]", p->dropout);
    if (p->batch_first < -1 || p->batch_first > 1)
        return attn__fail_arg(ATTN_ERR_INVALID, "params.batch_first",
                              "params.batch_first is %d; expected -1 (the config's), 0 or 1",
                              p->batch_first);
    return ATTN_OK;
}

/* A rank-3 (N, T, F) view of a batched (T, N, F)/(N, T, F) or unbatched
 * (T, F) tensor. Unbatched inputs get a broadcast batch of 1. */
attn_tensor attn__mha_to_ntf(const attn_tensor *t, bool batched, bool batch_first) {
    attn_tensor v = *t;
    if (!batched) {
        v.rank = 3;
        v.shape[2] = t->shape[1];
        v.strides[2] = t->strides[1];
        v.shape[1] = t->shape[0];
        v.strides[1] = t->strides[0];
        v.shape[0] = 1;
        v.strides[0] = 0;
    } else if (!batch_first) {
        v.shape[0] = t->shape[1];
        v.strides[0] = t->strides[1];
        v.shape[1] = t->shape[0];
        v.strides[1] = t->strides[0];
    }
    return v;
}

static attn_status check_input(const attn_mha *m, const attn_tensor *t, const char *name,
                               int rank, int64_t features, const char *feature_name) {
    attn_status st = attn__check_tensor(t, name, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (t->rank != rank)
        return attn__fail_arg(ATTN_ERR_SHAPE, name,
                              "%s has rank %d; expected %d like the query (%s)", name, t->rank,
                              rank, rank == 3 ? "batched" : "unbatched");
    if (t->dtype != m->cfg.dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; this module is %s", name,
                              attn_dtype_name(t->dtype), attn_dtype_name(m->cfg.dtype));
    if (t->shape[rank - 1] != features)
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s.shape[-1] is %lld; expected %s = %lld",
                              name, (long long)t->shape[rank - 1], feature_name,
                              (long long)features);
    return ATTN_OK;
}

/* query, key and value (NULL for attn_mha_out_shapes) agree on the batch
 * size and key and value on the source length. The layout is named in
 * the message as torch spells the flag, since it decides which dimension
 * is the batch. */
static attn_status check_lengths(const mha_shapes *s, bool has_value) {
    const char *layout = s->batch_first ? "True" : "False";
    const int64_t Nk = s->key.shape[0], Nv = has_value ? s->value.shape[0] : s->N;
    if (!has_value && Nk != s->N)
        return attn__fail_arg(ATTN_ERR_SHAPE, "key",
                              "query and key must have the same batch size; got %lld and %lld "
                              "(batch_first=%s)",
                              (long long)s->N, (long long)Nk, layout);
    if (Nk != s->N || Nv != s->N)
        return attn__fail_arg(ATTN_ERR_SHAPE, Nk != s->N ? "key" : "value",
                              "query, key and value must have the same batch size; got %lld, "
                              "%lld and %lld (batch_first=%s)",
                              (long long)s->N, (long long)Nk, (long long)Nv, layout);
    if (has_value && s->value.shape[1] != s->S)
        return attn__fail_arg(ATTN_ERR_SHAPE, "value",
                              "key has %lld positions but value has %lld: they must match",
                              (long long)s->S, (long long)s->value.shape[1]);
    return ATTN_OK;
}

attn_status attn__mha_resolve_shapes(const attn_mha *m, const attn_mha_forward_params *p,
                                     const attn_tensor *query, const attn_tensor *key,
                                     const attn_tensor *value, mha_shapes *s) {
    const attn_mha_config *c = &m->cfg;
    attn_status st = attn__check_tensor(query, "query", 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (query->rank != 2 && query->rank != 3)
        return attn__fail_arg(ATTN_ERR_SHAPE, "query",
                              "query has rank %d; expected 3 (batched) or 2 (unbatched)",
                              query->rank);
    int rank = query->rank;
    if ((st = check_input(m, query, "query", rank, c->embed_dim, "embed_dim")) != ATTN_OK ||
        (st = check_input(m, key, "key", rank, c->kdim, "kdim")) != ATTN_OK ||
        (value != NULL &&
         (st = check_input(m, value, "value", rank, c->vdim, "vdim")) != ATTN_OK))
        return st;
    s->batched = rank == 3;
    s->batch_first = p->batch_first < 0 ? c->batch_first != 0 : p->batch_first != 0;
    s->query = attn__mha_to_ntf(query, s->batched, s->batch_first);
    s->key = attn__mha_to_ntf(key, s->batched, s->batch_first);
    if (value != NULL) s->value = attn__mha_to_ntf(value, s->batched, s->batch_first);
    s->N = s->query.shape[0];
    s->L = s->query.shape[1];
    s->S = s->key.shape[1];
    if ((st = check_lengths(s, value != NULL)) != ATTN_OK) return st;
    s->S_ext = s->S + c->add_bias_kv + c->add_zero_attn;
    int64_t rows;
    if (!attn__blas_fits(s->L) || !attn__blas_fits(s->S_ext) ||
        attn__mul_overflows(s->N, s->L > s->S_ext ? s->L : s->S_ext, &rows) ||
        !attn__blas_fits(rows))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, s->L > s->S_ext ? "query" : "key",
                              "batch x sequence length is too large");
    return ATTN_OK;
}

static void weights_shape(const attn_mha *m, const mha_shapes *s, bool average, int *rank,
                          int64_t *shape) {
    int r = 0;
    if (s->batched) shape[r++] = s->N;
    if (!average) shape[r++] = m->cfg.num_heads;
    shape[r++] = s->L;
    shape[r++] = s->S_ext;
    *rank = r;
}

attn_status attn_mha_out_shapes(const attn_mha *m, const attn_tensor *query,
                                const attn_tensor *key, const attn_mha_forward_params *params,
                                int need_weights, int *out_rank,
                                int64_t out_shape[ATTN_MAX_RANK], int *weights_rank,
                                int64_t weights_shape_out[ATTN_MAX_RANK]) {
    attn__clear_error();
    if (m == NULL) return attn__fail_arg(ATTN_ERR_NULL, "mha", "mha is NULL");
    if (out_rank == NULL || out_shape == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, out_rank == NULL ? "out_rank" : "out_shape",
                              "out_rank/out_shape is NULL");
    attn_mha_forward_params p;
    mha_shapes s;
    memset(&s, 0, sizeof s);
    attn_status st = read_params(params, &p);
    if (st == ATTN_OK) st = attn__mha_resolve_shapes(m, &p, query, key, NULL, &s);
    if (st != ATTN_OK) return st;
    *out_rank = query->rank;
    memcpy(out_shape, query->shape, sizeof(int64_t) * (size_t)query->rank);
    if (need_weights) {
        if (weights_rank == NULL || weights_shape_out == NULL)
            return attn__fail_arg(ATTN_ERR_NULL,
                                  weights_rank == NULL ? "weights_rank" : "weights_shape",
                                  "weights_rank/weights_shape is NULL");
        weights_shape(m, &s, p.average_attn_weights != 0, weights_rank, weights_shape_out);
    }
    return ATTN_OK;
}

/* ---- checks of the outputs and masks, before any work ---- */

/* `t` (already checked as a tensor) is `dt` and `shape`; else a message in
 * the words "out is float32 (2, 3); expected float64 (2, 4)<suffix>". */
static attn_status check_output_like(const attn_tensor *t, const char *name, attn_dtype dt,
                                     int rank, const int64_t *shape, const char *suffix) {
    bool ok = t->rank == rank && t->dtype == dt;
    for (int d = 0; ok && d < rank; d++) ok = t->shape[d] == shape[d];
    if (ok) return ATTN_OK;
    char got[160], want[160];
    return attn__fail_arg(t->dtype != dt ? ATTN_ERR_DTYPE : ATTN_ERR_SHAPE, name,
                          "%s is %s %s; expected %s %s%s", name, attn_dtype_name(t->dtype),
                          attn__shape_str(got, sizeof got, t->rank, t->shape),
                          attn_dtype_name(dt), attn__shape_str(want, sizeof want, rank, shape),
                          suffix);
}

/* out is shaped like the query; weights (optional) as weights_shape says. */
static attn_status check_outputs(const attn_mha *m, const mha_shapes *s, bool average,
                                 const attn_tensor *query, const attn_tensor *out,
                                 const attn_tensor *weights) {
    const attn_dtype dt = m->cfg.dtype;
    if (out == NULL) return attn__fail_arg(ATTN_ERR_NULL, "out", "out is NULL");
    attn_status st = attn__check_tensor(out, "out", 1, ATTN__OUTPUT);
    if (st == ATTN_OK)
        st = check_output_like(out, "out", dt, query->rank, query->shape, " like the query");
    if (st != ATTN_OK || weights == NULL) return st;
    int wr;
    int64_t ws[ATTN_MAX_RANK];
    weights_shape(m, s, average, &wr, ws);
    if ((st = attn__check_tensor(weights, "weights", 1, ATTN__OUTPUT)) != ATTN_OK) return st;
    return check_output_like(weights, "weights", dt, wr, ws, "");
}

/* attn_mask (L, S) or (N*H, L, S) as a view over (N, H, L, S): the head
 * dimension splits into (N, H). */
static attn_status attn_mask_view(const attn_mha *m, const mha_shapes *s,
                                  const attn_tensor *t, attn_tensor *am) {
    const int64_t H = m->cfg.num_heads;
    char got[160], want[80], want3[80];
    attn_status st = attn__check_tensor(t, "attn_mask", 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    int64_t heads = s->batched ? s->N * H : H;
    int64_t w2[2] = {s->L, s->S}, w3[3] = {heads, s->L, s->S};
    bool ok2 = t->rank == 2 && t->shape[0] == s->L && t->shape[1] == s->S;
    bool ok3 = t->rank == 3 && t->shape[0] == heads && t->shape[1] == s->L &&
               t->shape[2] == s->S;
    if (!ok2 && !ok3)
        return attn__fail_arg(ATTN_ERR_SHAPE, "attn_mask",
                              "attn_mask has shape %s; expected %s or %s%s",
                              attn__shape_str(got, sizeof got, t->rank, t->shape),
                              attn__shape_str(want, sizeof want, 2, w2),
                              attn__shape_str(want3, sizeof want3, 3, w3),
                              s->batched ? " (batch * num_heads, L, S)" : " (num_heads, L, S)");
    *am = *t;
    if (ok3) { /* (N*H, L, S) -> (N, H, L, S) */
        am->rank = 4;
        am->shape[3] = t->shape[2];
        am->strides[3] = t->strides[2];
        am->shape[2] = t->shape[1];
        am->strides[2] = t->strides[1];
        am->shape[1] = H;
        am->strides[1] = t->strides[0];
        am->shape[0] = s->batched ? s->N : 1;
        /* With one batch the stride is never used, and stride * H may
         * not fit; with N >= 2 it does (the view spans stride * (N*H - 1)). */
        am->strides[0] = am->shape[0] == 1 ? 0 : t->strides[0] * H;
    }
    return ATTN_OK;
}

/* key_padding_mask (N, S), unbatched (S), as a view over (N, 1, 1, S). */
static attn_status kpm_view(const mha_shapes *s, const attn_tensor *t, attn_tensor *kpm) {
    char got[160], want[80];
    attn_status st = attn__check_tensor(t, "key_padding_mask", 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    int64_t w[2] = {s->N, s->S};
    bool ok = s->batched ? (t->rank == 2 && t->shape[0] == s->N && t->shape[1] == s->S)
                         : (t->rank == 1 && t->shape[0] == s->S);
    if (!ok)
        return attn__fail_arg(ATTN_ERR_SHAPE, "key_padding_mask",
                              "key_padding_mask has shape %s; expected %s",
                              attn__shape_str(got, sizeof got, t->rank, t->shape),
                              attn__shape_str(want, sizeof want, s->batched ? 2 : 1,
                                              s->batched ? w : w + 1));
    *kpm = *t;
    if (s->batched) { /* (N, S) -> (N, 1, 1, S) */
        kpm->rank = 4;
        kpm->shape[3] = t->shape[1];
        kpm->strides[3] = t->strides[1];
        kpm->shape[1] = kpm->shape[2] = 1;
        kpm->strides[1] = kpm->strides[2] = 0;
    }
    return ATTN_OK;
}

static attn_status check_mask_dtype(const attn_tensor *t, const char *name) {
    if (t != NULL && t->dtype != ATTN_DTYPE_BOOL && !attn__is_floating(t->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, name,
                              "%s is %s; expected bool or a float dtype (float32, float64, "
                              "float16, bfloat16)",
                              name, attn_dtype_name(t->dtype));
    return ATTN_OK;
}

/* Checks the MHA masks and turns them into views over (N, H, L, S) for the
 * problem (before any padding); *am_use / *kpm_use point at them, or are
 * NULL for a mask not given. */
static attn_status mask_views(const attn_mha *m, const mha_shapes *s,
                              const attn_mha_forward_params *p, attn_tensor *am,
                              attn_tensor *kpm) {
    attn_status st = ATTN_OK;
    if (p->attn_mask != NULL) st = attn_mask_view(m, s, p->attn_mask, am);
    if (st == ATTN_OK && p->key_padding_mask != NULL) st = kpm_view(s, p->key_padding_mask, kpm);
    if (st == ATTN_OK) st = check_mask_dtype(p->attn_mask, "attn_mask");
    if (st == ATTN_OK) st = check_mask_dtype(p->key_padding_mask, "key_padding_mask");
    return st;
}

/* out and weights must not share memory with an input, the module's
 * parameters or each other (the masks are read while weights are written,
 * out_proj's weight after out is). */
static attn_status check_output_overlaps(const attn_mha *m, const attn_tensor *query,
                                         const attn_tensor *key, const attn_tensor *value,
                                         const attn_mha_forward_params *p,
                                         const attn_tensor *out, const attn_tensor *weights) {
    const attn_tensor params = attn__mha_storage_view(m);
    const attn_tensor *ins[6] = {query, key, value, p->attn_mask, p->key_padding_mask, &params};
    const char *names[6] = {"query", "key", "value", "attn_mask", "key_padding_mask",
                            "the module's parameters"};
    const attn_tensor *outs[2] = {out, weights};
    for (int o = 0; o < 2; o++) {
        const char *name = o ? "weights" : "out";
        attn_status st = attn__check_output_layout(outs[o], name);
        if (st != ATTN_OK) return st;
        for (int i = 0; i < 6; i++)
            if (attn__views_overlap(outs[o], ins[i]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, name,
                                      "%s overlaps %s in memory: give %s a buffer of its own",
                                      name, names[i], name);
    }
    if (attn__views_overlap(out, weights))
        return attn__fail_arg(ATTN_ERR_OVERLAP, "weights", "out and weights overlap in memory");
    return ATTN_OK;
}

/* Whether two views show the same elements in the same order. */
static bool same_view(const attn_tensor *a, const attn_tensor *b) {
    if (a->data != b->data || a->dtype != b->dtype || a->rank != b->rank) return false;
    for (int d = 0; d < a->rank; d++)
        if (a->shape[d] != b->shape[d] || a->strides[d] != b->strides[d]) return false;
    return true;
}

/* ---- the workspace ---- */

/* Chooses the layout of Q, K, V and O (the strides above). */
static void work_layout(const attn_mha *m, const mha_shapes *s, const attn_tensor *query,
                        const attn_tensor *key, const attn_tensor *value, mha_work *w) {
    const int64_t N = s->N, L = s->L, Sx = s->S_ext, D = m->D;
    const bool seq_major = s->query.strides[0] < s->query.strides[1] && N > 1;
    w->seq_major = seq_major;
    w->fused_qkv = m->packed && Sx == s->S && same_view(query, key) && same_view(key, value);
    const int64_t width = w->fused_qkv ? 3 * D : D; /* columns per row of Q/K/V */
    w->qsN = seq_major ? width : L * width;
    w->qsT = seq_major ? N * width : width;
    w->ksN = seq_major ? width : Sx * width;
    w->ksT = seq_major ? N * width : width;
    w->osN = seq_major ? D : L * D;
    w->osT = seq_major ? N * D : D;
}

/* Allocates the buffers work_layout laid out; ATTN_ERR_NOMEM (everything
 * freed by work_free) when one fails. */
static attn_status work_alloc(const attn_mha *m, const mha_shapes *s, bool all_weights,
                              bool save, mha_work *w) {
    const int64_t N = s->N, L = s->L, Sx = s->S_ext, D = m->D, H = m->cfg.num_heads;
    const size_t es = attn_dtype_size(m->cfg.dtype);
    const int64_t qkv_elems = w->fused_qkv ? N * L * 3 * D : N * L * D + 2 * N * Sx * D;
    /* written whole before they are read (projections, the heads' outputs) */
    w->qkv = attn__work_alloc((size_t)qkv_elems, es, false);
    w->O = attn__work_alloc((size_t)(N * L * D), es, false);
    if (all_weights) w->W_all = attn__alloc_array((size_t)(N * H * L), (size_t)Sx * es);
    /* lse in float64 for either dtype: float32's rounding of it would move
     * every weight the backward recomputes from it */
    if (save) w->lse = attn__alloc_array((size_t)(N * H * L), sizeof(double));
    if (w->qkv == NULL || w->O == NULL || (all_weights && w->W_all == NULL) ||
        (save && w->lse == NULL))
        return ATTN_ERR_NOMEM;
    w->Q = w->qkv;
    if (w->fused_qkv) { /* column blocks of one row */
        w->K = w->qkv + (size_t)D * es;
        w->V = w->qkv + (size_t)(2 * D) * es;
    } else {
        w->K = w->qkv + (size_t)(N * L * D) * es;
        w->V = w->K + (size_t)(N * Sx * D) * es;
    }
    return ATTN_OK;
}

void attn__mha_work_free(mha_work *w) {
    attn__work_free(w->qkv);
    attn__work_free(w->O);
    attn__free(w->lse);
    attn__free(w->W_all);
    attn__free(w->am_pad_data);
    attn__free(w->kpm_pad_data);
}

/* ---- step 1: project ---- */

/* (mha.h) A bfloat16 module's products in bfloat16 dot products where the
 * kernel path has them, as PyTorch's bfloat16 linear layers run on such
 * CPUs; otherwise attn__gemm_abt (float16: on widened float32). */
attn_status attn__mha_gemm_abt(attn_dtype dt, int64_t m, int64_t n, int64_t k, const void *a,
                               int64_t lda, const void *w, const void *bias, void *y,
                               int64_t ldy, const volatile int *cancel) {
    if (dt != ATTN_DTYPE_BF16)
        return attn__gemm_abt(dt, m, n, k, a, lda, w, k, bias, y, ldy, cancel);
    const attn__ukernel *u = attn__ukernel_for(attn_get_isa());
    const attn__gemm_bf16 kern = {u->pack_qt_bf, u->qkt_bf, u->round_bf16_f};
    return attn__gemm_abt_bf16(&kern, m, n, k, a, lda, w, k, bias, y, ldy, cancel);
}

/*
 * Y[n, t, :] = X[n, t, :] · Wᵀ + bias for an (N, T, F) view X and a
 * contiguous W (Dout x F). Y is an (N, T, Dout) view with unit column
 * stride. One GEMM when the (n, t) rows of both X and Y walk memory with one
 * stride (in either order), otherwise one GEMM per batch; X is packed first
 * when BLAS cannot read it in place.
 */
static attn_status project(attn_dtype dt, const attn_tensor *x, const void *w, const void *bias,
                           int64_t dout, void *y, int64_t ysN, int64_t ysT,
                           const volatile int *cancel) {
    const int64_t N = x->shape[0], T = x->shape[1], F = x->shape[2];
    const size_t es = attn_dtype_size(dt);
    int64_t xsN = x->strides[0], xsT = x->strides[1];
    const char *xdata = x->data;
    void *packed = NULL;
    bool blas_readable = x->strides[2] == 1 && (T == 1 || xsT >= F) && xsN >= 0 && xsT >= 0 &&
                         (N == 1 || xsN >= F) && (T == 1 || attn__blas_fits(xsT)) &&
                         (N == 1 || attn__blas_fits(xsN)); /* leading dimensions are int */
    if (!blas_readable) {
        packed = attn__alloc_array((size_t)(N * T), (size_t)F * es);
        if (packed == NULL) return ATTN_ERR_NOMEM;
        attn__mha_copy_strided(x, packed, dt);
        xdata = packed;
        xsN = T * F;
        xsT = F;
    }
    attn_status st = ATTN_OK;
    if (N == 1 || (xsN * N == xsT && ysN * N == ysT && xsN >= F)) /* time-major rows */
        st = attn__mha_gemm_abt(dt, N * T, dout, F, xdata, N == 1 ? xsT : xsN, w, bias, y,
                                 N == 1 ? ysT : ysN, cancel);
    else if (xsT * T == xsN && ysT * T == ysN) /* batch-major rows */
        st = attn__mha_gemm_abt(dt, N * T, dout, F, xdata, xsT, w, bias, y, ysT, cancel);
    else
        for (int64_t n = 0; st == ATTN_OK && n < N; n++)
            st = attn__mha_gemm_abt(dt, T, dout, F, xdata + (size_t)(n * xsN) * es, xsT, w,
                                    bias, (char *)y + (size_t)(n * ysN) * es, ysT, cancel);
    attn__free(packed);
    return st;
}

/* Q (N, L, D), K and V (N, S, D) from the inputs: one GEMM of width 3D for
 * self-attention, else one per input with the matching rows of the packed
 * in_proj_weight (3D, E) or the separate q/k/v_proj_weight (D, F). */
static attn_status project_in(const attn_mha *m, const mha_shapes *s, const mha_work *w,
                              const volatile int *cancel) {
    const attn_dtype dt = m->cfg.dtype;
    const size_t es = attn_dtype_size(dt);
    const int64_t D = m->D, E = m->cfg.embed_dim;
    const char *w_all = attn__mha_param_data(m, m->packed ? "in_proj_weight" : "q_proj_weight");
    const char *b_all = attn__mha_param_data(m, "in_proj_bias"); /* (3D), or NULL */
    if (w->fused_qkv)
        return project(dt, &s->query, w_all, b_all, 3 * D, w->Q, w->qsN, w->qsT, cancel);
    const char *Wq = w_all, *Wk, *Wv;
    if (m->packed) {
        Wk = w_all + (size_t)(D * E) * es;
        Wv = w_all + (size_t)(2 * D * E) * es;
    } else {
        Wk = attn__mha_param_data(m, "k_proj_weight");
        Wv = attn__mha_param_data(m, "v_proj_weight");
    }
    const char *bq = b_all, *bk = b_all ? b_all + (size_t)D * es : NULL,
               *bv = b_all ? b_all + (size_t)(2 * D) * es : NULL;
    attn_status st = project(dt, &s->query, Wq, bq, D, w->Q, w->qsN, w->qsT, cancel);
    if (st == ATTN_OK) st = project(dt, &s->key, Wk, bk, D, w->K, w->ksN, w->ksT, cancel);
    if (st == ATTN_OK) st = project(dt, &s->value, Wv, bv, D, w->V, w->ksN, w->ksT, cancel);
    return st;
}

/* K and V grow from S to S_ext rows per batch: bias_k / bias_v, then a zero
 * row (per head, as every head reads its slice of it). */
static void append_kv_rows(const attn_mha *m, const mha_shapes *s, const mha_work *w) {
    const size_t es = attn_dtype_size(m->cfg.dtype), row_bytes = (size_t)m->D * es;
    const void *bias_k = attn__mha_param_data(m, "bias_k"); /* (1, 1, D), or NULL */
    const void *bias_v = attn__mha_param_data(m, "bias_v");
    for (int64_t n = 0; n < s->N; n++) {
        size_t row = (size_t)(n * w->ksN + s->S * w->ksT) * es;
        if (m->cfg.add_bias_kv) {
            memcpy(w->K + row, bias_k, row_bytes);
            memcpy(w->V + row, bias_v, row_bytes);
            row += (size_t)w->ksT * es;
        }
        if (m->cfg.add_zero_attn) {
            memset(w->K + row, 0, row_bytes);
            memset(w->V + row, 0, row_bytes);
        }
    }
}

/* ---- the masks over the appended keys ---- */

/* A padded copy of an MHA mask whose last dimension grows from S to S_ext
 * (extra columns allowed), with the causal triangle folded in when asked;
 * used only with add_bias_kv / add_zero_attn, where torch pads the masks and
 * the appended keys stay visible to every query. `m` may be NULL (causal
 * only). The copy keeps MHA polarity: bool true = masked out. */
static attn_status pad_mask(const attn_tensor *m, int64_t L, int64_t S, int64_t S_ext,
                            bool causal, attn_tensor *out) {
    attn_tensor src;
    int64_t shape[ATTN_MAX_RANK];
    if (m != NULL) {
        src = *m;
    } else {
        int64_t one[2] = {1, 1};
        static const unsigned char never = 0;
        attn_tensor_init(&src, (void *)&never, ATTN_DTYPE_BOOL, 2, one);
        src.strides[0] = src.strides[1] = 0;
        src.shape[0] = L;
        src.shape[1] = S;
    }
    memcpy(shape, src.shape, sizeof(int64_t) * (size_t)src.rank);
    shape[src.rank - 1] = S_ext;
    int64_t count = 1;
    for (int d = 0; d < src.rank; d++) count *= shape[d];
    void *data = attn__alloc_array((size_t)count, attn_dtype_size(src.dtype));
    if (data == NULL) return ATTN_ERR_NOMEM;
    attn_tensor_init(out, data, src.dtype, src.rank, shape);
    int64_t rows = count / S_ext, idx[ATTN_MAX_RANK] = {0};
    for (int64_t r = 0; r < rows; r++) {
        int64_t off = 0;
        for (int d = 0; d < src.rank - 1; d++) off += idx[d] * src.strides[d];
        int64_t i = src.rank >= 2 ? idx[src.rank - 2] : 0; /* query row */
        for (int64_t j = 0; j < S; j++) {
            double x = attn__load(src.data, src.dtype, off + j * src.strides[src.rank - 1]);
            bool hidden = causal && j > i;
            if (src.dtype == ATTN_DTYPE_BOOL)
                ((unsigned char *)data)[r * S_ext + j] = (x != 0.0) || hidden;
            else
                attn__store(data, src.dtype, r * S_ext + j, hidden ? -INFINITY : x);
        }
        for (int d = src.rank - 2; d >= 0; d--) {
            if (++idx[d] < src.shape[d]) break;
            idx[d] = 0;
        }
    }
    return ATTN_OK;
}

/* Padded copies of the masks, only when keys were appended (S_ext > S); the
 * causal rule then goes into the attn_mask copy, since it must not hide the
 * appended keys. */
static attn_status pad_masks(const mha_shapes *s, bool is_causal, mha_work *w) {
    attn_status st = ATTN_OK;
    if (s->S_ext == s->S) return ATTN_OK;
    if (w->am_use != NULL || is_causal) {
        st = pad_mask(w->am_use, s->L, s->S, s->S_ext, is_causal, &w->am_pad);
        w->am_pad_data = st == ATTN_OK ? w->am_pad.data : NULL;
        w->am_use = st == ATTN_OK ? &w->am_pad : NULL;
        w->causal_in_mask = true;
    }
    if (st == ATTN_OK && w->kpm_use != NULL) {
        st = pad_mask(w->kpm_use, 1, s->S, s->S_ext, false, &w->kpm_pad);
        w->kpm_pad_data = st == ATTN_OK ? w->kpm_pad.data : NULL;
        w->kpm_use = &w->kpm_pad;
    }
    return st;
}

/* ---- steps 2 and 3: split heads, attend ---- */

/* A (N, H, T, hd) view of a (N, T, D) buffer with strides (sN, sT, 1):
 * head h is columns h*hd .. h*hd + hd - 1. */
static void head_view(attn_tensor *t, void *data, attn_dtype dt, const int64_t shape[4],
                      int64_t sN, int64_t sT) {
    attn_tensor_init(t, data, dt, 4, shape);
    int64_t strides[4] = {sN, shape[3], sT, 1};
    memcpy(t->strides, strides, sizeof strides);
}

/* The weights as the problem writes them: all heads into W_all when they are
 * to be averaged, else straight into the caller's (N, H, L, S_ext) or
 * unbatched (H, L, S_ext) view, given a broadcast batch of 1. */
static void head_weights(const mha_shapes *s, const mha_work *w, attn_dtype dt, int64_t H,
                         const attn_tensor *weights, mha_heads *h) {
    h->weights = NULL;
    if (weights == NULL) return;
    if (w->W_all != NULL) {
        int64_t wshape[4] = {s->N, H, s->L, s->S_ext};
        attn_tensor_init(&h->w, w->W_all, dt, 4, wshape);
    } else {
        h->w = *weights;
        if (!s->batched) {
            h->w.rank = 4;
            for (int d = 3; d >= 1; d--) {
                h->w.shape[d] = weights->shape[d - 1];
                h->w.strides[d] = weights->strides[d - 1];
            }
            h->w.shape[0] = 1;
            h->w.strides[0] = 0;
        }
    }
    h->weights = &h->w;
}

void attn__mha_split_heads(const attn_mha *m, const mha_shapes *s, const mha_work *w,
                           const attn_tensor *weights, mha_heads *h) {
    const attn_dtype dt = m->cfg.dtype;
    const int64_t H = m->cfg.num_heads, hd = m->cfg.head_dim;
    const int64_t qshape[4] = {s->N, H, s->L, hd}, kshape[4] = {s->N, H, s->S_ext, hd};
    head_view(&h->q, w->Q, dt, qshape, w->qsN, w->qsT);
    head_view(&h->k, w->K, dt, kshape, w->ksN, w->ksT);
    head_view(&h->v, w->V, dt, kshape, w->ksN, w->ksT);
    head_view(&h->o, w->O, dt, qshape, w->osN, w->osT);
    head_weights(s, w, dt, H, weights, h);
    if (w->lse != NULL) {
        const int64_t lshape[3] = {s->N, H, s->L};
        attn_tensor_init(&h->lse, w->lse, ATTN_DTYPE_F64, 3, lshape);
    }
}

/* The problem request of O_h = softmax(Q_h K_hᵀ / sqrt(hd) + masks) V_h for
 * every (n, h); the backward builds the same one. torch MHA's bool masks say
 * true = masked out. */
void attn__mha_attend_request(const attn_mha *m, const attn_mha_forward_params *p,
                              const mha_work *w, mha_heads *h, attn__problem_request *r) {
    memset(r, 0, sizeof *r);
    r->q = &h->q;
    r->k = &h->k;
    r->v = &h->v;
    r->nmask = 2;
    r->mask[0] = w->am_use;
    r->mask_name[0] = "attn_mask";
    r->mask[1] = w->kpm_use;
    r->mask_name[1] = "key_padding_mask";
    r->mask_bool_keep[0] = r->mask_bool_keep[1] = 0;
    r->causal = p->is_causal && !w->causal_in_mask ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    r->has_scale = 1;
    r->scale = 1.0 / sqrt((double)m->cfg.head_dim);
    const double p_drop = p->has_dropout ? p->dropout : m->cfg.dropout;
    r->dropout_p = p->training ? p_drop : 0.0;
    r->seed = p->seed;
    r->rng_offset = p->rng_offset;
    r->out = &h->o;
    r->weights = h->weights;
    r->lse = w->lse != NULL ? &h->lse : NULL;
    r->lse_for_backward = false;
}

/* Runs every head's attention on the SDPA problem path. */
static attn_status attend(const attn_mha *m, const attn_mha_forward_params *p,
                          const mha_work *w, mha_heads *h) {
    attn__problem_request r;
    attn__mha_attend_request(m, p, w, h, &r);
    attn__problem problem;
    attn_status st = attn__problem_build(&problem, &r);
    if (st == ATTN_OK) st = attn__sdpa_execute(&problem);
    return st;
}

/* ---- steps 4 and 5: merge heads, project out ---- */

/* The heads of O side by side again: (N, H, L, hd) is (N, L, D) in memory. */
static attn_tensor merge_heads(const attn_mha *m, const mha_shapes *s, const mha_work *w) {
    attn_tensor o;
    int64_t shape[3] = {s->N, s->L, m->D};
    attn_tensor_init(&o, w->O, m->cfg.dtype, 3, shape);
    o.strides[0] = w->osN;
    o.strides[1] = w->osT;
    return o;
}

/* out = O·Woᵀ + bo, written straight into the caller's out when BLAS can
 * address it, else through a contiguous (N, L, E) buffer. */
static attn_status project_out(const attn_mha *m, const mha_shapes *s, const attn_tensor *o,
                               const attn_tensor *out, const volatile int *cancel) {
    const attn_dtype dt = m->cfg.dtype;
    const int64_t N = s->N, L = s->L, E = m->cfg.embed_dim;
    const attn_tensor outv = attn__mha_to_ntf(out, s->batched, s->batch_first);
    const void *Wo = attn__mha_param_data(m, "out_proj.weight"); /* (E, D) */
    const void *bo = attn__mha_param_data(m, "out_proj.bias");   /* (E), or NULL */
    bool direct = outv.strides[2] == 1 && outv.strides[0] >= 0 && outv.strides[1] >= 0 &&
                  (L == 1 || (outv.strides[1] >= E && attn__blas_fits(outv.strides[1]))) &&
                  (N == 1 || (outv.strides[0] >= E && attn__blas_fits(outv.strides[0])));
    if (direct)
        return project(dt, o, Wo, bo, E, out->data, outv.strides[0], outv.strides[1], cancel);
    void *tmp = attn__alloc_array((size_t)(N * L), (size_t)E * attn_dtype_size(dt));
    attn_status st = tmp ? project(dt, o, Wo, bo, E, tmp, L * E, E, cancel) : ATTN_ERR_NOMEM;
    if (st == ATTN_OK) attn__mha_copy_dense(tmp, &outv);
    attn__free(tmp);
    return st;
}

/* Mean over heads: (N, H, L, S) contiguous -> the caller's (N, L, S) view. */
static void average_heads(attn_dtype dt, const void *all, int64_t N, int64_t H, int64_t L,
                          int64_t S, const attn_tensor *w, bool batched) {
    const int64_t sN = batched ? w->strides[0] : 0, sL = w->strides[batched ? 1 : 0],
                  sS = w->strides[batched ? 2 : 1];
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < S; j++) {
                double sum = 0.0;
                for (int64_t h = 0; h < H; h++)
                    sum += attn__load(all, dt, ((n * H + h) * L + i) * S + j);
                attn__store(w->data, dt, n * sN + i * sL + j * sS, sum / (double)H);
            }
}

/* ---- the forward pass ---- */

/* Everything a call checks before it allocates or computes, in the order
 * the messages are given: params, inputs, outputs, masks, overlaps. */
static attn_status check_call(const attn_mha *m, const attn_tensor *query,
                              const attn_tensor *key, const attn_tensor *value,
                              const attn_mha_forward_params *user, attn_tensor *out,
                              attn_tensor *weights, attn_mha_forward_params *p, mha_shapes *s,
                              mha_work *w) {
    attn_status st = read_params(user, p);
    /* resolve_shapes lets a NULL value through for attn_mha_out_shapes,
     * which needs none; a forward reads it */
    if (st == ATTN_OK && value == NULL && query != NULL && key != NULL)
        st = attn__fail_arg(ATTN_ERR_NULL, "value", "value is NULL");
    if (st == ATTN_OK) st = attn__mha_resolve_shapes(m, p, query, key, value, s);
    if (st == ATTN_OK)
        st = check_outputs(m, s, p->average_attn_weights != 0, query, out, weights);
    if (st == ATTN_OK) st = mask_views(m, s, p, &w->am, &w->kpm);
    if (st == ATTN_OK) st = check_output_overlaps(m, query, key, value, p, out, weights);
    w->am_use = p->attn_mask != NULL ? &w->am : NULL;
    w->kpm_use = p->key_padding_mask != NULL ? &w->kpm : NULL;
    return st;
}

/* The masks the attention read, as owned dense copies in the work (padded
 * ones already are): a saved call holds no pointer to caller memory. */
static attn_status own_masks(mha_work *w) {
    attn_tensor *views[2] = {&w->am, &w->kpm}, *copies[2] = {&w->am_pad, &w->kpm_pad};
    const attn_tensor **uses[2] = {&w->am_use, &w->kpm_use};
    void **datas[2] = {&w->am_pad_data, &w->kpm_pad_data};
    for (int i = 0; i < 2; i++) {
        if (*uses[i] != views[i]) continue; /* absent, or a padded copy already */
        const attn_tensor *v = views[i];
        void *data = attn__alloc_array((size_t)attn_tensor_numel(v), attn_dtype_size(v->dtype));
        if (data == NULL) return ATTN_ERR_NOMEM;
        attn__mha_copy_strided(v, data, v->dtype);
        attn_tensor_init(copies[i], data, v->dtype, v->rank, v->shape);
        *datas[i] = data;
        *uses[i] = copies[i];
    }
    return ATTN_OK;
}

/* Moves the work into a new saved context (*saved), with what the backward
 * needs to rebuild this call: its options, shapes, and the caller's shapes. */
static attn_status save_call(const attn_mha *m, const attn_mha_forward_params *p,
                             const mha_shapes *s, const attn_tensor *const in[3], mha_work *w,
                             attn_mha_saved **saved) {
    attn_status st = own_masks(w);
    attn_mha_saved *c = st == ATTN_OK ? attn__alloc(sizeof *c) : NULL;
    if (c == NULL) return ATTN_ERR_NOMEM;
    memset(c, 0, sizeof *c);
    c->cfg = m->cfg;
    c->p = *p;
    c->p.attn_mask = c->p.key_padding_mask = NULL;
    c->s = *s;
    memset(&c->s.query, 0, 3 * sizeof c->s.query); /* views of caller memory */
    c->rank = in[0]->rank;
    for (int i = 0; i < 3; i++)
        memcpy(c->shape[i], in[i]->shape, sizeof(int64_t) * (size_t)c->rank);
    c->has_am = w->am_use != NULL;
    c->has_kpm = w->kpm_use != NULL;
    attn__free(w->W_all); /* the averaged weights are the caller's now */
    w->W_all = NULL;
    c->work = *w;
    c->work.am_use = c->work.kpm_use = NULL; /* pointed into w: rebuilt from has_* */
    memset(w, 0, sizeof *w);
    *saved = c;
    return ATTN_OK;
}

/* The forward pass; with `saved`, also the context of a backward. */
static attn_status forward_run(const attn_mha *m, const attn_tensor *query,
                               const attn_tensor *key, const attn_tensor *value,
                               const attn_mha_forward_params *params, attn_tensor *out,
                               attn_tensor *weights, attn_mha_saved **saved) {
    const volatile int *cancel = attn__cancel_flag();
    attn_mha_forward_params p;
    mha_shapes s;
    memset(&s, 0, sizeof s);
    mha_work w;
    memset(&w, 0, sizeof w);
    attn_status st = check_call(m, query, key, value, params, out, weights, &p, &s, &w);
    if (st != ATTN_OK) return st;
    const bool average = weights != NULL && p.average_attn_weights != 0;
    work_layout(m, &s, query, key, value, &w);
    st = work_alloc(m, &s, average, saved != NULL, &w);
    if (st == ATTN_OK) st = project_in(m, &s, &w, cancel);
    if (st == ATTN_OK) append_kv_rows(m, &s, &w);
    if (st == ATTN_OK) st = pad_masks(&s, p.is_causal != 0, &w);
    mha_heads h;
    if (st == ATTN_OK) {
        attn__mha_split_heads(m, &s, &w, weights, &h);
        st = attend(m, &p, &w, &h);
    }
    if (st == ATTN_OK) {
        const attn_tensor o = merge_heads(m, &s, &w);
        st = project_out(m, &s, &o, out, cancel);
    }
    if (st == ATTN_OK && average)
        average_heads(m->cfg.dtype, w.W_all, s.N, m->cfg.num_heads, s.L, s.S_ext, weights,
                      s.batched);
    if (st == ATTN_OK && saved != NULL) {
        const attn_tensor *const in[3] = {query, key, value};
        st = save_call(m, &p, &s, in, &w, saved);
    }
    attn__mha_work_free(&w);
    return st;
}

attn_status attn_mha_forward(const attn_mha *m, const attn_tensor *query, const attn_tensor *key,
                             const attn_tensor *value, const attn_mha_forward_params *params,
                             attn_tensor *out, attn_tensor *weights) {
    attn__clear_error();
    if (m == NULL) return attn__fail_arg(ATTN_ERR_NULL, "mha", "mha is NULL");
    return forward_run(m, query, key, value, params, out, weights, NULL);
}

attn_status attn_mha_forward_train(const attn_mha *m, const attn_tensor *query,
                                   const attn_tensor *key, const attn_tensor *value,
                                   const attn_mha_forward_params *params, attn_tensor *out,
                                   attn_tensor *weights, attn_mha_saved **saved) {
    attn__clear_error();
    if (saved == NULL) return attn__fail_arg(ATTN_ERR_NULL, "saved", "saved is NULL");
    *saved = NULL;
    if (m == NULL) return attn__fail_arg(ATTN_ERR_NULL, "mha", "mha is NULL");
    return forward_run(m, query, key, value, params, out, weights, saved);
}

void attn_mha_saved_destroy(attn_mha_saved *saved) {
    if (saved == NULL) return;
    attn__mha_work_free(&saved->work);
    attn__free(saved);
}
