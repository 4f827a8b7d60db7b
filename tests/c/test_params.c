/*
 * test_params.c — what bindings and future callers rely on besides the
 * message text: attn_last_error_arg() names the argument a failure is about;
 * versioned parameter structs (struct_size) are read as attn.h promises; and
 * attn_mha_forward_params.batch_first overrides the module's layout with the
 * same bits.
 */
#include <stddef.h>

#include "core/internal.h"
#include "testutil.h"

/* The last failure was about `want` (and a success left ""). */
#define CHECK_ARG(want)                                                                  \
    CHECK(strcmp(attn_last_error_arg(), want) == 0, "arg is '%s', expected '%s' (%s)", \
          attn_last_error_arg(), want, attn_last_error())

/* ---- SDPA operands: q (2,3,4,8), k (2,3,5,8), v (2,3,5,6) ---- */

static double qd[2 * 3 * 4 * 8], kd[2 * 3 * 5 * 8], vd[2 * 3 * 5 * 6];
static double od[2 * 3 * 4 * 6], od2[2 * 3 * 4 * 6], wd[2 * 3 * 4 * 5];
static unsigned char md[4 * 5];

typedef struct sdpa_args {
    attn_tensor q, k, v, out, out2, weights, mask;
} sdpa_args;

static void sdpa_setup(sdpa_args *a) {
    int64_t qs[4] = {2, 3, 4, 8}, ks[4] = {2, 3, 5, 8}, vs[4] = {2, 3, 5, 6}, os[4] = {2, 3, 4, 6},
            ws[4] = {2, 3, 4, 5}, ms[2] = {4, 5};
    rng r = {42};
    for (size_t i = 0; i < sizeof qd / sizeof qd[0]; i++) qd[i] = rng_normal(&r);
    for (size_t i = 0; i < sizeof kd / sizeof kd[0]; i++) kd[i] = rng_normal(&r);
    for (size_t i = 0; i < sizeof vd / sizeof vd[0]; i++) vd[i] = rng_normal(&r);
    memset(md, 1, sizeof md);
    attn_tensor_init(&a->q, qd, ATTN_DTYPE_F64, 4, qs);
    attn_tensor_init(&a->k, kd, ATTN_DTYPE_F64, 4, ks);
    attn_tensor_init(&a->v, vd, ATTN_DTYPE_F64, 4, vs);
    attn_tensor_init(&a->out, od, ATTN_DTYPE_F64, 4, os);
    attn_tensor_init(&a->out2, od2, ATTN_DTYPE_F64, 4, os);
    attn_tensor_init(&a->weights, wd, ATTN_DTYPE_F64, 4, ws);
    attn_tensor_init(&a->mask, md, ATTN_DTYPE_BOOL, 2, ms);
}

static void sdpa_error_args(void) {
    sdpa_args a;
    sdpa_setup(&a);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    CHECK_STATUS(attn_sdpa(NULL, &a.k, &a.v, NULL, &a.out, NULL, NULL), ATTN_ERR_NULL);
    CHECK_ARG("q");
    attn_tensor bad = a.k;
    bad.shape[3] = 7;
    CHECK_STATUS(attn_sdpa(&a.q, &bad, &a.v, NULL, &a.out, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("k");
    bad = a.v;
    bad.shape[2] = 4;
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &bad, NULL, &a.out, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("v");
    p.dropout_p = 1.5;
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &p, &a.out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.dropout_p");
    attn_sdpa_params_init(&p);
    p.has_scale = 1;
    p.scale = NAN;
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &p, &a.out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.scale");
    attn_sdpa_params_init(&p);
    bad = a.mask;
    bad.shape[0] = 3;
    p.attn_mask = &bad;
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &p, &a.out, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("attn_mask");
    bad = a.weights;
    bad.shape[3] = 4;
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, NULL, &a.out, &bad, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("weights");
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, NULL, &a.q, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("out");
    CHECK_OK(attn_sdpa(&a.q, &a.k, &a.v, NULL, &a.out, NULL, NULL));
    CHECK_ARG("");
}

/* ---- MHA: E = 8, 2 heads; x (L=5, N=3, E) ---- */

static float xd[5 * 3 * 8], yd[5 * 3 * 8], y2d[5 * 3 * 8];
static float wts[3 * 2 * 5 * 5], wts2[3 * 2 * 5 * 5]; /* up to (N, H, L, S) */
static unsigned char mask55[5 * 5];

/* A module with E = 8 and 2 heads (batch_first as given, dropout 0.25) and
 * x filled with N(0, 1), viewed as (5, 3, 8). */
static attn_mha *mha_setup(int batch_first, attn_tensor *x) {
    attn_mha_config c;
    attn_mha_config_init(&c, 8, 2);
    c.batch_first = batch_first;
    c.dropout = 0.25;
    c.init_seed = 11;
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&c, &m));
    rng r = {7};
    for (size_t i = 0; i < sizeof xd / sizeof xd[0]; i++) xd[i] = (float)rng_normal(&r);
    int64_t xs[3] = {5, 3, 8};
    attn_tensor_init(x, xd, ATTN_DTYPE_F32, 3, xs);
    return m;
}

static void mha_config_error_args(void) {
    attn_mha_config c;
    attn_mha *m = NULL;
    attn_mha_config_init(&c, 0, 1);
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    CHECK_ARG("config.embed_dim");
    attn_mha_config_init(&c, 8, 0);
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    CHECK_ARG("config.num_heads");
    attn_mha_config_init(&c, 200, 6);
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_SHAPE);
    CHECK_ARG("config.num_heads");
    attn_mha_config_init(&c, 8, 2);
    c.dropout = 2;
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    CHECK_ARG("config.dropout");
    attn_mha_config_init(&c, 8, 2);
    c.batch_first = 7; /* flags are 0 or 1, as a call's batch_first */
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    CHECK_ARG("config.batch_first");
    attn_mha_config_init(&c, 8, 2);
    c.add_zero_attn = -1;
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    CHECK_ARG("config.add_zero_attn");
    attn_mha_config_init(&c, 8, 2);
    c.kdim = -1;
    CHECK_STATUS(attn_mha_create(&c, &m), ATTN_ERR_INVALID);
    CHECK_ARG("config.kdim");
    CHECK_STATUS(attn_mha_create(NULL, &m), ATTN_ERR_NULL);
    CHECK_ARG("config");
    attn_mha_config_init(&c, 8, 2);
    CHECK_STATUS(attn_mha_create(&c, NULL), ATTN_ERR_NULL);
    CHECK_ARG("mha");
}

static void mha_forward_error_args(void) {
    attn_tensor x, y, w, bad, tm;
    attn_mha *m = mha_setup(0, &x);
    int64_t xs[3] = {5, 3, 8}, ws[3] = {3, 5, 5}, ms[2] = {5, 4};
    attn_tensor_init(&y, yd, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&w, wts, ATTN_DTYPE_F32, 3, ws);
    attn_tensor_init(&tm, mask55, ATTN_DTYPE_BOOL, 2, ms);
    CHECK_STATUS(attn_mha_forward(NULL, &x, &x, &x, NULL, &y, NULL), ATTN_ERR_NULL);
    CHECK_ARG("mha");
    bad = x;
    bad.shape[2] = 7;
    CHECK_STATUS(attn_mha_forward(m, &bad, &x, &x, NULL, &y, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("query");
    bad = x;
    bad.shape[1] = 2; /* a batch of 2 where the query has 3 */
    CHECK_STATUS(attn_mha_forward(m, &x, &bad, &x, NULL, &y, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("key");
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &bad, NULL, &y, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("value");
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, NULL, NULL, NULL), ATTN_ERR_NULL);
    CHECK_ARG("out");
    bad = w;
    bad.shape[2] = 4;
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, NULL, &y, &bad), ATTN_ERR_SHAPE);
    CHECK_ARG("weights");
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, NULL, &x, NULL), ATTN_ERR_OVERLAP);
    CHECK_ARG("out");
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    fp.attn_mask = &tm;
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, &fp, &y, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("attn_mask");
    attn_mha_forward_params_init(&fp);
    fp.key_padding_mask = &tm;
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, &fp, &y, NULL), ATTN_ERR_SHAPE);
    CHECK_ARG("key_padding_mask");
    attn_mha_forward_params_init(&fp);
    fp.has_dropout = 1;
    fp.dropout = 1.5;
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, &fp, &y, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.dropout");
    CHECK_STATUS(attn_mha_set_param(m, "out_proj.weight", &x), ATTN_ERR_SHAPE);
    CHECK_ARG("out_proj.weight");
    attn_tensor view;
    CHECK_STATUS(attn_mha_param(m, "nope", &view), ATTN_ERR_INVALID);
    CHECK_ARG("name");
    CHECK_OK(attn_mha_forward(m, &x, &x, &x, NULL, &y, &w));
    CHECK_ARG("");
    attn_mha_destroy(m);
}

/* ---- versioned structs ---- */

/* A parameter struct from a newer attn.h: this library's fields, then one
 * it does not know. */
typedef struct newer_sdpa_params {
    attn_sdpa_params p;
    uint64_t added;
} newer_sdpa_params;
typedef struct newer_mha_config {
    attn_mha_config c;
    uint64_t added;
} newer_mha_config;
typedef struct newer_forward_params {
    attn_mha_forward_params p;
    uint64_t added;
} newer_forward_params;

static bool same_bytes(const attn_tensor *a, const attn_tensor *b) {
    return memcmp(a->data, b->data, (size_t)attn_tensor_numel(a) * attn_dtype_size(a->dtype)) == 0;
}

static void uninitialised_structs(void) {
    sdpa_args a;
    sdpa_setup(&a);
    attn_sdpa_params p;
    memset(&p, 0, sizeof p);
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &p, &a.out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.struct_size");
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    CHECK_STATUS(attn_sdpa_out_shape(&a.q, &a.k, &a.v, &p, &rank, shape), ATTN_ERR_INVALID);
    CHECK_ARG("params.struct_size");
    /* Stack garbage in struct_size: refused, nothing past the struct read
     * (ASan would see a read of SIZE_MAX - sizeof bytes). */
    p.struct_size = (size_t)0xdeadbeefdeadbeefull;
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &p, &a.out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.struct_size");
    p.struct_size = sizeof p + 4096; /* past any header's struct */
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &p, &a.out, NULL, NULL), ATTN_ERR_INVALID);

    attn_mha_config c;
    attn_mha_config_init(&c, 8, 2);
    c.struct_size = 0;
    attn_mha *bad = NULL;
    CHECK_STATUS(attn_mha_create(&c, &bad), ATTN_ERR_INVALID);
    CHECK_ARG("config.struct_size");
    attn_tensor x, y;
    attn_mha *m = mha_setup(0, &x);
    CHECK_STATUS(attn_mha_get_config(m, &c), ATTN_ERR_INVALID); /* c.struct_size is still 0 */
    CHECK_ARG("config.struct_size");
    attn_tensor_init(&y, yd, ATTN_DTYPE_F32, 3, x.shape);
    attn_mha_forward_params fp;
    memset(&fp, 0, sizeof fp);
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, &fp, &y, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.struct_size");
    int orank;
    int64_t oshape[ATTN_MAX_RANK];
    CHECK_STATUS(attn_mha_out_shapes(m, &x, &x, &fp, 0, &orank, oshape, NULL, NULL),
                 ATTN_ERR_INVALID);
    CHECK_ARG("params.struct_size");
    attn_mha_destroy(m);
}

/* Dropout makes every field count: the mask depends on seed and rng_offset. */
static attn_sdpa_params dropout_params(void) {
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.dropout_p = 0.5;
    p.seed = 9;
    return p;
}

static void newer_sdpa_params_struct(void) {
    sdpa_args a;
    sdpa_setup(&a);
    attn_sdpa_params p = dropout_params();
    CHECK_OK(attn_sdpa(&a.q, &a.k, &a.v, &p, &a.out, NULL, NULL));
    newer_sdpa_params n;
    memset(&n, 0, sizeof n); /* no padding garbage in the bytes the library reads */
    n.p = p;
    n.p.struct_size = sizeof n;
    n.added = 1; /* a field this library does not know is set: refused */
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &n.p, &a.out2, NULL, NULL), ATTN_ERR_UNSUPPORTED);
    CHECK_ARG("params.struct_size");
    n.added = 0; /* left at its "unset" zero: the call is the same call */
    CHECK_OK(attn_sdpa(&a.q, &a.k, &a.v, &n.p, &a.out2, NULL, NULL));
    CHECK(same_bytes(&a.out, &a.out2), "a newer struct with zero extra bytes changed the result");
}

static void newer_mha_structs(void) {
    newer_mha_config nc;
    memset(&nc, 0, sizeof nc);
    attn_mha_config_init(&nc.c, 8, 2);
    nc.c.struct_size = sizeof nc;
    nc.added = 3;
    attn_mha *m = NULL;
    CHECK_STATUS(attn_mha_create(&nc.c, &m), ATTN_ERR_UNSUPPORTED);
    CHECK_ARG("config.struct_size");
    nc.added = 0;
    CHECK_OK(attn_mha_create(&nc.c, &m));
    /* get_config writes this library's fields only and keeps struct_size. */
    nc.added = 0x5eed;
    nc.c.embed_dim = 0;
    CHECK_OK(attn_mha_get_config(m, &nc.c));
    CHECK(nc.added == 0x5eed && nc.c.struct_size == sizeof nc && nc.c.embed_dim == 8,
          "get_config wrote past the library's struct or lost a field");
    attn_mha_destroy(m);

    attn_tensor x, y, y2;
    m = mha_setup(0, &x);
    attn_tensor_init(&y, yd, ATTN_DTYPE_F32, 3, x.shape);
    attn_tensor_init(&y2, y2d, ATTN_DTYPE_F32, 3, x.shape);
    newer_forward_params nf;
    memset(&nf, 0, sizeof nf);
    attn_mha_forward_params_init(&nf.p);
    nf.p.struct_size = sizeof nf;
    nf.p.training = 1;
    nf.p.seed = 5;
    nf.added = 1;
    CHECK_STATUS(attn_mha_forward(m, &x, &x, &x, &nf.p, &y, NULL), ATTN_ERR_UNSUPPORTED);
    CHECK_ARG("params.struct_size");
    nf.added = 0;
    CHECK_OK(attn_mha_forward(m, &x, &x, &x, &nf.p, &y, NULL));
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    fp.training = 1;
    fp.seed = 5;
    CHECK_OK(attn_mha_forward(m, &x, &x, &x, &fp, &y2, NULL));
    CHECK(same_bytes(&y, &y2), "a newer struct with zero extra bytes changed the result");
    attn_mha_destroy(m);
}

/*
 * An older caller's struct stops before the fields added after its version;
 * whatever lies in memory after its struct_size must not be read. 0.2.0 is
 * the first versioned release, so the public calls refuse every size below
 * it; the mechanism they share (attn__read_params) is tested here as a
 * later version will use it: with attn_sdpa_params of a version that ended
 * at `seed`, a garbage rng_offset after it must read as the default 0.
 */
static void older_structs(void) {
    sdpa_args a;
    sdpa_setup(&a);
    attn_sdpa_params older = dropout_params();
    older.struct_size = ATTN__SIZE_THROUGH(attn_sdpa_params, seed);
    older.rng_offset = 0xdeadbeef; /* not part of the older struct: garbage */
    CHECK_STATUS(attn_sdpa(&a.q, &a.k, &a.v, &older, &a.out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.struct_size");

    attn_sdpa_params read;
    attn_sdpa_params_init(&read);
    CHECK_OK(attn__read_params(&read, sizeof read, older.struct_size, &older, "params",
                               "attn_sdpa_params_init"));
    CHECK(read.struct_size == sizeof read && read.rng_offset == 0 && read.seed == 9 &&
              read.dropout_p == 0.5,
          "an older struct's missing field did not keep its default");
    attn_sdpa_params defaults = dropout_params();
    CHECK_OK(attn_sdpa(&a.q, &a.k, &a.v, &read, &a.out, NULL, NULL));
    CHECK_OK(attn_sdpa(&a.q, &a.k, &a.v, &defaults, &a.out2, NULL, NULL));
    CHECK(same_bytes(&a.out, &a.out2), "the older struct's call differs from the default one");
}

/* ---- params.batch_first ---- */

/* x (5, 3, 8) read as (N=5, L=3, E) by a batch-first call and as
 * (L=5, N=3, E) by a sequence-first one. */
static void batch_first_override(void) {
    attn_tensor x, y, y2, w, w2;
    attn_mha *seq = mha_setup(0, &x);
    attn_mha *bat = mha_setup(1, &x); /* same init_seed: same parameters */
    int64_t ws[4] = {5, 2, 3, 3};
    attn_tensor_init(&y, yd, ATTN_DTYPE_F32, 3, x.shape);
    attn_tensor_init(&y2, y2d, ATTN_DTYPE_F32, 3, x.shape);
    attn_tensor_init(&w, wts, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&w2, wts2, ATTN_DTYPE_F32, 4, ws);
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    fp.training = 1; /* dropout 0.25: the mask index must follow the layout too */
    fp.seed = 3;
    fp.average_attn_weights = 0;
    CHECK_OK(attn_mha_forward(bat, &x, &x, &x, &fp, &y, &w));
    fp.batch_first = 1;
    CHECK_OK(attn_mha_forward(seq, &x, &x, &x, &fp, &y2, &w2));
    CHECK(same_bytes(&y, &y2) && same_bytes(&w, &w2), "params.batch_first=1 differs from config");
    int orank, wrank;
    int64_t oshape[ATTN_MAX_RANK], wshape[ATTN_MAX_RANK];
    CHECK_OK(attn_mha_out_shapes(seq, &x, &x, &fp, 1, &orank, oshape, &wrank, wshape));
    CHECK(wrank == 4 && wshape[0] == 5 && wshape[2] == 3, "out_shapes ignored params.batch_first");

    /* ... and 0 on a batch-first module reads (L, N, E). */
    int64_t ws0[4] = {3, 2, 5, 5};
    attn_tensor_init(&w, wts, ATTN_DTYPE_F32, 4, ws0);
    attn_tensor_init(&w2, wts2, ATTN_DTYPE_F32, 4, ws0);
    fp.batch_first = -1;
    CHECK_OK(attn_mha_forward(seq, &x, &x, &x, &fp, &y, &w));
    fp.batch_first = 0;
    CHECK_OK(attn_mha_forward(bat, &x, &x, &x, &fp, &y2, &w2));
    CHECK(same_bytes(&y, &y2) && same_bytes(&w, &w2), "params.batch_first=0 differs from config");

    attn_tensor key = x;
    key.shape[0] = 4; /* batch-first: a batch of 4 against the query's 5 */
    fp.batch_first = 1;
    CHECK_STATUS(attn_mha_out_shapes(seq, &x, &key, &fp, 0, &orank, oshape, NULL, NULL),
                 ATTN_ERR_SHAPE);
    CHECK(strstr(attn_last_error(), "got 5 and 4 (batch_first=True)") != NULL, "message: %s",
          attn_last_error());
    fp.batch_first = 2;
    CHECK_STATUS(attn_mha_forward(seq, &x, &x, &x, &fp, &y, NULL), ATTN_ERR_INVALID);
    CHECK_ARG("params.batch_first");
    CHECK_STATUS(attn_mha_out_shapes(seq, &x, &x, &fp, 0, &orank, oshape, NULL, NULL),
                 ATTN_ERR_INVALID);
    CHECK_ARG("params.batch_first");
    attn_mha_destroy(seq);
    attn_mha_destroy(bat);
}

HARNESS_MAIN(T(sdpa_error_args), T(mha_config_error_args), T(mha_forward_error_args),
             T(uninitialised_structs), T(newer_sdpa_params_struct), T(newer_mha_structs),
             T(older_structs), T(batch_first_override))
