/*
 * test_errors.c — every invalid input gives the right status and a message
 * that names the problem; nothing crashes (this file runs under ASan+UBSan
 * in CI).
 */
#include "testutil.h"

static float qd[2 * 3 * 4 * 8], kd[2 * 3 * 5 * 8], vd[2 * 3 * 5 * 6], od[2 * 3 * 4 * 6];
static float wd[2 * 3 * 4 * 5], ld[2 * 3 * 4];
static unsigned char md[4 * 5];

typedef struct fixture {
    attn_tensor q, k, v, out, weights, lse, mask;
    attn_sdpa_params p;
} fixture;

/* A valid call: q (2,3,4,8), k (2,3,5,8), v (2,3,5,6). */
static void setup(fixture *f) {
    int64_t qs[4] = {2, 3, 4, 8}, ks[4] = {2, 3, 5, 8}, vs[4] = {2, 3, 5, 6}, os[4] = {2, 3, 4, 6},
            ws[4] = {2, 3, 4, 5}, ms[2] = {4, 5};
    attn_tensor_init(&f->q, qd, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&f->k, kd, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&f->v, vd, ATTN_DTYPE_F32, 4, vs);
    attn_tensor_init(&f->out, od, ATTN_DTYPE_F32, 4, os);
    attn_tensor_init(&f->weights, wd, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&f->lse, ld, ATTN_DTYPE_F32, 3, os);
    attn_tensor_init(&f->mask, md, ATTN_DTYPE_BOOL, 2, ms);
    memset(md, 1, sizeof md);
    attn_sdpa_params_init(&f->p);
}

static attn_status call(fixture *f) {
    return attn_sdpa(&f->q, &f->k, &f->v, &f->p, &f->out, &f->weights, &f->lse);
}

/* The message of the last call mentions `needle`. */
#define CHECK_MESSAGE(needle) \
    CHECK(strstr(attn_last_error(), needle) != NULL, "message '%s' lacks '%s'", attn_last_error(), needle)

static void valid_baseline(void) {
    fixture f;
    setup(&f);
    CHECK_OK(call(&f));
    CHECK(attn_last_error()[0] == '\0', "success leaves a message");
}

static void null_pointers(void) {
    fixture f;
    setup(&f);
    CHECK_STATUS(attn_sdpa(NULL, &f.k, &f.v, NULL, &f.out, NULL, NULL), ATTN_ERR_NULL);
    CHECK_MESSAGE("q");
    CHECK_STATUS(attn_sdpa(&f.q, NULL, &f.v, NULL, &f.out, NULL, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_sdpa(&f.q, &f.k, NULL, NULL, &f.out, NULL, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_sdpa(&f.q, &f.k, &f.v, NULL, NULL, NULL, NULL), ATTN_ERR_NULL);
    CHECK_MESSAGE("out");
    f.k.data = NULL;
    CHECK_STATUS(call(&f), ATTN_ERR_NULL);
    CHECK_MESSAGE("k->data");
    setup(&f);
    f.weights.data = NULL;
    CHECK_STATUS(call(&f), ATTN_ERR_NULL);
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    CHECK_STATUS(attn_sdpa_out_shape(&f.q, &f.k, &f.v, NULL, NULL, shape), ATTN_ERR_NULL);
    CHECK_STATUS(attn_sdpa_out_shape(&f.q, &f.k, &f.v, NULL, &rank, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_tensor_init(NULL, qd, ATTN_DTYPE_F32, 1, shape), ATTN_ERR_NULL);
    CHECK_STATUS(attn_tensor_permute(NULL, NULL), ATTN_ERR_NULL);
}

static void bad_rank(void) {
    fixture f;
    setup(&f);
    f.q.rank = 1;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("q has rank 1");
    setup(&f);
    f.k.rank = ATTN_MAX_RANK + 1;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    setup(&f);
    f.v.rank = 0;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    setup(&f);
    f.out.rank = 3; /* out must have the broadcast rank */
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    int64_t shape[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    attn_tensor t;
    CHECK_STATUS(attn_tensor_init(&t, qd, ATTN_DTYPE_F32, 9, shape), ATTN_ERR_SHAPE);
    CHECK_STATUS(attn_tensor_init(&t, qd, ATTN_DTYPE_F32, 0, shape), ATTN_ERR_SHAPE);
}

static void shape_mismatch(void) {
    fixture f;
    setup(&f);
    f.k.shape[3] = 7; /* E differs */
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("k.shape[-1] is 7 but q.shape[-1] is 8");
    setup(&f);
    f.v.shape[2] = 4; /* S differs between k and v */
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("v.shape[-2] is 4");
    setup(&f);
    f.k.shape[0] = 1;
    f.v.shape[0] = 1;
    f.q.shape[0] = 2;
    CHECK_OK(call(&f)); /* batch 1 broadcasts */
    setup(&f);
    f.k.shape[1] = 2; /* 3 query heads vs 2 key heads, no GQA */
    f.v.shape[1] = 2;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("does not broadcast");
    setup(&f);
    f.out.shape[3] = 5;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("out has shape (2, 3, 4, 5); expected (2, 3, 4, 6)");
    setup(&f);
    f.weights.shape[3] = 4;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("weights");
    setup(&f);
    f.lse.shape[2] = 5;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("lse");
}

static void heads_not_dividing(void) {
    fixture f;
    setup(&f);
    f.p.enable_gqa = 1;
    f.k.shape[1] = 2; /* 3 query heads over 2 key heads */
    f.v.shape[1] = 2;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("multiple of the key and value heads");
    setup(&f);
    f.p.enable_gqa = 1;
    f.k.shape[1] = 1;
    f.v.shape[1] = 1;
    CHECK_OK(call(&f)); /* 3 over 1: fine */
    setup(&f);
    f.p.enable_gqa = 1;
    f.q.rank = f.k.rank = f.v.rank = 2; /* no head dimension at all */
    memmove(f.q.shape, f.q.shape + 2, 2 * sizeof(int64_t));
    memmove(f.q.strides, f.q.strides + 2, 2 * sizeof(int64_t));
    memmove(f.k.shape, f.k.shape + 2, 2 * sizeof(int64_t));
    memmove(f.k.strides, f.k.strides + 2, 2 * sizeof(int64_t));
    memmove(f.v.shape, f.v.shape + 2, 2 * sizeof(int64_t));
    memmove(f.v.strides, f.v.strides + 2, 2 * sizeof(int64_t));
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("enable_gqa needs a head dimension");
}

static void zero_size(void) {
    fixture f;
    setup(&f);
    f.q.shape[2] = 0;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("q.shape[2] is 0");
    setup(&f);
    f.k.shape[0] = -3;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    int64_t shape[2] = {3, 0};
    attn_tensor t;
    CHECK_STATUS(attn_tensor_init(&t, qd, ATTN_DTYPE_F32, 2, shape), ATTN_ERR_SHAPE);
}

static void size_overflow(void) {
    fixture f;
    setup(&f);
    /* 2^40 x 2^40 elements: the byte count overflows; no memory is touched. */
    f.q.shape[2] = (int64_t)1 << 40;
    f.q.shape[3] = (int64_t)1 << 40;
    f.q.strides[2] = (int64_t)1 << 40;
    CHECK_STATUS(call(&f), ATTN_ERR_OVERFLOW);
    setup(&f);
    f.k.strides[3] = INT64_MAX / 2; /* span overflows */
    CHECK_STATUS(call(&f), ATTN_ERR_OVERFLOW);
    setup(&f);
    f.v.strides[0] = INT64_MIN;
    CHECK_STATUS(call(&f), ATTN_ERR_OVERFLOW);
    /* batch x L x S overflows even though each tensor fits. */
    setup(&f);
    int64_t big = (int64_t)1 << 31;
    f.q.shape[0] = big;
    f.q.strides[0] = 0;
    f.q.shape[2] = big;
    f.q.strides[2] = 0;
    f.k.shape[0] = 1;
    f.k.shape[2] = big;
    f.k.strides[2] = 0;
    f.v.shape[0] = 1;
    f.v.shape[2] = big;
    f.v.strides[2] = 0;
    CHECK_STATUS(call(&f), ATTN_ERR_OVERFLOW);
    int64_t shape[3] = {(int64_t)1 << 30, (int64_t)1 << 30, (int64_t)1 << 30};
    attn_tensor t;
    CHECK_STATUS(attn_tensor_init(&t, qd, ATTN_DTYPE_F32, 3, shape), ATTN_ERR_OVERFLOW);
}

static void bad_dtypes(void) {
    fixture f;
    setup(&f);
    f.q.dtype = ATTN_DTYPE_BOOL;
    CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
    setup(&f);
    f.k.dtype = ATTN_DTYPE_F64;
    CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
    CHECK_MESSAGE("share one dtype");
    setup(&f);
    f.v.dtype = (attn_dtype)42;
    CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
    setup(&f);
    f.out.dtype = ATTN_DTYPE_F64;
    CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
    setup(&f);
    f.lse.dtype = ATTN_DTYPE_BOOL; /* q's dtype or float64 */
    CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
    CHECK(attn_dtype_size((attn_dtype)42) == 0 && strcmp(attn_dtype_name((attn_dtype)42), "unknown") == 0,
          "unknown dtype");
}

static void bad_masks(void) {
    fixture f;
    setup(&f);
    f.p.attn_mask = &f.mask;
    CHECK_OK(call(&f)); /* (L, S) broadcasts */
    f.mask.shape[1] = 6; /* not S */
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("attn_mask has shape (4, 6), which does not broadcast");
    setup(&f);
    f.p.attn_mask = &f.mask;
    f.mask.rank = 5; /* more dims than the weights */
    for (int d = 0; d < 5; d++) f.mask.shape[d] = 1, f.mask.strides[d] = 0;
    CHECK_STATUS(call(&f), ATTN_ERR_SHAPE);
    setup(&f);
    f.p.attn_mask = &f.mask;
    f.mask.dtype = (attn_dtype)7;
    CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
    setup(&f);
    f.p.attn_mask = &f.mask;
    f.mask.data = NULL;
    CHECK_STATUS(call(&f), ATTN_ERR_NULL);
    CHECK_MESSAGE("attn_mask");
}

static void bad_values(void) {
    fixture f;
    setup(&f);
    f.p.has_scale = 1;
    f.p.scale = NAN;
    CHECK_STATUS(call(&f), ATTN_ERR_INVALID);
    CHECK_MESSAGE("scale");
    f.p.scale = INFINITY;
    CHECK_STATUS(call(&f), ATTN_ERR_INVALID);
    f.p.scale = -0.5;
    CHECK_OK(call(&f));
    setup(&f);
    const double bad_p[] = {-0.1, 1.5, NAN};
    for (int i = 0; i < 3; i++) {
        f.p.dropout_p = bad_p[i];
        CHECK_STATUS(call(&f), ATTN_ERR_INVALID);
        CHECK_MESSAGE("dropout_p");
    }
    setup(&f);
    f.p.causal = (attn_causal)9;
    CHECK_STATUS(call(&f), ATTN_ERR_INVALID);
    setup(&f);
    f.out.strides[3] = 0; /* overlapping output elements */
    CHECK_STATUS(call(&f), ATTN_ERR_INVALID);
    CHECK_MESSAGE("overlap");
    CHECK_STATUS(attn_set_isa((attn_isa)99), ATTN_ERR_INVALID);
    attn_tensor t = f.q;
    CHECK_STATUS(attn_tensor_permute(&t, (int[]){0, 0, 1, 2}), ATTN_ERR_INVALID);
    CHECK_STATUS(attn_tensor_transpose(&t, 0, 4), ATTN_ERR_INVALID);
}

static void status_strings(void) {
    for (int s = 0; s <= 9; s++) {
        const char *m = attn_strerror((attn_status)s);
        CHECK(m != NULL && m[0] != '\0', "status %d has no string", s);
    }
    CHECK(strcmp(attn_strerror((attn_status)1234), "unknown status code") == 0, "unknown code");
    CHECK(strcmp(attn_version(), ATTN_VERSION_STRING) == 0, "version string");
    CHECK(attn_version_number() == ATTN_VERSION_NUMBER, "version number");
}

/* ---- MHA ---- */

static void mha_config_errors(void) {
    attn_mha_config c;
    attn_mha *m = (attn_mha *)&c; /* must be reset to NULL on failure */
    attn_mha_config_init(&c, 200, 6);
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_SHAPE);
    CHECK(m == NULL, "failed create leaves a pointer");
    CHECK_MESSAGE("not divisible by num_heads");
    CHECK_MESSAGE("even split");
    attn_mha_config_init(&c, 0, 1);
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    attn_mha_config_init(&c, 8, 0);
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    attn_mha_config_init(&c, 8, 2);
    c.dropout = 2;
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    attn_mha_config_init(&c, 8, 2);
    c.dtype = ATTN_DTYPE_BOOL;
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_DTYPE);
    CHECK_STATUS(attn_mha_create(NULL, &m), ATTN_ERR_NULL);
    attn_mha_config_init(&c, 8, 2);
    CHECK_STATUS(attn_mha_create(&c, NULL), ATTN_ERR_NULL);
    attn_mha_config_init(&c, (int64_t)1 << 40, 1);
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_OVERFLOW);
    attn_mha_destroy(NULL); /* a no-op */
}

static void mha_forward_errors(void) {
    attn_mha_config c;
    attn_mha_config_init(&c, 8, 2);
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&c, &m));
    static float x[5 * 3 * 8], y[5 * 3 * 8], w[3 * 5 * 5];
    static unsigned char mask[5 * 5];
    int64_t xs[3] = {5, 3, 8}, ws[3] = {3, 5, 5};
    attn_tensor tx, ty, tw, tm;
    attn_tensor_init(&tx, x, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&ty, y, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&tw, w, ATTN_DTYPE_F32, 3, ws);
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, NULL, &ty, &tw));
    CHECK_STATUS(attn_mha_forward(NULL, &tx, &tx, &tx, NULL, &ty, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, NULL, NULL, NULL), ATTN_ERR_NULL);
    attn_tensor bad = tx;
    bad.shape[2] = 7;
    CHECK_STATUS(attn_mha_forward(m, &bad, &tx, &tx, NULL, &ty, NULL), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("query.shape[-1] is 7; expected embed_dim = 8");
    bad = tx;
    bad.shape[1] = 2; /* batch differs */
    CHECK_STATUS(attn_mha_forward(m, &tx, &bad, &tx, NULL, &ty, NULL), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("got 3, 2 and 3");
    /* attn_mha_out_shapes sees no value, so its message must not invent one
     * (it used to report the query's batch size as the value's). */
    int orank, wrank;
    int64_t oshape[ATTN_MAX_RANK], wshape[ATTN_MAX_RANK];
    CHECK_STATUS(attn_mha_out_shapes(m, &tx, &bad, NULL, 1, &orank, oshape, &wrank, wshape),
                 ATTN_ERR_SHAPE);
    CHECK_MESSAGE("query and key must have the same batch size; got 3 and 2");
    bad = tx;
    bad.rank = 4;
    CHECK_STATUS(attn_mha_forward(m, &bad, &tx, &tx, NULL, &ty, NULL), ATTN_ERR_SHAPE);
    bad = tx;
    bad.dtype = ATTN_DTYPE_F64;
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &bad, NULL, &ty, NULL), ATTN_ERR_DTYPE);
    attn_tensor wrong_w = tw;
    wrong_w.shape[2] = 4;
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, NULL, &ty, &wrong_w), ATTN_ERR_SHAPE);
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    int64_t ms[2] = {5, 4};
    attn_tensor_init(&tm, mask, ATTN_DTYPE_BOOL, 2, ms);
    fp.attn_mask = &tm;
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, NULL), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("attn_mask has shape (5, 4)");
    attn_mha_forward_params_init(&fp);
    fp.key_padding_mask = &tm; /* (5, 4) is not (N=3, S=5) */
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, NULL), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("key_padding_mask has shape (5, 4); expected (3, 5)");
    /* parameters */
    attn_tensor view;
    CHECK_STATUS(attn_mha_param(m, "nope", &view), ATTN_ERR_INVALID);
    CHECK_MESSAGE("in_proj_weight");
    CHECK_STATUS(attn_mha_set_param(m, "out_proj.weight", &tx), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("expects (8, 8)");
    CHECK_STATUS(attn_mha_param_at(m, 99, NULL, NULL), ATTN_ERR_INVALID);
    attn_mha_destroy(m);
}

/* ---- the 16-bit storage dtypes (issue 16) ---- */

/* The arg of the last failure is `arg`. */
#define CHECK_ARG(arg) \
    CHECK(strcmp(attn_last_error_arg(), arg) == 0, "arg '%s', expected '%s' (%s)", \
          attn_last_error_arg(), arg, attn_last_error())

/* float16 and bfloat16 computations (issue 13): every operand may be
 * 16-bit, under the rules of attn.h's "Dtypes"; each broken rule is refused
 * with ATTN_ERR_DTYPE naming the operand that breaks it. */
static void half_dtype_rules_sdpa(void) {
    CHECK(attn_dtype_size(ATTN_DTYPE_F16) == 2 && attn_dtype_size(ATTN_DTYPE_BF16) == 2,
          "16-bit sizes");
    CHECK(strcmp(attn_dtype_name(ATTN_DTYPE_F16), "float16") == 0 &&
              strcmp(attn_dtype_name(ATTN_DTYPE_BF16), "bfloat16") == 0,
          "16-bit names");
    const attn_dtype halves[2] = {ATTN_DTYPE_F16, ATTN_DTYPE_BF16};
    for (int h = 0; h < 2; h++) {
        const attn_dtype dt = halves[h], other = halves[1 - h];
        fixture f;
        /* one operand 16-bit, the rest float32: which rule names whom */
        attn_tensor *ops[6] = {&f.q, &f.k, &f.v, &f.out, &f.weights, &f.lse};
        const char *names[6] = {"k", "k", "v", "out", "weights", "lse"};
        const char *says[6] = {"like the query", "share one dtype", "share one dtype",
                               "like the query", "like the query", "or float64"};
        for (int i = 0; i < 6; i++) {
            setup(&f);
            ops[i]->dtype = dt;
            CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
            CHECK_ARG(names[i]);
            CHECK_MESSAGE(says[i]);
        }
        /* float64 queries take float64 keys only; the two 16-bit dtypes do not mix */
        setup(&f);
        f.q.dtype = f.out.dtype = f.weights.dtype = ATTN_DTYPE_F64;
        f.k.dtype = f.v.dtype = dt;
        CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
        CHECK_ARG("k");
        setup(&f);
        f.q.dtype = f.out.dtype = f.weights.dtype = dt;
        f.k.dtype = f.v.dtype = other;
        CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
        CHECK_ARG("k");
        /* an integer mask is refused; 16-bit float masks are fine */
        setup(&f);
        f.p.attn_mask = &f.mask;
        f.mask.dtype = ATTN_DTYPE_I32;
        CHECK_STATUS(call(&f), ATTN_ERR_DTYPE);
        CHECK_ARG("attn_mask");
        CHECK_MESSAGE("float16 or bfloat16");
        setup(&f);
        int rank;
        int64_t shape[ATTN_MAX_RANK];
        f.q.dtype = dt;
        CHECK_STATUS(attn_sdpa_out_shape(&f.q, &f.k, &f.v, NULL, &rank, shape), ATTN_ERR_DTYPE);
        CHECK_ARG("k");
        /* The backward: dout and out in the query's dtype, lse float32 or float64. */
        setup(&f);
        CHECK_OK(attn_sdpa(&f.q, &f.k, &f.v, NULL, &f.out, NULL, &f.lse));
        static float dq[2 * 3 * 4 * 8], dout[2 * 3 * 4 * 6];
        attn_tensor tdout = f.out, tdq = f.q;
        tdout.data = dout;
        tdq.data = dq;
        attn_tensor *bops[4] = {&tdout, &f.out, &f.lse, &tdq};
        const char *bnames[4] = {"dout", "out", "lse", "dq"};
        for (int i = 0; i < 4; i++) {
            bops[i]->dtype = dt;
            CHECK_STATUS(attn_sdpa_backward(&tdout, &f.q, &f.k, &f.v, &f.out, &f.lse, NULL, &tdq,
                                            NULL, NULL, NULL),
                         ATTN_ERR_DTYPE);
            CHECK_ARG(bnames[i]);
            bops[i]->dtype = ATTN_DTYPE_F32;
        }
    }
}

static void storage_dtypes_mha(void) {
    attn_mha_config c;
    attn_mha *m = NULL;
    attn_mha_config_init(&c, 8, 2);
    c.dtype = ATTN_DTYPE_BOOL;
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_DTYPE);
    CHECK_ARG("config.dtype");
    c.dtype = ATTN_DTYPE_BF16; /* a bfloat16 module takes bfloat16 operands only */
    CHECK_OK(attn_mha_create(&c, &m));
    attn_mha_destroy(m);
    attn_mha_config_init(&c, 8, 2);
    CHECK_OK(attn_mha_create(&c, &m));
    static float x[5 * 3 * 8], y[5 * 3 * 8], w[3 * 5 * 5];
    static unsigned char mask[5 * 5];
    int64_t xs[3] = {5, 3, 8}, ws[3] = {3, 5, 5}, ms[2] = {5, 5}, ks[2] = {3, 5};
    attn_tensor tx, ty, tw, tm, tk;
    attn_tensor_init(&tx, x, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&ty, y, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&tw, w, ATTN_DTYPE_F32, 3, ws);
    attn_tensor_init(&tm, mask, ATTN_DTYPE_BOOL, 2, ms);
    attn_tensor_init(&tk, mask, ATTN_DTYPE_BOOL, 2, ks);
    attn_tensor half = tx;
    half.dtype = ATTN_DTYPE_F16;
    CHECK_STATUS(attn_mha_forward(m, &half, &tx, &tx, NULL, &ty, NULL), ATTN_ERR_DTYPE);
    CHECK_ARG("query");
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &half, NULL, &ty, NULL), ATTN_ERR_DTYPE);
    CHECK_ARG("value");
    half = ty;
    half.dtype = ATTN_DTYPE_BF16;
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, NULL, &half, NULL), ATTN_ERR_DTYPE);
    CHECK_ARG("out");
    half = tw;
    half.dtype = ATTN_DTYPE_F16;
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, NULL, &ty, &half), ATTN_ERR_DTYPE);
    CHECK_ARG("weights");
    /* Masks: bool or any float dtype (a 16-bit float mask is added exactly). */
    static uint16_t half_zeros[5 * 5];
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    tm.dtype = ATTN_DTYPE_BF16;
    tm.data = half_zeros;
    fp.attn_mask = &tm;
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, NULL));
    attn_mha_forward_params_init(&fp);
    tk.dtype = ATTN_DTYPE_F16;
    tk.data = half_zeros;
    fp.key_padding_mask = &tk;
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, NULL));
    /* The backward's dout. */
    attn_mha_saved *saved = NULL;
    CHECK_OK(attn_mha_forward_train(m, &tx, &tx, &tx, NULL, &ty, NULL, &saved));
    half = ty;
    half.dtype = ATTN_DTYPE_BF16;
    CHECK_STATUS(attn_mha_backward(m, saved, &tx, &tx, &tx, &half, NULL, NULL, NULL, NULL),
                 ATTN_ERR_DTYPE);
    CHECK_ARG("dout");
    attn_mha_saved_destroy(saved);
    /* attn_mha_set_param widens them exactly: 1.5 (0x3fc0 in both), -2^-24
     * (float16's smallest subnormal, 0x8001), and bfloat16's 2^-133. */
    uint16_t f16[8 * 8], bf16[8 * 8];
    for (int i = 0; i < 64; i++) {
        f16[i] = i % 2 ? 0x3e00 : 0x8001; /* 1.5, -2^-24 */
        bf16[i] = i % 2 ? 0x3fc0 : 0x0001; /* 1.5, 2^-133 */
    }
    int64_t ps[2] = {8, 8};
    attn_tensor src, view;
    attn_tensor_init(&src, f16, ATTN_DTYPE_F16, 2, ps);
    CHECK_OK(attn_mha_set_param(m, "out_proj.weight", &src));
    CHECK_OK(attn_mha_param(m, "out_proj.weight", &view));
    const float *p = view.data;
    CHECK(p[0] == -0x1p-24f && p[1] == 1.5f, "float16 widened to %g, %g", p[0], p[1]);
    attn_tensor_init(&src, bf16, ATTN_DTYPE_BF16, 2, ps);
    CHECK_OK(attn_mha_set_param(m, "out_proj.weight", &src));
    CHECK(p[0] == 0x1p-133f && p[1] == 1.5f, "bfloat16 widened to %g, %g", p[0], p[1]);
    attn_mha_destroy(m);
}

/* .npy holds float16 ('<f2'), not bfloat16 (NumPy has no descr for it)
 * nor int32 (attn never writes index files). */
static void storage_dtypes_npy(void) {
    uint16_t h[4] = {0x3c00, 0x8001, 0x7bff, 0xfc00}; /* 1, -2^-24, 65504, -inf */
    int64_t s4[1] = {4};
    attn_tensor t, back;
    attn_tensor_init(&t, h, ATTN_DTYPE_F16, 1, s4);
    const char *path = "/tmp/attn_f16_roundtrip.npy";
    CHECK_OK(attn_npy_save(path, &t));
    CHECK_OK(attn_npy_load(path, &back));
    CHECK(back.dtype == ATTN_DTYPE_F16 && back.rank == 1 && back.shape[0] == 4 &&
              memcmp(back.data, h, sizeof h) == 0,
          "float16 .npy round trip");
    attn_npy_free(&back);
    remove(path);
    t.dtype = ATTN_DTYPE_BF16;
    remove("/tmp/attn_never_written.npy"); /* a stale one from an older run */
    CHECK_STATUS(attn_npy_save("/tmp/attn_never_written.npy", &t), ATTN_ERR_DTYPE);
    CHECK_ARG("tensor");
    CHECK_MESSAGE("attn_safetensors_save");
    CHECK_STATUS(attn_npy_write_fd(1, &t), ATTN_ERR_DTYPE);
    CHECK_MESSAGE("bfloat16");
    int32_t ints[4] = {0};
    attn_tensor ti;
    attn_tensor_init(&ti, ints, ATTN_DTYPE_I32, 1, s4);
    CHECK_STATUS(attn_npy_save("/tmp/attn_never_written.npy", &ti), ATTN_ERR_DTYPE);
    FILE *f = fopen("/tmp/attn_never_written.npy", "rb");
    CHECK(f == NULL, "a refused save created its file");
    if (f != NULL) fclose(f);
}

/* ---- .npy ---- */

static attn_status parse_text(const char *header, size_t data_bytes, int version) {
    unsigned char buf[4096];
    size_t hl = strlen(header), pre = version == 1 ? 10 : 12;
    memcpy(buf, "\x93NUMPY", 6);
    buf[6] = (unsigned char)version;
    buf[7] = 0;
    buf[8] = (unsigned char)(hl & 0xff);
    buf[9] = (unsigned char)(hl >> 8);
    if (version != 1) buf[10] = buf[11] = 0;
    memcpy(buf + pre, header, hl);
    memset(buf + pre + hl, 0, data_bytes);
    attn_tensor t;
    attn_status st = attn_npy_parse(buf, pre + hl + data_bytes, &t);
    if (st == ATTN_OK) attn_npy_free(&t);
    return st;
}

static void malformed_npy(void) {
    attn_tensor t;
    CHECK_STATUS(attn_npy_parse("", 0, &t), ATTN_ERR_FORMAT);
    CHECK_STATUS(attn_npy_parse("\x93NUMPX\x01\x00", 8, &t), ATTN_ERR_FORMAT);
    CHECK_MESSAGE("magic");
    CHECK_STATUS(attn_npy_parse("\x93NUMPY\x04\x00\x00\x00", 10, &t), ATTN_ERR_FORMAT);
    CHECK_MESSAGE("version");
    CHECK_STATUS(attn_npy_parse("\x93NUMPY\x01\x00\xff\x00{", 11, &t), ATTN_ERR_FORMAT);
    CHECK_MESSAGE("truncated");
    CHECK_STATUS(attn_npy_parse(NULL, 10, &t), ATTN_ERR_NULL);
    CHECK_STATUS(attn_npy_parse("x", 1, NULL), ATTN_ERR_NULL);
    const char *ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n";
    CHECK_OK(parse_text(ok, 24, 1));
    CHECK_OK(parse_text(ok, 24, 2));
    CHECK_OK(parse_text(ok, 24, 3));
    CHECK_STATUS(parse_text(ok, 23, 1), ATTN_ERR_FORMAT); /* truncated data */
    CHECK_MESSAGE("promises 24");
    CHECK_STATUS(parse_text(ok, 25, 1), ATTN_ERR_FORMAT); /* trailing bytes */
    struct {
        const char *header;
        attn_status want;
        const char *needle;
    } cases[] = {
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", ATTN_ERR_FORMAT, "newline"},
        {"['descr', '<f4']\n", ATTN_ERR_FORMAT, "dictionary"},
        {"{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }\n", ATTN_ERR_DTYPE, "<i4"},
        {"{'descr': 'f4', 'fortran_order': False, 'shape': (2, 3), }\n", ATTN_ERR_FORMAT, "byte-order"},
        {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }\n", ATTN_ERR_FORMAT, "structured"},
        {"{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2, 3), }\n", ATTN_ERR_FORMAT, "fortran_order"},
        {"{'descr': '<f4', 'shape': (2, 3), }\n", ATTN_ERR_FORMAT, "lacks"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }\n", ATTN_ERR_FORMAT, "shape"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 0), }\n", ATTN_ERR_SHAPE, "empty"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }\n", ATTN_ERR_FORMAT, "overflows"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }\n", ATTN_ERR_FORMAT, "overflows"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }\n", ATTN_ERR_SHAPE, "dimensions"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}\n", ATTN_ERR_FORMAT, "extra"},
        {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}\n", ATTN_ERR_FORMAT, "repeated"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3) } junk\n", ATTN_ERR_FORMAT, "after"},
        {"{'descr': '<f4' 'fortran_order': False}\n", ATTN_ERR_FORMAT, "expected ','"},
        {"{'descr: '<f4'}\n", ATTN_ERR_FORMAT, "key"},
        {"{\n", ATTN_ERR_FORMAT, "key"},
        {"\n", ATTN_ERR_FORMAT, "dictionary"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK_STATUS(parse_text(cases[i].header, 24, 1), cases[i].want);
        CHECK_MESSAGE(cases[i].needle);
    }
    /* A header with a NUL byte inside. */
    unsigned char nul[] = "\x93NUMPY\x01\x00\x04\x00{\0}\n";
    CHECK_STATUS(attn_npy_parse(nul, 14, &t), ATTN_ERR_FORMAT);
    /* Files: missing, a directory. */
    CHECK_STATUS(attn_npy_load("/nonexistent/attn.npy", &t), ATTN_ERR_IO);
    CHECK_MESSAGE("/nonexistent/attn.npy");
    CHECK_STATUS(attn_npy_load("/", &t), ATTN_ERR_IO);
    attn_npy_free(NULL);
}

HARNESS_MAIN(T(valid_baseline), T(null_pointers), T(bad_rank), T(shape_mismatch),
             T(heads_not_dividing), T(zero_size), T(size_overflow), T(bad_dtypes), T(bad_masks),
             T(bad_values), T(status_strings), T(mha_config_errors), T(mha_forward_errors),
             T(malformed_npy), T(half_dtype_rules_sdpa), T(storage_dtypes_mha),
             T(storage_dtypes_npy))
