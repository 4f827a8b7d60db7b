/*
 * test_mha_backward.c — attn_mha_forward_train + attn_mha_backward.
 *
 *  - gradients: float64 gradients of loss = Σ dout ⊙ out with respect to
 *    every input element and every parameter, against central finite
 *    differences of attn_mha_forward, for every option and combinations;
 *  - layouts: strided, permuted and reversed inputs and gradients give the
 *    gradients of contiguous copies;
 *  - determinism: bitwise identical gradients for 1-4 threads;
 *  - hostile arguments: NULLs, wrong shapes and dtypes, wrong grads or
 *    saved modules, overlaps, each naming its argument;
 *  - allocation failures: every allocation of forward_train + backward
 *    failed in turn gives ATTN_ERR_NOMEM and leaks nothing.
 */
#include "testutil.h"

/* ---- one case: a module, its inputs and options ---- */

typedef struct bw_opts {
    attn_dtype dtype;
    int64_t N, L, S, E, H, head_dim, kdim, vdim;
    int bias, add_bias_kv, add_zero_attn, batch_first, call_batch_first;
    int unbatched, self_attn, is_causal, training;
    double dropout;
    int kpm;       /* 0 none, 1 bool, 2 float */
    int am;        /* 0 none, 1 bool 2-D, 2 float 2-D, 3 bool 3-D, 4 float 3-D */
    int layout;    /* LAYOUT_CONTIGUOUS or LAYOUT_RANDOM for inputs and outputs */
} bw_opts;

typedef struct bw_case {
    bw_opts o;
    attn_mha_config cfg;
    attn_mha *m;
    test_tensor query, key, value, kpm, am, out, dout;
    attn_tensor *q, *k, *v; /* q == k == v for self-attention */
    attn_mha_forward_params fp;
} bw_case;

static void shape3(const bw_opts *o, int64_t T, int64_t F, int64_t *shape, int *rank) {
    if (o->unbatched) {
        shape[0] = T;
        shape[1] = F;
        *rank = 2;
        return;
    }
    const int bf = o->call_batch_first >= 0 ? o->call_batch_first : o->batch_first;
    shape[0] = bf ? o->N : T;
    shape[1] = bf ? T : o->N;
    shape[2] = F;
    *rank = 3;
}

static void case_masks(bw_case *c, rng *r) {
    const bw_opts *o = &c->o;
    const int64_t N = o->unbatched ? 1 : o->N;
    if (o->kpm) {
        int64_t ks[2] = {N, o->S};
        attn_dtype dt = o->kpm == 1 ? ATTN_DTYPE_BOOL : ATTN_DTYPE_F64;
        tt_make(&c->kpm, r, dt, o->unbatched ? 1 : 2, o->unbatched ? ks + 1 : ks, o->layout,
                1.0, 0.25);
        c->fp.key_padding_mask = &c->kpm.t;
    }
    if (o->am) {
        const bool three = o->am >= 3;
        int64_t as[3] = {N * o->H, o->L, o->S};
        attn_dtype dt = o->am % 2 == 1 ? ATTN_DTYPE_BOOL : ATTN_DTYPE_F32;
        tt_make(&c->am, r, dt, three ? 3 : 2, three ? as : as + 1, o->layout, 1.0, 0.25);
        c->fp.attn_mask = &c->am.t;
    }
}

static void case_make(bw_case *c, const bw_opts *o, rng *r) {
    memset(c, 0, sizeof *c);
    c->o = *o;
    attn_mha_config_init(&c->cfg, o->E, o->H);
    c->cfg.head_dim = o->head_dim;
    c->cfg.kdim = o->self_attn ? 0 : o->kdim;
    c->cfg.vdim = o->self_attn ? 0 : o->vdim;
    c->cfg.bias = o->bias;
    c->cfg.add_bias_kv = o->add_bias_kv;
    c->cfg.add_zero_attn = o->add_zero_attn;
    c->cfg.batch_first = o->batch_first;
    c->cfg.dropout = o->dropout;
    c->cfg.dtype = o->dtype;
    c->cfg.init_seed = rng_next(r);
    CHECK_OK(attn_mha_create(&c->cfg, &c->m));
    /* Nonzero biases, so that their paths carry weight. */
    for (int i = 0; i < attn_mha_param_count(c->m); i++) {
        const char *name;
        attn_tensor v;
        attn_mha_param_at(c->m, i, &name, &v);
        if (strstr(name, "bias") != NULL) {
            int64_t idx[3] = {0, 0, 0}, n = attn_tensor_numel(&v);
            for (int64_t e = 0; e < n; e++) {
                idx[v.rank - 1] = e; /* biases are (X) or (1, 1, X) */
                tt_set(&v, idx, 0.5 * rng_normal(r));
            }
        }
    }
    attn_mha_forward_params_init(&c->fp);
    c->fp.batch_first = o->call_batch_first;
    c->fp.is_causal = o->is_causal;
    c->fp.training = o->training;
    c->fp.seed = rng_next(r);
    c->fp.rng_offset = rng_next(r) % 7;
    int64_t qs[3], ks[3], vs[3];
    int rank;
    const int64_t kd = o->self_attn || !o->kdim ? o->E : o->kdim;
    const int64_t vd = o->self_attn || !o->vdim ? o->E : o->vdim;
    shape3(o, o->L, o->E, qs, &rank);
    shape3(o, o->S, kd, ks, &rank);
    shape3(o, o->S, vd, vs, &rank);
    tt_make(&c->query, r, o->dtype, rank, qs, o->layout, 1.0, 0);
    c->q = c->k = c->v = &c->query.t;
    if (!o->self_attn) {
        tt_make(&c->key, r, o->dtype, rank, ks, o->layout, 1.0, 0);
        tt_make(&c->value, r, o->dtype, rank, vs, o->layout, 1.0, 0);
        c->k = &c->key.t;
        c->v = &c->value.t;
    }
    tt_make_output(&c->out, r, o->dtype, rank, qs, o->layout);
    tt_make(&c->dout, r, o->dtype, rank, qs, o->layout, 1.0, 0);
    case_masks(c, r);
}

static void case_free(bw_case *c) {
    attn_mha_destroy(c->m);
    tt_free(&c->query);
    tt_free(&c->key);
    tt_free(&c->value);
    tt_free(&c->kpm);
    tt_free(&c->am);
    tt_free(&c->out);
    tt_free(&c->dout);
}

/* The gradients of one backward: of the inputs (dense copies) and of the
 * parameters (a module). */
typedef struct bw_grads {
    double *dx[3];
    attn_mha *g;
    attn_status st;
} bw_grads;

static void grads_free(bw_grads *g) {
    for (int i = 0; i < 3; i++) free(g->dx[i]);
    attn_mha_destroy(g->g);
    memset(g, 0, sizeof *g);
}

/* forward_train, then backward into gradients of random layout. */
static bw_grads run_backward(bw_case *c, rng *r) {
    bw_grads res;
    memset(&res, 0, sizeof res);
    attn_mha_saved *saved = NULL;
    test_tensor dx[3];
    memset(dx, 0, sizeof dx);
    const attn_tensor *in[3] = {c->q, c->k, c->v};
    for (int i = 0; i < 3; i++)
        tt_make_output(&dx[i], r, c->o.dtype, in[i]->rank, in[i]->shape, c->o.layout);
    res.st = attn_mha_create(&c->cfg, &res.g);
    if (res.st == ATTN_OK)
        res.st = attn_mha_forward_train(c->m, c->q, c->k, c->v, &c->fp, &c->out.t, NULL, &saved);
    if (res.st == ATTN_OK)
        res.st = attn_mha_backward(c->m, saved, c->q, c->k, c->v, &c->dout.t, &dx[0].t, &dx[1].t,
                                   &dx[2].t, res.g);
    CHECK(res.st == ATTN_OK, "backward: %s (%s)", attn_last_error(), attn_last_error_arg());
    attn_mha_saved_destroy(saved);
    for (int i = 0; i < 3; i++) {
        if (res.st == ATTN_OK) res.dx[i] = tt_dense(&dx[i].t);
        tt_free(&dx[i]);
    }
    return res;
}

/* ---- finite differences ---- */

/* loss = Σ dout ⊙ attn_mha_forward(...) (the same dropout stream). */
static double loss(bw_case *c) {
    CHECK_OK(attn_mha_forward(c->m, c->q, c->k, c->v, &c->fp, &c->out.t, NULL));
    double *o = tt_dense(&c->out.t), *g = tt_dense(&c->dout.t), sum = 0.0;
    int64_t n = attn_tensor_numel(&c->out.t);
    for (int64_t i = 0; i < n; i++) sum += o[i] * g[i];
    free(o);
    free(g);
    return sum;
}

/* d loss / d t[idx] by central differences, t being an input or a
 * parameter view (perturbed in place and restored). */
static double numeric(bw_case *c, const attn_tensor *t, const int64_t *idx) {
    const double h = 1e-5, x = tt_get(t, idx);
    tt_set(t, idx, x + h);
    const double up = loss(c);
    tt_set(t, idx, x - h);
    const double down = loss(c);
    tt_set(t, idx, x);
    return (up - down) / (2 * h);
}

/* Compares an analytic gradient (element i of `analytic`, dense in t's
 * index order) with finite differences over every element of t. */
static void compare_fd(bw_case *c, const attn_tensor *t, const double *analytic,
                       const char *what, const char *label) {
    int64_t n = attn_tensor_numel(t), idx[ATTN_MAX_RANK] = {0};
    double worst = 0.0, scale = 1.0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(analytic[i]));
    for (int64_t i = 0; i < n; i++) {
        const double fd = numeric(c, t, idx);
        worst = fmax(worst, fabs(fd - analytic[i]));
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
    /* Central differences in float64 with h = 1e-5: truncation ~h² and
     * rounding ~1e-16/h, both far below 1e-7 of the gradient's scale. */
    CHECK(worst <= 1e-7 * scale, "%s: d/d %s differs from finite differences by %g (scale %g)",
          label, what, worst, scale);
}

/* Every input and parameter gradient of one case against finite
 * differences. Self-attention compares dquery + dkey + dvalue. */
static void check_case_fd(const bw_opts *o, rng *r, const char *label) {
    bw_case c;
    case_make(&c, o, r);
    bw_grads g = run_backward(&c, r);
    if (g.st == ATTN_OK) {
        const attn_tensor *in[3] = {c.q, c.k, c.v};
        const char *names[3] = {"query", "key", "value"};
        if (o->self_attn) {
            int64_t n = attn_tensor_numel(c.q);
            for (int64_t i = 0; i < n; i++) g.dx[0][i] += g.dx[1][i] + g.dx[2][i];
            compare_fd(&c, c.q, g.dx[0], "query = key = value", label);
        } else {
            for (int i = 0; i < 3; i++) compare_fd(&c, in[i], g.dx[i], names[i], label);
        }
        for (int i = 0; i < attn_mha_param_count(c.m); i++) {
            const char *name;
            attn_tensor p, gp;
            attn_mha_param_at(c.m, i, &name, &p);
            attn_mha_param_at(g.g, i, &name, &gp);
            double *analytic = tt_dense(&gp);
            compare_fd(&c, &p, analytic, name, label);
            free(analytic);
        }
    }
    grads_free(&g);
    case_free(&c);
}

static bw_opts base_opts(void) {
    bw_opts o;
    memset(&o, 0, sizeof o);
    o.dtype = ATTN_DTYPE_F64;
    o.N = 2;
    o.L = 3;
    o.S = 4;
    o.E = 4;
    o.H = 2;
    o.bias = 1;
    o.call_batch_first = -1;
    o.layout = LAYOUT_CONTIGUOUS;
    return o;
}

/* Each option alone, then the options together. */
static void gradients_each_option(void) {
    rng r = {harness_seed() ^ 0xbacc};
    bw_opts o = base_opts();
    check_case_fd(&o, &r, "defaults");
    o = base_opts(); o.kdim = 3; o.vdim = 5; check_case_fd(&o, &r, "kdim/vdim");
    o = base_opts(); o.head_dim = 3; check_case_fd(&o, &r, "explicit head_dim");
    o = base_opts(); o.bias = 0; check_case_fd(&o, &r, "bias=False");
    o = base_opts(); o.add_bias_kv = 1; check_case_fd(&o, &r, "add_bias_kv");
    o = base_opts(); o.add_zero_attn = 1; check_case_fd(&o, &r, "add_zero_attn");
    o = base_opts(); o.kpm = 1; check_case_fd(&o, &r, "bool key_padding_mask");
    o = base_opts(); o.kpm = 2; check_case_fd(&o, &r, "float key_padding_mask");
    o = base_opts(); o.am = 1; check_case_fd(&o, &r, "bool 2-D attn_mask");
    o = base_opts(); o.am = 2; check_case_fd(&o, &r, "float 2-D attn_mask");
    o = base_opts(); o.am = 3; check_case_fd(&o, &r, "bool 3-D attn_mask");
    o = base_opts(); o.am = 4; check_case_fd(&o, &r, "float 3-D attn_mask");
    o = base_opts(); o.is_causal = 1; o.S = 3; check_case_fd(&o, &r, "is_causal");
    o = base_opts(); o.batch_first = 1; check_case_fd(&o, &r, "batch_first");
    o = base_opts(); o.call_batch_first = 1; check_case_fd(&o, &r, "params.batch_first=1");
    o = base_opts(); o.batch_first = 1; o.call_batch_first = 0;
    check_case_fd(&o, &r, "params.batch_first=0 over a batch_first config");
    o = base_opts(); o.unbatched = 1; check_case_fd(&o, &r, "unbatched");
    o = base_opts(); o.training = 1; o.dropout = 0.3; check_case_fd(&o, &r, "dropout");
    o = base_opts(); o.training = 0; o.dropout = 0.5; check_case_fd(&o, &r, "eval: no dropout");
    o = base_opts(); o.self_attn = 1; o.S = o.L; check_case_fd(&o, &r, "self-attention");
    o = base_opts(); o.self_attn = 1; o.S = o.L; o.batch_first = 1;
    check_case_fd(&o, &r, "self-attention, batch_first");
}

/* Random options, several at once. */
static bw_opts random_opts(rng *r) {
    bw_opts o = base_opts();
    o.N = rng_int(r, 1, 3);
    o.L = rng_int(r, 1, 4);
    o.S = rng_int(r, 1, 4);
    o.H = rng_int(r, 1, 3);
    o.head_dim = rng_int(r, 0, 1) ? rng_int(r, 1, 3) : 0;
    o.E = o.head_dim ? rng_int(r, 2, 5) : o.H * rng_int(r, 1, 2);
    o.self_attn = rng_int(r, 0, 4) == 0;
    if (o.self_attn) o.S = o.L;
    if (rng_int(r, 0, 1)) o.kdim = rng_int(r, 1, 5);
    if (rng_int(r, 0, 1)) o.vdim = rng_int(r, 1, 5);
    o.bias = rng_int(r, 0, 3) != 0;
    o.add_bias_kv = rng_int(r, 0, 1);
    o.add_zero_attn = rng_int(r, 0, 1);
    o.batch_first = rng_int(r, 0, 1);
    o.call_batch_first = (int)rng_int(r, -1, 1);
    o.unbatched = rng_int(r, 0, 3) == 0;
    o.is_causal = rng_int(r, 0, 2) == 0;
    o.training = rng_int(r, 0, 1);
    o.dropout = rng_int(r, 0, 1) ? 0.25 : 0.0;
    o.kpm = (int)rng_int(r, 0, 2);
    o.am = (int)rng_int(r, 0, 4);
    o.layout = rng_int(r, 0, 1) ? LAYOUT_RANDOM : LAYOUT_CONTIGUOUS;
    if (o.is_causal && o.am == 0 && o.S < o.L) o.S = o.L; /* torch's causal is square */
    return o;
}

static bool has_broadcast(const attn_tensor *t) {
    for (int d = 0; d < t->rank; d++)
        if (t->strides[d] == 0 && t->shape[d] > 1) return true;
    return false;
}

/* Random combinations; random layouts are compared by finite differences
 * only when no input element is shared by a zero stride (perturbing a
 * shared element moves several). */
static void gradients_combinations(void) {
    rng r = {harness_seed() ^ 0xc0b1};
    char label[64];
    for (int i = 0; i < 24; i++) {
        bw_opts o = random_opts(&r);
        rng probe = r;
        bw_case c;
        case_make(&c, &o, &probe);
        bool shared = has_broadcast(c.q) || has_broadcast(c.k) || has_broadcast(c.v);
        case_free(&c);
        if (shared) o.layout = LAYOUT_CONTIGUOUS;
        snprintf(label, sizeof label, "combination %d", i);
        check_case_fd(&o, &r, label);
    }
}

/* Strided, permuted, reversed and broadcast inputs and gradient outputs
 * give the gradients of contiguous copies of the same values. */
static void layouts(void) {
    rng r = {harness_seed() ^ 0x1a70};
    for (int i = 0; i < 30; i++) {
        bw_opts o = random_opts(&r);
        o.layout = LAYOUT_RANDOM;
        bw_case c;
        case_make(&c, &o, &r);
        bw_grads strided = run_backward(&c, &r);
        /* the same values, contiguous */
        test_tensor copies[4];
        attn_tensor *orig[4] = {c.q, c.k, c.v, &c.dout.t};
        attn_tensor saved_views[4] = {*c.q, *c.k, *c.v, c.dout.t};
        for (int k = 0; k < 4; k++) {
            memset(&copies[k], 0, sizeof copies[k]);
            if (k > 0 && k < 3 && o.self_attn) continue;
            double *d = tt_dense(orig[k]);
            tt_make_output(&copies[k], &r, o.dtype, orig[k]->rank, orig[k]->shape,
                           LAYOUT_CONTIGUOUS);
            int64_t n = attn_tensor_numel(orig[k]);
            for (int64_t e = 0; e < n; e++) ((double *)copies[k].t.data)[e] = d[e];
            free(d);
        }
        *c.q = copies[0].t;
        if (!o.self_attn) {
            *c.k = copies[1].t;
            *c.v = copies[2].t;
        }
        c.dout.t = copies[3].t;
        o.layout = LAYOUT_CONTIGUOUS;
        c.o.layout = LAYOUT_CONTIGUOUS;
        bw_grads dense = run_backward(&c, &r);
        if (strided.st == ATTN_OK && dense.st == ATTN_OK) {
            for (int k = 0; k < 3; k++) {
                const attn_tensor *t = k == 0 ? c.q : k == 1 ? c.k : c.v;
                int64_t n = attn_tensor_numel(t);
                double diff = max_abs_diff(strided.dx[k], dense.dx[k], n), scale = 1.0;
                for (int64_t e = 0; e < n; e++) scale = fmax(scale, fabs(dense.dx[k][e]));
                CHECK(diff <= 1e-12 * scale, "layout case %d: d input %d differs by %g", i, k,
                      diff);
            }
            for (int p = 0; p < attn_mha_param_count(c.m); p++) {
                const char *name;
                attn_tensor a, b;
                attn_mha_param_at(strided.g, p, &name, &a);
                attn_mha_param_at(dense.g, p, &name, &b);
                double *da = tt_dense(&a), *db = tt_dense(&b), scale = 1.0;
                int64_t n = attn_tensor_numel(&a);
                for (int64_t e = 0; e < n; e++) scale = fmax(scale, fabs(db[e]));
                double diff = max_abs_diff(da, db, n);
                CHECK(diff <= 1e-12 * scale, "layout case %d: d %s differs by %g", i, name, diff);
                free(da);
                free(db);
            }
        }
        *c.q = saved_views[0];
        if (!o.self_attn) {
            *c.k = saved_views[1];
            *c.v = saved_views[2];
        }
        c.dout.t = saved_views[3];
        for (int k = 0; k < 4; k++) tt_free(&copies[k]);
        grads_free(&strided);
        grads_free(&dense);
        case_free(&c);
    }
}

/* ---- determinism ---- */

static bool same_bits(const double *a, const double *b, int64_t n) {
    return memcmp(a, b, sizeof(double) * (size_t)n) == 0;
}

/* Shapes large enough that every GEMM is tiled across threads and the
 * backward's per-batch paths run (batch_first with appended keys). */
static void determinism(void) {
    rng r = {harness_seed() ^ 0xde7e};
    for (int variant = 0; variant < 4; variant++) {
        bw_opts o = base_opts();
        o.dtype = variant % 2 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
        o.N = 3;
        o.L = 70;
        o.S = 50;
        o.E = 64;
        o.H = 4;
        o.batch_first = variant >= 2;
        o.add_bias_kv = o.add_zero_attn = variant >= 2;
        o.kdim = variant == 1 ? 48 : 0;
        o.kpm = 1;
        o.am = variant == 3 ? 4 : 2;
        o.training = 1;
        o.dropout = 0.2;
        o.is_causal = variant == 0;
        if (o.is_causal) o.S = o.L;
        bw_case c;
        case_make(&c, &o, &r);
        bw_grads ref;
        memset(&ref, 0, sizeof ref);
        for (int threads = 1; threads <= 4; threads++) {
            attn_set_num_threads(threads);
            rng rr = {7}; /* the same gradient layouts every time */
            bw_grads g = run_backward(&c, &rr);
            if (threads == 1) {
                ref = g;
                continue;
            }
            if (g.st == ATTN_OK && ref.st == ATTN_OK) {
                const attn_tensor *in[3] = {c.q, c.k, c.v};
                for (int k = 0; k < 3; k++)
                    CHECK(same_bits(g.dx[k], ref.dx[k], attn_tensor_numel(in[k])),
                          "variant %d: d input %d differs at %d threads", variant, k, threads);
                for (int p = 0; p < attn_mha_param_count(c.m); p++) {
                    const char *name;
                    attn_tensor a, b;
                    attn_mha_param_at(g.g, p, &name, &a);
                    attn_mha_param_at(ref.g, p, &name, &b);
                    size_t bytes = (size_t)attn_tensor_numel(&a) * attn_dtype_size(a.dtype);
                    CHECK(memcmp(a.data, b.data, bytes) == 0,
                          "variant %d: d %s differs at %d threads", variant, name, threads);
                }
            }
            grads_free(&g);
        }
        attn_set_num_threads(0);
        grads_free(&ref);
        case_free(&c);
    }
}

/* ---- hostile arguments ---- */

#define CHECK_ARG(call, status, arg)                                                    \
    do {                                                                                \
        CHECK_STATUS(call, status);                                                     \
        CHECK(strcmp(attn_last_error_arg(), arg) == 0, "%s named '%s', expected '%s'", \
              #call, attn_last_error_arg(), arg);                                       \
    } while (0)

static void hostile_arguments(void) {
    rng r = {harness_seed() ^ 0x4057};
    bw_opts o = base_opts();
    o.kdim = 3;
    bw_case c;
    case_make(&c, &o, &r);
    attn_mha_saved *sv = (attn_mha_saved *)&r; /* must be overwritten with NULL */
    CHECK_ARG(attn_mha_forward_train(c.m, c.q, c.k, c.v, &c.fp, &c.out.t, NULL, NULL),
              ATTN_ERR_NULL, "saved");
    CHECK_ARG(attn_mha_forward_train(NULL, c.q, c.k, c.v, &c.fp, &c.out.t, NULL, &sv),
              ATTN_ERR_NULL, "mha");
    CHECK(sv == NULL, "a failed forward_train leaves *saved set");
    CHECK_ARG(attn_mha_forward_train(c.m, c.q, c.q, c.v, &c.fp, &c.out.t, NULL, &sv),
              ATTN_ERR_SHAPE, "key");
    /* a NULL value read address 0 (attn_mha_out_shapes takes none) */
    CHECK_ARG(attn_mha_forward_train(c.m, c.q, c.k, NULL, &c.fp, &c.out.t, NULL, &sv),
              ATTN_ERR_NULL, "value");
    CHECK_ARG(attn_mha_forward(c.m, c.q, c.k, NULL, &c.fp, &c.out.t, NULL), ATTN_ERR_NULL,
              "value");
    CHECK_OK(attn_mha_forward_train(c.m, c.q, c.k, c.v, &c.fp, &c.out.t, NULL, &sv));
    attn_mha *g = NULL, *other = NULL, *wrong = NULL;
    CHECK_OK(attn_mha_create(&c.cfg, &g));
    attn_mha_config oc = c.cfg;
    oc.num_heads = 1;
    CHECK_OK(attn_mha_create(&oc, &wrong));
    oc = c.cfg;
    oc.dtype = ATTN_DTYPE_F32;
    CHECK_OK(attn_mha_create(&oc, &other));
    test_tensor dq, dk, small, f32;
    tt_make_output(&dq, &r, o.dtype, c.q->rank, c.q->shape, LAYOUT_CONTIGUOUS);
    tt_make_output(&dk, &r, o.dtype, c.k->rank, c.k->shape, LAYOUT_CONTIGUOUS);
    int64_t ss[3] = {2, 2, 4};
    tt_make(&small, &r, o.dtype, 3, ss, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make_output(&f32, &r, ATTN_DTYPE_F32, c.q->rank, c.q->shape, LAYOUT_CONTIGUOUS);
    const attn_tensor *q = c.q, *k = c.k, *v = c.v, *d = &c.dout.t;
    CHECK_ARG(attn_mha_backward(NULL, sv, q, k, v, d, &dq.t, NULL, NULL, g), ATTN_ERR_NULL, "mha");
    CHECK_ARG(attn_mha_backward(c.m, NULL, q, k, v, d, &dq.t, NULL, NULL, g), ATTN_ERR_NULL,
              "saved");
    CHECK_ARG(attn_mha_backward(c.m, sv, NULL, k, v, d, &dq.t, NULL, NULL, g), ATTN_ERR_NULL,
              "query");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, NULL, d, &dq.t, NULL, NULL, g), ATTN_ERR_NULL,
              "value");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, NULL, &dq.t, NULL, NULL, g), ATTN_ERR_NULL,
              "dout");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, &dq.t, NULL, NULL, wrong), ATTN_ERR_INVALID,
              "grads");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, &dq.t, NULL, NULL, other), ATTN_ERR_INVALID,
              "grads");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, &dq.t, NULL, NULL, c.m), ATTN_ERR_INVALID,
              "grads");
    CHECK_ARG(attn_mha_backward(wrong, sv, q, k, v, d, &dq.t, NULL, NULL, NULL), ATTN_ERR_INVALID,
              "saved");
    CHECK_ARG(attn_mha_backward(c.m, sv, &small.t, k, v, d, &dq.t, NULL, NULL, g),
              ATTN_ERR_SHAPE, "query");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, &small.t, &dq.t, NULL, NULL, g),
              ATTN_ERR_SHAPE, "dout");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, &f32.t, &dq.t, NULL, NULL, g), ATTN_ERR_DTYPE,
              "dout");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, &dk.t, NULL, NULL, g), ATTN_ERR_SHAPE,
              "dquery");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, &f32.t, NULL, NULL, g), ATTN_ERR_DTYPE,
              "dquery");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, NULL, &dq.t, NULL, g), ATTN_ERR_SHAPE, "dkey");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, NULL, NULL, &dk.t, g), ATTN_ERR_SHAPE,
              "dvalue");
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, &c.dout.t, NULL, NULL, g), ATTN_ERR_OVERLAP,
              "dquery");
    test_tensor dv;
    tt_make_output(&dv, &r, o.dtype, c.v->rank, c.v->shape, LAYOUT_CONTIGUOUS);
    attn_tensor dq_alias; /* dquery inside dvalue's buffer */
    attn_tensor_init(&dq_alias, dv.t.data, o.dtype, c.q->rank, c.q->shape);
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, d, &dq_alias, NULL, &dv.t, g),
              ATTN_ERR_OVERLAP, "dvalue");
    tt_free(&dv);
    /* grads' parameters are written: an input inside them would be
     * overwritten while it is read (dout in out_proj.weight gave that
     * weight's and bias's gradients off by 0.13 and 1.46, ATTN_OK) */
    attn_tensor gw, in_grads;
    CHECK_OK(attn_mha_param(g, "out_proj.weight", &gw));
    attn_tensor_init(&in_grads, gw.data, o.dtype, c.dout.t.rank, c.dout.t.shape);
    CHECK_ARG(attn_mha_backward(c.m, sv, q, k, v, &in_grads, &dq.t, NULL, NULL, g),
              ATTN_ERR_OVERLAP, "grads");
    attn_tensor_init(&in_grads, gw.data, o.dtype, c.q->rank, c.q->shape);
    CHECK_ARG(attn_mha_backward(c.m, sv, &in_grads, k, v, d, NULL, NULL, NULL, g),
              ATTN_ERR_OVERLAP, "grads");
    CHECK_OK(attn_mha_backward(c.m, sv, q, k, v, d, &dq.t, &dk.t, NULL, g));
    CHECK_OK(attn_mha_backward(c.m, sv, q, k, v, d, NULL, NULL, NULL, NULL)); /* nothing asked */
    attn_mha_saved_destroy(NULL);
    attn_mha_saved_destroy(sv);
    attn_mha_destroy(g);
    attn_mha_destroy(other);
    attn_mha_destroy(wrong);
    tt_free(&dq);
    tt_free(&dk);
    tt_free(&small);
    tt_free(&f32);
    case_free(&c);
}

/* ---- allocation failures ---- */

static test_failer F; /* testutil.h */

/* forward_train + backward under allocation failure n = 1, 2, ... until
 * one run succeeds: each failure is ATTN_ERR_NOMEM with a message, nothing
 * leaks, and the run that succeeds gives the default allocator's bits. */
static void walk_failures(bw_case *c, const char *label, bool persistent) {
    rng r0 = {3};
    bw_grads want = run_backward(c, &r0);
    long n;
    for (n = 1; n < 10000; n++) {
        failer_install(&F, n, persistent);
        attn_mha_saved *sv = NULL;
        attn_mha *g = NULL;
        test_tensor dx[3];
        rng r = {3};
        const attn_tensor *in[3] = {c->q, c->k, c->v};
        for (int i = 0; i < 3; i++)
            tt_make_output(&dx[i], &r, c->o.dtype, in[i]->rank, in[i]->shape, c->o.layout);
        attn_status st = attn_mha_create(&c->cfg, &g);
        if (st == ATTN_OK)
            st = attn_mha_forward_train(c->m, c->q, c->k, c->v, &c->fp, &c->out.t, NULL, &sv);
        if (st == ATTN_OK)
            st = attn_mha_backward(c->m, sv, c->q, c->k, c->v, &c->dout.t, &dx[0].t, &dx[1].t,
                                   &dx[2].t, g);
        CHECK(st == ATTN_OK || sv == NULL || F.failed > 0, "%s", label);
        if (st == ATTN_OK)
            for (int i = 0; i < 3; i++) {
                double *got = tt_dense(&dx[i].t);
                CHECK(same_bits(got, want.dx[i], attn_tensor_numel(in[i])),
                      "%s: gradient %d differs after failure injection", label, i);
                free(got);
            }
        attn_mha_saved_destroy(sv);
        attn_mha_destroy(g);
        attn_set_allocator(NULL);
        for (int i = 0; i < 3; i++) tt_free(&dx[i]);
        CHECK(F.live == 0, "%s: failing allocation %ld leaks %ld blocks", label, n, F.live);
        if (st == ATTN_OK) {
            CHECK(F.failed == 0, "%s: allocation %ld failed but the calls returned ATTN_OK",
                  label, n);
            break;
        }
        CHECK(st == ATTN_ERR_NOMEM, "%s: failing allocation %ld gave %s: %s", label, n,
              attn_strerror(st), attn_last_error());
        CHECK(attn_last_error()[0] != '\0', "%s: no message", label);
    }
    printf("  %s (%s): %ld failure points\n", label, persistent ? "persistent" : "transient", n - 1);
    CHECK(n > 5, "%s: too few allocations walked (%ld)", label, n);
    grads_free(&want);
}

static void allocation_failures(void) {
    rng r = {harness_seed() ^ 0xa110};
    for (int kind = 0; kind < 3; kind++) {
        bw_opts o = base_opts();
        if (kind == 0) { /* padded masks, batch-major blocks, strided everything */
            o.add_bias_kv = o.add_zero_attn = 1;
            o.batch_first = 1;
            o.kpm = 1;
            o.am = 2;
            o.is_causal = 1;
            o.layout = LAYOUT_RANDOM;
        } else if (kind == 1) { /* kdim/vdim, 3-D mask, dropout, float32 */
            o.dtype = ATTN_DTYPE_F32;
            o.kdim = 3;
            o.vdim = 5;
            o.am = 3;
            o.training = 1;
            o.dropout = 0.3;
        } else { /* unbatched self-attention, owned mask copies */
            o.unbatched = 1;
            o.self_attn = 1;
            o.S = o.L;
            o.kpm = 2;
        }
        bw_case c;
        case_make(&c, &o, &r);
        const char *labels[3] = {"padded masks", "kdim/vdim + dropout", "unbatched self"};
        walk_failures(&c, labels[kind], false);
        walk_failures(&c, labels[kind], true);
        case_free(&c);
    }
}

HARNESS_MAIN(T(gradients_each_option), T(gradients_combinations), T(layouts), T(determinism),
             T(hostile_arguments), T(allocation_failures))
