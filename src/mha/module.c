/*
 * module.c — the torch.nn.MultiheadAttention module: its configuration,
 * creation, parameters (in state_dict() order) and their initialisation.
 * The forward pass is in forward.c.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../core/gemm.h"
#include "mha.h"

typedef attn__mha_param mha_param;

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

/* attn_mha_config as 0.2.0 had it: the smallest struct_size accepted. */
#define CONFIG_FIRST_SIZE ATTN__SIZE_THROUGH(attn_mha_config, init_seed)

/* head_dim 0 means an even split of embed_dim over the heads (torch's only
 * choice); explain at length why a split that is not even fails. */
static attn_status derive_head_dim(attn_mha_config *c) {
    if (c->head_dim != 0) return ATTN_OK;
    if (c->embed_dim % c->num_heads != 0)
        return attn__fail_arg(
            ATTN_ERR_SHAPE, "config.num_heads",
            "embed_dim %lld is not divisible by num_heads %lld: the heads are an even "
            "split of the embedding features (each head gets embed_dim / num_heads of "
            "them), so %lld features cannot make %lld equal heads. Choose num_heads "
            "dividing embed_dim, or give head_dim explicitly to project to num_heads * "
            "head_dim features",
            (long long)c->embed_dim, (long long)c->num_heads, (long long)c->embed_dim,
            (long long)c->num_heads);
    c->head_dim = c->embed_dim / c->num_heads;
    return ATTN_OK;
}

/* Reads the caller's config over the defaults, checks it and fills in the
 * derived fields (head_dim, kdim, vdim). */
static attn_status resolve_config(const attn_mha_config *in, attn_mha_config *c) {
    if (in == NULL) return attn__fail_arg(ATTN_ERR_NULL, "config", "config is NULL");
    attn_mha_config_init(c, 0, 0);
    attn_status st = attn__read_params(c, sizeof *c, CONFIG_FIRST_SIZE, in, "config",
                                       "attn_mha_config_init");
    if (st != ATTN_OK) return st;
    if (c->embed_dim < 1)
        return attn__fail_arg(ATTN_ERR_INVALID, "config.embed_dim",
                              "embed_dim is %lld; it must be >= 1", (long long)c->embed_dim);
    if (c->num_heads < 1)
        return attn__fail_arg(ATTN_ERR_INVALID, "config.num_heads",
                              "num_heads is %lld; it must be >= 1", (long long)c->num_heads);
    if (c->head_dim < 0 || c->kdim < 0 || c->vdim < 0)
        return attn__fail_arg(ATTN_ERR_INVALID,
                              c->head_dim < 0 ? "config.head_dim"
                              : c->kdim < 0   ? "config.kdim"
                                              : "config.vdim",
                              "head_dim, kdim and vdim must be >= 0 (0 = default)");
    if ((st = derive_head_dim(c)) != ATTN_OK) return st;
    if (c->kdim == 0) c->kdim = c->embed_dim;
    if (c->vdim == 0) c->vdim = c->embed_dim;
    if (!(c->dropout >= 0.0 && c->dropout <= 1.0))
        return attn__fail_arg(ATTN_ERR_INVALID, "config.dropout",
                              "dropout is %g; expected a probability in [0, 1]", c->dropout);
    const int flags[4] = {c->bias, c->add_bias_kv, c->add_zero_attn, c->batch_first};
    static const char *const flag_names[4] = {"config.bias", "config.add_bias_kv",
                                              "config.add_zero_attn", "config.batch_first"};
    if ((st = attn__check_flags(flags, flag_names, 4)) != ATTN_OK) return st;
    if (!attn__is_floating(c->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, "config.dtype",
                              "dtype is %s; expected float32, float64, float16 or bfloat16",
                              attn_dtype_name(c->dtype));
    int64_t D, w;
    if (attn__mul_overflows(c->num_heads, c->head_dim, &D) || !attn__blas_fits(D) ||
        !attn__blas_fits(c->embed_dim) || !attn__blas_fits(c->kdim) ||
        !attn__blas_fits(c->vdim) ||
        attn__mul_overflows(3 * D, c->embed_dim + c->kdim + c->vdim, &w))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, "config", "the projection sizes are too large");
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

void *attn__mha_param_data(const attn_mha *m, const char *name) {
    const mha_param *p = find_param(m, name);
    return p != NULL ? param_data(m, p) : NULL;
}

attn_tensor attn__mha_storage_view(const attn_mha *m) {
    const attn__mha_param *last = &m->param[m->nparam - 1];
    int64_t count = 1;
    for (int d = 0; d < last->rank; d++) count *= last->shape[d];
    count += last->offset;
    attn_tensor t;
    attn_tensor_init(&t, m->storage, m->cfg.dtype, 1, &count);
    return t;
}

/* ---- initialisation, as torch's _reset_parameters draws it ---- */

double attn__init_uniform01(attn__init_rng *r) { /* (0, 1), 53 bits */
    uint32_t ctr[4] = {(uint32_t)r->counter, (uint32_t)(r->counter >> 32), r->stream, 0};
    uint32_t key[2] = {(uint32_t)r->seed, (uint32_t)(r->seed >> 32)}, out[4];
    r->counter++;
    attn__philox4x32_10(ctr, key, out);
    uint64_t bits = ((uint64_t)out[0] << 21) ^ (out[1] >> 11);
    return ((double)(bits & ((1ull << 53) - 1)) + 0.5) / 9007199254740992.0;
}

static void fill_uniform(attn_mha *m, const mha_param *p, double bound, attn__init_rng *r) {
    int64_t n = p->shape[0] * (p->rank > 1 ? p->shape[1] : 1) * (p->rank > 2 ? p->shape[2] : 1);
    for (int64_t i = 0; i < n; i++)
        attn__store(param_data(m, p), m->cfg.dtype, i,
                    (2.0 * attn__init_uniform01(r) - 1.0) * bound);
}

static void fill_normal(attn_mha *m, const mha_param *p, double std, attn__init_rng *r) {
    int64_t n = p->shape[0] * (p->rank > 1 ? p->shape[1] : 1) * (p->rank > 2 ? p->shape[2] : 1);
    for (int64_t i = 0; i < n; i++) { /* Box-Muller */
        double u = attn__init_uniform01(r), v = attn__init_uniform01(r);
        attn__store(param_data(m, p), m->cfg.dtype, i,
                    std * sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
    }
}

static void reset_parameters(attn_mha *m) {
    attn__init_rng r = {m->cfg.init_seed, 0, 0x6d6861u}; /* "mha" */
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
    if (out == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, "mha", "mha (the out-parameter) is NULL");
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
        return attn__fail_arg(ATTN_ERR_NULL, m == NULL ? "mha" : "config", "%s is NULL",
                              m == NULL ? "mha" : "config");
    /* A caller built against an older attn.h gets the fields its struct has;
     * one from a newer header keeps the fields this library does not know.
     * Either way the caller's struct_size stays as the caller set it. */
    const size_t size = config->struct_size;
    if (size < CONFIG_FIRST_SIZE)
        return attn__fail_arg(ATTN_ERR_INVALID, "config.struct_size",
                              "config.struct_size is %zu: set it to sizeof(attn_mha_config), "
                              "or initialise config with attn_mha_config_init(), so that "
                              "attn_mha_get_config knows how many bytes it may write",
                              size);
    attn_mha_config c = m->cfg;
    c.struct_size = size;
    memcpy(config, &c, size < sizeof c ? size : sizeof c);
    return ATTN_OK;
}

int attn_mha_param_count(const attn_mha *m) { return m == NULL ? 0 : m->nparam; }

static void param_view(attn_mha *m, const mha_param *p, attn_tensor *view) {
    int64_t shape[3] = {p->shape[0], p->shape[1], p->shape[2]};
    attn_tensor_init(view, param_data(m, p), m->cfg.dtype, p->rank, shape);
}

attn_status attn_mha_param_at(attn_mha *m, int index, const char **name, attn_tensor *view) {
    attn__clear_error();
    if (m == NULL) return attn__fail_arg(ATTN_ERR_NULL, "mha", "mha is NULL");
    if (index < 0 || index >= m->nparam)
        return attn__fail_arg(ATTN_ERR_INVALID, "index", "parameter index %d is outside 0..%d",
                              index, m->nparam - 1);
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
    return attn__fail_arg(ATTN_ERR_INVALID, "name", "this module has no parameter '%s'; it has: %s",
                          name, names);
}

attn_status attn_mha_param(attn_mha *m, const char *name, attn_tensor *view) {
    attn__clear_error();
    if (m == NULL || name == NULL || view == NULL) {
        const char *arg = m == NULL ? "mha" : name == NULL ? "name" : "view";
        return attn__fail_arg(ATTN_ERR_NULL, arg, "%s is NULL", arg);
    }
    const mha_param *p = find_param(m, name);
    if (p == NULL) return unknown_param(m, name);
    param_view(m, p, view);
    return ATTN_OK;
}

void attn__mha_copy_strided(const attn_tensor *src, void *dst, attn_dtype dst_dtype) {
    attn_tensor d;
    attn_tensor_init(&d, dst, dst_dtype, src->rank, src->shape); /* src's shape is valid */
    attn__tensor_copy(src, &d);
}

attn_status attn__mha_set_from(const attn_tensor *src, void *dst, attn_dtype dst_dtype) {
    attn_tensor d;
    attn_tensor_init(&d, dst, dst_dtype, src->rank, src->shape); /* src's shape is valid */
    if (!attn__views_overlap(src, &d)) {
        attn__tensor_copy(src, &d);
        return ATTN_OK;
    }
    int64_t n = 1;
    for (int i = 0; i < src->rank; i++) n *= src->shape[i];
    const size_t es = attn_dtype_size(dst_dtype);
    void *staged = attn__alloc_array((size_t)n, es);
    if (staged == NULL) return ATTN_ERR_NOMEM;
    attn__mha_copy_strided(src, staged, dst_dtype);
    memcpy(dst, staged, (size_t)n * es);
    attn__free(staged);
    return ATTN_OK;
}

void attn__mha_copy_dense(const void *src, const attn_tensor *dst) {
    attn_tensor d;
    attn_tensor_init(&d, (void *)src, dst->dtype, dst->rank, dst->shape); /* dst's shape is valid */
    attn__tensor_copy(&d, dst);
}

attn_status attn_mha_set_param(attn_mha *m, const char *name, const attn_tensor *src) {
    attn__clear_error();
    if (m == NULL || name == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, m == NULL ? "mha" : "name", "%s is NULL",
                              m == NULL ? "mha" : "name");
    const mha_param *p = find_param(m, name);
    if (p == NULL) return unknown_param(m, name);
    attn_status st = attn__check_tensor(src, name, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (!attn__is_float(src->dtype) && !attn__is_half(src->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, name,
                              "%s is %s; expected float32, float64, float16 or bfloat16", name,
                              attn_dtype_name(src->dtype));
    bool same = src->rank == p->rank;
    for (int d = 0; same && d < p->rank; d++) same = src->shape[d] == p->shape[d];
    if (!same) {
        char want[96], got[160];
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has shape %s; this module expects %s",
                              name, attn__shape_str(got, sizeof got, src->rank, src->shape),
                              attn__shape_str(want, sizeof want, p->rank, p->shape));
    }
    return attn__mha_set_from(src, param_data(m, p), m->cfg.dtype);
}


bool attn__mha_same_shape(const attn_mha_config *a, const attn_mha_config *b) {
    return a->embed_dim == b->embed_dim && a->num_heads == b->num_heads &&
           a->head_dim == b->head_dim && a->kdim == b->kdim && a->vdim == b->vdim &&
           (a->bias != 0) == (b->bias != 0) && (a->add_bias_kv != 0) == (b->add_bias_kv != 0) &&
           (a->add_zero_attn != 0) == (b->add_zero_attn != 0) && a->dtype == b->dtype;
}
