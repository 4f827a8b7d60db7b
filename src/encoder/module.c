/*
 * module.c — torch.nn.TransformerEncoderLayer's configuration, creation and
 * parameters. The self-attention is an attn_mha owned by the layer; its
 * parameters are listed first, under "self_attn.", as torch's state_dict()
 * lists them. The forward pass is in forward.c.
 */
#include <math.h>
#include <string.h>

#include "../mha/mha.h"
#include "encoder.h"

typedef attn__enc_param enc_param;

void attn_encoder_layer_config_init(attn_encoder_layer_config *c, int64_t d_model,
                                    int64_t nhead) {
    if (c == NULL) return;
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->d_model = d_model;
    c->nhead = nhead;
    c->dim_feedforward = 2048;
    c->dropout = 0.1;
    c->activation = ATTN_ACTIVATION_RELU;
    c->layer_norm_eps = 1e-5;
    c->bias = 1;
    c->dtype = ATTN_DTYPE_F32;
}

#define CONFIG_FIRST_SIZE ATTN__SIZE_THROUGH(attn_encoder_layer_config, init_seed)

static attn_status resolve_config(const attn_encoder_layer_config *in,
                                  attn_encoder_layer_config *c) {
    if (in == NULL) return attn__fail_arg(ATTN_ERR_NULL, "config", "config is NULL");
    attn_encoder_layer_config_init(c, 0, 0);
    attn_status st = attn__read_params(c, sizeof *c, CONFIG_FIRST_SIZE, in, "config",
                                       "attn_encoder_layer_config_init");
    if (st != ATTN_OK) return st;
    c->struct_size = sizeof *c;
    if (c->d_model < 1)
        return attn__fail_arg(ATTN_ERR_INVALID, "config.d_model", "d_model is %lld; it must be >= 1",
                              (long long)c->d_model);
    if (c->nhead < 1)
        return attn__fail_arg(ATTN_ERR_INVALID, "config.nhead", "nhead is %lld; it must be >= 1",
                              (long long)c->nhead);
    if (c->d_model % c->nhead != 0)
        return attn__fail_arg(ATTN_ERR_SHAPE, "config.nhead",
                              "d_model %lld is not divisible by nhead %lld: the heads are an "
                              "even split of the d_model features",
                              (long long)c->d_model, (long long)c->nhead);
    if (c->dim_feedforward < 1)
        return attn__fail_arg(ATTN_ERR_INVALID, "config.dim_feedforward",
                              "dim_feedforward is %lld; it must be >= 1",
                              (long long)c->dim_feedforward);
    const int flags[3] = {c->batch_first, c->norm_first, c->bias};
    static const char *const flag_names[3] = {"config.batch_first", "config.norm_first",
                                              "config.bias"};
    if ((st = attn__check_flags(flags, flag_names, 3)) != ATTN_OK) return st;
    /* the own parameters, two F x E weights and F + 5·E biases and norms,
     * counted in bytes of the widest dtype */
    int64_t ff, n, e5, bytes;
    if (attn__mul_overflows(c->dim_feedforward, c->d_model, &ff) ||
        attn__mul_overflows(ff, 2, &n) || attn__add_overflows(n, c->dim_feedforward, &n) ||
        attn__mul_overflows(c->d_model, 5, &e5) || attn__add_overflows(n, e5, &n) ||
        attn__mul_overflows(n, 8, &bytes))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, "config.dim_feedforward",
                              "dim_feedforward %lld with d_model %lld: the parameters' byte "
                              "count overflows 64 bits",
                              (long long)c->dim_feedforward, (long long)c->d_model);
    if (!(c->dropout >= 0.0 && c->dropout <= 1.0))
        return attn__fail_arg(ATTN_ERR_INVALID, "config.dropout",
                              "dropout is %g; it must be in [0, 1]", c->dropout);
    if (!(c->layer_norm_eps >= 0.0 && isfinite(c->layer_norm_eps)))
        return attn__fail_arg(ATTN_ERR_INVALID, "config.layer_norm_eps",
                              "layer_norm_eps is %g; it must be finite and >= 0",
                              c->layer_norm_eps);
    if (c->activation != ATTN_ACTIVATION_RELU && c->activation != ATTN_ACTIVATION_GELU &&
        c->activation != ATTN_ACTIVATION_GELU_TANH)
        return attn__fail_arg(ATTN_ERR_INVALID, "config.activation",
                              "activation is %d; expected ATTN_ACTIVATION_RELU, _GELU or "
                              "_GELU_TANH",
                              (int)c->activation);
    if (!attn__is_floating(c->dtype))
        return attn__fail_arg(ATTN_ERR_DTYPE, "config.dtype",
                              "config.dtype must be float32, float64, float16 or bfloat16");
    c->batch_first = c->batch_first != 0;
    c->norm_first = c->norm_first != 0;
    c->bias = c->bias != 0;
    return ATTN_OK;
}

static void add_param(attn_encoder_layer *l, const char *name, int rank, int64_t d0,
                      int64_t d1, int64_t *offset) {
    enc_param *p = &l->own[l->nown++];
    p->name = name;
    p->rank = rank;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->offset = *offset;
    *offset += rank == 2 ? d0 * d1 : d0;
}

static const enc_param *find_own(const attn_encoder_layer *l, const char *name) {
    for (int i = 0; i < l->nown; i++)
        if (strcmp(l->own[i].name, name) == 0) return &l->own[i];
    return NULL;
}

static void *own_data(const attn_encoder_layer *l, const enc_param *p) {
    return (char *)l->storage + (size_t)p->offset * attn_dtype_size(l->cfg.dtype);
}

void *attn__enc_param_data(const attn_encoder_layer *l, const char *name) {
    const enc_param *p = find_own(l, name);
    return p != NULL ? own_data(l, p) : NULL;
}

/* torch's reset: Linear draws weight and bias from U(±1/sqrt(fan_in))
 * (kaiming_uniform with a = sqrt 5 gives that bound); LayerNorm starts at
 * weight 1, bias 0. Drawn as attn_mha draws its own, on another stream. */
static void reset_own(attn_encoder_layer *l) {
    attn__init_rng r = {l->cfg.init_seed, 0, 0x656e63u}; /* "enc" */
    for (int i = 0; i < l->nown; i++) {
        const enc_param *p = &l->own[i];
        void *data = own_data(l, p);
        const int64_t n = p->rank == 2 ? p->shape[0] * p->shape[1] : p->shape[0];
        if (strncmp(p->name, "norm", 4) == 0) {
            const double v = strstr(p->name, ".weight") != NULL ? 1.0 : 0.0;
            for (int64_t e = 0; e < n; e++) attn__store(data, l->cfg.dtype, e, v);
            continue;
        }
        const int64_t fan_in = strncmp(p->name, "linear1", 7) == 0 ? l->cfg.d_model
                                                                     : l->cfg.dim_feedforward;
        const double bound = 1.0 / sqrt((double)fan_in);
        for (int64_t e = 0; e < n; e++)
            attn__store(data, l->cfg.dtype, e, (2.0 * attn__init_uniform01(&r) - 1.0) * bound);
    }
}

attn_status attn_encoder_layer_create(const attn_encoder_layer_config *config,
                                      attn_encoder_layer **out) {
    attn__clear_error();
    if (out == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, "layer", "layer (the out-parameter) is NULL");
    *out = NULL;
    attn_encoder_layer_config c;
    attn_status st = resolve_config(config, &c);
    if (st != ATTN_OK) return st;
    attn_encoder_layer *l = attn__alloc_array(1, sizeof *l);
    if (l == NULL) return ATTN_ERR_NOMEM;
    l->cfg = c;
    attn_mha_config mc;
    attn_mha_config_init(&mc, c.d_model, c.nhead);
    mc.bias = c.bias;
    mc.batch_first = c.batch_first;
    mc.dropout = c.dropout;
    mc.dtype = c.dtype;
    mc.init_seed = c.init_seed;
    st = attn_mha_create(&mc, &l->self_attn);
    if (st != ATTN_OK) {
        attn__free(l);
        return attn__prefix_error(st, "self_attn: ");
    }
    const int64_t E = c.d_model, F = c.dim_feedforward;
    int64_t n = 0;
    add_param(l, "linear1.weight", 2, F, E, &n);
    if (c.bias) add_param(l, "linear1.bias", 1, F, 0, &n);
    add_param(l, "linear2.weight", 2, E, F, &n);
    if (c.bias) add_param(l, "linear2.bias", 1, E, 0, &n);
    add_param(l, "norm1.weight", 1, E, 0, &n);
    if (c.bias) add_param(l, "norm1.bias", 1, E, 0, &n);
    add_param(l, "norm2.weight", 1, E, 0, &n);
    if (c.bias) add_param(l, "norm2.bias", 1, E, 0, &n);
    l->storage_count = n;
    l->storage = attn__alloc_array((size_t)n, attn_dtype_size(c.dtype));
    if (l->storage == NULL) {
        attn_encoder_layer_destroy(l);
        return ATTN_ERR_NOMEM;
    }
    reset_own(l);
    *out = l;
    return ATTN_OK;
}

void attn_encoder_layer_destroy(attn_encoder_layer *l) {
    if (l == NULL) return;
    attn_mha_destroy(l->self_attn);
    attn__free(l->storage);
    attn__free(l);
}

/* ---- parameters: self_attn's (prefixed), then the layer's own ---- */

static const char *const SELF_ATTN_NAMES[][2] = {
    {"in_proj_weight", "self_attn.in_proj_weight"},
    {"in_proj_bias", "self_attn.in_proj_bias"},
    {"out_proj.weight", "self_attn.out_proj.weight"},
    {"out_proj.bias", "self_attn.out_proj.bias"},
};

/* "self_attn.X" -> "X" for the attention's parameters, else NULL. */
static const char *attention_name(const char *name) {
    for (size_t i = 0; i < sizeof SELF_ATTN_NAMES / sizeof SELF_ATTN_NAMES[0]; i++)
        if (strcmp(name, SELF_ATTN_NAMES[i][1]) == 0) return SELF_ATTN_NAMES[i][0];
    return NULL;
}

static const char *prefixed(const char *mha_name) {
    for (size_t i = 0; i < sizeof SELF_ATTN_NAMES / sizeof SELF_ATTN_NAMES[0]; i++)
        if (strcmp(mha_name, SELF_ATTN_NAMES[i][0]) == 0) return SELF_ATTN_NAMES[i][1];
    return mha_name; /* not reached: the attention has only these */
}

int attn_encoder_layer_param_count(const attn_encoder_layer *l) {
    return l == NULL ? 0 : attn_mha_param_count(l->self_attn) + l->nown;
}

static void own_view(const attn_encoder_layer *l, const enc_param *p, attn_tensor *view) {
    const int64_t shape[2] = {p->shape[0], p->shape[1]};
    attn_tensor_init(view, own_data(l, p), l->cfg.dtype, p->rank, shape);
}

attn_status attn_encoder_layer_param_at(attn_encoder_layer *l, int index, const char **name,
                                        attn_tensor *view) {
    attn__clear_error();
    if (l == NULL) return attn__fail_arg(ATTN_ERR_NULL, "layer", "layer is NULL");
    const int na = attn_mha_param_count(l->self_attn);
    if (index < 0 || index >= na + l->nown)
        return attn__fail_arg(ATTN_ERR_INVALID, "index", "parameter index %d is outside 0..%d",
                              index, na + l->nown - 1);
    if (index < na) {
        const char *mha_name;
        attn_status st = attn_mha_param_at(l->self_attn, index, &mha_name, view);
        if (st == ATTN_OK && name != NULL) *name = prefixed(mha_name);
        return st;
    }
    const enc_param *p = &l->own[index - na];
    if (name != NULL) *name = p->name;
    if (view != NULL) own_view(l, p, view);
    return ATTN_OK;
}

static attn_status unknown_param(const attn_encoder_layer *l, const char *name) {
    char names[512] = "";
    for (int i = 0; i < attn_encoder_layer_param_count(l); i++) {
        const char *n = NULL;
        attn_encoder_layer_param_at((attn_encoder_layer *)l, i, &n, NULL);
        strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
        strncat(names, n, sizeof names - strlen(names) - 1);
    }
    return attn__fail_arg(ATTN_ERR_INVALID, "name", "this layer has no parameter '%s'; it has: %s",
                          name, names);
}

attn_status attn_encoder_layer_param(attn_encoder_layer *l, const char *name,
                                     attn_tensor *view) {
    attn__clear_error();
    if (l == NULL || name == NULL || view == NULL) {
        const char *arg = l == NULL ? "layer" : name == NULL ? "name" : "view";
        return attn__fail_arg(ATTN_ERR_NULL, arg, "%s is NULL", arg);
    }
    const char *mha_name = attention_name(name);
    attn_tensor v;
    if (mha_name != NULL && attn_mha_param(l->self_attn, mha_name, &v) == ATTN_OK) {
        *view = v;
        return ATTN_OK;
    }
    const enc_param *p = find_own(l, name);
    if (p == NULL) return unknown_param(l, name);
    own_view(l, p, view);
    return ATTN_OK;
}

attn_status attn_encoder_layer_set_param(attn_encoder_layer *l, const char *name,
                                         const attn_tensor *src) {
    attn__clear_error();
    if (l == NULL || name == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, l == NULL ? "layer" : "name", "%s is NULL",
                              l == NULL ? "layer" : "name");
    attn_tensor view;
    attn_status st = attn_encoder_layer_param(l, name, &view);
    if (st != ATTN_OK) return st;
    const char *mha_name = attention_name(name);
    if (mha_name != NULL) { /* the attention checks and copies its own */
        st = attn_mha_set_param(l->self_attn, mha_name, src);
        return st == ATTN_OK ? st : attn__prefix_error(st, "self_attn: ");
    }
    st = attn__check_tensor(src, name, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (!attn__is_float(src->dtype) && !attn__is_half(src->dtype)) /* as attn_mha_set_param */
        return attn__fail_arg(ATTN_ERR_DTYPE, name,
                              "%s is %s; expected float32, float64, float16 or bfloat16", name,
                              attn_dtype_name(src->dtype));
    bool same = src->rank == view.rank;
    for (int d = 0; same && d < view.rank; d++) same = src->shape[d] == view.shape[d];
    if (!same) {
        char want[96], got[160];
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has shape %s; this layer expects %s",
                              name, attn__shape_str(got, sizeof got, src->rank, src->shape),
                              attn__shape_str(want, sizeof want, view.rank, view.shape));
    }
    return attn__mha_set_from(src, view.data, view.dtype);
}
