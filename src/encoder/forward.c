/*
 * forward.c — torch.nn.TransformerEncoderLayer's forward pass: the
 * self-attention is attn_mha_forward, the feed-forward two GEMMs of
 * core/gemm.c (thread-count independent bits), and the rest row steps
 * (rows.inc). Every buffer is a contiguous copy of src's rows in src's own
 * C order, so the row steps need no layout and the attention sees src's
 * shape (with this call's batch_first).
 */
#include <math.h>
#include <string.h>

#include "../core/gemm.h"
#include "../mha/mha.h"
#include "encoder.h"

/* The activation of x in float64 (the row steps of every dtype). */
static double activation_of(double x, attn_activation act) {
    if (act == ATTN_ACTIVATION_RELU) return x > 0 ? x : (x == x ? 0.0 : x); /* NaN stays NaN */
    if (act == ATTN_ACTIVATION_GELU) return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440));
    return 0.5 * x * (1.0 + tanh(0.79788456080286535588 * (x + 0.044715 * x * x * x)));
}

#define REAL float
#define SFX(name) name##_f
#include "rows.inc"
#undef REAL
#undef SFX
#define REAL double
#define SFX(name) name##_d
#include "rows.inc"
#undef REAL
#undef SFX

/* ---- the row steps on 16-bit rows ----
 * Each reads its 16-bit inputs exactly, computes as the float64 steps do,
 * and rounds its result once to the dtype (nearest even): torch's float16 /
 * bfloat16 layer norm, residual add, activation and dropout also compute in
 * float32 and round once. */

static void layer_norm_h(attn_dtype dt, const void *x, const void *w, const void *b, double eps,
                         int64_t R, int64_t E, void *y) {
#pragma omp parallel for num_threads(attn__threads()) schedule(static) if (R * E > 65536)
    for (int64_t r = 0; r < R; r++) {
        double mean = 0, var = 0;
        for (int64_t e = 0; e < E; e++) mean += attn__load(x, dt, r * E + e);
        mean /= (double)E;
        for (int64_t e = 0; e < E; e++) {
            const double d = attn__load(x, dt, r * E + e) - mean;
            var += d * d;
        }
        const double inv = 1.0 / sqrt(var / (double)E + eps);
        for (int64_t e = 0; e < E; e++) /* y may be x: each element read before written */
            attn__store(y, dt, r * E + e,
                        (attn__load(x, dt, r * E + e) - mean) * inv * attn__load(w, dt, e) +
                            (b ? attn__load(b, dt, e) : 0.0));
    }
}

static void add_h(attn_dtype dt, void *x, const void *a, int64_t n) {
#pragma omp parallel for num_threads(attn__threads()) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++)
        attn__store(x, dt, i, attn__load(x, dt, i) + attn__load(a, dt, i));
}

static void activate_h(attn_dtype dt, void *h, int64_t n, attn_activation act) {
#pragma omp parallel for num_threads(attn__threads()) schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; i++)
        attn__store(h, dt, i, activation_of(attn__load(h, dt, i), act));
}

static void dropout_h(attn_dtype dt, void *x, int64_t n, double p, uint64_t seed,
                      uint64_t stream) {
    const uint64_t threshold = attn__dropout_threshold(p);
    const double scale = p < 1.0 ? 1.0 / (1.0 - p) : 0.0;
#pragma omp parallel for num_threads(attn__threads()) schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; i++)
        attn__store(x, dt, i,
                    (uint64_t)attn__dropout_word(seed, stream, (uint64_t)i) >= threshold
                        ? attn__load(x, dt, i) * scale
                        : 0.0);
}

void attn_encoder_forward_params_init(attn_encoder_forward_params *p) {
    if (p == NULL) return;
    memset(p, 0, sizeof *p);
    p->struct_size = sizeof *p;
    p->batch_first = -1;
}

#define PARAMS_FIRST_SIZE ATTN__SIZE_THROUGH(attn_encoder_forward_params, batch_first)

/* The buffers of one call, each (R, width) in the compute type. */
typedef struct enc_work {
    int64_t R, E, F; /* rows (src's elements / d_model), d_model, dim_feedforward */
    void *x;         /* (R, E) the running activations: src, then out */
    void *a;         /* (R, E) a sublayer's output */
    void *y;         /* (R, E) the normed input of a sublayer (norm_first), else NULL */
    void *h;         /* (R, F) the feed-forward's hidden layer */
} enc_work;

/* out may be src (it is written after the layer has read it) but not the
 * layer's parameters, which every later call reads. */
static attn_status check_out_over_parameters(const attn_encoder_layer *l, const attn_tensor *out) {
    attn_tensor own;
    attn_tensor_init(&own, l->storage, l->cfg.dtype, 1, &l->storage_count);
    const attn_tensor mha = attn__mha_storage_view(l->self_attn);
    const attn_tensor *params[2] = {&own, &mha};
    const char *names[2] = {"the layer's parameters", "self_attn's parameters"};
    for (int i = 0; i < 2; i++)
        if (attn__views_overlap(out, params[i]))
            return attn__fail_arg(ATTN_ERR_OVERLAP, "out",
                                  "out overlaps %s in memory: give out a buffer of its own",
                                  names[i]);
    return ATTN_OK;
}

static attn_status check_call(const attn_encoder_layer *l, const attn_tensor *src,
                              const attn_encoder_forward_params *user,
                              attn_encoder_forward_params *p, const attn_tensor *out) {
    if (l == NULL) return attn__fail_arg(ATTN_ERR_NULL, "layer", "layer is NULL");
    attn_encoder_forward_params_init(p);
    if (user != NULL) {
        attn_status st = attn__read_params(p, sizeof *p, PARAMS_FIRST_SIZE, user, "params",
                                           "attn_encoder_forward_params_init");
        if (st != ATTN_OK) return st;
    }
    if (p->batch_first < -1 || p->batch_first > 1)
        return attn__fail_arg(ATTN_ERR_INVALID, "params.batch_first",
                              "params.batch_first is %d; expected -1 (the config's), 0 or 1",
                              p->batch_first);
    attn_status st = attn__check_tensor(src, "src", 2, ATTN__INPUT);
    if (st == ATTN_OK) st = attn__check_tensor(out, "out", 2, ATTN__OUTPUT);
    if (st != ATTN_OK) return st;
    const attn_dtype dt = l->cfg.dtype;
    if (src->dtype != dt || out->dtype != dt) {
        const char *arg = src->dtype != dt ? "src" : "out";
        return attn__fail_arg(ATTN_ERR_DTYPE, arg, "%s is %s; this layer computes in %s", arg,
                              attn_dtype_name(arg[0] == 's' ? src->dtype : out->dtype),
                              attn_dtype_name(dt));
    }
    char got[160], want[160];
    if (src->rank > 3 || src->shape[src->rank - 1] != l->cfg.d_model)
        return attn__fail_arg(ATTN_ERR_SHAPE, "src",
                              "src has shape %s; expected (L, N, %lld), (N, L, %lld) with "
                              "batch_first, or (L, %lld) unbatched",
                              attn__shape_str(got, sizeof got, src->rank, src->shape),
                              (long long)l->cfg.d_model, (long long)l->cfg.d_model,
                              (long long)l->cfg.d_model);
    bool same = out->rank == src->rank;
    for (int d = 0; same && d < src->rank; d++) same = out->shape[d] == src->shape[d];
    if (!same)
        return attn__fail_arg(ATTN_ERR_SHAPE, "out", "out has shape %s; expected src's %s",
                              attn__shape_str(got, sizeof got, out->rank, out->shape),
                              attn__shape_str(want, sizeof want, src->rank, src->shape));
    st = attn__check_output_layout(out, "out");
    return st == ATTN_OK ? check_out_over_parameters(l, out) : st;
}

static void work_free(enc_work *w) {
    attn__work_free(w->x);
    attn__work_free(w->a);
    attn__work_free(w->y);
    attn__work_free(w->h);
}

static attn_status work_alloc(const attn_encoder_layer *l, const attn_tensor *src, enc_work *w) {
    const size_t es = attn_dtype_size(l->cfg.dtype);
    memset(w, 0, sizeof *w);
    w->E = l->cfg.d_model;
    w->F = l->cfg.dim_feedforward;
    w->R = attn_tensor_numel(src) / w->E;
    int64_t rf;
    if (attn__mul_overflows(w->R, w->F, &rf) || !attn__blas_fits(w->R) || !attn__blas_fits(w->F))
        return attn__fail_arg(ATTN_ERR_SHAPE, "src",
                              "src has %lld rows; with dim_feedforward %lld the hidden layer "
                              "is beyond what the BLAS indexes",
                              (long long)w->R, (long long)w->F);
    w->x = attn__work_alloc((size_t)w->R, (size_t)w->E * es, true);
    w->a = attn__work_alloc((size_t)w->R, (size_t)w->E * es, true);
    w->h = attn__work_alloc((size_t)rf, es, true);
    if (l->cfg.norm_first) w->y = attn__work_alloc((size_t)w->R, (size_t)w->E * es, true);
    if (w->x == NULL || w->a == NULL || w->h == NULL || (l->cfg.norm_first && w->y == NULL)) {
        work_free(w);
        return ATTN_ERR_NOMEM;
    }
    attn__mha_copy_strided(src, w->x, l->cfg.dtype);
    return ATTN_OK;
}

/* ---- the steps, on either compute type ---- */

static void norm(const attn_encoder_layer *l, int which, const void *x, void *y, const enc_work *w) {
    const void *g = attn__enc_param_data(l, which == 1 ? "norm1.weight" : "norm2.weight");
    const void *b = attn__enc_param_data(l, which == 1 ? "norm1.bias" : "norm2.bias");
    const attn_dtype dt = l->cfg.dtype;
    if (dt == ATTN_DTYPE_F32)
        layer_norm_f(x, g, b, l->cfg.layer_norm_eps, w->R, w->E, y);
    else if (dt == ATTN_DTYPE_F64)
        layer_norm_d(x, g, b, l->cfg.layer_norm_eps, w->R, w->E, y);
    else
        layer_norm_h(dt, x, g, b, l->cfg.layer_norm_eps, w->R, w->E, y);
}

static void add_to(const attn_encoder_layer *l, void *x, const void *a, int64_t n) {
    if (l->cfg.dtype == ATTN_DTYPE_F32)
        add_f(x, a, n);
    else if (l->cfg.dtype == ATTN_DTYPE_F64)
        add_d(x, a, n);
    else
        add_h(l->cfg.dtype, x, a, n);
}

/* Dropout of one of the layer's streams (1: dropout1, 2: the feed-forward's,
 * 3: dropout2) when training with p > 0. */
static void drop(const attn_encoder_layer *l, const attn_encoder_forward_params *p, int stream,
                 void *x, int64_t n) {
    const double q = l->cfg.dropout;
    if (!p->training || q == 0.0) return;
    const uint64_t s = p->rng_offset + (uint64_t)stream;
    if (l->cfg.dtype == ATTN_DTYPE_F32)
        dropout_f(x, n, q, p->seed, s);
    else if (l->cfg.dtype == ATTN_DTYPE_F64)
        dropout_d(x, n, q, p->seed, s);
    else
        dropout_h(l->cfg.dtype, x, n, q, p->seed, s);
}

/* a = self_attn(in, in, in) on src's shape. */
static attn_status attention(const attn_encoder_layer *l, const attn_tensor *src,
                             const attn_encoder_forward_params *p, const void *in, void *a) {
    attn_tensor tin, ta;
    attn_tensor_init(&tin, (void *)in, l->cfg.dtype, src->rank, src->shape);
    attn_tensor_init(&ta, a, l->cfg.dtype, src->rank, src->shape);
    attn_mha_forward_params mp;
    attn_mha_forward_params_init(&mp);
    mp.attn_mask = p->src_mask;
    mp.key_padding_mask = p->src_key_padding_mask;
    mp.is_causal = p->is_causal;
    mp.training = p->training;
    mp.seed = p->seed;
    mp.rng_offset = p->rng_offset;
    mp.batch_first = p->batch_first;
    attn_status st = attn_mha_forward(l->self_attn, &tin, &tin, &tin, &mp, &ta, NULL);
    if (st == ATTN_OK) return st;
    st = attn__rename_arg(st, "attn_mask", "src_mask");
    st = attn__rename_arg(st, "key_padding_mask", "src_key_padding_mask");
    return attn__rename_arg(st, "query", "src");
}

/* a = linear2(dropout(activation(linear1(in)))). */
static attn_status feed_forward(const attn_encoder_layer *l, const attn_encoder_forward_params *p,
                                const void *in, const enc_work *w, void *a) {
    const attn_dtype dt = l->cfg.dtype;
    const volatile int *cancel = attn__cancel_flag();
    attn_status st = attn__mha_gemm_abt(dt, w->R, w->F, w->E, in, w->E,
                                        attn__enc_param_data(l, "linear1.weight"),
                                        attn__enc_param_data(l, "linear1.bias"), w->h, w->F,
                                        cancel);
    if (st != ATTN_OK) return st;
    if (dt == ATTN_DTYPE_F32)
        activate_f(w->h, w->R * w->F, l->cfg.activation);
    else if (dt == ATTN_DTYPE_F64)
        activate_d(w->h, w->R * w->F, l->cfg.activation);
    else
        activate_h(dt, w->h, w->R * w->F, l->cfg.activation);
    drop(l, p, 2, w->h, w->R * w->F);
    return attn__mha_gemm_abt(dt, w->R, w->E, w->F, w->h, w->F,
                              attn__enc_param_data(l, "linear2.weight"),
                              attn__enc_param_data(l, "linear2.bias"), a, w->E, cancel);
}

/* The two sublayers, post-norm or pre-norm, on w->x in place. */
static attn_status sublayers(const attn_encoder_layer *l, const attn_tensor *src,
                             const attn_encoder_forward_params *p, enc_work *w) {
    const int64_t n = w->R * w->E;
    attn_status st;
    if (l->cfg.norm_first) {
        norm(l, 1, w->x, w->y, w);
        st = attention(l, src, p, w->y, w->a);
        if (st != ATTN_OK) return st;
        drop(l, p, 1, w->a, n);
        add_to(l, w->x, w->a, n);
        norm(l, 2, w->x, w->y, w);
        st = feed_forward(l, p, w->y, w, w->a);
        if (st != ATTN_OK) return st;
        drop(l, p, 3, w->a, n);
        add_to(l, w->x, w->a, n);
        return ATTN_OK;
    }
    st = attention(l, src, p, w->x, w->a);
    if (st != ATTN_OK) return st;
    drop(l, p, 1, w->a, n);
    add_to(l, w->x, w->a, n);
    norm(l, 1, w->x, w->x, w);
    st = feed_forward(l, p, w->x, w, w->a);
    if (st != ATTN_OK) return st;
    drop(l, p, 3, w->a, n);
    add_to(l, w->x, w->a, n);
    norm(l, 2, w->x, w->x, w);
    return ATTN_OK;
}

/* out (any strides) = the rows of x. */
static void store_out(const enc_work *w, attn_dtype dt, attn_tensor *out) {
    const int64_t n = w->R * w->E;
    bool dense = true; /* C-contiguous: one copy */
    int64_t step = 1;
    for (int d = out->rank - 1; d >= 0; step *= out->shape[d], d--)
        dense = dense && (out->shape[d] == 1 || out->strides[d] == step);
    if (dense) {
        memcpy(out->data, w->x, (size_t)n * attn_dtype_size(dt));
        return;
    }
    attn_tensor x;
    attn_tensor_init(&x, w->x, dt, out->rank, out->shape);
    attn__tensor_copy(&x, out);
}

attn_status attn_encoder_layer_forward(const attn_encoder_layer *l, const attn_tensor *src,
                                       const attn_encoder_forward_params *params,
                                       attn_tensor *out) {
    attn__clear_error();
    attn_encoder_forward_params p;
    attn_status st = check_call(l, src, params, &p, out);
    if (st != ATTN_OK) return st;
    enc_work w;
    st = work_alloc(l, src, &w);
    if (st != ATTN_OK) return st;
    st = sublayers(l, src, &p, &w);
    if (st == ATTN_OK) store_out(&w, l->cfg.dtype, out);
    work_free(&w);
    return st;
}
