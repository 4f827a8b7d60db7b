/*
 * test_numerics.c — hostile numerics, as attn.h documents them:
 *  - NaN/Inf in a masked-out key, value or float-mask entry (bool mask,
 *    -inf float mask, causal) never reaches the output;
 *  - NaN in a query or in a visible key / float-mask entry makes its row
 *    NaN and leaves the other rows unchanged; NaN/Inf in a
 *    visible value reaches exactly that value's column;
 *  - a key whose weight is exactly 0 (underflow, dropout) contributes
 *    nothing, even with a NaN or Inf value;
 *  - fully masked rows (bool, -inf, causal) give 0 / 0 / -inf;
 *  - logits of magnitude 1e30 (float64) and ~1e4·E (float32) do not
 *    overflow: the weights are one-hot and the output is the winning value;
 *  - sizes whose byte count overflows 64 bits are rejected with a status.
 * Every test runs on every kernel path this machine supports (attn_set_isa),
 * in float32 and float64: nothing here is specific to the reference kernel.
 * "Unchanged" is bit for bit on the reference path; a fused path may move a
 * value by rounding (1e-12 relative in float64, 1e-5 in float32) when it
 * reroutes around a non-finite input, never make it NaN/Inf.
 */
#include <float.h>

#include "kernels/exp2.h"
#include "kernels/ukernel.h"
#include "testutil.h"

enum { MAXL = 16, MAXS = 16, MAXE = 32 };

typedef struct prob {
    int64_t L, S, E, Ev;
    double q[MAXL * MAXE], k[MAXS * MAXE], v[MAXS * MAXE];
    attn_dtype mask_dtype; /* 0: no mask */
    double mask[MAXL * MAXS];
    attn_sdpa_params p; /* attn_mask is set by solve() */
} prob;

typedef struct result {
    attn_status st;
    double out[MAXL * MAXE], w[MAXL * MAXS], lse[MAXL];
} result;

static void to_dtype(void *dst, attn_dtype dt, const double *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (dt == ATTN_DTYPE_F32)
            ((float *)dst)[i] = (float)src[i];
        else if (dt == ATTN_DTYPE_F64)
            ((double *)dst)[i] = src[i];
        else
            ((unsigned char *)dst)[i] = src[i] != 0;
    }
}
static void from_dtype(double *dst, attn_dtype dt, const void *src, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = dt == ATTN_DTYPE_F32 ? (double)((const float *)src)[i] : ((const double *)src)[i];
}

static result solve(const prob *pr, attn_dtype dt) {
    static double qb[MAXL * MAXE], kb[MAXS * MAXE], vb[MAXS * MAXE], mb[MAXL * MAXS];
    static double ob[MAXL * MAXE], wb[MAXL * MAXS], lb[MAXL];
    result r;
    memset(&r, 0, sizeof r);
    to_dtype(qb, dt, pr->q, pr->L * pr->E);
    to_dtype(kb, dt, pr->k, pr->S * pr->E);
    to_dtype(vb, dt, pr->v, pr->S * pr->Ev);
    int64_t qs[2] = {pr->L, pr->E}, ks[2] = {pr->S, pr->E}, vs[2] = {pr->S, pr->Ev},
            os[2] = {pr->L, pr->Ev}, ws[2] = {pr->L, pr->S};
    attn_tensor q, k, v, o, w, l, m;
    attn_tensor_init(&q, qb, dt, 2, qs);
    attn_tensor_init(&k, kb, dt, 2, ks);
    attn_tensor_init(&v, vb, dt, 2, vs);
    attn_tensor_init(&o, ob, dt, 2, os);
    attn_tensor_init(&w, wb, dt, 2, ws);
    attn_tensor_init(&l, lb, dt, 1, qs);
    attn_sdpa_params p = pr->p;
    if (pr->mask_dtype != 0) {
        to_dtype(mb, pr->mask_dtype, pr->mask, pr->L * pr->S);
        attn_tensor_init(&m, mb, pr->mask_dtype, 2, ws);
        p.attn_mask = &m;
    }
    r.st = attn_sdpa(&q, &k, &v, &p, &o, &w, &l);
    from_dtype(r.out, dt, ob, pr->L * pr->Ev);
    from_dtype(r.w, dt, wb, pr->L * pr->S);
    from_dtype(r.lse, dt, lb, pr->L);
    return r;
}

/* A random problem with moderate values; mask all-visible when present. */
static void random_prob(prob *pr, rng *r, int64_t L, int64_t S, int64_t E, int64_t Ev) {
    memset(pr, 0, sizeof *pr);
    pr->L = L, pr->S = S, pr->E = E, pr->Ev = Ev;
    for (int64_t i = 0; i < L * E; i++) pr->q[i] = rng_normal(r);
    for (int64_t i = 0; i < S * E; i++) pr->k[i] = rng_normal(r);
    for (int64_t i = 0; i < S * Ev; i++) pr->v[i] = rng_normal(r);
    attn_sdpa_params_init(&pr->p);
}

/* "Unchanged": a fused kernel may take another route (its reference
 * fallback, say) when an input it never uses holds NaN/Inf, so outside the
 * reference path values may move by rounding; but a non-finite value must
 * be exactly where the baseline has one. On the reference path: bit for bit. */
static double tol;
static bool same_value(double a, double b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    if (!isfinite(a) || !isfinite(b)) return a == b;
    return fabs(a - b) <= tol * (1 + fabs(b));
}
static bool same_values(const double *a, const double *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!same_value(a[i], b[i])) return false;
    return true;
}
static bool row_same(const result *a, const result *b, const prob *pr, int64_t i) {
    return same_values(a->out + i * pr->Ev, b->out + i * pr->Ev, pr->Ev) &&
           same_values(a->w + i * pr->S, b->w + i * pr->S, pr->S) && same_value(a->lse[i], b->lse[i]);
}
static bool all_same(const result *a, const result *b, const prob *pr) {
    for (int64_t i = 0; i < pr->L; i++)
        if (!row_same(a, b, pr, i)) return false;
    return true;
}
static bool row_nan(const result *a, const prob *pr, int64_t i) {
    for (int64_t e = 0; e < pr->Ev; e++)
        if (!isnan(a->out[i * pr->Ev + e])) return false;
    return isnan(a->lse[i]);
}

static const double POISON[] = {NAN, INFINITY, -INFINITY};
static const char *POISON_NAME[] = {"NaN", "+Inf", "-Inf"};

/* Runs `fn` on every supported path, for float32 and float64. */
static void each_path(void (*fn)(attn_dtype, const char *)) {
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        CHECK_OK(attn_set_isa((attn_isa)i));
        char where[64];
        for (int d = 0; d < 2; d++) {
            attn_dtype dt = d ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
            snprintf(where, sizeof where, "%s/%s", attn_isa_name((attn_isa)i), attn_dtype_name(dt));
            tol = i == ATTN_ISA_REF ? 0.0 : dt == ATTN_DTYPE_F64 ? 1e-12 : 1e-5;
            fn(dt, where);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- masked-out entries never reach the output ---- */

static void masked_out_poison_case(attn_dtype dt, const char *where) {
    rng r = {harness_seed() ^ 0x6a};
    for (int kind = 0; kind < 3; kind++) { /* bool false, float -inf, causal */
        prob pr;
        random_prob(&pr, &r, 4, 6, 5, 3);
        const int64_t hidden = 2; /* key 2 is masked out for every row */
        if (kind == 0) {
            pr.mask_dtype = ATTN_DTYPE_BOOL;
            for (int64_t i = 0; i < pr.L * pr.S; i++) pr.mask[i] = (i % pr.S) != hidden;
        } else if (kind == 1) {
            pr.mask_dtype = dt;
            for (int64_t i = 0; i < pr.L * pr.S; i++)
                pr.mask[i] = (i % pr.S) == hidden ? -INFINITY : 0.25 * (double)(i % 3);
        } else {
            /* Bottom-right causal with S - L = 2: row i sees keys j <= i + 2,
             * so key 5 is hidden from rows 0..2 only; poison a float-mask
             * entry that causality hides, and check key 5 separately. */
            pr.p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
            pr.mask_dtype = dt;
            for (int64_t i = 0; i < pr.L * pr.S; i++) pr.mask[i] = 0;
        }
        result base = solve(&pr, dt);
        CHECK(base.st == ATTN_OK, "%s: %s", where, attn_last_error());
        for (int pz = 0; pz < 3; pz++) {
            prob bad = pr;
            if (kind < 2) {
                for (int64_t e = 0; e < pr.E; e++) bad.k[hidden * pr.E + e] = POISON[pz];
                for (int64_t e = 0; e < pr.Ev; e++) bad.v[hidden * pr.Ev + e] = POISON[pz];
            } else {
                for (int64_t i = 0; i < 3; i++) bad.mask[i * pr.S + 5] = POISON[pz];
                bad.mask[0 * pr.S + 3] = POISON[pz];
            }
            result got = solve(&bad, dt);
            CHECK(got.st == ATTN_OK && all_same(&got, &base, &pr),
                  "%s: %s in a masked-out entry (mask kind %d) changed the result", where,
                  POISON_NAME[pz], kind);
            if (kind == 2) { /* key 5 is visible to row 3 only */
                prob k5 = pr;
                for (int64_t e = 0; e < pr.E; e++) k5.k[5 * pr.E + e] = NAN;
                got = solve(&k5, dt);
                bool ok = row_nan(&got, &pr, 3);
                for (int64_t i = 0; i < 3; i++) ok &= row_same(&got, &base, &pr, i);
                CHECK(ok, "%s: NaN in key 5 must poison row 3 only (bottom-right causal)", where);
            }
        }
    }
}
static void masked_out_never_reaches_output(void) { each_path(masked_out_poison_case); }

/* ---- NaN in what takes part ---- */

static void visible_nan_case(attn_dtype dt, const char *where) {
    rng r = {harness_seed() ^ 0x7b};
    prob pr;
    random_prob(&pr, &r, 4, 5, 6, 3);
    pr.mask_dtype = dt;
    for (int64_t i = 0; i < pr.L * pr.S; i++) pr.mask[i] = 0.5 * (double)(i % 2);
    result base = solve(&pr, dt);
    CHECK(base.st == ATTN_OK, "%s", where);
    /* NaN in query row 1: row 1 is NaN, the others are unchanged. */
    prob a = pr;
    a.q[1 * pr.E + 2] = NAN;
    result got = solve(&a, dt);
    bool ok = got.st == ATTN_OK && row_nan(&got, &pr, 1);
    for (int64_t i = 0; i < pr.L; i++)
        if (i != 1) ok &= row_same(&got, &base, &pr, i);
    CHECK(ok, "%s: NaN in query row 1 must poison row 1 only", where);
    /* NaN in a visible float-mask entry (2, 3): row 2 only. */
    a = pr;
    a.mask[2 * pr.S + 3] = NAN;
    got = solve(&a, dt);
    ok = got.st == ATTN_OK && row_nan(&got, &pr, 2);
    for (int64_t i = 0; i < pr.L; i++)
        if (i != 2) ok &= row_same(&got, &base, &pr, i);
    CHECK(ok, "%s: NaN in mask entry (2, 3) must poison row 2 only", where);
    /* NaN in a key every row sees: every row. */
    a = pr;
    a.k[4 * pr.E + 0] = NAN;
    got = solve(&a, dt);
    ok = got.st == ATTN_OK;
    for (int64_t i = 0; i < pr.L; i++) ok &= row_nan(&got, &pr, i);
    CHECK(ok, "%s: NaN in a visible key must poison every row that sees it", where);
    /* NaN / +Inf in a visible value: exactly that value's column. */
    for (int pz = 0; pz < 2; pz++) {
        a = pr;
        a.v[3 * pr.Ev + 1] = POISON[pz];
        got = solve(&a, dt);
        ok = got.st == ATTN_OK;
        for (int64_t i = 0; i < pr.L; i++)
            for (int64_t e = 0; e < pr.Ev; e++) {
                double x = got.out[i * pr.Ev + e], b = base.out[i * pr.Ev + e];
                if (e == 1)
                    ok &= pz == 0 ? isnan(x) : x == INFINITY;
                else
                    ok &= same_value(x, b);
            }
        CHECK(ok, "%s: %s in value (3, 1) must reach column 1 only", where, POISON_NAME[pz]);
    }
}
static void visible_nan_poisons_its_rows(void) { each_path(visible_nan_case); }

/* ---- keys with weight exactly 0 ---- */

static void zero_weight_case(attn_dtype dt, const char *where) {
    rng r = {harness_seed() ^ 0x8c};
    /* Underflow: key 1's score is ~1e4 below the best, so exp() is 0. */
    prob pr;
    random_prob(&pr, &r, 3, 4, 2, 2);
    for (int64_t i = 0; i < pr.L; i++) pr.q[i * 2] = 1, pr.q[i * 2 + 1] = 0;
    pr.k[1 * 2] = -2e4;
    pr.p.has_scale = 1;
    pr.p.scale = 1;
    result base = solve(&pr, dt);
    bool zero = base.st == ATTN_OK;
    for (int64_t i = 0; i < pr.L; i++) zero &= base.w[i * pr.S + 1] == 0.0;
    CHECK(zero, "%s: key 1 should get weight exactly 0", where);
    for (int pz = 0; pz < 3; pz++) {
        prob a = pr;
        a.v[1 * 2] = a.v[1 * 2 + 1] = POISON[pz];
        result got = solve(&a, dt);
        CHECK(got.st == ATTN_OK && all_same(&got, &base, &pr),
              "%s: %s in an underflowed key's value reached the output", where, POISON_NAME[pz]);
    }
    /* Dropout: find a key dropped in every row, poison its value. */
    bool found = false;
    for (uint64_t seed = 1; seed < 64 && !found; seed++) {
        random_prob(&pr, &r, 2, 16, 3, 2);
        pr.p.dropout_p = 0.5;
        pr.p.seed = seed;
        base = solve(&pr, dt);
        for (int64_t j = 0; j < pr.S && !found; j++) {
            bool dropped = true;
            for (int64_t i = 0; i < pr.L; i++) dropped &= base.w[i * pr.S + j] == 0.0;
            if (!dropped) continue;
            found = true;
            for (int pz = 0; pz < 3; pz++) {
                prob a = pr;
                for (int64_t e = 0; e < pr.Ev; e++) a.v[j * pr.Ev + e] = POISON[pz];
                result got = solve(&a, dt);
                CHECK(got.st == ATTN_OK && all_same(&got, &base, &pr),
                      "%s: %s in a dropped key's value reached the output", where,
                      POISON_NAME[pz]);
            }
        }
    }
    CHECK(found, "%s: no seed dropped a whole column", where);
}
static void zero_weight_keys_contribute_nothing(void) { each_path(zero_weight_case); }

/* ---- fully masked rows ---- */

static void fully_masked_case(attn_dtype dt, const char *where) {
    rng r = {harness_seed() ^ 0x9d};
    for (int kind = 0; kind < 3; kind++) {
        prob pr;
        random_prob(&pr, &r, 5, 3, 4, 2);
        int64_t empty_rows = 1;
        if (kind == 0) { /* bool false on row 0; NaN values do not matter */
            pr.mask_dtype = ATTN_DTYPE_BOOL;
            for (int64_t i = 0; i < pr.L * pr.S; i++) pr.mask[i] = i >= pr.S;
        } else if (kind == 1) { /* -inf on row 0 */
            pr.mask_dtype = dt;
            for (int64_t i = 0; i < pr.L * pr.S; i++) pr.mask[i] = i < pr.S ? -INFINITY : 1.0;
        } else { /* bottom-right causal, L = 5 > S = 3: rows 0, 1 see nothing */
            pr.p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
            empty_rows = 2;
        }
        result got = solve(&pr, dt);
        bool ok = got.st == ATTN_OK;
        for (int64_t i = 0; i < empty_rows; i++) {
            for (int64_t e = 0; e < pr.Ev; e++) ok &= got.out[i * pr.Ev + e] == 0.0;
            for (int64_t j = 0; j < pr.S; j++) ok &= got.w[i * pr.S + j] == 0.0;
            ok &= got.lse[i] == -INFINITY;
        }
        for (int64_t i = empty_rows; i < pr.L; i++) ok &= isfinite(got.lse[i]);
        CHECK(ok, "%s: fully masked rows (kind %d) must give 0, 0, -inf", where, kind);
    }
}
static void fully_masked_rows_give_zero(void) { each_path(fully_masked_case); }

/* ---- rows of more than 2^24 keys ---- */

/* A float32 sum that adds a term of 1 at a time stops at 2^24. Keys are
 * summed in chunks of at most 2^24 merged in float64 (flash.c, CHUNK_MAX;
 * test_schedule checks the forward's chunks): flat weights over S = 2^25
 * keys gave out = 0.5 for 1 and the backward's dq half its value. Here,
 * on every path, with cheap shapes (E = 1, one query row):
 *   - weights asked for, which keep a row's keys in one piece: computed
 *     by the float64 reference past 2^24 keys (one value through zero
 *     strides: out = 1, each weight 1/S);
 *   - the backward of 8 heads (8 tasks, so no split for balance), q = 0,
 *     k = v = j mod 2: P = 1/S, out = 1/2, dq = (1/S) sum (v - 1/2) v = 1/4. */
static void long_rows_case(attn_dtype dt, const char *where) {
    if (dt != ATTN_DTYPE_F32) return; /* float64 sums stop at 2^53 */
    const int64_t S = ((int64_t)1 << 24) + 4096, H = 8;
    static float one[1] = {1.0f}, zero[1] = {0.0f};
    float *w = malloc((size_t)S * sizeof *w), *kv = malloc((size_t)S * sizeof *kv);
    CHECK(w != NULL && kv != NULL, "%s: allocation", where);
    if (w == NULL || kv == NULL) goto done;
    { /* weights */
        const int64_t qs[2] = {1, 1}, ks[2] = {S, 1}, ws[2] = {1, S};
        float out = 0.0f;
        attn_tensor q, k, o, wt;
        attn_tensor_init(&q, zero, ATTN_DTYPE_F32, 2, qs);
        attn_tensor_init(&k, one, ATTN_DTYPE_F32, 2, ks);
        attn_tensor_init(&o, &out, ATTN_DTYPE_F32, 2, qs);
        attn_tensor_init(&wt, w, ATTN_DTYPE_F32, 2, ws);
        k.strides[0] = 0;
        CHECK_OK(attn_sdpa(&q, &k, &k, NULL, &o, &wt, NULL));
        double sum = 0.0;
        bool flat = true;
        for (int64_t j = 0; j < S; j++) {
            sum += w[j];
            flat &= fabs(w[j] * (double)S - 1.0) <= 1e-6;
        }
        CHECK(fabs(out - 1.0) <= 1e-6 && flat && fabs(sum - 1.0) <= 1e-6,
              "%s: S = 2^24 + 4096 with weights: out %.9g, weights sum %.9g, flat %d", where,
              (double)out, sum, flat);
    }
    { /* backward */
        for (int64_t j = 0; j < S; j++) kv[j] = (float)(j % 2);
        const int64_t qs[3] = {H, 1, 1}, ks[3] = {H, S, 1}, ls[2] = {H, 1};
        float q0[8] = {0}, dout[8], out[8], dq[8];
        double lse[8];
        for (int h = 0; h < H; h++) dout[h] = 1.0f, out[h] = 0.5f, lse[h] = log((double)S);
        attn_tensor q, k, o, g, l, d;
        attn_tensor_init(&q, q0, ATTN_DTYPE_F32, 3, qs);
        attn_tensor_init(&k, kv, ATTN_DTYPE_F32, 3, ks);
        attn_tensor_init(&o, out, ATTN_DTYPE_F32, 3, qs);
        attn_tensor_init(&g, dout, ATTN_DTYPE_F32, 3, qs);
        attn_tensor_init(&l, lse, ATTN_DTYPE_F64, 2, ls);
        attn_tensor_init(&d, dq, ATTN_DTYPE_F32, 3, qs);
        k.strides[0] = 0; /* one key array read by every head */
        CHECK_OK(attn_sdpa_backward(&g, &q, &k, &k, &o, &l, NULL, &d, NULL, NULL, NULL));
        for (int h = 0; h < H; h++)
            CHECK(fabs(dq[h] - 0.25) <= 1e-4, "%s: S = 2^24 + 4096 backward: dq[%d] %.9g, want 0.25",
                  where, h, (double)dq[h]);
    }
done:
    free(w);
    free(kv);
}
static void rows_of_more_than_2_24_keys(void) { each_path(long_rows_case); }

/* ---- huge logits ---- */

static void huge_logits_case(attn_dtype dt, const char *where) {
    /* float64: entries c = 1e15 give logits ~ E * 1e30; float32: c = 100
     * gives ~1e4 * E. Key j's logit is a_j * c^2 * E (times scale), with
     * distinct a_j, so the weights are exactly one-hot. */
    const double c = dt == ATTN_DTYPE_F64 ? 1e15 : 100;
    const int64_t E = dt == ATTN_DTYPE_F64 ? 4 : 32;
    static const double a[5] = {0.5, 1.0, -1.0, 0.25, 0.75};
    for (int sign = 0; sign < 2; sign++) {
        prob pr;
        memset(&pr, 0, sizeof pr);
        pr.L = 2, pr.S = 5, pr.E = E, pr.Ev = 3;
        attn_sdpa_params_init(&pr.p);
        pr.p.has_scale = 1;
        pr.p.scale = sign ? -1.0 : 1.0; /* negative scale: the smallest a_j wins */
        for (int64_t i = 0; i < pr.L * E; i++) pr.q[i] = c;
        for (int64_t j = 0; j < pr.S; j++)
            for (int64_t e = 0; e < E; e++) pr.k[j * E + e] = a[j] * c;
        for (int64_t j = 0; j < pr.S; j++)
            for (int64_t e = 0; e < pr.Ev; e++) pr.v[j * pr.Ev + e] = (double)(10 * j + e);
        if (dt == ATTN_DTYPE_F64) { /* and a float mask of the same magnitude */
            pr.mask_dtype = ATTN_DTYPE_F64;
            for (int64_t i = 0; i < pr.L * pr.S; i++) pr.mask[i] = i % 2 ? 1e29 : -1e29;
        }
        result got = solve(&pr, dt);
        int64_t win = sign ? 2 : 1;
        double logit = (sign ? -1.0 : 1.0) * a[win] * c * c * (double)E;
        bool ok = got.st == ATTN_OK;
        for (int64_t i = 0; i < pr.L; i++) {
            for (int64_t j = 0; j < pr.S; j++) ok &= got.w[i * pr.S + j] == (j == win ? 1.0 : 0.0);
            for (int64_t e = 0; e < pr.Ev; e++) ok &= got.out[i * pr.Ev + e] == (double)(10 * win + e);
            double want = logit + pr.mask[i * pr.S + win];
            ok &= isfinite(got.lse[i]) && fabs(got.lse[i] - want) <= 1e-6 * fabs(want);
        }
        CHECK(ok, "%s: logits of magnitude %.0e (scale %+.0f) overflowed: out %g, lse %g", where,
              fabs(logit), pr.p.scale, got.out[0], got.lse[0]);
    }
}
static void huge_logits_do_not_overflow(void) { each_path(huge_logits_case); }

/* ---- sizes whose byte count overflows ---- */

static void byte_count_overflow_rejected(void) {
    static double x[64];
    int64_t one[2] = {1, 1};
    attn_tensor q, k, v, o;
    attn_tensor_init(&q, x, ATTN_DTYPE_F32, 2, one);
    attn_tensor_init(&k, x, ATTN_DTYPE_F32, 2, one);
    attn_tensor_init(&v, x, ATTN_DTYPE_F32, 2, one);
    attn_tensor_init(&o, x + 8, ATTN_DTYPE_F32, 2, one);
    /* 2^62 broadcast queries: the element count fits, 4 bytes each do not. */
    q.shape[0] = (int64_t)1 << 62;
    q.strides[0] = 0;
    CHECK_STATUS(attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL), ATTN_ERR_OVERFLOW);
    /* 2^61 float64 keys, broadcast: 2^64 bytes. */
    attn_tensor_init(&q, x, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&k, x, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&v, x, ATTN_DTYPE_F64, 2, one);
    k.shape[0] = v.shape[0] = (int64_t)1 << 61;
    k.strides[0] = v.strides[0] = 0;
    CHECK_STATUS(attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL), ATTN_ERR_OVERFLOW);
    /* Each input fits, but L x S weights do not (2^32 x 2^32). */
    attn_tensor_init(&q, x, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&k, x, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&v, x, ATTN_DTYPE_F64, 2, one);
    q.shape[0] = k.shape[0] = v.shape[0] = (int64_t)1 << 32;
    q.strides[0] = k.strides[0] = v.strides[0] = 0;
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    CHECK_STATUS(attn_sdpa_out_shape(&q, &k, &v, NULL, &rank, shape), ATTN_ERR_OVERFLOW);
    /* A mask whose span overflows. */
    attn_tensor_init(&q, x, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&k, x, ATTN_DTYPE_F64, 2, one);
    attn_tensor_init(&v, x, ATTN_DTYPE_F64, 2, one);
    attn_tensor m;
    int64_t ms[3] = {3, 1, 1};
    attn_tensor_init(&m, x, ATTN_DTYPE_F64, 3, ms);
    m.strides[0] = INT64_MAX / 4; /* span fits in elements, not in bytes */
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.attn_mask = &m;
    int64_t qs3[3] = {3, 1, 1};
    attn_tensor_init(&q, x, ATTN_DTYPE_F64, 3, qs3);
    CHECK_STATUS(attn_sdpa_out_shape(&q, &k, &v, &p, &rank, shape), ATTN_ERR_OVERFLOW);
    /* MHA: a sequence of 2^40 broadcast positions. */
    attn_mha_config c;
    attn_mha_config_init(&c, 4, 2);
    attn_mha *mha = NULL;
    CHECK_OK(attn_mha_create(&c, &mha));
    int64_t xs[3] = {(int64_t)1 << 40, 1, 4};
    attn_tensor tx;
    attn_tensor_init(&tx, x, ATTN_DTYPE_F32, 3, (int64_t[3]){1, 1, 4});
    memcpy(tx.shape, xs, sizeof xs);
    tx.strides[0] = 0;
    int orank, wrank;
    int64_t oshape[ATTN_MAX_RANK], wshape[ATTN_MAX_RANK];
    CHECK_STATUS(attn_mha_out_shapes(mha, &tx, &tx, NULL, 1, &orank, oshape, &wrank, wshape),
                 ATTN_ERR_OVERFLOW);
    attn_mha_destroy(mha);
}

/* ---- float16 outputs at the top of their range ---- */

/* A float16 output is the exact value rounded once: values up to 65504
 * (float16's largest) stay finite even when every key's value is 65504,
 * and only a result past 65520 (dropout's 1/(1-p) scaling here) becomes
 * infinity, as rounding makes it. Every path, keys in lanes and in
 * columns (L = 40 and L = 1), with the split decode's merge (S = 3000). */
static void float16_outputs_round_at_the_range(void) {
    enum { L = 40, S = 3000, E = 16 };
    static uint16_t q[L * E], k[S * E], v[S * E], out[L * E];
    for (int i = 0; i < L * E; i++) q[i] = (uint16_t)(i % 7 == 0 ? 0x3c00 : 0x3800); /* 1, 0.5 */
    for (int i = 0; i < S * E; i++) {
        k[i] = (uint16_t)(i % 5 == 0 ? 0xbc00 : 0x3400); /* -1, 0.25 */
        v[i] = 0x7bff;                                    /* 65504 */
    }
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        CHECK_OK(attn_set_isa((attn_isa)i));
        for (int rows = 1; rows <= L; rows += L - 1) {
            int64_t qs[2] = {rows, E}, ks[2] = {S, E};
            attn_tensor tq, tk, tv, to;
            attn_tensor_init(&tq, q, ATTN_DTYPE_F16, 2, qs);
            attn_tensor_init(&tk, k, ATTN_DTYPE_F16, 2, ks);
            attn_tensor_init(&tv, v, ATTN_DTYPE_F16, 2, ks);
            attn_tensor_init(&to, out, ATTN_DTYPE_F16, 2, qs);
            attn_sdpa_params p;
            attn_sdpa_params_init(&p);
            CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL));
            bool all_max = true;
            for (int x = 0; x < rows * E; x++) all_max = all_max && out[x] == 0x7bff;
            CHECK(all_max, "%s, %d rows: a convex mix of 65504s is not 65504 in float16",
                  attn_isa_name((attn_isa)i), rows);
            /* kept weights doubled: a row whose kept weights sum past about
             * half gives more than 65520, which rounds to +infinity; the
             * rest stay finite, and nothing is NaN */
            p.dropout_p = 0.5;
            p.seed = 3;
            CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL));
            bool inf_or_finite = true, some_inf = false;
            for (int x = 0; x < rows * E; x++) {
                inf_or_finite = inf_or_finite && (out[x] == 0x7c00 || (out[x] & 0x7fff) < 0x7c00);
                some_inf = some_inf || out[x] == 0x7c00;
            }
            CHECK(inf_or_finite && some_inf,
                  "%s, %d rows: dropout's values past 65520 are not +infinity (or a NaN came out)",
                  attn_isa_name((attn_isa)i), rows);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Every context's store_half_f writes the bits attn__store writes (o·inv in
 * float64 rounded once) and reports non-finite products: random values
 * and the edges (bfloat16 and float16 ties, subnormal results, the top of
 * each range, past float32's, NaN and Inf), every tail length. */
static uint64_t below(rng *r, uint64_t n) { return rng_next(r) % n; }

static void output_rows_round_as_attn_store(void) {
    rng r = {harness_seed() ^ 0x57e};
    enum { N = 40 };
    const float edges[] = {1.0f + 0x1p-11f, 1.5f + 0x1p-8f, -(1.0f + 0x1p-11f), 1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -(1.0f + 0x1p-7f + 0x1p-8f),
                           65504.0f, 65520.0f, 65519.99f, 0x1p-24f, 0x1.8p-25f, 0x1p-130f,
                           3.0e38f, -3.3e38f, 0x1.fefffep127f, 0.0f, -0.0f, 1e-45f};
    int checked = 0;
    for (int isa = ATTN_ISA_GENERIC; isa <= ATTN_ISA_LAST; isa++) {
        if (!attn_isa_supported((attn_isa)isa)) continue;
        const attn__ukernel *kern = attn__ukernel_for((attn_isa)isa);
        if (kern->store_half_f == NULL) continue;
        for (int trial = 0; trial < 400; trial++) {
            float o[N];
            const int64_t n = 1 + (int64_t)below(&r, N);
            /* 1 +- 2^-40: products just off a tie that float32 cannot hold
             * (rounding twice would land on the tie) */
            const double invs[] = {1.0,  1.0 / 3.0, 0.7 + rng_uniform(&r), 2.0,
                                   1e-10, 0.0,      1 + 0x1p-40,           1 - 0x1p-40};
            const double inv = invs[trial % 8];
            for (int64_t e = 0; e < n; e++)
                o[e] = below(&r, 3) == 0 ? edges[below(&r, sizeof edges / sizeof *edges)]
                                             : (float)(rng_normal(&r) * ldexp(1, (int)below(&r, 40) - 20));
            if (trial % 50 == 7) o[below(&r, (uint64_t)n)] = trial % 100 == 7 ? NAN : INFINITY;
            for (int d = 0; d < 2; d++) {
                const attn_dtype dt = d ? ATTN_DTYPE_BF16 : ATTN_DTYPE_F16;
                uint16_t got[N + 1], want[N + 1];
                bool finite = true;
                got[n] = 0xdead;
                for (int64_t e = 0; e < n; e++) {
                    attn__store(want, dt, e, (double)o[e] * inv);
                    finite &= isfinite((double)o[e] * inv);
                }
                const bool said = kern->store_half_f(o, inv, n, dt, got);
                CHECK(said == finite, "%s %s: finite %d, said %d", kern->name, attn_dtype_name(dt),
                      finite, said);
                CHECK(got[n] == 0xdead, "%s: wrote past n = %lld", kern->name, (long long)n);
                for (int64_t e = 0; e < n; e++) {
                    if (!isfinite((double)o[e] * inv)) continue; /* recomputed by the reference */
                    CHECK(got[e] == want[e], "%s %s: %.9g x %.17g gave %04x, attn__store %04x",
                          kern->name, attn_dtype_name(dt), (double)o[e], inv, got[e], want[e]);
                }
                checked++;
            }
        }
    }
    printf("  %d rows compared\n", checked);
}

/* Every context's round_bf16_f writes attn__float_to_bf16's bits for
 * src + bias in float32 (src alone without a bias): ties each way, the
 * edges of float32, subnormals, ±Inf, NaN of any payload and sign, sums
 * that overflow; every tail length; nothing past n. */
static void gemm_rows_round_as_float_to_bf16(void) {
    rng r = {harness_seed() ^ 0xb16};
    enum { N = 40 };
    const uint32_t edges[] = {0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f807fffu, 0x3f808001u,
                              0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x00000001u, 0x80400000u,
                              0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u,
                              0x7fbfffffu, 0x00000000u, 0x80000000u};
    int checked = 0;
    for (int isa = ATTN_ISA_GENERIC; isa <= ATTN_ISA_LAST; isa++) {
        if (!attn_isa_supported((attn_isa)isa)) continue;
        const attn__ukernel *kern = attn__ukernel_for((attn_isa)isa);
        if (kern->round_bf16_f == NULL) continue;
        for (int trial = 0; trial < 400; trial++) {
            float src[N], bias[N];
            const int64_t n = 1 + (int64_t)below(&r, N);
            const bool with_bias = trial % 2;
            for (int64_t j = 0; j < n; j++) {
                const uint32_t bits = edges[below(&r, sizeof edges / sizeof *edges)];
                if (below(&r, 3) == 0)
                    memcpy(&src[j], &bits, sizeof bits);
                else
                    src[j] = (float)(rng_normal(&r) * ldexp(1, (int)below(&r, 60) - 30));
                bias[j] = below(&r, 4) == 0 ? 3e38f : (float)rng_normal(&r);
            }
            uint16_t got[N + 1];
            got[n] = 0xdead;
            kern->round_bf16_f(src, with_bias ? bias : NULL, n, got);
            CHECK(got[n] == 0xdead, "%s: wrote past n = %lld", kern->name, (long long)n);
            for (int64_t j = 0; j < n; j++) {
                const uint16_t want = attn__float_to_bf16(with_bias ? src[j] + bias[j] : src[j]);
                CHECK(got[j] == want, "%s: %a + %a gave %04x, attn__float_to_bf16 %04x",
                      kern->name, (double)src[j], with_bias ? (double)bias[j] : 0.0, got[j], want);
            }
            checked++;
        }
    }
    printf("  %d rows compared\n", checked);
}

/* ---- bfloat16: a hidden NaN/Inf value row, any thread count ---- */

/* A bfloat16 call, (1, L, 16), whose last value row holds NaN or ±Inf that
 * every other row weighs 0 (causal, or a bool mask hiding that key from
 * all): those rows give the same bits for 1-4 threads on every path, and
 * on avx512_bf16 and amx (bfloat16 products) the bits of the same call with that
 * row finite. The products there once sent every row of a tile that met
 * the NaN (weight 0 times NaN) to the reference kernel, and the tiles,
 * hence the rows, differed between 1 and 3 threads. */
static void bf16_hidden_special_values(void) {
    enum { L = 200, E = 16 };
    rng r = {harness_seed() ^ 0xbf1e};
    static uint16_t q[L * E], k[L * E], v[L * E], finite_v[L * E], out[4][L * E], base[L * E];
    for (int i = 0; i < L * E; i++) {
        q[i] = tt_half_bits(rng_normal(&r), ATTN_DTYPE_BF16);
        k[i] = tt_half_bits(rng_normal(&r), ATTN_DTYPE_BF16);
        finite_v[i] = v[i] = tt_half_bits(rng_normal(&r), ATTN_DTYPE_BF16);
    }
    static unsigned char keep[L];
    for (int j = 0; j < L; j++) keep[j] = j != L - 1;
    const int64_t sh[3] = {1, L, E}, ms[2] = {1, L};
    attn_tensor tq, tk, tv, tvf, to, tm;
    CHECK_OK(attn_tensor_init(&tq, q, ATTN_DTYPE_BF16, 3, sh));
    CHECK_OK(attn_tensor_init(&tk, k, ATTN_DTYPE_BF16, 3, sh));
    CHECK_OK(attn_tensor_init(&tv, v, ATTN_DTYPE_BF16, 3, sh));
    CHECK_OK(attn_tensor_init(&tvf, finite_v, ATTN_DTYPE_BF16, 3, sh));
    CHECK_OK(attn_tensor_init(&tm, keep, ATTN_DTYPE_BOOL, 2, ms));
    const uint16_t special[3] = {0x7fc0, 0x7f80, 0xff80}; /* NaN, +Inf, -Inf */
    const int threads0 = attn_get_num_threads();
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        CHECK_OK(attn_set_isa((attn_isa)i));
        for (int hide = 0; hide < 2; hide++) {
            attn_sdpa_params p;
            attn_sdpa_params_init(&p);
            if (hide == 0) p.causal = ATTN_CAUSAL_TOP_LEFT;
            else p.attn_mask = &tm;
            attn_set_num_threads(1);
            CHECK_OK(attn_tensor_init(&to, base, ATTN_DTYPE_BF16, 3, sh));
            CHECK_OK(attn_sdpa(&tq, &tk, &tvf, &p, &to, NULL, NULL));
            for (int sp = 0; sp < 3; sp++) {
                for (int e = 0; e < E; e++) v[(L - 1) * E + e] = special[sp];
                for (int t = 1; t <= 4; t++) {
                    attn_set_num_threads(t);
                    CHECK_OK(attn_tensor_init(&to, out[t - 1], ATTN_DTYPE_BF16, 3, sh));
                    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL));
                    CHECK(memcmp(out[t - 1], out[0], sizeof(uint16_t) * (L - 1) * E) == 0,
                          "%s, %s, value %04x: rows 0..%d differ between 1 and %d threads",
                          attn_isa_name((attn_isa)i), hide ? "mask" : "causal", special[sp],
                          L - 2, t);
                }
                if (i == ATTN_ISA_AVX512_BF16 || i == ATTN_ISA_AMX)
                    CHECK(memcmp(out[0], base, sizeof(uint16_t) * (L - 1) * E) == 0,
                          "%s, %s, value %04x: the rows that weigh it 0 differ from "
                          "the call with a finite value there",
                          attn_isa_name((attn_isa)i), hide ? "mask" : "causal", special[sp]);
            }
            memcpy(v, finite_v, sizeof v);
        }
    }
    attn_set_num_threads(threads0);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- float32 scores past float32's range, with finite inputs ---- */

/* q·k of -1e40 (q 1e20, k -1e20 and -2e20) is finite in float64 but -inf
 * in a float32 sum: the fused paths took both keys for masked (out 0, lse
 * -inf). With a finite ALiBi slope of 3e38 the bias did the same; with
 * soft-capping a score sum that passed through +inf was capped to +softcap
 * (a finite, wrong weight). A float32 lse of such a row was stored as
 * -inf, which says "no key", and the backward then dropped the row. Every
 * path must give the reference's result, and a float32 lse of -FLT_MAX. */
static void overflowing_float32_scores(void) {
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        CHECK_OK(attn_set_isa((attn_isa)i));
        const char *where = attn_isa_name((attn_isa)i);
        float q[2] = {1e20f, 1.0f}, k[2] = {-1e20f, -2e20f}, v[4] = {3, 4, 5, 6};
        float dout[4] = {1, 1, 1, 1}, out[4], lse[2], dq[2], dk[2], dv[4];
        attn_tensor tq, tk, tv, tg, to, tl, tdq, tdk, tdv;
        CHECK_OK(attn_tensor_init(&tq, q, ATTN_DTYPE_F32, 2, (int64_t[]){2, 1}));
        CHECK_OK(attn_tensor_init(&tk, k, ATTN_DTYPE_F32, 2, (int64_t[]){2, 1}));
        CHECK_OK(attn_tensor_init(&tv, v, ATTN_DTYPE_F32, 2, (int64_t[]){2, 2}));
        CHECK_OK(attn_tensor_init(&tg, dout, ATTN_DTYPE_F32, 2, (int64_t[]){2, 2}));
        CHECK_OK(attn_tensor_init(&to, out, ATTN_DTYPE_F32, 2, (int64_t[]){2, 2}));
        CHECK_OK(attn_tensor_init(&tl, lse, ATTN_DTYPE_F32, 1, (int64_t[]){2}));
        CHECK_OK(attn_tensor_init(&tdq, dq, ATTN_DTYPE_F32, 2, (int64_t[]){2, 1}));
        CHECK_OK(attn_tensor_init(&tdk, dk, ATTN_DTYPE_F32, 2, (int64_t[]){2, 1}));
        CHECK_OK(attn_tensor_init(&tdv, dv, ATTN_DTYPE_F32, 2, (int64_t[]){2, 2}));
        CHECK_OK(attn_sdpa(&tq, &tk, &tv, NULL, &to, NULL, &tl));
        CHECK(out[0] == 3 && out[1] == 4, "%s: row 0 gave (%g, %g), not key 0's (3, 4)", where,
              out[0], out[1]);
        CHECK(lse[0] == -FLT_MAX, "%s: row 0's float32 lse is %g, not -FLT_MAX", where, lse[0]);
        CHECK_OK(attn_sdpa_backward(&tg, &tq, &tk, &tv, &to, &tl, NULL, &tdq, &tdk, &tdv, NULL));
        CHECK(dv[0] == 2 && dv[1] == 2, "%s: dv of key 0 is (%g, %g), not (2, 2)", where, dv[0],
              dv[1]);
        /* a finite ALiBi slope whose bias passes float32's range */
        float q1[1] = {1}, k3[3] = {0, 0, 0}, v3[3] = {3, 5, 7}, o1[1], slope[1] = {3e38f};
        attn_tensor a, b, c, o, sl;
        CHECK_OK(attn_tensor_init(&a, q1, ATTN_DTYPE_F32, 3, (int64_t[]){1, 1, 1}));
        CHECK_OK(attn_tensor_init(&b, k3, ATTN_DTYPE_F32, 3, (int64_t[]){1, 3, 1}));
        CHECK_OK(attn_tensor_init(&c, v3, ATTN_DTYPE_F32, 3, (int64_t[]){1, 3, 1}));
        CHECK_OK(attn_tensor_init(&o, o1, ATTN_DTYPE_F32, 3, (int64_t[]){1, 1, 1}));
        CHECK_OK(attn_tensor_init(&sl, slope, ATTN_DTYPE_F32, 1, (int64_t[]){1}));
        attn_sdpa_params p;
        attn_sdpa_params_init(&p);
        p.alibi_slopes = &sl; /* the last key is at distance 0: weight 1 */
        CHECK_OK(attn_sdpa(&a, &b, &c, &p, &o, NULL, NULL));
        CHECK(o1[0] == 7, "%s: ALiBi 3e38 gave %g, not the nearest key's 7", where, o1[0]);
        /* soft-capping over a float32 sum that overflows: q·k0 = -2e38 */
        enum { SL = 64, SS = 200, SE = 8 };
        static float sq[SL * SE], sk[SS * SE], sv[SS], so[SL];
        for (int r = 0; r < SL * SE; r++) sq[r] = r % SE < 4 ? 1e19f : 0;
        for (int r = 0; r < SS * SE; r++) sk[r] = 0;
        for (int r = 0; r < SS; r++) sv[r] = r == 0;
        sk[0] = sk[1] = 2e19f, sk[2] = sk[3] = -3e19f;
        CHECK_OK(attn_tensor_init(&a, sq, ATTN_DTYPE_F32, 2, (int64_t[]){SL, SE}));
        CHECK_OK(attn_tensor_init(&b, sk, ATTN_DTYPE_F32, 2, (int64_t[]){SS, SE}));
        CHECK_OK(attn_tensor_init(&c, sv, ATTN_DTYPE_F32, 2, (int64_t[]){SS, 1}));
        CHECK_OK(attn_tensor_init(&o, so, ATTN_DTYPE_F32, 2, (int64_t[]){SL, 1}));
        attn_sdpa_params_init(&p);
        p.softcap = 1;
        CHECK_OK(attn_sdpa(&a, &b, &c, &p, &o, NULL, NULL));
        const double want = exp(-1.0) / (exp(-1.0) + SS - 1); /* the capped score -1 */
        CHECK(fabs(so[0] - want) <= 1e-6 * want, "%s: softcap gave %g, not %g", where, so[0],
              want);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* The bfloat16 products' softmax (softmax_t_bf) against the float64 one:
 * each weight, paired as P·V reads it, is 2^((s - m)·c) rounded to
 * bfloat16 up to exp2.h's bfloat16 fit (ATTN__EXP2F_BF16_ERR) and x's own
 * float32 rounding; a masked key (-inf) weighs exactly 0; l is the old sum
 * rescaled plus these weights to the fit; m and alpha are softmax_t_f's
 * bits. Odd and even key counts, one to three lane vectors, the running
 * state fresh and carried. */
static void bf16_softmax_weights(void) {
    enum { NK = 33, LANES = 48 };
    const attn__ukernel *u = attn__ukernel_for(ATTN_ISA_AVX512_BF16);
    if (!attn_isa_supported(ATTN_ISA_AVX512_BF16) || u->softmax_t_bf == NULL) {
        printf("  (no AVX512-BF16 on this machine: skipped)\n");
        return;
    }
    rng r = {harness_seed() ^ 0x5f7b};
    static float st[NK * LANES], st2[NK * LANES];
    static uint32_t pp[(NK + 1) / 2 * LANES];
    float m[LANES], l[LANES], alpha[LANES], m2[LANES], l2[LANES], alpha2[LANES], l0[LANES];
    double worst = 0;
    for (int trial = 0; trial < 200; trial++) {
        const int64_t nk = 1 + (int64_t)(rng_next(&r) % NK), lanes = 16 * (1 + trial % 3);
        const float c = (float)(0.05 + 0.5 * rng_uniform(&r));
        for (int64_t i = 0; i < nk * LANES; i++)
            st[i] = rng_next(&r) % 9 == 0 ? -INFINITY : (float)(20 * rng_normal(&r));
        for (int64_t x = 0; x < LANES; x++) {
            const bool fresh = trial % 2 == 0;
            m[x] = fresh ? -INFINITY : (float)(20 * rng_normal(&r));
            l[x] = fresh ? 0 : (float)(1 + 10 * rng_uniform(&r));
        }
        memcpy(st2, st, sizeof st);
        memcpy(m2, m, sizeof m), memcpy(l2, l, sizeof l), memcpy(l0, l, sizeof l);
        u->softmax_t_bf(st, LANES, nk, lanes, c, m, l, alpha, pp, LANES);
        u->softmax_t_f(st2, LANES, nk, lanes, c, m2, l2, alpha2);
        for (int64_t x = 0; x < lanes; x++) {
            CHECK(memcmp(&m[x], &m2[x], sizeof(float)) == 0 &&
                      memcmp(&alpha[x], &alpha2[x], sizeof(float)) == 0,
                  "lane %lld: m or alpha is not softmax_t_f's", (long long)x);
            double sum = (double)l0[x] * alpha[x], bound = 0;
            for (int64_t j = 0; j < nk; j++) {
                const uint32_t pair = pp[j / 2 * LANES + x];
                const float got = attn__bf16_to_float((uint16_t)(j % 2 ? pair >> 16 : pair));
                const double s = st[j * LANES + x], xj = (s - (double)m[x]) * c;
                if (s == -INFINITY || xj < ATTN__EXP2F_MIN) { /* masked, or flushed */
                    CHECK(got == 0, "lane %lld key %lld: weight %g, not 0", (long long)x,
                          (long long)j, got);
                    continue;
                }
                const double want = exp2(xj);
                /* rounding to bfloat16, the fit, and x's two float32 roundings,
                 * which move 2^x by ln 2·dx of itself */
                const double err_x = fabs(xj) * 0x1p-22 * 0.6931471805599453;
                const double within = want * (0x1p-8 + ATTN__EXP2F_BF16_ERR + err_x);
                CHECK(fabs(got - want) <= within,
                      "nk %lld lane %lld key %lld: weight %.9g, want %.9g", (long long)nk,
                      (long long)x, (long long)j, got, want);
                if (want > 0) worst = fmax(worst, fabs(got - want) / want);
                sum += want;
                bound += want * (ATTN__EXP2F_BF16_ERR + err_x + (double)(nk + 2) * 0x1p-24);
            }
            bound += (double)l0[x] * alpha[x] * 0x1p-22;
            CHECK(fabs(l[x] - sum) <= bound, "nk %lld lane %lld: l %.9g, want %.9g (bound %.3g)",
                  (long long)nk, (long long)x, l[x], sum, bound);
        }
    }
    printf("  worst relative weight error %.3g (rounding to bfloat16: up to 2^-8 = %.3g)\n", worst,
           0x1p-8);
}

/* The bfloat16 products of every context that has them (avx512_bf16's
 * vdpbf16ps, amx's tiles) against float64 sums of the same bfloat16
 * values: each product is exact, and the float32 sum of n of them is within
 * n·2^-24 of their absolute sum. Shapes cover what the tiles take whole
 * (E a multiple of 32, 16 keys, rows, features and pairs) and every tail
 * they hand back to the vector kernels; AMX calls run both inside
 * tiles_begin/tiles_end (as the driver calls them) and outside. Nothing
 * past the tiles' rows, lanes or features is written. */
static double bf(uint16_t h) { return attn__bf16_to_float(h); }

static void bf16_products_qkt(const attn__ukernel *u, rng *r, bool bracket, double *worst) {
    enum { QK_E = 160, QK_K = 70, QK_L = 96, LDQT = QK_L + 16, LDST = QK_L + 5 };
    static uint16_t k[QK_K * (QK_E + 3)];
    static uint32_t qtp[(QK_E / 2) * LDQT];
    static float st[(QK_K + 1) * LDST];
    const int64_t E = below(r, 3) ? 32 * (1 + (int64_t)below(r, 4)) : 1 + (int64_t)below(r, QK_E);
    const int64_t nk = 1 + (int64_t)below(r, QK_K), lanes = 16 * (1 + (int64_t)below(r, 6));
    const int64_t ldk = E + (int64_t)below(r, 3), pairs = (E + 1) / 2;
    for (int64_t i = 0; i < nk * ldk; i++) k[i] = tt_half_bits(rng_normal(r), ATTN_DTYPE_BF16);
    for (int64_t i = 0; i < pairs * LDQT; i++) {
        const uint32_t lo = tt_half_bits(rng_normal(r), ATTN_DTYPE_BF16);
        const uint32_t hi = tt_half_bits(rng_normal(r), ATTN_DTYPE_BF16);
        qtp[i] = lo | (2 * (i / LDQT) + 1 < E ? hi << 16 : 0); /* an odd E's last pair: 0 */
    }
    for (int64_t i = 0; i < (QK_K + 1) * LDST; i++) st[i] = 12345.0f;
    if (bracket) u->tiles_begin();
    u->qkt_bf(qtp, LDQT, k, ldk, E, nk, lanes, st, LDST, NULL);
    if (bracket) u->tiles_end();
    for (int64_t j = 0; j <= nk; j++)
        for (int64_t x = 0; x < LDST; x++) {
            if (j == nk || x >= lanes) {
                CHECK(st[j * LDST + x] == 12345.0f, "%s: St[%lld][%lld] written past the tile",
                      u->name, (long long)j, (long long)x);
                continue;
            }
            double want = 0, mag = 0;
            for (int64_t e = 0; e < E; e++) {
                const uint32_t pair = qtp[(e / 2) * LDQT + x];
                const double t = bf(k[j * ldk + e]) * bf((uint16_t)(e % 2 ? pair >> 16 : pair));
                want += t, mag += fabs(t);
            }
            const double err = fabs(st[j * LDST + x] - want), bound = (double)(E + 1) * 0x1p-24 * mag;
            CHECK(err <= bound, "%s: E %lld nk %lld lanes %lld: St[%lld][%lld] %.9g, want %.9g",
                  u->name, (long long)E, (long long)nk, (long long)lanes, (long long)j,
                  (long long)x, st[j * LDST + x], want);
            if (mag > 0) *worst = fmax(*worst, err / (E * 0x1p-24 * mag));
        }
}

static void bf16_products_pv(const attn__ukernel *u, rng *r, bool bracket, double *worst) {
    enum { MAXR = 100, MAXP = 40, MAXEV = 80, LDPP = MAXR + 4, LDVP = MAXEV + 3, LDO = MAXEV + 5 };
    static uint32_t pp[MAXP * LDPP], vp[MAXP * LDVP];
    static float o[(MAXR + 1) * LDO], o0[(MAXR + 1) * LDO], alpha[MAXR];
    const int rows = below(r, 2) ? 16 * (1 + (int)below(r, 6)) : 1 + (int)below(r, MAXR);
    const int64_t npairs = below(r, 2) ? 16 * (1 + (int64_t)below(r, 2)) : 1 + (int64_t)below(r, MAXP);
    const int64_t Ev = below(r, 2) ? 16 * (1 + (int64_t)below(r, 5)) : 1 + (int64_t)below(r, MAXEV);
    for (int64_t i = 0; i < MAXP * LDPP; i++)
        pp[i] = tt_half_bits(rng_uniform(r), ATTN_DTYPE_BF16) |
                (uint32_t)tt_half_bits(rng_uniform(r), ATTN_DTYPE_BF16) << 16;
    for (int64_t i = 0; i < MAXP * LDVP; i++)
        vp[i] = tt_half_bits(rng_normal(r), ATTN_DTYPE_BF16) |
                (uint32_t)tt_half_bits(rng_normal(r), ATTN_DTYPE_BF16) << 16;
    for (int64_t i = 0; i < (MAXR + 1) * LDO; i++) o0[i] = o[i] = (float)rng_normal(r);
    for (int x = 0; x < rows; x++) alpha[x] = below(r, 3) ? 1.0f : (float)rng_uniform(r);
    if (bracket) u->tiles_begin();
    u->pv_bf(pp, LDPP, vp, LDVP, rows, npairs, Ev, o, LDO, alpha);
    if (bracket) u->tiles_end();
    for (int x = 0; x <= rows; x++)
        for (int64_t e = 0; e < LDO; e++) {
            const float got = o[x * LDO + e];
            if (x == rows || e >= Ev) {
                CHECK(got == o0[x * LDO + e], "%s: O[%d][%lld] written past the tile", u->name,
                      x, (long long)e);
                continue;
            }
            double want = (double)alpha[x] * o0[x * LDO + e], mag = fabs(want);
            for (int64_t p = 0; p < npairs; p++)
                for (int h = 0; h < 2; h++) {
                    const double t = bf((uint16_t)(pp[p * LDPP + x] >> 16 * h)) *
                                     bf((uint16_t)(vp[p * LDVP + e] >> 16 * h));
                    want += t, mag += fabs(t);
                }
            const double n = 2 * (double)npairs + 2, err = fabs(got - want);
            CHECK(err <= n * 0x1p-24 * mag,
                  "%s: rows %d pairs %lld Ev %lld: O[%d][%lld] %.9g, want %.9g", u->name, rows,
                  (long long)npairs, (long long)Ev, x, (long long)e, got, want);
            if (mag > 0) *worst = fmax(*worst, err / (n * 0x1p-24 * mag));
        }
}

static void bf16_product_kernels(void) {
    rng r = {harness_seed() ^ 0xa3c5};
    int paths = 0;
    for (int isa = ATTN_ISA_AVX512_BF16; isa <= ATTN_ISA_LAST; isa++) {
        const attn__ukernel *u = attn__ukernel_for((attn_isa)isa);
        if (!attn_isa_supported((attn_isa)isa) || u->qkt_bf == NULL) continue;
        double worst_s = 0, worst_o = 0;
        for (int trial = 0; trial < 300; trial++) {
            const bool bracket = u->tiles_begin != NULL && trial % 2 == 0;
            bf16_products_qkt(u, &r, bracket, &worst_s);
            bf16_products_pv(u, &r, bracket, &worst_o);
        }
        printf("  %s: worst error / (n·2^-24·sum|products|): scores %.3g, P·V %.3g\n", u->name,
               worst_s, worst_o);
        paths++;
    }
    if (paths == 0) printf("  (no bfloat16 products on this machine: skipped)\n");
}

/* ---- exact scores: float64 sums of float32 products ---- */

/* Every context's qk_direct_f gives each score as the float64 sum of its
 * float32 products rounded once to float32: within half a float32 ulp of
 * the exact dot product plus float64's summation error, for 1..20 rows
 * (past 6, a tiny call's whole head: the same bits as 6-row tiles called
 * one by one), every key and feature tail (heads past 256 take the
 * one-key loop), and writes nothing past its rows and keys. */
static void exact_scores_are_float64_sums(void) {
    rng r = {harness_seed() ^ 0xd1ec7};
    enum { MAXR = 20, TILE = 6, MAXK = 37, MAXW = 300, LDS = MAXK + 3 };
    static float q[MAXR * (MAXW + 5)], k[MAXK * (MAXW + 5)], s[MAXR * LDS], t[MAXR * LDS];
    int checked = 0;
    for (int isa = ATTN_ISA_GENERIC; isa <= ATTN_ISA_LAST; isa++) {
        if (!attn_isa_supported((attn_isa)isa)) continue;
        const attn__ukernel *kern = attn__ukernel_for((attn_isa)isa);
        for (int trial = 0; trial < 300; trial++) {
            const int rows = 1 + (int)below(&r, MAXR);
            const int64_t nk = 1 + (int64_t)below(&r, MAXK);
            const int64_t E = trial % 10 == 9 ? 257 + (int64_t)below(&r, MAXW - 256)
                                              : 1 + (int64_t)below(&r, 130);
            const int64_t ldq = E + (int64_t)below(&r, 5), ldk = E + (int64_t)below(&r, 5);
            for (int64_t i = 0; i < MAXR * (MAXW + 5); i++)
                q[i] = (float)(rng_normal(&r) * (trial % 3 == 0 ? 200.0 : 1.0));
            for (int64_t i = 0; i < MAXK * (MAXW + 5); i++) k[i] = (float)rng_normal(&r);
            for (int64_t i = 0; i < MAXR * LDS; i++) s[i] = 12345.0f;
            kern->qk_direct_f(q, ldq, k, ldk, E, rows, nk, s, LDS);
            for (int r0 = 0; r0 < rows; r0 += TILE) /* the same rows tile by tile */
                kern->qk_direct_f(q + r0 * ldq, ldq, k, ldk, E, rows - r0 < TILE ? rows - r0 : TILE,
                                  nk, t + r0 * LDS, LDS);
            for (int i = 0; i < rows; i++)
                CHECK(memcmp(s + i * LDS, t + i * LDS, sizeof(float) * (size_t)nk) == 0,
                      "%s rows %d E %lld nk %lld: row %d differs from its tile's call", kern->name,
                      rows, (long long)E, (long long)nk, i);
            for (int i = 0; i < MAXR; i++)
                for (int64_t j = 0; j < LDS; j++) {
                    const float got = s[i * LDS + j];
                    if (i >= rows || j >= nk) {
                        CHECK(got == 12345.0f, "%s: wrote row %d key %lld (rows %d, nk %lld)",
                              kern->name, i, (long long)j, rows, (long long)nk);
                        continue;
                    }
                    long double exact = 0;
                    double mag = 0;
                    for (int64_t e = 0; e < E; e++) {
                        const double pr = (double)q[i * ldq + e] * (double)k[j * ldk + e];
                        exact += pr;
                        mag += fabs(pr);
                    }
                    const double want = (double)exact;
                    const double bound = 0.5 * (nextafterf((float)fabs(want), INFINITY) -
                                                (float)fabs(want)) +
                                         (double)E * 0x1p-52 * mag;
                    CHECK(fabs((double)got - want) <= bound,
                          "%s rows %d E %lld nk %lld: score (%d, %lld) %.9g, want %.17g", kern->name,
                          rows, (long long)E, (long long)nk, i, (long long)j, (double)got, want);
                    checked++;
                }
        }
    }
    printf("  %d scores compared\n", checked);
}
/* Every context's pack_qt_f is the transpose its contract names: Qt[e·ldqt
 * + r] = scale · q[r·rs + e·cs] for r < nr, zeros up to lanes, nothing
 * written past lanes or E; unit and other column strides, every tail of
 * rows and of E, scale 1 (a copy: the bits of the portable transpose, which
 * the kernels' results depend on) and not. */
static void packed_queries_are_the_transpose(void) {
    rng r = {harness_seed() ^ 0x9ac7};
    enum { MAXN = 48, MAXW = 140, LD = MAXN + 5 };
    static float q[MAXN * (2 * MAXW + 8)], qt[(MAXW + 1) * LD];
    int checked = 0;
    for (int isa = ATTN_ISA_GENERIC; isa <= ATTN_ISA_LAST; isa++) {
        if (!attn_isa_supported((attn_isa)isa)) continue;
        const attn__ukernel *kern = attn__ukernel_for((attn_isa)isa);
        if (kern->pack_qt_f == NULL) continue;
        for (int trial = 0; trial < 300; trial++) {
            const int64_t lanes = 16 * (1 + (int64_t)below(&r, 3)); /* lane_step multiples */
            const int64_t nr = (int64_t)below(&r, (uint64_t)lanes + 1);
            const int64_t E = 1 + (int64_t)below(&r, MAXW);
            const int64_t cs = trial % 4 == 3 ? 2 : 1, rs = cs * E + (int64_t)below(&r, 8);
            const int64_t ldqt = lanes + (int64_t)below(&r, 6);
            const float scale = trial % 2 ? 1.0f : (float)(0.1 + rng_uniform(&r));
            for (size_t i = 0; i < sizeof q / sizeof *q; i++) q[i] = (float)rng_normal(&r);
            for (size_t i = 0; i < sizeof qt / sizeof *qt; i++) qt[i] = 12345.0f;
            kern->pack_qt_f(q, rs, cs, nr, E, scale, qt, lanes, ldqt);
            for (int64_t e = 0; e <= E; e++) /* row E and columns past lanes: untouched */
                for (int64_t c = 0; c < ldqt; c++) {
                    const float got = qt[e * ldqt + c];
                    if (e == E || c >= lanes) {
                        CHECK(got == 12345.0f, "%s: wrote (%lld, %lld), E %lld lanes %lld",
                              kern->name, (long long)e, (long long)c, (long long)E,
                              (long long)lanes);
                        continue;
                    }
                    const float want = c < nr ? q[c * rs + e * cs] * scale : 0.0f;
                    CHECK(memcmp(&got, &want, sizeof got) == 0,
                          "%s nr %lld E %lld cs %lld: Qt(%lld, %lld) %.9g, want %.9g", kern->name,
                          (long long)nr, (long long)E, (long long)cs, (long long)e, (long long)c,
                          (double)got, (double)want);
                    checked++;
                }
        }
    }
    printf("  %d packed values compared\n", checked);
}
HARNESS_MAIN(T(masked_out_never_reaches_output), T(visible_nan_poisons_its_rows),
             T(zero_weight_keys_contribute_nothing), T(fully_masked_rows_give_zero),
             T(huge_logits_do_not_overflow), T(byte_count_overflow_rejected),
             T(rows_of_more_than_2_24_keys),
             T(float16_outputs_round_at_the_range), T(output_rows_round_as_attn_store),
             T(gemm_rows_round_as_float_to_bf16),
             T(bf16_hidden_special_values), T(overflowing_float32_scores),
             T(bf16_softmax_weights), T(bf16_product_kernels), T(exact_scores_are_float64_sums),
             T(packed_queries_are_the_transpose))
