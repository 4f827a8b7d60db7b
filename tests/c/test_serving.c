/*
 * test_serving.c — attn_sdpa_varlen and attn_sdpa_kvcache.
 *
 * Each call is checked against an oracle written here from the header's
 * formula (float64, one row at a time, no library code): packed sequences
 * unpacked, paged caches gathered through the block table, every modifier
 * (window, ALiBi, softcap, sinks) applied as attn.h words it. On the
 * reference path (ATTN_ISA_REF) the results must also equal attn_sdpa run
 * per sequence on the unpacked views bit for bit; on every path a paged
 * cache of small pages must give the bits of the same cache laid out
 * contiguously.
 * Appends are checked byte for byte over the whole cache, guard bytes
 * included. Every path the machine runs is tested.
 */
#include "core/internal.h" /* the 16-bit formats and their rounding: what a cache holds */
#include "kernels/exp2.h"     /* the bfloat16 weights' fit */
#include "testutil.h"

enum { MAXB = 8, GUARD = 64 /* elements of guard before and after a cache */ };

/* ---- paths ---- */

static attn_isa PATHS[8];
static int NPATHS;

static void find_paths(void) {
    NPATHS = 0;
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++)
        if (attn_isa_supported((attn_isa)i)) PATHS[NPATHS++] = (attn_isa)i;
}

/* Random cases per path and test (ATTN_SERVING_CASES overrides). */
static int cases_per_path(int usual) {
    const char *env = getenv("ATTN_SERVING_CASES");
    return env != NULL ? atoi(env) : usual;
}

/* ---- elements of any dtype the serving calls read ---- */

static double elem_get(const attn_tensor *t, int64_t off) {
    switch (t->dtype) {
    case ATTN_DTYPE_F32: return ((const float *)t->data)[off];
    case ATTN_DTYPE_F64: return ((const double *)t->data)[off];
    case ATTN_DTYPE_F16: return attn__f16_to_float(((const uint16_t *)t->data)[off]);
    case ATTN_DTYPE_BF16: return attn__bf16_to_float(((const uint16_t *)t->data)[off]);
    case ATTN_DTYPE_I32: return ((const int32_t *)t->data)[off];
    default: return NAN;
    }
}

/* Stores x as a KV cache holds it: rounded once to the 16-bit format
 * (through float32 rounded to odd, which keeps the one rounding exact). */
static void elem_set(const attn_tensor *t, int64_t off, double x) {
    switch (t->dtype) {
    case ATTN_DTYPE_F32: ((float *)t->data)[off] = (float)x; break;
    case ATTN_DTYPE_F64: ((double *)t->data)[off] = x; break;
    case ATTN_DTYPE_F16:
        ((uint16_t *)t->data)[off] = attn__float_to_f16(attn__float_round_to_odd(x));
        break;
    case ATTN_DTYPE_BF16:
        ((uint16_t *)t->data)[off] = attn__float_to_bf16(attn__float_round_to_odd(x));
        break;
    default: break;
    }
}

static double get3(const attn_tensor *t, int64_t a, int64_t b, int64_t c) {
    return elem_get(t, a * t->strides[0] + b * t->strides[1] + c * t->strides[2]);
}

/* ---- the oracle ---- */

/* What the oracle needs of attn_sdpa_params, as plain numbers. */
typedef struct mods {
    attn_causal causal;
    double scale;
    int64_t wl, wr;      /* window sides, -1 unbounded */
    double softcap;      /* 0: none */
    const double *alibi; /* slope of (sequence, head) at [seq * alibi_seq_stride + head], or NULL */
    int64_t alibi_seq_stride;
    const double *sinks; /* (Hq,) or NULL */
} mods;

/* Row i of a sequence of L queries against its S keys (K: S x E, V: S x
 * Ev, dense) for head h of sequence n: out (Ev) and the returned lse. */
static double oracle_row(const mods *m, int64_t n, int64_t h, const double *q, const double *K,
                         const double *V, int64_t L, int64_t S, int64_t E, int64_t Ev, int64_t i,
                         double *out) {
    const int64_t diag = i + S - L; /* bottom-right diagonal: window and ALiBi measure from it */
    double *s = malloc(sizeof(double) * (size_t)(S + 1));
    double max = -INFINITY;
    for (int64_t j = 0; j < S; j++) {
        bool seen = true;
        if (m->causal == ATTN_CAUSAL_TOP_LEFT && j > i) seen = false;
        if (m->causal == ATTN_CAUSAL_BOTTOM_RIGHT && j > diag) seen = false;
        if (m->wl >= 0 && j < diag - m->wl) seen = false;
        if (m->wr >= 0 && j > diag + m->wr) seen = false;
        s[j] = -INFINITY;
        if (!seen) continue;
        double dot = 0;
        for (int64_t e = 0; e < E; e++) dot += q[e] * K[j * E + e];
        double x = m->scale * dot;
        if (m->softcap > 0) x = m->softcap * tanh(x / m->softcap);
        if (m->alibi != NULL) x -= m->alibi[n * m->alibi_seq_stride + h] * fabs((double)(diag - j));
        s[j] = x;
        if (x > max) max = x;
    }
    const double sink = m->sinks != NULL ? m->sinks[h] : -INFINITY;
    if (sink > max) max = sink;
    double sum = sink == -INFINITY ? 0.0 : exp(sink - max);
    for (int64_t j = 0; j < S; j++)
        if (s[j] != -INFINITY) sum += exp(s[j] - max);
    for (int64_t e = 0; e < Ev; e++) out[e] = 0;
    if (max == -INFINITY) { /* no key and no sink */
        free(s);
        return -INFINITY;
    }
    for (int64_t j = 0; j < S; j++) {
        if (s[j] == -INFINITY) continue;
        const double w = exp(s[j] - max) / sum;
        for (int64_t e = 0; e < Ev; e++) out[e] += w * V[j * Ev + e];
    }
    free(s);
    return max + log(sum);
}

/* Error bounds: u per operation, for sums over E products and S keys. */
static double tol_of(attn_dtype dt, int64_t E, int64_t S, double mag) {
    const bool f64 = dt == ATTN_DTYPE_F64, half = dt == ATTN_DTYPE_F16 || dt == ATTN_DTYPE_BF16;
    const double u = f64 ? 0x1p-53 : 0x1p-24; /* 16-bit calls compute in float32 */
    /* 16-bit: the output's rounding (half an ulp, relative 2^-8 in
     * bfloat16, 2^-11 in float16) and, for bfloat16 products, each
     * weight's (2^-8, and exp2.h's bfloat16 fit in the weights and in l:
     * of sum P|V| / l <= vmax) */
    const double round =
        dt == ATTN_DTYPE_BF16 ? 2 * 0x1p-8 + 2 * ATTN__EXP2F_BF16_ERR : half ? 0x1p-11 : 0;
    return 8 * u * (double)(E + S + 16) * (1 + mag) + round * (1 + mag);
}

/* ---- modifiers drawn for a case ---- */

/* ALiBi slopes (B, Hq) or (Hq,), sinks (Hq,): their tensors and numbers. */
typedef struct mod_data {
    double alibi[MAXB * 16], sinks[16];
    float alibi32[MAXB * 16];
    attn_tensor talibi, tsinks;
} mod_data;

/* Fills p and m with modifiers drawn from r (each about half the time)
 * for B sequences of Hq heads; `on` = 0 draws none. */
static void draw_mods(rng *r, bool on, int64_t B, int64_t Hq, double E, mod_data *d,
                      attn_sdpa_params *p, mods *m) {
    m->causal = p->causal;
    m->scale = p->has_scale ? p->scale : 1.0 / sqrt(E);
    m->wl = m->wr = -1;
    m->softcap = 0;
    m->alibi = m->sinks = NULL;
    if (!on) return;
    if (rng_int(r, 0, 1)) p->window_left = m->wl = rng_int(r, 0, 12);
    if (rng_int(r, 0, 2) == 0) p->window_right = m->wr = rng_int(r, 0, 6);
    if (rng_int(r, 0, 1)) p->softcap = m->softcap = (double)rng_int(r, 1, 8) / 2;
    if (rng_int(r, 0, 1)) {
        const bool per_seq = rng_int(r, 0, 1);
        const int64_t n = per_seq ? B * Hq : Hq;
        for (int64_t x = 0; x < n; x++) {
            d->alibi32[x] = (float)(rng_uniform(r) * 0.5);
            d->alibi[x] = d->alibi32[x];
        }
        const int64_t shape[2] = {B, Hq};
        attn_tensor_init(&d->talibi, d->alibi32, ATTN_DTYPE_F32, per_seq ? 2 : 1,
                         per_seq ? shape : shape + 1);
        p->alibi_slopes = &d->talibi;
        m->alibi = d->alibi;
        m->alibi_seq_stride = per_seq ? Hq : 0;
    }
    if (rng_int(r, 0, 1)) {
        for (int64_t h = 0; h < Hq; h++) d->sinks[h] = rng_normal(r);
        attn_tensor_init(&d->tsinks, d->sinks, ATTN_DTYPE_F64, 1, &Hq);
        p->sinks = &d->tsinks;
        m->sinks = d->sinks;
    }
}

static const attn_causal CAUSALS[3] = {ATTN_CAUSAL_NONE, ATTN_CAUSAL_TOP_LEFT,
                                       ATTN_CAUSAL_BOTTOM_RIGHT};

/* Whether two numbers are the same bits' worth: equal, or both NaN. */
static bool same_value(double a, double b) { return a == b || (isnan(a) && isnan(b)); }

/* ======================================================================== */
/* Variable-length batches                                                  */
/* ======================================================================== */

typedef struct varlen_case {
    attn_dtype dt;
    int64_t B, Hq, Hkv, E, Ev, total_q, total_k, max_q, max_k;
    int32_t cu_q[MAXB + 1], cu_k[MAXB + 1];
    attn_tensor tcu_q, tcu_k;
    test_tensor q, k, v, out, lse; /* (total_q, Hq, E), (total_k, Hkv, E / Ev), (Hq, total_q) */
    bool with_lse;
    attn_sdpa_params p;
    mods m;
    mod_data md;
} varlen_case;

static const double SENTINEL = 7.25; /* what out and lse hold before a call */

/* Offsets for B sequences of random lengths (some empty, some past one
 * key block); returns the total. */
static int64_t draw_offsets(rng *r, int64_t B, int64_t most, int32_t *cu, int64_t *longest) {
    cu[0] = 0;
    *longest = 0;
    for (int64_t n = 0; n < B; n++) {
        const int64_t len = rng_int(r, 0, 7) == 0 ? 0 : rng_int(r, 0, 4) == 0 ? rng_int(r, 1, most) : rng_int(r, 1, 24);
        cu[n + 1] = (int32_t)(cu[n] + len);
        if (len > *longest) *longest = len;
    }
    return cu[B];
}

/* Tensors for the sizes and offsets set in c: random layouts, out and lse
 * full of the sentinel, default params. */
static void varlen_build(varlen_case *c, rng *r) {
    const int64_t qs[3] = {c->total_q, c->Hq, c->E}, ks[3] = {c->total_k, c->Hkv, c->E},
                  vs[3] = {c->total_k, c->Hkv, c->Ev}, os[3] = {c->total_q, c->Hq, c->Ev},
                  ls[2] = {c->Hq, c->total_q}, nb = c->B + 1;
    tt_make(&c->q, r, c->dt, 3, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&c->k, r, c->dt, 3, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&c->v, r, c->dt, 3, vs, LAYOUT_RANDOM, 1, 0);
    tt_make_output(&c->out, r, c->dt, 3, os, LAYOUT_RANDOM);
    tt_fill(&c->out.t, SENTINEL);
    tt_make_output(&c->lse, r, rng_int(r, 0, 1) ? ATTN_DTYPE_F64 : c->dt, 2, ls, LAYOUT_RANDOM);
    tt_fill(&c->lse.t, SENTINEL);
    attn_tensor_init(&c->tcu_q, c->cu_q, ATTN_DTYPE_I32, 1, &nb);
    attn_tensor_init(&c->tcu_k, c->cu_k, ATTN_DTYPE_I32, 1, &nb);
    attn_sdpa_params_init(&c->p);
    c->m.causal = ATTN_CAUSAL_NONE;
    c->m.scale = 1.0 / sqrt((double)c->E);
    c->m.wl = c->m.wr = -1;
}

static void varlen_make(varlen_case *c, rng *r, attn_dtype dt, bool with_mods) {
    memset(c, 0, sizeof *c);
    c->dt = dt;
    c->B = rng_int(r, 1, MAXB);
    c->Hkv = rng_int(r, 1, 2);
    c->Hq = c->Hkv * rng_int(r, 1, 3);
    c->E = rng_int(r, 0, 3) == 0 ? 64 : rng_int(r, 1, 20);
    c->Ev = rng_int(r, 0, 3) == 0 ? c->E : rng_int(r, 1, 20);
    int64_t longest_q, longest_k;
    c->total_q = draw_offsets(r, c->B, 150, c->cu_q, &longest_q) + rng_int(r, 0, 3);
    c->total_k = draw_offsets(r, c->B, 200, c->cu_k, &longest_k) + rng_int(r, 0, 3);
    if (c->total_q == 0) c->total_q = 1; /* a tensor has rows; no sequence holds this one */
    if (c->total_k == 0) c->total_k = 1;
    c->max_q = longest_q + (rng_int(r, 0, 2) == 0 ? rng_int(r, 1, 40) : 0);
    c->max_k = longest_k + (rng_int(r, 0, 2) == 0 ? rng_int(r, 1, 40) : 0);
    varlen_build(c, r);
    c->with_lse = rng_int(r, 0, 2) != 0;
    c->p.causal = CAUSALS[rng_int(r, 0, 2)];
    if (rng_int(r, 0, 3) == 0) {
        c->p.has_scale = 1;
        c->p.scale = rng_uniform(r) - 0.25;
    }
    draw_mods(r, with_mods, c->B, c->Hq, (double)c->E, &c->md, &c->p, &c->m);
}

/* A fixed batch: B sequences of the given lengths, (Hq, Hkv, E, Ev). */
static void varlen_fixed(varlen_case *c, rng *r, attn_dtype dt, int64_t B, const int *lq,
                         const int *lk, int64_t Hq, int64_t Hkv, int64_t E, int64_t Ev) {
    memset(c, 0, sizeof *c);
    c->dt = dt;
    c->B = B;
    c->Hq = Hq;
    c->Hkv = Hkv;
    c->E = E;
    c->Ev = Ev;
    for (int64_t n = 0; n < B; n++) {
        c->cu_q[n + 1] = c->cu_q[n] + lq[n];
        c->cu_k[n + 1] = c->cu_k[n] + lk[n];
        c->max_q = lq[n] > c->max_q ? lq[n] : c->max_q;
        c->max_k = lk[n] > c->max_k ? lk[n] : c->max_k;
    }
    c->total_q = c->cu_q[B] > 0 ? c->cu_q[B] : 1;
    c->total_k = c->cu_k[B] > 0 ? c->cu_k[B] : 1;
    varlen_build(c, r);
    c->with_lse = true;
}

/* out and lse, dense, for comparing two calls' bits. */
static double *varlen_result(const varlen_case *c) {
    double *o = tt_dense(&c->out.t), *l = tt_dense(&c->lse.t);
    const int64_t no = attn_tensor_numel(&c->out.t), nl = attn_tensor_numel(&c->lse.t);
    o = realloc(o, sizeof(double) * (size_t)(no + nl));
    memcpy(o + no, l, sizeof(double) * (size_t)nl);
    free(l);
    return o;
}

static bool same_result(const varlen_case *c, const double *a, const double *b) {
    const int64_t n = attn_tensor_numel(&c->out.t) + attn_tensor_numel(&c->lse.t);
    for (int64_t i = 0; i < n; i++)
        if (!same_value(a[i], b[i])) return false;
    return true;
}

static void varlen_free(varlen_case *c) {
    tt_free(&c->q);
    tt_free(&c->k);
    tt_free(&c->v);
    tt_free(&c->out);
    tt_free(&c->lse);
}

static attn_status varlen_call(varlen_case *c) {
    return attn_sdpa_varlen(&c->q.t, &c->k.t, &c->v.t, &c->tcu_q, &c->tcu_k, c->max_q, c->max_k,
                            &c->p, &c->out.t, c->with_lse ? &c->lse.t : NULL);
}

/* Rows [r0, r0 + n) of head h of a packed tensor, dense (n x width). */
static double *gather_packed(const attn_tensor *t, int64_t r0, int64_t n, int64_t h) {
    const int64_t width = t->shape[2];
    double *x = malloc(sizeof(double) * (size_t)(n * width + 1));
    for (int64_t i = 0; i < n; i++)
        for (int64_t e = 0; e < width; e++) x[i * width + e] = get3(t, r0 + i, h, e);
    return x;
}

/* out and lse against the oracle, sequence by sequence; rows no sequence
 * holds keep the sentinel. Returns the worst error / tolerance. */
static double varlen_vs_oracle(const varlen_case *c, const char *what) {
    const attn_isa isa = attn_get_isa();
    double worst = 0, *o = malloc(sizeof(double) * (size_t)c->Ev);
    for (int64_t n = 0; n < c->B; n++) {
        const int64_t q0 = c->cu_q[n], L = c->cu_q[n + 1] - q0;
        const int64_t k0 = c->cu_k[n], S = c->cu_k[n + 1] - k0;
        for (int64_t h = 0; h < c->Hq && L > 0; h++) {
            const int64_t hk = h / (c->Hq / c->Hkv);
            double *Q = gather_packed(&c->q.t, q0, L, h), *K = gather_packed(&c->k.t, k0, S, hk),
                   *V = gather_packed(&c->v.t, k0, S, hk);
            double vmax = 0;
            for (int64_t x = 0; x < S * c->Ev; x++) vmax = fmax(vmax, fabs(V[x]));
            for (int64_t i = 0; i < L; i++) {
                const double lse = oracle_row(&c->m, n, h, Q + i * c->E, K, V, L, S, c->E, c->Ev,
                                              i, o);
                const double tol = tol_of(c->dt, c->E, S, vmax), ltol = tol_of(c->dt, c->E, S, fabs(lse));
                for (int64_t e = 0; e < c->Ev; e++) {
                    const double got = get3(&c->out.t, q0 + i, h, e), err = fabs(got - o[e]);
                    CHECK(err <= tol, "%s (%s): sequence %lld head %lld row %lld col %lld: %.9g, "
                          "expected %.9g", what, attn_isa_name(isa), (long long)n, (long long)h,
                          (long long)i, (long long)e, got, o[e]);
                    worst = fmax(worst, err / tol);
                }
                if (!c->with_lse) continue;
                const double got = elem_get(&c->lse.t, h * c->lse.t.strides[0] +
                                                           (q0 + i) * c->lse.t.strides[1]);
                CHECK(same_value(got, lse) || fabs(got - lse) <= ltol,
                      "%s (%s): lse of sequence %lld head %lld row %lld: %.12g, expected %.12g",
                      what, attn_isa_name(isa), (long long)n, (long long)h, (long long)i, got, lse);
            }
            free(Q);
            free(K);
            free(V);
        }
    }
    for (int64_t t = c->cu_q[c->B]; t < c->total_q; t++) /* rows past the last sequence */
        for (int64_t h = 0; h < c->Hq; h++) {
            for (int64_t e = 0; e < c->Ev; e++)
                CHECK(get3(&c->out.t, t, h, e) == SENTINEL, "%s: out row %lld (no sequence's) "
                      "was written", what, (long long)t);
            CHECK(elem_get(&c->lse.t, h * c->lse.t.strides[0] + t * c->lse.t.strides[1]) ==
                      SENTINEL, "%s: lse of row %lld (no sequence's) was written", what, (long long)t);
        }
    free(o);
    return worst;
}

/* A packed operand's rows of one sequence as an attn_sdpa view (H, n, width). */
static attn_tensor unpacked(const attn_tensor *t, int64_t r0, int64_t n) {
    attn_tensor x = *t;
    x.data = (char *)t->data + r0 * t->strides[0] * (int64_t)attn_dtype_size(t->dtype);
    x.shape[0] = t->shape[1];
    x.shape[1] = n;
    x.strides[0] = t->strides[1];
    x.strides[1] = t->strides[0];
    return x;
}

/* On the reference path: each sequence through attn_sdpa on its unpacked
 * views gives the same bits (the same float64 rows, rounded once). */
static void varlen_vs_sdpa(const varlen_case *c, const char *what) {
    for (int64_t n = 0; n < c->B; n++) {
        const int64_t q0 = c->cu_q[n], L = c->cu_q[n + 1] - q0;
        const int64_t k0 = c->cu_k[n], S = c->cu_k[n + 1] - k0;
        if (L == 0 || S == 0) continue; /* attn_sdpa takes no empty tensor; the oracle covers them */
        attn_tensor q = unpacked(&c->q.t, q0, L), k = unpacked(&c->k.t, k0, S),
                    v = unpacked(&c->v.t, k0, S), out, lse, alibi;
        const int64_t os[3] = {c->Hq, L, c->Ev};
        void *ob = malloc((size_t)(c->Hq * L * c->Ev) * 8), *lb = malloc((size_t)(c->Hq * L) * 8);
        attn_tensor_init(&out, ob, c->dt, 3, os);
        attn_tensor_init(&lse, lb, c->lse.t.dtype, 2, os);
        attn_sdpa_params p = c->p;
        p.enable_gqa = 1;
        if (p.alibi_slopes != NULL && p.alibi_slopes->rank == 2) { /* this sequence's row */
            alibi = *p.alibi_slopes;
            alibi.rank = 1;
            alibi.shape[0] = c->Hq;
            alibi.strides[0] = 1;
            alibi.data = (float *)alibi.data + n * c->Hq;
            p.alibi_slopes = &alibi;
        }
        CHECK_OK(attn_sdpa(&q, &k, &v, &p, &out, NULL, c->with_lse ? &lse : NULL));
        bool same = true;
        for (int64_t h = 0; h < c->Hq; h++)
            for (int64_t i = 0; i < L; i++) {
                for (int64_t e = 0; e < c->Ev; e++)
                    same &= same_value(get3(&out, h, i, e), get3(&c->out.t, q0 + i, h, e));
                if (c->with_lse)
                    same &= same_value(elem_get(&lse, h * L + i),
                                       elem_get(&c->lse.t, h * c->lse.t.strides[0] +
                                                               (q0 + i) * c->lse.t.strides[1]));
            }
        CHECK(same, "%s: sequence %lld differs from attn_sdpa on its unpacked views", what,
              (long long)n);
        free(ob);
        free(lb);
    }
}

/* Random packed batches on every path, each against the oracle (and, on
 * the reference path, against attn_sdpa per sequence, bitwise). */
static void varlen_cases(bool with_mods, int count) {
    rng r = {harness_seed() ^ (with_mods ? 0x5e41 : 0x7a11)};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        double worst = 0;
        for (int i = 0; i < count; i++) {
            varlen_case c;
            varlen_make(&c, &r, rng_int(&r, 0, 2) ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64, with_mods);
            char what[64];
            snprintf(what, sizeof what, "varlen case %d", i);
            attn_status st = varlen_call(&c);
            CHECK(st == ATTN_OK, "%s: %s", what, attn_last_error());
            if (st == ATTN_OK) {
                worst = fmax(worst, varlen_vs_oracle(&c, what));
                if (PATHS[pi] == ATTN_ISA_REF) varlen_vs_sdpa(&c, what);
            }
            varlen_free(&c);
        }
        printf("  %-8s %d cases, worst error %.3f of the tolerance\n", attn_isa_name(PATHS[pi]),
               count, worst);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

static void varlen_random(void) { varlen_cases(false, cases_per_path(60)); }
static void varlen_modifiers(void) { varlen_cases(true, cases_per_path(60)); }

/* Empty batches and sequences, queries without keys, max_seqlen rounded up,
 * thread counts and dropout. */
static void varlen_edges(void) {
    rng r = {harness_seed() ^ 0xed9e};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        varlen_case c;
        /* No sequence at all (cu_seqlens = {0}): nothing is written. */
        varlen_fixed(&c, &r, ATTN_DTYPE_F32, 0, NULL, NULL, 2, 1, 8, 8);
        CHECK_OK(varlen_call(&c));
        varlen_vs_oracle(&c, "no sequence");
        varlen_free(&c);
        /* Every sequence empty. */
        const int zeros[3] = {0, 0, 0};
        varlen_fixed(&c, &r, ATTN_DTYPE_F64, 3, zeros, zeros, 2, 2, 8, 4);
        CHECK_OK(varlen_call(&c));
        varlen_vs_oracle(&c, "empty sequences");
        varlen_free(&c);
        /* Queries with no key: out 0, lse -inf; next to a sequence with keys. */
        const int lq[3] = {3, 2, 0}, lk[3] = {0, 4, 5};
        varlen_fixed(&c, &r, ATTN_DTYPE_F32, 3, lq, lk, 4, 2, 8, 8);
        CHECK_OK(varlen_call(&c));
        varlen_vs_oracle(&c, "queries without keys");
        CHECK(get3(&c.out.t, 0, 0, 0) == 0.0 && elem_get(&c.lse.t, 0) == -INFINITY,
              "a row without keys: out %g, lse %g", get3(&c.out.t, 0, 0, 0), elem_get(&c.lse.t, 0));
        varlen_free(&c);

        /* An empty sequence at the end of one-row tensors starts at row 1;
         * any stride is legal on a dimension of size 1 and must not scale it. */
        const int lq1[2] = {0, 1}, lk1[2] = {1, 0}; /* sequence 1: a query, no key */
        varlen_fixed(&c, &r, ATTN_DTYPE_F32, 2, lq1, lk1, 2, 2, 4, 4);
        test_tensor *packed[3] = {&c.q, &c.k, &c.v};
        for (int i = 0; i < 3; i++) packed[i]->t.strides[0] = INT64_MAX;
        CHECK_OK(varlen_call(&c));
        varlen_vs_oracle(&c, "an empty last sequence");
        varlen_free(&c);

        /* The same bits with max_seqlen rounded up, on 1 and 2 threads. */
        const int lq2[3] = {5, 130, 17}, lk2[3] = {200, 3, 64};
        varlen_fixed(&c, &r, ATTN_DTYPE_F32, 3, lq2, lk2, 4, 2, 32, 16);
        c.p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
        c.m.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
        attn_set_num_threads(1);
        CHECK_OK(varlen_call(&c));
        varlen_vs_oracle(&c, "three sequences");
        double *first = varlen_result(&c);
        c.max_q += 1000;
        c.max_k += 3;
        attn_set_num_threads(2);
        CHECK_OK(varlen_call(&c));
        double *second = varlen_result(&c);
        CHECK(same_result(&c, first, second), "%s: max_seqlen or the thread count changed bits",
              attn_isa_name(PATHS[pi]));
        free(second);
        attn_set_num_threads(0);

        /* Dropout: reproducible, and p = 1 leaves out = 0 (lse is before dropout). */
        c.p.dropout_p = 0.5;
        c.p.seed = 99;
        CHECK_OK(varlen_call(&c));
        double *d1 = varlen_result(&c);
        CHECK_OK(varlen_call(&c));
        double *d2 = varlen_result(&c);
        CHECK(same_result(&c, d1, d2), "dropout is not reproducible");
        c.p.dropout_p = 1.0;
        CHECK_OK(varlen_call(&c));
        for (int64_t t = 0; t < c.cu_q[3]; t++)
            CHECK(get3(&c.out.t, t, 1, 3) == 0.0, "dropout_p = 1 left %g", get3(&c.out.t, t, 1, 3));
        free(d1);
        free(d2);
        free(first);
        varlen_free(&c);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ======================================================================== */
/* KV caches                                                                */
/* ======================================================================== */

/* A cache over its own buffer with GUARD elements before and after; every
 * byte is 0xFF (NaN in each float dtype) until written, so a read of a row
 * that is not filled poisons the output. */
typedef struct cache_buf {
    attn_tensor t;
    unsigned char *alloc;
    size_t bytes;
} cache_buf;

static void cache_make(cache_buf *c, rng *r, attn_dtype dt, const int64_t shape[4]) {
    memset(c, 0, sizeof *c);
    const int64_t pad = rng_int(r, 0, 2);
    int64_t *s = c->t.strides;
    s[3] = 1;
    if (rng_int(r, 0, 3) == 0) { /* head-major in memory: (blocks, H, rows, E) */
        s[1] = shape[3] + pad;
        s[2] = shape[1] * s[1];
        s[0] = shape[2] * s[2] + rng_int(r, 0, 5);
    } else {
        s[2] = shape[3] + pad;
        s[1] = shape[2] * s[2];
        s[0] = shape[1] * s[1] + rng_int(r, 0, 5);
    }
    int64_t span = 1;
    for (int d = 0; d < 4; d++) span += s[d] * (shape[d] - 1);
    const size_t es = attn_dtype_size(dt);
    c->bytes = (size_t)(span + 2 * GUARD) * es;
    c->alloc = malloc(c->bytes);
    memset(c->alloc, 0xFF, c->bytes);
    c->t.data = c->alloc + GUARD * es;
    c->t.dtype = dt;
    c->t.rank = 4;
    memcpy(c->t.shape, shape, 4 * sizeof(int64_t));
}

/* A copy of a cache (its buffer and a view at the same offsets). */
static void cache_copy(cache_buf *dst, const cache_buf *src) {
    *dst = *src;
    dst->alloc = malloc(src->bytes);
    memcpy(dst->alloc, src->alloc, src->bytes);
    dst->t.data = dst->alloc + ((unsigned char *)src->t.data - src->alloc);
}

typedef struct kv_case {
    attn_dtype dt, cdt;                /* q's dtype, the caches' */
    int64_t B, Lq, Hq, Hkv, E, Ev, Lnew;
    int64_t bs;                        /* block size; 0: contiguous */
    int64_t smax;                      /* rows per sequence a contiguous cache holds */
    int64_t num_blocks, max_blocks;
    int32_t seqlens[MAXB];
    int32_t *table;                    /* (B, max_blocks) dense: what the view holds */
    int32_t *table_store;              /* the view's buffer: ids in every other int32 */
    attn_tensor tseq, ttable;
    cache_buf kc, vc;
    test_tensor q, k, v, out, lse;     /* (B, Lq, Hq, E), (B, Lnew, Hkv, E / Ev), (B, Hq, Lq) */
    bool with_lse, with_seqlens, borrowed; /* borrowed: q, k, v belong to another case */
    attn_sdpa_params p;
    mods m;
    mod_data md;
} kv_case;

/* Element (b, r, h, e) of sequence b's row r in a cache laid out like c's. */
static int64_t kv_at(const kv_case *c, const attn_tensor *t, int64_t b, int64_t r, int64_t h,
                     int64_t e) {
    const int64_t *s = t->strides, head = h * s[2] + e * s[3];
    if (c->bs == 0) return b * s[0] + r * s[1] + head;
    return (int64_t)c->table[b * c->max_blocks + r / c->bs] * s[0] + (r % c->bs) * s[1] + head;
}

static double get4(const attn_tensor *t, int64_t a, int64_t b, int64_t c, int64_t d) {
    return elem_get(t, a * t->strides[0] + b * t->strides[1] + c * t->strides[2] + d * t->strides[3]);
}

/* Rows each sequence holds after the call. */
static int64_t kv_len(const kv_case *c, int64_t b) {
    if (!c->with_seqlens) return c->bs ? c->max_blocks * c->bs : c->smax;
    return c->seqlens[b] + c->Lnew;
}

/* The block table: each sequence's blocks drawn from a shuffled list of
 * ids; entries past the rows in use hold ids out of range (never read). */
static void kv_table(kv_case *c, rng *r) {
    int64_t need[MAXB], total = 0;
    c->max_blocks = c->with_seqlens ? 1 : rng_int(r, 1, 3); /* without: every row is filled */
    for (int64_t b = 0; b < c->B; b++) {
        need[b] = c->with_seqlens ? (kv_len(c, b) + c->bs - 1) / c->bs : c->max_blocks;
        total += need[b];
        if (need[b] > c->max_blocks) c->max_blocks = need[b];
    }
    if (c->with_seqlens) c->max_blocks += rng_int(r, 0, 2);
    c->num_blocks = total + rng_int(r, 0, 3);
    if (c->num_blocks == 0) c->num_blocks = 1;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)c->num_blocks);
    for (int64_t i = 0; i < c->num_blocks; i++) ids[i] = (int32_t)i;
    for (int64_t i = c->num_blocks - 1; i > 0; i--) {
        const int64_t j = rng_int(r, 0, i);
        const int32_t x = ids[i];
        ids[i] = ids[j];
        ids[j] = x;
    }
    c->table = malloc(sizeof(int32_t) * (size_t)(c->B * c->max_blocks));
    c->table_store = malloc(sizeof(int32_t) * (size_t)(2 * c->B * c->max_blocks));
    int64_t next = 0;
    const int32_t junk[4] = {-1, (int32_t)c->num_blocks, INT32_MAX, INT32_MIN};
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t t = 0; t < c->max_blocks; t++) {
            int32_t *slot = &c->table[b * c->max_blocks + t];
            *slot = t < need[b] ? ids[next++] : junk[rng_int(r, 0, 3)];
            c->table_store[2 * (b * c->max_blocks + t)] = *slot;
            c->table_store[2 * (b * c->max_blocks + t) + 1] = -7;
        }
    free(ids);
    c->ttable.data = c->table_store;
    c->ttable.dtype = ATTN_DTYPE_I32;
    c->ttable.rank = 2;
    c->ttable.shape[0] = c->B;
    c->ttable.shape[1] = c->max_blocks;
    c->ttable.strides[0] = 2 * c->max_blocks;
    c->ttable.strides[1] = 2;
}

/* Tensors for the sizes set in c (cdt, bs, seqlens included): caches with
 * their filled rows drawn, q and the new rows drawn, out and lse full of
 * the sentinel, default params. */
static void kv_build(kv_case *c, rng *r) {
    c->smax = 1;
    for (int64_t b = 0; b < c->B; b++)
        if (c->seqlens[b] + c->Lnew > c->smax) c->smax = c->seqlens[b] + c->Lnew;
    c->smax += rng_int(r, 0, 3);
    if (c->bs) kv_table(c, r);
    const int64_t kshape[4] = {c->bs ? c->num_blocks : c->B, c->bs ? c->bs : c->smax, c->Hkv, c->E};
    const int64_t vshape[4] = {kshape[0], kshape[1], c->Hkv, c->Ev};
    cache_make(&c->kc, r, c->cdt, kshape);
    cache_make(&c->vc, r, c->cdt, vshape);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t row = 0; row < (c->with_seqlens ? c->seqlens[b] : kv_len(c, b)); row++)
            for (int64_t h = 0; h < c->Hkv; h++) {
                for (int64_t e = 0; e < c->E; e++)
                    elem_set(&c->kc.t, kv_at(c, &c->kc.t, b, row, h, e), rng_normal(r));
                for (int64_t e = 0; e < c->Ev; e++)
                    elem_set(&c->vc.t, kv_at(c, &c->vc.t, b, row, h, e), rng_normal(r));
            }
    const int64_t qs[4] = {c->B, c->Lq, c->Hq, c->E}, os[4] = {c->B, c->Lq, c->Hq, c->Ev},
                  ls[3] = {c->B, c->Hq, c->Lq};
    tt_make(&c->q, r, c->dt, 4, qs, LAYOUT_RANDOM, 1, 0);
    if (c->Lnew > 0) {
        const int64_t ks[4] = {c->B, c->Lnew, c->Hkv, c->E}, vs[4] = {c->B, c->Lnew, c->Hkv, c->Ev};
        tt_make(&c->k, r, c->dt, 4, ks, LAYOUT_RANDOM, 1, 0);
        tt_make(&c->v, r, c->dt, 4, vs, LAYOUT_RANDOM, 1, 0);
    }
    tt_make_output(&c->out, r, c->dt, 4, os, LAYOUT_RANDOM);
    tt_fill(&c->out.t, SENTINEL);
    const bool half = c->dt == ATTN_DTYPE_F16 || c->dt == ATTN_DTYPE_BF16; /* lse: float32 */
    tt_make_output(&c->lse, r, rng_int(r, 0, 1) ? ATTN_DTYPE_F64 : half ? ATTN_DTYPE_F32 : c->dt,
                   3, ls, LAYOUT_RANDOM);
    tt_fill(&c->lse.t, SENTINEL);
    attn_tensor_init(&c->tseq, c->seqlens, ATTN_DTYPE_I32, 1, &c->B);
    attn_sdpa_params_init(&c->p);
    c->m.causal = ATTN_CAUSAL_NONE;
    c->m.scale = 1.0 / sqrt((double)c->E);
    c->m.wl = c->m.wr = -1;
}

static void kv_free(kv_case *c) {
    if (!c->borrowed) {
        tt_free(&c->q);
        tt_free(&c->k);
        tt_free(&c->v);
    }
    tt_free(&c->out);
    tt_free(&c->lse);
    free(c->kc.alloc);
    free(c->vc.alloc);
    free(c->table);
    free(c->table_store);
}

static attn_status kv_call(kv_case *c) {
    return attn_sdpa_kvcache(&c->q.t, &c->kc.t, &c->vc.t, c->Lnew ? &c->k.t : NULL,
                             c->Lnew ? &c->v.t : NULL, c->with_seqlens ? &c->tseq : NULL,
                             c->bs ? &c->ttable : NULL, &c->p, &c->out.t,
                             c->with_lse ? &c->lse.t : NULL);
}

/* The caches as the call must leave them: copies with the new rows written
 * (rounded to the cache's dtype) where the test's own addressing says. */
static void kv_expected(const kv_case *c, cache_buf *ek, cache_buf *ev) {
    cache_copy(ek, &c->kc);
    cache_copy(ev, &c->vc);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t r = 0; r < c->Lnew; r++)
            for (int64_t h = 0; h < c->Hkv; h++) {
                const int64_t row = c->seqlens[b] + r;
                for (int64_t e = 0; e < c->E; e++)
                    elem_set(&ek->t, kv_at(c, &ek->t, b, row, h, e), get4(&c->k.t, b, r, h, e));
                for (int64_t e = 0; e < c->Ev; e++)
                    elem_set(&ev->t, kv_at(c, &ev->t, b, row, h, e), get4(&c->v.t, b, r, h, e));
            }
}

/* Sequence b's rows 0 .. n-1 of head h of a cache, dense (n x width). */
static double *gather_cache(const kv_case *c, const attn_tensor *t, int64_t b, int64_t n,
                            int64_t h) {
    const int64_t width = t->shape[3];
    double *x = malloc(sizeof(double) * (size_t)(n * width + 1));
    for (int64_t r = 0; r < n; r++)
        for (int64_t e = 0; e < width; e++) x[r * width + e] = elem_get(t, kv_at(c, t, b, r, h, e));
    return x;
}

/* out and lse of a call that succeeded against the oracle over the caches
 * as expected (ek, ev). Returns the worst error / tolerance. */
static double kv_vs_oracle(const kv_case *c, const cache_buf *ek, const cache_buf *ev,
                           const char *what) {
    double worst = 0, *o = malloc(sizeof(double) * (size_t)c->Ev), *qrow = malloc(sizeof(double) * (size_t)c->E);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->Hq; h++) {
            const int64_t S = kv_len(c, b), hk = h / (c->Hq / c->Hkv);
            double *K = gather_cache(c, &ek->t, b, S, hk), *V = gather_cache(c, &ev->t, b, S, hk);
            double vmax = 0;
            for (int64_t x = 0; x < S * c->Ev; x++) vmax = fmax(vmax, fabs(V[x]));
            for (int64_t i = 0; i < c->Lq; i++) {
                for (int64_t e = 0; e < c->E; e++) qrow[e] = get4(&c->q.t, b, i, h, e);
                const double lse = oracle_row(&c->m, b, h, qrow, K, V, c->Lq, S, c->E, c->Ev, i, o);
                const double tol = tol_of(c->dt, c->E, S, vmax);
                for (int64_t e = 0; e < c->Ev; e++) {
                    const double got = get4(&c->out.t, b, i, h, e), err = fabs(got - o[e]);
                    CHECK(err <= tol, "%s (%s): sequence %lld head %lld row %lld col %lld: %.9g, "
                          "expected %.9g", what, attn_isa_name(attn_get_isa()), (long long)b,
                          (long long)h, (long long)i, (long long)e, got, o[e]);
                    worst = fmax(worst, err / tol);
                }
                if (!c->with_lse) continue;
                const double got = get3(&c->lse.t, b, h, i);
                CHECK(same_value(got, lse) || fabs(got - lse) <= tol_of(c->dt, c->E, S, fabs(lse)),
                      "%s (%s): lse of sequence %lld head %lld row %lld: %.12g, expected %.12g",
                      what, attn_isa_name(attn_get_isa()), (long long)b, (long long)h, (long long)i,
                      got, lse);
            }
            free(K);
            free(V);
        }
    free(o);
    free(qrow);
    return worst;
}

/* Runs a case and checks the caches byte for byte (guards included) and
 * the attention against the oracle. */
static double kv_run_check(kv_case *c, const char *what) {
    cache_buf ek, ev;
    kv_expected(c, &ek, &ev);
    attn_status st = kv_call(c);
    CHECK(st == ATTN_OK, "%s: %s", what, attn_last_error());
    double worst = 0;
    if (st == ATTN_OK) {
        CHECK(memcmp(ek.alloc, c->kc.alloc, ek.bytes) == 0,
              "%s: k_cache holds other bytes than the appended rows", what);
        CHECK(memcmp(ev.alloc, c->vc.alloc, ev.bytes) == 0,
              "%s: v_cache holds other bytes than the appended rows", what);
        worst = kv_vs_oracle(c, &ek, &ev, what);
    }
    free(ek.alloc);
    free(ev.alloc);
    return worst;
}

/* A random case: decoding mostly (Lq 1..4), sometimes a prefill chunk;
 * bs = 0 for a contiguous cache. */
static void kv_make_long(kv_case *c, rng *r, int64_t bs, bool with_mods, int64_t most) {
    memset(c, 0, sizeof *c);
    c->dt = rng_int(r, 0, 2) ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64;
    const attn_dtype cdts[4] = {c->dt, c->dt, ATTN_DTYPE_F16, ATTN_DTYPE_BF16};
    c->cdt = cdts[rng_int(r, 0, 3)];
    c->B = rng_int(r, 1, 6);
    c->Lq = rng_int(r, 0, 3) == 0 ? rng_int(r, 1, 40) : rng_int(r, 1, 4);
    c->Hkv = rng_int(r, 1, 2);
    c->Hq = c->Hkv * rng_int(r, 1, 4);
    c->E = rng_int(r, 0, 2) == 0 ? 64 : rng_int(r, 1, 24);
    c->Ev = rng_int(r, 0, 2) == 0 ? c->E : rng_int(r, 1, 24);
    c->Lnew = rng_int(r, 0, 3) == 0 ? 0 : rng_int(r, 0, 3) == 0 ? rng_int(r, 1, 20) : rng_int(r, 1, 2);
    c->bs = bs;
    c->with_seqlens = true;
    if (most == 0) most = bs >= 64 ? 3 * bs : 150;
    for (int64_t b = 0; b < c->B; b++)
        c->seqlens[b] = (int32_t)(rng_int(r, 0, 7) == 0 ? 0 : rng_int(r, 0, most));
    kv_build(c, r);
    c->with_lse = rng_int(r, 0, 2) != 0;
    c->p.causal = rng_int(r, 0, 2) ? ATTN_CAUSAL_BOTTOM_RIGHT : CAUSALS[rng_int(r, 0, 2)];
    draw_mods(r, with_mods, c->B, c->Hq, (double)c->E, &c->md, &c->p, &c->m);
}

static void kv_make(kv_case *c, rng *r, int64_t bs, bool with_mods) {
    kv_make_long(c, r, bs, with_mods, 0);
}

/* The paged case's twin over contiguous caches holding the same rows, with
 * the same q, new rows and params (borrowed). */
static void kv_mirror(const kv_case *paged, kv_case *c, rng *r) {
    *c = *paged;
    c->bs = 0;
    c->table = c->table_store = NULL;
    c->borrowed = true;
    c->smax = paged->max_blocks * paged->bs;
    const int64_t ks[4] = {c->B, c->smax, c->Hkv, c->E}, vs[4] = {c->B, c->smax, c->Hkv, c->Ev};
    cache_make(&c->kc, r, c->cdt, ks);
    cache_make(&c->vc, r, c->cdt, vs);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t row = 0; row < (c->with_seqlens ? c->seqlens[b] : kv_len(paged, b)); row++)
            for (int64_t h = 0; h < c->Hkv; h++) {
                for (int64_t e = 0; e < c->E; e++)
                    elem_set(&c->kc.t, kv_at(c, &c->kc.t, b, row, h, e),
                             elem_get(&paged->kc.t, kv_at(paged, &paged->kc.t, b, row, h, e)));
                for (int64_t e = 0; e < c->Ev; e++)
                    elem_set(&c->vc.t, kv_at(c, &c->vc.t, b, row, h, e),
                             elem_get(&paged->vc.t, kv_at(paged, &paged->vc.t, b, row, h, e)));
            }
    const int64_t os[4] = {c->B, c->Lq, c->Hq, c->Ev}, ls[3] = {c->B, c->Hq, c->Lq};
    tt_make_output(&c->out, r, c->dt, 4, os, LAYOUT_RANDOM);
    tt_make_output(&c->lse, r, paged->lse.t.dtype, 3, ls, LAYOUT_RANDOM);
}

/* Whether two cases' out (and lse) hold the same bits. */
static bool kv_same_result(const kv_case *a, const kv_case *b) {
    bool same = true;
    for (int64_t x = 0; x < a->B; x++)
        for (int64_t i = 0; i < a->Lq; i++)
            for (int64_t h = 0; h < a->Hq; h++) {
                for (int64_t e = 0; e < a->Ev; e++)
                    same &= same_value(get4(&a->out.t, x, i, h, e), get4(&b->out.t, x, i, h, e));
                if (a->with_lse) same &= same_value(get3(&a->lse.t, x, h, i), get3(&b->lse.t, x, h, i));
            }
    return same;
}

/* Random cases with block size bs (0: contiguous) on every path; a paged
 * case with small pages must also give the bits of its contiguous twin. */
static void kv_cases(int64_t bs, bool with_mods, int count) {
    rng r = {harness_seed() ^ (uint64_t)(bs * 7919 + (with_mods ? 0x3d : 0x1f))};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        double worst = 0;
        for (int i = 0; i < count; i++) {
            kv_case c, twin;
            kv_make(&c, &r, bs, with_mods);
            if (bs) kv_mirror(&c, &twin, &r);
            char what[96];
            snprintf(what, sizeof what, "kvcache case %d (block size %lld, %s cache)", i,
                     (long long)bs, attn_dtype_name(c.cdt));
            worst = fmax(worst, kv_run_check(&c, what));
            /* Pages shorter than 64 rows are gathered a key block at a time,
             * so the blocks, and the bits, are the contiguous cache's; longer
             * pages are read in place, with key blocks cut at page ends (the
             * oracle has checked those). */
            if (bs) {
                CHECK_OK(kv_call(&twin));
                CHECK(bs >= 64 || kv_same_result(&c, &twin),
                      "%s (%s): paged and contiguous caches differ", what,
                      attn_isa_name(PATHS[pi]));
                kv_free(&twin);
            }
            kv_free(&c);
        }
        printf("  %-8s block size %3lld: %d cases, worst error %.3f of the tolerance\n",
               attn_isa_name(PATHS[pi]), (long long)bs, count, worst);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

static void kvcache_contiguous(void) { kv_cases(0, false, cases_per_path(40)); }

/* Long caches (up to 5,000 rows): a decode step's few rows split the keys
 * into chunks of each sequence's own length (sequences that end before a
 * chunk hold none of it), and a (B, S, H_kv, E) cache is read by tasks that
 * take every K/V head of a sequence (ganged decoding). Against the oracle,
 * and paged caches give the bits of their contiguous twins whatever the
 * block size (ganged blocks do not follow pages). */
static void kvcache_long(void) {
    rng r = {harness_seed() ^ 0x1046};
    const int64_t sizes[3] = {0, 16, 256};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        double worst = 0;
        for (int i = 0; i < cases_per_path(6); i++) {
            kv_case c, twin;
            const int64_t bs = sizes[i % 3];
            kv_make_long(&c, &r, bs, i % 2 == 1, 5000);
            if (bs) kv_mirror(&c, &twin, &r);
            char what[96];
            snprintf(what, sizeof what, "long kvcache case %d (block size %lld, %s cache, Hkv %lld)",
                     i, (long long)bs, attn_dtype_name(c.cdt), (long long)c.Hkv);
            worst = fmax(worst, kv_run_check(&c, what));
            if (bs) {
                CHECK_OK(kv_call(&twin));
                const bool ganged = c.Hkv > 1 && c.Lq * (c.Hq / c.Hkv) <= 16;
                CHECK(!ganged || kv_same_result(&c, &twin), "%s (%s): paged and contiguous caches differ",
                      what, attn_isa_name(PATHS[pi]));
                kv_free(&twin);
            }
            kv_free(&c);
        }
        printf("  %-8s long caches: %d cases, worst error %.3f of the tolerance\n",
               attn_isa_name(PATHS[pi]), cases_per_path(6), worst);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

static void kvcache_paged(void) {
    const int64_t sizes[4] = {1, 16, 64, 256};
    for (int i = 0; i < 4; i++) kv_cases(sizes[i], false, cases_per_path(15));
}

static void kvcache_modifiers(void) {
    kv_cases(0, true, cases_per_path(30));
    kv_cases(16, true, cases_per_path(30));
}

/* 16-bit queries over a cache of their dtype, prefill chunks of 17-60 rows
 * per head: the queries-in-lanes layout, whose bfloat16 products
 * (avx512_bf16) read a contiguous cache and pages of 64 rows in place and
 * gather pages of 16; ragged sequences, GQA, odd widths and strided
 * queries; on every path against the oracle. */
static void kvcache_half_prefill(void) {
    rng r = {harness_seed() ^ 0xbf16};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        double worst = 0;
        for (int i = 0; i < 12; i++) {
            kv_case c;
            memset(&c, 0, sizeof c);
            c.dt = c.cdt = i % 4 == 3 ? ATTN_DTYPE_F16 : ATTN_DTYPE_BF16;
            c.B = rng_int(&r, 1, 3);
            c.Lq = rng_int(&r, 17, 60);
            c.Hkv = rng_int(&r, 1, 2);
            c.Hq = c.Hkv * rng_int(&r, 1, 3);
            c.E = i % 2 ? 64 : rng_int(&r, 1, 40);
            c.Ev = rng_int(&r, 0, 1) ? c.E : rng_int(&r, 1, 80);
            c.Lnew = rng_int(&r, 0, 1) ? c.Lq : 0;
            c.bs = i % 3 == 0 ? 0 : i % 3 == 1 ? 16 : 64;
            c.with_seqlens = true;
            for (int64_t b = 0; b < c.B; b++) c.seqlens[b] = (int32_t)rng_int(&r, 0, 300);
            kv_build(&c, &r);
            c.with_lse = true;
            c.p.causal = c.m.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
            worst = fmax(worst, kv_run_check(&c, "16-bit prefill over a cache"));
            kv_free(&c);
        }
        printf("  path %-11s 12 cases; worst error/tolerance %.3f\n", attn_isa_name(PATHS[pi]),
               worst);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* cache_seqlens NULL: every row of the cache is filled and attended to. */
static void kvcache_full(void) {
    rng r = {harness_seed() ^ 0xf011};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        for (int i = 0; i < 8; i++) {
            kv_case c;
            memset(&c, 0, sizeof c);
            c.dt = ATTN_DTYPE_F32;
            c.cdt = i % 4 == 3 ? ATTN_DTYPE_BF16 : ATTN_DTYPE_F32;
            c.B = rng_int(&r, 1, 4);
            c.Lq = rng_int(&r, 1, 3);
            c.Hkv = 2;
            c.Hq = 4;
            c.E = c.Ev = 16;
            c.bs = i % 2 ? 16 : 0;
            for (int64_t b = 0; b < c.B; b++) c.seqlens[b] = (int32_t)rng_int(&r, 1, 40);
            kv_build(&c, &r);
            c.with_lse = true;
            c.p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
            c.m.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
            kv_run_check(&c, c.bs ? "full paged cache" : "full contiguous cache");
            kv_free(&c);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* attn_sdpa on (B, H, S, E) views of token-major (B, S, H, E) buffers, the
 * layout ganged decoding reads (every K/V head of a key row in one pass):
 * few query rows per KV head, GQA, float32 and float64, on every path;
 * against the same call on head-major copies of the same values. Keys up
 * to s_max: below 1,024 (no key chunks) both walk the same key blocks, so
 * the bits must be the same (same_bits); longer keys split into chunks
 * counted per gang, not per head, and the two agree within the oracle's
 * tolerance. */
static void token_major_cases(uint64_t salt, int64_t s_min, int64_t s_max, int64_t hkv_max,
                              bool same_bits) {
    rng r = {harness_seed() ^ salt};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        double worst = 0;
        for (int i = 0; i < cases_per_path(6); i++) {
            const attn_dtype dt = i % 3 == 2 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
            const size_t es = attn_dtype_size(dt);
            const int64_t B = rng_int(&r, 1, 3), Hkv = rng_int(&r, 2, hkv_max), G = rng_int(&r, 1, 4);
            const int64_t H = Hkv * G, L = rng_int(&r, 1, 3), S = rng_int(&r, s_min, s_max);
            const int64_t widths[3] = {64, 128, rng_int(&r, 1, 40)};
            const int64_t E = widths[rng_int(&r, 0, 2)];
            const int64_t nq = B * H * L * E, nk = B * S * Hkv * E;
            char *q = malloc((size_t)nq * es), *out = malloc((size_t)nq * es);
            char *ref = malloc((size_t)nq * es), *kt = malloc((size_t)nk * es);
            char *vt = malloc((size_t)nk * es), *kh = malloc((size_t)nk * es);
            char *vh = malloc((size_t)nk * es);
            for (int64_t x = 0; x < nq; x++) elem_set(&(attn_tensor){.data = q, .dtype = dt}, x, rng_normal(&r));
            /* token-major kt[b][j][h][e] and head-major kh[b][h][j][e] of one value */
            for (int64_t b = 0; b < B; b++)
                for (int64_t j = 0; j < S; j++)
                    for (int64_t h = 0; h < Hkv; h++)
                        for (int64_t e = 0; e < E; e++) {
                            const int64_t t = ((b * S + j) * Hkv + h) * E + e;
                            const int64_t hm = ((b * Hkv + h) * S + j) * E + e;
                            const double kx = rng_normal(&r), vx = rng_normal(&r);
                            elem_set(&(attn_tensor){.data = kt, .dtype = dt}, t, kx);
                            elem_set(&(attn_tensor){.data = kh, .dtype = dt}, hm, kx);
                            elem_set(&(attn_tensor){.data = vt, .dtype = dt}, t, vx);
                            elem_set(&(attn_tensor){.data = vh, .dtype = dt}, hm, vx);
                        }
            const int64_t qs[4] = {B, H, L, E}, ks[4] = {B, Hkv, S, E}, ts[4] = {B, S, Hkv, E};
            attn_tensor tq, to, tr, tkh, tvh, tkt, tvt;
            CHECK_OK(attn_tensor_init(&tq, q, dt, 4, qs));
            CHECK_OK(attn_tensor_init(&to, out, dt, 4, qs));
            CHECK_OK(attn_tensor_init(&tr, ref, dt, 4, qs));
            CHECK_OK(attn_tensor_init(&tkh, kh, dt, 4, ks));
            CHECK_OK(attn_tensor_init(&tvh, vh, dt, 4, ks));
            CHECK_OK(attn_tensor_init(&tkt, kt, dt, 4, ts)); /* (B, S, Hkv, E) in memory, */
            CHECK_OK(attn_tensor_init(&tvt, vt, dt, 4, ts)); /* seen as (B, Hkv, S, E)    */
            CHECK_OK(attn_tensor_transpose(&tkt, 1, 2));
            CHECK_OK(attn_tensor_transpose(&tvt, 1, 2));
            attn_sdpa_params p;
            attn_sdpa_params_init(&p);
            p.enable_gqa = 1;
            p.causal = rng_int(&r, 0, 1) ? ATTN_CAUSAL_BOTTOM_RIGHT : ATTN_CAUSAL_NONE;
            if (rng_int(&r, 0, 2) == 0) p.window_left = rng_int(&r, S / 16, S / 2);
            CHECK_OK(attn_sdpa(&tq, &tkt, &tvt, &p, &to, NULL, NULL));
            CHECK_OK(attn_sdpa(&tq, &tkh, &tvh, &p, &tr, NULL, NULL));
            /* both sum the same products; in chunks of different keys the
             * difference is far below the S-term oracle bound */
            const double tol = tol_of(dt, E, 64, 4.0);
            int64_t bad = 0, first = -1;
            for (int64_t x = 0; x < nq; x++) {
                const double a = elem_get(&to, x), e = elem_get(&tr, x);
                if (!(same_bits ? same_value(a, e) : fabs(a - e) <= tol) && bad++ == 0) first = x;
                worst = fmax(worst, fabs(a - e) / tol);
            }
            CHECK(bad == 0, "token-major case %d (%s, %s, S %lld, Hkv %lld, E %lld): %lld of %lld "
                  "elements differ from head-major, the first %lld: %.17g against %.17g", i,
                  attn_isa_name(PATHS[pi]), attn_dtype_name(dt), (long long)S, (long long)Hkv,
                  (long long)E, (long long)bad, (long long)nq, (long long)first,
                  bad ? elem_get(&to, first) : 0.0, bad ? elem_get(&tr, first) : 0.0);
            free(q), free(out), free(ref), free(kt), free(vt), free(kh), free(vh);
        }
        printf("  %-8s token-major sdpa, S %lld-%lld: %d cases, worst difference %.3f of the "
               "tolerance\n", attn_isa_name(PATHS[pi]), (long long)s_min, (long long)s_max,
               cases_per_path(6), worst);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

static void sdpa_token_major(void) { token_major_cases(0x70c3, 1500, 5000, 4, false); }

/* Below one key chunk, up to 8 KV heads of E = 128: the gang's key blocks
 * are a head's own (they were half the L2 long: 32-64 keys). */
static void sdpa_token_major_same_bits(void) { token_major_cases(0x70c4, 300, 1000, 8, true); }

/* ======================================================================== */
/* Hostile arguments: a clear error naming the argument, nothing written    */
/* ======================================================================== */

#define EXPECT_FAIL(call, want, arg) expect_fail((call), (want), (arg), #call, __LINE__)

static void expect_fail(attn_status st, attn_status want, const char *arg, const char *what,
                        int line) {
    CHECK(st == want, "line %d: %s gave %d (%s), expected %d: %s", line, what, (int)st,
          attn_strerror(st), (int)want, attn_last_error());
    CHECK(strcmp(attn_last_error_arg(), arg) == 0, "line %d: %s names '%s', expected '%s' (%s)",
          line, what, attn_last_error_arg(), arg, attn_last_error());
    CHECK(attn_last_error()[0] != '\0', "line %d: no message", line);
}

/* Bytes of a test tensor's whole buffer, to see that nothing was written. */
static size_t storage_bytes(const test_tensor *x) {
    int64_t span = 1;
    for (int d = 0; d < x->t.rank; d++)
        span += (x->t.strides[d] < 0 ? -x->t.strides[d] : x->t.strides[d]) * (x->t.shape[d] - 1);
    return (size_t)span * attn_dtype_size(x->t.dtype);
}

static void varlen_hostile(void) {
    rng r = {harness_seed() ^ 0xbad1};
    varlen_case c;
    const int lq[2] = {3, 5}, lk[2] = {4, 6};
    varlen_fixed(&c, &r, ATTN_DTYPE_F32, 2, lq, lk, 4, 2, 8, 8);
    double *before = varlen_result(&c);
    attn_tensor *q = &c.q.t, *k = &c.k.t, *v = &c.v.t, *out = &c.out.t, *lse = &c.lse.t;
    const attn_tensor saved_q = *q, saved_k = *k, saved_v = *v, saved_out = *out, saved_lse = *lse;
#define RESTORE() (*q = saved_q, *k = saved_k, *v = saved_v, *out = saved_out, *lse = saved_lse)
    /* offsets */
    c.cu_q[0] = 1;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "cu_seqlens_q");
    c.cu_q[0] = 0;
    c.cu_k[2] = 3;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "cu_seqlens_k"); /* 4 then 3: decreasing */
    c.cu_k[2] = 10;
    c.cu_q[2] = (int32_t)c.total_q + 1;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "cu_seqlens_q"); /* past the end */
    c.cu_q[2] = 8;
    c.cu_k[0] = -3;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "cu_seqlens_k");
    c.cu_k[0] = 0;
    c.tcu_k.shape[0] = 2;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "cu_seqlens_k");
    c.tcu_k.shape[0] = 3;
    c.tcu_q.dtype = ATTN_DTYPE_F32;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_DTYPE, "cu_seqlens_q");
    c.tcu_q.dtype = ATTN_DTYPE_I32;
    c.tcu_q.rank = 2;
    c.tcu_q.shape[1] = 1;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "cu_seqlens_q");
    c.tcu_q.rank = 1;
    /* No sequence (cu_seqlens of one entry): that entry is still checked
     * (it returned ATTN_OK for [5], [-3] or [7], and Python then trusted it) */
    c.tcu_q.shape[0] = c.tcu_k.shape[0] = 1;
    c.cu_q[0] = 5;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "cu_seqlens_q");
    c.cu_q[0] = 0;
    c.cu_k[0] = -3;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "cu_seqlens_k");
    c.cu_k[0] = 0;
    CHECK_OK(varlen_call(&c));
    c.tcu_q.shape[0] = c.tcu_k.shape[0] = 3;
    EXPECT_FAIL(attn_sdpa_varlen(q, k, v, NULL, &c.tcu_k, 5, 6, NULL, out, NULL), ATTN_ERR_NULL,
                "cu_seqlens_q");
    EXPECT_FAIL(attn_sdpa_varlen(q, k, v, &c.tcu_q, &c.tcu_k, 4, 6, NULL, out, NULL),
                ATTN_ERR_INVALID, "max_seqlen_q");
    EXPECT_FAIL(attn_sdpa_varlen(q, k, v, &c.tcu_q, &c.tcu_k, 5, -1, NULL, out, NULL),
                ATTN_ERR_INVALID, "max_seqlen_k");
    /* tensors */
    EXPECT_FAIL(attn_sdpa_varlen(NULL, k, v, &c.tcu_q, &c.tcu_k, 5, 6, NULL, out, NULL),
                ATTN_ERR_NULL, "q");
    EXPECT_FAIL(attn_sdpa_varlen(q, k, v, &c.tcu_q, &c.tcu_k, 5, 6, NULL, NULL, NULL),
                ATTN_ERR_NULL, "out");
    q->rank = 4;
    q->shape[3] = 1;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "q");
    RESTORE();
    k->dtype = ATTN_DTYPE_F64;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_DTYPE, "k");
    RESTORE();
    q->dtype = ATTN_DTYPE_I32;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_DTYPE, "q");
    RESTORE();
    k->shape[1] = v->shape[1] = 3; /* 4 query heads over 3 */
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "k");
    RESTORE();
    v->shape[0] -= 1;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "v");
    RESTORE();
    out->shape[2] = 7;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "out");
    RESTORE();
    out->data = q->data; /* in place */
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_OVERLAP, "out");
    RESTORE();
    lse->shape[0] = c.total_q;
    lse->shape[1] = c.Hq;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_SHAPE, "lse");
    RESTORE();
    lse->dtype = ATTN_DTYPE_I32;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_DTYPE, "lse");
    RESTORE();
    lse->data = out->data;
    lse->dtype = out->dtype;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_OVERLAP, "lse");
    RESTORE();
    /* An output over the offsets it is located by. */
    attn_tensor cu_over = c.tcu_q;
    cu_over.data = out->data;
    EXPECT_FAIL(attn_sdpa_varlen(q, k, v, &cu_over, &c.tcu_k, 5, 6, NULL, out, NULL),
                ATTN_ERR_OVERLAP, "out");
    /* params */
    const char *names[6] = {"query", "key", "value", "output", NULL, "logsumexp"};
    c.p.arg_names = names;
    q->dtype = ATTN_DTYPE_BOOL;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_DTYPE, "query");
    RESTORE();
    c.p.arg_names = NULL;
    c.p.attn_mask = q;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.attn_mask");
    c.p.attn_mask = NULL;
    c.p.q_offset = 1;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.q_offset");
    c.p.q_offset = 0;
    c.p.k_total = 100;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.k_total");
    c.p.k_total = 0;
    c.p.causal = (attn_causal)7;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.causal");
    c.p.causal = ATTN_CAUSAL_NONE;
    c.p.has_scale = 1;
    c.p.scale = NAN;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.scale");
    c.p.has_scale = 0;
    c.p.dropout_p = 1.5;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.dropout_p");
    c.p.dropout_p = 0;
    c.p.struct_size = 0;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.struct_size");
    c.p.struct_size = sizeof c.p;
    c.p.softcap = -1;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.softcap");
    c.p.softcap = 0;
    c.p.window_left = -2;
    EXPECT_FAIL(varlen_call(&c), ATTN_ERR_INVALID, "params.window_left");
    c.p.window_left = -1;
#undef RESTORE
    double *after = varlen_result(&c);
    CHECK(same_result(&c, before, after), "a refused call wrote out or lse");
    CHECK_OK(varlen_call(&c)); /* and the case itself is fine */
    free(before);
    free(after);
    varlen_free(&c);
}

/* A fixed case: B sequences filled to seqlens, Lnew new rows, (Hq, Hkv) =
 * (4, 2), E = Ev = 8, float32 throughout. */
static void kv_fixed(kv_case *c, rng *r, int64_t bs, int64_t B, const int *seqlens, int64_t Lnew) {
    memset(c, 0, sizeof *c);
    c->dt = c->cdt = ATTN_DTYPE_F32;
    c->B = B;
    c->Lq = 2;
    c->Hq = 4;
    c->Hkv = 2;
    c->E = c->Ev = 8;
    c->Lnew = Lnew;
    c->bs = bs;
    c->with_seqlens = true;
    for (int64_t b = 0; b < B; b++) c->seqlens[b] = seqlens[b];
    kv_build(c, r);
    c->with_lse = true;
    c->p.causal = c->m.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
}

/* Whether a case's caches and outputs still hold the bytes of `twin`, a
 * copy taken before refused calls. */
typedef struct kv_snapshot {
    unsigned char *k, *v, *out, *lse;
    void *out_at, *lse_at; /* the buffers (views may be changed between calls) */
    size_t out_bytes, lse_bytes;
} kv_snapshot;

static void kv_snap(const kv_case *c, kv_snapshot *s) {
    s->out_bytes = storage_bytes(&c->out);
    s->lse_bytes = storage_bytes(&c->lse);
    s->out_at = c->out.storage;
    s->lse_at = c->lse.storage;
    s->k = malloc(c->kc.bytes);
    s->v = malloc(c->vc.bytes);
    s->out = malloc(s->out_bytes);
    s->lse = malloc(s->lse_bytes);
    memcpy(s->k, c->kc.alloc, c->kc.bytes);
    memcpy(s->v, c->vc.alloc, c->vc.bytes);
    memcpy(s->out, s->out_at, s->out_bytes);
    memcpy(s->lse, s->lse_at, s->lse_bytes);
}

static bool kv_unchanged(const kv_case *c, const kv_snapshot *s) {
    return memcmp(s->k, c->kc.alloc, c->kc.bytes) == 0 &&
           memcmp(s->v, c->vc.alloc, c->vc.bytes) == 0 &&
           memcmp(s->out, s->out_at, s->out_bytes) == 0 &&
           memcmp(s->lse, s->lse_at, s->lse_bytes) == 0;
}

static void kv_snap_free(kv_snapshot *s) {
    free(s->k);
    free(s->v);
    free(s->out);
    free(s->lse);
}

/* Rows requested ahead of a streamed walk (attn__stream_prefetch, on where
 * the CPU gains from them) change no arithmetic: long caches, contiguous
 * and paged, ganged or not, 16-bit or not, give the same bytes with the
 * requests forced off and on, on every path, whatever this CPU's rule. */
static void kvcache_requests_ahead_change_no_bits(void) {
    rng r = {harness_seed() ^ 0x5eed};
    const int64_t sizes[3] = {0, 16, 256};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        for (int i = 0; i < cases_per_path(9); i++) {
            kv_case c;
            kv_make_long(&c, &r, sizes[i % 3], i % 2 == 1, 5000);
            attn__stream_prefetch_force(0);
            CHECK_OK(kv_call(&c)); /* appends are idempotent: the same rows again */
            kv_snapshot s;
            kv_snap(&c, &s);
            attn__stream_prefetch_force(1);
            CHECK_OK(kv_call(&c));
            CHECK(kv_unchanged(&c, &s), "case %d (%s, block size %lld, %s cache, Hkv %lld): "
                  "requests ahead changed the result", i, attn_isa_name(PATHS[pi]),
                  (long long)sizes[i % 3], attn_dtype_name(c.cdt), (long long)c.Hkv);
            kv_snap_free(&s);
            kv_free(&c);
        }
    }
    attn__stream_prefetch_force(-1);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Index values: lengths, capacity, block ids, blocks shared by writers. */
static void kvcache_hostile_indices(void) {
    rng r = {harness_seed() ^ 0xbad2};
    kv_case c;
    const int seqlens[3] = {5, 0, 7};
    kv_fixed(&c, &r, 4, 3, seqlens, 2); /* blocks of 4: rows 5, 6 | 0, 1 | 7, 8 written */
    kv_snapshot snap;
    kv_snap(&c, &snap);
#define REFUSED(want, arg)                                                                  \
    do {                                                                                    \
        EXPECT_FAIL(kv_call(&c), want, arg);                                                \
        CHECK(kv_unchanged(&c, &snap), "line %d: a refused call wrote something", __LINE__); \
    } while (0)
    const int64_t capacity = c.max_blocks * c.bs;
    c.seqlens[1] = -1;
    REFUSED(ATTN_ERR_INVALID, "cache_seqlens");
    c.seqlens[1] = 0;
    c.seqlens[2] = (int32_t)capacity - 1; /* + 2 new rows: one past the end */
    REFUSED(ATTN_ERR_SHAPE, "cache_seqlens");
    c.seqlens[2] = 7;
    /* Sequence 2's last written row lies in its third block (row 8). */
    int32_t *slot = &c.table_store[2 * (2 * c.max_blocks + 2)];
    const int32_t id = *slot;
    const int32_t bad[3] = {(int32_t)c.num_blocks, -1, INT32_MIN};
    for (int i = 0; i < 3; i++) {
        *slot = bad[i];
        REFUSED(ATTN_ERR_INVALID, "block_table");
    }
    *slot = id;
    /* Two sequences writing into one block: sequence 1's first block is
     * sequence 0's second (rows 5, 6 there are 1, 2; sequence 1 writes 0, 1). */
    int32_t *s1 = &c.table_store[2 * (1 * c.max_blocks + 0)];
    const int32_t s1_id = *s1;
    *s1 = c.table_store[2 * (0 * c.max_blocks + 1)];
    REFUSED(ATTN_ERR_OVERLAP, "block_table");
    /* ... or into a block another sequence reads (sequence 2's first). */
    *s1 = c.table_store[2 * (2 * c.max_blocks + 0)];
    REFUSED(ATTN_ERR_OVERLAP, "block_table");
    /* ... or one sequence listing one block twice, writing into rows it reads. */
    *s1 = s1_id;
    int32_t *s2 = &c.table_store[2 * (2 * c.max_blocks + 2)];
    *s2 = c.table_store[2 * (2 * c.max_blocks + 0)];
    REFUSED(ATTN_ERR_OVERLAP, "block_table");
    *s2 = id;
    /* A block two sequences only read (a shared prefix) is fine: sequences
     * 0 and 2 share their first block, and both write elsewhere. */
    c.table_store[2 * (2 * c.max_blocks + 0)] = c.table_store[2 * (0 * c.max_blocks + 0)];
    c.table[2 * c.max_blocks + 0] = c.table[0];
    kv_run_check(&c, "a shared read-only block");
#undef REFUSED
    kv_snap_free(&snap);
    kv_free(&c);
}

/* Tensors, dtypes, NULLs, overlaps and params of attn_sdpa_kvcache. */
static void kvcache_hostile_args(void) {
    rng r = {harness_seed() ^ 0xbad3};
    kv_case c;
    const int seqlens[3] = {5, 0, 7};
    kv_fixed(&c, &r, 4, 3, seqlens, 2);
    kv_snapshot snap;
    kv_snap(&c, &snap);
    attn_tensor *q = &c.q.t, *k = &c.k.t, *v = &c.v.t, *kc = &c.kc.t, *vc = &c.vc.t,
                *out = &c.out.t, *lse = &c.lse.t;
    const attn_tensor sq = *q, sk = *k, sv = *v, skc = *kc, svc = *vc, sout = *out, slse = *lse,
                      stable = c.ttable, sseq = c.tseq;
#define RESTORE() \
    (*q = sq, *k = sk, *v = sv, *kc = skc, *vc = svc, *out = sout, *lse = slse, c.ttable = stable, c.tseq = sseq)
#define REFUSED(call, want, arg)                                                            \
    do {                                                                                    \
        EXPECT_FAIL(call, want, arg);                                                       \
        CHECK(kv_unchanged(&c, &snap), "line %d: a refused call wrote something", __LINE__); \
        RESTORE();                                                                          \
    } while (0)
    const attn_tensor *seq = &c.tseq, *table = &c.ttable;
    /* NULLs and pairs */
    REFUSED(attn_sdpa_kvcache(NULL, kc, vc, k, v, seq, table, NULL, out, NULL), ATTN_ERR_NULL, "q");
    REFUSED(attn_sdpa_kvcache(q, NULL, vc, k, v, seq, table, NULL, out, NULL), ATTN_ERR_NULL, "k_cache");
    REFUSED(attn_sdpa_kvcache(q, kc, vc, k, NULL, seq, table, NULL, out, NULL), ATTN_ERR_NULL, "v");
    REFUSED(attn_sdpa_kvcache(q, kc, vc, NULL, v, seq, table, NULL, out, NULL), ATTN_ERR_NULL, "k");
    REFUSED(attn_sdpa_kvcache(q, kc, vc, k, v, NULL, table, NULL, out, NULL), ATTN_ERR_NULL,
            "cache_seqlens");
    REFUSED(attn_sdpa_kvcache(q, kc, vc, k, v, seq, table, NULL, NULL, NULL), ATTN_ERR_NULL, "out");
    kc->data = NULL;
    REFUSED(kv_call(&c), ATTN_ERR_NULL, "k_cache");
    /* dtypes */
    q->dtype = ATTN_DTYPE_I32;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "q");
    kc->dtype = vc->dtype = ATTN_DTYPE_BOOL;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "k_cache");
    vc->dtype = ATTN_DTYPE_F16;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "v_cache");
    k->dtype = ATTN_DTYPE_F64;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "k");
    c.tseq.dtype = ATTN_DTYPE_F32;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "cache_seqlens");
    c.ttable.dtype = ATTN_DTYPE_F32;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "block_table");
    lse->dtype = ATTN_DTYPE_I32;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "lse");
    out->dtype = ATTN_DTYPE_F64;
    REFUSED(kv_call(&c), ATTN_ERR_DTYPE, "out");
    /* shapes */
    q->rank = 3;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "q");
    kc->shape[3] = vc->shape[3] = 7;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "k_cache");
    vc->shape[1] = 3;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "v_cache");
    kc->shape[2] = vc->shape[2] = 3; /* 4 query heads over 3 */
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "k_cache");
    k->shape[1] = 3;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "v"); /* k has 3 new rows, v 2 */
    c.tseq.shape[0] = 4;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "cache_seqlens");
    c.ttable.rank = 1;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "block_table");
    c.ttable.shape[0] = 2;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "block_table");
    out->shape[1] = 3;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "out");
    lse->shape[1] = c.Lq;
    lse->shape[2] = c.Hq;
    REFUSED(kv_call(&c), ATTN_ERR_SHAPE, "lse");
    kc->strides[1] = 0; /* the rows written would share one address */
    REFUSED(kv_call(&c), ATTN_ERR_INVALID, "k_cache");
    /* overlaps */
    out->data = q->data;
    REFUSED(kv_call(&c), ATTN_ERR_OVERLAP, "out");
    out->data = kc->data;
    REFUSED(kv_call(&c), ATTN_ERR_OVERLAP, "out");
    lse->data = vc->data;
    REFUSED(kv_call(&c), ATTN_ERR_OVERLAP, "lse");
    k->data = kc->data; /* new rows read from where they are written */
    REFUSED(kv_call(&c), ATTN_ERR_OVERLAP, "k_cache");
    *vc = *kc; /* one buffer written as both caches */
    REFUSED(kv_call(&c), ATTN_ERR_OVERLAP, "v_cache");
    c.ttable.data = (char *)c.kc.t.data;
    c.ttable.dtype = ATTN_DTYPE_I32;
    REFUSED(kv_call(&c), ATTN_ERR_OVERLAP, "k_cache");
    /* params */
    const char *names[6] = {"query", "key", "value", "output", NULL, "logsumexp"};
    c.p.arg_names = names;
    REFUSED(attn_sdpa_kvcache(q, kc, vc, k, NULL, seq, table, &c.p, out, NULL), ATTN_ERR_NULL,
            "value");
    c.p.arg_names = NULL;
    c.p.attn_mask = q;
    REFUSED(kv_call(&c), ATTN_ERR_INVALID, "params.attn_mask");
    c.p.attn_mask = NULL;
    c.p.q_total = 9;
    REFUSED(kv_call(&c), ATTN_ERR_INVALID, "params.q_total");
    c.p.q_total = 0;
    c.p.lse_for_backward = 1; /* a cache call has no backward pass (varlen has) */
    REFUSED(kv_call(&c), ATTN_ERR_INVALID, "params.lse_for_backward");
    c.p.lse_for_backward = 0;
    c.p.window_right = -7;
    REFUSED(kv_call(&c), ATTN_ERR_INVALID, "params.window_right");
    c.p.window_right = -1;
    c.p.softcap = INFINITY;
    REFUSED(kv_call(&c), ATTN_ERR_INVALID, "params.softcap");
    c.p.softcap = 0;
#undef REFUSED
#undef RESTORE
    kv_snap_free(&snap);
    /* Overlapping caches are fine when nothing is written: both are read. */
    kv_case ro;
    kv_fixed(&ro, &r, 0, 3, seqlens, 0);
    attn_tensor vview = ro.kc.t;
    CHECK_OK(attn_sdpa_kvcache(&ro.q.t, &ro.kc.t, &vview, NULL, NULL, &ro.tseq, NULL, NULL,
                               &ro.out.t, NULL));
    /* A contiguous cache holds one slab per sequence of q. */
    ro.kc.t.shape[0] = ro.vc.t.shape[0] = 2;
    EXPECT_FAIL(kv_call(&ro), ATTN_ERR_SHAPE, "k_cache");
    kv_free(&ro);
    kv_free(&c);
}

/* A NaN key in a sequence shorter than the longest: the rows that see it
 * come out NaN, and computing them must still read only the sequence's
 * own keys, never rows past it (the last sequence's end is the end of the
 * buffer; a paged cache's table holds junk past the blocks in use). Every
 * other sequence is unaffected. */
static void nonfinite_key_in_short_sequence(void) {
    rng r = {harness_seed() ^ 0x1f1};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        varlen_case c;
        const int lq[2] = {3, 2}, lk[2] = {6, 2};
        varlen_fixed(&c, &r, ATTN_DTYPE_F32, 2, lq, lk, 2, 1, 4, 4);
        const int64_t ks[3] = {8, 1, 4};
        tt_free(&c.k); /* no broadcast layout: the NaN key is one key */
        tt_make(&c.k, &r, ATTN_DTYPE_F32, 3, ks, LAYOUT_CONTIGUOUS, 1, 0);
        for (int64_t e = 0; e < 4; e++) { /* sequence 1's second key */
            const int64_t at[3] = {7, 0, e};
            tt_set(&c.k.t, at, NAN);
        }
        CHECK_OK(varlen_call(&c));
        CHECK(isnan(get3(&c.out.t, 4, 0, 0)) && isfinite(get3(&c.out.t, 0, 0, 0)),
              "%s varlen: %g in the row that sees a NaN key, %g in another sequence",
              attn_isa_name(PATHS[pi]), get3(&c.out.t, 4, 0, 0), get3(&c.out.t, 0, 0, 0));
        varlen_free(&c);

        kv_case kv;
        const int seqlens[2] = {40, 3};
        kv_fixed(&kv, &r, 16, 2, seqlens, 0);
        for (int64_t h = 0; h < 2; h++)
            for (int64_t e = 0; e < 8; e++) elem_set(&kv.kc.t, kv_at(&kv, &kv.kc.t, 1, 2, h, e), NAN);
        CHECK_OK(kv_call(&kv));
        /* (bottom-right causal: of sequence 1's two queries, the second sees key 2) */
        CHECK(isnan(get4(&kv.out.t, 1, 1, 0, 0)) && isfinite(get4(&kv.out.t, 0, 1, 0, 0)),
              "%s kvcache: %g in the row that sees a NaN key, %g in another sequence",
              attn_isa_name(PATHS[pi]), get4(&kv.out.t, 1, 1, 0, 0), get4(&kv.out.t, 0, 1, 0, 0));
        kv_free(&kv);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Window sides as large as int64 goes see every key, as -1 does (attn.h:
 * any value >= 0 bounds the window; the diagonal plus it must not wrap). */
static void huge_windows(void) {
    rng r = {harness_seed() ^ 0x819};
    for (int pi = 0; pi < NPATHS; pi++) {
        CHECK_OK(attn_set_isa(PATHS[pi]));
        varlen_case c;
        const int lq[2] = {3, 5}, lk[2] = {6, 2};
        varlen_fixed(&c, &r, ATTN_DTYPE_F64, 2, lq, lk, 2, 1, 4, 4);
        CHECK_OK(varlen_call(&c));
        double *unbounded = varlen_result(&c);
        const int64_t sides[3] = {INT64_MAX, INT64_MAX - 1, INT64_MAX / 2};
        for (int i = 0; i < 3; i++) {
            c.p.window_left = c.p.window_right = sides[i];
            CHECK_OK(varlen_call(&c));
            double *huge = varlen_result(&c);
            CHECK(same_result(&c, unbounded, huge), "%s: window sides %lld differ from -1",
                  attn_isa_name(PATHS[pi]), (long long)sides[i]);
            free(huge);
        }
        free(unbounded);
        varlen_free(&c);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

int main(int argc, char **argv) {
    find_paths();
    static const harness_test tests[] = {
        T(varlen_random),          T(varlen_edges),           T(varlen_hostile),
        T(kvcache_contiguous),     T(kvcache_paged),          T(kvcache_full), T(kvcache_half_prefill),
        T(kvcache_hostile_indices), T(kvcache_hostile_args),  T(varlen_modifiers),
        T(kvcache_modifiers),      T(nonfinite_key_in_short_sequence), T(huge_windows),
        T(kvcache_long),           T(sdpa_token_major),       T(sdpa_token_major_same_bits),
        T(kvcache_requests_ahead_change_no_bits),
    };
    return harness_main(argc, argv, tests, (int)(sizeof tests / sizeof tests[0]));
}
