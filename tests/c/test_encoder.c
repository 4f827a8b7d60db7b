/*
 * test_encoder.c — attn_encoder_layer: against a float64 layer written here
 * from torch.nn.TransformerEncoderLayer's documented formula (on top of
 * attn_mha, which test_mha checks), parameter names and order, errors that
 * name their argument, in-place calls, dropout replayed from its seed, and
 * bits that do not depend on the thread count. (tests/python/
 * test_encoder_conformance.py checks it against torch itself.)
 */
#include "testutil.h"

static attn_encoder_layer *make_layer(int64_t E, int64_t H, int64_t F, attn_activation act,
                                      int norm_first, int batch_first, attn_dtype dt) {
    attn_encoder_layer_config c;
    attn_encoder_layer_config_init(&c, E, H);
    c.dim_feedforward = F;
    c.activation = act;
    c.norm_first = norm_first;
    c.batch_first = batch_first;
    c.dtype = dt;
    c.dropout = 0.25;
    c.init_seed = 5;
    attn_encoder_layer *l = NULL;
    CHECK_OK(attn_encoder_layer_create(&c, &l));
    /* LayerNorm starts at (1, 0): give it values, so that a swapped weight
     * and bias would show */
    rng r = {77};
    const char *norms[4] = {"norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"};
    for (int i = 0; l != NULL && i < 4; i++) {
        attn_tensor v;
        CHECK_OK(attn_encoder_layer_param(l, norms[i], &v));
        for (int64_t e = 0; e < E; e++) {
            const int64_t idx[1] = {e};
            tt_set(&v, idx, 0.5 + rng_uniform(&r));
        }
    }
    return l;
}

static double *param(attn_encoder_layer *l, const char *name) {
    attn_tensor v;
    return attn_encoder_layer_param(l, name, &v) == ATTN_OK ? tt_dense(&v) : NULL;
}

/* y = LayerNorm(x) for R rows of E, in place. */
static void ref_norm(double *x, int64_t R, int64_t E, const double *g, const double *b) {
    for (int64_t r = 0; r < R; r++) {
        double m = 0, v = 0, *xr = x + r * E;
        for (int64_t e = 0; e < E; e++) m += xr[e] / (double)E;
        for (int64_t e = 0; e < E; e++) v += (xr[e] - m) * (xr[e] - m) / (double)E;
        for (int64_t e = 0; e < E; e++) xr[e] = (xr[e] - m) / sqrt(v + 1e-5) * g[e] + b[e];
    }
}

/* a = linear2(act(linear1(x))) for R rows. */
static void ref_ff(attn_encoder_layer *l, const double *x, int64_t R, int64_t E, int64_t F,
                   attn_activation act, double *a) {
    double *W1 = param(l, "linear1.weight"), *b1 = param(l, "linear1.bias"),
           *W2 = param(l, "linear2.weight"), *b2 = param(l, "linear2.bias");
    double *h = calloc((size_t)F, sizeof(double));
    for (int64_t r = 0; r < R; r++) {
        for (int64_t f = 0; f < F; f++) {
            double s = b1[f];
            for (int64_t e = 0; e < E; e++) s += W1[f * E + e] * x[r * E + e];
            h[f] = act == ATTN_ACTIVATION_RELU ? (s > 0 ? s : 0)
                   : act == ATTN_ACTIVATION_GELU
                       ? 0.5 * s * (1 + erf(s / sqrt(2.0)))
                       : 0.5 * s * (1 + tanh(sqrt(2 / 3.141592653589793) * (s + 0.044715 * s * s * s)));
        }
        for (int64_t e = 0; e < E; e++) {
            double s = b2[e];
            for (int64_t f = 0; f < F; f++) s += W2[e * F + f] * h[f];
            a[r * E + e] = s;
        }
    }
    free(h);
    free(W1);
    free(b1);
    free(W2);
    free(b2);
}

/* The layer in float64, its attention through attn_mha itself (a float64
 * copy of the layer's module: test_mha checks attn_mha). */
static double *ref_layer(attn_encoder_layer *l, const attn_tensor *src, int64_t E, int64_t F,
                         attn_activation act, int norm_first, int batch_first) {
    const int64_t n = attn_tensor_numel(src), R = n / E;
    double *x = tt_dense(src), *y = malloc(sizeof(double) * (size_t)n),
           *a = malloc(sizeof(double) * (size_t)n);
    double *g1 = param(l, "norm1.weight"), *b1 = param(l, "norm1.bias"),
           *g2 = param(l, "norm2.weight"), *b2 = param(l, "norm2.bias");
    /* the attention: a float64 attn_mha (2 heads, as make_layer's) with
     * the layer's parameters */
    attn_mha_config mc;
    attn_mha *m = NULL;
    attn_mha_config_init(&mc, E, 2);
    mc.dtype = ATTN_DTYPE_F64;
    mc.batch_first = batch_first;
    CHECK_OK(attn_mha_create(&mc, &m));
    const char *names[4] = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"};
    for (int i = 0; i < 4; i++) {
        char full[64];
        snprintf(full, sizeof full, "self_attn.%s", names[i]);
        attn_tensor v;
        CHECK_OK(attn_encoder_layer_param(l, full, &v));
        CHECK_OK(attn_mha_set_param(m, names[i], &v));
    }
    attn_tensor tin, tout;
    attn_tensor_init(&tin, norm_first ? y : x, ATTN_DTYPE_F64, src->rank, src->shape);
    attn_tensor_init(&tout, a, ATTN_DTYPE_F64, src->rank, src->shape);
    if (norm_first) {
        memcpy(y, x, sizeof(double) * (size_t)n);
        ref_norm(y, R, E, g1, b1);
    }
    CHECK_OK(attn_mha_forward(m, &tin, &tin, &tin, NULL, &tout, NULL));
    for (int64_t i = 0; i < n; i++) x[i] += a[i];
    if (!norm_first) ref_norm(x, R, E, g1, b1);
    memcpy(y, x, sizeof(double) * (size_t)n);
    if (norm_first) ref_norm(y, R, E, g2, b2);
    ref_ff(l, y, R, E, F, act, a);
    for (int64_t i = 0; i < n; i++) x[i] += a[i];
    if (!norm_first) ref_norm(x, R, E, g2, b2);
    attn_mha_destroy(m);
    free(y);
    free(a);
    free(g1);
    free(b1);
    free(g2);
    free(b2);
    return x;
}

static void matches_reference(void) {
    rng r = {harness_seed() ^ 0xe7c};
    double worst_half = 0;
    for (int i = 0; i < 48; i++) {
        static const attn_dtype halves[2] = {ATTN_DTYPE_F16, ATTN_DTYPE_BF16};
        const attn_dtype dt = i >= 24 ? halves[i % 2]
                              : i % 3 == 2 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
        const attn_activation act = (attn_activation)(i % 3);
        const int norm_first = (i / 3) % 2, batch_first = (i / 6) % 2, unbatched = i % 8 == 7;
        const int64_t E = 2 * rng_int(&r, 1, 12), F = rng_int(&r, 1, 40), L = rng_int(&r, 1, 9),
                      N = rng_int(&r, 1, 3);
        attn_encoder_layer *l = make_layer(E, 2, F, act, norm_first, batch_first, dt);
        int64_t shape[3] = {batch_first ? N : L, batch_first ? L : N, E};
        if (unbatched) shape[0] = L, shape[1] = E;
        test_tensor src, out;
        tt_make(&src, &r, dt, unbatched ? 2 : 3, shape, LAYOUT_RANDOM, 1, 0);
        tt_make_output(&out, &r, dt, unbatched ? 2 : 3, shape, LAYOUT_RANDOM);
        CHECK_OK(attn_encoder_layer_forward(l, &src.t, NULL, &out.t));
        double *want = ref_layer(l, &src.t, E, F, act, norm_first, batch_first), *got = tt_dense(&out.t);
        const int64_t n = attn_tensor_numel(&src.t);
        double size = 0;
        for (int64_t k = 0; k < n; k++) size = fmax(size, fabs(want[k]));
        /* 16-bit: the layer rounds its every step (Q, K, V, the heads, both
         * projections, each residual sum, norm, activation) once to the dtype,
         * as torch's does; tests/python/test_encoder_conformance.py holds it
         * to torch's own error. Here: 16 roundings of the largest value
         * (measured over six seeds: at most 6.4). */
        const double u = dt == ATTN_DTYPE_F16 ? 0x1p-11 : dt == ATTN_DTYPE_BF16 ? 0x1p-8 : 0;
        const double tol = (u > 0 ? 16 * u : dt == ATTN_DTYPE_F32 ? 2e-5 : 1e-12) *
                           (size > 1 ? size : 1);
        if (u > 0) worst_half = fmax(worst_half, max_abs_diff(want, got, n) / tol);
        CHECK(max_abs_diff(want, got, n) <= tol, "case %d (%s, E %lld, F %lld, act %d, "
              "norm_first %d): error %.3g > %.3g", i, attn_dtype_name(dt), (long long)E,
              (long long)F, (int)act, norm_first, max_abs_diff(want, got, n), tol);
        free(want);
        free(got);
        tt_free(&src);
        tt_free(&out);
        attn_encoder_layer_destroy(l);
    }
    printf("  16-bit layers: worst error %.2f of the bound\n", worst_half);
}

static void parameters_in_state_dict_order(void) {
    attn_encoder_layer *l = make_layer(8, 2, 16, ATTN_ACTIVATION_RELU, 0, 0, ATTN_DTYPE_F32);
    static const char *want[] = {"self_attn.in_proj_weight", "self_attn.in_proj_bias",
                                 "self_attn.out_proj.weight", "self_attn.out_proj.bias",
                                 "linear1.weight", "linear1.bias", "linear2.weight",
                                 "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight",
                                 "norm2.bias"};
    CHECK(attn_encoder_layer_param_count(l) == 12, "count %d", attn_encoder_layer_param_count(l));
    for (int i = 0; i < 12; i++) {
        const char *name = NULL;
        attn_tensor v;
        CHECK_OK(attn_encoder_layer_param_at(l, i, &name, &v));
        CHECK(name && strcmp(name, want[i]) == 0, "param %d is %s, expected %s", i,
              name ? name : "NULL", want[i]);
    }
    attn_tensor v;
    CHECK_OK(attn_encoder_layer_param(l, "linear1.weight", &v));
    CHECK(v.rank == 2 && v.shape[0] == 16 && v.shape[1] == 8, "linear1.weight shape");
    CHECK_STATUS(attn_encoder_layer_param(l, "linear3.weight", &v), ATTN_ERR_INVALID);
    CHECK(strstr(attn_last_error(), "norm2.bias") != NULL, "the message lists the names: %s",
          attn_last_error());
    double w[8 * 16];
    for (int i = 0; i < 128; i++) w[i] = i;
    attn_tensor src;
    CHECK_OK(attn_tensor_init(&src, w, ATTN_DTYPE_F64, 2, (int64_t[]){8, 16}));
    CHECK_OK(attn_tensor_transpose(&src, 0, 1)); /* (16, 8), strided */
    CHECK_OK(attn_encoder_layer_set_param(l, "linear1.weight", &src));
    CHECK(((float *)v.data)[1] == 16.0f, "set_param copied the strided source");
    CHECK_STATUS(attn_encoder_layer_set_param(l, "linear2.weight", &src), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "linear2.weight") == 0, "arg %s", attn_last_error_arg());
    /* A source that is a view of the parameter itself, reversed: read whole
     * before it is written (it was copied over itself, element by element) */
    attn_tensor n1, rev;
    CHECK_OK(attn_encoder_layer_param(l, "norm1.weight", &n1));
    float *g = n1.data;
    for (int i = 0; i < 8; i++) g[i] = (float)i;
    rev = n1;
    rev.data = g + 7;
    rev.strides[0] = -1;
    CHECK_OK(attn_encoder_layer_set_param(l, "norm1.weight", &rev));
    for (int i = 0; i < 8; i++) CHECK(g[i] == (float)(7 - i), "norm1.weight[%d] is %g", i, g[i]);
    attn_tensor w2, w2t; /* a square weight of the attention: out_proj, transposed in place */
    CHECK_OK(attn_encoder_layer_param(l, "self_attn.out_proj.weight", &w2));
    float *o = w2.data;
    for (int i = 0; i < 64; i++) o[i] = (float)i;
    w2t = w2;
    CHECK_OK(attn_tensor_transpose(&w2t, 0, 1));
    CHECK_OK(attn_encoder_layer_set_param(l, "self_attn.out_proj.weight", &w2t));
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++)
            CHECK(o[i * 8 + j] == (float)(j * 8 + i), "out_proj.weight[%d][%d] is %g", i, j,
                  o[i * 8 + j]);
    attn_encoder_layer_destroy(l);

    attn_encoder_layer_config c;
    attn_encoder_layer_config_init(&c, 8, 2);
    c.bias = 0;
    CHECK_OK(attn_encoder_layer_create(&c, &l));
    CHECK(attn_encoder_layer_param_count(l) == 6, "bias=0: %d params",
          attn_encoder_layer_param_count(l));
    attn_encoder_layer_destroy(l);
}

static void errors_name_the_argument(void) {
    attn_encoder_layer_config c;
    attn_encoder_layer *l = NULL;
    attn_encoder_layer_config_init(&c, 8, 3);
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "config.nhead") == 0 && l == NULL, "nhead");
    attn_encoder_layer_config_init(&c, 8, 2);
    c.dim_feedforward = 0;
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "config.dim_feedforward") == 0, "dim_feedforward");
    attn_encoder_layer_config_init(&c, 8, 2);
    c.dropout = 1.5;
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "config.dropout") == 0, "dropout");
    attn_encoder_layer_config_init(&c, 8, 2);
    c.norm_first = -3; /* flags are 0 or 1, as a call's batch_first */
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "config.norm_first") == 0, "norm_first");
    attn_encoder_layer_config_init(&c, 8, 2);
    c.batch_first = 7;
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "config.batch_first") == 0, "batch_first");
    attn_encoder_layer_config_init(&c, 8, 2);
    c.layer_norm_eps = NAN;
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "config.layer_norm_eps") == 0, "eps");
    attn_encoder_layer_config_init(&c, 8, 2);
    c.activation = (attn_activation)7;
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "config.activation") == 0, "activation");
    CHECK_STATUS(attn_encoder_layer_create(NULL, &l), ATTN_ERR_NULL);
    CHECK_STATUS(attn_encoder_layer_create(&c, NULL), ATTN_ERR_NULL);
    attn_encoder_layer_config_init(&c, 3, 1); /* 2·F·E overflows (UBSan once) */
    c.dim_feedforward = INT64_MAX / 4;
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_OVERFLOW);
    CHECK(strcmp(attn_last_error_arg(), "config.dim_feedforward") == 0 && l == NULL, "huge F");
    attn_encoder_layer_config_init(&c, 1, 1);
    c.dim_feedforward = INT64_MAX / 2;
    CHECK_STATUS(attn_encoder_layer_create(&c, &l), ATTN_ERR_OVERFLOW);

    l = make_layer(8, 2, 16, ATTN_ACTIVATION_GELU, 0, 0, ATTN_DTYPE_F32);
    float x[3 * 2 * 8] = {0}, y[3 * 2 * 8];
    bool kpm[2 * 5] = {0}, m[5 * 5] = {0};
    attn_tensor src, out, tk, tm;
    attn_tensor_init(&src, x, ATTN_DTYPE_F32, 3, (int64_t[]){3, 2, 8});
    attn_tensor_init(&out, y, ATTN_DTYPE_F32, 3, (int64_t[]){3, 2, 8});
    attn_tensor_init(&tk, kpm, ATTN_DTYPE_BOOL, 2, (int64_t[]){2, 5});
    attn_tensor_init(&tm, m, ATTN_DTYPE_BOOL, 2, (int64_t[]){5, 5});
    attn_encoder_forward_params p;
    attn_encoder_forward_params_init(&p);
    CHECK_STATUS(attn_encoder_layer_forward(NULL, &src, &p, &out), ATTN_ERR_NULL);
    CHECK(strcmp(attn_last_error_arg(), "layer") == 0, "layer");
    p.src_key_padding_mask = &tk;
    CHECK_STATUS(attn_encoder_layer_forward(l, &src, &p, &out), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "src_key_padding_mask") == 0, "kpm arg %s: %s",
          attn_last_error_arg(), attn_last_error());
    p.src_key_padding_mask = NULL;
    p.src_mask = &tm;
    CHECK_STATUS(attn_encoder_layer_forward(l, &src, &p, &out), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "src_mask") == 0, "mask arg %s", attn_last_error_arg());
    p.src_mask = NULL;
    p.batch_first = 2;
    CHECK_STATUS(attn_encoder_layer_forward(l, &src, &p, &out), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "params.batch_first") == 0, "batch_first");
    p.batch_first = -1;
    attn_tensor wrong = out;
    wrong.shape[2] = 4;
    CHECK_STATUS(attn_encoder_layer_forward(l, &src, &p, &wrong), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "out") == 0, "out");
    wrong = src;
    wrong.shape[2] = 4;
    CHECK_STATUS(attn_encoder_layer_forward(l, &wrong, &p, &out), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "src") == 0, "src");
    double xd[48];
    attn_tensor srcd;
    attn_tensor_init(&srcd, xd, ATTN_DTYPE_F64, 3, (int64_t[]){3, 2, 8});
    CHECK_STATUS(attn_encoder_layer_forward(l, &srcd, &p, &out), ATTN_ERR_DTYPE);
    CHECK(strcmp(attn_last_error_arg(), "src") == 0, "src dtype");
    /* out over the layer's parameters, its own or its attention's: refused,
     * nothing written (the weights were overwritten with ATTN_OK) */
    const char *targets[2] = {"linear1.weight", "self_attn.in_proj_weight"};
    for (int t = 0; t < 2; t++) {
        attn_tensor pv, over;
        CHECK_OK(attn_encoder_layer_param(l, targets[t], &pv));
        const float before = ((float *)pv.data)[0];
        attn_tensor_init(&over, pv.data, ATTN_DTYPE_F32, 3, (int64_t[]){3, 2, 8});
        CHECK_STATUS(attn_encoder_layer_forward(l, &src, &p, &over), ATTN_ERR_OVERLAP);
        CHECK(strcmp(attn_last_error_arg(), "out") == 0, "out over %s: arg %s", targets[t],
              attn_last_error_arg());
        CHECK(((float *)pv.data)[0] == before, "%s was written", targets[t]);
    }
    attn_encoder_layer_destroy(l);
}

/* out may be src; dropout is a function of (seed, rng_offset); the bits do
 * not depend on the thread count. */
static void in_place_dropout_and_threads(void) {
    rng r = {harness_seed() ^ 0xd0};
    attn_encoder_layer *l = make_layer(16, 2, 48, ATTN_ACTIVATION_GELU_TANH, 1, 1, ATTN_DTYPE_F32);
    int64_t shape[3] = {3, 40, 16};
    test_tensor src;
    tt_make(&src, &r, ATTN_DTYPE_F32, 3, shape, LAYOUT_CONTIGUOUS, 1, 0);
    const size_t bytes = sizeof(float) * 3 * 40 * 16;
    float *a = malloc(bytes), *b = malloc(bytes), *c = malloc(bytes), *inplace = malloc(bytes);
    attn_tensor ta, tb, tc, ti;
    attn_tensor_init(&ta, a, ATTN_DTYPE_F32, 3, shape);
    attn_tensor_init(&tb, b, ATTN_DTYPE_F32, 3, shape);
    attn_tensor_init(&tc, c, ATTN_DTYPE_F32, 3, shape);
    attn_encoder_forward_params p;
    attn_encoder_forward_params_init(&p);
    p.training = 1;
    p.seed = 42;
    attn_set_num_threads(1);
    CHECK_OK(attn_encoder_layer_forward(l, &src.t, &p, &ta));
    attn_set_num_threads(2);
    CHECK_OK(attn_encoder_layer_forward(l, &src.t, &p, &tb));
    attn_set_num_threads(0);
    CHECK(memcmp(a, b, bytes) == 0, "1 and 2 threads differ");
    p.rng_offset = 4; /* the next layer's streams */
    CHECK_OK(attn_encoder_layer_forward(l, &src.t, &p, &tc));
    CHECK(memcmp(a, c, bytes) != 0, "another rng_offset drew the same dropout");
    memcpy(inplace, src.t.data, bytes);
    attn_tensor_init(&ti, inplace, ATTN_DTYPE_F32, 3, shape);
    p.rng_offset = 0;
    CHECK_OK(attn_encoder_layer_forward(l, &ti, &p, &ti));
    CHECK(memcmp(a, inplace, bytes) == 0, "out = src gave another result");
    p.training = 0; /* eval: no dropout, so another seed changes nothing */
    CHECK_OK(attn_encoder_layer_forward(l, &src.t, &p, &ta));
    p.seed = 43;
    CHECK_OK(attn_encoder_layer_forward(l, &src.t, &p, &tb));
    CHECK(memcmp(a, b, bytes) == 0, "eval depends on the seed");
    free(a);
    free(b);
    free(c);
    free(inplace);
    tt_free(&src);
    attn_encoder_layer_destroy(l);
}

HARNESS_MAIN(T(matches_reference), T(parameters_in_state_dict_order), T(errors_name_the_argument),
             T(in_place_dropout_and_threads))
