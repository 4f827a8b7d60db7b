/*
 * test_backward.c — attn_sdpa_backward.
 *
 *  - the float64 reference backward against central finite differences of
 *    the independent oracle's forward (testutil.c), for every option:
 *    loss = sum(dout * out), so d loss / d x is what the backward returns;
 *  - every fused path against the reference (float64 tight, float32 within
 *    a bound that scales with the gradient's magnitude);
 *  - bits identical for 1-4 threads on every path, including the layouts
 *    that take the backward's reductions (key chunks, shared K/V, q
 *    broadcast over batch);
 *  - the NaN/Inf rules and fully masked rows; hostile arguments.
 * Inputs use random strides (LAYOUT_RANDOM), except under finite
 * differences.
 */
#include <float.h>

#include "testutil.h"

typedef struct bw_case {
    int rank;
    int64_t q[6], k[6], v[6];
    int mask_rank;
    int64_t m[6];
    attn_dtype mask_dtype; /* 0: no mask */
    attn_causal causal;
    int gqa;
    int has_scale;
    double scale;
    double dropout_p;
} bw_case;

/* One case's tensors: inputs, the forward's out and lse, dout, gradients. */
typedef struct bw_data {
    test_tensor q, k, v, mask, out, lse, dout, dq, dk, dv, dmask;
    attn_sdpa_params params;
    int out_rank;
    int64_t out_shape[ATTN_MAX_RANK];
} bw_data;

static void bw_params(const bw_case *c, const attn_tensor *mask, attn_sdpa_params *p) {
    attn_sdpa_params_init(p);
    p->attn_mask = mask;
    p->causal = c->causal;
    p->enable_gqa = c->gqa;
    p->has_scale = c->has_scale;
    p->scale = c->scale;
    p->dropout_p = c->dropout_p;
    p->seed = 1234;
    p->rng_offset = 7;
}

/* Inputs, the reference forward's out and lse, dout; zeroed gradients. */
static void bw_make(bw_data *d, const bw_case *c, attn_dtype dtype, int layout, rng *r) {
    memset(d, 0, sizeof *d);
    tt_make(&d->q, r, dtype, c->rank, c->q, layout, 1.0, 0);
    tt_make(&d->k, r, dtype, c->rank, c->k, layout, 1.0, 0);
    tt_make(&d->v, r, dtype, c->rank, c->v, layout, 1.0, 0);
    const bool mask = c->mask_dtype != 0;
    if (mask) tt_make(&d->mask, r, c->mask_dtype, c->mask_rank, c->m, layout, 1.0, 0.7);
    bw_params(c, mask ? &d->mask.t : NULL, &d->params);
    CHECK_OK(attn_sdpa_out_shape(&d->q.t, &d->k.t, &d->v.t, &d->params, &d->out_rank,
                                 d->out_shape));
    tt_make_output(&d->out, r, dtype, d->out_rank, d->out_shape, layout);
    tt_make_output(&d->lse, r, dtype, d->out_rank - 1, d->out_shape, layout);
    tt_make(&d->dout, r, dtype, d->out_rank, d->out_shape, layout, 1.0, 0);
    const attn_isa isa = attn_get_isa();
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    CHECK_OK(attn_sdpa(&d->q.t, &d->k.t, &d->v.t, &d->params, &d->out.t, NULL, &d->lse.t));
    CHECK_OK(attn_set_isa(isa));
    tt_make_output(&d->dq, r, dtype, c->rank, c->q, layout);
    tt_make_output(&d->dk, r, dtype, c->rank, c->k, layout);
    tt_make_output(&d->dv, r, dtype, c->rank, c->v, layout);
    if (mask && c->mask_dtype != ATTN_DTYPE_BOOL)
        tt_make_output(&d->dmask, r, c->mask_dtype, c->mask_rank, c->m, layout);
}

static void bw_free(bw_data *d) {
    test_tensor *all[] = {&d->q, &d->k, &d->v, &d->mask, &d->out, &d->lse,
                          &d->dout, &d->dq, &d->dk, &d->dv, &d->dmask};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->storage != NULL) tt_free(all[i]);
}

static attn_status bw_run(bw_data *d) {
    return attn_sdpa_backward(&d->dout.t, &d->q.t, &d->k.t, &d->v.t, &d->out.t, &d->lse.t,
                              &d->params, &d->dq.t, &d->dk.t, &d->dv.t,
                              d->dmask.storage ? &d->dmask.t : NULL);
}

/* ---- finite differences of the oracle ---- */

/* sum(dout * out) by the oracle, for the current inputs. */
static double oracle_loss(const bw_data *d, const bw_case *c) {
    oracle_sdpa_args a = {&d->q.t, &d->k.t, &d->v.t, c->mask_dtype ? &d->mask.t : NULL, 1,
                          (int)c->causal, c->has_scale, c->scale, c->gqa, c->dropout_p,
                          1234, 7, NULL};
    oracle_sdpa_result res;
    CHECK(oracle_sdpa(&a, &res) == 0, "oracle refused the case");
    double *g = tt_dense(&d->dout.t), loss = 0;
    const int64_t n = res.nbatch * res.L * res.Ev;
    for (int64_t x = 0; x < n; x++) loss += g[x] * res.out[x];
    free(g);
    oracle_free(&res);
    return loss;
}

/* Next index of a row-major walk over `shape`; false after the last. */
static bool next_index(int rank, const int64_t *shape, int64_t *idx) {
    for (int d = rank - 1; d >= 0; d--) {
        if (++idx[d] < shape[d]) return true;
        idx[d] = 0;
    }
    return false;
}

/* Every element of x's gradient g against (loss(x + h) - loss(x - h)) / 2h. */
static void check_fd(bw_data *d, const bw_case *c, test_tensor *x, const test_tensor *g,
                     const char *name) {
    int64_t idx[ATTN_MAX_RANK] = {0};
    double worst = 0, scale = 0;
    do {
        const double x0 = tt_get(&x->t, idx), h = 1e-5 * (fabs(x0) > 1 ? fabs(x0) : 1);
        tt_set(&x->t, idx, x0 + h);
        const double up = oracle_loss(d, c);
        tt_set(&x->t, idx, x0 - h);
        const double down = oracle_loss(d, c);
        tt_set(&x->t, idx, x0);
        const double fd = (up - down) / (2 * h), got = tt_get(&g->t, idx);
        if (fabs(fd - got) > worst) worst = fabs(fd - got);
        if (fabs(fd) > scale) scale = fabs(fd);
    } while (next_index(x->t.rank, x->t.shape, idx));
    /* central differences in float64: O(h^2) + O(eps/h), ~1e-9 here */
    CHECK(worst <= 1e-7 * (scale > 1 ? scale : 1), "%s: |reference - finite difference| = %.3g "
          "(max |grad| %.3g)", name, worst, scale);
}

static const bw_case FD_CASES[] = {
    /* rank, q, k, v, mask rank, mask shape, mask dtype, causal, gqa, scale, dropout */
    {4, {2, 2, 5, 4}, {2, 2, 6, 4}, {2, 2, 6, 3}, 0, {0}, 0, ATTN_CAUSAL_NONE, 0, 0, 0, 0},
    {4, {1, 4, 5, 4}, {1, 2, 6, 4}, {1, 2, 6, 3}, 0, {0}, 0, ATTN_CAUSAL_NONE, 1, 0, 0, 0},
    {4, {2, 2, 6, 3}, {2, 2, 6, 3}, {2, 2, 6, 2}, 0, {0}, 0, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0},
    {3, {2, 3, 4}, {2, 7, 4}, {2, 7, 2}, 0, {0}, 0, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 1, -0.8, 0},
    {4, {2, 2, 4, 3}, {2, 2, 5, 3}, {2, 2, 5, 3}, 2, {4, 5}, ATTN_DTYPE_F64, 0, 0, 0, 0, 0},
    {4, {2, 2, 4, 3}, {2, 2, 5, 3}, {2, 2, 5, 3}, 4, {2, 1, 1, 5}, ATTN_DTYPE_F64, 0, 0, 0, 0, 0},
    {4, {2, 2, 4, 3}, {2, 2, 5, 3}, {2, 2, 5, 3}, 3, {2, 4, 5}, ATTN_DTYPE_BOOL, 0, 0, 0, 0, 0},
    {4, {1, 2, 4, 3}, {3, 2, 5, 3}, {3, 1, 5, 2}, 0, {0}, 0, ATTN_CAUSAL_NONE, 0, 0, 0, 0},
    {4, {2, 2, 5, 3}, {2, 2, 5, 3}, {2, 2, 5, 3}, 0, {0}, 0, ATTN_CAUSAL_NONE, 0, 0, 0, 0.3},
    {4, {2, 2, 5, 3}, {2, 2, 5, 3}, {2, 2, 5, 3}, 2, {5, 5}, ATTN_DTYPE_F64,
     ATTN_CAUSAL_TOP_LEFT, 0, 1, 0.0, 0.25},
};

static void test_reference_matches_finite_differences(void) {
    rng r = {harness_seed() ^ 0xbac4u};
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    for (size_t i = 0; i < sizeof FD_CASES / sizeof FD_CASES[0]; i++) {
        const bw_case *c = &FD_CASES[i];
        bw_data d;
        /* contiguous: a zero-stride input would alias the element perturbed */
        bw_make(&d, c, ATTN_DTYPE_F64, LAYOUT_CONTIGUOUS, &r);
        CHECK_OK(bw_run(&d));
        check_fd(&d, c, &d.q, &d.dq, "dq");
        check_fd(&d, c, &d.k, &d.dk, "dk");
        check_fd(&d, c, &d.v, &d.dv, "dv");
        if (d.dmask.storage != NULL) check_fd(&d, c, &d.mask, &d.dmask, "dmask");
        bw_free(&d);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- fused paths against the reference ---- */

static const attn_isa FUSED[] = {ATTN_ISA_GENERIC, ATTN_ISA_AVX2, ATTN_ISA_AVX512,
                                 ATTN_ISA_AVX512_BF16, ATTN_ISA_AMX};

/* A random case of moderate size (one block and a few). */
static bw_case random_case(rng *r) {
    bw_case c;
    memset(&c, 0, sizeof c);
    const int64_t B = rng_int(r, 1, 2), H = rng_int(r, 1, 3), G = rng_int(r, 1, 2);
    const int64_t L = rng_int(r, 1, 70), S = rng_int(r, 1, 150), E = rng_int(r, 1, 40),
                  Ev = rng_int(r, 1, 40);
    c.gqa = G > 1;
    c.rank = 4;
    const int64_t q[4] = {B, H * G, L, E}, k[4] = {B, H, S, E}, v[4] = {B, H, S, Ev};
    memcpy(c.q, q, sizeof q);
    memcpy(c.k, k, sizeof k);
    memcpy(c.v, v, sizeof v);
    c.causal = (attn_causal)rng_int(r, 0, 2);
    const long m = rng_int(r, 0, 3);
    if (m > 0) {
        c.mask_dtype = m == 1 ? ATTN_DTYPE_BOOL : m == 2 ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64;
        c.mask_rank = 4;
        const int64_t ms[4] = {rng_int(r, 0, 1) ? B : 1, rng_int(r, 0, 1) ? H * G : 1,
                               rng_int(r, 0, 1) ? L : 1, S};
        memcpy(c.m, ms, sizeof ms);
    }
    c.has_scale = rng_int(r, 0, 3) == 0;
    c.scale = rng_normal(r);
    c.dropout_p = rng_int(r, 0, 3) == 0 ? 0.2 : 0;
    return c;
}

static void check_against_reference(bw_data *d, const bw_case *c, attn_dtype dtype, rng *r,
                                    const char *isa) {
    bw_data ref = *d; /* the same inputs; gradients of its own */
    tt_make_output(&ref.dq, r, dtype, c->rank, c->q, LAYOUT_CONTIGUOUS);
    tt_make_output(&ref.dk, r, dtype, c->rank, c->k, LAYOUT_CONTIGUOUS);
    tt_make_output(&ref.dv, r, dtype, c->rank, c->v, LAYOUT_CONTIGUOUS);
    if (d->dmask.storage)
        tt_make_output(&ref.dmask, r, c->mask_dtype, c->mask_rank, c->m, LAYOUT_CONTIGUOUS);
    const attn_isa isa_now = attn_get_isa();
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    CHECK_OK(bw_run(&ref));
    CHECK_OK(attn_set_isa(isa_now));
    /* float64: the fused sums differ from the reference's in order only;
     * float32: rounding of scores and sums, growing like sqrt of the
     * lengths summed over (E, S, L). Relative to max(|grad|, 1): inputs are
     * N(0, 1), so the terms a gradient sums are of order 1, and a gradient
     * that cancels to 0 (random layouts broadcast V along S: dP = D) still
     * carries their rounding. */
    const double n = (double)(c->q[2] + c->k[2] + c->q[3]);
    const double tol = dtype == ATTN_DTYPE_F64 ? 1e-12 : 16 * FLT_EPSILON * sqrt(n);
    const test_tensor *got[4] = {&d->dq, &d->dk, &d->dv, &d->dmask},
                      *want[4] = {&ref.dq, &ref.dk, &ref.dv, &ref.dmask};
    const char *names[4] = {"dq", "dk", "dv", "dmask"};
    for (int g = 0; g < 4; g++) {
        if (got[g]->storage == NULL) continue;
        double diff, mag;
        tt_compare(&got[g]->t, &want[g]->t, &diff, &mag);
        CHECK(diff <= tol * (mag > 1 ? mag : 1),
              "%s %s %s: |fused - reference| = %.3g, max |grad| %.3g (L %lld S %lld E %lld mask %d causal %d scale %d %g drop %g gqa %d)",
              isa, attn_dtype_name(dtype), names[g], diff, mag, (long long)c->q[2],
              (long long)c->k[2], (long long)c->q[3], (int)c->mask_dtype, (int)c->causal,
              c->has_scale, c->scale, c->dropout_p, c->gqa);
        tt_free((test_tensor *)want[g]);
    }
}

static void test_fused_matches_reference(void) {
    rng r = {harness_seed() ^ 0xf00du};
    for (size_t i = 0; i < sizeof FUSED / sizeof FUSED[0]; i++) {
        if (!attn_isa_supported(FUSED[i])) continue;
        CHECK_OK(attn_set_isa(FUSED[i]));
        for (int n = 0; n < 40; n++) {
            const bw_case c = random_case(&r);
            const attn_dtype dtype = n % 2 ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64;
            bw_data d;
            bw_make(&d, &c, dtype, LAYOUT_RANDOM, &r);
            CHECK_OK(bw_run(&d));
            check_against_reference(&d, &c, dtype, &r, attn_isa_name(FUSED[i]));
            bw_free(&d);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- bits for any thread count ---- */

static const bw_case THREAD_CASES[] = {
    /* many heads: one task per head */
    {4, {2, 4, 100, 32}, {2, 4, 90, 32}, {2, 4, 90, 16}, 0, {0}, 0, 0, 0, 0, 0, 0},
    /* one head, many keys: dq partial sums over key chunks */
    {4, {1, 1, 70, 16}, {1, 1, 1500, 16}, {1, 1, 1500, 16}, 2, {70, 1500}, ATTN_DTYPE_F32,
     ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0.1},
    /* K/V broadcast over the batch: dk, dv folded; GQA */
    {4, {3, 4, 40, 8}, {1, 2, 300, 8}, {1, 2, 300, 8}, 0, {0}, 0, 0, 1, 0, 0, 0},
    /* q broadcast over the batch: dq folded */
    {4, {1, 2, 30, 8}, {3, 2, 200, 8}, {3, 2, 200, 8}, 4, {3, 1, 1, 200}, ATTN_DTYPE_F32,
     ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0},
};

static void test_bits_for_any_thread_count(void) {
    rng r = {harness_seed() ^ 0x7a11u};
    for (size_t i = 0; i < sizeof FUSED / sizeof FUSED[0]; i++) {
        if (!attn_isa_supported(FUSED[i])) continue;
        CHECK_OK(attn_set_isa(FUSED[i]));
        for (size_t n = 0; n < sizeof THREAD_CASES / sizeof THREAD_CASES[0]; n++) {
            const bw_case *c = &THREAD_CASES[n];
            bw_data d, base;
            bw_make(&d, c, ATTN_DTYPE_F32, LAYOUT_CONTIGUOUS, &r);
            base = d;
            tt_make_output(&base.dq, &r, ATTN_DTYPE_F32, c->rank, c->q, LAYOUT_CONTIGUOUS);
            tt_make_output(&base.dk, &r, ATTN_DTYPE_F32, c->rank, c->k, LAYOUT_CONTIGUOUS);
            tt_make_output(&base.dv, &r, ATTN_DTYPE_F32, c->rank, c->v, LAYOUT_CONTIGUOUS);
            if (d.dmask.storage)
                tt_make_output(&base.dmask, &r, c->mask_dtype, c->mask_rank, c->m,
                               LAYOUT_CONTIGUOUS);
            attn_set_num_threads(1);
            CHECK_OK(bw_run(&base));
            for (int t = 2; t <= 4; t++) {
                attn_set_num_threads(t);
                CHECK_OK(bw_run(&d));
                CHECK(tt_same_bits(&d.dq.t, &base.dq.t) && tt_same_bits(&d.dk.t, &base.dk.t) &&
                          tt_same_bits(&d.dv.t, &base.dv.t) &&
                          (!d.dmask.storage || tt_same_bits(&d.dmask.t, &base.dmask.t)),
                      "%s case %zu: gradients differ between 1 and %d threads",
                      attn_isa_name(FUSED[i]), n, t);
            }
            tt_free(&base.dq);
            tt_free(&base.dk);
            tt_free(&base.dv);
            if (base.dmask.storage) tt_free(&base.dmask);
            bw_free(&d);
        }
    }
    attn_set_num_threads(0);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- NaN/Inf rules ---- */

/* A NaN key and an Inf value that a mask hides, and a row that sees no key:
 * every path gives finite gradients, zero for the hidden key and for the
 * empty row's dq, and the reference's everywhere else. */
static void test_hidden_nan_and_empty_rows(void) {
    rng r = {harness_seed() ^ 0x4a4u};
    const bw_case c = {4, {1, 2, 6, 4}, {1, 2, 7, 4}, {1, 2, 7, 3}, 2, {6, 7}, ATTN_DTYPE_BOOL,
                       ATTN_CAUSAL_NONE, 0, 0, 0, 0};
    for (int isa = ATTN_ISA_REF; isa <= ATTN_ISA_LAST; isa++) {
        if (!attn_isa_supported((attn_isa)isa)) continue;
        CHECK_OK(attn_set_isa((attn_isa)isa));
        bw_data d;
        bw_make(&d, &c, ATTN_DTYPE_F32, LAYOUT_CONTIGUOUS, &r);
        for (int64_t i = 0; i < 6; i++) /* key 3 hidden from every row, row 2 sees nothing */
            for (int64_t j = 0; j < 7; j++)
                tt_set(&d.mask.t, (int64_t[]){i, j}, j != 3 && i != 2);
        CHECK_OK(attn_set_isa(ATTN_ISA_REF)); /* the forward again, with the new mask */
        CHECK_OK(attn_sdpa(&d.q.t, &d.k.t, &d.v.t, &d.params, &d.out.t, NULL, &d.lse.t));
        CHECK_OK(attn_set_isa((attn_isa)isa));
        for (int64_t h = 0; h < 2; h++) {
            tt_set(&d.k.t, (int64_t[]){0, h, 3, 1}, NAN);
            tt_set(&d.v.t, (int64_t[]){0, h, 3, 2}, INFINITY);
        }
        CHECK_OK(bw_run(&d));
        const test_tensor *g[3] = {&d.dq, &d.dk, &d.dv};
        for (int x = 0; x < 3; x++) {
            double *v = tt_dense(&g[x]->t);
            const int64_t n = attn_tensor_numel(&g[x]->t);
            bool finite = true;
            for (int64_t e = 0; e < n; e++) finite &= isfinite(v[e]) != 0;
            CHECK(finite, "%s: gradient %d is not finite", attn_isa_name((attn_isa)isa), x);
            free(v);
        }
        for (int64_t h = 0; h < 2; h++)
            for (int64_t e = 0; e < 4; e++) {
                CHECK(tt_get(&d.dk.t, (int64_t[]){0, h, 3, e}) == 0, "hidden key: dk != 0");
                CHECK(tt_get(&d.dq.t, (int64_t[]){0, h, 2, e}) == 0, "empty row: dq != 0");
                if (e < 3)
                    CHECK(tt_get(&d.dv.t, (int64_t[]){0, h, 3, e}) == 0, "hidden key: dv != 0");
            }
        /* and every other gradient is the reference's, which skips the
         * hidden terms (P = 0) rather than multiplying them */
        if (isa != ATTN_ISA_REF)
            check_against_reference(&d, &c, ATTN_DTYPE_F32, &r, attn_isa_name((attn_isa)isa));
        bw_free(&d);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* lse_for_backward: the same out, bit for bit, and an lse within rounding
 * of float32 scores of the exact one. (That its gradients are closer to
 * the float64 ones is what the Python suite measures against torch.) */
static void test_lse_for_backward(void) {
    rng r = {harness_seed() ^ 0x15eu};
    const bw_case c = {4, {1, 4, 200, 64}, {1, 4, 300, 64}, {1, 4, 300, 64}, 0, {0}, 0,
                       ATTN_CAUSAL_NONE, 0, 0, 0, 0};
    for (size_t i = 0; i < sizeof FUSED / sizeof FUSED[0]; i++) {
        if (!attn_isa_supported(FUSED[i])) continue;
        CHECK_OK(attn_set_isa(FUSED[i]));
        bw_data d;
        bw_make(&d, &c, ATTN_DTYPE_F32, LAYOUT_CONTIGUOUS, &r);
        test_tensor out2, lse2;
        tt_make_output(&out2, &r, ATTN_DTYPE_F32, d.out_rank, d.out_shape, LAYOUT_CONTIGUOUS);
        tt_make_output(&lse2, &r, ATTN_DTYPE_F32, d.out_rank - 1, d.out_shape, LAYOUT_CONTIGUOUS);
        CHECK_OK(attn_sdpa(&d.q.t, &d.k.t, &d.v.t, &d.params, &d.out.t, NULL, &d.lse.t));
        d.params.lse_for_backward = 1;
        CHECK_OK(attn_sdpa(&d.q.t, &d.k.t, &d.v.t, &d.params, &out2.t, NULL, &lse2.t));
        CHECK(tt_same_bits(&d.out.t, &out2.t), "%s: lse_for_backward changed out",
              attn_isa_name(FUSED[i]));
        double diff, mag;
        tt_compare(&lse2.t, &d.lse.t, &diff, &mag);
        CHECK(diff <= 64 * FLT_EPSILON * (mag > 1 ? mag : 1), "%s: lse moved by %.3g",
              attn_isa_name(FUSED[i]), diff);
        /* A float64 lse for the float32 call: the same value, unrounded
         * (float32's is its rounding), and the backward takes it. */
        test_tensor lse64;
        tt_make_output(&lse64, &r, ATTN_DTYPE_F64, d.out_rank - 1, d.out_shape, LAYOUT_CONTIGUOUS);
        CHECK_OK(attn_sdpa(&d.q.t, &d.k.t, &d.v.t, &d.params, &out2.t, NULL, &lse64.t));
        double *wide = tt_dense(&lse64.t), *narrow = tt_dense(&lse2.t);
        int64_t rows = 1;
        for (int dim = 0; dim < d.out_rank - 1; dim++) rows *= d.out_shape[dim];
        bool rounds = true;
        for (int64_t x = 0; x < rows; x++) rounds = rounds && (double)(float)wide[x] == narrow[x];
        free(wide);
        free(narrow);
        CHECK(rounds, "%s: the float64 lse does not round to the float32 one",
              attn_isa_name(FUSED[i]));
        CHECK_OK(attn_sdpa_backward(&d.dout.t, &d.q.t, &d.k.t, &d.v.t, &out2.t, &lse64.t,
                                    &d.params, &d.dq.t, &d.dk.t, &d.dv.t, NULL));
        const test_tensor out1 = d.out, lse1 = d.lse; /* its gradients against the reference's */
        d.out = out2, d.lse = lse64;
        check_against_reference(&d, &c, ATTN_DTYPE_F32, &r, attn_isa_name(FUSED[i]));
        d.out = out1, d.lse = lse1;
        tt_free(&lse64);
        tt_free(&out2);
        tt_free(&lse2);
        bw_free(&d);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- arguments ---- */

#define CHECK_ARG(call, status, arg)                                                       \
    do {                                                                                   \
        CHECK_STATUS(call, status);                                                        \
        CHECK(strcmp(attn_last_error_arg(), arg) == 0, "%s: arg is '%s', expected '%s'", \
              #call, attn_last_error_arg(), arg);                                          \
    } while (0)

static void test_arguments(void) {
    rng r = {harness_seed() ^ 0xa2u};
    const bw_case c = {4, {1, 2, 5, 4}, {1, 2, 6, 4}, {1, 2, 6, 3}, 2, {5, 6}, ATTN_DTYPE_F32,
                       ATTN_CAUSAL_NONE, 0, 0, 0, 0};
    bw_data d;
    bw_make(&d, &c, ATTN_DTYPE_F32, LAYOUT_CONTIGUOUS, &r);
    attn_tensor *dq = &d.dq.t, *dk = &d.dk.t, *dv = &d.dv.t, *dm = &d.dmask.t;
    const attn_tensor *q = &d.q.t, *k = &d.k.t, *v = &d.v.t, *o = &d.out.t, *l = &d.lse.t,
                      *g = &d.dout.t;
    const attn_sdpa_params *p = &d.params;
    CHECK_OK(attn_sdpa_backward(g, q, k, v, o, l, p, dq, dk, dv, dm));
    CHECK_OK(attn_sdpa_backward(g, q, k, v, o, l, p, NULL, NULL, dv, NULL)); /* only dv */
    CHECK_ARG(attn_sdpa_backward(NULL, q, k, v, o, l, p, dq, dk, dv, dm), ATTN_ERR_NULL, "dout");
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, NULL, l, p, dq, dk, dv, dm), ATTN_ERR_NULL, "out");
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, NULL, p, dq, dk, dv, dm), ATTN_ERR_NULL, "lse");
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, p, dk, dk, dv, NULL), ATTN_ERR_SHAPE, "dq");
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, p, dq, dq, dv, NULL), ATTN_ERR_SHAPE, "dk");
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, p, dq, dk, dk, NULL), ATTN_ERR_SHAPE, "dv");
    attn_tensor alias = *dv; /* dv over dq's memory */
    alias.data = dq->data;
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, p, dq, NULL, &alias, NULL), ATTN_ERR_OVERLAP,
              "dv");
    attn_tensor in_q = *dq; /* dq over q itself */
    in_q.data = d.q.t.data;
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, p, &in_q, dk, dv, NULL), ATTN_ERR_OVERLAP,
              "dq");
    attn_tensor wrong = *g; /* dout of the wrong shape */
    wrong.shape[2] = 4;
    CHECK_ARG(attn_sdpa_backward(&wrong, q, k, v, o, l, p, dq, dk, dv, dm), ATTN_ERR_SHAPE,
              "dout");
    attn_tensor f64 = *dq; /* a gradient of another dtype */
    f64.dtype = ATTN_DTYPE_F64;
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, p, &f64, dk, dv, dm), ATTN_ERR_DTYPE, "dq");
    attn_sdpa_params none = *p; /* dmask without a float mask */
    none.attn_mask = NULL;
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, &none, dq, dk, dv, dm), ATTN_ERR_INVALID,
              "dmask");
    attn_sdpa_params bad = *p;
    bad.dropout_p = 2;
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, &bad, dq, dk, dv, dm), ATTN_ERR_INVALID,
              "params.dropout_p");
    bad = *p;
    bad.struct_size = 0;
    CHECK_ARG(attn_sdpa_backward(g, q, k, v, o, l, &bad, dq, dk, dv, dm), ATTN_ERR_INVALID,
              "params.struct_size");
    bw_free(&d);
}

/* ---- the reference's two ways of reading K ---- */

/* The reference backward reads float32 K rows of unit column stride
 * directly and any other K element by element: the same multiply-adds in
 * the same order, so the gradients of K contiguous and of the same values
 * two floats apart are the same bits (tiny problems run this backward). */
static void test_reference_k_reads_alike(void) {
    rng r = {harness_seed() ^ 0x4eadu};
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    for (int trial = 0; trial < 40; trial++) {
        const bw_case c = random_case(&r);
        bw_data d;
        bw_make(&d, &c, ATTN_DTYPE_F32, LAYOUT_CONTIGUOUS, &r);
        CHECK_OK(bw_run(&d));
        const int64_t n = attn_tensor_numel(&d.k.t), nq = attn_tensor_numel(&d.q.t);
        float *wide = malloc(sizeof(float) * (size_t)(2 * n));
        float *dq = malloc(sizeof(float) * (size_t)nq);
        CHECK(wide != NULL && dq != NULL, "out of memory");
        for (int64_t x = 0; x < n; x++) wide[2 * x] = ((const float *)d.k.t.data)[x];
        memcpy(dq, d.dq.t.data, sizeof(float) * (size_t)nq);
        attn_tensor k = d.k.t;
        k.data = wide;
        for (int a = 0; a < k.rank; a++) k.strides[a] *= 2;
        CHECK_OK(attn_sdpa_backward(&d.dout.t, &d.q.t, &k, &d.v.t, &d.out.t, &d.lse.t, &d.params,
                                    &d.dq.t, NULL, NULL, NULL));
        CHECK(memcmp(dq, d.dq.t.data, sizeof(float) * (size_t)nq) == 0,
              "trial %d: dq with K two floats apart differs from K contiguous", trial);
        free(wide);
        free(dq);
        bw_free(&d);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

HARNESS_MAIN(T(test_reference_matches_finite_differences), T(test_reference_k_reads_alike),
             T(test_fused_matches_reference),
             T(test_bits_for_any_thread_count), T(test_hidden_nan_and_empty_rows),
             T(test_lse_for_backward), T(test_arguments))
