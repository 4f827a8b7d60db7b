/*
 * backward.c — attn_mha_backward: the forward's five steps run backwards,
 * from dout (shaped like out) to the gradients of the inputs and of every
 * parameter. With R the rows of a (batch, time) set:
 *
 *   project out   dO = dout·Wo            (N, L, D)
 *                 dWo = doutᵀ·O (E, D),  dbo = Σ_rows dout
 *   attend        dQ, dK, dV from the SDPA backward of every head, which
 *                 recomputes the weights from the saved lse (and replays
 *                 dropout from the saved seed)
 *   bias_k/v      dbias_k = Σ_n dK[n, S],  dbias_v = Σ_n dV[n, S]; the zero
 *                 row of add_zero_attn is a constant and has no gradient
 *   project in    dWq = dQᵀ·Xq (D, E), dbq = Σ_rows dQ, and so for K, V
 *                 (their first S rows: the appended ones are not projections)
 *                 dquery = dQ·Wq, dkey = dK·Wk, dvalue = dV·Wv
 *
 * Every product is an attn__gemm tiled by shape and every sum runs in a
 * fixed order in float64, so the gradients do not depend on the thread
 * count. dquery, dkey and dvalue are separate gradients even when the
 * forward was given one tensor three times: the caller sums them.
 */
#include <string.h>

#include "../core/gemm.h"
#include "../sdpa/sdpa.h"
#include "mha.h"

/* ---- rows of (batch, time) matrices, as BLAS reads them ---- */

/* A (N, T, width) matrix with unit column stride: row (n, t) starts at
 * data + n*sN + t*sT elements. */
typedef struct rowmat {
    char *data;
    int64_t sN, sT, width;
} rowmat;

/* m's leading dimension when its N*T rows are one BLAS matrix in
 * time-major ((t, n)) or batch-major ((n, t)) order, or -1. */
static int64_t block_ld(const rowmat *m, int64_t N, int64_t T, bool time_major) {
    if (N == 1 && T == 1) return m->width;
    if (N == 1) return m->sT;
    if (T == 1) return m->sN;
    if (time_major) return m->sT == N * m->sN ? m->sN : -1;
    return m->sN == T * m->sT ? m->sT : -1;
}

/* Whether a and b are one BLAS matrix each with rows in the same order. */
static bool one_block(int64_t N, int64_t T, const rowmat *a, const rowmat *b, int64_t *la,
                      int64_t *lb) {
    for (int tm = 0; tm < 2; tm++) {
        *la = block_ld(a, N, T, tm);
        *lb = block_ld(b, N, T, tm);
        if (*la >= 0 && *lb >= 0) return true;
    }
    return false;
}

/* The row stride within one batch (one block of T rows). */
static int64_t row_ld(const rowmat *m, int64_t T) { return T == 1 ? m->width : m->sT; }

static char *block_of(const rowmat *m, int64_t n, size_t es) {
    return m->data + (size_t)(n * m->sN) * es;
}

/* A dense batch-major (N*T, width) copy of m's rows, or NULL (NOMEM). */
static char *dense_rows(const rowmat *m, int64_t N, int64_t T, size_t es) {
    char *d = attn__alloc_array((size_t)(N * T), (size_t)m->width * es);
    if (d != NULL)
        for (int64_t n = 0; n < N; n++)
            for (int64_t t = 0; t < T; t++)
                memcpy(d + (size_t)((n * T + t) * m->width) * es,
                       m->data + (size_t)(n * m->sN + t * m->sT) * es, (size_t)m->width * es);
    return d;
}

/* dW (g.width x x.width) = Σ_(n,t) g[n,t]ᵀ · x[n,t]: one GEMM over all rows
 * when their orders agree, else one per batch added in order n = 0, 1, ...
 * 16-bit rows in other orders are packed into one instead: each dW element
 * is then rounded once, not once per batch. */
static attn_status weight_grad(attn_dtype dt, int64_t N, int64_t T, const rowmat *g,
                               const rowmat *x, void *dw, const volatile int *cancel) {
    const size_t es = attn_dtype_size(dt);
    int64_t lg, lx;
    if (one_block(N, T, g, x, &lg, &lx))
        return attn__gemm(dt, true, false, g->width, x->width, N * T, g->data, lg, x->data, lx,
                          0.0, dw, x->width, cancel);
    if (attn__is_half(dt)) {
        char *gd = dense_rows(g, N, T, es), *xd = gd ? dense_rows(x, N, T, es) : NULL;
        attn_status st = ATTN_ERR_NOMEM;
        if (xd != NULL)
            st = attn__gemm(dt, true, false, g->width, x->width, N * T, gd, g->width, xd,
                            x->width, 0.0, dw, x->width, cancel);
        attn__free(xd);
        attn__free(gd);
        return st;
    }
    attn_status st = ATTN_OK;
    for (int64_t n = 0; st == ATTN_OK && n < N; n++)
        st = attn__gemm(dt, true, false, g->width, x->width, T, block_of(g, n, es),
                        row_ld(g, T), block_of(x, n, es), row_ld(x, T), n > 0 ? 1.0 : 0.0, dw,
                        x->width, cancel);
    return st;
}

/* y[n,t] = g[n,t] · W for a contiguous W (g.width x y.width). */
static attn_status input_grad(attn_dtype dt, int64_t N, int64_t T, const rowmat *g,
                              const void *w, const rowmat *y, const volatile int *cancel) {
    const size_t es = attn_dtype_size(dt);
    int64_t lg, ly;
    if (one_block(N, T, g, y, &lg, &ly))
        return attn__gemm(dt, false, false, N * T, y->width, g->width, g->data, lg, w, y->width,
                          0.0, y->data, ly, cancel);
    attn_status st = ATTN_OK;
    for (int64_t n = 0; st == ATTN_OK && n < N; n++)
        st = attn__gemm(dt, false, false, T, y->width, g->width, block_of(g, n, es),
                        row_ld(g, T), w, y->width, 0.0, block_of(y, n, es), row_ld(y, T),
                        cancel);
    return st;
}

/* Σ over the (n, t) rows of m, in that order, in float64, stored to out. */
static void col_sums(attn_dtype dt, int64_t N, int64_t T, const rowmat *m, double *acc,
                     void *out) {
    const size_t es = attn_dtype_size(dt);
    for (int64_t f = 0; f < m->width; f++) acc[f] = 0.0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < T; t++) {
            const char *row = m->data + (size_t)(n * m->sN + t * m->sT) * es;
            for (int64_t f = 0; f < m->width; f++) acc[f] += attn__load(row, dt, f);
        }
    for (int64_t f = 0; f < m->width; f++) attn__store(out, dt, f, acc[f]);
}

/* A caller's (N, T, F) view as a rowmat: itself when BLAS can address its
 * rows (unit columns, row strides >= F that fit an int), else a dense
 * batch-major buffer in *own — filled from the view for an input, to be
 * copied back (attn__mha_copy_dense) for an output. */
static attn_status caller_rows(const attn_tensor *v, bool input, rowmat *r, void **own) {
    const int64_t N = v->shape[0], T = v->shape[1], F = v->shape[2];
    const int64_t sN = v->strides[0], sT = v->strides[1];
    *own = NULL;
    const bool direct = (v->strides[2] == 1 || F == 1) &&
                        (T == 1 || (sT >= F && attn__blas_fits(sT))) &&
                        (N == 1 || (sN >= F && attn__blas_fits(sN)));
    if (direct) {
        *r = (rowmat){v->data, N == 1 ? 0 : sN, T == 1 ? 0 : sT, F};
        return ATTN_OK;
    }
    *own = attn__alloc_array((size_t)(N * T), (size_t)F * attn_dtype_size(v->dtype));
    if (*own == NULL) return ATTN_ERR_NOMEM;
    if (input) attn__mha_copy_strided(v, *own, v->dtype);
    *r = (rowmat){*own, T * F, F, F};
    return ATTN_OK;
}

/* ---- the call: its arguments, checked ---- */

typedef struct bwd_call {
    const attn_mha *m;
    const attn_mha_saved *sv;
    attn__mha_shapes s;     /* query, key, value as (N, T, F) views       */
    attn_tensor dout;       /* (N, L, E)                                  */
    attn_tensor dx[3];      /* dquery, dkey, dvalue as (N, T, F) views    */
    bool want[3];           /* which of them the caller asked for         */
    attn_mha *grads;        /* or NULL                                    */
} bwd_call;

static const char *const INPUT_NAMES[3] = {"query", "key", "value"};
static const char *const GRAD_NAMES[3] = {"dquery", "dkey", "dvalue"};

/* mha, saved and grads describe modules of one shape. */
static attn_status check_modules(const attn_mha *m, const attn_mha_saved *sv,
                                 const attn_mha *grads) {
    if (m == NULL) return attn__fail_arg(ATTN_ERR_NULL, "mha", "mha is NULL");
    if (sv == NULL) return attn__fail_arg(ATTN_ERR_NULL, "saved", "saved is NULL");
    if (!attn__mha_same_shape(&m->cfg, &sv->cfg))
        return attn__fail_arg(ATTN_ERR_INVALID, "saved",
                              "saved was made by attn_mha_forward_train on a module with "
                              "another configuration (embed_dim %lld, num_heads %lld, %s) than "
                              "mha (embed_dim %lld, num_heads %lld, %s)",
                              (long long)sv->cfg.embed_dim, (long long)sv->cfg.num_heads,
                              attn_dtype_name(sv->cfg.dtype), (long long)m->cfg.embed_dim,
                              (long long)m->cfg.num_heads, attn_dtype_name(m->cfg.dtype));
    if (grads == m)
        return attn__fail_arg(ATTN_ERR_INVALID, "grads",
                              "grads is mha itself: the gradients would overwrite the "
                              "parameters the backward reads; give a module of its own");
    if (grads != NULL && !attn__mha_same_shape(&m->cfg, &grads->cfg))
        return attn__fail_arg(ATTN_ERR_INVALID, "grads",
                              "grads must be a module made with mha's configuration (its "
                              "parameters receive the gradients); it has embed_dim %lld, "
                              "num_heads %lld, %s",
                              (long long)grads->cfg.embed_dim, (long long)grads->cfg.num_heads,
                              attn_dtype_name(grads->cfg.dtype));
    return ATTN_OK;
}

/* t (checked) has exactly `rank` and `shape`; else a message naming what
 * it should be like. */
static attn_status check_shape(const attn_tensor *t, const char *name, int rank,
                               const int64_t *shape, const char *like) {
    bool same = t->rank == rank;
    for (int d = 0; same && d < rank; d++) same = t->shape[d] == shape[d];
    if (same) return ATTN_OK;
    char got[160], want[160];
    return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has shape %s; expected %s, %s", name,
                          attn__shape_str(got, sizeof got, t->rank, t->shape),
                          attn__shape_str(want, sizeof want, rank, shape), like);
}

/* query, key and value are shaped as the forward that made `saved` saw
 * them; dout like the query. */
static attn_status check_inputs(bwd_call *c, const attn_tensor *const in[3],
                                const attn_tensor *dout) {
    const attn_mha_saved *sv = c->sv;
    for (int i = 0; i < 3; i++) /* resolve_shapes takes a NULL value as "none" */
        if (in[i] == NULL)
            return attn__fail_arg(ATTN_ERR_NULL, INPUT_NAMES[i], "%s is NULL", INPUT_NAMES[i]);
    attn_status st = attn__mha_resolve_shapes(c->m, &sv->p, in[0], in[1], in[2], &c->s);
    for (int i = 0; st == ATTN_OK && i < 3; i++)
        st = check_shape(in[i], INPUT_NAMES[i], sv->rank, sv->shape[i],
                         "the shape the forward saved in `saved` was given");
    if (st != ATTN_OK) return st;
    if (dout == NULL) return attn__fail_arg(ATTN_ERR_NULL, "dout", "dout is NULL");
    if ((st = attn__check_tensor(dout, "dout", 1, ATTN__INPUT)) != ATTN_OK) return st;
    if (dout->dtype != c->m->cfg.dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, "dout", "dout is %s; this module is %s",
                              attn_dtype_name(dout->dtype), attn_dtype_name(c->m->cfg.dtype));
    if ((st = check_shape(dout, "dout", in[0]->rank, in[0]->shape, "the shape of out")))
        return st;
    c->dout = attn__mha_to_ntf(dout, c->s.batched, c->s.batch_first);
    return ATTN_OK;
}

/* dquery, dkey, dvalue: optional outputs shaped like their inputs, sharing
 * no memory with what the backward reads or writes; grads' parameters, an
 * output too, none with the inputs. */
static attn_status check_grads(bwd_call *c, const attn_tensor *const in[3],
                               const attn_tensor *dout, attn_tensor *const d[3]) {
    attn_status st = ATTN_OK;
    attn_tensor params = attn__mha_storage_view(c->m), gparams;
    if (c->grads != NULL) gparams = attn__mha_storage_view(c->grads);
    const attn_tensor *reads[6] = {in[0], in[1], in[2], dout, &params,
                                   c->grads ? &gparams : NULL};
    const char *read_names[6] = {"query", "key", "value", "dout", "mha's parameters",
                                 "grads' parameters"};
    for (int i = 0; i < 3; i++) {
        c->want[i] = d[i] != NULL;
        if (d[i] == NULL) continue;
        const char *name = GRAD_NAMES[i];
        if ((st = attn__check_tensor(d[i], name, 1, ATTN__OUTPUT)) != ATTN_OK) return st;
        if (d[i]->dtype != c->m->cfg.dtype)
            return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; this module is %s", name,
                                  attn_dtype_name(d[i]->dtype),
                                  attn_dtype_name(c->m->cfg.dtype));
        if ((st = check_shape(d[i], name, in[i]->rank, in[i]->shape, "the shape of its input")) ||
            (st = attn__check_output_layout(d[i], name)))
            return st;
        for (int r = 0; r < 6; r++)
            if (attn__views_overlap(d[i], reads[r]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, name,
                                      "%s overlaps %s in memory: give it a buffer of its own",
                                      name, read_names[r]);
        for (int j = 0; j < i; j++)
            if (attn__views_overlap(d[i], d[j]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, name, "%s and %s overlap in memory",
                                      GRAD_NAMES[j], name);
        c->dx[i] = attn__mha_to_ntf(d[i], c->s.batched, c->s.batch_first);
    }
    for (int r = 0; c->grads != NULL && r < 4; r++) /* query, key, value, dout */
        if (attn__views_overlap(&gparams, reads[r]))
            return attn__fail_arg(ATTN_ERR_OVERLAP, "grads",
                                  "grads' parameters overlap %s in memory: the gradients would "
                                  "overwrite what they are computed from",
                                  read_names[r]);
    return ATTN_OK;
}

/* ---- the workspace ---- */

typedef struct bwd_work {
    attn__mha_work fwd;  /* the saved buffers, its mask pointers rebuilt        */
    attn__mha_work grad; /* dQ, dK, dV, dO laid out like Q, K, V, O (width D)   */
    void *dq, *dk, *dv;  /* (N, L, D), (N, S_ext, D) x 2, or NULL: not needed   */
    void *dO;            /* (N, L, D)                                           */
    rowmat dout;         /* (N, L, E): the caller's, or dout_own                */
    void *dout_own;
    double *acc;         /* column sums: max(E, D) entries                      */
} bwd_work;

static attn_status work_alloc(const bwd_call *c, bwd_work *b) {
    const attn_mha *m = c->m;
    const attn__mha_shapes *s = &c->sv->s;
    const int64_t N = s->N, L = s->L, Sx = s->S_ext, D = m->D, E = m->cfg.embed_dim;
    const size_t row = (size_t)D * attn_dtype_size(m->cfg.dtype);
    const bool all = c->grads != NULL;
    b->fwd = c->sv->work;
    b->fwd.am_use = c->sv->has_am ? &b->fwd.am_pad : NULL;
    b->fwd.kpm_use = c->sv->has_kpm ? &b->fwd.kpm_pad : NULL;
    /* Zeroed: the rows of appended keys get gradients too, read or not. */
    b->dO = attn__work_alloc((size_t)(N * L), row, true);
    if (c->want[0] || all) b->dq = attn__work_alloc((size_t)(N * L), row, true);
    if (c->want[1] || all) b->dk = attn__work_alloc((size_t)(N * Sx), row, true);
    if (c->want[2] || all) b->dv = attn__work_alloc((size_t)(N * Sx), row, true);
    b->acc = attn__alloc_array((size_t)(E > D ? E : D), sizeof(double));
    if (b->dO == NULL || b->acc == NULL || ((c->want[0] || all) && b->dq == NULL) ||
        ((c->want[1] || all) && b->dk == NULL) || ((c->want[2] || all) && b->dv == NULL))
        return ATTN_ERR_NOMEM;
    attn__mha_work *g = &b->grad; /* the layout of the forward's, at width D */
    memset(g, 0, sizeof *g);
    g->seq_major = b->fwd.seq_major;
    g->qsN = g->seq_major ? D : L * D;
    g->qsT = g->seq_major ? N * D : D;
    g->ksN = g->seq_major ? D : Sx * D;
    g->ksT = g->seq_major ? N * D : D;
    g->osN = b->fwd.osN;
    g->osT = b->fwd.osT;
    g->Q = b->dq;
    g->K = b->dk;
    g->V = b->dv;
    g->O = b->dO;
    return caller_rows(&c->dout, true, &b->dout, &b->dout_own);
}

static void work_free(bwd_work *b) {
    attn__work_free(b->dq);
    attn__work_free(b->dk);
    attn__work_free(b->dv);
    attn__work_free(b->dO);
    attn__free(b->dout_own);
    attn__free(b->acc);
}

/* ---- the steps, last forward step first ---- */

/* dO = dout·Wo; dWo = doutᵀ·O, dbo = Σ dout into grads. */
static attn_status project_out_backward(const bwd_call *c, bwd_work *b,
                                        const volatile int *cancel) {
    const attn_mha *m = c->m;
    const attn_dtype dt = m->cfg.dtype;
    const int64_t N = c->sv->s.N, L = c->sv->s.L, D = m->D;
    const rowmat O = {b->fwd.O, b->fwd.osN, b->fwd.osT, D};
    const rowmat dO = {b->dO, b->fwd.osN, b->fwd.osT, D};
    attn_status st = input_grad(dt, N, L, &b->dout, attn__mha_param_data(m, "out_proj.weight"),
                                &dO, cancel);
    if (st != ATTN_OK || c->grads == NULL) return st;
    st = weight_grad(dt, N, L, &b->dout, &O, attn__mha_param_data(c->grads, "out_proj.weight"),
                     cancel);
    void *dbo = attn__mha_param_data(c->grads, "out_proj.bias"); /* (E), or NULL */
    if (st == ATTN_OK && dbo != NULL) col_sums(dt, N, L, &b->dout, b->acc, dbo);
    return st;
}

/* dQ, dK, dV of every head: the SDPA backward of the forward's own problem
 * (same masks, causality, scale and dropout stream), from the saved O and
 * lse. */
static attn_status attend_backward(const bwd_call *c, bwd_work *b) {
    attn__mha_heads h, gh;
    attn__mha_split_heads(c->m, &c->sv->s, &b->fwd, NULL, &h);
    attn__mha_split_heads(c->m, &c->sv->s, &b->grad, NULL, &gh);
    attn__problem_request r;
    attn__mha_attend_request(c->m, &c->sv->p, &b->fwd, &h, &r);
    const attn__backward_request g = {&gh.o, &h.o, &h.lse,
                                      b->dq ? &gh.q : NULL, b->dk ? &gh.k : NULL,
                                      b->dv ? &gh.v : NULL, NULL, 0};
    attn__problem p;
    attn_status st = attn__problem_build_backward(&p, &r, &g);
    if (st == ATTN_OK) st = attn__sdpa_backward_execute(&p);
    return st;
}

/* The projection weight of input i (0 query, 1 key, 2 value): its rows of
 * in_proj_weight, or q/k/v_proj_weight. */
static char *proj_weight(const attn_mha *m, int i) {
    static const char *const names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
    if (!m->packed) return attn__mha_param_data(m, names[i]);
    char *w = attn__mha_param_data(m, "in_proj_weight"); /* (3D, E) */
    return w + (size_t)(i * m->D * m->cfg.embed_dim) * attn_dtype_size(m->cfg.dtype);
}

/* Input i's projection backwards: dW_i = G_iᵀ·X_i and db_i = Σ G_i into
 * grads, d(input) = G_i·W_i into the caller's gradient. G_i is dQ, dK or dV
 * over the T real rows of each batch (not the appended keys). */
static attn_status project_in_backward(const bwd_call *c, bwd_work *b, int i,
                                       const volatile int *cancel) {
    const attn_mha *m = c->m;
    const attn_dtype dt = m->cfg.dtype;
    const attn__mha_work *g = &b->grad;
    const int64_t N = c->sv->s.N, T = i == 0 ? c->sv->s.L : c->sv->s.S, D = m->D;
    const rowmat G = {i == 0 ? g->Q : i == 1 ? g->K : g->V, i == 0 ? g->qsN : g->ksN,
                      i == 0 ? g->qsT : g->ksT, D};
    const attn_tensor *x = i == 0 ? &c->s.query : i == 1 ? &c->s.key : &c->s.value;
    rowmat X, Y;
    void *own = NULL;
    attn_status st = ATTN_OK;
    if (c->grads != NULL) {
        st = caller_rows(x, true, &X, &own);
        if (st == ATTN_OK) st = weight_grad(dt, N, T, &G, &X, proj_weight(c->grads, i), cancel);
        attn__free(own);
        own = NULL;
        char *db = attn__mha_param_data(c->grads, "in_proj_bias"); /* (3D), or NULL */
        if (st == ATTN_OK && db != NULL)
            col_sums(dt, N, T, &G, b->acc, db + (size_t)(i * D) * attn_dtype_size(dt));
    }
    if (st != ATTN_OK || !c->want[i]) return st;
    st = caller_rows(&c->dx[i], false, &Y, &own);
    if (st == ATTN_OK) st = input_grad(dt, N, T, &G, proj_weight(m, i), &Y, cancel);
    if (st == ATTN_OK && own != NULL) attn__mha_copy_dense(own, &c->dx[i]);
    attn__free(own);
    return st;
}

/* dbias_k = Σ_n dK[n, S], dbias_v = Σ_n dV[n, S]: the appended row. */
static void bias_kv_backward(const bwd_call *c, bwd_work *b) {
    const attn_mha *m = c->m;
    const attn_dtype dt = m->cfg.dtype;
    const size_t es = attn_dtype_size(dt);
    const attn__mha_work *g = &b->grad;
    const int64_t S = c->sv->s.S;
    const rowmat dk = {g->K + (size_t)(S * g->ksT) * es, g->ksN, 0, m->D};
    const rowmat dv = {g->V + (size_t)(S * g->ksT) * es, g->ksN, 0, m->D};
    col_sums(dt, c->sv->s.N, 1, &dk, b->acc, attn__mha_param_data(c->grads, "bias_k"));
    col_sums(dt, c->sv->s.N, 1, &dv, b->acc, attn__mha_param_data(c->grads, "bias_v"));
}

attn_status attn_mha_backward(const attn_mha *m, const attn_mha_saved *saved,
                              const attn_tensor *query, const attn_tensor *key,
                              const attn_tensor *value, const attn_tensor *dout,
                              attn_tensor *dquery, attn_tensor *dkey, attn_tensor *dvalue,
                              attn_mha *grads) {
    attn__clear_error();
    bwd_call c;
    memset(&c, 0, sizeof c);
    const attn_tensor *const in[3] = {query, key, value};
    attn_tensor *const d[3] = {dquery, dkey, dvalue};
    attn_status st = check_modules(m, saved, grads);
    c.m = m;
    c.sv = saved;
    c.grads = grads;
    if (st == ATTN_OK) st = check_inputs(&c, in, dout);
    if (st == ATTN_OK) st = check_grads(&c, in, dout, d);
    if (st != ATTN_OK || (!c.want[0] && !c.want[1] && !c.want[2] && grads == NULL)) return st;
    const volatile int *cancel = attn__cancel_flag();
    bwd_work b;
    memset(&b, 0, sizeof b);
    st = work_alloc(&c, &b);
    if (st == ATTN_OK) st = project_out_backward(&c, &b, cancel);
    if (st == ATTN_OK) st = attend_backward(&c, &b);
    if (st == ATTN_OK && grads != NULL && m->cfg.add_bias_kv) bias_kv_backward(&c, &b);
    for (int i = 0; st == ATTN_OK && i < 3; i++) st = project_in_backward(&c, &b, i, cancel);
    work_free(&b);
    return st;
}
