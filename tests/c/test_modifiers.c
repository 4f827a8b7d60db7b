/*
 * test_modifiers.c — the score modifiers of attn_sdpa_params (sliding
 * window, ALiBi, softcap, sinks), alone and combined with causality, masks,
 * GQA and dropout, on every kernel path this machine has:
 *   - forward results against the independent oracle (testutil.c);
 *   - the window and causality skip whole key blocks (counted);
 *   - the backward on every fused path against the float64 reference
 *     backward, and that against central differences of the oracle;
 *   - the sinks' gradient against central differences;
 *   - sinks counted once when a decode's keys are split into chunks.
 */
#include "kernels/exp2.h"
#include "sdpa/flash.h"
#include "testutil.h"

/* The forward error model of test_sdpa.c, with the modifiers' terms: the
 * soft-cap's tanh errs by about u·softcap and ALiBi's bias by u·|bias|,
 * absolute, in every logit (see test_sdpa.c for the rest). p_u: the
 * relative error of each weight before P·V (bfloat16 products round P
 * to bfloat16, up to 2^-8, after exp2.h's bfloat16 fit, which l shares),
 * which moves out by at most p_u·sum_j P_j|V_j| / l <= p_u·vmax. */
typedef struct model {
    double u, out_u, p_u, A, E, S, vmax, extra;
} model;

static double tol_out(const model *m) {
    const double rel = 4 * m->u * ((m->E + 4) * m->A + m->S + 16 + 4 * m->extra);
    return rel * m->vmax + 2 * m->out_u * m->vmax + m->p_u * m->vmax;
}

static double max_abs(const double *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(x[i]) && fabs(x[i]) > m) m = fabs(x[i]);
    return m;
}

/* ---- a random case ---- */

typedef struct mod_case {
    oracle_modifiers mods;
    attn_dtype dtype;    /* q, out and a float mask           */
    attn_dtype kv_dtype; /* k and v: dtype, or 16-bit under a float32 q */
    int64_t B, H, Hkv, L, S, E, Ev;
    test_tensor q, k, v, mask, out, lse;
    bool has_mask;
    attn_tensor slopes_t, sinks_t;
    double slopes[2 * 8], sinks[8];   /* (B, H) or (H,) values            */
    double slope_of[2 * 8], sink_of[2 * 8]; /* per batch index, for the oracle */
    attn_sdpa_params p;
} mod_case;

static uint64_t rng_below(rng *r, uint64_t n) { return rng_next(r) % n; }
static int64_t pick(rng *r, const int64_t *xs, int n) { return xs[rng_below(r, (uint64_t)n)]; }

/* Case sizes: small prefill, decode (few rows, keys split into chunks),
 * wide (enough work to run on several threads, in blocks that narrow when
 * there are many threads). */
typedef enum { CASE_SMALL, CASE_DECODE, CASE_WIDE } case_size;

/* The dtypes of a case: float32 or float64, or (halves) 16-bit operands:
 * all float16, all bfloat16, or a float32 query over 16-bit K/V. */
static void pick_dtypes(mod_case *c, rng *r, bool halves) {
    if (!halves) {
        c->dtype = c->kv_dtype = rng_below(r, 3) == 0 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
        return;
    }
    const attn_dtype half = rng_below(r, 2) ? ATTN_DTYPE_BF16 : ATTN_DTYPE_F16;
    c->kv_dtype = half;
    c->dtype = rng_below(r, 3) == 0 ? ATTN_DTYPE_F32 : half;
}

static void make_case(mod_case *c, rng *r, case_size size, bool dense, bool halves) {
    memset(c, 0, sizeof *c);
    static const int64_t lens[] = {1, 3, 17, 64, 97, 130, 257};
    /* wide: one K/V head and 100-200 query rows, which 1 thread runs in
     * blocks of 48 rows and 8 threads in blocks of 16 or 32 (lanes_for) */
    static const int64_t wide_rows[] = {100, 150, 200}, wide_keys[] = {300, 700, 1000};
    static const int64_t full_widths[] = {8, 16, 32, 64, 80};
    /* 16-bit: odd widths too (bfloat16 products pair features, ukernel.h) */
    static const int64_t half_widths[] = {7, 16, 33, 64, 80};
    const int64_t *widths = halves ? half_widths : full_widths;
    const bool decode = size == CASE_DECODE;
    pick_dtypes(c, r, halves);
    const bool wide = size == CASE_WIDE;
    c->B = wide ? 1 : 1 + (int64_t)rng_below(r, 2);
    c->Hkv = wide ? 1 : 1 + (int64_t)rng_below(r, 2);
    c->H = c->Hkv * (1 + (int64_t)rng_below(r, 2));
    c->L = decode ? 1 + (int64_t)rng_below(r, 3) : wide ? pick(r, wide_rows, 3) : pick(r, lens, 7);
    c->S = decode ? 2048 + (int64_t)rng_below(r, 2048)
           : wide ? pick(r, wide_keys, 3) : pick(r, lens, 7);
    c->E = pick(r, widths, 5);
    c->Ev = rng_below(r, 4) == 0 ? pick(r, widths, 5) : c->E;
    const int64_t qs[4] = {c->B, c->H, c->L, c->E}, ks[4] = {c->B, c->Hkv, c->S, c->E},
                  vs[4] = {c->B, c->Hkv, c->S, c->Ev}, os[4] = {c->B, c->H, c->L, c->Ev},
                  ls[3] = {c->B, c->H, c->L}, ms[2] = {c->L, c->S};
    const int layout = !dense && rng_below(r, 2) ? LAYOUT_RANDOM : LAYOUT_CONTIGUOUS;
    tt_make(&c->q, r, c->dtype, 4, qs, layout, 1.0 + 2 * rng_uniform(r), 0);
    tt_make(&c->k, r, c->kv_dtype, 4, ks, layout, 1.0, 0);
    tt_make(&c->v, r, c->kv_dtype, 4, vs, layout, 1.0, 0);
    tt_make_output(&c->out, r, c->dtype, 4, os, layout);
    tt_make_output(&c->lse, r, ATTN_DTYPE_F64, 3, ls, LAYOUT_CONTIGUOUS);
    attn_sdpa_params_init(&c->p);
    c->p.enable_gqa = c->H != c->Hkv;
    c->p.causal = (attn_causal)rng_below(r, 3);
    if (rng_below(r, 3) == 0) { /* a float mask */
        tt_make(&c->mask, r, c->dtype, 2, ms, LAYOUT_CONTIGUOUS, 1.0, 0);
        c->has_mask = true;
        c->p.attn_mask = &c->mask.t;
    }
    const int mods = (int)rng_below(r, 16); /* which modifiers: 4 bits */
    if (mods & 1) {
        c->p.window_left = rng_below(r, 3) == 0 ? -1 : (int64_t)rng_below(r, (uint64_t)c->S + 1);
        c->p.window_right = rng_below(r, 3) == 0 ? -1 : (int64_t)rng_below(r, (uint64_t)c->S + 1);
    }
    if (mods & 2) c->p.softcap = rng_below(r, 2) ? 2.0 + 10 * rng_uniform(r) : 30.0;
    const bool per_batch = rng_below(r, 2);
    for (int64_t x = 0; x < c->B * c->H; x++) {
        c->slopes[x] = 0.5 * rng_uniform(r) / (double)(1 + x % c->H);
        c->sinks[x] = 2 * rng_normal(r);
    }
    for (int64_t b = 0; b < c->B * c->H; b++) {
        c->slope_of[b] = c->slopes[per_batch ? b : b % c->H];
        c->sink_of[b] = c->sinks[b % c->H];
    }
    const int64_t bh[2] = {c->B, c->H};
    if (mods & 4) {
        attn_tensor_init(&c->slopes_t, c->slopes, ATTN_DTYPE_F64, per_batch ? 2 : 1,
                         per_batch ? bh : bh + 1);
        c->p.alibi_slopes = &c->slopes_t;
    }
    if (mods & 8) {
        attn_tensor_init(&c->sinks_t, c->sinks, ATTN_DTYPE_F64, 1, bh + 1);
        c->p.sinks = &c->sinks_t;
    }
}

static void free_case(mod_case *c) {
    tt_free(&c->q);
    tt_free(&c->k);
    tt_free(&c->v);
    tt_free(&c->mask);
    tt_free(&c->out);
    tt_free(&c->lse);
}

static oracle_sdpa_args oracle_of(mod_case *c) {
    c->mods = (oracle_modifiers){c->p.window_left, c->p.window_right, c->p.softcap,
                                 c->p.alibi_slopes ? c->slope_of : NULL,
                                 c->p.sinks ? c->sink_of : NULL};
    oracle_sdpa_args a = {&c->q.t, &c->k.t, &c->v.t, c->has_mask ? &c->mask.t : NULL, 1,
                          (int)c->p.causal, 0, 0, c->p.enable_gqa, 0, 0, 0, &c->mods};
    return a;
}

/* Whether the output is 16-bit: then each value is judged by itself
 * (half_bound), the model keeping only the float32 computation's error. */
static bool half_out(const mod_case *c) {
    return c->dtype == ATTN_DTYPE_F16 || c->dtype == ATTN_DTYPE_BF16;
}

static model model_of(const mod_case *c) {
    model m;
    const attn_isa isa = attn_get_isa();
    const bool f32 = c->dtype != ATTN_DTYPE_F64; /* float32 kernels, also for 16-bit */
    m.u = isa == ATTN_ISA_REF || !f32 ? 0x1p-53 : 0x1p-24;
    m.out_u = half_out(c) ? 0 : f32 ? 0x1p-24 : 0x1p-53;
    /* a bfloat16 call on the bfloat16-products path (its prefill blocks) */
    const bool bf16_products = c->dtype == ATTN_DTYPE_BF16 && c->kv_dtype == ATTN_DTYPE_BF16 &&
                               (isa == ATTN_ISA_AVX512_BF16 || isa == ATTN_ISA_AMX);
    m.p_u = bf16_products ? 0x1p-8 + 2 * ATTN__EXP2F_BF16_ERR : 0;
    double *Q = tt_dense(&c->q.t), *K = tt_dense(&c->k.t), *V = tt_dense(&c->v.t);
    double qrow = 0;
    for (int64_t i = 0; i < attn_tensor_numel(&c->q.t); i += c->E) {
        double sum = 0;
        for (int64_t e = 0; e < c->E; e++) sum += fabs(Q[i + e]);
        qrow = fmax(qrow, sum);
    }
    m.E = (double)c->E;
    m.S = (double)c->S;
    m.A = qrow * max_abs(K, attn_tensor_numel(&c->k.t)) / sqrt(m.E);
    m.vmax = max_abs(V, attn_tensor_numel(&c->v.t));
    m.extra = c->p.softcap + (c->p.alibi_slopes ? 0.5 * (double)(c->S + c->L) : 0) +
              (c->p.sinks ? 8 : 0);
    free(Q);
    free(K);
    free(V);
    return m;
}

/* Half a unit in the last place of a float16/bfloat16 at x: each 16-bit
 * output is the exact result rounded once, up to the float32 error `tol`. */
static double half_ulp(double x, attn_dtype dtype) {
    const int bits = dtype == ATTN_DTYPE_BF16 ? 8 : 11; /* significand bits */
    int e;
    frexp(fabs(x), &e); /* |x| in [2^(e-1), 2^e) */
    const double ulp = ldexp(1.0, e - bits);
    return 0.5 * (dtype == ATTN_DTYPE_F16 ? fmax(ulp, 0x1p-24) : ulp);
}

/* The outputs' error in units of their tolerance: max |out - ref| / tol,
 * or for 16-bit outputs max |out - ref| / (half_ulp(ref) + tol). */
static double out_ratio(const mod_case *c, const double *out, const double *ref, int64_t n,
                        double tol) {
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs(out[i] - ref[i]);
        const double bound = half_out(c) ? half_ulp(ref[i], c->dtype) + tol : tol;
        worst = fmax(worst, d / bound);
        if (!(d <= bound) && !isfinite(d)) worst = INFINITY; /* NaN or Inf where ref is finite */
    }
    return worst;
}

/* One case on the current path against its oracle result; returns
 * err/tol. */
static double check_case(mod_case *c, int index, const oracle_sdpa_result *oracle) {
    const oracle_sdpa_result ref = *oracle;
    CHECK_OK(attn_sdpa(&c->q.t, &c->k.t, &c->v.t, &c->p, &c->out.t, NULL, &c->lse.t));
    const model m = model_of(c);
    double *out = tt_dense(&c->out.t), *lse = tt_dense(&c->lse.t);
    const int64_t nout = ref.nbatch * ref.L * ref.Ev;
    const double err = max_abs_diff(out, ref.out, nout), tol = tol_out(&m);
    const double ratio = out_ratio(c, out, ref.out, nout, tol);
    const double lerr = max_abs_diff(lse, ref.lse, ref.nbatch * ref.L);
    const double ltol = tol_out(&m) / fmax(m.vmax, 1e-300) +
                        4 * (m.u + (half_out(c) ? 0x1p-24 : m.out_u)) *
                            max_abs(ref.lse, ref.nbatch * ref.L);
    CHECK(ratio <= 1 && lerr <= ltol,
          "case %d (%s over %s K/V, %s, L %lld S %lld E %lld causal %d window %lld,%lld "
          "softcap %g alibi %d sinks %d mask %d): out error %.3g (%.3g of its bound; float32 "
          "model %.3g), lse error %.3g (tol %.3g)",
          index, attn_dtype_name(c->dtype), attn_dtype_name(c->kv_dtype),
          attn_isa_name(attn_get_isa()), (long long)c->L, (long long)c->S, (long long)c->E,
          (int)c->p.causal, (long long)c->p.window_left, (long long)c->p.window_right,
          c->p.softcap, c->p.alibi_slopes != NULL, c->p.sinks != NULL, c->has_mask, err, ratio,
          tol, lerr, ltol);
    free(out);
    free(lse);
    return fmax(ratio, lerr / ltol);
}

/* The oracle of a case: the float64 formula, which no path changes. */
static oracle_sdpa_result oracle_case(mod_case *c, int index) {
    oracle_sdpa_args a = oracle_of(c);
    oracle_sdpa_result ref;
    CHECK(oracle_sdpa(&a, &ref) == 0, "case %d: the oracle rejects it", index);
    return ref;
}


static int paths(attn_isa *out) {
    int n = 0;
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++)
        if (attn_isa_supported((attn_isa)i)) out[n++] = (attn_isa)i;
    return n;
}

/* Case i on each of the n paths against one oracle result, each path's
 * worst err/tol kept: a case is drawn and its oracle computed once (drawing
 * and the float64 oracle were most of this test's time under the
 * sanitizers when both were redone per path). */
static void check_on_paths(mod_case *c, int i, const attn_isa *isa, int n, double *worst) {
    oracle_sdpa_result ref = oracle_case(c, i);
    for (int pi = 0; pi < n; pi++) {
        CHECK_OK(attn_set_isa(isa[pi]));
        worst[pi] = fmax(worst[pi], check_case(c, i, &ref));
    }
    oracle_free(&ref);
}

static void random_modifiers(void) {
    const int cases = 160, decode_cases = 12;
    attn_isa isa[8];
    const int n = paths(isa);
    double worst[8] = {0};
    rng r = {harness_seed() ^ 0x51ab};
    for (int i = 0; i < cases + decode_cases; i++) {
        mod_case c;
        make_case(&c, &r, i >= cases ? CASE_DECODE : CASE_SMALL, false, false);
        check_on_paths(&c, i, isa, n, worst);
        free_case(&c);
    }
    for (int pi = 0; pi < n; pi++)
        printf("  path %-11s %d cases (%d decode) against the oracle; worst error/tolerance "
               "%.3f\n",
               attn_isa_name(isa[pi]), cases + decode_cases, decode_cases, worst[pi]);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* float16 and bfloat16 (issue 13): every modifier, masks (in the query's
 * dtype), causality, GQA and strided layouts with 16-bit operands, and
 * float32 queries over 16-bit K/V, on every path: each 16-bit output within
 * half an ulp of the exact result of the stored inputs plus the float32
 * model, the lse within the float32 model. */
static void half_dtypes(void) {
    const int cases = 120, decode_cases = 12;
    attn_isa isa[8];
    const int n = paths(isa);
    double worst[8] = {0};
    int kinds[2][2] = {{0, 0}, {0, 0}}; /* [bf16][float32 query] */
    rng r = {harness_seed() ^ 0x16b1};
    for (int i = 0; i < cases + decode_cases; i++) {
        mod_case c;
        make_case(&c, &r, i >= cases ? CASE_DECODE : CASE_SMALL, false, true);
        kinds[c.kv_dtype == ATTN_DTYPE_BF16][c.dtype == ATTN_DTYPE_F32]++;
        check_on_paths(&c, i, isa, n, worst);
        free_case(&c);
    }
    CHECK(kinds[0][0] && kinds[0][1] && kinds[1][0] && kinds[1][1],
          "every dtype combination drawn: %d %d %d %d", kinds[0][0], kinds[0][1], kinds[1][0],
          kinds[1][1]);
    for (int pi = 0; pi < n; pi++)
        printf("  path %-11s %d cases (float16 %d, bfloat16 %d, float32 over 16-bit K/V %d); "
               "worst error/bound %.3f\n",
               attn_isa_name(isa[pi]), cases + decode_cases, kinds[0][0], kinds[1][0],
               kinds[0][1] + kinds[1][1], worst[pi]);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- the thread count sets no bit ---- */

/* Every modifier, masks, causality, GQA and dropout on 1 thread and on more
 * threads than the machine has cores (query blocks narrow there, and the
 * key blocks of a window stay on one grid): the same bits, out and lse. */
static void many_threads_same_bits(void) {
    enum { CASES = 24 };
    attn_isa isa[8];
    const int n = paths(isa);
    const int many = attn_max_threads();
    for (int pi = 0; pi < n; pi++) {
        if (isa[pi] == ATTN_ISA_REF) continue;
        CHECK_OK(attn_set_isa(isa[pi]));
        rng r = {harness_seed() ^ 0x7a11};
        for (int i = 0; i < CASES; i++) {
            mod_case c;
            make_case(&c, &r, i % 6 == 5 ? CASE_DECODE : CASE_WIDE, false, i % 4 == 3);
            if (i % 3 == 0) { /* dropout too */
                c.p.dropout_p = 0.2;
                c.p.seed = 77 + (uint64_t)i;
            }
            const size_t ob = sizeof(double) * (size_t)attn_tensor_numel(&c.out.t);
            const size_t lb = sizeof(double) * (size_t)attn_tensor_numel(&c.lse.t);
            attn_set_num_threads(1);
            CHECK_OK(attn_sdpa(&c.q.t, &c.k.t, &c.v.t, &c.p, &c.out.t, NULL, &c.lse.t));
            double *out1 = tt_dense(&c.out.t), *lse1 = tt_dense(&c.lse.t);
            attn_set_num_threads(many);
            CHECK_OK(attn_sdpa(&c.q.t, &c.k.t, &c.v.t, &c.p, &c.out.t, NULL, &c.lse.t));
            double *out2 = tt_dense(&c.out.t), *lse2 = tt_dense(&c.lse.t);
            CHECK(memcmp(out1, out2, ob) == 0 && memcmp(lse1, lse2, lb) == 0,
                  "case %d on %s (L %lld S %lld window %lld,%lld causal %d dropout %g): %d "
                  "threads differ from 1",
                  i, attn_isa_name(isa[pi]), (long long)c.L, (long long)c.S,
                  (long long)c.p.window_left, (long long)c.p.window_right, (int)c.p.causal,
                  c.p.dropout_p, many);
            free(out1), free(lse1), free(out2), free(lse2);
            free_case(&c);
        }
        printf("  path %-8s %d cases: 1 and %d threads give the same bits\n",
               attn_isa_name(isa[pi]), CASES, many);
    }
    attn_set_num_threads(0);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- block skipping ---- */

/* Key blocks one call computes, forward then backward. */
static void count_blocks(const attn_sdpa_params *p, int64_t L, int64_t S, int64_t *fwd,
                         int64_t *bwd) {
    enum { H = 2, E = 64 };
    const int64_t qs[4] = {1, H, L, E}, ks[4] = {1, H, S, E}, ls[3] = {1, H, L};
    float *q = calloc((size_t)(H * L * E), 4), *k = calloc((size_t)(H * S * E), 4);
    float *v = calloc((size_t)(H * S * E), 4), *o = calloc((size_t)(H * L * E), 4);
    float *g = calloc((size_t)(H * L * E), 4), *dq = calloc((size_t)(H * L * E), 4);
    float *dk = calloc((size_t)(H * S * E), 4), *dv = calloc((size_t)(H * S * E), 4);
    double *lse = calloc((size_t)(H * L), 8);
    attn_tensor tq, tk, tv, to, tg, tdq, tdk, tdv, tl;
    attn_tensor_init(&tq, q, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&tk, k, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&tv, v, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&to, o, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&tg, g, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&tdq, dq, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&tdk, dk, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&tdv, dv, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&tl, lse, ATTN_DTYPE_F64, 3, ls);
    attn__flash_blocks_visited();
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, p, &to, NULL, &tl));
    *fwd = attn__flash_blocks_visited();
    CHECK_OK(attn_sdpa_backward(&tg, &tq, &tk, &tv, &to, &tl, p, &tdq, &tdk, &tdv, NULL));
    *bwd = attn__flash_blocks_visited();
    free(q), free(k), free(v), free(o), free(g), free(dq), free(dk), free(dv), free(lse);
}

/* Long rows to a bound that a lost or doubled key breaks. The error model
 * above grows with S (a worst case: 2-6e-3 of max|v| at S = 2,100-4,500),
 * where dropping one key at a window's, a chunk's or a block's edge moves
 * out by about its weight times |v|, ~1/S (2-5e-4). With N(0, 1) inputs
 * the float32 sums err like sqrt(S) roundings: each path is held to
 * 2·u·sqrt(S)·max|v| (5.5-8e-6 of max|v|) against the float64 oracle, for
 * windows, causality and both together, with key chunks (L = 1) and query
 * blocks (L = 37). Measured on Zen 5: at most 1.4% of that bound; with
 * window_left one larger than the oracle's, every windowed case failed on
 * every path (120 of 120). */
static void long_rows_lose_no_key(void) {
    rng r = {harness_seed() ^ 0x10e6u};
    attn_isa isas[ATTN_ISA_LAST + 1];
    const int npaths = paths(isas);
    const int64_t windows[][2] = {{-1, -1}, {1000, -1}, {2047, 0}, {100, 5}, {-1, 0}, {777, 33}};
    const int64_t lens[][2] = {{1, 2100}, {3, 4500}, {37, 2100}};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
        for (size_t wi = 0; wi < sizeof windows / sizeof windows[0]; wi++)
            for (int causal = 0; causal <= 2; causal += 2) {
                const int64_t L = lens[li][0], S = lens[li][1];
                int64_t qs[4] = {1, 2, L, 32}, ks[4] = {1, 2, S, 32}, vs[4] = {1, 2, S, 8};
                test_tensor q, k, v, o;
                tt_make(&q, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 1, 0);
                tt_make(&k, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
                tt_make(&v, &r, ATTN_DTYPE_F32, 4, vs, LAYOUT_CONTIGUOUS, 1, 0);
                int64_t os[4] = {1, 2, L, 8};
                tt_make_output(&o, &r, ATTN_DTYPE_F32, 4, os, LAYOUT_CONTIGUOUS);
                attn_sdpa_params p;
                attn_sdpa_params_init(&p);
                p.causal = (attn_causal)causal;
                p.window_left = windows[wi][0], p.window_right = windows[wi][1];
                oracle_modifiers mods = {p.window_left, p.window_right, 0, NULL, NULL};
                oracle_sdpa_args a = {&q.t, &k.t, &v.t, NULL, 1, causal, 0, 0, 0, 0, 0, 0, &mods};
                oracle_sdpa_result ref;
                CHECK(oracle_sdpa(&a, &ref) == 0, "the oracle refused the case");
                double *vd = tt_dense(&v.t);
                const int64_t n = 2 * L * 8;
                const double bound = 2 * 0x1p-24 * sqrt((double)S) * max_abs(vd, 2 * S * 8);
                for (int pi = 0; pi < npaths; pi++) {
                    CHECK_OK(attn_set_isa(isas[pi]));
                    CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &p, &o.t, NULL, NULL));
                    double *out = tt_dense(&o.t), err = 0;
                    for (int64_t x = 0; x < n; x++)
                        err = fmax(err, isnan(out[x]) ? INFINITY : fabs(out[x] - ref.out[x]));
                    CHECK(err <= bound, "%s L %lld S %lld window (%lld, %lld) causal %d: "
                          "|out - oracle| %.3g > %.3g", attn_isa_name(isas[pi]), (long long)L,
                          (long long)S, (long long)p.window_left, (long long)p.window_right,
                          causal, err, bound);
                    free(out);
                }
                free(vd);
                oracle_free(&ref);
                tt_free(&q), tt_free(&k), tt_free(&v), tt_free(&o);
            }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* A window of W keys on L = S costs about W/S of the full attention, and
 * causal about half, forward and backward, on every fused path. */
static void window_skips_blocks(void) {
    enum { N = 4096, W = 256 };
    attn_isa isa[8];
    const int n = paths(isa);
    for (int pi = 0; pi < n; pi++) {
        if (isa[pi] == ATTN_ISA_REF) continue;
        CHECK_OK(attn_set_isa(isa[pi]));
        attn_sdpa_params p;
        attn_sdpa_params_init(&p);
        int64_t full_f, full_b, win_f, win_b, causal_f, causal_b;
        count_blocks(&p, N, N, &full_f, &full_b);
        p.window_left = W;
        p.window_right = 0;
        count_blocks(&p, N, N, &win_f, &win_b);
        p.window_left = p.window_right = -1;
        p.causal = ATTN_CAUSAL_TOP_LEFT;
        count_blocks(&p, N, N, &causal_f, &causal_b);
        const double wf = (double)win_f / (double)full_f, wb = (double)win_b / (double)full_b;
        const double cf = (double)causal_f / (double)full_f, cb = (double)causal_b / (double)full_b;
        printf("  path %-8s blocks: full %lld / %lld, window %d: %.3f / %.3f of them, causal "
               "%.3f / %.3f (forward / backward)\n",
               attn_isa_name(isa[pi]), (long long)full_f, (long long)full_b, W, wf, wb, cf, cb);
        /* the window's share is (W + one block of each side) / N */
        CHECK(wf > 0 && wf < 3.0 * W / N && wb > 0 && wb < 3.0 * W / N,
              "%s: a window of %d keys visited %.3f / %.3f of the blocks", attn_isa_name(isa[pi]),
              W, wf, wb);
        CHECK(cf > 0.45 && cf < 0.6 && cb > 0.45 && cb < 0.6,
              "%s: causal visited %.3f / %.3f of the blocks", attn_isa_name(isa[pi]), cf, cb);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- the backward ---- */

/* loss = Σ out·g for a float64 case, by the oracle. */
static double oracle_loss(mod_case *c, const double *g) {
    oracle_sdpa_args a = oracle_of(c);
    oracle_sdpa_result ref;
    oracle_sdpa(&a, &ref);
    double loss = 0;
    for (int64_t x = 0; x < ref.nbatch * ref.L * ref.Ev; x++) loss += ref.out[x] * g[x];
    oracle_free(&ref);
    return loss;
}

/* d loss / d x[idx] by central differences, x a float64 input of c. */
static double numeric_grad(mod_case *c, double *x, const double *g) {
    const double h = 1e-5, x0 = *x;
    *x = x0 + h;
    const double up = oracle_loss(c, g);
    *x = x0 - h;
    const double down = oracle_loss(c, g);
    *x = x0;
    return (up - down) / (2 * h);
}

/* Gradients of a float64 case: q, k, v and sinks by the library (ref or
 * fused) and the central differences of the oracle agree. */
static void backward_case(rng *r, int index, double *worst) {
    mod_case c;
    do {
        make_case(&c, r, CASE_SMALL, true, false); /* no broadcast inputs: one element, one gradient */
        if (c.dtype == ATTN_DTYPE_F64 && c.L * c.S * c.E <= 40000) break;
        free_case(&c);
    } while (1);
    c.p.lse_for_backward = 1;
    const int64_t no = c.B * c.H * c.L * c.Ev;
    double *g = malloc(sizeof(double) * (size_t)no);
    for (int64_t x = 0; x < no; x++) g[x] = rng_normal(r);
    const int64_t os[4] = {c.B, c.H, c.L, c.Ev};
    attn_tensor tg;
    attn_tensor_init(&tg, g, ATTN_DTYPE_F64, 4, os);
    test_tensor dq, dk, dv;
    tt_make_output(&dq, r, ATTN_DTYPE_F64, 4, c.q.t.shape, LAYOUT_CONTIGUOUS);
    tt_make_output(&dk, r, ATTN_DTYPE_F64, 4, c.k.t.shape, LAYOUT_CONTIGUOUS);
    tt_make_output(&dv, r, ATTN_DTYPE_F64, 4, c.v.t.shape, LAYOUT_CONTIGUOUS);
    double dsinks[8];
    attn_tensor tds;
    attn_tensor_init(&tds, dsinks, ATTN_DTYPE_F64, 1, &c.H);
    CHECK_OK(attn_sdpa(&c.q.t, &c.k.t, &c.v.t, &c.p, &c.out.t, NULL, &c.lse.t));
    CHECK_OK(attn_sdpa_backward(&tg, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t, &c.p, &dq.t,
                                &dk.t, &dv.t, NULL));
    if (c.p.sinks) CHECK_OK(attn_sdpa_sinks_backward(&tg, &c.out.t, &c.lse.t, &c.p, &tds));
    /* a few entries of each gradient, through the inputs' own strides */
    struct { test_tensor *in, *grad; } pairs[3] = {{&c.q, &dq}, {&c.k, &dk}, {&c.v, &dv}};
    for (int w = 0; w < 3; w++) {
        const attn_tensor *t = &pairs[w].in->t;
        for (int probe = 0; probe < 3; probe++) {
            int64_t idx[4];
            for (int d = 0; d < 4; d++) idx[d] = (int64_t)rng_below(r, (uint64_t)t->shape[d]);
            int64_t off = 0;
            for (int d = 0; d < 4; d++) off += idx[d] * t->strides[d];
            const double num = numeric_grad(&c, (double *)t->data + off, g);
            const double got = tt_get(&pairs[w].grad->t, idx);
            const double tol = 1e-6 * (1 + fabs(num));
            *worst = fmax(*worst, fabs(got - num) / tol);
            CHECK(fabs(got - num) <= tol,
                  "backward case %d (%s, softcap %g window %lld,%lld alibi %d sinks %d causal %d): "
                  "d%c %.10g, numerically %.10g",
                  index, attn_isa_name(attn_get_isa()), c.p.softcap, (long long)c.p.window_left,
                  (long long)c.p.window_right, c.p.alibi_slopes != NULL, c.p.sinks != NULL,
                  (int)c.p.causal, "qkv"[w], got, num);
        }
    }
    for (int64_t h = 0; c.p.sinks && h < c.H; h++) {
        /* the oracle reads sink_of: every batch index of head h moves */
        const double x0 = c.sinks[h], step = 1e-5;
        double up, down;
        for (int64_t b = h; b < c.B * c.H; b += c.H) c.sink_of[b] = x0 + step;
        up = oracle_loss(&c, g);
        for (int64_t b = h; b < c.B * c.H; b += c.H) c.sink_of[b] = x0 - step;
        down = oracle_loss(&c, g);
        for (int64_t b = h; b < c.B * c.H; b += c.H) c.sink_of[b] = x0;
        const double want = (up - down) / (2 * step), tol = 1e-6 * (1 + fabs(want));
        *worst = fmax(*worst, fabs(dsinks[h] - want) / tol);
        CHECK(fabs(dsinks[h] - want) <= tol, "backward case %d: dsinks[%lld] %.10g, numerically %.10g",
              index, (long long)h, dsinks[h], want);
    }
    tt_free(&dq);
    tt_free(&dk);
    tt_free(&dv);
    free(g);
    free_case(&c);
}

static void backward_modifiers(void) {
    attn_isa isa[8];
    const int n = paths(isa);
    for (int pi = 0; pi < n; pi++) {
        CHECK_OK(attn_set_isa(isa[pi]));
        rng r = {harness_seed() ^ 0xbac4};
        double worst = 0;
        const int cases = 24;
        for (int i = 0; i < cases; i++) backward_case(&r, i, &worst);
        printf("  path %-8s %d float64 backward cases against central differences; worst "
               "error/tolerance %.3f\n",
               attn_isa_name(isa[pi]), cases, worst);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Float32 fused gradients stay within a float32 error of the float64
 * reference backward's, with every modifier on (a shape the fused backward
 * takes: more than its tiny-problem limit). */
static void backward_fused_f32(void) {
    enum { B = 1, H = 2, L = 200, S = 300, E = 64 };
    attn_isa isa[8];
    const int n = paths(isa);
    rng r = {harness_seed() ^ 0xf32};
    const int64_t qs[4] = {B, H, L, E}, ks[4] = {B, H, S, E}, ls[3] = {B, H, L}, hs[1] = {H};
    test_tensor q, k, v, out, g;
    tt_make(&q, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 2.0, 0);
    tt_make(&k, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_RANDOM, 1.0, 0);
    tt_make(&v, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1.0, 0);
    tt_make(&g, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 1.0, 0);
    tt_make_output(&out, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS);
    double slopes[H] = {0.25, 0.0625}, sinks[H] = {0.5, -1.0}, lse[B * H * L];
    attn_tensor ts, tk2, tl;
    attn_tensor_init(&ts, slopes, ATTN_DTYPE_F64, 1, hs);
    attn_tensor_init(&tk2, sinks, ATTN_DTYPE_F64, 1, hs);
    attn_tensor_init(&tl, lse, ATTN_DTYPE_F64, 3, ls);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    p.window_left = 70;
    p.softcap = 4.0;
    p.alibi_slopes = &ts;
    p.sinks = &tk2;
    p.lse_for_backward = 1;
    float *want[3] = {NULL, NULL, NULL};
    const int64_t sizes[3] = {B * H * L * E, B * H * S * E, B * H * S * E};
    for (int pi = 0; pi < n; pi++) {
        CHECK_OK(attn_set_isa(isa[pi]));
        float *got[3];
        attn_tensor t[3];
        for (int w = 0; w < 3; w++) {
            got[w] = calloc((size_t)sizes[w], 4);
            attn_tensor_init(&t[w], got[w], ATTN_DTYPE_F32, 4, w == 0 ? qs : ks);
        }
        CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &p, &out.t, NULL, &tl));
        CHECK_OK(attn_sdpa_backward(&g.t, &q.t, &k.t, &v.t, &out.t, &tl, &p, &t[0], &t[1], &t[2],
                                    NULL));
        if (isa[pi] == ATTN_ISA_REF) {
            for (int w = 0; w < 3; w++) want[w] = got[w];
            continue;
        }
        for (int w = 0; w < 3; w++) {
            double err = 0, mag = 0;
            for (int64_t x = 0; x < sizes[w]; x++) {
                err = fmax(err, fabs((double)got[w][x] - (double)want[w][x]));
                mag = fmax(mag, fabs((double)want[w][x]));
            }
            /* float32 scores of |x| <= ~8 and sums over S = 300 keys */
            const double tol = 0x1p-24 * 2000 * fmax(mag, 1);
            CHECK(err <= tol, "%s: float32 d%c differs from the reference's by %.3g (tol %.3g)",
                  attn_isa_name(isa[pi]), "qkv"[w], err, tol);
            printf("  path %-8s float32 d%c within %.3g of the reference's (|d%c| <= %.3g)\n",
                   attn_isa_name(isa[pi]), "qkv"[w], err, "qkv"[w], mag);
            free(got[w]);
        }
    }
    for (int w = 0; w < 3; w++) free(want[w]);
    tt_free(&q), tt_free(&k), tt_free(&v), tt_free(&g), tt_free(&out);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Random cases large enough for the fused backward (past its tiny-problem
 * limit): every fused path's dq, dk, dv against the float64 reference
 * backward's on the same inputs and lse. */
/* Gradients of a fused path against the reference backward's, both from
 * one forward (the fused path's out and lse). */
static void backward_fused_random(void) {
    attn_isa isa[8];
    const int n = paths(isa), cases = 30;
    rng r = {harness_seed() ^ 0xfb};
    double worst = 0;
    for (int i = 0; i < cases; i++) {
        mod_case c;
        do {
            make_case(&c, &r, CASE_SMALL, false, false);
            if (c.L * c.S * (c.E + c.Ev) > 70000) break;
            free_case(&c);
        } while (1);
        c.p.lse_for_backward = 1;
        const bool f32 = c.dtype == ATTN_DTYPE_F32;
        const attn_isa fused = isa[n - 1 - i % (n - 1)];
        test_tensor g, grads[2][3];
        const int64_t os[4] = {c.B, c.H, c.L, c.Ev};
        tt_make(&g, &r, c.dtype, 4, os, LAYOUT_CONTIGUOUS, 1.0, 0);
        const attn_tensor *ins[3] = {&c.q.t, &c.k.t, &c.v.t};
        CHECK_OK(attn_set_isa(fused));
        CHECK_OK(attn_sdpa(&c.q.t, &c.k.t, &c.v.t, &c.p, &c.out.t, NULL, &c.lse.t));
        for (int which = 0; which < 2; which++) { /* 0: the reference, 1: the fused path */
            CHECK_OK(attn_set_isa(which == 0 ? ATTN_ISA_REF : fused));
            for (int w = 0; w < 3; w++)
                tt_make_output(&grads[which][w], &r, c.dtype, 4, ins[w]->shape, LAYOUT_CONTIGUOUS);
            CHECK_OK(attn_sdpa_backward(&g.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t, &c.p,
                                        &grads[which][0].t, &grads[which][1].t,
                                        &grads[which][2].t, NULL));
        }
        for (int w = 0; w < 3; w++) {
            double *a = tt_dense(&grads[0][w].t), *b = tt_dense(&grads[1][w].t);
            const int64_t cnt = attn_tensor_numel(&grads[0][w].t);
            const double err = max_abs_diff(a, b, cnt), mag = fmax(max_abs(a, cnt), 1);
            /* float32: scores of |x| <~ 10 over S <= 257 keys (seen: 30 u); float64: 1e-9 */
            const double tol = (f32 ? 0x1p-24 * 400 : 1e-9) * mag;
            worst = fmax(worst, err / tol);
            CHECK(err <= tol,
                  "case %d (%s %s L %lld S %lld E %lld causal %d window %lld,%lld softcap %g "
                  "alibi %d sinks %d mask %d): d%c differs from the reference by %.3g (tol %.3g)",
                  i, attn_dtype_name(c.dtype), attn_isa_name(fused), (long long)c.L,
                  (long long)c.S, (long long)c.E, (int)c.p.causal, (long long)c.p.window_left,
                  (long long)c.p.window_right, c.p.softcap, c.p.alibi_slopes != NULL,
                  c.p.sinks != NULL, c.has_mask, "qkv"[w], err, tol);
            free(a);
            free(b);
            tt_free(&grads[0][w]);
            tt_free(&grads[1][w]);
        }
        tt_free(&g);
        free_case(&c);
    }
    printf("  %d random cases, fused backward vs the reference's; worst error/tolerance %.3f\n",
           cases, worst);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* The backward with 16-bit operands (issue 13) on every path: dout and out
 * in the query's dtype, each gradient in its input's. Its computation is
 * the float32 one on the same values (D = dout . out from the float32
 * call's out, which a 16-bit out is computed again into), rounded once at
 * the end: each 16-bit gradient within half an ulp of the float32 call's
 * on float32 copies of q, k, v, dout and the mask, which
 * backward_fused_random holds to the reference; a float32 gradient (the
 * query's, over 16-bit K/V) the same bits. */
static void backward_half_random(void) {
    attn_isa isa[8];
    const int n = paths(isa), cases = 24;
    rng r = {harness_seed() ^ 0x16bd};
    double worst = 0;
    for (int i = 0; i < cases; i++) {
        mod_case c;
        do {
            make_case(&c, &r, CASE_SMALL, false, true);
            if (c.L * c.S * (c.E + c.Ev) > 70000) break;
            free_case(&c);
        } while (1);
        c.p.lse_for_backward = 1;
        const attn_isa path = isa[i % n];
        CHECK_OK(attn_set_isa(path));
        CHECK_OK(attn_sdpa(&c.q.t, &c.k.t, &c.v.t, &c.p, &c.out.t, NULL, &c.lse.t));
        test_tensor g, wide[6], grads[2][3];
        const int64_t os[4] = {c.B, c.H, c.L, c.Ev};
        tt_make(&g, &r, c.dtype, 4, os, LAYOUT_CONTIGUOUS, 1.0, 0);
        const attn_tensor *ins[6] = {&c.q.t, &c.k.t, &c.v.t, &g.t, &c.out.t, &c.mask.t};
        for (int x = 0; x < 6; x++) /* float32 copies: q, k, v, dout, out, mask */
            if (x < 5 || c.has_mask) tt_convert(ins[x], ATTN_DTYPE_F32, &wide[x]);
        attn_sdpa_params wp = c.p;
        if (c.has_mask) wp.attn_mask = &wide[5].t;
        if (c.dtype != ATTN_DTYPE_F32) /* the float32 call's own out, not the rounded one */
            CHECK_OK(attn_sdpa(&wide[0].t, &wide[1].t, &wide[2].t, &wp, &wide[4].t, NULL, NULL));
        for (int w = 0; w < 3; w++) {
            tt_make_output(&grads[0][w], &r, ins[w]->dtype, 4, ins[w]->shape, LAYOUT_CONTIGUOUS);
            tt_make_output(&grads[1][w], &r, ATTN_DTYPE_F32, 4, ins[w]->shape, LAYOUT_CONTIGUOUS);
        }
        CHECK_OK(attn_sdpa_backward(&g.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t, &c.p,
                                    &grads[0][0].t, &grads[0][1].t, &grads[0][2].t, NULL));
        CHECK_OK(attn_sdpa_backward(&wide[3].t, &wide[0].t, &wide[1].t, &wide[2].t, &wide[4].t,
                                    &c.lse.t, &wp, &grads[1][0].t, &grads[1][1].t,
                                    &grads[1][2].t, NULL));
        for (int w = 0; w < 3; w++) {
            double *a = tt_dense(&grads[0][w].t), *b = tt_dense(&grads[1][w].t);
            const attn_dtype gd = ins[w]->dtype;
            const bool half = gd == ATTN_DTYPE_F16 || gd == ATTN_DTYPE_BF16;
            double ratio = 0;
            for (int64_t x = 0; x < attn_tensor_numel(&grads[0][w].t); x++) {
                const double d = fabs(a[x] - b[x]);
                if (half) ratio = fmax(ratio, d / half_ulp(b[x], gd));
                else if (d != 0 || !isfinite(a[x])) ratio = INFINITY;
                if (!isfinite(d)) ratio = INFINITY;
            }
            worst = fmax(worst, ratio);
            CHECK(ratio <= 1,
                  "case %d (%s over %s K/V, %s L %lld S %lld E %lld causal %d window %lld,%lld "
                  "softcap %g alibi %d sinks %d mask %d): d%c is %.3g of its bound from the "
                  "float32 call's",
                  i, attn_dtype_name(c.dtype), attn_dtype_name(c.kv_dtype), attn_isa_name(path),
                  (long long)c.L, (long long)c.S, (long long)c.E, (int)c.p.causal,
                  (long long)c.p.window_left, (long long)c.p.window_right, c.p.softcap,
                  c.p.alibi_slopes != NULL, c.p.sinks != NULL, c.has_mask, "qkv"[w], ratio);
            free(a);
            free(b);
            tt_free(&grads[0][w]);
            tt_free(&grads[1][w]);
        }
        for (int x = 0; x < 6; x++)
            if (x < 5 || c.has_mask) tt_free(&wide[x]);
        tt_free(&g);
        free_case(&c);
    }
    printf("  %d random cases with 16-bit operands on %d paths: gradients within %.3f of half an "
           "ulp of the float32 call's\n",
           cases, n, worst);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- hostile modifier values ---- */

static void hostile_modifiers(void) {
    float q[2 * 4 * 8] = {0}, o[2 * 4 * 8];
    const int64_t qs[3] = {2, 4, 8}, hs[1] = {2}, bad[1] = {3};
    attn_tensor t, out, slopes, wrong;
    attn_tensor_init(&t, q, ATTN_DTYPE_F32, 3, qs);
    attn_tensor_init(&out, o, ATTN_DTYPE_F32, 3, qs);
    float sv[3] = {1, 2, 3};
    attn_tensor_init(&slopes, sv, ATTN_DTYPE_F32, 1, hs);
    attn_tensor_init(&wrong, sv, ATTN_DTYPE_F32, 1, bad);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.window_left = -2;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "params.window_left") == 0, "%s", attn_last_error_arg());
    attn_sdpa_params_init(&p);
    p.window_right = INT64_MIN;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "params.window_right") == 0, "%s", attn_last_error_arg());
    attn_sdpa_params_init(&p);
    p.softcap = -1;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_INVALID);
    p.softcap = NAN;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "params.softcap") == 0, "%s", attn_last_error_arg());
    attn_sdpa_params_init(&p);
    p.alibi_slopes = &wrong;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "params.alibi_slopes") == 0, "%s", attn_last_error_arg());
    attn_sdpa_params_init(&p);
    p.sinks = &wrong;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "params.sinks") == 0, "%s", attn_last_error_arg());
    attn_tensor mask_dtype = slopes;
    mask_dtype.dtype = ATTN_DTYPE_BOOL;
    p.sinks = &mask_dtype;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_DTYPE);
    /* a window that hides every key: out 0, lse -inf; with a sink, lse = sink */
    attn_sdpa_params_init(&p);
    p.window_left = 0;
    p.window_right = 0;
    p.q_offset = 0;
    const int64_t ks[3] = {2, 2, 8};
    attn_tensor k2;
    attn_tensor_init(&k2, q, ATTN_DTYPE_F32, 3, ks); /* S = 2 < L = 4: row 0, 1 see none */
    float lse[8];
    const int64_t ls[2] = {2, 4};
    attn_tensor tl;
    attn_tensor_init(&tl, lse, ATTN_DTYPE_F32, 2, ls);
    p.sinks = &slopes;
    CHECK_OK(attn_sdpa(&t, &k2, &k2, &p, &out, NULL, &tl));
    CHECK(lse[0] == 1.0f && lse[4] == 2.0f && o[0] == 0.0f, "rows that see no key: lse %g %g",
          (double)lse[0], (double)lse[4]);
    /* Hostile test: a sink of +inf gave NaN rows from finite inputs; it is
     * refused by name. -inf is no sink: the same bits as without one. */
    attn_sdpa_params_init(&p);
    sv[1] = INFINITY;
    p.sinks = &slopes;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "params.sinks") == 0 &&
              strstr(attn_last_error(), "+inf (element 1)") != NULL,
          "%s", attn_last_error());
    for (int i = 0; i < 2 * 4 * 8; i++) q[i] = (float)((i * 37) % 11) / 7.0f - 0.6f;
    float plain[2 * 4 * 8];
    attn_tensor tp = out;
    tp.data = plain;
    CHECK_OK(attn_sdpa(&t, &t, &t, NULL, &tp, NULL, NULL));
    sv[0] = sv[1] = -INFINITY;
    CHECK_OK(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL));
    CHECK(memcmp(o, plain, sizeof plain) == 0, "sinks of -inf changed the output");
    /* an infinite ALiBi slope gave NaN (inf times the distance 0) */
    attn_sdpa_params_init(&p);
    p.alibi_slopes = &slopes;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, &p, &out, NULL, NULL), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "params.alibi_slopes") == 0 &&
              strstr(attn_last_error(), "infinite slope (element 0)") != NULL,
          "%s", attn_last_error());
}

/* A sink far above a row's only score: lse is the sink's (0 here), not
 * moved by the float32 rounding of the score -260 (an ulp there is 3e-5);
 * a helper's reproducer, where the fused paths gave 9.5e-6. */
static void sink_dominates_lse(void) {
    attn_isa isa[8];
    const int n = paths(isa);
    float q = 100, k = -2.6f, v = 1, out, lse, sink = 0;
    const int64_t one[3] = {1, 1, 1};
    attn_tensor tq, tk, tv, to, tl, ts;
    attn_tensor_init(&tq, &q, ATTN_DTYPE_F32, 3, one);
    attn_tensor_init(&tk, &k, ATTN_DTYPE_F32, 3, one);
    attn_tensor_init(&tv, &v, ATTN_DTYPE_F32, 3, one);
    attn_tensor_init(&to, &out, ATTN_DTYPE_F32, 3, one);
    attn_tensor_init(&tl, &lse, ATTN_DTYPE_F32, 2, one);
    attn_tensor_init(&ts, &sink, ATTN_DTYPE_F32, 1, one);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.has_scale = 1;
    p.scale = 1;
    p.sinks = &ts;
    for (int pi = 0; pi < n; pi++) {
        CHECK_OK(attn_set_isa(isa[pi]));
        CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, &tl));
        CHECK(lse == 0.0f && fabsf(out) < 1e-30f, "%s: lse %.9g out %.9g; want 0, ~0",
              attn_isa_name(isa[pi]), (double)lse, (double)out);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* attn_sdpa_sinks_backward's arguments: each bad one named, nothing
 * written; an allocation failure is ATTN_ERR_NOMEM with nothing leaked. */
static void sinks_backward_hostile(void) {
    float out[2 * 3 * 4] = {0}, dout[2 * 3 * 4] = {0}, lse[2 * 3] = {0}, sinks[2] = {1, 2};
    float ds[2] = {7, 7}, ds3[3];
    double lse64[2 * 3] = {0};
    const int64_t os[3] = {2, 3, 4}, ls[2] = {2, 3}, hs[1] = {2}, bad[1] = {3}, lbad[2] = {2, 4};
    attn_tensor to, tg, tl, tl64, tlbad, ts, tds, tds3, tgd;
    attn_tensor_init(&to, out, ATTN_DTYPE_F32, 3, os);
    attn_tensor_init(&tg, dout, ATTN_DTYPE_F32, 3, os);
    attn_tensor_init(&tl, lse, ATTN_DTYPE_F32, 2, ls);
    attn_tensor_init(&tl64, lse64, ATTN_DTYPE_F64, 2, ls);
    attn_tensor_init(&tlbad, lse, ATTN_DTYPE_F32, 2, lbad);
    attn_tensor_init(&ts, sinks, ATTN_DTYPE_F32, 1, hs);
    attn_tensor_init(&tds, ds, ATTN_DTYPE_F32, 1, hs);
    attn_tensor_init(&tds3, ds3, ATTN_DTYPE_F32, 1, bad);
    tgd = tg;
    tgd.dtype = ATTN_DTYPE_F64;
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tl, &p, &tds), ATTN_ERR_NULL);
    CHECK(strcmp(attn_last_error_arg(), "params.sinks") == 0, "%s", attn_last_error_arg());
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tl, NULL, &tds), ATTN_ERR_NULL);
    p.sinks = &ts;
    attn_tensor tds64 = tds; /* the shape, not the dtype: ATTN_ERR_DTYPE (was SHAPE) */
    tds64.dtype = ATTN_DTYPE_F64;
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tl, &p, &tds64), ATTN_ERR_DTYPE);
    CHECK(strcmp(attn_last_error_arg(), "dsinks") == 0, "%s", attn_last_error_arg());
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tl, &p, &tds3), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "dsinks") == 0, "%s", attn_last_error_arg());
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tlbad, &p, &tds), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "lse") == 0, "%s", attn_last_error_arg());
    CHECK_STATUS(attn_sdpa_sinks_backward(&tgd, &to, &tl, &p, &tds), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "dout") == 0, "%s", attn_last_error_arg());
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tl, &p, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tl, &p, &ts), ATTN_ERR_OVERLAP);
    CHECK(ds[0] == 7 && ds[1] == 7, "a refused call wrote dsinks");
    test_failer f;
    failer_install(&f, 1, false);
    CHECK_STATUS(attn_sdpa_sinks_backward(&tg, &to, &tl64, &p, &tds), ATTN_ERR_NOMEM);
    attn_set_allocator(NULL);
    CHECK(f.live == 0, "%ld blocks leaked", f.live);
    /* dout = 0: every gradient 0; a float64 lse is accepted */
    CHECK_OK(attn_sdpa_sinks_backward(&tg, &to, &tl64, &p, &tds));
    CHECK(ds[0] == 0 && ds[1] == 0, "dsinks %g %g", (double)ds[0], (double)ds[1]);
}

HARNESS_MAIN(T(sink_dominates_lse), T(sinks_backward_hostile), T(random_modifiers), T(half_dtypes), T(many_threads_same_bits), T(window_skips_blocks), T(long_rows_lose_no_key), T(backward_modifiers),
             T(backward_fused_f32), T(backward_fused_random), T(backward_half_random), T(hostile_modifiers))
