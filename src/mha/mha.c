/*
 * mha.c — torch.nn.MultiheadAttention on top of the SDPA planner.
 *
 * Heads are never copied apart: the projections write (batch, time, D)
 * buffers, and each head is a strided view into them, so SDPA reads
 * Q_h, K_h, V_h and writes O_h in place. D = num_heads * head_dim.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../core/gemm.h"
#include "../core/internal.h"
#include "../sdpa/sdpa.h"

enum { MAX_PARAMS = 8 };

typedef struct mha_param {
    const char *name;
    int rank;
    int64_t shape[3];
    int64_t offset; /* elements into storage */
} mha_param;

struct attn_mha {
    attn_mha_config cfg; /* derived fields filled in */
    int64_t D;           /* num_heads * head_dim */
    bool packed;         /* one in_proj_weight (kdim == vdim == embed_dim) */
    int nparam;
    mha_param param[MAX_PARAMS];
    void *storage;
};

/* ---- configuration ---- */

void attn_mha_config_init(attn_mha_config *c, int64_t embed_dim, int64_t num_heads) {
    if (c == NULL) return;
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->embed_dim = embed_dim;
    c->num_heads = num_heads;
    c->bias = 1;
    c->dtype = ATTN_DTYPE_F32;
}

static attn_status resolve_config(const attn_mha_config *in, attn_mha_config *c) {
    if (in == NULL) return attn__fail(ATTN_ERR_NULL, "config is NULL");
    *c = *in;
    if (c->embed_dim < 1)
        return attn__fail(ATTN_ERR_INVALID, "embed_dim is %lld; it must be >= 1",
                          (long long)c->embed_dim);
    if (c->num_heads < 1)
        return attn__fail(ATTN_ERR_INVALID, "num_heads is %lld; it must be >= 1",
                          (long long)c->num_heads);
    if (c->head_dim < 0 || c->kdim < 0 || c->vdim < 0)
        return attn__fail(ATTN_ERR_INVALID, "head_dim, kdim and vdim must be >= 0 (0 = default)");
    if (c->head_dim == 0) {
        if (c->embed_dim % c->num_heads != 0)
            return attn__fail(
                ATTN_ERR_SHAPE,
                "embed_dim %lld is not divisible by num_heads %lld: the heads are an even "
                "split of the embedding features (each head gets embed_dim / num_heads of "
                "them), so %lld features cannot make %lld equal heads. Choose num_heads "
                "dividing embed_dim, or give head_dim explicitly to project to num_heads * "
                "head_dim features",
                (long long)c->embed_dim, (long long)c->num_heads, (long long)c->embed_dim,
                (long long)c->num_heads);
        c->head_dim = c->embed_dim / c->num_heads;
    }
    if (c->kdim == 0) c->kdim = c->embed_dim;
    if (c->vdim == 0) c->vdim = c->embed_dim;
    if (!(c->dropout >= 0.0 && c->dropout <= 1.0))
        return attn__fail(ATTN_ERR_INVALID, "dropout is %g; expected a probability in [0, 1]",
                          c->dropout);
    if (!attn__is_float(c->dtype))
        return attn__fail(ATTN_ERR_DTYPE, "dtype is %s; expected float32 or float64",
                          attn_dtype_name(c->dtype));
    int64_t D, w;
    if (attn__mul_overflows(c->num_heads, c->head_dim, &D) || !attn__blas_fits(D) ||
        !attn__blas_fits(c->embed_dim) || !attn__blas_fits(c->kdim) ||
        !attn__blas_fits(c->vdim) || attn__mul_overflows(3 * D, c->embed_dim + c->kdim + c->vdim, &w))
        return attn__fail(ATTN_ERR_OVERFLOW, "the projection sizes are too large");
    c->bias = c->bias != 0;
    c->add_bias_kv = c->add_bias_kv != 0;
    c->add_zero_attn = c->add_zero_attn != 0;
    c->batch_first = c->batch_first != 0;
    return ATTN_OK;
}

static void add_param(attn_mha *m, const char *name, int rank, int64_t d0, int64_t d1,
                      int64_t d2, int64_t *offset) {
    mha_param *p = &m->param[m->nparam++];
    p->name = name;
    p->rank = rank;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->shape[2] = d2;
    p->offset = *offset;
    int64_t n = 1;
    for (int i = 0; i < rank; i++) n *= p->shape[i];
    *offset += n;
}

static const mha_param *find_param(const attn_mha *m, const char *name) {
    for (int i = 0; i < m->nparam; i++)
        if (strcmp(m->param[i].name, name) == 0) return &m->param[i];
    return NULL;
}

static void *param_data(const attn_mha *m, const mha_param *p) {
    return (char *)m->storage + (size_t)p->offset * attn_dtype_size(m->cfg.dtype);
}

/* ---- initialisation, as torch's _reset_parameters draws it ---- */

typedef struct init_rng {
    uint64_t seed, counter;
} init_rng;

static double uniform01(init_rng *r) { /* (0, 1), 53 bits */
    uint32_t ctr[4] = {(uint32_t)r->counter, (uint32_t)(r->counter >> 32), 0x6d6861u, 0};
    uint32_t key[2] = {(uint32_t)r->seed, (uint32_t)(r->seed >> 32)}, out[4];
    r->counter++;
    attn__philox4x32_10(ctr, key, out);
    uint64_t bits = ((uint64_t)out[0] << 21) ^ (out[1] >> 11);
    return ((double)(bits & ((1ull << 53) - 1)) + 0.5) / 9007199254740992.0;
}

static void fill_uniform(attn_mha *m, const mha_param *p, double bound, init_rng *r) {
    int64_t n = p->shape[0] * (p->rank > 1 ? p->shape[1] : 1) * (p->rank > 2 ? p->shape[2] : 1);
    for (int64_t i = 0; i < n; i++)
        attn__store(param_data(m, p), m->cfg.dtype, i, (2.0 * uniform01(r) - 1.0) * bound);
}

static void fill_normal(attn_mha *m, const mha_param *p, double std, init_rng *r) {
    int64_t n = p->shape[0] * (p->rank > 1 ? p->shape[1] : 1) * (p->rank > 2 ? p->shape[2] : 1);
    for (int64_t i = 0; i < n; i++) { /* Box-Muller */
        double u = uniform01(r), v = uniform01(r);
        attn__store(param_data(m, p), m->cfg.dtype, i,
                    std * sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
    }
}

static void reset_parameters(attn_mha *m) {
    init_rng r = {m->cfg.init_seed, 0};
    /* storage is zeroed: the biases stay 0, as torch sets them. */
    for (int i = 0; i < m->nparam; i++) {
        const mha_param *p = &m->param[i];
        if (strcmp(p->name, "out_proj.weight") == 0) /* Linear: kaiming_uniform(a=sqrt 5) */
            fill_uniform(m, p, 1.0 / sqrt((double)p->shape[1]), &r);
        else if (strstr(p->name, "_weight") != NULL) /* xavier_uniform */
            fill_uniform(m, p, sqrt(6.0 / (double)(p->shape[0] + p->shape[1])), &r);
        else if (strncmp(p->name, "bias_", 5) == 0) /* xavier_normal on (1, 1, D) */
            fill_normal(m, p, sqrt(2.0 / (double)(2 * p->shape[2])), &r);
    }
}

/* ---- create / destroy / parameters ---- */

attn_status attn_mha_create(const attn_mha_config *config, attn_mha **out) {
    attn__clear_error();
    if (out == NULL) return attn__fail(ATTN_ERR_NULL, "mha (the out-parameter) is NULL");
    *out = NULL;
    attn_mha_config c;
    attn_status st = resolve_config(config, &c);
    if (st != ATTN_OK) return st;
    attn_mha *m = attn__alloc_array(1, sizeof *m);
    if (m == NULL) return ATTN_ERR_NOMEM;
    m->cfg = c;
    m->D = c.num_heads * c.head_dim;
    m->packed = c.kdim == c.embed_dim && c.vdim == c.embed_dim;
    const int64_t D = m->D, E = c.embed_dim;
    int64_t n = 0;
    if (m->packed) {
        add_param(m, "in_proj_weight", 2, 3 * D, E, 0, &n);
    } else {
        add_param(m, "q_proj_weight", 2, D, E, 0, &n);
        add_param(m, "k_proj_weight", 2, D, c.kdim, 0, &n);
        add_param(m, "v_proj_weight", 2, D, c.vdim, 0, &n);
    }
    if (c.bias) add_param(m, "in_proj_bias", 1, 3 * D, 0, 0, &n);
    if (c.add_bias_kv) {
        add_param(m, "bias_k", 3, 1, 1, D, &n);
        add_param(m, "bias_v", 3, 1, 1, D, &n);
    }
    add_param(m, "out_proj.weight", 2, E, D, 0, &n);
    if (c.bias) add_param(m, "out_proj.bias", 1, E, 0, 0, &n);
    m->storage = attn__alloc_array((size_t)n, attn_dtype_size(c.dtype));
    if (m->storage == NULL) {
        attn__free(m);
        return ATTN_ERR_NOMEM;
    }
    reset_parameters(m);
    *out = m;
    return ATTN_OK;
}

void attn_mha_destroy(attn_mha *m) {
    if (m == NULL) return;
    attn__free(m->storage);
    attn__free(m);
}

attn_status attn_mha_get_config(const attn_mha *m, attn_mha_config *config) {
    attn__clear_error();
    if (m == NULL || config == NULL)
        return attn__fail(ATTN_ERR_NULL, "%s is NULL", m == NULL ? "mha" : "config");
    *config = m->cfg;
    return ATTN_OK;
}

int attn_mha_param_count(const attn_mha *m) { return m == NULL ? 0 : m->nparam; }

static void param_view(attn_mha *m, const mha_param *p, attn_tensor *view) {
    int64_t shape[3] = {p->shape[0], p->shape[1], p->shape[2]};
    attn_tensor_init(view, param_data(m, p), m->cfg.dtype, p->rank, shape);
}

attn_status attn_mha_param_at(attn_mha *m, int index, const char **name, attn_tensor *view) {
    attn__clear_error();
    if (m == NULL) return attn__fail(ATTN_ERR_NULL, "mha is NULL");
    if (index < 0 || index >= m->nparam)
        return attn__fail(ATTN_ERR_INVALID, "parameter index %d is outside 0..%d", index,
                          m->nparam - 1);
    if (name != NULL) *name = m->param[index].name;
    if (view != NULL) param_view(m, &m->param[index], view);
    return ATTN_OK;
}

static attn_status unknown_param(const attn_mha *m, const char *name) {
    char names[256] = "";
    for (int i = 0; i < m->nparam; i++) {
        strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
        strncat(names, m->param[i].name, sizeof names - strlen(names) - 1);
    }
    return attn__fail(ATTN_ERR_INVALID, "this module has no parameter '%s'; it has: %s", name,
                      names);
}

attn_status attn_mha_param(attn_mha *m, const char *name, attn_tensor *view) {
    attn__clear_error();
    if (m == NULL || name == NULL || view == NULL)
        return attn__fail(ATTN_ERR_NULL, "%s is NULL",
                          m == NULL ? "mha" : name == NULL ? "name" : "view");
    const mha_param *p = find_param(m, name);
    if (p == NULL) return unknown_param(m, name);
    param_view(m, p, view);
    return ATTN_OK;
}

/* Copies any strided tensor into a contiguous destination of the same shape,
 * converting float32 <-> float64. */
static void copy_strided(const attn_tensor *src, void *dst, attn_dtype dst_dtype) {
    int64_t n = attn_tensor_numel(src), idx[ATTN_MAX_RANK] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        for (int d = 0; d < src->rank; d++) off += idx[d] * src->strides[d];
        attn__store(dst, dst_dtype, i, attn__load(src->data, src->dtype, off));
        for (int d = src->rank - 1; d >= 0; d--) {
            if (++idx[d] < src->shape[d]) break;
            idx[d] = 0;
        }
    }
}

attn_status attn_mha_set_param(attn_mha *m, const char *name, const attn_tensor *src) {
    attn__clear_error();
    if (m == NULL || name == NULL)
        return attn__fail(ATTN_ERR_NULL, "%s is NULL", m == NULL ? "mha" : "name");
    const mha_param *p = find_param(m, name);
    if (p == NULL) return unknown_param(m, name);
    attn_status st = attn__check_tensor(src, name, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (!attn__is_float(src->dtype))
        return attn__fail(ATTN_ERR_DTYPE, "%s is %s; expected float32 or float64", name,
                          attn_dtype_name(src->dtype));
    bool same = src->rank == p->rank;
    for (int d = 0; same && d < p->rank; d++) same = src->shape[d] == p->shape[d];
    if (!same) {
        char want[96], got[160];
        return attn__fail(ATTN_ERR_SHAPE, "%s has shape %s; this module expects %s", name,
                          attn__shape_str(got, sizeof got, src->rank, src->shape),
                          attn__shape_str(want, sizeof want, p->rank, p->shape));
    }
    copy_strided(src, param_data(m, p), m->cfg.dtype);
    return ATTN_OK;
}

/* ---- forward ---- */

void attn_mha_forward_params_init(attn_mha_forward_params *p) {
    if (p == NULL) return;
    memset(p, 0, sizeof *p);
    p->struct_size = sizeof *p;
    p->average_attn_weights = 1;
    p->batch_first = -1;
}

/* The shapes of one forward call, all in (batch, time, features) order. */
typedef struct mha_shapes {
    bool batched;
    int64_t N, L, S, S_ext; /* S_ext = S + add_bias_kv + add_zero_attn */
    attn_tensor query, key, value; /* rank-3 (N, T, F) views */
} mha_shapes;

/* A rank-3 (N, T, F) view of a batched (T, N, F)/(N, T, F) or unbatched
 * (T, F) tensor. Unbatched inputs get a broadcast batch of 1. */
static attn_tensor to_ntf(const attn_tensor *t, bool batched, bool batch_first) {
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
        return attn__fail(ATTN_ERR_SHAPE,
                          "%s has rank %d; expected %d like the query (%s)", name, t->rank,
                          rank, rank == 3 ? "batched" : "unbatched");
    if (t->dtype != m->cfg.dtype)
        return attn__fail(ATTN_ERR_DTYPE, "%s is %s; this module is %s", name,
                          attn_dtype_name(t->dtype), attn_dtype_name(m->cfg.dtype));
    if (t->shape[rank - 1] != features)
        return attn__fail(ATTN_ERR_SHAPE, "%s.shape[-1] is %lld; expected %s = %lld", name,
                          (long long)t->shape[rank - 1], feature_name, (long long)features);
    return ATTN_OK;
}

static attn_status resolve_shapes(const attn_mha *m, const attn_tensor *query,
                                  const attn_tensor *key, const attn_tensor *value,
                                  mha_shapes *s) {
    const attn_mha_config *c = &m->cfg;
    attn_status st = attn__check_tensor(query, "query", 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (query->rank != 2 && query->rank != 3)
        return attn__fail(ATTN_ERR_SHAPE,
                          "query has rank %d; expected 3 (batched) or 2 (unbatched)",
                          query->rank);
    int rank = query->rank;
    if ((st = check_input(m, query, "query", rank, c->embed_dim, "embed_dim")) != ATTN_OK ||
        (st = check_input(m, key, "key", rank, c->kdim, "kdim")) != ATTN_OK ||
        (value != NULL &&
         (st = check_input(m, value, "value", rank, c->vdim, "vdim")) != ATTN_OK))
        return st;
    s->batched = rank == 3;
    s->query = to_ntf(query, s->batched, c->batch_first);
    s->key = to_ntf(key, s->batched, c->batch_first);
    if (value != NULL) s->value = to_ntf(value, s->batched, c->batch_first);
    s->N = s->query.shape[0];
    s->L = s->query.shape[1];
    s->S = s->key.shape[1];
    if (value == NULL && s->key.shape[0] != s->N) /* attn_mha_out_shapes: no value */
        return attn__fail(ATTN_ERR_SHAPE,
                          "query and key must have the same batch size; got %lld and %lld "
                          "(batch_first=%d)",
                          (long long)s->N, (long long)s->key.shape[0], c->batch_first);
    if (value != NULL && (s->key.shape[0] != s->N || s->value.shape[0] != s->N))
        return attn__fail(ATTN_ERR_SHAPE,
                          "query, key and value must have the same batch size; got %lld, "
                          "%lld and %lld (batch_first=%d)",
                          (long long)s->N, (long long)s->key.shape[0],
                          (long long)s->value.shape[0], c->batch_first);
    if (value != NULL && s->value.shape[1] != s->S)
        return attn__fail(ATTN_ERR_SHAPE,
                          "key has %lld positions but value has %lld: they must match",
                          (long long)s->S, (long long)s->value.shape[1]);
    s->S_ext = s->S + c->add_bias_kv + c->add_zero_attn;
    int64_t rows;
    if (!attn__blas_fits(s->L) || !attn__blas_fits(s->S_ext) ||
        attn__mul_overflows(s->N, s->L > s->S_ext ? s->L : s->S_ext, &rows) ||
        !attn__blas_fits(rows))
        return attn__fail(ATTN_ERR_OVERFLOW, "batch x sequence length is too large");
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

/* [attn] A per-call dropout must be a probability, like config.dropout. */
static attn_status check_dropout(const attn_mha_forward_params *p) {
    if (p != NULL && p->has_dropout && !(p->dropout >= 0.0 && p->dropout <= 1.0))
        return attn__fail(ATTN_ERR_INVALID, "dropout is %g; expected a probability in [0, 1]",
                          p->dropout);
    return ATTN_OK;
}

attn_status attn_mha_out_shapes(const attn_mha *m, const attn_tensor *query,
                                const attn_tensor *key, const attn_mha_forward_params *params,
                                int need_weights, int *out_rank,
                                int64_t out_shape[ATTN_MAX_RANK], int *weights_rank,
                                int64_t weights_shape_out[ATTN_MAX_RANK]) {
    attn__clear_error();
    if (m == NULL) return attn__fail(ATTN_ERR_NULL, "mha is NULL");
    if (out_rank == NULL || out_shape == NULL)
        return attn__fail(ATTN_ERR_NULL, "out_rank/out_shape is NULL");
    mha_shapes s;
    attn_status st = check_dropout(params);
    if (st == ATTN_OK) st = resolve_shapes(m, query, key, NULL, &s);
    if (st != ATTN_OK) return st;
    *out_rank = query->rank;
    memcpy(out_shape, query->shape, sizeof(int64_t) * (size_t)query->rank);
    if (need_weights) {
        if (weights_rank == NULL || weights_shape_out == NULL)
            return attn__fail(ATTN_ERR_NULL, "weights_rank/weights_shape is NULL");
        bool average = params == NULL || params->average_attn_weights;
        weights_shape(m, &s, average, weights_rank, weights_shape_out);
    }
    return ATTN_OK;
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
        copy_strided(x, packed, dt);
        xdata = packed;
        xsN = T * F;
        xsT = F;
    }
    attn_status st = ATTN_OK;
    if (N == 1 || (xsN * N == xsT && ysN * N == ysT && xsN >= F)) /* time-major rows */
        st = attn__gemm_abt(dt, N * T, dout, F, xdata, N == 1 ? xsT : xsN, w, F, bias, y,
                            N == 1 ? ysT : ysN, cancel);
    else if (xsT * T == xsN && ysT * T == ysN) /* batch-major rows */
        st = attn__gemm_abt(dt, N * T, dout, F, xdata, xsT, w, F, bias, y, ysT, cancel);
    else
        for (int64_t n = 0; st == ATTN_OK && n < N; n++)
            st = attn__gemm_abt(dt, T, dout, F, xdata + (size_t)(n * xsN) * es, xsT, w, F, bias,
                                (char *)y + (size_t)(n * ysN) * es, ysT, cancel);
    attn__free(packed);
    return st;
}

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

/* Checks an MHA mask and turns it into a view over (N, H, L, S) for the
 * planner (before any padding). */
static attn_status mask_views(const attn_mha *m, const mha_shapes *s,
                              const attn_mha_forward_params *p, attn_tensor *am,
                              attn_tensor *kpm) {
    const int64_t H = m->cfg.num_heads;
    char got[160], want[80], want3[80];
    if (p->attn_mask != NULL) {
        const attn_tensor *t = p->attn_mask;
        attn_status st = attn__check_tensor(t, "attn_mask", 1, ATTN__INPUT);
        if (st != ATTN_OK) return st;
        int64_t heads = s->batched ? s->N * H : H;
        int64_t w2[2] = {s->L, s->S}, w3[3] = {heads, s->L, s->S};
        bool ok2 = t->rank == 2 && t->shape[0] == s->L && t->shape[1] == s->S;
        bool ok3 = t->rank == 3 && t->shape[0] == heads && t->shape[1] == s->L &&
                   t->shape[2] == s->S;
        if (!ok2 && !ok3)
            return attn__fail(ATTN_ERR_SHAPE, "attn_mask has shape %s; expected %s or %s%s",
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
    }
    if (p->key_padding_mask != NULL) {
        const attn_tensor *t = p->key_padding_mask;
        attn_status st = attn__check_tensor(t, "key_padding_mask", 1, ATTN__INPUT);
        if (st != ATTN_OK) return st;
        int64_t w[2] = {s->N, s->S};
        bool ok = s->batched ? (t->rank == 2 && t->shape[0] == s->N && t->shape[1] == s->S)
                             : (t->rank == 1 && t->shape[0] == s->S);
        if (!ok)
            return attn__fail(ATTN_ERR_SHAPE, "key_padding_mask has shape %s; expected %s",
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
    }
    for (int i = 0; i < 2; i++) {
        const attn_tensor *t = i ? p->key_padding_mask : p->attn_mask;
        if (t != NULL && t->dtype != ATTN_DTYPE_BOOL && !attn__is_float(t->dtype))
            return attn__fail(ATTN_ERR_DTYPE, "%s is %s; expected bool, float32 or float64",
                              i ? "key_padding_mask" : "attn_mask", attn_dtype_name(t->dtype));
    }
    return ATTN_OK;
}

/* Whether two views show the same elements in the same order. */
static bool same_view(const attn_tensor *a, const attn_tensor *b) {
    if (a->data != b->data || a->dtype != b->dtype || a->rank != b->rank) return false;
    for (int d = 0; d < a->rank; d++)
        if (a->shape[d] != b->shape[d] || a->strides[d] != b->strides[d]) return false;
    return true;
}

/* out and weights must not share memory with an input or each other (the
 * masks are read while weights are written). */
static attn_status check_output_overlaps(const attn_tensor *query, const attn_tensor *key,
                                         const attn_tensor *value,
                                         const attn_mha_forward_params *p,
                                         const attn_tensor *out, const attn_tensor *weights) {
    const attn_tensor *ins[5] = {query, key, value, p->attn_mask, p->key_padding_mask};
    const char *names[5] = {"query", "key", "value", "attn_mask", "key_padding_mask"};
    const attn_tensor *outs[2] = {out, weights};
    for (int o = 0; o < 2; o++) {
        attn_status st = attn__check_output_layout(outs[o], o ? "weights" : "out");
        if (st != ATTN_OK) return st;
        for (int i = 0; i < 5; i++)
            if (attn__views_overlap(outs[o], ins[i]))
                return attn__fail(ATTN_ERR_OVERLAP,
                                  "%s overlaps %s in memory: give %s a buffer of its own",
                                  o ? "weights" : "out", names[i], o ? "weights" : "out");
    }
    if (attn__views_overlap(out, weights))
        return attn__fail(ATTN_ERR_OVERLAP, "out and weights overlap in memory");
    return ATTN_OK;
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

attn_status attn_mha_forward(const attn_mha *m, const attn_tensor *query, const attn_tensor *key,
                             const attn_tensor *value, const attn_mha_forward_params *params,
                             attn_tensor *out, attn_tensor *weights) {
    attn__clear_error();
    if (m == NULL) return attn__fail(ATTN_ERR_NULL, "mha is NULL");
    attn_mha_forward_params defaults;
    if (params == NULL) {
        attn_mha_forward_params_init(&defaults);
        params = &defaults;
    }
    const attn_mha_config *c = &m->cfg;
    const attn_dtype dt = c->dtype;
    const size_t es = attn_dtype_size(dt);
    const volatile int *cancel = attn__cancel_flag();
    mha_shapes s;
    attn_status st = check_dropout(params);
    if (st == ATTN_OK) st = resolve_shapes(m, query, key, value, &s);
    if (st != ATTN_OK) return st;
    const int64_t N = s.N, L = s.L, S = s.S, Sx = s.S_ext, H = c->num_heads,
                  hd = c->head_dim, D = m->D, E = c->embed_dim;

    /* Outputs: shapes first, so no work is done for a call that must fail. */
    if (out == NULL) return attn__fail(ATTN_ERR_NULL, "out is NULL");
    if ((st = attn__check_tensor(out, "out", 1, ATTN__OUTPUT)) != ATTN_OK) return st;
    bool out_ok = out->rank == query->rank && out->dtype == dt;
    for (int d = 0; out_ok && d < query->rank; d++) out_ok = out->shape[d] == query->shape[d];
    if (!out_ok) {
        char got[160], want[160];
        return attn__fail(out->dtype != dt ? ATTN_ERR_DTYPE : ATTN_ERR_SHAPE,
                          "out is %s %s; expected %s %s like the query",
                          attn_dtype_name(out->dtype),
                          attn__shape_str(got, sizeof got, out->rank, out->shape),
                          attn_dtype_name(dt),
                          attn__shape_str(want, sizeof want, query->rank, query->shape));
    }
    const bool average = params->average_attn_weights != 0;
    if (weights != NULL) {
        int wr;
        int64_t ws[ATTN_MAX_RANK];
        weights_shape(m, &s, average, &wr, ws);
        if ((st = attn__check_tensor(weights, "weights", 1, ATTN__OUTPUT)) != ATTN_OK) return st;
        bool ok = weights->rank == wr && weights->dtype == dt;
        for (int d = 0; ok && d < wr; d++) ok = weights->shape[d] == ws[d];
        if (!ok) {
            char got[160], want[160];
            return attn__fail(weights->dtype != dt ? ATTN_ERR_DTYPE : ATTN_ERR_SHAPE,
                              "weights is %s %s; expected %s %s", attn_dtype_name(weights->dtype),
                              attn__shape_str(got, sizeof got, weights->rank, weights->shape),
                              attn_dtype_name(dt), attn__shape_str(want, sizeof want, wr, ws));
        }
    }
    attn_tensor am, kpm;
    if ((st = mask_views(m, &s, params, &am, &kpm)) != ATTN_OK) return st;
    if ((st = check_output_overlaps(query, key, value, params, out, weights)) != ATTN_OK)
        return st;
    const attn_tensor *am_use = params->attn_mask ? &am : NULL;
    const attn_tensor *kpm_use = params->key_padding_mask ? &kpm : NULL;

    /* Workspace: projected Q (N, L, D), K and V (N, Sx, D), the attention
     * output O (N, L, D) and, for averaged weights, all heads' weights. The
     * layout follows the query: sequence-major inputs keep sequence-major
     * buffers, so a (L, N, E) input is one GEMM. For self-attention (one
     * tensor as query, key and value) Q, K and V are the three column
     * blocks of one (rows, 3D) product with in_proj_weight, as in torch. */
    const bool seq_major = s.query.strides[0] < s.query.strides[1] && N > 1;
    const bool fused_qkv = m->packed && Sx == S && same_view(query, key) && same_view(key, value);
    const int64_t width = fused_qkv ? 3 * D : D; /* columns per row of Q/K/V */
    const int64_t qsN = seq_major ? width : L * width, qsT = seq_major ? N * width : width;
    const int64_t ksN = seq_major ? width : Sx * width, ksT = seq_major ? N * width : width;
    const int64_t osN = seq_major ? D : L * D, osT = seq_major ? N * D : D;
    const int64_t qkv_elems = fused_qkv ? N * L * 3 * D : N * L * D + 2 * N * Sx * D;
    char *qkv = attn__alloc((size_t)qkv_elems * es);
    void *Op = attn__alloc((size_t)(N * L * D) * es);
    void *Wall = NULL;
    attn_tensor am_pad, kpm_pad;
    void *am_pad_data = NULL, *kpm_pad_data = NULL;
    if (weights != NULL && average) Wall = attn__alloc_array((size_t)(N * H * L), (size_t)Sx * es);
    st = (qkv && Op && (Wall || !(weights && average))) ? ATTN_OK : ATTN_ERR_NOMEM;
    char *Qp = qkv, *Kp = NULL, *Vp = NULL; /* no arithmetic on a failed (NULL) block */
    if (qkv != NULL && fused_qkv) {
        Kp = qkv + (size_t)D * es;
        Vp = qkv + (size_t)(2 * D) * es;
    } else if (qkv != NULL) {
        Kp = qkv + (size_t)(N * L * D) * es;
        Vp = Kp + (size_t)(N * Sx * D) * es;
    }

    const char *w_all =
        param_data(m, find_param(m, m->packed ? "in_proj_weight" : "q_proj_weight"));
    const char *bias_all = c->bias ? param_data(m, find_param(m, "in_proj_bias")) : NULL;
    if (st == ATTN_OK && fused_qkv) {
        st = project(dt, &s.query, w_all, bias_all, 3 * D, Qp, qsN, qsT, cancel);
    } else if (st == ATTN_OK) {
        const char *Wq = w_all, *Wk, *Wv;
        if (m->packed) {
            Wk = w_all + (size_t)(D * E) * es;
            Wv = w_all + (size_t)(2 * D * E) * es;
        } else {
            Wk = param_data(m, find_param(m, "k_proj_weight"));
            Wv = param_data(m, find_param(m, "v_proj_weight"));
        }
        const char *bq = bias_all, *bk = bias_all ? bias_all + (size_t)D * es : NULL,
                   *bv = bias_all ? bias_all + (size_t)(2 * D) * es : NULL;
        if ((st = project(dt, &s.query, Wq, bq, D, Qp, qsN, qsT, cancel)) == ATTN_OK &&
            (st = project(dt, &s.key, Wk, bk, D, Kp, ksN, ksT, cancel)) == ATTN_OK)
            st = project(dt, &s.value, Wv, bv, D, Vp, ksN, ksT, cancel);
    }
    /* Appended key/value rows: bias_k/bias_v, then a zero row per head. */
    for (int64_t n = 0; st == ATTN_OK && n < N; n++) {
        size_t row = (size_t)(n * ksN + S * ksT) * es;
        if (c->add_bias_kv) {
            memcpy((char *)Kp + row, param_data(m, find_param(m, "bias_k")), (size_t)D * es);
            memcpy((char *)Vp + row, param_data(m, find_param(m, "bias_v")), (size_t)D * es);
            row += (size_t)ksT * es;
        }
        if (c->add_zero_attn) {
            memset((char *)Kp + row, 0, (size_t)D * es);
            memset((char *)Vp + row, 0, (size_t)D * es);
        }
    }

    /* Masks: padded copies only when keys were appended. */
    bool causal_in_mask = false;
    if (st == ATTN_OK && Sx > S) {
        if (am_use != NULL || params->is_causal) {
            st = pad_mask(am_use, L, S, Sx, params->is_causal != 0, &am_pad);
            am_pad_data = st == ATTN_OK ? am_pad.data : NULL;
            am_use = st == ATTN_OK ? &am_pad : NULL;
            causal_in_mask = true;
        }
        if (st == ATTN_OK && kpm_use != NULL) {
            st = pad_mask(kpm_use, 1, S, Sx, false, &kpm_pad);
            kpm_pad_data = st == ATTN_OK ? kpm_pad.data : NULL;
            kpm_use = &kpm_pad;
        }
    }

    /* Attention over heads as strided views: (N, H, T, hd). */
    if (st == ATTN_OK) {
        attn_tensor qh, kh, vh, oh, wh;
        int64_t qshape[4] = {N, H, L, hd}, kshape[4] = {N, H, Sx, hd};
        attn_tensor_init(&qh, Qp, dt, 4, qshape);
        attn_tensor_init(&kh, Kp, dt, 4, kshape);
        attn_tensor_init(&vh, Vp, dt, 4, kshape);
        attn_tensor_init(&oh, Op, dt, 4, qshape);
        int64_t qst[4] = {qsN, hd, qsT, 1}, kst[4] = {ksN, hd, ksT, 1}, ost[4] = {osN, hd, osT, 1};
        memcpy(qh.strides, qst, sizeof qst);
        memcpy(oh.strides, ost, sizeof ost);
        memcpy(kh.strides, kst, sizeof kst);
        memcpy(vh.strides, kst, sizeof kst);
        attn_tensor *w_use = NULL;
        if (weights != NULL) {
            int64_t wshape[4] = {N, H, L, Sx};
            if (average) {
                attn_tensor_init(&wh, Wall, dt, 4, wshape);
            } else {
                wh = *weights; /* (N, H, L, Sx) or unbatched (H, L, Sx) */
                if (!s.batched) {
                    wh.rank = 4;
                    for (int d = 3; d >= 1; d--) {
                        wh.shape[d] = weights->shape[d - 1];
                        wh.strides[d] = weights->strides[d - 1];
                    }
                    wh.shape[0] = 1;
                    wh.strides[0] = 0;
                }
            }
            w_use = &wh;
        }
        attn__problem_request r;
        memset(&r, 0, sizeof r);
        r.q = &qh;
        r.k = &kh;
        r.v = &vh;
        r.nmask = 2;
        r.mask[0] = am_use;
        r.mask_name[0] = "attn_mask";
        r.mask[1] = kpm_use;
        r.mask_name[1] = "key_padding_mask";
        r.mask_bool_keep[0] = r.mask_bool_keep[1] = 0; /* torch MHA: true = masked out */
        r.causal = params->is_causal && !causal_in_mask ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
        r.has_scale = 1;
        r.scale = 1.0 / sqrt((double)hd);
        const double p_drop = params->has_dropout ? params->dropout : c->dropout;
        r.dropout_p = params->training ? p_drop : 0.0;
        r.seed = params->seed;
        r.rng_offset = params->rng_offset;
        r.out = &oh;
        r.weights = w_use;
        attn__problem plan;
        st = attn__problem_build(&plan, &r);
        if (st == ATTN_OK) st = attn__sdpa_execute(&plan);
    }

    /* Merge heads and project out: out = O · Wo^T + bo. */
    if (st == ATTN_OK) {
        attn_tensor o3, outv = to_ntf(out, s.batched, c->batch_first);
        int64_t oshape[3] = {N, L, D};
        attn_tensor_init(&o3, Op, dt, 3, oshape);
        o3.strides[0] = osN;
        o3.strides[1] = osT;
        const char *Wo = param_data(m, find_param(m, "out_proj.weight"));
        const char *bo = c->bias ? param_data(m, find_param(m, "out_proj.bias")) : NULL;
        bool direct = outv.strides[2] == 1 && outv.strides[0] >= 0 && outv.strides[1] >= 0 &&
                      (L == 1 || (outv.strides[1] >= E && attn__blas_fits(outv.strides[1]))) &&
                      (N == 1 || (outv.strides[0] >= E && attn__blas_fits(outv.strides[0])));
        if (direct) {
            st = project(dt, &o3, Wo, bo, E, out->data, outv.strides[0], outv.strides[1], cancel);
        } else {
            void *tmp = attn__alloc_array((size_t)(N * L), (size_t)E * es);
            st = tmp ? project(dt, &o3, Wo, bo, E, tmp, L * E, E, cancel) : ATTN_ERR_NOMEM;
            if (st == ATTN_OK)
                for (int64_t n = 0; n < N; n++)
                    for (int64_t t = 0; t < L; t++)
                        for (int64_t e = 0; e < E; e++)
                            attn__store(outv.data, dt,
                                        n * outv.strides[0] + t * outv.strides[1] +
                                            e * outv.strides[2],
                                        attn__load(tmp, dt, (n * L + t) * E + e));
            attn__free(tmp);
        }
    }
    if (st == ATTN_OK && weights != NULL && average)
        average_heads(dt, Wall, N, H, L, Sx, weights, s.batched);

    attn__free(qkv);
    attn__free(Op);
    attn__free(Wall);
    attn__free(am_pad_data);
    attn__free(kpm_pad_data);
    return st;
}
