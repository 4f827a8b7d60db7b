/*
 * test_mha.c — attn_mha against a float64 multi-head attention written here
 * from torch.nn.MultiheadAttention's documented behaviour, over random
 * configurations of every option; parameter names, shapes and order; and
 * the initialisation schemes.
 */
#include "core/gemm.h"
#include "kernels/ukernel.h"
#include "testutil.h"

typedef struct mha_case {
    attn_mha_config cfg;
    attn_mha *m;
    bool batched, need_weights, average, causal, training;
    int64_t N, L, S;
    test_tensor query, key, value, kpm, mask, out, weights;
    bool has_kpm, has_mask, self_attention;
    attn_mha_forward_params fp;
} mha_case;

static double *param(attn_mha *m, const char *name) {
    attn_tensor v;
    if (attn_mha_param(m, name, &v) != ATTN_OK) return NULL;
    return tt_dense(&v);
}

/* Index of (n, t, f) in a dense copy of a (T, N, F) / (N, T, F) / (T, F) input. */
static int64_t at(const mha_case *c, int64_t n, int64_t t, int64_t f, int64_t T, int64_t F) {
    if (!c->batched) return t * F + f;
    return c->cfg.batch_first ? (n * T + t) * F + f : (t * c->N + n) * F + f;
}

/* Whether key j < S is visible to row i of head h of batch n (causal, the
 * attention mask, the key-padding mask: bool or -inf hide it), adding the
 * float masks' values to *add. Appended keys (j >= S) are never masked:
 * torch pads the masks with 0 for them. */
static bool key_visible(const mha_case *c, const double *AM, const double *KPM, int64_t H,
                        int64_t n, int64_t h, int64_t i, int64_t j, double *add) {
    const int64_t L = c->L, S = c->S;
    bool vis = !(c->causal && j > i);
    const double mv = AM == NULL ? 0
                      : c->mask.t.rank == 2 ? AM[i * S + j]
                                            : AM[((n * H + h) * L + i) * S + j];
    const double kv = KPM == NULL ? 0 : KPM[n * S + j];
    const attn_dtype mdt[2] = {c->mask.t.dtype, c->kpm.t.dtype};
    const double vals[2] = {mv, kv};
    for (int m = 0; m < 2; m++) {
        if ((m == 0 ? AM : KPM) == NULL) continue;
        if (mdt[m] == ATTN_DTYPE_BOOL) {
            if (vals[m] != 0) vis = false;
        } else if (vals[m] == -INFINITY) {
            vis = false;
        } else {
            *add += vals[m];
        }
    }
    return vis;
}

/* Whether dropout keeps weight number idx of the (N, H, L, S') weights
 * (Philox-4x32-10 of idx/4, word idx % 4). */
static bool dropout_keeps(const mha_case *c, double p, uint64_t idx) {
    uint32_t ctr[4] = {(uint32_t)(idx / 4), (uint32_t)(idx / 4 >> 32),
                       (uint32_t)c->fp.rng_offset, 0};
    uint32_t key[2] = {(uint32_t)c->fp.seed, (uint32_t)(c->fp.seed >> 32)}, r4[4];
    oracle_philox(ctr, key, r4);
    return (double)r4[idx % 4] >= p * 4294967296.0;
}

/* The oracle: returns out (dense, query layout) and weights (dense), and
 * for a 16-bit module (unit roundoff u > 0) a first-order bound on the
 * error of each (bout, bw): Q, K, V, O, the weights and out are each
 * rounded once to the dtype (relative u; the float32 sums add far less).
 * A rounded q and k move a score by at most 2u·a, a = scale·Σ|q||k|, so
 * a weight P by at most 4u·P·amax (amax over the row's visible keys); then
 *   |ΔO_e|   <= u·(|O_e| + (4·amax + 2)·Σ_j P_j·|v_je|)   (V, P·V rounded)
 *   |Δout_f| <= u·|out_f| + Σ_d |Wo_fd|·|ΔO_d|,
 * each rounding adding at most `tiny` more where it lands among the
 * dtype's subnormals (half their spacing: 2^-25 for float16). */
static void oracle_mha(const mha_case *c, double u, double **out_p, double **w_p,
                       double **bout_p, double **bw_p) {
    const double tiny = u == 0x1p-11 ? 0x1p-25 : u * 0x1p-126;
    attn_mha *m = c->m;
    attn_mha_config cfg = {.struct_size = sizeof cfg}; /* how much get_config may write */
    attn_mha_get_config(m, &cfg);
    const int64_t N = c->N, L = c->L, S = c->S, H = cfg.num_heads, hd = cfg.head_dim,
                  D = H * hd, E = cfg.embed_dim;
    const int64_t Sx = S + cfg.add_bias_kv + cfg.add_zero_attn;
    double *Wq, *Wk, *Wv;
    double *in_w = param(m, "in_proj_weight");
    if (in_w) {
        Wq = in_w;
        Wk = in_w + D * E;
        Wv = in_w + 2 * D * E;
    } else {
        Wq = param(m, "q_proj_weight");
        Wk = param(m, "k_proj_weight");
        Wv = param(m, "v_proj_weight");
    }
    double *bin = param(m, "in_proj_bias"), *Wo = param(m, "out_proj.weight"),
           *bo = param(m, "out_proj.bias"), *bk = param(m, "bias_k"), *bv = param(m, "bias_v");
    double *X = tt_dense(&c->query.t), *K = tt_dense(&c->key.t), *V = tt_dense(&c->value.t);
    double *KPM = c->has_kpm ? tt_dense(&c->kpm.t) : NULL,
           *AM = c->has_mask ? tt_dense(&c->mask.t) : NULL;
    double *out = calloc((size_t)(N * L * E), sizeof(double));
    double *wall = calloc((size_t)(N * H * L * Sx), sizeof(double));
    double *Qp = calloc((size_t)(L * D), sizeof(double)), *Kp = calloc((size_t)(Sx * D), sizeof(double)),
           *Vp = calloc((size_t)(Sx * D), sizeof(double)), *O = calloc((size_t)(L * D), sizeof(double)),
           *s = calloc((size_t)Sx, sizeof(double));
    double *bout = calloc((size_t)(N * L * E), sizeof(double)),
           *bw = calloc((size_t)(N * H * L * Sx), sizeof(double)),
           *bO = calloc((size_t)(L * D), sizeof(double)); /* |O| + (4amax+2)·Σ P|v| */
    bool *vis = calloc((size_t)Sx, sizeof(bool));
    const double p = c->training ? cfg.dropout : 0;
    for (int64_t n = 0; n < N; n++) {
        for (int64_t d = 0; d < D; d++) {
            for (int64_t t = 0; t < L; t++) {
                double acc = bin ? bin[d] : 0;
                for (int64_t f = 0; f < E; f++) acc += Wq[d * E + f] * X[at(c, n, t, f, L, E)];
                Qp[t * D + d] = acc;
            }
            for (int64_t t = 0; t < S; t++) {
                double ak = bin ? bin[D + d] : 0, av = bin ? bin[2 * D + d] : 0;
                for (int64_t f = 0; f < cfg.kdim; f++) ak += Wk[d * cfg.kdim + f] * K[at(c, n, t, f, S, cfg.kdim)];
                for (int64_t f = 0; f < cfg.vdim; f++) av += Wv[d * cfg.vdim + f] * V[at(c, n, t, f, S, cfg.vdim)];
                Kp[t * D + d] = ak;
                Vp[t * D + d] = av;
            }
            if (cfg.add_bias_kv) {
                Kp[S * D + d] = bk[d];
                Vp[S * D + d] = bv[d];
            }
            if (cfg.add_zero_attn) Kp[(Sx - 1) * D + d] = Vp[(Sx - 1) * D + d] = 0;
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < L; i++) {
                double mx = -INFINITY, amax = 0;
                for (int64_t j = 0; j < Sx; j++) {
                    double add = 0;
                    vis[j] = j >= S || key_visible(c, AM, KPM, H, n, h, i, j, &add);
                    if (!vis[j]) continue;
                    double dot = 0, a = 0;
                    for (int64_t e = 0; e < hd; e++) {
                        dot += Qp[i * D + h * hd + e] * Kp[j * D + h * hd + e];
                        a += fabs(Qp[i * D + h * hd + e] * Kp[j * D + h * hd + e]);
                    }
                    s[j] = dot / sqrt((double)hd) + add;
                    amax = fmax(amax, a / sqrt((double)hd));
                    if (s[j] > mx) mx = s[j];
                }
                double sum = 0;
                for (int64_t j = 0; j < Sx; j++)
                    if (vis[j] && mx != -INFINITY) sum += exp(s[j] - mx);
                for (int64_t j = 0; j < Sx; j++) {
                    double w = vis[j] && mx != -INFINITY ? exp(s[j] - mx) / sum : 0;
                    if (p > 0)
                        w = dropout_keeps(c, p, (uint64_t)(((n * H + h) * L + i) * Sx + j))
                                ? w / (1 - p)
                                : 0;
                    wall[((n * H + h) * L + i) * Sx + j] = w;
                    bw[((n * H + h) * L + i) * Sx + j] = u * w * (1 + 4 * amax) + tiny;
                }
                for (int64_t e = 0; e < hd; e++) {
                    double acc = 0, abs_pv = 0;
                    for (int64_t j = 0; j < Sx; j++) {
                        double w = wall[((n * H + h) * L + i) * Sx + j];
                        if (w != 0) acc += w * Vp[j * D + h * hd + e];
                        abs_pv += fabs(w * Vp[j * D + h * hd + e]);
                    }
                    O[i * D + h * hd + e] = acc;
                    bO[i * D + h * hd + e] = fabs(acc) + (4 * amax + 2) * abs_pv + (u > 0 ? 4 * tiny / u : 0);
                }
            }
        for (int64_t t = 0; t < L; t++)
            for (int64_t f = 0; f < E; f++) {
                double acc = bo ? bo[f] : 0, b = 0;
                for (int64_t d = 0; d < D; d++) {
                    acc += Wo[f * D + d] * O[t * D + d];
                    b += fabs(Wo[f * D + d]) * bO[t * D + d];
                }
                out[at(c, n, t, f, L, E)] = acc;
                bout[at(c, n, t, f, L, E)] = u * (fabs(acc) + b) + tiny;
            }
    }
    if (c->average) { /* mean over heads */
        double *avg = calloc((size_t)(N * L * Sx), sizeof(double)),
               *bavg = calloc((size_t)(N * L * Sx), sizeof(double));
        for (int64_t n = 0; n < N; n++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t x = 0; x < L * Sx; x++) {
                    avg[n * L * Sx + x] += wall[(n * H + h) * L * Sx + x] / (double)H;
                    bavg[n * L * Sx + x] += bw[(n * H + h) * L * Sx + x] / (double)H;
                }
        for (int64_t x = 0; x < N * L * Sx; x++) bavg[x] += u * avg[x] + tiny; /* the mean rounded */
        free(wall);
        free(bw);
        wall = avg;
        bw = bavg;
    }
    *out_p = out;
    *w_p = wall;
    if (bout_p != NULL) *bout_p = bout; else free(bout);
    if (bw_p != NULL) *bw_p = bw; else free(bw);
    double *all[] = {in_w, bin, Wo, bo, bk, bv, X, K, V, KPM, AM, Qp, Kp, Vp, O, s, bO};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
    if (!in_w) {
        free(Wq);
        free(Wk);
        free(Wv);
    }
    free(vis);
}

static void make_case(mha_case *c, rng *r) {
    memset(c, 0, sizeof *c);
    const int64_t heads[] = {1, 2, 3, 4};
    int64_t H = heads[rng_int(r, 0, 3)];
    int64_t hd = rng_int(r, 1, 5);
    int64_t E = H * hd;
    attn_mha_config_init(&c->cfg, E, H);
    if (rng_int(r, 0, 4) == 0) { /* attn's head_dim extension: D != E */
        c->cfg.embed_dim = E = rng_int(r, 2, 9);
        c->cfg.head_dim = hd;
    }
    static const attn_dtype dtypes[] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_F16,
                                        ATTN_DTYPE_BF16};
    c->cfg.dtype = dtypes[rng_int(r, 0, 3)];
    if (rng_int(r, 0, 2) == 0) c->cfg.kdim = rng_int(r, 1, 9);
    if (rng_int(r, 0, 2) == 0) c->cfg.vdim = rng_int(r, 1, 9);
    c->cfg.bias = rng_int(r, 0, 3) != 0;
    c->cfg.add_bias_kv = rng_int(r, 0, 3) == 0;
    c->cfg.add_zero_attn = rng_int(r, 0, 3) == 0;
    c->cfg.batch_first = rng_int(r, 0, 1);
    c->cfg.dropout = rng_int(r, 0, 3) == 0 ? 0.3 : 0;
    c->cfg.init_seed = rng_next(r);
    CHECK_OK(attn_mha_create(&c->cfg, &c->m));
    attn_mha_get_config(c->m, &c->cfg);
    /* Random parameters, biases included, written through set_param from
     * strided sources. */
    for (int i = 0; i < attn_mha_param_count(c->m); i++) {
        const char *name;
        attn_tensor view;
        CHECK_OK(attn_mha_param_at(c->m, i, &name, &view));
        test_tensor src;
        tt_make(&src, r, rng_int(r, 0, 1) ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64, view.rank, view.shape,
                LAYOUT_RANDOM, 0.5, 0);
        CHECK_OK(attn_mha_set_param(c->m, name, &src.t));
        tt_free(&src);
    }
    c->batched = rng_int(r, 0, 4) != 0;
    c->N = c->batched ? rng_int(r, 1, 3) : 1;
    c->L = rng_int(r, 1, 7);
    c->S = rng_int(r, 0, 2) == 0 ? c->L : rng_int(r, 1, 7);
    const attn_dtype dt = c->cfg.dtype;
    int64_t qs[3], ks[3], vs[3];
    int rank = c->batched ? 3 : 2;
    if (!c->batched) {
        qs[0] = c->L, qs[1] = E;
        ks[0] = c->S, ks[1] = c->cfg.kdim;
        vs[0] = c->S, vs[1] = c->cfg.vdim;
    } else if (c->cfg.batch_first) {
        qs[0] = ks[0] = vs[0] = c->N;
        qs[1] = c->L, ks[1] = vs[1] = c->S;
        qs[2] = E, ks[2] = c->cfg.kdim, vs[2] = c->cfg.vdim;
    } else {
        qs[1] = ks[1] = vs[1] = c->N;
        qs[0] = c->L, ks[0] = vs[0] = c->S;
        qs[2] = E, ks[2] = c->cfg.kdim, vs[2] = c->cfg.vdim;
    }
    int layout = rng_int(r, 0, 1) ? LAYOUT_RANDOM : LAYOUT_CONTIGUOUS;
    tt_make(&c->query, r, dt, rank, qs, layout, 1, 0);
    /* Self-attention (one tensor as query, key and value) whenever the shapes
     * allow it: attn then projects Q, K and V with one GEMM. Key and value
     * are views of the query's storage (their own storage stays NULL). */
    c->self_attention = c->cfg.kdim == E && c->cfg.vdim == E && c->S == c->L;
    if (c->self_attention) {
        c->key.t = c->value.t = c->query.t;
    } else {
        tt_make(&c->key, r, dt, rank, ks, layout, 1, 0);
        tt_make(&c->value, r, dt, rank, vs, layout, 1, 0);
    }
    attn_mha_forward_params_init(&c->fp);
    int kk = (int)rng_int(r, 0, 3);
    if (kk >= 2) {
        int64_t s2[2] = {c->N, c->S}, s1[1] = {c->S};
        tt_make(&c->kpm, r, kk == 2 ? ATTN_DTYPE_BOOL : dt, c->batched ? 2 : 1,
                c->batched ? s2 : s1, layout, 1, 0.3);
        c->has_kpm = true;
        c->fp.key_padding_mask = &c->kpm.t;
    }
    int mk = (int)rng_int(r, 0, 4);
    if (mk >= 2) {
        int64_t H_ = c->cfg.num_heads;
        int64_t s2[2] = {c->L, c->S}, s3[3] = {(c->batched ? c->N : 1) * H_, c->L, c->S};
        bool three = mk == 4 || rng_int(r, 0, 1);
        attn_dtype mdt = rng_int(r, 0, 1) ? ATTN_DTYPE_BOOL : dt;
        tt_make(&c->mask, r, mdt, three ? 3 : 2, three ? s3 : s2, layout, 1, 0.3);
        if (mdt != ATTN_DTYPE_BOOL) { /* some -inf entries */
            int64_t n = attn_tensor_numel(&c->mask.t), idx[3] = {0};
            for (int64_t i = 0; i < n; i++) {
                if (rng_int(r, 0, 4) == 0) tt_set(&c->mask.t, idx, -INFINITY);
                for (int d = c->mask.t.rank - 1; d >= 0; d--) {
                    if (++idx[d] < c->mask.t.shape[d]) break;
                    idx[d] = 0;
                }
            }
        }
        c->has_mask = true;
        c->fp.attn_mask = &c->mask.t;
    }
    c->causal = rng_int(r, 0, 3) == 0;
    c->fp.is_causal = c->causal;
    c->training = c->cfg.dropout > 0 && rng_int(r, 0, 1);
    c->fp.training = c->training;
    c->fp.seed = rng_next(r);
    c->fp.rng_offset = rng_int(r, 0, 2);
    c->need_weights = rng_int(r, 0, 1);
    c->average = rng_int(r, 0, 1);
    c->fp.average_attn_weights = c->average;
    tt_make_output(&c->out, r, dt, rank, qs, layout);
    if (c->need_weights) {
        int wr;
        int64_t ws[ATTN_MAX_RANK], os[ATTN_MAX_RANK];
        int orank;
        CHECK_OK(attn_mha_out_shapes(c->m, &c->query.t, &c->key.t, &c->fp, 1, &orank, os, &wr, ws));
        tt_make_output(&c->weights, r, dt, wr, ws, layout);
    }
}

static void free_case(mha_case *c) {
    attn_mha_destroy(c->m);
    test_tensor *all[] = {&c->query, &c->key, &c->value, &c->kpm, &c->mask, &c->out, &c->weights};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tt_free(all[i]);
}

/* The worst |ours - ref| / bound over n elements (elementwise bounds). */
static double worst_ratio(const double *ours, const double *ref, const double *bound, int64_t n) {
    double worst = 0;
    for (int64_t k = 0; k < n; k++) {
        const double e = fabs(ours[k] - ref[k]);
        if (e > 0) worst = fmax(worst, bound[k] > 0 ? e / bound[k] : INFINITY);
    }
    return worst;
}

/* float32 and float64 modules: a fixed relative bound on the largest
 * output; 16-bit ones: oracle_mha's first-order bound per element, with a
 * factor 2 for the second-order terms and the float32 sums. */
static void random_modules(void) {
    const int cases = 400;
    unsigned long long seed = harness_seed() ^ 0x6666;
    printf("random_modules: %d cases, seed %llu\n", cases, seed);
    rng r = {seed};
    int agree = 0;
    double worst_half[2] = {0, 0}; /* float16, bfloat16: the worst error / bound */
    for (int i = 0; i < cases; i++) {
        mha_case c;
        make_case(&c, &r);
        attn_status st = attn_mha_forward(c.m, &c.query.t, &c.key.t, &c.value.t, &c.fp, &c.out.t,
                                          c.need_weights ? &c.weights.t : NULL);
        CHECK(st == ATTN_OK, "case %d: %s", i, attn_last_error());
        if (st != ATTN_OK) {
            free_case(&c);
            continue;
        }
        const attn_dtype dt = c.cfg.dtype;
        const bool half = dt == ATTN_DTYPE_F16 || dt == ATTN_DTYPE_BF16;
        const double u = dt == ATTN_DTYPE_F16 ? 0x1p-11 : dt == ATTN_DTYPE_BF16 ? 0x1p-8 : 0;
        const double fixed = dt == ATTN_DTYPE_F64 ? 1e-11 : 3e-5;
        const double drop = c.training ? 1 / (1 - c.cfg.dropout) : 1;
        double *ref_out, *ref_w, *b_out, *b_w;
        oracle_mha(&c, u, &ref_out, &ref_w, &b_out, &b_w);
        double *out = tt_dense(&c.out.t);
        const int64_t n = attn_tensor_numel(&c.out.t);
        double mag = 0;
        for (int64_t k = 0; k < n; k++) mag = fmax(mag, fabs(ref_out[k]));
        const double err = max_abs_diff(out, ref_out, n);
        double ratio = half ? worst_ratio(out, ref_out, b_out, n) / 2
                            : err / (fixed * (1 + mag) * drop);
        CHECK(ratio <= 1, "case %d (%s, E=%lld H=%lld hd=%lld kdim=%lld vdim=%lld bias=%d bkv=%d "
                          "zero=%d bf=%d batched=%d causal=%d kpm=%d mask=%d train=%d): out error "
                          "%.3g is %.3g of the bound",
              i, attn_dtype_name(dt), (long long)c.cfg.embed_dim, (long long)c.cfg.num_heads,
              (long long)c.cfg.head_dim, (long long)c.cfg.kdim, (long long)c.cfg.vdim, c.cfg.bias,
              c.cfg.add_bias_kv, c.cfg.add_zero_attn, c.cfg.batch_first, c.batched, c.causal,
              c.has_kpm, c.has_mask, c.training, err, ratio);
        bool ok = ratio <= 1;
        if (c.need_weights) {
            double *w = tt_dense(&c.weights.t);
            const int64_t nw = attn_tensor_numel(&c.weights.t);
            const double wratio = half ? worst_ratio(w, ref_w, b_w, nw) / 2
                                       : max_abs_diff(w, ref_w, nw) / (fixed * drop);
            CHECK(wratio <= 1, "case %d (%s): weights error %.3g of the bound", i,
                  attn_dtype_name(dt), wratio);
            ok &= wratio <= 1;
            ratio = fmax(ratio, wratio);
            free(w);
        }
        if (half) worst_half[dt == ATTN_DTYPE_BF16] = fmax(worst_half[dt == ATTN_DTYPE_BF16], ratio);
        agree += ok;
        free(out);
        free(ref_out);
        free(ref_w);
        free(b_out);
        free(b_w);
        free_case(&c);
    }
    printf("  %d/%d modules agree with the oracle; 16-bit: worst error %.2f (float16), %.2f "
           "(bfloat16) of the bound\n", agree, cases, worst_half[0], worst_half[1]);
}

static void parameter_names_and_order(void) {
    struct {
        int64_t kdim;
        int bias, bias_kv;
        const char *names[8];
    } cases[] = {
        {0, 1, 0, {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}},
        {0, 0, 0, {"in_proj_weight", "out_proj.weight"}},
        {5, 1, 1, {"q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k",
                   "bias_v", "out_proj.weight", "out_proj.bias"}},
    };
    for (int c = 0; c < 3; c++) {
        attn_mha_config cfg;
        attn_mha_config_init(&cfg, 8, 2);
        cfg.kdim = cases[c].kdim;
        cfg.bias = cases[c].bias;
        cfg.add_bias_kv = cases[c].bias_kv;
        attn_mha *m;
        CHECK_OK(attn_mha_create(&cfg, &m));
        int n = attn_mha_param_count(m), want = 0;
        while (want < 8 && cases[c].names[want]) want++;
        CHECK(n == want, "case %d: %d parameters, expected %d", c, n, want);
        for (int i = 0; i < n && i < want; i++) {
            const char *name;
            CHECK_OK(attn_mha_param_at(m, i, &name, NULL));
            CHECK(strcmp(name, cases[c].names[i]) == 0, "case %d: parameter %d is %s, expected %s",
                  c, i, name, cases[c].names[i]);
        }
        attn_tensor v;
        if (cases[c].kdim) {
            CHECK_OK(attn_mha_param(m, "k_proj_weight", &v));
            CHECK(v.rank == 2 && v.shape[0] == 8 && v.shape[1] == 5, "k_proj_weight shape");
        }
        if (cases[c].bias_kv) {
            CHECK_OK(attn_mha_param(m, "bias_k", &v));
            CHECK(v.rank == 3 && v.shape[0] == 1 && v.shape[1] == 1 && v.shape[2] == 8, "bias_k shape");
        }
        attn_mha_destroy(m);
    }
}

/* Initial values follow torch's schemes: xavier-uniform in_proj, zero
 * biases, out_proj uniform(+-1/sqrt(D)), normal bias_k/v with std 1/sqrt(D). */
static void initialisation(void) {
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, 64, 4);
    cfg.add_bias_kv = 1;
    cfg.dtype = ATTN_DTYPE_F64;
    cfg.init_seed = 42;
    attn_mha *m;
    CHECK_OK(attn_mha_create(&cfg, &m));
    attn_tensor v;
    CHECK_OK(attn_mha_param(m, "in_proj_weight", &v));
    double bound = sqrt(6.0 / (64 + 192)), mx = 0, var = 0;
    int64_t n = attn_tensor_numel(&v);
    for (int64_t i = 0; i < n; i++) {
        double x = ((double *)v.data)[i];
        mx = fmax(mx, fabs(x));
        var += x * x / (double)n;
    }
    CHECK(mx <= bound && mx > 0.95 * bound, "in_proj max %.4f, bound %.4f", mx, bound);
    CHECK(fabs(var - bound * bound / 3) < 0.05 * bound * bound, "in_proj variance %.5f", var);
    CHECK_OK(attn_mha_param(m, "in_proj_bias", &v));
    for (int i = 0; i < 192; i++) CHECK(((double *)v.data)[i] == 0, "in_proj_bias starts at 0");
    CHECK_OK(attn_mha_param(m, "out_proj.weight", &v));
    mx = 0;
    for (int i = 0; i < 64 * 64; i++) mx = fmax(mx, fabs(((double *)v.data)[i]));
    CHECK(mx <= 1 / 8.0 && mx > 0.9 / 8, "out_proj max %.4f", mx);
    attn_mha *m2;
    CHECK_OK(attn_mha_create(&cfg, &m2));
    attn_tensor v2;
    attn_mha_param(m2, "bias_k", &v2);
    attn_mha_param(m, "bias_k", &v);
    CHECK(memcmp(v.data, v2.data, 64 * sizeof(double)) == 0, "same init_seed, same parameters");
    attn_mha_destroy(m);
    attn_mha_destroy(m2);
}

/* x[i] = value in dtype dt (16-bit: rounded to nearest even). */
static void put(void *x, attn_dtype dt, size_t i, double value) {
    switch (dt) {
    case ATTN_DTYPE_F32: ((float *)x)[i] = (float)value; break;
    case ATTN_DTYPE_F64: ((double *)x)[i] = value; break;
    default: ((uint16_t *)x)[i] = tt_half_bits(value, dt); break;
    }
}

/* Issue 9: MHA results must not depend on the thread count, whatever BLAS
 * core runs (CI repeats this test under every OPENBLAS_CORETYPE the machine
 * can run). The shapes cover the GEMM tiling: many row tiles (4 x 300
 * rows), few rows with column tiles (2 x 9 rows, 3·768 columns), one call
 * (tiny), ragged edges everywhere, self- and cross-attention, sequence- and
 * batch-first, float32, float64, float16 and bfloat16. */
static void thread_count_independence(void) {
    printf("  BLAS: %s\n", attn_blas_info());
    static const int64_t shapes[][6] = {/* N, L, S, E, heads, batch_first */
                                        {4, 300, 300, 200, 5, 1}, {2, 257, 131, 96, 3, 0},
                                        {1, 1000, 1000, 72, 8, 1}, {2, 9, 9, 768, 12, 1},
                                        {3, 5, 7, 16, 2, 0}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int dti = 0; dti < 4; dti++) {
            static const attn_dtype dts[] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_F16,
                                             ATTN_DTYPE_BF16};
            const attn_dtype dt = dts[dti];
            const size_t es = attn_dtype_size(dt);
            const int64_t N = shapes[si][0], L = shapes[si][1], S = shapes[si][2],
                          E = shapes[si][3];
            const bool bf = shapes[si][5] != 0, self = L == S;
            attn_mha_config cfg;
            attn_mha_config_init(&cfg, E, shapes[si][4]);
            cfg.batch_first = bf;
            cfg.dtype = dt;
            cfg.init_seed = 7 + si;
            attn_mha *m;
            CHECK_OK(attn_mha_create(&cfg, &m));
            const size_t nq = (size_t)(N * L * E), nk = (size_t)(N * S * E);
            char *x = malloc(nq * es), *kv = malloc(nk * es), *y = malloc(nq * es),
                 *y1 = malloc(nq * es);
            rng r = {99 + si};
            for (size_t i = 0; i < nq; i++) put(x, dt, i, rng_normal(&r));
            for (size_t i = 0; i < nk; i++) put(kv, dt, i, rng_normal(&r));
            const int64_t qshape[3] = {bf ? N : L, bf ? L : N, E}, kshape[3] = {bf ? N : S, bf ? S : N, E};
            attn_tensor tx, tkv, ty;
            attn_tensor_init(&tx, x, dt, 3, qshape);
            attn_tensor_init(&tkv, kv, dt, 3, kshape);
            attn_tensor_init(&ty, y, dt, 3, qshape);
            const attn_tensor *key = self ? &tx : &tkv;
            for (int threads = 1; threads <= 4; threads++) {
                attn_set_num_threads(threads);
                CHECK_OK(attn_mha_forward(m, &tx, key, key, NULL, &ty, NULL));
                if (threads == 1)
                    memcpy(y1, y, nq * es);
                else
                    CHECK(memcmp(y, y1, nq * es) == 0, "shape %zu %s: %d threads differ from 1",
                          si, attn_dtype_name(dt), threads);
            }
            attn_set_num_threads(0);
            free(x);
            free(kv);
            free(y);
            free(y1);
            attn_mha_destroy(m);
        }
}

/* [attn] params.has_dropout: this call's dropout replaces config.dropout
 * (the Python module reads m.dropout at every forward, as torch does). */
static void per_call_dropout(void) {
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, 8, 2);
    cfg.dtype = ATTN_DTYPE_F64;
    cfg.dropout = 0.5;
    cfg.init_seed = 3;
    attn_mha *m;
    CHECK_OK(attn_mha_create(&cfg, &m));
    const int64_t shape[2] = {5, 8}, wshape[2] = {5, 5};
    double x[40], y0[40], y[40], w[25], *bo = param(m, "out_proj.bias");
    for (int i = 0; i < 40; i++) x[i] = sin(i + 1.0);
    attn_tensor tx, ty0, ty, tw;
    attn_tensor_init(&tx, x, ATTN_DTYPE_F64, 2, shape);
    attn_tensor_init(&ty0, y0, ATTN_DTYPE_F64, 2, shape);
    attn_tensor_init(&ty, y, ATTN_DTYPE_F64, 2, shape);
    attn_tensor_init(&tw, w, ATTN_DTYPE_F64, 2, wshape);
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp); /* eval mode: no dropout */
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty0, NULL));
    fp.training = 1;
    fp.seed = 7;
    fp.has_dropout = 1;
    fp.dropout = 0.0;
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, NULL));
    CHECK(memcmp(y, y0, sizeof y) == 0, "dropout 0 for this call dropped something");
    fp.dropout = 1.0;
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, &tw));
    for (int i = 0; i < 40; i++) CHECK(y[i] == bo[i % 8], "dropout 1: out[%d] is not the bias", i);
    for (int i = 0; i < 25; i++) CHECK(w[i] == 0.0, "dropout 1: weight %d is %g", i, w[i]);
    fp.has_dropout = 0; /* config.dropout = 0.5 again */
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, &tw));
    int zeros = 0;
    for (int i = 0; i < 25; i++) zeros += w[i] == 0.0;
    CHECK(zeros > 0 && zeros < 25, "config dropout 0.5: %d of 25 weights dropped", zeros);
    fp.has_dropout = 1;
    const double bad[2] = {1.5, NAN};
    for (int b = 0; b < 2; b++) {
        fp.dropout = bad[b];
        CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, NULL), ATTN_ERR_INVALID);
        int orank, wrank;
        int64_t oshape[ATTN_MAX_RANK], ws[ATTN_MAX_RANK];
        CHECK_STATUS(attn_mha_out_shapes(m, &tx, &tx, &fp, 1, &orank, oshape, &wrank, ws),
                     ATTN_ERR_INVALID);
    }
    free(bo);
    attn_mha_destroy(m);
}

/* The bfloat16 projections (attn__gemm_abt_bf16): on every path with
 * bfloat16 dot products, and on the widened float32 fallback (kern NULL),
 * each element of C within its own rounding (2^-8 relative) plus float32
 * sums' (k + 2)·2^-24·(Σ|a·b| + |bias|) of the float64 result of the same
 * bfloat16 values; edges of every kind: k odd and 1, n not a multiple of
 * 16, one row, many row tiles, lda > k, with and without a bias; and the
 * same bits for 1-4 threads. */
static void bf16_projection_gemm(void) {
    static const int64_t shapes[][4] = {/* m, n, k, lda - k */
                                        {1, 1, 1, 0}, {3, 17, 5, 2}, {8, 16, 2, 0},
                                        {33, 48, 7, 1}, {515, 260, 33, 3}, {600, 300, 129, 0},
                                        /* B in column panels (bf16_panel) */
                                        {40, 300, 2048, 5}};
    rng r = {harness_seed() ^ 0xbf16};
    int paths = 0;
    for (int isa = ATTN_ISA_REF; isa <= ATTN_ISA_LAST + 1; isa++) {
        const bool fallback = isa == ATTN_ISA_LAST + 1;
        const attn__ukernel *u = fallback ? NULL : attn__ukernel_for((attn_isa)isa);
        if (!fallback && (!attn_isa_supported((attn_isa)isa) || u->qkt_bf == NULL)) continue;
        const attn__gemm_bf16 kern = {u ? u->pack_qt_bf : NULL, u ? u->qkt_bf : NULL,
                                      u ? u->round_bf16_f : NULL};
        paths++;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                const int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2],
                              lda = k + shapes[si][3];
                uint16_t *a = malloc((size_t)(m * lda) * 2), *b = malloc((size_t)(n * k) * 2),
                         *bias = malloc((size_t)n * 2), *c = malloc((size_t)(m * n) * 2),
                         *c1 = malloc((size_t)(m * n) * 2);
                for (int64_t i = 0; i < m * lda; i++) a[i] = tt_half_bits(rng_normal(&r), ATTN_DTYPE_BF16);
                for (int64_t i = 0; i < n * k; i++) b[i] = tt_half_bits(rng_normal(&r), ATTN_DTYPE_BF16);
                for (int64_t i = 0; i < n; i++) bias[i] = tt_half_bits(rng_normal(&r), ATTN_DTYPE_BF16);
                double worst = 0;
                for (int threads = 1; threads <= 4; threads++) {
                    attn_set_num_threads(threads);
                    CHECK_OK(attn__gemm_abt_bf16(fallback ? NULL : &kern, m, n, k, a, lda, b, k,
                                                 with_bias ? bias : NULL, c, n, NULL));
                    if (threads == 1) {
                        memcpy(c1, c, (size_t)(m * n) * 2);
                        continue;
                    }
                    CHECK(memcmp(c, c1, (size_t)(m * n) * 2) == 0,
                          "%s, shape %zu: %d threads differ from 1", u ? u->name : "fallback", si,
                          threads);
                }
                attn_set_num_threads(0);
                if (kern.round != NULL) { /* the portable rounding gives the slot's bits */
                    const attn__gemm_bf16 portable = {kern.pack, kern.tile, NULL};
                    CHECK_OK(attn__gemm_abt_bf16(&portable, m, n, k, a, lda, b, k,
                                                 with_bias ? bias : NULL, c, n, NULL));
                    CHECK(memcmp(c, c1, (size_t)(m * n) * 2) == 0,
                          "%s, shape %zu: rounding without round_bf16_f differs", u->name, si);
                }
                for (int64_t i = 0; i < m; i++)
                    for (int64_t j = 0; j < n; j++) {
                        double exact = with_bias ? tt_half_value(bias[j], ATTN_DTYPE_BF16) : 0;
                        double mag = fabs(exact);
                        for (int64_t e = 0; e < k; e++) {
                            const double p = tt_half_value(a[i * lda + e], ATTN_DTYPE_BF16) *
                                             tt_half_value(b[j * k + e], ATTN_DTYPE_BF16);
                            exact += p;
                            mag += fabs(p);
                        }
                        const double got = tt_half_value(c1[i * n + j], ATTN_DTYPE_BF16);
                        const double bound = 0x1p-8 * fabs(exact) + (double)(k + 2) * 0x1p-24 * mag;
                        worst = fmax(worst, fabs(got - exact) / bound);
                    }
                CHECK(worst <= 1, "%s, shape %zu, bias %d: error %.3g of the bound",
                      u ? u->name : "fallback", si, with_bias, worst);
                free(a);
                free(b);
                free(bias);
                free(c);
                free(c1);
            }
    }
    printf("  %d paths with bfloat16 products, and the float32 fallback\n", paths - 1);
}

HARNESS_MAIN(T(random_modules), T(bf16_projection_gemm), T(parameter_names_and_order), T(initialisation),
             T(thread_count_independence), T(per_call_dropout))
