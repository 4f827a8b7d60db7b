/*
 * test_sdpa.c — attn_sdpa against the independent float64 oracle:
 * the seed example, hundreds of random configurations over every option
 * and layout, invariants, and the edge cases (fully masked rows, huge
 * logits, L = S = E = 1, dropout statistics, thread-count independence).
 *
 * Every ISA path the machine supports is run (ATTN_TEST_ISA=name limits it).
 */
#include <float.h>

#include "testutil.h"

/* ---- tolerances: a forward error model ----
 *
 * For one output row, with u the unit roundoff of the arithmetic:
 *   - each logit carries an absolute error of about (E + 4) u A, where
 *     A = |scale| max_j sum_e |q_e k_je| (the dot product, the pre-scaling of
 *     q and the exp2 argument), which the softmax turns into a relative
 *     error of the same size in every weight;
 *   - the sums over keys add about (S + 16) u relative error;
 * so |out - exact| <= C u ((E + 4) A + S + 16) max|v|, and the same bound
 * without max|v| for weights and lse. C = 4 covers the constants the model
 * rounds away. The reference path computes in float64 (u = 2^-53) and then
 * rounds its result once to the output type. */
typedef struct error_model {
    double u;       /* unit roundoff of the kernel's arithmetic */
    double out_u;   /* rounding of the stored result            */
    double A, E, S; /* see above                                */
    double vmax;    /* max |v|                                  */
    double keep;    /* 1/(1-p) with dropout, else 1             */
} error_model;

static double model_rel(const error_model *m) {
    return 4 * m->u * ((m->E + 4) * m->A + m->S + 16) * m->keep;
}
static double tol_out(const error_model *m) {
    return model_rel(m) * m->vmax + 2 * m->out_u * m->vmax * m->keep;
}
static double tol_weights(const error_model *m) { return model_rel(m) + 2 * m->out_u * m->keep; }
static double tol_lse(const error_model *m, double lse_mag) {
    return model_rel(m) + 2 * (m->u + m->out_u) * lse_mag;
}

/* Worst error/tolerance ratio seen per path, reported at the end. */
static double worst_ratio[8];

static double max_abs(const double *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(x[i]) && fabs(x[i]) > m) m = fabs(x[i]);
    return m;
}

/* ---- a random configuration ---- */

typedef struct sdpa_case {
    attn_dtype dtype;
    test_tensor q, k, v, mask, out, weights, lse;
    bool has_mask, has_weights, has_lse;
    attn_sdpa_params p;
} sdpa_case;

static const int64_t SIZES[] = {1, 1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33};

static int64_t pick_size(rng *r) { return SIZES[rng_int(r, 0, (long)(sizeof SIZES / sizeof SIZES[0]) - 1)]; }

/* Shape of a tensor of rank `rank` right-aligned against batch shape b
 * (full batch rank nb), each batch dim either b's or 1. */
static void batch_shape(rng *r, int64_t *shape, int rank, const int64_t *b, int nb, bool bcast) {
    for (int d = 0; d < rank - 2; d++) {
        int bd = d + (nb - (rank - 2));
        shape[d] = (bcast && rng_int(r, 0, 3) == 0) ? 1 : b[bd];
    }
}

static void make_case(sdpa_case *c, rng *r) {
    memset(c, 0, sizeof *c);
    c->dtype = rng_int(r, 0, 1) ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
    attn_sdpa_params_init(&c->p);
    int full = (int)rng_int(r, 2, 5), nb = full - 2;
    int64_t b[ATTN_MAX_RANK];
    for (int d = 0; d < nb; d++) b[d] = rng_int(r, 1, 3);
    bool gqa = nb >= 1 && rng_int(r, 0, 3) == 0;
    int64_t hk = 1, group = 1;
    if (gqa) {
        hk = rng_int(r, 1, 2);
        group = rng_int(r, 1, 3);
        b[nb - 1] = hk * group;
        c->p.enable_gqa = 1;
    }
    int64_t L = pick_size(r), S = pick_size(r), E = pick_size(r), Ev = pick_size(r);
    /* One case in six has a long key sequence, so that rows span several
     * key blocks (the online-softmax rescale) and, with few queries, the
     * fused kernels split keys into chunks merged by log-sum-exp. */
    if (rng_int(r, 0, 5) == 0) {
        static const int64_t LONG[] = {257, 513, 2100, 4500};
        S = LONG[rng_int(r, 0, 3)];
        if (S > 1000) {
            L = rng_int(r, 1, 4);
            for (int d = 0; d + 1 < nb; d++) b[d] = 1;
        }
    }
    int layout = rng_int(r, 0, 9) < 7 ? LAYOUT_RANDOM : LAYOUT_CONTIGUOUS;
    /* Ranks: each operand may drop leading batch dims (broadcast), except
     * under GQA, where all need the head dim. */
    int rq = full, rk = full, rv = full;
    if (rng_int(r, 0, 2) == 0) {
        int lo = gqa ? 3 : 2;
        rq = (int)rng_int(r, lo, full);
        rk = (int)rng_int(r, lo, full);
        rv = (int)rng_int(r, lo, full);
        if (rq < full && rk < full && rv < full) rq = full;
    }
    int64_t qs[ATTN_MAX_RANK], ks[ATTN_MAX_RANK], vs[ATTN_MAX_RANK];
    bool bcast = rng_int(r, 0, 2) == 0;
    batch_shape(r, qs, rq, b, nb, bcast);
    batch_shape(r, ks, rk, b, nb, bcast);
    batch_shape(r, vs, rv, b, nb, bcast);
    if (gqa) {
        qs[rq - 3] = hk * group;
        ks[rk - 3] = hk;
        vs[rv - 3] = hk;
    }
    qs[rq - 2] = L;
    qs[rq - 1] = E;
    ks[rk - 2] = S;
    ks[rk - 1] = E;
    vs[rv - 2] = S;
    vs[rv - 1] = Ev;
    /* Logits of magnitude ~1e4 in one case of ten. */
    double amp = rng_int(r, 0, 9) == 0 ? 100.0 : 1.0;
    tt_make(&c->q, r, c->dtype, rq, qs, layout, amp, 0);
    tt_make(&c->k, r, c->dtype, rk, ks, layout, amp, 0);
    tt_make(&c->v, r, c->dtype, rv, vs, layout, 1.0, 0);

    if (rng_int(r, 0, 4) < 2) {
        c->p.has_scale = 1;
        c->p.scale = rng_uniform(r) * 4 - 2; /* negative too */
    }

    int causal = (int)rng_int(r, 0, 3);
    c->p.causal = causal == 3 ? ATTN_CAUSAL_NONE : (attn_causal)causal;

    /* The broadcast shape comes from q, k and v alone: a mask may not widen it
     * (PyTorch refuses that too). */
    int orank;
    int64_t os[ATTN_MAX_RANK];
    CHECK_OK(attn_sdpa_out_shape(&c->q.t, &c->k.t, &c->v.t, &c->p, &orank, os));
    int mk = (int)rng_int(r, 0, 4); /* 0,1: none; 2,3: bool; 4: float */
    if (mk >= 2) {
        int mrank = (int)rng_int(r, 1, full);
        int64_t ms[ATTN_MAX_RANK], target[ATTN_MAX_RANK];
        for (int d = 0; d < nb; d++) target[d] = os[d];
        target[nb] = L;
        target[nb + 1] = S;
        for (int d = 0; d < mrank; d++) {
            int fd = d + (full - mrank);
            ms[d] = rng_int(r, 0, 2) == 0 ? 1 : target[fd];
        }
        attn_dtype mdt = mk == 4 ? (rng_int(r, 0, 1) ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64)
                                 : ATTN_DTYPE_BOOL;
        double p_true = (double[]){0.3, 0.8, 1.0}[rng_int(r, 0, 2)];
        tt_make(&c->mask, r, mdt, mrank, ms, layout, 1.0, p_true);
        /* Knock out whole rows and single entries. */
        int64_t n = 1, idx[ATTN_MAX_RANK] = {0};
        for (int d = 0; d < mrank; d++) n *= ms[d];
        for (int64_t i = 0; i < n; i++) {
            bool row_out = mrank >= 2 && idx[mrank - 2] % 3 == 1 && rng_int(r, 0, 1);
            if (mdt != ATTN_DTYPE_BOOL && (row_out || rng_int(r, 0, 4) == 0))
                tt_set(&c->mask.t, idx, -INFINITY);
            if (mdt == ATTN_DTYPE_BOOL && row_out) tt_set(&c->mask.t, idx, 0);
            for (int d = mrank - 1; d >= 0; d--) {
                if (++idx[d] < ms[d]) break;
                idx[d] = 0;
            }
        }
        c->has_mask = true;
        c->p.attn_mask = &c->mask.t;
    }
    int dk = (int)rng_int(r, 0, 19);
    if (dk >= 14) {
        c->p.dropout_p = dk == 19 ? 1.0 : dk == 18 ? 0.9 : 0.25;
        c->p.seed = rng_next(r);
        c->p.rng_offset = rng_int(r, 0, 3);
    }
    /* Outputs in the broadcast shape, with random layouts. */
    tt_make_output(&c->out, r, c->dtype, orank, os, layout);
    c->has_weights = rng_int(r, 0, 1);
    c->has_lse = rng_int(r, 0, 1);
    if (c->has_weights) {
        int64_t ws[ATTN_MAX_RANK];
        memcpy(ws, os, sizeof ws);
        ws[orank - 1] = S;
        tt_make_output(&c->weights, r, c->dtype, orank, ws, layout);
    }
    if (c->has_lse) tt_make_output(&c->lse, r, c->dtype, orank - 1, os, layout);
}

static void free_case(sdpa_case *c) {
    tt_free(&c->q);
    tt_free(&c->k);
    tt_free(&c->v);
    tt_free(&c->mask);
    tt_free(&c->out);
    tt_free(&c->weights);
    tt_free(&c->lse);
}

static oracle_sdpa_args oracle_args(const sdpa_case *c) {
    oracle_sdpa_args a = {&c->q.t, &c->k.t, &c->v.t, c->has_mask ? &c->mask.t : NULL, 1,
                          (int)c->p.causal, c->p.has_scale, c->p.scale, c->p.enable_gqa,
                          c->p.dropout_p, c->p.seed, c->p.rng_offset, NULL};
    return a;
}

/* The error model's inputs for a case on the current path. */
static error_model case_model(const sdpa_case *c) {
    error_model m;
    const bool f32 = c->dtype == ATTN_DTYPE_F32;
    const bool ref = attn_get_isa() == ATTN_ISA_REF;
    m.u = ref || !f32 ? 0x1p-53 : 0x1p-24;
    m.out_u = f32 ? 0x1p-24 : 0x1p-53;
    const attn_tensor *q = &c->q.t, *k = &c->k.t;
    m.E = (double)q->shape[q->rank - 1];
    m.S = (double)k->shape[k->rank - 2];
    /* A: the largest |scale| sum_e |q_e k_e| over any query/key pair, bounded
     * by |scale| max_i sum_e |q_ie| max_j,e |k_je| to keep it cheap. */
    double *Q = tt_dense(q), *K = tt_dense(k), *V = tt_dense(&c->v.t);
    const int64_t nq = attn_tensor_numel(q), nkk = attn_tensor_numel(k);
    const int64_t E = q->shape[q->rank - 1];
    double qrow = 0, kmax = max_abs(K, nkk);
    for (int64_t i = 0; i < nq; i += E) {
        double sum = 0;
        for (int64_t e = 0; e < E; e++) sum += fabs(Q[i + e]);
        qrow = fmax(qrow, sum);
    }
    const double scale = c->p.has_scale ? fabs(c->p.scale) : 1 / sqrt(m.E);
    m.A = scale * qrow * kmax;
    m.vmax = max_abs(V, attn_tensor_numel(&c->v.t));
    m.keep = c->p.dropout_p > 0 && c->p.dropout_p < 1 ? 1 / (1 - c->p.dropout_p) : 1;
    free(Q);
    free(K);
    free(V);
    return m;
}

/* Runs one case on the current path; returns false on a mismatch. */
static bool run_case(sdpa_case *c, int index) {
    attn_status st = attn_sdpa(&c->q.t, &c->k.t, &c->v.t, &c->p, &c->out.t,
                               c->has_weights ? &c->weights.t : NULL,
                               c->has_lse ? &c->lse.t : NULL);
    CHECK(st == ATTN_OK, "case %d: %s", index, attn_last_error());
    if (st != ATTN_OK) return false;
    oracle_sdpa_args a = oracle_args(c);
    oracle_sdpa_result ref;
    CHECK(oracle_sdpa(&a, &ref) == 0, "case %d: the oracle rejects it", index);
    const error_model m = case_model(c);
    int64_t n_out = ref.nbatch * ref.L * ref.Ev, n_w = ref.nbatch * ref.L * ref.S;
    double *out = tt_dense(&c->out.t);
    double err = max_abs_diff(out, ref.out, n_out), tol = tol_out(&m);
    double ratio = err / tol;
    CHECK(err <= tol, "case %d (%s, %s): out error %.3g > %.3g", index,
          attn_dtype_name(c->dtype), attn_isa_name(attn_get_isa()), err, tol);
    free(out);
    if (c->has_weights) {
        double *w = tt_dense(&c->weights.t);
        double werr = max_abs_diff(w, ref.weights, n_w), wtol = tol_weights(&m);
        CHECK(werr <= wtol, "case %d: weights error %.3g > %.3g", index, werr, wtol);
        ratio = fmax(ratio, werr / wtol);
        free(w);
    }
    if (c->has_lse) {
        double *l = tt_dense(&c->lse.t);
        double lerr = max_abs_diff(l, ref.lse, ref.nbatch * ref.L);
        double ltol = tol_lse(&m, max_abs(ref.lse, ref.nbatch * ref.L));
        CHECK(lerr <= ltol, "case %d: lse error %.3g > %.3g", index, lerr, ltol);
        ratio = fmax(ratio, lerr / ltol);
        free(l);
    }
    if (ratio > worst_ratio[attn_get_isa()]) worst_ratio[attn_get_isa()] = ratio;
    bool ok = ratio <= 1;
    oracle_free(&ref);
    return ok;
}

/* The paths to test: every one this machine runs, or ATTN_TEST_ISA. */
static int test_paths(attn_isa *paths) {
    const char *only = getenv("ATTN_TEST_ISA");
    int n = 0;
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++)
        if (attn_isa_supported((attn_isa)i) &&
            (only == NULL || strcmp(only, attn_isa_name((attn_isa)i)) == 0))
            paths[n++] = (attn_isa)i;
    return n;
}

static void random_configurations(void) {
    const int cases = 400;
    unsigned long long seed = harness_seed();
    printf("random_configurations: %d cases, seed %llu (ATTN_TEST_SEED to change)\n", cases,
           seed);
    attn_isa paths[8];
    int npaths = test_paths(paths);
    for (int pi = 0; pi < npaths; pi++) {
        CHECK_OK(attn_set_isa(paths[pi]));
        rng r = {seed};
        int failures = 0;
        for (int i = 0; i < cases; i++) {
            sdpa_case c;
            make_case(&c, &r);
            if (!run_case(&c, i)) failures++;
            free_case(&c);
        }
        printf("  path %-8s %d/%d cases agree with the oracle; worst error/tolerance %.3f\n",
               attn_isa_name(paths[pi]), cases - failures, cases, worst_ratio[paths[pi]]);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- seed 004 ---- */

static void seed_example(void) {
    static const double X[4][4] = {{1, 1, 1, 0}, {1, 2, 1, 0}, {0, 1, 0, 1}, {0, 1, 1, 0}};
    static const double W[3][4][3] = {{{1, 0, 1}, {1, 1, 1}, {0, 0, 1}, {1, 0, 0}},
                                      {{1, 0, 0}, {1, 1, 1}, {1, 0, 1}, {0, 1, 0}},
                                      {{1, 2, 0}, {1, 3, 1}, {1, 0, 2}, {1, 1, 0}}};
    static const double expect[4][3] = {{3.9492, 7.8588, 3.9577},
                                        {3.9924, 7.9784, 3.9934},
                                        {3.8407, 7.5669, 3.8595},
                                        {3.7902, 7.4482, 3.8228}};
    double M[3][4][3], O[4][3], cols[3][3][4], R2[3][4];
    for (int m = 0; m < 3; m++)
        for (int n = 0; n < 4; n++)
            for (int d = 0; d < 3; d++) {
                M[m][n][d] = 0;
                for (int p = 0; p < 4; p++) M[m][n][d] += X[n][p] * W[m][p][d];
                cols[m][d][n] = M[m][n][d]; /* column layout: (d, n) */
            }
    int64_t shape[2] = {4, 3}, cshape[2] = {3, 4};
    attn_tensor q, k, v, o, q2, k2, v2, r2;
    attn_tensor_init(&q, M[0], ATTN_DTYPE_F64, 2, shape);
    attn_tensor_init(&k, M[1], ATTN_DTYPE_F64, 2, shape);
    attn_tensor_init(&v, M[2], ATTN_DTYPE_F64, 2, shape);
    attn_tensor_init(&o, O, ATTN_DTYPE_F64, 2, shape);
    CHECK_OK(attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL));
    attn_tensor_init(&q2, cols[0], ATTN_DTYPE_F64, 2, cshape);
    attn_tensor_init(&k2, cols[1], ATTN_DTYPE_F64, 2, cshape);
    attn_tensor_init(&v2, cols[2], ATTN_DTYPE_F64, 2, cshape);
    attn_tensor_init(&r2, R2, ATTN_DTYPE_F64, 2, cshape);
    CHECK_OK(attn_tensor_transpose(&q2, 0, 1));
    CHECK_OK(attn_tensor_transpose(&k2, 0, 1));
    CHECK_OK(attn_tensor_transpose(&v2, 0, 1));
    CHECK_OK(attn_tensor_transpose(&r2, 0, 1));
    CHECK_OK(attn_sdpa(&q2, &k2, &v2, NULL, &r2, NULL, NULL));
    for (int n = 0; n < 4; n++)
        for (int d = 0; d < 3; d++) {
            CHECK(fabs(O[n][d] - expect[n][d]) < 5e-5, "row layout [%d][%d] = %.6f, seed %.4f",
                  n, d, O[n][d], expect[n][d]);
            CHECK(fabs(R2[d][n] - expect[n][d]) < 5e-5, "column layout [%d][%d] = %.6f", n, d,
                  R2[d][n]);
        }
}

/* ---- invariants ---- */

static void weights_rows_sum_to_one(void) {
    rng r = {harness_seed() ^ 0x1111};
    for (int i = 0; i < 60; i++) {
        sdpa_case c;
        make_case(&c, &r);
        c.p.dropout_p = 0;
        if (!c.has_weights) {
            int orank = c.out.t.rank;
            int64_t ws[ATTN_MAX_RANK];
            memcpy(ws, c.out.t.shape, sizeof ws);
            ws[orank - 1] = c.k.t.shape[c.k.t.rank - 2];
            tt_make_output(&c.weights, &r, c.dtype, orank, ws, LAYOUT_RANDOM);
            c.has_weights = true;
        }
        if (!c.has_lse) {
            tt_make_output(&c.lse, &r, c.dtype, c.out.t.rank - 1, c.out.t.shape, LAYOUT_RANDOM);
            c.has_lse = true;
        }
        CHECK_OK(attn_sdpa(&c.q.t, &c.k.t, &c.v.t, &c.p, &c.out.t, &c.weights.t, &c.lse.t));
        /* which rows see no key: the oracle's word, not the library's lse */
        oracle_sdpa_args a = oracle_args(&c);
        oracle_sdpa_result ref;
        CHECK(oracle_sdpa(&a, &ref) == 0, "case %d: the oracle rejects it", i);
        double *w = tt_dense(&c.weights.t), *l = tt_dense(&c.lse.t);
        int64_t S = c.weights.t.shape[c.weights.t.rank - 1];
        int64_t rows = attn_tensor_numel(&c.weights.t) / S;
        for (int64_t row = 0; row < rows; row++) {
            double sum = 0;
            for (int64_t j = 0; j < S; j++) {
                CHECK(w[row * S + j] >= 0 && w[row * S + j] <= 1, "weight out of [0, 1]");
                sum += w[row * S + j];
            }
            const double want = ref.lse[row] == -INFINITY ? 0.0 : 1.0; /* fully masked: 0 */
            CHECK(fabs(sum - want) < (c.dtype == ATTN_DTYPE_F64 ? 1e-12 : 1e-5),
                  "case %d row %lld sums to %.9f, expected %g", i, (long long)row, sum, want);
            CHECK((l[row] == -INFINITY) == (want == 0), "case %d row %lld: lse %g", i,
                  (long long)row, l[row]);
        }
        oracle_free(&ref);
        free(w);
        free(l);
        free_case(&c);
    }
}

/* out == weights · v, with and without dropout. */
static void output_is_weights_times_values(void) {
    rng r = {harness_seed() ^ 0x2222};
    int64_t qs[3] = {2, 5, 4}, ks[3] = {2, 7, 4}, vs[3] = {2, 7, 3}, os[3] = {2, 5, 3},
            ws[3] = {2, 5, 7};
    for (int drop = 0; drop < 2; drop++) {
        test_tensor q, k, v, o, w;
        tt_make(&q, &r, ATTN_DTYPE_F64, 3, qs, LAYOUT_RANDOM, 1, 0);
        tt_make(&k, &r, ATTN_DTYPE_F64, 3, ks, LAYOUT_RANDOM, 1, 0);
        tt_make(&v, &r, ATTN_DTYPE_F64, 3, vs, LAYOUT_RANDOM, 1, 0);
        tt_make_output(&o, &r, ATTN_DTYPE_F64, 3, os, LAYOUT_CONTIGUOUS);
        tt_make_output(&w, &r, ATTN_DTYPE_F64, 3, ws, LAYOUT_CONTIGUOUS);
        attn_sdpa_params p;
        attn_sdpa_params_init(&p);
        p.dropout_p = drop ? 0.4 : 0;
        p.seed = 7;
        CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &p, &o.t, &w.t, NULL));
        double *V = tt_dense(&v.t), *W = tt_dense(&w.t), *O = tt_dense(&o.t);
        for (int b = 0; b < 2; b++)
            for (int i = 0; i < 5; i++)
                for (int e = 0; e < 3; e++) {
                    double acc = 0;
                    for (int j = 0; j < 7; j++) acc += W[(b * 5 + i) * 7 + j] * V[(b * 7 + j) * 3 + e];
                    CHECK(fabs(acc - O[(b * 5 + i) * 3 + e]) < 1e-12, "out != weights·v");
                }
        free(V);
        free(W);
        free(O);
        tt_free(&q);
        tt_free(&k);
        tt_free(&v);
        tt_free(&o);
        tt_free(&w);
    }
}

/* Permuting keys and values (and the mask's key axis) together leaves the
 * output unchanged. */
static void key_permutation_invariance(void) {
    rng r = {harness_seed() ^ 0x3333};
    for (int trial = 0; trial < 20; trial++) {
        const int64_t L = rng_int(&r, 1, 9), S = rng_int(&r, 2, 17), E = rng_int(&r, 1, 8),
                      Ev = rng_int(&r, 1, 8);
        int64_t qs[2] = {L, E}, ks[2] = {S, E}, vs[2] = {S, Ev}, ms[2] = {L, S}, os[2] = {L, Ev};
        test_tensor q, k, v, m, o1, o2, k2, v2, m2;
        tt_make(&q, &r, ATTN_DTYPE_F64, 2, qs, LAYOUT_RANDOM, 2, 0);
        tt_make(&k, &r, ATTN_DTYPE_F64, 2, ks, LAYOUT_RANDOM, 2, 0);
        tt_make(&v, &r, ATTN_DTYPE_F64, 2, vs, LAYOUT_RANDOM, 1, 0);
        tt_make(&m, &r, ATTN_DTYPE_BOOL, 2, ms, LAYOUT_RANDOM, 1, 0.7);
        tt_make_output(&o1, &r, ATTN_DTYPE_F64, 2, os, LAYOUT_CONTIGUOUS);
        tt_make_output(&o2, &r, ATTN_DTYPE_F64, 2, os, LAYOUT_CONTIGUOUS);
        tt_make_output(&k2, &r, ATTN_DTYPE_F64, 2, ks, LAYOUT_CONTIGUOUS);
        tt_make_output(&v2, &r, ATTN_DTYPE_F64, 2, vs, LAYOUT_CONTIGUOUS);
        tt_make_output(&m2, &r, ATTN_DTYPE_BOOL, 2, ms, LAYOUT_CONTIGUOUS);
        int64_t perm[64];
        for (int64_t j = 0; j < S; j++) perm[j] = j;
        for (int64_t j = S - 1; j > 0; j--) {
            int64_t x = rng_int(&r, 0, (long)j), t = perm[j];
            perm[j] = perm[x];
            perm[x] = t;
        }
        for (int64_t j = 0; j < S; j++) {
            for (int64_t e = 0; e < E; e++)
                tt_set(&k2.t, (int64_t[]){j, e}, tt_get(&k.t, (int64_t[]){perm[j], e}));
            for (int64_t e = 0; e < Ev; e++)
                tt_set(&v2.t, (int64_t[]){j, e}, tt_get(&v.t, (int64_t[]){perm[j], e}));
            for (int64_t i = 0; i < L; i++)
                tt_set(&m2.t, (int64_t[]){i, j}, tt_get(&m.t, (int64_t[]){i, perm[j]}));
        }
        attn_sdpa_params p;
        attn_sdpa_params_init(&p);
        p.attn_mask = &m.t;
        CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &p, &o1.t, NULL, NULL));
        p.attn_mask = &m2.t;
        CHECK_OK(attn_sdpa(&q.t, &k2.t, &v2.t, &p, &o2.t, NULL, NULL));
        double *a = tt_dense(&o1.t), *b = tt_dense(&o2.t);
        double err = max_abs_diff(a, b, L * Ev);
        CHECK(err < 1e-12, "trial %d: permuting keys changed the output by %.3g", trial, err);
        free(a);
        free(b);
        test_tensor *all[] = {&q, &k, &v, &m, &o1, &o2, &k2, &v2, &m2};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tt_free(all[i]);
    }
}

/* ---- edge cases ---- */

static void fully_masked_rows(void) {
    /* L = 3, S = 4: row 1 masked by a bool mask, row 2 by -inf floats. */
    double q[3][2] = {{1, 2}, {3, 4}, {5, 6}}, k[4][2] = {{1, 0}, {0, 1}, {1, 1}, {2, 1}};
    double v[4][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}}, o[3][2], w[3][4], lse[3];
    unsigned char mb[3][4] = {{1, 1, 0, 1}, {0, 0, 0, 0}, {1, 1, 1, 1}};
    double mf[3][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {-INFINITY, -INFINITY, -INFINITY, -INFINITY}};
    int64_t qs[2] = {3, 2}, ks[2] = {4, 2}, ms[2] = {3, 4}, ls[1] = {3};
    attn_tensor tq, tk, tv, to, tw, tl, tmb, tmf;
    attn_tensor_init(&tq, q, ATTN_DTYPE_F64, 2, qs);
    attn_tensor_init(&tk, k, ATTN_DTYPE_F64, 2, ks);
    attn_tensor_init(&tv, v, ATTN_DTYPE_F64, 2, ks);
    attn_tensor_init(&to, o, ATTN_DTYPE_F64, 2, qs);
    attn_tensor_init(&tw, w, ATTN_DTYPE_F64, 2, ms);
    attn_tensor_init(&tl, lse, ATTN_DTYPE_F64, 1, ls);
    attn_tensor_init(&tmb, mb, ATTN_DTYPE_BOOL, 2, ms);
    attn_tensor_init(&tmf, mf, ATTN_DTYPE_F64, 2, ms);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.attn_mask = &tmb;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, &tw, &tl));
    CHECK(o[1][0] == 0 && o[1][1] == 0, "bool-masked row gives %g %g", o[1][0], o[1][1]);
    CHECK(lse[1] == -INFINITY, "lse of a masked row is %g", lse[1]);
    for (int j = 0; j < 4; j++) CHECK(w[1][j] == 0, "weights of a masked row");
    CHECK(w[0][2] == 0, "masked key has weight %g", w[0][2]);
    p.attn_mask = &tmf;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, &tw, &tl));
    CHECK(o[2][0] == 0 && o[2][1] == 0 && lse[2] == -INFINITY, "-inf row not zero");
    CHECK(isfinite(o[0][0]) && isfinite(o[1][0]), "unmasked rows are finite");
    /* Bottom-right causal with L > S: the first L - S rows see no key. */
    int64_t q5[2] = {5, 2}, o5[2] = {5, 2}, k2s[2] = {2, 2};
    double q5d[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, o5d[10];
    attn_tensor_init(&tq, q5d, ATTN_DTYPE_F64, 2, q5);
    attn_tensor_init(&to, o5d, ATTN_DTYPE_F64, 2, o5);
    attn_tensor_init(&tk, k, ATTN_DTYPE_F64, 2, k2s);
    attn_tensor_init(&tv, v, ATTN_DTYPE_F64, 2, k2s);
    attn_sdpa_params_init(&p);
    p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL));
    for (int i = 0; i < 3; i++) CHECK(o5d[2 * i] == 0 && o5d[2 * i + 1] == 0, "row %d not 0", i);
    CHECK(o5d[6] == 1 && o5d[7] == 2, "row 3 sees only key 0: got %g %g", o5d[6], o5d[7]);
    /* Top-left with L > S: row 0 sees key 0 only; every row sees something. */
    p.causal = ATTN_CAUSAL_TOP_LEFT;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL));
    CHECK(o5d[0] == 1 && o5d[1] == 2, "top-left row 0 sees key 0 only");
}

static void huge_logits(void) {
    /* |q·k| ~ 1e30 (float64) and 1e4 * E (float32): the max-subtraction keeps
     * exp() in range; the result is the value of the best key. */
    for (int dt = 0; dt < 2; dt++) {
        attn_dtype dtype = dt ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
        double big = dt ? 1e15 : 1e2;
        double qd[2] = {big, big}, kd[3][2] = {{big, big}, {-big, big}, {big, 0.5 * big}};
        double vd[3][2] = {{1, -1}, {2, -2}, {3, -3}};
        float qf[2], kf[6], vf[6];
        for (int i = 0; i < 2; i++) qf[i] = (float)qd[i];
        for (int i = 0; i < 6; i++) {
            kf[i] = (float)(&kd[0][0])[i];
            vf[i] = (float)(&vd[0][0])[i];
        }
        double od[2];
        float of[2];
        int64_t qs[2] = {1, 2}, ks[2] = {3, 2};
        attn_tensor q, k, v, o;
        attn_tensor_init(&q, dt ? (void *)qd : qf, dtype, 2, qs);
        attn_tensor_init(&k, dt ? (void *)kd : kf, dtype, 2, ks);
        attn_tensor_init(&v, dt ? (void *)vd : vf, dtype, 2, ks);
        attn_tensor_init(&o, dt ? (void *)od : of, dtype, 2, qs);
        CHECK_OK(attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL));
        double o0 = dt ? od[0] : of[0], o1 = dt ? od[1] : of[1];
        CHECK(o0 == 1 && o1 == -1, "%s huge logits: got (%g, %g), expected (1, -1)",
              attn_dtype_name(dtype), o0, o1);
    }
}

/* Every key of a row masked with -FLT_MAX (torch.finfo(float32).min, the
 * Hugging Face padding idiom): torch's softmax of the equal scores is
 * uniform, out = the mean of V, however many keys there are. Long rows are
 * cut into key chunks merged by lse (1 query, S >= 1024), where the lse of
 * ~-3.4e38 had lost the log of each chunk's key count: chunks of 296 keys
 * weighed as much as chunks of 512, and before that each chunk weighed 1
 * (the sum of the chunks' means). Also -FLT_MAX on every other key, and
 * +FLT_MAX on every other key (those tie at the top: their mean). */
static void float_min_masks_long_rows(void) {
    rng r = {harness_seed() ^ 0x7e57};
    attn_isa paths[8];
    int npaths = test_paths(paths);
    const int64_t lens[3] = {1000, 9000, 40000};
    for (int li = 0; li < 3; li++) {
        const int64_t S = lens[li], E = 16, Ev = 4;
        int64_t qs[4] = {1, 1, 1, E}, ks[4] = {1, 1, S, E}, vs[4] = {1, 1, S, Ev};
        int64_t os[4] = {1, 1, 1, Ev}, ms[2] = {1, S};
        test_tensor q, k, v;
        tt_make(&q, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make(&k, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make(&v, &r, ATTN_DTYPE_F32, 4, vs, LAYOUT_CONTIGUOUS, 1, 0);
        float *mask = malloc(sizeof(float) * (size_t)S), out[4];
        double *vd = tt_dense(&v.t);
        for (int kind = 0; kind < 3; kind++) { /* all -max, every other -max, every other +max */
            double mean[4] = {0, 0, 0, 0}, n = 0;
            for (int64_t j = 0; j < S; j++) {
                const bool odd = j % 2 == 1;
                mask[j] = kind == 0 ? -FLT_MAX : kind == 1 ? (odd ? -FLT_MAX : 0) : (odd ? 0 : FLT_MAX);
                if (kind == 0 || !odd) { /* the keys the weights fall on, uniformly */
                    for (int e = 0; e < Ev; e++) mean[e] += vd[j * Ev + e];
                    n++;
                }
            }
            attn_tensor tm, to;
            attn_tensor_init(&tm, mask, ATTN_DTYPE_F32, 2, ms);
            attn_tensor_init(&to, out, ATTN_DTYPE_F32, 4, os);
            attn_sdpa_params p;
            attn_sdpa_params_init(&p);
            p.attn_mask = &tm;
            /* kind 1, -FLT_MAX hiding its keys as -inf would: the oracle's
             * softmax over the even keys; else the mean of V over them */
            double want[4];
            if (kind == 1) {
                oracle_sdpa_args a = {&q.t, &k.t, &v.t, &tm, 1, 0, 0, 0, 0, 0, 0, 0, NULL};
                oracle_sdpa_result ref;
                oracle_sdpa(&a, &ref);
                for (int e = 0; e < Ev; e++) want[e] = ref.out[e];
                oracle_free(&ref);
            } else {
                for (int e = 0; e < Ev; e++) want[e] = mean[e] / n;
            }
            for (int pi = 0; pi < npaths; pi++) {
                CHECK_OK(attn_set_isa(paths[pi]));
                CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &p, &to, NULL, NULL));
                for (int e = 0; e < Ev; e++)
                    CHECK(fabs(out[e] - want[e]) <= 1e-6,
                          "S=%lld mask %d path %s: out[%d] = %.9g, expected %.9g", (long long)S,
                          kind, attn_isa_name(paths[pi]), e, out[e], want[e]);
            }
        }
        free(vd);
        free(mask);
        tt_free(&q);
        tt_free(&k);
        tt_free(&v);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

static void unit_sizes(void) {
    /* L = S = E = Ev = 1: the single key gets weight 1. */
    double q = 3, k = -2, v = 5, o = 0, w = 0, l = 0;
    int64_t one[2] = {1, 1}, ls[1] = {1};
    attn_tensor tq, tk, tv, to, tw, tl;
    attn_tensor_init(&tq, &q, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&tk, &k, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&tv, &v, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&to, &o, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&tw, &w, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&tl, &l, ATTN_DTYPE_F64, 1, ls);
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, NULL, &to, &tw, &tl));
    CHECK(o == 5 && w == 1 && fabs(l + 6) < 1e-14, "got out %.17g weight %.17g lse %.17g", o, w, l);
}

/* ---- dropout ---- */

static void dropout_statistics(void) {
    /* One query over S keys whose values are all 1, with uniform scores: each
     * weight is 1/S, and kept weights become 1/(S(1-p)). */
    enum { S = 4096, L = 8 };
    static double q[L], k[S], v[S], o[L], w[L * S];
    for (int i = 0; i < L; i++) q[i] = 0;
    for (int j = 0; j < S; j++) k[j] = v[j] = 1;
    int64_t qs[2] = {L, 1}, ks[2] = {S, 1}, ws[2] = {L, S};
    attn_tensor tq, tk, tv, to, tw;
    attn_tensor_init(&tq, q, ATTN_DTYPE_F64, 2, qs);
    attn_tensor_init(&tk, k, ATTN_DTYPE_F64, 2, ks);
    attn_tensor_init(&tv, v, ATTN_DTYPE_F64, 2, ks);
    attn_tensor_init(&to, o, ATTN_DTYPE_F64, 2, qs);
    attn_tensor_init(&tw, w, ATTN_DTYPE_F64, 2, ws);
    const double ps[] = {0.1, 0.5, 0.9};
    for (int t = 0; t < 3; t++) {
        attn_sdpa_params p;
        attn_sdpa_params_init(&p);
        p.dropout_p = ps[t];
        p.seed = 1234 + (uint64_t)t;
        CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, &tw, NULL));
        long kept = 0;
        bool scaled = true;
        for (int i = 0; i < L * S; i++) {
            if (w[i] != 0) {
                kept++;
                scaled &= fabs(w[i] - 1.0 / (S * (1 - ps[t]))) < 1e-15;
            }
        }
        double n = L * S, mean = n * (1 - ps[t]), sigma = sqrt(n * ps[t] * (1 - ps[t]));
        CHECK(fabs((double)kept - mean) < 4 * sigma, "p=%g: kept %ld of %.0f, expected %.0f±%.0f",
              ps[t], kept, n, mean, 4 * sigma);
        CHECK(scaled, "kept weights are not scaled by 1/(1-p)");
    }
    /* Same seed: identical; different seed or offset: different. */
    double o2[L];
    attn_tensor to2;
    attn_tensor_init(&to2, o2, ATTN_DTYPE_F64, 2, qs);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.dropout_p = 0.5;
    p.seed = 99;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL));
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to2, NULL, NULL));
    CHECK(memcmp(o, o2, sizeof o) == 0, "same seed gave different outputs");
    p.seed = 100;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to2, NULL, NULL));
    CHECK(memcmp(o, o2, sizeof o) != 0, "different seeds gave the same output");
    p.seed = 99;
    p.rng_offset = 1;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to2, NULL, NULL));
    CHECK(memcmp(o, o2, sizeof o) != 0, "different offsets gave the same output");
    /* p = 1 drops everything. */
    p.dropout_p = 1;
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, &tw, NULL));
    bool zero = true;
    for (int i = 0; i < L; i++) zero &= o[i] == 0;
    CHECK(zero, "p = 1 leaves a non-zero output");
}

/* ---- threads ---- */

/* Shapes that exercise the fused driver's scheduling: key chunks merged by
 * log-sum-exp (decode with GQA), many query blocks with causal skipping,
 * and the keys-in-columns layout. Random values, contiguous layout. */
static void scheduling_shapes_are_thread_independent(void) {
    struct {
        int64_t B, H, Hk, L, S, E;
        attn_causal causal;
    } shapes[] = {
        {1, 8, 2, 1, 4500, 64, ATTN_CAUSAL_NONE},        /* decode: GQA, key chunks */
        {2, 4, 4, 3, 3000, 32, ATTN_CAUSAL_BOTTOM_RIGHT}, /* few rows, chunks, causal */
        {1, 3, 3, 130, 300, 48, ATTN_CAUSAL_TOP_LEFT},    /* query blocks, causal skip */
        {1, 2, 1, 97, 1100, 40, ATTN_CAUSAL_NONE},        /* GQA prefill, block tails */
        /* 15 query blocks of 48 rows, more of fewer rows at 2+ threads: the
         * key split (below 16 blocks) must follow the shape, not the width */
        {1, 3, 3, 220, 2100, 33, ATTN_CAUSAL_NONE},
        {1, 4, 4, 74, 2100, 33, ATTN_CAUSAL_NONE},
    };
    rng r = {harness_seed() ^ 0x5151};
    attn_isa paths[8];
    int npaths = test_paths(paths);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int64_t qs[4] = {shapes[si].B, shapes[si].H, shapes[si].L, shapes[si].E};
        int64_t ks[4] = {shapes[si].B, shapes[si].Hk, shapes[si].S, shapes[si].E};
        test_tensor q, k, v, o;
        tt_make(&q, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make(&k, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make(&v, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make_output(&o, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS);
        attn_sdpa_params p;
        attn_sdpa_params_init(&p);
        p.causal = shapes[si].causal;
        p.enable_gqa = shapes[si].Hk != shapes[si].H;
        const size_t bytes = sizeof(float) * (size_t)attn_tensor_numel(&o.t);
        for (int pi = 0; pi < npaths; pi++) {
            CHECK_OK(attn_set_isa(paths[pi]));
            float *first = malloc(bytes);
            /* 1-4 threads, and more than the cores (narrower query blocks) */
            const int counts[5] = {1, 2, 3, 4, attn_max_threads()};
            for (int ti = 0; ti < 5; ti++) {
                const int threads = counts[ti];
                attn_set_num_threads(threads);
                CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &p, &o.t, NULL, NULL));
                if (threads == 1)
                    memcpy(first, o.t.data, bytes);
                else
                    CHECK(memcmp(first, o.t.data, bytes) == 0,
                          "shape %zu, path %s: %d threads differ from 1", si,
                          attn_isa_name(paths[pi]), threads);
            }
            /* and the result is right */
            oracle_sdpa_args a = {&q.t, &k.t, &v.t, NULL, 1, (int)p.causal, 0, 0, p.enable_gqa,
                                  0, 0, 0, NULL};
            oracle_sdpa_result ref;
            oracle_sdpa(&a, &ref);
            double *out = tt_dense(&o.t);
            const double err = max_abs_diff(out, ref.out, attn_tensor_numel(&o.t));
            CHECK(err < 1e-4, "shape %zu, path %s: error %.3g", si, attn_isa_name(paths[pi]), err);
            free(out);
            oracle_free(&ref);
            free(first);
        }
        tt_free(&q);
        tt_free(&k);
        tt_free(&v);
        tt_free(&o);
    }
    attn_set_num_threads(0);
    attn_set_isa(ATTN_ISA_AUTO);
}

static void thread_count_independence(void) {
    rng r = {harness_seed() ^ 0x4444};
    attn_isa paths[8];
    int npaths = test_paths(paths);
    for (int pi = 0; pi < npaths; pi++) {
        CHECK_OK(attn_set_isa(paths[pi]));
        for (int trial = 0; trial < 6; trial++) {
            sdpa_case c;
            make_case(&c, &r);
            int64_t n = attn_tensor_numel(&c.out.t);
            double *first = NULL;
            /* 1-4 threads, and more than the cores (narrower query blocks) */
            const int counts[5] = {1, 2, 3, 4, attn_max_threads()};
            for (int ti = 0; ti < 5; ti++) {
                const int threads = counts[ti];
                attn_set_num_threads(threads);
                CHECK_OK(attn_sdpa(&c.q.t, &c.k.t, &c.v.t, &c.p, &c.out.t, NULL, NULL));
                double *out = tt_dense(&c.out.t);
                if (first == NULL) {
                    first = out;
                    continue;
                }
                CHECK(memcmp(first, out, sizeof(double) * (size_t)n) == 0,
                      "path %s: %d threads differ from 1 thread", attn_isa_name(paths[pi]),
                      threads);
                free(out);
            }
            free(first);
            free_case(&c);
        }
    }
    attn_set_num_threads(0);
    attn_set_isa(ATTN_ISA_AUTO);
}

HARNESS_MAIN(T(seed_example), T(random_configurations), T(weights_rows_sum_to_one),
             T(output_is_weights_times_values), T(key_permutation_invariance),
             T(fully_masked_rows), T(huge_logits), T(float_min_masks_long_rows), T(unit_sizes), T(dropout_statistics),
             T(thread_count_independence), T(scheduling_shapes_are_thread_independent))
